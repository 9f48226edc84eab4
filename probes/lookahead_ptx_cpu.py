"""Probe (not a tool of the package): lookahead's CUDA launches compiled to sm90 PTX on the CPU, no GPU (issue 28 item 4).

    PYTHONPATH=<triton 3.6>:src python probes/lookahead_ptx_cpu.py

Compiles :func:`coldset.kernels.triton_slots._forecast_kernel` and ``_ahead_kernel`` at the
Qwen3-30B-A3B bench shapes (E 128, k 8, H 2048, 48 x 128 slots: residency 1.0) for 1 and 8 tokens
with ``triton.compile`` for a ``cuda`` 9.0 target (on the CPU, triton's bundled ptxas
included; only the launch needs the GPU), and the forecast's top-k both ways in a kernel of its own: the
k rounds of max/argmin reductions the decisions launch had (a run-time loop: its barriers and
shuffles run k times) and the partial bitonic sort (``tl.topk``) of (logit, id) keys it has now.
Prints static instruction counts (barriers, shuffles, shared-memory traffic, spills): a check
that the launches compile for sm90 (``tl.topk`` on int64 keys, the grid-dependency wait) and a
rough count of the work, never a time (none of it has run on a GPU yet).
"""

from __future__ import annotations

import collections
import inspect

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from coldset.kernels import triton_slots as ts

TYPES = {"row_map_ptr": "*i32", "count_ptr": "*fp64", "w_ptr": "*fp32", "w_out_ptr": "*bf16", "inflight_ptr": "*u8",
         "logits_ptr": "*fp32", "x_ptr": "*bf16", "out_ptr": "*fp32"}


def ptx(fn, const: dict, num_warps: int) -> str:
    names = list(inspect.signature(fn.fn).parameters)
    gemv = "x_ptr" in names
    sig = {}
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = "*bf16" if gemv and n == "w_ptr" else TYPES.get(n, "*i64")
        else:
            sig[n] = "i32"
    src = ASTSource(fn, sig, {(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]


def counts(text: str) -> dict:
    c = collections.Counter()
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith((".", "//", "$", "{", "}")):
            continue
        op = s.split()[1] if s.startswith("@") else s.split()[0]
        c["instructions"] += 1
        for key in ("bar.sync", "shfl", "st.shared", "ld.shared", "ld.global", "st.local", "griddepcontrol", "bra"):
            c[key] += op.startswith(key)
    return dict(c)


@triton.jit
def topk_rounds(logits_ptr, out_ptr, n_tok, E: tl.constexpr, K: tl.constexpr, TP: tl.constexpr, EP: tl.constexpr,
                NP: tl.constexpr):
    """The decisions launch's top-k before issue 28 item 4 (k rounds of reductions), alone."""
    offs = tl.arange(0, NP)
    tok = tl.arange(0, TP)
    col = tl.arange(0, EP)
    v = tl.load(logits_ptr + tok[:, None] * E + col[None, :], mask=(tok < n_tok)[:, None] & (col[None, :] < E),
                other=float("-inf"))
    lst = tl.zeros((NP,), dtype=tl.int64)
    for r in range(0, K):
        mx = tl.max(v, axis=1)
        idx = tl.min(tl.where(v == mx[:, None], col[None, :], EP), axis=1)
        v = tl.where(col[None, :] == idx[:, None], float("-inf"), v)
        pick_r = tl.sum(tl.where((offs // K)[:, None] == tok[None, :], idx[None, :], 0), axis=1)
        lst = tl.where(offs % K == r, pick_r.to(tl.int64), lst)
    tl.store(out_ptr + offs, lst)


@triton.jit
def topk_sort(logits_ptr, out_ptr, n_tok, E: tl.constexpr, K: tl.constexpr, TP: tl.constexpr, EP: tl.constexpr,
              NP: tl.constexpr):
    """The decisions launch's top-k now (one partial bitonic sort of (logit, id) keys), alone."""
    tok = tl.arange(0, TP)
    col = tl.arange(0, EP)
    v = tl.load(logits_ptr + tok[:, None] * E + col[None, :], mask=(tok < n_tok)[:, None] & (col[None, :] < E),
                other=float("-inf"))
    top = tl.topk(ts._ordered_keys(v, col[None, :], EP), K, dim=1)
    tl.store(out_ptr + tl.arange(0, TP * K), (EP - 1) - (tl.reshape(top, [TP * K]) & (EP - 1)))


def main() -> None:
    E, k, H, C, L = 128, 8, 2048, 48 * 128, 48
    p2 = ts._next_pow2
    for T in (1, 8):
        n = T * k
        tp = max(2, p2(T))
        topk = dict(E=E, K=k, TP=tp, EP=E, NP=p2(n))
        warps = 16 if p2(C) >= 4096 else 8
        print(f"{T} token(s), {warps} warps: top-k by rounds (x{k} at run time)", counts(ptx(topk_rounds, topk, warps)))
        print(f"{T} token(s), {warps} warps: top-k by one sort", counts(ptx(topk_sort, topk, warps)))
        mv = max(2, p2(min(n, E)))
        ahead = dict(E=E, NP=max(2, p2(n)), SCAN=ts._scan_size(C, mv), MV=mv, CAST=True, USE_GDC=True, AHEAD=True,
                     K=k, KP=p2(k), TP=tp, EP=E, WP=max(2, p2(n)), MPV=mv, ZB=1024, NI=L * E, WAIT_LOGITS=True)
        print(f"{T} token(s): _ahead_kernel", counts(ptx(ts._ahead_kernel, ahead, warps)))
        be = ts.FORECAST_EXPERTS
        bh = min(p2(H), ts.FORECAST_TILE // be)
        gemv = dict(E=E, TP=p2(T), BE=be, BH=bh, USE_GDC=True)
        print(f"{T} token(s): _forecast_kernel ({E // be} programs, {bh} of H a load)",
              counts(ptx(ts._forecast_kernel, gemv, ts.FORECAST_WARPS)))


if __name__ == "__main__":
    main()
