# Probe, not a tool: the one-token GEMV with block-FP8 weights against the bf16 GEMV (issue 29).
"""µs per launch of :func:`coldset.kernels.triton_decode.gemv` with block-FP8 weights
(``weight_scale=``) against the bf16 GEMV at Qwen3-30B-A3B's attention shapes, and each against a
plain read of the same bytes (the ceiling a launch of that size meets).

    PYTHONPATH=src python3 probes/fp8_gemv_h200.py [--out DIR] [--reps 50]

Shapes as the engine runs them: qkv ``[5120, 2048]`` with the input add and norm, o_proj
``[2048, 4096]`` with the residual; 48 layers' weights (random, bf16, quantized per 128 x 128
block for FP8 with q/k/v's own grids) launched one after the other in one CUDA graph, so no launch
finds its weights in L2 (the 50 MB L2 holds 2-5 of them). Per config: µs per launch (median of
``--reps`` graph replays over 48), GB/s of the bytes it reads (FP8: the e4m3 bytes plus the
per-row scale table it reads), and that rate over the plain read's
(:func:`coldset.kernels.bandwidth.best_read_bandwidth` with 48 launches over a buffer of 48 x the
same bytes: the rate of one launch of that size). Every config's output is checked first: FP8
against :func:`coldset.kernels.reference.torch_gemv` (< 1e-2) and against the bf16 GEMV of the
dequantized weight (< 2e-2: e4m3 weights read in float32 against bf16-rounded ones), bf16 against
float32 torch. Also the per-layer pair (qkv then o_proj, 48 layers, pdl as the engine at batch 1)
in both formats: the attention GEMVs' share of a decode step. Prints a table last; ``--out``
writes ``fp8_gemv.json`` (the H200 run at 59a1710: probes/fp8_gemv_h200.json, kept out of
docs/measurements/, whose files are ``bench`` results the renderer reads).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()

    from coldset.core import fp8
    from coldset.kernels.bandwidth import best_read_bandwidth
    from coldset.kernels.reference import torch_gemv
    from coldset.kernels.triton_decode import GemvConfig, gemv, gemv_config
    from coldset.measure.harness import log
    from coldset.core.timing import graph_time_us

    dev, dt, L = torch.device("cuda"), torch.bfloat16, 48
    H, Q, KV = 2048, 4096, 512
    shapes = {"qkv": (Q + 2 * KV, H, [Q, KV, KV]), "o_proj": (H, Q, [H])}
    cands = {"qkv": [(2, 1, 4), (4, 1, 4), (4, 1, 8), (8, 1, 8), (8, 1, 4), (4, 2, 4), (2, 1, 2)],
             "o_proj": [(1, 1, 4), (2, 1, 4), (2, 1, 8), (4, 1, 8), (4, 1, 4), (1, 1, 2)]}
    g = torch.Generator(device=dev).manual_seed(0)
    rows: list[dict] = []
    data = {}

    def ceiling(nbytes: int) -> float:
        buf = torch.randint(-100, 100, (L * nbytes // 2,), dtype=torch.int16, device=dev)
        rate = best_read_bandwidth(buf, launches=L, rounds=2) / 1e9
        del buf
        return rate

    for name, (n, k, parts) in shapes.items():
        ws = [torch.randn(n, k, device=dev, dtype=dt, generator=g) * k ** -0.5 for _ in range(L)]
        qs, tables = [], []
        for w in ws:
            pieces = [fp8.quantize_weight(p) for p in w.split(parts)]
            qs.append(torch.cat([q for q, _ in pieces]))
            tables.append(torch.cat([fp8.row_scales(s, q.shape[0], k) for q, s in pieces]))
        deq = torch.cat([fp8.dequantize_weight(q, s).to(dt) for q, s in pieces])  # the last layer's, bf16
        x = torch.randn(1, k, device=dev, dtype=dt, generator=g)
        extra = torch.randn(1, n if name == "o_proj" else k, device=dev, dtype=dt, generator=g)
        nw = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(dt)
        data[name] = (ws, qs, tables, x, extra, nw)

        def apply(w, s=None, **kw):
            if name == "o_proj":
                return gemv(x, w, residual=extra, weight_scale=s, **kw)
            return gemv(x, w, norm_weight=nw, eps=1e-6, add=extra, weight_scale=s, **kw)[1]

        def ref(w, s=None):
            if name == "o_proj":
                return torch_gemv(x, w, residual=extra, weight_scale=s)
            return torch_gemv(x, w, norm_weight=nw, eps=1e-6, add=extra, weight_scale=s)[1]

        def rel(a, b):
            return ((a.float() - b.float()).norm() / b.float().norm()).item()

        bytes16 = n * k * 2
        bytes8 = n * k + tables[0].numel() * 4
        ceil16, ceil8 = ceiling(bytes16), ceiling(bytes8)
        log(name, "plain read GB/s: bf16-size launch", round(ceil16), "FP8-size launch", round(ceil8))
        rows.append(dict(shape=name, fmt="read", config=f"plain read of {bytes16 / 1e6:.2f} MB", GBps=ceil16))
        rows.append(dict(shape=name, fmt="read", config=f"plain read of {bytes8 / 1e6:.2f} MB", GBps=ceil8))
        d16, d8 = gemv_config(n, k), gemv_config(n, k, 1)
        for fmt, default, nbytes, ceil in (("bf16", d16, bytes16, ceil16), ("fp8", d8, bytes8, ceil8)):
            configs = [default] + [GemvConfig(*c) for c in cands[name] if GemvConfig(*c) != default]
            for c in configs:
                for pdl in ((False, True) if c == default else (False,)):
                    try:
                        if fmt == "bf16":
                            err = rel(apply(ws[0], config=c), ref(ws[0]))
                            ok = err < 1e-2
                            fn = (lambda c=c, pdl=pdl: [apply(w, config=c, pdl=pdl) for w in ws])
                        else:
                            err = rel(apply(qs[-1], tables[-1], config=c), ref(qs[-1], tables[-1]))
                            err16 = rel(apply(qs[-1], tables[-1], config=c), ref(deq))
                            ok = err < 1e-2 and err16 < 2e-2
                            fn = (lambda c=c, pdl=pdl: [apply(q, s, config=c, pdl=pdl) for q, s in zip(qs, tables)])
                        if not ok:
                            rows.append(dict(shape=name, fmt=fmt, config=str(c), error=f"rel err {err:.3g}"))
                            continue
                        us = graph_time_us(fn, args.reps) / L
                    except Exception as exc:  # a config out of resources is a result
                        rows.append(dict(shape=name, fmt=fmt, config=str(c), error=repr(exc)[:160]))
                        continue
                    gbps = nbytes / us / 1e3
                    r = dict(shape=name, fmt=fmt, config=f"{c.block_n}x{c.iters} w{c.num_warps}" + (" pdl" if pdl else ""),
                             us=us, GBps=gbps, of_read=gbps / ceil, rel_err=err, default=c == default)
                    rows.append(r)
                    log(r)

    # the per-layer pair as the engine runs it at batch 1 (qkv with add + norm, o_proj with residual, pdl)
    (wq, qq, tq, xq, aq, nq), (wo, qo, to, xo, ro, _) = data["qkv"], data["o_proj"]

    def pair16():
        for a, b in zip(wq, wo):
            gemv(xq, a, norm_weight=nq, eps=1e-6, add=aq, pdl=True)
            gemv(xo, b, residual=ro, pdl=True)

    def pair8():
        for a, sa, b, sb in zip(qq, tq, qo, to):
            gemv(xq, a, norm_weight=nq, eps=1e-6, add=aq, pdl=True, weight_scale=sa)
            gemv(xo, b, residual=ro, pdl=True, weight_scale=sb)

    t16, t8 = graph_time_us(pair16, args.reps), graph_time_us(pair8, args.reps)
    rows.append(dict(shape="48 x (qkv + o_proj)", fmt="bf16", config="defaults pdl", us=t16))
    rows.append(dict(shape="48 x (qkv + o_proj)", fmt="fp8", config="defaults pdl", us=t8, bf16_over_fp8=t16 / t8))
    if args.out:
        from coldset.core.files import write_json

        write_json(Path(args.out) / "fp8_gemv.json", {"device": torch.cuda.get_device_name(), "rows": rows})
    print(f"{'shape':20s} {'fmt':5s} {'config':26s} {'us':>9s} {'GB/s':>7s} {'of read':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:20s} {r['fmt']:5s} {r['config']:26s} {r['error']}")
            continue
        print(f"{r['shape']:20s} {r['fmt']:5s} {r['config']:26s} "
              + (f"{r['us']:9.2f}" if "us" in r else " " * 9)
              + (f" {r['GBps']:7.0f}" if "GBps" in r else " " * 8)
              + (f" {100 * r['of_read']:7.1f}%" if "of_read" in r else "")
              + (" (default)" if r.get("default") else "")
              + (f" bf16/fp8 {r['bf16_over_fp8']:.3f}x" if "bf16_over_fp8" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
