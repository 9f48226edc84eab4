"""Routing skew statistics: how concentrated expert use is, and how well it transfers.

One streaming pass over a trace (:func:`scan_trace`, row group by row group, memory
proportional to the histogram plus the decode rows of the requests being read) produces

* the histogram: selections per (domain, split, phase, layer, expert), and
* the oracle per-token cache hits per (domain, layer), which need each request's order.

:func:`skew_stats` turns them into the statistics and :func:`run_stats` is the stage: it writes
``histogram.csv``, ``skew.json``, ``coverage.csv`` and the figures.

Definitions (also written into ``skew.json``):

* **Gini** of one layer: over that layer's ``num_experts`` selection counts (zeros included),
  ``G = sum_i sum_j |x_i - x_j| / (2 n^2 mean)``; 0 = uniform, (n-1)/n = one expert takes all.
  ``mean`` is the mean over layers that have selections.
* **top-x% share**: the share of selections taken by the ``ceil(x/100 * num_experts)`` most
  selected experts. ``mean_over_layers`` computes it per layer and averages over layers;
  ``model_wide`` ranks all (layer, expert) pairs together and takes the top
  ``ceil(x/100 * layers * experts)`` pairs.
* **Spearman**: rank correlation (average ranks for ties) of the per-layer expert counts of two
  domains, or of prefill and decode, computed per layer and averaged over the layers where
  both vectors vary (``layers_defined``).
* **oracle cache**: for each (request, MoE layer), a cache of ``slots = 3 * top_k`` experts,
  empty at the first decode step, sees the decode steps in position order. At each step the
  token's top-k experts are needed; each that is already cached is a hit. Missing ones are loaded,
  evicting the cached expert (not needed at this step) whose next use is farthest in the future
  (Belady's rule; never used again = farthest). Hit rate = hits / decode selections. Prefill
  is not simulated.
* **held-out coverage** at x%: per layer, the ``ceil(x/100 * num_experts)`` experts most selected
  in the *profile* split's decode rows of domain A (ties broken by lower expert id) form the hot
  set; coverage is the share of the *heldout* split's decode selections of domain B (all layers
  pooled) that fall in the hot sets. ``(all)`` stands for every domain pooled.

Splits come from the trace's ``split`` column, or from :func:`coldset.core.trace.split_of` on the
request id when the trace has none.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from coldset.core.files import atomic_path

from coldset.core.trace import (
    PHASES,
    SPLITS,
    TraceError,
    TraceMeta,
    iter_trace_batches,
    validate_trace,
    read_trace_meta,
    split_of,
)

DEFAULT_XS = (10, 25, 50, 73)
ALL = "(all)"
#: Decode rows gathered before the oracle cache simulation runs on finished requests.
_ORACLE_CHUNK_ROWS = 1_000_000
#: Rows per batch read by the streaming pass (bounds its working memory).
_SCAN_BATCH_ROWS = 1 << 18


# --------------------------------------------------------------------------------------------
# elementary statistics (plain numpy, tested against hand-computed values)


def gini(counts: np.ndarray) -> float:
    """Gini coefficient of a non-negative vector (NaN when it sums to zero)."""
    x = np.sort(np.asarray(counts, dtype=np.float64))
    n = x.size
    total = x.sum()
    if n == 0 or total <= 0:
        return float("nan")
    i = np.arange(1, n + 1)
    return float(2.0 * np.sum(i * x) / (n * total) - (n + 1.0) / n)


def top_count(x: float, n: int) -> int:
    """How many of ``n`` items make up the top ``x`` percent: ceil(x/100 * n), at least 1."""
    return max(1, math.ceil(x / 100.0 * n - 1e-9))


def top_share(counts: np.ndarray, x: float) -> float:
    """Share of the total taken by the top ``x`` percent of entries (NaN when the total is zero)."""
    c = np.sort(np.asarray(counts, dtype=np.float64).ravel())[::-1]
    total = c.sum()
    if total <= 0:
        return float("nan")
    return float(c[: top_count(x, c.size)].sum() / total)


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks with ties given the mean of the ranks they span."""
    x = np.asarray(x)
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    bounds = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1], True])
    starts, stops = bounds[:-1], bounds[1:]
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = np.repeat((starts + stops + 1) / 2.0, stops - starts)
    return ranks


def _spearman_rows(ranks_a: np.ndarray, ranks_b: np.ndarray) -> np.ndarray:
    """Row-wise Pearson correlation of rank matrices ``[L, E]``; NaN where a row is constant."""
    a = ranks_a - ranks_a.mean(axis=-1, keepdims=True)
    b = ranks_b - ranks_b.mean(axis=-1, keepdims=True)
    den = np.sqrt((a * a).sum(axis=-1) * (b * b).sum(axis=-1))
    num = (a * b).sum(axis=-1)
    return np.divide(num, den, out=np.full(num.shape, np.nan), where=den > 0)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation with average ranks for ties; NaN if either vector is constant."""
    return float(_spearman_rows(average_ranks(a)[None], average_ranks(b)[None])[0])


def lorenz_curve(counts: np.ndarray) -> np.ndarray:
    """Cumulative share of selections held by the least-used experts: values at 0, 1/n, ..., 1."""
    c = np.sort(np.asarray(counts, dtype=np.float64))
    total = c.sum()
    if total <= 0:
        return np.full(c.size + 1, np.nan)
    return np.r_[0.0, np.cumsum(c) / total]


def hot_sets(profile_counts: np.ndarray, x: float) -> np.ndarray:
    """Boolean [layers, experts]: per layer the top ``x`` percent by count, ties to lower id."""
    L, E = profile_counts.shape
    n = top_count(x, E)
    order = np.argsort(-np.asarray(profile_counts), axis=1, kind="stable")  # stable: ties to lower id
    hot = np.zeros((L, E), dtype=bool)
    np.put_along_axis(hot, order[:, :n], True, axis=1)
    return hot


def coverage(profile_counts: np.ndarray, heldout_counts: np.ndarray, x: float) -> float:
    """Share of held-out selections (all layers pooled) inside the per-layer top-x% hot sets
    chosen on the profile counts; NaN when either side has no selections."""
    if profile_counts.sum() <= 0 or heldout_counts.sum() <= 0:
        return float("nan")
    hot = hot_sets(profile_counts, x)
    return float(heldout_counts[hot].sum() / heldout_counts.sum())


# --------------------------------------------------------------------------------------------
# oracle per-token cache


def oracle_cache_hits(steps: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Belady-rule cache simulation for many sequences at once.

    ``steps`` is int ``[S, T, k]``: for sequence s, decode step t, the k selected experts
    (-1 = no selection: padding past a sequence's end). Returns (hits [S], selections [S]).
    See the module docstring for the exact rule. Vectorised over sequences and ranks: one pass
    backwards for next uses, one pass forwards over steps.
    """
    steps = np.asarray(steps)
    S, T, k = steps.shape
    if slots < k:
        raise ValueError(f"a cache of {slots} slots cannot hold one step's {k} experts")
    valid = steps >= 0
    never = T + 1
    n_ids = int(steps.max(initial=0)) + 2  # last column collects the -1 padding
    ids = np.where(valid, steps, n_ids - 1).astype(np.int64)
    rows_sk = np.broadcast_to(np.arange(S)[:, None], (S, k))
    # next_use[s, t, r]: the next step after t whose selections include steps[s, t, r]
    next_use = np.empty((S, T, k), dtype=np.int32)
    upcoming = np.full((S, n_ids), never, dtype=np.int32)
    for t in range(T - 1, -1, -1):
        next_use[:, t] = upcoming[rows_sk, ids[:, t]]
        upcoming[rows_sk, ids[:, t]] = t
    cache_e = np.full((S, slots), -1, dtype=np.int64)
    cache_nu = np.full((S, slots), never + 1, dtype=np.int32)  # empty slots are taken first
    hits = np.zeros(S, dtype=np.int64)
    for t in range(T):
        e_t, v_t = steps[:, t], valid[:, t]
        match = (cache_e[:, None, :] == e_t[:, :, None]) & v_t[:, :, None]  # [S, k, slots]
        hit = match.any(axis=2)
        hits += hit.sum(axis=1)
        protected = np.zeros((S, slots), dtype=bool)
        hs, hr = np.nonzero(hit)
        if hs.size:
            slot = match[hs, hr].argmax(axis=1)
            cache_nu[hs, slot] = next_use[hs, t, hr]
            protected[hs, slot] = True
        miss = v_t & ~hit
        ms, mr = np.nonzero(miss)
        if ms.size:
            # the j-th miss of a sequence takes its j-th most evictable slot: farthest next use
            # among slots not needed at this step (same as evicting one by one)
            cand = np.where(protected, -1, cache_nu)
            order = np.argsort(-cand, axis=1, kind="stable")
            j = (np.cumsum(miss, axis=1) - 1)[ms, mr]
            slot = order[ms, j]
            cache_e[ms, slot] = e_t[ms, mr]
            cache_nu[ms, slot] = next_use[ms, t, mr]
    return hits, valid.sum(axis=(1, 2))


def _oracle_rows(req: np.ndarray, li: np.ndarray, pos: np.ndarray, rank: np.ndarray, expert: np.ndarray,
                 num_moe_layers: int, top_k: int, slots: int, request_names: list[str], where: str):
    """Oracle hits for decode rows of finished requests: returns (request, layer idx, hits, sels)."""
    if req.size == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, z
    seqkey = req.astype(np.int64) * num_moe_layers + li
    # one int64 sort key (sequence, position, rank) instead of a three-key lexsort
    span_pos = int(pos.max()) + 1
    order = np.argsort((seqkey * span_pos + pos) * top_k + rank)
    seqkey, pos, rank, expert = seqkey[order], pos[order], rank[order], expert[order]
    new_seq = np.r_[True, seqkey[1:] != seqkey[:-1]]
    new_step = new_seq | np.r_[True, pos[1:] != pos[:-1]]
    dup = ~new_step & np.r_[False, rank[1:] == rank[:-1]]
    if dup.any():
        i = int(np.flatnonzero(dup)[0])
        raise TraceError(f"{where}: request {request_names[seqkey[i] // num_moe_layers]!r} has two rows for "
                         f"position {int(pos[i])}, MoE layer index {int(seqkey[i] % num_moe_layers)}, rank {int(rank[i])}")
    seq_idx = np.cumsum(new_seq) - 1
    step_global = np.cumsum(new_step) - 1
    step = step_global - step_global[np.flatnonzero(new_seq)][seq_idx]
    n_seq = int(seq_idx[-1]) + 1
    hits = np.zeros(n_seq, dtype=np.int64)
    sels = np.zeros(n_seq, dtype=np.int64)
    steps_per_seq = step[np.r_[np.flatnonzero(new_seq)[1:] - 1, step.size - 1]] + 1
    # Simulate sequences in groups of similar length so padding stays small.
    by_len = np.argsort(steps_per_seq, kind="stable")
    lens_sorted = steps_per_seq[by_len]
    group_cells = 2_000_000
    start = 0
    while start < n_seq:
        # ascending lengths: a group's padded size is (members) x (its last member's length)
        cost = (np.arange(1, n_seq - start + 1)) * lens_sorted[start:] * top_k
        stop = start + max(1, int(np.searchsorted(cost, group_cells, side="right")))
        group = by_len[start:stop]
        t_max = int(steps_per_seq[group].max())
        local = np.full(n_seq, -1, dtype=np.int64)
        local[group] = np.arange(group.size)
        sel = local[seq_idx] >= 0
        grid = np.full((group.size, t_max, top_k), -1, dtype=np.int32)
        grid[local[seq_idx[sel]], step[sel], rank[sel]] = expert[sel]
        h, s = oracle_cache_hits(grid, slots)
        hits[group] = h
        sels[group] = s
        start = stop
    first = np.flatnonzero(new_seq)
    return seqkey[first] // num_moe_layers, seqkey[first] % num_moe_layers, hits, sels


# --------------------------------------------------------------------------------------------
# temporal locality: consecutive-token overlap, its shuffled baseline, reuse distances

#: Reuse-distance buckets in decode tokens (upper bounds, inclusive); past the last: "longer".
REUSE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
LOCALITY_DEFINITIONS = {
    "consecutive_overlap": "per MoE layer, mean over consecutive decode tokens (t-1, t) of one request of "
                           "|experts(t) & experts(t-1)| / top_k; 'mean' = mean over layers",
    "shuffled_overlap": "the same with each request's decode tokens in a random order (numpy default_rng(seed)): "
                        "what the request's expert mix alone gives, without token-to-token continuity",
    "lift": "mean consecutive_overlap / mean shuffled_overlap (1.0 = no temporal structure beyond the mix)",
    "reuse_distance": "per decode selection, tokens since the same (layer, expert) was last selected in the same "
                      "request (buckets: <= bound; 'longer'; 'first' = not selected before in that request); "
                      "shares of all decode selections",
}


def decode_tokens(rows: pd.DataFrame, num_moe_layers: int, top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode rows (request, position, layer_index, rank, expert) as ``sel`` int64 ``[T, L, k]``
    (-1 where a token has no row for that layer and rank), with ``request`` codes (string order)
    and ``position`` per token, tokens sorted by (request, position)."""
    req = rows["request"]
    cat = req.array if isinstance(req.dtype, pd.CategoricalDtype) else pd.Categorical(np.asarray(req).astype(str))
    names = np.asarray(cat.categories).astype(str)
    rank_of = np.empty(names.size, dtype=np.int64)
    rank_of[np.argsort(names, kind="stable")] = np.arange(names.size)
    rc = rank_of[np.asarray(cat.codes, dtype=np.int64)]
    pos = rows["position"].to_numpy(np.int64)
    span = int(pos.max(initial=0)) + 1
    tok_key = rc * span + pos
    keys, tok = np.unique(tok_key, return_inverse=True)
    sel = np.full((keys.size, num_moe_layers, top_k), -1, dtype=np.int64)
    rank = rows["rank"].to_numpy(np.int64)
    if rank.size and (rank.max() >= top_k or rank.min() < 0):
        raise ValueError(f"rank outside [0, {top_k})")
    sel[tok, rows["layer_index"].to_numpy(np.int64), rank] = rows["expert"].to_numpy(np.int64)
    return sel, keys // span, keys % span


def pair_overlap(a: np.ndarray, b: np.ndarray, top_k: int) -> np.ndarray:
    """``[P, L]``: |set(a[p, l]) & set(b[p, l])| / top_k for selections ``[P, L, k]`` (-1 ignored)."""
    out = np.zeros(a.shape[:2], dtype=np.float64)
    step = max(1, 4_000_000 // max(1, a.shape[1] * top_k * top_k))
    for s in range(0, a.shape[0], step):
        x, y = a[s:s + step], b[s:s + step]
        eq = (x[..., :, None] == y[..., None, :]) & (x[..., :, None] >= 0)
        out[s:s + step] = eq.any(axis=-1).sum(axis=-1) / top_k
    return out


def consecutive_overlap(sel: np.ndarray, request: np.ndarray, position: np.ndarray) -> np.ndarray:
    """Per layer, the mean overlap of consecutive decode tokens (position t-1, t) of one request
    (NaN for a layer without such pairs)."""
    pair = (request[1:] == request[:-1]) & (position[1:] == position[:-1] + 1)
    ov = pair_overlap(sel[1:][pair], sel[:-1][pair], sel.shape[2])
    return ov.mean(axis=0) if ov.shape[0] else np.full(sel.shape[1], np.nan)


def shuffled_overlap(sel: np.ndarray, request: np.ndarray, seed: int = 0) -> np.ndarray:
    """Per layer, the mean overlap of neighbours after shuffling each request's tokens
    (``numpy.random.default_rng(seed)``; deterministic for a seed)."""
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.random(request.size), request))
    s, r = sel[order], request[order]
    pair = r[1:] == r[:-1]
    ov = pair_overlap(s[1:][pair], s[:-1][pair], sel.shape[2])
    return ov.mean(axis=0) if ov.shape[0] else np.full(sel.shape[1], np.nan)


def reuse_distances(sel: np.ndarray, request: np.ndarray, position: np.ndarray) -> np.ndarray:
    """Per decode selection (valid entries of ``sel`` in (token, layer, rank) order), tokens
    since the same (layer, expert) was last selected in the same request; 0 = first time."""
    T, L, k = sel.shape
    t_idx, l_idx, _ = np.nonzero(sel >= 0)
    e = sel[sel >= 0]
    inst = l_idx * (int(e.max(initial=0)) + 1) + e
    order = np.lexsort((position[t_idx], inst, request[t_idx]))
    r_o, i_o, p_o = request[t_idx][order], inst[order], position[t_idx][order]
    same = np.r_[False, (r_o[1:] == r_o[:-1]) & (i_o[1:] == i_o[:-1])]
    d = np.where(same, p_o - np.r_[0, p_o[:-1]], 0)
    out = np.empty_like(d)
    out[order] = d
    return out


def reuse_histogram(distances: np.ndarray) -> dict[str, float | None]:
    """Shares of selections per reuse-distance bucket (``REUSE_BUCKETS``, 'longer', 'first')."""
    n = distances.size
    out: dict[str, float | None] = {}
    lo = 1
    for hi in REUSE_BUCKETS:
        out[str(hi) if hi == lo else f"{lo}-{hi}"] = float(((distances >= lo) & (distances <= hi)).sum() / n) if n else None
        lo = hi + 1
    out[f">{REUSE_BUCKETS[-1]}"] = float((distances > REUSE_BUCKETS[-1]).sum() / n) if n else None
    out["first"] = float((distances == 0).sum() / n) if n else None
    return out


def locality_stats(rows: pd.DataFrame, meta: TraceMeta, seed: int = 0) -> dict[str, Any]:
    """The locality statistic of decode rows (``coldset.analysis.cache.trace_decode_rows``'s frame), JSON-ready."""
    sel, req, pos = decode_tokens(rows, meta.num_moe_layers, meta.top_k)
    cons = consecutive_overlap(sel, req, pos)
    shuf = shuffled_overlap(sel, req, seed)
    c, s = _nanmean(cons), _nanmean(shuf)
    return {
        "definitions": LOCALITY_DEFINITIONS,
        "seed": int(seed),
        "tokens": int(sel.shape[0]),
        "requests": int(np.unique(req).size),
        "consecutive_overlap": {"mean": c, "per_layer": _layer_dict(meta, cons)},
        "shuffled_overlap": {"mean": s, "per_layer": _layer_dict(meta, shuf)},
        "lift": (c / s) if (c is not None and s) else None,
        "reuse_distance": reuse_histogram(reuse_distances(sel, req, pos)),
    }


# --------------------------------------------------------------------------------------------
# the streaming pass


@dataclass
class TraceScan:
    """What one pass over a trace yields."""

    meta: TraceMeta
    histogram: pd.DataFrame  # domain, split, phase, layer, expert, count
    oracle: pd.DataFrame | None  # domain, layer, hits, selections (decode)
    rows: int
    requests: int
    cached_prefix_rows_skipped: int
    split_source: str  # "column" or "hash"
    heldout_fraction: float
    counts: np.ndarray | None = None  # int64 [domain, split, phase, moe layer, expert]
    domains: list[str] | None = None  # names of counts' first axis


class _Codes:
    """String -> dense integer codes that stay stable across batches."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.names: list[str] = []

    def encode(self, column: pa.Array) -> np.ndarray:
        if not pa.types.is_dictionary(column.type):
            column = column.dictionary_encode()
        values = column.dictionary.cast(pa.string()).to_pylist()
        codes = np.empty(len(values), dtype=np.int64)
        for i, v in enumerate(values):
            c = self.index.get(v)
            if c is None:
                c = self.index[v] = len(self.names)
                self.names.append(v)
            codes[i] = c
        return codes[column.indices.to_numpy(zero_copy_only=False)]


def _decode_value_codes(column: pa.Array, allowed: Sequence[str]) -> np.ndarray:
    if not pa.types.is_dictionary(column.type):
        column = column.dictionary_encode()
    values = column.dictionary.cast(pa.string()).to_pylist()
    lut = np.array([allowed.index(v) if v in allowed else -1 for v in values], dtype=np.int64)
    return lut[column.indices.to_numpy(zero_copy_only=False)]


def scan_trace(trace_path: str | os.PathLike, heldout_fraction: float = 0.25, *, oracle: bool = True,
               cache_slots: int | None = None, expect: Any = None, progress: bool = True,
               batch_rows: int = _SCAN_BATCH_ROWS) -> TraceScan:
    """One streaming pass: the histogram and (if ``oracle``) the oracle cache hits.

    ``cache_slots`` defaults to 3 * top_k. The oracle needs each request's decode rows in
    order; they are gathered per request and simulated once the request's rows end (requests
    are contiguous in traces written by this package). If a request reappears after others,
    the oracle falls back, with a warning, to a second pass holding all decode rows at once
    (same result, more memory).
    """
    from tqdm import tqdm

    path = Path(trace_path)
    meta = validate_trace(path, expect)  # the one trace validator (rows and whole tokens)
    L, E, k = meta.num_moe_layers, meta.num_experts, meta.top_k
    slots = cache_slots if cache_slots is not None else 3 * k
    lut = np.full(max(meta.moe_layers) + 1, -1, dtype=np.int64)
    lut[meta.moe_layers] = np.arange(L)
    has_split = "split" in pq.read_schema(path).names
    columns = ["request", "domain", "position", "phase", "layer", "rank", "expert"] + (["split"] if has_split else [])
    domains, requests = _Codes(), _Codes()
    req_split: list[int] = []  # hash split per request code (no split column)
    req_domain = np.full(0, -1, dtype=np.int64)
    req_state = np.zeros(0, dtype=np.int8)  # 0 unseen, 1 open, 2 closed
    hist = np.zeros((0, 2, 2, L, E), dtype=np.int64)
    cached = 0
    rows = 0
    streaming = oracle
    buffer: list[tuple[np.ndarray, ...]] = []
    ready: list[tuple[np.ndarray, ...]] = []
    ready_rows = 0
    oracle_parts: list[tuple[np.ndarray, ...]] = []
    total_rows = pq.ParquetFile(path).metadata.num_rows
    bar = tqdm(total=total_rows, desc=f"stats {path.name}", file=sys.stderr, disable=not progress, unit="row",
               unit_scale=True)

    def run_oracle(parts: list[tuple[np.ndarray, ...]]) -> None:
        if not parts:
            return
        cols = [np.concatenate([p[i] for p in parts]) for i in range(5)]
        oracle_parts.append(_oracle_rows(*cols, L, k, slots, requests.names, str(path)))

    for batch in iter_trace_batches(path, columns, validate=False, batch_rows=batch_rows):
        n = batch.num_rows
        rows += n
        dom = domains.encode(batch.column("domain"))
        req = requests.encode(batch.column("request"))
        n_req = len(requests.names)
        if req_domain.size < n_req:
            grow = n_req - req_domain.size
            req_domain = np.r_[req_domain, np.full(grow, -1, dtype=np.int64)]
            req_state = np.r_[req_state, np.zeros(grow, dtype=np.int8)]
        # a request belongs to one domain
        first = req_domain[req] < 0
        req_domain[req[first]] = dom[first]
        if (req_domain[req] != dom).any():
            i = int(np.flatnonzero(req_domain[req] != dom)[0])
            raise TraceError(f"{path}: request {requests.names[req[i]]!r} appears with domains "
                             f"{domains.names[req_domain[req[i]]]!r} and {domains.names[dom[i]]!r}")
        if has_split:
            split = _decode_value_codes(batch.column("split"), SPLITS)
        else:
            while len(req_split) < n_req:
                req_split.append(SPLITS.index(split_of(requests.names[len(req_split)], heldout_fraction)))
            split = np.asarray(req_split, dtype=np.int64)[req]
        phase = _decode_value_codes(batch.column("phase"), PHASES)
        li = lut[batch.column("layer").to_numpy(zero_copy_only=False).astype(np.int64)]
        expert = batch.column("expert").to_numpy(zero_copy_only=False).astype(np.int64)
        keep = expert >= 0
        cached += int(n - keep.sum())
        if len(domains.names) > hist.shape[0]:
            hist = np.concatenate([hist, np.zeros((len(domains.names) - hist.shape[0], 2, 2, L, E), np.int64)])
        key = (((dom * 2 + split) * 2 + phase) * L + li) * E + expert
        hist += np.bincount(key[keep], minlength=hist.size).reshape(hist.shape)
        if streaming:
            present = np.unique(req)
            if (req_state[present] == 2).any():
                again = requests.names[int(present[req_state[present] == 2][0])]
                warnings.warn(f"{path}: request {again!r} reappears after other requests; the oracle cache "
                              "falls back to a second pass that holds all decode rows in memory", stacklevel=2)
                streaming = False
                buffer.clear()
                ready.clear()
                ready_rows = 0
                oracle_parts.clear()
            else:
                dec = keep & (phase == 1)
                buffer.append((req[dec], li[dec], batch.column("position").to_numpy(zero_copy_only=False)[dec].astype(np.int64),
                               batch.column("rank").to_numpy(zero_copy_only=False)[dec].astype(np.int64), expert[dec]))
                was_open = np.flatnonzero(req_state == 1)
                req_state[present] = 1
                closing = np.setdiff1d(was_open, present, assume_unique=True)
                if closing.size:
                    req_state[closing] = 2
                    allc = [np.concatenate([b[i] for b in buffer]) for i in range(5)]
                    m = np.isin(allc[0], closing)
                    ready.append(tuple(c[m] for c in allc))
                    ready_rows += int(m.sum())
                    buffer = [tuple(c[~m] for c in allc)]
                if ready_rows >= _ORACLE_CHUNK_ROWS:
                    run_oracle(ready)
                    ready, ready_rows = [], 0
        bar.update(n)
    bar.close()
    if oracle and streaming:
        run_oracle(ready + buffer)
    elif oracle:
        parts = []
        for batch in iter_trace_batches(path, ["request", "phase", "layer", "position", "rank", "expert"],
                                        validate=False, batch_rows=batch_rows):
            phase = _decode_value_codes(batch.column("phase"), PHASES)
            expert = batch.column("expert").to_numpy(zero_copy_only=False).astype(np.int64)
            dec = (phase == 1) & (expert >= 0)
            req = requests.encode(batch.column("request"))
            li = lut[batch.column("layer").to_numpy(zero_copy_only=False).astype(np.int64)]
            parts.append((req[dec], li[dec], batch.column("position").to_numpy(zero_copy_only=False)[dec].astype(np.int64),
                          batch.column("rank").to_numpy(zero_copy_only=False)[dec].astype(np.int64), expert[dec]))
        run_oracle(parts)

    histogram = _histogram_frame(hist, domains.names, meta)
    oracle_df = None
    if oracle:
        if oracle_parts:
            r, l, h, s = (np.concatenate([p[i] for p in oracle_parts]) for i in range(4))
        else:
            r = l = h = s = np.zeros(0, dtype=np.int64)
        d = req_domain[r]
        nd = len(domains.names)
        hits = np.bincount(d * L + l, weights=h, minlength=nd * L).reshape(nd, L)
        sels = np.bincount(d * L + l, weights=s, minlength=nd * L).reshape(nd, L)
        oracle_df = pd.DataFrame({
            "domain": np.repeat(domains.names, L),
            "layer": np.tile(np.asarray(meta.moe_layers), nd),
            "hits": hits.ravel().astype(np.int64),
            "selections": sels.ravel().astype(np.int64),
        })
    return TraceScan(meta, histogram, oracle_df, rows, len(requests.names), cached,
                     "column" if has_split else "hash", heldout_fraction, hist, list(domains.names))


def _histogram_frame(hist: np.ndarray, domain_names: list[str], meta: TraceMeta) -> pd.DataFrame:
    D, _, _, L, E = hist.shape
    idx = np.indices(hist.shape).reshape(5, -1)
    return pd.DataFrame({
        "domain": np.asarray(domain_names, dtype=object)[idx[0]] if D else np.zeros(0, dtype=object),
        "split": np.asarray(SPLITS, dtype=object)[idx[1]],
        "phase": np.asarray(PHASES, dtype=object)[idx[2]],
        "layer": np.asarray(meta.moe_layers, dtype=np.int64)[idx[3]],
        "expert": idx[4].astype(np.int64),
        "count": hist.ravel(),
    })


def histogram_from_trace(trace_path: str | os.PathLike, heldout_fraction: float = 0.25, *,
                         expect: Any = None, progress: bool = True) -> pd.DataFrame:
    """Selections per (domain, split, phase, layer, expert), zeros included, streaming the trace.

    Columns ``domain, split, phase, layer, expert, count``; ``layer`` is the model's layer index.
    """
    return scan_trace(trace_path, heldout_fraction, oracle=False, expect=expect, progress=progress).histogram


# --------------------------------------------------------------------------------------------
# statistics from the histogram


class _Hist:
    """Dense view of a histogram frame: counts[domain, split, phase, moe_layer_idx, expert]."""

    def __init__(self, counts: np.ndarray, domains: Sequence[str], meta: TraceMeta):
        self.meta = meta
        self.domains = list(domains)
        self.counts = counts
        self._all = counts.sum(axis=0)

    @classmethod
    def from_frame(cls, histogram: pd.DataFrame, meta: TraceMeta) -> "_Hist":
        missing = [c for c in ("domain", "split", "phase", "layer", "expert", "count") if c not in histogram.columns]
        if missing:
            raise ValueError(f"histogram lacks column(s) {missing}")
        L, E = meta.num_moe_layers, meta.num_experts
        domains = sorted(histogram["domain"].astype(str).unique().tolist())
        lut = np.full(max(meta.moe_layers) + 1, -1, dtype=np.int64)
        lut[meta.moe_layers] = np.arange(L)
        d = pd.Categorical(histogram["domain"].astype(str), categories=domains).codes.astype(np.int64)
        sp = pd.Categorical(histogram["split"], categories=list(SPLITS)).codes.astype(np.int64)
        ph = pd.Categorical(histogram["phase"], categories=list(PHASES)).codes.astype(np.int64)
        layer = histogram["layer"].to_numpy().astype(np.int64)
        e = histogram["expert"].to_numpy().astype(np.int64)
        for name, arr in (("split", sp), ("phase", ph)):
            if (arr < 0).any():
                raise ValueError(f"histogram column {name!r} holds a value outside {SPLITS if name == 'split' else PHASES}")
        if ((layer < 0) | (layer >= lut.size)).any() or (lut[np.clip(layer, 0, lut.size - 1)] < 0).any():
            raise ValueError(f"histogram column 'layer' holds a layer outside the MoE layers {meta.moe_layers}")
        if ((e < 0) | (e >= E)).any():
            raise ValueError(f"histogram column 'expert' holds ids outside 0..{E - 1}")
        shape = (len(domains), 2, 2, L, E)
        flat = np.ravel_multi_index((d, sp, ph, lut[layer], e), shape)
        counts = np.bincount(flat, weights=histogram["count"].to_numpy().astype(np.float64),
                             minlength=int(np.prod(shape))).reshape(shape)
        return cls(np.rint(counts).astype(np.int64), domains, meta)

    def get(self, phase: str, domain: str = ALL, split: str | None = None) -> np.ndarray:
        c = self._all if domain == ALL else self.counts[self.domains.index(domain)]
        c = c.sum(axis=0) if split is None else c[SPLITS.index(split)]
        return c[PHASES.index(phase)]


def _layer_dict(meta: TraceMeta, values: Sequence[float]) -> dict[str, float | None]:
    return {str(layer): _num(v) for layer, v in zip(meta.moe_layers, values)}


def _num(v: float) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def _nanmean(values: Sequence[float]) -> float | None:
    arr = np.asarray(values, dtype=np.float64)
    arr = arr[~np.isnan(arr)]
    return float(arr.mean()) if arr.size else None


def _rank_rows(counts: np.ndarray) -> np.ndarray:
    return np.stack([average_ranks(row) for row in counts])


def _spearman_layers(ranks_a: np.ndarray, ranks_b: np.ndarray, meta: TraceMeta) -> dict[str, Any]:
    per = _spearman_rows(ranks_a, ranks_b)
    return {"mean": _nanmean(per), "layers_defined": int(np.sum(~np.isnan(per))), "per_layer": _layer_dict(meta, per)}


#: Pairwise tables (Spearman between domains, held-out coverage profile x held-out domain) grow
#: with the square of the domains: 300 domains once took 27 s, 1 GB and a 72 MB skew.json. They
#: keep the most selected domains only (stats.max_pairwise_domains in the config).
MAX_PAIRWISE_DOMAINS = 12


def pairwise_domains(h: "_Hist", max_domains: int = MAX_PAIRWISE_DOMAINS) -> list[str]:
    """The domains pairwise tables cover: the ``max_domains`` with the most selections (both
    phases; ties by name), in the histogram's order."""
    if len(h.domains) <= max_domains:
        return list(h.domains)
    totals = [(-int(h.counts[i].sum()), d) for i, d in enumerate(h.domains)]
    keep = {d for _, d in sorted(totals)[:max_domains]}
    return [d for d in h.domains if d in keep]


def coverage_table(histogram: pd.DataFrame, meta: TraceMeta, xs: Sequence[float] = DEFAULT_XS,
                   max_domains: int = MAX_PAIRWISE_DOMAINS) -> pd.DataFrame:
    """Held-out coverage for every (x, profile domain, heldout domain), ``(all)`` included, over
    the :func:`pairwise_domains` (the ``max_domains`` most selected).

    Columns: x, profile_domain, heldout_domain, coverage, cold_share (= 1 - coverage),
    profile_selections, heldout_selections (decode rows only).
    """
    h = histogram if isinstance(histogram, _Hist) else _Hist.from_frame(histogram, meta)
    names = pairwise_domains(h, max_domains) + [ALL]
    L, E = meta.num_moe_layers, meta.num_experts
    held = np.stack([h.get("decode", b, "heldout") for b in names]).astype(np.float64)  # [D+1, L, E]
    held_total = held.sum(axis=(1, 2))
    n_top = {x: top_count(x, E) for x in xs}
    rows = {x: [] for x in xs}
    for a in names:
        prof = h.get("decode", a, "profile")
        # hot set for x = the first top_count(x, E) experts of this order (ties to lower id)
        order = np.argsort(-prof, axis=1, kind="stable")
        cum = np.cumsum(held[:, np.arange(L)[:, None], order], axis=2).sum(axis=1)  # [D+1, E]
        for x in xs:
            if prof.sum() > 0:
                cov = np.divide(cum[:, n_top[x] - 1], held_total, out=np.full(len(names), np.nan),
                                where=held_total > 0)
            else:
                cov = np.full(len(names), np.nan)
            for b, value, total in zip(names, cov, held_total):
                rows[x].append({"x": x, "profile_domain": a, "heldout_domain": b, "coverage": float(value),
                                "cold_share": 1.0 - float(value), "profile_selections": int(prof.sum()),
                                "heldout_selections": int(total)})
    out = [r for x in xs for r in rows[x]]
    return pd.DataFrame(out, columns=["x", "profile_domain", "heldout_domain", "coverage", "cold_share",
                                      "profile_selections", "heldout_selections"])


DEFINITIONS = {
    "gini": "per layer over the num_experts selection counts (zeros included); mean = over layers with selections",
    "top_share": "share of selections taken by the ceil(x% * num_experts) most selected experts: mean_over_layers "
                 "= per layer then averaged; model_wide = top ceil(x% * layers * experts) (layer, expert) pairs",
    "spearman": "rank correlation (average ranks for ties) of per-layer expert counts, per layer then averaged "
                "over layers where both vectors vary",
    "oracle_cache": "per (request, MoE layer) cache of slots experts, empty at the first decode step; at each "
                    "decode step the token's top_k experts are needed, cached ones are hits, missing ones are "
                    "loaded evicting the cached expert not needed now whose next use is farthest (Belady); "
                    "hit_rate = hits / decode selections",
    "coverage": "per layer the top ceil(x% * num_experts) experts of the profile split's decode counts "
                "(ties to lower id) form the hot set; coverage = share of the heldout split's decode "
                "selections, all layers pooled, inside the hot sets",
    "splits": "skew statistics pool both splits; coverage uses profile vs heldout",
    "all": f"{ALL!r} = all domains pooled",
    "pairwise_domains": "spearman_between_domains and coverage cover these domains only: the most selected "
                        "ones, at most stats.max_pairwise_domains (pairwise tables grow with the square of "
                        "the domains); per-domain statistics cover every domain",
}


def skew_stats(histogram: pd.DataFrame, meta: TraceMeta, oracle: pd.DataFrame | None = None, *,
               xs: Sequence[float] = DEFAULT_XS, cache_slots: int | None = None,
               max_pairwise_domains: int = MAX_PAIRWISE_DOMAINS) -> dict[str, Any]:
    """Skew statistics per phase and per domain (plus ``(all)``), JSON-ready (NaN -> null).

    ``oracle`` is :attr:`TraceScan.oracle` (decode hits per domain and layer); without it the
    oracle cache entry is omitted. Definitions are in the module docstring and in the result's
    ``definitions``.
    """
    h = _Hist.from_frame(histogram, meta)
    return _skew_stats(h, meta, oracle, xs, cache_slots, coverage_table(h, meta, xs, max_pairwise_domains),
                       max_pairwise_domains)


def _skew_stats(h: "_Hist", meta: TraceMeta, oracle: pd.DataFrame | None, xs: Sequence[float],
                cache_slots: int | None, cov: pd.DataFrame,
                max_pairwise_domains: int = MAX_PAIRWISE_DOMAINS) -> dict[str, Any]:
    names = h.domains + [ALL]
    pairwise = pairwise_domains(h, max_pairwise_domains)
    result: dict[str, Any] = {"definitions": DEFINITIONS, "xs": list(xs), "phases": {},
                              "pairwise_domains": pairwise}
    for phase in PHASES:
        per_domain = {}
        for name in names:
            c = h.get(phase, name)
            g = [gini(row) for row in c]
            entry: dict[str, Any] = {
                "selections": int(c.sum()),
                "gini": {"mean": _nanmean(g), "per_layer": _layer_dict(meta, g)},
                "top_share": {},
            }
            for x in xs:
                per = [top_share(row, x) for row in c]
                entry["top_share"][str(x)] = {
                    "mean_over_layers": _nanmean(per),
                    "model_wide": _num(top_share(c, x)),
                    "per_layer": _layer_dict(meta, per),
                }
            if phase == "decode" and oracle is not None:
                od = oracle if name == ALL else oracle[oracle["domain"] == name]
                by_layer = od.groupby("layer")[["hits", "selections"]].sum()
                hits, sels = int(by_layer["hits"].sum()), int(by_layer["selections"].sum())
                entry["oracle_cache"] = {
                    "slots_per_layer": int(cache_slots if cache_slots is not None else 3 * meta.top_k),
                    "hits": hits,
                    "selections": sels,
                    "hit_rate": hits / sels if sels else None,
                    "per_layer": {str(int(layer)): (_num(r.hits / r.selections) if r.selections else None)
                                  for layer, r in by_layer.iterrows()},
                }
            per_domain[name] = entry
        ranks = {name: _rank_rows(h.get(phase, name)) for name in pairwise}
        pairs = []
        for i, a in enumerate(pairwise):
            for b in pairwise[i + 1:]:
                pairs.append({"a": a, "b": b, **_spearman_layers(ranks[a], ranks[b], meta)})
        result["phases"][phase] = {"domains": per_domain, "spearman_between_domains": pairs}
    result["spearman_prefill_vs_decode"] = {
        name: _spearman_layers(_rank_rows(h.get("prefill", name)), _rank_rows(h.get("decode", name)), meta)
        for name in names
    }
    result["coverage"] = {
        str(x): {a: {b: _num(v) for b, v in zip(g["heldout_domain"], g["coverage"])}
                 for a, g in sub.groupby("profile_domain", sort=False)}
        for x, sub in cov.groupby("x", sort=False)
    }
    return result


# --------------------------------------------------------------------------------------------
# figures


def _figure_heatmaps(h: _Hist, meta: TraceMeta, phase: str, path: Path, max_panels: int = 6) -> None:
    """Layer x expert (raw ids) heatmap per domain: selections relative to uniform, log colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    ranked = sorted(h.domains, key=lambda d: -int(h.get(phase, d).sum()))[:max_panels]
    panels = [ALL] + ranked
    L, E = meta.num_moe_layers, meta.num_experts
    fig, axes = plt.subplots(1, len(panels), figsize=(min(4 + 3.2 * len(panels), 26), 1.5 + 0.18 * L + 1.5),
                             squeeze=False)
    im = None
    for ax, name in zip(axes[0], panels):
        c = h.get(phase, name).astype(np.float64)
        tot = c.sum(axis=1, keepdims=True)
        rel = np.where(tot > 0, c * E / np.where(tot > 0, tot, 1), np.nan)
        im = ax.imshow(np.where(rel > 0, rel, 1e-2), aspect="auto", interpolation="nearest", cmap="magma",
                       norm=LogNorm(vmin=1e-2, vmax=max(10.0, float(np.nanmax(rel)) if np.isfinite(rel).any() else 10.0)))
        ax.set_title(f"{name} ({int(c.sum()):,})", fontsize=9)
        ax.set_xlabel("expert id")
        ticks = np.linspace(0, L - 1, min(L, 8)).round().astype(int)
        ax.set_yticks(ticks, [str(meta.moe_layers[t]) for t in ticks])
    axes[0][0].set_ylabel("layer")
    fig.colorbar(im, ax=axes[0].tolist(), label="selections / uniform share")
    fig.suptitle(f"{meta.model}: {phase} selections per layer and expert (raw ids)", fontsize=10)
    _save(fig, path)


def _figure_lorenz(h: _Hist, meta: TraceMeta, phase: str, path: Path, max_lines: int = 12) -> None:
    """Lorenz curves (mean over layers of the per-layer curve) per domain, with mean Gini."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    E = meta.num_experts
    fig, ax = plt.subplots(figsize=(5.5, 5))
    frac = np.arange(E + 1) / E
    ax.plot(frac, frac, color="grey", lw=0.8, ls="--", label="uniform")
    ranked = sorted(h.domains, key=lambda d: -int(h.get(phase, d).sum()))[:max_lines]
    for name in [ALL] + ranked:
        c = h.get(phase, name)
        curves = np.array([lorenz_curve(row) for row in c if row.sum() > 0])
        if not len(curves):
            continue
        g = _nanmean([gini(row) for row in c])
        ax.plot(frac, curves.mean(axis=0), lw=2.0 if name == ALL else 1.2, label=f"{name} (Gini {g:.3f})")
    ax.set_xlabel("share of experts (least used first)")
    ax.set_ylabel("share of selections")
    ax.set_title(f"{meta.model}: {phase} Lorenz curves (mean over layers)", fontsize=10)
    ax.legend(fontsize=7)
    _save(fig, path)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------------------------
# the stage


def _write_csv(df: pd.DataFrame, path: str) -> None:
    """CSV through pyarrow (several times faster than pandas for million-row histograms)."""
    import pyarrow.csv as pcsv

    pcsv.write_csv(pa.Table.from_pandas(df, preserve_index=False), path,
                   write_options=pcsv.WriteOptions(quoting_style="needed"))


def _write_atomic(path: Path, write) -> None:
    with atomic_path(path) as tmp:
        write(tmp)


def run_stats(trace_path: str | os.PathLike, out_dir: str | os.PathLike, *, heldout_fraction: float = 0.25,
              xs: Sequence[float] = DEFAULT_XS, cache_slots_factor: int = 3, expect: Any = None,
              figures: bool = True, progress: bool = True, locality_seed: int = 0,
              max_pairwise_domains: int = MAX_PAIRWISE_DOMAINS) -> dict[str, Path]:
    """The ``stats`` stage: one pass over the trace, then every output into ``out_dir``.

    Writes ``histogram.csv`` (domain, split, phase, layer, expert, count; zeros included),
    ``skew.json`` (:func:`skew_stats` plus the trace summary), ``coverage.csv``
    (:func:`coverage_table`), ``locality.json`` (:func:`locality_stats` over every decode row, held
    in memory: about 60 bytes a row; shuffled baseline from ``locality_seed``) and, with ``figures``, ``heatmap_{phase}.png`` (raw expert ids, one
    panel per domain) and ``lorenz_{phase}.png``. ``expect`` (ModelConfig-like) makes a trace
    recorded for another model shape an error. Returns the paths by name.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = read_trace_meta(trace_path, expect)
    slots = cache_slots_factor * meta.top_k
    scan = scan_trace(trace_path, heldout_fraction, oracle=True, cache_slots=slots, progress=progress)
    order = np.argsort(scan.domains, kind="stable")  # domains sorted by name, as from a frame
    h = _Hist(scan.counts[order], [scan.domains[i] for i in order], meta)
    cov = coverage_table(h, meta, xs, max_pairwise_domains)
    stats = _skew_stats(h, meta, scan.oracle, xs, slots, cov, max_pairwise_domains)
    stats["trace"] = {
        "path": str(trace_path),
        "model": meta.model,
        "num_layers": meta.num_layers,
        "num_experts": meta.num_experts,
        "top_k": meta.top_k,
        "moe_layers": meta.moe_layers,
        "source": meta.source,
        "rows": scan.rows,
        "requests": scan.requests,
        "cached_prefix_rows_skipped": scan.cached_prefix_rows_skipped,
        "cached_prefix_tokens_skipped_at_import": int(meta.extra.get("cached_prefix_tokens_skipped", 0)),
        "split_source": scan.split_source,
        "heldout_fraction": heldout_fraction if scan.split_source == "hash" else None,
    }
    from coldset.analysis.streams import trace_decode_rows

    locality = locality_stats(trace_decode_rows(trace_path, heldout_fraction)[0], meta, locality_seed)
    paths = {"histogram": out / "histogram.csv", "skew": out / "skew.json", "coverage": out / "coverage.csv",
             "locality": out / "locality.json"}
    _write_atomic(paths["locality"], lambda p: Path(p).write_text(json.dumps(locality, indent=1, allow_nan=False)))
    _write_atomic(paths["histogram"], lambda p: _write_csv(scan.histogram, p))
    _write_atomic(paths["skew"], lambda p: Path(p).write_text(json.dumps(stats, indent=1, allow_nan=False)))
    _write_atomic(paths["coverage"], lambda p: cov.to_csv(p, index=False))
    if figures:
        for phase in PHASES:
            paths[f"heatmap_{phase}"] = out / f"heatmap_{phase}.png"
            _figure_heatmaps(h, meta, phase, paths[f"heatmap_{phase}"])
            paths[f"lorenz_{phase}"] = out / f"lorenz_{phase}.png"
            _figure_lorenz(h, meta, phase, paths[f"lorenz_{phase}"])
    return paths
