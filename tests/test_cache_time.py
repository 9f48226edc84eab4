"""The time simulator (coldset.analysis.time_model.simulate_time) against cases computed by hand and a
brute-force reference that advances a clock one unit at a time."""

from __future__ import annotations

import numpy as np
import pytest

from coldset.analysis.simulate import simulate
from coldset.analysis.streams import AccessStream, CacheError
from coldset.analysis import time_model
from coldset.analysis.speed import compressed_fill_s
from coldset.analysis.time_model import TimeModel, simulate_time

# What a gated policy may cost beyond lru where its gate closes: the lists it fetched before the
# gate judged them. The recommendation allows nothing: a policy slower than lru is not recommended.
GATE_PROBE_SLACK = 0.02


def one_layer(experts, n_experts=4):
    """A stream of one MoE layer, top-1: one group (= one step) per entry."""
    ids = np.asarray(experts, dtype=np.int64)
    return AccessStream(ids, np.arange(ids.size + 1), ids.size, 1, n_experts)


# step 1 ms, no head, the layer's decisions at 0.5 ms; bytes / rate chosen for the copy time
def model(copy_ms, **kw):
    return TimeModel(step_ms=1.0, bytes_per_expert=int(copy_ms * 1e6), link_gb_s=1.0, head_share=0.0,
                     router_share=0.5, **kw)


PROFILE = np.array([[4.0, 3.0, 0.0, 0.0]])  # warm: e0 (one slot), e0 and e1 (two: e1 the first victim)


def test_one_miss_stalls_by_one_copy():
    stream = one_layer([0, 2, 0])  # one slot warm with e0; step 1 misses e2, step 2 misses e0
    res = simulate(stream, "lru", 1, PROFILE)
    assert res.hit.tolist() == [True, False, False]
    ts = simulate_time(stream, res, model(0.3))
    assert ts.step_ms == pytest.approx((3 * 1.0 + 2 * 0.3) / 3)
    assert ts.stall_ms_per_token == pytest.approx(0.6 / 3)
    assert ts.link_gb_per_token == pytest.approx(2 * 0.3e6 / 3 / 1e9)
    # in series: overlap 0; the bound is the compute (0.2 ms of link a step < 1 ms)
    assert ts.overlap == pytest.approx(0.0, abs=1e-12) and ts.bound_ms == 1.0
    assert ts.bound_fraction == pytest.approx(1.0 / ts.step_ms)


def test_prefetch_a_step_ahead_is_hidden_and_a_late_one_saves_part():
    stream = one_layer([0, 2])
    lists = np.array([[2], [-1]])  # after step 0 the forecast names e2
    # (the replays timed here run without the gate, which starts closed: the prefetch is what is timed)
    res = simulate(stream, "nexttoken", 2, PROFILE, predictions=lists, prefetch_gate=False)
    assert res.hit.tolist() == [True, True] and res.prefetches.tolist() == [1, 0]
    # issued at 0.5 ms, the decisions of step 1 at 1.5 ms: a copy of 0.8 ms lands at 1.3, hidden
    hidden = simulate_time(stream, res, model(0.8))
    assert hidden.step_ms == pytest.approx(1.0) and hidden.stall_ms_per_token == 0.0 and hidden.overlap == 1.0
    # a copy of 1.6 ms lands at 2.1: step 1 waits 0.6 ms (a miss would wait 1.6)
    late = simulate_time(stream, res, model(1.6))
    assert late.stall_ms_per_token == pytest.approx(0.6 / 2) and late.step_ms == pytest.approx(2.6 / 2)
    assert late.overlap == pytest.approx(1 - 0.3 / 0.8)
    miss = simulate_time(stream, simulate(stream, "lru", 2, PROFILE), model(1.6))
    assert miss.stall_ms_per_token == pytest.approx(1.6 / 2)


def test_demand_priority_passes_queued_prefetches():
    """Two slots warm with e0, e4. Step 0 prefetches e2 (into e4's slot); step 1 misses e1 while
    that prefetch still crosses: with priority its copy goes first, without it waits behind it."""
    stream = one_layer([0, 1], n_experts=5)
    profile = np.array([[4.0, 0.0, 0.0, 0.0, 3.0]])  # warm e0, e4
    lists = np.array([[2, 3], [-1, -1]])
    res = simulate(stream, "nexttoken", 2, profile, predictions=lists, prefetch_gate=False)
    # g0: e0 hits; e4 is the only victim not used: e2 prefetched into it; no slot left for e3
    assert res.hit.tolist() == [True, False] and res.issued[0].tolist() == [2, -1]
    # the prefetch (issued 0.5, copy 2.0 ms) crosses until 2.5; step 1 decides at 1.5 and misses e1
    pri = simulate_time(stream, res, model(2.0, link="priority"))
    fifo = simulate_time(stream, res, model(2.0, link="fifo"))
    share = simulate_time(stream, res, model(2.0, link="share", demand_share=0.8))
    # priority: e1's copy pauses the prefetch: 1.5 -> 3.5, stall 2.0; FIFO: behind it, 2.5 -> 4.5, stall 3.0
    assert pri.stall_ms_per_token == pytest.approx(2.0 / 2)
    assert fifo.stall_ms_per_token == pytest.approx(3.0 / 2)
    # share: at 1.5 the prefetch has 1.0 left; demand at 0.8 of the rate, prefetch at 0.2: the demand's
    # 2.0 lands at 1.5 + 2.0 / 0.8 = 4.0 (the prefetch would need until 6.5 at 0.2): stall 2.5
    assert share.stall_ms_per_token == pytest.approx(2.5 / 2)
    # and the prefetch, alone after 4.0 with 1.0 - 2.5 x 0.2 = 0.5 left, lands at 4.5: nobody waits for it
    assert share.step_ms == pytest.approx((2.0 + 2.5) / 2)


def test_join_step_waits_for_the_steps_copies():
    stream = one_layer([0, 2])
    res = simulate(stream, "nexttoken", 2, PROFILE, predictions=np.array([[2], [-1]]), prefetch_gate=False)
    # join at the step's end: step 0 ends at 1.0, the copy (0.8 from 0.5) lands at 1.3: 0.3 of stall
    ts = simulate_time(stream, res, model(0.8, join="step"))
    with pytest.raises(CacheError, match="link"):
        model(0.8, link="lifo")
    assert ts.stall_ms_per_token == pytest.approx(0.3 / 2)
    with pytest.raises(CacheError, match="join"):
        model(0.8, join="later")


# ---------------------------------------------------------------------------------------------
# brute force: a clock that advances one unit at a time; the link serves one unit per tick


def brute_time(stream, res, pre, post, head, copy, priority, join_step, fill=None, decode=0):
    """``fill`` (None: the raw tier) the link units of a slot fill from the compressed tier (admitted
    demand misses: ``res.victims >= 0``; every prefetch) and ``decode`` its decode's units: the
    decoder takes the landed fills one at a time in landing order, a unit a tick."""
    ids, ptr = stream.instances.tolist(), stream.group_ptr.tolist()
    E = stream.num_experts
    issued = res.issued if res.issued is not None else np.zeros((stream.num_groups, 0), np.int64)
    compressed = fill is not None
    copies = []  # [link units left, kind, usable at, decode units left]
    decoding = []  # landed fills in landing order
    latest = {}
    t = stall = 0

    def tick():
        nonlocal t
        if decoding:  # the decoder works on a fill landed before this tick
            decoding[0][3] -= 1
            if decoding[0][3] == 0:
                decoding.pop(0)[2] = t + 1
        queue = [c for c in copies if c[0] > 0]
        if queue:
            first = next((c for c in queue if c[1] == "demand"), queue[0]) if priority else queue[0]
            first[0] -= 1
            if first[0] == 0:
                if first[3]:
                    decoding.append(first)
                else:
                    first[2] = t + 1
        t += 1

    def wait_for(cs):  # the clock runs until every copy in cs is usable, a stall
        nonlocal stall
        while any(c[2] is None for c in cs):
            tick()
            stall += 1

    def end_step():  # with join_step every copy issued so far is waited for, then the head
        if join_step:
            wait_for(copies)
        for _ in range(head):
            tick()

    prev_layer = None
    for g in range(stream.num_groups):
        sel = ids[ptr[g]:ptr[g + 1]]
        hits = res.hit[ptr[g]:ptr[g + 1]].tolist()
        layer = sel[0] // E
        if prev_layer is not None and layer <= prev_layer:  # a step ends
            end_step()
        prev_layer = layer
        for _ in range(pre):
            tick()
        seen = set()
        for i, (x, h) in enumerate(zip(sel, hits)):
            if not h and x not in seen:
                seen.add(x)
                admitted = compressed and res.victims[ptr[g] + i] >= 0
                latest[x] = [fill, "demand", None, decode] if admitted else [copy, "demand", None, 0]
                copies.append(latest[x])
        waiting = [latest[x] for x in sel if x in latest]
        for x in issued[g]:
            if x >= 0:
                latest[int(x)] = [fill, "prefetch", None, decode] if compressed else [copy, "prefetch", None, 0]
                copies.append(latest[int(x)])
        wait_for(waiting)
        for _ in range(post):
            tick()
    end_step()
    return t, stall


def random_stream(rng, L=2, E=5):
    """A random stream of ``L`` layers (top-1 or top-2, 2-11 steps) with its profile and random
    own-layer lists."""
    k = int(rng.integers(1, 3))
    steps = int(rng.integers(2, 12))
    groups = [[int(layer * E + e) for e in rng.choice(E, size=k, replace=False)]
              for _ in range(steps) for layer in range(L)]
    stream = AccessStream(np.array([x for g in groups for x in g]), np.r_[0, np.cumsum([k] * len(groups))],
                          steps, L, E)
    profile = rng.integers(0, 4, size=(L, E)).astype(float)
    lists = np.array([[g[0] // E * E + int(e) for e in rng.permutation(E)[:3]] for g in groups])
    return stream, profile, lists, k


@pytest.mark.parametrize("priority", [True, False])
@pytest.mark.parametrize("join", ["use", "step"])
def test_time_matches_the_unit_clock(priority, join):
    """Random streams of 2 layers (1 ms = 1 unit: pre 2, post 3, head 10, copy 1-9 units), lru,
    static and nexttoken with random lists, against the unit clock."""
    rng = np.random.default_rng(5 + priority + 2 * (join == "step"))
    seen_stall = 0
    for trial in range(30):
        stream, profile, lists, k = random_stream(rng)
        L, E, steps = stream.num_moe_layers, stream.num_experts, stream.tokens
        copy = int(rng.integers(1, 10))
        tm = TimeModel(step_ms=20.0, bytes_per_expert=copy * 10**6, link_gb_s=1.0, head_share=0.5, router_share=0.4,
                       link="priority" if priority else "fifo", join=join)
        for policy in ("static", "lru", "nexttoken"):
            cap = int(rng.integers(k, L * E))
            res = simulate(stream, policy, cap, profile, predictions=lists if policy == "nexttoken" else None)
            ts = simulate_time(stream, res, tm)
            t, stall = brute_time(stream, res, 2, 3, 10, copy, priority, join == "step")
            assert ts.step_ms == pytest.approx(t / steps, abs=1e-9), (trial, policy)
            assert ts.stall_ms_per_token == pytest.approx(stall / steps, abs=1e-9), (trial, policy)
            seen_stall += stall
    assert seen_stall > 0


def test_reproduces_the_issue_engine_figures_from_their_counts():
    """issue 28's H200 run, lru-0.5 b1: 0.169 GB a token over the link (17.9 expert copies), every
    copy a demand fill (lru prefetches nothing), all-HBM step 2.56 ms, measured 6.07 ms. Here a
    stream with 18 cold reads a token (static, so the counts are fixed by construction): the
    simulator puts the copies in series with the compute, as the engine does (overlap -0.06
    measured): 2.56 + 18 x 0.185 = 5.89 ms, within 3% of the engine's 6.07."""
    per_expert = 9_437_184  # Qwen3-30B-A3B: 3 x 2048 x 768 bf16
    fills = round(0.169e9 / per_expert)  # 18
    L, E, steps = 48, 128, 20
    warm = np.zeros((L, E))
    warm[:, :8] = 1.0  # the warm set: experts 0..7 of every layer
    groups = [[layer * E + 8] + [layer * E + e for e in range(7)] if layer < fills else
              [layer * E + e for e in range(8)] for _ in range(steps) for layer in range(L)]
    stream = AccessStream(np.array([x for g in groups for x in g]), np.arange(len(groups) + 1) * 8, steps, L, E)
    res = simulate(stream, "static", L * 8, warm)
    assert res.stats().fills == fills * steps
    ts = simulate_time(stream, res, TimeModel(2.56, per_expert, 51.0))
    assert ts.link_gb_per_token == pytest.approx(fills * per_expert / 1e9)
    assert ts.step_ms == pytest.approx(2.56 + fills * per_expert / 51e9 * 1e3)
    assert abs(ts.step_ms / 6.07 - 1) < 0.04 and ts.overlap == pytest.approx(0.0, abs=1e-9)


def test_management_per_group_adds_to_every_group_and_delays_the_copies():
    """manage_ms: the cache's own work at each group's decisions. All hits: the step grows by it
    per group, as the engine's residency-1.0 step does; manage_ms_per_group recovers it from the
    two steps. A miss: its copy is issued after the decisions, so it lands manage_ms later."""
    from coldset.analysis.time_model import manage_ms_per_group

    hits = one_layer([0, 0, 0])
    res = simulate(hits, "lru", 1, PROFILE)
    assert res.hit.all()
    plain, managed = simulate_time(hits, res, model(0.3)), simulate_time(hits, res, model(0.3, manage_ms=0.25))
    assert plain.step_ms == pytest.approx(1.0) and managed.step_ms == pytest.approx(1.25)
    assert manage_ms_per_group(managed.step_ms, plain.step_ms, 1) == pytest.approx(0.25)
    assert manage_ms_per_group(0.9, 1.0, 4) == 0.0  # a residency-1.0 step faster than all-HBM: noise, not credit
    miss = one_layer([2])
    res = simulate(miss, "lru", 1, PROFILE)
    # decisions at 0.5 + 0.25, the copy lands at 1.05, the experts' 0.5 ms follow
    assert simulate_time(miss, res, model(0.3, manage_ms=0.25)).step_ms == pytest.approx(1.55)
    with pytest.raises(CacheError, match="manage_ms"):
        model(0.3, manage_ms=-0.1)
    with pytest.raises(CacheError, match="manage_ms_per_group"):
        manage_ms_per_group(1.0, 0.0, 4)


def test_time_models_carry_each_policys_management():
    """cache.time.steps[].manage_us: per batch, each policy's model has its own manage_ms (µs in
    the config), the others none; a policy name the simulator does not know is refused by name;
    simulation_table times each policy with its own model."""
    from coldset.analysis.cache import simulation_table
    from coldset.analysis.policies import POLICIES
    from coldset.analysis.time_model import time_models

    cfg = {"steps": [{"batch": 1, "all_hbm_step_ms": 1.0, "manage_us": {"nexttoken": 250.0}},
                     {"batch": 2, "all_hbm_step_ms": 2.0}], "head_share": 0.0, "router_share": 0.5}
    models = time_models(cfg, 300_000)
    assert set(models) == {1, 2} and set(models[1]) == set(POLICIES)
    assert models[1]["nexttoken"].manage_ms == pytest.approx(0.25)
    assert all(m.manage_ms == 0.0 for p, m in models[1].items() if p != "nexttoken")
    assert all(m.manage_ms == 0.0 and m.step_ms == 2.0 for m in models[2].values())
    with pytest.raises(CacheError, match="lookahead"):
        time_models({"steps": [{"batch": 1, "all_hbm_step_ms": 1.0, "manage_us": {"lookahead": 1.0}}]}, 300_000)
    stream = one_layer([0, 0, 2])
    from dataclasses import replace

    per_policy = {**models[1], "lru": replace(models[1]["lru"], manage_ms=0.1)}
    table = simulation_table(stream, PROFILE, ["static", "lru"], [0.25], 300_000, time_model=per_policy)
    for p in ("static", "lru"):
        res = simulate(stream, p, 1, PROFILE)
        want = simulate_time(stream, res, per_policy[p]).step_ms
        assert table.loc[table.policy == p, "step_ms"].item() == pytest.approx(want)
    assert table.loc[table.policy == "lru", "step_ms"].item() == pytest.approx(
        simulate_time(stream, simulate(stream, "lru", 1, PROFILE), models[1]["lru"]).step_ms + 0.1)


# ---------------------------------------------------------------------------------------------
# the prefetch gate on synthetic routing: useless prefetching turned off, useful kept


def _routing(kind: str, seed: int, requests: int = 24, length: int = 40, L: int = 4, E: int = 16, k: int = 2):
    """Decode tokens ``[T, L, k]`` and their request numbers: ``uniform`` (every token's experts
    drawn at random: nothing to forecast) or ``successor`` (a request's first token at random, each
    next token's experts those of the token before plus one, mod E: a forecast of the current token
    alone is exact, and consecutive tokens share no expert, so lru misses)."""
    rng = np.random.default_rng(seed)
    toks = []
    for _ in range(requests):
        first = np.stack([rng.choice(E, size=k, replace=False) for _ in range(L)])
        for t in range(length):
            toks.append(first + t if kind == "successor" else
                        np.stack([rng.choice(E, size=k, replace=False) for _ in range(L)]))
    tokens = np.stack(toks) % E
    return tokens.astype(np.int64), np.repeat(np.arange(requests), length)


def _frame(tokens, seq):
    import pandas as pd

    T, L, k = tokens.shape
    pos = np.concatenate([np.arange((seq == s).sum()) for s in np.unique(seq)])
    return pd.DataFrame({"request": np.repeat([f"r{s:03d}" for s in seq], L * k), "position": np.repeat(pos, L * k),
                         "layer_index": np.tile(np.repeat(np.arange(L), k), T), "rank": np.tile(np.arange(k), T * L),
                         "expert": tokens.reshape(-1)})




@pytest.mark.parametrize("kind", ["uniform", "successor"])
def test_gated_prefetch_is_off_where_useless_and_on_where_it_helps(kind):
    """Profile = the first half of the requests (the forecasters fitted there), replay = the other
    half at batch 1 and 2, residency 0.5, the time model's link and compute terms setting the gate.
    Uniform routing: the gate closes (fewer copies than two steps' lists), and no policy is slower
    than lru by more than ``GATE_PROBE_SLACK``. Successor routing: the gate stays open, most
    prefetches are useful and the prefetching policies are faster than lru by a tenth or more."""
    from coldset.analysis.cache import simulation_table
    from coldset.analysis.forecast import NextTokenForecaster, TransitionForecaster
    from coldset.analysis.streams import counts_from_rows, lanes_from_tokens

    L, E, k = 4, 16, 2
    tokens, seq = _routing(kind, seed=5)
    prof, held = seq < 12, seq >= 12
    frame = _frame(tokens[prof], seq[prof])
    counts = counts_from_rows(frame, L, E)
    transition = TransitionForecaster.fit(frame, L, E, k)
    nexttoken = NextTokenForecaster.fit_tuned(tokens[prof], seq[prof], k, E, extra=1)
    for batch in (1, 2):
        lanes = lanes_from_tokens(tokens[held], seq[held], E, batch)
        stream = lanes.stream()
        model = TimeModel(step_ms=2.0 * batch ** 0.5, bytes_per_expert=10_200_000, link_gb_s=51.0)
        assert model.lead_unit(L) >= 1024  # a list a step ahead hides its copies
        table = simulation_table(stream, counts, ["lru", "lru_guard", "forecast", "nexttoken"], [0.5],
                                 10_200_000, transition, lanes=lanes, nexttoken=nexttoken, time_model=model,
                                 batch=batch).set_index("policy")
        lru = table.loc["lru", "step_ms"]
        for policy in ("forecast", "nexttoken"):
            issued = table.loc[policy, "prefetches_per_token"] * stream.tokens
            if kind == "uniform":
                assert issued <= 2 * L * batch * nexttoken.num_predictions, (policy, batch, issued)
                assert table.loc[policy, "step_ms"] <= lru * (1 + GATE_PROBE_SLACK), (policy, batch)
            else:
                assert issued >= 0.5 * stream.tokens * L * k, (policy, batch, issued)
                assert table.loc[policy, "prefetch_precision"] > 0.6, (policy, batch)
                assert table.loc[policy, "step_ms"] < 0.9 * lru, (policy, batch)
        assert table.loc["lru_guard", "step_ms"] <= lru * (1 + GATE_PROBE_SLACK)


def test_recommendation_is_by_simulated_time_and_never_slower_than_lru_on_the_heldout_split():
    """Hand-made tables: the policy chosen on the validation table is kept where its held-out step
    is lru's or faster, replaced by lru, saying so, where it is slower at all (a thousandth);
    belady (the offline bound) is never chosen; the hit rate plays no part; no time columns: no rows."""
    import pandas as pd

    from coldset.analysis.cache import recommendation

    def table(steps, hits=None):
        return pd.DataFrame([{"batch": b, "residency": r, "policy": p, "step_ms": s,
                              "hit_rate": (hits or {}).get(p, 0.5)} for (b, r, p), s in steps.items()])

    held = table({(1, 0.5, "lru"): 10.0, (1, 0.5, "nexttoken"): 12.0, (1, 0.5, "belady"): 5.0,
                  (1, 0.5, "forecast"): 9.0, (8, 0.5, "lru"): 20.0, (8, 0.5, "nexttoken"): 18.0,
                  (8, 0.5, "belady"): 1.0, (8, 0.5, "forecast"): 20.02, (4, 0.5, "lru"): 20.0, (4, 0.5, "forecast"): 19.0},
                 hits={"nexttoken": 0.99})
    choice = table({(1, 0.5, "lru"): 10.0, (1, 0.5, "nexttoken"): 7.0, (1, 0.5, "belady"): 1.0,
                    (1, 0.5, "forecast"): 8.0, (8, 0.5, "lru"): 20.0, (8, 0.5, "nexttoken"): 21.0,
                    (8, 0.5, "belady"): 1.0, (8, 0.5, "forecast"): 19.0, (4, 0.5, "lru"): 20.0,
                    (4, 0.5, "forecast"): 19.0})
    rec = recommendation(held, choice).set_index("batch")
    assert rec.loc[1, "chosen"] == "nexttoken" and rec.loc[1, "policy"] == "lru"
    assert "slower than lru on the held-out split" in rec.loc[1, "verdict"] and rec.loc[1, "vs_lru"] == 1.0
    assert rec.loc[8, "chosen"] == "forecast" and rec.loc[8, "policy"] == "lru" and rec.loc[8, "vs_lru"] == 1.0
    assert "forecast slower than lru on the held-out split (1.0010x)" in rec.loc[8, "verdict"]
    assert rec.loc[4, "chosen"] == rec.loc[4, "policy"] == "forecast" and rec.loc[4, "verdict"] == "faster than lru"
    assert (rec.chosen_on == "validation").all()
    own = recommendation(held).set_index("batch")  # chosen on the held-out table itself: never slower than lru
    assert own.loc[1, "policy"] == "forecast" and own.loc[8, "policy"] == "nexttoken"
    assert (own.chosen_on == "heldout").all() and (own.vs_lru <= 1).all()
    assert recommendation(held.assign(step_ms=float("nan"))).empty


# ---------------------------------------------------------------------------------------------
# the compressed host tier: fills cross as compressed records and are decoded before use


@pytest.mark.parametrize("priority", [True, False])
@pytest.mark.parametrize("join", ["use", "step"])
def test_compressed_fills_match_the_unit_clock(priority, join):
    """Random streams (as above): fills (admitted misses, prefetches) cross in ``fill`` units and are
    decoded in ``decode`` units one at a time; reads in place stay ``copy`` units; against the unit
    clock, with lru_guard and nexttoken reading some misses in place."""
    rng = np.random.default_rng(11 + priority + 2 * (join == "step"))
    seen = {"decode_wait": 0, "in_place": 0}
    for trial in range(30):
        stream, profile, lists, k = random_stream(rng)
        L, E, steps = stream.num_moe_layers, stream.num_experts, stream.tokens
        copy, fill, decode = int(rng.integers(2, 10)), int(rng.integers(1, 6)), int(rng.integers(1, 8))
        tm = TimeModel(step_ms=20.0, bytes_per_expert=copy * 10**6, link_gb_s=1.0, head_share=0.5, router_share=0.4,
                       link="priority" if priority else "fifo", join=join, compressed_ratio=fill / copy,
                       decode_gb_s=copy / decode)
        raw = TimeModel(step_ms=20.0, bytes_per_expert=copy * 10**6, link_gb_s=1.0, head_share=0.5,
                        router_share=0.4, link="priority" if priority else "fifo", join=join)
        for policy in ("static", "lru", "lru_guard", "nexttoken"):
            cap = int(rng.integers(k, L * E))
            res = simulate(stream, policy, cap, profile, predictions=lists if policy == "nexttoken" else None,
                           record_victims=True)
            ts = simulate_time(stream, res, tm)
            t, stall = brute_time(stream, res, 2, 3, 10, copy, priority, join == "step", fill=fill, decode=decode)
            assert ts.step_ms == pytest.approx(t / steps, abs=1e-9), (trial, policy)
            assert ts.stall_ms_per_token == pytest.approx(stall / steps, abs=1e-9), (trial, policy)
            st = res.stats()
            in_place = st.fills - int((res.victims >= 0).sum())
            decoded = st.fills + st.prefetches - in_place
            assert ts.link_gb_per_token == pytest.approx((in_place * copy + decoded * fill) * 1e6 / steps / 1e9)
            assert ts.bound_ms == pytest.approx(max(20.0, (in_place * copy + decoded * fill) / steps,
                                                    decoded * decode / steps))
            if policy == "static":  # every cold read in place: the raw tier's time
                assert ts.step_ms == simulate_time(stream, res, raw).step_ms
            seen["in_place"] += in_place * (policy != "static")
            t_raw, _ = brute_time(stream, res, 2, 3, 10, fill, priority, join == "step")
            seen["decode_wait"] += t > t_raw  # the decode delays a use where it could
    assert seen["in_place"] > 0 and seen["decode_wait"] > 0


def test_a_groups_compressed_fills_take_the_speed_models_time():
    """One group missing 3 experts from the compressed tier: its experts start when the speed model's
    ``compressed_fill_s`` (records back to back, each decode after its copy and the previous decode)
    says the last is decoded; with a slow decoder the decodes set the pace."""
    stream = AccessStream(np.array([0, 1, 2, 3, 4, 5]), np.array([0, 3, 6]), 2, 1, 8)
    profile = np.array([[9.0, 9.0, 9.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    res = simulate(stream, "lru", 3, profile, record_victims=True)
    assert res.hit.tolist() == [True] * 3 + [False] * 3
    nbytes, link, ratio = 4 * 10**6, 2.0, 0.6
    for decode_gb_s in (8.0, 1.0):
        tm = TimeModel(step_ms=1.0, bytes_per_expert=nbytes, link_gb_s=link, head_share=0.0, router_share=0.5,
                       compressed_ratio=ratio, decode_gb_s=decode_gb_s)
        want_ms = compressed_fill_s([nbytes] * 3, [ratio] * 3, link, decode_gb_s) * 1e3
        ts = simulate_time(stream, res, tm)
        assert ts.stall_ms_per_token == pytest.approx(want_ms / 2)
        assert ts.link_gb_per_token == pytest.approx(3 * ratio * nbytes / 2 / 1e9)
    with pytest.raises(CacheError, match="victims"):
        simulate_time(stream, simulate(stream, "lru", 3, profile), tm)
    with pytest.raises(CacheError, match="together"):
        TimeModel(step_ms=1.0, bytes_per_expert=nbytes, compressed_ratio=0.5)


@pytest.mark.parametrize("slots", [1, 2, 8])
def test_the_link_rings_grow_and_wrap_without_changing_a_time(monkeypatch, slots):
    """The link's queues start at ``slots`` entries and double: on a stream whose queues wrap and
    grow many times (a slow link, many prefetches, the compressed tier too), every figure equals the
    one with rings larger than any queue."""
    rng = np.random.default_rng(3)
    L, E, k, steps = 3, 16, 2, 60
    sel = np.stack([rng.choice(E, size=k, replace=False) for _ in range(steps * L)]).reshape(steps, L, k)
    ids = (sel + (np.arange(L) * E)[None, :, None]).reshape(-1)
    stream = AccessStream(ids, np.arange(0, ids.size + 1, k), steps, L, E)
    lists = np.array([[int(ids[g * k]) // E * E + int(e) for e in rng.permutation(E)[:6]]
                      for g in range(stream.num_groups)])
    res = simulate(stream, "nexttoken", 2 * L * k, rng.random((L, E)), predictions=lists, record_victims=True,
                   prefetch_gate=False)
    assert res.stats().prefetches > 4 * slots
    models = [model(2.5, link=link, join=join, **tier) for link in ("fifo", "priority", "share")
              for join in ("use", "step") for tier in ({}, {"compressed_ratio": 0.5, "decode_gb_s": 0.2})]
    wide = [simulate_time(stream, res, m) for m in models]
    monkeypatch.setattr(time_model, "QUEUE_SLOTS", slots)
    assert [simulate_time(stream, res, m) for m in models] == wide


def test_the_config_names_a_ratio_per_format():
    """cache.compressed_tier: None is the raw tier; the experts' format picks its ratio (aliases
    allowed), the measured defaults without ratios; a format without a ratio, a missing decode rate
    or an unknown key is refused by name."""
    assert time_model.compressed_tier(None, "bfloat16") is None
    assert time_model.compressed_tier({"decode_gb_s": 200}, "bf16") == (0.6757, 200.0)
    spec = {"decode_gb_s": 100.0, "ratios": {"fp8_block128": 0.8, "bf16": 0.7}}
    assert time_model.compressed_tier(spec, "fp8_block128") == (0.8, 100.0)
    assert time_model.compressed_tier(spec, "bfloat16") == (0.7, 100.0)
    with pytest.raises(CacheError, match="'mxfp4'"):
        time_model.compressed_tier(spec, "mxfp4")
    with pytest.raises(CacheError, match="decode_gb_s"):
        time_model.compressed_tier({"ratios": {"bf16": 0.7}}, "bf16")
    with pytest.raises(CacheError, match="decode_gbs"):
        time_model.compressed_tier({"decode_gbs": 1.0}, "bf16")
    m = time_model.with_compressed_tier(model(2.0), (0.5, 4.0))
    assert m.fill_ms == pytest.approx(1.0) and m.decode_ms == pytest.approx(2.0e6 / 4e9 * 1e3)
    assert model(2.0).fill_ms == model(2.0).copy_ms and model(2.0).decode_ms == 0.0
