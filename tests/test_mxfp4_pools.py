"""MXFP4 experts in the pools (coldset.kernels.tiers: packed e2m1 + e8m0 scale pools) and the torch
path (coldset.kernels.reference) against a float64 oracle written here: weights decoded from their
bits in float64, the intermediate rounded to bf16 where the torch path and the kernel round it,
everything else float64. Tolerance: each output within 2^-7 of (|oracle| + the oracle's RMS), the
bf16 output's rounding (2^-9) plus a rare flip of the intermediate's bf16 rounding under float32
summation order. Placements bitwise the all-hot path; refusals by name. The kernel's tests
(tests/test_mxfp4_kernel.py) use these helpers and this oracle.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coldset.core import mxfp4
from coldset.kernels import torch_experts
from coldset.kernels.activation import SILU, swiglu_clamped, torch_activation
from coldset.kernels.tiers import ExpertPools, build_pools, host_tier


def make_mxfp4(num_layers, num_experts, hidden, inter, seed=0, bias=True):
    """``(w13 [L, E, 2I, H/2], w2 [L, E, H, I/2], s13 [L, E, 2I, H/32], s2 [L, E, H, I/32], b13, b2)``:
    random float weights quantized (OCP MX), packed as the pools hold them; bf16 biases or None."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_layers, num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_layers, num_experts, hidden, inter, generator=g) / inter**0.5
    (b13, s13), (b2, s2) = mxfp4.quantize(w13), mxfp4.quantize(w2)
    biases = (None, None)
    if bias:
        biases = ((torch.randn(num_layers, num_experts, 2 * inter, generator=g) * 0.1).bfloat16(),
                  (torch.randn(num_layers, num_experts, hidden, generator=g) * 0.1).bfloat16())
    return b13.flatten(-2), b2.flatten(-2), s13, s2, *biases


def routing(num_tokens, num_experts, top_k, hidden, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    w = torch.softmax(torch.randn(num_tokens, top_k, generator=g), dim=-1)
    return x, ids, w


def random_row_map(num_layers, num_experts, cold_fraction, seed):
    rng = np.random.default_rng(seed)
    cold = rng.random((num_layers, num_experts)) < cold_fraction
    rm = np.zeros((num_layers, num_experts), dtype=np.int32)
    rm[~cold] = np.arange(int((~cold).sum()))
    rm[cold] = -np.arange(1, int(cold.sum()) + 1)
    return rm


def _spec_decode(packed, scales):
    """float64 weights from the bits (independent of coldset.core.mxfp4): e2m1 sign / 2 exponent
    bits of bias 1 / 1 mantissa bit, low nibble first, times 2^(s - 127)."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    mag, sign = codes & 7, 1.0 - 2.0 * ((codes >> 3) & 1).double()
    e, m = (mag >> 1).double(), (mag & 1).double()
    val = torch.where(e == 0, 0.5 * m, 2.0 ** (e - 1) * (1 + m / 2)) * sign
    scale = torch.pow(2.0, scales.double() - 127).repeat_interleave(32, dim=-1)
    return val * scale


def float64_oracle(q, layer, x, ids, weights, activation):
    """The experts in float64 with the intermediate rounded to bf16 (where both paths round it)."""
    w13p, w2p, s13, s2, b13, b2 = q
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in torch.unique(ids).tolist():
        tok, rank = torch.where(ids == e)
        w13 = _spec_decode(w13p[layer, e], s13[layer, e])
        w2 = _spec_decode(w2p[layer, e], s2[layer, e])
        gu = x[tok].double() @ w13.T + (0 if b13 is None else b13[layer, e].double())
        gate, up = gu.chunk(2, dim=-1)
        act = torch_activation(activation, gate, up).bfloat16().double()
        y = act @ w2.T + (0 if b2 is None else b2[layer, e].double())
        out.index_add_(0, tok, y * weights[tok, rank, None].double())
    return out


def assert_close_to_oracle(out, ref, what):
    tol = 2.0**-7 * (ref.abs() + ref.pow(2).mean().sqrt())
    err = (out.double() - ref).abs()
    assert torch.isfinite(out).all() and bool((err <= tol).all()), (what, float((err / tol).max()))


def pools_of(q, activation):
    return ExpertPools.all_hot(*q[:4], w13_bias=q[4], w2_bias=q[5], activation=activation)


@pytest.mark.parametrize("activation", [SILU, swiglu_clamped(limit=1.5)], ids=["silu", "swiglu"])
@pytest.mark.parametrize("bias", [True, False])
def test_torch_mxfp4_path_against_float64(activation, bias):
    q = make_mxfp4(2, 8, 64, 96, seed=3, bias=bias)
    x, ids, w = routing(9, 8, 3, 64)
    out = torch_experts(pools_of(q, activation), 1, x, ids, w)
    assert out.dtype == torch.bfloat16
    assert_close_to_oracle(out, float64_oracle(q, 1, x, ids, w, activation), "torch path")


def test_mxfp4_placements_bitwise_all_hot_with_scales_in_the_same_rows():
    q = make_mxfp4(2, 8, 64, 96, seed=4)
    x, ids, w = routing(7, 8, 3, 64, seed=5)
    all_hot = pools_of(q, swiglu_clamped(limit=7.0))
    ref = torch_experts(all_hot, 1, x, ids, w)
    host = host_tier(all_hot)
    for seed in range(3):
        rm = random_row_map(2, 8, 0.5, seed)
        built = build_pools(*q[:2], rm, "cpu", w13_scale=q[2], w2_scale=q[3], w13_bias=q[4], w2_bias=q[5],
                            activation=all_hot.activation)
        assert built.is_mxfp4 and not built.is_fp8 and built.num_cold == int((rm < 0).sum())
        assert torch.equal(torch_experts(built, 1, x, ids, w), ref)
        assert torch.equal(torch_experts(all_hot.placed(rm, host), 1, x, ids, w), ref)
        moved = rm.reshape(-1)[np.random.default_rng(seed).permutation(16)].reshape(2, 8)
        built.apply_placement(moved)  # weights and scales move together
        assert torch.equal(torch_experts(built, 1, x, ids, w), ref)


def test_mxfp4_pools_refuse_missing_or_misshapen_scales():
    q = make_mxfp4(1, 4, 64, 96, bias=False)
    with pytest.raises(ValueError, match="MXFP4 .* without their e8m0 scale pools"):
        ExpertPools.all_hot(q[0], q[1])
    with pytest.raises(ValueError, match="w13_scale_hot: shape"):
        ExpertPools.all_hot(q[0], q[1], q[2][..., :1], q[3])
    with pytest.raises(ValueError, match="w2_scale_hot: expected a contiguous torch.uint8"):
        ExpertPools.all_hot(q[0], q[1], q[2], q[3].float())
    with pytest.raises(ValueError, match="MXFP4 rows"):
        ExpertPools.all_hot(q[0][..., :16], q[1], q[2][..., :1], q[3])
    bad = q[2].clone()
    bad[0, 1, 2, 0] = 255
    with pytest.raises(mxfp4.Mxfp4FormatError, match="w13_scale: e8m0 scale 255"):
        ExpertPools.all_hot(q[0], q[1], bad, q[3])
    with pytest.raises(mxfp4.Mxfp4FormatError, match="w13_scale: e8m0 scale 255"):
        build_pools(q[0], q[1], random_row_map(1, 4, 0.5, 0), "cpu", w13_scale=bad, w2_scale=q[3])


def test_mxfp4_slot_cache_fills_scales_with_their_weights():
    """A CPU slot cache over MXFP4 pools that has just filled cold experts into slots: every slot
    holds its owner's packed weights and scales (the cache's own content check), and the torch path
    on it is bitwise the all-hot output, token group after token group."""
    from coldset.engine.cache.pool import SlotCache

    q = make_mxfp4(2, 8, 64, 96, seed=6)
    all_hot = pools_of(q, swiglu_clamped(limit=7.0))
    x, ids, w = routing(6, 8, 3, 64, seed=6)
    flat = np.arange(16).reshape(2, 8)
    warm = np.where(flat % 8 < 3, flat, -flat - 1)  # 3 warm experts a layer in 6 slots
    rm = np.where(warm >= 0, np.cumsum(warm >= 0).reshape(2, 8) - 1, -np.cumsum(warm < 0).reshape(2, 8)).astype(np.int32)
    cache = SlotCache.build(all_hot, host_tier(all_hot), rm, np.ones(6), "lru", max_tokens=2, top_k=3)
    for t in range(0, 6, 2):
        cache.admit(1, ids[t:t + 2])
        cache.check(contents=True)
        group = (x[t:t + 2], ids[t:t + 2], w[t:t + 2])
        assert torch.equal(torch_experts(cache.pools, 1, *group), torch_experts(all_hot, 1, *group))
    assert cache.pools.is_mxfp4 and (cache.pools.row_map[1].numpy() != rm[1]).any()
