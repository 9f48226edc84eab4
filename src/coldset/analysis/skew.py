"""Routing skew statistics on selection counts: how concentrated expert use is, and how well it
transfers (plain numpy, tested against hand-computed values), and the oracle per-token cache.

Definitions (also written into ``skew.json`` by :func:`coldset.analysis.stats.skew_stats`):

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from coldset.core.trace import TraceError, TraceMeta

#: The domain name that stands for every domain pooled.
ALL = "(all)"


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


def spearman_rows(ranks_a: np.ndarray, ranks_b: np.ndarray) -> np.ndarray:
    """Row-wise Pearson correlation of rank matrices ``[L, E]``; NaN where a row is constant."""
    a = ranks_a - ranks_a.mean(axis=-1, keepdims=True)
    b = ranks_b - ranks_b.mean(axis=-1, keepdims=True)
    den = np.sqrt((a * a).sum(axis=-1) * (b * b).sum(axis=-1))
    num = (a * b).sum(axis=-1)
    return np.divide(num, den, out=np.full(num.shape, np.nan), where=den > 0)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation with average ranks for ties; NaN if either vector is constant."""
    return float(spearman_rows(average_ranks(a)[None], average_ranks(b)[None])[0])


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


def oracle_rows(req: np.ndarray, li: np.ndarray, pos: np.ndarray, rank: np.ndarray, expert: np.ndarray,
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
                         f"position {int(pos[i])}, MoE layer index {int(seqkey[i] % num_moe_layers)}, "
                         f"rank {int(rank[i])}")
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


def layer_dict(meta: TraceMeta, values: Sequence[float]) -> dict[str, float | None]:
    """``{model layer index: value}`` for per-MoE-layer values, NaN as None (JSON-ready)."""
    return {str(layer): json_number(v) for layer, v in zip(meta.moe_layers, values)}


def json_number(v: float) -> float | None:
    """``v`` as a float, NaN or None as None."""
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def nanmean(values: Sequence[float]) -> float | None:
    """The mean of the values that are not NaN (None if none)."""
    arr = np.asarray(values, dtype=np.float64)
    arr = arr[~np.isnan(arr)]
    return float(arr.mean()) if arr.size else None
