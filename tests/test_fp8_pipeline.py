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

from coldset.workflow import process_engine
from coldset.workflow.context import StageContext
from family_workflow import assert_every_placement_bitwise, run_stages

EXAMPLE = Path(__file__).resolve().parents[1] / "config" / "examples" / "synthetic-fp8.yaml"
TINY = dict(layers=2, experts=8, top_k=2, hidden=64, moe_intermediate=32, heads=2, kv_heads=1, head_dim=32,
            vocab_size=512, seed=3)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8wf")
    # TINY merged over the example's weight_format: fp8
    config = run_stages(root, {"name": "tiny-fp8", "synthetic": TINY}, base=EXAMPLE)
    assert config["model"]["synthetic"]["weight_format"] == "fp8"
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
    """The gate and every placement's parity bitwise; at residency 0.5 the cold tier (its FP8 weights
    and scales) was read."""
    assert_every_placement_bitwise(run["results"], "tiny-fp8")
