"""The workflow on a gpt_oss checkpoint as gpt-oss publishes it, on the CPU: a tiny random
GptOssForCausalLM (transformers' own, its biases and sinks random) with MXFP4 experts
(``*_blocks`` / ``*_scales``, ``quantization_config`` mxfp4) plus a small tokenizer, as
``model.path`` through model, fixtures, routing, stats, placement, cache, autotune, parity and
parity_gate in this process, in bfloat16 with the experts kept 4-bit (``model.experts_format``
checkpoint, the default). Every placement, static and the slot cache's, decodes bitwise the
all-hot MXFP4 path's logits; the manifest and the placements' bytes say mxfp4. A dequantized run
is asked for (``experts_format: dequantized``) and says so; float32 with 4-bit experts is refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from coldset.core import mxfp4
from coldset.engine.gpt_oss import GptOssConfig
from coldset.workflow import pipeline, process_engine
from coldset.workflow.config import decoding_support, input_file_problems
from coldset.workflow.context import StageContext, StageError
from family_workflow import STAGES, assert_every_placement_bitwise, run_stages
from hf_fixtures import build_tokenizer

from test_gpt_oss import random_model, write_mxfp4

transformers = pytest.importorskip("transformers")

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptosswf")
    tok = build_tokenizer()
    folder = write_mxfp4(random_model("mxfp4", vocab_size=tok.get_vocab_size(), max_positions=2048), root / "hf")
    tok.save(str(folder / "tokenizer.json"))
    config = run_stages(root, {"name": "tiny-gptoss", "path": str(folder), "dtype": "bfloat16"},
                        [*STAGES[:5], "cache", *STAGES[5:]], cache={"policies": ["static", "lru"]})
    yield {"config": config, "results": root / "results", "folder": folder}
    process_engine.release_engine()


def test_the_workflow_reads_the_family_and_decodes_it(run):
    assert decoding_support(run["config"]) is None
    cfg = StageContext.from_config(run["config"]).model_config
    assert isinstance(cfg, GptOssConfig) and cfg.checkpoint_expert_format == "mxfp4"
    manifest = json.loads((run["results"] / "model" / "tiny-gptoss" / "manifest.json").read_text())
    assert manifest["config"]["model_type"] == "gpt_oss"


def test_the_experts_run_kept_4bit_and_the_files_say_mxfp4(run):
    """The engine the stages decoded with holds the checkpoint's packed rows and e8m0 scales; the
    manifest records the format that ran, and every placement counts MXFP4 bytes (blocks + scales
    of w13 and w2; the biases stay resident), computed here from the format's definition."""
    ctx = StageContext.from_config(run["config"])
    engine, _ = process_engine.load_engine(ctx)
    assert engine.pools.is_mxfp4 and engine.pools.w13_hot.dtype == torch.uint8
    assert engine.config.expert_format == "mxfp4"
    manifest = json.loads((run["results"] / "model" / "tiny-gptoss" / "manifest.json").read_text())
    assert manifest["experts_format"] == manifest["checkpoint_experts_format"] == "mxfp4"
    assert manifest["config"]["expert_format"] == "mxfp4"
    tuned = json.loads((run["results"] / "autotune" / "tiny-gptoss.json").read_text())
    assert tuned["shape"]["weight_format"] == "mxfp4" and tuned["shape"]["dtype"] == "bfloat16"
    cfg = ctx.model_config
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    packed = (2 * I * H + H * I) // 2 + (2 * I * H + H * I) // 32  # 4 bits a weight, 1 byte a group of 32
    for name in ctx.placements:
        doc = json.loads((run["results"] / "placement" / "tiny-gptoss" / f"{name}.json").read_text())
        assert doc["weight_format"] == "mxfp4", name
        assert doc["bytes_per_expert"] == packed, name
    sim = pd.read_csv(run["results"] / "cache" / "tiny-gptoss" / "simulation.csv")
    missed = sim[(sim["misses_per_token"] > 0) & (sim["batch"] == 1) & (sim["prefetches_per_token"] == 0)]
    assert len(missed) > 0  # at batch 1 without prefetches each miss moves one MXFP4 expert (the CSV keeps
    # 6 decimals of GB: up to 14% here; bf16's bytes would be 3.4x these)
    assert np.allclose(missed["link_gb_per_token"] * 1e9 / missed["misses_per_token"],
                       packed, rtol=0.2)


def test_every_placement_is_bitwise_the_all_hot_path(run):
    assert_every_placement_bitwise(run["results"], "tiny-gptoss")


@pytest.mark.parametrize("change, words", [
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128]}}, ("quantization_config", "gpt_oss")),
    ({"quantization_config": {"quant_method": "mxfp4", "block_size": 16}}, ("block_size",)),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, ("llama3", "gpt_oss")),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, ("layer_types", "chunked_attention")),
])
def test_a_variant_the_engine_does_not_run_is_refused_before_any_job(tmp_path, run, change, words):
    """decoding_support (asked before the workflow schedules any job) names the file and the field."""
    folder = tmp_path / "variant"
    folder.mkdir()
    raw = json.loads((run["folder"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, **change}))
    (folder / "model.safetensors").write_bytes((run["folder"] / "model.safetensors").read_bytes())
    config = {**run["config"], "model": {**run["config"]["model"], "path": str(folder)}}
    reason = decoding_support(config)
    assert reason and "config.json" in reason and all(w in reason for w in words), reason


def _with_model(run, tmp_path, **model) -> dict:
    """The run's config with other model settings and its own results folder."""
    return {**run["config"], "results": str(tmp_path / "results"), "model": {**run["config"]["model"], **model}}


def test_float32_with_4bit_experts_is_refused_before_any_job_and_at_the_model_stage(run, tmp_path):
    config = _with_model(run, tmp_path, dtype="float32")
    problems = input_file_problems(config)  # the config check Snakemake runs before scheduling
    assert any(str(run["folder"]) in p and "model.dtype float32" in p and "MXFP4" in p for p in problems), problems
    assert not input_file_problems(_with_model(run, tmp_path, dtype="float32", experts_format="dequantized"))
    with pytest.raises(StageError, match=r"model\.dtype float32.*MXFP4.*experts_format: dequantized"):
        pipeline.run_stage("model", config)
    assert not (tmp_path / "results" / "model").exists() or not any((tmp_path / "results" / "model").rglob("*.json"))


def test_a_dequantized_run_is_asked_for_and_says_so(run, tmp_path):
    """experts_format dequantized: the engine's experts are float32 (the MXFP4 values exactly), the
    manifest says float32 of an mxfp4 checkpoint, and the placements count float32 bytes."""
    config = _with_model(run, tmp_path, dtype="float32", experts_format="dequantized")
    pipeline.run_stage("model", config)
    stats = tmp_path / "results" / "stats" / "tiny-gptoss"
    shutil.copytree(run["results"] / "stats" / "tiny-gptoss", stats)  # the same routing counts
    pipeline.run_stage("placement", config)
    manifest = json.loads((tmp_path / "results" / "model" / "tiny-gptoss" / "manifest.json").read_text())
    assert manifest["experts_format"] == "float32" and manifest["checkpoint_experts_format"] == "mxfp4"
    ctx = StageContext.from_config(config)
    cfg = ctx.model_config
    for name in ctx.placements:
        doc = json.loads((tmp_path / "results" / "placement" / "tiny-gptoss" / f"{name}.json").read_text())
        assert doc["weight_format"] == "float32", name
        assert doc["bytes_per_expert"] == 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4, name
    engine, _ = process_engine.load_engine(ctx)
    try:
        assert not engine.pools.is_mxfp4 and engine.pools.w13_hot.dtype == torch.float32
        blocks = load_file(run["folder"] / "model.safetensors")["model.layers.0.mlp.experts.down_proj_blocks"]
        scales = load_file(run["folder"] / "model.safetensors")["model.layers.0.mlp.experts.down_proj_scales"]
        assert torch.equal(engine.pools.w2_hot[:cfg.num_experts], mxfp4.dequantize(blocks, scales, torch.float32))
    finally:
        process_engine.release_engine()


def test_dequantized_is_refused_for_experts_that_are_not_mxfp4(run, tmp_path):
    folder = tmp_path / "bf16"
    folder.mkdir()
    raw = json.loads((run["folder"] / "config.json").read_text())
    raw.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(raw))
    config = _with_model(run, tmp_path, path=str(folder), experts_format="dequantized")
    with pytest.raises(StageError, match="experts_format: dequantized dequantizes MXFP4 experts"):
        process_engine.experts_format(StageContext.from_config(config))


@pytest.mark.gpu
def test_cuda_workflow_keeps_mxfp4_and_every_placement_is_bitwise(run, tmp_path):
    """The same folder through model..parity_gate on CUDA: the MXFP4 Triton kernel with its tuned
    configs, cold experts (blocks and scales) in pinned host memory, the lru slot cache filling
    slots with scales; every placement bitwise the all-hot MXFP4 path."""
    config = {**_with_model(run, tmp_path), "device": "cuda"}
    process_engine.release_engine()
    try:
        for stage in ["model", "fixtures", "routing", "stats", "placement", "autotune", "parity", "parity_gate"]:
            pipeline.run_stage(stage, config)
        engine, _ = process_engine.load_engine(StageContext.from_config(config))
        assert engine.pools.is_mxfp4 and engine.device.type == "cuda"
    finally:
        process_engine.release_engine()
    res = tmp_path / "results" / "parity" / "tiny-gptoss"
    gate = json.loads((res / "gate.json").read_text())
    assert gate["passed"] and len(gate["placements"]) == 6
    for name in gate["placements"]:
        parity = json.loads((res / f"{name}.json").read_text())
        assert parity["passed"] and parity["max_abs_logit_diff"] == 0.0, name
