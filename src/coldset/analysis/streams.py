"""The access streams the cache simulator replays, and the trace rows they are built from.

An :class:`AccessStream` is a trace's decode selections in replay order, cut into groups: a
(token, MoE layer) group of ``top_k`` selections (:func:`stream_from_frame`), or a (step, MoE
layer) group of ``B * k`` for an engine batch of ``B`` lanes (:class:`Lanes`,
:func:`lanes_from_frame`, :func:`lanes_from_engine`). Instance id = ``moe_layer_index * E +
expert`` (the row map's row, not the model's layer index).

Two readings of a trace: :func:`read_decode_tokens` keeps its decode tokens as compact arrays
(:class:`DecodeTokens`: an int16 ``[T, L, k]`` block and a few numbers per token, read batch by
batch, a few bytes a selection), from which the cache command builds its selections, streams,
lanes, profiles and the forecasters' input at any trace size; :func:`trace_decode_rows` reads the
decode rows as a frame (a row per selection) for the small analyses that group rows, with
:func:`select_rows`, :func:`counts_from_rows` and :func:`token_array` on frames. The replay rules
are in :mod:`coldset.analysis.simulate`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from coldset.analysis.compiled import jit
from coldset.core.trace import iter_trace_batches, read_trace_meta, request_codes, split_of


class CacheError(ValueError):
    """Bad input to the cache simulation (policy, capacity, stream, profile); the message says what."""


def instance_dtype(num_instances: int) -> type:
    """The integer type of instance ids among ``num_instances`` (a stream's selections, prefetch
    lists): int32 (half the memory of a large trace's), int64 past its range."""
    return np.int32 if num_instances <= np.iinfo(np.int32).max else np.int64


@dataclass(frozen=True)
class AccessStream:
    """Selections in replay order, cut into groups.

    ``instances`` int32 or int64 ``[N]`` (other integer types are stored as int64): instance id
    ``moe_layer_index * num_experts + expert`` of each selection (:func:`instance_dtype` where this
    module builds a stream); ``group_ptr`` int64 ``[G + 1]``: group ``g`` is ``instances[group_ptr[g]:
    group_ptr[g + 1]]`` (non-empty); ``tokens``: decoded tokens the stream covers (the divisor of
    the per-token metrics).
    """

    instances: np.ndarray
    group_ptr: np.ndarray
    tokens: int
    num_moe_layers: int
    num_experts: int

    def __post_init__(self) -> None:
        ids = np.asarray(self.instances)
        ids = np.ascontiguousarray(ids, dtype=ids.dtype if ids.dtype in (np.int32, np.int64) else np.int64)
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


def _frame_columns(rows: pd.DataFrame | Mapping[str, Any], who: str) -> tuple:
    """``(request, position, layer_index, rank, expert)`` of decode rows, the numbers as int64 arrays
    (a categorical request column as its array); columns of different lengths refused, naming ``who``."""
    req_col = rows["request"]
    if isinstance(req_col, pd.Series) and isinstance(req_col.dtype, pd.CategoricalDtype):
        req_col = req_col.array
    pos, li, rank, exp = (np.asarray(rows[c], dtype=np.int64) for c in ("position", "layer_index", "rank", "expert"))
    if not (len(req_col) == pos.size == li.size == rank.size == exp.size):
        raise CacheError(f"{who}: columns differ in length")
    return req_col, pos, li, rank, exp


def stream_from_frame(rows: pd.DataFrame | Mapping[str, Any], num_moe_layers: int,
                      num_experts: int) -> AccessStream:
    """The replay stream of decode rows: columns ``request`` (str or categorical),
    ``position``, ``layer_index`` (MoE-layer index 0..L-1), ``rank``, ``expert``.

    Order: request id (string order), position, layer index, rank; one group per (request,
    position, layer index); tokens = distinct (request, position). Two rows with the same
    (request, position, layer index, rank) are an error. Rows already in that order (as traces
    are written) skip the sort.
    """
    req_col, pos, li, rank, exp = _frame_columns(rows, "stream_from_frame")
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
        sel = np.asarray(self.sel)
        if not np.issubdtype(sel.dtype, np.signedinteger):
            raise CacheError(f"Lanes: sel must hold signed integers (experts, -1 idle), got {sel.dtype}")
        sel = np.ascontiguousarray(sel)
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
        dtype = instance_dtype(L * self.num_experts)
        flat = np.empty(self.sel.shape, dtype=dtype)
        # experts lie in [-1, E) (checked): every sum fits the instance type
        np.add(self.sel, np.arange(L, dtype=dtype)[None, :, None, None] * self.num_experts, out=flat, casting="unsafe")
        ids = flat.reshape(-1) if act.all() else flat[np.broadcast_to(act[:, None, :, None], flat.shape)]
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
    """The decode tokens of ``rows`` as ``batch`` lanes (:func:`lanes_from_tokens` of
    :func:`token_array`). ``batch = 1`` gives :func:`stream_from_frame`'s stream."""
    if batch < 1:
        raise CacheError(f"lanes_from_frame: batch must be >= 1, got {batch}")
    tokens, seq = token_array(rows, num_moe_layers, num_experts)
    return lanes_from_tokens(tokens, seq, num_experts, batch)


def lanes_from_tokens(tokens: np.ndarray, sequence: np.ndarray, num_experts: int, batch: int) -> Lanes:
    """Decode ``tokens`` int ``[T, L, k]`` of sequences ``sequence`` ``[T]`` (each sequence's tokens
    consecutive, in position order) as ``batch`` lanes under continuous batching: sequences in
    order, each to the lane that frees first (the lowest lane on ties), its tokens on consecutive
    steps. ``sel`` keeps ``tokens``' dtype; at ``batch = 1`` it is ``tokens`` itself."""
    if batch < 1:
        raise CacheError(f"lanes_from_tokens: batch must be >= 1, got {batch}")
    T, L, k = tokens.shape
    if T == 0:
        return Lanes(np.zeros((0, L, batch, k), tokens.dtype), np.zeros((0, batch), bool), num_experts)
    starts = np.r_[0, np.flatnonzero(sequence[1:] != sequence[:-1]) + 1]
    if batch == 1:
        start = np.zeros((T, 1), dtype=bool)
        start[starts, 0] = True
        return Lanes(tokens[:, :, None, :], start, num_experts)
    lengths = np.diff(np.r_[starts, T])
    free = np.zeros(batch, dtype=np.int64)
    lane = np.empty(starts.size, np.int64)
    step0 = np.empty(starts.size, np.int64)
    for r, n in enumerate(lengths):
        b = int(np.argmin(free))
        lane[r], step0[r] = b, free[b]
        free[b] += n
    S = int(free.max())
    sel = np.full((S, L, batch, k), -1, dtype=tokens.dtype)
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
    """Selections per instance, float64 ``[L, E]`` (a profile for :func:`coldset.analysis.simulate.simulate`)."""
    flat = rows["layer_index"].to_numpy(np.int64) * num_experts + rows["expert"].to_numpy(np.int64)
    return np.bincount(flat, minlength=num_moe_layers * num_experts).astype(np.float64).reshape(
        num_moe_layers, num_experts)



@jit
def count_selections(experts, out):
    """Add to ``out`` int64 ``[L, E]`` each selection of ``experts`` ``[T, L, k]`` (-1: none), in
    one pass without a per-selection array; returns how many name an expert >= E (not counted)."""
    T, L, k = experts.shape
    E = out.shape[1]
    bad = 0
    for t in range(T):
        for layer in range(L):
            for r in range(k):
                e = experts[t, layer, r]
                if e >= E:
                    bad += 1
                elif e >= 0:
                    out[layer, e] += 1
    return bad


@dataclass(frozen=True)
class DecodeTokens:
    """A trace's decode tokens as compact arrays, one row per token, in request (string) then
    position order: what the cache command keeps of a trace (a few bytes a selection, no Python
    object or frame row per selection).

    ``experts`` int16 ``[T, L, k]`` (MoE-layer index, rank order; -1 where the trace has no
    selection); ``request`` int32 ``[T]``: the request's number in string order of
    ``request_names`` (:func:`coldset.core.trace.request_codes`' numbering); ``position`` int32
    ``[T]``; ``domain`` int32 ``[T]`` into ``domain_names``; ``heldout`` bool ``[T]``: the request's
    split is ``heldout``. A selection keeps every name, so request numbers agree across selections.
    """

    experts: np.ndarray
    request: np.ndarray
    position: np.ndarray
    domain: np.ndarray
    heldout: np.ndarray
    request_names: np.ndarray
    domain_names: np.ndarray
    num_experts: int

    @property
    def tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def num_moe_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def domains(self) -> list[str]:
        """The domains that have tokens here, sorted."""
        return sorted(str(d) for d in self.domain_names[np.unique(self.domain)])

    def take(self, keep: np.ndarray) -> "DecodeTokens":
        """The tokens where ``keep`` (bool ``[T]``)."""
        return DecodeTokens(self.experts[keep], self.request[keep], self.position[keep], self.domain[keep],
                            self.heldout[keep], self.request_names, self.domain_names, self.num_experts)

    def select(self, split: str | None = None, domains: Sequence[str] | None = None) -> "DecodeTokens":
        """The tokens of one split (``None``: both) and of the given domains (``None``: all), as
        :func:`select_rows` picks rows."""
        keep = np.ones(self.tokens, dtype=bool)
        if split is not None:
            keep &= self.heldout if split == "heldout" else ~self.heldout
        if domains is not None:
            have = self.domains
            missing = sorted(set(domains) - set(have))
            if missing:
                raise CacheError(f"domain(s) {missing} have no decode rows; available {have}")
            keep &= np.isin(self.domain, np.flatnonzero(np.isin(self.domain_names, list(domains))))
        return self.take(keep)

    def counts(self) -> np.ndarray:
        """Selections per instance, float64 ``[L, E]`` (:func:`counts_from_rows` of these tokens)."""
        out = np.zeros((self.num_moe_layers, self.num_experts), dtype=np.int64)
        bad = count_selections(self.experts, out)
        if bad:
            raise CacheError(f"{bad} decode selection(s) name an expert >= num_experts {self.num_experts}")
        return out.astype(np.float64)

    def stream(self) -> AccessStream:
        """The replay stream one token at a time: :func:`stream_from_frame` of these tokens' rows
        (a group per (token, MoE layer) with selections)."""
        T, L, k = self.experts.shape
        E = self.num_experts
        dtype = instance_dtype(L * E)
        ids = np.empty((T, L, k), dtype=dtype)
        np.add(self.experts, (np.arange(L, dtype=dtype) * E)[None, :, None], out=ids)
        valid = self.experts >= 0
        if valid.all():
            return AccessStream(ids.reshape(-1), np.arange(0, T * L * k + 1, k, dtype=np.int64), T, L, E)
        sizes = valid.sum(axis=2).reshape(-1)
        sizes = sizes[sizes > 0]
        return AccessStream(ids[valid], np.r_[0, np.cumsum(sizes)], T, L, E)

    def token_array(self) -> tuple[np.ndarray, np.ndarray]:
        """``(experts int16 [T, L, k], sequence int64 [T])`` as :func:`token_array`: every token must
        hold all ``L`` MoE layers and ``k`` ranks."""
        if self.tokens and (self.experts < 0).any():
            t = int(np.flatnonzero((self.experts < 0).any(axis=(1, 2)))[0])
            raise CacheError(f"token_array: every decode token must hold all {self.num_moe_layers} MoE layers "
                             f"with the same top_k selections (request {str(self.request_names[self.request[t]])!r}, "
                             f"position {int(self.position[t])} lacks some)")
        return self.experts, self.request.astype(np.int64)

    def lanes(self, batch: int) -> Lanes:
        """The tokens as ``batch`` lanes (:func:`lanes_from_tokens`; :func:`lanes_from_frame` of
        these tokens' rows)."""
        return lanes_from_tokens(*self.token_array(), self.num_experts, batch)

    def consecutive(self) -> np.ndarray:
        """bool ``[T]``: token ``t + 1`` is the next position of token ``t``'s request (False for the
        last token)."""
        if self.tokens == 0:
            return np.zeros(0, dtype=bool)
        return np.r_[(self.request[1:] == self.request[:-1]) & (self.position[1:] == self.position[:-1] + 1), False]


#: Tokens :func:`read_decode_tokens` compares at once (a bool per selection of these tokens only).
TOKEN_CHUNK = 1 << 16
#: Rows a pass of :func:`read_decode_tokens` reads at once (at most a row group).
READ_BATCH_ROWS = 1 << 22


def _codes(col: pa.Array) -> tuple[np.ndarray, list[str]]:
    """(int64 codes per row, names) of a string or dictionary column."""
    if not pa.types.is_dictionary(col.type):
        col = pc.dictionary_encode(col)
    return col.indices.to_numpy(zero_copy_only=False).astype(np.int64), col.dictionary.cast(pa.string()).to_pylist()


def _global(names: list[str], ids: dict[str, int]) -> np.ndarray:
    """Each name's number in ``ids`` (first seen, first numbered; ``ids`` grows)."""
    return np.asarray([ids.setdefault(n, len(ids)) for n in names], dtype=np.int64).reshape(-1)


def _runs(*cols: np.ndarray) -> np.ndarray:
    """Row indices where any of ``cols`` differs from the previous row (row 0 included)."""
    change = np.zeros(cols[0].size, dtype=bool)
    if change.size:
        change[0] = True
        for c in cols:
            change[1:] |= c[1:] != c[:-1]
    return np.flatnonzero(change)


def _decode_mask(batch: pa.RecordBatch) -> np.ndarray:
    codes, names = _codes(batch.column("phase"))
    return codes == names.index("decode") if "decode" in names else np.zeros(batch.num_rows, dtype=bool)


def _scan_tokens(path: str | os.PathLike, has_split: bool, expect: Any):
    """Pass 1 of :func:`read_decode_tokens`: the decode tokens' keys (request number << 32 | position,
    requests numbered first seen first), the request and domain names in that numbering, and each
    request's (request, domain, split) combinations."""
    req_ids: dict[str, int] = {}
    dom_ids: dict[str, int] = {}
    keys, combos = [], []
    cols = ["request", "domain", "position", "phase"] + (["split"] if has_split else [])
    for batch in iter_trace_batches(path, cols, batch_rows=READ_BATCH_ROWS, expect=expect):
        dec = _decode_mask(batch)
        if not dec.any():
            continue
        rc, rn = _codes(batch.column("request"))
        dc, dn = _codes(batch.column("domain"))
        req = _global(rn, req_ids)[rc[dec]]
        dom = _global(dn, dom_ids)[dc[dec]]
        if has_split:
            sc, sn = _codes(batch.column("split"))
            spl = np.asarray([s == "heldout" for s in sn], dtype=np.int64).reshape(-1)[sc[dec]]
        else:
            spl = np.zeros(req.size, dtype=np.int64)
        key = (req << 32) | batch.column("position").to_numpy(zero_copy_only=False)[dec].astype(np.int64)
        keys.append(np.unique(key[_runs(key)]))
        at = _runs(req, dom, spl)
        combos.append(np.unique(np.stack([req[at], dom[at], spl[at]], axis=1), axis=0))
    return keys, combos, req_ids, dom_ids


def read_decode_tokens(trace_path: str | os.PathLike, heldout_fraction: float = 0.25,
                       expect: Any = None) -> tuple[DecodeTokens, Any]:
    """The decode tokens of a trace as :class:`DecodeTokens`, and its
    :class:`coldset.core.trace.TraceMeta`: :func:`trace_decode_rows` in a few bytes a selection.

    Read through pyarrow batch by batch (validated) in two passes: the tokens (request, position,
    domain, split), then each selection written into its token's row. ``split`` comes from the
    trace's column or, without one, from :func:`coldset.core.trace.split_of` on the request id. A
    request's decode rows must agree on their domain and split, and a (request, position, layer,
    rank) must occur once (:class:`CacheError` naming it)."""
    meta = read_trace_meta(trace_path, expect)
    has_split = "split" in pq.read_schema(trace_path).names
    L, E, k = meta.num_moe_layers, meta.num_experts, meta.top_k
    keys, combos, req_ids, dom_ids = _scan_tokens(trace_path, has_split, expect)
    names = np.asarray(list(req_ids), dtype=str)
    order = np.argsort(names, kind="stable")
    rank_of = np.empty(order.size, dtype=np.int64)
    rank_of[order] = np.arange(order.size)
    if keys:
        key = np.concatenate(keys)
        key = np.unique((rank_of[key >> 32] << 32) | (key & 0xFFFFFFFF))
    else:
        key = np.zeros(0, dtype=np.int64)
    request = (key >> 32).astype(np.int32)
    position = (key & 0xFFFFFFFF).astype(np.int32)
    combo = np.unique(np.concatenate(combos), axis=0) if combos else np.zeros((0, 3), np.int64)
    dom_of = np.full(order.size, -1, dtype=np.int64)
    split_of_req = np.zeros(order.size, dtype=bool)
    for what, col, out in (("domains", 1, dom_of), ("splits", 2, split_of_req)):
        pairs = np.unique(combo[:, [0, col]], axis=0)
        twice = np.flatnonzero(pairs[1:, 0] == pairs[:-1, 0])
        if twice.size:
            raise CacheError(f"{trace_path}: request {str(names[pairs[twice[0], 0]])!r} has decode rows of two {what}; "
                             "a request's rows share one domain and one split")
        out[rank_of[pairs[:, 0]]] = pairs[:, 1]
    if not has_split:
        split_of_req = np.asarray([split_of(str(n), heldout_fraction) == "heldout" for n in names[order]], dtype=bool)
    experts = np.full((key.size, L, k), -1, dtype=np.int16)
    placed = _place_selections(trace_path, experts, key, req_ids, rank_of, meta, expect)
    filled = sum(int(np.count_nonzero(experts[c:c + TOKEN_CHUNK] >= 0)) for c in range(0, key.size, TOKEN_CHUNK))
    if placed != filled:
        _place_selections(trace_path, np.full_like(experts, -1), key, req_ids, rank_of, meta, expect,
                          names[order], check=True)
    tokens = DecodeTokens(experts, request, position, dom_of[request].astype(np.int32), split_of_req[request],
                          names[order], np.asarray(list(dom_ids), dtype=str), E)
    return tokens, meta


def _place_selections(path, experts: np.ndarray, key: np.ndarray, req_ids: dict[str, int], rank_of: np.ndarray,
                      meta: Any, expect: Any, sorted_names: np.ndarray | None = None, check: bool = False) -> int:
    """Pass 2 of :func:`read_decode_tokens`: each decode selection into ``experts[token, layer,
    rank]``; returns the rows placed. ``check``: raise on the first (request, position, layer, rank)
    seen twice (the slow path, run only when the counts say one exists)."""
    L, k = experts.shape[1:]
    lut = np.full(max(meta.moe_layers) + 1, -1, dtype=np.int64)
    lut[list(meta.moe_layers)] = np.arange(L)
    flat_out = experts.reshape(-1)
    placed = 0
    for batch in iter_trace_batches(path, ["request", "position", "phase", "layer", "rank", "expert"],
                                    batch_rows=READ_BATCH_ROWS, expect=expect):
        dec = _decode_mask(batch)
        if not dec.any():
            continue
        rc, rn = _codes(batch.column("request"))
        req = rank_of[_global(rn, req_ids)][rc[dec]]
        row_key = (req << 32) | batch.column("position").to_numpy(zero_copy_only=False)[dec].astype(np.int64)
        at = _runs(row_key)
        tok = np.repeat(np.searchsorted(key, row_key[at]), np.diff(np.r_[at, row_key.size]))
        li = lut[batch.column("layer").to_numpy(zero_copy_only=False)[dec].astype(np.int64)]
        rank = batch.column("rank").to_numpy(zero_copy_only=False)[dec].astype(np.int64)
        flat = (tok * L + li) * k + rank
        if check:
            seen = np.flatnonzero(flat_out[flat] >= 0)
            srt = np.sort(flat)
            again = srt[1:][srt[1:] == srt[:-1]]
            if seen.size or again.size:
                f = int(flat[seen[0]]) if seen.size else int(again[0])
                t = f // (L * k)
                raise CacheError(f"{path}: request {str(sorted_names[key[t] >> 32])!r} has two rows for position "
                                 f"{int(key[t] & 0xFFFFFFFF)}, MoE layer index {f // k % L}, rank {f % k}")
        flat_out[flat] = batch.column("expert").to_numpy(zero_copy_only=False)[dec]
        placed += int(flat.size)
    return placed


def tokens_from_frame(rows: pd.DataFrame | Mapping[str, Any], num_moe_layers: int, num_experts: int) -> DecodeTokens:
    """:class:`DecodeTokens` of decode rows (columns request, position, layer_index, rank, expert, in
    any order; ``k`` = the largest rank + 1): the forecasters' input from a frame. Optional columns
    ``domain`` and ``split`` give each token its first row's (else domain ``""``, profile). Two rows
    with the same (request, position, layer index, rank) are an error."""
    req_col, pos, li, rank, exp = _frame_columns(rows, "tokens_from_frame")
    L, E = num_moe_layers, num_experts
    if pos.size == 0:
        z = np.zeros(0, np.int32)
        return DecodeTokens(np.zeros((0, L, 1), np.int16), z, z, z, np.zeros(0, bool), np.zeros(0, str),
                            np.asarray([""]), E)
    if li.min() < 0 or li.max() >= L or exp.min() < 0 or exp.max() >= E or pos.min() < 0 or rank.min() < 0:
        raise CacheError(f"rows: layer_index, expert, position or rank outside [0, {L}) x [0, {E}) x [0, ..)")
    rc, names = request_codes(req_col)
    key, first, tok = np.unique((rc << 32) | pos, return_index=True, return_inverse=True)
    tok = tok.reshape(-1)
    k = int(rank.max()) + 1
    flat = (tok * L + li) * k + rank
    srt = np.sort(flat)
    again = srt[1:][srt[1:] == srt[:-1]]
    if again.size:
        f = int(again[0])
        t = f // (L * k)
        raise CacheError(f"rows: request {str(names[key[t] >> 32])!r} has two rows for position "
                         f"{int(key[t] & 0xFFFFFFFF)}, MoE layer index {f // k % L}, rank {f % k}")
    experts = np.full((key.size, L, k), -1, dtype=np.int16)
    experts.reshape(-1)[flat] = exp
    domain, domain_names = np.zeros(key.size, np.int32), np.asarray([""])
    if "domain" in rows:
        cat = pd.Categorical(np.asarray(rows["domain"]).astype(str))
        domain, domain_names = np.asarray(cat.codes)[first].astype(np.int32), np.asarray(cat.categories, dtype=str)
    heldout = ((np.asarray(rows["split"]).astype(str)[first] == "heldout") if "split" in rows
               else np.zeros(key.size, bool))
    return DecodeTokens(experts, (key >> 32).astype(np.int32), (key & 0xFFFFFFFF).astype(np.int32), domain,
                        heldout, names, domain_names, E)
