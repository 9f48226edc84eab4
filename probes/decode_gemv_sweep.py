# Probe, not a tool: the launch-config sweep behind triton_decode's GEMV / norm_linear / router defaults (issue 13); moved out of the decode-step measurement (`python -m coldset bench step`).
"""µs per launch of the decode step's GEMV, ``norm_linear`` and fused-router configs at
Qwen3-30B-A3B's shapes against cuBLAS and what they replace, random weights (no model).

    PYTHONPATH=src python3 probes/decode_gemv_sweep.py --out <dir> [--parts gemv,router,linear8]

Writes ``gemv_sweep.json`` and prints one line per (shape, config).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from coldset.measure.harness import log


def gemv_sweep(dev, dtype, layers: int = 48, reps: int = 20, parts=("gemv", "router")) -> list[dict]:
    """µs per launch of the one-token GEMV (``triton_decode.gemv``) configs against what ran
    before (``norm_linear``'s default, cuBLAS) at Qwen3-30B-A3B's qkv (with the input add and norm),
    o_proj (with the residual) and LM head (add + final norm) shapes, and of the fused router
    (``triton_decode.route``) against the rms_norm + cuBLAS + softmax_topk + cast it replaces, at 1
    and 8 tokens: each a CUDA graph over ``layers`` weight copies (3 of the LM head), nothing left
    in L2. Random weights: no model needed. Every config's output is checked against cuBLAS first."""
    import torch.nn.functional as F

    from coldset.kernels import softmax_topk
    from coldset.kernels.triton_decode import GemvConfig, gemv, gemv_config, norm_linear, rms_norm, route
    from coldset.core.timing import graph_time_us

    rows: list[dict] = []
    shapes = {"qkv": (5120, 2048, layers), "o_proj": (2048, 4096, layers), "lm_head": (151936, 2048, 3)}
    cands = {"qkv": [(2, 1, 4), (4, 1, 4), (4, 1, 8), (8, 1, 8), (4, 2, 4)],
             "o_proj": [(1, 1, 4), (2, 1, 4), (2, 1, 8), (4, 1, 8)],
             "lm_head": [(4, 1, 4), (4, 4, 4), (8, 4, 8), (8, 2, 8), (16, 4, 8)]}

    def record(**r):
        rows.append(r)
        log("sweep", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()})

    def case(name: str, n: int, k: int, copies: int, m: int):
        """``copies`` random ``[n, k]`` weights, ``m`` tokens ``x`` and the shape's other input
        (o_proj: the residual ``[m, n]``; qkv and the LM head: the add ``[m, k]`` before a unit
        norm); ``apply(op, w, **kw)`` runs ``gemv`` or ``norm_linear`` with them as the engine
        does, ``want(w)`` is float32 torch's result."""
        g = torch.Generator(device=dev).manual_seed(n if m == 1 else n + m)
        ws = [torch.randn(n, k, device=dev, dtype=dtype, generator=g) * k ** -0.5 for _ in range(copies)]
        x = torch.randn(m, k, device=dev, dtype=dtype, generator=g)
        extra = torch.randn(m, n if name == "o_proj" else k, device=dev, dtype=dtype, generator=g)
        nw = torch.ones(k, device=dev, dtype=dtype)

        def apply(op, w, **kw):
            if name == "o_proj":
                return op(x, w, residual=extra, **kw)
            return op(x, w, norm_weight=nw, eps=1e-6, add=extra, **kw)[1]

        def want(w):
            if name == "o_proj":
                return extra.float() + x.float() @ w.float().T
            return F.rms_norm((x + extra).float(), (k,), eps=1e-6) @ w.float().T

        return ws, x, extra, nw, apply, want

    def timed(shape: str, n: int, k: int, copies: int, label: str, fn, **fields):
        us = graph_time_us(fn, reps) / copies
        record(shape=shape, n=n, k=k, config=label, us=us, GBps=n * k * 2 / us / 1e3, **fields)

    def checked(shape: str, label: str, got, want) -> bool:
        """Whether a config's output is within 1e-2 of float32 torch (recorded as an error if not)."""
        err = ((got.float() - want).norm() / want.norm()).item()
        if err > 1e-2:
            record(shape=shape, config=label, error=f"relative error {err:.3g}")
        return err <= 1e-2

    for name, (n, k, copies) in (shapes.items() if "gemv" in parts else ()):
        ws, x, extra, nw, apply, want = case(name, n, k, copies, 1)
        timed(name, n, k, copies, "cublas F.linear (no norm)", lambda: [F.linear(x, w) for w in ws])
        if name != "lm_head":
            timed(name, n, k, copies, "norm_linear default", lambda: [apply(norm_linear, w) for w in ws])
        default = gemv_config(n, k)
        for c in [default] + [GemvConfig(*t) for t in cands[name] if GemvConfig(*t) != default]:
            if checked(name, str(c), apply(gemv, ws[0], config=c), want(ws[0])):
                timed(name, n, k, copies, str(c), lambda c=c: [apply(gemv, w, config=c) for w in ws], default=c == default)
        timed(name, n, k, copies, f"{default} pdl", lambda: [apply(gemv, w, config=default, pdl=True) for w in ws],
              default=True, pdl=True)
        ws.clear()  # free the copies before the next shape

    if "linear8" in parts:  # batch 8: the engine's way (rms_norm + cuBLAS qkv, norm_linear o_proj) against norm_linear configs
        from coldset.kernels.triton_decode import LinearConfig, linear_config

        m = 8
        lin_cands = [(16, 16, 512, 4, 3), (16, 16, 256, 4, 4), (16, 16, 128, 4, 6), (16, 32, 256, 4, 4), (16, 32, 256, 4, 6),
                     (16, 32, 512, 4, 3), (16, 32, 512, 8, 4), (16, 64, 256, 4, 4), (16, 64, 256, 8, 5), (16, 64, 128, 4, 6),
                     (16, 16, 1024, 8, 2), (16, 32, 128, 4, 8)]
        for name in ("qkv", "o_proj"):
            n, k, copies = shapes[name]
            ws, x, extra, nw, apply, want = case(name, n, k, copies, m)
            label = f"{name} m={m}"

            def engine(w):
                if name == "o_proj":
                    return norm_linear(x, w, residual=extra)
                return F.linear(rms_norm(x, nw, 1e-6, add=extra)[1], w)

            timed(label, n, k, copies, "cublas F.linear (no norm)", lambda: [F.linear(x, w) for w in ws])
            timed(label, n, k, copies, "engine (qkv: rms_norm + cuBLAS; o_proj: norm_linear default)",
                  lambda: [engine(w) for w in ws])
            default = linear_config(m, n, k)
            for c in [default] + [LinearConfig(*t) for t in lin_cands if LinearConfig(*t) != default]:
                try:
                    ok = checked(label, str(c), apply(norm_linear, ws[0], config=c), want(ws[0]))
                except Exception as exc:  # out of resources
                    record(shape=label, config=str(c), error=repr(exc)[:200])
                    continue
                if ok:
                    timed(label, n, k, copies, str(c), lambda c=c: [apply(norm_linear, w, config=c) for w in ws],
                          default=c == default)
            ws.clear()

    if "router" not in parts:
        return rows
    E, H, topk = 128, 2048, 8
    g = torch.Generator(device=dev).manual_seed(7)
    gws = [torch.randn(E, H, device=dev, dtype=dtype, generator=g) * H ** -0.5 for _ in range(layers)]
    nw = torch.ones(H, device=dev, dtype=dtype)
    counters = [torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(layers)]
    for m in (1, 8):
        x = torch.randn(m, H, device=dev, dtype=dtype, generator=g) * 3

        def before():
            for w in gws:
                h = rms_norm(x, nw, 1e-6)
                ids, wt = softmax_topk(F.linear(h, w), topk, True)
                wt.to(dtype)

        ref_ids = softmax_topk(F.linear(rms_norm(x, nw, 1e-6), gws[0]), topk, True)[0]
        us = graph_time_us(before, reps) / layers
        record(shape=f"router m={m}", config="rms_norm + cuBLAS + softmax_topk + cast", us=us)
        for be in (1, 2, 4):
            ids = route(x, nw, 1e-6, gws[0], topk, True, counters[0], weights_dtype=dtype, block_e=be)[1]
            same = (ids == ref_ids).all(dim=-1).float().mean().item()
            us = graph_time_us(lambda be=be: [route(x, nw, 1e-6, w, topk, True, c, weights_dtype=dtype, block_e=be)
                                              for w, c in zip(gws, counters)], reps) / layers
            record(shape=f"router m={m}", config=f"route block_e={be}", us=us, rows_same_ids_as_before=same,
                   default=be == 2)
        us = graph_time_us(lambda: [route(x, nw, 1e-6, w, topk, True, c, weights_dtype=dtype, pdl=True)
                                    for w, c in zip(gws, counters)], reps) / layers
        record(shape=f"router m={m}", config="route block_e=2 pdl", us=us, default=True, pdl=True)
    assert all(int(c.item()) == 0 for c in counters), "route left a ticket counter non-zero"
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="gemv,router",
                    help="comma-separated: gemv (one-token GEMV configs), router (the fused router), linear8 "
                         "(norm_linear configs at 8 tokens)")
    args = ap.parse_args()
    from coldset.core.files import write_json

    rows = gemv_sweep(torch.device("cuda"), torch.bfloat16, parts=args.parts.split(","))
    write_json(Path(args.out) / "gemv_sweep.json", rows)
    for r in rows:
        print(f"{r['shape']:12s} {r['config']:60s} " + (f"{r['us']:7.2f} us" if "us" in r else r.get("error", ""))
              + (f" {r['GBps']:6.0f} GB/s" if "GBps" in r else "")
              + (f" same ids {r['rows_same_ids_as_before']:.2f}" if "rows_same_ids_as_before" in r else "")
              + (" (default)" if r.get("default") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
