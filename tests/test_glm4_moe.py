"""glm4_moe in the embedded engine against transformers' Glm4MoeForCausalLM on tiny random
checkpoints of odd shapes it wrote itself: greedy tokens, every step's logits (float32, within
LOGIT_ATOL) and the routed experts and their weights at every token and MoE layer; the partial
RoPE's frequencies; unsupported variants refused by field name."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from coldset.core.shapes import parameter_counts, read_shape
from coldset.engine.deepseek_v3 import DeepseekMoE
from coldset.engine.generate import generate
from coldset.engine.glm4_moe import Glm4MoeConfig, Glm4MoeModel
from coldset.engine.loading import load_model, read_config

from family_oracle import (assert_config_refused, assert_cuda_placements_bitwise_eager_and_compiled,
                           assert_graphed_step_decodes_generate, assert_greedy_matches,
                           assert_random_half_placement_bitwise, checkpoints_by_variant)
from test_deepseek_v3 import NEW_TOKENS, PROMPTS, _routers

transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-4  # float32, every step of every prompt

# Two variants: q/k/v biases, qk-norm, half the head rotated, a dense first layer, 2 groups of 5
# experts with one kept, one shared expert; and no biases or qk-norm, 3/4 of the head rotated,
# one kv head for 5 query heads, every layer MoE, one group, two shared experts, no
# renormalisation and tied embeddings.
VARIANTS = {
    "bias_qknorm": dict(
        hidden_size=44, intermediate_size=60, moe_intermediate_size=20, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, first_k_dense_replace=1, n_routed_experts=10,
        n_group=2, topk_group=1, num_experts_per_tok=3, n_shared_experts=1, routed_scaling_factor=1.7,
        norm_topk_prob=True, attention_bias=True, use_qk_norm=True, num_mtp_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "plain_mqa": dict(
        hidden_size=36, intermediate_size=52, moe_intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=5, num_key_value_heads=1, head_dim=16, first_k_dense_replace=0, n_routed_experts=9,
        n_group=1, topk_group=1, num_experts_per_tok=2, n_shared_experts=2, routed_scaling_factor=2.5,
        norm_topk_prob=False, attention_bias=False, use_qk_norm=False, num_mtp_layers=0, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.75}),
}


def build_checkpoint(variant: str, out, seed: int = 0, vocab_size: int = 97, max_positions: int = 64):
    """Save a random float32 Glm4MoeForCausalLM of ``variant`` (weights std 0.2, random q/k/v biases
    and ``e_score_correction_bias``, so both move the result) with save_pretrained."""
    torch.manual_seed(seed)
    cfg = transformers.Glm4MoeConfig(vocab_size=vocab_size, max_position_embeddings=max_positions,
                                     initializer_range=0.2,
                                     bos_token_id=None, eos_token_id=None, pad_token_id=None, **VARIANTS[variant])
    model = transformers.Glm4MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            if cfg.attention_bias:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.2)
            if i >= cfg.first_k_dense_replace:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoints_by_variant(tmp_path_factory, build_checkpoint)


def load(folder, dtype=torch.float32) -> Glm4MoeModel:
    model = load_model(folder, dtype=dtype)
    assert isinstance(model, Glm4MoeModel) and isinstance(model.config, Glm4MoeConfig)
    return model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_decode_matches_transformers(checkpoint, variant):
    """Left-padded batched decode (prefill, then NEW_TOKENS steps) against transformers' own
    generate per unpadded prompt: the same tokens, logits within LOGIT_ATOL at every step, the
    same experts (as sets; both routers' top-k is unsorted) and weights at every token and layer."""
    path = checkpoint(variant)
    model = load(path)
    cfg = model.config
    assert isinstance(model.layers[-1].mlp, DeepseekMoE)
    hf = transformers.Glm4MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_greedy_matches(model, hf, PROMPTS, NEW_TOKENS, _routers(hf, cfg), LOGIT_ATOL)


@pytest.mark.parametrize("variant, rotary_dim", [("bias_qknorm", 6), ("plain_mqa", 12)])
def test_partial_rope_is_transformers(checkpoint, variant, rotary_dim):
    path = checkpoint(variant)
    model = load(path)
    hf = transformers.Glm4MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.rotary_dim == rotary_dim
    assert torch.equal(model.inv_freq, hf.model.rotary_emb.inv_freq)


def test_the_attention_biases_and_the_correction_bias_matter(checkpoint):
    """Zeroing the q/k/v biases changes the logits, and zeroing e_score_correction_bias changes
    the chosen experts somewhere, so the oracle test exercises both."""
    model = load(checkpoint("bias_qknorm"))
    ref = generate(model, PROMPTS, 4, capture_routing=True, progress=False, return_all_logits=True)
    for layer in model.layers:
        if isinstance(layer.mlp, DeepseekMoE):
            layer.mlp.e_score_correction_bias.zero_()
    unbiased = generate(model, PROMPTS, 4, capture_routing=True, progress=False, return_all_logits=True)
    assert any(not torch.equal(a.experts.sort(-1)[0], b.experts.sort(-1)[0])
               for a, b in zip(ref.routing, unbiased.routing))
    model = load(checkpoint("bias_qknorm"))
    for layer in model.layers:
        layer.self_attn.qkv_proj.bias.zero_()
    no_attn_bias = generate(model, PROMPTS, 1, progress=False, return_all_logits=True)
    assert (no_attn_bias.all_logits[:, 0] - ref.all_logits[:, 0]).abs().max().item() > 1e-3


def test_a_placement_is_bitwise_all_hot(checkpoint):
    assert_random_half_placement_bitwise(load(checkpoint("plain_mqa")), PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_shape_counts_transformers_parameters(checkpoint, variant):
    """The glm4_moe shape every stage reads (coldset.core.shapes, from config.json alone) counts
    the parameters transformers' model holds (its buffers aside: the correction bias is counted with
    the router), part by part in total."""
    path = checkpoint(variant)
    shape = read_shape(path)
    hf = transformers.Glm4MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
    biases = sum(b.numel() for name, b in hf.named_buffers() if name.endswith("e_score_correction_bias"))
    assert sum(parameter_counts(shape).values()) == sum(p.numel() for p in hf.parameters()) + biases
    assert shape.model_type == "glm4_moe" and shape.moe_layers == read_config(path).moe_layers


def test_mtp_layers_are_skipped_with_a_log_line(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="coldset.engine.glm4_moe"):
        load(checkpoint("bias_qknorm"))
    assert "skipping 1 multi-token-prediction layer(s) (model.layers.3 and on)" in caplog.text


def test_the_fused_decode_step_is_refused(checkpoint):
    model = load(checkpoint("plain_mqa"))
    with pytest.raises(ValueError, match=r"fused=True.*glm4_moe"):
        model.compile_decode(fused=True)


def test_published_layout_top_level_rope_fields(checkpoint, tmp_path):
    """GLM-4.5's own config.json layout: ``partial_rotary_factor`` and ``rope_theta`` at the top
    level, ``rope_scaling`` null, fields left to transformers' defaults."""
    raw = json.loads((checkpoint("bias_qknorm") / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"], rope_scaling=None)
    for name in ("routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group"):
        raw.pop(name)
    raw["num_experts_per_tok"] = 1  # one group (the default) of 10 holds it
    folder = tmp_path / "published"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    cfg = read_config(folder)
    assert isinstance(cfg, Glm4MoeConfig)
    assert (cfg.rotary_dim, cfg.rope_theta, cfg.routed_scaling_factor, cfg.norm_topk_prob) == (6, 10000.0, 1.0, True)
    assert (cfg.n_group, cfg.topk_group, cfg.moe_layers, cfg.shared_expert_intermediate_size) == (1, 1, (1, 2), 20)


@pytest.mark.parametrize("change, field", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor"),
    ({"n_group": 3}, "n_group"),
    ({"n_group": None}, "n_group"),
    ({"topk_group": 3}, "topk_group"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128]}}, "quantization_config"),
    ({"model_type": "glm4"}, "model_type"),
])
def test_unsupported_variants_are_refused_by_name(checkpoint, change, field):
    assert_config_refused(Glm4MoeConfig, checkpoint("bias_qknorm"), change, field)


@pytest.mark.gpu
def test_cuda_placements_are_bitwise_all_hot_eager_and_compiled(checkpoint):
    """On CUDA in bf16 through the Triton experts kernel: a placement whose cold experts are read
    from pinned host memory gives bitwise the all-hot logits, eagerly and with the decode region
    that compile_decode installs (torch.compile; the fused GQA kernels are refused)."""
    model = load_model(checkpoint("bias_qknorm"), device="cuda", dtype=torch.bfloat16)
    assert_cuda_placements_bitwise_eager_and_compiled(model, PROMPTS, NEW_TOKENS)


@pytest.mark.gpu
def test_cuda_graph_of_the_compiled_step_decodes_what_generate_decodes(checkpoint):
    """The bench's decode loop (coldset.bench.decode.Decoder: the compiled step captured in one CUDA
    graph, replayed) gives generate()'s greedy tokens."""
    model = load_model(checkpoint("bias_qknorm"), device="cuda", dtype=torch.bfloat16)
    assert_graphed_step_decodes_generate(model, PROMPTS, NEW_TOKENS)
