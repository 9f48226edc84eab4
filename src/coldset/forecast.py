"""Forecast the next decode token's experts in every MoE layer from the current token's (issue 12, item 3).

Why: one layer of compute hides about one expert transfer over PCIe, so a cache that waits for the
router of the layer that needs an expert fetches too late; a prefetch must know, while token
``t`` computes, which experts token ``t + 1`` will select in every layer. Consecutive tokens of a
request reuse experts (the locality statistic of :mod:`coldset.stats`), and which experts follow
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
policy of :func:`coldset.cache.simulate` replays.

The next-layer lookahead (pre-gated MoE) is the other forecaster measured here: within one step,
the router of MoE layer ``l + d`` applied to layer ``l``'s router input names layer ``l + d``'s
experts ``d`` layers before its own router runs, from hidden states rather than statistics (so
from an engine run, not a trace). :func:`lookahead_recall` measures it on the selections a cache
missed (what a prefetch could hide); :func:`lookahead_predictions` gives the simulator's
``lookahead`` policy its lists. Why a layer ahead can be enough after all: at residency 0.5 a
recency cache misses about 0.1-0.5 instances per layer and token (BENCHMARKS.md, issue 12), not
the whole top-k the "one layer hides one expert" estimate assumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from coldset.trace import request_codes


class ForecastError(ValueError):
    """Bad input to the forecaster (rows, shapes, parameters); the message says what."""


@dataclass(frozen=True)
class TokenGroups:
    """Decode selections as (request, position, layer) groups of ``top_k`` experts.

    ``experts`` int64 ``[G, k]`` in rank order; ``layer`` int64 ``[G]`` (MoE-layer index);
    ``next_group`` int64 ``[G]``: the group of the same request and layer at the next position
    (-1 when that token is absent).
    """

    experts: np.ndarray
    layer: np.ndarray
    next_group: np.ndarray


def token_groups(rows: pd.DataFrame, num_moe_layers: int, num_experts: int) -> TokenGroups:
    """Group decode ``rows`` (columns request, position, layer_index, rank, expert) by (request,
    position, layer); every group must hold ranks ``0..k-1`` once (as :func:`coldset.trace.
    validate_trace` guarantees for a trace)."""
    n = len(rows)
    if n == 0:
        z = np.zeros(0, np.int64)
        return TokenGroups(np.zeros((0, 1), np.int64), z, z)
    rc, _ = request_codes(rows["request"].array if isinstance(rows["request"].dtype, pd.CategoricalDtype)
                   else rows["request"])
    pos = rows["position"].to_numpy(np.int64)
    li = rows["layer_index"].to_numpy(np.int64)
    rank = rows["rank"].to_numpy(np.int64)
    exp = rows["expert"].to_numpy(np.int64)
    if li.min() < 0 or li.max() >= num_moe_layers or exp.min() < 0 or exp.max() >= num_experts:
        raise ForecastError(f"rows: layer_index or expert outside [0, {num_moe_layers}) x [0, {num_experts})")
    n_pos = int(pos.max()) + 2
    key = (rc * n_pos + pos) * num_moe_layers + li
    order = np.lexsort((rank, key))
    key, rank, exp = key[order], rank[order], exp[order]
    starts = np.r_[0, np.flatnonzero(key[1:] != key[:-1]) + 1]
    sizes = np.diff(np.r_[starts, n])
    k = int(sizes[0])
    if (sizes != k).any() or (rank != np.tile(np.arange(k), starts.size)).any():
        raise ForecastError("rows: every (request, position, layer) must hold ranks 0..k-1 once")
    gkey = key[starts]
    nxt = np.searchsorted(gkey, gkey + num_moe_layers)
    found = nxt < gkey.size
    found[found] = gkey[nxt[found]] == gkey[found] + num_moe_layers
    return TokenGroups(exp.reshape(-1, k), gkey % num_moe_layers, np.where(found, nxt, -1))


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
    def fit(cls, rows: pd.DataFrame, num_moe_layers: int, num_experts: int, top_k: int, extra: int = 3,
            alpha: float = 1.0) -> "TransitionForecaster":
        """Fit on the consecutive decode tokens of ``rows`` (the profile selection)."""
        if extra < 0 or alpha <= 0:
            raise ForecastError(f"extra must be >= 0 and alpha > 0, got {extra}, {alpha}")
        g = token_groups(rows, num_moe_layers, num_experts)
        if g.experts.shape[0] and g.experts.shape[1] != top_k:
            raise ForecastError(f"rows hold {g.experts.shape[1]} selections per token and layer, top_k is {top_k}")
        L, E = num_moe_layers, num_experts
        has = g.next_group >= 0
        if not has.any():
            raise ForecastError("rows: no two consecutive decode tokens of one request to fit a forecaster on")
        cur, nxt, layer = g.experts[has], g.experts[g.next_group[has]], g.layer[has]
        flat = (layer[:, None, None] * E + cur[:, :, None]) * E + nxt[:, None, :]
        pairs = np.bincount(flat.reshape(-1), minlength=L * E * E).reshape(L, E, E).astype(np.float64)
        occ = np.bincount((layer[:, None] * E + cur).reshape(-1), minlength=L * E).reshape(L, E).astype(np.float64)
        pop = np.bincount((layer[:, None] * E + nxt).reshape(-1), minlength=L * E).reshape(L, E).astype(np.float64)
        pop /= np.maximum(np.bincount(layer, minlength=L), 1)[:, None]  # P(e' selected by a next token)
        table = (pairs + alpha * pop[:, None, :]) / (occ[:, :, None] + alpha)
        return cls(table.astype(np.float32), int(top_k), int(extra))

    def predict(self, layer: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """int64 ``[N, n]``: the forecast (experts, best first, ties by id) of the next token in
        ``layer[i]`` given the current token's ``experts[i]`` (``[N, k]``)."""
        layer = np.asarray(layer, dtype=np.int64)
        experts = np.asarray(experts, dtype=np.int64)
        out = np.empty((layer.size, self.num_predictions), dtype=np.int64)
        chunk = 1 << 14
        for s in range(0, layer.size, chunk):
            cur = experts[s:s + chunk]
            sc = self.table[layer[s:s + chunk, None], cur].sum(axis=1)  # [n, E]
            # the current token's own experts first (consecutive tokens keep experts), by score
            np.put_along_axis(sc, cur, np.take_along_axis(sc, cur, axis=1) + self.top_k, axis=1)
            out[s:s + chunk] = np.argsort(-sc, axis=1, kind="stable")[:, :self.num_predictions]
        return out


def forecast_recall(forecaster: TransitionForecaster, rows: pd.DataFrame, num_moe_layers: int,
                    num_experts: int) -> dict:
    """Recall one token ahead on ``rows`` (the held-out selection): over every (token, layer) whose
    next token exists, the share of the next token's selections inside the forecast. Also the
    previous-token baseline (forecast = the current token's own experts) and the forecast size."""
    g = token_groups(rows, num_moe_layers, num_experts)
    has = np.flatnonzero(g.next_group >= 0)
    if has.size == 0:
        raise ForecastError("rows: no two consecutive decode tokens of one request to measure recall on")
    pred = forecaster.predict(g.layer[has], g.experts[has])
    nxt = g.experts[g.next_group[has]]
    inside = (nxt[:, :, None] == pred[:, None, :]).any(axis=2)
    same = (nxt[:, :, None] == g.experts[has][:, None, :]).any(axis=2)
    return {"recall": float(inside.mean()), "previous_token_recall": float(same.mean()),
            "predictions": forecaster.num_predictions, "top_k": forecaster.top_k, "pairs": int(has.size),
            "table_bytes": forecaster.nbytes}


def stream_predictions(forecaster: TransitionForecaster, stream) -> np.ndarray:
    """int64 ``[G, P]``: for each group of a :class:`coldset.cache.AccessStream` (one MoE layer's
    selections of one step: ``B * top_k`` of them, token by token), the instances to prefetch
    after it: the union of each token's forecast in token order then score order, first
    occurrence kept, padded with -1."""
    E, k = stream.num_experts, forecaster.top_k
    ptr = stream.group_ptr
    sizes = np.diff(ptr)
    if (sizes % k).any():
        raise ForecastError(f"stream groups must hold a multiple of top_k = {k} selections")
    n = forecaster.num_predictions
    width = int(sizes.max(initial=k)) // k * n
    out = np.full((sizes.size, width), -1, dtype=np.int64)
    ids = stream.instances
    for b in np.unique(sizes // k):  # groups of b tokens (one size in an engine stream)
        gs = np.flatnonzero(sizes == b * k)
        sel = ids[ptr[gs][:, None] + np.arange(b * k)[None, :]]  # [g, b*k]
        layer = sel[:, 0] // E
        pred = forecaster.predict(np.repeat(layer, b), (sel % E).reshape(-1, k)).reshape(gs.size, b * n)
        pred = pred + layer[:, None] * E
        if b > 1:  # keep the first occurrence of each instance
            dup = np.zeros(pred.shape, dtype=bool)
            for j in range(1, pred.shape[1]):
                dup[:, j] = (pred[:, :j] == pred[:, j:j + 1]).any(axis=1)
            pred = np.where(dup, -1, pred)
            order = np.argsort(dup, axis=1, kind="stable")  # kept ones first, in order
            pred = np.take_along_axis(pred, order, axis=1)
        out[gs, :b * n] = pred
    return out


def lookahead_recall(hidden, routers, routing: np.ndarray, missed: np.ndarray, depth: int, extra: int = 0) -> dict:
    """The next-layer lookahead (pre-gated MoE) measured on recorded decode steps: the router of
    MoE layer ``l`` applied to the router input of layer ``l - depth`` of the same token and step,
    its top ``k + extra`` experts by logit (ties to the lower id) as the forecast of layer ``l``'s
    selections, ``depth`` layers before its router runs.

    ``hidden``: torch ``[S, L, T, H]``, each MoE layer's router input (the post-attention norm's
    output) per step and token; ``routers``: the ``L`` router weights ``[E, H]``; ``routing``:
    int ``[S, L, T, k]`` the selections; ``missed``: bool ``[S, L, T, k]``, the selections a cache
    missed (e.g. ``lru``'s per-selection ``~hit`` of :func:`coldset.cache.simulate`).

    Returns the recall on the missed selections of layers ``>= depth`` (what a prefetch could
    hide) and on all their selections, the share of missed selections in layers ``< depth`` (no
    lookahead can reach them), and the precision of the forecast (its share of experts selected).
    Logits are computed in float32 (the engine ranks the model dtype's logits; near-ties may rank
    otherwise: a measurement, not the engine's decisions)."""
    import torch

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
    :func:`coldset.cache.simulate` for an engine stream of ``S`` steps (groups in step, layer order,
    ``T`` tokens each): after group (step ``s``, layer ``l``) the instances of layer ``l + depth``
    that its router ranks in the top ``num_predictions`` on layer ``l``'s router inputs
    ``hidden[s, l]`` (token by token, then rank, first occurrence kept), -1 padded; nothing after
    the last ``depth`` layers. ``hidden`` torch ``[S, L, T, H]``, ``routers`` the ``L`` router
    weights ``[E, H]``; float32 logits, ties to the lower expert id (as :func:`lookahead_recall`)."""
    import torch

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
