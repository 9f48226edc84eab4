"""The engine's ``lookahead`` cache (coldset.engine.cache.lookahead) against the simulator's
``lookahead`` (coldset.analysis.simulate), the Triton decisions against the torch path, and its
parity with the unmodified path."""

import os
import sys

import numpy as np
import pytest
import torch

from coldset.verify import gate
from coldset.analysis.simulate import simulate
from coldset.analysis.streams import AccessStream
from coldset.analysis.placement import hot_count_for_residency
from coldset.engine.cache.pool import SlotCache
from coldset.kernels.tiers import ExpertPools, host_tier
from synthetic_engines import random_prompts
from test_slots import _graphed_cache, _random_pools, _warm, state
from test_slots import engine, graphed_model  # noqa: F401 (pytest fixtures)


# lookahead: lru + the prefetch of layer l + d's router forecast on layer l's router input


def _lookahead_run(engine, residency, batch, depth, prompts, sabotage=None):
    """Decode ``prompts`` ``batch`` at a time through a lookahead cache; returns the cache, the
    decode groups (stream order) and the logits, beside the unmodified path's logits."""
    cfg = engine.config
    L, E = cfg.num_moe_layers, cfg.num_experts
    counts = np.random.default_rng(7).integers(0, 20, size=(L, E)).astype(np.float64)
    C = hot_count_for_residency(residency, L * E)
    row_map, _, wc = _warm(counts, C)
    routers = [engine.layers[i].mlp.gate.weight.detach() for i in cfg.moe_layers]
    cache = SlotCache.build(engine.pools, host_tier(engine.pools), row_map, wc, "lookahead", batch, cfg.top_k,
                            routers=routers, depth=depth)
    if sabotage is not None:
        sabotage(cache)
    ref_fn, rowmap_fn, _ = gate.experts_functions(engine.device)
    ids = [f"p{i}" for i in range(len(prompts))]
    reference = gate.reference_decode(engine, prompts, 10, batch_size=batch, progress=False)
    groups = []
    admit = cache.admit

    def recording(layer, topk_ids, *a, **kw):
        if topk_ids.shape[0] <= batch:  # decode groups (prefill is not decided)
            groups.append(topk_ids.reshape(-1).tolist())
        return admit(layer, topk_ids, *a, **kw)

    cache.admit = recording
    got = gate.placement_decode(engine, cache.pools, prompts, 10, batch_size=batch, progress=False, cache=cache)
    result = gate.compare(f"lookahead-{residency}", ids, reference, got, cache.pools, engine)
    return cache, counts, C, groups, result


@pytest.mark.parametrize("batch,depth", [(1, 1), (2, 2)])
def test_lookahead_engine_equals_the_simulator_and_passes_the_gate(engine, batch, depth):
    """The engine's lookahead decisions on CPU: per group hits, misses, fills and prefetches equal
    coldset.analysis.simulate.simulate's 'lookahead' policy fed with the prediction lists the engine recorded;
    logits bitwise the unmodified path's; prefetches happened and were used. Residency 0.5 and 8
    prompts: room past lru_guard's bar to prefetch, and lists enough for the gate (closed at first)
    to open."""
    cfg = engine.config
    L, E = cfg.num_moe_layers, cfg.num_experts
    prompts = random_prompts(cfg.vocab_size, 8, seed=5)
    cache, counts, C, groups, result = _lookahead_run(engine, 0.5, batch, depth, prompts)
    assert result.passed and result.tokens_matched == result.tokens_total
    cache.check(contents=True)
    n_groups = int(cache.groups)
    assert len(groups) == n_groups
    layer_of = np.arange(n_groups) % L
    inst = np.array([layer_of[g] * E + e for g in range(n_groups) for e in groups[g]])
    ptr = np.cumsum([0] + [len(x) for x in groups])
    stream = AccessStream(inst, ptr, n_groups // L * batch, L, E)
    pred = cache.prefetch_lists()
    sim = simulate(stream, "lookahead", C, counts, predictions=pred)
    np.testing.assert_array_equal(cache.group_history(), np.stack([sim.hits, sim.misses, sim.fills], axis=1))
    np.testing.assert_array_equal(cache.rules.prefetch_history[:n_groups].cpu().numpy(), sim.prefetches)
    assert sim.prefetches.sum() > 0 and sim.useful_prefetches > 0, "no prefetch used: the test lost its point"
    # the prefetches moved the stream off lru's decisions (so the equality above tested them)
    assert not np.array_equal(sim.hit, simulate(stream, "lru", C, counts).hit)


def test_a_stale_prefetch_fails_the_gate(engine, monkeypatch):
    """A prefetch whose copy never lands (its slot keeps the victim's weights, the row map names the
    prefetched expert) must fail the gate and the contents check. (Residency 0.5 and 4 prompts: the
    prefetch gate, closed at first, opens.)"""
    prompts = random_prompts(engine.config.vocab_size, 4, seed=6)
    real_fill = SlotCache.fill
    skipped = []

    def no_prefetch_copy(self, victims, new_inst, valid, m):
        if sys._getframe(1).f_code.co_name == "_prefetch":
            skipped.append(int(m))
            return
        real_fill(self, victims, new_inst, valid, m)

    monkeypatch.setattr(SlotCache, "fill", no_prefetch_copy)
    cache, _, _, _, result = _lookahead_run(engine, 0.5, 1, 1, prompts)
    assert sum(skipped) > 0
    assert not result.passed
    with pytest.raises(ValueError, match="does not hold the weights"):
        cache.check(contents=True)


@pytest.mark.parametrize("depth", [1, 2])
def test_lookahead_decisions_equal_the_simulator_on_random_streams(depth):
    """Random groups, router inputs and routers, pools barely larger than a group (so the in-flight
    rule, the read-in-place of a miss without a free slot and the skipped rest of a list all
    occur): the engine's per-group hits, misses, fills and prefetches equal the simulator's
    'lookahead' policy on the lists the engine recorded, and every slot holds its owner."""
    rng = np.random.default_rng(depth)
    L, E, k, T, H = 3, 6, 2, 2, 5
    for trial in range(6):
        counts = rng.integers(0, 9, size=(L, E)).astype(np.float64)
        C = int(rng.integers(k * T, k * T + 4))
        row_map, _, wc = _warm(counts, C)
        all_hot = _random_pools(L, E)
        routers = [torch.as_tensor(rng.standard_normal((E, H)), dtype=torch.float32) for _ in range(L)]
        cache = SlotCache.build(all_hot, host_tier(all_hot), row_map, wc, "lookahead", T, k, routers=routers,
                                depth=depth)
        groups = []
        for _ in range(12):
            for layer in range(L):
                ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])
                hidden = torch.as_tensor(rng.standard_normal((T, H)), dtype=torch.float32)
                cache.admit(layer, torch.as_tensor(ids), hidden=hidden)
                groups.append((ids + layer * E).reshape(-1))
        inst = np.concatenate(groups)
        stream = AccessStream(inst, np.arange(0, inst.size + 1, k * T), 12 * T, L, E)
        sim = simulate(stream, "lookahead", C, counts, predictions=cache.prefetch_lists())
        np.testing.assert_array_equal(cache.group_history(), np.stack([sim.hits, sim.misses, sim.fills], axis=1),
                                      err_msg=f"trial {trial}, C {C}")
        np.testing.assert_array_equal(cache.rules.prefetch_history[:len(groups)].numpy(), sim.prefetches)
        cache.check(contents=True)


def test_lookahead_in_flight_slots_are_no_demand_victims():
    """Hand-checked: 2 layers x 6 experts, top-2, 2 tokens, 4 slots warm with (0,0..3); routers =
    identity, so the router input names the forecast. Layer 0 hits (0,0) (0,1) and its lookahead
    [(1,4), (1,5)] takes the slots of (0,3) and (0,2) (least used first). Layer 1 misses (1,0..3):
    (1,4) (1,5) are in flight and (0,0) (0,1) were used by the last L groups (lru_guard's bar), so
    every miss is read in place; the prefetched (1,4) (1,5) stay. The simulator agrees. Without the
    gate (closed at first: tests/test_gate_rule.py), so that the first list is issued."""
    L, E, k, T = 2, 6, 2, 2
    counts = np.zeros((L, E))
    counts[0, :4] = [9, 8, 7, 6]
    row_map, _, wc = _warm(counts, 4)
    all_hot = _random_pools(L, E)
    routers = [torch.eye(E) for _ in range(L)]
    cache = SlotCache.build(all_hot, host_tier(all_hot), row_map, wc, "lookahead", T, k, routers=routers,
                            prefetch_gate=False)
    forecast = torch.tensor([[0, 0, 0, 0, 2.0, 1.0]] * T)
    cache.admit(0, torch.tensor([[0, 1], [0, 1]]), hidden=forecast)
    assert cache.prefetch_lists()[0].tolist() == [E + 4, E + 5, -1, -1]
    assert int(cache.rules.prefetch_history[0]) == 2
    cache.admit(1, torch.tensor([[0, 1], [2, 3]]), hidden=forecast)
    rm = cache.pools.row_map
    assert [int(rm[1, e]) >= 0 for e in range(E)] == [False, False, False, False, True, True]
    assert [int(rm[0, e]) >= 0 for e in range(E)] == [True, True, False, False, False, False]
    np.testing.assert_array_equal(cache.group_history(), [[4, 0, 0], [0, 4, 4]])
    cache.check(contents=True)
    stream = AccessStream(np.array([0, 1, 0, 1, 6, 7, 8, 9]), np.array([0, 4, 8]), T, L, E)
    sim = simulate(stream, "lookahead", 4, counts, predictions=cache.prefetch_lists(), prefetch_gate=False)
    np.testing.assert_array_equal(cache.group_history(), np.stack([sim.hits, sim.misses, sim.fills], axis=1))


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [1, 2])
def test_triton_lookahead_decisions_equal_the_torch_path(depth):
    """lookahead on CUDA: the decisions in one Triton launch (demand with the in-flight rule, the
    forecast's top k, the prefetch), the demand fill on the compute stream and the prefetch copy on
    the side stream: after every group the same state as the torch path (row map, owners, recency,
    counts, in-flight flags, recorded lists and prefetch counts), the router weights cast bitwise as
    ``Tensor.to``, and every slot holding its owner at the end. Pools barely larger than a group
    and tokens sharing experts make the read-in-place and skipped-list cases occur. Both paths rank
    the same logits, the kernel path's GEMV (``forecast_logits``; the lists are recorded, so their
    rounding is the engine's choice: the GEMV against torch's float32 product is
    test_cuda_lookahead_lists_equal_lookahead_predictions')."""
    from coldset.kernels.triton_slots import forecast_logits

    rng = np.random.default_rng(10 + depth)
    L, E, k, T, H = 5, 8, 2, 3, 16
    prefetched = 0
    for trial in range(4):
        counts = rng.integers(0, 9, size=(L, E)).astype(np.float64)
        C = int(rng.integers(k * T, k * T * 3 + 8))  # (lru_guard's bar leaves room to prefetch in the larger pools)
        row_map, _, wc = _warm(counts, C)
        pools = _random_pools(L, E, seed=trial, dtype=torch.bfloat16)
        all_hot = ExpertPools.all_hot(pools.w13_hot.view(L, E, 8, 4).cuda(), pools.w2_hot.view(L, E, 4, 4).cuda())
        routers = [torch.as_tensor(rng.standard_normal((E, H)), dtype=torch.bfloat16).cuda() for _ in range(L)]
        host = host_tier(all_hot)
        # odd trials with the gate at lead unit 0 (its cap keeps it closed: the sums are compared, no
        # list is issued), even ones without
        a, b = (SlotCache.build(all_hot, host, row_map, wc, "lookahead", T, k, routers=routers, depth=depth,
                                prefetch_gate=bool(trial % 2), lead_unit=0) for _ in range(2))
        a.use_kernel = False
        a.rules.forecast_logits = lambda _cache, h, t, pdl=False: forecast_logits(
            h, a.rules.forecast_routers[t], torch.empty((h.shape[0], E), dtype=torch.float32, device=h.device))
        assert b.use_kernel and b.rules.side_stream is not None
        for step in range(8):
            for layer in range(L):
                ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])
                if trial % 2:
                    ids[1] = ids[0]
                ids = torch.as_tensor(ids).cuda()
                hidden = torch.as_tensor(rng.standard_normal((T, H)), dtype=torch.bfloat16).cuda()
                w = torch.as_tensor(rng.random((T, k)), dtype=torch.float32).cuda()
                wa = a.admit(layer, ids, w, torch.bfloat16, hidden=hidden)
                wb = b.admit(layer, ids, w, torch.bfloat16, hidden=hidden)
                assert torch.equal(wa, w.to(torch.bfloat16)) and torch.equal(wb, wa)
                for name in ("owner", "last_use", "count", "tick", "totals", "groups", "inflight", "gate_state",
                             "prediction_history", "prefetch_history", "history"):
                    assert torch.equal(state(a, name), state(b, name)), (name, trial, step, layer)
                assert torch.equal(a.pools.row_map, b.pools.row_map)
        prefetched += int(b.rules.prefetch_history.sum())
        b.check(contents=True)
        a.check(contents=True)
    assert prefetched > 0


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [1, 2])
def test_cuda_lookahead_lists_equal_lookahead_predictions(depth):
    """The lists the CUDA path records (the forecast GEMV ``forecast_logits`` over the bf16 routers,
    float32 sums, then ``decide_ahead``'s sort-based top-k) equal
    ``coldset.analysis.forecast.lookahead_predictions`` (torch's float32 product on the CPU, a stable sort)
    on the same router inputs, group for group, except where a token's float64 logits have two of
    their top k + 1 within twice the float32 summation bound (``gamma_{H+1} * sum_h |x_h w_h|``: each
    float32 sum lies within it of the exact one, so the two may order such a pair either way); such
    groups are few (asserted), so the equality is tested. ``COLDSET_TEST_DEVICE=cpu
    TRITON_INTERPRET=1`` runs it through Triton's interpreter in float32 (by hand)."""
    from coldset.analysis.forecast import lookahead_predictions

    dev = os.environ.get("COLDSET_TEST_DEVICE", "cuda")
    dt = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter has no bfloat16
    rng = np.random.default_rng(40 + depth)
    L, E, k, T, H, S = 4, 16, 4, 3, 256, 6
    counts = rng.integers(0, 9, size=(L, E)).astype(np.float64)
    row_map, _, wc = _warm(counts, L * E * 3 // 4)  # (room to prefetch past lru_guard's bar)
    pools = _random_pools(L, E, dtype=dt)
    all_hot = ExpertPools.all_hot(pools.w13_hot.view(L, E, 8, 4).to(dev), pools.w2_hot.view(L, E, 4, 4).to(dev))
    routers = [torch.as_tensor(rng.standard_normal((E, H)), dtype=dt).to(dev) for _ in range(L)]
    # random routers forecast poorly: without the gate, so that the lists are issued
    cache = SlotCache.build(all_hot, host_tier(all_hot), row_map, wc, "lookahead", T, k, routers=routers, depth=depth,
                            prefetch_gate=False)
    if dev == "cpu":  # the interpreter: the kernel path by hand
        cache.use_kernel, cache.fill_ticket = True, torch.zeros(1, dtype=torch.int32)
    assert cache.use_kernel
    hidden = torch.as_tensor(rng.standard_normal((S, L, T, H)), dtype=dt)
    for s in range(S):
        for layer in range(L):
            ids = torch.as_tensor(np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])).to(dev)
            cache.admit(layer, ids, hidden=hidden[s, layer].to(dev))
    got = cache.prefetch_lists()
    want = lookahead_predictions(hidden, [r.cpu() for r in routers], depth, k)
    gamma = (H + 1) * 2.0 ** -24 / (1 - (H + 1) * 2.0 ** -24)
    near = 0
    for s in range(S):
        for layer in range(L - depth):
            g = s * L + layer
            x, w = hidden[s, layer].double(), routers[layer + depth].cpu().double()
            exact = torch.sort(x @ w.T, dim=1, descending=True).values[:, :k + 1]
            slack = 2 * gamma * (x.abs() @ w.abs().T).max(dim=1).values
            tied = bool(((exact[:, :-1] - exact[:, 1:]) <= slack[:, None]).any())
            near += tied
            if not tied:
                assert np.array_equal(got[g], want[g]), (s, layer, got[g], want[g])
        assert (got[s * L + L - depth:(s + 1) * L] == -1).all(), "a list past the last layer"
    assert near <= S * (L - depth) // 10, f"{near} groups with near ties: the equality lost its point"
    assert int(cache.rules.prefetch_history.sum()) > 0
    cache.check(contents=True)


def _without_gate(cache):
    """A ``_graphed_cache`` patch: the prefetch gate never closes (the captured prefetch is under
    test, whatever the forecast's precision; the gate starts closed)."""
    cache.rules.gate_on = False


@pytest.mark.gpu
@pytest.mark.parametrize("gate_on", [True, False], ids=["gate", "no-gate"])
@pytest.mark.parametrize("depth", [1, 2])
def test_graphed_lookahead_steps_equal_the_simulator_and_the_unmodified_path(graphed_model, depth, gate_on):
    """lookahead in the captured step (the fused router launch computing the forecast and making
    the whole decision, ``SlotCache.route``; prefetch copies forked onto the side stream inside the
    graph, joined before layer l + depth's experts): every step's logits bitwise the unmodified
    path's, per group hits, misses, fills and prefetches equal to ``coldset.analysis.simulate.simulate``'s
    'lookahead' on the engine's recorded lists, with the gate and without; without it, prefetches
    issued (each evicting a slot) and used."""
    model = graphed_model
    L, E, k = model.config.num_moe_layers, model.config.num_experts, model.config.top_k
    assert model._fused_head is not None, "the fused decode region (the router decides) is what this tests"
    cache, logits, ref_logits, routing, counts, C = _graphed_cache(model, "lookahead", depth,
                                                                   patch=None if gate_on else _without_gate)
    assert cache.records_in_route(routing.shape[2])
    for s, (a, b) in enumerate(zip(logits, ref_logits)):
        assert torch.equal(a, b), f"step {s + 1}: logits differ from the unmodified path's"
    bsz = routing.shape[2]
    inst = (routing + (np.arange(L) * E)[None, :, None, None]).reshape(-1)
    stream = AccessStream(inst, np.arange(0, inst.size + 1, bsz * k), bsz * len(logits), L, E)
    sim = simulate(stream, "lookahead", C, counts, predictions=cache.prefetch_lists(), prefetch_gate=gate_on)
    np.testing.assert_array_equal(cache.group_history(), np.stack([sim.hits, sim.misses, sim.fills], axis=1))
    np.testing.assert_array_equal(cache.rules.prefetch_history[:sim.hits.size].cpu().numpy(), sim.prefetches)
    if not gate_on:
        assert sim.prefetches.sum() > 0 and sim.useful_prefetches > 0, "no prefetch used: the test lost its point"
    cache.check(contents=True)


@pytest.mark.gpu
def test_a_prefetch_joined_late_fails_the_gate_on_cuda(graphed_model, monkeypatch):
    """The prefetch copy is made slow (a sleep of about 25 ms on the side stream before it). Joined where it
    belongs (before layer l + depth's experts), the logits stay bitwise the unmodified path's; joined
    only at the end of the step (a stale join: layer l + depth reads a slot whose copy has not
    landed), they differ, so the parity gate fails. The prefetch gate is off (``_without_gate``):
    the copies are what is tested.

    The sleep counts clock cycles, not this process's time on the GPU: beside other processes on the
    same GPU (``pytest -m gpu -n 8``) it can end before the main stream reaches the layer, and the
    stale join goes unseen. 50 M cycles make that rare, not impossible: alone, the test is reliable."""
    from coldset.kernels import triton_slots

    real_fill = triton_slots.fill

    def slow_fill(pools, victims, instances, count, pdl=False, blocks=triton_slots.FILL_BLOCKS):
        if blocks != triton_slots.FILL_BLOCKS:
            torch.cuda._sleep(50_000_000)  # the prefetch copy (side stream, fewer blocks) lands late
        real_fill(pools, victims, instances, count, pdl=pdl, blocks=blocks)

    monkeypatch.setattr(triton_slots, "fill", slow_fill)
    cache, logits, ref, _, _, _ = _graphed_cache(graphed_model, "lookahead", 1, patch=_without_gate)
    assert int(cache.rules.prefetch_history.sum()) > 0
    assert all(torch.equal(a, b) for a, b in zip(logits, ref)), "the join did not hold the slow copy back"

    def late(cache):
        _without_gate(cache)
        ahead = cache.rules
        L = len(ahead.pending)

        def join_at_the_end(_cache, layer):
            if layer == L - 1 and any(ahead.pending):
                last = max(i for i, p in enumerate(ahead.pending) if p)
                torch.cuda.current_stream().wait_event(ahead.join_events[last])
                ahead.pending[:] = [False] * L

        ahead._join_layer = join_at_the_end

    cache, logits, ref, _, _, _ = _graphed_cache(graphed_model, "lookahead", 1, patch=late)
    assert int(cache.rules.prefetch_history.sum()) > 0
    assert not all(torch.equal(a, b) for a, b in zip(logits, ref)), "a stale prefetch went unnoticed"
    cache.check(contents=True)  # the copies did land by the step's end: only the timing was wrong


def _tiny_shape_and_profile(layers: int, experts: int):
    """A qwen3_moe shape of ``layers`` MoE layers x ``experts`` (top-1) and a decode profile whose
    counts rise with layer and expert id (so every placement's hot set is known)."""
    import pandas as pd

    from coldset.engine.model import ModelConfig

    shape = ModelConfig.from_hf_config({
        "model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 4, "num_hidden_layers": layers,
        "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 4, "num_experts": experts,
        "num_experts_per_tok": 1, "moe_intermediate_size": 2, "rms_norm_eps": 1e-6})
    hist = pd.DataFrame([{"domain": "d", "split": "profile", "phase": "decode", "layer": layer, "expert": e,
                          "count": 1 + layer * experts + e} for layer in range(layers) for e in range(experts)])
    return shape, hist


def test_lookahead_placement_file_carries_its_depth(tmp_path):
    """lookahead-0.5 on disk: lru's warm state plus ``cache_lookahead_depth``, which the cache built
    from it uses and the parity fingerprint covers (another depth is another placement); a depth
    outside [1, MoE layers - 1], or one missing, is refused naming the field."""
    import json

    from coldset.verify.fingerprint import placement_fingerprint
    from coldset.analysis.placement import place
    from coldset.core.placement import PlacementError, load_placement, save_placement

    shape, hist = _tiny_shape_and_profile(3, 4)
    lru = place(hist, shape, "lru", 0.5, batch_sizes=(1,))
    la = place(hist, shape, "lookahead", 0.5, batch_sizes=(1,), lookahead_depth=2)
    assert np.array_equal(la.row_map, lru.row_map)
    assert la.cache_lookahead_depth == 2 and lru.cache_lookahead_depth is None
    with pytest.raises(PlacementError, match="lookahead_depth must lie in"):
        place(hist, shape, "lookahead", 0.5, batch_sizes=(1,), lookahead_depth=3)
    path = save_placement(la, tmp_path / "lookahead-0.5.json")
    back = load_placement(path)
    assert back.dynamic and back.cache_lookahead_depth == 2
    np.testing.assert_array_equal(back.cache_warm_counts, lru.cache_warm_counts)
    all_hot = _random_pools(3, 4)
    routers = [torch.randn(4, 4) for _ in range(3)]
    cache = SlotCache.from_placement(all_hot, host_tier(all_hot), back, 1, 1, routers=routers)
    assert cache.policy == "lookahead" and cache.rules.depth == 2
    before = placement_fingerprint(path)
    doc = json.loads(path.read_text())
    doc["cache_lookahead_depth"] = 1
    path.write_text(json.dumps(doc))
    assert placement_fingerprint(path) != before
    for bad in (None, 3, 0, {"2": 1}, {"1": 3}, {"one": 1}):
        doc["cache_lookahead_depth"] = bad
        path.write_text(json.dumps(doc))
        with pytest.raises(PlacementError, match="cache_lookahead_depth"):
            load_placement(path)


def test_lookahead_depth_per_batch_size_reaches_the_cache_of_each_batch(tmp_path):
    """``cache.lookahead_depth`` as ``{batch size: depth}`` (lookahead's best depth differs by batch
    size: BENCHMARKS.md section 4): the placement file keeps the mapping, and the cache built for a
    decode of B sequences runs the entry of the largest batch size <= B; refused naming the field
    when batch 1 has none or a depth leaves the model."""
    from coldset.analysis.placement import place
    from coldset.core.placement import PlacementError, load_placement, lookahead_depth_for, save_placement

    shape, hist = _tiny_shape_and_profile(4, 32)
    la = place(hist, shape, "lookahead", 0.5, batch_sizes=(1, 8), lookahead_depth={8: 1, 1: 3, 4: 2})
    assert la.cache_lookahead_depth == {1: 3, 4: 2, 8: 1}
    back = load_placement(save_placement(la, tmp_path / "lookahead-0.5.json"))
    assert back.cache_lookahead_depth == {1: 3, 4: 2, 8: 1}
    all_hot = _random_pools(4, 32)
    routers = [torch.randn(32, 4) for _ in range(4)]
    for batch, depth in [(1, 3), (3, 3), (4, 2), (7, 2), (8, 1)]:
        assert lookahead_depth_for(back.cache_lookahead_depth, batch) == depth
        cache = SlotCache.from_placement(all_hot, host_tier(all_hot), back, batch, 1, routers=routers)
        assert cache.rules.depth == depth, (batch, cache.rules.depth)
    assert lookahead_depth_for(back.cache_lookahead_depth, 64) == 1
    with pytest.raises(PlacementError, match=r"lookahead_depth must give batch size 1 a depth"):
        place(hist, shape, "lookahead", 0.5, batch_sizes=(1,), lookahead_depth={8: 1})
    with pytest.raises(PlacementError, match=r"lookahead_depth\[8\] must lie in \[1, 3\]"):
        place(hist, shape, "lookahead", 0.5, batch_sizes=(1,), lookahead_depth={1: 1, 8: 4})


def test_lookahead_deferred_fork_is_never_dropped_silently():
    """``list_after_experts`` (build()'s choice at depth >= 2): route() leaves the layer's list and
    prefetch for :meth:`SlotCache.experts_done`. A layer's decisions while another layer's fork is
    still pending (its experts never went through wrap()'s experts function) is refused by name
    rather than replacing it, and experts_done of the wrong layer too; the pending fork is kept."""
    L, E, k, T, H = 4, 8, 2, 2, 16
    rng = np.random.default_rng(3)
    row_map, _, wc = _warm(rng.integers(0, 9, size=(L, E)).astype(np.float64), k * T + 4)
    pools = _random_pools(L, E, seed=3, dtype=torch.float32)
    all_hot = ExpertPools.all_hot(pools.w13_hot.view(L, E, 8, 4), pools.w2_hot.view(L, E, 4, 4))
    routers = [torch.randn(E, H) for _ in range(L)]
    built = {d: SlotCache.build(all_hot, host_tier(all_hot), row_map, wc, "lookahead", T, k, routers=routers, depth=d)
             for d in (1, 2)}
    assert not built[1].rules.list_after_experts and built[2].rules.list_after_experts
    cache = built[2]
    cache.rules.deferred_fork = (0, 2, k * T)  # what route() leaves at layer 0
    with pytest.raises(RuntimeError, match="layer 0's prefetch fork is still pending at layer 1"):
        cache.rules._ahead_fork_join(cache, 1, 3, listed=k * T)
    with pytest.raises(RuntimeError, match="layer 1's experts, but layer 0's prefetch fork is pending"):
        cache.experts_done(1)
    assert cache.rules.deferred_fork == (0, 2, k * T)
