"""The engine's slot cache (coldset.engine.cache.pool) against the trace simulator (coldset.analysis.simulate) and a
brute-force reference of the cache semantics (coldset.analysis.simulate's module doc), and its parity with
the unmodified path."""

import os

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
    the list of (slot, admitted instance). ``lru_guard`` and ``lfu`` (``num_layers`` L): victims
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
        barred = set().union(*recent[-num_layers:]) if policy in ("lru_guard", "lfu") else group
        candidates = [r for r in slot_of if r not in barred]
        if policy in ("lru", "lru_guard"):
            candidates.sort(key=lambda r: last_use[r])
        elif policy == "mru":
            candidates.sort(key=lambda r: -last_use[r])
        else:
            candidates.sort(key=lambda r: (count.get(r, 0.0), last_use[r]))
        assert policy in ("lru_guard", "lfu") or len(candidates) >= len(missed)
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
    the unmodified path's; and under lru the run contains a token in which a slot is evicted and
    refilled again (never under lfu, which keeps lru_guard's bar)."""
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
    want, fills = reference_cache(groups, cfg.num_experts, owner.tolist(), wc.tolist(), policy, cfg.num_moe_layers)
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
    # lfu keeps lru_guard's bar: no slot is refilled twice within a step (L groups)
    assert bool(refilled) == (policy == "lru"), "a slot evicted and refilled within a token: lru only"
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



def graphed_runner(model, bsz: int, steps: int, plen: int = 8):
    """``(run, recording, ref_fn, rowmap_fn)`` for the bench's CUDA step (compiled region, one CUDA
    graph a step) on ``bsz`` random prompts of ``plen`` tokens. ``run(experts_fn, pools, cache=None)``
    prefills, captures, resets ``cache``, decodes ``steps`` greedy steps and returns (the logits of
    each step, the routing ``[steps, L, bsz, k]`` that ``recording``, the unmodified experts function
    wrapped, saw); ``rowmap_fn`` is the row-map experts function a cache wraps."""
    from coldset.bench import decode as bench

    cfg = model.config
    ref_fn, rowmap_fn, _ = gate.experts_functions(torch.device("cuda"), None)
    prompts = torch.as_tensor(random_prompts(cfg.vocab_size, 1, seed=4)[0] * 8)[: bsz * plen].view(bsz, plen)
    rec = torch.zeros((cfg.num_moe_layers, bsz, cfg.top_k), dtype=torch.long, device="cuda")

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

    return run, recording, ref_fn, rowmap_fn


def _graphed_cache(model, policy, depth=0, patch=None, bsz=2, residency=0.25, forecaster=None):
    """The bench's CUDA step (compiled region, one CUDA graph a step) through a slot cache of
    ``policy`` at residency 0.25 (``lookahead``: of ``depth``; ``patch`` may alter the cache before
    the run) beside the unmodified path, whose routing is recorded: (cache, logits, reference
    logits, routing ``[steps, L, bsz, k]``, warm counts, C)."""
    cfg = model.config
    L, E, k, steps = cfg.num_moe_layers, cfg.num_experts, cfg.top_k, 12
    run, recording, ref_fn, rowmap_fn = graphed_runner(model, bsz, steps)

    all_hot = model.pools
    try:
        ref_logits, routing = run(recording, all_hot)
        counts = np.random.default_rng(3).integers(0, 20, size=(L, E)).astype(np.float64)
        C = hot_count_for_residency(residency, L * E)
        row_map, _, wc = _warm(counts, C)
        ahead = dict(routers=[model.layers[i].mlp.gate.weight.detach() for i in cfg.moe_layers], depth=depth)
        if callable(forecaster):  # fitted on the unmodified run's routing
            forecaster = forecaster(routing)
        # nexttoken without the gate: the captured prefetch is under test, whatever the forecast's precision
        extra = (ahead if policy == "lookahead" else dict(forecaster=forecaster, prefetch_gate=False)
                 if policy == "nexttoken" else {})
        cache = SlotCache.build(all_hot, host_tier(all_hot), row_map, wc, policy, bsz, k,
                                history=(steps + 8) * L, **extra)
        if patch is not None:
            patch(cache)
        logits, _ = run(cache.wrap(rowmap_fn), cache.pools, cache)
    finally:
        model.pools, model.experts_fn = all_hot, ref_fn
    return cache, logits, ref_logits, routing, counts, C
