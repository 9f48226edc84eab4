"""Expert biases and gpt-oss's clamped SwiGLU in the routed-experts paths.

The torch path (:func:`coldset.kernels.torch_experts`) with ``w13_bias`` / ``w2_bias`` and
``swiglu_clamped`` against an independent float64 loop written from transformers' formula and
against transformers' own ``GptOssExperts`` with the same weights (gate and up re-interleaved as
the checkpoint stores them), in float32; every placement (hot/cold rows, ``placed`` over a host
tier, a slot cache that has just filled cold experts) bitwise the all-hot output with biases read
by expert id; bad biases and activations refused naming the tensor or field. The Triton kernels'
variants are checked against the torch path under the interpreter (:mod:`test_expert_bias_triton`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from coldset.kernels import torch_experts
from coldset.kernels.activation import (
    SILU, Activation, activation_from_config, swiglu_clamped, torch_activation)
from coldset.kernels.tiers import ExpertPools, build_pools, host_tier

L, E, H, I, K = 2, 6, 40, 18, 3  # odd shapes: I and H not multiples of any tile


def make_experts(dtype=torch.float32, seed=0, scale=1.0):
    """(w13 [L, E, 2I, H] gate rows then up rows, w2 [L, E, H, I], w13_bias [L, E, 2I], w2_bias
    [L, E, H]); ``scale`` large enough that gate and up pass gpt-oss's limit often."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(L, E, 2 * I, H, generator=g) * scale / H**0.5
    w2 = torch.randn(L, E, H, I, generator=g) / I**0.5
    b13 = torch.randn(L, E, 2 * I, generator=g) * scale
    b2 = torch.randn(L, E, H, generator=g)
    return tuple(t.to(dtype) for t in (w13, w2, b13, b2))


def make_routing(tokens, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, H, generator=g) * 3).to(dtype)
    scores, ids = torch.randn(tokens, E, generator=g).topk(K, dim=-1)
    return x, ids, torch.softmax(scores, dim=-1).to(dtype)  # gpt-oss: softmax over the k chosen


def float64_gpt_oss_experts(w13, w2, b13, b2, layer, x, ids, weights, alpha, limit):
    """transformers' GptOssExperts formula per (token, rank), in float64, from de-interleaved weights."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for r in range(ids.shape[1]):
            e = int(ids[t, r])
            gu = w13[layer, e].double() @ x[t].double() + b13[layer, e].double()
            gate, up = gu[:I].clamp(max=limit), gu[I:].clamp(-limit, limit)
            glu = gate * torch.sigmoid(gate * alpha)
            out[t] += (w2[layer, e].double() @ ((up + 1) * glu) + b2[layer, e].double()) * float(weights[t, r])
    return out


def rel_err(a, ref):
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def test_torch_path_with_biases_and_clamped_swiglu_against_float64():
    w13, w2, b13, b2 = make_experts(scale=3.0)
    act = swiglu_clamped(limit=7.0)
    pools = ExpertPools.all_hot(w13, w2, w13_bias=b13, w2_bias=b2, activation=act)
    x, ids, w = make_routing(9)
    for layer in range(L):
        ref = float64_gpt_oss_experts(w13, w2, b13, b2, layer, x, ids, w, act.alpha, act.limit)
        assert rel_err(torch_experts(pools, layer, x, ids, w), ref) < 1e-6
    # the clamp is exercised (gate and up pass the limit on both sides), and it matters
    gu = torch.einsum("th,eih->tei", x, w13[1]) + b13[1][None]
    assert (gu[..., :I] > 7).any() and (gu[..., I:] < -7).any() and (gu[..., I:] > 7).any()
    wide = float64_gpt_oss_experts(w13, w2, b13, b2, 1, x, ids, w, act.alpha, 1e9)
    assert rel_err(torch_experts(pools, 1, x, ids, w), wide) > 1e-2
    # and so do the biases: without them the output is another one
    plain = ExpertPools.all_hot(w13, w2, w13_bias=torch.zeros_like(b13), w2_bias=torch.zeros_like(b2), activation=act)
    assert rel_err(torch_experts(plain, 1, x, ids, w), ref) > 1e-2


def _gpt_oss_module(w13, w2, b13, b2, layer, act):
    """transformers' GptOssExperts holding layer ``layer``'s experts, gate and up interleaved."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
                       swiglu_limit=act.limit)
    cfg._experts_implementation = "eager"
    assert cfg.swiglu_alpha == act.alpha
    mod = GptOssExperts(cfg)
    gate_up = torch.empty(E, H, 2 * I)
    gate_up[..., ::2], gate_up[..., 1::2] = w13[layer, :, :I].transpose(1, 2), w13[layer, :, I:].transpose(1, 2)
    bias = torch.empty(E, 2 * I)
    bias[:, ::2], bias[:, 1::2] = b13[layer, :, :I], b13[layer, :, I:]
    with torch.no_grad():
        mod.gate_up_proj.copy_(gate_up)
        mod.gate_up_proj_bias.copy_(bias)
        mod.down_proj.copy_(w2[layer].transpose(1, 2))
        mod.down_proj_bias.copy_(b2[layer])
    return mod


def test_torch_path_against_transformers_gpt_oss_experts():
    w13, w2, b13, b2 = make_experts(scale=3.0, seed=3)
    hf_cfg = {"model_type": "gpt_oss", "swiglu_limit": 7.0, "hidden_act": "silu"}
    act = activation_from_config(hf_cfg)  # published configs carry swiglu_limit, not alpha
    assert act == Activation("swiglu_clamped", alpha=1.702, limit=7.0)
    pools = ExpertPools.all_hot(w13, w2, w13_bias=b13, w2_bias=b2, activation=act)
    x, ids, w = make_routing(11, seed=4)
    for layer in range(L):
        with torch.no_grad():
            ref = _gpt_oss_module(w13, w2, b13, b2, layer, act)(x, ids, w)
        out = torch_experts(pools, layer, x, ids, w)
        assert rel_err(out, ref) < 1e-5, layer
        assert rel_err(out, float64_gpt_oss_experts(w13, w2, b13, b2, layer, x, ids, w, act.alpha, act.limit)) < 1e-6


def test_torch_path_in_bf16_rounds_as_transformers():
    """bf16: transformers rounds the product, the bias sum and every activation op in bf16; the torch
    path does the same ops, so it stays as close to the float64 formula as transformers' module."""
    w13, w2, b13, b2 = make_experts(scale=3.0, seed=5)
    act = swiglu_clamped(limit=7.0)
    x, ids, w = make_routing(7, seed=6)
    bf = [t.bfloat16() for t in (w13, w2, b13, b2)]
    pools = ExpertPools.all_hot(*bf[:2], w13_bias=bf[2], w2_bias=bf[3], activation=act)
    xb, wb = x.bfloat16(), w.bfloat16()
    ref = float64_gpt_oss_experts(*bf, 0, xb, ids, wb, act.alpha, act.limit)
    with torch.no_grad():
        hf = _gpt_oss_module(*bf, 0, act).bfloat16()(xb, ids, wb)
    out = torch_experts(pools, 0, xb, ids, wb)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 2 * rel_err(hf, ref) + 1e-3, (rel_err(out, ref), rel_err(hf, ref))
    assert rel_err(out, hf) < 1e-3  # the same ops in the same order: measured bitwise equal on x86 CPU


def test_silu_default_is_unchanged_by_zero_biases_and_the_activation_field():
    """Zero biases with SiLU give the bias-free path's output bit for bit in float32 (x + 0 = x)."""
    w13, w2, _, _ = make_experts(seed=7)
    x, ids, w = make_routing(5, seed=8)
    plain = torch_experts(ExpertPools.all_hot(w13, w2), 1, x, ids, w)
    zero = ExpertPools.all_hot(w13, w2, w13_bias=torch.zeros(L, E, 2 * I), w2_bias=torch.zeros(L, E, H))
    assert torch.equal(torch_experts(zero, 1, x, ids, w), plain)
    g, u = torch.randn(4, I), torch.randn(4, I)
    assert torch.equal(torch_activation(SILU, g, u), torch.nn.functional.silu(g) * u)


def _random_row_map(seed, cold_fraction=0.5):
    rng = np.random.default_rng(seed)
    n = L * E
    cold = rng.random(n) < cold_fraction
    cold[0], cold[1] = True, False  # both tiers used
    rows = np.empty(n, dtype=np.int32)
    rows[~cold] = rng.permutation(int((~cold).sum()))
    rows[cold] = -rng.permutation(int(cold.sum())) - 1
    return rows.reshape(L, E)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_placements_bitwise_equal_all_hot_with_biases(dtype):
    from coldset.engine.cache.pool import SlotCache

    w13, w2, b13, b2 = make_experts(dtype, scale=3.0, seed=9)
    act = swiglu_clamped(limit=7.0)
    all_hot = ExpertPools.all_hot(w13, w2, w13_bias=b13, w2_bias=b2, activation=act)
    x, ids, w = make_routing(10, dtype, seed=10)
    base = [torch_experts(all_hot, layer, x, ids, w) for layer in range(L)]
    host = host_tier(all_hot)
    for seed in range(3):
        rm = _random_row_map(seed)
        built = build_pools(w13, w2, rm, "cpu", w13_bias=b13, w2_bias=b2, activation=act)
        placed = all_hot.placed(rm, host)
        assert placed.w13_bias is all_hot.w13_bias and placed.activation == act
        for layer in range(L):
            assert torch.equal(torch_experts(built, layer, x, ids, w), base[layer]), (seed, layer)
            assert torch.equal(torch_experts(placed, layer, x, ids, w), base[layer]), (seed, layer)
    # a slot cache that has just filled cold experts into slots: biases by expert id, unchanged
    warm = np.where(np.arange(L * E).reshape(L, E) % E < 3, 0, -1)
    rm = np.where(warm >= 0, np.cumsum(warm >= 0).reshape(L, E) - 1, -np.cumsum(warm < 0).reshape(L, E))
    cache = SlotCache.build(all_hot, host, rm.astype(np.int32), np.ones(3 * L), "lru", max_tokens=2, top_k=K)
    cache.admit(1, ids[:2])
    assert (cache.pools.row_map[1].numpy() != rm[1]).any() and cache.pools.w13_bias is all_hot.w13_bias
    assert torch.equal(torch_experts(cache.pools, 1, x, ids, w), base[1])


def test_bad_biases_and_activations_are_refused_by_name():
    w13, w2, b13, b2 = make_experts()
    cases = [
        (dict(w13_bias=b13), "ExpertPools.w2_bias"),
        (dict(w2_bias=b2), "ExpertPools.w13_bias"),
        (dict(w13_bias=b13[..., :I], w2_bias=b2), "ExpertPools.w13_bias: shape"),
        (dict(w13_bias=b13, w2_bias=b2[..., 1:]), "ExpertPools.w2_bias: shape"),
        (dict(w13_bias=b13.double(), w2_bias=b2.double()), "ExpertPools.w13_bias: dtype"),
        (dict(w13_bias=b13, w2_bias=b2.half()), "ExpertPools.w2_bias: dtype"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            ExpertPools.all_hot(w13, w2, **kwargs)
    pools = ExpertPools.all_hot(w13, w2, w13_bias=b13, w2_bias=b2)  # all_hot copies a strided bias; a direct one:
    with pytest.raises(ValueError, match="ExpertPools.w13_bias: strides .* not contiguous"):
        dataclasses.replace(pools, w13_bias=b13.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="ExpertPools.w2_bias: shape"):
        build_pools(w13, w2, _random_row_map(0), "cpu", w13_bias=b13, w2_bias=b2[:1])
    with pytest.raises(TypeError, match="ExpertPools.activation"):
        ExpertPools.all_hot(w13, w2, activation="swiglu_clamped")
    for kwargs, match in [(dict(kind="gelu"), "Activation.kind"), (dict(kind="silu", limit=7.0), "takes no"),
                          (dict(kind="swiglu_clamped", alpha=1.702), "Activation.limit"),
                          (dict(kind="swiglu_clamped", alpha=-1.0, limit=7.0), "Activation.alpha"),
                          (dict(kind="swiglu_clamped", alpha=1.702, limit=float("inf")), "Activation.limit")]:
        with pytest.raises(ValueError, match=match):
            Activation(**kwargs)
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        activation_from_config({"hidden_act": "gelu"})
    assert activation_from_config({"hidden_act": "silu"}) == SILU and activation_from_config({}) == SILU
    assert activation_from_config({"swiglu_limit": 5.0, "swiglu_alpha": 2.0}) == swiglu_clamped(5.0, 2.0)


def test_bias_bytes_are_resident_and_counted_once():
    w13, w2, b13, b2 = make_experts(torch.bfloat16)
    pools = build_pools(w13, w2, _random_row_map(1), "cpu", w13_bias=b13, w2_bias=b2)
    assert pools.has_bias and pools.bias_bytes == L * E * (2 * I + H) * 2
    assert not ExpertPools.all_hot(w13, w2).has_bias and ExpertPools.all_hot(w13, w2).bias_bytes == 0


def test_autotune_key_and_tuning_pools_carry_the_variant(tmp_path):
    from coldset.kernels.tune import TuneShape, autotune, autotune_key, result_from_entry

    base = TuneShape(E, H, I, K, "float32", L, L * E, 0)
    variants = [base, dataclasses.replace(base, expert_bias=True),
                dataclasses.replace(base, activation=swiglu_clamped(7.0)),
                dataclasses.replace(base, expert_bias=True, activation=swiglu_clamped(5.0))]
    assert len({autotune_key(s, [2], "cpu") for s in variants}) == len(variants)
    silu = dataclasses.replace(base, activation=Activation())  # SiLU is the default code: the same key
    assert silu.activation is None and autotune_key(silu, [2], "cpu") == autotune_key(base, [2], "cpu")
    result = autotune(variants[3], [2], "cpu", cache_dir=tmp_path, reps=1)  # the torch path on biased pools
    entry = __import__("json").loads(result.path.read_text())
    assert result_from_entry(entry).shape == variants[3]
