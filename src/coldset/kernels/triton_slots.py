"""The slot cache's work inside the decode step on CUDA, two launches per MoE layer.

:func:`decide` (one program): the cache's decisions for one (step, layer) group exactly as
:meth:`coldset.slots.SlotCache.admit`'s torch path makes them (hits, first occurrences, victims
outside the group, row-map and owner writes, recency, frequency, counters), writing the victims,
the admitted instances and their number for the fill. The torch path is about thirty small
launches a layer (6.2 ms of decisions for 48 layers against a 3.9 ms all-HBM step at Qwen3-30B-A3B
shapes on the H200, BENCHMARKS.md issue 12); here the group (at most 64 selections) and the
``C`` slots' keys live in one program's registers. The same launch casts the router's float32
weights to the activation dtype (round to nearest even, as ``Tensor.to``): the experts call of
every path has that cast as a launch of its own, so a cached layer costs one launch more than an
uncached one (the fill), not two.

How the group's own residents are kept out of the victims without a membership test per slot:
their recency is written first (the group's ticks are the newest, so LRU's smallest keys never
reach them while ``C >= group size``), and for LFU their count is set to infinity until the
decisions are made, then to its new value.

:func:`fill` (one launch for both weights): copies host-tier rows into slots, reading pinned host
memory in place, only for the step's actual misses. A kernel rather than a copy: the rows to copy
are decided on the device inside the captured step, so a ``cudaMemcpyAsync`` (addresses fixed at
capture) cannot express them without a host round trip; on the H200 the kernel reads 8 experts
(75 MB) from pinned memory at 50.6 GB/s, the copy engine the same rows at 53.0 GB/s. The grid is
fixed (``FILL_BLOCKS`` blocks per weight, each looping over the step's misses and copying its
stripe of each row): a step without a miss costs one small launch whose blocks read one scalar,
where a grid of one row of blocks per possible miss (64 x 64 x 2 = 8192 blocks at batch 8) cost
the scheduling of all of them. On sm90+ the fill is a programmatic dependent launch: the decisions
let it start at once (``gdc_launch_dependents``), and its blocks wait for the decisions to
complete and be visible (``gdc_wait``) before reading anything, which hides the fill's launch
latency behind the decisions.

Two ways to spend fewer launches were built, measured on the H200 and dropped (BENCHMARKS.md,
issue 12, third session; every layer's work on all-hit groups, 48 layers, against 0.162 ms here):
decisions and copy in one launch (the first block to take a ticket decides, the others wait on its
release flag, then copy) took 0.31 ms; decisions alone with the experts kernel storing the tiles
it reads of an admitted expert into its slot (the admission entering the row map at the next
group's decisions) took 0.10 ms, but the experts kernel, with stores under a branch in its inner
loop, made an all-hit step 27% slower (these two ways: 5%).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # programmatic dependent launch (sm90+), triton >= 3.3; without it the fill is a plain launch
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton
    gdc_launch_dependents = gdc_wait = None

BLOCK = 4096  # elements per load in the fill
FILL_BLOCKS = 128  # blocks per weight in the fill, each copying a stripe of every missed row
_INT64_MAX = tl.constexpr(9223372036854775807)  # a constexpr: jit code may read it


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@triton.jit
def _decide_kernel(ids_ptr, n, layer, row_map_ptr, owner_ptr, last_use_ptr, count_ptr, tick_ptr,
                   totals_ptr, history_ptr, groups_ptr, hist_cap, victims_ptr, new_ptr, m_ptr, C,
                   w_ptr, w_out_ptr,
                   E: tl.constexpr, NP: tl.constexpr, CP: tl.constexpr, M: tl.constexpr, LFU: tl.constexpr,
                   CAST: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:
        gdc_launch_dependents()  # the fill may launch now; its blocks wait for this grid (gdc_wait)
    # The scalars are loaded first, beside the group's ids: each dependent global round trip is
    # latency in a step of 48 such programs (0.182 -> 0.162 ms for 48 layers, BENCHMARKS.md).
    offs = tl.arange(0, NP)
    valid = offs < n
    ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int64)
    if CAST:  # the router's weights in the activation dtype (round to nearest even, as Tensor.to)
        w = tl.load(w_ptr + offs, mask=valid, other=0.0)
        tl.store(w_out_ptr + offs, w.to(w_out_ptr.dtype.element_ty), mask=valid)
    t0 = tl.load(tick_ptr)
    tot_hits = tl.load(totals_ptr)
    tot_misses = tl.load(totals_ptr + 1)
    tot_fills = tl.load(totals_ptr + 2)
    g = tl.load(groups_ptr)
    inst = layer * E + ids
    rows = tl.load(row_map_ptr + inst, mask=valid, other=-1)
    hit = valid & (rows >= 0)
    same = (ids[:, None] == ids[None, :]) & valid[:, None] & valid[None, :]
    first = valid & (tl.sum((same & (offs[None, :] < offs[:, None])).to(tl.int32), axis=1) == 0)
    last = valid & (tl.sum((same & (offs[None, :] > offs[:, None])).to(tl.int32), axis=1) == 0)
    occ = tl.sum(same.to(tl.int32), axis=1)
    missed = first & (rows < 0)
    m = tl.sum(missed.to(tl.int32), axis=0)
    rank = tl.cumsum(missed.to(tl.int32), axis=0) - 1
    old_cnt = tl.load(count_ptr + inst, mask=valid, other=0.0)
    tl.debug_barrier()  # every thread has read the old counts before any is overwritten
    tl.store(last_use_ptr + inst, t0 + offs, mask=last)  # the newest ticks: never an LRU victim
    if LFU:
        tl.store(count_ptr + inst, float("inf"), mask=first & hit)  # never an LFU victim
    tl.debug_barrier()
    if m > 0:
        offs_c = tl.arange(0, CP)
        okc = offs_c < C
        own = tl.load(owner_ptr + offs_c, mask=okc, other=0)
        lu = tl.load(last_use_ptr + own, mask=okc, other=_INT64_MAX)
        cnt = tl.load(count_ptr + own, mask=okc, other=float("inf"))
        for j in range(0, M):
            if j < m:
                if LFU:
                    low = cnt == tl.min(cnt, axis=0)
                    key = tl.where(low, lu, _INT64_MAX)
                else:
                    key = lu
                s = tl.min(tl.where(key == tl.min(key, axis=0), offs_c, CP), axis=0)
                pick = offs_c == s
                old = tl.sum(tl.where(pick, own, 0), axis=0)
                lu = tl.where(pick, _INT64_MAX, lu)
                cnt = tl.where(pick, float("inf"), cnt)
                new = layer * E + tl.sum(tl.where(missed & (rank == j), ids, 0), axis=0)
                tl.store(row_map_ptr + old, (-old - 1).to(tl.int32))
                tl.store(row_map_ptr + new, s.to(tl.int32))
                tl.store(owner_ptr + s, new)
                tl.store(victims_ptr + j, s.to(tl.int64))
                tl.store(new_ptr + j, new)
    tl.store(count_ptr + inst, old_cnt + occ.to(tl.float64), mask=first)
    tl.store(m_ptr, m.to(tl.int64))
    tl.store(tick_ptr, t0 + n)
    nhit = tl.sum(hit.to(tl.int64), axis=0)
    tl.store(totals_ptr, tot_hits + nhit)
    tl.store(totals_ptr + 1, tot_misses + (n - nhit))
    tl.store(totals_ptr + 2, tot_fills + m.to(tl.int64))
    h = history_ptr + (g % hist_cap) * 3
    tl.store(h, nhit)
    tl.store(h + 1, n - nhit)
    tl.store(h + 2, m.to(tl.int64))
    tl.store(groups_ptr, g + 1)


def pdl_available(device: torch.device) -> bool:
    """Whether :func:`decide` and :func:`fill` can run as a programmatic dependent pair on ``device``."""
    return gdc_wait is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def decide(cache, layer: int, ids: torch.Tensor, weights: torch.Tensor | None = None,
           weights_out: torch.Tensor | None = None) -> None:
    """The decisions of :meth:`coldset.slots.SlotCache.admit` for ``ids`` (int64 ``[n]``, the
    group's selections in order) in one launch; writes ``cache.victims``, ``cache.admitted`` and
    ``cache.num_misses`` for :func:`fill`. With ``weights`` (float32 ``[n]``, contiguous) the same
    launch writes them cast to ``weights_out``'s dtype into ``weights_out`` (``[n]``, contiguous).
    With ``cache.pdl`` the launch lets the next one (the fill) start early."""
    n = ids.numel()
    cap = cache.capacity
    cp = _next_pow2(cap)
    cast = weights is not None
    if cast and not (weights.is_contiguous() and weights_out.is_contiguous()
                     and weights.numel() == n == weights_out.numel()):
        raise ValueError(f"decide: weights ({tuple(weights.shape)}) and weights_out "
                         f"({tuple(weights_out.shape)}) must be contiguous with one entry per selection ({n})")
    _decide_kernel[(1,)](
        ids, n, layer, cache.pools.row_map, cache.owner, cache.last_use, cache.count, cache.tick,
        cache.totals, cache.history, cache.groups, cache.history.shape[0], cache.victims, cache.admitted,
        cache.num_misses, cap, weights if cast else ids, weights_out if cast else ids,
        E=cache.pools.num_experts, NP=max(2, _next_pow2(n)), CP=cp, M=cache.victims.numel(),
        LFU=cache.policy == "lfu", CAST=cast, USE_GDC=cache.pdl, num_warps=16 if cp >= 4096 else 8)


@triton.jit
def _fill_kernel(src13_ptr, dst13_ptr, row13, src2_ptr, dst2_ptr, row2, slots_ptr, inst_ptr, count_ptr,
                 BLOCK: tl.constexpr, NB: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:
        gdc_wait()  # launched early: the decisions (victims, admitted, count) are complete after this
    part = tl.program_id(0)
    m = tl.load(count_ptr).to(tl.int32)
    if tl.program_id(1) == 0:
        src_base = src13_ptr
        dst_base = dst13_ptr
        row = row13
    else:
        src_base = src2_ptr
        dst_base = dst2_ptr
        row = row2
    for j in range(0, m):
        slot = tl.load(slots_ptr + j).to(tl.int64)
        inst = tl.load(inst_ptr + j).to(tl.int64)
        src = src_base + inst * row
        dst = dst_base + slot * row
        for start in range(part * BLOCK, row, NB * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < row
            tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)


def fill(pools, victims: torch.Tensor, instances: torch.Tensor, count: torch.Tensor, pdl: bool = False) -> None:
    """``slot[victims[j]] = host[instances[j]]`` for both weights and ``j < count`` (``count`` a
    device scalar): ``pools``' hot pools are the slots, its cold pools the host tier (pinned,
    read in place). ``pdl``: launched as the programmatic dependent of :func:`decide` (which must
    be the launch just before it on the stream, with ``cache.pdl`` set)."""
    for host, slots in ((pools.w13_cold, pools.w13_hot), (pools.w2_cold, pools.w2_hot)):
        if host.shape[1:] != slots.shape[1:] or host.dtype != slots.dtype:
            raise ValueError(f"fill: host rows {tuple(host.shape[1:])} {host.dtype} differ from slots "
                             f"{tuple(slots.shape[1:])} {slots.dtype}")
        if not (host.is_contiguous() and slots.is_contiguous()):
            raise ValueError("fill: host tier and slots must be contiguous")
    _fill_kernel[(FILL_BLOCKS, 2)](
        pools.w13_cold, pools.w13_hot, pools.w13_hot[0].numel(), pools.w2_cold, pools.w2_hot,
        pools.w2_hot[0].numel(), victims, instances, count.reshape(1), BLOCK=BLOCK, NB=FILL_BLOCKS,
        USE_GDC=pdl, num_warps=4, launch_pdl=pdl)
