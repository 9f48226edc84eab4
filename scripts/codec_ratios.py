"""The lossless codec's ratio per expert format (bf16, block-FP8, MXFP4) at real expert shapes.

One expert (w13 ``[2I, H]`` and w2 ``[H, I]``) per shape and weight distribution, stored in the
compressed host tier (:func:`coldset.kernels.compressed_tier.compressed_host_tier`), so a ratio is
the tier's: host bytes, and bytes a fill sends over the link, over the raw tier's, scales included
(FP8's float32 scales stored raw, MXFP4's e8m0 scales coded where that is smaller). Beside it, the
entropy bound of the coded symbols (bf16: exponent byte, raw sign and mantissa; one-byte formats:
the byte) with the raw planes and scales as stored: no code without a table does better.

Weights are drawn as trained experts' are distributed (no published checkpoint is at hand here):

- ``gaussian``: N(0, 1 / fan_in), the scale of trained expert weights (std 1 / sqrt(fan_in));
- ``student-t``: Student-t with ``--df`` degrees of freedom scaled to the same std: heavier tails,
  as trained weights' outliers are.

bf16 is that draw cast; block-FP8 is :func:`coldset.core.fp8.quantize_w13` (w13: gate and up in
their own 128 x 128 blocks) and :func:`coldset.core.fp8.quantize_weight` (w2) of it;
MXFP4 is :func:`coldset.core.mxfp4.quantize` of it (32-element blocks, e8m0 scales).

    python scripts/codec_ratios.py [--shapes qwen3-30b-a3b:2048:768,gpt-oss-120b:2880:2880] [--df 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from coldset.core import codec, fp8, mxfp4
from coldset.kernels.compressed_tier import compressed_host_tier
from coldset.kernels.tiers import ExpertPools

SHAPES = "qwen3-30b-a3b:2048:768,gpt-oss-120b:2880:2880"


def draw(rows: int, cols: int, dist: str, df: float, rng: np.random.Generator) -> torch.Tensor:
    """float32 ``[rows, cols]`` weights of std ``1 / sqrt(cols)`` (``cols`` = fan_in)."""
    if dist == "gaussian":
        z = rng.standard_normal((rows, cols))
    else:  # Student-t scaled to unit variance (its variance is df / (df - 2))
        z = rng.standard_t(df, (rows, cols)) * math.sqrt((df - 2) / df)
    return torch.from_numpy(z / math.sqrt(cols)).float()


def symbol_entropy_bytes(t: torch.Tensor) -> float:
    """Bytes of the coded plane at its empirical entropy (the optimum of any code per symbol)."""
    symbols, _raw = codec.split_planes(t)
    p = torch.bincount(symbols.to(torch.int64), minlength=256).double() / symbols.numel()
    p = p[p > 0]
    return float(-(p * p.log2()).sum()) * symbols.numel() / 8


def expert_pools(fmt: str, w13: torch.Tensor, w2: torch.Tensor) -> ExpertPools:
    """One layer, one expert, in ``fmt``."""
    if fmt == "bf16":
        return ExpertPools.all_hot(w13.to(torch.bfloat16)[None, None], w2.to(torch.bfloat16)[None, None])
    if fmt == "fp8":
        (q13, s13), (q2, s2) = fp8.quantize_w13(w13), fp8.quantize_weight(w2)
        return ExpertPools.all_hot(q13[None, None], q2[None, None], s13[None, None], s2[None, None])
    (b13, s13), (b2, s2) = mxfp4.quantize(w13), mxfp4.quantize(w2)
    return ExpertPools.all_hot(b13.flatten(-2)[None, None], b2.flatten(-2)[None, None], s13[None, None], s2[None, None])


def row(shape: str, hidden: int, inter: int, dist: str, df: float, fmt: str, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    w13, w2 = draw(2 * inter, hidden, dist, df, rng), draw(hidden, inter, dist, df, rng)
    pools = expert_pools(fmt, w13, w2)
    tier = compressed_host_tier(pools)
    bound = 0.0
    for part in tier.parts[0]:
        t = getattr(pools, f"{part.name}_hot")[0]
        if part.coded:
            _symbols, raw = codec.split_planes(t)
            bound += symbol_entropy_bytes(t) + (0 if raw is None else raw.numel())
        else:
            bound += t.numel() * t.element_size()
    return {"shape": shape, "H": hidden, "I": inter, "weights": dist if dist == "gaussian" else f"student-t df={df:g}",
            "format": fmt, "raw_bytes": tier.raw_nbytes, "tier_bytes": tier.nbytes, "ratio": tier.ratio,
            "entropy_bound": bound / tier.raw_nbytes,
            "coded": ",".join(p.name for p in tier.parts[0] if p.coded)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="name:H:I,... (hidden size, expert intermediate size)")
    p.add_argument("--formats", default="bf16,fp8,mxfp4")
    p.add_argument("--df", type=float, default=4.0, help="Student-t degrees of freedom (> 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    if args.df <= 2:
        raise SystemExit(f"codec_ratios: --df {args.df} must be > 2 (the std is finite only there)")
    rows = []
    for spec in args.shapes.split(","):
        name, hidden, inter = spec.split(":")
        for dist in ("gaussian", "student-t"):
            for fmt in args.formats.split(","):
                rows.append(row(name, int(hidden), int(inter), dist, args.df, fmt, args.seed))
    print("| shape | H | I | weights | format | MB raw | ratio | entropy bound | coded parts |")
    print("|---|--:|--:|---|---|--:|--:|--:|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['H']} | {r['I']} | {r['weights']} | {r['format']} | {r['raw_bytes'] / 1e6:.2f} | "
              f"{r['ratio']:.4f} | {r['entropy_bound']:.4f} | {r['coded']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
