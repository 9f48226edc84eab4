"""Expert cache simulation over routing traces: static, LRU, LFU and Belady slot pools.

Why: a static cold set serves a fixed share of selections; a cache that follows the traffic serves
more where consecutive tokens reuse experts. This module replays a trace's decode selections
through one pool of ``C`` slots shared by every MoE layer and counts hits, misses and link bytes,
so a user can compare static and dynamic placement at the same HBM budget on their own traffic
before touching a GPU, and so the engine's slot cache (CUDA) can be checked step by step against
an independent implementation of the same rules.

Semantics (this module is their reference implementation; the engine's slot cache,
:mod:`coldset.engine.cache.pool`, follows the same rules):

- Instance = (MoE-layer index, expert), id ``moe_layer_index * E + expert`` (the row-map row,
  not the model's layer index).
- Pool of ``C`` slots, ``C = capacity_for_residency(residency, L, E)`` (placement's rounding,
  :func:`coldset.core.placement.hot_count_for_residency`). The online policies need ``C`` at least
  the largest group (``top_k`` x tokens per step), else :class:`CacheError`.
- Warm start: the pool holds the ``usage_global`` hot set of size ``C`` chosen on the profile
  counts (:func:`coldset.core.placement.hot_mask_usage_global`). Initial order: profile count
  ascending, ties by instance id ascending (:func:`warm_order`); warm instances get ticks
  ``-C..-1`` in that order, so the least-used warm instance is the first victim.
- The stream is a sequence of *groups* (:class:`AccessStream`): a (token, MoE layer) group of
  ``top_k`` selections for the simulator's own streams (:func:`stream_from_frame`), or any grouping
  a caller builds (an engine step at batch ``B`` processes (step, layer) groups of ``B * k``).
  Ticks count selections in stream order from 0; every access sets ``last_use`` to its tick.
- Per group: every selection whose instance is resident at the group's start is a hit
  (duplicates of one instance count once per selection). Then the distinct missed instances are
  admitted (online policies always admit), each evicting one victim among residents *not used by
  this group* (the hazard guard). Victims are taken in the policy's order and assigned to the
  missed instances in rank order (first occurrence).
- ``lru``: victim = smallest ``last_use``.
- ``lru_guard``: ``lru`` without a victim among the instances any of the last ``L`` groups used
  (this one included: a step's worth, ``L`` MoE layers); the misses past the remaining residents
  are read in place, not admitted (they cross the link all the same: ``fills`` counts them). Why:
  where one step's distinct experts outnumber the slots (batch 8, residency 0.25 of the issue 28
  runs: 1,637 against 1,536), lru evicts what the next step selects again and its hit rate falls
  under the static set's (0.18 against 0.72); the guard keeps the pool and streams the surplus.
  Where fewer residents than the slots were used by the last step, lru's victims are older than
  that anyway and the two replays are the same.
- ``lfu``: victim = smallest ``(count, last_use)``; ``count`` = profile count for warm instances
  (0 for others) + accesses during replay, kept across evictions (an instance's frequency is a
  property of the traffic, not of its stay in the pool).
- ``belady``: victim = the resident whose next use after this group is furthest away (never used
  again = infinitely far; ties by instance id ascending). Offline optimum for the miss count.
- ``static``: no admission, no eviction: the hit rate is the warm set's coverage of the replay.
- ``forecast``: ``lru`` plus prefetch (issue 12, item 3). After each group (MoE layer ``l`` of
  step ``t``) the group's prefetch list (:func:`coldset.analysis.forecast.stream_predictions`: the
  forecast of layer ``l``'s experts at step ``t + 1``) is walked in order; each listed instance
  not resident is admitted into the slot of a victim chosen *in layers ``0..l`` only*, least
  recent first, among residents that this group did not use, that are not in the list and that
  are not in flight. The work of layers ``0..l`` in step ``t`` is then done (layer ``l``'s experts
  still run beside the copy: hence "not used by this group") and those layers come again only at
  the next step, so the copy can run beside the rest of the step without any compute reading its
  slot. A prefetched instance is *in flight* until the step ends (the next group whose layer is
  not above the current one starts a new step): demand misses never evict it. It enters the
  recency order as most recent, in list order, after the group's own accesses. No eviction
  candidate left in those layers: the rest of the list is skipped. A demand miss that finds no slot
  outside the group and the in-flight ones is read in place and not admitted (a pool barely
  larger than a group). Demand hits and misses are
  ``lru``'s; ``prefetches`` counts the copies (they cross the link: ``link_gb_per_token`` counts
  them with the fills) and ``useful_prefetches`` the prefetched instances hit before eviction.

- ``lookahead``: the same replay with other lists (not a ``cache.policies`` entry: its lists come
  from the model's hidden states, which traces do not hold). After group (step ``t``, layer ``l``)
  the list names instances of a *later* layer of the same step (pre-gated MoE's lookahead: the
  router of layer ``l + d`` applied to layer ``l``'s router input,
  :func:`coldset.analysis.forecast.lookahead_predictions`); the victims, the in-flight rule and the commit
  at the step's end are ``forecast``'s, so no slot that layers ``l + 1 ..`` of the step can need is
  evicted for a prefetch, and a prefetched instance counts as a hit when its layer runs.

Link traffic: each distinct missed instance of a group crosses the link once (``fills``); for
``static`` these are the cold reads, for the online policies the slot fills, plus ``forecast``'s
prefetches. ``link_gb_per_token = (fills + prefetches) * bytes_per_expert / tokens / 1e9``.

API (plain functions, numpy arrays):

- :func:`stream_from_frame` (columns ``request, position, layer_index, rank, expert``) and
  :func:`stream_from_trace` (a trace file, decode rows, a split / domain selection) build an
  :class:`AccessStream` in replay order (request id as a string, position, layer, rank).
- :func:`simulate` ``(stream, policy, capacity, profile_counts, *, record_victims=False)`` ->
  :class:`CacheResult` with per-selection ``hit`` ``bool [N]``, per-group ``hits``, ``misses``
  and ``fills`` ``int64 [G]`` (step-by-step comparison with the engine), optionally per-group
  victims, and :meth:`CacheResult.stats` -> :class:`CacheStats` (the CSV row).
- :func:`simulation_table` runs policies x residencies into the ``simulation.csv`` frame;
  :func:`run_cache` is the workflow stage (``results/cache/{model}/simulation.csv`` + figure).

The replay loops are compiled with numba when it is importable (the same Python source runs
uncompiled otherwise: same results, slower); everything around them is vectorised numpy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from coldset.analysis.placement import hot_count_for_residency, hot_mask_usage_global
from coldset.core.trace import request_codes

log = logging.getLogger(__name__)

POLICIES = ("static", "lru", "lru_guard", "lfu", "belady", "forecast", "nexttoken")
PREFETCH_POLICIES = ("forecast", "lookahead", "nexttoken")  # replayed with prefetch lists; lookahead: simulate() only
ONLINE_POLICIES = ("lru", "lru_guard", "lfu", "belady", "forecast", "nexttoken")
SIMULATION_COLUMNS = ("policy", "residency", "capacity", "accesses", "tokens", "hit_rate",
                      "misses_per_token", "link_gb_per_token")
# issue 28: the batch the replay steps, the prefetches, and the simulated time (simulate_time)
TIME_COLUMNS = ("batch", "prefetches_per_token", "prefetch_precision", "step_ms", "bound_ms", "bound_fraction",
                "overlap", "stall_ms_per_token", "wasted_gb_per_token")

try:  # numba compiles the replay loops; without it the same code runs as plain Python
    from numba import njit as _njit

    def _jit(fn):
        return _njit(cache=True, nogil=True)(fn)
except ImportError:  # pragma: no cover - exercised only where numba is absent
    def _jit(fn):
        return fn


class CacheError(ValueError):
    """Bad input to the cache simulation (policy, capacity, stream, profile); the message says what."""


# --------------------------------------------------------------------------------------------
# The access stream


@dataclass(frozen=True)
class AccessStream:
    """Selections in replay order, cut into groups.

    ``instances`` int64 ``[N]``: instance id ``moe_layer_index * num_experts + expert`` of each
    selection; ``group_ptr`` int64 ``[G + 1]``: group ``g`` is ``instances[group_ptr[g]:
    group_ptr[g + 1]]`` (non-empty); ``tokens``: decoded tokens the stream covers (the divisor of
    the per-token metrics).
    """

    instances: np.ndarray
    group_ptr: np.ndarray
    tokens: int
    num_moe_layers: int
    num_experts: int

    def __post_init__(self) -> None:
        ids = np.ascontiguousarray(self.instances, dtype=np.int64)
        ptr = np.ascontiguousarray(self.group_ptr, dtype=np.int64)
        object.__setattr__(self, "instances", ids)
        object.__setattr__(self, "group_ptr", ptr)
        n_inst = self.num_moe_layers * self.num_experts
        if ids.ndim != 1 or ptr.ndim != 1 or ptr.size < 1:
            raise CacheError("AccessStream: instances and group_ptr must be 1-D, group_ptr non-empty")
        if ptr[0] != 0 or ptr[-1] != ids.size or (np.diff(ptr) <= 0).any():
            raise CacheError(f"AccessStream: group_ptr must rise strictly from 0 to {ids.size} "
                             "(every group non-empty)")
        if ids.size and (ids.min() < 0 or ids.max() >= n_inst):
            raise CacheError(f"AccessStream: instance ids must lie in [0, {n_inst}) "
                             f"({self.num_moe_layers} MoE layers x {self.num_experts} experts)")
        if self.tokens < 0 or (ids.size and self.tokens == 0):
            raise CacheError(f"AccessStream: tokens must be > 0 for a non-empty stream, got {self.tokens}")

    @property
    def num_groups(self) -> int:
        return int(self.group_ptr.size - 1)

    @property
    def num_instances(self) -> int:
        return self.num_moe_layers * self.num_experts

    @property
    def max_group(self) -> int:
        return int(np.diff(self.group_ptr).max(initial=0))


def stream_from_frame(rows: pd.DataFrame | Mapping[str, Any], num_moe_layers: int,
                      num_experts: int) -> AccessStream:
    """The replay stream of decode rows: columns ``request`` (str or categorical),
    ``position``, ``layer_index`` (MoE-layer index 0..L-1), ``rank``, ``expert``.

    Order: request id (string order), position, layer index, rank; one group per (request,
    position, layer index); tokens = distinct (request, position). Two rows with the same
    (request, position, layer index, rank) are an error. Rows already in that order (as traces
    are written) skip the sort.
    """
    req_col = rows["request"]
    if isinstance(req_col, pd.Series) and isinstance(req_col.dtype, pd.CategoricalDtype):
        req_col = req_col.array
    pos = np.asarray(rows["position"], dtype=np.int64)
    li = np.asarray(rows["layer_index"], dtype=np.int64)
    rank = np.asarray(rows["rank"], dtype=np.int64)
    exp = np.asarray(rows["expert"], dtype=np.int64)
    if not (len(req_col) == pos.size == li.size == rank.size == exp.size):
        raise CacheError("stream_from_frame: columns differ in length")
    if pos.size == 0:
        return AccessStream(np.zeros(0, np.int64), np.zeros(1, np.int64), 0, num_moe_layers, num_experts)
    if li.min() < 0 or li.max() >= num_moe_layers:
        raise CacheError(f"stream_from_frame: layer_index outside [0, {num_moe_layers})")
    if exp.min() < 0 or exp.max() >= num_experts:
        raise CacheError(f"stream_from_frame: expert outside [0, {num_experts})")
    if pos.min() < 0 or rank.min() < 0:
        raise CacheError("stream_from_frame: position and rank must be >= 0")
    rc, names = request_codes(req_col)
    # one int64 key (request, position, layer, rank)
    n_rank = int(rank.max()) + 1
    n_pos = int(pos.max()) + 1
    key = ((rc * n_pos + pos) * num_moe_layers + li) * n_rank + rank
    if not (key[1:] > key[:-1]).all():
        order = np.argsort(key, kind="stable")
        key, rc, pos, li, rank, exp = key[order], rc[order], pos[order], li[order], rank[order], exp[order]
        dup = np.flatnonzero(key[1:] == key[:-1])
        if dup.size:
            i = int(dup[0]) + 1
            raise CacheError(f"stream_from_frame: request {names[rc[i]]!r} has two rows for position {int(pos[i])}, "
                             f"MoE layer index {int(li[i])}, rank {int(rank[i])}")
    group_key = key // n_rank
    new_group = np.r_[True, group_key[1:] != group_key[:-1]]
    token_key = group_key // num_moe_layers
    tokens = int(np.count_nonzero(np.r_[True, token_key[1:] != token_key[:-1]]))
    ptr = np.r_[np.flatnonzero(new_group), exp.size]
    return AccessStream(li * num_experts + exp, ptr, tokens, num_moe_layers, num_experts)


@dataclass(frozen=True)
class Lanes:
    """Decode tokens laid out as an engine batch steps them (the ``nexttoken`` forecast's input).

    ``sel`` int64 ``[S, L, B, k]``: the experts lane ``b`` selects at step ``s`` in MoE layer
    ``l`` (rank order), ``-1`` for every layer and rank of a lane idle at that step; ``start``
    bool ``[S, B]``: a new sequence begins in lane ``b`` at step ``s`` (its history, the
    forecast's past tokens and per-sequence state, starts empty there). The engine's pass is
    ``B`` lanes started together at step 0; :func:`lanes_from_frame` lays a trace's requests out
    in lanes as continuous batching would.
    """

    sel: np.ndarray
    start: np.ndarray
    num_experts: int

    def __post_init__(self) -> None:
        sel = np.ascontiguousarray(self.sel, dtype=np.int64)
        start = np.ascontiguousarray(self.start, dtype=bool)
        object.__setattr__(self, "sel", sel)
        object.__setattr__(self, "start", start)
        if sel.ndim != 4 or start.shape != (sel.shape[0], sel.shape[2]):
            raise CacheError(f"Lanes: sel must be [steps, layers, lanes, k] and start [steps, lanes], got "
                             f"{sel.shape} and {start.shape}")
        if sel.size and (sel.min() < -1 or sel.max() >= self.num_experts):
            raise CacheError(f"Lanes: experts must lie in [0, {self.num_experts}) or be -1 (idle lane)")
        idle = sel < 0
        if (idle.any(axis=(1, 3)) != idle.all(axis=(1, 3))).any():
            raise CacheError("Lanes: a lane is idle at a step in every layer and rank or in none")
        if sel.shape[0] and ((~idle[:, 0, :, 0]).sum(axis=1) == 0).any():
            raise CacheError("Lanes: every step needs at least one active lane")

    @property
    def active(self) -> np.ndarray:
        """bool ``[S, B]``: lane ``b`` decodes a token at step ``s``."""
        return self.sel[:, 0, :, 0] >= 0

    def stream(self) -> AccessStream:
        """The replay stream: one group per (step, MoE layer), the active lanes' selections in lane
        then rank order (the engine's row order)."""
        S, L, B, k = self.sel.shape
        if S == 0:
            return AccessStream(np.zeros(0, np.int64), np.zeros(1, np.int64), 0, L, self.num_experts)
        act = self.active
        flat = (np.arange(L, dtype=np.int64)[None, :, None, None] * self.num_experts + self.sel)
        ids = flat[np.broadcast_to(act[:, None, :, None], flat.shape)]
        sizes = np.repeat(act.sum(axis=1) * k, L)
        return AccessStream(ids, np.r_[0, np.cumsum(sizes)], int(act.sum()), L, self.num_experts)


def lanes_from_engine(decode: np.ndarray, num_experts: int) -> Lanes:
    """An engine pass's decode routing ``decode`` int ``[B, steps, L, k]`` (the bench's capture) as
    :class:`Lanes`: ``B`` lanes started together at step 0 (the forecast's history starts empty at
    the cache's reset), so ``lanes.stream()`` is the bench's (step, layer) grouping."""
    decode = np.asarray(decode, dtype=np.int64)
    if decode.ndim != 4:
        raise CacheError(f"lanes_from_engine: decode must be [B, steps, L, k], got {decode.shape}")
    B, S = decode.shape[:2]
    start = np.zeros((S, B), dtype=bool)
    start[:1] = True
    return Lanes(decode.transpose(1, 2, 0, 3), start, num_experts)


def token_array(rows: pd.DataFrame | Mapping[str, Any], num_moe_layers: int,
                num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """``(experts int64 [T, L, k], sequence int64 [T])``: every decode token of ``rows`` (columns
    request, position, layer_index, rank, expert) in request (string) then position order, with its
    request's number. Every token must hold all ``L`` MoE layers and ranks ``0..k-1`` once: a
    token with a missing layer is refused (its next-token statistics would be misaligned)."""
    stream = stream_from_frame(rows, num_moe_layers, num_experts)
    L, E = num_moe_layers, num_experts
    if stream.tokens == 0:
        return np.zeros((0, L, 1), np.int64), np.zeros(0, np.int64)
    sizes = np.diff(stream.group_ptr)
    k = int(sizes[0])
    if stream.num_groups != stream.tokens * L or (sizes != k).any():
        raise CacheError(f"token_array: every decode token must hold all {L} MoE layers with the same top_k "
                         f"selections ({stream.num_groups} groups for {stream.tokens} tokens)")
    layer = stream.instances // E
    if (layer.reshape(-1, L, k) != np.arange(L)[None, :, None]).any():
        raise CacheError(f"token_array: every decode token must hold all {L} MoE layers")
    req_col = rows["request"]
    if isinstance(req_col, pd.Series) and isinstance(req_col.dtype, pd.CategoricalDtype):
        req_col = req_col.array
    rc, _ = request_codes(req_col)
    seq = np.sort(rc)[:: L * k]  # stream order is request code order
    return (stream.instances % E).reshape(-1, L, k), seq


def lanes_from_frame(rows: pd.DataFrame | Mapping[str, Any], num_moe_layers: int, num_experts: int,
                     batch: int) -> Lanes:
    """The decode tokens of ``rows`` as ``batch`` lanes under continuous batching: requests in
    request id order, each to the lane that frees first (the lowest lane on ties), its tokens in
    position order on consecutive steps. ``batch = 1`` gives :func:`stream_from_frame`'s stream."""
    if batch < 1:
        raise CacheError(f"lanes_from_frame: batch must be >= 1, got {batch}")
    tokens, seq = token_array(rows, num_moe_layers, num_experts)
    T, L, k = tokens.shape
    if T == 0:
        return Lanes(np.zeros((0, L, batch, k), np.int64), np.zeros((0, batch), bool), num_experts)
    starts = np.r_[0, np.flatnonzero(seq[1:] != seq[:-1]) + 1]
    lengths = np.diff(np.r_[starts, T])
    free = np.zeros(batch, dtype=np.int64)
    lane = np.empty(starts.size, np.int64)
    step0 = np.empty(starts.size, np.int64)
    for r, n in enumerate(lengths):
        b = int(np.argmin(free))
        lane[r], step0[r] = b, free[b]
        free[b] += n
    S = int(free.max())
    sel = np.full((S, L, batch, k), -1, dtype=np.int64)
    start = np.zeros((S, batch), dtype=bool)
    tok_step = np.repeat(step0, lengths) + (np.arange(T) - np.repeat(starts, lengths))
    tok_lane = np.repeat(lane, lengths)
    sel[tok_step, :, tok_lane, :] = tokens
    start[step0, lane] = True
    return Lanes(sel, start, num_experts)


def trace_decode_rows(trace_path: str | os.PathLike, heldout_fraction: float = 0.25,
                      expect: Any = None) -> tuple[pd.DataFrame, Any]:
    """Decode rows of a trace as a frame (request and domain categorical, split, position,
    layer_index, rank, expert) and its :class:`coldset.core.trace.TraceMeta`. ``split`` comes from
    the trace's column or, without one, from :func:`coldset.core.trace.split_of` on the request id
    (as the stats stage does). Read column-wise through pyarrow (validated batch by batch)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from coldset.core.trace import iter_trace_batches, read_trace_meta, split_of

    meta = read_trace_meta(trace_path, expect)
    has_split = "split" in pq.read_schema(trace_path).names
    cols = ["request", "domain", "position", "phase", "layer", "rank", "expert"] + (["split"] if has_split else [])
    lut = np.full(max(meta.moe_layers) + 1, -1, dtype=np.int64)
    lut[list(meta.moe_layers)] = np.arange(meta.num_moe_layers)
    batches = []
    for batch in iter_trace_batches(trace_path, cols, batch_rows=1 << 22):
        keep = pc.and_(pc.equal(batch.column("phase").cast(pa.string()), "decode"),
                       pc.greater_equal(batch.column("expert"), 0))
        batches.append(batch.filter(keep))
    table = pa.Table.from_batches(batches, schema=batches[0].schema).unify_dictionaries() if batches else None

    def strings(name: str) -> pd.Categorical:
        col = table.column(name).combine_chunks()
        if not pa.types.is_dictionary(col.type):
            col = col.dictionary_encode()
        return pd.Categorical.from_codes(col.indices.to_numpy(zero_copy_only=False).astype(np.int64),
                                         col.dictionary.cast(pa.string()).to_pylist())

    if table is None or table.num_rows == 0:
        empty = {c: np.zeros(0, np.int64) for c in ("position", "layer_index", "rank", "expert")}
        return pd.DataFrame({"request": pd.Categorical([]), "domain": pd.Categorical([]),
                             "split": np.zeros(0, dtype=object), **empty}), meta
    request = strings("request")
    if has_split:
        split = strings("split")
    else:
        by_request = np.asarray([split_of(str(r), heldout_fraction) for r in request.categories], dtype=object)
        split = pd.Categorical(by_request[np.asarray(request.codes)])
    rows = pd.DataFrame({
        "request": request,
        "domain": strings("domain"),
        "split": split,
        "position": table.column("position").to_numpy().astype(np.int64),
        "layer_index": lut[table.column("layer").to_numpy().astype(np.int64)],
        "rank": table.column("rank").to_numpy().astype(np.int64),
        "expert": table.column("expert").to_numpy().astype(np.int64),
    })
    return rows, meta


def select_rows(rows: pd.DataFrame, split: str | None = None,
                domains: Sequence[str] | None = None) -> pd.DataFrame:
    """Rows of one split (``None``: both) and of the given domains (``None``: all)."""
    keep = np.ones(len(rows), dtype=bool)
    if split is not None:
        keep &= (rows["split"] == split).to_numpy()
    if domains is not None:
        missing = sorted(set(domains) - set(rows["domain"].unique()))
        if missing:
            raise CacheError(f"domain(s) {missing} have no decode rows; available "
                             f"{sorted(rows['domain'].unique())}")
        keep &= rows["domain"].isin(list(domains)).to_numpy()
    return rows[keep]


def counts_from_rows(rows: pd.DataFrame, num_moe_layers: int, num_experts: int) -> np.ndarray:
    """Selections per instance, float64 ``[L, E]`` (a profile for :func:`simulate`)."""
    flat = rows["layer_index"].to_numpy(np.int64) * num_experts + rows["expert"].to_numpy(np.int64)
    return np.bincount(flat, minlength=num_moe_layers * num_experts).astype(np.float64).reshape(
        num_moe_layers, num_experts)


# --------------------------------------------------------------------------------------------
# Warm start and capacity


def capacity_for_residency(residency: float, num_moe_layers: int, num_experts: int) -> int:
    """Slots of the pool at ``residency``: the static placements' hot count for the same residency."""
    return hot_count_for_residency(residency, num_moe_layers * num_experts)


def warm_order(profile_counts: np.ndarray, capacity: int) -> np.ndarray:
    """The warm pool's instance ids, first victim first: the ``usage_global`` hot set of size
    ``capacity`` ordered by profile count ascending, ties by instance id ascending."""
    counts = np.asarray(profile_counts, dtype=np.float64)
    hot = np.flatnonzero(hot_mask_usage_global(counts, capacity).reshape(-1))
    flat = counts.reshape(-1)
    return hot[np.lexsort((hot, flat[hot]))]


# --------------------------------------------------------------------------------------------
# Replay kernels (numba-compiled when available). All share the per-group protocol:
#   pass 1: hit = resident at the group's start; mark the group's resident instances protected;
#   pass 2: take one victim per distinct missed instance from the policy's order, skipping
#           protected residents;
#   pass 3: in rank order, admit missed instances into the victims' slots and update keys.
# A binary min-heap over (key1, key2, instance) with lazy deletion serves lfu and belady: every
# access pushes the instance's new key, so an entry is live only while it equals the current key
# of a resident, unprotected instance (a protected instance is accessed in this group, so its old
# entry is stale anyway).


@_jit
def _heap_less(k1, k2, ins, i, j):
    if k1[i] != k1[j]:
        return k1[i] < k1[j]
    if k2[i] != k2[j]:
        return k2[i] < k2[j]
    return ins[i] < ins[j]


@_jit
def _heap_swap(k1, k2, ins, i, j):
    t1 = k1[i]
    k1[i] = k1[j]
    k1[j] = t1
    t2 = k2[i]
    k2[i] = k2[j]
    k2[j] = t2
    t3 = ins[i]
    ins[i] = ins[j]
    ins[j] = t3


@_jit
def _heap_push(k1, k2, ins, size, a, b, x):
    k1[size] = a
    k2[size] = b
    ins[size] = x
    i = size
    while i > 0:
        p = (i - 1) // 2
        if _heap_less(k1, k2, ins, i, p):
            _heap_swap(k1, k2, ins, i, p)
            i = p
        else:
            break
    return size + 1


@_jit
def _heap_pop(k1, k2, ins, size):
    """Remove the minimum (moved to index ``size - 1``); return the new size."""
    size -= 1
    _heap_swap(k1, k2, ins, 0, size)
    i = 0
    while True:
        l = 2 * i + 1
        if l >= size:
            break
        c = l
        if l + 1 < size and _heap_less(k1, k2, ins, l + 1, l):
            c = l + 1
        if _heap_less(k1, k2, ins, c, i):
            _heap_swap(k1, k2, ins, c, i)
            i = c
        else:
            break
    return size


@_jit
def _max_group(ptr):
    """The largest group's selection count."""
    out = 0
    for g in range(ptr.size - 1):
        out = max(out, ptr[g + 1] - ptr[g])
    return out


@_jit
def _classify_group(ids, s, e, resident, protected, in_group, hit, missed):
    """Pass 1 of a group (selections ``s..e-1``): mark hits and protect their instances; list each
    missed instance's first selection in ``missed``. Returns the number of missed instances."""
    n_miss = 0
    for i in range(s, e):
        x = ids[i]
        if resident[x]:
            hit[i] = True
            protected[x] = True
        elif not in_group[x]:
            in_group[x] = True
            missed[n_miss] = i
            n_miss += 1
    return n_miss


@_jit
def _link_tail(nxt, prv, head, x):
    """Link instance ``x`` at the tail (most recent end) of the LRU list."""
    last = prv[head]
    nxt[last] = x
    prv[x] = last
    nxt[x] = head
    prv[head] = x


@_jit
def _unlink(nxt, prv, v):
    after = nxt[v]
    nxt[prv[v]] = after
    prv[after] = prv[v]
    return after


@_jit
def _evict(nxt, prv, resident, unused_prefetch, v):
    """Evict instance ``v`` from its slot (off the LRU list, not resident); returns (the instance
    after it in the list, 1 if ``v`` was a prefetch never used: wasted bytes, else 0)."""
    after = _unlink(nxt, prv, v)
    resident[v] = False
    wasted = 1 if unused_prefetch[v] else 0
    unused_prefetch[v] = False
    return after, wasted


@_jit
def _admit_demand(ids, i, v, resident, protected, nxt, prv, head, record, victims):
    """Selection ``i``'s instance takes the slot evicted ``v`` left: resident, protected for the rest
    of its group, most recent in the LRU list; ``victims[i] = v`` when recording."""
    x = ids[i]
    resident[x] = True
    protected[x] = True
    _link_tail(nxt, prv, head, x)
    if record:
        victims[i] = v


@_jit
def _end_group(ids, s, e, missed, n_miss, in_group, protected, used, resident, nxt, prv, head):
    """After a group's demand admissions: its instances are no longer protected, count as used by
    this step, and the resident ones move to the most recent end of the LRU list in selection order."""
    for m in range(n_miss):
        in_group[ids[missed[m]]] = False
    for i in range(s, e):
        x = ids[i]
        protected[x] = False
        used[x] = True
        if resident[x]:
            _unlink(nxt, prv, x)
            _link_tail(nxt, prv, head, x)


@_jit
def _replay_heap(ids, ptr, warm, warm_count, n_inst, policy, next_tick, record, victims):
    """lfu (policy 0) or belady (policy 1). Keys: lfu (count, last_use); belady (-next_use, 0)
    with ties by instance id. Returns (hit [N], fills [G]); ``victims[i]`` (when ``record``) is
    the instance evicted to admit selection ``i`` (its first occurrence in the group)."""
    n = ids.size
    n_groups = ptr.size - 1
    hit = np.zeros(n, dtype=np.bool_)
    fills = np.zeros(n_groups, dtype=np.int64)
    resident = np.zeros(n_inst, dtype=np.bool_)
    protected = np.zeros(n_inst, dtype=np.bool_)
    in_group = np.zeros(n_inst, dtype=np.bool_)
    key1 = np.zeros(n_inst, dtype=np.float64)
    key2 = np.zeros(n_inst, dtype=np.float64)
    count = np.zeros(n_inst, dtype=np.float64)
    cap = warm.size
    max_group = _max_group(ptr)
    heap_cap = 4 * n_inst + max_group + 64
    h1 = np.empty(heap_cap, dtype=np.float64)
    h2 = np.empty(heap_cap, dtype=np.float64)
    hi = np.empty(heap_cap, dtype=np.int64)
    size = 0
    # first use of every instance (belady's key for the warm pool)
    first = np.full(n_inst, np.inf)
    for i in range(n - 1, -1, -1):
        first[ids[i]] = i
    for j in range(cap):
        x = warm[j]
        resident[x] = True
        count[x] = warm_count[j]
        if policy == 0:
            key1[x] = count[x]
            key2[x] = j - cap
        else:
            key1[x] = -first[x]
            key2[x] = 0.0
        size = _heap_push(h1, h2, hi, size, key1[x], key2[x], x)
    missed = np.empty(max(max_group, 1), dtype=np.int64)
    for g in range(n_groups):
        s = ptr[g]
        e = ptr[g + 1]
        n_miss = _classify_group(ids, s, e, resident, protected, in_group, hit, missed)
        fills[g] = n_miss
        for m in range(n_miss):
            while True:
                size = _heap_pop(h1, h2, hi, size)
                v = hi[size]
                if resident[v] and not protected[v] and h1[size] == key1[v] and h2[size] == key2[v]:
                    break
            resident[v] = False
            i = missed[m]
            resident[ids[i]] = True
            protected[ids[i]] = True  # its stale entries must not make it a victim in this group
            if record:
                victims[i] = v
        for m in range(n_miss):
            in_group[ids[missed[m]]] = False
        # key updates in rank order (the last occurrence in the group sets the final key)
        for i in range(s, e):
            x = ids[i]
            protected[x] = False
            count[x] += 1.0
            if policy == 0:
                key1[x] = count[x]
                key2[x] = i
            else:
                key1[x] = -next_tick[i]
                key2[x] = 0.0
        if size + (e - s) > heap_cap:
            # rebuild from the residents' current keys (drops every stale entry)
            size = 0
            for y in range(n_inst):
                if resident[y]:
                    size = _heap_push(h1, h2, hi, size, key1[y], key2[y], y)
        else:
            for i in range(s, e):  # one push per distinct instance of the group
                x = ids[i]
                if not in_group[x]:
                    in_group[x] = True
                    size = _heap_push(h1, h2, hi, size, key1[x], key2[x], x)
            for i in range(s, e):
                in_group[ids[i]] = False
    return hit, fills


@_jit
def _replay_static(ids, ptr, warm, n_inst):
    n_groups = ptr.size - 1
    resident = np.zeros(n_inst, dtype=np.bool_)
    for j in range(warm.size):
        resident[warm[j]] = True
    hit = np.empty(ids.size, dtype=np.bool_)
    fills = np.zeros(n_groups, dtype=np.int64)
    seen = np.zeros(n_inst, dtype=np.bool_)
    for g in range(n_groups):
        for i in range(ptr[g], ptr[g + 1]):
            x = ids[i]
            hit[i] = resident[x]
            if not hit[i] and not seen[x]:
                seen[x] = True
                fills[g] += 1
        for i in range(ptr[g], ptr[g + 1]):
            seen[ids[i]] = False
    return hit, fills


@_jit
def _replay_lru(ids, ptr, warm, n_inst, n_exp, pred, record, victims, guard=0):
    """LRU through a doubly linked list in last_use order (head = least recent), plus the prefetch
    of ``pred[g]`` after each group g (``forecast``, ``lookahead``: see the module doc); plain
    ``lru`` is the same replay with empty lists (no prefetch, so nothing in flight, and a pool of at
    least one group always has a victim outside the group). ``guard`` > 0 (``lru_guard``, no
    prefetch): no demand victim among the instances the last ``guard`` groups used (this one
    included); the misses past the other slots are read in place, not admitted. Returns (hit [N], fills [G],
    prefetches [G], useful prefetches, issued [G, W] (the instances copied after each group, in
    issue order, -1 padded), wasted prefetches (evicted before any hit))."""
    n = ids.size
    n_groups = ptr.size - 1
    hit = np.zeros(n, dtype=np.bool_)
    fills = np.zeros(n_groups, dtype=np.int64)
    prefetches = np.zeros(n_groups, dtype=np.int64)
    issued = np.full((n_groups, pred.shape[1]), -1, dtype=np.int64)
    wasted = 0
    resident = np.zeros(n_inst, dtype=np.bool_)
    protected = np.zeros(n_inst + 1, dtype=np.bool_)
    in_group = np.zeros(n_inst, dtype=np.bool_)
    used = np.zeros(n_inst, dtype=np.bool_)
    listed = np.zeros(n_inst, dtype=np.bool_)
    inflight = np.zeros(n_inst + 1, dtype=np.bool_)
    flight = np.empty(n_inst, dtype=np.int64)
    n_flight = 0
    unused_prefetch = np.zeros(n_inst, dtype=np.bool_)
    useful = 0
    head = n_inst  # sentinel
    nxt = np.full(n_inst + 1, head, dtype=np.int64)
    prv = np.full(n_inst + 1, head, dtype=np.int64)
    for j in range(warm.size):
        x = warm[j]
        resident[x] = True
        _link_tail(nxt, prv, head, x)
    max_group = max(_max_group(ptr), 1)
    missed = np.empty(max_group, dtype=np.int64)
    last_group = np.full(n_inst + 1, -(2**62), dtype=np.int64)  # lru_guard: each instance's last group
    prev_layer = n_inst
    for g in range(n_groups):
        s = ptr[g]
        e = ptr[g + 1]
        layer = ids[s] // n_exp
        if layer <= prev_layer:  # a new step: the previous step's prefetches are committed
            for j in range(n_flight):
                inflight[flight[j]] = False
            n_flight = 0
        prev_layer = layer
        n_miss = _classify_group(ids, s, e, resident, protected, in_group, hit, missed)
        fills[g] = n_miss
        for i in range(s, e):
            if hit[i] and unused_prefetch[ids[i]]:
                unused_prefetch[ids[i]] = False
                useful += 1
        v = nxt[head]
        for m in range(n_miss):
            while v != head and (protected[v] or inflight[v] or last_group[v] > g - guard):
                v = nxt[v]
            if v == head:  # every slot is used by this group, in flight or guarded: read in place, not admitted
                break
            after, w = _evict(nxt, prv, resident, unused_prefetch, v)
            wasted += w
            _admit_demand(ids, missed[m], v, resident, protected, nxt, prv, head, record, victims)
            v = after
        _end_group(ids, s, e, missed, n_miss, in_group, protected, used, resident, nxt, prv, head)
        if guard > 0:
            for i in range(s, e):
                last_group[ids[i]] = g
        # prefetch after the group: victims in layers 0..layer, not used, not listed, not in flight
        for q in range(pred.shape[1]):
            if pred[g, q] >= 0:
                listed[pred[g, q]] = True
        v = nxt[head]
        for q in range(pred.shape[1]):
            x = pred[g, q]
            if x < 0 or resident[x]:
                continue
            while v != head and (v // n_exp > layer or used[v] or listed[v] or inflight[v]):
                v = nxt[v]
            if v == head:
                break
            after, w = _evict(nxt, prv, resident, unused_prefetch, v)
            wasted += w
            resident[x] = True
            inflight[x] = True
            flight[n_flight] = x
            n_flight += 1
            unused_prefetch[x] = True
            _link_tail(nxt, prv, head, x)
            issued[g, prefetches[g]] = x
            prefetches[g] += 1
            v = after
        for q in range(pred.shape[1]):
            if pred[g, q] >= 0:
                listed[pred[g, q]] = False
        for i in range(s, e):
            used[ids[i]] = False
    return hit, fills, prefetches, useful, issued, wasted


@_jit
def _replay_next(ids, ptr, warm, n_inst, n_exp, n_layers, pred, budget, record, victims):
    """``nexttoken`` (see the module doc): LRU list as :func:`_replay_lru`, victims by (predicted,
    last use), the forecast's flags replaced per layer after each group, the prefetch of the
    group's list (up to ``budget`` copies, ``budget < 0``: no cut) into unpredicted, unused, not
    in-flight slots of any layer, in flight until the next group of the same layer. Returns (hit
    [N], fills [G], prefetches [G], useful, issued [G, W], wasted)."""
    n = ids.size
    n_groups = ptr.size - 1
    width = pred.shape[1]
    hit = np.zeros(n, dtype=np.bool_)
    fills = np.zeros(n_groups, dtype=np.int64)
    prefetches = np.zeros(n_groups, dtype=np.int64)
    issued = np.full((n_groups, width), -1, dtype=np.int64)
    wasted = 0
    useful = 0
    resident = np.zeros(n_inst, dtype=np.bool_)
    protected = np.zeros(n_inst + 1, dtype=np.bool_)
    in_group = np.zeros(n_inst, dtype=np.bool_)
    used = np.zeros(n_inst + 1, dtype=np.bool_)
    predicted = np.zeros(n_inst + 1, dtype=np.bool_)
    inflight = np.zeros(n_inst + 1, dtype=np.bool_)
    unused_prefetch = np.zeros(n_inst, dtype=np.bool_)
    last_group = np.full(n_layers, -1, dtype=np.int64)  # the previous group of each layer
    head = n_inst  # sentinel
    nxt = np.full(n_inst + 1, head, dtype=np.int64)
    prv = np.full(n_inst + 1, head, dtype=np.int64)
    for j in range(warm.size):
        x = warm[j]
        resident[x] = True
        _link_tail(nxt, prv, head, x)
    max_group = max(_max_group(ptr), 1)
    missed = np.empty(max_group, dtype=np.int64)
    for g in range(n_groups):
        s = ptr[g]
        e = ptr[g + 1]
        layer = ids[s] // n_exp
        pg = last_group[layer]
        if pg >= 0:  # 1. commit the previous group of this layer's prefetches
            for q in range(width):
                x = issued[pg, q]
                if x >= 0:
                    inflight[x] = False
        n_miss = _classify_group(ids, s, e, resident, protected, in_group, hit, missed)
        fills[g] = n_miss
        for i in range(s, e):
            if hit[i] and unused_prefetch[ids[i]]:
                unused_prefetch[ids[i]] = False
                useful += 1
        # 2. demand: unpredicted least recent first, then predicted; never used by the group or in flight
        v = nxt[head]
        second = False
        for m in range(n_miss):
            while True:
                while v != head and (protected[v] or inflight[v] or predicted[v] != second):
                    v = nxt[v]
                if v != head or second:
                    break
                second = True
                v = nxt[head]
            if v == head:  # every slot is used by this group or in flight: read in place, not admitted
                break
            after, w = _evict(nxt, prv, resident, unused_prefetch, v)
            wasted += w
            _admit_demand(ids, missed[m], v, resident, protected, nxt, prv, head, record, victims)
            v = after
        _end_group(ids, s, e, missed, n_miss, in_group, protected, used, resident, nxt, prv, head)
        # 3. the forecast replaces this layer's predicted flags
        if pg >= 0:
            for q in range(width):
                if pred[pg, q] >= 0:
                    predicted[pred[pg, q]] = False
        for q in range(width):
            if pred[g, q] >= 0:
                predicted[pred[g, q]] = True
        last_group[layer] = g
        # 4. prefetch: unpredicted, unused, not in-flight victims of any layer, least recent first
        v = nxt[head]
        for q in range(width):
            x = pred[g, q]
            if x < 0 or resident[x]:
                continue
            if budget >= 0 and prefetches[g] >= budget:
                break
            while v != head and (used[v] or inflight[v] or predicted[v]):
                v = nxt[v]
            if v == head:
                break
            after, w = _evict(nxt, prv, resident, unused_prefetch, v)
            wasted += w
            resident[x] = True
            inflight[x] = True
            unused_prefetch[x] = True
            _link_tail(nxt, prv, head, x)
            issued[g, prefetches[g]] = x
            prefetches[g] += 1
            v = after
        for i in range(s, e):
            used[ids[i]] = False
    return hit, fills, prefetches, useful, issued, wasted


def next_use_ticks(ids: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """float64 ``[N]``: for each selection, the tick of the next selection of the same instance
    (``inf`` when none). Used by Belady at the last occurrence of an instance in its group, where
    this is its next use after the group."""
    ids = np.asarray(ids, dtype=np.int64)
    order = np.argsort(ids, kind="stable")
    out = np.full(ids.size, np.inf)
    same = ids[order[1:]] == ids[order[:-1]]
    out[order[:-1][same]] = order[1:][same]
    return out


# --------------------------------------------------------------------------------------------
# Time: the link as one queue beside the compute (issue 28)


LINK_MODES = ("fifo", "priority", "share")  # _serve's mode numbers


@_jit
def _serve(until, target, link_t, remaining, done, dq, dhead, pq, phead, mode, share):
    """Advance the link from ``link_t``: up to time ``until`` (``target < 0``; the queues empty
    first: the link idles until then, or stays where it is when ``until`` is inf) or until copy
    ``target`` has landed. ``dhead`` / ``phead``: [head, tail] of the demand / prefetch queues.
    Modes: 0 fifo (everything in the demand queue), 1 priority (the demand queue's head whenever
    it has one: a prefetch pauses), 2 share (both heads at once, demand at ``share`` of the rate).
    Returns the new ``link_t``."""
    while True:
        if target >= 0:
            if done[target] != np.inf:
                return link_t
        elif link_t >= until:
            return link_t
        has_d = dhead[0] < dhead[1]
        has_p = phead[0] < phead[1]
        if not has_d and not has_p:
            return link_t if until == np.inf or target >= 0 else until
        rd = 0.0
        rp = 0.0
        if has_d and has_p and mode == 2:
            rd = share
            rp = 1.0 - share
        elif has_d:
            rd = 1.0
        else:
            rp = 1.0
        cd = dq[dhead[0]] if has_d else -1
        cp = pq[phead[0]] if has_p else -1
        td = remaining[cd] / rd if rd > 0 else np.inf
        tp = remaining[cp] / rp if rp > 0 else np.inf
        dt = min(td, tp)
        if target < 0:
            dt = min(dt, until - link_t)
        new_t = link_t + dt
        if rd > 0:
            if td <= dt:
                remaining[cd] = 0.0
                done[cd] = new_t
                dhead[0] += 1
            else:
                remaining[cd] -= rd * dt
        if rp > 0:
            if tp <= dt:
                remaining[cp] = 0.0
                done[cp] = new_t
                phead[0] += 1
            else:
                remaining[cp] -= rp * dt
        link_t = new_t


@_jit
def _replay_time(ids, ptr, hit, issued, new_step, pre_ms, post_ms, head_ms, copy_ms, mode, share, join_step,
                 n_inst):
    """The compute clock and the link queue through a replay's decisions (see :func:`simulate_time`).
    Returns (total ms, stall ms, steps, copies)."""
    n_groups = ptr.size - 1
    width = issued.shape[1]
    n_copies = 0
    for g in range(n_groups):
        n_copies += (ptr[g + 1] - ptr[g]) + width
    remaining = np.zeros(n_copies + 1, dtype=np.float64)
    done = np.full(n_copies + 1, np.inf)
    dq = np.empty(n_copies + 1, dtype=np.int64)  # demand copies (every copy in fifo mode)
    pq = np.empty(n_copies + 1, dtype=np.int64)  # prefetch copies
    dhead = np.zeros(2, dtype=np.int64)
    phead = np.zeros(2, dtype=np.int64)
    latest = np.full(n_inst, -1, dtype=np.int64)
    seen = np.zeros(n_inst, dtype=np.bool_)
    nc = 0
    t = 0.0
    link_t = 0.0
    stall = 0.0
    steps = 0
    for g in range(n_groups):
        if new_step[g]:
            if g > 0:
                if join_step:  # the previous step's end waits for every copy issued so far
                    link_t = _serve(np.inf, -1, link_t, remaining, done, dq, dhead, pq, phead, mode, share)
                    if link_t > t:
                        stall += link_t - t
                        t = link_t
                t += head_ms
            steps += 1
        t += pre_ms
        link_t = _serve(t, -1, link_t, remaining, done, dq, dhead, pq, phead, mode, share)
        s = ptr[g]
        e = ptr[g + 1]
        for i in range(s, e):  # demand copies: each distinct missed instance, first occurrence order
            x = ids[i]
            if not hit[i] and not seen[x]:
                seen[x] = True
                remaining[nc] = copy_ms
                latest[x] = nc
                dq[dhead[1]] = nc
                dhead[1] += 1
                nc += 1
        for i in range(s, e):
            seen[ids[i]] = False
        for q in range(width):  # the group's prefetches, issued with its decisions
            x = issued[g, q]
            if x < 0:
                continue
            remaining[nc] = copy_ms
            latest[x] = nc
            if mode == 0:
                dq[dhead[1]] = nc
                dhead[1] += 1
            else:
                pq[phead[1]] = nc
                phead[1] += 1
            nc += 1
        ready = t
        for i in range(s, e):  # the experts start when every selected instance's copy has landed
            c = latest[ids[i]]
            if c < 0:
                continue
            if done[c] == np.inf:
                link_t = _serve(np.inf, c, link_t, remaining, done, dq, dhead, pq, phead, mode, share)
            if done[c] > ready:
                ready = done[c]
        stall += ready - t
        t = ready + post_ms
    if n_groups > 0:
        if join_step:
            link_t = _serve(np.inf, -1, link_t, remaining, done, dq, dhead, pq, phead, mode, share)
            if link_t > t:
                stall += link_t - t
                t = link_t
        t += head_ms
    return t, stall, steps, nc


@dataclass(frozen=True)
class TimeModel:
    """What :func:`simulate_time` assumes about the step and the host link.

    ``step_ms``: the all-HBM decode step at the stream's batch size (measured; the H200 at
    Qwen3-30B-A3B's shape: 2.56 ms at b1, NOTES.md). ``link_gb_s``: the host link's read rate
    (the measured pinned read rate, 51 GB/s on the H200). ``bytes_per_expert``: one copy
    (:func:`coldset.core.placement.expert_bytes`). ``head_share``: the share of the step outside the
    MoE layers' loop (embedding, final norm, LM head; 0.1 is the LM head's share of Qwen3-30B-A3B's
    bytes per step at b1); the rest is split equally over the MoE layers. ``router_share``: the share
    of a layer before its cache decisions (attention and router; the experts follow). Copies are
    issued at the decisions, the group's demand copies first. ``link``: ``"priority"`` (demand
    copies go before every queued prefetch and pause a running one, resumed after), ``"fifo"`` (one
    queue in issue order) or ``"share"`` (a demand and a prefetch copy cross at once, the demand
    at ``demand_share`` of the rate: the engine's demand fill and side-stream copy running
    together, 128 and 32 blocks a weight; a class alone gets the whole rate); FIFO within a class.
    ``join``: ``"use"`` (a copy is waited on only by a group that selects its instance) or
    ``"step"`` (in addition, each step's end, after its last MoE layer, waits for every copy issued
    until then: a side path joined inside the step's CUDA graph, the engine of issue 28).
    ``manage_ms``: the cache's own work per (step, layer) group on the compute stream (its
    decision and fill launches, cross-stream waits), paid at the group's decisions whether or not
    anything is copied: :func:`manage_ms_per_group` measures it from the policy's residency-1.0
    step, where every selection hits. Without it a policy whose decisions cost time (``lookahead``:
    +0.69 ms a step at b1 on the H200) is simulated 10% fast."""

    step_ms: float
    bytes_per_expert: int
    link_gb_s: float = 51.0
    head_share: float = 0.1
    router_share: float = 0.4
    link: str = "priority"
    join: str = "use"
    demand_share: float = 0.8
    manage_ms: float = 0.0

    def __post_init__(self) -> None:
        if not (self.step_ms > 0 and self.link_gb_s > 0 and self.bytes_per_expert > 0):
            raise CacheError(f"TimeModel: step_ms, link_gb_s and bytes_per_expert must be > 0, got {self.step_ms}, "
                             f"{self.link_gb_s}, {self.bytes_per_expert}")
        if not self.manage_ms >= 0:
            raise CacheError(f"TimeModel: manage_ms must be >= 0, got {self.manage_ms}")
        if not (0 <= self.head_share < 1 and 0 <= self.router_share <= 1):
            raise CacheError(f"TimeModel: head_share must lie in [0, 1) and router_share in [0, 1], got "
                             f"{self.head_share}, {self.router_share}")
        if self.join not in ("use", "step"):
            raise CacheError(f"TimeModel: join must be 'use' or 'step', got {self.join!r}")
        if self.link not in LINK_MODES or not 0 < self.demand_share < 1:
            raise CacheError(f"TimeModel: link must be one of {LINK_MODES} and demand_share in (0, 1), got "
                             f"{self.link!r}, {self.demand_share}")

    @property
    def copy_ms(self) -> float:
        return self.bytes_per_expert / (self.link_gb_s * 1e9) * 1e3


@dataclass(frozen=True)
class TimeStats:
    """A replay's simulated time (per step of the stream's batch; per token = per step / batch).

    ``bound_ms = max(allhbm_ms, link ms per step)``; ``bound_fraction = bound_ms / step_ms``;
    ``overlap = 1 - (step_ms - allhbm_ms) / link ms per step`` (NaN without link traffic): 1 when
    every copy hides under the compute, 0 when the link time adds to it in series."""

    step_ms: float
    allhbm_ms: float
    bound_ms: float
    bound_fraction: float
    overlap: float
    stall_ms_per_token: float
    link_gb_per_token: float
    wasted_gb_per_token: float
    steps: int
    tokens: int


def simulate_time(stream: AccessStream, result: CacheResult, model: TimeModel) -> TimeStats:
    """The time a replay's decisions (:func:`simulate`'s ``result`` on ``stream``) take.

    Compute: per step, each MoE layer ``(step_ms * (1 - head_share)) / L`` (``router_share`` of it
    before its decisions) plus ``manage_ms`` (the decisions), then ``head_share`` of the step. Link: one queue at ``link_gb_s``; a
    copy lands when its bytes have crossed. At a group's decisions its demand copies (each distinct
    missed instance: a slot fill, a read in place or a static cold read) and then its prefetches
    (``result.issued``) are queued; the group's experts start when every copy of an instance it
    selects has landed, the last of its own demand copies and any earlier copy still crossing (a
    late prefetch is a hit that saves only part of a copy); the wait is the stall. A new step
    starts where the stream's MoE layer index does not rise (as :func:`simulate`'s commit)."""
    if result.hit.size != stream.instances.size or result.fills.size != stream.num_groups:
        raise CacheError("simulate_time: the result is not a replay of this stream")
    ids, ptr = stream.instances, stream.group_ptr
    L = stream.num_moe_layers
    issued = result.issued if result.issued is not None else np.zeros((stream.num_groups, 0), np.int64)
    layer = ids[ptr[:-1]] // stream.num_experts if ids.size else np.zeros(0, np.int64)
    new_step = np.r_[True, layer[1:] <= layer[:-1]] if layer.size else np.zeros(0, bool)
    per_layer = model.step_ms * (1 - model.head_share) / L
    total, stall, steps, copies = _replay_time(
        ids, ptr, result.hit, np.ascontiguousarray(issued, dtype=np.int64), new_step,
        per_layer * model.router_share + model.manage_ms, per_layer * (1 - model.router_share),
        model.step_ms * model.head_share,
        model.copy_ms, LINK_MODES.index(model.link), float(model.demand_share),
        model.join == "step", stream.num_instances)
    total, stall, copies = float(total), float(stall), int(copies)
    st = result.stats()
    if copies != st.fills + st.prefetches:
        raise CacheError(f"simulate_time: {copies} copies timed, the replay counted {st.fills + st.prefetches}")
    tokens = max(stream.tokens, 1)
    steps = max(int(steps), 1)
    step = total / steps
    link_ms = copies * model.copy_ms / steps
    bound = max(model.step_ms, link_ms)
    return TimeStats(step, model.step_ms, bound, bound / step, 1 - (step - model.step_ms) / link_ms if copies else
                     float("nan"), stall / tokens, copies * model.bytes_per_expert / tokens / 1e9,
                     st.wasted_prefetches * model.bytes_per_expert / tokens / 1e9, steps, stream.tokens)


def manage_ms_per_group(full_step_ms: float, allhbm_step_ms: float, num_moe_layers: int) -> float:
    """:attr:`TimeModel.manage_ms` from two measured steps of one run and batch size: the policy at
    residency 1.0 (every selection hits, so its step exceeds the all-HBM one only by the cache's
    decisions) and the all-HBM step, spread over the step's ``num_moe_layers`` groups; 0 when the
    policy's step is not slower (noise)."""
    if num_moe_layers < 1 or not (full_step_ms > 0 and allhbm_step_ms > 0):
        raise CacheError(f"manage_ms_per_group: steps {full_step_ms}, {allhbm_step_ms} ms over {num_moe_layers} "
                         "layers: each must be > 0")
    return max(0.0, (full_step_ms - allhbm_step_ms) / num_moe_layers)


# --------------------------------------------------------------------------------------------
# The simulation


@dataclass(frozen=True)
class CacheStats:
    """One (policy, capacity) replay: the ``simulation.csv`` row (without residency/bytes)."""

    policy: str
    capacity: int
    accesses: int
    hits: int
    misses: int
    fills: int
    tokens: int
    groups: int
    prefetches: int = 0
    useful_prefetches: int = 0
    wasted_prefetches: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else float("nan")

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.tokens if self.tokens else float("nan")

    def link_gb_per_token(self, bytes_per_expert: int) -> float:
        return (self.fills + self.prefetches) * bytes_per_expert / self.tokens / 1e9 if self.tokens else float("nan")


@dataclass(frozen=True)
class CacheResult:
    """Per-selection and per-group outcome of one replay.

    ``hit`` bool ``[N]``; ``hits``, ``misses``, ``fills`` int64 ``[G]`` per group (``fills`` =
    distinct missed instances = link transfers); ``victims`` int64 ``[N]`` when recorded: at the
    first occurrence of each missed instance of a group, the instance evicted for it (-1
    elsewhere, and always -1 for ``static``). ``prefetches`` int64 ``[G]``: copies issued after
    each group and ``useful_prefetches`` (prefetched instances hit before eviction), prefetching
    policies only (None / 0 otherwise); ``issued`` int64 ``[G, W]`` the instances copied after each
    group in issue order (-1 padded; the engine's prefetch lists compare against it) and
    ``wasted_prefetches`` (prefetched instances evicted before any hit).
    """

    policy: str
    capacity: int
    hit: np.ndarray
    hits: np.ndarray
    misses: np.ndarray
    fills: np.ndarray
    tokens: int
    victims: np.ndarray | None = None
    prefetches: np.ndarray | None = None
    useful_prefetches: int = 0
    issued: np.ndarray | None = None
    wasted_prefetches: int = 0

    def stats(self) -> CacheStats:
        pf = int(self.prefetches.sum()) if self.prefetches is not None else 0
        return CacheStats(self.policy, self.capacity, int(self.hit.size), int(self.hits.sum()),
                          int(self.misses.sum()), int(self.fills.sum()), self.tokens, int(self.hits.size),
                          pf, int(self.useful_prefetches), int(self.wasted_prefetches))


def simulate(stream: AccessStream, policy: str, capacity: int, profile_counts: np.ndarray, *,
             record_victims: bool = False, predictions: np.ndarray | None = None,
             prefetch_budget: int | None = None) -> CacheResult:
    """Replay ``stream`` through a pool of ``capacity`` slots under ``policy``.

    ``profile_counts`` float ``[L, E]`` (profile split's selections) choose the warm pool
    (:func:`warm_order`) and LFU's initial counts. ``predictions`` int64 ``[G, P]`` (``forecast``
    and ``lookahead`` only, required there): the instances to prefetch after each group, -1 padded
    (:func:`coldset.analysis.forecast.stream_predictions`, :func:`coldset.analysis.forecast.lookahead_predictions`);
    ``nexttoken``: the forecast's candidate list of each group (:func:`coldset.analysis.forecast.
    nexttoken_lists`), which also sets the predicted flags, and ``prefetch_budget`` (copies per
    group, None: no cut). See the module docstring for the rules.
    """
    if policy not in POLICIES and policy != "lookahead":
        raise CacheError(f"unknown cache policy {policy!r}; known: {list(POLICIES) + ['lookahead']}")
    counts = np.asarray(profile_counts, dtype=np.float64)
    if counts.shape != (stream.num_moe_layers, stream.num_experts):
        raise CacheError(f"profile_counts has shape {counts.shape}, expected "
                         f"({stream.num_moe_layers}, {stream.num_experts})")
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise CacheError("profile_counts must be finite and >= 0")
    capacity = int(capacity)
    if capacity < 0 or capacity > stream.num_instances:
        raise CacheError(f"capacity {capacity} outside [0, {stream.num_instances}] instances")
    if policy in ONLINE_POLICIES and capacity < stream.max_group:
        raise CacheError(f"a pool of {capacity} slots cannot hold one group's {stream.max_group} selections "
                         f"(top_k x tokens per step); policy {policy!r} needs capacity >= {stream.max_group}")
    warm = warm_order(counts, capacity)
    ids, ptr, n_inst = stream.instances, stream.group_ptr, stream.num_instances
    victims = np.full(ids.size if record_victims else 0, -1, dtype=np.int64)
    prefetches, useful, issued, wasted = None, 0, None, 0
    if (policy in PREFETCH_POLICIES) != (predictions is not None):
        raise CacheError("predictions (the prefetch lists) are required by policy 'forecast', 'lookahead' or "
                         "'nexttoken' and only by them")
    if prefetch_budget is not None and (policy != "nexttoken" or int(prefetch_budget) < 0):
        raise CacheError(f"prefetch_budget (>= 0 copies per group) is a parameter of 'nexttoken' only, got "
                         f"{prefetch_budget} for {policy!r}")
    if policy in PREFETCH_POLICIES:
        pred = np.ascontiguousarray(predictions, dtype=np.int64)
        if pred.ndim != 2 or pred.shape[0] != stream.num_groups:
            raise CacheError(f"predictions: one row per group expected ({stream.num_groups}), got {pred.shape}")
        if pred.size and (pred.min() < -1 or pred.max() >= n_inst):
            raise CacheError(f"predictions: instance ids must lie in [0, {n_inst}) or be -1")
        if ids.size:
            layer_of = ids[ptr[:-1]] // stream.num_experts
            if policy in ("forecast", "nexttoken"):
                bad = (pred >= 0) & (pred // stream.num_experts != layer_of[:, None])
                what = "of another MoE layer (a group prefetches its own layer's next-step experts)"
            else:
                bad = (pred >= 0) & (pred // stream.num_experts <= layer_of[:, None])
                what = "of its own or an earlier MoE layer (a lookahead prefetches for later layers of its step)"
            if bad.any():
                raise CacheError(f"predictions: group {int(np.flatnonzero(bad.any(axis=1))[0])} lists an instance {what}")
        if policy == "nexttoken":
            budget = -1 if prefetch_budget is None else int(prefetch_budget)
            hit, fills, prefetches, useful, issued, wasted = _replay_next(
                ids, ptr, warm, n_inst, stream.num_experts, stream.num_moe_layers, pred, budget,
                record_victims, victims)
        else:
            hit, fills, prefetches, useful, issued, wasted = _replay_lru(
                ids, ptr, warm, n_inst, stream.num_experts, pred, record_victims, victims)
    elif policy == "static":
        hit, fills = _replay_static(ids, ptr, warm, n_inst)
    elif policy in ("lru", "lru_guard"):
        no_prefetch = np.zeros((stream.num_groups, 0), dtype=np.int64)
        guard = stream.num_moe_layers if policy == "lru_guard" else 0
        hit, fills, _, _, _, _ = _replay_lru(ids, ptr, warm, n_inst, stream.num_experts, no_prefetch,
                                             record_victims, victims, guard)
    else:
        nt = next_use_ticks(ids, ptr) if policy == "belady" else np.zeros(0)
        hit, fills = _replay_heap(ids, ptr, warm, counts.reshape(-1)[warm], n_inst,
                                  0 if policy == "lfu" else 1, nt, record_victims, victims)
    sizes = np.diff(ptr)
    hits = np.add.reduceat(hit.astype(np.int64), ptr[:-1]) if ids.size else np.zeros(0, np.int64)
    return CacheResult(policy, capacity, hit, hits, sizes - hits, fills, stream.tokens,
                       victims if record_victims else None, prefetches, int(useful), issued, int(wasted))


def simulation_table(stream: AccessStream, profile_counts: np.ndarray, policies: Sequence[str],
                     residencies: Sequence[float], bytes_per_expert: int, forecaster: Any = None, *,
                     lanes: Lanes | None = None, nexttoken: Any = None,
                     time_model: TimeModel | Mapping[str, TimeModel] | None = None,
                     batch: int = 1, prefetch_budget: int | None = None) -> pd.DataFrame:
    """The ``simulation.csv`` frame of one batch size: one row per (policy, residency) in the given
    orders. ``forecaster`` (a :class:`coldset.analysis.forecast.TransitionForecaster`) is required by
    ``forecast``; ``nexttoken`` (a :class:`coldset.analysis.forecast.NextTokenForecaster`) and ``lanes``
    (the stream's tokens per lane, ``stream == lanes.stream()``) by ``nexttoken``. With
    ``time_model`` (its ``step_ms`` the all-HBM step at ``batch``; or one per policy,
    :func:`time_models`' form, each with the policy's own ``manage_ms``) the time columns are
    filled (:func:`simulate_time`), else NaN."""
    pred = None
    if "forecast" in policies:
        if forecaster is None:
            raise CacheError("policy 'forecast' needs a forecaster fitted on the profile selection")
        from coldset.analysis.forecast import stream_predictions

        pred = stream_predictions(forecaster, stream)
    lists = None
    if "nexttoken" in policies:
        if nexttoken is None or lanes is None:
            raise CacheError("policy 'nexttoken' needs a NextTokenForecaster fitted on the profile selection and the "
                             "replay's lanes")
        from coldset.analysis.forecast import nexttoken_lists

        lists = nexttoken_lists(nexttoken, lanes.sel, lanes.start)
    rows = []
    for r in residencies:
        cap = capacity_for_residency(r, stream.num_moe_layers, stream.num_experts)
        fits = [p for p in policies if cap >= stream.max_group or p not in ONLINE_POLICIES]
        if len(fits) < len(policies):
            msg = (f"residency {r}: a pool of {cap} slots cannot hold one step's {stream.max_group} selections at "
                   f"batch {batch} (top_k x batch)")
            if batch == 1:
                raise CacheError(f"{msg}; raise the residency")
            # A larger batch of cache.time.steps is an extra view of the same cache: a small model's pool
            # may not hold its step. Its cached rows are left out, said here and absent from the table.
            log.warning("%s: no %s rows at batch %d", msg, "/".join(p for p in policies if p not in fits), batch)
        for p in fits:
            res = simulate(stream, p, cap, profile_counts,
                           predictions={"forecast": pred, "nexttoken": lists}.get(p),
                           prefetch_budget=prefetch_budget if p == "nexttoken" else None)
            st = res.stats()
            row = {"policy": p, "residency": float(r), "batch": int(batch), "capacity": cap, "accesses": st.accesses,
                   "tokens": st.tokens, "hit_rate": st.hit_rate, "misses_per_token": st.misses_per_token,
                   "link_gb_per_token": st.link_gb_per_token(bytes_per_expert),
                   "prefetches_per_token": st.prefetches / st.tokens if st.tokens else float("nan"),
                   "prefetch_precision": st.useful_prefetches / st.prefetches if st.prefetches else float("nan")}
            if time_model is not None:
                ts = simulate_time(stream, res, time_model if isinstance(time_model, TimeModel) else time_model[p])
                row.update(step_ms=ts.step_ms, bound_ms=ts.bound_ms, bound_fraction=ts.bound_fraction,
                           overlap=ts.overlap, stall_ms_per_token=ts.stall_ms_per_token,
                           wasted_gb_per_token=ts.wasted_gb_per_token)
            rows.append(row)
    return pd.DataFrame(rows, columns=list(SIMULATION_COLUMNS + TIME_COLUMNS))


# --------------------------------------------------------------------------------------------
# The workflow stage


# The H200 at Qwen3-30B-A3B's shape (NOTES.md, issue 28) and the engine of issue 28's round: copies
# on a side stream joined at the step's end, sharing the link with the demand fills.
DEFAULT_TIME = {"steps": [{"batch": 1, "all_hbm_step_ms": 2.56}, {"batch": 8, "all_hbm_step_ms": 5.76}],
                "link_gb_s": 51.0, "head_share": 0.1, "router_share": 0.4, "link": "share", "demand_share": 0.8,
                "join": "step"}


def time_models(time: Mapping[str, Any] | None, bytes_per_expert: int) -> dict[int, dict[str, TimeModel]]:
    """The config's ``cache.time`` section (None: :data:`DEFAULT_TIME`, the H200 figures at
    Qwen3-30B-A3B's shape in NOTES.md) as, per simulated batch size, one :class:`TimeModel` per
    policy of :data:`POLICIES`: the same step and link, each with the policy's own work per group
    from the step entry's ``manage_us`` (``TimeModel.manage_ms``; a policy not listed: none)."""
    t = {**DEFAULT_TIME, **(time or {})}
    out: dict[int, dict[str, TimeModel]] = {}
    for entry in t["steps"]:
        b = int(entry["batch"])
        if b < 1 or b in out:
            raise CacheError(f"cache.time.steps: batch {b} is < 1 or listed twice")
        manage = dict(entry.get("manage_us") or {})
        unknown = sorted(set(manage) - set(POLICIES))
        if unknown:
            raise CacheError(f"cache.time.steps: batch {b}'s manage_us names {unknown}, not among {', '.join(POLICIES)}")
        out[b] = {p: TimeModel(float(entry["all_hbm_step_ms"]), int(bytes_per_expert), float(t["link_gb_s"]),
                               float(t["head_share"]), float(t["router_share"]), str(t["link"]), str(t["join"]),
                               float(t["demand_share"]), float(manage.get(p, 0.0)) / 1e3) for p in POLICIES}
    if not out:
        raise CacheError("cache.time.steps: at least one (batch, all_hbm_step_ms) entry")
    return out


def run_cache(trace_path: str | os.PathLike, histogram_csv: str | os.PathLike, model_config: Any,
              out_dir: str | os.PathLike, policies: Sequence[str] = POLICIES,
              residencies: Sequence[float] = (0.25, 0.5, 0.75, 1.0), profile_domains: Any = None, *,
              phase: str = "decode", domain_weights: Any = None, weight_format: str | None = None,
              heldout_fraction: float = 0.25, locality_json: str | os.PathLike | None = None,
              figures: bool = True, time: Mapping[str, Any] | None = None,
              prefetch_budget: int | None = None, nexttoken_extra: int = 3) -> dict[str, Path]:
    """The ``cache`` stage: ``simulation.csv`` (:data:`SIMULATION_COLUMNS` + :data:`TIME_COLUMNS`)
    and ``locality.png``.

    Warm pool = the ``usage_global`` hot set the placement stage chooses from the same histogram
    and profile (:func:`coldset.core.placement.profile_counts` with ``profile_domains``, ``phase``,
    ``domain_weights``); replay = the held-out split's decode rows of every domain, at each batch
    size of ``time["steps"]`` (requests laid out in lanes, :func:`lanes_from_frame`), timed by
    :func:`simulate_time` with that batch's all-HBM step (``time``: the config's ``cache.time``).
    Link bytes use placement's byte model (:func:`coldset.core.placement.expert_bytes` in
    ``weight_format``, by default the model's own expert format, as the placement stage does).
    The forecasters (``forecast``, ``nexttoken``) are fitted on the profile selection's decode rows.
    The figure shows the locality statistic of ``locality_json`` (stats stage) beside the hit rates
    and the simulated time.
    """
    from coldset.core.files import atomic_path
    from coldset.analysis.placement import expert_bytes
    from coldset.analysis.profile import profile_counts, read_histogram
    from coldset.core.placement import ProfileSpec

    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise CacheError(f"cache.policies: unknown {unknown}; known {list(POLICIES)}")
    rows, meta = trace_decode_rows(trace_path, heldout_fraction, expect=model_config)
    L, E = meta.num_moe_layers, meta.num_experts
    spec = ProfileSpec.make(profile_domains, phase, domain_weights)
    counts = profile_counts(read_histogram(histogram_csv), meta.moe_layers, E, spec)
    replay = select_rows(rows, "heldout")
    if len(replay) == 0:
        raise CacheError(f"{trace_path}: the held-out split has no decode rows to replay")
    profile = select_rows(rows, "profile", spec.domains)
    per_expert = expert_bytes(model_config, weight_format)
    forecaster = nexttoken = None
    if "forecast" in policies:
        from coldset.analysis.forecast import TransitionForecaster

        forecaster = TransitionForecaster.fit(profile, L, E, meta.top_k)
    if "nexttoken" in policies:
        from coldset.analysis.forecast import NextTokenForecaster

        tokens, seq = token_array(profile, L, E)
        nexttoken = NextTokenForecaster.fit_tuned(tokens, seq, meta.top_k, E, extra=nexttoken_extra)
    tables = []
    for batch, models in time_models(time, per_expert).items():
        lanes = lanes_from_frame(replay, L, E, batch)
        tables.append(simulation_table(lanes.stream(), counts, policies, residencies, per_expert, forecaster,
                                       lanes=lanes, nexttoken=nexttoken, time_model=models, batch=batch,
                                       prefetch_budget=prefetch_budget))
    table = pd.concat(tables, ignore_index=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"simulation": out / "simulation.csv"}
    with atomic_path(paths["simulation"]) as tmp:
        table.to_csv(tmp, index=False)
    if figures:
        import json

        locality = json.loads(Path(locality_json).read_text()) if locality_json else None
        paths["figure"] = out / "locality.png"
        figure_locality(table, locality, meta, paths["figure"])
    return paths


def read_simulation(path: str | os.PathLike) -> pd.DataFrame:
    """Read and check ``simulation.csv`` (columns, policies, rates in [0, 1])."""
    path = Path(path)
    if not path.is_file():
        raise CacheError(f"{path}: cache simulation file not found")
    df = pd.read_csv(path)
    missing = [c for c in SIMULATION_COLUMNS if c not in df.columns]
    if missing:
        raise CacheError(f"{path}: missing column(s) {missing}; expected {list(SIMULATION_COLUMNS)}")
    bad = sorted(set(df["policy"]) - set(POLICIES))
    if bad:
        raise CacheError(f"{path}: unknown policy name(s) {bad}")
    rates = df["hit_rate"].to_numpy(dtype=float)
    if not np.all((rates >= 0) & (rates <= 1)):
        raise CacheError(f"{path}: hit_rate outside [0, 1]")
    # the time columns (issue 28) are optional: a file written before them still reads
    for col in ("step_ms", "bound_ms", "stall_ms_per_token", "wasted_gb_per_token"):
        if col in df.columns:
            vals = df[col].to_numpy(dtype=float)
            if (vals[~np.isnan(vals)] < 0).any():
                raise CacheError(f"{path}: {col} must be >= 0")
    if "batch" in df.columns and (df["batch"].to_numpy() < 1).any():
        raise CacheError(f"{path}: batch must be >= 1")
    return df


def draw_locality(fig, table: pd.DataFrame | None, locality: Mapping[str, Any] | None, model: str) -> None:
    """Panels on ``fig``: consecutive vs shuffled overlap per layer, the reuse-distance
    distribution, hit rate vs residency per policy (the smallest batch), and, where the table has
    the time columns, the simulated step's fraction of its bound per policy and batch (each panel
    says so when its input is absent)."""
    timed = table is not None and "bound_fraction" in table.columns and table["bound_fraction"].notna().any()
    axes = fig.subplots(1, 4 if timed else 3)
    ax = axes[0]
    if locality:
        layers = list(locality["consecutive_overlap"]["per_layer"])
        x = np.arange(len(layers))
        for key, label, marker in (("consecutive_overlap", "consecutive tokens", "o"),
                                   ("shuffled_overlap", "shuffled within request", "s")):
            vals = [locality[key]["per_layer"][k] for k in layers]
            ax.plot(x, [np.nan if v is None else v for v in vals], marker=marker, label=label)
        ticks = x[:: max(1, len(x) // 12)]
        ax.set_xticks(ticks, [layers[i] for i in ticks])
        lift = locality.get("lift")
        ax.set_title("expert overlap |E(t) & E(t-1)| / k" + (f" (lift {lift:.2f}x)" if lift else ""), fontsize=9)
        ax.set_xlabel("layer")
        ax.set_ylabel("overlap")
        ax.legend(fontsize=7)
        reuse = locality["reuse_distance"]
        axes[1].bar(list(reuse), [v or 0.0 for v in reuse.values()], color="tab:gray")
        axes[1].set_title("reuse distance (decode tokens, same request)", fontsize=9)
        axes[1].set_ylabel("share of decode selections")
        axes[1].tick_params(axis="x", labelrotation=45)
    else:
        for a in axes[:2]:
            a.text(0.5, 0.5, "no locality statistic", ha="center", va="center")
            a.set_axis_off()
    ax = axes[2]
    if table is not None and len(table):
        batch1 = table[table["batch"] == table["batch"].min()] if "batch" in table.columns else table
        for policy, sub in batch1.groupby("policy", sort=False):
            ax.plot(sub["residency"], sub["hit_rate"], marker="o", label=policy)
        ax.set_xlabel("residency (share of routed experts in the pool)")
        ax.set_ylabel("hit rate (held-out decode selections)")
        ax.set_title("cache simulation, warm from usage_global", fontsize=9)
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no cache simulation", ha="center", va="center")
        ax.set_axis_off()
    if timed:
        ax = axes[3]
        for (policy, batch), sub in table.groupby(["policy", "batch"], sort=False):
            ax.plot(sub["residency"], sub["bound_fraction"], marker="o" if batch == table["batch"].min() else "s",
                    label=f"{policy} b{batch}")
        ax.set_xlabel("residency")
        ax.set_ylabel("bound / simulated step")
        ax.set_ylim(0, 1.05)
        ax.set_title("simulated time: fraction of max(all-HBM step, link time)", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"{model}: temporal locality of decode routing", fontsize=10)


def figure_locality(table: pd.DataFrame, locality: Mapping[str, Any] | None, meta: Any, path: Path) -> None:
    """The cache stage's figure (:func:`draw_locality`) as a PNG at ``path``, atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from coldset.core.files import atomic_path

    fig = Figure(figsize=(20 if "bound_fraction" in table.columns else 15, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    draw_locality(fig, table, locality, str(getattr(meta, "model", "")))
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", bbox_inches="tight")


def recall_table(profile: pd.DataFrame, replay: pd.DataFrame, num_moe_layers: int, num_experts: int, top_k: int,
                 horizons: Sequence[int] = (1, 2, 4, 8), extra: int = 3,
                 budget: int | None = None, term_sets=None, ceiling_lower_layers: int = 0) -> pd.DataFrame:
    """The next-token forecast's quality per horizon: the :class:`coldset.analysis.forecast.NextTokenForecaster`
    fitted (and tuned) on ``profile`` for each horizon, measured on ``replay``: recall and
    precision at ``top_k + extra`` candidates and at ``top_k`` (and at ``budget``), beside the
    transition table of the current token alone (issue 12's forecaster), the previous-token
    baseline and the in-sample ceiling of any function of the current token's experts
    (:func:`coldset.analysis.forecast.conditional_ceiling`), with the forecaster's cost. ``term_sets``: as
    :meth:`~coldset.analysis.forecast.NextTokenForecaster.fit_tuned` (chosen on the profile's validation
    part); ``ceiling_lower_layers`` = m > 0 adds the in-sample ceiling of any function of the
    current token's experts in layers l..l-m (column ``ceiling_current_and_lower_layers``)."""
    import time as _time

    from coldset.analysis.forecast import NextTokenForecaster, conditional_ceiling, forecast_quality

    L, E = num_moe_layers, num_experts
    tp, sp = token_array(profile, L, E)
    th, sh = token_array(replay, L, E)
    n = min(top_k + extra, E)
    # a replay of domains the profile lacks (a held-out subject): tune on a held-out profile domain too
    validation, tuned_on = None, "every 5th profile request"
    prof_domains = sorted(set(profile["domain"].astype(str))) if "domain" in profile else []
    if len(prof_domains) > 1 and "domain" in replay and not set(replay["domain"].astype(str)) & set(prof_domains):
        req_col = profile["request"]
        _, names = request_codes(req_col.array if isinstance(req_col.dtype, pd.CategoricalDtype) else req_col)
        dom_of = dict(zip(req_col.astype(str).to_numpy(), profile["domain"].astype(str).to_numpy()))
        validation = np.array([dom_of[names[s]] == prof_domains[-1] for s in sp])  # sp: token_array's numbering
        tuned_on = f"profile domain {prof_domains[-1]!r}"
    sizes = tuple(sorted({top_k} | ({int(budget)} if budget else set())))
    out = []
    for h in horizons:
        t0 = _time.perf_counter()
        f = NextTokenForecaster.fit_tuned(tp, sp, top_k, E, horizon=h, extra=extra, validation=validation,
                                          term_sets=term_sets)
        fit_s = _time.perf_counter() - t0
        t0 = _time.perf_counter()
        q = forecast_quality(f, th, sh, sizes)
        per_token_us = (_time.perf_counter() - t0) / max(th.shape[0], 1) * 1e6
        cur = NextTokenForecaster.fit(tp, sp, top_k, E, horizon=h, extra=extra, terms=((0, 0),), weights=(1.0,),
                                      hist_beta=0.0)
        qc = forecast_quality(cur, th, sh)
        prev_recall = float("nan")  # the forecast "it selects what the token h before did"
        if th.shape[0] > h:
            same = sh[h:] == sh[:-h]
            if same.any():
                prev_recall = float((th[h:][same][..., :, None] == th[:-h][same][..., None, :]).any(-1).mean())
        ceil = conditional_ceiling(th, sh, h, n)
        if ceiling_lower_layers > 0:
            wide = conditional_ceiling(th, sh, h, n, lower_layers=ceiling_lower_layers)
            ceil["ceiling_recall_lower"] = wide["ceiling_recall"]
            ceil["contexts_lower"] = wide["contexts"]
        ops = f.ops_per_step(1)
        row = {"horizon": h, "candidates": n, "recall": q["recall"], "precision": q["precision"]}
        for m in sizes:
            row[f"recall_at_{m}"] = q[f"recall_at_{m}"]
            row[f"precision_at_{m}"] = q[f"precision_at_{m}"]
        row.update({"recall_current_table_only": qc["recall"], "recall_previous_token": prev_recall,
                    "ceiling_current_experts": ceil["ceiling_recall"], "popularity_recall": ceil["popularity_recall"],
                    **({"ceiling_current_and_lower_layers": ceil["ceiling_recall_lower"],
                        "ceiling_lower_layers": ceiling_lower_layers, "contexts_current": ceil["contexts"],
                        "contexts_current_and_lower": ceil["contexts_lower"]} if ceiling_lower_layers > 0 else {}),
                    "hist_beta": f.hist_unit / 65536, "hist_shift": f.hist_shift,
                    "self_boost": f.self_boost, "tuned_on": tuned_on,
                    "terms": str(list(f.terms)),
                    "table_mb": f.nbytes / 1e6, "state_bytes_per_sequence": 4 * L * E,
                    "table_bytes_read_per_step_b1": ops["bytes_read"], "int_adds_per_step_b1": ops["int_adds"],
                    "cpu_us_per_token": per_token_us, "fit_s": fit_s, "pairs": q["pairs"]})
        out.append(row)
    return pd.DataFrame(out)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m coldset.analysis.cache TRACE ...``: the simulation table of any trace, printed as CSV."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m coldset.analysis.cache", description=(
        "Replay a trace's decode routing through the cache policies (warm from usage_global on the profile "
        "selection, replay the held-out selection) and print simulation.csv's rows."))
    ap.add_argument("trace")
    ap.add_argument("--profile-domains", nargs="+", help="profile = these domains, every request (default: profile split)")
    ap.add_argument("--replay-domains", nargs="+", help="replay = these domains, every request (default: heldout split)")
    ap.add_argument("--heldout-fraction", type=float, default=0.25, help="hash split for traces without a split column")
    ap.add_argument("--residency", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--bytes-per-expert", type=int, help="for link_gb_per_token and the time columns (NaN without it)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="replay batch sizes (requests in lanes)")
    ap.add_argument("--step-ms", type=float, nargs="+",
                    help="the all-HBM step (ms) at each --batch (default: the H200 figures, 2.56 at b1, 5.76 at b8)")
    ap.add_argument("--link-gb-s", type=float, default=DEFAULT_TIME["link_gb_s"])
    ap.add_argument("--head-share", type=float, default=DEFAULT_TIME["head_share"])
    ap.add_argument("--router-share", type=float, default=DEFAULT_TIME["router_share"])
    ap.add_argument("--link", choices=LINK_MODES, default=DEFAULT_TIME["link"],
                    help="demand vs prefetch copies on the link (TimeModel.link)")
    ap.add_argument("--demand-share", type=float, default=DEFAULT_TIME["demand_share"])
    ap.add_argument("--join", choices=("use", "step"), default=DEFAULT_TIME["join"])
    ap.add_argument("--prefetch-budget", type=int, help="nexttoken: copies per group (default: no cut)")
    ap.add_argument("--nexttoken-extra", type=int, default=3,
                    help="nexttoken: candidates per token beyond top_k (the predicted set and the prefetch list)")
    ap.add_argument("--recall", action="store_true",
                    help="print the next-token forecast's recall / precision table per horizon to stderr (CSV), "
                         "and the issue-12 forecaster's one-token recall (JSON)")
    ap.add_argument("--horizons", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--lower-layer-terms", action="store_true",
                    help="nexttoken: also try the current token's two lower layers as forecast terms "
                         "(coldset.analysis.forecast.LOWER_LAYER_TERMS), chosen or not on the profile's validation part")
    ap.add_argument("--ceiling-lower-layers", type=int, default=0,
                    help="--recall: also the in-sample ceiling of any function of the current token's experts in "
                         "layers l..l-N (slow: a minute per horizon on the real trace)")
    args = ap.parse_args(argv)
    term_sets = None
    if args.lower_layer_terms:
        from coldset.analysis.forecast import DEFAULT_TERMS, DEFAULT_WEIGHTS, LOWER_LAYER_TERMS, LOWER_LAYER_WEIGHTS

        term_sets = ((DEFAULT_TERMS, DEFAULT_WEIGHTS), (LOWER_LAYER_TERMS, LOWER_LAYER_WEIGHTS))
    rows, meta = trace_decode_rows(args.trace, args.heldout_fraction)
    L, E = meta.num_moe_layers, meta.num_experts
    profile = select_rows(rows, None, args.profile_domains) if args.profile_domains else select_rows(rows, "profile")
    replay = select_rows(rows, None, args.replay_domains) if args.replay_domains else select_rows(rows, "heldout")
    import sys

    forecaster = nexttoken = None
    if "forecast" in args.policies or args.recall:
        import time

        from coldset.analysis.forecast import TransitionForecaster, forecast_recall, stream_predictions

        t0 = time.perf_counter()
        forecaster = TransitionForecaster.fit(profile, L, E, meta.top_k)
        fit_s = time.perf_counter() - t0
        if args.recall:
            import json

            stream = stream_from_frame(replay, L, E)
            t0 = time.perf_counter()
            stream_predictions(forecaster, stream)
            per_token = (time.perf_counter() - t0) / max(stream.tokens, 1)
            print(json.dumps({**forecast_recall(forecaster, replay, L, E), "fit_s": round(fit_s, 3),
                              "forecast_us_per_token": round(per_token * 1e6, 1)}), file=sys.stderr)
            table = recall_table(profile, replay, L, E, meta.top_k, args.horizons, budget=args.prefetch_budget,
                                 term_sets=term_sets, ceiling_lower_layers=args.ceiling_lower_layers)
            print(table.to_csv(index=False, float_format="%.4g"), end="", file=sys.stderr)
    if "nexttoken" in args.policies:
        from coldset.analysis.forecast import NextTokenForecaster

        tokens, seq = token_array(profile, L, E)
        nexttoken = NextTokenForecaster.fit_tuned(tokens, seq, meta.top_k, E, extra=args.nexttoken_extra,
                                                  term_sets=term_sets)
        print(f"nexttoken forecaster: terms {list(nexttoken.terms)}, hist_unit {nexttoken.hist_unit}, hist_shift "
              f"{nexttoken.hist_shift}, self_boost {nexttoken.self_boost}, n {nexttoken.n}", file=sys.stderr)
    steps = args.step_ms or [next((s["all_hbm_step_ms"] for s in DEFAULT_TIME["steps"] if s["batch"] == b), None)
                             for b in args.batch]
    if len(steps) != len(args.batch) or any(s is None for s in steps):
        ap.error("--step-ms: one all-HBM step per --batch (defaults exist for batch 1 and 8 only)")
    tables = []
    for batch, step_ms in zip(args.batch, steps):
        lanes = lanes_from_frame(replay, L, E, batch)
        model = None
        if args.bytes_per_expert:
            model = TimeModel(step_ms, args.bytes_per_expert, args.link_gb_s, args.head_share, args.router_share,
                              args.link, args.join, args.demand_share)
        tables.append(simulation_table(lanes.stream(), counts_from_rows(profile, L, E), args.policies,
                                       args.residency, args.bytes_per_expert or 0, forecaster, lanes=lanes,
                                       nexttoken=nexttoken, time_model=model, batch=batch,
                                       prefetch_budget=args.prefetch_budget))
    table = pd.concat(tables, ignore_index=True)
    if not args.bytes_per_expert:
        table["link_gb_per_token"] = float("nan")
    print(table.to_csv(index=False, float_format="%.6g"), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
