"""gpt_oss in the embedded engine against transformers' GptOssForCausalLM on tiny random
checkpoints of odd shapes it wrote itself (attention, router and expert biases and the sinks set
random: transformers initialises most of them to zero): greedy tokens, every step's logits
(float32, within LOGIT_ATOL) and the routed experts at every token and layer over prompts longer
than the sliding window; an MXFP4 folder against transformers' own dequantization; placements and
the slot cache bitwise the all-hot path; unsupported variants refused by field name."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from coldset.analysis.placement import row_map_from_mask
from coldset.core import mxfp4
from coldset.core.shapes import expert_bytes, nonexpert_bytes_breakdown, parameter_counts
from coldset.engine.generate import generate
from coldset.engine import gpt_oss
from coldset.engine.gpt_oss import GPT_OSS_20B_CONFIG, GptOssConfig, GptOssModel
from coldset.engine.loading import _TensorSource, load_model, read_config
from coldset.engine.model import ModelLoadError
from coldset.kernels import torch_experts
from coldset.verify import gate
from family_oracle import (assert_config_refused, assert_cuda_placements_bitwise_eager_and_compiled,
                           assert_graphed_step_decodes_generate, assert_greedy_matches, assert_lru_cache_bitwise,
                           assert_random_half_placement_bitwise, checkpoints_by_variant)
from hf_fixtures import build_tiny_checkpoint

transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-4  # float32, every step of every prompt
NEW_TOKENS = 10
# the longest prompts pass every variant's sliding_window (5 and 4), prefill and decode alike
PROMPTS = [[5, 9, 33, 2, 11, 40, 7, 8, 1, 3, 30], [4, 8, 15], [17, 3, 3, 9, 52, 6, 23, 5]]
UNQUANTIZED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]

# Two variants: grouped-query heads, YaRN (truncate false, as published), sliding layers first (the
# default layer_types), a tight swiglu_limit so the clamp bites; and one kv head per query head,
# plain RoPE, a full layer first, no attention biases, tied embeddings. The MXFP4 variant needs
# hidden and intermediate sizes that are multiples of 32 (the format's block).
VARIANTS = {
    "gqa_yarn": dict(
        hidden_size=40, intermediate_size=24, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        head_dim=8, num_local_experts=7, num_experts_per_tok=3, sliding_window=5, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}),
    "mha_plain": dict(
        hidden_size=36, intermediate_size=20, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3,
        head_dim=10, num_local_experts=5, num_experts_per_tok=2, sliding_window=4, swiglu_limit=2.0,
        layer_types=["full_attention", "sliding_attention"], attention_bias=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "mxfp4": dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=5, num_experts_per_tok=2, sliding_window=4, swiglu_limit=3.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 2.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32}),
}


def random_model(variant: str, seed: int = 0, vocab_size: int = 61, max_positions: int = 64):
    """A random float32 GptOssForCausalLM of ``variant``: weights std 0.2, every bias and sink
    random (std 0.5), so each one moves the logits."""
    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(vocab_size=vocab_size, max_position_embeddings=max_positions,
                                    initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                    **VARIANTS[variant])
    model = transformers.GptOssForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            biases = [attn.sinks, mlp.router.bias, mlp.experts.gate_up_proj_bias, mlp.experts.down_proj_bias]
            if cfg.attention_bias:
                biases += [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias, attn.o_proj.bias]
            for t in biases:
                t.normal_(0.0, 0.5)
    return model


def write_mxfp4(model, out):
    """Save ``model`` as gpt-oss publishes it: the experts' fused tensors as MXFP4 ``*_blocks`` /
    ``*_scales`` ([E, out, in / 32, ...], quantized by coldset.core.mxfp4), everything else as is,
    and the ``quantization_config`` of the published checkpoints."""
    model.save_pretrained(out)
    tensors = load_file(out / "model.safetensors")
    for key in list(tensors):
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4.quantize(tensors.pop(key).transpose(1, 2).contiguous(), key)
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = mxfp4.quantization_config(UNQUANTIZED)
    (out / "config.json").write_text(json.dumps(raw))
    return out


def build_checkpoint(variant: str, out):
    """Save :func:`random_model` of ``variant`` in ``out``; the ``mxfp4`` variant as gpt-oss publishes it."""
    model = random_model(variant)
    if variant == "mxfp4":
        return write_mxfp4(model, out)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoints_by_variant(tmp_path_factory, build_checkpoint)


def load(folder, dtype=torch.float32, device="cpu") -> GptOssModel:
    model = load_model(folder, device=device, dtype=dtype)
    assert isinstance(model, GptOssModel) and isinstance(model.config, GptOssConfig)
    return model


def hf_model(folder, dtype=torch.float32):
    """transformers' model of ``folder``, an MXFP4 one dequantized on the CPU by transformers, its
    experts clamping as the config says under any transformers version (:func:`clamp_as_configured`)."""
    raw = json.loads((folder / "config.json").read_text())
    extra = {"quantization_config": transformers.Mxfp4Config(dequantize=True)} if "quantization_config" in raw else {}
    return clamp_as_configured(transformers.GptOssForCausalLM.from_pretrained(folder, dtype=dtype, **extra).eval(),
                               folder)


def _assert_matches_transformers(model, hf):
    """The family oracle (:func:`family_oracle.assert_greedy_matches`) over every layer's router; the
    experts compared in order (both take a sorted top-k)."""
    routers = {i: hf.model.layers[i].mlp.router for i in range(model.config.num_layers)}
    return assert_greedy_matches(model, hf, PROMPTS, NEW_TOKENS, routers, LOGIT_ATOL, ordered=True)


@pytest.mark.parametrize("variant", ["gqa_yarn", "mha_plain"])
def test_greedy_decode_matches_transformers(checkpoint, variant):
    path = checkpoint(variant)
    model = load(path)
    assert model.config.checkpoint_expert_format == "float32" == model.config.expert_format
    windows = [layer.self_attn.window for layer in model.layers]
    assert windows == [model.config.layer_window(i) for i in range(model.config.num_layers)]
    assert None in windows and any(w is not None and w < len(PROMPTS[0]) for w in windows)
    _assert_matches_transformers(model, hf_model(path))


def test_windows_sinks_and_biases_each_move_the_logits(checkpoint):
    """The oracle test can fail on each feature: dropping the window of the sliding layers, the
    sinks, the router bias or the experts' biases changes the logits far beyond LOGIT_ATOL."""
    model = load(checkpoint("gqa_yarn"))
    ref = generate(model, PROMPTS, 4, progress=False, return_all_logits=True).all_logits

    def changed(undo):
        saved = undo()
        try:
            return (generate(model, PROMPTS, 4, progress=False, return_all_logits=True).all_logits - ref).abs().max()
        finally:
            saved()

    def no_window():
        attns = [layer.self_attn for layer in model.layers]
        kept = [a.window for a in attns]
        for a in attns:
            a.window = None
        return lambda: [setattr(a, "window", w) for a, w in zip(attns, kept)]

    def zeroed(tensors):
        def undo():
            kept = [t.clone() for t in tensors]
            for t in tensors:
                t.zero_()
            return lambda: [t.copy_(k) for t, k in zip(tensors, kept)]
        return undo

    layers = model.layers
    for name, undo in [("window", no_window), ("sinks", zeroed([la.self_attn.sinks for la in layers])),
                       ("router bias", zeroed([la.mlp.gate.bias for la in layers])),
                       ("expert biases", zeroed([model.pools.w13_bias, model.pools.w2_bias]))]:
        assert changed(undo) > 100 * LOGIT_ATOL, name


def test_rope_is_transformers(checkpoint):
    """YaRN (truncate false): the same inverse frequencies (bitwise) and cos/sin factor as
    transformers builds; plain RoPE: factor 1."""
    path = checkpoint("gqa_yarn")
    model, hf = load(path), hf_model(path)
    assert torch.equal(model.inv_freq, hf.model.rotary_emb.inv_freq)
    assert model.attention_factor == hf.model.rotary_emb.attention_scaling != 1.0
    plain = load(checkpoint("mha_plain"))
    assert plain.attention_factor == 1.0 and plain.config.yarn is None


def test_mxfp4_folder_is_transformers_dequantization(checkpoint, caplog):
    """An MXFP4 folder (published names and quantization_config): the pools hold, bit for bit,
    transformers' own dequantization of the blocks (convert_moe_packed_tensors), de-interleaved
    into [gate; up] rows; the biases too; greedy decode matches transformers loading the same
    folder (dequantized on the CPU); the log says where the experts went."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # the oracle's dequantizer

    path = checkpoint("mxfp4")
    with caplog.at_level(logging.INFO, logger="coldset.engine.gpt_oss"):
        model = load(path)
    assert "MXFP4 experts dequantized to float32" in caplog.text and "keep_mxfp4 keeps them 4-bit" in caplog.text
    cfg = model.config
    assert (cfg.checkpoint_expert_format, cfg.expert_format) == ("mxfp4", "float32")
    tensors = load_file(path / "model.safetensors")
    inter = cfg.moe_intermediate_size
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = convert_moe_packed_tensors(tensors[f"{p}.gate_up_proj_blocks"], tensors[f"{p}.gate_up_proj_scales"],
                                             dtype=torch.float32)  # [E, H, 2I], interleaved
        down = convert_moe_packed_tensors(tensors[f"{p}.down_proj_blocks"], tensors[f"{p}.down_proj_scales"],
                                          dtype=torch.float32)  # [E, I, H]
        w13 = model.pools.w13_hot[layer * cfg.num_experts:(layer + 1) * cfg.num_experts]
        assert torch.equal(w13[:, :inter], gate_up[..., 0::2].transpose(1, 2))
        assert torch.equal(w13[:, inter:], gate_up[..., 1::2].transpose(1, 2))
        assert torch.equal(model.pools.w2_hot[layer * cfg.num_experts:(layer + 1) * cfg.num_experts],
                           down.transpose(1, 2))
        bias = tensors[f"{p}.gate_up_proj_bias"]
        assert torch.equal(model.pools.w13_bias[layer], torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1))
        assert torch.equal(model.pools.w2_bias[layer], tensors[f"{p}.down_proj_bias"])
    _assert_matches_transformers(model, hf_model(path))


def load_mxfp4_kept(folder, device="cpu") -> GptOssModel:
    """An MXFP4 folder with its experts kept 4-bit in the pools (bf16 activations)."""
    return gpt_oss.load(read_config(folder), _TensorSource(folder), torch.device(device), torch.bfloat16,
                        keep_mxfp4=True)


def test_mxfp4_experts_kept_4bit(checkpoint):
    """keep_mxfp4: the pools hold the checkpoint's packed rows and scales (gate rows then up rows,
    nothing unpacked), the config says mxfp4 (its expert bytes blocks + scales + biases); greedy
    decode follows the dequantized bf16 load (other rounding: float32 products of the exact
    weights); every placement bitwise the all-hot MXFP4 path; refused on a float32 model or a
    folder without MXFP4 experts."""
    path = checkpoint("mxfp4")
    model = load_mxfp4_kept(path)
    cfg, pools = model.config, model.pools
    assert pools.is_mxfp4 and cfg.expert_format == "mxfp4" and pools.has_bias
    tensors = load_file(path / "model.safetensors")
    # what a placement moves: blocks and scales; the biases stay resident (core.shapes' expert_biases)
    assert expert_bytes(cfg) == mxfp4.expert_bytes(cfg.hidden_size, cfg.moe_intermediate_size)
    blocks, scales, _ = mxfp4.w13_from_checkpoint(tensors["model.layers.1.mlp.experts.gate_up_proj_blocks"],
                                                  tensors["model.layers.1.mlp.experts.gate_up_proj_scales"])
    rows = slice(cfg.num_experts, 2 * cfg.num_experts)
    assert torch.equal(pools.w13_hot[rows], blocks.flatten(-2)) and torch.equal(pools.w13_scale_hot[rows], scales)
    dequantized = generate(load(path, torch.bfloat16), PROMPTS, 4, progress=False, return_all_logits=True)
    kept = generate(model, PROMPTS, 4, progress=False, return_all_logits=True)
    assert [t[:2] for t in kept.tokens] == [t[:2] for t in dequantized.tokens]
    assert (kept.all_logits.float() - dequantized.all_logits.float()).abs().max().item() < 0.5
    ids = [f"p{i}" for i in range(len(PROMPTS))]
    mask = np.random.default_rng(2).random((cfg.num_moe_layers, cfg.num_experts)) < 0.5
    placed = pools.placed(row_map_from_mask(mask))
    result = gate.compare("random-half", ids, gate.reference_decode(model, PROMPTS, 4, progress=False),
                          gate.placement_decode(model, placed, PROMPTS, 4, progress=False), placed, model)
    assert placed.num_cold > 0 and result.passed and result.logits_bitwise_equal
    with pytest.raises(ModelLoadError, match="bfloat16"):
        gpt_oss.load(read_config(path), _TensorSource(path), torch.device("cpu"), torch.float32, keep_mxfp4=True)
    plain = checkpoint("gqa_yarn")
    with pytest.raises(ModelLoadError, match="not MXFP4"):
        load_mxfp4_kept(plain)


def test_load_model_passes_keep_mxfp4_through_and_refuses_other_folders(checkpoint, tmp_path):
    """load_model(keep_mxfp4=True) is the gpt_oss loader's kept-4-bit model (the same pools, byte for
    byte); a folder whose experts are not MXFP4 (a bf16 gpt_oss, a qwen3_moe) is refused naming its
    config.json, before any weight is read."""
    path = checkpoint("mxfp4")
    via, direct = load_model(path, dtype=torch.bfloat16, keep_mxfp4=True).pools, load_mxfp4_kept(path).pools
    assert via.is_mxfp4
    for name in ("w13_hot", "w2_hot", "w13_scale_hot", "w2_scale_hot", "w13_bias", "w2_bias"):
        assert torch.equal(getattr(via, name), getattr(direct, name)), name
    assert not load_model(path, dtype=torch.bfloat16).pools.is_mxfp4  # without it: dequantized
    qwen = build_tiny_checkpoint("qwen3_moe", tmp_path / "qwen")
    for folder in (checkpoint("gqa_yarn"), qwen):
        with pytest.raises(ModelLoadError, match=r"config\.json: keep_mxfp4 .* not MXFP4"):
            load_model(folder, dtype=torch.bfloat16, keep_mxfp4=True)


def test_placements_and_the_slot_cache_are_bitwise_all_hot(checkpoint):
    """Experts in both tiers (a static placement) and a dynamic one (an LRU slot cache at batch 1)
    give bitwise the all-hot logits and tokens through the parity gate; the biases stay put."""
    model = load(checkpoint("gqa_yarn"))
    pools = assert_random_half_placement_bitwise(model, PROMPTS, NEW_TOKENS)
    assert pools.w13_bias is model.pools.w13_bias
    assert_lru_cache_bitwise(model, PROMPTS, NEW_TOKENS)


def test_the_fused_decode_step_is_refused(checkpoint):
    model = load(checkpoint("mha_plain"))
    with pytest.raises(ValueError, match="sink attention"):
        model.compile_decode(fused=True)


def test_shape_counts_are_transformers_parameters(checkpoint):
    """core.shapes reads gpt_oss: the parameter count is transformers' model's, an expert's bytes
    are its two weight tensors' per expert, and the resident biases every expert's two bias rows."""
    for variant in ("gqa_yarn", "mha_plain"):
        path = checkpoint(variant)
        cfg = read_config(path)
        hf = hf_model(path)
        assert sum(parameter_counts(cfg).values()) == sum(p.numel() for p in hf.parameters())
        experts = hf.model.layers[0].mlp.experts
        per_expert = sum(t[0].numel() * t.element_size() for t in (experts.gate_up_proj, experts.down_proj))
        assert expert_bytes(cfg) == per_expert
        biases = sum(t.numel() * t.element_size() for t in (experts.gate_up_proj_bias, experts.down_proj_bias))
        assert nonexpert_bytes_breakdown(cfg)["expert_biases"] == cfg.num_moe_layers * biases


def test_gpt_oss_20b_config_reads_as_published():
    """The published gpt-oss-20b config: 20.9B parameters, 3.6B active (as OpenAI's model card
    counts them: the embedding table, a lookup, not among the active),
    38.2 GB of bf16 experts, 13.22 MB an expert in MXFP4 (blocks and scales; the bf16 biases stay
    resident) with the published quantization_config."""
    cfg = GptOssConfig.from_hf_config(GPT_OSS_20B_CONFIG)
    counts = parameter_counts(cfg)
    per_expert = counts["routed_experts"] // (cfg.num_moe_layers * cfg.num_experts)
    active = (sum(counts.values()) - counts["routed_experts"] - counts["embed_tokens"]
              + cfg.num_moe_layers * cfg.top_k * per_expert)
    assert round(sum(counts.values()) / 1e9, 1) == 20.9 and round(active / 1e9, 1) == 3.6
    assert round(expert_bytes(cfg) * cfg.num_moe_layers * cfg.num_experts / 1e9, 1) == 38.2
    published = GptOssConfig.from_hf_config({**GPT_OSS_20B_CONFIG,
                                             "quantization_config": mxfp4.quantization_config(UNQUANTIZED)})
    assert (published.checkpoint_expert_format, published.expert_format) == ("mxfp4", "bfloat16")
    from coldset.core.shapes import shape_from_hf_config  # the shape every non-decoding stage reads
    shape = shape_from_hf_config({**GPT_OSS_20B_CONFIG, "quantization_config": mxfp4.quantization_config(UNQUANTIZED)})
    assert expert_bytes(shape) == mxfp4.expert_bytes(2880, 2880) == 13_219_200
    assert nonexpert_bytes_breakdown(shape)["expert_biases"] == 24 * 32 * 3 * 2880 * 2


@pytest.mark.parametrize("change, field", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "llama3"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 16}}, "factor"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "original_max_position_embeddings"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"swiglu_limit": None}, "swiglu_limit"),
    ({"swiglu_limit": -1.0}, "swiglu_limit"),
    ({"head_dim": 7}, "head_dim"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128]}}, "quantization_config"),
    ({"quantization_config": {**mxfp4.quantization_config(UNQUANTIZED), "block_size": 16}}, "block_size"),
    ({"model_type": "gpt_oss_v2"}, "model_type"),
])
def test_unsupported_variants_are_refused_by_name(checkpoint, change, field):
    assert_config_refused(GptOssConfig, checkpoint("gqa_yarn"), change, field)


def test_the_loader_refuses_a_quantization_it_does_not_read_naming_file_and_field(checkpoint, tmp_path):
    folder = tmp_path / "fp8"
    folder.mkdir()
    raw = json.loads((checkpoint("mha_plain") / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"config\.json: quantization_config.*not decoded by the engine"):
        load_model(folder)


def test_published_config_layout(checkpoint):
    """A config in the published layout (``rope_scaling`` and a top-level ``rope_theta``, no
    ``layer_types`` or ``swiglu_alpha``): transformers' defaults (sliding layers first, alpha 1.702)."""
    raw = json.loads((checkpoint("gqa_yarn") / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope, experts_per_token=raw["num_experts_per_tok"])
    for name in ("layer_types", "swiglu_alpha"):
        raw.pop(name)
    cfg = GptOssConfig.from_hf_config(raw)
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (cfg.activation.kind, cfg.activation.alpha, cfg.activation.limit) == ("swiglu_clamped", 1.702, 1.5)
    assert cfg.yarn is not None and cfg.yarn.factor == 4.0 and not cfg.yarn.truncate and cfg.rope_theta == 1000.0
    assert cfg.sliding_window is None and cfg.attention_window == 5


def test_low_precision_decode_tracks_float32(checkpoint):
    """In bf16 the RMSNorm weights stay float32 (as transformers keeps them), everything else and
    the pools (biases included) are bf16; the logits stay near float32's and the first tokens agree."""
    path = checkpoint("gqa_yarn")
    ref = generate(load(path), PROMPTS, 4, progress=False, return_all_logits=True)
    model = load(path, torch.bfloat16)
    layer = model.layers[0]
    assert layer.input_layernorm.weight.dtype == model.norm.weight.dtype == torch.float32
    assert model.pools.w13_hot.dtype == model.pools.w13_bias.dtype == layer.self_attn.sinks.dtype == torch.bfloat16
    got = generate(model, PROMPTS, 4, progress=False, return_all_logits=True)
    assert (got.all_logits.float() - ref.all_logits).abs().max().item() < 0.5
    assert [t[:2] for t in got.tokens] == [t[:2] for t in ref.tokens]


@pytest.mark.gpu
def test_cuda_placements_are_bitwise_all_hot_eager_and_compiled(checkpoint):
    """On CUDA in bf16 through the Triton experts kernel (biases and the clamped SwiGLU in its
    epilogue): a placement whose cold experts are read from pinned host memory gives bitwise the
    all-hot logits, eagerly and with the decode region compile_decode installs (torch.compile;
    the fused kernels are refused), for a bf16 folder and an MXFP4 one, dequantized and kept 4-bit
    (the MXFP4 kernel)."""
    for variant in ("gqa_yarn", "mxfp4", "mxfp4-kept"):
        model = (load_mxfp4_kept(checkpoint("mxfp4"), "cuda") if variant == "mxfp4-kept"
                 else load(checkpoint(variant), torch.bfloat16, "cuda"))
        assert_cuda_placements_bitwise_eager_and_compiled(model, PROMPTS, NEW_TOKENS, variant)


@pytest.mark.gpu
@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_cuda_graph_of_the_compiled_step_with_4bit_experts_decodes_what_generate_decodes(checkpoint, batch_size):
    """The bench's decode loop (the compiled step captured in one CUDA graph, replayed) with the
    experts kept MXFP4 gives generate()'s greedy tokens at 1, 2 and 3 tokens a step: up to 2 the
    MXFP4 kernel's default is the prefetching Triton GEMV tile, at 3 on CUDA the Gluon GEMV tile; the
    launches after the first are programmatic dependent launches (pdl 2, where triton has
    grid-dependency control), captured in the graph."""
    from coldset.kernels import triton_moe, triton_mxfp4

    cfg = triton_mxfp4.default_config(batch_size, cuda=True)
    pdl = 2 if triton_moe.gdc_wait is not None else 0
    if batch_size <= 2:
        assert (cfg.pdl, cfg.num_stages, cfg.w8a16) == (pdl, 2, 2)
    elif triton_mxfp4.gluon_mxfp4 is not None and pdl:
        assert (cfg.w8a16, cfg.pdl) == (4, 2)
    else:
        assert (cfg.pdl, cfg.num_stages) == (0, 1)
    model = load_mxfp4_kept(checkpoint("mxfp4"), "cuda")
    assert_graphed_step_decodes_generate(model, PROMPTS, NEW_TOKENS, batch_size)


@pytest.mark.gpu
def test_cuda_bf16_decode_tracks_transformers(checkpoint):
    """On CUDA in bf16, through the torch experts (the engine's default experts_fn) and through the
    Triton experts kernel (biases and the clamped SwiGLU in its float32 epilogue, as the bench runs
    it), the engine is as close to transformers' float32 logits as transformers' own bf16 run on
    CUDA is (the first two steps; later ones may follow another token), and its first token is
    float32's. Both oracles clamp at the config's swiglu_limit (:func:`hf_model`)."""
    path = checkpoint("gqa_yarn")
    model = load(path, torch.bfloat16, "cuda")
    hf32, hf16 = hf_model(path), hf_model(path, torch.bfloat16).to("cuda")
    runs = []
    for b, prompt in enumerate(PROMPTS):
        per_oracle = []
        for hf, dev in ((hf32, "cpu"), (hf16, "cuda")):
            out = hf.generate(torch.tensor([prompt], device=dev), max_new_tokens=2, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=dev),
                              output_logits=True, return_dict_in_generate=True)
            logits = torch.stack(out.logits, dim=1)[0].float().cpu()
            per_oracle.append((out.sequences[0, len(prompt):].tolist(), logits))
        runs.append(per_oracle)
    triton_fn = gate.experts_functions(model.device)[0]
    for name, experts_fn in (("torch experts", torch_experts), ("triton experts", triton_fn)):
        model.experts_fn = experts_fn
        gen = generate(model, PROMPTS, 2, progress=False, return_all_logits=True)
        for b, ((ref_tokens, ref), (their_tokens, theirs)) in enumerate(runs):
            assert gen.tokens[b][0] == ref_tokens[0], (name, f"prompt {b}")
            steps = 2 if gen.tokens[b][0] == their_tokens[0] else 1  # the second step's input must be the same token
            ours_err = (gen.all_logits[b][:steps].float().cpu() - ref[:steps]).abs().max().item()
            their_err = (theirs[:steps] - ref[:steps]).abs().max().item()
            assert ours_err <= max(2 * their_err, 0.1), (name, b, ours_err, their_err)


def clamp_as_configured(hf, folder):
    """``hf`` (transformers' GptOssForCausalLM) with every layer's experts clamping at ``folder``'s
    config.json ``swiglu_limit`` and ``swiglu_alpha`` (transformers' defaults 7.0 and 1.702 where
    absent), as the engine reads them. Why: transformers 5.17 (the GPU image's) hard-codes limit 7.0
    and alpha 1.702 in GptOssExperts whatever the config says, so for gqa_yarn (limit 1.5) it
    computes another model than the checkpoint's, in float32 already."""
    raw = json.loads((folder / "config.json").read_text())
    alpha, limit = raw.get("swiglu_alpha", 1.702), raw.get("swiglu_limit", 7.0)
    for layer in hf.model.layers:
        layer.mlp.experts.alpha, layer.mlp.experts.limit = alpha, limit
    return hf


def test_the_oracle_clamps_at_the_configured_swiglu_limit(checkpoint):
    """gqa_yarn's swiglu_limit (1.5) bites: an oracle whose experts clamp at 7.0 (as transformers
    5.17's GptOssExperts does whatever the config says) is far off the engine's float32 logits;
    :func:`clamp_as_configured` brings such an oracle back to them within LOGIT_ATOL."""
    path = checkpoint("gqa_yarn")
    ours = generate(load(path), PROMPTS, 2, progress=False, return_all_logits=True).all_logits
    hf = hf_model(path)
    experts = [layer.mlp.experts for layer in hf.model.layers]

    def worst_error():
        errs = []
        for b, prompt in enumerate(PROMPTS):
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=2, do_sample=False, output_logits=True, return_dict_in_generate=True)
            errs.append((torch.stack(out.logits, dim=1)[0] - ours[b]).abs().max().item())
        return max(errs)

    for e in experts:
        e.alpha, e.limit = 1.702, 7.0
    assert worst_error() > 0.5
    assert clamp_as_configured(hf, path) is hf
    assert [(e.alpha, e.limit) for e in experts] == [(1.702, 1.5)] * len(experts)
    assert worst_error() < LOGIT_ATOL
