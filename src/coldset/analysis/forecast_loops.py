"""The forecasters' loops over every token of a trace, compiled by numba where it is installed
(:mod:`coldset.analysis.compiled`; plain Python with the same results otherwise).

Why: counting transitions, ranking a transition table's scores and stepping the next-token
forecast touch every (token, layer, selection) of a trace; as numpy they expand ``k x k`` pairs
or ``E`` scores per selection into arrays, as loops they keep a few counters. Each loop is the
reference form of a computation :mod:`coldset.analysis.forecast` documents: the transition counts
of :func:`coldset.analysis.forecast.transition_counts`, the top-n of
:meth:`coldset.analysis.forecast.TransitionForecaster.predict`, the forecast of
:meth:`coldset.analysis.forecast.NextTokenForecaster.forecast_lanes` and the hit counts of
:func:`coldset.analysis.forecast.forecast_quality`.
"""

from __future__ import annotations

import numpy as np

from coldset.analysis.compiled import jit


@jit
def _seen_before(row, a):
    """Whether ``row[a]`` occurs in ``row[:a]`` (a set's member counted once)."""
    for r in range(a):
        if row[r] == row[a]:
            return True
    return False


@jit
def count_transitions(tokens, src_tokens, tgt_tokens, src_layers, tgt_layers, layers, pairs, sources, targets):
    """Add to ``pairs [L, E, E]``, ``sources [L, E]``, ``targets [L, E]`` (int64): for each pair ``i``
    and layer column ``j``, every expert ``e`` of ``tokens[src_tokens[i], src_layers[j]]`` followed
    by every ``e'`` of ``tokens[tgt_tokens[i], tgt_layers[j]]``, in table layer ``tgt_layers[j]``,
    or ``layers[i]`` where ``layers`` is not empty."""
    k = tokens.shape[2]
    for j in range(src_layers.size):  # layer by layer: one layer's table stays in cache
        for i in range(src_tokens.size):
            s, t = src_tokens[i], tgt_tokens[i]
            lay = layers[i] if layers.size else tgt_layers[j]
            for a in range(k):
                e = tokens[s, src_layers[j], a]
                sources[lay, e] += 1
                for b in range(k):
                    pairs[lay, e, tokens[t, tgt_layers[j], b]] += 1
            for b in range(k):
                targets[lay, tokens[t, tgt_layers[j], b]] += 1


@jit
def top_scores(table, layer, experts, boost, n, out):
    """``out[i]`` = the ``n`` experts of highest score, ties to the lower id, where the score of
    ``e'`` is the float32 sum of ``table[layer[i], e, e']`` over ``e`` in ``experts[i]`` (in rank
    order) plus ``boost`` for the experts of ``experts[i]``."""
    E = table.shape[2]
    k = experts.shape[1]
    score = np.zeros(E, dtype=np.float32)
    best_v = np.empty(n, dtype=np.float32)
    best_e = np.empty(n, dtype=np.int64)
    for i in range(layer.size):
        for e in range(E):
            score[e] = table[layer[i], experts[i, 0], e]
        for a in range(1, k):
            for e in range(E):
                score[e] += table[layer[i], experts[i, a], e]
        for a in range(k):
            if not _seen_before(experts[i], a):
                score[experts[i, a]] = score[experts[i, a]] + np.float32(boost)
        m = 0
        for e in range(E):
            v = score[e]
            if m == n and not v > best_v[n - 1]:
                continue
            p = m if m < n else n - 1
            while p > 0 and v > best_v[p - 1]:
                if p < n:
                    best_v[p] = best_v[p - 1]
                    best_e[p] = best_e[p - 1]
                p -= 1
            best_v[p] = v
            best_e[p] = e
            if m < n:
                m += 1
        for p in range(n):
            out[i, p] = best_e[p]


@jit
def forecast_segments(sel, lane, first, length, tables, term_a, term_d, units, shifts, n, out, horizon, widths,
                      hits):
    """The next-token forecast of lane segments: segment ``i`` is lane ``lane[i]`` of ``sel``
    ``[S, L, B, k]`` (-1: idle) from step ``first[i]`` (state empty there) for ``length[i]`` steps.
    After each active (step, layer), for each variant ``v`` (``units[v]``, ``shifts[v]``) the ``n``
    experts of highest ``(H + score) * E + (E - 1 - e)``; written to ``out [V, S, L, B, n]``
    where ``out`` is not empty, and where ``horizon > 0`` counted against the lane's selections
    ``horizon`` steps later in the segment (when active): ``hits[v, w, 0]`` += the target
    selections inside the first ``widths[w]``, ``hits[v, w, 1]`` += those first ``widths[w]``
    the target selects."""
    S, L, B, k = sel.shape
    E = tables.shape[2]
    V = units.size
    J = term_a.size
    keep = out.size > 0
    H = np.zeros((V, L, E), dtype=np.int64)
    score = np.zeros(E, dtype=np.int64)
    keys = np.empty(E, dtype=np.int64)
    best_k = np.empty(n, dtype=np.int64)
    best_e = np.empty(n, dtype=np.int64)
    cur = np.empty(k, dtype=np.int64)
    stamp = np.full(E, -1, dtype=np.int64)
    rank = np.zeros(E, dtype=np.int64)
    tick = -1
    for i in range(lane.size):
        b = lane[i]
        H[:] = 0
        for p in range(length[i]):
            s = first[i] + p
            if sel[s, 0, b, 0] < 0:
                continue
            for l in range(L):
                score[:] = 0
                for j in range(J):
                    a, d = term_a[j], term_d[j]
                    if p < a or l - d < 0 or l - d >= L:
                        continue
                    for r in range(k):
                        e0 = sel[s - a, l - d, b, r]
                        if e0 >= 0:
                            row = tables[j, l, e0]
                            for e in range(E):
                                score[e] += row[e]
                ncur = 0  # the current token's distinct experts (a set: H counts each once)
                for r in range(k):
                    if not _seen_before(sel[s, l, b], r):
                        cur[ncur] = sel[s, l, b, r]
                        ncur += 1
                for v in range(V):
                    h = H[v, l]
                    sh = shifts[v]
                    for e in range(E):
                        h[e] -= h[e] >> sh
                    for r in range(ncur):
                        h[cur[r]] += units[v]
                    for e in range(E):
                        keys[e] = (h[e] + score[e]) * E + (E - 1 - e)
                    m = 0
                    for e in range(E):
                        key = keys[e]
                        if m == n and key <= best_k[n - 1]:
                            continue
                        q = m if m < n else n - 1
                        while q > 0 and key > best_k[q - 1]:
                            if q < n:
                                best_k[q] = best_k[q - 1]
                            q -= 1
                        best_k[q] = key
                        if m < n:
                            m += 1
                    for q in range(n):
                        best_e[q] = E - 1 - best_k[q] % E
                    if keep:
                        for q in range(n):
                            out[v, s, l, b, q] = best_e[q]
                    if horizon > 0 and p + horizon < length[i] and sel[s + horizon, 0, b, 0] >= 0:
                        tgt = sel[s + horizon, l, b]
                        tick += 1  # rank[e]: e's place in this forecast, where stamp[e] == tick
                        for q in range(n):
                            stamp[best_e[q]] = tick
                            rank[best_e[q]] = q
                        for r in range(k):
                            x = tgt[r]
                            if x < 0 or stamp[x] != tick:
                                continue
                            first_time = not _seen_before(tgt, r)  # the forecast's experts are distinct
                            for w in range(widths.size):
                                if rank[x] < widths[w]:
                                    hits[v, w, 0] += 1
                                    hits[v, w, 1] += first_time


@jit
def group_predictions(table, ids, ptr, k, num_experts, boost, n, out):
    """``out[g]`` (-1 filled): for group ``g`` of an access stream (``ids[ptr[g]:ptr[g + 1]]``,
    tokens of ``k`` selections of one MoE layer), each token's :func:`top_scores` forecast in token
    then score order as instance ids, each instance's first occurrence kept."""
    E = num_experts
    stamp = np.full(E, -1, dtype=np.int64)
    one = np.empty((1, n), dtype=np.int64)
    lay = np.zeros(1, dtype=np.int64)
    cur = np.empty((1, k), dtype=np.int64)
    for g in range(ptr.size - 1):
        lay[0] = ids[ptr[g]] // E
        w = 0
        for t0 in range(ptr[g], ptr[g + 1], k):
            for a in range(k):
                cur[0, a] = ids[t0 + a] % E
            top_scores(table, lay, cur, boost, n, one)
            for q in range(n):
                e = one[0, q]
                if stamp[e] != g:
                    stamp[e] = g
                    out[g, w] = lay[0] * E + e
                    w += 1


@jit
def round_robin_lists(lists, num_experts, out):
    """``out[s * L + l]`` (-1 filled): the lanes' forecasts ``lists [S, L, B, n]`` (-1: idle) of
    (step ``s``, layer ``l``) round robin over rank then lane, as instance ids ``l * E + e``, each
    instance's first occurrence kept."""
    S, L, B, n = lists.shape
    E = num_experts
    stamp = np.full(E, -1, dtype=np.int64)
    for s in range(S):
        for l in range(L):
            g = s * L + l
            w = 0
            for q in range(n):
                for b in range(B):
                    e = lists[s, l, b, q]
                    if e >= 0 and stamp[e] != g:
                        stamp[e] = g
                        out[g, w] = l * E + e
                        w += 1
