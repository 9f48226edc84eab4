"""The engine's slot cache (coldset.engine.cache.pool) against the trace simulator (coldset.analysis.cache) and a
brute-force reference of the cache semantics (coldset.analysis.simulate's module doc), and its parity with
the unmodified path."""

import os
import sys

import numpy as np
import pytest
import torch

from coldset.verify import gate
from coldset.analysis.simulate import simulate
from coldset.analysis.streams import AccessStream
from coldset.engine.generate import generate
from coldset.analysis.placement import hot_count_for_residency, hot_mask_usage_global, row_map_from_mask
from coldset.core.placement import DYNAMIC_POLICIES
from coldset.engine.cache.policy import CachePolicy
from coldset.engine.cache.pool import CacheCapacityError, SlotCache
from coldset.engine.cache.registry import POLICIES
from coldset.engine.synthetic import SyntheticSpec
from coldset.kernels.tiers import ExpertPools, host_tier
from synthetic_engines import random_prompts, synthetic_engine


def reference_cache(groups, num_experts, warm, warm_counts, policy, num_layers=None):
    """Brute force of the semantics: ``groups`` = [(layer, [expert, ...] in selection order)],
    ``warm`` = instance per slot. Returns per group (hits, missed selections, fills) and per group
    the list of (slot, admitted instance). ``lru_guard`` (``num_layers`` L): lru whose victims
    exclude every instance one of the last L groups used (this one included); the misses past the
    remaining candidates stay unadmitted (read in place)."""
    slot_of = {inst: s for s, inst in enumerate(warm)}
    ranked = sorted(range(len(warm)), key=lambda s: (warm_counts[s], warm[s]))
    last_use = {warm[s]: i - len(warm) for i, s in enumerate(ranked)}
    count = {warm[s]: float(warm_counts[s]) for s in range(len(warm))}
    recent = []  # lru_guard: the instance sets of the groups so far
    tick, out, fills = 0, [], []
    for layer, experts in groups:
        insts = [layer * num_experts + e for e in experts]
        hits = sum(i in slot_of for i in insts)
        missed = []
        for i in insts:
            if i not in slot_of and i not in missed:
                missed.append(i)
        group = set(insts)
        recent.append(group)
        barred = set().union(*recent[-num_layers:]) if policy == "lru_guard" else group
        candidates = [r for r in slot_of if r not in barred]
        if policy in ("lru", "lru_guard"):
            candidates.sort(key=lambda r: last_use[r])
        elif policy == "mru":
            candidates.sort(key=lambda r: -last_use[r])
        else:
            candidates.sort(key=lambda r: (count.get(r, 0.0), last_use[r]))
        assert policy == "lru_guard" or len(candidates) >= len(missed)
        step_fills = []
        for i, victim in zip(missed, candidates):
            s = slot_of.pop(victim)
            slot_of[i] = s
            step_fills.append((s, i))
        for t, i in enumerate(insts):
            last_use[i] = tick + t
            count[i] = count.get(i, 0.0) + 1
        tick += len(insts)
        out.append((hits, len(insts) - hits, len(missed)))
        fills.append(step_fills)
    return np.array(out, dtype=np.int64).reshape(-1, 3), fills


def simulator_history(groups, num_layers, num_experts, counts, capacity, policy, tokens):
    """Per-group (hits, misses, fills) of coldset.analysis.simulate.simulate on the same groups, warm from
    the same profile counts."""
    ids = np.array([layer * num_experts + e for layer, ex in groups for e in ex], dtype=np.int64)
    ptr = np.cumsum([0] + [len(ex) for _, ex in groups])
    res = simulate(AccessStream(ids, ptr, tokens, num_layers, num_experts), policy, capacity, counts)
    return np.stack([res.hits, res.misses, res.fills], axis=1)


def state(cache, name):
    """A state tensor by name: the pool's field or its policy's."""
    return getattr(cache.rules if hasattr(cache.rules, name) else cache, name)


def _random_pools(L, E, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn((L, E, 8, 4), generator=g, dtype=dtype)
    w2 = torch.randn((L, E, 4, 4), generator=g, dtype=dtype)
    return ExpertPools.all_hot(w13, w2)


def _warm(counts, capacity):
    row_map = row_map_from_mask(hot_mask_usage_global(counts, capacity))
    flat = row_map.reshape(-1)
    owner = np.empty(capacity, dtype=np.int64)
    hot = np.flatnonzero(flat >= 0)
    owner[flat[hot]] = hot
    return row_map, owner, counts.reshape(-1)[owner]


@pytest.mark.parametrize("policy", ["lru", "lfu", "lru_guard"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_decisions_equal_the_brute_force_reference(policy, tokens):
    L, E, k = 3, 8, 2
    C = (5 if policy == "lru_guard" else 7) if tokens == 1 else 13  # lru_guard: fewer slots than a step uses
    rng = np.random.default_rng(tokens)
    counts = rng.integers(0, 5, size=(L, E)).astype(np.float64)  # ties on purpose
    all_hot = _random_pools(L, E)
    row_map, owner, warm_counts = _warm(counts, C)
    cache = SlotCache.build(all_hot, host_tier(all_hot), row_map, warm_counts, policy, max_tokens=tokens, top_k=k)
    groups = []
    for step in range(40):
        for layer in range(L):
            # skewed draws with repeats across tokens of a step (duplicates inside a group)
            ids = np.stack([rng.choice(E, size=k, replace=False, p=np.r_[[0.3, 0.2], [0.5 / (E - 2)] * (E - 2)])
                            for _ in range(tokens)])
            groups.append((layer, ids.reshape(-1).tolist()))
            cache.admit(layer, torch.as_tensor(ids))
            cache.check(contents=True)
    want, fills = reference_cache(groups, E, owner.tolist(), warm_counts.tolist(), policy, L)
    got = cache.group_history()
    assert got.shape == want.shape == (len(groups), 3)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, simulator_history(groups, L, E, counts, C, policy, 40 * tokens))
    assert want[:, 2].sum() > 10 and want[:, 0].sum() > 10  # the stream exercised both
    if policy == "lru_guard":  # the guard read misses in place, and that changed what lru would have done
        assert sum(len(f) for f in fills) < want[:, 2].sum()
        assert not np.array_equal(want, reference_cache(groups, E, owner.tolist(), warm_counts.tolist(), "lru")[0])
    assert cache.counters() == {"hits": int(want[:, 0].sum()), "misses": int(want[:, 1].sum()),
                                "fills": int(want[:, 2].sum()), "groups": len(groups)}
    # reset: the warm state again, and the same stream gives the same history
    cache.reset()
    cache.check(contents=True)
    for layer, ids in groups:
        cache.admit(layer, torch.as_tensor(ids).view(tokens, k))
    np.testing.assert_array_equal(cache.group_history(), want)


class MostRecentlyUsed(CachePolicy):
    """A toy policy, the whole of its module: victims by most recent use (the barred slots last)."""

    name = "mru"

    def victim_order(self, cache, barred):
        last = (-cache.last_use[cache.owner]).masked_fill(barred, torch.iinfo(torch.int64).max)
        return torch.argsort(last, stable=True)


def test_a_policy_is_one_class_and_one_registry_line(monkeypatch):
    """A new policy = its class (here :class:`MostRecentlyUsed`) + one line in the registry: the
    pool builds it by name and drives it through the torch path; its decisions, group by group
    (hits, misses, fills and which slot took which instance), equal the brute-force reference's."""
    monkeypatch.setitem(POLICIES, "mru", MostRecentlyUsed)
    L, E, k, T, C = 3, 8, 2, 2, 9
    rng = np.random.default_rng(11)
    counts = rng.integers(0, 5, size=(L, E)).astype(np.float64)
    all_hot = _random_pools(L, E)
    row_map, owner, warm_counts = _warm(counts, C)
    cache = SlotCache.build(all_hot, host_tier(all_hot), row_map, warm_counts, "mru", max_tokens=T, top_k=k)
    assert isinstance(cache.rules, MostRecentlyUsed) and not cache.records_in_route(T)
    groups, admitted = [], []
    for _ in range(30):
        for layer in range(L):
            ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])
            groups.append((layer, ids.reshape(-1).tolist()))
            before = cache.owner.clone()
            cache.admit(layer, torch.as_tensor(ids))
            changed = torch.nonzero(cache.owner != before).flatten().tolist()
            admitted.append(sorted((s, int(cache.owner[s])) for s in changed))
    cache.check(contents=True)
    want, fills = reference_cache(groups, E, owner.tolist(), warm_counts.tolist(), "mru")
    np.testing.assert_array_equal(cache.group_history(), want)
    assert admitted == [sorted(f) for f in fills]
    assert want[:, 2].sum() > 10 and not np.array_equal(want, reference_cache(groups, E, owner.tolist(),
                                                                              warm_counts.tolist(), "lru")[0])


def test_the_registry_holds_the_placements_dynamic_policies():
    assert tuple(POLICIES) == DYNAMIC_POLICIES
    assert all(cls.name == name and cls.routes for name, cls in POLICIES.items())


def test_prefill_groups_change_nothing_and_capacity_is_checked():
    L, E, k = 2, 8, 2
    all_hot = _random_pools(L, E)
    counts = np.arange(L * E, dtype=np.float64).reshape(L, E)
    row_map, owner, wc = _warm(counts, 4)
    cache = SlotCache.build(all_hot, host_tier(all_hot), row_map, wc, "lru", max_tokens=2, top_k=k)
    before = cache.pools.row_map.clone()
    cache.admit(0, torch.tensor([[0, 1], [2, 3], [4, 5]]))  # 3 tokens > max_tokens: prefill
    assert torch.equal(cache.pools.row_map, before) and cache.counters()["groups"] == 0
    with pytest.raises(CacheCapacityError, match="4 slots.*top_k 2 x 3 tokens"):
        SlotCache.build(all_hot, host_tier(all_hot), row_map, wc, "lru", max_tokens=3, top_k=k)


SPEC = SyntheticSpec(layers=4, experts=8, top_k=2, hidden=64, moe_intermediate=32, heads=2, kv_heads=1,
                     head_dim=32, vocab_size=512, seed=3, expert_gain=2.0, lm_successor_gain=1.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return synthetic_engine(SPEC, tmp_path_factory.mktemp("slots"))



def _engine_cache(engine, policy, residency, max_tokens):
    cfg = engine.config
    L, E = cfg.num_moe_layers, cfg.num_experts
    counts = np.random.default_rng(7).integers(0, 20, size=(L, E)).astype(np.float64)
    C = hot_count_for_residency(residency, L * E)
    row_map, owner, wc = _warm(counts, C)
    cache = SlotCache.build(engine.pools, host_tier(engine.pools), row_map, wc, policy, max_tokens, cfg.top_k)
    cache.profile_counts = counts  # for the simulator's warm start (test only)
    return cache, owner, wc


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_engine_hits_and_misses_per_step_equal_the_reference(engine, policy):
    """Batch 1, requests in order: the engine's per-(token, layer) counts are the simulator's (and
    the brute-force reference's) on the routing the engine itself recorded; its logits are bitwise
    the unmodified path's; and the run contains a token in which a slot is evicted and refilled
    again."""
    prompts = random_prompts(engine.config.vocab_size, 3)
    cache, owner, wc = _engine_cache(engine, policy, 0.125, 1)
    ref_fn, rowmap_fn, _ = gate.experts_functions(engine.device)
    groups, logits, ref_logits = [], [], []
    saved = engine.pools, engine.experts_fn
    try:
        for p in prompts:
            engine.pools, engine.experts_fn = cache.pools, cache.wrap(rowmap_fn)
            gen = generate(engine, [p], 12, capture_routing=True, progress=False, return_all_logits=True)
            logits.append(gen.all_logits)
            r = gen.routing[0]
            for tok in r.experts[r.num_prompt_tokens:].numpy():
                groups.extend((layer, tok[layer].astype(int).tolist()) for layer in range(len(tok)))
            engine.pools, engine.experts_fn = saved[0], ref_fn
            ref_logits.append(generate(engine, [p], 12, progress=False, return_all_logits=True).all_logits)
    finally:
        engine.pools, engine.experts_fn = saved
    cfg = engine.config
    want, fills = reference_cache(groups, cfg.num_experts, owner.tolist(), wc.tolist(), policy)
    got = cache.group_history()
    np.testing.assert_array_equal(got, want)
    sim = simulator_history(groups, cfg.num_moe_layers, cfg.num_experts, cache.profile_counts, cache.capacity,
                            policy, len(groups) // cfg.num_moe_layers)
    np.testing.assert_array_equal(got, sim)
    cache.check(contents=True)
    for a, b in zip(logits, ref_logits):
        assert torch.equal(a, b)
    L = engine.config.num_moe_layers
    refilled = [t for t in range(len(fills) // L)
                if any(len([1 for f in fills[t * L:(t + 1) * L] for s, _ in f if s == slot]) > 1
                       for slot in range(cache.capacity))]
    assert refilled, "no token evicted and refilled a slot twice: the test lost its point"
    assert want[:, 2].sum() > 0


@pytest.mark.parametrize("policy", ["lru", "lfu", "lru_guard"])
def test_dynamic_placement_passes_the_gate_at_batch_2(engine, policy):
    prompts = random_prompts(engine.config.vocab_size, 4, seed=1)
    ids = [f"p{i}" for i in range(len(prompts))]
    reference = gate.reference_decode(engine, prompts, 12, batch_size=2, progress=False)
    cache, _, _ = _engine_cache(engine, policy, 0.125, 2)
    got = gate.placement_decode(engine, cache.pools, prompts, 12, batch_size=2, progress=False, cache=cache)
    result = gate.compare(f"{policy}-0.25", ids, reference, got, cache.pools, engine)
    assert result.passed and result.tokens_matched == result.tokens_total
    assert cache.counters()["fills"] > 0
    cache.check(contents=True)


def test_a_corrupted_slot_fails_the_gate(engine):
    prompts = random_prompts(engine.config.vocab_size, 2, seed=2)
    ids = ["a", "b"]
    reference = gate.reference_decode(engine, prompts, 12, batch_size=1, progress=False)
    cache, _, _ = _engine_cache(engine, "lru", 0.5, 1)
    # A warm slot whose instance the first token uses: its weights scaled (wrong weights, valid map).
    routing = generate(engine, prompts[:1], 2, capture_routing=True, progress=False).routing[0]
    layer, expert = 0, int(routing.experts[routing.num_prompt_tokens - 1, 0, 0])
    rm = cache.pools.row_map
    if int(rm[layer, expert]) < 0:
        expert = next(e for e in range(engine.config.num_experts) if int(rm[layer, e]) >= 0)
    cache.pools.w13_hot[int(rm[layer, expert])] *= 1.5
    got = gate.placement_decode(engine, cache.pools, prompts, 12, batch_size=1, progress=False, cache=cache)
    result = gate.compare("lru-0.5", ids, reference, got, cache.pools, engine)
    assert not result.passed and not result.logits_bitwise_equal


def test_a_stale_fill_fails_the_gate(engine, monkeypatch):
    """A fill that never lands (the slot keeps its victim's weights) must be caught."""
    prompts = random_prompts(engine.config.vocab_size, 2, seed=3)
    ids = ["a", "b"]
    reference = gate.reference_decode(engine, prompts, 12, batch_size=1, progress=False)
    cache, _, _ = _engine_cache(engine, "lru", 0.25, 1)
    monkeypatch.setattr(SlotCache, "fill", lambda self, *a: None)
    got = gate.placement_decode(engine, cache.pools, prompts, 12, batch_size=1, progress=False, cache=cache)
    assert cache.counters()["fills"] > 0
    result = gate.compare("lru-0.25", ids, reference, got, cache.pools, engine)
    assert not result.passed
    with pytest.raises(ValueError, match="does not hold the weights"):
        cache.check(contents=True)


def test_dynamic_placement_file_is_the_warm_state(tmp_path):
    """lru-0.5 on disk: usage_global-0.5's row map plus each slot's profile count; the cache built
    from it evicts the least-used warm instance first."""
    import pandas as pd

    from coldset.analysis.placement import place
    from coldset.core.placement import load_placement, save_placement

    from coldset.engine.model import ModelConfig

    shape = ModelConfig.from_hf_config({
        "model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 4, "num_hidden_layers": 2,
        "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 4, "num_experts": 4,
        "num_experts_per_tok": 1, "moe_intermediate_size": 2, "rms_norm_eps": 1e-6})

    counts = {(0, 0): 5, (0, 1): 1, (0, 2): 7, (0, 3): 0, (1, 0): 2, (1, 1): 9, (1, 2): 3, (1, 3): 4}
    hist = pd.DataFrame([{"domain": "d", "split": "profile", "phase": "decode", "layer": layer, "expert": e,
                          "count": c} for (layer, e), c in counts.items()])
    lru = place(hist, shape, "lru", 0.5, batch_sizes=(1,))
    ug = place(hist, shape, "usage_global", 0.5, batch_sizes=(1,))
    assert np.array_equal(lru.row_map, ug.row_map) and lru.predictions == []
    save_placement(lru, tmp_path / "lru-0.5.json")
    back = load_placement(tmp_path / "lru-0.5.json")
    hot = [(layer, e) for layer in range(2) for e in range(4) if back.row_map[layer, e] >= 0]
    assert sorted(back.cache_warm_counts.tolist()) == sorted(counts[h] for h in hot) == [4, 5, 7, 9]
    for layer, e in hot:
        assert back.cache_warm_counts[back.row_map[layer, e]] == counts[(layer, e)]
    w13 = torch.randn((2, 4, 4, 4))
    all_hot = ExpertPools.all_hot(w13, torch.randn((2, 4, 4, 2)))
    cache = SlotCache.from_placement(all_hot, host_tier(all_hot), back, max_tokens=1, top_k=1)
    cache.admit(0, torch.tensor([[1]]))  # a miss: the victim is (1, 3), count 4, the least used
    assert int(cache.pools.row_map[1, 3]) < 0 and int(cache.pools.row_map[0, 1]) >= 0
    cache.check(contents=True)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "lfu", "lru_guard"])
def test_triton_decisions_equal_the_torch_path(policy):
    """On CUDA the decisions are one Triton launch (which also casts the router weights) and the
    fill another (its programmatic dependent on sm90+): the same state after every group as the
    torch path, the weights cast bitwise as ``Tensor.to``, and the slots hold their owners."""
    L, E, k, tokens, C = 3, 8, 2, 3, 13
    rng = np.random.default_rng(5)
    counts = rng.integers(0, 5, size=(L, E)).astype(np.float64)
    all_hot = _random_pools(L, E, dtype=torch.bfloat16)
    all_hot = ExpertPools.all_hot(all_hot.w13_hot.view(L, E, 8, 4).cuda(), all_hot.w2_hot.view(L, E, 4, 4).cuda())
    row_map, _, wc = _warm(counts, C)
    host = host_tier(all_hot)
    a = SlotCache.build(all_hot, host, row_map, wc, policy, max_tokens=tokens, top_k=k)
    b = SlotCache.build(all_hot, host, row_map, wc, policy, max_tokens=tokens, top_k=k)
    a.use_kernel = False
    assert b.use_kernel
    assert b.pdl == (torch.cuda.get_device_capability()[0] >= 9)
    for step in range(30):
        for layer in range(L):
            ids = torch.as_tensor(np.stack([rng.choice(E, size=k, replace=False) for _ in range(tokens)])).cuda()
            # float32 weights whose bfloat16 rounding is not a truncation (the cast rounds to nearest even)
            w = torch.as_tensor(rng.random((tokens, k)), dtype=torch.float32).cuda()
            if step % 2:  # the decisions alone (weights already cast, or none)
                assert a.admit(layer, ids) is None and b.admit(layer, ids) is None
            else:
                wa = a.admit(layer, ids, w, torch.bfloat16)
                wb = b.admit(layer, ids, w, torch.bfloat16)
                assert wb.dtype == torch.bfloat16 and wb.shape == w.shape
                assert torch.equal(wa, w.to(torch.bfloat16)) and torch.equal(wb, wa)
            for name in ("owner", "last_use", "count", "tick", "totals", "groups"):
                assert torch.equal(state(a, name), state(b, name)), name
            assert torch.equal(a.pools.row_map, b.pools.row_map)
    np.testing.assert_array_equal(a.group_history(), b.group_history())
    assert a.counters()["fills"] > 20
    b.check(contents=True)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "lfu", "lru_guard"])
def test_router_recorded_decisions_equal_the_torch_path(policy):
    """On CUDA the fused decode step records an lru/lfu group in the router's own launch (its last
    program, on the selections in registers) and the fill's blocks choose, commit and copy
    (``SlotCache.route``): the router's outputs are those of the plain router launch, and after
    every group the cache's state equals the torch path's and the standalone decisions kernel's;
    the fill's ticket is left at zero. ``COLDSET_TEST_DEVICE=cpu TRITON_INTERPRET=1`` runs it
    through Triton's interpreter (by hand)."""
    from coldset.kernels import triton_decode as td

    dev = os.environ.get("COLDSET_TEST_DEVICE", "cuda")
    dt = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter has no bfloat16
    L, E, k, tokens, C, H = 3, 8, 2, 3, 13, 32
    rng = np.random.default_rng(5)
    counts = rng.integers(0, 5, size=(L, E)).astype(np.float64)
    all_hot = _random_pools(L, E, dtype=dt)
    all_hot = ExpertPools.all_hot(all_hot.w13_hot.view(L, E, 8, 4).to(dev), all_hot.w2_hot.view(L, E, 4, 4).to(dev))
    row_map, _, wc = _warm(counts, C)
    host = host_tier(all_hot)
    ref, routed, alone = (SlotCache.build(all_hot, host, row_map, wc, policy, max_tokens=tokens, top_k=k)
                          for _ in range(3))
    plain = SlotCache.build(all_hot, host, row_map, wc, "lru", max_tokens=tokens, top_k=k)  # lru_guard's twin
    ref.use_kernel = plain.use_kernel = False
    if dev == "cpu":  # the interpreter: the kernel path by hand
        for c in (routed, alone):
            c.use_kernel, c.fill_ticket = True, torch.zeros(1, dtype=torch.int32)
    assert routed.records_in_route(tokens) and not routed.records_in_route(tokens + 1)
    gen = torch.Generator().manual_seed(3)
    gates = [torch.randn((E, H), generator=gen).to(dev, dt) for _ in range(L)]
    norm_w = (1 + 0.1 * torch.randn(H, generator=gen)).to(dev, dt)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    for step in range(30):
        for layer in range(L):
            x = torch.randn((tokens, H), generator=gen).to(dev, dt)
            h, ids, w = td.route(x, norm_w, 1e-6, gates[layer], k, True, counter, weights_dtype=dt)
            hr, ids_r, w_r = routed.route(layer, x, norm_w, 1e-6, gates[layer], k, True, counter, pdl=routed.pdl)
            assert torch.equal(hr, h) and torch.equal(ids_r, ids) and torch.equal(w_r, w)
            assert routed.admit(layer, ids_r, w_r, dt) is w_r  # recorded: no second decision
            ref.admit(layer, ids)
            alone.admit(layer, ids)
            plain.admit(layer, ids)
            for c in (routed, alone):
                for name in ("owner", "last_use", "count", "tick", "totals", "groups"):
                    assert torch.equal(state(ref, name), state(c, name)), (step, layer, name)
                assert torch.equal(ref.pools.row_map, c.pools.row_map), (step, layer)
            assert int(routed.fill_ticket) == 0
    np.testing.assert_array_equal(ref.group_history(), routed.group_history())
    assert ref.counters()["fills"] > 20
    # lru_guard read misses in place where lru would have evicted (else the guard went untested)
    if policy != "lfu":
        assert np.array_equal(plain.group_history(), ref.group_history()) == (policy == "lru")
    with pytest.raises(RuntimeError, match="router recorded layer 0"):
        routed.route(0, x, norm_w, 1e-6, gates[0], k, True, counter, pdl=routed.pdl)
        routed.admit(1, ids)
    routed.recorded_layer = None
    routed.check(contents=True)
    alone.check(contents=True)


@pytest.fixture(scope="module")
def graphed_model():
    from coldset.engine.synthetic import build_synthetic_model

    spec = SyntheticSpec(layers=4, experts=16, top_k=4, hidden=256, moe_intermediate=128, heads=4, kv_heads=2,
                         head_dim=64, vocab_size=1024, seed=5, in_memory=True)
    model, _ = build_synthetic_model(spec, "cuda", torch.bfloat16)
    model.compile_decode()
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("policy,bsz", [("lru", 1), ("lru", 2), ("lfu", 2), ("lru_guard", 2)])
def test_graphed_compiled_steps_with_the_cache_equal_the_simulator_and_the_unmodified_path(graphed_model, policy, bsz):
    """The CUDA step as the bench runs it (the fused decode region, the whole step one CUDA graph,
    the router's launch recording each group, the fill choosing, committing and copying as its
    programmatic dependent; at batch 1 the fused kernels launched as dependent launches): every step's
    logits bitwise those of the unmodified path's graphed step, the per-group hits, misses and
    fills those of ``coldset.analysis.simulate.simulate`` on the routing that path recorded, and every slot
    holding its owner's weights at the end."""
    model = graphed_model
    L, E, k = model.config.num_moe_layers, model.config.num_experts, model.config.top_k
    assert model._fused_head is not None, "the fused decode region (the router records the groups) is what this tests"
    cache, logits, ref_logits, routing, counts, C = _graphed_cache(model, policy, bsz=bsz)
    assert cache.records_in_route(bsz) and routing.shape[2] == bsz
    steps = len(logits)
    for s, (a, b) in enumerate(zip(logits, ref_logits)):
        assert torch.equal(a, b), f"step {s + 1}: logits differ from the unmodified path's"
    inst = (routing + (np.arange(L) * E)[None, :, None, None]).reshape(-1)
    sim = simulate(AccessStream(inst, np.arange(0, inst.size + 1, bsz * k), bsz * steps, L, E), policy, C, counts)
    np.testing.assert_array_equal(cache.group_history(), np.stack([sim.hits, sim.misses, sim.fills], axis=1))
    assert sim.fills.sum() > 0, "no miss: the test lost its point"
    cache.check(contents=True)


# ------------------------------------------------------------------------------------------------
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
    logits bitwise the unmodified path's; prefetches happened and were used."""
    cfg = engine.config
    L, E = cfg.num_moe_layers, cfg.num_experts
    prompts = random_prompts(cfg.vocab_size, 4, seed=5)
    cache, counts, C, groups, result = _lookahead_run(engine, 0.25, batch, depth, prompts)
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
    prefetched expert) must fail the gate and the contents check."""
    prompts = random_prompts(engine.config.vocab_size, 2, seed=6)
    real_fill = SlotCache.fill
    skipped = []

    def no_prefetch_copy(self, victims, new_inst, valid, m):
        if sys._getframe(1).f_code.co_name == "_prefetch":
            skipped.append(int(m))
            return
        real_fill(self, victims, new_inst, valid, m)

    monkeypatch.setattr(SlotCache, "fill", no_prefetch_copy)
    cache, _, _, _, result = _lookahead_run(engine, 0.25, 1, 1, prompts)
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
    only (0,0) and (0,1) are neither in the group nor in flight, so (1,0) (1,1) are admitted and
    (1,2) (1,3) read in place; the prefetched (1,4) (1,5) stay. The simulator agrees."""
    L, E, k, T = 2, 6, 2, 2
    counts = np.zeros((L, E))
    counts[0, :4] = [9, 8, 7, 6]
    row_map, _, wc = _warm(counts, 4)
    all_hot = _random_pools(L, E)
    routers = [torch.eye(E) for _ in range(L)]
    cache = SlotCache.build(all_hot, host_tier(all_hot), row_map, wc, "lookahead", T, k, routers=routers)
    forecast = torch.tensor([[0, 0, 0, 0, 2.0, 1.0]] * T)
    cache.admit(0, torch.tensor([[0, 1], [0, 1]]), hidden=forecast)
    assert cache.prefetch_lists()[0].tolist() == [E + 4, E + 5, -1, -1]
    assert int(cache.rules.prefetch_history[0]) == 2
    cache.admit(1, torch.tensor([[0, 1], [2, 3]]), hidden=forecast)
    rm = cache.pools.row_map
    assert [int(rm[1, e]) >= 0 for e in range(E)] == [True, True, False, False, True, True]
    assert [int(rm[0, e]) >= 0 for e in range(E)] == [False] * E
    np.testing.assert_array_equal(cache.group_history(), [[4, 0, 0], [0, 4, 4]])
    cache.check(contents=True)
    stream = AccessStream(np.array([0, 1, 0, 1, 6, 7, 8, 9]), np.array([0, 4, 8]), T, L, E)
    sim = simulate(stream, "lookahead", 4, counts, predictions=cache.prefetch_lists())
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
    for trial in range(4):
        counts = rng.integers(0, 9, size=(L, E)).astype(np.float64)
        C = int(rng.integers(k * T, k * T + 14))
        row_map, _, wc = _warm(counts, C)
        pools = _random_pools(L, E, seed=trial, dtype=torch.bfloat16)
        all_hot = ExpertPools.all_hot(pools.w13_hot.view(L, E, 8, 4).cuda(), pools.w2_hot.view(L, E, 4, 4).cuda())
        routers = [torch.as_tensor(rng.standard_normal((E, H)), dtype=torch.bfloat16).cuda() for _ in range(L)]
        host = host_tier(all_hot)
        a = SlotCache.build(all_hot, host, row_map, wc, "lookahead", T, k, routers=routers, depth=depth)
        b = SlotCache.build(all_hot, host, row_map, wc, "lookahead", T, k, routers=routers, depth=depth)
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
                for name in ("owner", "last_use", "count", "tick", "totals", "groups", "inflight",
                             "prediction_history", "prefetch_history", "history"):
                    assert torch.equal(state(a, name), state(b, name)), (name, trial, step, layer)
                assert torch.equal(a.pools.row_map, b.pools.row_map)
        assert int(b.rules.prefetch_history.sum()) > 0
        b.check(contents=True)
        a.check(contents=True)


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
    row_map, _, wc = _warm(counts, L * E // 2)
    pools = _random_pools(L, E, dtype=dt)
    all_hot = ExpertPools.all_hot(pools.w13_hot.view(L, E, 8, 4).to(dev), pools.w2_hot.view(L, E, 4, 4).to(dev))
    routers = [torch.as_tensor(rng.standard_normal((E, H)), dtype=dt).to(dev) for _ in range(L)]
    cache = SlotCache.build(all_hot, host_tier(all_hot), row_map, wc, "lookahead", T, k, routers=routers, depth=depth)
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


def _graphed_cache(model, policy, depth=0, patch=None, bsz=2, residency=0.25, forecaster=None):
    """The bench's CUDA step (compiled region, one CUDA graph a step) through a slot cache of
    ``policy`` at residency 0.25 (``lookahead``: of ``depth``; ``patch`` may alter the cache before
    the run) beside the unmodified path, whose routing is recorded: (cache, logits, reference
    logits, routing ``[steps, L, bsz, k]``, warm counts, C)."""
    from coldset.bench import decode as bench

    cfg = model.config
    L, E, k, plen, steps = cfg.num_moe_layers, cfg.num_experts, cfg.top_k, 8, 12
    ref_fn, rowmap_fn, _ = gate.experts_functions(torch.device("cuda"), None)
    prompts = torch.as_tensor(random_prompts(cfg.vocab_size, 1, seed=4)[0] * 8)[: bsz * plen].view(bsz, plen)
    rec = torch.zeros((L, bsz, k), dtype=torch.long, device="cuda")

    def recording(p, layer, x, ids, w):
        if x.shape[0] == bsz:
            rec[layer].copy_(ids)
        return ref_fn(p, layer, x, ids, w)

    def run(fn, pools, cache=None):
        model.pools, model.experts_fn = pools, fn
        dec = bench.Decoder(model, bsz, plen, steps + 1, True)
        tok = dec.prefill(prompts.cuda())
        dec.set_step(tok, 1)
        dec.capture()
        if cache is not None:
            cache.reset()
        logits, routing = [], []
        for s in range(1, steps + 1):
            dec.set_step(tok, s)
            lg = dec.step()
            logits.append(lg.clone())
            routing.append(rec.cpu().numpy().copy())
            tok = torch.argmax(lg, dim=-1)
        return logits, np.stack(routing)

    all_hot = model.pools
    try:
        ref_logits, routing = run(recording, all_hot)
        counts = np.random.default_rng(3).integers(0, 20, size=(L, E)).astype(np.float64)
        C = hot_count_for_residency(residency, L * E)
        row_map, _, wc = _warm(counts, C)
        ahead = dict(routers=[model.layers[i].mlp.gate.weight.detach() for i in cfg.moe_layers], depth=depth)
        if callable(forecaster):  # fitted on the unmodified run's routing
            forecaster = forecaster(routing)
        extra = ahead if policy == "lookahead" else dict(forecaster=forecaster) if policy == "nexttoken" else {}
        cache = SlotCache.build(all_hot, host_tier(all_hot), row_map, wc, policy, bsz, k,
                                history=(steps + 8) * L, **extra)
        if patch is not None:
            patch(cache)
        logits, _ = run(cache.wrap(rowmap_fn), cache.pools, cache)
    finally:
        model.pools, model.experts_fn = all_hot, ref_fn
    return cache, logits, ref_logits, routing, counts, C


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [1, 2])
def test_graphed_lookahead_steps_equal_the_simulator_and_the_unmodified_path(graphed_model, depth):
    """lookahead in the captured step (the fused router launch computing the forecast and making
    the whole decision, ``SlotCache.route``; prefetch copies forked onto the side stream inside the
    graph, joined before layer l + depth's experts): every step's logits bitwise the unmodified
    path's, per group hits, misses, fills and prefetches equal to ``coldset.analysis.simulate.simulate``'s
    'lookahead' on the engine's recorded lists, prefetches issued (each evicting a slot) and used."""
    model = graphed_model
    L, E, k = model.config.num_moe_layers, model.config.num_experts, model.config.top_k
    assert model._fused_head is not None, "the fused decode region (the router decides) is what this tests"
    cache, logits, ref_logits, routing, counts, C = _graphed_cache(model, "lookahead", depth)
    assert cache.records_in_route(routing.shape[2])
    for s, (a, b) in enumerate(zip(logits, ref_logits)):
        assert torch.equal(a, b), f"step {s + 1}: logits differ from the unmodified path's"
    bsz = routing.shape[2]
    inst = (routing + (np.arange(L) * E)[None, :, None, None]).reshape(-1)
    stream = AccessStream(inst, np.arange(0, inst.size + 1, bsz * k), bsz * len(logits), L, E)
    sim = simulate(stream, "lookahead", C, counts, predictions=cache.prefetch_lists())
    np.testing.assert_array_equal(cache.group_history(), np.stack([sim.hits, sim.misses, sim.fills], axis=1))
    np.testing.assert_array_equal(cache.rules.prefetch_history[:sim.hits.size].cpu().numpy(), sim.prefetches)
    assert sim.prefetches.sum() > 0 and sim.useful_prefetches > 0, "no prefetch used: the test lost its point"
    cache.check(contents=True)


@pytest.mark.gpu
def test_a_prefetch_joined_late_fails_the_gate_on_cuda(graphed_model, monkeypatch):
    """The prefetch copy is made slow (a 2 ms sleep on the side stream before it). Joined where it
    belongs (before layer l + depth's experts), the logits stay bitwise the unmodified path's; joined
    only at the end of the step (a stale join: layer l + depth reads a slot whose copy has not
    landed), they differ, so the parity gate fails."""
    from coldset.kernels import triton_slots

    real_fill = triton_slots.fill

    def slow_fill(pools, victims, instances, count, pdl=False, blocks=triton_slots.FILL_BLOCKS):
        if blocks != triton_slots.FILL_BLOCKS:
            torch.cuda._sleep(4_000_000)  # the prefetch copy (side stream, fewer blocks) lands late
        real_fill(pools, victims, instances, count, pdl=pdl, blocks=blocks)

    monkeypatch.setattr(triton_slots, "fill", slow_fill)
    cache, logits, ref, _, _, _ = _graphed_cache(graphed_model, "lookahead", 1)
    assert int(cache.rules.prefetch_history.sum()) > 0
    assert all(torch.equal(a, b) for a, b in zip(logits, ref)), "the join did not hold the slow copy back"

    def late(cache):
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
    assert np.array_equal(la.row_map, lru.row_map) and la.cache_lookahead_depth == 2 and lru.cache_lookahead_depth is None
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
    on the H200: 4 at b1, 1 at b8): the placement file keeps the mapping, and the cache built for a
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


# ------------------------------------------------------------------------------------------------
# nexttoken: the forecast of each layer's experts for the next token, prefetched beside the step


def _forecaster(L, E, k, seed, terms=((0, 0), (1, 0), (0, 1), (1, -1)), extra=3, unit=40, shift=2, keep=0):
    """A next-token forecaster with random integer tables (the rules, not the fit, are under test):
    terms reading this token's layer, the layer before, the last token's same and next layer;
    ``keep`` added on the first term's diagonal (the next token keeps this one's experts)."""
    from coldset.analysis.forecast import NextTokenForecaster

    rng = np.random.default_rng(seed)
    terms = tuple((a, d) for a, d in terms if abs(d) < L)
    tables = rng.integers(0, 60, size=(len(terms), L, E, E)).astype(np.int32)
    tables[0][:, np.arange(E), np.arange(E)] += keep
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


def _sim_next(stream, counts, C, lists, budget):
    from coldset.analysis.simulate import simulate

    sim = simulate(stream, "nexttoken", C, counts, predictions=lists, prefetch_budget=budget)
    return sim, np.stack([sim.hits, sim.misses, sim.fills, sim.prefetches], axis=1)


@pytest.mark.parametrize("tokens,budget", [(1, None), (3, None), (2, 2)])
def test_nexttoken_decisions_equal_the_simulator_on_random_streams(tokens, budget):
    """Random groups and tables, pools from one group's size up (the in-flight rule, the read in
    place of a miss without a free slot, predicted victims and a cut list all occur): the engine's
    candidate list of every group is coldset.analysis.forecast.nexttoken_lists' (the forecast, computed
    independently), its per-group hits, misses, fills and prefetches are coldset.analysis.simulate.simulate's
    'nexttoken' on the same tokens, no commit is refused, and every slot holds its owner."""
    L, E, k = 3, 8, 2
    rng = np.random.default_rng(tokens * 10 + (budget or 0))
    F = _forecaster(L, E, k, seed=tokens)
    prefetched = read_in_place = 0
    for trial in range(5):
        counts = rng.integers(0, 9, size=(L, E)).astype(np.float64)
        C = int(rng.integers(k * tokens, k * tokens + 10))
        row_map, _, wc = _warm(counts, C)
        all_hot = _random_pools(L, E, seed=trial)
        cache = SlotCache.build(all_hot, host_tier(all_hot), row_map, wc, "nexttoken", tokens, k, forecaster=F,
                                prefetch_budget=budget)
        S = 10
        # skewed draws: consecutive tokens reuse experts, so forecasts hit
        p = rng.dirichlet(np.ones(E) * 0.5, size=L)
        sel = np.stack([[[rng.choice(E, size=k, replace=False, p=p[layer]) for _ in range(tokens)]
                         for layer in range(L)] for _ in range(S)])
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
    assert prefetched > 10 and sim.useful_prefetches >= 0


def test_nexttoken_in_flight_and_predicted_slots_are_kept():
    """Hand-checked, 2 layers x 4 experts, top-1, 1 token, 3 slots warm with (0,0) (0,1) (1,0)
    (counts 5, 6, 7). Tables: after expert e every layer forecasts e + 1 (mod 4) first, then e.
    Step 0: layer 0 selects 0 (hit); forecast [1, 0, 2, 3][:n=2] = [(0,1), (0,0)]: both resident,
    no prefetch. Layer 1 selects 2 (miss): demand victims exclude the predicted (0,0) (0,1), so
    (1,0) goes; forecast [(1,3), (1,2)]: (1,3) missing, every other slot is predicted or used: no
    victim, nothing issued. Step 1: layer 0 selects 1 (hit), forecast [(0,2), (0,1)]: (0,0) is no
    longer predicted and becomes the victim of (0,2), in flight; layer 1 selects 3: a miss whose
    candidates are all predicted ((0,1), (1,2)) or in flight ((0,2)): the least recent predicted one,
    (1,2), goes; forecast [(1,0), (1,3)]: no unpredicted, unused slot out of flight, nothing issued."""
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
    cache = SlotCache.build(all_hot, host_tier(all_hot), row_map, wc, "nexttoken", 1, k, forecaster=F)
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
    np.testing.assert_array_equal(_next_history(cache), _sim_next(stream, counts, 3, lists, None)[1])
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
    cache = SlotCache.build(engine.pools, host_tier(engine.pools), row_map, wc, "nexttoken", batch, k, forecaster=F)
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
    cache, logits, ref, routing, counts, C, F = _next_engine_run(engine, batch, 0.5, prompts)
    assert torch.equal(logits, ref)
    _assert_next_run_is_the_simulators(cache, routing, counts, C, F)


def _assert_next_run_is_the_simulators(cache, routing, counts, C, F):
    """A nexttoken run's checks beside its logits: the recorded lists are nexttoken_lists on the
    engine's own routing, the per-group counts simulate's on them, some prefetch was issued and
    used, no commit refused, the cache's state consistent."""
    stream, lists = _next_reference(routing, F, None)
    np.testing.assert_array_equal(cache.prefetch_lists(), lists)
    sim, want = _sim_next(stream, counts, C, lists, None)
    np.testing.assert_array_equal(_next_history(cache), want)
    assert sim.prefetches.sum() > 0 and sim.useful_prefetches > 0, "no prefetch used: the test lost its point"
    assert cache.counters()["stale"] == 0
    cache.check(contents=True)


def test_a_prefetch_that_never_lands_is_never_committed(engine):
    """The prefetch copy is sabotaged (nothing copied, no tag written back): the commit finds the
    slot's tag unwritten and leaves the instance on its host row (counted as stale), so no kernel
    reads the unfilled slot: the logits stay bitwise the unmodified path's."""
    prompts = np.random.default_rng(6).integers(0, engine.config.vocab_size, size=(1, 8)).tolist()

    def sabotage(cache):
        real = cache.fill

        def fill(victims, new_inst, valid, m, tags=None):
            if tags is None:
                real(victims, new_inst, valid, m)

        cache.fill = fill

    cache, logits, ref, *_ = _next_engine_run(engine, 1, 0.5, prompts, sabotage=sabotage)
    c = cache.counters()
    assert c["prefetches"] > 0 and c["stale"] == c["prefetches"]
    assert torch.equal(logits, ref)


_STATE = ("owner", "last_use", "count", "tick", "totals", "groups", "inflight", "predicted", "tags", "selections",
          "step", "seq_history", "prediction_history", "prefetch_history", "pf_count", "stale")


def _same_next_state(a, b, where):
    for name in _STATE:
        assert torch.equal(state(a, name), state(b, name)), (where, name)
    assert torch.equal(a.pools.row_map, b.pools.row_map), where
    for layer, cnt in enumerate(a.rules.pf_count.reshape(-1).tolist()):  # the issued lists, up to their counts
        for name in ("pf_victims", "pf_new", "pf_tags"):
            assert torch.equal(state(a, name)[layer, :cnt], state(b, name)[layer, :cnt]), (where, name, layer)


@pytest.mark.gpu
def test_router_recorded_nexttoken_equals_the_torch_path(monkeypatch):
    """nexttoken on CUDA as the fused step runs it (``SlotCache.route``): the router's launch
    records the group, the fill's blocks choose the demand victims by (predicted, recency) past the
    in-flight slots, commit and copy; the forecast and prefetch decisions run on the decisions stream
    (one launch) and the tagged copy on the copy stream; the step's end joins them and commits by
    tag. After every group the whole state equals the torch path's (row map, owners, recency,
    flags, tags, ring, per-sequence history, lists and counts), and after each step's commit too;
    the slots hold their owners. The second cache's prefetch victims are scanned in tiles smaller
    than the cache (``SCAN_TILE`` 2: the tile is the prefetch span's power of two, the picks merged
    across tiles). ``COLDSET_TEST_DEVICE=cpu TRITON_INTERPRET=1`` runs it through Triton's
    interpreter (by hand)."""
    from coldset.kernels import triton_decode as td
    from coldset.kernels import triton_slots as ts

    dev = os.environ.get("COLDSET_TEST_DEVICE", "cuda")
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    L, E, k, tokens, H = 3, 8, 2, 3, 32
    F = _forecaster(L, E, k, seed=4, extra=1, keep=100)
    rng = np.random.default_rng(8)
    gen = torch.Generator().manual_seed(3)
    gates = [torch.randn((E, H), generator=gen).to(dev, dt) for _ in range(L)]
    norm_w = (1 + 0.1 * torch.randn(H, generator=gen)).to(dev, dt)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    issued = 0
    for C, budget, tile in ((k * tokens + 2, None, ts.SCAN_TILE), (15, 2, 2)):
        monkeypatch.setattr(ts, "SCAN_TILE", tile)
        counts = rng.integers(0, 9, size=(L, E)).astype(np.float64)
        row_map, _, wc = _warm(counts, C)
        pools = _random_pools(L, E, dtype=dt)
        all_hot = ExpertPools.all_hot(pools.w13_hot.view(L, E, 8, 4).to(dev), pools.w2_hot.view(L, E, 4, 4).to(dev))
        host = host_tier(all_hot)
        ref, routed = (SlotCache.build(all_hot, host, row_map, wc, "nexttoken", tokens, k, forecaster=F,
                                       prefetch_budget=budget) for _ in range(2))
        ref.use_kernel = False
        if dev == "cpu":  # the interpreter: the kernel path by hand
            routed.use_kernel = True
            routed.fill_ticket = torch.zeros(1, dtype=torch.int32)
            routed.rules.copy_ticket = torch.zeros(1, dtype=torch.int32)
        assert routed.records_in_route(tokens)
        if tile == 2:  # more than one tile
            assert ts._scan_size(C, max(2, ts._next_pow2(routed.rules.pf_victims.shape[1]))) < C
        for step in range(6):
            for layer in range(L):
                x = torch.randn((tokens, H), generator=gen).to(dev, dt)
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
            assert torch.equal(ref.done, routed.done)
            assert int(routed.fill_ticket) == 0 and int(routed.rules.copy_ticket) == 0
        assert routed.counters()["stale"] == 0
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


# ------------------------------------------------------------------ block-FP8 experts in the slots (issue 29)

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
    for bit; the slots hold their owners' weights and scales at the end. ``COLDSET_TEST_DEVICE=cpu
    TRITON_INTERPRET=1`` runs it through Triton's interpreter (by hand; there the router-recorded
    fill and the prefetch copies run 4 blocks per weight, lookahead's demand fill the default)."""
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
    extra = (dict(forecaster=_forecaster(L, E, k, seed=4, extra=1, keep=100)) if policy == "nexttoken"
             else dict(routers=gates, depth=1) if policy == "lookahead" else {})
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
            assert torch.equal(ref.pools.row_map, routed.pools.row_map) and torch.equal(ref.done, routed.done)
    assert int(routed.fill_ticket) == 0
    assert ref.counters()["fills"] >= 3 and ref.counters() == routed.counters()
    if policy != "lru":
        assert routed.counters()["prefetches"] > 0
    if policy == "nexttoken":
        assert routed.counters()["stale"] == 0
    routed.check(contents=True)
    ref.check(contents=True)


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
