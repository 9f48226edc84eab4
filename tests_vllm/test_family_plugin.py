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
config without its router fields by the stage before vLLM starts. The compiled refusal's reason is
kept honest (COMPILED_CHECK): with the rule lifted, torch's inductor drops the router's dependency
on the gate GEMM and the tokens differ from coldset's engine; with that dependency restored they
are equal.
"""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

import pytest

from family_checkpoints import build_family_checkpoint
from family_workflow import run_stages

from conftest import GATE_STAGES, PROMPTS, REPO, coldset_env, embedded_tokens

PLACEMENT = "usage_global-0.5"


def _gated(root, family: str) -> dict:
    """The workflow up to the gate on a tiny ``family`` checkpoint, with PLACEMENT only."""
    folder = build_family_checkpoint(family, root / "ckpt")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"domain": d, "prompt": p}) + "\n" for d, p in PROMPTS))
    config = run_stages(root, {"name": f"tiny-{family}", "path": str(folder), "dtype": "float32"}, GATE_STAGES,
                        placement={"policies": ["usage_global"], "residency": [0.5]},
                        fixtures={"domains": ["agent", "code", "prose"], "per_domain": 2, "max_new_tokens": 6,
                                  "prompts": str(prompts)})
    return {"config": config, "results": root / "results", "name": f"tiny-{family}"}


#: The plugin on deepseek_v3 in vLLM's compiled mode with compiled_refusal lifted (argv: model
#: folder, prompts, "as_is" or "restore"): prints its greedy tokens and the reads torch's inductor
#: lost their mutation renaming in (SchedulerNode.recompute_size_and_body, the CPU backend's fusion);
#: "restore" puts the renaming back, which is what the lost dependency would have kept.
COMPILED_CHECK = """
import json, sys
import coldset.serve.vllm_families as families
from torch._inductor.scheduler import SchedulerNode
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

families.compiled_refusal = lambda *args: None
dropped, recompute = [], SchedulerNode.recompute_size_and_body
def recompute_checked(self, *args, **kwargs):
    renames, before = getattr(self, "mutation_renames", {}), {d.name for d in self.read_writes.reads}
    recompute(self, *args, **kwargs)
    dropped.extend(d.name for d in self.read_writes.reads if d.name in renames and d.name not in before)
    if sys.argv[3] == "restore":
        self.set_read_writes(self.read_writes.rename(renames))
SchedulerNode.recompute_size_and_body = recompute_checked
llm = LLM(model=sys.argv[1], dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=64,
          enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[2])],
                    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False), use_tqdm=False)
print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "dropped": dropped}))
"""


def _compiled_deepseek(folder, prompts, mode: str, env: dict, cache: Path) -> dict:
    """COMPILED_CHECK in a fresh process and compile cache (no graph reused between modes)."""
    proc = subprocess.run([sys.executable, "-c", COMPILED_CHECK, str(folder), json.dumps(prompts), mode],
                          capture_output=True, text=True, timeout=600, env=dict(env, VLLM_CACHE_ROOT=str(cache)),
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])


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
    # why compiled is refused: inductor drops the router's read of the gate's logits from its
    # dependencies, and the tokens differ; restored, they are coldset's engine's. When torch keeps
    # that dependency, the first assertion fails: drop compiled_refusal (coldset.serve.vllm_families)
    prompts = [[5, 17, 33, 80, 120, 7, 9], [44, 3, 200, 11]]
    want = embedded_tokens(Path(folder), placement.parent, PLACEMENT, prompts, 6)
    as_is = _compiled_deepseek(folder, prompts, "as_is", env, tmp_path / "cache-as-is")
    assert as_is["dropped"] and as_is["tokens"] != want, f"compiled deepseek_v3 through the plugin now decodes {want}"
    assert _compiled_deepseek(folder, prompts, "restore", env, tmp_path / "cache-restore")["tokens"] == want
    # a config without the published router fields: the stage refuses it before any vLLM run
    config_json = run["results"] / "model" / run["name"] / "hf" / "config.json"
    config_json = config_json if config_json.is_file() else Path(folder) / "config.json"
    raw = json.loads(config_json.read_text())
    config_json.write_text(json.dumps({k: v for k, v in raw.items() if k != "topk_method"}))
    with pytest.raises(VllmParityError, match="field 'topk_method' is None"):
        run_stage(vllm_parity, run["config"])
    process_engine.release_engine()
