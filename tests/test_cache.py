"""The cache simulator against brute-force references of its semantics (coldset.analysis.simulate's module doc
and the policies' modules)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from coldset.analysis.cache import simulation_table
from coldset.analysis.policies import POLICIES, REGISTRY
from coldset.analysis.policies.base import CachePolicy, Replay
from coldset.analysis.simulate import capacity_for_residency, simulate, warm_order
from coldset.analysis.streams import AccessStream, CacheError, select_rows, stream_from_frame, trace_decode_rows
from coldset.analysis.time_model import TimeModel, simulate_time
from coldset.core.trace import TraceMeta, write_trace
from test_placement import Shape

# ---------------------------------------------------------------------------------------------
# brute force: the semantics read literally, one victim at a time by scanning every resident



#: The toy model shape the cache stage's tests place and time (3 layers, MoE layers 0 and 2, 8
#: experts, top-2): test_placement's stand-in for the engine's ModelConfig.
TINY_SHAPE = Shape(moe_layers=(0, 2), num_layers=3, num_experts=8, top_k=2, hidden_size=16, moe_intermediate_size=8,
                   intermediate_size=32, vocab_size=50, head_dim=8, qk_norm=True)


def brute_force(groups: list[list[int]], policy: str, capacity: int, profile: np.ndarray, num_layers: int = 0):
    """Per-selection hits and per-missed-selection victims, plain Python. ``lru_guard`` and ``lfu``:
    no victim among the instances of the last ``num_layers`` groups (this one included); a miss
    without a candidate left is not admitted (victim -1)."""
    flat = profile.reshape(-1)
    n_inst = flat.size
    # usage_global hot set: top `capacity` by count, ties by id ascending
    hot = sorted(range(n_inst), key=lambda x: (-flat[x], x))[:capacity]
    warm = sorted(hot, key=lambda x: (flat[x], x))
    resident = set(warm)
    last_use = {x: j - capacity for j, x in enumerate(warm)}
    count = {x: float(flat[x]) for x in warm}
    stream = [x for g in groups for x in g]
    hits, victims = [], []
    tick = 0
    for gi, g in enumerate(groups):
        start = tick
        gh = [x in resident for x in g]
        hits += gh
        vics = [-1] * len(g)
        if policy != "static":
            missed = []
            for r, x in enumerate(g):
                if not gh[r] and x not in [g[q] for q in missed]:
                    missed.append(r)
            recent = {y for h in groups[max(0, gi - num_layers + 1):gi + 1] for y in h}
            for r in missed:
                cands = [y for y in resident if y not in (recent if policy in ("lru_guard", "lfu") else g)]
                if not cands:
                    break

                def next_use(y):
                    for t in range(start + len(g), len(stream)):
                        if stream[t] == y:
                            return t
                    return float("inf")

                if policy in ("lru", "lru_guard"):
                    v = min(cands, key=lambda y: last_use[y])
                elif policy == "lfu":
                    v = min(cands, key=lambda y: (count.get(y, 0.0), last_use[y]))
                else:
                    v = min(cands, key=lambda y: (-next_use(y), y))
                resident.remove(v)
                resident.add(g[r])
                vics[r] = v
        victims += vics
        for x in g:
            last_use[x] = tick
            count[x] = count.get(x, 0.0) + 1.0
            tick += 1
    return np.array(hits), np.array(victims)


def once_per_row(lists: np.ndarray) -> None:
    """A prediction list names an instance once: each row's repeats (after the first) become -1, in place."""
    for row in lists:
        _, first = np.unique(row, return_index=True)
        dup = np.ones(row.size, bool)
        dup[first] = False
        row[dup] = -1


def random_stream(rng, n_layers=3, n_experts=6, n_groups=60, k=2, dup=False, skew=1.2):
    n_inst = n_layers * n_experts
    p = 1.0 / np.arange(1, n_experts + 1) ** skew
    groups = []
    for g in range(n_groups):
        layer = g % n_layers
        perm = rng.permutation(n_experts)  # per-group popularity drift
        ex = rng.choice(perm, size=k, replace=dup, p=p / p.sum())
        groups.append([int(layer * n_experts + e) for e in ex])
    ids = np.array([x for g in groups for x in g], dtype=np.int64)
    ptr = np.r_[0, np.cumsum([len(g) for g in groups])]
    profile = rng.integers(0, 5, size=(n_layers, n_experts)).astype(float)  # many ties
    return groups, AccessStream(ids, ptr, n_groups, n_layers, n_experts), profile, n_inst


@pytest.mark.parametrize("policy", [p for p in POLICIES if p not in ("forecast", "nexttoken")])  # own tests below
def test_policies_match_brute_force(policy):
    rng = np.random.default_rng(7)
    differs = 0
    for trial in range(25):
        k = int(rng.integers(1, 4))
        dup = bool(trial % 3 == 0)
        groups, stream, profile, n_inst = random_stream(rng, k=k, dup=dup, n_groups=int(rng.integers(5, 70)))
        # uneven groups too (an engine step at batch B): merge some neighbours
        if trial % 4 == 1:
            merged = [groups[0]]
            for g in groups[1:]:
                if rng.random() < 0.3:
                    merged[-1] = merged[-1] + g
                else:
                    merged.append(g)
            groups = merged
            stream = AccessStream(stream.instances, np.r_[0, np.cumsum([len(g) for g in groups])], len(groups),
                                  stream.num_moe_layers, stream.num_experts)
        cap = int(rng.integers(stream.max_group, n_inst + 1))
        res = simulate(stream, policy, cap, profile, record_victims=True)
        ref_hit, ref_vic = brute_force(groups, policy, cap, profile, stream.num_moe_layers)
        if policy == "lru_guard":  # the guard changed lru's replay somewhere (else it went untested)
            differs += not np.array_equal(res.hit, simulate(stream, "lru", cap, profile).hit)
        np.testing.assert_array_equal(res.hit, ref_hit, err_msg=f"trial {trial} cap {cap}")
        np.testing.assert_array_equal(res.victims, ref_vic, err_msg=f"trial {trial} cap {cap}")
        sizes = np.array([len(g) for g in groups])
        bounds = np.r_[0, np.cumsum(sizes)]
        np.testing.assert_array_equal(res.hits, [ref_hit[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])])
        np.testing.assert_array_equal(res.misses, sizes - res.hits)
        fills = [len({x for x, h in zip(g, ref_hit[a:b]) if not h}) for g, a, b in zip(groups, bounds[:-1], bounds[1:])]
        np.testing.assert_array_equal(res.fills, fills)
    assert policy != "lru_guard" or differs > 0


def test_belady_bounds_every_online_policy():
    rng = np.random.default_rng(11)
    for trial in range(40):
        groups, stream, profile, n_inst = random_stream(rng, n_layers=4, n_experts=8, n_groups=150,
                                                        k=int(rng.integers(1, 4)), skew=0.8)
        cap = int(rng.integers(stream.max_group, n_inst))
        bel = simulate(stream, "belady", cap, profile).hits.sum()
        # Belady is optimal among policies that admit every miss (lru); static admits none and can
        # beat it when the pool is as small as one group (every group flushes the pool), and so can
        # the guarded policies (lru_guard, lfu), which read a miss in place rather than evict
        for policy in ("lru",):
            assert bel >= simulate(stream, policy, cap, profile).hits.sum(), (trial, policy, cap)


def test_warm_start_is_the_usage_global_set_least_used_first():
    profile = np.array([[5.0, 0.0, 3.0], [3.0, 9.0, 1.0]])
    # top 3 by count, ties by id: 4 (9), 0 (5), then 2 and 3 (3, 3) -> 2 by id
    np.testing.assert_array_equal(warm_order(profile, 3), [2, 0, 4])
    # LRU evicts the warm pool least used first (2, 0, 4), then the first admitted (1, tick 0)
    stream = AccessStream(np.array([1, 3, 5, 4]), np.array([0, 1, 2, 3, 4]), 4, 2, 3)
    res = simulate(stream, "lru", 3, profile, record_victims=True)
    assert res.hit.tolist() == [False, False, False, False]
    assert res.victims.tolist() == [2, 0, 4, 1]
    # a warm instance touched first keeps its slot: 4 is hit and moves behind 2 and 0
    stream = AccessStream(np.array([4, 1, 3, 4]), np.array([0, 1, 2, 3, 4]), 4, 2, 3)
    res = simulate(stream, "lru", 3, profile, record_victims=True)
    assert res.hit.tolist() == [True, False, False, True]
    assert res.victims.tolist() == [-1, 2, 0, -1]
    static = simulate(stream, "static", 3, profile)
    assert static.hit.tolist() == [True, False, False, True] and static.fills.tolist() == [0, 1, 1, 0]


def test_capacity_checks_and_rounding():
    assert capacity_for_residency(0.29, 10, 10) == 29  # placement's exact decimal floor
    stream = AccessStream(np.array([0, 1, 2, 3]), np.array([0, 2, 4]), 2, 1, 4)
    with pytest.raises(CacheError, match="cannot hold one group"):
        simulate(stream, "lru", 1, np.ones((1, 4)))
    with pytest.raises(CacheError, match="unknown cache policy"):
        simulate(stream, "fifo", 2, np.ones((1, 4)))
    assert simulate(stream, "static", 0, np.ones((1, 4))).hits.sum() == 0


class _KeepPreviousGroup(CachePolicy):
    """A toy policy in one class: the pool holds exactly the previous group's instances (none at the
    start, whatever the capacity)."""

    holds_group = False

    def replay(self, stream, warm, counts, lists, budget, victims, lead_unit=0):
        hit = np.zeros(stream.instances.size, dtype=bool)
        fills = np.zeros(stream.num_groups, dtype=np.int64)
        previous: set[int] = set()
        for g in range(stream.num_groups):
            group = stream.instances[stream.group_ptr[g]:stream.group_ptr[g + 1]]
            hit[stream.group_ptr[g]:stream.group_ptr[g + 1]] = [int(x) in previous for x in group]
            fills[g] = len({int(x) for x in group} - previous)
            previous = {int(x) for x in group}
        return Replay(hit, fills)


def test_simulate_dispatches_through_the_policy_registry(monkeypatch):
    """A new policy = its class + one registry line: registered under a new name, simulate replays it
    (hits = selections whose instance the previous group used, counted here by brute force) and the
    stage's table takes it; unregistered, the name is refused."""
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 8, 60)
    stream = AccessStream(ids, np.arange(0, 61, 3), 20, 2, 4)
    counts = np.ones((2, 4))
    with pytest.raises(CacheError, match="unknown cache policy 'previous_group'"):
        simulate(stream, "previous_group", 4, counts)
    monkeypatch.setitem(REGISTRY, "previous_group", _KeepPreviousGroup())
    res = simulate(stream, "previous_group", 4, counts)
    groups = [list(ids[a:a + 3]) for a in range(0, 60, 3)]
    expected = sum(x in prev for prev, group in zip([[]] + groups[:-1], groups) for x in group)
    assert res.policy == "previous_group" and int(res.hits.sum()) == expected > 0
    assert res.stats().hit_rate == pytest.approx(expected / 60)
    assert int(res.fills.sum()) == sum(len(set(g) - set(p)) for p, g in zip([[]] + groups[:-1], groups))
    table = simulation_table(stream, counts, ["previous_group", "static"], [0.5], bytes_per_expert=10**6)
    assert list(table.policy) == ["previous_group", "static"] and table.hit_rate.iloc[0] == pytest.approx(expected / 60)


def test_stream_order_and_heldout_replay_from_a_trace(tmp_path):
    """Held-out requests replay in request-id string order, then position, layer, rank; the
    profile split chooses the warm set."""
    meta = TraceMeta("toy", num_layers=3, num_experts=4, top_k=2, moe_layers=[0, 2], source="test")
    rng = np.random.default_rng(3)
    rows = []
    for req, split in (("b-2", "heldout"), ("a-10", "heldout"), ("a-9", "profile"), ("c", "heldout")):
        for pos in range(3, 3 + int(rng.integers(2, 5))):
            for layer in (0, 2):
                ex = rng.choice(4, size=2, replace=False)
                for rank in range(2):
                    rows.append((req, "d", pos, "decode", layer, rank, int(ex[rank]), split))
        rows.append((req, "d", 0, "prefill", 0, 0, 3, split))
        rows.append((req, "d", 0, "prefill", 0, 1, 2, split))
    df = pd.DataFrame(rows, columns=["request", "domain", "position", "phase", "layer", "rank", "expert", "split"])
    shuffled = df.sample(frac=1.0, random_state=0)
    shuffled = shuffled.sort_values("request", kind="stable")  # requests contiguous, rows shuffled within
    path = write_trace(tmp_path / "t.parquet", meta, pa.Table.from_pandas(shuffled, preserve_index=False))
    dec, m = trace_decode_rows(path)
    held = select_rows(dec, "heldout")
    stream = stream_from_frame(held, m.num_moe_layers, m.num_experts)
    expect = df[(df.phase == "decode") & (df.split == "heldout")].copy()
    expect["li"] = expect["layer"].map({0: 0, 2: 1})
    expect = expect.sort_values(["request", "position", "li", "rank"])  # "a-10" < "b-2" < "c"
    np.testing.assert_array_equal(stream.instances, expect["li"] * 4 + expect["expert"])
    assert stream.tokens == len(expect.groupby(["request", "position"]))
    assert stream.num_groups == stream.tokens * 2 and stream.max_group == 2
    prof = select_rows(dec, "profile")
    from coldset.analysis.streams import counts_from_rows

    counts = counts_from_rows(prof, 2, 4)
    from coldset.analysis.forecast import TransitionForecaster

    with pytest.raises(CacheError, match="needs a forecaster"):
        simulation_table(stream, counts, POLICIES, [0.5], bytes_per_expert=10**6)
    with pytest.raises(CacheError, match="nexttoken' needs a NextTokenForecaster"):
        simulation_table(stream, counts, POLICIES, [0.5], bytes_per_expert=10**6,
                         forecaster=TransitionForecaster.fit(prof, 2, 4, 2))
    table = simulation_table(stream, counts, [p for p in POLICIES if p != "nexttoken"], [0.25, 0.5, 1.0],
                             bytes_per_expert=10**6, forecaster=TransitionForecaster.fit(prof, 2, 4, 2))
    assert table.step_ms.isna().all()  # no time model: no time columns
    full = table[table.residency == 1.0]
    assert (full.hit_rate == 1.0).all() and (full.link_gb_per_token == 0.0).all()
    st = table[(table.policy == "static") & (table.residency == 0.5)].iloc[0]
    hot = set(warm_order(counts, 4).tolist())
    assert st.hit_rate == pytest.approx(np.isin(stream.instances, list(hot)).mean())
    assert st.misses_per_token == pytest.approx((~np.isin(stream.instances, list(hot))).sum() / stream.tokens)
    assert st.link_gb_per_token == pytest.approx(st.misses_per_token * 1e-3)


def test_duplicate_rows_are_refused():
    df = pd.DataFrame({"request": ["a", "a"], "position": [0, 0], "layer_index": [0, 0], "rank": [1, 1],
                       "expert": [0, 1]})
    with pytest.raises(CacheError, match="two rows"):
        stream_from_frame(df, 1, 2)


def test_cache_stage_warms_from_the_placement_profile(tmp_path):
    """run_cache: the static rows equal usage_global's held-out coverage from the same histogram,
    every online policy is checked against the brute-force reference, the figure is written."""

    from coldset.analysis.cache import read_simulation, run_cache
    from coldset.analysis.placement import expert_bytes, place
    from coldset.analysis.profile import read_histogram
    from coldset.analysis.stats import run_stats

    meta = TraceMeta("toy", num_layers=3, num_experts=8, top_k=2, moe_layers=[0, 2], source="test")
    rng = np.random.default_rng(5)
    rows = []
    for i in range(8):
        split = "heldout" if i % 2 else "profile"
        dom = "x" if i < 4 else "y"
        for pos in range(int(rng.integers(3, 9))):
            for layer in (0, 2):
                ex = rng.choice(8, size=2, replace=False, p=np.r_[0.4, 0.2, 0.1, [0.3 / 5] * 5])
                rows += [(f"q{i}", dom, pos, "decode", layer, r, int(ex[r]), split) for r in range(2)]
    df = pd.DataFrame(rows, columns=["request", "domain", "position", "phase", "layer", "rank", "expert", "split"])
    trace = write_trace(tmp_path / "t.parquet", meta, pa.Table.from_pandas(df, preserve_index=False))
    stats = run_stats(trace, tmp_path / "stats", figures=False, progress=False)
    time = {"steps": [{"batch": 1, "all_hbm_step_ms": 2.0}, {"batch": 2, "all_hbm_step_ms": 3.0}]}
    paths = run_cache(trace, stats["histogram"], TINY_SHAPE, tmp_path / "cache", residencies=[0.25, 0.5],
                      locality_json=stats["locality"], time=time)
    every = read_simulation(paths["simulation"])
    assert paths["figure"].stat().st_size > 0
    # the recommendation: one row per (batch, residency), by simulated time, never slower than lru
    rec = pd.read_csv(paths["recommendation"])
    assert len(rec) == 4 and set(rec.policy) <= set(POLICIES) - {"belady"}
    assert (rec.vs_lru <= 1).all()
    # one table per batch size of the time model, each policies x residencies
    assert list(every.policy) == list(POLICIES) * 4 and list(every.batch) == [1] * 2 * len(POLICIES) + [2] * 2 * len(
        POLICIES)
    assert every.step_ms.notna().all() and (every.bound_fraction > 0).all() and (every.bound_fraction <= 1 + 1e-9).all()
    table = every[every.batch == 1]
    for r in (0.25, 0.5):
        pl = place(read_histogram(stats["histogram"]), TINY_SHAPE, "usage_global", r)
        st = table[(table.policy == "static") & (table.residency == r)].iloc[0]
        assert st.capacity == pl.num_hot
        assert st.hit_rate == pytest.approx(pl.coverage_heldout)
        held = df[df.split == "heldout"].sort_values(["request", "position", "layer", "rank"])
        groups = [list(g) for _, g in held.assign(i=held.layer.map({0: 0, 2: 1}) * 8 + held.expert)
                  .groupby(["request", "position", "layer"], sort=True)["i"]]
        prof = df[df.split == "profile"]
        counts = np.zeros(16)
        np.add.at(counts, prof.layer.map({0: 0, 2: 1}) * 8 + prof.expert, 1)
        for policy in ("lru", "lfu", "belady"):
            ref_hit, _ = brute_force(groups, policy, st.capacity, counts.reshape(2, 8), 2)
            row = table[(table.policy == policy) & (table.residency == r)].iloc[0]
            assert row.hit_rate == pytest.approx(ref_hit.mean())
            assert row.misses_per_token == pytest.approx((~ref_hit).sum() / row.tokens)
        # forecast: the forecaster fitted on the profile split's rows, its lists replayed by brute force
        from coldset.analysis.forecast import TransitionForecaster, stream_predictions

        trows, _ = trace_decode_rows(trace)
        fc = TransitionForecaster.fit(select_rows(trows, "profile"), 2, 8, 2)
        pred = stream_predictions(fc, stream_from_frame(select_rows(trows, "heldout"), 2, 8))
        # the gate's unit from the batch-1 time model's link and compute terms
        lead = TimeModel(2.0, expert_bytes(TINY_SHAPE)).lead_unit(2)
        from test_forecast_gate import brute_force_dueled_forecast

        ref_hit, ref_pf, _ = brute_force_dueled_forecast(groups, st.capacity, counts.reshape(2, 8), 8, pred.tolist(), 2,
                                                         lead)
        row = table[(table.policy == "forecast") & (table.residency == r)].iloc[0]
        assert row.hit_rate == pytest.approx(ref_hit.mean())
        fills = sum(len({x for x, h in zip(g, ref_hit[a:a + len(g)]) if not h})
                    for g, a in zip(groups, np.cumsum([0] + [len(g) for g in groups])))
        moved = (fills + ref_pf.sum()) * expert_bytes(TINY_SHAPE)
        assert row.link_gb_per_token == pytest.approx(moved / row.tokens / 1e9)
        # nexttoken: the forecaster fitted (and tuned) on the profile tokens, its lists replayed by brute force
        from coldset.analysis.streams import lanes_from_frame, token_array
        from coldset.analysis.forecast import NextTokenForecaster, nexttoken_lists

        tok, seq = token_array(select_rows(trows, "profile"), 2, 8)
        nt = NextTokenForecaster.fit_tuned(tok, seq, 2, 8)
        lanes = lanes_from_frame(select_rows(trows, "heldout"), 2, 8, 1)
        lists = nexttoken_lists(nt, lanes.sel, lanes.start)
        ref = brute_force_nexttoken(groups, st.capacity, counts.reshape(2, 8), 8, 2, lists.tolist(), None, lead)
        row = table[(table.policy == "nexttoken") & (table.residency == r)].iloc[0]
        assert row.hit_rate == pytest.approx(np.mean(ref["hit"]))
        assert row.prefetches_per_token == pytest.approx(sum(ref["prefetches"]) / row.tokens)
    assert table.link_gb_per_token.iloc[0] == pytest.approx(
        table.misses_per_token.iloc[0] * expert_bytes(TINY_SHAPE) / 1e9)
    # cache.compressed_tier: each row again timed with compressed fills (the bf16 default ratio); the raw rows,
    # the recommendation unchanged
    both_paths = run_cache(trace, stats["histogram"], TINY_SHAPE, tmp_path / "cache_c", residencies=[0.25, 0.5],
                           time=time, figures=False, compressed={"decode_gb_s": 100.0})
    both = read_simulation(both_paths["simulation"])
    assert both.host_tier.tolist() == ["raw", "compressed"] * len(every)
    pd.testing.assert_frame_equal(both[both.host_tier == "raw"].drop(columns="host_tier").reset_index(drop=True),
                                  every)
    comp = both[both.host_tier == "compressed"].reset_index(drop=True)
    assert (comp.hit_rate == every.hit_rate).all()
    lru = (every.policy == "lru") & (every.link_gb_per_token > 0)
    assert lru.any() and np.allclose(comp.link_gb_per_token[lru], 0.6757 * every.link_gb_per_token[lru])
    pd.testing.assert_frame_equal(pd.read_csv(both_paths["recommendation"]), rec)


# test_without_numba's stream (2 layers x 6 experts, top-3, a group's selections kept at the layer's
# next group with probability 0.7) and own-layer lists naming that next group's experts (each entry
# kept with probability 0.9): a forecast the prefetch gate opens for
_PLAIN_SETUP = (
    "rng = np.random.default_rng(2)\n"
    "sel = rng.integers(0, 6, (100, 3))\n"
    "for g in range(2, 100):\n"
    "    sel[g] = np.where(rng.random(3) < 0.7, sel[g - 2], sel[g])\n"
    "ids = ((np.arange(100) % 2)[:, None] * 6 + sel).reshape(-1); ptr = np.arange(0, 301, 3)\n"
    "s = streams.AccessStream(ids, ptr, 100, 2, 6); prof = rng.random((2, 6))\n"
    "pred = np.where(rng.random((100, 3)) < 0.9, np.roll(ids.reshape(100, 3), -2, axis=0), -1)\n"
    "for row in pred:\n"
    "    row[np.setdiff1d(np.arange(3), np.unique(row, return_index=True)[1])] = -1\n"
)


def test_without_numba_the_same_source_runs_as_plain_python():
    """Where numba is missing (the GPU host's image), the replay loops run uncompiled: same results."""
    import subprocess
    import sys
    from pathlib import Path

    from coldset.analysis import streams

    code = (
        "import sys; sys.modules['numba'] = None\n"
        "import numpy as np\n"
        "from coldset.analysis import policies, simulate, streams, time_model\n"
        "from coldset.analysis.policies import lru\n"
        "assert type(lru.replay_lru).__name__ == 'function'\n"
        + _PLAIN_SETUP +
        "rs = [simulate.simulate(s, p, 5, prof, predictions=pred if p in ('forecast', 'nexttoken') else None) "
        "for p in policies.POLICIES]\n"
        "tm = time_model.TimeModel(1.0, 10**7, 20.0, 0.1, 0.4, link='share', join='step')\n"
        "print([int(r.hits.sum()) for r in rs], [int(r.stats().prefetches) for r in rs], "
        "[round(time_model.simulate_time(s, r, tm).step_ms, 9) for r in rs])\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": src})
    assert out.returncode == 0, out.stderr[-2000:]
    scope = {"np": np, "streams": streams}
    exec(_PLAIN_SETUP, scope)
    s, prof, pred = scope["s"], scope["prof"], scope["pred"]
    from coldset.analysis.time_model import TimeModel, simulate_time

    rs = [simulate(s, p, 5, prof, predictions=pred if p in ("forecast", "nexttoken") else None) for p in POLICIES]
    tm = TimeModel(1.0, 10**7, 20.0, 0.1, 0.4, link="share", join="step")
    want = (f"{[int(r.hits.sum()) for r in rs]} {[int(r.stats().prefetches) for r in rs]} "
            f"{[round(simulate_time(s, r, tm).step_ms, 9) for r in rs]}")
    assert out.stdout.strip() == want
    assert sum(r.stats().prefetches for r in rs) > 0


# ---------------------------------------------------------------------------------------------
# forecast: lru plus the per-layer prefetch of a prediction list (issue 12, item 3)


def brute_warm_start(profile, capacity):
    """The warm start read literally: the ``capacity`` most used instances of ``profile`` (ties: the
    lower id) resident, least used first in recency (ticks -capacity .. -1). ``(resident, recency)``."""
    flat = profile.reshape(-1)
    hot = sorted(range(flat.size), key=lambda x: (-flat[x], x))[:capacity]
    warm = sorted(hot, key=lambda x: (flat[x], x))
    return set(warm), {x: float(j - capacity) for j, x in enumerate(warm)}


def first_misses(g, gh):
    """The group's missed instances (``gh``: each selection's hit), each once, in selection order."""
    missed = []
    for x, h in zip(g, gh):
        if not h and x not in missed:
            missed.append(x)
    return missed


def brute_touch(g, resident, recency, last, tick, gi):
    """Each selection of group ``gi`` in turn takes a tick: a resident instance's recency becomes its
    tick, its last group ``gi``. Returns the next tick."""
    for x in g:
        if x in resident:
            recency[x] = float(tick)
        tick += 1
        last[x] = gi
    return tick


class BruteGate:
    """The prefetch gate read literally: running (wanted, useful, saving) sums over the lists, each
    list judged when its layer next runs, each sum losing its 64th (rounded down) before the list's
    copies (1024 parts a copy) are added; wanted starts at 4 copies. Open while the saving, capped
    at 64 groups' compute (64 lead units), beats the waste (wanted - useful) by more than a 32nd of
    the wanted (rounded down)."""

    def __init__(self, lead_unit):
        self.lead_unit, self.acc, self.pending = lead_unit, [4 * 1024, 0, 0], {}

    def judge(self, layer, g, group):
        if layer in self.pending:
            want, g0 = self.pending.pop(layer)
            useful = sum(x in group for x in want)
            adds = (len(want) * 1024, useful * 1024, useful * min(1024, (g - g0) * self.lead_unit))
            self.acc = [a - a // 64 + d for a, d in zip(self.acc, adds)]
        wanted, used, saving = self.acc
        return min(saving, 64 * self.lead_unit) > (wanted - used) + wanted // 32

    def listed(self, layer, g, want):
        self.pending[layer] = (list(want), g)


def brute_force_forecast(groups, capacity, profile, n_experts, preds, own_layer=False, guard=0, lead_unit=None):
    """The forecast policy read literally: per-selection hits, per-group prefetches, useful ones.
    ``own_layer``: a prefetch is in flight until its layer's next group (else until the step ends);
    ``guard``: no victim the last ``guard`` groups used or prefetched; ``lead_unit``: the gate."""
    resident, recency = brute_warm_start(profile, capacity)
    inflight, fresh = set(), set()
    hits, prefetches, useful = [], [], 0
    tick, prev_layer = 0, None
    last = {}  # instance -> the last group that used or prefetched it
    gate = BruteGate(lead_unit) if lead_unit is not None else None
    for gi, (g, pred) in enumerate(zip(groups, preds)):
        layer = g[0] // n_experts
        guarded = {y for y, t in last.items() if t > gi - guard}
        if own_layer:  # this layer's prefetches of the last step have reached their layer
            inflight = {y for y in inflight if y // n_experts != layer}
        elif prev_layer is None or layer <= prev_layer:  # a new step commits the prefetches
            inflight = set()
        prev_layer = layer
        gh = [x in resident for x in g]
        hits += gh
        for x, h in zip(g, gh):
            if h and x in fresh:
                useful += 1
                fresh.discard(x)
        for x in first_misses(g, gh):
            cands = [y for y in resident if y not in g and y not in inflight and y not in guarded]
            if not cands:
                break
            v = min(cands, key=recency.get)
            resident.remove(v)
            fresh.discard(v)
            resident.add(x)
        tick = brute_touch(g, resident, recency, last, tick, gi)
        guarded |= set(g)
        listed = {x for x in pred if x >= 0}
        n = 0
        if gate is not None:
            is_open = gate.judge(layer, gi, g)
            # a list is judged at the next group of the layer it forecasts (own_layer: this one; else its entries')
            target = layer if own_layer else next((x // n_experts for x in pred if x >= 0), None)
            if target is not None:
                gate.listed(target, gi, [x for x in pred if x >= 0 and x not in resident])
            if not is_open:
                pred = []
        for x in pred:
            if x < 0 or x in resident:
                continue
            cands = [y for y in resident if y // n_experts <= layer and y not in g and y not in listed
                     and y not in inflight and y not in guarded]
            if not cands:
                break
            v = min(cands, key=recency.get)
            resident.remove(v)
            fresh.discard(v)
            resident.add(x)
            inflight.add(x)
            fresh.add(x)
            last[x] = gi
            guarded.add(x)
            n += 1
            recency[x] = tick - 1 + n / (len(pred) + 1)
        prefetches.append(n)
    return np.array(hits), np.array(prefetches), useful


def test_forecast_prefetch_lands_for_the_next_step():
    """2 layers x 4 experts, top-1, 3 warm slots (0,0) (0,1) (1,0). Step 1, layer 0 hits (0,0) and
    prefetches (0,2) into the slot of (0,1) (the least recent of layer 0 not used); layer 1 misses
    (1,3) and evicts (1,0), the least recent slot not in flight. Step 2, layer 0 hits (0,2) where
    lru misses it; the prediction lists are checked (own layer only, required). Without the gate
    (which starts closed: tests/test_gate_rule.py), so that the first list is issued."""
    profile = np.array([[5.0, 4.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0]])  # warm: (0,0), (0,1), (1,0)
    ids = np.array([0, 7, 2, 4])  # step 1: (0,0), (1,3); step 2: (0,2), (1,0)
    stream = AccessStream(ids, np.arange(5), 2, 2, 4)
    pred = np.array([[2], [-1], [-1], [-1]])
    res = simulate(stream, "forecast", 3, profile, predictions=pred, prefetch_gate=False)
    assert res.hit.tolist() == [True, False, True, False] and res.prefetches.tolist() == [1, 0, 0, 0]
    assert res.useful_prefetches == 1
    lru = simulate(stream, "lru", 3, profile)
    assert lru.hit.tolist() == [True, False, False, False]
    with pytest.raises(CacheError, match="another MoE layer"):
        simulate(stream, "forecast", 3, profile, predictions=np.array([[6], [-1], [-1], [-1]]))
    with pytest.raises(CacheError, match="required by policy 'forecast'"):
        simulate(stream, "forecast", 3, profile)


def test_forecast_prefetch_survives_the_next_steps_earlier_layers():
    """3 layers x 4 experts, 3 slots warm with (0,1) (0,2) (1,2). Step 1: layer 0 misses (0,3) and
    evicts (0,1); layer 1 misses (1,3) and evicts (0,2), then its list [(1,1)] is prefetched into
    (1,2)'s slot (never used); layer 2 misses (2,0) and (2,2), which find no victim: (0,3) and
    (1,3) were used within the last step's groups and (1,1) is in flight, so both are read in place.
    Step 2: layer 0 misses (0,1) and evicts (0,3) (used a step ago); layer 1 hits its prefetch (1,1).
    Without the rules (a prefetch in flight only until the step ends, no guard) layer 2's misses
    evicted (0,3) and (1,3), layer 0's then took the prefetch, by then the least recent slot, before
    its layer ran."""
    ids = np.array([3, 7, 8, 10, 1, 5, 8])
    stream = AccessStream(ids, np.array([0, 1, 2, 4, 5, 6, 7]), 2, 3, 4)
    prof = np.array([[3.0, 4.0, 4.0, 0.0], [0.0, 3.0, 4.0, 1.0], [1.0, 0.0, 1.0, 4.0]])
    pred = np.array([[-1], [5], [-1], [-1], [-1], [-1]])
    res = simulate(stream, "forecast", 3, prof, predictions=pred, record_victims=True, prefetch_gate=False)
    assert res.hit.tolist() == [False, False, False, False, False, True, False]
    assert res.prefetches.tolist() == [0, 1, 0, 0, 0, 0] and res.useful_prefetches == 1
    assert res.victims.tolist() == [1, 2, -1, -1, 3, -1, 7]
    groups = [ids[s:e].tolist() for s, e in zip(stream.group_ptr[:-1], stream.group_ptr[1:])]
    ref_hit, _, _ = brute_force_forecast(groups, 3, prof, 4, pred.tolist(), own_layer=True, guard=3)
    np.testing.assert_array_equal(res.hit, ref_hit)
    old_hit, old_pf, _ = brute_force_forecast(groups, 3, prof, 4, pred.tolist())
    assert old_pf.tolist() == [0, 1, 0, 0, 0, 0] and not old_hit[5]  # the old rules lost the prefetch


def test_prefetching_policies_keep_lru_guards_protection_where_a_step_outnumbers_the_slots():
    """3 layers x 4 experts, top-2, 4 slots warm with experts no step selects; every step selects
    (l,0) and (l,1) at each layer: 6 experts a step, 4 slots. lru thrashes (every selection misses);
    lru_guard keeps layer 0 and 1's and reads layer 2's in place. nexttoken and forecast (lists
    that name nothing to fetch) keep the same bar, so they hit as lru_guard does."""
    L, E, steps = 3, 4, 5
    ids = np.array([l * E + e for _ in range(steps) for l in range(L) for e in (0, 1)])
    stream = AccessStream(ids, np.arange(0, ids.size + 1, 2), steps, L, E)
    prof = np.zeros((L, E))
    prof[1:, 2:] = 1.0  # warm: (1,2) (1,3) (2,2) (2,3)
    none = np.full((steps * L, 1), -1)
    lru = simulate(stream, "lru", 4, prof)
    guard = simulate(stream, "lru_guard", 4, prof)
    assert lru.hit.sum() == 0 and guard.hit.sum() == 4 * (steps - 1)
    for policy in ("nexttoken", "forecast"):
        res = simulate(stream, policy, 4, prof, predictions=none)
        assert res.hit.tolist() == guard.hit.tolist(), policy
        assert res.fills.tolist() == guard.fills.tolist(), policy


def test_lookahead_policy_matches_brute_force():
    """The lookahead policy: forecast's replay with lists naming later layers of the same step
    (victims only in layers already done, in-flight until the step ends), lru_guard's bar and the
    gate, against the literal brute force on random streams of whole steps. Each list names the
    experts its target group selects, each replaced w.p. ``1 - p`` by a random one (p 0.9 in odd
    trials: lists the gate opens for; 0.3 in even ones: lists it keeps closed), and w.p. 0.2 a
    random entry more; the gate's unit varies (its cap binding at 128 and 1024, not at 10**6)."""
    rng = np.random.default_rng(23)
    seen_prefetch = seen_useful = opened = 0
    L, E = 3, 6
    for trial in range(30):
        k = int(rng.integers(1, 3))
        steps = int(rng.integers(10, 40))
        sel = [[int(e) for e in rng.choice(E, size=k, replace=False)] for _ in range(steps * L)]
        groups = [[(g % L) * E + e for e in sel[g]] for g in range(steps * L)]
        ids = np.array([x for g in groups for x in g])
        stream = AccessStream(ids, np.arange(0, ids.size + 1, k), steps, L, E)
        profile = rng.integers(0, 9, size=(L, E)).astype(np.float64)
        depth = 1 + trial % 2
        p = 0.9 if trial % 2 else 0.3
        pred = np.full((len(groups), 3), -1)
        for g in range(len(groups)):
            layer = g % L
            if layer + depth < L:
                row = [e if rng.random() < p else int(rng.integers(E)) for e in sel[g + depth]]
                row = list(dict.fromkeys(row + [int(rng.integers(E))] * (rng.random() < 0.2)))
                pred[g, :len(row)] = (layer + depth) * E + np.array(row)
        cap = int(rng.integers(stream.max_group, L * E + 1))
        lead_unit = int(rng.choice([128, 1024, 10**6]))
        res = simulate(stream, "lookahead", cap, profile, predictions=pred, lead_unit=lead_unit)
        ref_hit, ref_pf, ref_useful = brute_force_forecast(groups, cap, profile, E, pred.tolist(), guard=L,
                                                           lead_unit=lead_unit)
        np.testing.assert_array_equal(res.hit, ref_hit, err_msg=f"trial {trial} cap {cap}")
        np.testing.assert_array_equal(res.prefetches, ref_pf, err_msg=f"trial {trial} cap {cap}")
        assert res.useful_prefetches == ref_useful
        seen_prefetch += int(ref_pf.sum())
        seen_useful += ref_useful
        opened += bool(ref_pf.sum())
    assert seen_prefetch > 30 and seen_useful > 10
    assert 5 <= opened <= 25, opened  # the gate opened in some trials and stayed closed in others


def test_lookahead_prefetch_lands_for_a_later_layer_of_the_step():
    """2 layers x 4 experts, top-1, 3 warm slots (0,0) (0,1) (1,0). Layer 0 hits (0,0), and its
    lookahead names (1,3): prefetched into (0,1)'s slot (layer 0 is done, (0,0) is in use), so
    layer 1 hits (1,3) where lru misses it. Lists naming the own layer are refused. Without the gate
    (which starts closed: tests/test_gate_rule.py), so that the first list is issued."""
    profile = np.array([[5.0, 4.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0]])
    stream = AccessStream(np.array([0, 7]), np.arange(3), 1, 2, 4)
    res = simulate(stream, "lookahead", 3, profile, predictions=np.array([[7], [-1]]), prefetch_gate=False)
    assert res.hit.tolist() == [True, True] and res.prefetches.tolist() == [1, 0] and res.useful_prefetches == 1
    assert simulate(stream, "lru", 3, profile).hit.tolist() == [True, False]
    with pytest.raises(CacheError, match="earlier MoE layer"):
        simulate(stream, "lookahead", 3, profile, predictions=np.array([[2], [-1]]))
    with pytest.raises(CacheError, match="required by policy"):
        simulate(stream, "lookahead", 3, profile)


# ---------------------------------------------------------------------------------------------
# nexttoken (issue 28): /work/coord/policy28.md's rules read literally


def brute_force_nexttoken(groups, capacity, profile, n_experts, n_layers, lists, budget, lead_unit=1024):
    """Per-selection hits, per-group prefetch lists, useful and wasted prefetches, plain Python; no
    victim among the instances the last ``n_layers`` groups used or prefetched; the gate."""
    resident, recency = brute_warm_start(profile, capacity)
    predicted_of = {}  # layer -> the latest candidate set
    inflight_of = {}  # layer -> instances prefetched after its previous group
    fresh = set()
    out = {"hit": [], "prefetches": [], "issued": [], "useful": 0, "wasted": 0}
    tick = 0
    last = {}  # instance -> the last group that used or prefetched it
    gate = BruteGate(lead_unit)
    for gi, (g, cand) in enumerate(zip(groups, lists)):
        layer = g[0] // n_experts
        guarded = {y for y, t in last.items() if t > gi - n_layers}
        inflight_of[layer] = set()  # 1. commit
        inflight = set().union(*inflight_of.values())
        predicted = set().union(*predicted_of.values())
        gh = [x in resident for x in g]
        out["hit"] += gh
        for x, h in zip(g, gh):
            if h and x in fresh:
                out["useful"] += 1
                fresh.discard(x)
        for x in first_misses(g, gh):  # 2. demand
            cands = [y for y in resident if y not in g and y not in inflight and y not in guarded]
            if not cands:
                break
            v = min(cands, key=lambda y: (y in predicted, recency[y]))
            resident.remove(v)
            if v in fresh:
                out["wasted"] += 1
                fresh.discard(v)
            resident.add(x)
        tick = brute_touch(g, resident, recency, last, tick, gi)
        guarded |= set(g)
        is_open = gate.judge(layer, gi, g)
        gate.listed(layer, gi, [x for x in cand if x >= 0 and x not in resident])
        predicted_of[layer] = {x for x in cand if x >= 0 and is_open}  # 3. forecast (closed: flags nothing)
        predicted = set().union(*predicted_of.values())
        issued = []
        for x in cand if is_open else []:  # 4. prefetch
            if x < 0 or x in resident:
                continue
            if budget is not None and len(issued) >= budget:
                break
            cands = [y for y in resident if y not in g and y not in inflight and y not in predicted
                     and y not in guarded]
            if not cands:
                break
            v = min(cands, key=recency.get)
            resident.remove(v)
            if v in fresh:
                out["wasted"] += 1
                fresh.discard(v)
            resident.add(x)
            inflight.add(x)
            inflight_of[layer].add(x)
            fresh.add(x)
            last[x] = gi
            guarded.add(x)
            issued.append(x)
            recency[x] = tick - 1 + len(issued) / (len(cand) + 1)
        out["prefetches"].append(len(issued))
        out["issued"].append(issued)
    return out


def test_nexttoken_policy_matches_brute_force():
    """nexttoken against the literal brute force on random streams: lists naming the layer's next
    group (each entry kept w.p. 0.95, in half the trials: lists the gate opens for) or mostly
    random ones (it stays closed), budgets, and gate units whose cap binds (0, 10, 1024) or not."""
    rng = np.random.default_rng(23)
    seen = {"prefetch": 0, "useful": 0, "wasted": 0, "predicted_victim": 0, "opened": 0}
    for trial in range(60):
        k = int(rng.integers(1, 4))
        n_layers = int(rng.integers(1, 4))
        groups, stream, profile, n_inst = random_stream(rng, n_layers=n_layers, n_experts=6, k=k,
                                                        dup=trial % 3 == 0, n_groups=int(rng.integers(30, 120)))
        E = stream.num_experts
        p = 0.95 if trial % 4 < 2 else 0.3  # the entries naming the layer's next group: a gate that opens, or not
        width = int(rng.integers(1, k + 1 if p > 0.5 else 6))  # (entries past k are random: wasted)
        layer = np.array([g[0] // E for g in groups])
        lists = layer[:, None] * E + rng.integers(0, E, size=(len(groups), width))
        for g in range(len(groups) - n_layers):
            right = groups[g + n_layers][:width]
            take = rng.random(len(right)) < p
            lists[g, :len(right)] = np.where(take, right, lists[g, :len(right)])
        lists = np.where(rng.random(lists.shape) < 0.2 * (1 - p), -1, lists)
        once_per_row(lists)
        cap = int(rng.integers(stream.max_group, n_inst + 1))
        budget = None if trial % 2 else int(rng.integers(0, 3))
        lead_unit = int(rng.choice([0, 10, 1024, 10**6]))
        res = simulate(stream, "nexttoken", cap, profile, predictions=lists, prefetch_budget=budget, lead_unit=lead_unit)
        ref = brute_force_nexttoken(groups, cap, profile, E, n_layers, lists.tolist(), budget, lead_unit)
        np.testing.assert_array_equal(res.hit, ref["hit"], err_msg=f"trial {trial} cap {cap}")
        np.testing.assert_array_equal(res.prefetches, ref["prefetches"], err_msg=f"trial {trial}")
        for g, want in enumerate(ref["issued"]):
            assert res.issued[g, :len(want)].tolist() == want and (res.issued[g, len(want):] == -1).all()
        assert res.useful_prefetches == ref["useful"] and res.wasted_prefetches == ref["wasted"]
        seen["prefetch"] += sum(ref["prefetches"])
        seen["useful"] += ref["useful"]
        seen["wasted"] += ref["wasted"]
        seen["opened"] += bool(sum(ref["prefetches"]))
    assert seen["prefetch"] > 50 and seen["useful"] > 20 and seen["wasted"] > 5  # the streams exercised it
    assert 10 <= seen["opened"] <= 50, seen  # the gate opened in some trials and stayed closed in others


def test_nexttoken_evicts_unpredicted_first_and_keeps_in_flight_slots():
    """1 layer x 4 experts, top-1, 2 slots warm with e0 (least used) and e1. Step 0 selects e2:
    miss; e0 is predicted (the previous list), so e1 goes although it is more recent. The list
    [e3] then prefetches e3 into the only unpredicted slot not used by the group... none: e2 is used,
    e0 is predicted by the old list? No: the new list [e3] replaces layer 0's flags, so e0 is free.
    Without the gate (which starts closed: tests/test_gate_rule.py), so that every list is issued
    and flags its entries."""
    stream = AccessStream(np.array([2, 3, 0]), np.array([0, 1, 2, 3]), 3, 1, 4)
    profile = np.array([[1.0, 2.0, 0.0, 0.0]])  # warm e1 (count 2) and e0 (count 1, first victim)
    # group 0's predicted flags come from no earlier list: every resident unpredicted -> lru victim e0
    lists = np.array([[3], [0], [-1]])
    res = simulate(stream, "nexttoken", 2, profile, predictions=lists, record_victims=True, prefetch_gate=False)
    # g0: e2 misses, victim e0 (least recent); list [e3] prefetches into e1's slot (e2 used by the group)
    # g1: e3 hits (committed), list [e0]: victims exclude e3 (predicted? no: the new list is [e0]) -> e2 goes
    # g2: e0 hits
    assert res.hit.tolist() == [False, True, True]
    assert res.victims.tolist() == [0, -1, -1]
    assert res.issued[:, 0].tolist() == [3, 0, -1] and res.useful_prefetches == 2 and res.wasted_prefetches == 0
    # with a predicted resident the demand miss takes the unpredicted one even when it is more recent
    stream = AccessStream(np.array([1, 2]), np.array([0, 1, 2]), 2, 1, 4)
    res = simulate(stream, "nexttoken", 2, profile, predictions=np.array([[0], [-1]]), record_victims=True,
                   prefetch_gate=False)
    # g0: e1 hits, list [e0] (resident: no copy) -> e0 predicted; g1: e2 misses: e0 predicted, e1 is
    # unpredicted (more recent than e0) -> e1 goes
    assert res.hit.tolist() == [True, False] and res.victims.tolist() == [-1, 1]
    lru = simulate(stream, "lru", 2, profile, record_victims=True)
    assert lru.victims.tolist() == [-1, 0]  # lru alone would have evicted e0


def test_tracked_cache_metrics_keep_the_first_batch_and_name_the_others(tmp_path):
    """simulation.csv with two batch sizes: MLflow's legacy cache_{policy}_{metric} names keep the
    smallest batch's (a later batch must not overwrite them), every batch is named b{batch}."""
    from coldset.reporting.track_runs import simulation_metrics as _cache_metrics

    rows = [{"policy": "lru", "residency": 0.5, "batch": b, "capacity": 8, "accesses": 10, "tokens": 5,
             "hit_rate": h, "misses_per_token": 1.0, "link_gb_per_token": 0.1, "prefetches_per_token": 0.0,
             "prefetch_precision": float("nan"), "step_ms": s, "bound_ms": 2.0, "bound_fraction": 2.0 / s,
             "overlap": float("nan"), "stall_ms_per_token": 0.5, "wasted_gb_per_token": 0.0}
            for b, h, s in ((1, 0.9, 3.0), (8, 0.7, 9.0))]
    pd.DataFrame(rows).to_csv(tmp_path / "simulation.csv", index=False)
    (m,) = _cache_metrics(tmp_path / "simulation.csv").values()
    assert m["cache_lru_hit_rate"] == 0.9 and m["cache_lru_b8_hit_rate"] == 0.7
    assert m["cache_lru_b1_step_ms"] == 3.0 and m["cache_lru_b8_step_ms"] == 9.0
    assert m["cache_lru_b8_overlap"] is None  # NaN (no link traffic) is not a number to log


def test_lru_copies_in_series_report_an_overlap_of_exactly_zero():
    """lru's copies are all demand copies, each queued at its group's decisions and waited for: the
    link time adds to the compute in series, so ``overlap`` is 0 by definition. The step's float sums
    round to +-1e-13 off it; the table prints 0, not float noise such as -8e-14."""
    rng = np.random.default_rng(3)
    steps, layers, experts, k = 300, 6, 32, 4
    sel = np.sort(np.stack([np.stack([rng.choice(experts, k, replace=False) for _ in range(layers)])
                            for _ in range(steps)]), axis=2)
    ids = (sel + (np.arange(layers) * experts)[None, :, None]).reshape(-1)
    stream = AccessStream(ids, np.arange(0, ids.size + 1, k), steps, layers, experts)
    result = simulate(stream, "lru", layers * experts // 3, np.ones((layers, experts)))
    assert result.stats().fills > 0
    for step_ms in (0.37, 1.3, 2.0, 7.7):
        stats = simulate_time(stream, result, TimeModel(step_ms=step_ms, bytes_per_expert=10_200_003, link_gb_s=51.3))
        assert stats.overlap == 0.0 and stats.step_ms > step_ms, step_ms
