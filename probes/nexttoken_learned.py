"""Probe (issue 28, item 2): does a small LEARNED model over the routing history forecast every
layer's next-token experts with recall >= 0.60 (k + 3 candidates, one token ahead) on the real
trace's held-out subject, where the integer-table NextTokenForecaster reaches 0.563? CPU only.

    PYTHONPATH=src python probes/nexttoken_learned.py                       # selection, h = 1 (~10 min)
    PYTHONPATH=src python probes/nexttoken_learned.py --horizons-from probes/nexttoken_learned.json \
        --horizons 2 4 8 --causal                                           # the chosen model at 2/4/8 ahead

Data and metric are the package's: :func:`coldset.analysis.cache.trace_decode_rows`, ``select_rows``,
``token_array`` (decode tokens ``[T, L, k]`` and their sequence ids), and every recall below is
:func:`coldset.analysis.forecast.forecast_quality` itself. A learned model is wrapped in an object with the
interface ``forecast_quality`` reads (``horizon``, ``top_k``, ``num_predictions``,
``forecast_lanes(sel, start)``), so it is scored by the same code path as the table forecaster
(first row of the table: the table forecaster as ``recall_table`` fits it, which must give
BENCHMARKS section 5's 0.563).

Models (torch, CPU, one thread), all emitting per-layer logits over E for the token ``h`` ahead,
trained by per-layer softmax cross-entropy on the profile subjects only:

- ``skip``: the current token's own experts and decayed per-sequence histories of the lane's
  experts at three fixed decays, per-layer weights (the table forecaster's history term, learned);
  ``+ learned bias``: with a per-layer popularity bias (subject-specific).
- ``bilinear d``: ``skip`` + a low-rank bilinear map from the current and two previous tokens'
  multi-hots over all L x E instances and the history multi-hot (each ``L E -> d``) to the
  ``L E`` logits (``d -> L E``).
- ``gru d``: ``skip`` + a GRU (hidden ``d``) over the per-token multi-hot embedding (``L E -> d``)
  and the decode position, with a ``d -> L E`` head.
- ``incontext``: ``skip`` + the two previous tokens' experts + an induction over the sequence's own
  routing: every earlier pair (token s, token s + h) of the sequence is weighted by
  ``exp(sum_j w_j[#layers where token s - j matched token t - j] + rho * age)`` (j = 0, 1, 2: the
  current token and its two predecessors matched as whole routing signatures across all layers),
  and the weights are spread over token s + h's experts in each layer (``log1p`` of the sum, a
  per-layer weight), beside the per-layer version (layer l's expert matched alone). Expert
  ids never enter a parameter (a few hundred weights), so it does not learn one subject's
  experts. ``+ prompt routing``: the prompt's (prefill) routing runs through the model before
  the first decode token (it feeds the histories and the induction memory; only decode tokens
  are scored).
- ``+ table ranking``: the best one blended at score level with the table forecaster's
  ranking, ``log_softmax(logits) + lam * (-log(1 + rank))``, ``lam`` chosen on validation.

Selection: fitted on abstract_algebra, validated on anatomy (model, epochs and ``lam`` chosen
there), then refitted on both with the chosen epochs and measured once on astronomy.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import replace as dataclass_replace

import numpy as np
import pandas as pd
import torch
from torch import nn

from coldset.analysis.streams import select_rows, token_array, trace_decode_rows
from coldset.core.trace import request_codes
from coldset.analysis.forecast import NextTokenForecaster, forecast_quality, lanes_per_sequence

TRACE = "../shared/data/traces/llama4-maverick-mmlu.parquet"
PROFILE, VALIDATION, REPLAY = ("abstract_algebra", "anatomy"), "anatomy", ("astronomy",)
DECAYS = (0.5, 0.85, 31 / 32)  # the history features' per-step decays (31/32 = the table forecaster's shift 5)
MAX_POS = 128
MATCH_LAGS = 3  # the in-context model matches the current token and its 2 predecessors


def prompt_tokens(trace: str, meta) -> dict:
    """Each request's prompt (prefill) routing as int64 ``[P, L, k]`` in position order, read with
    the package's trace reader (the decode rows' loader keeps decode only); every prompt token must
    hold all MoE layers and ranks."""
    from coldset.core.trace import iter_trace_batches

    L, k = meta.num_moe_layers, meta.top_k
    lut = np.full(max(meta.moe_layers) + 1, -1, dtype=np.int64)
    lut[list(meta.moe_layers)] = np.arange(L)
    parts = []
    for b in iter_trace_batches(trace, ["request", "position", "phase", "layer", "rank", "expert"]):
        f = b.to_pandas()
        parts.append(f[(f["phase"].astype(str) == "prefill") & (f["expert"] >= 0)])
    f = pd.concat(parts)
    f = f.assign(request=f["request"].astype(str), li=lut[f["layer"].to_numpy(np.int64)])
    f = f.sort_values(["request", "position", "li", "rank"])
    out = {}
    for req, g in f.groupby("request", sort=False):
        npos = g["position"].nunique()
        if len(g) != npos * L * k:
            raise ValueError(f"{trace}: request {req}'s prompt does not hold {L} MoE layers x top-{k} at every position")
        out[req] = g["expert"].to_numpy(np.int64).reshape(npos, L, k)
    return out


class RoutingModel(nn.Module):
    """Per-step next-token logits ``[B, L, E]`` from the lanes' routing so far (see the module doc)."""

    def __init__(self, kind: str, L: int, E: int, d: int = 128, horizons=(1,), causal: bool = False):
        super().__init__()
        self.kind, self.L, self.E, self.d, self.horizons = kind, L, E, d, tuple(horizons)
        self.causal = causal  # in-context: layer l's forecast sees token t's layers <= l only (made after l's router)
        nh, nd = len(self.horizons), len(DECAYS)
        self.bias = nn.Parameter(torch.zeros(nh, L, E))
        self.w_cur = nn.Parameter(torch.full((nh, L, 1), 1.0))
        self.w_hist = nn.Parameter(torch.full((nh, nd, L, 1), 0.5))
        self.register_buffer("decay", torch.tensor(DECAYS, dtype=torch.float32))
        if kind in ("bilinear", "gru"):
            self.emb = nn.Embedding(L * E + 1, d, padding_idx=L * E)  # the multi-hot times an L E x d matrix
            nn.init.normal_(self.emb.weight, std=0.02)
            with torch.no_grad():
                self.emb.weight[L * E].zero_()
            self.head = nn.Linear(d, nh * L * E)
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)
        if kind == "bilinear":
            self.emb_lag = nn.ModuleList(nn.Embedding(L * E + 1, d, padding_idx=L * E) for _ in range(2))
            self.emb_hist = nn.Linear(L * E, d, bias=False)
            for m in self.emb_lag:
                nn.init.normal_(m.weight, std=0.02)
                with torch.no_grad():
                    m.weight[L * E].zero_()
            nn.init.normal_(self.emb_hist.weight, std=0.002)
        if kind == "incontext":
            if nh != 1:
                raise ValueError("the in-context model forecasts one horizon; fit one per horizon")
            self.w_lag = nn.Parameter(torch.full((nh, 2, L, 1), 0.1))
            self.w_loc = nn.Parameter(torch.full((nh, L, 1), 0.5))
            self.w_sig = nn.Parameter(torch.full((nh, L, 1), 0.5))
            # log-weight of a past pair by how many layers token s - j matched token t - j
            self.sim_logw = nn.Parameter(torch.cat([torch.linspace(-6.0, 0.0, L + 1)[None],
                                                    torch.zeros(MATCH_LAGS - 1, L + 1)]))
            self.recency = nn.Parameter(torch.zeros(2))  # log-weight per step of age (signature, per-layer match)
        if kind == "gru":
            self.pos = nn.Embedding(MAX_POS, d)
            nn.init.normal_(self.pos.weight, std=0.02)
            self.cell = nn.GRUCell(d, d)

    def params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def run(self, ids: torch.Tensor, active: torch.Tensor, start: torch.Tensor):
        """Yield ``(t, logits [H, B, L, E])`` for each step of lanes ``ids`` int64 ``[S, B, L, k]``
        (-1 where a lane is idle), ``start`` bool ``[S, B]`` (a new sequence: state reset)."""
        S, B, L, k = ids.shape
        E = self.E
        lidx = torch.arange(L)[None, :, None] * E
        hist = torch.zeros(len(DECAYS), B, L, E)
        z = torch.zeros(B, self.d) if self.kind == "gru" else None
        lag = [torch.full((B, L, k), L * E, dtype=torch.long) for _ in range(2)]
        pos = torch.zeros(B, dtype=torch.long)
        seen = []
        begin = torch.zeros(B, dtype=torch.long)
        for t in range(S):
            act = active[t]
            st = start[t]
            keep = (~st).float()
            hist = hist * keep[None, :, None, None]
            pos = torch.where(st, torch.zeros_like(pos), pos + 1)
            flat = torch.where(ids[t] >= 0, ids[t] + lidx, torch.full_like(ids[t], L * E))  # [B, L, k]
            onehot = torch.zeros(B, L * E + 1)
            onehot.scatter_(1, flat.reshape(B, -1), 1.0)
            onehot = onehot[:, :L * E].view(B, L, E)
            hist = torch.where(act[None, :, None, None], hist * self.decay[:, None, None, None] + onehot[None], hist)
            logits = (self.bias[:, None] + self.w_cur[:, None] * onehot[None]
                      + (self.w_hist[:, :, None] * hist[None]).sum(1))  # [H, B, L, E]
            if self.kind == "bilinear":
                for j in range(2):
                    lag[j] = torch.where(st[:, None, None], torch.full_like(lag[j], L * E), lag[j])
                x = (self.emb(flat).sum((1, 2)) + self.emb_lag[0](lag[0]).sum((1, 2))
                     + self.emb_lag[1](lag[1]).sum((1, 2)) + self.emb_hist(hist[-1].reshape(B, -1)))
                logits = logits + self.head(x).view(B, -1, L, E).transpose(0, 1)
                lag = [flat, lag[0]]
            elif self.kind == "gru":
                z = z * keep[:, None]
                x = self.emb(flat).sum((1, 2)) + self.pos(pos.clamp(max=MAX_POS - 1))
                z = torch.where(act[:, None], self.cell(x, z), z)
                logits = logits + self.head(z).view(B, -1, L, E).transpose(0, 1)
            elif self.kind == "incontext":
                for j in range(2):
                    lag[j] = torch.where(st[:, None, None], torch.full_like(lag[j], L * E), lag[j])
                begin = torch.where(st, torch.full_like(begin, t), begin)
                lagged = [torch.zeros(B, L * E + 1).scatter_(1, lg.reshape(B, -1), 1.0)[:, :L * E].view(B, L, E)
                          for lg in lag]
                logits = logits + sum(self.w_lag[:, j, None] * lagged[j][None] for j in range(2))
                seen.append(torch.where(act[:, None], ids[t][..., 0], torch.full_like(ids[t][..., 0], -1)))  # rank 0
                g = self.horizons[0]  # the in-context model forecasts one horizon
                if t >= g:
                    # memory: the lane's pairs (s, s + g), s + g <= t, both in the current sequence. A
                    # pair is weighted by how many layers token s - j matched token t - j (j <
                    # MATCH_LAGS) and its age; the weights spread over the experts of token s + g (an
                    # induction over routing signatures); "loc" is the per-layer version (layer l
                    # matched, lag 0).
                    allids = torch.stack(seen, 1)  # [B, t + 1, L]
                    spos = torch.arange(t - g + 1)
                    succ = allids[:, g:]  # [B, t - g + 1, L]: token s + g
                    valid = (spos[None, :] >= begin[:, None]) & (succ[:, :, 0] >= 0)
                    age = (t - g - spos).float()[None, :]
                    logw = self.recency[0] * age
                    for j in range(MATCH_LAGS):
                        okj = (spos - j >= 0)[None, :] & (spos[None, :] - j >= begin[:, None]) & (t - j >= begin)[:, None]
                        past = allids[:, (spos - j).clamp(min=0)]  # token s - j
                        m = (past == allids[:, t - j][:, None, :]) & (past >= 0) & okj[..., None]
                        if j == 0:
                            match0 = m & valid[..., None]
                            if self.causal:  # per target layer: the matches among layers <= l
                                logw0 = self.sim_logw[0][m.cumsum(-1)]  # [B, pairs, L]
                                continue
                        logw = logw + self.sim_logw[j][m.sum(-1)] * okj + self.sim_logw[j][0] * ~okj
                    idx = succ.clamp(min=0).transpose(1, 2)  # [B, L, pairs]
                    if self.causal:
                        wsig = (logw[..., None] + logw0).exp() * valid[..., None]  # [B, pairs, L]
                        sig = torch.zeros(B, L, E).scatter_add_(2, idx, wsig.transpose(1, 2))
                    else:
                        wsig = logw.exp() * valid
                        sig = torch.zeros(B, L, E).scatter_add_(2, idx, wsig[:, None, :].expand(B, L, -1))
                    wloc = match0.float() * (self.recency[1] * age).exp()[..., None]
                    loc = torch.zeros(B, L, E).scatter_add_(2, idx, wloc.transpose(1, 2))
                    logits = logits + self.w_loc[:, None] * torch.log1p(loc)[None] + self.w_sig[:, None] * torch.log1p(sig)[None]
                lag = [flat, lag[0]]
            yield t, logits


def with_prefix(sel: np.ndarray, prefix) -> tuple[np.ndarray, np.ndarray]:
    """Lanes ``sel [S, L, N, k]`` (one sequence a lane from step 0, as lanes_per_sequence) with
    each lane's prompt tokens ``prefix[n]`` ``[P_n, L, k]`` in front: ``(ext [S + max P, L, N, k],
    offset [N])``, the lane's decode token ``t`` at ``ext[t + offset[n]]``."""
    S, L, N, k = sel.shape
    if len(prefix) != N:
        raise ValueError(f"with_prefix: {len(prefix)} prompts for {N} lanes")
    off = np.array([p.shape[0] for p in prefix], dtype=np.int64)
    ext = np.full((S + int(off.max(initial=0)), L, N, k), -1, dtype=np.int64)
    for n, p in enumerate(prefix):
        ext[:off[n], :, n] = p
        ext[off[n]:off[n] + S, :, n] = sel[:, :, n]
    return ext, off


def lanes_tensors(tokens: np.ndarray, sequence: np.ndarray, prefix=None):
    """``(ids [S, N, L, k], start [S, N], active [S, N], scored [S, N])``: the sequences as lanes,
    with their prompts in front when ``prefix`` is given (prompt steps are not scored)."""
    sel, start, step, lane = lanes_per_sequence(tokens, sequence)  # sel [S, L, N, k]
    scored = sel[:, 0, :, 0] >= 0
    if prefix is not None:
        sel, off = with_prefix(sel, prefix)
        scored = np.zeros(sel.shape[0::2][:2], dtype=bool)
        scored[step + off[lane], lane] = True
        start = np.zeros(scored.shape, dtype=bool)
        start[0] = True
    ids = torch.from_numpy(np.ascontiguousarray(sel.transpose(0, 2, 1, 3)))  # [S, N, L, k]
    return ids, torch.from_numpy(start), ids[:, :, 0, 0] >= 0, torch.from_numpy(scored)


def train(kind: str, tokens, sequence, L, E, *, d, epochs, lr, wd, horizons=(1,), lanes_per_batch=8,
          val=None, seed=0, log=None, learn_bias=True, prefix=None, causal=False):
    """Fit a RoutingModel on the sequences of ``tokens``; with ``val`` (a function model -> recall),
    the validation recall after each epoch. Returns (model, [val recall per epoch], seconds)."""
    torch.manual_seed(seed)
    model = RoutingModel(kind, L, E, d, horizons, causal)
    model.bias.requires_grad_(learn_bias)  # the per-layer popularity: subject-specific, it may not transfer
    ids, start, active, scored = lanes_tensors(tokens, sequence, prefix)
    S, N = active.shape
    big = [p for n, p in model.named_parameters() if n.startswith(("emb", "head", "cell", "pos"))]
    small = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith(("emb", "head", "cell", "pos"))]
    opt = torch.optim.Adam([{"params": small, "weight_decay": 0.0}, {"params": big, "weight_decay": wd}], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    curve = []
    t0 = time.perf_counter()
    for ep in range(epochs):
        model.train()
        for b in torch.randperm(N, generator=gen).split(lanes_per_batch):
            bid, bst, bact, bsc = ids[:, b], start[:, b], active[:, b], scored[:, b]
            last = int(bact.any(1).nonzero().max()) + 1
            loss_sum, count = 0.0, 0
            for t, logits in model.run(bid[:last], bact[:last], bst[:last]):
                for i, h in enumerate(model.horizons):
                    if t + h >= last:
                        continue
                    ok = bsc[t] & bsc[t + h] & ~bst[t + 1:t + h + 1].any(0)
                    if not ok.any():
                        continue
                    tgt = bid[t + h, ok, :, 0]  # [b, L] (top-1 traces: the rank-0 expert is the label)
                    lp = torch.log_softmax(logits[i, ok], -1)
                    loss_sum = loss_sum - lp.gather(-1, tgt[..., None]).sum()
                    count += tgt.numel()
            loss = loss_sum / max(count, 1)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if val is not None:
            curve.append(val(model))
            if log:
                log(f"  {kind} d={d} epoch {ep + 1}: loss {float(loss.detach()):.4f} validation recall {curve[-1]:.4f}")
    return model, curve, time.perf_counter() - t0


class LearnedForecast:
    """A fitted RoutingModel (one of its horizons) in the interface :func:`forecast_quality`
    reads; optionally blended with a table forecaster's ranking (``lam * -log(1 + rank)``)."""

    def __init__(self, model: RoutingModel, horizon: int, top_k: int, extra: int = 3, table=None, lam: float = 0.0,
                 prefix=None):
        self.model, self.horizon, self.top_k, self.extra, self.prefix = model, horizon, top_k, extra, prefix
        self.table, self.lam = table, lam
        self.num_predictions = min(top_k + extra, model.E)
        self.head = model.horizons.index(horizon)

    def forecast_lanes(self, sel: np.ndarray, start: np.ndarray) -> np.ndarray:
        S, L, B, k = sel.shape
        E, n = self.model.E, self.num_predictions
        ids = torch.from_numpy(np.ascontiguousarray(sel.transpose(0, 2, 1, 3)))
        st = torch.from_numpy(np.asarray(start, dtype=bool))
        act = ids[:, :, 0, 0] >= 0
        scores = torch.empty(S, B, L, E)
        self.model.eval()
        if self.prefix is not None:  # the prompts' routing in front of each lane's decode tokens
            if np.asarray(start)[1:].any() or not np.asarray(start)[0].all():
                raise ValueError("LearnedForecast with prompts: one sequence a lane from step 0 expected")
            ext, off = with_prefix(sel, self.prefix)
            eids = torch.from_numpy(np.ascontiguousarray(ext.transpose(0, 2, 1, 3)))
            est = torch.zeros(ext.shape[0], B, dtype=torch.bool)
            est[0] = True
            lanes = torch.arange(B)
            with torch.no_grad():
                for t, logits in self.model.run(eids, eids[:, :, 0, 0] >= 0, est):
                    tt = t - torch.from_numpy(off)  # the decode step each lane is at
                    m = (tt >= 0) & (tt < S)
                    if m.any():
                        scores[tt[m], lanes[m]] = torch.log_softmax(logits[self.head][m], -1)
        else:
            with torch.no_grad():
                for t, logits in self.model.run(ids, act, st):
                    scores[t] = torch.log_softmax(logits[self.head], -1)
        if self.table is not None and self.lam:
            scores += self.lam * table_bonus(self.table, sel, start)
        # top-n, ties to the lower expert id (a stable sort of the negated scores)
        top = torch.sort(-scores, dim=-1, stable=True).indices[..., :n].numpy()  # [S, B, L, n]
        out = top.transpose(0, 2, 1, 3).astype(np.int64)
        out[np.broadcast_to((~act.numpy())[:, None, :, None], out.shape)] = -1
        return out


_BONUS: dict = {}


def table_bonus(table: NextTokenForecaster, sel: np.ndarray, start: np.ndarray) -> torch.Tensor:
    """``-log(1 + rank)`` of every expert in the table forecaster's whole ranking, ``[S, B, L, E]``
    (its own forecast_lanes with ``extra = E - k``: the full order, ties to the lower id); cached."""
    key = (id(table), sel.shape, hash(sel.tobytes()), hash(np.asarray(start).tobytes()))
    if key not in _BONUS:
        S, L, B, _ = sel.shape
        E = table.num_experts
        full = dataclass_replace(table, extra=E - table.top_k)
        out = torch.empty(S, B, L, E)
        for b0 in range(0, B, 32):
            order = full.forecast_lanes(sel[:, :, b0:b0 + 32], start[:, b0:b0 + 32])  # [S, L, b, E]
            rank = np.empty_like(order)
            np.put_along_axis(rank, np.maximum(order, 0), np.arange(E)[None, None, None, :], axis=3)
            out[:, b0:b0 + 32] = torch.from_numpy(-np.log1p(rank.astype(np.float32)).transpose(0, 2, 1, 3))
        _BONUS[key] = out
    return _BONUS[key]


def cost(kind: str, d: int, L: int, E: int, k: int, context: int = 192, nh: int = len(DECAYS)) -> dict:
    """Work of one decode step at batch 1 (every layer's forecast), counted from the model's form:
    multiply-adds (or adds / compares), weight bytes read (fp32; half at bf16) and the state a
    sequence keeps (fp32 histories; the in-context memory as int16 expert ids of ``context`` past
    tokens: this trace's longest prompt + decode is 187 tokens)."""
    LE = L * E
    macs = 2 * nh * LE + LE * (nh + 1)  # the histories' update, the skip logits (bias, own experts, histories)
    wbytes = 4 * LE * 1 + 4 * L * (nh + 1)  # the bias and the per-layer weights
    state = 4 * nh * LE
    if kind == "bilinear":
        macs += 3 * L * k * d + LE * d + d * LE  # 3 gathers of L k embedding rows, history L E x d, head d x L E
        wbytes += 4 * (3 * L * k * d + LE * d + d * LE + LE)  # gathered embedding rows, dense history map, head
        state += 2 * 2 * L * k
    elif kind == "gru":
        macs += L * k * d + 3 * (2 * d * d) + d * LE
        wbytes += 4 * (L * k * d + d + 6 * d * d + 3 * 2 * d + d * LE + LE)  # rows gathered, position row, GRU, head
        state += 4 * d
    elif kind == "incontext":
        # 2 lags; per past pair: L k^2 compares, L k scatter-adds of the match and L k of the weighted successor
        macs += 2 * LE + context * L * (k * k + 2 * k) + 2 * LE
        wbytes += 4 * (4 * L + L + 1)
        state += 2 * (2 * context * L * k + 2 * L * k)
    elif kind != "skip":
        raise ValueError(kind)
    return {"macs_per_step_b1": int(macs), "weight_bytes_read_per_step_b1_fp32": int(wbytes),
            "state_bytes_per_sequence": int(state)}


def costs(kind: str, d: int, L: int, E: int, k: int) -> dict:
    """:func:`cost` at the trace's shape and at the engine's Qwen3-30B-A3B shape (48 x 128, top-8)."""
    here, engine = cost(kind, d, L, E, k), cost(kind, d, 48, 128, 8)
    return {**here, "at_48x128_top8": engine}


def table_cost(f: NextTokenForecaster) -> dict:
    """The table forecaster's own count (NextTokenForecaster.ops_per_step), here and at 48 x 128 top-8."""
    def one(ff):
        ops = ff.ops_per_step(1)
        return {"macs_per_step_b1": ops["int_adds"], "weight_bytes_read_per_step_b1_fp32": ops["bytes_read"],
                "state_bytes_per_sequence": 4 * ff.num_layers * ff.num_experts, "table_bytes": ff.nbytes}
    big = NextTokenForecaster(f.terms, np.zeros((len(f.terms), 48, 128, 128), np.int32), f.hist_unit, f.hist_shift, 8)
    return {**one(f), "at_48x128_top8": one(big)}


def horizons_table(row, horizons, tp, sp, th, sh, val, k, E, L, *, ppre, hpre, quality, log) -> list:
    """The chosen learned model refitted on the whole profile for each horizon (h = 1's epochs), and
    the table forecaster fitted as recall_table does, both measured on the held-out subject."""
    out = []
    for h in horizons:
        ft = NextTokenForecaster.fit_tuned(tp, sp, k, E, horizon=h, validation=val)
        qt = quality(ft, th, sh)
        m, _, secs = train(row["kind"], tp, sp, L, E, d=row["d"], epochs=row["epochs"], lr=row["lr"], wd=row["wd"],
                           learn_bias=row["learn_bias"], prefix=ppre if row["prompts"] else None, horizons=(h,))
        ql = quality(LearnedForecast(m, h, k, prefix=hpre if row["prompts"] else None), th, sh)
        out.append({"horizon": h, "table_recall_k+3": qt[0], "table_recall_k": qt[1], "learned_recall_k+3": ql[0],
                    "learned_recall_k": ql[1], "learned_fit_s": secs})
        log(f"{h} ahead: table {qt[0]:.4f} (k+3), {row['model']} {ql[0]:.4f} (k+3), {ql[1]:.4f} (k)")
    return out


def seen_share(tokens: np.ndarray, sequence: np.ndarray, prefix=None, horizon: int = 1) -> float:
    """Share of the selections ``horizon`` tokens ahead (the metric's pairs) that the same layer of
    the same sequence selected at or before the current token (with ``prefix``: the prompt's
    too): what an in-context forecast can rank at all, whatever the candidate count."""
    starts = np.r_[0, np.flatnonzero(sequence[1:] != sequence[:-1]) + 1, sequence.size]
    T, L, k = tokens.shape
    hit = tot = 0
    for i in range(starts.size - 1):
        seq = tokens[starts[i]:starts[i + 1]]
        pre = prefix[i] if prefix is not None else seq[:0]
        allt = np.concatenate([pre, seq])  # [P + n, L, k]
        first = np.full((L, tokens.max() + 1), np.iinfo(np.int64).max)
        for t in range(allt.shape[0] - 1, -1, -1):  # earliest step each (layer, expert) appears
            for r in range(k):
                first[np.arange(L), allt[t, :, r]] = t
        t = np.arange(seq.shape[0] - horizon) + pre.shape[0]
        tgt = allt[t + horizon]  # [m, L, k]
        hit += int((first[np.arange(L)[None, :, None], tgt] <= t[:, None, None]).sum())
        tot += tgt.size
    return hit / max(tot, 1)


def print_horizons(name: str, ahead: list) -> None:
    print(f"\nheld-out astronomy, {name} (refitted per horizon) against the table forecaster")
    print(f"{'ahead':>5s} {'learned k+3':>11s} {'learned k':>9s} {'table k+3':>9s} {'table k':>7s}")
    for a in ahead:
        print(f"{a['horizon']:5d} {a['learned_recall_k+3']:11.4f} {a['learned_recall_k']:9.4f} {a['table_recall_k+3']:9.4f} "
              f"{a['table_recall_k']:7.4f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--out", default="probes/nexttoken_learned.json")
    ap.add_argument("--epochs", type=int, default=7, help="most epochs of the in-context candidates on the validation fit")
    ap.add_argument("--horizons", type=int, nargs="+", default=[1],
                    help="horizons for the chosen learned model (each refitted; 1 comes from the selection)")
    ap.add_argument("--horizons-from", metavar="JSON",
                    help="skip the selection: refit the model chosen in JSON (an earlier run's --out) at --horizons, "
                         "beside the table forecaster, and add the table to JSON")
    ap.add_argument("--causal", action="store_true",
                    help="with --horizons-from: also refit the chosen in-context model with layer l's forecast "
                         "seeing only token t's layers <= l (when the engine could make it)")
    ap.add_argument("--quick", action="store_true", help="fewer candidates (a smoke run)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t_all = time.perf_counter()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    rows, meta = trace_decode_rows(args.trace, 0.25)
    L, E, k = meta.num_moe_layers, meta.num_experts, meta.top_k
    if k != 1:
        raise SystemExit(f"{args.trace}: this probe's loss takes the rank-0 expert as the label (top-1); top-{k}")
    profile = select_rows(rows, None, list(PROFILE))
    replay = select_rows(rows, None, list(REPLAY))
    tp, sp = token_array(profile, L, E)
    th, sh = token_array(replay, L, E)
    _, names = request_codes(profile["request"].array if isinstance(profile["request"].dtype, pd.CategoricalDtype)
                             else profile["request"])
    dom_of = dict(zip(profile["request"].astype(str).to_numpy(), profile["domain"].astype(str).to_numpy()))
    val = np.array([dom_of[names[s]] == VALIDATION for s in sp])  # recall_table's validation part
    tr = ~val
    n = min(k + 3, E)

    def quality(f, tokens, seq):
        q = forecast_quality(f, tokens, seq, (k,))
        return q["recall"], q[f"recall_at_{k}"], q["precision"]

    results = []
    # 1. the table forecaster exactly as recall_table fits it (BENCHMARKS section 5: 0.563)
    t0 = time.perf_counter()
    tab = NextTokenForecaster.fit_tuned(tp, sp, k, E, horizon=1, validation=val)
    fit_s = time.perf_counter() - t0
    # its validation number: the same parameters, tables fitted on abstract_algebra only
    tab_tr = NextTokenForecaster.fit(tp[tr], sp[tr], k, E, hist_beta=tab.hist_unit / 65536, hist_shift=tab.hist_shift,
                                     self_boost=tab.self_boost)
    rv = quality(tab_tr, tp[val], sp[val])
    rh = quality(tab, th, sh)
    results.append({"model": "table (NextTokenForecaster.fit_tuned, the existing forecaster)", "params": int(tab.tables.size),
                    "validation_recall": rv[0], "heldout_recall_k+3": rh[0], "heldout_recall_k": rh[1],
                    "heldout_precision_k+3": rh[2], "fit_s": fit_s, **table_cost(tab)})
    log(f"table forecaster: validation {rv[0]:.4f}, held-out astronomy {rh[0]:.4f} (k+3), {rh[1]:.4f} (k), {fit_s:.0f} s")

    # the prompts' routing, lane by lane (token_array numbers sequences in request order: lanes in that order)
    prompts = prompt_tokens(args.trace, meta)
    _, rnames = request_codes(replay["request"].array if isinstance(replay["request"].dtype, pd.CategoricalDtype)
                              else replay["request"])
    for seq in (sp, sh):
        if (np.diff(seq) < 0).any():
            raise SystemExit("token_array's sequences are not in lane order")
    pre_of = lambda seq, nm: [prompts[nm[c]] for c in np.unique(seq)]  # noqa: E731

    # 2. learned candidates: fitted on abstract_algebra, validated on anatomy, best epoch kept
    # (kind, d, lr, weight decay, learn the per-layer bias, with the prompts, most epochs)
    if args.horizons_from:
        with open(args.horizons_from) as fh:
            prev = json.load(fh)
        row = next(r for r in prev["rows"] if r["model"] == prev["chosen"])
        row.setdefault("prompts", False)
        ahead = horizons_table(row, [h for h in args.horizons if h != 1], tp, sp, th, sh, val, k, E, L,
                               ppre=pre_of(sp, names), hpre=pre_of(sh, rnames), quality=quality, log=log)
        prev["horizons"] = [a for a in prev.get("horizons", []) if a["horizon"] == 1] + ahead
        prev["seen_share"] = {f"{h}_ahead": {"decode_only": seen_share(th, sh, None, h),
                                             "with_prompt": seen_share(th, sh, pre_of(sh, rnames), h)}
                              for h in [1] + [h for h in args.horizons if h != 1]}
        log(f"held-out selections seen earlier in their sequence and layer: {prev['seen_share']}")
        if row["kind"] == "incontext" and args.causal:
            # the engine's timing: layer l's forecast made right after layer l's router at step t
            m, _, secs = train(row["kind"], tp, sp, L, E, d=row["d"], epochs=row["epochs"], lr=row["lr"], wd=row["wd"],
                               learn_bias=row["learn_bias"], prefix=pre_of(sp, names) if row["prompts"] else None,
                               causal=True)
            qc = quality(LearnedForecast(m, 1, k, prefix=pre_of(sh, rnames) if row["prompts"] else None), th, sh)
            prev["causal_within_step"] = {"model": row["model"] + ", layers <= l of the current token",
                                          "heldout_recall_k+3": qc[0], "heldout_recall_k": qc[1],
                                          "heldout_precision_k+3": qc[2], "fit_s": secs}
            log(f"causal within the step: held-out astronomy {qc[0]:.4f} (k+3) {qc[1]:.4f} (k)")
        prev["horizons_command"] = "PYTHONPATH=src python probes/nexttoken_learned.py " + " ".join(sys.argv[1:])
        prev["horizons_s"] = time.perf_counter() - t_all
        print_horizons(prev["chosen"], prev["horizons"])
        with open(args.horizons_from, "w") as fh:
            json.dump(prev, fh, indent=1)
        return 0

    ep_ = args.epochs
    cands = [("skip", 0, 2e-2, 0.0, True, False, 3), ("skip", 0, 2e-2, 0.0, False, False, 3),
             ("bilinear", 64, 3e-3, 1e-5, False, False, 2), ("gru", 128, 3e-3, 1e-5, False, False, 3),
             ("incontext", 0, 2e-2, 0.0, False, False, ep_), ("incontext", 0, 2e-2, 0.0, False, True, ep_)]
    if args.quick:
        cands = [("skip", 0, 2e-2, 0.0, False, False, 1), ("gru", 32, 3e-3, 1e-5, False, False, 1),
                 ("incontext", 0, 2e-2, 0.0, False, True, 1)]
    best = None
    for kind, d, lr, wd, learn_bias, use_prompts, epochs in cands:
        vpre = pre_of(sp[val], names) if use_prompts else None
        vfun = lambda m: quality(LearnedForecast(m, 1, k, prefix=vpre), tp[val], sp[val])[0]  # noqa: E731
        m, curve, secs = train(kind, tp[tr], sp[tr], L, E, d=d, epochs=epochs, lr=lr, wd=wd, val=vfun, log=log,
                               learn_bias=learn_bias, prefix=pre_of(sp[tr], names) if use_prompts else None)
        ep = int(np.argmax(curve)) + 1
        name = ((kind if kind in ("skip", "incontext") else f"{kind} d={d}") + (" + learned bias" if learn_bias else "")
                + (" + prompt routing" if use_prompts else ""))
        row = {"model": name, "kind": kind, "d": d, "lr": lr, "wd": wd, "learn_bias": learn_bias,
               "prompts": use_prompts, "params": sum(p.numel() for p in m.parameters() if p.requires_grad),
               "validation_recall": max(curve), "validation_curve": curve, "epochs": ep,
               "validation_fit_s": secs, **costs(kind, d, L, E, k)}
        log(f"{row['model']}: best validation {max(curve):.4f} at epoch {ep} ({secs:.0f} s)")
        results.append(row)
        if best is None or row["validation_recall"] > best[0]["validation_recall"]:
            best = (row, m)
    # the blend with the table forecaster's ranking, lam on validation (tables from abstract_algebra)
    row, m = best
    vpre = pre_of(sp[val], names) if row["prompts"] else None
    lams = (0.0, 0.1, 0.2, 0.4, 0.8)
    blend = {lam: quality(LearnedForecast(m, 1, k, table=tab_tr, lam=lam, prefix=vpre), tp[val], sp[val])[0]
             for lam in lams}
    lam = max(lams, key=lambda x: (blend[x], -x))
    log(f"blend {row['model']} + table: validation {blend}")

    # 3. refit the learned candidates on the whole profile with their chosen epochs; astronomy once each
    ppre, hpre = pre_of(sp, names), pre_of(sh, rnames)
    for r in list(results[1:]):
        m, _, secs = train(r["kind"], tp, sp, L, E, d=r["d"], epochs=r["epochs"], lr=r["lr"], wd=r["wd"],
                           learn_bias=r["learn_bias"], prefix=ppre if r["prompts"] else None)
        rh = quality(LearnedForecast(m, 1, k, prefix=hpre if r["prompts"] else None), th, sh)
        r.update({"heldout_recall_k+3": rh[0], "heldout_recall_k": rh[1], "heldout_precision_k+3": rh[2], "fit_s": secs})
        log(f"{r['model']}: held-out astronomy {rh[0]:.4f} (k+3) {rh[1]:.4f} (k), refit {secs:.0f} s")
        if r is row:
            rb = quality(LearnedForecast(m, 1, k, table=tab, lam=lam, prefix=hpre if r["prompts"] else None), th, sh)
            tc = table_cost(tab)
            results.append({**r, "model": f"{r['model']} + table ranking (lam {lam})", "lam": lam,
                            "params": r["params"] + int(tab.tables.size),
                            "validation_recall": blend[lam], "validation_blend": {str(x): y for x, y in blend.items()},
                            "heldout_recall_k+3": rb[0], "heldout_recall_k": rb[1], "heldout_precision_k+3": rb[2],
                            "fit_s": secs + fit_s,
                            **{c: r[c] + tc[c] for c in ("macs_per_step_b1", "weight_bytes_read_per_step_b1_fp32",
                                                         "state_bytes_per_sequence")},
                            "at_48x128_top8": {c: r["at_48x128_top8"][c] + tc["at_48x128_top8"][c]
                                               for c in ("macs_per_step_b1", "weight_bytes_read_per_step_b1_fp32",
                                                         "state_bytes_per_sequence")}})
            log(f"  + table (lam {lam}): held-out astronomy {rb[0]:.4f} (k+3) {rb[1]:.4f} (k)")

    # 4. further horizons (optional here; see --horizons-from)
    ahead = [{"horizon": 1, "table_recall_k+3": results[0]["heldout_recall_k+3"],
              "table_recall_k": results[0]["heldout_recall_k"], "learned_recall_k+3": row["heldout_recall_k+3"],
              "learned_recall_k": row["heldout_recall_k"]}]
    ahead += horizons_table(row, [h for h in args.horizons if h != 1], tp, sp, th, sh, val, k, E, L,
                            ppre=ppre, hpre=hpre, quality=quality, log=log)

    out = {"command": "PYTHONPATH=src python probes/nexttoken_learned.py " + " ".join(sys.argv[1:]),
           "trace": args.trace, "profile": PROFILE, "validation": VALIDATION, "replay": REPLAY,
           "layers": L, "experts": E, "top_k": k, "candidates": n, "device": "CPU, torch.set_num_threads(1)",
           "torch": torch.__version__, "tree": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                              capture_output=True, text=True).stdout.strip(),
           "rows": results, "horizons": ahead, "chosen": row["model"], "total_s": time.perf_counter() - t_all}
    print(f"{'model':48s} {'params':>8s} {'val':>6s} {'astro k+3':>9s} {'astro k':>7s} {'fit s':>5s} "
          f"{'MAC/step':>9s} {'B/step':>9s} {'state B':>8s} | 48x128 top-8: {'MAC/step':>9s} {'B/step':>9s} {'state B':>8s}")
    for r in results:
        g = r["at_48x128_top8"]
        print(f"{r['model']:48s} {r['params']:8d} {r['validation_recall']:6.4f} {r.get('heldout_recall_k+3', float('nan')):9.4f} "
              f"{r.get('heldout_recall_k', float('nan')):7.4f} {r.get('fit_s', float('nan')):5.0f} "
              f"{r['macs_per_step_b1']:9d} {r['weight_bytes_read_per_step_b1_fp32']:9d} {r['state_bytes_per_sequence']:8d} |"
              f"               {g['macs_per_step_b1']:9d} {g['weight_bytes_read_per_step_b1_fp32']:9d} {g['state_bytes_per_sequence']:8d}")
    print_horizons(row["model"], ahead)
    print(f"total {out['total_s']:.0f} s")
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
