"""deepseek_v3 in the embedded engine against transformers' DeepseekV3ForCausalLM on tiny random
checkpoints of odd shapes it wrote itself: greedy tokens, every step's logits (float32, within
LOGIT_ATOL) and the routed experts at every token and MoE layer; placements and the slot cache
bitwise the all-hot path; unsupported variants refused by field name."""

from __future__ import annotations

import functools
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from coldset.core import fp8
from coldset.engine.deepseek_v3 import DeepseekMoE, DeepseekV3Config, DeepseekV3Model, yarn_mscale
from coldset.engine.generate import generate
from coldset.engine.loading import load_model
from coldset.engine.model import ModelLoadError
from coldset.kernels import torch_experts
from family_oracle import (assert_config_refused, assert_cuda_placements_bitwise_eager_and_compiled,
                           assert_graphed_step_decodes_generate, assert_greedy_matches, assert_lru_cache_bitwise,
                           assert_random_half_placement_bitwise, checkpoints_by_variant)
from test_fp8 import TABLE

transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-4  # float32, every step of every prompt
NEW_TOKENS = 10
PROMPTS = [[5, 9, 33, 2, 71, 40], [4, 8, 15, 16, 23, 42, 11, 3, 90, 61, 7], [77]]

# Two variants: the query through q_a_proj (LoRA) with YaRN and interleaved RoPE, a dense first
# layer and one shared expert; and the query through q_proj with plain, non-interleaved RoPE, every
# layer MoE, two shared experts, no renormalisation and tied embeddings.
VARIANTS = {
    "q_lora_yarn": dict(
        hidden_size=72, intermediate_size=88, moe_intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=3, num_key_value_heads=3, first_k_dense_replace=1, n_routed_experts=10,
        n_group=2, topk_group=1, num_experts_per_tok=3, n_shared_experts=1, routed_scaling_factor=1.7,
        norm_topk_prob=True, q_lora_rank=20, kv_lora_rank=24, qk_nope_head_dim=10, qk_rope_head_dim=8,
        v_head_dim=12, rope_interleave=True, num_mtp_layers=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "mscale": 0.8, "mscale_all_dim": 0.9,
                         "beta_fast": 32, "beta_slow": 1}),
    "q_proj_plain": dict(
        hidden_size=72, intermediate_size=56, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=5, num_key_value_heads=5, first_k_dense_replace=0, n_routed_experts=10,
        n_group=5, topk_group=3, num_experts_per_tok=4, n_shared_experts=2, routed_scaling_factor=2.5,
        norm_topk_prob=False, q_lora_rank=None, kv_lora_rank=17, qk_nope_head_dim=6, qk_rope_head_dim=4,
        v_head_dim=14, rope_interleave=False, num_mtp_layers=0, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
}


def build_checkpoint(variant: str, out, seed: int = 0):
    """Save a random float32 DeepseekV3ForCausalLM of ``variant`` (weights std 0.2, a random
    ``e_score_correction_bias``, so the bias moves the choice) with save_pretrained."""
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(vocab_size=97, max_position_embeddings=64, initializer_range=0.2,
                                        bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                        **VARIANTS[variant])
    model = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return out


def load(folder, dtype=torch.float32, device="cpu") -> DeepseekV3Model:
    """The engine's loader on a deepseek_v3 folder: the family's model, weights and expert pools."""
    model = load_model(folder, device=device, dtype=dtype)
    assert isinstance(model, DeepseekV3Model) and isinstance(model.config, DeepseekV3Config)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoints_by_variant(tmp_path_factory, build_checkpoint)


def _routers(hf, cfg) -> dict:
    """transformers' router module of each MoE layer, in the engine's MoE-layer order."""
    return {i: hf.model.layers[i].mlp.gate for i in cfg.moe_layers}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_decode_matches_transformers(checkpoint, variant):
    """Left-padded batched decode with the compressed-latent cache against transformers' own
    generate per unpadded prompt: the same tokens, logits within LOGIT_ATOL at every step, the
    same experts (as sets; both routers' top-k is unsorted) and weights at every token and layer."""
    path = checkpoint(variant)
    model = load(path)
    cfg = model.config
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_greedy_matches(model, hf, PROMPTS, NEW_TOKENS, _routers(hf, cfg), LOGIT_ATOL)
    # the cache holds the latent and the rotated RoPE key, not per-head keys and values
    attn = model.layers[0].self_attn
    assert tuple(attn.latent_cache.shape) == (len(PROMPTS), max(map(len, PROMPTS)) + NEW_TOKENS, cfg.kv_lora_rank)
    assert tuple(attn.rope_key_cache.shape)[-1] == cfg.qk_rope_head_dim


def test_rope_and_softmax_scale_are_transformers(checkpoint):
    """YaRN: the same inverse frequencies (bitwise), the same cos/sin factor and softmax scale
    (mscale_all_dim folded in squared) as transformers builds."""
    path = checkpoint("q_lora_yarn")
    model = load(path)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = model.config
    assert torch.equal(model.inv_freq, hf.model.rotary_emb.inv_freq)
    assert model.attention_factor == hf.model.rotary_emb.attention_scaling != 1.0
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert cfg.softmax_scale == pytest.approx(qk ** -0.5 * yarn_mscale(4.0, 0.9) ** 2)
    assert cfg.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)


def test_the_correction_bias_moves_the_choice_not_the_weights(checkpoint):
    """Zeroing e_score_correction_bias changes which experts are chosen somewhere (so the oracle
    test exercises it), and the weights are the unbiased scores: they sum to routed_scaling_factor."""
    model = load(checkpoint("q_lora_yarn"))
    cfg = model.config
    with_bias = generate(model, PROMPTS, 4, capture_routing=True, progress=False).routing
    for r in with_bias:
        sums = r.weights.sum(-1)
        torch.testing.assert_close(sums, torch.full_like(sums, cfg.routed_scaling_factor))
    for layer in model.layers:
        if isinstance(layer.mlp, DeepseekMoE):
            layer.mlp.e_score_correction_bias.zero_()
    without = generate(model, PROMPTS, 4, capture_routing=True, progress=False).routing
    assert any(not torch.equal(a.experts.sort(-1)[0], b.experts.sort(-1)[0]) for a, b in zip(with_bias, without))


def test_placements_and_the_slot_cache_are_bitwise_all_hot(checkpoint):
    """Experts in both tiers (a static placement) and a dynamic one (an LRU slot cache at batch 1)
    give bitwise the all-hot logits and tokens through the parity gate."""
    model = load(checkpoint("q_lora_yarn"))
    assert_random_half_placement_bitwise(model, PROMPTS, NEW_TOKENS)
    assert_lru_cache_bitwise(model, PROMPTS, NEW_TOKENS)


def test_mtp_layers_are_skipped_with_a_log_line(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="coldset.engine.deepseek_v3"):
        load(checkpoint("q_lora_yarn"))
    assert "skipping 1 multi-token-prediction layer(s) (model.layers.3 and on)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="coldset.engine.deepseek_v3"):
        load(checkpoint("q_proj_plain"))
    assert "multi-token-prediction" not in caplog.text


def test_the_fused_decode_step_is_refused(checkpoint):
    model = load(checkpoint("q_proj_plain"))
    with pytest.raises(ValueError, match="multi-head latent attention"):
        model.compile_decode(fused=True)


@pytest.mark.parametrize("change, field", [
    ({"index_topk": 2048}, "index_topk"),
    ({"index_n_heads": 64}, "index_n_heads"),
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "llama3"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "factor"),
    ({"n_group": 3}, "n_group"),
    ({"n_group": None}, "n_group"),
    ({"topk_group": 3}, "topk_group"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [64, 64]}}, "weight_block_size"),
    ({"model_type": "deepseek_v2"}, "model_type"),
])
def test_unsupported_variants_are_refused_by_name(checkpoint, change, field):
    assert_config_refused(DeepseekV3Config, checkpoint("q_lora_yarn"), change, field)


def test_the_loader_refuses_sparse_attention_naming_file_and_field(checkpoint, tmp_path):
    """load_model on a V3.2-style folder (the indexer's fields) names config.json and the field."""
    folder = tmp_path / "v32"
    folder.mkdir()
    raw = json.loads((checkpoint("q_proj_plain") / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "index_topk": 2048}))
    with pytest.raises(ModelLoadError, match=r"config\.json: field 'index_topk'.*sparse attention"):
        load_model(folder)


def test_published_defaults_and_legacy_rope_scaling(checkpoint):
    """A config in DeepSeek's own layout (``rope_scaling`` with ``type``, top-level ``rope_theta``,
    ``topk_method`` / ``scoring_func`` as published, fields left to transformers' defaults)."""
    raw = json.loads((checkpoint("q_lora_yarn") / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw.update(rope_theta=rope.pop("rope_theta"), topk_method="noaux_tc", scoring_func="sigmoid",
               rope_scaling={**{k: v for k, v in rope.items() if k != "rope_type"}, "type": "yarn"})
    for name in ("routed_scaling_factor", "norm_topk_prob", "rope_interleave"):
        raw.pop(name)
    cfg = DeepseekV3Config.from_hf_config(raw)
    assert (cfg.routed_scaling_factor, cfg.norm_topk_prob, cfg.rope_interleave) == (2.5, True, True)
    assert cfg.yarn is not None and cfg.yarn.factor == 4.0 and cfg.rope_theta == 10000.0
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.moe_layers) == (20, 24, (1, 2))
    assert cfg.shared_expert_intermediate_size == 40


@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 0.5), (torch.float16, 0.1)])
def test_low_precision_decode_tracks_float32(checkpoint, dtype, atol):
    """In bf16/fp16 the router (its weight, correction bias and logits) stays float32, as
    transformers keeps it; the logits stay near float32's and the first tokens agree."""
    path = checkpoint("q_lora_yarn")
    ref = generate(load(path), PROMPTS, 4, progress=False, return_all_logits=True)
    model = load(path, dtype)
    moe = model.layers[1].mlp
    assert moe.gate.weight.dtype == moe.e_score_correction_bias.dtype == torch.float32
    assert model.pools.w13_hot.dtype == dtype and model.layers[0].self_attn.kv_b_proj.weight.dtype == dtype
    got = generate(model, PROMPTS, 4, progress=False, return_all_logits=True)
    assert (got.all_logits.float() - ref.all_logits).abs().max().item() < atol
    assert [t[:2] for t in got.tokens] == [t[:2] for t in ref.tokens]


# --------------------------------------------------------------------------------------------
# Block-FP8 checkpoints (DeepSeek-V3's published format)
# --------------------------------------------------------------------------------------------

# hidden 136 and a dense MLP of 144: most matrices span two 128-column or 128-row blocks, the
# last one partial
FP8_VARIANT = dict(VARIANTS["q_lora_yarn"], hidden_size=136, intermediate_size=144)
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
_LINEAR_WEIGHTS = ("_proj.weight", "_proj_with_mqa.weight")  # every linear layer; not lm_head, not the router


def write_block_fp8(folder, out):
    """The float32 checkpoint in ``folder`` in DeepSeek-V3's published block-FP8 layout, into ``out``:
    every linear weight but the LM head's (the router is no linear layer) as float8_e4m3fn with its
    ``weight_scale_inv`` (:func:`coldset.core.fp8.quantize_weight`, DeepSeek's ``weight_quant``
    convention), the published ``quantization_config`` (no ``modules_to_not_convert``)."""
    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "quantization_config": FP8_CONFIG}))
    tensors = {}
    for key, t in load_file(str(folder / "model.safetensors")).items():
        if key.endswith(_LINEAR_WEIGHTS):
            tensors[key], tensors[key.removesuffix(".weight") + ".weight_scale_inv"] = fp8.quantize_weight(t)
        else:
            tensors[key] = t
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _hf_dequant(q, s):
    """transformers' own block-FP8 dequantization (what its FP8 loader runs on a CPU)."""
    mod = pytest.importorskip("transformers.integrations.finegrained_fp8")
    return mod.Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)


def dequant_oracle(q, s):
    """A block-FP8 weight's values: transformers' dequantization where it reads the grid as the
    format defines it, else an independent one. transformers' ``Fp8Dequantize`` takes the block as
    ``rows // grid rows``: right when every block is full or one block spans the dim, wrong for a
    partial last block (136 rows in 2 blocks read as blocks of 68) and refused when that does not
    divide (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows, 5 blocks). The independent one: each byte's
    e4m3 value decoded from its bits (``test_fp8.TABLE``) times its 128 x 128 block's scale,
    exact in float64, rounded once to float32."""
    rows, cols = q.shape
    if all(g == 1 or n == 128 * g for n, g in zip((rows, cols), s.shape)):
        return _hf_dequant(q, s)
    scales = s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return (TABLE[q.view(torch.uint8).long()] * scales).float()


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(float32 folder, its block-FP8 folder, transformers' model on the dequantized weights)."""
    torch.manual_seed(1)
    root = tmp_path_factory.mktemp("fp8")
    cfg = transformers.DeepseekV3Config(vocab_size=97, max_position_embeddings=64, initializer_range=0.2,
                                        bos_token_id=None, eos_token_id=None, pad_token_id=None, **FP8_VARIANT)
    hf = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in hf.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    hf.save_pretrained(root / "float")
    folder = write_block_fp8(root / "float", root / "fp8")
    stored = load_file(str(folder / "model.safetensors"))
    dequantized = {k: dequant_oracle(t, stored[k + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
                   for k, t in stored.items() if not k.endswith("_scale_inv")}
    hf_deq = transformers.DeepseekV3ForCausalLM.from_pretrained(root / "float", dtype=torch.float32).eval()
    float_sd = load_file(str(root / "float" / "model.safetensors"))
    assert set(float_sd) == set(dequantized)
    with torch.no_grad():
        for key, t in dequantized.items():
            if key != "lm_head.weight" or not cfg.tie_word_embeddings:
                _assign_hf(hf_deq, key, t)
    return root / "float", folder, hf_deq, stored


def _assign_hf(hf, key, tensor):
    """Put checkpoint tensor ``key`` into transformers' model (experts are fused there: one slice)."""
    parts = key.split(".")
    if ".mlp.experts." in key:  # model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight
        experts = hf.get_submodule(".".join(parts[:5]))
        e, proj = int(parts[5]), parts[6]
        inter = experts.down_proj.shape[-1]
        if proj == "down_proj":
            experts.down_proj[e].copy_(tensor)
        else:
            rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
            experts.gate_up_proj[e, rows].copy_(tensor)
        return
    getattr(hf.get_submodule(".".join(parts[:-1])), parts[-1]).copy_(tensor)


def test_block_fp8_loads_experts_as_stored_and_the_rest_as_transformers_dequantizes(fp8_checkpoint, caplog):
    _, folder, _, stored = fp8_checkpoint
    with caplog.at_level(logging.INFO, logger="coldset.engine.deepseek_v3"):
        model = load(folder)
    cfg, pools = model.config, model.pools
    assert pools.is_fp8 and pools.w13_hot.dtype == torch.float8_e4m3fn
    converted = [k for k in stored if k.endswith(_LINEAR_WEIGHTS) and ".mlp.experts." not in k]
    assert f"deepseek_v3: {len(converted)} block-FP8 linear layers outside the routed experts" in caplog.text
    params = dict(model.named_parameters())
    for key in converted:  # MLA projections, the dense layer's MLP, the shared experts
        mine = key.replace("model.", "", 1)
        assert torch.equal(params[mine], dequant_oracle(stored[key], stored[key + "_scale_inv"])), key
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"])
    down = "model.layers.0.mlp.down_proj.weight"  # [136, 144]: why transformers' dequantization is not the oracle here
    assert not torch.equal(_hf_dequant(stored[down], stored[down + "_scale_inv"]),
                           params[down.replace("model.", "", 1)])
    inter = cfg.moe_intermediate_size
    for m, layer in enumerate(cfg.moe_layers):
        assert torch.equal(model.layers[layer].mlp.gate.weight, stored[f"model.layers.{layer}.mlp.gate.weight"])
        for e in range(cfg.num_experts):
            base = f"model.layers.{layer}.mlp.experts.{e}"
            w13, w2 = pools.expert_weights(m, e)
            s13, s2 = pools.expert_scales(m, e)
            gate_up = torch.cat([stored[f"{base}.gate_proj.weight"], stored[f"{base}.up_proj.weight"]])
            assert torch.equal(w13.view(torch.uint8), gate_up.view(torch.uint8))  # the bytes as stored
            assert torch.equal(w2.view(torch.uint8), stored[f"{base}.down_proj.weight"].view(torch.uint8))
            assert torch.equal(s2, stored[f"{base}.down_proj.weight_scale_inv"])
            deq = fp8.dequantize_w13(w13, s13)
            assert torch.equal(deq[:inter], dequant_oracle(stored[f"{base}.gate_proj.weight"],
                                                           stored[f"{base}.gate_proj.weight_scale_inv"]))
            assert torch.equal(deq[inter:], dequant_oracle(stored[f"{base}.up_proj.weight"],
                                                           stored[f"{base}.up_proj.weight_scale_inv"]))


def test_block_fp8_routing_matches_transformers_on_the_dequantized_weights(fp8_checkpoint):
    """The FP8 folder decoded with weight-only experts (``w8a16``: the dequantized weights, the
    activations unquantized, the arithmetic of transformers' CPU FP8 load) against transformers'
    model holding transformers' dequantization of the same tensors: the same tokens, logits within
    LOGIT_ATOL and the same experts and weights at every token and MoE layer. The engine's default
    FP8 experts (activations quantized per 128-group, as the FP8 kernel does) stay close."""
    _, folder, hf, _ = fp8_checkpoint
    model = load(folder)
    cfg = model.config
    model.experts_fn = functools.partial(torch_experts, w8a16=True)
    gen = assert_greedy_matches(model, hf, PROMPTS, NEW_TOKENS, _routers(hf, cfg), LOGIT_ATOL)
    model.experts_fn = torch_experts
    w8a8 = generate(model, PROMPTS, 1, progress=False, return_all_logits=True).all_logits[:, 0].double()
    first = gen.all_logits[:, 0].double()
    assert 0 < float((w8a8 - first).norm() / first.norm()) < 0.05


@pytest.mark.parametrize("change, match", [
    ({"weight_block_size": [64, 64]}, "weight_block_size"),
    ({"weight_block_size": None}, "per-tensor FP8"),
    ({"activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "mxfp4"}, "quant_method 'mxfp4'"),
    ({"modules_to_not_convert": ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]}, "routed experts in"),
])
def test_other_quantized_formats_are_refused_by_name(fp8_checkpoint, change, match):
    raw = json.loads((fp8_checkpoint[1] / "config.json").read_text())
    raw["quantization_config"] = {**raw["quantization_config"], **change}
    with pytest.raises(ModelLoadError, match=match):
        DeepseekV3Config.from_hf_config(raw, "config.json")


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bf16", "block_fp8"])
def test_cuda_placements_are_bitwise_all_hot_eager_and_compiled(checkpoint, request, weights):
    """On CUDA in bf16 through the Triton experts kernel (the FP8 one for the block-FP8 folder, whose
    expert scales move with their experts): a placement whose cold experts are read from pinned
    host memory gives bitwise the all-hot logits, eagerly and with the decode region that
    compile_decode installs (torch.compile; the fused GQA kernels are refused)."""
    folder = checkpoint("q_lora_yarn") if weights == "bf16" else request.getfixturevalue("fp8_checkpoint")[1]
    model = load(folder, torch.bfloat16, "cuda")
    assert model.pools.is_fp8 == (weights == "block_fp8")
    assert_cuda_placements_bitwise_eager_and_compiled(model, PROMPTS, NEW_TOKENS)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bf16", "block_fp8"])
def test_cuda_graph_of_the_compiled_step_decodes_what_generate_decodes(checkpoint, request, weights):
    """The bench's decode loop (coldset.bench.decode.Decoder: the compiled step captured in one CUDA
    graph, replayed) on the latent cache gives generate()'s greedy tokens."""
    folder = checkpoint("q_lora_yarn") if weights == "bf16" else request.getfixturevalue("fp8_checkpoint")[1]
    model = load(folder, torch.bfloat16, "cuda")
    assert_graphed_step_decodes_generate(model, PROMPTS, NEW_TOKENS)
