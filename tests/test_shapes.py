"""coldset.core.shapes: model shapes and weight bytes from config.json alone, for every family listed.

References are independent of the parser: published totals from the model cards (layers, MoE
layers, experts, top-k, shared experts, parameter count) and byte counts of the tensors each
quantized checkpoint stores, laid out as the quantizer writes them.
"""

import json
import math
from pathlib import Path

import pytest

from coldset.core.shapes import (
    SHAPE_FAMILIES,
    MoEShape,
    ShapeError,
    as_shape,
    expert_bytes,
    get_weight_format,
    nonexpert_bytes,
    nonexpert_bytes_breakdown,
    parameter_counts,
    read_shape,
    shape_from_hf_config,
    total_bytes,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "config" / "examples" / "shapes"

# folder: (model_type, layers, MoE layers, first MoE layer, routed experts, top-k, shared experts,
#          published parameter count, where it is published)
PUBLISHED = {
    "deepseek-v3": ("deepseek_v3", 61, 58, 3, 256, 8, 1, 671e9, "DeepSeek-V3 model card: 671B total"),
    "glm-4.5-air": ("glm4_moe", 46, 45, 1, 128, 8, 1, 106e9, "GLM-4.5-Air model card: 106B total"),
    "deepseek-v2": ("deepseek_v2", 60, 59, 1, 160, 6, 2, 236e9, "DeepSeek-V2 model card: 236B total"),
    "qwen3-235b-a22b": ("qwen3_moe", 94, 94, 0, 128, 8, 0, 235e9, "Qwen3-235B-A22B card: 235B total"),
    "qwen3-30b-a3b-gptq-int4": ("qwen3_moe", 48, 48, 0, 128, 8, 0, 30.5e9, "Qwen3-30B-A3B card: 30.5B"),
    "qwen2-57b-a14b": ("qwen2_moe", 28, 28, 0, 64, 8, 1, 57.4e9, "Qwen2-57B-A14B: 57.4B"),
    "qwen3-next-80b-a3b": ("qwen3_next", 48, 48, 0, 512, 10, 1, 80e9, "Qwen3-Next-80B-A3B card: 80B total"),
    "mixtral-8x7b": ("mixtral", 32, 32, 0, 8, 2, 0, 46.7e9, "Mixtral-8x7B: 46.7B total"),
    "mixtral-8x7b-awq": ("mixtral", 32, 32, 0, 8, 2, 0, 46.7e9, "Mixtral-8x7B: 46.7B total"),
    "llama4-maverick": ("llama4", 48, 24, 1, 128, 1, 1, 400e9, "Llama-4-Maverick card: 400B total"),
    "gpt-oss-120b": ("gpt_oss", 36, 36, 0, 128, 4, 0, 116.83e9, "gpt-oss-120b card: 116.83B"),
    "olmoe-1b-7b": ("olmoe", 16, 16, 0, 64, 8, 0, 6.92e9, "OLMoE-1B-7B: 6.92B total"),
    "granite-3.0-3b-a800m": ("granitemoe", 32, 32, 0, 40, 8, 0, 3.3e9, "Granite 3.0 3B-A800M: 3.3B total"),
}
# Published FP8 checkpoints of a family above (Qwen's own FP8 releases): shape-only examples.
FP8_EXAMPLES = {
    "qwen3-30b-a3b-fp8": ("qwen3_moe", 48, 48, 0, 128, 8, 0, 30.5e9, "Qwen3-30B-A3B-FP8 card: 30.5B"),
    "qwen3-235b-a22b-fp8": ("qwen3_moe", 94, 94, 0, 128, 8, 0, 235e9, "Qwen3-235B-A22B-FP8 card: 235B total"),
}


def test_every_family_has_an_example():
    assert {v[0] for v in PUBLISHED.values()} == set(SHAPE_FAMILIES)
    assert {p.name for p in EXAMPLES.iterdir()} == set(PUBLISHED) | set(FP8_EXAMPLES)


@pytest.mark.parametrize("name", sorted(PUBLISHED) + sorted(FP8_EXAMPLES))
def test_example_parses_to_published_totals(name):
    model_type, layers, moe, first, experts, k, shared, params, _ = {**PUBLISHED, **FP8_EXAMPLES}[name]
    s = read_shape(EXAMPLES / name)
    assert (s.model_type, s.num_layers, s.num_moe_layers, s.moe_layers[0]) == (model_type, layers, moe, first)
    assert (s.num_experts, s.top_k, s.num_shared_experts) == (experts, k, shared)
    total = sum(parameter_counts(s).values())
    assert abs(total - params) / params < 0.02, f"{name}: {total / 1e9:.2f}B vs published {params / 1e9:.2f}B"


@pytest.mark.parametrize("name", ["deepseek-v2", "qwen3-235b-a22b", "qwen2-57b-a14b", "qwen3-next-80b-a3b",
                                  "mixtral-8x7b", "llama4-maverick", "olmoe-1b-7b", "granite-3.0-3b-a800m"])
def test_unquantized_bytes_are_two_per_parameter(name):
    s = read_shape(EXAMPLES / name)
    assert s.expert_format == s.linear_format == s.dtype == "bfloat16"
    assert total_bytes(s) == 2 * sum(parameter_counts(s).values())
    assert expert_bytes(s) == 2 * 3 * s.hidden_size * s.moe_intermediate_size


def test_exact_parameter_counts_from_safetensors_headers():
    # Counts read from the released checkpoints' safetensors headers (MTP layers excluded).
    assert sum(parameter_counts(read_shape(EXAMPLES / "qwen3-next-80b-a3b")).values()) == 79_674_391_296
    assert sum(parameter_counts(read_shape(EXAMPLES / "olmoe-1b-7b")).values()) == 6_919_161_856


def test_layer_patterns():
    assert read_shape(EXAMPLES / "llama4-maverick").moe_layers == tuple(range(1, 48, 2))  # the shared trace's
    assert read_shape(EXAMPLES / "deepseek-v3").moe_layers == tuple(range(3, 61))
    v3 = json.loads((EXAMPLES / "deepseek-v3" / "config.json").read_text())
    assert shape_from_hf_config(dict(v3, moe_layer_freq=2)).moe_layers == tuple(range(4, 61, 2))
    q = json.loads((EXAMPLES / "qwen3-235b-a22b" / "config.json").read_text())
    s = shape_from_hf_config(dict(q, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert s.moe_layers == tuple(i for i in range(94) if i % 2 == 1 and i != 3)
    assert parameter_counts(s)["dense_mlp"] == (94 - len(s.moe_layers)) * 3 * 4096 * 12288
    scout = json.loads((EXAMPLES / "llama4-maverick" / "config.json").read_text())
    scout["text_config"] = dict(scout["text_config"], interleave_moe_layer_step=1, num_local_experts=16)
    s = shape_from_hf_config(scout)
    assert s.moe_layers == tuple(range(48)) and s.intermediate_size == 0
    assert abs(sum(parameter_counts(s).values()) - 109e9) / 109e9 < 0.02  # Llama-4-Scout: 109B total


# Bytes of quantized experts from the tensors the checkpoints store (independent of WeightFormat).

def _awq_linear_bytes(out_f, in_f, group):  # AutoAWQ GEMM: qweight/qzeros int32 packed along out
    return in_f * (out_f // 8) * 4 + (in_f // group) * (out_f // 8) * 4 + (in_f // group) * out_f * 2


def _gptq_linear_bytes(out_f, in_f, group):  # AutoGPTQ: qweight packed along in, g_idx int32
    return (in_f // 8) * out_f * 4 + (in_f // group) * (out_f // 8) * 4 + (in_f // group) * out_f * 2 + in_f * 4


def _expert(linear_bytes, h, i, **kw):  # gate [I, H], up [I, H], down [H, I]
    return 2 * linear_bytes(i, h, **kw) + linear_bytes(h, i, **kw)


def test_expert_bytes_of_quantized_checkpoints():
    awq = read_shape(EXAMPLES / "mixtral-8x7b-awq")
    assert awq.expert_format == "awq_int4_g128" and awq.linear_format == "awq_int4_g128"
    assert expert_bytes(awq) == _expert(_awq_linear_bytes, 4096, 14336, group=128)
    gptq = read_shape(EXAMPLES / "qwen3-30b-a3b-gptq-int4")
    assert gptq.expert_format == "gptq_int4_g128" and gptq.dtype == "float16"
    assert expert_bytes(gptq) == _expert(_gptq_linear_bytes, 2048, 768, group=128)
    # DeepSeek-V3: e4m3 weights, float32 weight_scale_inv per 128 x 128 block
    v3 = read_shape(EXAMPLES / "deepseek-v3")
    blocks = 2 * math.ceil(2048 / 128) * math.ceil(7168 / 128) + math.ceil(7168 / 128) * math.ceil(2048 / 128)
    assert expert_bytes(v3) == 3 * 2048 * 7168 + 4 * blocks
    assert v3.linear_format == "fp8_block128"  # attention and dense MLP are fp8 too
    # gpt-oss: MXFP4 blocks [E, out, in/32, 16] uint8 + scales [E, out, in/32] uint8; the bf16 biases
    # stay resident (a non-expert part), not moved with the expert
    oss = read_shape(EXAMPLES / "gpt-oss-120b")
    assert (oss.expert_format, oss.linear_format) == ("mxfp4", "bfloat16")  # attention not converted
    gate_up = 5760 * (2880 // 32) * 16 + 5760 * (2880 // 32)
    down = 2880 * (2880 // 32) * 16 + 2880 * (2880 // 32)
    assert expert_bytes(oss) == gate_up + down
    assert nonexpert_bytes_breakdown(oss)["expert_biases"] == 36 * 128 * (5760 + 2880) * 2
    # the whole gpt-oss-120b checkpoint: 65.2 GB of safetensors (60.8 GiB)
    assert abs(total_bytes(oss) / 2**30 - 60.8) < 0.2


def test_format_names_round_trip():
    for name in ("fp8_block128", "fp8_block64x128", "awq_int4_g128", "gptq_int8_g64", "gptq_int4_gch",
                 "awq_int4_g128_nozp", "mxfp4", "fp8_channel", "fp8_tensor"):
        assert get_weight_format(name).name == name
    assert get_weight_format("gptq_int4_gch").matrix_bytes(8, 64) == 8 * 64 // 2 + 8 * 2.5 + 64 * 4
    with pytest.raises(ShapeError, match="unknown weight format 'int3'"):
        get_weight_format("int3")


def test_engine_config_is_the_shape_config_json_gives(tmp_path):
    """The engine reads its shape through this parser (one parser): every shape field and the bytes
    agree, and its record round-trips like a shape's (the model manifest)."""
    from dataclasses import fields

    from coldset.engine.model import ModelConfig

    for name in ("qwen3-235b-a22b", "mixtral-8x7b"):
        raw = json.loads((EXAMPLES / name / "config.json").read_text())
        eng, ours = ModelConfig.from_hf_config(raw), shape_from_hf_config(raw)
        assert as_shape(eng) is eng
        assert {f.name: getattr(eng, f.name) for f in fields(MoEShape)} == ours.to_dict()
        assert nonexpert_bytes(eng) == nonexpert_bytes(ours) and expert_bytes(eng) == expert_bytes(ours)
        assert ModelConfig.from_dict(json.loads(json.dumps(eng.to_dict()))) == eng
    assert ModelConfig.from_hf_config(raw).norm_topk_prob  # mixtral renormalises, always


def test_shape_round_trips_through_a_manifest():
    s = read_shape(EXAMPLES / "deepseek-v3")
    assert MoEShape.from_dict(json.loads(json.dumps(s.to_dict()))) == s


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": "abc"}, r"config\.json: field 'hidden_size' must be an integer >= 1, got 'abc'"),
    ({"num_attention_heads": 0}, r"field 'num_attention_heads' must be an integer >= 1, got 0"),
    ({"num_experts_per_tok": 300}, r"'num_experts_per_tok' \(300\) exceeds the number of routed experts \(256\)"),
    ({"model_type": "llama"}, r"model_type 'llama' is not a known MoE family"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, r"quant_method 'bitsandbytes' is not modelled"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, r"weight_block_size"),
    ({"n_routed_experts": None}, r"missing field 'n_routed_experts'"),
])
def test_bad_fields_are_named(tmp_path, change, message):
    raw = json.loads((EXAMPLES / "deepseek-v3" / "config.json").read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ShapeError, match=message) as e:
        read_shape(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ShapeError, match="config.json: missing"):
        read_shape(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ShapeError, match="not valid JSON"):
        read_shape(tmp_path)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_trace_only_example_configs_validate(name):
    """Every family's copyable example validates and points at its shape, which is shape-only."""
    import yaml

    from coldset.workflow.config import validate_config
    from coldset.workflow.config import skipped_stages

    repo = EXAMPLES.parents[2]
    cfg = validate_config(yaml.safe_load((repo / "config" / "examples" / "trace-only" / f"{name}.yaml").read_text()))
    assert cfg["model"]["name"] == name and cfg["routing"]["trace"] == f"exports/{name}/"
    cfg["model"]["path"] = str(repo / cfg["model"]["path"])
    assert read_shape(cfg["model"]["path"]) == read_shape(EXAMPLES / name)
    assert set(skipped_stages(cfg)) == {"autotune", "parity", "parity_gate", "bench"}


# ----------------------------------------------------------------------------------------------
# Exact bytes per part, every family and every format (issue 30): the expected bytes are written
# out by hand from the config values and the tensors each checkpoint format stores, not from the
# parser's fields or WeightFormat, so a part counted once instead of twice (DeepSeek-V2's two
# shared experts), a dropped gate (Qwen2-MoE's shared-expert gate) or a misread format (FP8
# without weight_block_size, AWQ without zero points) changes an exact number.

def _bf16(out_f, in_f):
    return 2 * out_f * in_f


def _fp8_block(out_f, in_f):  # e4m3 weight + float32 weight_scale_inv per 128 x 128 block
    return out_f * in_f + 4 * math.ceil(out_f / 128) * math.ceil(in_f / 128)


def _fp8_tensor(out_f, in_f):  # e4m3 weight + one float32 weight_scale
    return out_f * in_f + 4


def _fp8_channel(out_f, in_f):  # fbgemm: e4m3 weight + float32 weight_scale [out, 1]
    return out_f * in_f + 4 * out_f


def _mxfp4(out_f, in_f):  # blocks [out, in/32, 16] uint8 + scales [out, in/32] uint8
    return out_f * (in_f // 32) * 16 + out_f * (in_f // 32)


def _awq64(out_f, in_f):
    return _awq_linear_bytes(out_f, in_f, 64)


def _awq64_nozp(out_f, in_f):  # zero_point false: qweight and scales, no qzeros
    return in_f * (out_f // 8) * 4 + (in_f // 64) * out_f * 2


def _gptq64(out_f, in_f):
    return _gptq_linear_bytes(out_f, in_f, 64)


# name: (quantization_config, non-expert linear bytes, expert linear bytes)
FORMATS = {
    "bf16": (None, _bf16, _bf16),
    "fp8_block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}, _fp8_block, _fp8_block),
    "fp8_tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, _fp8_tensor, _fp8_tensor),
    "fp8_channel": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, _fp8_channel, _fp8_channel),
    "mxfp4": ({"quant_method": "mxfp4"}, _bf16, _mxfp4),  # transformers' mxfp4 converts the experts only
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
            _awq64, _awq64),
    "awq_nozp": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": False, "version": "gemm"},
                 _awq64_nozp, _awq64_nozp),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True},
             _gptq64, _gptq64),
}


def _mlp(lin, h, inter):  # gate [I, H], up [I, H], down [H, I] as the checkpoint stores them
    return 2 * lin(inter, h) + lin(h, inter)


def _hand_bytes(raw, lin, elin, kept=()):
    """(non-expert parts, one routed expert) by hand from a config dict: ``lin`` / ``elin`` the
    bytes of a non-expert / expert linear [out, in]; ``kept`` the non-expert groups in bf16."""
    if raw["model_type"] == "llama4":
        raw = raw["text_config"]
    mt = raw["model_type"]

    def g(name):
        return _bf16 if name in kept else lin

    h, L, V = raw["hidden_size"], raw["num_hidden_layers"], raw["vocab_size"]
    heads, kv = raw["num_attention_heads"], raw.get("num_key_value_heads", raw["num_attention_heads"])
    hd = raw.get("head_dim", h // heads)
    q, kvo = heads * hd, kv * hd
    gqa = g("q_proj")(q, h) + g("k_proj")(kvo, h) + g("v_proj")(kvo, h) + g("o_proj")(h, q)
    parts = dict(embed_tokens=2 * V * h, lm_head=0 if raw.get("tie_word_embeddings") else 2 * V * h,
                 shared_experts=0, dense_mlp=0, expert_biases=0)
    if mt == "qwen3_moe":
        I, E = raw["moe_intermediate_size"], raw["num_experts"]
        parts.update(attention=L * gqa, norms=2 * (L * (2 * h + 2 * hd) + h), routers=2 * L * E * h)
        expert = _mlp(elin, h, I)
    elif mt == "qwen2_moe":
        I, E, S = raw["moe_intermediate_size"], raw["num_experts"], raw["shared_expert_intermediate_size"]
        parts.update(attention=L * (gqa + 2 * (q + 2 * kvo)),  # q, k, v biases
                     norms=2 * (2 * L * h + h),
                     routers=2 * L * (E * h + h),  # mlp.gate [E, H] + mlp.shared_expert_gate [1, H]
                     shared_experts=L * _mlp(g("shared_experts"), h, S))
        expert = _mlp(elin, h, I)
    elif mt == "qwen3_next":
        I, E, S = raw["moe_intermediate_size"], raw["num_experts"], raw["shared_expert_intermediate_size"]
        full = L // raw["full_attention_interval"]
        lin_layers = L - full
        kd = raw["linear_num_key_heads"] * raw["linear_key_head_dim"]
        vd = raw["linear_num_value_heads"] * raw["linear_value_head_dim"]
        nv = raw["linear_num_value_heads"]
        full_attn = g("q_proj")(2 * q, h) + g("k_proj")(kvo, h) + g("v_proj")(kvo, h) + g("o_proj")(h, q)
        delta = g("in_proj_qkvz")(2 * kd + 2 * vd, h) + g("in_proj_ba")(2 * nv, h) + g("out_proj")(h, vd)
        conv = (2 * kd + vd) * raw["linear_conv_kernel_dim"]  # conv1d weight [channels, 1, kernel]
        parts.update(attention=full * full_attn + lin_layers * (delta + 2 * (conv + 2 * nv)),  # + dt_bias, A_log
                     norms=2 * (2 * L * h + full * 2 * hd + lin_layers * raw["linear_value_head_dim"] + h),
                     routers=2 * L * (E * h + h), shared_experts=L * _mlp(g("shared_experts"), h, S))
        expert = _mlp(elin, h, I)
    elif mt in ("mixtral", "granitemoe"):
        E = raw["num_local_experts"]
        parts.update(attention=L * gqa, norms=2 * (2 * L * h + h), routers=2 * L * E * h)
        expert = _mlp(elin, h, raw["intermediate_size"])
    elif mt == "olmoe":
        parts.update(attention=L * gqa, norms=2 * (L * (2 * h + q + kvo) + h), routers=2 * L * raw["num_experts"] * h)
        expert = _mlp(elin, h, raw["intermediate_size"])
    elif mt in ("deepseek_v2", "deepseek_v3"):
        I, E = raw["moe_intermediate_size"], raw["n_routed_experts"]
        dense = raw["first_k_dense_replace"]
        moe = L - dense
        ql, kl = raw["q_lora_rank"], raw["kv_lora_rank"]
        nope, rope, v = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"], raw["v_head_dim"]
        mla = (g("q_a_proj")(ql, h) + g("q_b_proj")(heads * (nope + rope), ql)
               + g("kv_a_proj_with_mqa")(kl + rope, h) + g("kv_b_proj")(heads * (nope + v), kl)
               + g("o_proj")(h, heads * v))
        bias = E if raw.get("topk_method") == "noaux_tc" else 0  # e_score_correction_bias
        # mlp.shared_experts.gate_proj is [n_shared * I, H]: two experts of I as one MLP
        parts.update(attention=L * mla, norms=2 * (L * (2 * h + ql + kl) + h), routers=2 * moe * (E * h + bias),
                     shared_experts=moe * _mlp(g("shared_experts"), h, raw["n_shared_experts"] * I),
                     dense_mlp=dense * _mlp(g("dense_mlp"), h, raw["intermediate_size"]))
        expert = _mlp(elin, h, I)
    elif mt == "glm4_moe":
        I, E = raw["moe_intermediate_size"], raw["n_routed_experts"]
        dense = raw["first_k_dense_replace"]
        moe = L - dense
        qk_norm = 2 * hd if raw.get("use_qk_norm") else 0
        parts.update(attention=L * (gqa + (2 * (q + 2 * kvo) if raw.get("attention_bias") else 0)),  # q/k/v biases
                     norms=2 * (L * (2 * h + qk_norm) + h), routers=2 * moe * (E * h + E),  # + correction bias
                     shared_experts=moe * _mlp(g("shared_experts"), h, raw["n_shared_experts"] * I),
                     dense_mlp=dense * _mlp(g("dense_mlp"), h, raw["intermediate_size"]))
        expert = _mlp(elin, h, I)
    elif mt == "llama4_text":
        I, E = raw["intermediate_size"], raw["num_local_experts"]
        moe = L // raw["interleave_moe_layer_step"]
        parts.update(attention=L * gqa, norms=2 * (2 * L * h + h), routers=2 * moe * E * h,
                     shared_experts=moe * _mlp(g("shared_experts"), h, I),
                     dense_mlp=(L - moe) * _mlp(g("dense_mlp"), h, raw["intermediate_size_mlp"]))
        expert = _mlp(elin, h, I)
    elif mt == "gpt_oss":
        I, E = raw["intermediate_size"], raw["num_local_experts"]
        parts.update(attention=L * (gqa + 2 * (q + 2 * kvo + h + heads)),  # q/k/v/o biases, sinks
                     norms=2 * (2 * L * h + h), routers=2 * L * (E * h + E),
                     expert_biases=2 * L * E * (2 * I + h))  # gate_up_proj_bias [2I], down_proj_bias [H], bf16, resident
        expert = _mlp(elin, h, I)
    else:
        raise AssertionError(mt)
    return parts, expert


def _example(name):
    return json.loads((EXAMPLES / name / "config.json").read_text())


def _with_quantization(raw, qcfg):
    raw = json.loads(json.dumps(raw))
    target = raw["text_config"] if raw["model_type"] == "llama4" else raw
    raw.pop("quantization_config", None)
    target.pop("quantization_config", None)
    if qcfg is not None:
        target["quantization_config"] = qcfg
    return raw


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_bytes_per_part_by_hand_every_family_and_format(name, fmt):
    qcfg, lin, elin = FORMATS[fmt]
    raw = _with_quantization(_example(name), qcfg)
    s = shape_from_hf_config(raw)
    parts, expert = _hand_bytes(raw, lin, elin)
    assert nonexpert_bytes_breakdown(s) == parts
    assert expert_bytes(s) == expert
    assert total_bytes(s) == sum(parts.values()) + s.num_moe_layers * s.num_experts * expert


@pytest.mark.parametrize("name, lin, elin, kept", [
    ("deepseek-v3", _fp8_block, _fp8_block, ()),
    ("mixtral-8x7b-awq", lambda o, i: _awq_linear_bytes(o, i, 128), lambda o, i: _awq_linear_bytes(o, i, 128), ()),
    ("qwen3-30b-a3b-gptq-int4", lambda o, i: _gptq_linear_bytes(o, i, 128),
     lambda o, i: _gptq_linear_bytes(o, i, 128), ()),
    ("gpt-oss-120b", _bf16, _mxfp4, ()),
    ("qwen3-30b-a3b-fp8", _fp8_block, _fp8_block, ()),
    ("qwen3-235b-a22b-fp8", _fp8_block, _fp8_block, ()),
])
def test_bytes_per_part_of_the_published_quantized_examples(name, lin, elin, kept):
    raw = _example(name)
    parts, expert = _hand_bytes(raw, lin, elin, kept)
    s = read_shape(EXAMPLES / name)
    assert nonexpert_bytes_breakdown(s) == parts
    assert expert_bytes(s) == expert


def test_deepseek_v2_counts_both_shared_experts():
    s = read_shape(EXAMPLES / "deepseek-v2")
    one = 3 * 5120 * 1536 * 2  # one shared expert of moe_intermediate_size 1536, bf16
    assert nonexpert_bytes_breakdown(s)["shared_experts"] == 59 * 2 * one  # two per MoE layer, 59 MoE layers


def test_qwen3_fp8_attention_is_fp8_not_bf16():
    """Qwen's FP8 configs list model.layers.N.post_attention_layernorm (and mlp.gate, lm_head) in
    modules_to_not_convert: the attention projections are FP8 all the same (their checkpoints store
    q/k/v/o_proj.weight as float8_e4m3fn with weight_scale_inv). 30B-A3B-FP8: an expert is
    4,719,744 bytes with its scales (NOTES.md), the attention 48 layers of q, k, v, o in FP8."""
    s = read_shape(EXAMPLES / "qwen3-30b-a3b-fp8")
    assert (s.expert_format, s.linear_format, s.unquantized_linears) == ("fp8_block128", "fp8_block128", ())
    assert expert_bytes(s) == 4_719_744
    q = 4096 * 2048 + 4 * 32 * 16
    kv = 512 * 2048 + 4 * 4 * 16
    o = 2048 * 4096 + 4 * 16 * 32
    assert nonexpert_bytes_breakdown(s)["attention"] == 48 * (q + 2 * kv + o) == 906_190_848
    big = read_shape(EXAMPLES / "qwen3-235b-a22b-fp8")
    assert big.linear_format == "fp8_block128" and big.unquantized_linears == ()
    assert nonexpert_bytes_breakdown(big)["attention"] == 94 * (2 * (8192 * 4096 + 4 * 64 * 32)
                                                                 + 2 * (512 * 4096 + 4 * 4 * 32))


@pytest.mark.parametrize("name, patterns", [
    ("model.layers.0.post_attention_layernorm", ["attention", "attn"]),
    ("model.layers.0.self_attn.q_proj", ["model.layers.0.post_attention_layernorm", "model.layers.0.mlp.gate"]),
    ("model.layers.0.self_attn.q_proj", ["model.layers.*.self_attn"]),
    ("model.layers.11.self_attn.q_proj", ["model.layers.1"]),
    ("model.layers.1.self_attn.q_proj", ["model.layers.1"]),
    ("model.layers.3.mlp.gate_proj", ["mlp.gate", "model.layers.3.mlp.gate"]),
    ("model.layers.3.mlp.gate", ["mlp.gate"]),
    ("model.layers.3.mlp.shared_expert.down_proj", ["down_proj"]),
    ("model.layers.3.linear_attn.in_proj_ba", ["model.layers.3.linear_attn.in_proj_b"]),
    ("lm_head", ["lm_head"]),
])
def test_module_names_match_as_transformers_matches_them(name, patterns):
    """Against transformers' own matcher (quantizers_utils.should_convert_module)."""
    qu = pytest.importorskip("transformers.quantizers.quantizers_utils")
    from coldset.core.shapes import module_not_converted

    assert module_not_converted(name, patterns) == (not qu.should_convert_module(name, patterns))


def test_skipped_modules_keep_their_group_in_the_model_dtype():
    raw = _example("qwen3-235b-a22b")
    fp8 = FORMATS["fp8_block"][0]
    # ignored_layers (per-tensor FP8 checkpoints) naming the attention: attention bf16, the rest FP8
    s = shape_from_hf_config(dict(raw, quantization_config={"quant_method": "fp8", "ignored_layers": [
        "lm_head", "model.layers.*.self_attn"]}))
    assert (s.expert_format, s.linear_format) == ("fp8_tensor", "bfloat16")
    parts, expert = _hand_bytes(raw, _bf16, _fp8_tensor)
    assert nonexpert_bytes_breakdown(s) == parts and expert_bytes(s) == expert
    # one projection kept: only it in bf16
    s = shape_from_hf_config(dict(raw, quantization_config=dict(fp8, modules_to_not_convert=["o_proj"])))
    assert s.unquantized_linears == ("o_proj",) and s.linear_format == "fp8_block128"
    assert nonexpert_bytes_breakdown(s) == _hand_bytes(raw, _fp8_block, _fp8_block, kept=("o_proj",))[0]
    # the experts named: experts in bf16
    s = shape_from_hf_config(dict(raw, quantization_config=dict(fp8, modules_to_not_convert=["mlp.experts"])))
    assert s.expert_format == "bfloat16" and expert_bytes(s) == 3 * 2 * 4096 * 1536
    # Qwen3-Next's DeltaNet in_proj_ba kept, the other projections FP8 (Qwen's FP8 release)
    nxt = _example("qwen3-next-80b-a3b")
    kept = [f"model.layers.{i}.linear_attn.in_proj_ba" for i in range(48) if (i + 1) % 4]
    s = shape_from_hf_config(dict(nxt, quantization_config=dict(fp8, modules_to_not_convert=kept)))
    assert s.unquantized_linears == ("in_proj_ba",)
    assert nonexpert_bytes_breakdown(s) == _hand_bytes(nxt, _fp8_block, _fp8_block, kept=("in_proj_ba",))[0]
    # a group partly named is refused, naming both modules
    with pytest.raises(ShapeError, match=r"keeps model\.layers\.0\.self_attn\.q_proj unquantized but not "
                                         r"model\.layers\.1\.self_attn\.q_proj"):
        shape_from_hf_config(dict(raw, quantization_config=dict(fp8, modules_to_not_convert=[
            "model.layers.0.self_attn"])))
    with pytest.raises(ShapeError, match="modules_to_not_convert must be a list"):
        shape_from_hf_config(dict(raw, quantization_config=dict(fp8, modules_to_not_convert="lm_head")))
    with pytest.raises(ShapeError, match="zero_point must be true or false"):
        shape_from_hf_config(dict(raw, quantization_config=dict(FORMATS["awq"][0], zero_point="no")))


def test_deepseek_fields_left_out_take_transformers_defaults():
    """A DeepSeek config without q_lora_rank (or n_shared_experts, first_k_dense_replace) is what
    transformers builds from it: its DeepseekV2Config / DeepseekV3Config defaults; an explicit
    null q_lora_rank (DeepSeek-V2-Lite) is no query compression."""
    tr = pytest.importorskip("transformers")
    for name, cls in (("deepseek-v2", tr.DeepseekV2Config), ("deepseek-v3", tr.DeepseekV3Config)):
        raw = _with_quantization(_example(name), None)  # bf16
        for key in ("q_lora_rank", "n_shared_experts", "first_k_dense_replace"):
            raw.pop(key)
        ref = cls()
        s = shape_from_hf_config(raw)
        names = [n for n, *_ in s.attention_linears]
        assert names[:2] == ["q_a_proj", "q_b_proj"] and s.attention_linears[0][1] == ref.q_lora_rank
        assert s.num_shared_experts == ref.n_shared_experts
        assert s.moe_layers[0] == ref.first_k_dense_replace
        full = dict(raw, q_lora_rank=ref.q_lora_rank, n_shared_experts=ref.n_shared_experts,
                    first_k_dense_replace=ref.first_k_dense_replace)
        assert _hand_bytes(full, _bf16, _bf16)[0] == nonexpert_bytes_breakdown(s)
    lite = dict(_example("deepseek-v2"), q_lora_rank=None)
    s = shape_from_hf_config(lite)
    assert s.attention_linears[0] == ("q_proj", 128 * 192, 5120, 60)
