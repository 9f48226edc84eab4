"""The MXFP4 expert-weight format as gpt-oss publishes it (OCP Microscaling, e2m1 elements).

What the published format is (Hugging Face ``quantization_config``): ``quant_method: mxfp4`` and
``modules_to_not_convert`` (only the routed experts are converted). Each expert projection
``P`` (``gate_up_proj``, ``down_proj``) is stored as two tensors:

- ``P_blocks`` uint8 ``[E, N, K / 32, 16]``: N output rows, the K inputs in blocks of 32, two
  e2m1 values a byte, element ``2j`` of a block in the low nibble of byte ``j`` and element
  ``2j + 1`` in the high nibble;
- ``P_scales`` uint8 ``[E, N, K / 32]``: one e8m0 scale a block, the value ``2^(s - 127)``.

An e2m1 code is a sign bit over 3 magnitude bits: codes 0..7 are ``0, 0.5, 1, 1.5, 2, 3, 4, 6``,
codes 8..15 the same negated (code 8 is ``-0.0``). An element is ``e2m1(code) * 2^(s - 127)``.
:func:`dequantize` computes it exactly and rounds once to the requested dtype, which is bit for
bit what transformers' ``integrations.mxfp4.convert_moe_packed_tensors`` computes (``ldexp`` of
the LUT value), including the two ends of the scale range: ``s = 0`` is ``2^-127`` (no flush to
zero), and ``s = 255``, NaN in the OCP MX spec, is read as ``2^128`` (finite ``0.5 * 2^128``,
infinite above, zero stays zero), as transformers reads it. :func:`quantize` never writes 255.

gpt-oss's ``gate_up_proj`` interleaves its rows: row ``2i`` is gate's row ``i`` and row
``2i + 1`` up's. The engine's fused w13 stacks all of gate's rows and then all of up's
(``coldset.kernels.tiers``): :func:`w13_from_checkpoint` de-interleaves the rows (blocks, scales
and the bias alike; rows are whole, so nothing is unpacked). ``down_proj`` is already the
engine's w2 ``[H, I]`` (rows = hidden outputs, inputs = the intermediate). transformers' own
dequantized ``gate_up_proj`` / ``down_proj`` parameters are the transposes ``[E, K, N]``.

What is refused, by name (:class:`Mxfp4FormatError`): another ``quant_method``, a block size other
than 32, a scale format other than e8m0 (uint8), a ``*_blocks`` tensor without its ``*_scales``,
tensors of mismatched or wrong shapes and dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from coldset.core.shapes import MXFP4, format_skip_patterns, module_not_converted, quantization_object

FORMAT_NAME = MXFP4  # coldset.core.shapes' name of this format
BLOCK = 32  # elements per scale (along the reduction), the only block size supported
BLOCK_BYTES = BLOCK // 2  # packed bytes per block
SCALE_BIAS = 127  # e8m0: the value of scale byte s is 2^(s - 127)
SCALE_FORMAT = "e8m0"
# The e2m1 value of each 4-bit code (transformers' FP4_VALUES): sign bit 3, magnitude bits 0-2.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of e2m1's largest power of two (4 = 2^2): the OCP MX scale is 2^(floor(log2 amax) - 2)
# Fields a quantization_config may carry that would change how the tensors read; each must name
# the published format or be absent.
_BLOCK_SIZE_KEYS = ("block_size", "group_size", "weight_block_size")
_SCALE_FORMAT_KEYS = ("scale_format", "scale_dtype")


class Mxfp4FormatError(ValueError):
    """A quantization_config or MXFP4 tensor this module does not support; the message names it."""


@dataclass(frozen=True)
class Mxfp4Format:
    """A parsed MXFP4 ``quantization_config``: which modules are kept unquantized."""

    modules_to_not_convert: tuple[str, ...] = ()

    def converts(self, module_name: str) -> bool:
        """Whether ``module_name`` is stored in MXFP4 under transformers' matching rule
        (:func:`coldset.core.shapes.module_not_converted`). transformers' MXFP4 quantizer converts
        only the routed experts (``...mlp.experts``); callers ask about those."""
        return not module_not_converted(module_name, list(self.modules_to_not_convert),
                                        "quantization_config.modules_to_not_convert")


def parse_quantization_config(qcfg: Mapping[str, Any] | None, source: str = "config.json") -> Mxfp4Format | None:
    """The MXFP4 format of a config's ``quantization_config`` (None: no quantization).

    Accepts the published format (``quant_method: mxfp4``, optional ``modules_to_not_convert`` and
    transformers' load-time ``dequantize`` flag). A block size other than 32 or a scale format
    other than e8m0, under any of the names other MX producers use, raises
    :class:`Mxfp4FormatError` naming the field.
    """
    if qcfg is None:
        return None
    where = f"{source}: quantization_config"
    qcfg = quantization_object(qcfg, where, Mxfp4FormatError)
    method = qcfg.get("quant_method")
    if method != FORMAT_NAME:
        raise Mxfp4FormatError(f"{where}.quant_method {method!r} is not MXFP4 (expected {FORMAT_NAME!r})")
    for key in _BLOCK_SIZE_KEYS:
        if key in qcfg and qcfg[key] not in (BLOCK, [BLOCK], [1, BLOCK]):
            raise Mxfp4FormatError(f"{where}.{key} {qcfg[key]!r} is not supported (MXFP4 blocks are {BLOCK} "
                                   "elements along the input dimension)")
    for key in _SCALE_FORMAT_KEYS:
        if key in qcfg and str(qcfg[key]).lower() not in (SCALE_FORMAT, "float8_e8m0fnu", "uint8"):
            raise Mxfp4FormatError(f"{where}.{key} {qcfg[key]!r} is not supported (only {SCALE_FORMAT} scales, "
                                   "one uint8 exponent per block)")
    return Mxfp4Format(modules_to_not_convert=format_skip_patterns(qcfg, where, Mxfp4FormatError))


def quantization_config(modules_to_not_convert: list[str]) -> dict:
    """The ``quantization_config`` an MXFP4 checkpoint publishes (gpt-oss's keys)."""
    return {"quant_method": FORMAT_NAME, "modules_to_not_convert": list(modules_to_not_convert)}


def check_tensors(blocks: torch.Tensor, scales: torch.Tensor | None, name: str = "weight") -> None:
    """Refuse a ``(*_blocks, *_scales)`` pair that :func:`dequantize` would misread, naming ``name``:
    a missing scale tensor, non-uint8 dtypes (another scale format), a last dimension other than
    16 bytes (another block size), block and scale grids that differ."""
    if scales is None:
        raise Mxfp4FormatError(f"{name}_blocks has no {name}_scales tensor: MXFP4 weights cannot be read "
                               "without their e8m0 scales")
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8:
        raise Mxfp4FormatError(f"{name}_blocks: expected uint8 packed e2m1 pairs, got "
                               f"{getattr(blocks, 'dtype', type(blocks).__name__)}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8:
        raise Mxfp4FormatError(f"{name}_scales: expected uint8 {SCALE_FORMAT} exponents, got "
                               f"{getattr(scales, 'dtype', type(scales).__name__)} (only {SCALE_FORMAT} scales are "
                               "supported)")
    if blocks.dim() < 3:
        raise Mxfp4FormatError(f"{name}_blocks: shape {list(blocks.shape)}, expected "
                               f"[..., N, K/{BLOCK}, {BLOCK_BYTES}]")
    if blocks.shape[-1] != BLOCK_BYTES:
        raise Mxfp4FormatError(f"{name}_blocks: last dimension {blocks.shape[-1]} bytes is a block of "
                               f"{2 * blocks.shape[-1]} elements; only {BLOCK}-element blocks ({BLOCK_BYTES} bytes) "
                               "are supported")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise Mxfp4FormatError(f"{name}_scales: shape {list(scales.shape)} does not match {name}_blocks "
                               f"{list(blocks.shape)} (expected {list(blocks.shape[:-1])}: one scale per block)")


def _e2m1_lut(device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
               name: str = "weight") -> torch.Tensor:
    """``[..., N, K]`` in ``dtype`` from ``blocks`` uint8 ``[..., N, K/32, 16]`` and ``scales`` uint8
    ``[..., N, K/32]``: ``e2m1(code) * 2^(s - 127)`` computed exactly and rounded once to ``dtype``
    (transformers' values bit for bit, see the module doc; its tensors are this one transposed).
    ``name`` names the tensors in errors."""
    check_tensors(blocks, scales, name)
    lut = _e2m1_lut(blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., N, G, 16, 2]: low nibble first
    exponent = scales.to(torch.int32) - SCALE_BIAS
    # float32 holds every product exactly but 2^128 and up (infinite in float32, bfloat16 and
    # float16 alike); float64 output is computed in float64 so that those stay finite there too.
    work = torch.float64 if dtype == torch.float64 else torch.float32
    values = lut.to(work)[codes].flatten(-2)  # [..., N, G, 32]
    out = torch.ldexp(values, exponent[..., None])  # an int exponent: 0 * 2^128 is 0, not 0 * inf
    return out.flatten(-2).to(dtype)


def quantize(w: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32])`` of a float ``w`` ``[..., N, K]``.

    The OCP MX v1.0 conversion (§6.3): per block of 32 along K the shared scale is
    ``2^(floor(log2(max|w|)) - 2)`` (2 = e2m1's largest exponent), its byte clamped to 0..254 (an
    all-zero block gets byte 0); each element ``w / scale`` is rounded to the nearest e2m1 value,
    ties to the even code, magnitudes above 6 saturating to 6; the sign is kept (``-0.0`` and
    negatives that round to zero are code 8). Values already of the form ``e2m1 * 2^k`` within a
    block's range come back exactly through :func:`dequantize`. This is not triton_kernels'
    ``downcast_to_mxfp_torch`` (vLLM's and transformers' on-line quantizer), which rounds the scale
    up (``max / 6`` to the next power of two, so nothing saturates) and rounds element ties away
    from zero; the two agree on representable blocks.
    """
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise Mxfp4FormatError(f"quantize {name}: expected a float tensor, got "
                               f"{getattr(w, 'dtype', type(w).__name__)}")
    if w.dim() < 2 or w.shape[-1] % BLOCK:
        raise Mxfp4FormatError(f"quantize {name}: shape {list(w.shape)}, expected [..., N, K] with K a multiple "
                               f"of {BLOCK}")
    w64 = w.to(torch.float64)
    if not torch.isfinite(w64).all():
        raise Mxfp4FormatError(f"quantize {name}: non-finite values (inf or NaN) have no MXFP4 encoding")
    grouped = w64.unflatten(-1, (w.shape[-1] // BLOCK, BLOCK))  # [..., N, G, 32]
    amax = grouped.abs().amax(dim=-1)
    _, exp2 = torch.frexp(amax)  # amax = m * 2^exp2 with m in [0.5, 1): floor(log2 amax) = exp2 - 1
    scale_exp = torch.where(amax > 0, exp2.to(torch.int32) - 1 - E2M1_EMAX,
                            torch.full_like(exp2, -SCALE_BIAS, dtype=torch.int32))
    scale_exp = scale_exp.clamp(-SCALE_BIAS, 254 - SCALE_BIAS)
    scaled = torch.ldexp(grouped, (-scale_exp)[..., None]).abs()
    code = _round_e2m1(scaled) | (torch.signbit(grouped).to(torch.uint8) << 3)
    packed = code.unflatten(-1, (BLOCK_BYTES, 2))
    blocks = packed[..., 0] | (packed[..., 1] << 4)
    return blocks.contiguous(), (scale_exp + SCALE_BIAS).to(torch.uint8).contiguous()


# Midpoints between consecutive e2m1 magnitudes; at a tie, the code above wins where it is even.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)


def _round_e2m1(magnitude: torch.Tensor) -> torch.Tensor:
    """The e2m1 magnitude code (0..7) nearest each non-negative value, ties to the even code,
    values past 6 saturating to code 7."""
    code = torch.zeros(magnitude.shape, dtype=torch.uint8, device=magnitude.device)
    for mid, up in zip(_MIDPOINTS, _TIE_UP):
        code += (magnitude >= mid) if up else (magnitude > mid)
    return code


def _gate_up_order(n: int, name: str) -> torch.Tensor:
    """Row indices taking gpt-oss's interleaved rows (gate ``2i``, up ``2i + 1``) to gate's rows then up's."""
    if n % 2:
        raise Mxfp4FormatError(f"{name}: {n} rows cannot be interleaved gate/up pairs")
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


def deinterleave_rows(t: torch.Tensor, dim: int, name: str = "gate_up_proj") -> torch.Tensor:
    """``t`` with its interleaved gate/up rows along ``dim`` reordered to all of gate's rows then
    all of up's (contiguous)."""
    return t.index_select(dim, _gate_up_order(t.shape[dim], name).to(t.device)).contiguous()


def interleave_rows(t: torch.Tensor, dim: int, name: str = "w13") -> torch.Tensor:
    """The inverse of :func:`deinterleave_rows`: gate's rows then up's along ``dim`` to gpt-oss's
    interleaved order (for writing checkpoints)."""
    return t.index_select(dim, torch.argsort(_gate_up_order(t.shape[dim], name)).to(t.device)).contiguous()


def w13_from_checkpoint(blocks: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None = None,
                        name: str = "gate_up_proj") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The engine's w13 ``(blocks [..., 2I, H/32, 16], scales [..., 2I, H/32], bias [..., 2I] or
    None)`` from gpt-oss's ``gate_up_proj_blocks`` / ``_scales`` / ``_bias`` (interleaved rows):
    gate's rows then up's, whole rows moved (no element is unpacked or changed)."""
    check_tensors(blocks, scales, name)
    rows = blocks.shape[-3]
    if bias is not None and bias.shape[-1] != rows:
        raise Mxfp4FormatError(f"{name}_bias: shape {list(bias.shape)} does not match {rows} rows of {name}_blocks")
    return (deinterleave_rows(blocks, blocks.dim() - 3, name), deinterleave_rows(scales, scales.dim() - 2, name),
            None if bias is None else deinterleave_rows(bias, bias.dim() - 1, name))


def checkpoint_from_w13(blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                        name: str = "w13") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of :func:`w13_from_checkpoint`: gpt-oss's interleaved ``gate_up_proj_*`` tensors."""
    check_tensors(blocks, scales, name)
    return (interleave_rows(blocks, blocks.dim() - 3, name), interleave_rows(scales, scales.dim() - 2, name),
            None if bias is None else interleave_rows(bias, bias.dim() - 1, name))


def matrix_bytes(rows: int, cols: int) -> int:
    """Bytes of one ``[rows, cols]`` MXFP4 matrix: ``rows * cols / 2`` of blocks plus one scale byte
    per 32 columns of each row."""
    if cols % BLOCK:
        raise Mxfp4FormatError(f"an MXFP4 matrix needs a multiple of {BLOCK} input columns, got {cols}")
    return rows * cols // 2 + rows * (cols // BLOCK)


def expert_bytes(hidden: int, intermediate: int) -> int:
    """Bytes of one routed expert's weights in MXFP4, blocks plus scales: w13 ``[2I, H]`` and w2
    ``[H, I]``. Biases (gpt-oss: ``2I + H`` values in the model dtype) are not included."""
    return matrix_bytes(2 * intermediate, hidden) + matrix_bytes(hidden, intermediate)
