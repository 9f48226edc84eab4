"""The locality statistic (issue 17 item 1) against brute force and traces of known overlap."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from coldset.core.trace import TraceMeta, write_trace
from coldset.analysis.locality import (
    consecutive_overlap,
    decode_tokens,
    locality_stats,
    pair_overlap,
    reuse_distances,
    reuse_histogram,
    shuffled_overlap,
)
from coldset.analysis.stats import run_stats


def _rows(seqs: dict[str, list[list[list[int]]]], start: int = 5) -> pd.DataFrame:
    """seqs: request -> tokens -> layers -> experts (rank order); positions from ``start``."""
    out = []
    for req, toks in seqs.items():
        for t, layers in enumerate(toks):
            for li, experts in enumerate(layers):
                for r, e in enumerate(experts):
                    out.append((req, start + t, li, r, e))
    return pd.DataFrame(out, columns=["request", "position", "layer_index", "rank", "expert"])


def _random_seqs(rng, n_req=5, n_layers=3, n_experts=7, k=2, stay=0.6):
    seqs = {}
    for i in range(n_req):
        toks, prev = [], None
        for _ in range(int(rng.integers(1, 12))):
            layers = []
            for li in range(n_layers):
                if prev is not None and rng.random() < stay:
                    keep = [e for e in prev[li] if rng.random() < 0.7]
                else:
                    keep = []
                rest = [e for e in rng.permutation(n_experts).tolist() if e not in keep]
                layers.append((keep + rest)[:k])
            toks.append(layers)
            prev = layers
        seqs[f"r{rng.integers(0, 10**6)}-{i}"] = toks
    return seqs


def test_consecutive_overlap_and_reuse_match_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(10):
        k, L = int(rng.integers(1, 4)), 3
        seqs = _random_seqs(rng, k=k, n_layers=L)
        sel, req, pos = decode_tokens(_rows(seqs), L, k)
        # brute force: per layer, mean over consecutive pairs of |A & B| / k
        per_layer = []
        for li in range(L):
            vals = [len(set(toks[t][li]) & set(toks[t - 1][li])) / k
                    for toks in seqs.values() for t in range(1, len(toks))]
            per_layer.append(np.mean(vals) if vals else np.nan)
        np.testing.assert_allclose(consecutive_overlap(sel, req, pos), per_layer)
        # reuse distances in (token, layer, rank) order of the sorted requests
        ref = []
        for name in sorted(seqs):
            last = {}
            for t, layers in enumerate(seqs[name]):
                for li, experts in enumerate(layers):
                    for e in experts:
                        ref.append(t - last[(li, e)] if (li, e) in last else 0)
                        last[(li, e)] = t
        np.testing.assert_array_equal(reuse_distances(sel, req, pos), ref)


def test_known_overlap_and_gaps():
    # every consecutive pair shares exactly 2 of 4 experts; position gaps break pairs
    k, n = 4, 40
    toks = [[[(2 * t + r) % 16 for r in range(k)]] for t in range(n)]
    seqs = {"a": toks, "b": toks[:10]}
    rows = _rows(seqs)
    sel, req, pos = decode_tokens(rows, 1, k)
    assert consecutive_overlap(sel, req, pos)[0] == pytest.approx(0.5)
    gap = rows[~((rows.request == "a") & (rows.position == 5 + 20))]  # drop a token: 2 pairs fewer
    sel2, req2, pos2 = decode_tokens(gap, 1, k)
    assert consecutive_overlap(sel2, req2, pos2)[0] == pytest.approx(0.5)
    s0 = shuffled_overlap(sel, req, seed=0)
    assert s0 == pytest.approx(shuffled_overlap(sel, req, seed=0))  # deterministic from the seed
    assert s0 != pytest.approx(shuffled_overlap(sel, req, seed=1))


def test_the_shuffle_stays_within_each_request():
    """Each request repeats its own expert set, the sets of different requests disjoint: shuffling
    each request's tokens leaves every neighbour pair in one request, overlap 1 whatever the seed
    (lift 1: all of the overlap is the request's mix). A shuffle across requests would pair tokens
    of different requests (overlap 0) and report a baseline below 1, a lift above 1 (issue 30:
    that mutant moved a real lift from 1.05 to 3.05 unseen by this file)."""
    k, L = 2, 2
    seqs = {f"r{i}": [[[2 * i, 2 * i + 1], [2 * i + 1, 2 * i]]] * (3 + i) for i in range(6)}
    rows = _rows(seqs)
    sel, req, pos = decode_tokens(rows, L, k)
    for seed in range(5):
        np.testing.assert_array_equal(shuffled_overlap(sel, req, seed), [1.0, 1.0])
    meta = TraceMeta("toy", num_layers=L, num_experts=12, top_k=k, moe_layers=[0, 1], source="test")
    doc = locality_stats(rows, meta, seed=7)
    assert doc["consecutive_overlap"]["mean"] == 1.0 and doc["shuffled_overlap"]["mean"] == 1.0 and doc["lift"] == 1.0


def test_shuffled_overlap_is_the_mean_over_pairs_within_requests():
    """The baseline's expectation by brute force: a uniformly shuffled request of n tokens has n - 1
    neighbour pairs, each a uniformly drawn pair of two of its tokens, so over seeds the baseline
    tends to sum_r (n_r - 1) * mean_{i<j in r} overlap(i, j) / sum_r (n_r - 1). Requests draw from
    disjoint expert pools, so pairing across requests would give a far lower value."""
    rng = np.random.default_rng(3)
    k, L = 2, 2
    seqs = {}
    for i in range(4):
        pool = list(range(4 * i, 4 * i + 4))
        seqs[f"q{i}"] = [[list(rng.choice(pool, size=k, replace=False)) for _ in range(L)]
                         for _ in range(int(rng.integers(4, 9)))]
    sel, req, pos = decode_tokens(_rows(seqs), L, k)
    want = []
    for li in range(L):
        num = den = 0.0
        for toks in seqs.values():
            n = len(toks)
            pairs = [len(set(toks[i][li]) & set(toks[j][li])) / k for i in range(n) for j in range(i + 1, n)]
            num += (n - 1) * np.mean(pairs)
            den += n - 1
        want.append(num / den)
    got = np.mean([shuffled_overlap(sel, req, seed) for seed in range(400)], axis=0)
    np.testing.assert_allclose(got, want, atol=0.02)
    across = []  # the same with every token shuffled across requests: far below
    for li in range(L):
        flat = [t[li] for toks in seqs.values() for t in toks]
        across.append(np.mean([len(set(a) & set(b)) / k for i, a in enumerate(flat) for b in flat[i + 1:]]))
    assert np.all(np.asarray(want) > np.asarray(across) + 0.2)


def test_padding_is_never_a_shared_expert():
    """-1 marks a (layer, rank) a token has no selection for: two tokens both missing rank 1 share
    only their real experts (issue 30: a mutant counting -1 == -1 as shared survived)."""
    rows = _rows({"a": [[[5]], [[5]], [[6]], [[6]]]})  # top_k 2, rank 1 never recorded
    sel, req, pos = decode_tokens(rows, 1, 2)
    assert (sel[:, 0, 1] == -1).all()
    # pairs: {5}&{5} = 1, {5}&{6} = 0, {6}&{6} = 1, each over top_k = 2
    assert consecutive_overlap(sel, req, pos)[0] == pytest.approx((0.5 + 0.0 + 0.5) / 3)
    np.testing.assert_allclose(pair_overlap(sel[1:], sel[:-1], 2)[:, 0], [0.5, 0.0, 0.5])
    np.testing.assert_array_equal(reuse_distances(sel, req, pos), [0, 1, 0, 1])


def test_reuse_distance_never_crosses_a_request():
    """Each request's first selection of an expert is 'first' (0), whatever another request did
    with it before or at the same positions (issue 30: distances across requests survived)."""
    rows = pd.concat([_rows({"a": [[[1]], [[1]], [[1]]]}, start=5), _rows({"b": [[[1]], [[1]]]}, start=20),
                      _rows({"c": [[[1]], [[2]], [[1]]]}, start=5), _rows({"d": [[[1]]]}, start=2)],
                     ignore_index=True)
    sel, req, pos = decode_tokens(rows, 1, 1)
    # tokens in (request, position) order: a 5-7, b 20-21, c 5-7, d 2
    np.testing.assert_array_equal(reuse_distances(sel, req, pos), [0, 1, 1, 0, 1, 0, 0, 2, 0])


def test_the_share_of_misses_no_lookahead_can_reach():
    """forecast.lookahead_recall's missed_unreachable_share: the missed selections in the first
    ``depth`` MoE layers (no earlier layer to forecast them from) over all missed selections, by
    hand (issue 30: its complement passed every test)."""
    import torch

    from coldset.analysis.forecast import lookahead_recall

    S, L, T, E, H, k = 1, 4, 1, 6, 3, 2
    rng = np.random.default_rng(0)
    hidden = torch.as_tensor(rng.standard_normal((S, L, T, H)), dtype=torch.float32)
    routers = [torch.as_tensor(rng.standard_normal((E, H)), dtype=torch.float32) for _ in range(L)]
    routing = np.array([[0, 1], [2, 3], [4, 5], [0, 2]]).reshape(S, L, T, k)
    missed = np.zeros((S, L, T, k), dtype=bool)
    missed[0, 0, 0, :] = True  # 2 misses in layer 0
    missed[0, 1, 0, 0] = True  # 1 in layer 1
    missed[0, 3, 0, :] = True  # 2 in layer 3
    assert lookahead_recall(hidden, routers, routing, missed, 1)["missed_unreachable_share"] == pytest.approx(2 / 5)
    assert lookahead_recall(hidden, routers, routing, missed, 2)["missed_unreachable_share"] == pytest.approx(3 / 5)
    assert lookahead_recall(hidden, routers, routing, np.zeros_like(missed), 1)["missed_unreachable_share"] == 0.0


def test_reuse_histogram_buckets():
    h = reuse_histogram(np.array([0, 1, 1, 2, 3, 4, 5, 64, 65, 0]))
    assert h["first"] == 0.2 and h["1"] == 0.2 and h["2"] == 0.1 and h["3-4"] == 0.2
    assert h["5-8"] == 0.1 and h["33-64"] == 0.1 and h[">64"] == 0.1
    assert sum(h.values()) == pytest.approx(1.0)


def test_run_stats_writes_locality(tmp_path):
    """locality.json from a trace file against brute force over the tokens written (issue 30: the
    old test compared the stage with the function it calls): per-layer consecutive overlap, the
    reuse-distance shares by hand, the request and token counts; layer 0 repeats each request's own
    expert pair, so its shuffled baseline is exactly 1 (within requests) whatever the seed."""
    rng = np.random.default_rng(4)
    seqs = _random_seqs(rng, n_req=6, n_layers=2, n_experts=6, k=2, stay=0.9)
    for i, toks in enumerate(seqs.values()):
        for t in toks:
            t[0] = [2 * i, 2 * i + 1]
    rows = _rows(seqs)
    meta = TraceMeta("toy", num_layers=2, num_experts=12, top_k=2, moe_layers=[0, 1], source="test")
    table = pd.DataFrame({"request": rows.request, "domain": "d", "position": rows.position.astype("int32"),
                          "phase": "decode", "layer": rows.layer_index.astype("int16"),
                          "rank": rows["rank"].astype("int8"), "expert": rows.expert.astype("int16")})
    path = write_trace(tmp_path / "t.parquet", meta, pa.Table.from_pandas(table, preserve_index=False))
    paths = run_stats(path, tmp_path / "out", figures=False, progress=False, locality_seed=3)
    doc = json.loads(paths["locality"].read_text())
    assert doc["seed"] == 3 and doc["requests"] == 6 and doc["tokens"] == sum(len(t) for t in seqs.values())
    cons = []
    for li in range(2):
        vals = [len(set(toks[t][li]) & set(toks[t - 1][li])) / 2 for toks in seqs.values() for t in range(1, len(toks))]
        cons.append(np.mean(vals))
    assert [doc["consecutive_overlap"]["per_layer"][str(li)] for li in range(2)] == pytest.approx(cons)
    assert cons[0] == 1.0 and doc["shuffled_overlap"]["per_layer"]["0"] == 1.0
    shuf = doc["shuffled_overlap"]["mean"]
    assert doc["lift"] == pytest.approx(np.mean(cons) / shuf)
    dist = []
    for name in sorted(seqs):
        last = {}
        for t, layers in enumerate(seqs[name]):
            for li, experts in enumerate(layers):
                for e in experts:
                    dist.append(t - last[(li, e)] if (li, e) in last else 0)
                    last[(li, e)] = t
    dist = np.asarray(dist)
    want = {"1": (dist == 1).mean(), "2": (dist == 2).mean(), "3-4": ((dist >= 3) & (dist <= 4)).mean(),
            "5-8": ((dist >= 5) & (dist <= 8)).mean(), "9-16": ((dist >= 9) & (dist <= 16)).mean(),
            "17-32": ((dist >= 17) & (dist <= 32)).mean(), "33-64": ((dist >= 33) & (dist <= 64)).mean(),
            ">64": (dist > 64).mean(), "first": (dist == 0).mean()}
    assert doc["reuse_distance"] == pytest.approx(want)


def test_the_lift_of_a_request_prefix_is_lower_and_the_prefix_is_each_requests_first_tokens():
    # scripts/locality_calibrate.py's like-for-like lift (issue 17, fourth session): each request's
    # first n decode tokens (counted from its own first position), against brute force; and the
    # length effect the window corrects: the same routing (the 4 experts slide by one of 256 every
    # token) has a far lower lift over a short prefix, since a short request's shuffled
    # neighbours lie few tokens apart, where the sets still overlap
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "locality_calibrate.py"
    spec = importlib.util.spec_from_file_location("locality_calibrate", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    toks = [[[t + r for r in range(4)]] for t in range(128)]
    rows = pd.concat([_rows({"a": toks}, start=3), _rows({"b": toks[:20]}, start=50)], ignore_index=True)
    for n in (1, 16, 31, 200):
        got = script.first_decode_tokens(rows, n)
        want = rows[((rows.request == "a") & (rows.position < 3 + n)) | ((rows.request == "b") & (rows.position < 50 + n))]
        assert got.equals(want)
    meta = TraceMeta(model="m", num_layers=1, num_experts=256, top_k=4, moe_layers=[0])
    short = locality_stats(script.first_decode_tokens(rows, 16), meta)["lift"]
    assert locality_stats(rows, meta)["lift"] > 2 * short > 4
