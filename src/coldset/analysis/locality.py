"""The locality statistic: how much consecutive decode tokens of a request share their experts.

Per MoE layer, the overlap of consecutive decode tokens' expert sets against the same tokens
shuffled within their request (the lift is their ratio), and the reuse distances of (layer,
expert) instances; definitions in ``LOCALITY_DEFINITIONS`` (also written into ``locality.json``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from coldset.analysis.skew import layer_dict, nanmean
from coldset.core.trace import TraceMeta


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
        share = float(((distances >= lo) & (distances <= hi)).sum() / n) if n else None
        out[str(hi) if hi == lo else f"{lo}-{hi}"] = share
        lo = hi + 1
    out[f">{REUSE_BUCKETS[-1]}"] = float((distances > REUSE_BUCKETS[-1]).sum() / n) if n else None
    out["first"] = float((distances == 0).sum() / n) if n else None
    return out


def locality_stats(rows: pd.DataFrame, meta: TraceMeta, seed: int = 0) -> dict[str, Any]:
    """The locality statistic of decode rows (``coldset.analysis.streams.trace_decode_rows``'s frame), JSON-ready."""
    sel, req, pos = decode_tokens(rows, meta.num_moe_layers, meta.top_k)
    cons = consecutive_overlap(sel, req, pos)
    shuf = shuffled_overlap(sel, req, seed)
    c, s = nanmean(cons), nanmean(shuf)
    return {
        "definitions": LOCALITY_DEFINITIONS,
        "seed": int(seed),
        "tokens": int(sel.shape[0]),
        "requests": int(np.unique(req).size),
        "consecutive_overlap": {"mean": c, "per_layer": layer_dict(meta, cons)},
        "shuffled_overlap": {"mean": s, "per_layer": layer_dict(meta, shuf)},
        "lift": (c / s) if (c is not None and s) else None,
        "reuse_distance": reuse_histogram(reuse_distances(sel, req, pos)),
    }
