"""The block-FP8 weight format of the checkpoints people serve (DeepSeek-V3/R1, Qwen3-*-FP8).

What the published format is (Hugging Face ``quantization_config``): ``quant_method: fp8``,
``fmt: e4m3``, ``activation_scheme: dynamic``, ``weight_block_size: [128, 128]``. Every linear
layer not named by ``modules_to_not_convert`` stores ``*.weight`` in ``float8_e4m3fn`` beside
``*.weight_scale_inv`` (float32, one scale per 128 x 128 block of the weight, ``[ceil(rows / 128),
ceil(cols / 128)]``: a partial last block has its own scale, as transformers' ``FP8Linear`` and
DeepSeek's ``weight_dequant`` allocate it). Dequantization is ``weight.float() * scale_inv``
broadcast over each block. Activations have no stored scale ("dynamic"): a serving engine
quantizes them per token and group of 128 columns at run time, with scale ``max|x| / 448`` (the
scheme of vLLM's ``per_token_group_quant_fp8`` and DeepGEMM's block-FP8 GEMMs); this module's
:func:`quantize_activations` is that scheme, and the torch experts path and the Triton kernel
both use it, so the CPU and CUDA paths compute the same quantity.

What is refused, by name: another block size, static activation scales, ``e5m2``, a converted
module without its ``weight_scale_inv`` tensor, a scale tensor of the wrong grid.

Routed experts keep the FP8 bytes and their scales in the engine's pools (``coldset.kernels.tiers``):
w13 (gate and up stacked) has the scale grid of gate followed by that of up (``[2 * ceil(I / 128),
ceil(H / 128)]``), so column ``n`` of up uses scale row ``ceil(I / 128) + n // 128`` whatever I is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from coldset.core.shapes import FP8_BLOCK128, format_skip_patterns, module_not_converted, quantization_object

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
BLOCK = 128  # the only weight block (rows and columns) and activation group supported
ACT_EPS = 1e-10  # floor of a group's max|x|, as vLLM's per_token_group_quant_fp8 (an all-zero group)
FORMAT_NAME = FP8_BLOCK128  # coldset.core.shapes' name of this format


class Fp8FormatError(ValueError):
    """A quantization_config or FP8 tensor this module does not support; the message names it."""


@dataclass(frozen=True)
class Fp8Format:
    """A parsed block-FP8 ``quantization_config``: which modules are converted."""

    modules_to_not_convert: tuple[str, ...] = ()

    def converts(self, module_name: str) -> bool:
        """Whether ``module_name`` (e.g. ``model.layers.0.self_attn.q_proj``) is stored in FP8: not
        kept unquantized by ``modules_to_not_convert`` under transformers' rule, as
        :func:`coldset.core.shapes.module_not_converted` matches it (``mlp.gate`` never skips
        ``mlp.gate_proj``, ``layers.1`` never ``layers.11``). Only linear layers are ever converted;
        callers ask about linear layers only."""
        return not module_not_converted(module_name, list(self.modules_to_not_convert),
                                        "quantization_config.modules_to_not_convert")


def parse_quantization_config(qcfg: Mapping[str, Any] | None, source: str = "config.json") -> Fp8Format | None:
    """The block-FP8 format of a config's ``quantization_config`` (None: no quantization).

    Accepts exactly the published format (quant_method fp8, weight_block_size [128, 128],
    activation_scheme dynamic, fmt e4m3 or absent); anything else raises :class:`Fp8FormatError`
    naming the field, rather than loading weights that would then be read wrongly.
    """
    if qcfg is None:
        return None
    where = f"{source}: quantization_config"
    qcfg = quantization_object(qcfg, where, Fp8FormatError)
    method = qcfg.get("quant_method")
    if method != "fp8":
        raise Fp8FormatError(f"{where}.quant_method {method!r} is not supported by the engine (only 'fp8', "
                             "block-scaled e4m3)")
    block = qcfg.get("weight_block_size")
    if block is None:
        raise Fp8FormatError(f"{where}.weight_block_size is missing: per-tensor FP8 is not supported (only "
                             f"[{BLOCK}, {BLOCK}] blocks)")
    if list(block) != [BLOCK, BLOCK]:
        raise Fp8FormatError(f"{where}.weight_block_size {list(block)!r} is not supported (only [{BLOCK}, {BLOCK}])")
    scheme = qcfg.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise Fp8FormatError(f"{where}.activation_scheme {scheme!r} is not supported (only 'dynamic': activations "
                             "quantized per token group of 128 at run time; static activation scales are not read)")
    fmt = qcfg.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise Fp8FormatError(f"{where}.fmt {fmt!r} is not supported (only 'e4m3'; e5m2 weights are not read)")
    return Fp8Format(modules_to_not_convert=format_skip_patterns(qcfg, where, Fp8FormatError))


def quantization_config(modules_to_not_convert: list[str]) -> dict:
    """The ``quantization_config`` a block-FP8 checkpoint publishes (Qwen3-30B-A3B-FP8's keys)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": list(modules_to_not_convert)}


def scale_grid(rows: int, cols: int) -> tuple[int, int]:
    """Shape of a ``[rows, cols]`` weight's ``weight_scale_inv``: one scale per block, partial last blocks included."""
    return math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)


def expand_scales(scale_inv: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Per-element float32 scales ``[..., rows, cols]`` from a block grid ``[..., ceil(rows/128), ceil(cols/128)]``."""
    if tuple(scale_inv.shape[-2:]) != scale_grid(rows, cols):
        raise Fp8FormatError(f"weight_scale_inv grid {tuple(scale_inv.shape[-2:])} does not match a [{rows}, {cols}] "
                             f"weight in {BLOCK}x{BLOCK} blocks (expected {scale_grid(rows, cols)})")
    s = scale_inv.float().repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return s[..., :rows, :cols]


def row_scales(scale_inv: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The per-row scale table of a ``[rows, cols]`` weight, float32 ``[rows, ceil(cols / 128)]``:
    its block grid ``scale_inv`` with each block row repeated for its 128 weight rows, what the
    one-token GEMV reads (``coldset.kernels.triton_decode.gemv(..., weight_scale=...)``). Why per
    row: a fused weight of several checkpoint matrices (qkv = q, k, v, each with its own grid, whose
    row counts need not be multiples of 128) is the row-wise concatenation of its parts' tables. It
    costs 4 bytes a row and 128-column group: 1/32 of the FP8 bytes (~3%)."""
    if tuple(scale_inv.shape) != scale_grid(rows, cols):
        raise Fp8FormatError(f"row_scales: weight_scale_inv grid {list(scale_inv.shape)} does not match a "
                             f"[{rows}, {cols}] weight in {BLOCK}x{BLOCK} blocks (expected "
                             f"{list(scale_grid(rows, cols))})")
    return scale_inv.float().repeat_interleave(BLOCK, dim=0)[:rows].contiguous()


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight float8_e4m3fn, weight_scale_inv float32)`` of a float weight ``[..., rows, cols]``.

    Each 128 x 128 block (partial at the edges) gets ``scale_inv = max|w| / 448`` (a zero block
    gets 1), and ``weight = round(w / scale_inv)`` in e4m3 (round to nearest even, as torch's
    cast does), so ``dequantize_weight`` gives back ``w`` to e4m3's precision: DeepSeek's
    ``weight_quant`` convention, which the published checkpoints follow.
    """
    rows, cols = w.shape[-2:]
    w32 = w.float()
    gr, gc = scale_grid(rows, cols)
    padded = w32.new_zeros((*w.shape[:-2], gr * BLOCK, gc * BLOCK))
    padded[..., :rows, :cols] = w32
    blocks = padded.unflatten(-1, (gc, BLOCK)).unflatten(-3, (gr, BLOCK))  # [..., gr, B, gc, B]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., gr, gc]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w32 / expand_scales(scale_inv, rows, cols)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv.contiguous()


def dequantize_weight(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.float() * scale_inv`` broadcast per 128 x 128 block, in ``dtype`` (float32 by default)."""
    if q.dtype != FP8_DTYPE:
        raise Fp8FormatError(f"dequantize_weight: weight dtype {q.dtype}, expected {FP8_DTYPE}")
    rows, cols = q.shape[-2:]
    return (q.float() * expand_scales(scale_inv, rows, cols).to(q.device)).to(dtype)


def w13_scale_rows(inter: int) -> int:
    """Scale rows of a fused w13 ``[2I, H]``: gate's grid then up's, ``2 * ceil(I / 128)``."""
    return 2 * math.ceil(inter / BLOCK)


def dequantize_w13(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fused ``[..., 2I, H]`` w13 whose scales are gate's grid then up's (module docstring)."""
    inter = q.shape[-2] // 2
    half = scale_inv.shape[-2] // 2
    return torch.cat([dequantize_weight(q[..., :inter, :], scale_inv[..., :half, :], dtype),
                      dequantize_weight(q[..., inter:, :], scale_inv[..., half:, :], dtype)], dim=-2)


def quantize_w13(w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused float ``[..., 2I, H]`` w13 quantized as a checkpoint stores it: gate and up each in
    their own 128 x 128 blocks, scales gate's grid then up's (what :func:`dequantize_w13` reads)."""
    inter = w13.shape[-2] // 2
    (qg, sg), (qu, su) = quantize_weight(w13[..., :inter, :]), quantize_weight(w13[..., inter:, :])
    return torch.cat([qg, qu], dim=-2), torch.cat([sg, su], dim=-2)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q float8_e4m3fn [T, K], scales float32 [T, ceil(K / 128)])``: per token, per group of 128 columns.

    ``scale = max(max|x_group|, 1e-10) / 448`` and ``x_q = clamp(x / scale, -448, 448)`` rounded
    to nearest even, all in float32: vLLM's ``per_token_group_quant_fp8`` (column-major scales
    aside). The Triton FP8 kernel computes the same on the fly (IEEE divisions, the same cast).
    """
    t, k = x.shape
    groups = math.ceil(k / BLOCK)
    x32 = x.float()
    padded = x32.new_zeros((t, groups * BLOCK))
    padded[:, :k] = x32
    amax = padded.view(t, groups, BLOCK).abs().amax(dim=-1).clamp(min=ACT_EPS)
    scales = amax / FP8_MAX
    q = (x32 / scales.repeat_interleave(BLOCK, dim=1)[:, :k]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales


def dequantize_activations(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale`` per token group of 128 (the inverse of :func:`quantize_activations`)."""
    k = q.shape[-1]
    return q.float() * scales.repeat_interleave(BLOCK, dim=-1)[..., :k]
