"""The workflow on a deepseek_v3 checkpoint, on the CPU: a tiny random DeepseekV3ForCausalLM
(transformers' own, saved with save_pretrained, plus a small tokenizer) as ``model.path`` through
model, fixtures, routing, stats, placement, autotune, parity and parity_gate in this process.
Every placement, static and the slot cache's, decodes bitwise the all-hot path's logits; the same
on that folder in DeepSeek-V3's published block-FP8 layout. A quantized format the engine does not
decode is refused, by field, before any decoding job."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from coldset.engine.deepseek_v3 import DeepseekV3Config
from coldset.workflow import process_engine
from coldset.workflow.config import DECODING_STAGES, decoding_support, skipped_stages
from coldset.workflow.context import StageContext
from family_workflow import assert_every_placement_bitwise, run_stages
from hf_fixtures import build_tokenizer

from test_deepseek_v3 import write_block_fp8

transformers = pytest.importorskip("transformers")

def build(out: Path) -> Path:
    import torch

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=tok.get_vocab_size(), max_position_embeddings=2048, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, first_k_dense_replace=1, n_routed_experts=8,
        n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=1.5,
        norm_topk_prob=True, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module", params=["float32", "block_fp8"])
def run(tmp_path_factory, request):
    """The stages on the float32 folder, or on it in DeepSeek-V3's published block-FP8 layout (routed
    experts kept FP8 in the pools, the other linear layers dequantized at load)."""
    root = tmp_path_factory.mktemp("dsv3wf")
    folder = build(root / "hf")
    if request.param == "block_fp8":
        folder = write_block_fp8(folder, root / "hf-fp8")
        shutil.copy(root / "hf" / "tokenizer.json", folder / "tokenizer.json")
    config = run_stages(root, {"name": "tiny-dsv3", "path": str(folder), "dtype": "float32"})
    yield {"config": config, "results": root / "results", "folder": folder}
    process_engine.release_engine()


def test_the_workflow_reads_the_family_and_decodes_it(run):
    assert decoding_support(run["config"]) is None
    cfg = StageContext.from_config(run["config"]).model_config
    assert isinstance(cfg, DeepseekV3Config)
    fp8 = "quantization_config" in json.loads((run["folder"] / "config.json").read_text())
    assert cfg.expert_format == ("fp8_block128" if fp8 else "float32")
    manifest = json.loads((run["results"] / "model" / "tiny-dsv3" / "manifest.json").read_text())
    assert manifest["config"]["model_type"] == "deepseek_v3"


def test_every_placement_is_bitwise_the_all_hot_path(run):
    assert_every_placement_bitwise(run["results"], "tiny-dsv3")


@pytest.mark.parametrize("change, match", [
    ({"weight_block_size": [64, 64]}, "weight_block_size [64, 64] is not supported"),
    ({"quant_method": "mxfp4"}, "quant_method 'mxfp4'"),
])
def test_an_unsupported_quantized_deepseek_v3_folder_is_refused_before_any_job(tmp_path, run, change, match):
    """A quantized format the engine does not decode: the decoding stages are left out, naming the
    field (the shape stages still run on it)."""
    folder = tmp_path / "other"
    folder.mkdir()
    raw = json.loads((run["folder"] / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], **change}
    (folder / "config.json").write_text(json.dumps(raw))
    (folder / "model.safetensors").write_bytes((run["folder"] / "model.safetensors").read_bytes())
    config = {**run["config"], "model": {**run["config"]["model"], "path": str(folder)}}
    reason = decoding_support(config)
    assert reason and "quantization_config" in reason and match in reason
    assert set(skipped_stages(config)) == set(DECODING_STAGES)
