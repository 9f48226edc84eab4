"""Forecast the next decode token's experts in every MoE layer from the current token's.

Why: one layer of compute hides about one expert transfer over PCIe, so a cache that waits for the
router of the layer that needs an expert fetches too late; a prefetch must know, while token
``t`` computes, which experts token ``t + 1`` will select in every layer. Consecutive tokens of a
request reuse experts (the locality statistic of :mod:`coldset.analysis.stats`), and which experts follow
which is a property of the model and its traffic that a profile can measure.

The forecaster: per MoE layer ``l`` a transition table ``T[l, e, e']``, the probability that a
token selects ``e'`` in layer ``l`` given that the previous token of the same request selected
``e`` there, fitted on the profile split's consecutive decode tokens with additive smoothing
towards the layer's next-token popularity::

    T[l, e, e'] = (pairs[l, e, e'] + alpha * popularity[l, e']) / (occurrences[l, e] + alpha)

The score of ``e'`` for the next token is the sum of ``T[l, e, e']`` over the current token's
selections ``e`` (so an expert the current token selected, which consecutive tokens tend to keep,
scores high through the table's diagonal, and an unseen expert falls back to popularity); the
forecast is the ``top_k + extra`` experts by score, ties by expert id (SeqMoE's "top k + 3").

Cost: the table is ``L x E x E`` float32 (3.1 MB at Qwen3-30B-A3B's 48 x 128 experts); a forecast
is a gather of ``k`` rows of ``E`` scores, a sum and a top-n per layer.

:func:`forecast_recall` measures it the way SeqMoE reports it: the share of the next token's
selections (per layer) that the forecast made from the current token contains, beside the
previous-token baseline (the forecast "the next token selects what this one did").
:func:`stream_predictions` turns it into the per-group prefetch lists that the ``forecast``
policy of :func:`coldset.analysis.simulate.simulate` replays.

The next-layer lookahead (pre-gated MoE) is the other forecaster measured here: within one step,
the router of MoE layer ``l + d`` applied to layer ``l``'s router input names layer ``l + d``'s
experts ``d`` layers before its own router runs, from hidden states rather than statistics (so
from an engine run, not a trace). :func:`lookahead_recall` measures it on the selections a cache
missed (what a prefetch could hide); :func:`lookahead_predictions` gives the simulator's
``lookahead`` policy its lists. Why a layer ahead can be enough after all: at residency 0.5 a
recency cache misses under one instance per layer and token, not
the whole top-k the "one layer hides one expert" estimate assumes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import torch

from coldset.analysis.compiled import numba_installed
from coldset.analysis.forecast_loops import (
    count_transitions,
    forecast_segments,
    group_predictions,
    round_robin_lists,
    top_scores,
)
from coldset.analysis.streams import DecodeTokens, instance_dtype, tokens_from_frame


class ForecastError(ValueError):
    """Bad input to the forecaster (rows, shapes, parameters); the message says what."""


def transition_counts(tokens: np.ndarray, src_tokens: np.ndarray, tgt_tokens: np.ndarray, src_layers: np.ndarray,
                      tgt_layers: np.ndarray, num_experts: int, *, layers: np.ndarray | None = None,
                      num_layers: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(pairs [L, E, E], sources [L, E], targets [L, E])`` int64 counts over pairs ``i`` and layer
    columns ``j``: expert ``e`` of ``tokens[src_tokens[i], src_layers[j]]`` followed by ``e'`` of
    ``tokens[tgt_tokens[i], tgt_layers[j]]``, counted in table layer ``tgt_layers[j]`` (or
    ``layers[i]``, a layer per pair, with ``num_layers``). ``tokens`` int ``[T, L', k]``. Counted
    by one loop (:func:`coldset.analysis.forecast_loops.count_transitions`): memory is the tables."""
    E = int(num_experts)
    L = int(num_layers) if layers is not None else tokens.shape[1]
    pairs = np.zeros((L, E, E), np.int64)
    sources = np.zeros((L, E), np.int64)
    targets = np.zeros((L, E), np.int64)
    idx = [np.ascontiguousarray(x, dtype=np.int64) for x in (src_tokens, tgt_tokens, src_layers, tgt_layers)]
    per_pair = np.zeros(0, np.int64) if layers is None else np.ascontiguousarray(layers, dtype=np.int64)
    count_transitions(np.ascontiguousarray(tokens), *idx, per_pair, pairs, sources, targets)
    return pairs, sources, targets


@dataclass(frozen=True)
class TransitionForecaster:
    """Per-layer next-token transition table (see the module doc). ``table`` float32 ``[L, E, E]``."""

    table: np.ndarray
    top_k: int
    extra: int = 3

    @property
    def num_predictions(self) -> int:
        return min(self.top_k + self.extra, self.table.shape[2])

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes)

    @classmethod
    def fit(cls, rows: DecodeTokens | pd.DataFrame, num_moe_layers: int, num_experts: int, top_k: int,
            extra: int = 3, alpha: float = 1.0) -> "TransitionForecaster":
        """Fit on the consecutive decode tokens (next position of one request) of ``rows`` (the
        profile selection: :class:`coldset.analysis.streams.DecodeTokens`, or a frame of decode rows
        as :func:`coldset.analysis.streams.tokens_from_frame` reads). A (token, layer) pair counts
        where both tokens hold that layer's ``top_k`` selections."""
        if extra < 0 or alpha <= 0:
            raise ForecastError(f"extra must be >= 0 and alpha > 0, got {extra}, {alpha}")
        tok = rows if isinstance(rows, DecodeTokens) else tokens_from_frame(rows, num_moe_layers, num_experts)
        L, E = num_moe_layers, num_experts
        src, layer = consecutive_pairs(tok, top_k)
        if src.size == 0:
            raise ForecastError("rows: no two consecutive decode tokens of one request to fit a forecaster on")
        if layer is None:  # every token holds every layer: count the layers side by side
            all_l = np.arange(L)
            pairs, occ, pop = transition_counts(tok.experts, src, src + 1, all_l, all_l, E)
            per_layer = np.full(L, src.size)
        else:  # a (token, layer) group is a "token" of one layer: the same counts, every group its own layer
            flat = tok.experts.reshape(-1, 1, tok.experts.shape[2])
            zero = np.zeros(1, np.int64)
            pairs, occ, pop = transition_counts(flat, src * L + layer, (src + 1) * L + layer, zero, zero, E,
                                                layers=layer, num_layers=L)
            per_layer = np.bincount(layer, minlength=L)
        pairs, occ, pop = pairs.astype(np.float64), occ.astype(np.float64), pop.astype(np.float64)
        pop /= np.maximum(per_layer, 1)[:, None]  # P(e' selected by a next token)
        table = (pairs + alpha * pop[:, None, :]) / (occ[:, :, None] + alpha)
        return cls(table.astype(np.float32), int(top_k), int(extra))

    def predict(self, layer: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """int64 ``[N, n]``: the forecast (experts, best first, ties by id) of the next token in
        ``layer[i]`` given the current token's ``experts[i]`` (``[N, k]``): the float32 sum of the
        table rows of ``experts[i]``, the current token's own experts first (plus ``top_k``:
        consecutive tokens keep experts), by score."""
        layer = np.ascontiguousarray(layer, dtype=np.int64).reshape(-1)
        experts = np.ascontiguousarray(experts)
        out = np.empty((layer.size, self.num_predictions), dtype=np.int64)
        top_scores(self.table, layer, experts, self.top_k, self.num_predictions, out)
        return out


def consecutive_pairs(tokens: DecodeTokens, top_k: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The (token, layer) pairs a transition is counted on: ``(src, None)`` where every token holds
    every layer (token ``src[i]`` and the next, every layer), else ``(src, layer)`` one entry per
    (token, layer) both tokens hold. Refuses a (token, layer) with some of its ``top_k`` ranks."""
    ex = tokens.experts
    if ex.shape[0] and ex.shape[2] != top_k:
        raise ForecastError(f"rows hold {ex.shape[2]} selections per token and layer, top_k is {top_k}")
    nxt = tokens.consecutive()
    held = (ex >= 0).all(axis=2)
    if (held != (ex >= 0).any(axis=2)).any():
        raise ForecastError("rows: every (request, position, layer) must hold ranks 0..k-1 once")
    if held.all():
        return np.flatnonzero(nxt), None
    both = held[:-1] & held[1:] & nxt[:-1, None]
    src, layer = np.nonzero(both)
    return src.astype(np.int64), layer.astype(np.int64)


def forecast_recall(forecaster: TransitionForecaster, rows: DecodeTokens | pd.DataFrame, num_moe_layers: int,
                    num_experts: int) -> dict:
    """Recall one token ahead on ``rows`` (the held-out selection, as :meth:`TransitionForecaster.fit`
    takes it): over every (token, layer) whose next token exists, the share of the next token's
    selections inside the forecast. Also the previous-token baseline (forecast = the current
    token's own experts) and the forecast size. Counted a chunk of pairs at a time."""
    tok = rows if isinstance(rows, DecodeTokens) else tokens_from_frame(rows, num_moe_layers, num_experts)
    src, layer = consecutive_pairs(tok, forecaster.top_k)
    L = num_moe_layers
    if layer is None:
        src, layer = np.repeat(src, L), np.tile(np.arange(L), src.size)
    if src.size == 0:
        raise ForecastError("rows: no two consecutive decode tokens of one request to measure recall on")
    inside = same = 0
    for c in range(0, src.size, RECALL_CHUNK):
        s_, l_ = src[c:c + RECALL_CHUNK], layer[c:c + RECALL_CHUNK]
        cur = tok.experts[s_, l_]
        nxt = tok.experts[s_ + 1, l_]
        pred = forecaster.predict(l_, cur)
        inside += int((nxt[:, :, None] == pred[:, None, :]).any(axis=2).sum())
        same += int((nxt[:, :, None] == cur[:, None, :]).any(axis=2).sum())
    total = src.size * forecaster.top_k
    return {"recall": inside / total, "previous_token_recall": same / total,
            "predictions": forecaster.num_predictions, "top_k": forecaster.top_k, "pairs": int(src.size),
            "table_bytes": forecaster.nbytes}


#: (token, layer) pairs :func:`forecast_recall` forecasts at once.
RECALL_CHUNK = 1 << 18


def stream_predictions(forecaster: TransitionForecaster, stream) -> np.ndarray:
    """int32 ``[G, P]`` (:func:`coldset.analysis.streams.instance_dtype`): for each group of a
    :class:`coldset.analysis.streams.AccessStream` (one MoE layer's
    selections of one step: ``B * top_k`` of them, token by token), the instances to prefetch
    after it: the union of each token's forecast in token order then score order, first
    occurrence kept, padded with -1 (:func:`coldset.analysis.forecast_loops.group_predictions`)."""
    k = forecaster.top_k
    sizes = np.diff(stream.group_ptr)
    if (sizes % k).any():
        raise ForecastError(f"stream groups must hold a multiple of top_k = {k} selections")
    width = int(sizes.max(initial=k)) // k * forecaster.num_predictions
    out = np.full((sizes.size, width), -1, dtype=instance_dtype(stream.num_instances))
    group_predictions(forecaster.table, stream.instances, stream.group_ptr, k, stream.num_experts, forecaster.top_k,
                      forecaster.num_predictions, out)
    return out


def lookahead_recall(hidden, routers, routing: np.ndarray, missed: np.ndarray, depth: int, extra: int = 0) -> dict:
    """The next-layer lookahead (pre-gated MoE) measured on recorded decode steps: the router of
    MoE layer ``l`` applied to the router input of layer ``l - depth`` of the same token and step,
    its top ``k + extra`` experts by logit (ties to the lower id) as the forecast of layer ``l``'s
    selections, ``depth`` layers before its router runs.

    ``hidden``: torch ``[S, L, T, H]``, each MoE layer's router input (the post-attention norm's
    output) per step and token; ``routers``: the ``L`` router weights ``[E, H]``; ``routing``:
    int ``[S, L, T, k]`` the selections; ``missed``: bool ``[S, L, T, k]``, the selections a cache
    missed (e.g. ``lru``'s per-selection ``~hit`` of :func:`coldset.analysis.simulate.simulate`).

    Returns the recall on the missed selections of layers ``>= depth`` (what a prefetch could
    hide) and on all their selections, the share of missed selections in layers ``< depth`` (no
    lookahead can reach them), and the precision of the forecast (its share of experts selected).
    Logits are computed in float32 (the engine ranks the model dtype's logits; near-ties may rank
    otherwise: a measurement, not the engine's decisions)."""
    S, L, T, k = routing.shape
    if missed.shape != routing.shape or tuple(hidden.shape[:3]) != (S, L, T) or len(routers) != L:
        raise ForecastError(f"lookahead_recall: hidden {tuple(hidden.shape)}, routing {routing.shape}, missed "
                            f"{missed.shape} and {len(routers)} routers do not describe the same steps and layers")
    if not 1 <= depth < L:
        raise ForecastError(f"lookahead_recall: depth must be in [1, {L - 1}], got {depth}")
    n = k + extra
    pred = np.empty((S, L - depth, T, n), dtype=np.int64)
    for layer in range(depth, L):
        h = hidden[:, layer - depth].reshape(S * T, -1).float()
        logits = h @ routers[layer].float().T.to(h.device)
        # top-n by logit, ties to the lower expert id: a stable sort of the negated logits
        order = torch.sort(-logits, dim=1, stable=True).indices[:, :n]
        pred[:, layer - depth] = order.reshape(S, T, n).cpu().numpy()
    sel = np.asarray(routing)[:, depth:]
    inside = (sel[..., :, None] == pred[..., None, :]).any(axis=-1)  # [S, L-d, T, k]
    miss = np.asarray(missed, dtype=bool)
    later = miss[:, depth:]
    chosen = (pred[..., :, None] == sel[..., None, :]).any(axis=-1)  # [S, L-d, T, n]
    return {"depth": depth, "predictions": n, "missed": int(miss.sum()), "missed_reachable": int(later.sum()),
            "recall_on_missed": float(inside[later].mean()) if later.any() else float("nan"),
            "recall": float(inside.mean()), "precision": float(chosen.mean()),
            "missed_unreachable_share": float(1 - later.sum() / miss.sum()) if miss.any() else 0.0}


def lookahead_predictions(hidden, routers, depth: int, num_predictions: int) -> np.ndarray:
    """int64 ``[S * L, P]``: the prefetch lists of the ``lookahead`` policy of
    :func:`coldset.analysis.simulate.simulate` for an engine stream of ``S`` steps (groups in step, layer order,
    ``T`` tokens each): after group (step ``s``, layer ``l``) the instances of layer ``l + depth``
    that its router ranks in the top ``num_predictions`` on layer ``l``'s router inputs
    ``hidden[s, l]`` (token by token, then rank, first occurrence kept), -1 padded; nothing after
    the last ``depth`` layers. ``hidden`` torch ``[S, L, T, H]``, ``routers`` the ``L`` router
    weights ``[E, H]``; float32 logits, ties to the lower expert id (as :func:`lookahead_recall`)."""
    S, L, T = (int(x) for x in hidden.shape[:3])
    if len(routers) != L or not 1 <= depth < L:
        raise ForecastError(f"lookahead_predictions: {len(routers)} routers for {L} layers, depth {depth}")
    E = int(routers[0].shape[0])
    n = int(num_predictions)
    out = np.full((S, L, T * n), -1, dtype=np.int64)
    for layer in range(L - depth):
        h = hidden[:, layer].reshape(S * T, -1).float()
        logits = h @ routers[layer + depth].float().T.to(h.device)
        top = torch.sort(-logits, dim=1, stable=True).indices[:, :n].reshape(S, T * n).cpu().numpy()
        for s in range(S):
            _, first = np.unique(top[s], return_index=True)
            keep = top[s][np.sort(first)]
            out[s, layer, :keep.size] = keep + (layer + depth) * E
    return out.reshape(S * L, T * n)


LOOKAHEAD_FIT_SHRINK = 0.1  # the ridge weight towards the router, in units of mean(diag(X^T X))
def fit_lookahead_routers(hidden, routers, depth: int, shrink: float = LOOKAHEAD_FIT_SHRINK) -> list:
    """The ``lookahead`` forecast's matrices fitted on profile router inputs, to use in place of the
    routers (:meth:`coldset.engine.cache.pool.SlotCache.build`'s ``routers``, :func:`lookahead_predictions`'):
    entry ``t >= depth`` is the ``[E, H]`` matrix ``F`` whose product with layer ``t - depth``'s
    router input best predicts layer ``t``'s router logits on the profile tokens, shrunk towards
    layer ``t``'s router ``R`` (the pre-gated forecast, which it equals as ``shrink`` grows)::

        F = argmin ||X_{t-d} F^T - X_t R^T||^2 + lam ||F - R||^2,   lam = shrink * mean(diag(X_{t-d}^T X_{t-d}))

    Entries ``t < depth`` (no layer forecasts them) are the routers themselves. Why: ``R`` applied
    to an earlier layer's input misses what the ``depth`` layers between add to the residual
    stream; a linear correction fitted on the profile split recovers part of it at the same cost a
    token (one ``[E, H]`` GEMV, the same launch reading other rows), so a prefetch names more of
    the experts layer ``t`` selects and copies fewer it does not. The prior keeps the fit sane with
    fewer profile tokens than hidden dimensions (the real shape's 2048). Measured: the synthetic
    router at 48 x 128, top-8, hidden 256 on the CPU (``probes/lookahead_fit.py``): recall of layer
    ``l + 4``'s selections 0.944 against the router's 0.912, simulated b1 residency 0.5 0.594 of
    all-HBM against 0.570; on the H200 at real shape: BENCHMARKS.md section 4.

    ``hidden``: ``[N, L, H]`` (any float dtype; N profile tokens, each MoE layer's router input);
    ``routers``: the ``L`` routers ``[E, H]``. Returns ``L`` tensors ``[E, H]`` in each router's
    dtype and device. Solved in float64 on ``hidden``'s device."""
    N, L, H = (int(x) for x in hidden.shape)
    if len(routers) != L or not 1 <= int(depth) < L:
        raise ForecastError(f"fit_lookahead_routers: {len(routers)} routers for {L} layers, depth {depth}")
    if N < 1 or not shrink > 0:
        raise ForecastError(f"fit_lookahead_routers: {N} profile tokens and shrink {shrink} (> 0 needed)")
    dev = hidden.device
    out = [r for r in routers[:depth]]
    eye = torch.eye(H, dtype=torch.float64, device=dev)
    for t in range(depth, L):
        x = hidden[:, t - depth].to(torch.float64)
        r = routers[t].to(dev, torch.float64)
        z = hidden[:, t].to(torch.float64) @ r.T
        g = x.T @ x
        lam = float(shrink) * g.diagonal().mean().clamp_min(torch.finfo(torch.float64).tiny)
        ft = torch.linalg.solve(g + lam * eye, x.T @ z + lam * r.T)
        out.append(ft.T.to(routers[t].device, routers[t].dtype).contiguous())
    return out


# --------------------------------------------------------------------------------------------
# The next-token forecast of every layer (the ``nexttoken`` policy's forecaster, coldset.analysis.policies.nexttoken)

SCORE_UNIT = 1 << 16  # the integer tables' unit: a probability p is stored as round(p * SCORE_UNIT)
DEFAULT_TERMS = ((0, 0), (1, 0), (2, 0))
DEFAULT_WEIGHTS = (1.0, 0.5, 0.25)
HIST_GRID = ((0.0, 5), (0.1, 3), (0.1, 5), (0.2, 3), (0.2, 5), (0.4, 3), (0.4, 5), (0.8, 5))
# Forms measured and not kept (a wider history grid, other terms and lags, log-probability tables,
# fitted weights): docs/history.md, "The next-token forecast". The current token's two lower
# layers (l - 1, l - 2: routed before layer l's forecast is made) beside the defaults are a
# candidate for fit_tuned(term_sets=...), not the default: within noise of the defaults' recall for
# 5/3 of the table memory (J x L x E x E int32) and of the table rows read per step.
LOWER_LAYER_TERMS = ((0, 0), (1, 0), (2, 0), (0, 1), (0, 2))
LOWER_LAYER_WEIGHTS = (1.0, 0.5, 0.25, 1.0, 0.5)


def term_counts(tokens: np.ndarray, sequence: np.ndarray, term: tuple, horizon: int, num_experts: int,
                mask: np.ndarray | None = None) -> tuple:
    """``(pairs [L, E, E], sources [L, E], targets [L, E], n)`` of one term ``(a, d)`` of
    :class:`NextTokenForecaster`: over the ``n`` tokens ``t`` whose tokens ``t - a`` and ``t + horizon``
    lie in its sequence (and where ``mask[t]``, a mask of whole sequences), expert ``e`` of token
    ``t - a`` in layer ``l - d`` followed by ``e'`` of token ``t + horizon`` in layer ``l``
    (:func:`transition_counts`); the arrays are None where no layer has its source layer."""
    a, d = int(term[0]), int(term[1])
    T, L = tokens.shape[:2]
    t = np.arange(a, T - horizon)
    t = t[(sequence[t - a] == sequence[t]) & (sequence[t + horizon] == sequence[t])] if t.size else t
    if mask is not None:
        t = t[np.asarray(mask, dtype=bool)[t]]
    lt = np.arange(max(0, d), min(L, L + d))  # target layers whose source layer l - d exists
    if t.size == 0 or lt.size == 0:
        return None, None, None, int(t.size)
    return (*transition_counts(tokens, t - a, t + horizon, lt - d, lt, num_experts), int(t.size))


def add_counts(one: tuple, other: tuple) -> tuple:
    """The :func:`term_counts` of two disjoint sets of sequences together."""
    if one[0] is None or other[0] is None:
        return other if one[0] is None else one
    return one[0] + other[0], one[1] + other[1], one[2] + other[2], one[3] + other[3]


def validation_split(sequence: np.ndarray, validation_every: int = 5,
                     validation: np.ndarray | None = None) -> np.ndarray:
    """bool ``[T]``: the tokens :meth:`NextTokenForecaster.fit_tuned` chooses its parameters on:
    ``validation`` when given, else every ``validation_every``-th sequence (in id order). It tunes
    only when this holds some tokens and leaves some out."""
    if validation is not None:
        return np.asarray(validation, dtype=bool)
    _, seq_idx = np.unique(np.asarray(sequence, dtype=np.int64), return_inverse=True)
    return seq_idx.reshape(-1) % validation_every == validation_every - 1


@dataclass(frozen=True)
class NextTokenForecaster:
    """The ``nexttoken`` policy's forecast: made right after MoE layer ``l``'s router at step ``t``,
    it ranks the experts layer ``l`` will select ``horizon`` tokens later, per sequence, with
    integer table lookups, a shift and an add (so the engine computes it inside the captured step
    and agrees with the simulator bitwise)::

        H[l, e]      = H[l, e] - (H[l, e] >> hist_shift) + hist_unit * [e in S(t, l)]
        score[e']    = H[l, e'] + sum_j  sum_{e in S(t - a_j, l - d_j)}  tables[j, l, e, e']

    ``H`` int ``[L, E]`` per sequence (zero at its start) is a decayed count of the experts the
    sequence selected in each layer: a request keeps returning to its own experts (on the real
    trace it lifts recall one token ahead from 0.42 to 0.56). ``tables[j]`` is the transition
    probability ``P(e' at t + horizon | e at t - a_j in layer l - d_j)`` (smoothed towards the
    layer's popularity as :class:`TransitionForecaster`) times ``weights[j]`` in units of
    :data:`SCORE_UNIT`; a term whose token precedes the sequence or whose layer lies outside the
    model adds nothing. The forecast is the top ``top_k + extra`` by score, ties to the lower
    expert id.
    """

    terms: tuple
    tables: np.ndarray
    hist_unit: int
    hist_shift: int
    top_k: int
    extra: int = 3
    horizon: int = 1
    self_boost: float = 0.0  # what fit added to the (0, 0) table's diagonal (already in tables; a record)

    def __post_init__(self) -> None:
        tables = np.ascontiguousarray(self.tables, dtype=np.int32)
        object.__setattr__(self, "tables", tables)
        object.__setattr__(self, "terms", tuple((int(a), int(d)) for a, d in self.terms))
        if tables.ndim != 4 or tables.shape[0] != len(self.terms) or tables.shape[2] != tables.shape[3]:
            raise ForecastError(f"NextTokenForecaster: tables must be [terms, L, E, E], got {tables.shape} for "
                                f"{len(self.terms)} terms")
        L = tables.shape[1]
        for a, d in self.terms:
            if a < 0 or (a == 0 and d < 0) or abs(d) >= L:
                raise ForecastError(f"NextTokenForecaster: term (a={a}, d={d}) is not known after layer l's router "
                                    f"(a >= 0; a = 0 needs d >= 0; |d| < {L})")
        if tables.size and tables.min() < 0:
            raise ForecastError("NextTokenForecaster: tables must be >= 0")
        if self.hist_unit < 0 or not 0 < self.hist_shift < 31 or self.horizon < 1 or self.extra < 0:
            raise ForecastError(f"NextTokenForecaster: hist_unit >= 0, hist_shift in [1, 30], horizon >= 1, extra "
                                f">= 0 expected, got {self.hist_unit}, {self.hist_shift}, {self.horizon}, {self.extra}")
        # int32 headroom: the largest score the sums can reach
        worst = int(tables.max(initial=0)) * self.top_k * len(self.terms) + self.hist_unit * (1 << self.hist_shift)
        if worst >= 2**31:
            raise ForecastError(f"NextTokenForecaster: scores could reach {worst}, beyond int32")

    @property
    def num_layers(self) -> int:
        return int(self.tables.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.tables.shape[2])

    @property
    def num_predictions(self) -> int:
        return min(self.top_k + self.extra, self.num_experts)

    @property
    def n(self) -> int:
        """Candidates per token (the engine's name for :attr:`num_predictions`)."""
        return self.num_predictions

    @property
    def nbytes(self) -> int:
        """Device memory of the tables (the per-sequence state H adds ``4 * L * E`` bytes a sequence)."""
        return int(self.tables.nbytes)

    @property
    def max_lag(self) -> int:
        return max((a for a, _ in self.terms), default=0)

    def ops_per_step(self, batch: int = 1) -> dict:
        """Work of one decode step (every layer) at ``batch``: table rows gathered and int adds."""
        L, E, k = self.num_layers, self.num_experts, self.top_k
        rows = len(self.terms) * k * batch * L
        return {"table_rows_read": rows, "bytes_read": rows * E * 4 + 2 * batch * L * E * 4,
                "int_adds": (rows + 2 * batch * L) * E, "topk": f"{batch * L} x top-{self.num_predictions} of {E}"}

    @classmethod
    def fit(cls, tokens: np.ndarray, sequence: np.ndarray, top_k: int, num_experts: int, *, horizon: int = 1,
            terms=DEFAULT_TERMS, weights=DEFAULT_WEIGHTS, hist_beta: float = 0.2, hist_shift: int = 5,
            extra: int = 3, alpha: float = 1.0, self_boost: float = 0.0, counts=None) -> "NextTokenForecaster":
        """Fit the tables on decode ``tokens`` int ``[T, L, k]`` (:func:`coldset.analysis.streams.token_array`
        of the profile selection) with their sequence ids ``[T]`` (consecutive tokens of a
        sequence in order). ``hist_beta``: H's increment as a share of :data:`SCORE_UNIT`;
        ``self_boost``: added (in :data:`SCORE_UNIT`) to the diagonal of the current token's table
        (term (0, 0)): with ``top_k`` the current token's experts rank first, as in
        :class:`TransitionForecaster` (data in the table, not another rule for the engine).
        ``counts``: each term's :func:`term_counts` on these tokens where already counted."""
        tokens = np.asarray(tokens)
        sequence = np.asarray(sequence, dtype=np.int64)
        if tokens.ndim != 3 or sequence.shape != tokens.shape[:1] or not np.issubdtype(tokens.dtype, np.integer):
            raise ForecastError(f"fit: tokens must be integer [T, L, k] and sequence [T], got {tokens.dtype} "
                                f"{tokens.shape}, {sequence.shape}")
        if tokens.shape[2] != top_k:
            raise ForecastError(f"fit: tokens hold {tokens.shape[2]} selections per layer, top_k is {top_k}")
        if len(terms) != len(weights) or alpha <= 0 or hist_beta < 0:
            raise ForecastError("fit: one weight per term, alpha > 0, hist_beta >= 0")
        T, L = tokens.shape[:2]
        E = int(num_experts)
        if T and (tokens.min() < 0 or tokens.max() >= E):
            raise ForecastError(f"fit: experts outside [0, {E})")
        if counts is None:
            counts = [term_counts(tokens, sequence, term, horizon, E) for term in terms]
        tables = np.zeros((len(terms), L, E, E), dtype=np.int32)
        n_pairs = max((c[3] for c in counts), default=0)
        for j, ((pairs, occ, pop, n), w) in enumerate(zip(counts, weights)):
            if pairs is None or n == 0:
                continue
            pairs = pairs.astype(np.float64)
            pop = pop / n
            prob = (pairs + alpha * pop[:, None, :]) / (occ[:, :, None] + alpha)
            tables[j] = np.rint(np.clip(prob, 0, None) * w * SCORE_UNIT).astype(np.int32)
        if n_pairs == 0:
            raise ForecastError(f"fit: no decode token has a successor {horizon} token(s) later in its sequence")
        if self_boost:
            if (0, 0) not in [tuple(t) for t in terms]:
                raise ForecastError("fit: self_boost needs the term (0, 0)")
            j0 = [tuple(t) for t in terms].index((0, 0))
            tables[j0][:, np.arange(E), np.arange(E)] += np.int32(round(self_boost * SCORE_UNIT))
        return cls(tuple(terms), tables, int(round(hist_beta * SCORE_UNIT)), int(hist_shift), int(top_k),
                   int(extra), int(horizon), float(self_boost))

    @classmethod
    def fit_tuned(cls, tokens: np.ndarray, sequence: np.ndarray, top_k: int, num_experts: int, *,
                  horizon: int = 1, grid=HIST_GRID, validation_every: int = 5, validation: np.ndarray | None = None,
                  term_sets=None, **kw) -> "NextTokenForecaster":
        """:meth:`fit` with H's (beta, shift) chosen from ``grid`` by recall on every
        ``validation_every``-th sequence of the profile (or on the tokens of the bool mask
        ``validation``, e.g. one profile domain when the replay is a held-out domain), fitted on the
        others, then refitted on the whole profile: the held-out selection never chooses a parameter.
        ``term_sets``: optional ``(terms, weights)`` pairs (e.g. ``(DEFAULT_TERMS, DEFAULT_WEIGHTS)``
        and ``(LOWER_LAYER_TERMS, LOWER_LAYER_WEIGHTS)``) chosen among the same way, with H's
        parameters (the first set wins ties); without it, ``kw``'s ``terms`` / ``weights`` (the
        defaults)."""
        sequence = np.asarray(sequence, dtype=np.int64)
        val = validation_split(sequence, validation_every, validation)
        if term_sets is None:
            term_sets = ((kw.pop("terms", DEFAULT_TERMS), kw.pop("weights", DEFAULT_WEIGHTS)),)
        elif "terms" in kw or "weights" in kw:
            raise ForecastError("fit_tuned: give term_sets or terms / weights, not both")
        term_sets = [(tuple(t), tuple(w)) for t, w in term_sets]
        if not term_sets:
            raise ForecastError("fit_tuned: term_sets is empty")
        best = None
        kw.pop("self_boost", None)
        tuned = val.any() and (~val).any()
        if tuned and (val[1:] != val[:-1])[sequence[1:] == sequence[:-1]].any():
            raise ForecastError("fit_tuned: the validation tokens must be whole sequences")
        # each term counted once on the fitting part and once on the validation part (counts add up)
        part_counts = {False: {}, True: {}}

        def counted(term, part):
            if term not in part_counts[part]:
                part_counts[part][term] = term_counts(tokens, sequence, term, horizon, num_experts, val == part)
            return part_counts[part][term]

        if tuned:
            for terms, weights in term_sets:
                for boost in (0.0, float(top_k)):  # the current token's experts first, or not
                    base = cls.fit(tokens, sequence, top_k, num_experts, horizon=horizon, terms=terms,
                                   weights=weights, self_boost=boost, counts=[counted(t, False) for t in terms], **kw)
                    # replace checks each point's int32 headroom; one forecast shares the table lookups
                    hist = [(f.hist_unit, f.hist_shift) for f in
                            (replace(base, hist_unit=int(round(b * SCORE_UNIT)), hist_shift=int(h)) for b, h in grid)]
                    recalls = [q["recall"] for q in forecast_quality(base, tokens[val], sequence[val], hist=hist)]
                    for (beta, shift), r in zip(grid, recalls):
                        if best is None or r > best[0] + 1e-12:
                            best = (r, beta, shift, boost, terms, weights)
        beta, shift, boost, terms, weights = (best[1:] if best else (kw.pop("hist_beta", 0.2), kw.pop("hist_shift", 5),
                                                                     0.0, *term_sets[0]))
        kw.pop("hist_beta", None)
        kw.pop("hist_shift", None)
        counts = [add_counts(counted(t, False), counted(t, True)) for t in terms] if best else None
        return cls.fit(tokens, sequence, top_k, num_experts, horizon=horizon, hist_beta=beta, hist_shift=shift,
                       self_boost=boost, terms=terms, weights=weights, counts=counts, **kw)

    def forecast_lanes(self, sel: np.ndarray, start: np.ndarray, hist=None) -> np.ndarray:
        """int64 ``[S, L, B, n]``: the forecast made after each (step, layer) for each lane (best
        first), ``-1`` for idle lanes. ``sel`` int ``[S, L, B, k]`` and ``start`` bool ``[S, B]`` as
        :class:`coldset.analysis.streams.Lanes` (the engine's pass: ``B`` lanes started at step 0).

        A lane's state begins afresh at each start, and no lane reads another's, so each segment
        of a lane (:func:`lane_segments`) is forecast from an empty state by one loop
        (:func:`coldset.analysis.forecast_loops.forecast_segments`; :meth:`_forecast_steps` is the
        vectorised reference stepping every lane together). Experts are int16 (int64 beyond
        32767 experts). ``hist``: ``(hist_unit, hist_shift)`` pairs to forecast with in place of the
        forecaster's own, sharing the table lookups: ``[V, S, L, B, n]``, one per pair."""
        sel = np.asarray(sel)
        start = np.asarray(start, dtype=bool)
        S, L, B, k = sel.shape
        n = self.num_predictions
        if L != self.num_layers or k != self.top_k:
            raise ForecastError(f"forecast_lanes: selections of {L} layers x top-{k}, the forecaster has "
                                f"{self.num_layers} x top-{self.top_k}")
        if not numba_installed():  # uncompiled, the loop is Python per selection; numpy steps the lanes together
            return self._forecast_steps(sel, start, hist)
        variants = [(self.hist_unit, self.hist_shift)] if hist is None else list(hist)
        out = np.full((len(variants), S, L, B, n), -1, dtype=np.int16 if self.num_experts <= 32767 else np.int64)
        if S and B:
            self._run_segments(sel, *lane_segments(sel, start), variants, out, 0, np.zeros(0, np.int64))
        return out if hist is not None else out[0]

    def _run_segments(self, sel, lane, first, length, variants, out, horizon, widths) -> np.ndarray:
        """:func:`coldset.analysis.forecast_loops.forecast_segments` with this forecaster's tables and
        terms; returns its hit counts ``[V, len(widths), 2]``."""
        hits = np.zeros((len(variants), len(widths), 2), dtype=np.int64)
        forecast_segments(np.ascontiguousarray(sel), lane, first, length, self.tables,
                          np.array([a for a, _ in self.terms], np.int64),
                          np.array([d for _, d in self.terms], np.int64),
                          np.array([u for u, _ in variants], np.int64), np.array([h for _, h in variants], np.int64),
                          self.num_predictions, out, int(horizon), np.asarray(widths, np.int64), hits)
        return hits

    def _forecast_steps(self, sel: np.ndarray, start: np.ndarray, hist=None) -> np.ndarray:
        """:meth:`forecast_lanes` stepping every lane together (its arguments checked)."""
        S, L, B, k = sel.shape
        E, n = self.num_experts, self.num_predictions
        variants = [(self.hist_unit, self.hist_shift)] if hist is None else [(int(u), int(h)) for u, h in hist]
        V = len(variants)
        units = np.array([u for u, _ in variants], dtype=np.int64)[:, None, None, None]
        shifts = np.array([h for _, h in variants], dtype=np.int64)[:, None, None, None]
        out = np.full((V, S, L, B, n), -1, dtype=np.int64)
        H = np.zeros((V, L, B, E), dtype=np.int64)
        A = self.max_lag
        past = np.full((A + 1, L, B, k), -1, dtype=np.int64)  # past[a] = the lane's token a steps back
        age = np.zeros(B, dtype=np.int64)
        lidx = np.arange(L)[:, None, None]
        bidx = np.arange(B)[None, :, None]
        tie = (E - 1 - np.arange(E, dtype=np.int64))[None, None, :]
        chunk = max(1, 4096 // max(V * B * L // 8, 1))
        keys = np.empty((chunk, V, L, B, E), dtype=np.int64)
        s0 = 0
        for s in range(S):
            act = sel[s, 0, :, 0] >= 0
            age = np.where(start[s], 0, age + 1)
            H[:, :, start[s], :] = 0
            past = np.roll(past, 1, axis=0)
            past[0] = sel[s]
            onehot = np.zeros((L, B, E), dtype=bool)
            cur = np.where(sel[s] >= 0, sel[s], 0)
            onehot[lidx, bidx, cur] = True
            onehot &= act[None, :, None]
            H = np.where(act[None, :, None], H - (H >> shifts), H) + units * onehot
            score = np.zeros((L, B, E), dtype=np.int64)
            for j, (a, d) in enumerate(self.terms):
                valid = act & (age >= a)
                if not valid.any():
                    continue
                lt = np.arange(max(0, d), min(L, L + d))
                src = np.where(valid[None, :, None], past[a][lt - d], -1)  # [Lv, B, k]
                rows = self.tables[j][lt[:, None, None], np.maximum(src, 0)]  # [Lv, B, k, E]
                rows = np.where((src >= 0)[..., None], rows, 0)
                score[lt] += rows.sum(axis=2, dtype=np.int64)
            keys[s - s0] = (H + score) * E + tie
            if s - s0 + 1 == chunk or s == S - 1:
                kk = keys[: s - s0 + 1]
                part = np.argpartition(-kk, n - 1, axis=4)[..., :n] if n < E else np.broadcast_to(
                    np.arange(E), kk.shape).copy()
                order = np.argsort(-np.take_along_axis(kk, part, axis=4), axis=4)
                out[:, s0:s + 1] = np.take_along_axis(part, order, axis=4).transpose(1, 0, 2, 3, 4)
                s0 = s + 1
        out[np.broadcast_to((sel[:, 0, :, 0] < 0)[None, :, None, :, None], out.shape)] = -1
        return out if hist is not None else out[0]


def lane_segments(sel: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(lane, first, length)`` int64: each segment of the lanes of ``sel`` ``[S, L, B, k]`` (a
    start, or step 0, to the lane's last active step before its next start), lane then step order:
    what :meth:`NextTokenForecaster.forecast_lanes` forecasts one after another, each from an
    empty state."""
    S, B = start.shape
    begin = start.copy()
    begin[0] = True
    lane, first = np.nonzero(begin.T)  # lane then step order
    nxt = np.where(np.r_[lane[1:] == lane[:-1], False], np.r_[first[1:], 0], S)
    flat = np.where(sel[:, 0, :, 0].T.reshape(-1) >= 0, np.arange(S * B), -1)
    last = np.maximum.accumulate(flat)[lane * S + nxt - 1] - lane * S  # last active step before nxt
    length = np.where(last >= first, last - first + 1, 0)
    keep = length > 0
    return lane[keep].astype(np.int64), first[keep].astype(np.int64), length[keep].astype(np.int64)


def lanes_of_tokens(tokens: np.ndarray, sequence: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(sel [T, L, 1, k], start [T, 1])``: the tokens as one lane, a sequence after another (a
    view of ``tokens``)."""
    tokens = np.asarray(tokens)
    sequence = np.asarray(sequence, dtype=np.int64)
    start = np.r_[True, sequence[1:] != sequence[:-1]] if sequence.size else np.zeros(0, bool)
    return tokens[:, :, None, :], start[:, None]


def forecast_quality(forecaster: NextTokenForecaster, tokens: np.ndarray, sequence: np.ndarray,
                     sizes: tuple | None = None, hist=None):
    """Recall and precision of the forecast ``forecaster.horizon`` tokens ahead on decode
    ``tokens`` ``[T, L, k]`` (the held-out selection), over every (token, layer) whose token
    ``horizon`` later exists in the same sequence: recall = share of that token's selections inside
    the forecast, precision = share of the forecast it selects. ``recall`` / ``precision`` at the
    full forecast (``top_k + extra``), and ``at`` each size in ``sizes`` (the forecast's first
    ``m``, e.g. ``top_k`` or a prefetch budget). ``hist``: ``(hist_unit, hist_shift)`` pairs
    (:meth:`NextTokenForecaster.forecast_lanes`): a list of such dicts, one per pair. Counted as
    the forecast steps each sequence (:func:`lanes_of_tokens`; no lists kept)."""
    tokens = np.asarray(tokens)
    sequence = np.asarray(sequence, dtype=np.int64)
    h = forecaster.horizon
    T = tokens.shape[0]
    t = np.arange(max(T - h, 0))
    n_pairs = int(np.count_nonzero(sequence[t + h] == sequence[t]))
    if n_pairs == 0:
        raise ForecastError(f"no token has a successor {h} token(s) later in its sequence")
    if tokens.shape[1:] != (forecaster.num_layers, forecaster.top_k):
        raise ForecastError(f"forecast_quality: tokens of {tokens.shape[1]} layers x top-{tokens.shape[2]}, the "
                            f"forecaster has {forecaster.num_layers} x top-{forecaster.top_k}")
    sel, start = lanes_of_tokens(tokens, sequence)
    n = forecaster.num_predictions
    widths = [n] + [int(min(m, n)) for m in sizes or ()]
    variants = [(forecaster.hist_unit, forecaster.hist_shift)] if hist is None else list(hist)
    hits = forecaster._run_segments(sel, *lane_segments(sel, start), variants, np.zeros((0, 0, 0, 0, 0), np.int64),
                                    h, widths)
    pairs = n_pairs * tokens.shape[1]
    k = tokens.shape[2]
    out = []
    for v in range(len(variants)):
        q = {"horizon": h, "predictions": n, "top_k": forecaster.top_k, "pairs": pairs,
             "recall": hits[v, 0, 0] / (pairs * k), "precision": hits[v, 0, 1] / (pairs * n)}
        for i, m in enumerate(widths[1:], 1):
            q[f"recall_at_{m}"] = hits[v, i, 0] / (pairs * k)
            q[f"precision_at_{m}"] = hits[v, i, 1] / (pairs * m)
        out.append({key: float(x) if isinstance(x, np.floating) else x for key, x in q.items()})
    return out if hist is not None else out[0]


def _set_ids(sets: np.ndarray, num_experts: int) -> np.ndarray:
    """int64 ``[m]``: a dense id per distinct row of ``sets`` int ``[m, k]`` (rows sorted, so a set)."""
    m, k = sets.shape
    if k * np.log2(max(num_experts, 2)) <= 62:
        key = np.zeros(m, dtype=np.int64)
        for j in range(k):
            key = key * num_experts + sets[:, j]
        return np.unique(key, return_inverse=True)[1].reshape(-1)
    return np.unique(sets, axis=0, return_inverse=True)[1].reshape(-1)


def _top_counts_per_context(ctx: np.ndarray, tgt: np.ndarray, num_experts: int, n: int) -> int:
    """The sum over contexts of the ``n`` largest target counts: ``ctx`` int64 ``[m]`` dense context
    ids, ``tgt`` int ``[m, k]`` the targets of each pair."""
    keys, cnt = np.unique((ctx[:, None] * num_experts + tgt).reshape(-1), return_counts=True)
    c_of = keys // num_experts
    order = np.lexsort((-cnt, c_of))
    c_sorted, cnt_sorted = c_of[order], cnt[order]
    first = np.r_[0, np.flatnonzero(c_sorted[1:] != c_sorted[:-1]) + 1]
    rank = np.arange(c_sorted.size) - np.repeat(first, np.diff(np.r_[first, c_sorted.size]))
    return int(cnt_sorted[rank < n].sum())


def conditional_ceiling(tokens: np.ndarray, sequence: np.ndarray, horizon: int, n: int,
                        lower_layers: int = 0) -> dict:
    """Where the trace's predictability caps a forecast from the current token's experts: the best
    recall any function of (layer, the current token's expert set) can reach ``horizon`` tokens
    ahead with ``n`` candidates, measured in-sample on these very tokens (the empirical conditional
    distribution's top ``n``; in-sample, so an upper bound on that data), beside the recall of the
    layer's ``n`` most popular experts (a function of nothing) on the same pairs.

    ``lower_layers`` = m widens the context to the current token's expert sets in layers
    ``l, l - 1, ..., l - m`` (those that exist): the ceiling of the forecast terms (0, d <= m). An
    in-sample bound grows with the context partly by memorising (fewer pairs per context): a
    context seen once is predicted perfectly. ``contexts`` and ``repeated_share`` (the share of
    pairs whose context occurs more than once) say how much of it is memorisation. Counted per
    layer with sorts (linear memory in the pairs of one layer)."""
    tokens = np.asarray(tokens)  # int16 from DecodeTokens: every product below is int64
    sequence = np.asarray(sequence, dtype=np.int64)
    T, L, k = tokens.shape
    if lower_layers < 0:
        raise ForecastError(f"conditional_ceiling: lower_layers must be >= 0, got {lower_layers}")
    t = np.arange(max(T - horizon, 0))
    t = t[sequence[t + horizon] == sequence[t]]
    E = int(tokens.max(initial=0)) + 1
    best = pop_best = contexts = repeated = 0
    set_ids: dict[int, np.ndarray] = {}
    for layer in range(L):
        for gone in [x for x in set_ids if x < layer - lower_layers]:
            del set_ids[gone]
        set_ids[layer] = _set_ids(np.sort(tokens[t, layer], axis=1), E)
        ctx = set_ids[layer]
        for below in range(layer - 1, max(layer - lower_layers, 0) - 1, -1):
            pair = ctx * (int(set_ids[below].max(initial=0)) + 1) + set_ids[below]
            ctx = np.unique(pair, return_inverse=True)[1].reshape(-1)
        tgt = tokens[t + horizon, layer]
        best += _top_counts_per_context(ctx, tgt, E, n)
        pop_best += int(np.sort(np.bincount(tgt.reshape(-1), minlength=E))[::-1][:n].sum())
        per_ctx = np.bincount(ctx) if ctx.size else np.zeros(0, np.int64)
        contexts += per_ctx.size
        repeated += int((per_ctx[ctx] > 1).sum())
    pairs = int(t.size * L)
    total = pairs * k
    return {"horizon": horizon, "candidates": n,
            "ceiling_recall": best / total if total else float("nan"),
            "popularity_recall": pop_best / total if total else float("nan"), "contexts": int(contexts),
            "repeated_share": repeated / pairs if pairs else float("nan"), "pairs": pairs}


def nexttoken_lists(forecaster: NextTokenForecaster, sel: np.ndarray, start: np.ndarray) -> np.ndarray:
    """int32 ``[S * L, B * n]`` (:func:`coldset.analysis.streams.instance_dtype`): the ``nexttoken``
    policy's candidate list of every (step, layer)
    group (the rows of :meth:`coldset.analysis.streams.Lanes.stream`'s groups): round robin over rank then
    lane (lane 0's best, lane 1's best, ..., lane 0's second, ...), first occurrence kept, as
    instance ids ``l * E + e``, -1 padded."""
    if forecaster.horizon != 1:
        raise ForecastError(f"the nexttoken policy prefetches for the next token (horizon 1), got {forecaster.horizon}")
    lists = forecaster.forecast_lanes(sel, start)  # [S, L, B, n]
    S, L, B, n = lists.shape
    inst = np.full((S * L, B * n), -1, dtype=instance_dtype(L * forecaster.num_experts))
    round_robin_lists(lists, forecaster.num_experts, inst)
    return inst
