"""Placement: policies against brute force, the row map validator, files, budgets, speed model.

References are independent of the code under test: brute force over every subset for
usage_global, per-layer brute force for usage_layer, byte and time arithmetic written out by hand.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest

from coldset.analysis.placement import (
    expert_bytes,
    hot_count_for_residency,
    hot_mask_positional,
    hot_mask_usage_global,
    hot_mask_usage_layer,
    nonexpert_bytes,
    nonexpert_bytes_breakdown,
    place,
    row_map_from_mask,
    run_placement,
)
from coldset.analysis.profile import profile_counts
from coldset.analysis.speed import predict_step
from coldset.core import placement as pm
from coldset.core.placement import GIB, PlacementError, ProfileSpec, load_placement, save_placement, validate_row_map


@dataclass(frozen=True)
class Shape:
    """A stand-in for coldset.engine.model.ModelConfig with the same field names."""

    moe_layers: tuple[int, ...] = (0, 1)
    num_layers: int = 2
    num_experts: int = 3
    top_k: int = 1
    hidden_size: int = 4
    moe_intermediate_size: int = 2
    intermediate_size: int = 0
    vocab_size: int = 10
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 2
    model_type: str = "qwen3_moe"
    norm_topk_prob: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    qk_norm: bool = False


def histogram(matrices: dict[tuple[str, str], np.ndarray], moe_layers, phase="decode") -> pd.DataFrame:
    """Long histogram rows from {(domain, split): counts [num_moe_layers, num_experts]}."""
    rows = []
    for (domain, split), m in matrices.items():
        for i, layer in enumerate(moe_layers):
            for e, c in enumerate(m[i]):
                rows.append((domain, split, phase, layer, e, c))
    return pd.DataFrame(rows, columns=["domain", "split", "phase", "layer", "expert", "count"])


def all_subset_sums(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Covered count and size of every subset of the flattened (layer, expert) pairs."""
    flat = counts.reshape(-1)
    n = flat.size
    masks = np.arange(2**n)
    bits = (masks[:, None] >> np.arange(n)[None, :]) & 1
    return bits @ flat, bits.sum(axis=1)


# ------------------------------------------------------------------------------------------
# Policies


def test_usage_global_is_optimal_against_brute_force_over_all_subsets():
    rng = np.random.default_rng(0)
    for trial in range(8):
        # Small integer counts make ties common; float counts model domain weighting.
        counts = rng.integers(0, 6, size=(3, 4)).astype(float)
        if trial % 2:
            counts = counts * rng.uniform(0.5, 2.0, size=(1, 4)).round(2)
        sums, sizes = all_subset_sums(counts)
        for k in range(13):
            mask = hot_mask_usage_global(counts, k)
            assert mask.sum() == k
            best = sums[sizes <= k].max()  # every subset that fits a budget of k experts
            assert counts[mask].sum() == pytest.approx(best, abs=1e-12)
            # Ties go to lower (layer, expert): the chosen set is the lexicographically smallest
            # sorted index tuple among the optimal subsets of size k.
            optimal = [
                c for c in itertools.combinations(range(12), k)
                if abs(counts.reshape(-1)[list(c)].sum() - best) < 1e-9
            ]
            assert tuple(np.flatnonzero(mask.reshape(-1))) == min(optimal)


def test_place_usage_global_optimal_on_weighted_profile_and_reports_that_coverage():
    rng = np.random.default_rng(1)
    shape = Shape(moe_layers=(1, 3, 5), num_layers=6, num_experts=4)
    for _ in range(4):
        a = rng.integers(0, 20, size=(3, 4)).astype(float)
        b = rng.integers(0, 5, size=(3, 4)).astype(float)
        a[0, 0] += 1
        b[0, 0] += 1
        hist = histogram({("a", "profile"): a, ("b", "profile"): b}, shape.moe_layers)
        weighted = a / a.sum() * 0.5 + b / b.sum() * 0.5  # "equal": each domain the same total
        sums, sizes = all_subset_sums(weighted)
        for r, k in ((0.25, 3), (0.5, 6), (0.75, 9)):
            p = place(hist, shape, "usage_global", r, domain_weights="equal", batch_sizes=())
            assert p.num_hot == k
            assert p.coverage_profile == pytest.approx(sums[sizes <= k].max() / weighted.sum())


def test_usage_layer_same_count_per_layer_and_each_layer_optimal():
    rng = np.random.default_rng(2)
    for _ in range(6):
        counts = rng.integers(0, 5, size=(3, 4)).astype(float)
        for num_hot in range(13):
            mask = hot_mask_usage_layer(counts, num_hot)
            per_layer = num_hot // 3
            assert mask.sum(axis=1).tolist() == [per_layer] * 3
            for layer in range(3):
                best = max(
                    (counts[layer, list(c)].sum(), tuple(-x for x in c))
                    for c in itertools.combinations(range(4), per_layer)
                )
                chosen = tuple(np.flatnonzero(mask[layer]))
                # optimal within the layer, ties to lower expert ids
                assert counts[layer, list(chosen)].sum() == best[0]
                assert chosen == min(
                    c for c in itertools.combinations(range(4), per_layer)
                    if counts[layer, list(c)].sum() == best[0]
                )


def test_positional_offloads_whole_layers_in_order_until_target_met():
    num_layers, num_experts = 5, 4
    per_expert = 48
    total = num_layers * num_experts
    for num_hot in range(total + 1):
        mask = hot_mask_positional(num_layers, num_experts, num_hot)
        cold_layers = [layer for layer in range(num_layers) if not mask[layer].any()]
        hot_layers = [layer for layer in range(num_layers) if mask[layer].all()]
        assert sorted(cold_layers + hot_layers) == list(range(num_layers))  # whole layers
        assert cold_layers == list(range(len(cold_layers)))  # first layers first
        target = (total - num_hot) * per_expert
        host = len(cold_layers) * num_experts * per_expert
        assert host >= target
        if cold_layers:  # one layer fewer would not meet the target
            assert host - num_experts * per_expert < target


def test_place_positional_bytes_meet_host_target():
    shape = Shape(moe_layers=(1, 3, 5, 7), num_layers=8, num_experts=4)
    counts = np.arange(16, dtype=float).reshape(4, 4) + 1
    hist = histogram({("a", "profile"): counts}, shape.moe_layers)
    per_expert = expert_bytes(shape)
    for r in (0.0, 0.1, 0.3, 0.5, 0.8, 1.0):
        p = place(hist, shape, "positional", r, batch_sizes=())
        target_host = (16 - math.floor(r * 16)) * per_expert
        assert p.host_expert_gib * GIB >= target_host
        assert p.host_expert_gib * GIB - 4 * per_expert < target_host or r == 1.0
        assert p.hbm_expert_gib * GIB == p.num_hot * per_expert
        assert p.num_hot % 4 == 0


def test_permute_keeps_positional_tiers_and_coverage_but_changes_rows():
    shape = Shape(moe_layers=(1, 3, 5, 7), num_layers=8, num_experts=4)
    counts = np.array([[1, 9, 3, 5], [7, 2, 8, 1], [0, 4, 6, 2], [3, 3, 9, 1]], dtype=float)
    held = counts[:, ::-1].copy()
    hist = histogram({("a", "profile"): counts, ("a", "heldout"): held}, shape.moe_layers)
    for r in (0.25, 0.5, 0.75, 1.0):
        pos = place(hist, shape, "positional", r, batch_sizes=())
        per = place(hist, shape, "permute", r, batch_sizes=())
        assert np.array_equal(pos.row_map >= 0, per.row_map >= 0)
        assert (pos.num_hot, pos.num_cold) == (per.num_hot, per.num_cold)
        assert per.coverage_profile == pos.coverage_profile
        assert per.coverage_heldout == pos.coverage_heldout
        assert not np.array_equal(pos.row_map, per.row_map)
        validate_row_map(per.row_map, per.num_hot, per.num_cold, 4, 4)
        for layer in range(4):
            rows = per.row_map[layer]
            key = np.where(rows >= 0, rows, -rows - 1)  # position inside its pool
            by_popularity = sorted(range(4), key=lambda e: (-counts[layer, e], e))
            assert list(np.argsort(key)) == by_popularity


def test_row_map_numbering_layer_major():
    mask = np.array([[True, False, True], [False, True, False]])
    assert row_map_from_mask(mask).tolist() == [[0, -1, 1], [-2, 2, -3]]
    order = np.array([[2, 0, 1], [1, 2, 0]])
    assert row_map_from_mask(mask, order).tolist() == [[1, -1, 0], [-3, 2, -2]]


# ------------------------------------------------------------------------------------------
# Row map validation


GOOD = np.array([[0, -1], [1, -2]], dtype=np.int32)


@pytest.mark.parametrize(
    "row_map, num_hot, num_cold, message",
    [
        (np.array([[0, -1], [0, -2]], dtype=np.int32), 2, 2,
         "hot row 0 is used more than once: at (layer 0, expert 0) and again at (layer 1, expert 0)"),
        (np.array([[0, -1], [1, -1]], dtype=np.int32), 2, 2,
         "cold row 0 (encoded -1) is used more than once: at (layer 0, expert 1) and again at "
         "(layer 1, expert 1)"),
        (np.array([[0, -1], [2, -2]], dtype=np.int32), 2, 2,
         "row out of range (falls outside the pools) at (layer 1, expert 0): hot row 2 but the "
         "hot pool has 2 rows"),
        (np.array([[0, -3], [1, -2]], dtype=np.int32), 2, 2,
         "at (layer 0, expert 1): cold row 2 (encoded -3) but the cold pool has 2 rows"),
        (GOOD, 3, 2, "pool sizes inconsistent: hot 3 + cold 2 rows but the map has 4 entries; "
         "hot row 2 is not used"),
        (GOOD, 2, 3, "cold row 2 is not used"),
        (GOOD.astype(np.int64), 2, 2, "dtype must be int32, got int64"),
        (np.zeros((2, 3), dtype=np.int32), 2, 2,
         "shape must be [num_moe_layers, num_experts] = [2, 2], got [2, 3]"),
        ([[0, -1], [1, -2]], 2, 2, "must be a numpy array or torch tensor, got list"),
    ],
)
def test_validate_row_map_errors(row_map, num_hot, num_cold, message):
    with pytest.raises(PlacementError) as err:
        validate_row_map(row_map, num_hot, num_cold, 2, 2)
    assert message in str(err.value)


def test_validate_row_map_accepts_good_maps_and_torch_tensors():
    validate_row_map(GOOD, 2, 2, 2, 2)
    validate_row_map(np.arange(4, dtype=np.int32).reshape(2, 2), 4, 0, 2, 2)
    validate_row_map(-np.arange(1, 5, dtype=np.int32).reshape(2, 2), 0, 4, 2, 2)
    torch = pytest.importorskip("torch")
    validate_row_map(torch.tensor(GOOD), 2, 2, 2, 2)
    with pytest.raises(PlacementError, match="dtype must be int32, got torch.int64"):
        validate_row_map(torch.tensor(GOOD, dtype=torch.int64), 2, 2, 2, 2)


# ------------------------------------------------------------------------------------------
# Budgets and bytes


def test_weight_format_bytes_hand_computed():
    big = Shape(hidden_size=5120, moe_intermediate_size=8192)
    elements = 3 * 8192 * 5120
    assert expert_bytes(big, "bfloat16") == elements * 2 == 251_658_240
    assert expert_bytes(big, "bf16") == expert_bytes(big, "float16") == 251_658_240
    assert expert_bytes(big, "float32") == elements * 4
    # fp8, one fp32 scale per 128x128 block: w13 [16384, 5120] 128*40 blocks, w2 [5120, 8192] 40*64
    assert expert_bytes(big, "fp8_block128") == elements + (128 * 40 + 40 * 64) * 4
    # fp8, one fp32 scale per output row: 16384 + 5120 rows
    assert expert_bytes(big, "fp8_channel") == elements + (16384 + 5120) * 4
    # mxfp4: half a byte per element, one byte per 32 inputs: w13 16384*160, w2 5120*256
    assert expert_bytes(big, "mxfp4") == elements // 2 + 16384 * 160 + 5120 * 256
    # blocks that do not divide: H=200, I=100 -> w13 [200, 200] 2x2 blocks, w2 [200, 100] 2x1
    odd = Shape(hidden_size=200, moe_intermediate_size=100)
    assert expert_bytes(odd, "fp8_block128") == 60_000 + (4 + 2) * 4
    with pytest.raises(PlacementError, match="unknown weight format 'int3'"):
        expert_bytes(big, "int3")


def test_nonexpert_bytes_hand_computed():
    s = Shape()  # vocab 10, H 4, 2 layers both MoE, 2 heads, 1 kv head, head_dim 2, 3 experts
    parts = nonexpert_bytes_breakdown(s)
    assert parts == {
        "embed_tokens": 10 * 4 * 2,
        "lm_head": 10 * 4 * 2,
        "attention": 2 * (4 * 4 + 4 * 2 + 4 * 2 + 4 * 4) * 2,
        "norms": (2 * (2 * 4) + 4) * 2,
        "routers": 2 * 3 * 4 * 2,
        "shared_experts": 0,
        "dense_mlp": 0,
        "expert_biases": 0,
    }
    assert nonexpert_bytes(s) == 440
    # tied embeddings, qk norms, one dense layer of width 6, a shared expert of width 5
    @dataclass(frozen=True)
    class WithShared(Shape):
        shared_expert_intermediate_size: int = 5

    t = WithShared(tie_word_embeddings=True, qk_norm=True, num_layers=3, moe_layers=(1, 2),
                   intermediate_size=6)
    parts = nonexpert_bytes_breakdown(t, "float32")
    assert parts["lm_head"] == 0
    assert parts["norms"] == (3 * (2 * 4 + 2 * 2) + 4) * 4
    assert parts["dense_mlp"] == 1 * 3 * 4 * 6 * 4
    assert parts["shared_experts"] == 2 * 3 * 4 * 5 * 4
    with pytest.raises(PlacementError, match="scaled format 'mxfp4' are not modelled"):
        nonexpert_bytes(t, "mxfp4")


def test_residency_rounding_and_errors():
    assert hot_count_for_residency(0.29, 100) == 29  # float 0.29 * 100 is 28.999999999999996
    assert hot_count_for_residency(0.5, 3) == 1
    assert hot_count_for_residency(1.0, 7) == 7
    assert hot_count_for_residency(0, 7) == 0
    for bad in (-0.1, 1.5, float("nan"), "half"):
        with pytest.raises(PlacementError, match=r"residency must be .*\[0, 1\]"):
            hot_count_for_residency(bad, 10)


def test_budget_in_gib():
    s = Shape()
    hist = histogram({("a", "profile"): np.array([[6, 3, 1], [5, 5, 0]], float)}, s.moe_layers)
    need = nonexpert_bytes(s)  # 440 bytes
    per = expert_bytes(s)  # 48 bytes
    budget = (need + 2.5 * per) / GIB
    p = place(hist, s, "usage_global", budget_gib=budget, batch_sizes=())
    assert p.num_hot == 2 and p.residency is None and p.label == f"{budget:g}gib"
    assert [tuple(x) for x in np.argwhere(p.row_map >= 0)] == [(0, 0), (1, 0)]
    big = place(hist, s, "usage_global", budget_gib=1.0, batch_sizes=())
    assert big.num_hot == 6  # capped at every expert
    with pytest.raises(PlacementError) as err:
        place(hist, s, "usage_global", budget_gib=100 / GIB, batch_sizes=())
    assert "cannot hold the non-expert weights, which need" in str(err.value)
    assert "(440 bytes)" in str(err.value)
    with pytest.raises(PlacementError, match="exactly one of residency"):
        place(hist, s, "usage_global", 0.5, budget_gib=1.0)
    with pytest.raises(PlacementError, match="exactly one of residency"):
        place(hist, s, "usage_global")
    with pytest.raises(PlacementError, match=r"residency must be .*\[0, 1\], got 1.2"):
        place(hist, s, "usage_global", 1.2)
    with pytest.raises(PlacementError, match="unknown policy 'belady'"):
        place(hist, s, "belady", 0.5)  # offline: the simulator's, not a placement


# ------------------------------------------------------------------------------------------
# Profile and coverage


def test_profile_domain_weighting_and_heldout_coverage_by_domain():
    s = Shape()
    a = np.array([[6, 3, 1], [5, 5, 0]], float)  # 10 per layer
    b = np.array([[0, 0, 30], [0, 30, 0]], float)  # 30 per layer
    ha = np.array([[1, 1, 2], [0, 4, 0]], float)
    hb = np.array([[4, 0, 0], [1, 1, 2]], float)
    hist = histogram(
        {("a", "profile"): a, ("b", "profile"): b, ("a", "heldout"): ha, ("b", "heldout"): hb},
        s.moe_layers,
    )
    spec = ProfileSpec.make(["a", "b"], "decode", None)
    assert np.allclose(profile_counts(hist, s.moe_layers, 3, spec), a + b)
    spec = ProfileSpec.make(["a", "b"], "decode", "equal")
    assert np.allclose(profile_counts(hist, s.moe_layers, 3, spec), a / 20 * 0.5 + b / 60 * 0.5)
    spec = ProfileSpec.make(["a", "b"], "decode", {"a": 3, "b": 1})
    assert np.allclose(profile_counts(hist, s.moe_layers, 3, spec), a / 20 * 0.75 + b / 60 * 0.25)
    spec = ProfileSpec.make("a")
    assert np.allclose(profile_counts(hist, s.moe_layers, 3, spec), a)
    assert ProfileSpec.make("all") == ProfileSpec.make(None)
    assert np.allclose(profile_counts(hist, s.moe_layers, 3, ProfileSpec.make("all")), a + b)

    # Profile a only, 3 hot: (0,0)=6, (1,0)=5, (1,1)=5 (tie with (1,0) kept by order).
    p = place(hist, s, "usage_global", 0.5, profile_domains=["a"], batch_sizes=())
    assert p.coverage_profile == pytest.approx(16 / 20)
    assert p.coverage_heldout_by_domain == pytest.approx({"a": 5 / 8, "b": 6 / 8})
    assert p.coverage_heldout == pytest.approx(11 / 16)
    assert p.profile.describe() == {
        "split": "profile", "domains": ["a"], "phase": "decode", "weighting": "none",
    }
    with pytest.raises(PlacementError, match=r"profile domain\(s\) \['c'\]"):
        place(hist, s, "usage_global", 0.5, profile_domains=["a", "c"])
    with pytest.raises(PlacementError, match="must name exactly the profile domains"):
        place(hist, s, "usage_global", 0.5, domain_weights={"a": 1, "c": 1})


def test_histogram_errors():
    s = Shape()
    hist = histogram({("a", "profile"): np.ones((2, 3))}, s.moe_layers)
    with pytest.raises(PlacementError, match=r"missing column\(s\) \['split'\]"):
        place(hist.drop(columns="split"), s, "usage_global", 0.5)
    bad = hist.copy()
    bad.loc[0, "split"] = "train"
    with pytest.raises(PlacementError, match="column 'split' has values \\['train'\\]"):
        place(bad, s, "usage_global", 0.5)
    bad = hist.copy()
    bad.loc[0, "layer"] = 7
    with pytest.raises(PlacementError, match=r"layer\(s\) \[7\] are not MoE layers"):
        place(bad, s, "usage_global", 0.5)
    bad = hist.copy()
    bad.loc[0, "expert"] = 3
    with pytest.raises(PlacementError, match=r"expert 3 in layer 0 is out of range \[0, 3\)"):
        place(bad, s, "usage_global", 0.5)
    bad = hist.copy()
    bad.loc[0, "count"] = -1
    with pytest.raises(PlacementError, match="'count' must hold finite numbers >= 0"):
        place(bad, s, "usage_global", 0.5)


# ------------------------------------------------------------------------------------------
# Speed model


def test_predict_step_hand_computed_batch_1_and_2():
    s = Shape()  # non-expert 440 bytes, 48 bytes per expert (bf16, H 4, I 2)
    counts = np.array([[6, 3, 1], [5, 5, 0]], float)
    hist = histogram({("a", "profile"): counts}, s.moe_layers)
    bw = {"name": "toy", "hbm_gb_s": 1e-6, "link_gb_s": 1e-7}  # 1000 and 100 bytes/s
    p = place(hist, s, "usage_global", 0.5, bandwidths=[bw], batch_sizes=(1, 2))
    # hot: (0,0) 6, (1,0) 5, (1,1) 5; cold: (0,1), (0,2), (1,2). p_e = count / 10 tokens.
    assert (p.row_map >= 0).tolist() == [[True, False, False], [True, True, False]]
    b1 = predict_step(p, hist, s, bw, 1)
    hot1, cold1 = 0.6 + 0.5 + 0.5, 0.3 + 0.1 + 0.0
    assert b1.expected_hot_experts == pytest.approx(hot1)
    assert b1.expected_cold_experts == pytest.approx(cold1)
    assert b1.hbm_bytes == pytest.approx(440 + hot1 * 48)  # 516.8
    assert b1.link_bytes == pytest.approx(cold1 * 48)  # 19.2
    assert b1.hbm_s == pytest.approx(0.5168)
    assert b1.link_s == pytest.approx(0.192)
    assert b1.step_s_lower == pytest.approx(0.5168)
    assert b1.step_s_sum == pytest.approx(0.7088)
    assert b1.tok_s_lower == pytest.approx(1 / 0.5168)
    b2 = predict_step(p, hist, s, bw, 2)
    # 1 - (1 - p)^2: layer 0 .84 .51 .19, layer 1 .75 .75 0
    hot2, cold2 = 0.84 + 0.75 + 0.75, 0.51 + 0.19
    assert b2.hbm_bytes == pytest.approx(440 + hot2 * 48)  # 552.32
    assert b2.link_bytes == pytest.approx(cold2 * 48)  # 33.6
    assert b2.step_s_lower == pytest.approx(0.55232)
    assert b2.step_s_sum == pytest.approx(0.55232 + 0.336)
    assert b2.tok_s_lower == pytest.approx(2 / 0.55232)
    assert p.predictions == [b1, b2]  # place() records the same numbers


def test_predict_step_top_k_and_presets():
    s = Shape(top_k=2)
    counts = np.array([[4, 3, 3], [10, 0, 10]], float)  # 5 and 10 tokens
    hist = histogram({("a", "profile"): counts}, s.moe_layers)
    p = place(hist, s, "positional", 0.5, batch_sizes=())  # layer 0 cold, layer 1 hot
    one = predict_step(p, hist, s, "h200", 1)
    assert one.expected_cold_experts == pytest.approx(2.0)  # p = .8 .6 .6
    assert one.expected_hot_experts == pytest.approx(2.0)  # p = 1 0 1
    assert one.hbm_gb_s == 3400 and one.link_gb_s == 51
    gb = predict_step(p, hist, s, "gb300", 1)
    assert gb.link_gb_s == 340 and gb.link_s == pytest.approx(one.link_s * 51 / 340)
    with pytest.raises(PlacementError, match="unknown bandwidth preset 'tpu'"):
        predict_step(p, hist, s, "tpu", 1)


# ------------------------------------------------------------------------------------------
# Files


def _small_case():
    s = Shape(moe_layers=(1, 3), num_layers=4, num_experts=3)
    counts = np.array([[6, 3, 1], [5, 5, 2]], float)
    held = np.array([[1, 3, 1], [2, 0, 2]], float)
    hist = histogram({("a", "profile"): counts, ("b", "heldout"): held}, s.moe_layers)
    return s, hist


def test_save_load_round_trip(tmp_path):
    s, hist = _small_case()
    p = place(hist, s, "usage_global", 0.5, batch_sizes=(1, 4), model="toy")
    path = save_placement(p, tmp_path / "usage_global-0.5.json")
    assert sorted(x.name for x in tmp_path.iterdir()) == [
        "usage_global-0.5.json", "usage_global-0.5.rowmap.npy",
    ]
    q = load_placement(path)
    assert np.array_equal(q.row_map, p.row_map) and q.row_map.dtype == np.int32
    for name in ("policy", "residency", "budget_gib", "num_hot", "num_cold", "moe_layers",
                 "num_experts", "bytes_per_expert", "hbm_expert_gib", "host_expert_gib",
                 "profile", "coverage_profile", "coverage_heldout", "coverage_heldout_by_domain",
                 "predictions", "model", "weight_format"):
        assert getattr(q, name) == getattr(p, name), name
    doc = json.loads(path.read_text())
    assert doc["row_map_file"] == "usage_global-0.5.rowmap.npy"
    assert doc["profile"]["domains"] is None and doc["coverage_heldout_by_domain"].keys() == {"b"}


def test_load_placement_errors_name_the_file(tmp_path):
    s, hist = _small_case()
    p = place(hist, s, "usage_global", 0.5, batch_sizes=())
    path = save_placement(p, tmp_path / "usage_global-0.5.json")
    npy = tmp_path / "usage_global-0.5.rowmap.npy"

    np.save(npy, p.row_map[:, ::-1].copy())  # a valid map, but not the one recorded
    with pytest.raises(PlacementError, match=rf"{npy}: sha256 differs .* {path}"):
        load_placement(path)

    save_placement(p, path)
    doc = json.loads(path.read_text())
    doc["num_hot"] += 1
    path.write_text(json.dumps(doc))
    with pytest.raises(PlacementError, match=rf"{npy} \(for {path.name}\): pool sizes inconsistent"):
        load_placement(path)

    save_placement(p, path)
    npy.unlink()
    with pytest.raises(PlacementError, match=rf"{path}: its row map file {npy} is missing"):
        load_placement(path)

    path.write_text("{not json")
    with pytest.raises(PlacementError, match=rf"{path}: not valid JSON"):
        load_placement(path)
    with pytest.raises(PlacementError, match="placement file not found"):
        load_placement(tmp_path / "nope.json")


def test_save_is_atomic_on_failure(tmp_path, monkeypatch):
    s, hist = _small_case()
    p = place(hist, s, "usage_global", 0.5, batch_sizes=())

    def fail_save(*a, **k):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(pm.np, "save", fail_save)
        with pytest.raises(OSError, match="disk full"):
            save_placement(p, tmp_path / "x.json")
    assert list(tmp_path.iterdir()) == []

    real_replace = pm.os.replace

    def fail_json_replace(src, dst):
        if str(dst).endswith(".json"):
            raise OSError("rename failed")
        return real_replace(src, dst)

    with monkeypatch.context() as m:
        m.setattr(pm.os, "replace", fail_json_replace)
        with pytest.raises(OSError, match="rename failed"):
            save_placement(p, tmp_path / "x.json")
    assert list(tmp_path.iterdir()) == []  # neither file, no temp files

    bad = place(hist, s, "usage_global", 0.5, batch_sizes=())
    bad.row_map = bad.row_map.astype(np.int64)
    with pytest.raises(PlacementError, match="dtype must be int32"):
        save_placement(bad, tmp_path / "x.json")
    assert list(tmp_path.iterdir()) == []


def test_run_placement_writes_every_policy_and_residency(tmp_path):
    s, hist = _small_case()
    csv = tmp_path / "histogram.csv"
    hist.to_csv(csv, index=False)
    out = tmp_path / "placement"
    placements = run_placement(csv, s, out, residencies=(0.25, 0.5, 1.0), batch_sizes=(1, 8),
                               progress=False, lookahead_depth=1,  # 2 MoE layers: depth 1 at most
                               forecaster=_forecaster(s), prefetch_budget=1)
    assert len(placements) == len(pm.POLICIES) * 3
    table = pd.read_csv(out / "coverage.csv")
    assert list(table["policy"]) == [p for p in pm.POLICIES for _ in range(3)]
    assert list(table["residency"]) == [0.25, 0.5, 1.0] * len(pm.POLICIES)
    for col in ("coverage_profile", "coverage_heldout", "coverage_heldout_b",
                "step_ms_lower_h200_b1", "step_ms_sum_gb300_b8", "tok_s_lower_h200_b8",
                "link_gb_per_token_h200_b8"):
        assert col in table.columns, col
    for p in placements:
        q = load_placement(out / f"{p.policy}-{p.label}.json")
        assert np.array_equal(q.row_map, p.row_map)
        if p.dynamic:  # the warm state: usage_global's row map, one profile count per slot
            ug = load_placement(out / f"usage_global-{p.label}.json")
            assert np.array_equal(q.row_map, ug.row_map) and not q.predictions
            assert np.array_equal(q.cache_warm_counts, p.cache_warm_counts) and len(q.cache_warm_counts) == q.num_hot
        # lookahead's forecast fitted on the profile router inputs (the default), recorded and read back
        assert q.cache_lookahead_fit == p.cache_lookahead_fit == (True if p.policy == "lookahead" else None)
    assert sorted(x.name for x in out.iterdir() if x.name.startswith(".")) == []
    # the field: true/false for lookahead (absent in files written before it: false), refused elsewhere
    path = out / "lookahead-0.5.json"
    doc = json.loads(path.read_text())
    doc.pop("cache_lookahead_fit")
    path.write_text(json.dumps(doc))
    assert load_placement(path).cache_lookahead_fit is False
    doc["cache_lookahead_fit"] = "yes"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlacementError, match="cache_lookahead_fit"):
        load_placement(path)
    lru = out / "lru-0.5.json"
    doc = json.loads(lru.read_text())
    doc["cache_lookahead_fit"] = True
    lru.write_text(json.dumps(doc))
    with pytest.raises(PlacementError, match="'cache_lookahead_fit' must be true or false for policy 'lookahead'"):
        load_placement(lru)
    assert {x.name for x in out.iterdir()} >= {"usage_global-1.0.json", "positional-0.25.rowmap.npy"}
    # usage_global covers at least as much of the profile as the others, everywhere
    for r in (0.25, 0.5, 1.0):
        rows = table[table["residency"] == r].set_index("policy")["coverage_profile"]
        assert rows["usage_global"] >= rows.max() - 1e-12


def test_run_placement_reads_model_shape_from_folder(tmp_path):
    pytest.importorskip("torch")
    s, hist = _small_case()
    csv = tmp_path / "histogram.csv"
    hist.to_csv(csv, index=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 4, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 2, "num_experts": 3,
        "num_experts_per_tok": 1, "moe_intermediate_size": 2, "intermediate_size": 8,
        "decoder_sparse_step": 2, "rms_norm_eps": 1e-6,
    }))
    placements = run_placement(csv, model, tmp_path / "out", policies=("usage_global",),
                               residencies=(0.5,), batch_sizes=(1,), progress=False)
    assert placements[0].moe_layers == (1, 3)
    assert placements[0].bytes_per_expert == 48


def test_equal_weighting_refuses_a_domain_with_zero_profile_counts():
    """Mutant (today's code): ``domain_weights: equal`` divides each domain's counts by their sum,
    so a domain with zero profile selections yields NaN counts, NaN coverage and predictions and
    an arbitrary row map with no error. It must be refused naming the domain; a domain weighted
    0 by a mapping is left out instead."""
    s = Shape()
    a = np.array([[6, 3, 1], [5, 5, 0]], float)
    hist = histogram({("a", "profile"): a, ("z", "profile"): np.zeros((2, 3)),
                      ("a", "heldout"): a, ("z", "heldout"): a}, s.moe_layers)
    assert "z" in set(hist[hist.split == "profile"].domain)  # present, with zero counts
    for weighting in ("equal", {"a": 1, "z": 2}):
        with pytest.raises(PlacementError, match=r"profile domain\(s\) \['z'\] have zero decode selections"):
            place(hist, s, "usage_global", 0.5, domain_weights=weighting, batch_sizes=(1,))
    counts = profile_counts(hist, s.moe_layers, 3, ProfileSpec.make(None, "decode", {"a": 1, "z": 0}))
    assert np.allclose(counts, a / 20) and np.isfinite(counts).all()
    p = place(hist, s, "usage_global", 0.5, domain_weights={"a": 1, "z": 0}, batch_sizes=(1,))
    assert math.isfinite(p.coverage_profile) and math.isfinite(p.coverage_heldout)


# ------------------------------------------------------------------------------------------
# nexttoken (issue 28): the placement carries its forecaster


def _forecaster(s, seed=0):
    """A next-token forecaster fitted on random tokens of ``s``'s shape (top-1)."""
    from coldset.analysis.forecast import NextTokenForecaster

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, s.num_experts, size=(30, len(s.moe_layers), s.top_k))
    return NextTokenForecaster.fit(tokens, np.repeat([0, 1, 2], 10), s.top_k, s.num_experts, extra=1,
                                   hist_beta=0.25, hist_shift=3)


def test_a_nexttoken_placement_round_trips_its_forecaster(tmp_path):
    """The forecaster's tables go to {name}.forecaster.npy and its fields to the JSON; loaded back
    and rebuilt by the pipeline it is the fitted object (every field, the tables bitwise)."""
    from coldset.bench.decode import placement_forecaster

    s, hist = _small_case()
    f = _forecaster(s)
    p = place(hist, s, "nexttoken", 0.5, batch_sizes=(1,), forecaster=f, prefetch_budget=2)
    assert p.dynamic and p.predictions == [] and p.cache_warm_counts is not None
    path = save_placement(p, tmp_path / "nexttoken-0.5.json")
    assert sorted(x.name for x in tmp_path.iterdir()) == [
        "nexttoken-0.5.forecaster.npy", "nexttoken-0.5.json", "nexttoken-0.5.rowmap.npy"]
    q = load_placement(path)
    assert q.cache_prefetch_budget == 2 and np.array_equal(q.row_map, p.row_map)
    g = placement_forecaster(q)
    assert g == dataclasses_replace_tables(f, g.tables) and np.array_equal(g.tables, f.tables)
    assert g.tables.dtype == np.int32 and g.n == s.top_k + 1
    assert placement_forecaster(load_placement(save_placement(place(hist, s, "lru", 0.5), tmp_path / "lru-0.5.json"))) is None
    doc = json.loads(path.read_text())
    assert doc["cache_forecaster"]["tables_file"] == "nexttoken-0.5.forecaster.npy"
    assert doc["cache_forecaster"]["hist_unit"] == f.hist_unit and doc["cache_forecaster"]["terms"] == [[0, 0], [1, 0], [2, 0]]


def dataclasses_replace_tables(f, tables):
    from dataclasses import replace

    return replace(f, tables=tables)


def test_nexttoken_placement_refusals_name_the_field_or_file(tmp_path):
    s, hist = _small_case()
    with pytest.raises(PlacementError, match="policy 'nexttoken' needs a next-token forecaster"):
        place(hist, s, "nexttoken", 0.5)
    wide = _forecaster(Shape(moe_layers=(1, 3), num_layers=4, num_experts=4))
    with pytest.raises(PlacementError, match=r"tables must be int32 \[3, 2, 3, 3\]"):
        place(hist, s, "nexttoken", 0.5, forecaster=wide)
    with pytest.raises(PlacementError, match="prefetch_budget must be >= 0"):
        place(hist, s, "nexttoken", 0.5, forecaster=_forecaster(s), prefetch_budget=-1)
    p = place(hist, s, "nexttoken", 0.5, forecaster=_forecaster(s))
    path = save_placement(p, tmp_path / "nexttoken-0.5.json")
    fc = tmp_path / "nexttoken-0.5.forecaster.npy"
    np.save(fc, p.cache_forecaster_tables + 1)  # valid tables, not the ones recorded
    with pytest.raises(PlacementError, match=rf"{fc}: sha256 differs .* {path}"):
        load_placement(path)
    fc.unlink()
    with pytest.raises(PlacementError, match=rf"{path}: its forecaster tables file {fc} is missing"):
        load_placement(path)
    save_placement(p, path)
    doc = json.loads(path.read_text())
    lru = {**doc, "policy": "lru"}
    path.write_text(json.dumps(lru))
    with pytest.raises(PlacementError, match="'cache_forecaster' / 'cache_prefetch_budget' are set for policy 'lru'"):
        load_placement(path)
    path.write_text(json.dumps({**doc, "cache_prefetch_budget": -2}))
    with pytest.raises(PlacementError, match="'cache_prefetch_budget' must be null or an integer >= 0"):
        load_placement(path)


def test_the_parity_fingerprint_covers_the_forecaster_and_keeps_other_digests(tmp_path):
    """A nexttoken placement's decode fingerprint changes with its tables (even an edited file the
    JSON's sha256 no longer describes), its fields and its budget; an lru placement's digest is the
    one it had before these fields existed (policy and warm counts only)."""
    import hashlib

    from coldset.verify.fingerprint import StaleReportError, placement_fingerprint

    s, hist = _small_case()
    lru = save_placement(place(hist, s, "lru", 0.5), tmp_path / "lru-0.5.json")
    doc = json.loads(lru.read_text())
    old = hashlib.sha256(json.dumps({"policy": "lru", "cache_warm_counts": doc["cache_warm_counts"]},
                                    sort_keys=True, default=str).encode()).hexdigest()
    assert placement_fingerprint(lru) == old

    p = place(hist, s, "nexttoken", 0.5, forecaster=_forecaster(s))
    path = save_placement(p, tmp_path / "nexttoken-0.5.json")
    base = placement_fingerprint(path)
    fc = tmp_path / "nexttoken-0.5.forecaster.npy"
    np.save(fc, p.cache_forecaster_tables + 1)
    assert placement_fingerprint(path) != base  # the file on disk, not only the recorded digest
    save_placement(p, path)
    assert placement_fingerprint(path) == base
    p.cache_prefetch_budget = 0
    save_placement(p, path)
    assert placement_fingerprint(path) != base
    p.cache_prefetch_budget = None
    p.cache_forecaster = {**p.cache_forecaster, "hist_shift": 4}
    save_placement(p, path)
    assert placement_fingerprint(path) != base
    fc.unlink()
    with pytest.raises(StaleReportError, match="forecaster tables .* do not exist"):
        placement_fingerprint(path)
