"""``routing.backend: vllm`` in the workflow: the model, fixtures and routing stages run through
``python -m coldset`` (the same functions the Snakemake rules call) on a tiny qwen3_moe checkpoint,
and the trace they leave is vLLM's (its ``source`` says so) and routes exactly as the embedded
engine does on the same fixture files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from hf_fixtures import build_tiny_checkpoint

from conftest import PROMPTS, coldset_env


def _rows(path: Path) -> dict[str, np.ndarray]:
    t = pq.read_table(path)
    cols = {c: np.asarray(t.column(c).to_pylist()) for c in ("request", "position", "layer", "rank", "expert")}
    order = np.lexsort([cols["rank"], cols["layer"], cols["position"],
                        np.unique(cols["request"], return_inverse=True)[1]])
    return {c: v[order] for c, v in cols.items()}


def test_routing_stage_with_vllm_backend(tmp_path):
    pytest.importorskip("vllm")
    from coldset.workflow.config import ConfigError, validate_config
    from coldset.trace.capture import capture_routing
    from coldset.core.trace import read_trace_meta

    ck = build_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"domain": d, "prompt": p}) + "\n" for d, p in PROMPTS))
    config = {
        "results": str(tmp_path / "results"),
        "model": {"name": "tiny", "path": str(ck), "dtype": "float32"},
        "device": "cpu",
        "fixtures": {"domains": ["agent", "code", "prose"], "per_domain": 2, "max_new_tokens": 6,
                     "prompts": str(prompts)},
        "routing": {"backend": "vllm"},
    }
    try:
        validate_config(json.loads(json.dumps(config)))
    except ConfigError as err:
        pytest.fail(f"config/schema.yaml does not accept routing.backend: vllm ({err}); the schema and the "
                    "routing stage must take it")
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    env = coldset_env()
    for stage in ("model", "fixtures", "routing"):
        proc = subprocess.run([sys.executable, "-m", "coldset", stage, "--config", str(cfg_path)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, f"stage {stage} failed:\n{proc.stderr[-6000:]}"
    trace = tmp_path / "results" / "routing" / "tiny" / "trace.parquet"
    meta = read_trace_meta(trace)
    assert meta.source.startswith("vllm ") and meta.extra["capture_method"] == "router_hooks"
    assert meta.model == "tiny"

    fixtures = sorted((tmp_path / "results" / "fixtures").glob("*.jsonl"))
    assert len(fixtures) == 3
    ref = capture_routing(ck, fixtures, tmp_path / "embedded.parquet", dtype="float32", progress=False)
    got, want = _rows(trace), _rows(ref)
    assert len(got["expert"]) == len(want["expert"]) > 0
    for col in got:
        assert np.array_equal(got[col], want[col]), col
