"""coldset's vLLM plugin on glm4_moe, gpt_oss and deepseek_v3 (tiny checkpoints of
tests_vllm/family_checkpoints.py).

The workflow runs up to its parity gate on each checkpoint (float32, CPU; tests/family_workflow.py's
stages in this process), then the ``vllm_parity`` stage (coldset.workflow.vllm_parity: offline
``LLM.generate`` in a process per run, vLLM's default compiled execution) serves usage_global-0.5
through the plugin: its greedy tokens must equal stock vLLM's and coldset's embedded engine's, with
coldset's classes in place (gpt_oss: its own routed-experts class replaced), the layers' expert
tensors freed and the hot pool holding the placement's hot half (deepseek_v3 runs eager with vLLM's
rotary op off: coldset.serve.vllm_families.CPU_DEEPSEEK_ENGINE). deepseek_v3 with vLLM's
rotary_embedding op on, or compiled, is refused where vLLM builds the model, and a deepseek_v3
config without its router fields by the stage before vLLM starts.
"""

from __future__ import annotations

import json
from pathlib import Path
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


@pytest.mark.parametrize("family", ["glm4_moe", "gpt_oss", "deepseek_v3"])
def test_plugin_serves_the_family_token_exact(family, tmp_path):
    pytest.importorskip("vllm")
    from coldset.core.placement import load_placement
    from coldset.workflow import process_engine
    from coldset.workflow.pipeline import run_stage
    from coldset.workflow.vllm_parity import VllmParityError, vllm_parity

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
    if family != "deepseek_v3":
        return
    # refused where vLLM builds the model: eager with vLLM's rotary_embedding op on, and compiled
    placement = run["results"] / "placement" / run["name"] / f"{PLACEMENT}.json"
    env = dict(coldset_env(), COLDSET_PLACEMENT=str(placement), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    folder = run["config"]["model"]["path"]
    for eager, message in ((True, "deepseek_v3 with vLLM's rotary_embedding custom op on"),
                           (False, "deepseek_v3 in vLLM's compiled mode on the CPU build")):
        code = (f"from vllm import LLM\nLLM(model={folder!r}, dtype='float32', skip_tokenizer_init=True, "
                f"max_model_len=64, enforce_eager={eager}, kv_cache_memory_bytes=64 << 20)")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                              cwd=REPO)
        assert proc.returncode != 0 and "PluginError" in proc.stderr and message in proc.stderr, proc.stderr[-3000:]
    # a config without the published router fields: the stage refuses it before any vLLM run
    config_json = run["results"] / "model" / run["name"] / "hf" / "config.json"
    config_json = config_json if config_json.is_file() else Path(folder) / "config.json"
    raw = json.loads(config_json.read_text())
    config_json.write_text(json.dumps({k: v for k, v in raw.items() if k != "topk_method"}))
    with pytest.raises(VllmParityError, match="field 'topk_method' is None"):
        run_stage(vllm_parity, run["config"])
    process_engine.release_engine()
