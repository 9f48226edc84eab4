"""The workflow on block-FP8 experts, on the CPU: config/examples/synthetic-fp8.yaml at
tiny shapes (hidden 64: one partial 128 x 128 block per matrix) through model, fixtures, routing,
stats, placement, autotune, parity and parity_gate in this process; every placement, static and
the slot cache's, decodes bitwise the logits of the all-hot FP8 path, with experts FP8 in both
tiers and in the slots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from coldset.workflow import pipeline, process_engine
from coldset.workflow.context import StageContext
from coldset.workflow.config import load_config

EXAMPLE = Path(__file__).resolve().parents[1] / "config" / "examples" / "synthetic-fp8.yaml"
TINY = dict(layers=2, experts=8, top_k=2, hidden=64, moe_intermediate=32, heads=2, kv_heads=1, head_dim=32,
            vocab_size=512, seed=3)
PLACEMENTS = ["lru-0.5", "positional-0.5", "positional-1.0", "usage_global-0.5"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8wf")
    overlay = {
        "results": str(root / "results"),
        "model": {"name": "tiny-fp8", "synthetic": TINY},  # merged over the example's weight_format: fp8
        "device": "cpu",
        "fixtures": {"per_domain": 2, "max_new_tokens": 6},
        "routing": {"batch_size": 4},
        "placement": {"policies": ["positional", "usage_global", "lru"], "residency": [0.5, 1.0]},
        "parity": {"max_new_tokens": 6},
        "autotune": {"cache_dir": str(root / "autotune-cache")},
    }
    (root / "tiny.yaml").write_text(yaml.safe_dump(overlay))
    config = load_config([EXAMPLE, root / "tiny.yaml"])
    assert config["model"]["synthetic"]["weight_format"] == "fp8"
    process_engine.release_engine()
    for stage in ["model", "fixtures", "routing", "stats", "placement", "autotune", "parity", "parity_gate"]:
        pipeline.run_stage(stage, config)
    engine, _ = process_engine.load_engine(StageContext.from_config(config))
    yield {"config": config, "results": root / "results", "engine": engine}
    process_engine.release_engine()


def test_the_checkpoint_is_fp8_and_the_engine_keeps_experts_fp8(run):
    hf = run["results"] / "model" / "tiny-fp8" / "hf"
    assert json.loads((hf / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    pools = run["engine"].pools
    assert pools.is_fp8 and pools.w13_hot.dtype == torch.float8_e4m3fn
    tuned = json.loads((run["results"] / "autotune" / "tiny-fp8.json").read_text())
    assert tuned["shape"]["weight_format"] == "fp8_block128"


def test_every_placement_is_bitwise_the_all_hot_fp8_path(run):
    res = run["results"]
    gate = json.loads((res / "parity" / "tiny-fp8" / "gate.json").read_text())
    names = [f"{p}-{r}" for p in ("positional", "usage_global", "lru") for r in ("0.5", "1.0")]
    assert gate["passed"] and sorted(gate["placements"]) == sorted(names)
    for name in PLACEMENTS:
        parity = json.loads((res / "parity" / "tiny-fp8" / f"{name}.json").read_text())
        assert parity["passed"] and parity["tokens_matched"] == parity["tokens_total"] > 0
        assert parity["max_abs_logit_diff"] == 0.0
        if name.endswith("0.5"):
            assert parity["num_cold"] > 0  # the cold tier (its FP8 weights and scales) was read
