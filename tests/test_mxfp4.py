"""The MXFP4 format (coldset.core.mxfp4) against transformers' own dequantization
(``integrations.mxfp4.convert_moe_packed_tensors``, pure torch: it runs on the CPU) bit for bit,
against an independent decoding of the e2m1 / e8m0 bits written here from the OCP MX spec, and
the quantizer against a brute-force nearest-value search; the layout transform against
transformers' gate/up split; the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from coldset.core import mxfp4, shapes

INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
            torch.float64: torch.int64}
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t`` (so -0.0 differs from 0.0 and infinities compare)."""
    return t.contiguous().view(INT_VIEW[t.dtype])


def _e2m1_spec(code: int) -> float:
    """An e2m1 code's value from its bits (OCP MX v1.0: sign, 2 exponent bits of bias 1, 1 mantissa bit)."""
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    return sign * (man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2))


def _spec_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Independent float64 decoding: element 2j in byte j's low nibble, 2j+1 in its high nibble,
    times 2^(s - 127) (s = 255 read as 2^128, transformers' reading), rounded once to ``dtype``."""
    table = torch.tensor([_e2m1_spec(c) for c in range(16)], dtype=torch.float64)
    lo, hi = table[(blocks & 0xF).long()], table[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., N, G, 32]
    scale = torch.tensor([2.0 ** (s - 127) for s in range(256)], dtype=torch.float64)[scales.long()]
    return (vals * scale[..., None]).flatten(-2).to(dtype)


def _every_code_and_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [1, 256, 16, 16]: row r holds every byte value once in each of its 16 blocks; scales
    [1, 256, 16]: row r's blocks all have scale byte r. Every (code, code, scale) triple occurs."""
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).expand(1, 256, 16, 16).contiguous()
    scales = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1).expand(1, 256, 16).contiguous()
    return blocks, scales


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_matches_transformers_bitwise_every_code_and_scale(dtype):
    blocks, scales = _every_code_and_scale()
    ours = mxfp4.dequantize(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(-1, -2)  # theirs is [E, K, N]
    assert ours.shape == (1, 256, 512) and ours.dtype == dtype
    assert torch.equal(_bits(ours), _bits(theirs))
    assert torch.equal(_bits(ours), _bits(_spec_dequantize(blocks, scales, dtype)))


def test_scale_ends_as_transformers_reads_them():
    """s = 0 is 2^-127 (no flush to zero in bf16/float32); s = 255 is 2^128: 0.5 * 2^128 finite,
    1 * 2^128 infinite, zero stays zero (no NaN)."""
    blocks, scales = _every_code_and_scale()
    out = mxfp4.dequantize(blocks, scales, torch.float32)[0]
    assert out[0, 2].item() == 2.0**-128 and out[0, 2].item() > 0  # code 1 (0.5) at s = 0
    assert out[255, 2].item() == 2.0**127  # code 1 at s = 255
    assert math.isinf(out[255, 4].item())  # code 2 (1.0) at s = 255
    assert not torch.isnan(out).any()
    assert out[255, 0].item() == 0.0
    assert torch.signbit(out[0, 16]).item() and out[0, 16].item() == 0.0  # byte 8: code 8 (-0.0) in the low nibble


@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
def test_dequantize_odd_shapes(lead):
    g = torch.Generator().manual_seed(len(lead))
    blocks = torch.randint(0, 256, (*lead, 5, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (*lead, 5, 3), dtype=torch.uint8, generator=g)
    out = mxfp4.dequantize(blocks, scales, torch.bfloat16)
    assert out.shape == (*lead, 5, 96)
    assert torch.equal(_bits(out), _bits(_spec_dequantize(blocks, scales, torch.bfloat16)))
    if len(lead) == 1:
        assert torch.equal(_bits(out), _bits(convert_moe_packed_tensors(blocks, scales).transpose(-1, -2)))


def test_round_trip_of_representable_values_is_exact():
    """Any block of e2m1 values times its power of two (every scale byte but 255, every code incl.
    -0.0) comes back bit for bit through quantize then dequantize."""
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (4, 255, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.arange(255, dtype=torch.uint8).reshape(1, 255, 1).expand(4, 255, 3).contiguous()
    values = mxfp4.dequantize(blocks, scales, torch.float64)  # float64: 6 x 2^127 is finite there
    b2, s2 = mxfp4.quantize(values)
    assert b2.shape == blocks.shape and s2.shape == scales.shape and b2.dtype == s2.dtype == torch.uint8
    assert torch.equal(_bits(mxfp4.dequantize(b2, s2, torch.float64)), _bits(values))
    # a block with a 4 or a 6 in it keeps its scale and codes too (the OCP scale is max's exponent - 2)
    full = blocks.clone()
    full[..., 0] = (full[..., 0] & 0xF0) | 0x7  # code 7 (6.0) first in every block
    again = mxfp4.quantize(mxfp4.dequantize(full, scales, torch.float64))
    assert torch.equal(again[0], full) and torch.equal(again[1], scales)


def _brute_quantize(w: torch.Tensor) -> torch.Tensor:
    """float64 values of the OCP MX conversion, by search: per block of 32 the scale
    2^(floor(log2 max|w|) - 2) (byte clamped to 0..254; all-zero: byte 0), each element the nearest
    of the 16 code values times the scale, ties to the even code, beyond 6 x scale: 6 x scale."""
    table = torch.tensor([_e2m1_spec(c) for c in range(8)], dtype=torch.float64)
    out = torch.empty(w.shape, dtype=torch.float64)
    flat, res = w.double().reshape(-1, 32), out.view(-1, 32)
    for b in range(flat.shape[0]):
        amax = flat[b].abs().max().item()
        e = math.frexp(amax)[1] - 1 - 2 if amax > 0 else -127
        scale = 2.0 ** min(max(e, -127), 127)
        for j in range(32):
            v = flat[b, j].item()
            d = [abs(abs(v) / scale - t) for t in table.tolist()]
            best = min(d)
            code = min((c for c in range(8) if d[c] == best), key=lambda c: (c % 2, c))
            res[b, j] = math.copysign(table[code].item() * scale, v)
    return out


def test_quantize_matches_brute_force_nearest_ties_even_and_saturation():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 4, 64, generator=g, dtype=torch.float64) * torch.logspace(-30, 30, 4, dtype=torch.float64)[:, None]
    w = w.reshape(3, 4, 64)
    # exact ties of every pair of neighbours, and values past 6 x scale (7.5 x 2^k: max exponent k + 2, 7.5 saturates)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
                         7.5, -7.0, 0.0, -0.0] + [0.1] * 14, dtype=torch.float64) * 2.0**-3
    w[0, 0, :32] = ties
    w[1, 2, 32:] = 0.0
    b, s = mxfp4.quantize(w.float())
    got = mxfp4.dequantize(b, s, torch.float64)
    want = _brute_quantize(w.float())
    assert torch.equal(_bits(got), _bits(want))
    assert s[1, 2, 1].item() == 0  # an all-zero block gets scale byte 0
    assert got[0, 0, 14].item() == 6.0 * 2.0**-3 and got[0, 0, 15].item() == -6.0 * 2.0**-3


def test_w13_from_checkpoint_is_transformers_gate_then_up():
    """Our w13 dequantized = transformers' gate_up_proj split as its experts split it (gate
    ``[..., ::2]``, up ``[..., 1::2]``), transposed to [out, in]; the bias likewise; and back."""
    g = torch.Generator().manual_seed(3)
    e, inter, hidden = 3, 5, 64
    blocks = torch.randint(0, 256, (e, 2 * inter, hidden // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 134, (e, 2 * inter, hidden // 32), dtype=torch.uint8, generator=g)
    bias = torch.randn(e, 2 * inter, generator=g)
    wb, ws, wbias = mxfp4.w13_from_checkpoint(blocks, scales, bias)
    gate_up = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, H, 2I]
    w13 = mxfp4.dequantize(wb, ws, torch.float32)
    assert torch.equal(w13[:, :inter], gate_up[..., ::2].transpose(1, 2))
    assert torch.equal(w13[:, inter:], gate_up[..., 1::2].transpose(1, 2))
    assert torch.equal(wbias, torch.cat([bias[:, ::2], bias[:, 1::2]], dim=1))
    back = mxfp4.checkpoint_from_w13(wb, ws, wbias)
    assert all(torch.equal(a, b) for a, b in zip(back, (blocks, scales, bias)))


def test_down_proj_is_w2_as_stored():
    g = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (2, 64, 3, 16), dtype=torch.uint8, generator=g)  # [E, H, I/32, 16], I = 96
    scales = torch.randint(120, 134, (2, 64, 3), dtype=torch.uint8, generator=g)
    down = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, I, H]: x_I @ down
    assert torch.equal(mxfp4.dequantize(blocks, scales), down.transpose(1, 2))


def test_expert_bytes_is_the_shapes_byte_model():
    f = shapes.get_weight_format("mxfp4")
    for hidden, inter in ((2880, 2880), (64, 96), (2048, 768)):
        assert mxfp4.expert_bytes(hidden, inter) == 2 * f.matrix_bytes(inter, hidden) + f.matrix_bytes(hidden, inter)
        assert mxfp4.expert_bytes(hidden, inter) == 3 * hidden * inter // 2 + 3 * hidden * inter // 32
    blocks, scales = mxfp4.quantize(torch.randn(2 * 96, 64))
    assert blocks.numel() + scales.numel() == mxfp4.matrix_bytes(2 * 96, 64)


def test_refusals_name_the_tensor_or_field():
    blocks, scales = torch.zeros(2, 4, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, 3, dtype=torch.uint8)
    with pytest.raises(mxfp4.Mxfp4FormatError, match="down_proj_scales"):
        mxfp4.dequantize(blocks, None, name="down_proj")
    with pytest.raises(mxfp4.Mxfp4FormatError, match="16-element blocks|32-element"):
        mxfp4.dequantize(torch.zeros(2, 4, 3, 8, dtype=torch.uint8), scales)
    with pytest.raises(mxfp4.Mxfp4FormatError, match="e8m0"):
        mxfp4.dequantize(blocks, scales.float())
    with pytest.raises(mxfp4.Mxfp4FormatError, match="weight_blocks: expected uint8"):
        mxfp4.dequantize(blocks.to(torch.int8), scales)
    with pytest.raises(mxfp4.Mxfp4FormatError, match="does not match"):
        mxfp4.dequantize(blocks, scales[:, :3])
    with pytest.raises(mxfp4.Mxfp4FormatError, match="multiple of 32"):
        mxfp4.quantize(torch.randn(4, 48))
    with pytest.raises(mxfp4.Mxfp4FormatError, match="non-finite"):
        mxfp4.quantize(torch.tensor([[math.inf] + [0.0] * 31]))
    with pytest.raises(mxfp4.Mxfp4FormatError, match="cannot be interleaved"):
        mxfp4.w13_from_checkpoint(blocks[:, :3], scales[:, :3])


def test_quantization_config_parser():
    published = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    fmt = mxfp4.parse_quantization_config(published)
    assert fmt.converts("model.layers.0.mlp.experts") and not fmt.converts("lm_head")
    assert mxfp4.parse_quantization_config(mxfp4.quantization_config(["lm_head"])).modules_to_not_convert == ("lm_head",)
    assert mxfp4.parse_quantization_config(None) is None
    for bad, field in (({"quant_method": "fp8"}, "quant_method"),
                       ({"quant_method": "mxfp4", "group_size": 16}, "group_size"),
                       ({"quant_method": "mxfp4", "block_size": 64}, "block_size"),
                       ({"quant_method": "mxfp4", "scale_format": "e4m3"}, "scale_format"),
                       ({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}, "modules_to_not_convert")):
        with pytest.raises(mxfp4.Mxfp4FormatError, match=f"x.json: quantization_config.{field}"):
            mxfp4.parse_quantization_config(bad, source="x.json")


@pytest.mark.gpu
def test_dequantize_on_cuda_equals_cpu():
    blocks, scales = _every_code_and_scale()
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(_bits(mxfp4.dequantize(blocks.cuda(), scales.cuda(), dtype).cpu()),
                           _bits(mxfp4.dequantize(blocks, scales, dtype)))
