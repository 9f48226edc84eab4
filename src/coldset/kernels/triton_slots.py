# One module over 900 lines: the decision, fill and list kernels are built from one set of shared @triton.jit helpers.
"""The slot cache's work inside the decode step on CUDA: one launch per MoE layer beside the router's.

Why one module: :func:`record_group`, :func:`_group_keys`, the victim scans (:func:`_least_recent`,
:func:`_choose_victims`), the victims' commit, :func:`_record_list` and :func:`_issue_prefetches` are
each used by several of lru's, lookahead's and nexttoken's launches and by the fill, and the
router's launch (:func:`coldset.kernels.triton_decode.route`) inlines :func:`record_group` and
:func:`ahead_group`; the launch-specialization constants (``PER_LAYER_ARGS``, ``SCAN_TILE``) apply to
all of them.

lru and lfu in the fused decode step (:meth:`coldset.engine.cache.pool.SlotCache.route`): the
router's launch ranks the layer's selections in its last program and, holding them in registers,
records the group there (:func:`record_group`: hits, first occurrences, the group's recency and use
counts, counters, history, the missed instances in selection order). The next launch,
:func:`choose_and_fill` (the router's programmatic dependent on sm90+), chooses the victims
(:func:`_choose_victims`: every block alike, the same reads), the last block to finish choosing
commits them (:func:`_commit_victims`: the evicted instance's row-map entry back to its host row, the
admitted one's to its slot, the owners) and every block copies its stripe of each admitted row from
the pinned host tier. A group without a miss costs the fill's blocks one load each.

:func:`decide` (one program) is the same decisions in a launch of their own, for the paths where the
router is not the fused launch (the Inductor-compiled region, torch routers): the group record, then
the victims and their commit in the same program, and the cast of the router's float32 weights to the
activation dtype (round to nearest even, as ``Tensor.to``: the experts call of those paths has that
cast as a launch of its own); :func:`fill` then copies. The torch path of
:meth:`coldset.engine.cache.pool.SlotCache.admit` is about thirty small launches a layer.

How the group's own residents are kept out of the victims without a membership test per slot: their
recency is written first and their ticks (``>= t0``, the tick the group started at) are the newest,
so the victim choice bars every slot whose owner was last used at ``t0`` or later (lfu's key is
(count, recency) over the other slots).

The fill: copies host-tier rows into slots, reading pinned host memory in place, only for the step's
actual misses. A kernel rather than a copy: the rows to copy are decided on the device inside the
captured step, so a ``cudaMemcpyAsync`` (addresses fixed at capture) cannot express them without a
host round trip; it reads pinned memory at about the copy engine's rate (BENCHMARKS.md section 4).
The grid is fixed (``FILL_BLOCKS`` blocks per weight, each looping over the step's misses and copying
its stripe of each row): a step without a miss costs one small launch whose blocks read one scalar. On
sm90+ it is a programmatic dependent launch: its predecessor lets it start at once
(``gdc_launch_dependents``) and its blocks wait for that grid to complete and be visible (``gdc_wait``)
before reading anything, which hides the fill's launch latency. Block-FP8 pools: each block copies,
for the same (slot, instance) pair in the same loop iteration, its stripe of the weight row and of
that weight's scale row (float32 ``weight_scale_inv`` blocks), so every fill (demand, lookahead's
prefetch, nexttoken's tagged prefetch, whose tag is written only once every block finished both)
moves an expert's weights and scales together or not at all.

lookahead: :func:`decide_ahead` (one program) is its group: the same demand decisions with the
in-flight rule and ``lru_guard``'s bar (slots prefetched this step, or whose instance the last ``L``
groups used or prefetched, are no victim; misses beyond the free slots are read in place), the gate's
judgement of the list that forecast this layer (:func:`_gate_judge`), then the forecast list (each
token's top ``k`` of the target layer's float32 router logits, ties by expert id, first occurrence
kept: one partial bitonic sort, ``tl.topk``, of (logit, id) keys per token), kept for the gate
(:func:`_gate_keep`), and while it is open the prefetch decisions (victims in layers ``<= l`` not
used by the group, not in flight, not guarded), written per target layer for a fill on the side
stream. The forecast is one launch of its
own, :func:`forecast_logits` (a program per two experts reading the router in the model's dtype,
float32 sums), whose programmatic dependent :func:`decide_ahead` is on sm90+. In the fused decode
step neither launch runs: :func:`coldset.kernels.triton_decode.route` with :func:`route_ahead_args`
computes the forecast in the router's own programs (each beside its router rows, the target layer's
same rows) and its last program makes the group's record and demand decisions on the selections in
registers (:func:`ahead_group` without ``LIST``: the body of :func:`_ahead_kernel`, one function both
call); the list and its prefetch decisions are a launch of their own, :func:`ahead_list` (one
program, the same code: :func:`_forecast_list`, :func:`_ahead_prefetch`), on the decisions stream
beside the layer's experts, the prefetch copy after it, the next group's router after it. The victim
scans are tiled (:func:`_least_recent`, ``SCAN_TILE`` slots a tile) so that the router's launch keeps
its registers whatever the slot count.

nexttoken (:func:`decide_next`, :func:`commit_prefetches`): the fill's blocks choose the demand
victims by (predicted, recency) past the in-flight slots (:func:`_choose_next_victims`); one program
on the decisions stream then makes the forecast (integer tables, the lanes' history) and the prefetch
decisions, and the fill copies the prefetched rows with tags (its last block writes each slot's tag
once every row landed); at the step's end one launch commits the rows whose tag landed and leaves
the others' slots empty (owner -1: first victims, read by no kernel). The gate is the same pair of
helpers as lookahead's (:func:`_gate_judge`, :func:`_gate_keep`). The fill
(:func:`fill`, :func:`choose_and_fill`) is one kernel behind one launcher (:func:`_launch_fill`),
whatever it chooses; lookahead's and nexttoken's lists, victims and commits share
:func:`_record_list` and :func:`_issue_prefetches`, and lookahead's group record is
:func:`record_group`'s.

Why not decisions and copy in one launch: the other blocks would wait on the deciding block's release
flag, slower for all-hit layers; nor the experts kernel storing the tiles it reads of an admitted
expert into its slot: stores under a branch in its inner loop slow every all-hit step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coldset.kernels import KERNEL_MAX_SLOTS

try:  # programmatic dependent launch (sm90+), triton >= 3.3; without it the fill is a plain launch
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton
    gdc_launch_dependents = gdc_wait = None

BLOCK = 4096  # elements per load in the fill
FILL_BLOCKS = 128  # blocks per weight in the fill, each copying a stripe of every missed row
_INT64_MAX = tl.constexpr(9223372036854775807)  # a constexpr: jit code may read it
# The scalars that change from one MoE layer's launch to the next. Triton specializes an int
# argument on its value (== 1, a multiple of 16), so a kernel taking them would compile a variant
# for layer 1, for the multiples of 16 and for the rest, each again by its target and new_step (and
# by PER_LAYER_VIEWS below): several compiles of the router's launch with lookahead's decision a
# batch size where two serve (probes/route_variants_cpu.py counts them), each of them seconds. They
# index small tables, where the specialization buys nothing.
PER_LAYER_ARGS = ("layer", "new_step", "target")
# Likewise the one-element views a launch gets per layer (a layer's prefetch count ``pf_count[t]``,
# the fill's ``count_ptr``): 16-byte aligned at every other layer only, so Triton's pointer-alignment
# specialization would compile two variants of the same launch. They are read and written as scalars.
# (Where a launch's ``count_ptr`` is another thing, the router's ticket or the use-count table, it
# is an atomic or gathered lane by lane: the alignment buys nothing there either.)
PER_LAYER_VIEWS = ("pf_m_ptr", "count_ptr")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _decision_warps(capacity: int) -> int:
    """Warps of a one-program decisions launch (decide, decide_ahead, ahead_list, decide_next): 16
    where the pool's slot vectors reach 4,096 lanes, else 8 (one rule for all of them)."""
    return 16 if _next_pow2(capacity) >= 4096 else 8


@triton.jit
def _group_keys(ids, sel, valid, layer, row_map_ptr, E: tl.constexpr):
    """A group's selections ``ids`` (one per lane; ``sel`` the selection index in the group, in
    lane order; ``valid`` masks padding lanes): their instances, hits (row-map entry >= 0), first
    and last occurrences, occurrence counts, first-occurrence misses, their number and their rank
    in selection order. Loads the row map only; every decisions kernel starts with it."""
    inst = layer * E + ids
    rows = tl.load(row_map_ptr + inst, mask=valid, other=-1)
    hit = valid & (rows >= 0)
    e32 = ids.to(tl.int32)  # expert ids < E: a 32-bit compare
    same = (e32[:, None] == e32[None, :]) & valid[:, None] & valid[None, :]
    occ = tl.sum(same.to(tl.int32), axis=1)
    before = tl.sum((same & (sel[None, :] < sel[:, None])).to(tl.int32), axis=1)
    first = valid & (before == 0)
    last = valid & (before == occ - 1)  # every other occurrence comes before it
    missed = first & (rows < 0)
    m = tl.sum(missed.to(tl.int32), axis=0)
    rank = tl.cumsum(missed.to(tl.int32), axis=0) - 1
    return inst, hit, first, last, occ, missed, m, rank


@triton.jit
def group_scalars(tick_ptr, totals_ptr, groups_ptr):
    """The cache's scalars a group record updates: ``(tick, hits, missed selections, fills, groups)``.
    Loaded apart from :func:`record_group` so that a caller can issue them early (the router's
    last program loads them before it ranks the logits: their latency hides behind the ranking)."""
    return (tl.load(tick_ptr), tl.load(totals_ptr), tl.load(totals_ptr + 1), tl.load(totals_ptr + 2),
            tl.load(groups_ptr))


@triton.jit
def record_group(ids, sel, valid, n, layer, row_map_ptr, last_use_ptr, count_ptr, tick_ptr, totals_ptr,
                 history_ptr, groups_ptr, hist_cap, new_ptr, m_ptr, scalars, E: tl.constexpr):
    """lru/lfu's decisions for one group up to the victims: hits and misses, the group's recency
    (its ticks ``t0 + sel`` are the newest: how the victim choice tells the group's own residents
    apart) and use counts, the counters and the group's history row, and the missed instances in
    selection order into ``new_ptr[:m]`` with ``m`` into ``m_ptr``. ``scalars``:
    :func:`group_scalars`' values. Returns ``(t0, m)``. The victims and the row-map writes are
    :func:`_choose_victims`' (in the same program, or in the fill's blocks when the router's
    launch records the group)."""
    t0, tot_hits, tot_misses, tot_fills, g = scalars
    # both gathers first, side by side: one round trip to L2 for the group
    old_cnt = tl.load(count_ptr + layer * E + ids, mask=valid, other=0.0)
    inst, hit, first, last, occ, missed, m, rank = _group_keys(ids, sel, valid, layer, row_map_ptr, E)
    tl.debug_barrier()  # every lane has read the old counts before any is overwritten
    tl.store(last_use_ptr + inst, t0 + sel, mask=last)
    tl.store(count_ptr + inst, old_cnt + occ.to(tl.float64), mask=first)
    tl.store(new_ptr + rank, inst, mask=missed)
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
    return t0, m


@triton.jit
def _least_keys(key, cnt, own, m, LFU: tl.constexpr, CP: tl.constexpr, MV: tl.constexpr):
    """The ``m`` lanes of smallest ``key`` (int64 ``[CP]``, barred lanes ``INT64_MAX``; ``LFU``:
    smallest ``(cnt, key)``, barred counts infinite), ties to the lowest lane, as ``(slots,
    owners)`` int64 ``[MV]`` (lane ``j < m`` = the ``j``-th pick; ``own`` the lanes' owners)."""
    offs_c = tl.arange(0, CP)
    jv = tl.arange(0, MV)
    slots = tl.zeros((MV,), dtype=tl.int64)
    olds = tl.zeros((MV,), dtype=tl.int64)
    for j in range(0, MV):
        if j < m:
            if LFU:
                k = tl.where(cnt == tl.min(cnt, axis=0), key, _INT64_MAX)
            else:
                k = key
            s = tl.min(tl.where(k == tl.min(k, axis=0), offs_c, CP), axis=0)
            pick = offs_c == s
            old = tl.sum(tl.where(pick, own, 0), axis=0)
            key = tl.where(pick, _INT64_MAX, key)
            if LFU:
                cnt = tl.where(pick, float("inf"), cnt)
            slots = tl.where(jv == j, s.to(tl.int64), slots)
            olds = tl.where(jv == j, old, olds)
    return slots, olds


# The victim scans of lookahead and nexttoken's prefetch (:func:`_least_recent`): slots a tile holds,
# and the packing of a slot's (last use, slot) into one int64 key.
SCAN_TILE = 512
_SLOT_SCALE = tl.constexpr(2**14)  # slots < KERNEL_MAX_SLOTS = 2**14: the key's low 14 bits
_SLOT_MASK = tl.constexpr(2**14 - 1)
_TICK_LIMIT = tl.constexpr(2**49)  # |last use| below it: last use * 2**14 + slot fits an int64 exactly
_BAR_NONE, _BAR_LAYER, _BAR_FLAG = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# An empty slot's (owner -1: nexttoken's prefetch that never landed) last use: older than any resident's, so the
# first victim (coldset.engine.cache.policy.EMPTY_TICK, the torch decisions' number).
_EMPTY_TICK = tl.constexpr(-(2**48))


@triton.jit
def _least_recent(t0, owner_ptr, last_use_ptr, inflight_ptr, extra_ptr, bound, C, E: tl.constexpr,
                  SCAN: tl.constexpr, MV: tl.constexpr, BAR: tl.constexpr):
    """The ``MV`` least recent slots of ``C`` not barred, least recent first, ties to the lowest slot,
    as ``(slots, owners, free)``: int64 ``[MV]`` (lane ``j`` the ``j``-th pick while ``j < free``, 0
    past them) and the number of slots not barred. Barred: used by the group (last use ``>= t0``),
    in flight (``inflight_ptr``, uint8 by instance), and with ``BAR``: ``_BAR_LAYER`` an instance
    of a layer above ``bound``, ``_BAR_FLAG`` an instance flagged at ``extra_ptr`` (uint8).

    Tiled: ``SCAN`` slots at a time (a power of two >= ``MV``), each tile's keys ``last use * 2**14
    + slot`` (barred: ``INT64_MAX``), its ``MV`` least by a partial bitonic sort (``tl.topk`` of the
    negated keys) merged into the running ``MV`` least (a ``tl.topk`` of ``2 MV``), the owners of
    the picks gathered at the end. The key orders by (last use, slot) exactly: a slot is below
    ``KERNEL_MAX_SLOTS`` = 2**14 and a resident's last use lies in ``[-C, tick)``, far inside
    ``+-2**49`` (ticks grow by a group's selections and list, about 6144 a step of 48 layers at 8
    tokens: 2**49 of them take 9 years of 3 ms steps; a device assert in Triton's debug mode).
    Why tiled: with every slot's key in registers at once (``_least_keys`` over ``[CP]`` int64
    owners, recency and flags; an 8192-lane int64 tensor is 128 registers a thread at 4 warps) the
    router's launch with lookahead's decision (4 warps: the routing's bits depend on it) spills;
    tiles keep the scan's registers independent of the slot count. A scan costs
    ``C / SCAN`` tiles one after the other, each a gather of owners then of their recency and
    flags, and a sort."""
    offs = tl.arange(0, SCAN)
    best = tl.full((MV,), -_INT64_MAX, tl.int64)  # the negated keys of the MV least so far, descending
    nfree = tl.zeros((), dtype=tl.int32)  # slots not barred, tile by tile
    for s0 in range(0, C, SCAN):
        slot = s0 + offs
        ok = slot < C
        own = tl.load(owner_ptr + slot, mask=ok, other=0)
        held = ok & (own >= 0)  # (an empty slot: no instance's state to read)
        lu = tl.where(held, tl.load(last_use_ptr + own, mask=held, other=0), _EMPTY_TICK)
        barred = (lu >= t0) | (tl.load(inflight_ptr + own, mask=held, other=0) != 0) | (~ok)
        if BAR == _BAR_LAYER:
            barred = barred | (own // E > bound)
        if BAR == _BAR_FLAG:
            barred = barred | (tl.load(extra_ptr + own, mask=held, other=0) != 0)
        tl.device_assert(barred | ((lu < _TICK_LIMIT) & (lu > -_TICK_LIMIT)), "last use out of the key's range")
        nfree += tl.sum((~barred).to(tl.int32), axis=0)
        neg = tl.where(barred, -_INT64_MAX, -(lu * _SLOT_SCALE + slot))
        top = tl.topk(neg, MV)  # this tile's MV least keys, negated, descending
        best = tl.topk(tl.reshape(tl.join(best, top), [2 * MV]), MV)
    key = -best
    real = key != _INT64_MAX
    slots = tl.where(real, key & _SLOT_MASK, 0)
    olds = tl.load(owner_ptr + slots, mask=real, other=0)
    return slots, olds, nfree


@triton.jit
def _choose_victims(m, t0, guard, owner_ptr, last_use_ptr, count_ptr, C, LFU: tl.constexpr, CP: tl.constexpr,
                    MV: tl.constexpr):
    """The victims of a recorded group's ``m`` misses: resident slots not used by the group (last
    use before ``t0``; ``lru_guard``: before ``max(t0 - guard, 0)``, the first tick of the group
    ``L - 1`` groups back, so no instance the last ``L`` groups used), least recent first (``lfu``: least
    count first, then least recent), as ``(slots, owners, admitted)``: int64 ``[MV]`` (lane ``j <
    admitted`` = the ``j``-th victim) and ``min(m, slots not barred)`` (the misses past it are read
    in place; lru and lfu always have ``m``: a pool holds at least one group). Reads only: the
    caller writes. Every slot's key lives in registers (``CP`` >= ``C`` lanes)."""
    offs_c = tl.arange(0, CP)
    okc = offs_c < C
    own = tl.load(owner_ptr + offs_c, mask=okc, other=0)
    lu = tl.load(last_use_ptr + own, mask=okc, other=_INT64_MAX)
    # the group's own residents, guarded ones (used at or after tick 0: the warm ticks are no use; guard 0:
    # t0 itself) and padding lanes
    barred = (lu >= tl.maximum(t0 - guard, 0)) | (offs_c >= C)
    lu = tl.where(barred, _INT64_MAX, lu)
    if LFU:
        cnt = tl.load(count_ptr + own, mask=okc, other=float("inf"))
        cnt = tl.where(barred, float("inf"), cnt)
    else:
        cnt = lu
    adm = tl.minimum(m, tl.sum((~barred).to(tl.int32), axis=0))
    slots, olds = _least_keys(lu, cnt, own, adm, LFU, CP, MV)
    return slots, olds, adm


@triton.jit
def _commit_victims(m, slots, olds, new_ptr, row_map_ptr, owner_ptr, victims_ptr, MV: tl.constexpr):
    """The row-map and owner writes of the chosen victims (the evicted instance back to its host
    row, the admitted one, ``new_ptr[j]``, to the slot: int32 writes, never a copy back) and the
    victims list; returns the admitted instances ``[MV]`` (lanes ``j < m``)."""
    jv = tl.arange(0, MV)
    ok = jv < m
    new = tl.load(new_ptr + jv, mask=ok, other=0)
    tl.store(row_map_ptr + olds, (-olds - 1).to(tl.int32), mask=ok & (olds >= 0))  # resident (or an empty slot's -1)
    tl.store(row_map_ptr + new, slots.to(tl.int32), mask=ok)
    tl.store(owner_ptr + slots, new, mask=ok)
    tl.store(victims_ptr + jv, slots, mask=ok)
    return new


@triton.jit(do_not_specialize=PER_LAYER_ARGS)
def _decide_kernel(ids_ptr, n, layer, row_map_ptr, owner_ptr, last_use_ptr, count_ptr, tick_ptr,
                   totals_ptr, history_ptr, groups_ptr, hist_cap, victims_ptr, new_ptr, m_ptr, C, guard,
                   w_ptr, w_out_ptr,
                   E: tl.constexpr, NP: tl.constexpr, CP: tl.constexpr, MV: tl.constexpr, LFU: tl.constexpr,
                   CAST: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:
        gdc_launch_dependents()  # the fill may launch now; its blocks wait for this grid (gdc_wait)
    offs = tl.arange(0, NP)
    valid = offs < n
    ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int64)
    if CAST:  # the router's weights in the activation dtype (round to nearest even, as Tensor.to)
        w = tl.load(w_ptr + offs, mask=valid, other=0.0)
        tl.store(w_out_ptr + offs, w.to(w_out_ptr.dtype.element_ty), mask=valid)
    t0, m = record_group(ids, offs, valid, n, layer, row_map_ptr, last_use_ptr, count_ptr, tick_ptr,
                         totals_ptr, history_ptr, groups_ptr, hist_cap, new_ptr, m_ptr,
                         group_scalars(tick_ptr, totals_ptr, groups_ptr), E)
    if m > 0:
        tl.debug_barrier()  # the group's recency and the missed list are visible to every lane
        slots, olds, adm = _choose_victims(m, t0, guard, owner_ptr, last_use_ptr, count_ptr, C, LFU, CP, MV)
        _commit_victims(adm, slots, olds, new_ptr, row_map_ptr, owner_ptr, victims_ptr, MV)
        tl.store(m_ptr, adm.to(tl.int64))  # the fill copies the admitted; the misses past them read in place


def pdl_available(device: torch.device) -> bool:
    """Whether :func:`decide` and :func:`fill` can run as a programmatic dependent pair on ``device``."""
    return gdc_wait is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _casts(name: str, n: int, weights, weights_out) -> bool:
    """Whether a decisions launch casts router weights (given), checking their layout."""
    if weights is None:
        return False
    if not (weights.is_contiguous() and weights_out.is_contiguous() and weights.numel() == n == weights_out.numel()):
        raise ValueError(f"{name}: weights ({tuple(weights.shape)}) and weights_out "
                         f"({tuple(weights_out.shape)}) must be contiguous with one entry per selection ({n})")
    return True


def decide(cache, layer: int, ids: torch.Tensor, weights: torch.Tensor | None = None,
           weights_out: torch.Tensor | None = None) -> None:
    """The decisions of :meth:`coldset.engine.cache.pool.SlotCache.admit` for ``ids`` (int64 ``[n]``, the
    group's selections in order) in one launch; writes ``cache.victims``, ``cache.admitted`` and
    ``cache.num_misses`` for :func:`fill`. With ``weights`` (float32 ``[n]``, contiguous) the same
    launch writes them cast to ``weights_out``'s dtype into ``weights_out`` (``[n]``, contiguous).
    With ``cache.pdl`` the launch lets the next one (the fill) start early."""
    n = ids.numel()
    cap = cache.capacity
    cp = _next_pow2(cap)
    cast = _casts("decide", n, weights, weights_out)
    _decide_kernel[(1,)](
        ids, n, layer, cache.pools.row_map, cache.owner, cache.last_use, cache.count, cache.tick,
        cache.totals, cache.history, cache.groups, cache.history.shape[0], cache.victims, cache.admitted,
        cache.num_misses, cap, cache.guard_ticks(n), weights if cast else ids, weights_out if cast else ids,
        E=cache.pools.num_experts, NP=max(2, _next_pow2(n)), CP=cp, MV=max(2, _next_pow2(cache.victims.numel())),
        LFU=cache.policy == "lfu", CAST=cast, USE_GDC=cache.pdl, num_warps=_decision_warps(cap))


# The fill's victim choice (CHOOSE): none (a plain copy of a decided list), or the recorded group's
# victims chosen by the fill's blocks for lru, lfu or nexttoken.
CHOOSE_NONE, CHOOSE_LRU, CHOOSE_LFU, CHOOSE_NEXT = 0, 1, 2, 3
_CHOOSE = {"lru": CHOOSE_LRU, "lru_guard": CHOOSE_LRU, "lfu": CHOOSE_LFU, "nexttoken": CHOOSE_NEXT}


@triton.jit
def _choose_next_victims(m, t0, guard, layer, owner_ptr, last_use_ptr, inflight_ptr, predicted_ptr, C,
                         E: tl.constexpr, CP: tl.constexpr, MV: tl.constexpr):
    """nexttoken's demand victims of a recorded group: residents not used by the group nor guarded
    (last use before ``max(t0 - guard, 0)``: no instance the last ``L`` groups used or prefetched)
    and not in flight (layer ``layer``'s in-flight instances are committed at this group, so they
    do not count), ordered by (predicted, last use): unpredicted least recent first. Returns
    ``(slots, owners, admitted)``; misses past the candidates are read in place."""
    offs_c = tl.arange(0, CP)
    okc = offs_c < C
    own = tl.load(owner_ptr + offs_c, mask=okc, other=0)
    held = okc & (own >= 0)  # an empty slot (owner -1): the first victim, neither in flight nor predicted
    lu = tl.where(held | ~okc, tl.load(last_use_ptr + own, mask=held, other=_INT64_MAX), _EMPTY_TICK)
    fl = (tl.load(inflight_ptr + own, mask=held, other=0) != 0) & (own // E != layer)
    pr = tl.load(predicted_ptr + own, mask=held, other=0).to(tl.float32)
    barred = (lu >= tl.maximum(t0 - guard, 0)) | fl | (offs_c >= C)
    lu = tl.where(barred, _INT64_MAX, lu)
    pr = tl.where(barred, float("inf"), pr)
    adm = tl.minimum(m, tl.sum((~barred).to(tl.int32), axis=0))
    slots, olds = _least_keys(lu, pr, own, adm, True, CP, MV)
    return slots, olds, adm


@triton.jit(do_not_specialize=PER_LAYER_ARGS, do_not_specialize_on_alignment=PER_LAYER_VIEWS)
def _fill_kernel(src13_ptr, dst13_ptr, row13, src2_ptr, dst2_ptr, row2, rowmax, slots_ptr, inst_ptr, count_ptr,
                 owner_ptr, last_use_ptr, key_ptr, flag_ptr, tick_ptr, n, layer, C, guard, ticket_ptr, row_map_ptr,
                 tags_ptr, done_ptr, ssrc13_ptr, sdst13_ptr, srow13, ssrc2_ptr, sdst2_ptr, srow2, srowmax,
                 BLOCK: tl.constexpr, NB: tl.constexpr, USE_GDC: tl.constexpr, CHOOSE: tl.constexpr,
                 TAGS: tl.constexpr, E: tl.constexpr, CP: tl.constexpr, MV: tl.constexpr, SCALES: tl.constexpr,
                 COPY: tl.constexpr = True):
    if USE_GDC:
        gdc_launch_dependents()  # the experts kernel may launch now (it waits for this grid before its reads)
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
    if SCALES:  # block-FP8 experts: the weight's scale pool, copied in the same iteration as its rows
        # the row length by a select, not in the branch: a scale row of 1 element is an
        # int specialized to a constant, which a branch could not join with the other's int32
        srow = tl.where(tl.program_id(1) == 0, srow13, srow2)
        if tl.program_id(1) == 0:
            ssrc_base = ssrc13_ptr
            sdst_base = sdst13_ptr
        else:
            ssrc_base = ssrc2_ptr
            sdst_base = sdst2_ptr
    jv = tl.arange(0, MV)
    slots = tl.zeros((MV,), dtype=tl.int64)
    if CHOOSE != 0:
        # The group was recorded by the router's launch; the victims are chosen here, by every
        # block alike (the same reads, the same result), and committed by the last block to
        # finish choosing (a ticket: no block still reads an owner or a recency it writes).
        if m > 0:
            t0 = tl.load(tick_ptr) - n
            if CHOOSE == 3:
                slots, olds, m = _choose_next_victims(m, t0, guard, layer, owner_ptr, last_use_ptr, flag_ptr,
                                                      key_ptr, C, E, CP, MV)
            else:
                slots, olds, m = _choose_victims(m, t0, guard, owner_ptr, last_use_ptr, key_ptr, C, CHOOSE == 2,
                                                 CP, MV)
            tl.debug_barrier()
            ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
            if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
                _commit_victims(m, slots, olds, inst_ptr, row_map_ptr, owner_ptr, slots_ptr, MV)
                tl.store(count_ptr, m.to(tl.int64))  # the admitted (misses past them read in place)
                tl.store(ticket_ptr, 0)
    if COPY:  # (False: choose and commit only; the rows are copied by the launch after this one)
        for j in range(0, MV):  # a constant bound (j < m inside): the same loop in Triton's interpreter
            if j < m:
                if CHOOSE != 0:
                    slot = tl.sum(tl.where(jv == j, slots, 0), axis=0)
                else:
                    slot = tl.load(slots_ptr + j).to(tl.int64)
                inst = tl.load(inst_ptr + j).to(tl.int64)
                src = src_base + inst * row
                dst = dst_base + slot * row
                # this block's stripe, BLOCK elements every NB * BLOCK (the bound the longer row's, masked)
                for start in range(0, rowmax, NB * BLOCK):
                    offs = start + part * BLOCK + tl.arange(0, BLOCK)
                    ok = offs < row
                    tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)
                if SCALES:
                    # the same (slot, instance) pair's scale row, striped alike: a slot's weights and
                    # scales are always one expert's, and both have landed when this grid (or, tagged,
                    # its last block's tag) is complete
                    ssrc = ssrc_base + inst * srow
                    sdst = sdst_base + slot * srow
                    for start in range(0, srowmax, NB * BLOCK):
                        offs = start + part * BLOCK + tl.arange(0, BLOCK)
                        ok = offs < srow
                        tl.store(sdst + offs, tl.load(ssrc + offs, mask=ok), mask=ok)
    if TAGS:
        # A tagged copy (nexttoken's prefetch): the last block to finish copying writes each slot's
        # tag, so a commit that finds the tag it assigned knows the whole row has landed.
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
            ok = jv < m
            s = tl.load(slots_ptr + jv, mask=ok, other=0)
            tl.store(done_ptr + s, tl.load(tags_ptr + jv, mask=ok, other=0), mask=ok)
            tl.store(ticket_ptr, 0)


def _fill_pairs(pools) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, host tier, slots) of every pool a fill copies: both weights, and for scaled
    (block-FP8, MXFP4) experts both scale pools (a slot holds its expert's scales beside its weights)."""
    return [(name, getattr(pools, f"{name}_cold"), getattr(pools, f"{name}_hot")) for name in pools.expert_parts]


def _check_fill_pools(pools) -> None:
    for name, host, slots in _fill_pairs(pools):
        if host is None or slots is None:
            raise ValueError(f"fill: scaled pools without their {name} host tier or slots")
        if host.shape[1:] != slots.shape[1:] or host.dtype != slots.dtype:
            raise ValueError(f"fill: {name} host rows {tuple(host.shape[1:])} {host.dtype} differ from slots "
                             f"{tuple(slots.shape[1:])} {slots.dtype}")
        if not (host.is_contiguous() and slots.is_contiguous()):
            raise ValueError(f"fill: {name} host tier and slots must be contiguous")


def _launch_fill(pools, slots: torch.Tensor, instances: torch.Tensor, count: torch.Tensor, *, blocks: int,
                 pdl: bool, cache=None, choose: int = CHOOSE_NONE, n: int = 0, layer: int = 0,
                 tags: tuple | None = None, copy: bool = True) -> None:
    """The one launcher of :func:`_fill_kernel`: ``slot[slots[j]] = host[instances[j]]`` for both
    weights (block-FP8 pools: and both scale pools, in the same iteration of the same block, so a
    slot never holds one expert's weights with another's scales) and ``j < count``. ``choose``
    (with ``cache``): the victims of the group the router recorded (``n`` selections, MoE layer
    ``layer``) are chosen and committed first. ``tags``:
    ``(tag list, done, ticket)``, the copy's last block writes ``done[slots[j]] = tag[j]``. ``copy``
    False (with ``choose``): choose and commit only, the rows copied by a launch after it."""
    _check_fill_pools(pools)
    mv = max(2, _next_pow2(slots.numel()))
    if choose != CHOOSE_NONE:
        state = (cache.owner, cache.last_use,
                 cache.rules.predicted.view(torch.uint8) if choose == CHOOSE_NEXT else cache.count,
                 cache.rules.inflight.view(torch.uint8) if choose == CHOOSE_NEXT else count,
                 cache.tick, int(n), int(layer), cache.capacity, cache.guard_ticks(n), cache.fill_ticket,
                 pools.row_map)
        cp = _next_pow2(cache.capacity)
    else:  # a plain copy reads none of the cache's state: any tensor stands in for the pointers
        state = (count, count, count, count, count, 0, 0, 0, 0, tags[2] if tags else count, count)
        cp = 2
    tag_list, done = (tags[0], tags[1]) if tags else (count, count)
    fp8 = pools.has_scales  # the scale pools ride in the same launch, never a launch of their own
    if fp8:
        s13, s2 = pools.w13_scale_hot, pools.w2_scale_hot
        scales = (pools.w13_scale_cold, s13, s13[0].numel(), pools.w2_scale_cold, s2, s2[0].numel(),
                  max(s13[0].numel(), s2[0].numel()))
    else:  # not read (SCALES False): any tensor stands in for the pointers
        scales = (count, count, 0, count, count, 0, 0)
    _fill_kernel[(int(blocks), 2)](
        pools.w13_cold, pools.w13_hot, pools.w13_hot[0].numel(), pools.w2_cold, pools.w2_hot,
        pools.w2_hot[0].numel(), max(pools.w13_hot[0].numel(), pools.w2_hot[0].numel()), slots, instances,
        count.reshape(1), *state, tag_list, done, *scales,
        BLOCK=BLOCK, NB=int(blocks), USE_GDC=pdl, CHOOSE=int(choose), TAGS=tags is not None,
        E=pools.num_experts, CP=cp, MV=mv, SCALES=fp8, COPY=bool(copy), num_warps=4, launch_pdl=pdl)


def fill(pools, victims: torch.Tensor, instances: torch.Tensor, count: torch.Tensor, pdl: bool = False,
         blocks: int = FILL_BLOCKS, tags: tuple | None = None) -> None:
    """``slot[victims[j]] = host[instances[j]]`` for both weights (and FP8 scales) and ``j < count`` (``count`` a
    device scalar, at most ``victims.numel()``): ``pools``' hot pools are the slots, its cold pools
    the host tier (pinned, read in place). ``pdl``: launched as the programmatic dependent of
    :func:`decide` (which must be the launch just before it on the stream, with ``cache.pdl`` set).
    ``blocks``: blocks per weight (the prefetch copies beside the compute run with fewer).
    ``tags``: ``(tag list [>= count] int64, done [C] int64, ticket int32 [1] zero)``: the last block
    writes each copied slot's tag into ``done`` (nexttoken's commit checks it)."""
    if getattr(pools, "compressed_fill", None) is not None:  # decoded from a compressed tier (triton_codec_fill)
        return pools.compressed_fill.fill(pools, victims, instances, count, blocks=blocks, tags=tags)
    _launch_fill(pools, victims, instances, count, blocks=blocks, pdl=pdl, tags=tags)


def choose_and_fill(cache, n: int, pdl: bool, layer: int = 0) -> None:
    """The victims and the fill of a group the router's launch recorded
    (:func:`coldset.kernels.triton_decode.route` with :func:`route_record_args`): every block
    chooses the victims (lru/lfu: :func:`_choose_victims`; nexttoken: :func:`_choose_next_victims`,
    the same reads), the last one commits them (row map, owners, ``cache.victims``), and every block
    copies its stripe of each admitted row (pools with a compressed tier's listed fill: one block
    chooses and commits, and the fill, :func:`fill`, decodes the rows in a launch after it). A group
    without a miss costs this launch's blocks one load each. ``n``: the group's selections (its
    first tick is the tick after it minus ``n``); ``layer``: its MoE layer. ``pdl``: the router's
    programmatic dependent."""
    listed = getattr(cache.pools, "compressed_fill", None) is not None  # its fills decode: a launch of their own
    _launch_fill(cache.pools, cache.victims, cache.admitted, cache.num_misses, blocks=1 if listed else FILL_BLOCKS,
                 pdl=pdl, cache=cache, choose=_CHOOSE[cache.policy], n=n, layer=layer, copy=not listed)
    if listed:
        fill(cache.pools, cache.victims, cache.admitted, cache.num_misses)


def route_record_args(cache, layer: int) -> tuple:
    """The arguments :func:`coldset.kernels.triton_decode.route` hands its last program to record
    ``layer``'s group for ``cache`` (:func:`record_group`), in the kernel's order."""
    return (layer, cache.pools.row_map, cache.last_use, cache.count, cache.tick, cache.totals, cache.history,
            cache.groups, cache.history.shape[0], cache.admitted, cache.num_misses)


# ------------------------------------------------------------------------------------------------
# prefetch lists (lookahead, nexttoken): first occurrences, the group's record, victims and commit


@triton.jit
def _record_list(lst, linst, lv, p, hrow, pred_hist_ptr, width, WP: tl.constexpr):
    """A group's prefetch list: of the lanes ``p`` holding instances ``linst`` (``lv`` valid), the
    first occurrence of each, in lane order, written as the group's history row (-1 padded to
    ``width``). Returns ``(fp, rank)``: first-occurrence lanes and their rank in the list.

    ``lst``: the lanes' expert ids (< E; every lane's instance is of one layer, so equal ids are
    equal instances): the lanes' pairwise compare is of int32 ids, not int64 instances. The row is
    a scatter of the first occurrences to their ranks (ranks past ``width`` dropped) beside a -1
    fill of the rest, not a ``[WP, lanes]`` select-and-sum: the same bytes. Why: the router
    launch's last program runs this alone on the step's critical path, and at 8 tokens (64 lanes)
    an int64 compare and a select-and-sum cost it thousands of instructions."""
    e32 = lst.to(tl.int32)
    same = (e32[:, None] == e32[None, :]) & lv[:, None] & lv[None, :]
    fp = lv & (tl.sum((same & (p[None, :] < p[:, None])).to(tl.int32), axis=1) == 0)
    nk = tl.sum(fp.to(tl.int32), axis=0)
    rk = tl.cumsum(fp.to(tl.int32), axis=0) - 1
    row = pred_hist_ptr + hrow * width
    tl.store(row + rk, linst, mask=fp & (rk < width))
    offs_w = tl.arange(0, WP)
    tl.store(row + offs_w, tl.full((WP,), -1, tl.int64), mask=(offs_w >= nk) & (offs_w < width))
    return fp, rk


@triton.jit
def _gate_open(a0, a1, a2, lead_unit, SHIFT: tl.constexpr):
    """Whether the gate with running sums ``a0`` (wanted), ``a1`` (useful), ``a2`` (saving) is open:
    the saving capped at ``lead_unit << SHIFT`` beats the waste ``a0 - a1`` by more than the margin
    ``a0 >> (SHIFT - 1)`` (the simulator's :func:`coldset.analysis.policies.pool.gate_open`)."""
    cap = (a2 * 0 + lead_unit) << SHIFT  # in int64 whether lead_unit comes as int32, int64 or a constant
    return tl.minimum(a2, cap) > (a0 - a1) + (a0 >> (SHIFT - 1))


@triton.jit
def _gate_judge(layer, chosen, col, gate_ptr, want_ptr, want_n_ptr, want_group_ptr, group_index_ptr, lead_unit,
                WM, E: tl.constexpr, WMP: tl.constexpr, COPY: tl.constexpr, SHIFT: tl.constexpr):
    """The prefetch gate at a group of ``layer`` (the rules of
    :func:`coldset.analysis.policies.base.prefetch_lead_unit`; the torch path's
    :meth:`coldset.engine.cache.policy.PrefetchingPolicy.gate`): the pending list for ``layer``
    (``want_ptr`` row ``layer``, ``WM`` wide) judged against the group's experts ``chosen`` (bool
    over ``col``), the running sums at ``gate_ptr`` decayed and updated where one was pending, and
    the list no longer pending. Returns the group's index (``group_index_ptr``, not advanced) and
    whether the gate is open (:func:`_gate_open`)."""
    q = tl.arange(0, WMP)
    wn = tl.load(want_n_ptr + layer)
    wg = tl.load(want_group_ptr + layer)
    gi = tl.load(group_index_ptr)
    wl = tl.load(want_ptr + layer * WM + q, mask=q < WM, other=-1) - layer * E
    hitq = tl.sum(((wl[:, None] == col[None, :]) & chosen[None, :]).to(tl.int32), axis=1) > 0
    useful = tl.sum(((q < wn) & hitq).to(tl.int64), axis=0)
    save = tl.minimum((gi - wg) * lead_unit, COPY)
    a0 = tl.load(gate_ptr)
    a1 = tl.load(gate_ptr + 1)
    a2 = tl.load(gate_ptr + 2)
    if wg >= 0:
        a0 = a0 - (a0 >> SHIFT) + wn * COPY
        a1 = a1 - (a1 >> SHIFT) + useful * COPY
        a2 = a2 - (a2 >> SHIFT) + useful * save
        tl.store(gate_ptr, a0)
        tl.store(gate_ptr + 1, a1)
        tl.store(gate_ptr + 2, a2)
    tl.debug_barrier()  # every read of the pending list is done before it is overwritten
    tl.store(want_group_ptr + layer, tl.where(wg >= 0, -1, wg))
    return gi, _gate_open(a0, a1, a2, lead_unit, SHIFT)


@triton.jit
def _gate_keep(target, want, wrank, linst, gi, want_ptr, want_n_ptr, want_group_ptr, WM):
    """The group's list's wanted lanes (``want``, ranked ``wrank`` in list order, instances
    ``linst``) kept as the pending list for layer ``target`` (the layer it forecasts), listed by
    group ``gi``."""
    nw = tl.sum(want.to(tl.int32), axis=0)
    tl.store(want_ptr + target * WM + wrank, linst, mask=want & (wrank < WM))
    tl.store(want_n_ptr + target, nw.to(tl.int64))
    tl.store(want_group_ptr + target, gi)


@triton.jit
def _gate_views(gate_ptr, L):
    """lookahead's gate state, one int64 buffer (:meth:`coldset.engine.cache.policy.PrefetchingPolicy.init_lists`'s
    layout): ``(sums [3], group index [1], want_n [L], want_group [L], want [L, WM])`` pointers."""
    return gate_ptr, gate_ptr + 3, gate_ptr + 4, gate_ptr + 4 + L, gate_ptr + 4 + 2 * L


@triton.jit
def _issue_prefetches(want, wrank, nwant, linst, barred_extra, t0, bar, n, owner_ptr, last_use_ptr, inflight_ptr,
                      row_map_ptr, pf_victims_ptr, pf_new_ptr, pf_m_ptr, pf_hist_ptr, hrow, C,
                      tag_ptr, pf_tag_ptr, LAYER_BOUND, E: tl.constexpr, SCAN: tl.constexpr, MPV: tl.constexpr,
                      NEXT: tl.constexpr):
    """The prefetch of the ``want`` lanes (``wrank`` their order, ``nwant`` how many may be issued):
    victims least recent first among the slots not used by the group (last use before ``bar``:
    ``t0``, the group's first tick, or nexttoken's guard before it), not
    in flight, not barred by the policy (lookahead: a layer above ``LAYER_BOUND``; nexttoken: a
    predicted instance, ``barred_extra`` = the predicted flags' pointer); each victim's instance back
    to its host row, the prefetched one owns the slot, is in flight and most recent after the
    group's accesses (ticks ``t0 + n + j``). lookahead points the row map at the slot now (its
    copy is joined before the target layer's experts); nexttoken leaves the row map to the commit
    after the step's join and gives each slot a new tag (``pf_tag_ptr``: the copy writes it back).
    Writes the issued list for the copy and the count; returns nothing. The victims:
    :func:`_least_recent` (``SCAN`` slots a tile)."""
    got = nwant * 0
    if nwant > 0:
        slots, olds, free = _least_recent(bar, owner_ptr, last_use_ptr, inflight_ptr, barred_extra, LAYER_BOUND, C, E,
                                          SCAN, MPV, _BAR_FLAG if NEXT else _BAR_LAYER)
        got = tl.minimum(nwant, free)
        tl.store(pf_new_ptr + wrank, linst, mask=want & (wrank < got))  # the prefetched, in list order
        tl.debug_barrier()
        jv = tl.arange(0, MPV)
        ok = jv < got
        if NEXT:
            new = tl.load(pf_new_ptr + jv, mask=ok, other=0)
            tl.store(row_map_ptr + olds, (-olds - 1).to(tl.int32), mask=ok & (olds >= 0))
            tl.store(owner_ptr + slots, new, mask=ok)
            tl.store(pf_victims_ptr + jv, slots, mask=ok)
            tg = tl.load(tag_ptr + slots, mask=ok, other=0) + 1
            tl.store(tag_ptr + slots, tg, mask=ok)
            tl.store(pf_tag_ptr + jv, tg, mask=ok)
        else:
            new = _commit_victims(got, slots, olds, pf_new_ptr, row_map_ptr, owner_ptr, pf_victims_ptr, MPV)
        tl.store(inflight_ptr + new, tl.full((MPV,), 1, tl.uint8), mask=ok)
        tl.store(last_use_ptr + new, t0 + n + jv, mask=ok)  # after the group's accesses
    tl.store(pf_m_ptr, got.to(tl.int64))
    tl.store(pf_hist_ptr + hrow, got.to(tl.int64))


# ------------------------------------------------------------------------------------------------
# lookahead: lru's decisions with the in-flight rule, plus the prefetch of a later layer's forecast

FORECAST_EXPERTS = 2  # experts per program of the forecast's GEMV (E / 2 programs: 64 at E = 128)
FORECAST_TILE = 4096  # router elements a GEMV program loads at once (2 x 2048: all of H at Qwen3-30B-A3B)
FORECAST_WARPS = 2  # warps a GEMV program (a token's reduction crosses 2 warps, not 4)


@triton.jit
def _forecast_kernel(x_ptr, w_ptr, out_ptr, T, H, stride_x, E: tl.constexpr, TP: tl.constexpr, BE: tl.constexpr,
                     BH: tl.constexpr, USE_GDC: tl.constexpr):
    """``out[t, e] = sum_h x[t, h] * w[e, h]`` for this program's ``BE`` experts and every token:
    each program reads its experts' router rows once (``H`` contiguous: coalesced; all of them in
    one load where ``H <= BH``) and each token's row (from L2 after the first program), the tokens
    unrolled so that their loads are independent, products and sums in float32."""
    if USE_GDC:
        gdc_launch_dependents()  # the decisions may launch now; they wait for this grid before reading the logits
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    oke = e < E
    tok = tl.arange(0, TP)
    acc = tl.zeros((TP, BE), dtype=tl.float32)
    for h0 in range(0, H, BH):
        hh = h0 + tl.arange(0, BH)
        okh = hh < H
        w = tl.load(w_ptr + e[:, None].to(tl.int64) * H + hh[None, :], mask=oke[:, None] & okh[None, :], other=0.0)
        w = w.to(tl.float32)
        for t in tl.static_range(TP):
            x = tl.load(x_ptr + t * stride_x + hh, mask=okh & (t < T), other=0.0).to(tl.float32)
            part = tl.sum(w * x[None, :], axis=1)
            acc = tl.where(tok[:, None] == t, acc + part[None, :], acc)
    tl.store(out_ptr + tok[:, None] * E + e[None, :], acc, mask=(tok < T)[:, None] & oke[None, :])


def forecast_logits(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``lookahead``'s forecast on CUDA: ``out = x @ weight.T`` in float32 (``x`` ``[T, H]`` with
    contiguous rows, ``weight`` a router ``[E, H]`` contiguous, both in the model's dtype, read as
    they are; ``out`` float32 ``[T, E]`` contiguous, the layout :func:`decide_ahead` reads) in one
    launch of ``E / FORECAST_EXPERTS`` programs, where a float32 cast of the router input and a
    ``torch.mm`` over a float32 copy of the router take two launches (the GEMM launch- and
    parallelism-bound at one program per output tile). Products are exact for bf16 operands and
    summed in float32 (in an order of its own: the lists are recorded by the engine, so the
    logits' rounding is not a contract). ``pdl``: the next launch (:func:`decide_ahead` with
    ``cache.pdl``) may start at once and do its demand part beside this one (checked under
    Triton's interpreter against float64)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"forecast_logits: x must be [tokens, hidden] with contiguous rows, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    T, H = x.shape
    E = weight.shape[0]
    if weight.shape != (E, H) or not weight.is_contiguous():
        raise ValueError(f"forecast_logits: weight must be a contiguous router [experts, {H}], got "
                         f"{tuple(weight.shape)} (contiguous {weight.is_contiguous()})")
    if out.dtype != torch.float32 or out.shape != (T, E) or not out.is_contiguous():
        raise ValueError(f"forecast_logits: out must be float32 contiguous [{T}, {E}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    tp = _next_pow2(T)
    be = FORECAST_EXPERTS
    bh = min(max(16, _next_pow2(H)), max(16, FORECAST_TILE // be))
    _forecast_kernel[(triton.cdiv(E, be),)](x, weight, out, T, H, x.stride(0), E=E, TP=tp, BE=be, BH=bh,
                                            USE_GDC=pdl, num_warps=FORECAST_WARPS)
    return out


@triton.jit
def _ordered_keys(v, col, EP: tl.constexpr):
    """int64 keys whose descending order is the logits' ``v`` (float32) descending order with ties
    to the lower column ``col``: the logit's bits made order-preserving as a signed integer (``-0.0``
    first made ``+0.0``: they compare equal, so they tie), above ``EP - 1 - col``."""
    v = tl.where(v == 0.0, 0.0, v)
    bits = v.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (EP - 1 - col).to(tl.int64)


@triton.jit
def forecast_tile(logits_ptr, n_tok, E: tl.constexpr, TP: tl.constexpr, EP: tl.constexpr):
    """Layer ``target``'s float32 router logits ``[n_tok, E]`` at ``logits_ptr`` as a ``[TP, EP]``
    tile, ``-inf`` past them: the forecast :func:`ahead_group` and :func:`ahead_list` rank. A load
    of its own so that a caller can issue it early, beside :func:`group_scalars`. ``.cg``: other
    programs of the router's launch, or the GEMV, stored them; L2 is where they are."""
    tok = tl.arange(0, TP)
    col = tl.arange(0, EP)
    return tl.load(logits_ptr + tok[:, None] * E + col[None, :], mask=(tok < n_tok)[:, None] & (col[None, :] < E),
                   other=float("-inf"), cache_modifier=".cg")


@triton.jit
def _forecast_list(v, n_tok, target, row_map_ptr, hrow, pred_hist_ptr, width, E: tl.constexpr, K: tl.constexpr,
                   KP: tl.constexpr, TP: tl.constexpr, EP: tl.constexpr, WP: tl.constexpr):
    """lookahead's forecast list from the logits tile ``v`` (:func:`forecast_tile`): each token's top
    ``K`` (descending, ties by expert id: a stable sort), token by token, first occurrence kept, as
    the group's history row. One partial bitonic sort (``tl.topk``) of (logit, id) keys per token.
    Returns ``(linst, lv, fp, lrow)``: the lanes'
    instances of layer ``target``, valid lanes, first occurrences and their row-map entries (loaded
    on the valid lanes, issued before the list's record so that its latency hides behind it and
    whatever the caller does next: ``fp & (lrow < 0)`` is the same on any superset of ``fp``)."""
    col = tl.arange(0, EP)
    top = tl.topk(_ordered_keys(v, col[None, :], EP), KP, dim=1)  # [TP, KP], descending
    lst = (EP - 1) - (tl.reshape(top, [TP * KP]) & (EP - 1))  # lane p: token p // KP, rank p % KP
    p = tl.arange(0, TP * KP)
    lv = ((p // KP) < n_tok) & ((p % KP) < K)
    linst = target * E + lst
    lrow = tl.load(row_map_ptr + linst, mask=lv, other=0)
    fp, rk = _record_list(lst, linst, lv, p, hrow, pred_hist_ptr, width, WP)
    return linst, lv, fp, lrow


@triton.jit
def _ahead_prefetch(linst, fp, lrow, t0, n, layer, target, owner_ptr, last_use_ptr, inflight_ptr, row_map_ptr,
                    pf_victims_ptr, pf_new_ptr, pf_m_ptr, pf_hist_ptr, hrow, C, guard, gate_ptr, L, WM, lead_unit,
                    gate_on, E: tl.constexpr, SCAN: tl.constexpr, MPV: tl.constexpr, SHIFT: tl.constexpr):
    """lookahead's prefetch of a group's list (``linst`` the lanes' instances, ``fp`` their first
    occurrences, ``lrow`` their row-map entries after the group's demand commit): the listed
    instances not resident, in list order, kept as the gate's pending list for layer ``target``
    (:func:`_gate_keep`) and, while the gate is open (its sums after :func:`ahead_group`'s judgement;
    always without ``gate_on``), prefetched into victims of layers ``<= layer`` not guarded (last use
    before ``max(t0 - guard, 0)``: ``lru_guard``'s bar) (:func:`_issue_prefetches`)."""
    want = fp & (lrow < 0)
    wrank = tl.cumsum(want.to(tl.int32), axis=0) - 1
    nwant = tl.sum(want.to(tl.int32), axis=0)
    tl.debug_barrier()  # the record's recency, the in-flight clearing and the gate's sums are visible
    g_sums, g_index, g_want_n, g_want_group, g_want = _gate_views(gate_ptr, L)
    a0 = tl.load(g_sums)
    a1 = tl.load(g_sums + 1)
    a2 = tl.load(g_sums + 2)
    _gate_keep(target, want, wrank, linst, tl.load(g_index) - 1, g_want, g_want_n, g_want_group, WM)
    nwant = tl.where(_gate_open(a0, a1, a2, lead_unit, SHIFT) | (gate_on == 0), nwant, 0)
    _issue_prefetches(want, wrank, nwant, linst, inflight_ptr, t0, tl.maximum(t0 - guard, 0), n, owner_ptr,
                      last_use_ptr, inflight_ptr, row_map_ptr, pf_victims_ptr, pf_new_ptr, pf_m_ptr, pf_hist_ptr, hrow,
                      C, pf_m_ptr, pf_m_ptr, layer, E, SCAN, MPV, False)


@triton.jit
def ahead_group(ids, sel, valid, n, layer, scalars, forecast, row_map_ptr, owner_ptr, last_use_ptr, count_ptr,
                tick_ptr, totals_ptr, history_ptr, groups_ptr, hist_cap, victims_ptr, new_ptr, m_ptr, C, inflight_ptr,
                new_step, logits_ptr, n_tok, target, pf_victims_ptr, pf_new_ptr, pf_m_ptr, pred_hist_ptr, pf_hist_ptr,
                width, guard, gate_ptr, L, WM, lead_unit, gate_on, E: tl.constexpr, SCAN: tl.constexpr,
                MV: tl.constexpr, AHEAD: tl.constexpr, K: tl.constexpr,
                KP: tl.constexpr, TP: tl.constexpr, EP: tl.constexpr, WP: tl.constexpr, MPV: tl.constexpr,
                ZB: tl.constexpr, NI: tl.constexpr, WMP: tl.constexpr, COPY: tl.constexpr, SHIFT: tl.constexpr,
                WAIT_LOGITS: tl.constexpr, LIST: tl.constexpr = True):
    """``lookahead``'s whole decision for one group (``ids``: one selection per lane, ``sel`` its
    index in the group, ``valid`` masks padding lanes; ``scalars``: :func:`group_scalars`' values),
    in one program: the group's record, the new step's in-flight clearing, the demand victims with
    the in-flight rule and their commit, then (``AHEAD``: layer ``target`` exists) the forecast list
    from layer ``target``'s float32 router logits ``[n_tok, E]`` and its prefetch decisions, else an
    empty list; the tick after the list. ``forecast``: the logits as :func:`forecast_tile` loads
    them from ``logits_ptr`` (the caller issues that load early); with ``WAIT_LOGITS`` (wait on the
    preceding grid, the forecast GEMV, before reading the logits) or without ``LIST`` any value:
    they are loaded here after the wait, or not at all. Called by :func:`_ahead_kernel` (a launch
    of its own) and by the router's launch's last program
    (:func:`coldset.kernels.triton_decode.route` with :func:`route_ahead_args`) without ``LIST``:
    there the list and its prefetch decisions are :func:`ahead_list`'s launch
    (:func:`_ahead_list_kernel`, the same code as here), off the router's critical path. One body,
    so the paths decide alike.

    The order (``LIST`` without ``WAIT_LOGITS``): the forecast's top-k and list, and the row-map
    gather of the list, come before the group's record, so that gather and the record's gathers are one round
    trip to L2, and a group with neither a demand miss nor a prefetch (residency 1.0) makes no
    other. The gather is taken again after a demand commit (which can evict an instance of layer
    ``target`` and rewrite its row-map entry); nothing else the list part reads (the logits, the row
    map) is written by the record. The barriers sit on the paths that read what other threads
    wrote: the demand scan (the record's recency, the in-flight clearing), the reload and the
    prefetch scan (the demand commit); a group without either passes none but the record's own."""
    t_s, hits_s, misses_s, fills_s, g_s = scalars
    hrow = g_s % hist_cap  # this group's history row (record_group counts it)
    if AHEAD and LIST and not WAIT_LOGITS:
        linst, lv, fp, lrow = _forecast_list(forecast, n_tok, target, row_map_ptr, hrow, pred_hist_ptr, width, E, K,
                                             KP, TP, EP, WP)
    # The group's record (lru's: recency first, so its own slots are told apart by ticks >= t0;
    # counters, history, the missed instances in selection order), then the victims.
    t0, m = record_group(ids, sel, valid, n, layer, row_map_ptr, last_use_ptr, count_ptr, tick_ptr, totals_ptr,
                         history_ptr, groups_ptr, hist_cap, new_ptr, m_ptr, scalars, E)
    if new_step != 0:  # a new step: the last step's prefetches are committed (no longer in flight)
        for z in range(0, NI, ZB):
            zo = z + tl.arange(0, ZB)
            tl.store(inflight_ptr + zo, tl.zeros((ZB,), dtype=tl.uint8), mask=zo < NI)
    # the gate: the pending list for this layer judged against the group's experts; the group counted
    col = tl.arange(0, EP)
    chosen = tl.max(((ids[:, None] == col[None, :]) & valid[:, None]).to(tl.int32), axis=0) > 0
    g_sums, g_index, g_want_n, g_want_group, g_want = _gate_views(gate_ptr, L)
    gi, _ = _gate_judge(layer, chosen, col, g_sums, g_want, g_want_n, g_want_group, g_index, lead_unit, WM, E, WMP,
                        COPY, SHIFT)
    tl.store(g_index, gi + 1)
    if m > 0:
        # Demand victims: least recent slot neither used by the group, nor in flight, nor guarded
        # (lru_guard's bar); a miss beyond them is read in place (not admitted).
        tl.debug_barrier()  # the group's recency, the missed list and the in-flight clearing are visible
        slots, olds, free = _least_recent(tl.maximum(t0 - guard, 0), owner_ptr, last_use_ptr, inflight_ptr,
                                          inflight_ptr, 0, C, E, SCAN, MV, _BAR_NONE)
        adm = tl.minimum(m, free)
        _commit_victims(adm, slots, olds, new_ptr, row_map_ptr, owner_ptr, victims_ptr, MV)
        tl.store(m_ptr, adm.to(tl.int64))  # the admitted: the demand fill's count
        tl.debug_barrier()  # the demand writes (row map, owners) are visible to every thread
        if AHEAD and LIST and not WAIT_LOGITS:
            lrow = tl.load(row_map_ptr + linst, mask=lv, other=0)  # a victim may be a listed instance
    if AHEAD:
        if LIST:
            if WAIT_LOGITS:
                gdc_wait()  # launched as the forecast GEMV's dependent: its logits are complete after this
                linst, lv, fp, lrow = _forecast_list(forecast_tile(logits_ptr, n_tok, E, TP, EP), n_tok, target,
                                                     row_map_ptr, hrow, pred_hist_ptr, width, E, K, KP, TP, EP, WP)
            _ahead_prefetch(linst, fp, lrow, t0, n, layer, target, owner_ptr, last_use_ptr, inflight_ptr, row_map_ptr,
                            pf_victims_ptr, pf_new_ptr, pf_m_ptr, pf_hist_ptr, hrow, C, guard, gate_ptr, L, WM,
                            lead_unit, gate_on, E, SCAN, MPV, SHIFT)
        # else: the list and its prefetch decisions are ahead_list's launch (after this one)
    else:
        tl.store(pred_hist_ptr + hrow * width + tl.arange(0, WP), tl.full((WP,), -1, tl.int64),
                 mask=tl.arange(0, WP) < width)
        tl.store(pf_hist_ptr + hrow, hrow.to(tl.int64) * 0)
    tl.store(tick_ptr, t0 + n + width)  # the list's ticks after the group's (record_group wrote t0 + n)


@triton.jit(do_not_specialize=PER_LAYER_ARGS, do_not_specialize_on_alignment=PER_LAYER_VIEWS)
def _ahead_kernel(ids_ptr, n, layer, row_map_ptr, owner_ptr, last_use_ptr, count_ptr, tick_ptr,
                  totals_ptr, history_ptr, groups_ptr, hist_cap, victims_ptr, new_ptr, m_ptr, C,
                  w_ptr, w_out_ptr, inflight_ptr, new_step, logits_ptr, n_tok, target,
                  pf_victims_ptr, pf_new_ptr, pf_m_ptr, pred_hist_ptr, pf_hist_ptr, width,
                  guard, gate_ptr, L, WM, lead_unit, gate_on,
                  E: tl.constexpr, NP: tl.constexpr, SCAN: tl.constexpr, MV: tl.constexpr, CAST: tl.constexpr,
                  USE_GDC: tl.constexpr, AHEAD: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, TP: tl.constexpr,
                  EP: tl.constexpr, WP: tl.constexpr, MPV: tl.constexpr, ZB: tl.constexpr, NI: tl.constexpr,
                  WMP: tl.constexpr, COPY: tl.constexpr, SHIFT: tl.constexpr, WAIT_LOGITS: tl.constexpr):
    if USE_GDC:
        gdc_launch_dependents()  # the demand fill may launch now; its blocks wait for this grid
    offs = tl.arange(0, NP)
    valid = offs < n
    ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int64)
    if CAST:
        w = tl.load(w_ptr + offs, mask=valid, other=0.0)
        tl.store(w_out_ptr + offs, w.to(w_out_ptr.dtype.element_ty), mask=valid)
    if AHEAD and not WAIT_LOGITS:  # the logits are complete: loaded beside the group's scalars
        forecast = forecast_tile(logits_ptr, n_tok, E, TP, EP)
    else:  # not read (no forecast, or ahead_group loads it after its wait)
        forecast = 0
    ahead_group(ids, offs, valid, n, layer, group_scalars(tick_ptr, totals_ptr, groups_ptr), forecast, row_map_ptr,
                owner_ptr, last_use_ptr, count_ptr, tick_ptr, totals_ptr, history_ptr, groups_ptr, hist_cap,
                victims_ptr, new_ptr, m_ptr, C, inflight_ptr, new_step, logits_ptr, n_tok, target, pf_victims_ptr,
                pf_new_ptr, pf_m_ptr, pred_hist_ptr, pf_hist_ptr, width, guard, gate_ptr, L, WM, lead_unit, gate_on,
                E, SCAN, MV, AHEAD, K, KP, TP, EP, WP, MPV, ZB, NI, WMP, COPY, SHIFT, WAIT_LOGITS)


@triton.jit(do_not_specialize=PER_LAYER_ARGS,
            do_not_specialize_on_alignment=PER_LAYER_VIEWS + ("pf_victims_ptr", "pf_new_ptr"))
def _ahead_list_kernel(logits_ptr, n_tok, n, layer, target, row_map_ptr, owner_ptr, last_use_ptr, inflight_ptr,
                       tick_ptr, groups_ptr, hist_cap, pf_victims_ptr, pf_new_ptr, pf_m_ptr, pred_hist_ptr,
                       pf_hist_ptr, width, C, guard, gate_ptr, L, WM, lead_unit, gate_on, E: tl.constexpr,
                       K: tl.constexpr, KP: tl.constexpr, TP: tl.constexpr, EP: tl.constexpr, WP: tl.constexpr,
                       SCAN: tl.constexpr, MPV: tl.constexpr, SHIFT: tl.constexpr):
    # The group was recorded (its history row counted, its ticks and the list's reserved: the
    # tick is t0 + n + width) and its demand committed by the router's launch before this one.
    hrow = (tl.load(groups_ptr) - 1) % hist_cap
    t0 = tl.load(tick_ptr) - n - width
    linst, lv, fp, lrow = _forecast_list(forecast_tile(logits_ptr, n_tok, E, TP, EP), n_tok, target, row_map_ptr,
                                         hrow, pred_hist_ptr, width, E, K, KP, TP, EP, WP)
    _ahead_prefetch(linst, fp, lrow, t0, n, layer, target, owner_ptr, last_use_ptr, inflight_ptr, row_map_ptr,
                    pf_victims_ptr, pf_new_ptr, pf_m_ptr, pf_hist_ptr, hrow, C, guard, gate_ptr, L, WM, lead_unit,
                    gate_on, E, SCAN, MPV, SHIFT)


def ahead_list(cache, layer: int, target: int, n: int) -> None:
    """``lookahead``'s forecast list and prefetch decisions of group ``layer`` (``n`` selections)
    in one launch of one program, after the router's launch (:func:`route_ahead_args`) recorded the
    group, made its demand decisions and wrote the forecast logits of layer ``target`` into
    ``cache.rules.forecast_out``: the same code as :func:`ahead_group`'s list part (:func:`_forecast_list`,
    :func:`_ahead_prefetch`), on the state the router's launch left, so the same decisions. Writes
    the group's list into its history row and row ``target`` of ``cache.rules.pf_victims`` /
    ``cache.rules.pf_new`` / ``cache.rules.pf_count`` for the prefetch's fill. Why a launch of its own: the
    list (its sort, its record, its row-map gather) is about a third of the router's last program
    after the ticket, on the step's critical path; here it runs on the decisions stream
    beside the layer's experts (:meth:`coldset.engine.cache.pool.SlotCache.route`), and the next group's router
    waits for it (it reads the state this launch writes)."""
    rules = cache.rules  # the policy's state
    E, k = cache.pools.num_experts, cache.top_k
    if not 0 <= layer < target < cache.pools.num_moe_layers:
        raise ValueError(f"ahead_list: target {target} must be a later MoE layer than {layer} "
                         f"(of {cache.pools.num_moe_layers})")
    if n <= 0 or n % k or n // k > rules.forecast_out.shape[0]:
        raise ValueError(f"ahead_list: {n} selections are not whole tokens of top-{k} within "
                         f"{rules.forecast_out.shape[0]} tokens")
    sizes = _ahead_sizes(cache)
    width = rules.prediction_history.shape[1]
    _ahead_list_kernel[(1,)](
        rules.forecast_out, n // k, n, layer, target, cache.pools.row_map, cache.owner, cache.last_use,
        rules.inflight.view(torch.uint8), cache.tick, cache.groups, cache.history.shape[0], rules.pf_victims[target],
        rules.pf_new[target], rules.pf_count[target], rules.prediction_history, rules.prefetch_history, width,
        cache.capacity, *_ahead_gate_args(cache, n), E=E, K=k, KP=_next_pow2(k),
        TP=max(2, _next_pow2(n // k)), EP=max(2, _next_pow2(E)), WP=sizes["WP"], SCAN=sizes["SCAN"], MPV=sizes["MPV"],
        SHIFT=sizes["SHIFT"], num_warps=_decision_warps(cache.capacity))


def decide_ahead(cache, layer: int, ids: torch.Tensor, new_step: bool, logits: torch.Tensor | None,
                 target: int, weights: torch.Tensor | None = None, weights_out: torch.Tensor | None = None,
                 after_forecast: bool = False) -> None:
    """``lookahead``'s decisions for one group in one launch (:meth:`coldset.engine.cache.pool.SlotCache.admit`'s
    torch path, the simulator's ``lookahead`` rules): the demand decisions with the in-flight rule
    (writes ``cache.victims``, ``cache.admitted`` and the admitted count ``cache.num_misses`` for the
    demand fill), then with ``logits`` (float32 ``[T, E]``, layer ``target``'s router on this
    layer's router input) the forecast list and the prefetch decisions, written to row ``target``
    of ``cache.rules.pf_victims`` / ``cache.rules.pf_new`` / ``cache.rules.pf_count`` for the prefetch's fill, and the
    list and its count into the group's history rows. ``new_step``: the first group of a step
    (the in-flight flags are cleared first). ``after_forecast`` (with ``cache.pdl``): the launch is
    the programmatic dependent of :func:`forecast_logits` (launched with ``pdl``, right before it on
    the stream): its demand part runs beside the GEMV and it waits for the GEMV's grid before
    reading the logits. The forecast's top ``k`` is one partial bitonic sort of (logit, id) keys
    per token (ties to the lower id, ``-0.0`` tying ``+0.0``)."""
    rules = cache.rules  # the policy's state
    n = ids.numel()
    cap = cache.capacity
    cast = _casts("decide_ahead", n, weights, weights_out)
    E = cache.pools.num_experts
    k = cache.top_k
    ahead = logits is not None
    if ahead and not (logits.dtype == torch.float32 and logits.is_contiguous() and logits.shape == (n // k, E)):
        raise ValueError(f"decide_ahead: logits must be float32 contiguous [{n // k}, {E}], got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    width = rules.prediction_history.shape[1]
    t = target if ahead else 0
    wait = bool(after_forecast and ahead and cache.pdl)
    _ahead_kernel[(1,)](
        ids, n, layer, cache.pools.row_map, cache.owner, cache.last_use, cache.count, cache.tick,
        cache.totals, cache.history, cache.groups, cache.history.shape[0], cache.victims, cache.admitted,
        cache.num_misses, cap, weights if cast else ids, weights_out if cast else ids,
        rules.inflight.view(torch.uint8), int(new_step), logits if ahead else ids, n // k, t,
        rules.pf_victims[t], rules.pf_new[t], rules.pf_count[t], rules.prediction_history,
        rules.prefetch_history, width, *_ahead_gate_args(cache, n),
        E=E, NP=max(2, _next_pow2(n)), CAST=cast, USE_GDC=cache.pdl, AHEAD=ahead, K=k, KP=_next_pow2(k),
        TP=max(2, _next_pow2(n // k)), EP=max(2, _next_pow2(E)), WAIT_LOGITS=wait, **_ahead_sizes(cache),
        num_warps=_decision_warps(cap), launch_pdl=wait)


def _scan_size(capacity: int, *picks: int) -> int:
    """The tile of :func:`_least_recent`'s victim scans over ``capacity`` slots: ``SCAN_TILE`` slots,
    fewer for a smaller cache (its power of two), at least every pick count of ``picks`` (the
    victim spans, powers of two: a tile's ``tl.topk`` takes that many). The scan's keys hold a
    slot in 14 bits: a larger cache is refused (the decisions run as torch ops there)."""
    if not 0 < capacity <= KERNEL_MAX_SLOTS:
        raise ValueError(f"_scan_size: capacity {capacity} outside the Triton decisions' 1..{KERNEL_MAX_SLOTS} slots")
    if SCAN_TILE < 1 or _next_pow2(SCAN_TILE) != SCAN_TILE:
        raise ValueError(f"_scan_size: SCAN_TILE {SCAN_TILE} is not a power of two")
    return max(min(_next_pow2(capacity), SCAN_TILE), *picks)


def _ahead_sizes(cache) -> dict:
    """:func:`ahead_group`'s block sizes that depend on the cache only (victim scan tile, victims,
    list width, prefetch span, in-flight flags), for both of its launches."""
    rules = cache.rules  # the policy's state
    mv, mpv = max(2, _next_pow2(cache.victims.numel())), max(2, _next_pow2(rules.pf_victims.shape[1]))
    return dict(SCAN=_scan_size(cache.capacity, mv, mpv), MV=mv, MPV=mpv,
                WP=max(2, _next_pow2(rules.prediction_history.shape[1])), ZB=1024, NI=rules.inflight.numel(),
                WMP=max(2, _next_pow2(rules.want.shape[1])), COPY=rules.copy_unit, SHIFT=rules.gate_shift)


def _ahead_gate_args(cache, n: int) -> tuple:
    """lookahead's guard and gate arguments of a group of ``n`` selections, in the kernels' order:
    ``lru_guard``'s bar in ticks, the gate's state buffer, the MoE layers, a pending list's width,
    the gate's lead unit and whether it may close."""
    rules = cache.rules  # the policy's state
    return (cache.guard_ticks(n), rules.gate_state, cache.pools.num_moe_layers, rules.want.shape[1], rules.lead_unit,
            int(rules.gate_on))


def route_ahead_args(cache, layer: int, target: int, new_step: bool, n: int) -> tuple:
    """What :func:`coldset.kernels.triton_decode.route` needs to run ``lookahead``'s whole decision
    for ``layer``'s group in its launch (:func:`ahead_group` in the last program, on the selections
    in registers, after every program wrote its tokens' forecast logits of layer ``target``'s router
    into ``cache.rules.forecast_out``): ``(record, ahead, sizes)``, :func:`route_record_args`' values, the
    decisions' other arguments in the kernel's order (owners, victims, slots, in-flight flags, the
    new step, the target router ``[E, H]`` (read by every program beside its own rows; ``target >=
    L``: no forecast, the group's list is empty), the forecast buffer, the target, its prefetch
    rows, the histories, the list width, then :func:`_ahead_gate_args` for the group's ``n``
    selections) and the decisions' block sizes (``FORECAST``: whether layer ``target`` exists)."""
    rules = cache.rules  # the policy's state
    L = cache.pools.num_moe_layers
    ahead = target < L
    t = target if ahead else 0
    args = (cache.owner, cache.victims, cache.capacity, rules.inflight.view(torch.uint8), int(new_step),
            rules.forecast_routers[t] if ahead else rules.forecast_out, rules.forecast_out, t, rules.pf_victims[t],
            rules.pf_new[t], rules.pf_count[t], rules.prediction_history, rules.prefetch_history,
            rules.prediction_history.shape[1], *_ahead_gate_args(cache, n))
    return route_record_args(cache, layer), args, dict(FORECAST=ahead, **_ahead_sizes(cache))


# ------------------------------------------------------------------------------------------------
# nexttoken: the forecast of layer l's experts for the next token, its prefetch and the commit


@triton.jit(do_not_specialize=PER_LAYER_ARGS, do_not_specialize_on_alignment=PER_LAYER_VIEWS)
def _next_kernel(ids_ptr, n, layer, new_step, row_map_ptr, owner_ptr, last_use_ptr, tick_ptr, groups_ptr,
                 inflight_ptr, predicted_ptr, tag_ptr, sel_ptr, step_ptr, terms_ptr, tables_ptr, seq_hist_ptr,
                 hist_unit, hist_shift,
                 pf_victims_ptr, pf_new_ptr, pf_tag_ptr, pf_m_ptr, pred_hist_ptr, pf_hist_ptr, hist_cap, width,
                 budget, C, L, R, guard, gate_ptr, want_ptr, want_n_ptr, want_group_ptr, group_index_ptr, lead_unit,
                 gate_on, WM, E: tl.constexpr, K: tl.constexpr, NPRED: tl.constexpr, NSEL: tl.constexpr, J: tl.constexpr,
                 TP: tl.constexpr, EP: tl.constexpr, WP: tl.constexpr, SCAN: tl.constexpr, MPV: tl.constexpr,
                 WMP: tl.constexpr, COPY: tl.constexpr, SHIFT: tl.constexpr):
    """nexttoken after group (step, ``layer``), on the side stream once the group's demand is
    committed (the rules of coldset.analysis.policies.nexttoken): the commit of layer ``layer``'s
    previous prefetches (their in-flight flags), the forecast (integer table sums over the terms,
    each token's top ``NPRED``, ties to the lower id, round robin over rank then token, first
    occurrence kept), the gate (layer ``layer``'s pending list judged against the group's experts,
    the running sums ``gate_ptr`` updated, this list's wanted instances kept for the next judgement)
    and, where it is open, layer ``layer``'s predicted flags (else none) and the prefetch of the listed experts
    not resident (at most ``budget``; victims not used by the group, not guarded (last use before
    ``max(t0 - guard, 0)``), not in flight, not predicted, least recent first)."""
    step = tl.load(step_ptr)
    if new_step != 0:
        step = step + 1
        tl.store(step_ptr, step)
    row = step % R
    n_tok = n // K
    tok = tl.arange(0, TP)
    okt = tok < n_tok
    col = tl.arange(0, EP)
    oke = col < E
    # The group's selections into the ring (the terms read them: this token's layer, and later
    # tokens read this step's), and layer `layer`'s in-flight flags cleared (the commit).
    for r in tl.static_range(K):
        e_r = tl.load(ids_ptr + tok * K + r, mask=okt, other=-1)
        tl.store(sel_ptr + (row * L + layer) * NSEL + tok * K + r, e_r, mask=okt)
    tl.store(inflight_ptr + layer * E + col, tl.zeros((EP,), dtype=tl.uint8), mask=oke)
    # The lanes' history H of this layer (int32 [max_tokens, E]): decayed, plus this step's experts.
    hp = seq_hist_ptr + layer * NSEL // K * E + tok[:, None] * E + col[None, :]
    hm = okt[:, None] & oke[None, :]
    hh = tl.load(hp, mask=hm, other=0)
    onehot = tl.zeros((TP, EP), dtype=tl.int32)
    for r in tl.static_range(K):
        e_r = tl.load(ids_ptr + tok * K + r, mask=okt, other=-1)
        onehot = tl.where(col[None, :] == e_r[:, None], 1, onehot)
    hh = hh - (hh >> hist_shift) + hist_unit * onehot
    tl.store(hp, hh, mask=hm)
    tl.debug_barrier()
    score = hh
    tab = tables_ptr + layer * E * E  # int32 offsets: J * L * E * E < 2**31 (checked by the caller)
    for j in tl.static_range(J):
        a = tl.load(terms_ptr + 2 * j)
        d = tl.load(terms_ptr + 2 * j + 1)
        src = layer - d
        use = (src >= 0) & (src < L) & (step - a >= 0)
        srow = (step - a + R) % R
        src = tl.minimum(tl.maximum(src, 0), L - 1)
        for r in tl.static_range(K):
            e_r = tl.load(sel_ptr + (srow * L + src) * NSEL + tok * K + r, mask=okt & use, other=-1)
            score += tl.load(tab + (j * L * E * E + e_r.to(tl.int64) * E)[:, None] + col[None, :],
                             mask=(e_r >= 0)[:, None] & oke[None, :], other=0)
    low = -2147483647 - 1
    v = tl.where(okt[:, None] & oke[None, :], score, low)
    p = tl.arange(0, WP)
    lv = p < n_tok * NPRED
    lst = tl.zeros((WP,), dtype=tl.int64)
    for r in tl.static_range(NPRED):
        mx = tl.max(v, axis=1)
        idx = tl.min(tl.where(v == mx[:, None], col[None, :], EP), axis=1)
        v = tl.where(col[None, :] == idx[:, None], low, v)
        pick = tl.sum(tl.where((p % n_tok)[:, None] == tok[None, :], idx[None, :], 0), axis=1)
        lst = tl.where(p // n_tok == r, pick.to(tl.int64), lst)
    linst = layer * E + lst
    hrow = (tl.load(groups_ptr) - 1) % hist_cap  # the router's launch recorded this group
    fp, rk = _record_list(lst, linst, lv, p, hrow, pred_hist_ptr, width, WP)
    lrow = tl.load(row_map_ptr + linst, mask=fp, other=0)
    want = fp & (lrow < 0)
    wrank = tl.cumsum(want.to(tl.int32), axis=0) - 1
    # the gate: layer `layer`'s pending list against the group's experts (onehot), then this list's
    chosen = tl.max(onehot, axis=0) > 0  # [EP]: the experts the group selected
    gi, gate_open = _gate_judge(layer, chosen, col, gate_ptr, want_ptr, want_n_ptr, want_group_ptr, group_index_ptr,
                                lead_unit, WM, E, WMP, COPY, SHIFT)
    nw = tl.sum(want.to(tl.int32), axis=0)
    _gate_keep(layer, want, wrank, linst, gi, want_ptr, want_n_ptr, want_group_ptr, WM)
    tl.store(group_index_ptr, gi + 1)
    is_open = gate_open | (gate_on == 0)
    nwant = tl.where(is_open, tl.minimum(nw, budget), 0)
    # the forecast's predicted flags (none while the gate is closed)
    tl.store(predicted_ptr + layer * E + col, tl.zeros((EP,), dtype=tl.uint8), mask=oke)
    tl.debug_barrier()
    tl.store(predicted_ptr + linst, tl.full((WP,), 1, tl.uint8), mask=fp & is_open)
    tl.debug_barrier()
    t0 = tl.load(tick_ptr) - n
    _issue_prefetches(want, wrank, nwant, linst, predicted_ptr, t0, tl.maximum(t0 - guard, 0), n, owner_ptr,
                      last_use_ptr, inflight_ptr,
                      row_map_ptr, pf_victims_ptr, pf_new_ptr, pf_m_ptr, pf_hist_ptr, hrow, C, tag_ptr, pf_tag_ptr,
                      layer, E, SCAN, MPV, True)
    tl.store(tick_ptr, t0 + n + width)


def decide_next(cache, layer: int, ids: torch.Tensor, new_step: bool) -> None:
    """nexttoken's forecast and prefetch decisions for group (step, ``layer``) in one launch
    (:func:`_next_kernel`), after the group's record and demand commit; writes row ``layer`` of
    ``cache.rules.pf_victims`` / ``pf_new`` / ``pf_tags`` / ``pf_count`` for the tagged copy."""
    rules = cache.rules  # the policy's state
    n = ids.numel()
    cap = cache.capacity
    E, k = cache.pools.num_experts, cache.top_k
    L = cache.pools.num_moe_layers
    width = rules.prediction_history.shape[1]
    mpv = max(2, _next_pow2(rules.pf_victims.shape[1]))
    _next_kernel[(1,)](
        ids, n, layer, int(new_step), cache.pools.row_map, cache.owner, cache.last_use, cache.tick, cache.groups,
        rules.inflight.view(torch.uint8), rules.predicted.view(torch.uint8), rules.tags, rules.selections,
        rules.step, rules.terms, rules.tables, rules.seq_history, rules.hist_unit, rules.hist_shift,
        rules.pf_victims[layer], rules.pf_new[layer], rules.pf_tags[layer],
        rules.pf_count[layer], rules.prediction_history, rules.prefetch_history, rules.prediction_history.shape[0],
        width, rules.prefetch_budget, cap, L, rules.selections.shape[0], cache.guard_ticks(n), rules.gate_acc,
        rules.want, rules.want_n, rules.want_group, rules.group_index, rules.lead_unit,
        int(rules.gate_on), rules.want.shape[1],
        E=E, K=k, NPRED=rules.num_predictions, NSEL=rules.selections.shape[2], J=rules.terms.shape[0],
        TP=max(2, _next_pow2(n // k)), EP=max(2, _next_pow2(E)), WP=max(2, _next_pow2(width)),
        SCAN=_scan_size(cap, mpv), MPV=mpv, WMP=max(2, _next_pow2(rules.want.shape[1])), COPY=rules.copy_unit,
        SHIFT=rules.gate_shift, num_warps=_decision_warps(cap))


@triton.jit
def _commit_kernel(pf_victims_ptr, pf_new_ptr, pf_tag_ptr, pf_m_ptr, done_ptr, row_map_ptr, owner_ptr, stale_ptr, span,
                   L, LP: tl.constexpr, SP: tl.constexpr):
    li = tl.arange(0, LP)
    j = tl.arange(0, SP)
    cnt = tl.load(pf_m_ptr + li, mask=li < L, other=0)
    ok = (li < L)[:, None] & (j[None, :] < cnt[:, None])
    at = li[:, None] * span + j[None, :]
    slot = tl.load(pf_victims_ptr + at, mask=ok, other=0)
    new = tl.load(pf_new_ptr + at, mask=ok, other=0)
    tag = tl.load(pf_tag_ptr + at, mask=ok, other=0)
    done = tl.load(done_ptr + slot, mask=ok, other=-1)
    good = ok & (done == tag)
    tl.store(row_map_ptr + new, slot.to(tl.int32), mask=good)
    tl.store(owner_ptr + slot, tl.full((LP, SP), -1, tl.int64), mask=ok & (done != tag))  # not landed: empty
    bad = tl.sum(tl.sum((ok & (done != tag)).to(tl.int64), axis=1), axis=0)
    tl.store(stale_ptr, tl.load(stale_ptr) + bad)
    tl.store(pf_m_ptr + li, tl.zeros((LP,), dtype=tl.int64), mask=li < L)


def commit_prefetches(cache) -> None:
    """nexttoken's commit after the step's join (one launch): each prefetch of the step whose slot's
    done tag equals the tag it was issued with gets its row map entry (the slot); one whose tag
    differs (its copy did not land, or a later copy superseded it) stays on its host row and is
    counted in ``cache.rules.stale``, and its slot is left empty (owner -1, named by no row-map entry).
    The lists are consumed (counts zeroed)."""
    rules = cache.rules  # the policy's state
    L, span = rules.pf_victims.shape
    _commit_kernel[(1,)](rules.pf_victims, rules.pf_new, rules.pf_tags, rules.pf_count, rules.done,
                         cache.pools.row_map, cache.owner, rules.stale, span, L, LP=max(2, _next_pow2(L)),
                         SP=max(2, _next_pow2(span)), num_warps=8)
