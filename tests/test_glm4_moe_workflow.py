"""The workflow on a glm4_moe checkpoint, on the CPU: a tiny random Glm4MoeForCausalLM (transformers'
own, saved with save_pretrained, plus a small tokenizer) as ``model.path`` through model, fixtures,
routing, stats, placement, autotune, parity and parity_gate in this process. Every placement,
static and the slot cache's, decodes bitwise the all-hot path's logits."""

from __future__ import annotations

import json

import pytest

from coldset.engine.glm4_moe import Glm4MoeConfig
from coldset.workflow import process_engine
from coldset.workflow.config import decoding_support
from coldset.workflow.context import StageContext
from family_workflow import assert_every_placement_bitwise, run_stages
from hf_fixtures import build_tokenizer

from test_glm4_moe import build_checkpoint

transformers = pytest.importorskip("transformers")

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm4wf")
    tok = build_tokenizer()
    folder = build_checkpoint("bias_qknorm", root / "hf", vocab_size=tok.get_vocab_size(), max_positions=2048)
    tok.save(str(folder / "tokenizer.json"))
    config = run_stages(root, {"name": "tiny-glm4", "path": str(folder), "dtype": "float32"})
    yield {"config": config, "results": root / "results", "folder": folder}
    process_engine.release_engine()


def test_the_workflow_reads_the_family_and_decodes_it(run):
    assert decoding_support(run["config"]) is None
    assert isinstance(StageContext.from_config(run["config"]).model_config, Glm4MoeConfig)
    manifest = json.loads((run["results"] / "model" / "tiny-glm4" / "manifest.json").read_text())
    assert manifest["config"]["model_type"] == "glm4_moe"


def test_every_placement_is_bitwise_the_all_hot_path(run):
    assert_every_placement_bitwise(run["results"], "tiny-glm4")
