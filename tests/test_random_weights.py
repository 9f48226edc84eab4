"""coldset.engine.random_weights: random models of published configs, each family through its own
model class, at tiny widths of the published configs on the CPU: they decode, their pools hold the
format asked for at the drawn std, the same seed gives the same model, a subset keeps what it says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coldset.core import fp8, mxfp4
from coldset.core.shapes import expert_bytes
from coldset.engine.deepseek_v3 import DeepseekV3Model
from coldset.engine.generate import generate
from coldset.engine.glm4_moe import Glm4MoeModel
from coldset.engine.gpt_oss import GPT_OSS_20B_CONFIG, GptOssModel
from coldset.engine.model import ModelLoadError, MoEModel
from coldset.engine.random_weights import (build_random_model, family_config, mxfp4_scale_exponent,
                                           subset_note, tiny_config)

SHAPES = Path(__file__).resolve().parents[1] / "config" / "examples" / "shapes"
PROMPTS = [[5, 9, 2, 7], [3, 1]]
FAMILY_CONFIGS = {"qwen3_moe": "qwen3-30b-a3b-fp8", "deepseek_v3": "deepseek-v3", "glm4_moe": "glm-4.5-air",
                  "gpt_oss": "gpt-oss-120b"}


def published(name: str) -> dict:
    return json.loads((SHAPES / name / "config.json").read_text())


def tiny(family: str) -> dict:
    """The family's published config at tiny widths (every other key as published)."""
    return tiny_config(published(FAMILY_CONFIGS[family]), vocab_size=300)


def test_tiny_config_keeps_the_family_and_narrows_it():
    for family in FAMILY_CONFIGS:
        cfg = family_config(tiny(family))
        assert cfg.model_type == family and cfg.hidden_size == 64 and cfg.num_moe_layers == 2
    ds = tiny("deepseek_v3")
    assert (ds["first_k_dense_replace"], ds["num_hidden_layers"], ds["n_group"], ds["num_key_value_heads"]) == (1, 3, 2, 4)


CASES = [("qwen3_moe", "bf16", MoEModel), ("qwen3_moe", "fp8", MoEModel), ("deepseek_v3", "fp8", DeepseekV3Model),
         ("glm4_moe", "bf16", Glm4MoeModel), ("gpt_oss", "bf16", GptOssModel), ("gpt_oss", "mxfp4", GptOssModel)]


@pytest.mark.parametrize("family, fmt, model_class", CASES)
def test_each_family_decodes_deterministically_through_its_own_class(family, fmt, model_class):
    raw = tiny(family)
    model = build_random_model(raw, "cpu", fmt, seed=3)
    assert type(model) is model_class and not any(p.is_meta for p in model.parameters())
    cfg = model.config
    assert cfg.expert_format == {"bf16": "bfloat16", "fp8": fp8.FORMAT_NAME, "mxfp4": mxfp4.FORMAT_NAME}[fmt]
    assert model.pools.is_fp8 == (fmt == "fp8") and model.pools.is_mxfp4 == (fmt == "mxfp4")
    assert model.pools.has_bias == (family == "gpt_oss")
    if family == "gpt_oss":  # its clamped SwiGLU and the sliding window on the layers layer_types names
        assert model.pools.activation.kind == "swiglu_clamped" and model.layers[0].self_attn.window == 4
    first = generate(model, PROMPTS, 4, progress=False)
    again = generate(build_random_model(raw, "cpu", fmt, seed=3), PROMPTS, 4, progress=False)
    other = generate(build_random_model(raw, "cpu", fmt, seed=4), PROMPTS, 4, progress=False)
    assert first.tokens == again.tokens and first.tokens != other.tokens
    assert all(0 <= t < cfg.vocab_size for seq in first.tokens for t in seq)


def _dequantized_experts(pools, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 and w2 of MoE layer ``layer`` in float32, by the core formats' own dequantizers."""
    E = pools.num_experts
    w13, w2 = pools.w13_hot[layer * E:(layer + 1) * E], pools.w2_hot[layer * E:(layer + 1) * E]
    if pools.is_fp8:
        s13, s2 = pools.w13_scale_hot[layer * E:(layer + 1) * E], pools.w2_scale_hot[layer * E:(layer + 1) * E]
        return fp8.dequantize_w13(w13, s13), fp8.dequantize_weight(w2, s2)
    if pools.is_mxfp4:
        s13, s2 = pools.w13_scale_hot[layer * E:(layer + 1) * E], pools.w2_scale_hot[layer * E:(layer + 1) * E]
        return (mxfp4.dequantize(w13.unflatten(-1, (-1, 16)), s13, torch.float32),
                mxfp4.dequantize(w2.unflatten(-1, (-1, 16)), s2, torch.float32))
    return w13.float(), w2.float()


@pytest.mark.parametrize("family, fmt", [("qwen3_moe", "bf16"), ("qwen3_moe", "fp8"), ("gpt_oss", "mxfp4")])
def test_pools_hold_the_format_at_std_one_over_sqrt_fan_in(family, fmt):
    raw = {**tiny(family), "hidden_size": 128, "moe_intermediate_size": 64, "intermediate_size": 64}
    model = build_random_model(raw, "cpu", fmt, seed=1)
    cfg, pools = model.config, model.pools
    L, E, I, H = cfg.num_moe_layers, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    packed = 2 if fmt == "mxfp4" else 1
    assert tuple(pools.w13_hot.shape) == (L * E, 2 * I, H // packed)
    assert tuple(pools.w2_hot.shape) == (L * E, H, I // packed)
    w13, w2 = _dequantized_experts(pools)
    rel = 2 ** 0.5 if fmt == "mxfp4" else 1.15  # MXFP4: power-of-two scales (test below), else the draw's std
    for w, fan_in in ((w13, H), (w2, I)):
        assert fan_in ** -0.5 / rel <= w.std().item() <= fan_in ** -0.5 * rel
    attn = model.layers[0].self_attn
    linear = attn.qkv_proj if hasattr(attn, "qkv_proj") else attn.q_a_proj
    assert linear.weight.dtype == torch.bfloat16 and linear.weight.float().std().item() == pytest.approx(
        H ** -0.5, rel=0.15)
    assert torch.equal(model.layers[0].input_layernorm.weight.float(), torch.ones(H))


def test_the_mxfp4_scale_gives_the_std_of_uniform_codes():
    codes = torch.tensor(mxfp4.E2M1_VALUES, dtype=torch.float64)
    rms = codes.pow(2).mean().sqrt().item()
    for fan_in in (64, 2880, 7168):  # scales: the exponent -1, 0 or +1, equally likely
        std = rms * (sum(4.0 ** (mxfp4_scale_exponent(fan_in) + j - 127) for j in (-1, 0, 1)) / 3) ** 0.5
        assert fan_in ** -0.5 / 2 ** 0.5 <= std <= fan_in ** -0.5 * 2 ** 0.5


def test_a_subset_keeps_the_dense_layers_and_the_first_moe_layers():
    raw = {**tiny("deepseek_v3"), "num_hidden_layers": 6, "first_k_dense_replace": 2}  # 2 dense, 4 MoE
    model = build_random_model(raw, "cpu", "fp8", moe_layers=2)
    cfg = model.config
    assert (cfg.num_layers, cfg.moe_layers, model.pools.num_moe_layers) == (4, (2, 3), 2)
    note = subset_note(raw, cfg, "fp8")
    assert (note["moe_layers"], note["published_moe_layers"], note["dense_layers"], note["subset"]) == (2, 4, 2, True)
    assert "first 2 of 4 MoE layers" in note["note"]
    assert generate(model, PROMPTS, 2, progress=False).tokens
    g = family_config(tiny("gpt_oss"), 1)  # 2 MoE layers, the first kept
    assert (g.num_layers, g.layer_types) == (1, ("sliding_attention",))
    with pytest.raises(ModelLoadError, match="moe_layers=3"):
        family_config(tiny("gpt_oss"), 3)


def test_published_configs_parse_at_full_size_without_drawing():
    """The real shapes the H200 tables measure: the configs parse, the bytes are the published ones."""
    oss = family_config(GPT_OSS_20B_CONFIG)
    assert (oss.num_moe_layers, oss.num_experts, oss.top_k) == (24, 32, 4)
    big = family_config(published("gpt-oss-120b"))
    assert expert_bytes(big, mxfp4.FORMAT_NAME) == 13_219_200 + 3 * 2880 * 2
    ds = family_config(published("deepseek-v3"), 4)
    assert (ds.num_layers, ds.num_moe_layers, ds.num_experts) == (7, 4, 256)
    glm = family_config(published("glm-4.5-air"), 12)
    assert (glm.num_layers, glm.num_moe_layers) == (13, 12)


def test_unknown_family_and_format_are_refused_by_name():
    with pytest.raises(ModelLoadError, match="llama4"):
        build_random_model({"model_type": "llama4"})
    with pytest.raises(ModelLoadError, match="int4"):
        build_random_model(tiny("qwen3_moe"), "cpu", "int4")
    with pytest.raises(ModelLoadError, match="moe_intermediate_size 48"):
        build_random_model({**tiny("gpt_oss"), "intermediate_size": 48}, "cpu", "mxfp4")


@pytest.mark.parametrize("family, fmt", [("qwen3_moe", "bf16"), ("deepseek_v3", "fp8"), ("glm4_moe", "bf16"),
                                         ("gpt_oss", "mxfp4")])
def test_the_step_floor_counts_every_non_expert_weight_once(family, fmt):
    """bench step's non-expert bytes (:func:`coldset.bench.decode._nonexpert_read_bytes`, from the
    shape) against the random model's own parameters and router correction biases, each counted in
    bf16 (the engine keeps routers and gpt_oss's norms in float32: a few MB at real shape), with one
    embedding row of the table read."""
    from coldset.bench.decode import _nonexpert_read_bytes

    model = build_random_model(tiny(family), "cpu", fmt)
    tensors = {id(p): p for p in model.parameters()}
    tensors.update({id(b): b for name, b in model.named_buffers() if name.endswith("e_score_correction_bias")})
    counted = sum(t.numel() * 2 for t in tensors.values())
    emb = model.embed_tokens.weight
    assert counted - emb.numel() * 2 + emb.shape[1] * 2 == _nonexpert_read_bytes(model.config, 1, torch.bfloat16)
