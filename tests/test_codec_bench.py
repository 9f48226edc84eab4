"""``bench cache --host-tier compressed`` on the CPU: the bytes a compressed row's fills copied (each
admitted or prefetched expert's own record, misses read in place at raw bytes) against a count off the
replay's per-selection hits, the management columns' pairing by tier, and the render of both tiers' rows."""

import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_cache_compressed_rows_count_the_records_their_fills_copied():
    """``bench cache --host-tier compressed``'s link bytes: each group's distinct missed experts (read
    off the replay's per-selection hits, not its victims) at their own record's bytes, plus each
    prefetched expert's record (lookahead's issued copies); a replay without victims (nexttoken's)
    counts its copies at the mean record; compressed rows pair with compressed residency-1.0 rows
    in the management columns."""
    from coldset.analysis.simulate import simulate
    from coldset.analysis.streams import AccessStream
    from coldset.measure.cache import _manage_columns, _time_columns
    from coldset.measure.cache_compressed import copied_bytes

    S, L, B, k, E = 10, 3, 2, 2, 8
    rng = np.random.default_rng(11)
    routing = np.array([[[rng.choice(E, k, replace=False) for _ in range(B)] for _ in range(L)] for _ in range(S)])
    inst = (routing + (np.arange(L) * E)[None, :, None, None]).reshape(-1)
    acc = AccessStream(inst, np.arange(0, inst.size + 1, B * k), B * S, L, E)
    record = rng.integers(1000, 9000, size=L * E)  # every expert's record of its own size
    sim = simulate(acc, "lru", 8, np.ones((L, E)), record_victims=True)
    want = 0
    for g in range(acc.group_ptr.size - 1):
        sel = slice(acc.group_ptr[g], acc.group_ptr[g + 1])
        want += int(record[np.unique(inst[sel][~sim.hit[sel]])].sum())
    assert sim.fills.sum() > 0 and copied_bytes(record, sim, inst, 10**6) == (want, "records")
    lists = np.full((acc.group_ptr.size - 1, 4), -1, dtype=np.int64)
    for g in range(lists.shape[0]):  # two experts of the next layer (none after the last)
        if g % L < L - 1:
            lists[g, :2] = (g % L + 1) * E + rng.choice(E, 2, replace=False)
    # (without the prefetch gate: the random lists would keep it closed, and the copies are counted here)
    ahead = simulate(acc, "lookahead", 8, np.ones((L, E)), record_victims=True, predictions=lists,
                     prefetch_gate=False)
    # in flight slots are no victims: some misses are read in place, at the raw bytes
    assert ahead.prefetches.sum() > 0 and int(ahead.fills.sum()) > int((ahead.victims >= 0).sum())
    want = int(record[ahead.issued[ahead.issued >= 0]].sum())
    for g in range(acc.group_ptr.size - 1):
        lo = acc.group_ptr[g]
        sel = inst[lo:acc.group_ptr[g + 1]]
        for x in np.unique(sel[~ahead.hit[lo:lo + sel.size]]):
            first = lo + int(np.flatnonzero(sel == x)[0])
            want += int(record[x]) if ahead.victims[first] >= 0 else 10**6
    assert copied_bytes(record, ahead, inst, 10**6) == (want, "records")
    plain = simulate(acc, "lru", 8, np.ones((L, E)))
    moved, basis = copied_bytes(record, plain, inst, 10**6)
    assert basis == "mean record" and moved == round(int(plain.fills.sum()) * record.mean())
    rows = {name: ({"step_ms_mean": ms, "residency": res, "link_gb_per_token": 0.01}, sim)
            for name, ms, res in (("lru-0.5", 11.0, 0.5), ("lru-1.0", 10.5, 1.0), ("lru-0.5 compressed", 11.0, 0.5),
                                  ("lru-1.0 compressed", 12.0, 1.0))}
    for r, _ in rows.values():
        r.update(_time_columns(r, 10.0, 50.0, B, acc, sim, 10**6))
    _manage_columns(rows, 10.0, 50.0, B, acc, 10**6)
    assert rows["lru-0.5"][0]["manage_ms_per_group"] == pytest.approx(0.5 / L)
    assert rows["lru-0.5 compressed"][0]["manage_ms_per_group"] == pytest.approx(2.0 / L)


def test_render_cache_renders_rows_of_both_host_tiers():
    from coldset.measure.render import render_cache

    res = json.loads((ROOT / "docs" / "measurements" / "cache_bench_fit_b1.json").read_text())
    extra = [dict(r, placement=r["placement"] + " compressed", host_tier="compressed", link_over_raw=0.68)
             for r in res["rows"] if r["placement"].startswith("lru-")]
    assert extra
    res["rows"] = [dict(r, host_tier="raw") for r in res["rows"]] + extra
    text = render_cache(res)
    for r in extra:
        assert f"| {r['placement']} |" in text


def _replays():
    """A small routing stream and lru's and lookahead's replays of it with their victims (lookahead
    without the prefetch gate: its random lists would keep it closed, and its copies are what the
    rows count)."""
    from coldset.analysis.simulate import simulate
    from coldset.analysis.streams import AccessStream

    S, L, B, k, E = 12, 3, 2, 2, 8
    rng = np.random.default_rng(5)
    routing = np.array([[[rng.choice(E, k, replace=False) for _ in range(B)] for _ in range(L)] for _ in range(S)])
    inst = (routing + (np.arange(L) * E)[None, :, None, None]).reshape(-1)
    acc = AccessStream(inst, np.arange(0, inst.size + 1, B * k), B * S, L, E)
    lists = np.full((acc.group_ptr.size - 1, 4), -1, dtype=np.int64)
    for g in range(lists.shape[0]):
        if g % L < L - 1:
            lists[g, :3] = (g % L + 1) * E + rng.choice(E, 3, replace=False)
    return B, S, acc, {"lru": simulate(acc, "lru", 8, np.ones((L, E)), record_victims=True),
                       "lookahead": simulate(acc, "lookahead", 8, np.ones((L, E)), record_victims=True,
                                             predictions=lists, prefetch_gate=False)}


@pytest.mark.parametrize("policy", ["lru", "lookahead"])
def test_compressed_rows_time_columns_are_the_time_model_with_the_tiers_ratio_and_decoder(policy):
    """A compressed row's simulated step, bound, fraction, overlap and wasted bytes are
    simulate_time's with the compressed tier (ratio, decode rate), not the raw model's; its bound
    counted here off the replay (admitted fills and prefetches decoded and crossing as records,
    misses read in place raw); the raw row's columns stay bench.metrics.time_columns'."""
    from coldset.analysis.time_model import TimeModel, simulate_time
    from coldset.bench.metrics import ENGINE_TIME, time_columns
    from coldset.measure.cache import _manage_columns, _time_columns

    B, S, acc, sims = _replays()
    sim, per_expert, link, allhbm, ratio = sims[policy], 10**6, 50.0, 0.25, 0.68
    decode = 4.0  # slow: 0.25 ms a decoded expert, so the decoder's work sets the bound
    raw = {"step_ms_mean": 0.9, "residency": 0.5, "host_tier": "raw", "link_gb_per_token": 0.004}
    comp = dict(raw, host_tier="compressed", compressed_ratio=ratio, decode_gb_s=decode)
    raw.update(_time_columns(raw, allhbm, link, B, acc, sim, per_expert))
    comp.update(_time_columns(comp, allhbm, link, B, acc, sim, per_expert))
    want_raw = time_columns(0.9, B, 0.004, allhbm, link, [(acc, sim, per_expert)])
    assert raw["bound_ms"] == want_raw["bound_ms"] and raw["sim_step_ms"] == want_raw["simulated_step_ms"]
    assert raw["overlap"] == want_raw["overlap"] and "wasted_gb_per_token" not in raw

    admitted = int((sim.victims >= 0).sum())
    prefetched = 0 if sim.issued is None else int((sim.issued >= 0).sum())
    in_place = int(sim.fills.sum()) - admitted
    assert admitted > 0 and in_place >= 0 and (policy == "lru" or prefetched > 0)
    decode_ms = (admitted + prefetched) * per_expert / (decode * 1e9) * 1e3 / S
    link_bytes = (admitted + prefetched) * ratio * per_expert + in_place * per_expert
    link_ms = link_bytes / (link * 1e9) * 1e3 / S
    assert comp["bound_ms"] == pytest.approx(max(allhbm, link_ms, decode_ms)) and decode_ms > link_ms
    assert comp["fraction_of_bound"] == pytest.approx(comp["bound_ms"] / 0.9)
    assert comp["overlap"] == pytest.approx(1 - (0.9 - allhbm) / link_ms)
    assert comp["sim_link_gb_per_token"] == pytest.approx(link_bytes / (B * S) / 1e9)
    model = TimeModel(allhbm, per_expert, link, **ENGINE_TIME, compressed_ratio=ratio, decode_gb_s=decode)
    ts = simulate_time(acc, sim, model)
    assert comp["sim_step_ms"] == ts.step_ms and comp["sim_over_measured"] == ts.step_ms / 0.9
    assert comp["wasted_gb_per_token"] == ts.wasted_gb_per_token
    assert comp["sim_step_ms"] != raw["sim_step_ms"] and comp["bound_ms"] != raw["bound_ms"]
    # the management columns: the compressed residency-1.0 row's step, the compressed model
    full = dict(comp, residency=1.0, step_ms_mean=0.4)
    rows = {"lru-0.5": (raw, sim), "lru-0.5 compressed": (comp, sim), "lru-1.0 compressed": (full, sim)}
    _manage_columns(rows, allhbm, link, B, acc, per_expert)
    manage = (0.4 - allhbm) / acc.num_moe_layers
    assert comp["manage_ms_per_group"] == pytest.approx(manage) and raw["manage_ms_per_group"] is None
    from dataclasses import replace
    assert comp["sim_managed_step_ms"] == simulate_time(acc, sim, replace(model, manage_ms=manage)).step_ms


def test_nexttoken_replayed_with_victims_and_the_decoder_flag_checked():
    """nexttoken's checked replay has no victims: with_victims replays it again recording them (the
    same decisions), None where the decisions differ; --decode-gb-s needs the compressed tier."""
    from coldset.analysis.simulate import simulate
    from coldset.measure.cli import build_parser
    from coldset.measure import cache
    from coldset.measure.cache_compressed import with_victims
    from coldset.measure.harness import MeasureError

    _, _, acc, _ = _replays()
    L, E = acc.num_moe_layers, acc.num_experts
    lists = np.full((acc.group_ptr.size - 1, 3), -1, dtype=np.int64)
    for g in range(lists.shape[0]):  # the same layer's experts one step on
        nxt = g + L if g + L < lists.shape[0] else g
        lists[g, :2] = acc.instances[acc.group_ptr[nxt]:acc.group_ptr[nxt + 1]][:2]
    counts = np.arange(L * E, dtype=float).reshape(L, E)
    plain = simulate(acc, "nexttoken", 8, counts, predictions=lists, prefetch_budget=2)
    again = with_victims(acc, plain, 8, counts, lists, 2)
    assert plain.victims is None and again is not None and (again.victims >= 0).sum() > 0
    assert np.array_equal(again.hit, plain.hit) and np.array_equal(again.prefetches, plain.prefetches)
    assert with_victims(acc, plain, 7, counts, lists, 2) is None  # other decisions: refused
    parse = build_parser().parse_args
    with pytest.raises(MeasureError, match="decode-gb-s"):
        cache.check_arguments(parse(["cache", "--out", "x", "--decode-gb-s", "100"]))
    cache.check_arguments(parse(["cache", "--out", "x", "--host-tier", "raw,compressed",
                                 "--decode-gb-s", "100"]))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_decode_rate_on_cuda_decodes_layer_zero_bitwise_and_refuses_other_bytes(fmt):
    """bench cache's decoder rate: layer 0's records decoded (the captured step's decode launch)
    bitwise the all-HBM experts, a positive rate; an all-HBM pool whose bytes differ is refused."""
    import torch

    from coldset.kernels.compressed_tier import compressed_host_tier
    from coldset.measure.cache_compressed import decode_rate
    from coldset.measure.harness import MeasureError
    from test_codec_tier import L, E, all_hot_on, bf16_pools, fp8_pools

    cpu = bf16_pools() if fmt == "bf16" else fp8_pools()
    all_hot = all_hot_on(cpu, "cuda")
    tier = compressed_host_tier(all_hot, lane_symbols=64)
    got = decode_rate(tier, all_hot, experts=8, reps=2)
    assert got["experts"] == E and got["decode_gb_s"] > 0 and got["raw_mb"] * 1e6 == pytest.approx(tier.raw_nbytes / L)
    all_hot.w2_hot[1].view(torch.uint8)[0] ^= 1
    with pytest.raises(MeasureError, match="w2"):
        decode_rate(tier, all_hot, experts=8, reps=1)
