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
    from coldset.measure.cache import _manage_columns, _time_columns, copied_bytes

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
    ahead = simulate(acc, "lookahead", 8, np.ones((L, E)), record_victims=True, predictions=lists)
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
