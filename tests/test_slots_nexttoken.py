"""The engine's ``nexttoken`` cache (coldset.engine.cache.nexttoken): the forecast of each layer's
experts for the next token, prefetched beside the step, against the simulator's ``nexttoken`` and
coldset.analysis.forecast.nexttoken_lists, and its parity with the unmodified path; the FP8 slot
fills of every policy."""

import os

import numpy as np
import pytest
import torch

from coldset.verify import gate
from coldset.engine.generate import generate
from coldset.analysis.placement import hot_count_for_residency
from coldset.engine.cache.pool import SlotCache
from coldset.engine.cache.policy import EMPTY_SLOT
from coldset.kernels.tiers import ExpertPools, host_tier
from test_slots import _graphed_cache, _random_pools, _warm, state
from test_slots import engine, graphed_model  # noqa: F401 (pytest fixtures)


def _forecaster(L, E, k, seed, terms=((0, 0), (1, 0), (0, 1), (1, -1)), extra=3, unit=40, shift=2, keep=0, succ=0):
    """A next-token forecaster with random integer tables (the rules, not the fit, are under test):
    terms reading this token's layer, the layer before, the last token's same and next layer;
    ``keep`` added on the first term's diagonal (the next token keeps this one's experts), ``succ``
    at (e, e + 1 mod E) (the next token takes each expert's successor)."""
    from coldset.analysis.forecast import NextTokenForecaster

    rng = np.random.default_rng(seed)
    terms = tuple((a, d) for a, d in terms if abs(d) < L)
    tables = rng.integers(0, 60, size=(len(terms), L, E, E)).astype(np.int32)
    tables[0][:, np.arange(E), np.arange(E)] += keep
    tables[0][:, np.arange(E), (np.arange(E) + 1) % E] += succ
    return NextTokenForecaster(terms, tables, unit, shift, k, extra)


def _next_reference(sel, forecaster, budget):
    """Per group (hits, misses, fills, prefetches) and the candidate list of the engine's groups
    ``sel`` ``[S, L, T, k]`` (lanes started at step 0) by coldset.analysis.forecast / coldset.analysis.cache's
    ``nexttoken`` (the simulator: the engine's reference)."""
    from coldset.analysis.streams import Lanes
    from coldset.analysis.forecast import nexttoken_lists

    S, L, T, k = sel.shape
    start = np.zeros((S, T), dtype=bool)
    start[0] = True
    lanes = Lanes(sel, start, forecaster.num_experts)
    return lanes.stream(), nexttoken_lists(forecaster, sel, start)


def _next_history(cache):
    n = int(cache.groups)
    return np.concatenate([cache.group_history(), cache.prefetch_counts()[:, None]], axis=1)[:n]


def _sim_next(stream, counts, C, lists, budget, gate=True):
    from coldset.analysis.simulate import simulate

    sim = simulate(stream, "nexttoken", C, counts, predictions=lists, prefetch_budget=budget, prefetch_gate=gate)
    return sim, np.stack([sim.hits, sim.misses, sim.fills, sim.prefetches], axis=1)


@pytest.mark.parametrize("tokens,budget,skew", [(1, None, 0.5), (3, None, 0.5), (2, 2, 0.5), (2, None, None)])
def test_nexttoken_decisions_equal_the_simulator_on_random_streams(tokens, budget, skew):
    """Random groups and tables, pools from one group's size up (the in-flight rule, the read in
    place of a miss without a free slot, predicted victims and a cut list all occur): the engine's
    candidate list of every group is coldset.analysis.forecast.nexttoken_lists' (the forecast, computed
    independently), its per-group hits, misses, fills and prefetches are coldset.analysis.simulate.simulate's
    'nexttoken' on the same tokens, no commit is refused, and every slot holds its owner. The
    tables favour each expert's successor (``succ``) and a token takes its lane's last experts'
    successors w.p. 0.8 (else skewed draws), so the forecast names experts not resident and the
    prefetch gate (closed at first) opens; with ``skew`` None the draws turn uniform after a quarter (the
    forecast becomes useless), which closes the gate again, after which the engine issues
    nothing, as the simulator."""
    L, E, k = 3, 8, 2
    rng = np.random.default_rng(tokens * 10 + (budget or 0))
    F = _forecaster(L, E, k, seed=tokens, extra=1, succ=1000)
    prefetched = read_in_place = closed = 0
    for trial in range(5):
        counts = rng.integers(0, 9, size=(L, E)).astype(np.float64)
        C = int(rng.integers(k * tokens, k * tokens + 10))
        row_map, _, wc = _warm(counts, C)
        all_hot = _random_pools(L, E, seed=trial)
        cache = SlotCache.build(all_hot, host_tier(all_hot), row_map, wc, "nexttoken", tokens, k, forecaster=F,
                                prefetch_budget=budget)
        S = 40
        # skewed draws: consecutive tokens reuse experts, so forecasts hit (skew None: uniform after S / 4)
        p = rng.dirichlet(np.ones(E) * (skew or 0.5), size=L)
        uniform = np.full((L, E), 1 / E)
        sel = np.stack([[[rng.choice(E, size=k, replace=False, p=(p if skew or s < S // 4 else uniform)[layer])
                          for _ in range(tokens)] for layer in range(L)] for s in range(S)])
        for s in range(1, S if skew else S // 4):  # the successors of the lane's last experts
            succ = rng.random((L, tokens)) < 0.8
            sel[s][succ] = (sel[s - 1][succ] + 1) % E
        for s in range(S):
            for layer in range(L):
                cache.admit(layer, torch.as_tensor(sel[s, layer]))
        cache.end_step()
        stream, lists = _next_reference(sel, F, budget)
        np.testing.assert_array_equal(cache.prefetch_lists(), lists, err_msg=f"trial {trial}: forecast lists")
        sim, want = _sim_next(stream, counts, C, lists, budget)
        np.testing.assert_array_equal(_next_history(cache), want, err_msg=f"trial {trial}, C {C}")
        assert cache.counters()["stale"] == 0
        cache.check(contents=True)
        prefetched += int(sim.prefetches.sum())
        read_in_place += int((sim.fills > 0).sum())
        if budget is not None:
            assert sim.prefetches.max() <= budget
        acc = cache.rules.gate_acc.tolist()
        closed += not min(acc[2], 64 * cache.rules.lead_unit) > acc[0] - acc[1] + acc[0] // 32
    assert prefetched > 10 and sim.useful_prefetches >= 0
    if skew is None:
        assert closed >= 3  # the gate closed on useless forecasts


def test_nexttoken_in_flight_and_predicted_slots_are_kept():
    """Hand-checked, 2 layers x 4 experts, top-1, 1 token, 3 slots warm with (0,0) (0,1) (1,0)
    (counts 5, 6, 7). Tables: after expert e every layer forecasts e + 1 (mod 4) first, then e.
    Step 0: layer 0 selects 0 (hit); forecast [1, 0, 2, 3][:n=2] = [(0,1), (0,0)]: both resident,
    no prefetch. Layer 1 selects 2 (miss): demand victims exclude the predicted (0,0) (0,1), so
    (1,0) goes; forecast [(1,3), (1,2)]: (1,3) missing, every other slot is predicted or used: no
    victim, nothing issued. Step 1: layer 0 selects 1 (hit), forecast [(0,2), (0,1)]: (0,0) is no
    longer predicted and becomes the victim of (0,2), in flight; layer 1 selects 3: a miss whose
    candidates are all predicted ((0,1), (1,2)) or in flight ((0,2)): the least recent predicted one,
    (1,2), goes; forecast [(1,0), (1,3)]: no unpredicted, unused slot out of flight, nothing issued.
    Without the gate (closed at first: tests/test_gate_rule.py), so that every list is issued and
    flags its entries."""
    from coldset.analysis.forecast import NextTokenForecaster

    L, E, k = 2, 4, 1
    tables = np.zeros((1, L, E, E), dtype=np.int32)
    for e in range(E):
        tables[0, :, e, (e + 1) % E] = 10
        tables[0, :, e, e] = 5
    F = NextTokenForecaster(((0, 0),), tables, 0, 1, k, extra=1)
    counts = np.array([[5.0, 6, 0, 0], [7, 0, 0, 0]])
    row_map, _, wc = _warm(counts, 3)
    all_hot = _random_pools(L, E)
    cache = SlotCache.build(all_hot, host_tier(all_hot), row_map, wc, "nexttoken", 1, k, forecaster=F,
                            prefetch_gate=False)
    sel = np.array([[[[0]], [[2]]], [[[1]], [[3]]]])
    for s in range(2):
        for layer in range(L):
            cache.admit(layer, torch.as_tensor(sel[s, layer]))
    assert cache.prefetch_lists().tolist() == [[1, 0], [7, 6], [2, 1], [4, 7]]
    np.testing.assert_array_equal(_next_history(cache), [[1, 0, 0, 0], [0, 1, 1, 0], [1, 0, 0, 1], [0, 1, 1, 0]])
    cache.end_step()
    rm = cache.pools.row_map
    assert [int(rm[0, e]) >= 0 for e in range(E)] == [False, True, True, False]
    assert [int(rm[1, e]) >= 0 for e in range(E)] == [False, False, False, True]
    stream, lists = _next_reference(sel, F, None)
    np.testing.assert_array_equal(cache.prefetch_lists(), lists)
    np.testing.assert_array_equal(_next_history(cache), _sim_next(stream, counts, 3, lists, None, gate=False)[1])
    cache.check(contents=True)


def _next_engine_run(engine, batch, residency, prompts, new_tokens=10, sabotage=None):
    """Decode ``prompts`` at ``batch`` through a nexttoken cache and the unmodified path: (cache,
    logits, reference logits, routing [S, L, B, k], counts, C, forecaster)."""
    cfg = engine.config
    L, E, k = cfg.num_moe_layers, cfg.num_experts, cfg.top_k
    counts = np.random.default_rng(7).integers(0, 20, size=(L, E)).astype(np.float64)
    C = hot_count_for_residency(residency, L * E)
    row_map, _, wc = _warm(counts, C)
    F = _forecaster(L, E, k, seed=batch, keep=200, extra=1)
    # random tables forecast poorly: without the gate, so that the prefetch itself is under test
    cache = SlotCache.build(engine.pools, host_tier(engine.pools), row_map, wc, "nexttoken", batch, k, forecaster=F,
                            prefetch_gate=False)
    if sabotage is not None:
        sabotage(cache)
    ref_fn, rowmap_fn, _ = gate.experts_functions(engine.device)
    saved = engine.pools, engine.experts_fn
    try:
        engine.pools, engine.experts_fn = cache.pools, cache.wrap(rowmap_fn)
        gen = generate(engine, prompts, new_tokens, capture_routing=True, progress=False, return_all_logits=True)
        engine.pools, engine.experts_fn = saved[0], ref_fn
        ref = generate(engine, prompts, new_tokens, progress=False, return_all_logits=True)
    finally:
        engine.pools, engine.experts_fn = saved
    plen = len(prompts[0])
    routing = np.stack([r.experts[plen:].numpy() for r in gen.routing], axis=2)  # [S, L, B, k]
    return cache, gen.all_logits, ref.all_logits, routing.astype(np.int64), counts, C, F


@pytest.mark.parametrize("batch", [1, 2])
def test_nexttoken_engine_equals_the_simulator_and_the_unmodified_path(engine, batch):
    """The CPU engine decoding through a nexttoken cache (decisions after each layer's router,
    prefetched rows committed at the step's end): logits bitwise the unmodified path's; the
    forecast lists and per-group counts equal coldset.analysis.forecast / coldset.analysis.cache on the engine's own
    routing; prefetches issued and used."""
    prompts = np.random.default_rng(5).integers(0, engine.config.vocab_size, size=(batch, 8)).tolist()
    # batch 2 on a larger pool: a step's experts fill half the slots, lru_guard's bar leaves room to prefetch
    cache, logits, ref, routing, counts, C, F = _next_engine_run(engine, batch, 0.5 if batch == 1 else 0.75, prompts)
    assert torch.equal(logits, ref)
    _assert_next_run_is_the_simulators(cache, routing, counts, C, F)


def _assert_next_run_is_the_simulators(cache, routing, counts, C, F):
    """A nexttoken run's checks beside its logits: the recorded lists are nexttoken_lists on the
    engine's own routing, the per-group counts simulate's on them, some prefetch was issued and
    used, no commit refused, the cache's state consistent."""
    stream, lists = _next_reference(routing, F, None)
    np.testing.assert_array_equal(cache.prefetch_lists(), lists)
    sim, want = _sim_next(stream, counts, C, lists, None, gate=cache.rules.gate_on)
    np.testing.assert_array_equal(_next_history(cache), want)
    assert sim.prefetches.sum() > 0 and sim.useful_prefetches > 0, "no prefetch used: the test lost its point"
    assert cache.counters()["stale"] == 0
    cache.check(contents=True)


def test_a_prefetch_that_never_lands_is_never_committed(engine):
    """The prefetch copy is sabotaged (nothing copied, no tag written back): the commit finds the
    slot's tag unwritten, leaves the instance on its host row (counted as stale) and its slot empty
    (owner -1, named by no row-map entry), so no kernel reads the unfilled slot: the logits stay
    bitwise the unmodified path's, the row map and the owners agree after every step (the empty
    slots are the first victims of the next admissions) and every other slot holds its owner."""
    prompts = np.random.default_rng(6).integers(0, engine.config.vocab_size, size=(1, 8)).tolist()
    empty = []

    def sabotage(cache):
        real, real_end = cache.fill, cache.end_step

        def fill(victims, new_inst, valid, m, tags=None):
            if tags is None:
                real(victims, new_inst, valid, m)

        def end_step():
            real_end()
            empty.append(int((cache.owner == EMPTY_SLOT).sum()))
            cache.check(contents=True)

        cache.fill, cache.end_step = fill, end_step

    cache, logits, ref, *_ = _next_engine_run(engine, 1, 0.5, prompts, sabotage=sabotage)
    c = cache.counters()
    assert c["prefetches"] > 0 and c["stale"] == c["prefetches"]
    assert max(empty) > 0, "no slot was left empty: the test lost its point"
    assert torch.equal(logits, ref)
    cache.check(contents=True)


_STATE = ("owner", "last_use", "count", "tick", "totals", "groups", "inflight", "predicted", "tags", "selections",
          "step", "seq_history", "prediction_history", "prefetch_history", "pf_count", "stale", "gate_acc",
          "want_n", "want_group", "group_index")


def _same_next_state(a, b, where):
    for name in _STATE:
        assert torch.equal(state(a, name), state(b, name)), (where, name)
    assert torch.equal(a.pools.row_map, b.pools.row_map), where
    for layer, cnt in enumerate(a.rules.pf_count.reshape(-1).tolist()):  # the issued lists, up to their counts
        for name in ("pf_victims", "pf_new", "pf_tags"):
            assert torch.equal(state(a, name)[layer, :cnt], state(b, name)[layer, :cnt]), (where, name, layer)
    for layer, cnt in enumerate(a.rules.want_n.tolist()):  # the gate's pending lists, up to their counts
        assert torch.equal(a.rules.want[layer, :cnt], b.rules.want[layer, :cnt]), (where, "want", layer)


@pytest.mark.gpu
@pytest.mark.parametrize("landing", ["landed", "never lands"])
def test_router_recorded_nexttoken_equals_the_torch_path(monkeypatch, landing):
    """nexttoken on CUDA as the fused step runs it (``SlotCache.route``): the router's launch
    records the group, the fill's blocks choose the demand victims by (predicted, recency) past the
    in-flight slots, commit and copy; the forecast and prefetch decisions run on the decisions stream
    (one launch) and the tagged copy on the copy stream; the step's end joins them and commits by
    tag. After every group the whole state equals the torch path's (row map, owners, recency,
    flags, tags, ring, per-sequence history, lists and counts), and after each step's commit too;
    the slots hold their owners. The second cache's prefetch victims are scanned in tiles smaller
    than the cache (``SCAN_TILE`` 2: the tile is the prefetch span's power of two, the picks merged
    across tiles). ``never lands``: every prefetch copy is sabotaged on both paths (nothing copied,
    no tag written back): the commit kernel leaves each such slot empty (owner -1) and its instance on
    its host row, as the torch path does, and the row map and the owners agree. The router inputs
    make each token select experts that move by one each step (``e`` then ``e + 1 mod E``, plus
    noise) and the forecast's table names each expert's successor first, so its lists name experts
    not resident that the next step selects, and the gate's unit (16 copies a group) leaves its cap
    unbinding: the prefetch gate, closed at first, opens. ``COLDSET_TEST_DEVICE=cpu
    TRITON_INTERPRET=1`` runs it through Triton's interpreter (by hand)."""
    from coldset.kernels import triton_decode as td
    from coldset.kernels import triton_slots as ts

    dev = os.environ.get("COLDSET_TEST_DEVICE", "cuda")
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    L, E, k, tokens, H = 3, 8, 2, 3, 32
    F = _forecaster(L, E, k, seed=4, extra=1, keep=100, succ=1000)
    rng = np.random.default_rng(8)
    gen = torch.Generator().manual_seed(3)
    gates = [torch.randn((E, H), generator=gen).to(dev, dt) for _ in range(L)]
    norm_w = (1 + 0.1 * torch.randn(H, generator=gen)).to(dev, dt)
    pinv = [torch.linalg.pinv(g.float().cpu()) for g in gates]  # [H, E]: router inputs of chosen logits
    first = np.array([[0, 4]] * tokens)  # each token's experts at step 0 (shared: lists short enough to leave victims)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    issued = 0
    if landing == "never lands":  # the kernel path's tagged copies skipped (its torch twin's below)
        monkeypatch.setattr(ts, "fill", lambda *a, tags=None, real=ts.fill, **kw: None if tags is not None else real(
            *a, **kw))
    for C, budget, tile in ((k * tokens + 2, None, ts.SCAN_TILE), (15, 2, 2)):
        monkeypatch.setattr(ts, "SCAN_TILE", tile)
        counts = rng.integers(0, 9, size=(L, E)).astype(np.float64)
        row_map, _, wc = _warm(counts, C)
        pools = _random_pools(L, E, dtype=dt)
        all_hot = ExpertPools.all_hot(pools.w13_hot.view(L, E, 8, 4).to(dev), pools.w2_hot.view(L, E, 4, 4).to(dev))
        host = host_tier(all_hot)
        ref, routed = (SlotCache.build(all_hot, host, row_map, wc, "nexttoken", tokens, k, forecaster=F,
                                       prefetch_budget=budget, lead_unit=16 * 1024) for _ in range(2))
        ref.use_kernel = False
        if landing == "never lands":  # the tagged (prefetch) copies of both paths skipped
            ref.fill = lambda *a, tags=None, real=ref.fill: None if tags is not None else real(*a)
        if dev == "cpu":  # the interpreter: the kernel path by hand
            routed.use_kernel = True
            routed.fill_ticket = torch.zeros(1, dtype=torch.int32)
            routed.rules.copy_ticket = torch.zeros(1, dtype=torch.int32)
        assert routed.records_in_route(tokens)
        if tile == 2:  # more than one tile
            assert ts._scan_size(C, max(2, ts._next_pow2(routed.rules.pf_victims.shape[1]))) < C
        for step in range(10):
            for layer in range(L):
                want = torch.zeros((tokens, E))
                want[np.arange(tokens)[:, None], (first + step + layer) % E] = 8.0
                x = ((want + torch.randn((tokens, E), generator=gen)) @ pinv[layer].T).to(dev, dt)
                h, ids, w = td.route(x, norm_w, 1e-6, gates[layer], k, True, counter, weights_dtype=dt)
                hr, ids_r, w_r = routed.route(layer, x, norm_w, 1e-6, gates[layer], k, True, counter, pdl=routed.pdl)
                assert torch.equal(hr, h) and torch.equal(ids_r, ids) and torch.equal(w_r, w)
                assert routed.admit(layer, ids_r, w_r, dt) is w_r
                ref.admit(layer, ids)
                if dev == "cuda":
                    torch.cuda.synchronize()
                _same_next_state(ref, routed, (C, step, layer))
            ref.end_step()
            routed.end_step()
            if dev == "cuda":
                torch.cuda.synchronize()
            _same_next_state(ref, routed, (C, step, "commit"))
            assert torch.equal(ref.rules.done, routed.rules.done)
            assert int(routed.fill_ticket) == 0 and int(routed.rules.copy_ticket) == 0
        stale = routed.counters()["stale"]
        assert stale == (routed.counters()["prefetches"] if landing == "never lands" else 0)
        issued += routed.counters()["prefetches"]
        routed.check(contents=True)
        ref.check(contents=True)
    assert issued > 5


@pytest.mark.gpu
@pytest.mark.parametrize("bsz,residency", [(1, 0.5), (2, 0.75)])
def test_graphed_nexttoken_steps_equal_the_simulator_and_the_unmodified_path(graphed_model, bsz, residency):
    """nexttoken in the captured step (decisions and tagged copies forked onto their streams inside
    the graph, joined and committed after the last layer's experts): every step's logits bitwise
    the unmodified path's; the forecast lists equal coldset.analysis.forecast.nexttoken_lists on the
    recorded routing and the per-group counts coldset.analysis.simulate.simulate's 'nexttoken'; prefetches
    issued and used; no commit refused."""
    from coldset.analysis.forecast import NextTokenForecaster

    model = graphed_model
    cfg = model.config
    fitted = []

    def fit(routing):  # on the run's own routing (a forecast that knows the tokens: prefetches get used)
        S, L, B, k = routing.shape
        fitted.append(NextTokenForecaster.fit(routing.transpose(2, 0, 1, 3).reshape(-1, L, k),
                                              np.repeat(np.arange(B), S), k, cfg.num_experts, terms=((0, 0),),
                                              weights=(1.0,), extra=1))
        return fitted[0]

    cache, logits, ref_logits, routing, counts, C = _graphed_cache(model, "nexttoken", bsz=bsz, residency=residency,
                                                                   forecaster=fit)
    F = fitted[0]
    for s, (a, b) in enumerate(zip(logits, ref_logits)):
        assert torch.equal(a, b), f"step {s + 1}: logits differ from the unmodified path's"
    _assert_next_run_is_the_simulators(cache, routing.astype(np.int64), counts, C, F)


# ------------------------------------------------------------------ block-FP8 experts in the slots

_FP8_POOLS = ("w13_hot", "w2_hot", "w13_scale_hot", "w2_scale_hot")


def _fp8_all_hot(L, E, hidden, inter, dev, seed=0):
    """FP8 pools all hot (weights quantized as a checkpoint: e4m3 + 128x128 weight_scale_inv)."""
    from coldset.core import fp8

    g = torch.Generator().manual_seed(seed)
    q13, s13 = fp8.quantize_w13(torch.randn(L, E, 2 * inter, hidden, generator=g) / hidden**0.5)
    q2, s2 = fp8.quantize_weight(torch.randn(L, E, hidden, inter, generator=g) / inter**0.5)
    return ExpertPools.all_hot(q13.to(dev), q2.to(dev), s13.to(dev), s2.to(dev))


def _same_fp8_slots(a, b, where):
    """Both caches' slot pools, weights and scales, bit for bit (float8 compared as bytes)."""
    for name in _FP8_POOLS:
        x, y = getattr(a.pools, name), getattr(b.pools, name)
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), (where, name)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "nexttoken", "lookahead"])
def test_fp8_slot_fills_copy_scales_and_the_kernel_reads_them(policy, monkeypatch):
    """Block-FP8 experts through the slot cache as the fused step runs it (``SlotCache.route``;
    lookahead: ``decide_ahead`` and its fills from ``admit``): the fill's blocks copy each admitted
    expert's weights and its scale rows in the same launch (lru's demand fill; nexttoken's also the
    tagged prefetch copy; lookahead's also the prefetch copy on the side stream). After every group
    the slots' weights and scales equal the torch path's bit for bit, as do the decisions; the FP8
    experts kernel reading the cache's pools (slot rows, host rows) gives the all-hot result bit
    for bit; the slots hold their owners' weights and scales at the end. The prefetching policies
    run without the gate (random routing: the copies, not the forecast, are under test).
    ``COLDSET_TEST_DEVICE=cpu TRITON_INTERPRET=1`` runs it through Triton's interpreter (by hand;
    there the router-recorded fill and the prefetch copies run 4 blocks per weight, lookahead's
    demand fill the default)."""
    from coldset.kernels import triton_decode as td
    from coldset.kernels import triton_experts
    from coldset.kernels import triton_slots as ts
    from coldset.kernels.triton_moe import KernelConfig

    dev = os.environ.get("COLDSET_TEST_DEVICE", "cuda")
    dt = torch.bfloat16 if dev == "cuda" else torch.float32  # the router's dtype (the interpreter has no bfloat16)
    xdt = torch.bfloat16 if dev == "cuda" else torch.float16  # the FP8 kernel's activations
    L, E, k, tokens, Hr, hidden, inter = 2, 8, 2, 2, 32, 256, 128
    steps = 3 if dev == "cpu" else 12
    if dev == "cpu":
        monkeypatch.setattr(ts, "FILL_BLOCKS", 4)  # the stripes as on the GPU, fewer interpreted programs
    cfg = KernelConfig(16, 32, 128, 64, 128, 4, 3, 32)
    rng = np.random.default_rng(11)
    gen = torch.Generator().manual_seed(12)
    gates = [torch.randn((E, Hr), generator=gen).to(dev, dt) for _ in range(L)]
    norm_w = (1 + 0.1 * torch.randn(Hr, generator=gen)).to(dev, dt)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    counts = rng.integers(0, 9, size=(L, E)).astype(np.float64)
    C = k * tokens + 1
    row_map, _, wc = _warm(counts, C)
    all_hot = _fp8_all_hot(L, E, hidden, inter, dev)
    host = host_tier(all_hot)
    extra = (dict(forecaster=_forecaster(L, E, k, seed=4, extra=1, keep=100), prefetch_gate=False)
             if policy == "nexttoken" else dict(routers=gates, depth=1, prefetch_gate=False) if policy == "lookahead"
             else {})
    ahead = policy == "lookahead"
    ref, routed = (SlotCache.build(all_hot, host, row_map, wc, policy, tokens, k, **extra) for _ in range(2))
    ref.use_kernel = False
    if dev == "cpu":  # the interpreter: the kernel path by hand
        routed.use_kernel, routed.prefetch_blocks = True, 4
        routed.fill_ticket = torch.zeros(1, dtype=torch.int32)
        if policy == "nexttoken":
            routed.rules.copy_ticket = torch.zeros(1, dtype=torch.int32)
    assert routed.pools.is_fp8 and (ahead or routed.records_in_route(tokens))
    for step in range(steps):
        for layer in range(L):
            x = torch.randn((tokens, Hr), generator=gen).to(dev, dt)
            _, ids, _ = td.route(x, norm_w, 1e-6, gates[layer], k, True, counter, weights_dtype=dt)
            if ahead:  # the router is not the fused launch: admit decides (one launch) and fills
                ids_r, w_r = ids, torch.full(ids.shape, 0.5, dtype=dt, device=dev)
                routed.admit(layer, ids, hidden=x)
                ref.admit(layer, ids, hidden=x)
            else:
                _, ids_r, w_r = routed.route(layer, x, norm_w, 1e-6, gates[layer], k, True, counter, pdl=routed.pdl)
                assert torch.equal(ids_r, ids)
                routed.admit(layer, ids_r, w_r, dt)
                ref.admit(layer, ids)
            if dev == "cuda":
                torch.cuda.synchronize()
            for name in ("owner", "last_use", "tick", "totals"):
                assert torch.equal(state(ref, name), state(routed, name)), (step, layer, name)
            assert torch.equal(ref.pools.row_map, routed.pools.row_map), (step, layer)
            _same_fp8_slots(ref, routed, (step, layer))
            xe = torch.randn((tokens, hidden), generator=gen).to(dev, xdt)
            we = w_r.to(xdt)
            out = triton_experts(routed.pools, layer, xe, ids_r, we, cfg)
            assert torch.equal(out, triton_experts(all_hot, layer, xe, ids_r, we, cfg)), (step, layer)
        if policy == "nexttoken":
            ref.end_step()
            routed.end_step()
            if dev == "cuda":
                torch.cuda.synchronize()
            assert torch.equal(ref.pools.row_map, routed.pools.row_map) and torch.equal(ref.rules.done, routed.rules.done)
    assert int(routed.fill_ticket) == 0
    assert ref.counters()["fills"] >= 3 and ref.counters() == routed.counters()
    if policy != "lru":
        assert routed.counters()["prefetches"] > 0
    if policy == "nexttoken":
        assert routed.counters()["stale"] == 0
    routed.check(contents=True)
    ref.check(contents=True)
