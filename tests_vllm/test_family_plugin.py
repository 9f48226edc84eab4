"""coldset's vLLM plugin on glm4_moe and gpt_oss (tiny checkpoints of tests_vllm/family_checkpoints.py).

The workflow runs up to its parity gate on each checkpoint (float32, CPU; tests/family_workflow.py's
stages in this process), then the ``vllm_parity`` stage (coldset.workflow.vllm_parity: offline
``LLM.generate`` in a process per run, vLLM's default compiled execution) serves usage_global-0.5
through the plugin: its greedy tokens must equal stock vLLM's and coldset's embedded engine's, with
coldset's classes in place (gpt_oss: its own routed-experts class replaced), the layers' expert
tensors freed and the hot pool holding the placement's hot half. A deepseek_v3 placement is
refused by the plugin and by the stage before vLLM starts.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from family_checkpoints import build_family_checkpoint
from family_workflow import run_stages

from conftest import REPO, coldset_env

PLACEMENT = "usage_global-0.5"
GATE = ["model", "fixtures", "routing", "stats", "placement", "autotune", "parity", "parity_gate"]
#: Short prompts (the default fixtures' are hundreds of this tokenizer's tokens), two per domain.
PROMPTS = [
    ("agent", '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
    ("agent", '{"name": "add", "arguments": {"a": 1, "b": 2}}'),
    ("code", "def add(a, b):\n    return a + b"),
    ("code", "for i in range(10):\n    print(i * i)"),
    ("prose", "The quick brown fox jumps over the lazy dog."),
    ("prose", "Mixture of experts models route every token."),
]


def _gated(root, family: str) -> dict:
    """The workflow up to the gate on a tiny ``family`` checkpoint, with PLACEMENT only."""
    folder = build_family_checkpoint(family, root / "ckpt")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"domain": d, "prompt": p}) + "\n" for d, p in PROMPTS))
    config = run_stages(root, folder, f"tiny-{family}", "float32", GATE,
                        placement={"policies": ["usage_global"], "residency": [0.5]},
                        fixtures={"domains": ["agent", "code", "prose"], "per_domain": 2, "max_new_tokens": 6,
                                  "prompts": str(prompts)})
    return {"config": config, "results": root / "results", "name": f"tiny-{family}"}


@pytest.mark.parametrize("family", ["glm4_moe", "gpt_oss"])
def test_plugin_serves_the_family_token_exact(family, tmp_path):
    pytest.importorskip("vllm")
    from coldset.core.placement import load_placement
    from coldset.workflow import process_engine
    from coldset.workflow.pipeline import run_stage
    from coldset.workflow.vllm_parity import vllm_parity

    run = _gated(tmp_path, family)
    process_engine.release_engine()
    run_stage(vllm_parity, run["config"])
    report = json.loads((run["results"] / "parity" / run["name"] / "vllm.json").read_text())
    stock, got = report["stock"], report["placements"][PLACEMENT]
    routed = "GptOssRoutedExperts" if family == "gpt_oss" else "RoutedExperts"
    assert stock["classes"] == [f"{routed}/UnquantizedFusedMoEMethod"]  # not asked for: vLLM's own
    assert stock["passed"] and stock["tokens_matched"] == stock["tokens_total"] > 0  # stock vLLM = embedded
    assert got["classes"] == [f"Coldset{routed}/ColdsetMoEMethod"]
    assert got["passed"] and got["equal_to_stock_vllm"] and report["passed"]
    assert got["tokens_matched"] == got["tokens_total"] == report["fixtures"] * report["max_new_tokens"] > 0
    mem = got["memory"]
    pl = load_placement(run["results"] / "placement" / run["name"] / f"{PLACEMENT}.json")
    assert pl.num_cold > 0 and mem["layer_expert_bytes_after"] == 0
    assert mem["layer_expert_bytes_before"] == (pl.num_hot + pl.num_cold) * pl.bytes_per_expert
    assert mem["hot_pool_bytes"] == pl.num_hot * pl.bytes_per_expert
    process_engine.release_engine()


def test_deepseek_v3_placement_refused_before_vllm_starts(tmp_path):
    """The gated workflow on a tiny deepseek_v3 checkpoint: the plugin's start (register, as vLLM
    calls it) and the vllm_parity stage refuse it by name, vLLM's engine never built."""
    pytest.importorskip("vllm")
    from coldset.workflow import process_engine
    from coldset.workflow.pipeline import run_stage
    from coldset.workflow.vllm_parity import VllmParityError, vllm_parity

    run = _gated(tmp_path, "deepseek_v3")
    process_engine.release_engine()
    placement = run["results"] / "placement" / run["name"] / f"{PLACEMENT}.json"
    env = dict(coldset_env(), COLDSET_PLACEMENT=str(placement))
    proc = subprocess.run([sys.executable, "-c", "from coldset.serve import vllm_plugin; vllm_plugin.register()"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode != 0 and "PluginError" in proc.stderr
    assert "model_type 'deepseek_v3'" in proc.stderr and "CPU_MLA" in proc.stderr
    with pytest.raises(VllmParityError, match="model_type 'deepseek_v3'.*CPU_MLA"):
        run_stage(vllm_parity, run["config"])
    assert not (run["results"] / "parity" / run["name"] / "vllm.json").exists()
    process_engine.release_engine()
