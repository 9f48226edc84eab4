"""The block-FP8 format (coldset.core.fp8) against an independent float64 reference: e4m3 values decoded
from their bits here, nearest value with ties to even, per 128 x 128 block (partial edges) and per
token group of 128; the quantization_config parser's refusals."""

from __future__ import annotations

import math

import pytest
import torch

from coldset.core import fp8


def _e4m3_table() -> torch.Tensor:
    """float64 value of every finite e4m3fn code 0..255 (NaN codes 0x7f, 0xff as nan), from the bits."""
    vals = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp, man = (code >> 3) & 0xF, code & 0x7
        if exp == 0xF and man == 0x7:
            vals.append(math.nan)
        elif exp == 0:
            vals.append(sign * man / 8 * 2.0**-6)
        else:
            vals.append(sign * (1 + man / 8) * 2.0 ** (exp - 7))
    return torch.tensor(vals, dtype=torch.float64)


TABLE = _e4m3_table()


def _nearest_code(v: torch.Tensor) -> torch.Tensor:
    """Code of the nearest finite e4m3 value to each float64 ``v`` (|v| <= 448), ties to the even code."""
    finite = ~torch.isnan(TABLE)
    codes = torch.arange(256)[finite]
    vals = TABLE[finite]
    d = (v.reshape(-1, 1) - vals[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    tie = d == best
    # among equally near codes prefer an even mantissa (code parity), then the zero of v's sign
    same_sign = (codes[None, :] < 128) == (v.reshape(-1, 1) >= 0)
    score = tie.double() * 4 + ((codes % 2) == 0).double()[None, :] * 2 + same_sign.double()
    return codes[score.argmax(dim=1)].reshape(v.shape)


def _codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).long()


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (64, 48)])
def test_quantize_weight_matches_float64_reference_per_block(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[1])  # columns of different magnitude
    q, s = fp8.quantize_weight(w)
    rows, cols = shape
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == (math.ceil(rows / 128), math.ceil(cols / 128))
    w64 = w.double()
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            blk = w64[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            ref_scale = blk.abs().max() / 448.0
            assert abs(float(s[bi, bj]) - float(ref_scale)) <= 1e-7 * float(ref_scale)
            # the quotient rounded to float32 first, as the format computes it (exact: float64 division of
            # float32 operands rounded once more to float32 is float32's correctly rounded division)
            ref_codes = _nearest_code((blk / float(s[bi, bj])).float().double().clamp(-448, 448))
            got = _codes(q[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128])
            assert torch.equal(got, ref_codes), f"block ({bi}, {bj})"
    # dequantization: the published convention, q.float() * scale_inv per block; error within half an e4m3 step
    deq = fp8.dequantize_weight(q, s).double()
    scale = fp8.expand_scales(s, rows, cols).double()
    bound = torch.maximum(w64.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert bool(((deq - w64).abs() <= bound).all())
    ref_deq = TABLE[_codes(q)] * scale
    assert torch.allclose(deq, ref_deq, rtol=1e-7, atol=0)


def test_activation_groups_match_float64_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 300, generator=g) * 3
    x[2, 128:256] = 0  # an all-zero group: scale floored at 1e-10 / 448, values 0
    q, s = fp8.quantize_activations(x.to(torch.bfloat16))
    assert tuple(s.shape) == (5, 3) and q.shape == x.shape
    x64 = x.to(torch.bfloat16).double()
    for t in range(5):
        for grp in range(3):
            seg = x64[t, grp * 128:(grp + 1) * 128]
            ref_scale = max(float(seg.abs().max()), 1e-10) / 448.0
            assert abs(float(s[t, grp]) - ref_scale) <= 1e-7 * ref_scale
            want = _nearest_code((seg / float(s[t, grp])).float().double().clamp(-448, 448))
            assert torch.equal(_codes(q[t, grp * 128:(grp + 1) * 128]), want), (t, grp)
    deq = fp8.dequantize_activations(q, s).double()
    assert float((deq - x64).norm() / x64.norm()) < 2.0**-4


def test_w13_scales_are_gate_then_up_even_when_inter_is_not_a_block_multiple():
    g = torch.Generator().manual_seed(2)
    gate, up = torch.randn(200, 256, generator=g), torch.randn(200, 256, generator=g) * 10
    (qg, sg), (qu, su) = fp8.quantize_weight(gate), fp8.quantize_weight(up)
    w13 = fp8.dequantize_w13(torch.cat([qg, qu]), torch.cat([sg, su]))
    assert fp8.w13_scale_rows(200) == 4
    assert torch.equal(w13[:200], fp8.dequantize_weight(qg, sg)) and torch.equal(w13[200:], fp8.dequantize_weight(qu, su))


PUBLISHED = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
             "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.input_layernorm"]}


def test_parse_accepts_the_published_config_and_refuses_others_by_name():
    fmt = fp8.parse_quantization_config(PUBLISHED, "x/config.json")
    assert fmt.modules_to_not_convert == tuple(PUBLISHED["modules_to_not_convert"])
    assert fp8.parse_quantization_config(None) is None
    for change, field in [({"weight_block_size": [64, 64]}, "weight_block_size"),
                          ({"weight_block_size": None}, "weight_block_size"),
                          ({"activation_scheme": "static"}, "activation_scheme"),
                          ({"fmt": "e5m2"}, "fmt"),
                          ({"quant_method": "awq"}, "quant_method")]:
        with pytest.raises(fp8.Fp8FormatError, match=rf"x/config.json: quantization_config.{field}"):
            fp8.parse_quantization_config({**PUBLISHED, **change}, "x/config.json")


def test_module_matching_is_transformers_rule():
    qu = pytest.importorskip("transformers.quantizers.quantizers_utils")
    fmt = fp8.parse_quantization_config(PUBLISHED)
    names = ["lm_head", "model.layers.0.mlp.gate", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.experts.3.gate_proj",
             "model.layers.10.mlp.gate", "model.layers.1.input_layernorm", "model.layers.11.input_layernorm",
             "model.layers.0.self_attn.q_proj"]
    for name in names:
        assert fmt.converts(name) == qu.should_convert_module(name, list(PUBLISHED["modules_to_not_convert"])), name
    assert not fmt.converts("model.layers.0.mlp.gate") and fmt.converts("model.layers.0.mlp.gate_proj")
