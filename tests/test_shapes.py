"""coldset.shapes: model shapes and weight bytes from config.json alone, for every family listed.

References are independent of the parser: published totals from the model cards (layers, MoE
layers, experts, top-k, shared experts, parameter count) and byte counts of the tensors each
quantized checkpoint stores, laid out as the quantizer writes them.
"""

import json
import math
from pathlib import Path

import pytest

from coldset.shapes import (
    SHAPE_FAMILIES,
    MoEShape,
    ShapeError,
    as_shape,
    expert_bytes,
    get_weight_format,
    nonexpert_bytes,
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


def test_every_family_has_an_example():
    assert {v[0] for v in PUBLISHED.values()} == set(SHAPE_FAMILIES)
    assert {p.name for p in EXAMPLES.iterdir()} == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_example_parses_to_published_totals(name):
    model_type, layers, moe, first, experts, k, shared, params, _ = PUBLISHED[name]
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
    # gpt-oss: MXFP4 blocks [E, out, in/32, 16] uint8 + scales [E, out, in/32] uint8, bf16 biases
    oss = read_shape(EXAMPLES / "gpt-oss-120b")
    assert (oss.expert_format, oss.linear_format) == ("mxfp4", "bfloat16")  # attention not converted
    gate_up = 5760 * (2880 // 32) * 16 + 5760 * (2880 // 32) + 5760 * 2
    down = 2880 * (2880 // 32) * 16 + 2880 * (2880 // 32) + 2880 * 2
    assert expert_bytes(oss) == gate_up + down
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

    from coldset.model import ModelConfig

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

    from coldset.config import validate_config
    from coldset.pipeline import skipped_stages

    repo = EXAMPLES.parents[2]
    cfg = validate_config(yaml.safe_load((repo / "config" / "examples" / "trace-only" / f"{name}.yaml").read_text()))
    assert cfg["model"]["name"] == name and cfg["routing"]["trace"] == f"exports/{name}/"
    cfg["model"]["path"] = str(repo / cfg["model"]["path"])
    assert read_shape(cfg["model"]["path"]) == read_shape(EXAMPLES / name)
    assert set(skipped_stages(cfg)) == {"autotune", "parity", "parity_gate", "bench"}
