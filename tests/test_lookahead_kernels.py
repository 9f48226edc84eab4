"""lookahead's CUDA launches (coldset.kernels.triton_slots: the forecast GEMV ``forecast_logits`` and
the decisions ``decide_ahead`` with its sort-based top-k) run on the CPU through Triton's
interpreter, in a subprocess with ``TRITON_INTERPRET=1`` (skipped where triton is not importable;
``PYTHONPATH=<triton>:src``). The GEMV against float64 within the float32 summation bound; the
decisions against the torch path (the simulator's ``lookahead`` rules; a stable sort of the
negated logits, ties to the lower id) on random and tie-heavy logits, every state bitwise. Neither
launch has been timed on a GPU yet; these check what they compute, not what they cost."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from interpreter_helpers import LEAN_INTERPRETER

_GEMV = r"""
import numpy as np
import torch
from coldset.kernels import triton_slots as ts

g = torch.Generator().manual_seed(0)
U = 2.0 ** -24  # float32's unit roundoff
# (tokens, hidden, experts, dtype, products per iteration): E not a multiple of the 2 experts a
# program, tokens padded to a power of two, one chunk of hidden or (a small tile) a loop over
# chunks with a ragged tail
for T, H, E, dt, tile in [(1, 40, 6, torch.float32, 4096), (3, 100, 7, torch.float16, 4096),
                          (5, 100, 10, torch.float32, 64), (2, 257, 16, torch.float16, 128)]:
    ts.FORECAST_TILE = tile
    wide = torch.randn(T, H + 3, generator=g).to(dt)
    x = wide[:, 2:H + 2]  # rows of a wider tensor: a row stride of H + 3
    w = torch.randn(E, H, generator=g).to(dt)
    out = torch.full((T, E), float("nan"))
    assert ts.forecast_logits(x, w, out) is out
    ref = x.double() @ w.double().T
    # any float32 summation order of H products (each exact for float16 operands, rounded once
    # for float32 ones): |error| <= gamma_{H+1} * sum_h |x_h w_h|
    gamma = (H + 1) * U / (1 - (H + 1) * U)
    bound = gamma * (x.double().abs() @ w.double().abs().T)
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), (T, H, E, dt, float((err - bound).max()))
    assert float(ref.abs().min()) > 0  # nothing compared against zeros
ts.FORECAST_TILE = 4096
x, w = torch.randn(2, 8), torch.randn(4, 8)
for args, what in [((x, w, torch.empty(2, 3)), "out must be float32"), ((x, w.T, torch.empty(2, 4)), "weight must"),
                   ((x.T, w, torch.empty(8, 4)), "x must"),
                   ((x, w, torch.empty(2, 4, dtype=torch.float64)), "out must")]:
    try:
        ts.forecast_logits(*args)
    except ValueError as e:
        assert what in str(e), (what, e)
    else:
        raise AssertionError(what)
print("INTERPRETED OK")
"""

# the interpreted scripts' common start: the slot cache on small pools, the fill in fewer programs
_FILL_PRELUDE = r"""
import sys
import numpy as np
import torch
sys.path.insert(0, sys.argv[1])
from test_slots import _random_pools, _warm, state
from coldset.kernels import triton_slots as ts
from coldset.engine.cache.pool import SlotCache
from coldset.kernels.tiers import host_tier

real_fill = ts.fill

def small_fill(pools, victims, inst, count, pdl=False, blocks=4, tags=None):
    # the same copies with fewer interpreted programs (a block copies its stripe of a row: any
    # number of blocks copies whole rows)
    return real_fill(pools, victims, inst, count, pdl=pdl, blocks=min(blocks, 4), tags=tags)

ts.fill = small_fill
"""

_DECIDE = _FILL_PRELUDE + r"""
TIES = np.array([-np.inf, -1.0, -0.0, 0.0, 1.0, 2.0, np.inf], dtype=np.float32)
STATE = ("owner", "last_use", "count", "tick", "totals", "groups", "inflight", "gate_state", "prediction_history",
         "prefetch_history", "history")

def logits_of(rng, kind, T, E):
    if kind == "random":
        return torch.as_tensor(rng.standard_normal((T, E)), dtype=torch.float32)
    # tie-heavy: few distinct values, -0.0 beside +0.0 (equal, so a tie), infinities
    return torch.as_tensor(rng.choice(TIES, size=(T, E), p=[0.05, 0.2, 0.2, 0.2, 0.2, 0.1, 0.05]))

prefetched = {}
# (layers, experts, top_k, tokens, depth, logits, seed): E and k both powers of two or not
for L, E, k, T, depth, kind, seed in [(3, 6, 2, 2, 1, "ties", 0), (4, 8, 3, 3, 2, "ties", 1),
                                      (3, 6, 2, 2, 1, "random", 2), (3, 8, 3, 3, 1, "random", 3),
                                      (3, 4, 2, 1, 1, "ties", 4), (4, 8, 3, 8, 1, "ties", 6)]:
    # (the last: 8 tokens, 24 list lanes of 32 over 8 experts: most experts repeat across tokens)
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 9, size=(L, E)).astype(np.float64)
    C = int(rng.integers(k * T + 2, min(k * T + 6, L * E)))
    row_map, _, wc = _warm(counts, C)
    all_hot = _random_pools(L, E, seed=seed)
    host = host_tier(all_hot)
    routers = [torch.zeros(E, 4) for _ in range(L)]  # not read: the logits are handed in
    # the gate's sums are kept (and compared) but it never closes: prefetches to compare in every case
    ref, ker = (SlotCache.build(all_hot, host, row_map, wc, "lookahead", T, k, routers=routers, depth=depth,
                                prefetch_gate=False)
                for _ in range(2))
    for c in (ref, ker):  # the router input stands for the logits themselves: both paths rank the same
        c.rules.forecast_logits = lambda _cache, hidden, target, pdl=False: hidden
    ker.use_kernel, ker.fill_ticket = True, torch.zeros(1, dtype=torch.int32)  # the kernel path by hand
    # odd seeds: the victim scans in tiles smaller than the cache (more than one, picks merged across them)
    ts.SCAN_TILE = 2 if seed % 2 else 1024
    scan = ts._ahead_sizes(ker)["SCAN"]
    assert (scan < C) == bool(seed % 2), (seed, scan, C)
    for step in range(4):
        for layer in range(L):
            ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])
            if step % 2 and T > 1:
                ids[1] = ids[0]
            ids = torch.as_tensor(ids)
            lg = logits_of(rng, kind, T, E)
            w = torch.as_tensor(rng.random((T, k)), dtype=torch.float32)
            ref.admit(layer, ids, w, torch.float32, hidden=lg)
            ker.admit(layer, ids, w, torch.float32, hidden=lg)
            for name in STATE:
                assert torch.equal(state(ref, name), state(ker, name)), (name, kind, seed, step, layer)
            assert torch.equal(ref.pools.row_map, ker.pools.row_map), (kind, seed, step, layer)
            # the recorded list by numpy: each token's k best (a stable sort of the negated logits,
            # ties to the lower id; -0.0 equals 0.0), token by token, first occurrence kept
            want = np.full(T * k, -1)
            if layer + depth < L:
                top = np.argsort(-lg.numpy(), axis=1, kind="stable")[:, :k].reshape(-1)
                keep = top[np.sort(np.unique(top, return_index=True)[1])] + (layer + depth) * E
                want[:keep.size] = keep
            got = ker.rules.prediction_history[int(ker.groups) - 1].numpy()
            assert np.array_equal(got, want), (kind, seed, step, layer, got, want)
    ker.check(contents=True)
    prefetched[(kind, seed)] = int(ker.rules.prefetch_history.sum())
assert all(v > 0 for v in prefetched.values()), prefetched
print("INTERPRETED OK", prefetched)
"""

_ROUTE = r"""
import sys
import numpy as np
import torch
sys.path.insert(0, sys.argv[1])
from test_slots import _random_pools, _warm, state
from coldset.kernels import triton_decode as td
from coldset.kernels import triton_slots as ts
from coldset.engine.cache.pool import SlotCache
from coldset.kernels.tiers import host_tier

real_fill = ts.fill

def small_fill(pools, victims, inst, count, pdl=False, blocks=4, tags=None):
    return real_fill(pools, victims, inst, count, pdl=pdl, blocks=min(blocks, 4), tags=tags)

dev = sys.argv[2] if len(sys.argv) > 2 else "cpu"
dt = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter has no bfloat16
if dev == "cpu":
    ts.fill = small_fill
U = 2.0 ** -24
STATE = ("owner", "last_use", "count", "tick", "totals", "groups", "inflight", "gate_state", "prediction_history",
         "prefetch_history", "history", "victims", "admitted", "num_misses", "pf_victims", "pf_new", "pf_count")
prefetched = {}


def variants():  # the router launch's compiled variants so far (Triton's cache; none under the interpreter)
    return sum(len(c[0]) for c in td._route_kernel.device_caches.values()) if dev == "cuda" else 0


# (layers, experts, top_k, tokens, depth, routers, seed): tie-heavy routers repeat a few rows (one
# of them zero), so logits tie exactly (and -0.0 meets +0.0) in the routing and in the forecast
gate_closed = 0  # groups after which a gated cache's gate was closed
for L, E, k, T, depth, kind, seed in [(4, 8, 2, 3, 1, "ties", 0), (4, 6, 3, 2, 2, "random", 1),
                                      (3, 8, 2, 3, 1, "random", 2), (3, 6, 2, 2, 2, "ties", 3),
                                      (3, 4, 2, 1, 1, "ties", 4)]:
    H = 24
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":
        rows = torch.cat([torch.zeros(1, H), torch.randn(2, H, generator=g)])
        gates = [rows[torch.as_tensor(rng.integers(0, 3, size=E))].to(dev, dt).contiguous() for _ in range(L)]
    else:
        gates = [torch.randn(E, H, generator=g).to(dev, dt) for _ in range(L)]
    norm_w = (1 + 0.1 * torch.randn(H, generator=g)).to(dev, dt)
    counts = rng.integers(0, 9, size=(L, E)).astype(np.float64)
    # (up to a step's selections and more: room for prefetches past lru_guard's bar)
    C = int(rng.integers(k * T + 1, min(k * T * L + 2, L * E)))
    row_map, _, wc = _warm(counts, C)
    all_hot = _random_pools(L, E, seed=seed, dtype=dt)
    all_hot = type(all_hot).all_hot(all_hot.w13_hot.view(L, E, 8, 4).to(dev), all_hot.w2_hot.view(L, E, 4, 4).to(dev))
    host = host_tier(all_hot)
    # even seeds with the gate at lead unit 16 (its cap: a 64th of a copy a group, one copy in all), its sums
    # set open by hand (a copy of saving, as after a useful list): it closes once a wasted entry is judged, and
    # both launches' list parts issue nothing then; odd seeds without
    routed, alone = (SlotCache.build(all_hot, host, row_map, wc, "lookahead", T, k, routers=gates, depth=depth,
                                     prefetch_gate=seed % 2 == 0, lead_unit=16)
                     for _ in range(2))
    for c in (routed, alone):
        c.rules.gate_acc.copy_(torch.tensor([0, 0, 1024]))
    assert routed.rules.list_after_experts == alone.rules.list_after_experts == (depth >= 2)  # build()'s choice
    routed.rules.list_after_experts = seed in (1, 2)  # the list and prefetch forked after the experts (experts_done)
    if dev == "cpu":
        for c in (routed, alone):  # the kernel path by hand
            c.use_kernel, c.fill_ticket = True, torch.zeros(1, dtype=torch.int32)
    # odd seeds: the victim scans in tiles smaller than the cache (more than one, picks merged across them)
    ts.SCAN_TILE = 2 if seed % 2 else 1024
    assert (ts._ahead_sizes(routed)["SCAN"] < C) == bool(seed % 2), (seed, C)
    assert routed.records_in_route(T) and not routed.records_in_route(T + 1)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    fc = {}
    compiled = variants()
    alone.rules.forecast_logits = lambda _cache, hidden, target, pdl=False: fc["now"]  # the routed launch's own logits
    for step in range(3):
        for layer in range(L):
            x = torch.randn((T, H), generator=g).to(dev, dt)
            if kind == "ties" and step == 1:
                x[-1] = x[0]  # two tokens with the same selections and forecast
            h, ids, w = td.route(x, norm_w, 1e-6, gates[layer], k, True, counter, weights_dtype=dt)
            routed.rules.forecast_out.fill_(float("nan"))
            hr, ids_r, w_r = routed.route(layer, x, norm_w, 1e-6, gates[layer], k, True, counter, pdl=routed.pdl)
            # (a) the routing is the plain launch's, bitwise; the forecast within the float32 bound
            assert torch.equal(hr, h) and torch.equal(ids_r, ids) and torch.equal(w_r, w), (seed, step, layer)
            assert int(counter) == 0
            target = layer + depth
            if target < L:
                f = routed.rules.forecast_out[:T].clone()
                ref = h.double() @ gates[target].double().T
                bound = (H + 1) * U / (1 - (H + 1) * U) * (h.double().abs() @ gates[target].double().abs().T)
                assert bool(((f.double() - ref).abs() <= bound).all()), (seed, step, layer)
                fc["now"] = f
            else:
                assert bool(routed.rules.forecast_out.isnan().all())  # no forecast past the last layer
            assert routed.admit(layer, ids_r, w_r, dt) is w_r  # decided in the route: no second decision
            assert (routed.rules.deferred_fork is not None) == (routed.rules.list_after_experts and target < L)
            routed.experts_done(layer)  # (what wrap()'s experts function calls after the experts)
            assert routed.rules.deferred_fork is None
            # (b) decide_ahead's launch on the same selections and logits: the same state, bitwise
            alone.admit(layer, ids_r, w_r, dt, hidden=hr)
            if dev == "cuda":  # the routed cache's list decisions run on its decisions stream
                torch.cuda.synchronize()
            for name in STATE:
                assert torch.equal(state(routed, name), state(alone, name)), (name, kind, seed, step, layer)
            assert torch.equal(routed.pools.row_map, alone.pools.row_map), (kind, seed, step, layer)
            acc = routed.rules.gate_acc.tolist()  # the next list is not issued where the gate is closed:
            gate_closed += routed.rules.gate_on and not min(acc[2], 64 * 16) > acc[0] - acc[1] + acc[0] // 32
    # (c) one compiled router launch for every layer: the plain one, lookahead's with a forecast and
    # without (the last layers), whatever the layer, its target or a new step (PER_LAYER_ARGS)
    assert variants() - compiled <= 3, (kind, seed, variants() - compiled)
    routed.check(contents=True)
    alone.check(contents=True)
    prefetched[(kind, seed)] = int(routed.rules.prefetch_history.sum())
assert all(v > 0 for v in prefetched.values()), prefetched
assert gate_closed > 0, "the gate never closed: its closed path untested"
try:
    td.route(x, norm_w, 1e-6, gates[0], k, True, counter,
             ahead=ts.route_ahead_args(routed, 0, 1, False, x.shape[0] * k),
             record=ts.route_record_args(routed, 0))
except ValueError as e:
    assert "give one" in str(e)
else:
    raise AssertionError("record and ahead together")
print("INTERPRETED OK", prefetched)
"""

_SCAN = r"""
import sys
import numpy as np
import torch
import triton
import triton.language as tl
from coldset.kernels import triton_slots as ts


@triton.jit
def scan_kernel(t0, owner_ptr, last_use_ptr, inflight_ptr, extra_ptr, bound, C, out_ptr, E: tl.constexpr,
                SCAN: tl.constexpr, MV: tl.constexpr, BAR: tl.constexpr):
    slots, olds, free = ts._least_recent(t0, owner_ptr, last_use_ptr, inflight_ptr, extra_ptr, bound, C, E, SCAN,
                                         MV, BAR)
    j = tl.arange(0, MV)
    tl.store(out_ptr + j, slots)
    tl.store(out_ptr + MV + j, olds)
    tl.store(out_ptr + 2 * MV, free.to(tl.int64))


rng = np.random.default_rng(0)
seen = {"tiles>2": 0, "free<MV": 0, "free>MV": 0, "tie picked": 0, "tie across tiles": 0}
L, E = 4, 6
for trial in range(48):
    C = int(rng.integers(3, L * E + 1))
    scan, mv = [(2, 2), (4, 2), (4, 4), (8, 4), (8, 8), (32, 4)][trial % 6]
    bar = trial % 3  # none, a layer bound, a flag
    owner = rng.permutation(L * E)[:C].astype(np.int64)
    # few distinct recencies (ties), warm ones negative; an instance's recency at or after t0 is the group's
    lu = rng.integers(-C, 8, size=L * E).astype(np.int64)
    t0 = int(rng.integers(0, 9))
    infl = (rng.random(L * E) < 0.25).astype(np.uint8)
    extra = (rng.random(L * E) < 0.25).astype(np.uint8)
    bound = int(rng.integers(0, L))
    out = torch.full((2 * mv + 1,), -7, dtype=torch.int64)
    scan_kernel[(1,)](t0, torch.as_tensor(owner), torch.as_tensor(lu), torch.as_tensor(infl), torch.as_tensor(extra),
                      bound, C, out, E=E, SCAN=scan, MV=mv, BAR=bar)
    # brute force: the slots not barred, by (recency, slot)
    own_lu = lu[owner]
    barred = (own_lu >= t0) | (infl[owner] != 0)
    if bar == 1:
        barred |= owner // E > bound
    if bar == 2:
        barred |= extra[owner] != 0
    cand = sorted((int(own_lu[s]), s) for s in range(C) if not barred[s])
    n = min(len(cand), mv)
    want = [s for _, s in cand[:n]] + [0] * (mv - n)
    got = out.numpy()
    assert got[:mv].tolist() == want, (trial, C, scan, mv, bar, got[:mv], want)
    assert got[mv:2 * mv].tolist() == [int(owner[s]) for s in want[:n]] + [0] * (mv - n), (trial, got)
    assert got[2 * mv] == len(cand), (trial, got[2 * mv], len(cand))
    seen["tiles>2"] += C > 2 * scan
    seen["free<MV"] += len(cand) < mv
    seen["free>MV"] += len(cand) > mv
    picked = cand[:n]
    seen["tie picked"] += any(a[0] == b[0] for a, b in zip(picked, picked[1:]))
    seen["tie across tiles"] += any(a[0] == b[0] and a[1] // scan != b[1] // scan for a, b in zip(picked, picked[1:]))
assert all(v > 0 for v in seen.values()), seen
# the tile the package picks: SCAN_TILE, fewer for a small cache, never fewer than the picks
assert ts._scan_size(6144, 8) == ts.SCAN_TILE and ts._scan_size(12, 2) == 16 and ts._scan_size(5, 8, 2) == 8
for capacity, tile, what in [(16385, ts.SCAN_TILE, "capacity 16385"), (0, ts.SCAN_TILE, "capacity 0"),
                             (64, 48, "not a power of two")]:
    ts.SCAN_TILE, keep = tile, ts.SCAN_TILE
    try:
        ts._scan_size(capacity, 2)
    except ValueError as e:
        assert what in str(e), (what, e)
    else:
        raise AssertionError(what)
    finally:
        ts.SCAN_TILE = keep
print("INTERPRETED OK", seen)
"""

_ENGINE = r"""
import functools
import sys
import numpy as np
import torch
sys.path.insert(0, sys.argv[1])
from synthetic_engines import random_prompts
from test_slots import _warm, state
from coldset.verify import gate
from coldset.analysis.simulate import simulate
from coldset.analysis.streams import AccessStream
from coldset.kernels import triton_slots as ts
from coldset.engine.model import fused_layer_before_experts, fused_norm_lm_head
from coldset.analysis.placement import hot_count_for_residency
from coldset.engine.cache.pool import SlotCache
from coldset.engine.synthetic import SyntheticSpec, build_synthetic_model
from coldset.kernels.tiers import host_tier

ts.FILL_BLOCKS = 4  # the same copies with fewer interpreted programs
ts.SCAN_TILE = 4  # the victim scans in tiles of 4 of the 8 slots: more than one tile, the picks merged across them
spec = SyntheticSpec(layers=4, experts=8, top_k=2, hidden=64, moe_intermediate=32, heads=2, kv_heads=1,
                     head_dim=32, vocab_size=512, seed=3, expert_gain=2.0, lm_successor_gain=1.0, in_memory=True)
model, _ = build_synthetic_model(spec, "cpu", torch.float32)
# the fused decode region by hand (compile_decode picks it on CUDA only): every decode layer's router
# is the fused launch, the cache's decisions in it
model._compiled_before_experts = functools.partial(fused_layer_before_experts, pdl=False)
model._fused_head = functools.partial(fused_norm_lm_head, pdl=False)
cfg = model.config
L, E, k = cfg.num_moe_layers, cfg.num_experts, cfg.top_k
batch, depth, new = 2, 1, 8
counts = np.random.default_rng(7).integers(0, 20, size=(L, E)).astype(np.float64)
C = hot_count_for_residency(0.25, L * E)
row_map, _, wc = _warm(counts, C)
routers = [model.layers[i].mlp.gate.weight.detach() for i in cfg.moe_layers]
cache = SlotCache.build(model.pools, host_tier(model.pools), row_map, wc, "lookahead", batch, k, routers=routers,
                        depth=depth)
cache.use_kernel, cache.fill_ticket = True, torch.zeros(1, dtype=torch.int32)  # the kernel path by hand
cache.prefetch_blocks = 4
assert ts._ahead_sizes(cache)["SCAN"] < C, (ts._ahead_sizes(cache), C)
prompts = random_prompts(cfg.vocab_size, 2, seed=5)
reference = gate.reference_decode(model, prompts, new, batch_size=batch, progress=False)
groups = []
route, decide = cache.route, ts.decide_ahead

def recording(layer, *a, **kw):
    out = route(layer, *a, **kw)
    groups.append(out[1].reshape(-1).tolist())
    return out

def refused(*a, **kw):
    raise AssertionError("a decode group decided by decide_ahead's launch, not in the router's")

cache.route, ts.decide_ahead = recording, refused
got = gate.placement_decode(model, cache.pools, prompts, new, batch_size=batch, progress=False, cache=cache)
result = gate.compare("lookahead-0.25", ["a", "b"], reference, got, cache.pools, model)
assert result.passed and result.tokens_matched == result.tokens_total, result
cache.check(contents=True)
n_groups = int(cache.groups)
assert len(groups) == n_groups == (new - 1) * L, (len(groups), n_groups)
layer_of = np.arange(n_groups) % L
inst = np.array([layer_of[g] * E + e for g in range(n_groups) for e in groups[g]])
stream = AccessStream(inst, np.cumsum([0] + [len(x) for x in groups]), n_groups // L * batch, L, E)
pred = cache.prefetch_lists()
sim = simulate(stream, "lookahead", C, counts, predictions=pred)
np.testing.assert_array_equal(cache.group_history(), np.stack([sim.hits, sim.misses, sim.fills], axis=1))
np.testing.assert_array_equal(cache.rules.prefetch_history[:n_groups].numpy(), sim.prefetches)
assert (pred[layer_of >= L - depth] == -1).all()  # no forecast past the last layer
assert sim.prefetches.sum() > 0 and sim.useful_prefetches > 0, "no prefetch used: the test lost its point"
assert not np.array_equal(sim.hit, simulate(stream, "lru", C, counts).hit)
print("INTERPRETED OK", int(sim.prefetches.sum()), int(sim.useful_prefetches))
"""

_RELOAD = _FILL_PRELUDE + r"""
STATE = ("owner", "last_use", "count", "tick", "totals", "groups", "inflight", "gate_state", "prediction_history",
         "prefetch_history", "history")
# A demand victim the forecast names: 2 layers of 4 experts, top-1, one token, 3 slots holding
# instances 0 (layer 0, expert 0), 6 and 7 (layer 1, experts 2 and 3), 6 the least recent (the least
# profile count). Layer 0's group selects expert 1, a miss: its victim is 6's slot; the forecast of
# layer 1 names expert 2, so the list wants 6 back, as the demand commit left it (not resident):
# the prefetch takes layer 0's other slot, instance 0's. The list's row-map gather taken before
# the commit, and not again, would see 6 resident and issue nothing.
L, E, k, T, H = 2, 4, 1, 1, 8
counts = np.array([[5, 0, 0, 0], [0, 0, 2, 3]], dtype=np.float64)
row_map, owner, wc = _warm(counts, 3)
assert sorted(owner.tolist()) == [0, 6, 7], owner
gates = [torch.zeros(E, H) for _ in range(L)]
gates[0][1] = 1.0  # layer 0 routes every positive input to expert 1
gates[1][2] = 1.0  # and layer 1 (the forecast of layer 0's group) to expert 2
norm_w = torch.ones(H)
all_hot = _random_pools(L, E, seed=0)
host = host_tier(all_hot)
# (without the gate, closed at first: the first group's list is issued)
ref, alone, routed = (SlotCache.build(all_hot, host, row_map, wc, "lookahead", T, k, routers=gates, depth=1,
                                      prefetch_gate=False) for _ in range(3))
for c in (alone, routed):  # the kernel path by hand: decide_ahead's launch, and the router's launch
    c.use_kernel, c.fill_ticket = True, torch.zeros(1, dtype=torch.int32)
counter = torch.zeros(1, dtype=torch.int32)
for step in range(2):
    for layer in range(L):
        x = torch.full((T, H), 1.0 + step + layer)
        h, ids, w = routed.route(layer, x, norm_w, 1e-6, gates[layer], k, True, counter, pdl=False)
        assert ids.reshape(-1).tolist() == [1 if layer == 0 else 2], (step, layer, ids)
        routed.admit(layer, ids, w, torch.float32)  # decided in the route
        alone.admit(layer, ids, w, torch.float32, hidden=h)
        ref.admit(layer, ids, w, torch.float32, hidden=h)  # the torch path (the simulator's rules)
        if (step, layer) == (0, 0):  # the case itself, on the torch path: the victim listed and prefetched back
            rm = ref.pools.row_map.reshape(-1)
            assert ref.history[0].tolist() == [0, 1, 1], ref.history[0]
            assert ref.rules.prediction_history[0, 0] == 6 and int(ref.rules.prefetch_history[0]) == 1
            assert rm[6] >= 0 and rm[0] < 0 and bool(ref.rules.inflight[6]), rm
        for c, path in ((alone, "decide_ahead"), (routed, "router")):
            for name in STATE:
                assert torch.equal(state(c, name), state(ref, name)), (path, name, step, layer)
            assert torch.equal(c.pools.row_map, ref.pools.row_map), (path, step, layer)
for c in (ref, alone, routed):
    c.check(contents=True)
print("INTERPRETED OK")
"""

# decide_ahead as the forecast GEMV's programmatic dependent (WAIT_LOGITS: the demand part first,
# the logits read after the grid-dependency wait), run under the interpreter, which has no grid
# dependency ops: they are no-ops here (one program, so the order they enforce is program order)
_PDL_PRELUDE = """
import triton
import triton.language as tl


@triton.jit
def _no_grid_dependency():
    pass


ts.gdc_wait = ts.gdc_launch_dependents = _no_grid_dependency
"""
_BY_HAND = "ker.use_kernel, ker.fill_ticket = True, torch.zeros(1, dtype=torch.int32)  # the kernel path by hand"
_DECIDE_PDL = _DECIDE.replace("ts.fill = small_fill\n", "ts.fill = small_fill\n" + _PDL_PRELUDE, 1).replace(
    _BY_HAND, _BY_HAND + "\n    ker.pdl = True  # the decisions wait for the GEMV's grid before the logits", 1)
assert _DECIDE_PDL.count("_no_grid_dependency") == 2 and "ker.pdl = True" in _DECIDE_PDL


def _interpret(script: str, device: str = "cpu", folder: Path | None = None) -> None:
    """``script`` in a subprocess: under Triton's interpreter (``device`` cpu), or compiled on CUDA.
    ``folder``: the script runs from a file there (Triton reads a kernel's source from its file:
    a script that defines kernels). Interpreted scripts start with ``LEAN_INTERPRETER``."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not importable here")
    src = str(Path(__file__).parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), src) if p)}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        script = LEAN_INTERPRETER + script
    else:
        env.pop("TRITON_INTERPRET", None)
    if folder is None:
        run = [sys.executable, "-c", script]
    else:
        (folder / "script.py").write_text(script)
        run = [sys.executable, str(folder / "script.py")]
    done = subprocess.run([*run, str(Path(__file__).parent), device], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "INTERPRETED OK" in done.stdout, done.stderr[-3000:]


def test_forecast_gemv_under_the_interpreter_is_within_the_float32_bound_of_float64():
    """``forecast_logits`` (one launch, a program per two experts, float32 products and sums) on
    float32 and float16 operands, row-strided input, ragged experts and hidden chunks: every logit
    within ``gamma_{H+1} * sum_h |x_h w_h|`` of the float64 product (the bound of any float32
    summation order, u = 2**-24); bad shapes, layouts and dtypes refused by name."""
    _interpret(_GEMV)


def test_decide_ahead_sort_topk_under_the_interpreter_equals_the_torch_path():
    """``decide_ahead`` (top-k by one partial bitonic sort of (logit, id) keys) against the torch
    path on the same logits, random and tie-heavy (few distinct values, ``-0.0`` beside ``+0.0``,
    infinities), ``k`` and ``E`` powers of two or not, pools barely larger than a group: after
    every group the same owners, recency, counts, ticks, counters, in-flight flags, recorded lists
    and prefetch counts, bitwise; prefetches issued in every case; every slot holds its owner. Odd
    seeds scan the victims in tiles smaller than the cache (``SCAN_TILE``)."""
    _interpret(_DECIDE)


def test_router_launch_lookahead_under_the_interpreter_equals_decide_ahead():
    """``lookahead`` in the fused router launch (``SlotCache.route``: the forecast of layer
    ``l + depth`` computed beside the router's own rows, the whole decision in the last program,
    then the demand fill and the prefetch fill) against the plain router launch and
    ``decide_ahead``'s launch (``admit``) fed the routed launch's logits: the routing (h, ids,
    weights) bitwise the plain launch's, the forecast within the float32 bound of float64, none
    written past the last layer, and after every group (new steps, the last layers without a
    forecast, random and tie-heavy routers) the whole cache state bitwise equal; prefetches issued
    in every case; every slot holds its owner; odd seeds scan the victims in tiles smaller than the
    cache (``SCAN_TILE``). Not timed on a GPU (interpreter only)."""
    _interpret(_ROUTE)


@pytest.mark.gpu
def test_router_launch_lookahead_on_cuda_equals_decide_ahead():
    """The interpreter test above compiled for the GPU (bfloat16 routers and inputs, the fills on
    their streams, the router and the demand fill as programmatic dependent launches on sm90+),
    and at most three compiled router launches a cache shape (plain, lookahead with and without a
    forecast) over every layer and step: the per-layer scalars are not specialized on."""
    _interpret(_ROUTE, "cuda")


def test_victim_scan_under_the_interpreter_equals_brute_force(tmp_path):
    """``_least_recent`` (the tiled victim scan of lookahead's demand and prefetch and nexttoken's
    prefetch) against a brute-force sort of the slots not barred by (recency, slot): tiles of 2 to 32
    slots over caches of 3 to 24 (more than two tiles, a last tile cut short), recencies with many
    ties (picked ties within a tile and across tiles), barred slots (used by the group, in flight,
    a layer above the bound, a flag) anywhere; the same picks in the same order, the owners, zeros
    past the slots not barred, and their count. The tile the launchers pick; a cache past 2**14 slots
    (the key's slot bits) and a tile not a power of two refused by name."""
    _interpret(_SCAN, folder=tmp_path)


@pytest.mark.parametrize("after_experts", [False, True], ids=["list after the demand fill", "list after the experts"])
def test_engine_through_the_fused_router_with_lookahead_equals_the_simulator_and_the_unmodified_path(after_experts):
    """The engine's decode steps through the fused router launch (the fused decode region set by
    hand on the CPU, every kernel interpreted) with a ``lookahead`` cache at residency 0.25, batch 2:
    every decode group decided in the router's launch (``decide_ahead``'s launch never runs), the
    logits bitwise the unmodified path's (the parity gate), per group hits, misses, fills and
    prefetches equal to ``coldset.analysis.simulate.simulate``'s ``lookahead`` on the lists the engine recorded,
    none past the last layer, prefetches used and the stream off lru's; every slot holds its owner.
    The victim scans run in tiles of 4 of the 8 slots (``SCAN_TILE``). ``after_experts``: the list
    and the prefetch forked after each layer's experts (``Lookahead.list_after_experts``), the same."""
    script = _ENGINE
    script = script.replace("cache.prefetch_blocks = 4\n",
                            f"cache.prefetch_blocks = 4\ncache.rules.list_after_experts = {after_experts}\n")
    assert f"rules.list_after_experts = {after_experts}" in script
    _interpret(script)


def test_lookahead_demand_victim_the_forecast_names_is_prefetched_back_under_the_interpreter():
    """A group whose demand victim is an instance of the target layer that the forecast lists
    (hand-built: the least recent slot holds it, the router and the forecast router pick fixed
    experts): the demand commit evicts it, so the list wants it back and the prefetch takes another
    slot. The router's launch and ``decide_ahead``'s (which gather the list's row-map entries before
    the group's record, and again after a demand commit) against the torch path, every group of
    two steps: the same state, bitwise; the case itself asserted on the torch path."""
    _interpret(_RELOAD)


def test_decide_ahead_after_the_forecast_gemv_under_the_interpreter_equals_the_torch_path(tmp_path):
    """The decide_ahead case above with the launch as the forecast GEMV's dependent (``WAIT_LOGITS``:
    :func:`ahead_group`'s other order, the forecast list after the demand part and the wait; the
    wait a no-op under the interpreter): the same state as the torch path, bitwise, every group."""
    _interpret(_DECIDE_PDL, folder=tmp_path)


def test_router_launch_register_cap_fits_the_grid_in_one_wave():
    """The router launch with lookahead's decision is capped (``maxnreg``) only where its grid needs
    more than two blocks an SM (any register count up to 255 fits two blocks of 4 warps in 65,536),
    and then at the most registers that fit the grid in one wave (whole warps of 256-register
    units), never below 128: b8 at E 128 (512 programs) on the H200's 132 SMs gets 128 (four
    blocks an SM, 528 in a wave), b1 and b4 none."""
    pytest.importorskip("triton")
    from coldset.kernels import triton_decode as td

    def blocks(regs: int, warps: int = td.ROUTE_WARPS) -> int:
        return 65536 // (-(-regs * 32 // 256) * 256 * warps)

    assert blocks(255) == 2 and blocks(128) == 4
    for programs, sms in [(64, 132), (128, 132), (256, 132), (264, 132), (512, 132), (396, 132), (397, 132),
                          (384, 108), (1024, 132), (8192, 132)]:
        cap = td._route_register_cap(programs, td.ROUTE_WARPS, sms)
        need = -(-programs // sms)
        if need <= 2:
            assert cap is None, (programs, sms, cap)
            continue
        assert cap % 8 == 0 and td.ROUTE_AHEAD_MAXNREG <= cap <= 255, (programs, sms, cap)
        if cap > td.ROUTE_AHEAD_MAXNREG:  # the most that still fits one wave
            assert blocks(cap) * sms >= programs > blocks(cap + 8) * sms, (programs, sms, cap)
        else:  # at the floor: one wave where 128 allows it
            assert (blocks(cap) * sms >= programs) == (need <= 4), (programs, sms, cap)
    assert td._route_register_cap(512, td.ROUTE_WARPS, 132) == 128


def test_ahead_list_refuses_a_target_not_after_its_layer_and_partial_tokens():
    """The list's launch (``ahead_list``, route's path) is refused, by name, for a target layer not
    after the group's (or past the last layer) and for selections that are not whole tokens of
    top-k within the cache's tokens, before anything is launched."""
    pytest.importorskip("triton")
    import numpy as np
    import torch

    from coldset.kernels import triton_slots as ts
    from coldset.analysis.placement import hot_mask_usage_global, row_map_from_mask
    from coldset.engine.cache.pool import SlotCache
    from coldset.kernels.tiers import ExpertPools, host_tier

    L, E, k, T, H, C = 3, 4, 2, 2, 8, 8
    all_hot = ExpertPools.all_hot(torch.randn(L, E, 2, 2), torch.randn(L, E, 2, 2))
    counts = np.arange(L * E, dtype=np.float64).reshape(L, E)
    row_map = row_map_from_mask(hot_mask_usage_global(counts, C))
    flat = row_map.reshape(-1)
    owner = np.empty(C, dtype=np.int64)
    owner[flat[flat >= 0]] = np.flatnonzero(flat >= 0)
    cache = SlotCache.build(all_hot, host_tier(all_hot), row_map, counts.reshape(-1)[owner], "lookahead", T, k,
                            routers=[torch.randn(E, H) for _ in range(L)])
    for layer, target, n, what in [(1, 1, 4, "later MoE layer"), (2, 3, 4, "later MoE layer"),
                                   (0, 1, 3, "whole tokens"), (0, 1, 6, "whole tokens"), (0, 1, 0, "whole tokens")]:
        with pytest.raises(ValueError, match=what):
            ts.ahead_list(cache, layer, target, n)
