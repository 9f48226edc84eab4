"""Probe (issue 28, item 2): the next-token forecast's recall on the real trace's profile split,
for choices inside NextTokenForecaster's form (H's grid, alpha, terms, log tables, tables fitted
by softmax cross-entropy with per-layer weights) and one form change (two history timescales).
Every number is on the profile's validation part: fitted on abstract_algebra, measured on
anatomy; the replay subject (astronomy) is never read. CPU only.

    PYTHONPATH=src python probes/nexttoken_recall_form.py [grid|alpha_terms|log|two|disc]

Measured (CPU, 2 shared cores): see coldset.analysis.forecast's note under HIST_GRID and issue 28's report.
"""
import sys
import time
from dataclasses import replace as dataclass_replace

import numpy as np
import pandas as pd

from coldset.analysis.streams import select_rows, token_array, trace_decode_rows
from coldset.core.trace import request_codes
from coldset.analysis.forecast import SCORE_UNIT, NextTokenForecaster as N, forecast_quality

TRACE = "../shared/data/traces/llama4-maverick-mmlu.parquet"
rows, meta = trace_decode_rows(TRACE, 0.25)
L, E, k = meta.num_moe_layers, meta.num_experts, meta.top_k
profile = select_rows(rows, None, ["abstract_algebra", "anatomy"])
tp, sp = token_array(profile, L, E)
_, names = request_codes(profile["request"].array if isinstance(profile["request"].dtype, pd.CategoricalDtype)
                         else profile["request"])
dom_of = dict(zip(profile["request"].astype(str).to_numpy(), profile["domain"].astype(str).to_numpy()))
val = np.array([dom_of[names[s]] == "anatomy" for s in sp])  # fit_tuned's validation in recall_table
tr = ~val
def ev(terms, weights, alpha=1.0, boost=0.0, hist=((0.2,5),), h=1):
    base = N.fit(tp[tr], sp[tr], k, E, horizon=h, terms=terms, weights=weights, alpha=alpha, self_boost=boost)
    out = []
    for b, s in hist:
        f = dataclass_replace(base, hist_unit=int(round(b*SCORE_UNIT)), hist_shift=int(s))
        out.append((b, s, forecast_quality(f, tp[val], sp[val])["recall"]))
    return out

def probs(tokens, sequence, terms, h, alpha):
    T, L, k = tokens.shape
    out = []
    for (a, d) in terms:
        t = np.arange(a, T - h)
        t = t[(sequence[t - a] == sequence[t]) & (sequence[t + h] == sequence[t])]
        lt = np.arange(max(0, d), min(L, L + d))
        P = np.full((L, E, E), 1.0 / E)
        src = tokens[t - a][:, lt - d]; tgt = tokens[t + h][:, lt]
        lay = np.broadcast_to(lt[None, :, None, None], (t.size, lt.size, k, k))
        flat = ((lay * E + src[:, :, :, None]) * E + tgt[:, :, None, :]).reshape(-1)
        pairs = np.bincount(flat, minlength=L * E * E).reshape(L, E, E).astype(np.float64)
        occ = np.bincount((lt[None, :, None] * E + src).reshape(-1), minlength=L * E).reshape(L, E)
        pop = np.bincount((lt[None, :, None] * E + tgt).reshape(-1), minlength=L * E).reshape(L, E) / t.size
        pop = (pop + 1e-3) / (pop + 1e-3).sum(-1, keepdims=True)
        P[lt] = ((pairs + alpha * pop[:, None, :]) / (occ[:, :, None] + alpha))[lt]
        out.append(P)
    return out
def logfit(tokens, sequence, terms, weights, h=1, alpha=1.0, scale=1.0):
    Ps = probs(tokens, sequence, terms, h, alpha)
    tabs = []
    for P, w in zip(Ps, weights):
        lg = np.log(P); lg = lg - lg.min(-1, keepdims=True)
        tabs.append(np.rint(lg * w * scale * SCORE_UNIT / 16).astype(np.int32))
    return N(tuple(terms), np.stack(tabs), 0, 5, k, 3, h)


from coldset.analysis.forecast import lanes_per_sequence
def recall2(f, tokens, sequence, hs):
    """recall of forecaster f's tables + sum of histories hs=[(unit, shift)], horizon f.horizon."""
    sel, start, step, lane = lanes_per_sequence(tokens, sequence)
    S, L, B, k = sel.shape; E = f.num_experts; n = f.num_predictions; h = f.horizon
    Hs = [np.zeros((L, B, E), np.int64) for _ in hs]
    hit = tot = 0
    lidx = np.arange(L)[:, None, None]; bidx = np.arange(B)[None, :, None]
    tie = (E - 1 - np.arange(E))[None, None, :]
    for s in range(S):
        act = sel[s, 0, :, 0] >= 0
        onehot = np.zeros((L, B, E), bool); onehot[lidx, bidx, np.maximum(sel[s], 0)] = True; onehot &= act[None, :, None]
        score = np.zeros((L, B, E), np.int64)
        for i, (u, sh) in enumerate(hs):
            Hs[i] = Hs[i] - (Hs[i] >> sh) + u * onehot; score += Hs[i]
        for j, (a, d) in enumerate(f.terms):
            if s < a: continue
            lt = np.arange(max(0, d), min(L, L + d))
            src = sel[s - a][lt - d]
            rows = f.tables[j][lt[:, None, None], np.maximum(src, 0)]
            score[lt] += np.where((src >= 0)[..., None], rows, 0).sum(2)
        if s + h >= S: break
        nxt = sel[s + h]; ok = act & (nxt[0, :, 0] >= 0)
        top = np.argpartition(-(score * E + tie), n - 1, axis=2)[..., :n]  # [L, B, n]
        inside = (nxt[..., :, None] == top[:, :, None, :]).any(-1)  # [L, B, k]
        hit += inside[:, ok].sum(); tot += inside[:, ok].size
    return hit / tot


U = 1 << 16
def hist(tokens, sequence, shift):
    T, L, k = tokens.shape
    H = np.zeros((T, L, E), np.int64); cur = np.zeros((L, E), np.int64)
    for t in range(T):
        if t == 0 or sequence[t] != sequence[t - 1]: cur[:] = 0
        cur = cur - (cur >> shift)
        for r in range(k): cur[np.arange(L), tokens[t, :, r]] += U
        H[t] = cur
    return H
def feats(tokens, sequence, Ps, terms, shift, h):
    T, L, k = tokens.shape
    H = hist(tokens, sequence, shift).astype(np.float32) / U
    t = np.arange(T - h); t = t[sequence[t + h] == sequence[t]]
    F = []  # [J, n, L, E]
    for (a, d), P in zip(terms, Ps):
        ok = (t - a >= 0) & (sequence[np.maximum(t - a, 0)] == sequence[t])
        lt = np.arange(L); src = lt - d; okl = (src >= 0) & (src < L)
        rows = np.zeros((t.size, L, E), np.float32)
        for r in range(k):
            e = tokens[np.maximum(t - a, 0)][:, np.clip(src, 0, L - 1), r]  # [n, L]
            rows += P[lt[None, :], e]
        rows *= (ok[:, None] & okl[None, :])[..., None]
        F.append(rows)
    diag = np.zeros((t.size, L, E), np.float32)
    for r in range(k): diag[np.arange(t.size)[:, None], np.arange(L)[None, :], tokens[t][:, :, r]] = 1
    tgt = tokens[t + h]  # [n, L, k]
    return torch.tensor(H[t]), torch.tensor(np.stack(F)), torch.tensor(diag), torch.tensor(tgt)
def train(Hf, F, D, tgt, L, iters=120, l2=1e-3):
    J = F.shape[0]
    hw = torch.zeros(L, requires_grad=True); cw = torch.zeros(J, L, requires_grad=True)
    g = torch.zeros(L, requires_grad=True); b = torch.zeros(L, E, requires_grad=True)
    with torch.no_grad(): hw += np.log(0.8); cw += 0.0
    opt = torch.optim.Adam([hw, cw, g, b], lr=0.1)
    for i in range(iters):
        s = hw.exp()[None, :, None] * Hf + (cw.exp()[:, None, :, None] * F).sum(0) + g[None, :, None] * D + b[None]
        lp = torch.log_softmax(s, -1)
        loss = -lp.gather(-1, tgt).mean() + l2 * (b ** 2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    return hw.detach().exp().numpy(), cw.detach().exp().numpy(), g.detach().numpy(), b.detach().numpy()
def to_int(Ps, terms, hw, cw, g, b, shift, h, scale=U):
    L = hw.size
    tabs = []
    for j, P in enumerate(Ps):
        T = P * (cw[j] / hw)[:, None, None]
        if terms[j] == (0, 0):
            T = T + (b / hw[:, None])[:, None, :] + (g / hw)[:, None, None] * np.eye(E)[None]
        T = T - T.min(-1, keepdims=True)
        tabs.append(np.rint(T * scale).astype(np.int32))
    return N(tuple(terms), np.stack(tabs), int(scale), shift, k, 3, h)

D, W = ((0, 0), (1, 0), (2, 0)), (1.0, 0.5, 0.25)
if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "grid"
    if what == "grid":
        grid = [(b, s) for b in (0.1, 0.2, 0.4, 0.8, 1.6, 3.2) for s in (3, 4, 5, 6)]
        for boost in (0.0, 1.0):
            r = ev(D, W, boost=boost, hist=grid)
            print("self_boost", boost, sorted((round(x, 4), b, s) for b, s, x in r)[-4:], flush=True)
    elif what == "alpha_terms":
        H = ((0.8, 4), (1.6, 4))
        for name, t, w, al in [("alpha0.1", D, W, 0.1), ("alpha10", D, W, 10.0), ("alpha100", D, W, 100.0),
                               ("prev higher layers", D + ((1, -1), (1, -2)), W + (0.5, 0.25), 1.0),
                               ("lags 3 4", D + ((3, 0), (4, 0)), W + (0.15, 0.1), 1.0),
                               ("lower layers", D + ((0, 1), (0, 2)), W + (1.0, 0.5), 1.0)]:
            print(name, [round(r, 4) for b, s, r in ev(t, w, alpha=al, hist=H)], flush=True)
    elif what == "log":
        for alpha in (1.0, 10.0):
            base = logfit(tp[tr], sp[tr], D, W, alpha=alpha)
            res = [(round(forecast_quality(dataclass_replace(base, hist_unit=int(round(b * SCORE_UNIT)), hist_shift=s),
                                           tp[val], sp[val])["recall"], 4), b, s)
                   for b in (0.1, 0.2, 0.4, 0.8) for s in (3, 4, 5, 6)]
            print("log tables alpha", alpha, sorted(res)[-3:], flush=True)
    elif what == "two":
        base = N.fit(tp[tr], sp[tr], k, E, terms=D, weights=W)
        U = SCORE_UNIT
        print("one H (0.8, 4)", round(recall2(base, tp[val], sp[val], [(int(0.8 * U), 4)]), 4), flush=True)
        for (b1, s1, b2, s2) in [(0.8, 3, 0.1, 7), (0.8, 4, 0.05, 8), (0.8, 3, 0.2, 6), (0.4, 2, 0.1, 6),
                                 (1.6, 3, 0.1, 7)]:
            print("two H", (b1, s1, b2, s2), round(recall2(base, tp[val], sp[val], [(int(b1 * U), s1), (int(b2 * U), s2)]), 4),
                  flush=True)
    elif what == "disc":
        import torch
        torch.set_num_threads(2)
        shift, h = 5, 1
        t0 = time.time()
        Ps = probs(tp[tr], sp[tr], D, h, 1.0)
        Hf, F, Dg, tgt = feats(tp[tr], sp[tr], Ps, D, shift, h)
        hw, cw, g, b = train(Hf, F, Dg, tgt, L)
        f = to_int(Ps, D, hw, cw, g, b, shift, h)
        print("cross-entropy per-layer weights, shift", shift, "validation recall",
              round(forecast_quality(f, tp[val], sp[val])["recall"], 4), round(time.time() - t0, 1), "s", flush=True)
        # cross-fitted: the count tables from even training sequences, the weights on the odd ones
        ids = np.unique(sp[tr], return_inverse=True)[1]
        A = ids % 2 == 0
        Pa = probs(tp[tr][A], sp[tr][A], D, h, 1.0)
        hw, cw, g, b = train(*feats(tp[tr][~A], sp[tr][~A], Pa, D, shift, h), L)
        f = to_int(Ps, D, hw, cw, g, b, shift, h)
        print("cross-fitted, validation recall", round(forecast_quality(f, tp[val], sp[val])["recall"], 4), flush=True)
        # across subjects: counts from abstract_algebra, weights on anatomy's even sequences, recall on its odd ones
        vid = np.unique(sp, return_inverse=True)[1]
        wfit, vtest = val & (vid % 2 == 0), val & (vid % 2 == 1)
        hw, cw, g, b = train(*feats(tp[wfit], sp[wfit], Ps, D, shift, h), L)
        f = to_int(Ps, D, hw, cw, g, b, shift, h)
        print("weights across subjects, recall on anatomy's odd sequences",
              round(forecast_quality(f, tp[vtest], sp[vtest])["recall"], 4), flush=True)
        base = N.fit(tp[tr], sp[tr], k, E, terms=D, weights=W, self_boost=1.0)
        fb = dataclass_replace(base, hist_unit=int(0.8 * SCORE_UNIT), hist_shift=5)
        print("count tables (fit_tuned's choice: self_boost 1, beta 0.8, shift 5), same sequences",
              round(forecast_quality(fb, tp[vtest], sp[vtest])["recall"], 4), flush=True)
