"""The workflow on a gpt_oss checkpoint as gpt-oss publishes it, on the CPU: a tiny random
GptOssForCausalLM (transformers' own, its biases and sinks random) with MXFP4 experts
(``*_blocks`` / ``*_scales``, ``quantization_config`` mxfp4) plus a small tokenizer, as
``model.path`` through model, fixtures, routing, stats, placement, autotune, parity and
parity_gate in this process. Every placement, static and the slot cache's, decodes bitwise the
all-hot path's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from coldset.engine.gpt_oss import GptOssConfig
from coldset.workflow import pipeline, process_engine
from coldset.workflow.config import decoding_support, load_config
from coldset.workflow.context import StageContext
from hf_fixtures import build_tokenizer

from test_gpt_oss import random_model, write_mxfp4

transformers = pytest.importorskip("transformers")

DEFAULT = Path(__file__).resolve().parents[1] / "config" / "config.yaml"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptosswf")
    tok = build_tokenizer()
    folder = write_mxfp4(random_model("mxfp4", vocab_size=tok.get_vocab_size(), max_positions=2048), root / "hf")
    tok.save(str(folder / "tokenizer.json"))
    overlay = {
        "results": str(root / "results"),
        "model": {"name": "tiny-gptoss", "path": str(folder), "dtype": "float32"},
        "device": "cpu",
        "fixtures": {"per_domain": 2, "max_new_tokens": 6},
        "routing": {"batch_size": 4},
        "placement": {"policies": ["positional", "usage_global", "lru"], "residency": [0.5, 1.0]},
        "parity": {"max_new_tokens": 6},
        "autotune": {"cache_dir": str(root / "autotune-cache")},
    }
    (root / "tiny.yaml").write_text(yaml.safe_dump(overlay))
    config = load_config([DEFAULT, root / "tiny.yaml"])
    process_engine.release_engine()
    for stage in ["model", "fixtures", "routing", "stats", "placement", "autotune", "parity", "parity_gate"]:
        pipeline.run_stage(stage, config)
    yield {"config": config, "results": root / "results", "folder": folder}
    process_engine.release_engine()


def test_the_workflow_reads_the_family_and_decodes_it(run):
    assert decoding_support(run["config"]) is None
    cfg = StageContext.from_config(run["config"]).model_config
    assert isinstance(cfg, GptOssConfig) and cfg.checkpoint_expert_format == "mxfp4"
    manifest = json.loads((run["results"] / "model" / "tiny-gptoss" / "manifest.json").read_text())
    assert manifest["config"]["model_type"] == "gpt_oss"


def test_every_placement_is_bitwise_the_all_hot_path(run):
    res = run["results"] / "parity" / "tiny-gptoss"
    gate = json.loads((res / "gate.json").read_text())
    names = [f"{p}-{r}" for p in ("positional", "usage_global", "lru") for r in ("0.5", "1.0")]
    assert gate["passed"] and sorted(gate["placements"]) == sorted(names)
    for name in names:
        parity = json.loads((res / f"{name}.json").read_text())
        assert parity["passed"] and parity["tokens_matched"] == parity["tokens_total"] > 0
        assert parity["max_abs_logit_diff"] == 0.0
        if name.endswith("0.5"):
            assert parity["num_cold"] > 0


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
