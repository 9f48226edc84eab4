"""Sweeps over models: models: expands into validated per-model configs; a sweep of two
trace-only models runs every non-decoding stage per model and one report compares them."""

import json
import re

import numpy as np
import pyarrow as pa
import pytest

from coldset.workflow.config import ConfigError, model_configs, validate_config
from coldset.workflow.sweep import comparison_rows, run_sweep
from coldset.core.trace import TraceMeta, write_trace

V3 = {"model_type": "deepseek_v3", "vocab_size": 500, "hidden_size": 128, "intermediate_size": 256,
      "moe_intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2, "n_routed_experts": 8,
      "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 32,
      "q_lora_rank": None, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16}
L4 = {"model_type": "llama4", "text_config": {
      "vocab_size": 500, "hidden_size": 128, "intermediate_size": 64, "intermediate_size_mlp": 256,
      "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
      "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2}}


def trace(path, name, num_layers, moe_layers, experts, k, seed):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(experts, 0.2), size=len(moe_layers))
    cols = {c: [] for c in ("request", "domain", "position", "phase", "layer", "rank", "expert")}
    for r in range(16):
        for pos in range(8):
            for li, layer in enumerate(moe_layers):
                for rank, e in enumerate(rng.choice(experts, size=k, replace=False, p=p[li])):
                    for c, v in zip(cols, (f"q{r}", "qa", pos, "prefill" if pos < 4 else "decode", layer, rank, int(e))):
                        cols[c].append(v)
    t = pa.table({"request": cols["request"], "domain": cols["domain"],
                  "position": pa.array(cols["position"], pa.int32()), "phase": cols["phase"],
                  "layer": pa.array(cols["layer"], pa.int16()), "rank": pa.array(cols["rank"], pa.int8()),
                  "expert": pa.array(cols["expert"], pa.int16())})
    write_trace(path, TraceMeta(name, num_layers, experts, k, moe_layers, "test"), t)


def test_models_expand_and_validate():
    cfg = validate_config({"model": {"dtype": "bfloat16"},
                           "models": {"a": {"path": "x", "trace": "a.parquet"}, "b": {"synthetic": {"layers": 2}}}})
    got = model_configs(cfg)
    assert list(got) == ["a", "b"]
    assert got["a"]["model"]["name"] == "a" and got["a"]["model"]["dtype"] == "bfloat16"
    assert got["a"]["routing"]["trace"] == "a.parquet" and got["b"]["routing"]["trace"] is None
    assert got["a"]["models"] == {}  # each per-model config is a single-model config
    single = validate_config({"model": {"name": "one"}})
    assert list(model_configs(single)) == ["one"]
    with pytest.raises(ConfigError, match=r"models\.c"):
        model_configs(validate_config({"models": {"c": {"dtype": "int3"}}}))


def test_sweep_of_two_trace_only_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, raw in (("v3", V3), ("l4", L4)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
    trace(tmp_path / "v3.parquet", "v3", 3, [1, 2], 8, 2, 0)
    trace(tmp_path / "l4.parquet", "l4", 4, [1, 3], 16, 1, 1)
    cfg = validate_config({
        "models": {"v3": {"path": "v3", "trace": "v3.parquet"}, "l4": {"path": "l4", "trace": "l4.parquet"}},
        "placement": {"policies": ["positional", "usage_global"], "residency": [0.5, 1.0]},
        "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db"}})
    out = run_sweep(cfg)
    html = out.read_text()
    assert out.resolve() == tmp_path / "results" / "report" / "models.html"
    assert "2 models compared" in html and html.count("data:image/png;base64,") == 2
    rows = comparison_rows(model_configs(cfg))
    assert {(r["model"], r["policy"], r["residency"]) for r in rows} == {
        (m, p, r) for m in ("v3", "l4") for p in ("positional", "usage_global") for r in ("0.5", "1.0")}
    for r in rows:  # hit rates are the placement files' own, speeds the speed model's
        pl = json.loads((tmp_path / "results" / "placement" / r["model"] / f"{r['policy']}-{r['residency']}.json")
                        .read_text())
        assert r["coverage_heldout"] == pl["coverage_heldout"] and r["speed_source"].startswith("predicted")
        h200_b1 = next(q for q in pl["predictions"] if (q["preset"], q["batch_size"]) == ("h200", 1))
        assert r["tok_s"] == pytest.approx(1 / h200_b1["step_s_lower"]) and r["batch_size"] == 1
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["coldset"])
    assert sorted(set(runs["tags.model"])) == ["l4", "v3"]


def test_snakemake_expands_models_as_a_wildcard(tmp_path):
    """The rules run each model of models: (its own trace and shape) and one comparison report."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    for name, raw in (("v3", V3), ("l4", L4)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
    trace(tmp_path / "v3.parquet", "v3", 3, [1, 2], 8, 2, 0)
    trace(tmp_path / "l4.parquet", "l4", 4, [1, 3], 16, 1, 1)
    (tmp_path / "sweep.yaml").write_text(
        "models:\n  v3: {path: v3, trace: v3.parquet}\n  l4: {path: l4, trace: l4.parquet}\n"
        "placement: {policies: [usage_global], residency: [0.5, 1.0]}\n")
    exe = Path(sys.executable).with_name("snakemake")
    done = subprocess.run([str(exe), "-s", str(repo / "Snakefile"), "--configfile", "sweep.yaml", "--cores", "2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(repo / "src")})
    assert done.returncode == 0, done.stderr[-3000:]
    html = (tmp_path / "results" / "report" / "models.html").read_text()
    assert "2 models compared" in html
    for name, experts in (("v3", 8), ("l4", 16)):
        runs = json.loads((tmp_path / "results" / "track" / f"{name}.done").read_text())["runs"]
        # run keys: model@{invocation}/policy/residency/batch (coldset.reporting.track's parent runs)
        assert {k.split("@", 1)[0] for k in runs} == {name}
        assert sorted(k.split("/", 1)[1] for k in runs) == ["usage_global/0.5/1", "usage_global/1.0/1"]
        manifest = json.loads((tmp_path / "results" / "model" / name / "manifest.json").read_text())
        assert manifest["shape"]["num_experts"] == experts  # each model's own shape
    assert not (tmp_path / "results" / "bench").exists()


def _results_tree():
    """tests/test_report.py's results tree builder (placement, parity and bench files)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_coldset_results_tree", Path(__file__).with_name("test_report.py"))
    tree = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tree)
    return tree


def test_comparison_never_publishes_cpu_speed_ratios(tmp_path):
    """Issue 30 item 5: a CPU bench's tok/s (placements differ by timing noise alone) is neither
    labelled "measured" nor turned into tok_s_per_gib: the row falls back to the speed model,
    labelled as the upper estimate it is. A GPU bench's rows are measured, with the bench's own
    tok_s_per_gib, none where a timing is noisy."""
    from coldset.core.layout import Layout
    from coldset.workflow.sweep import render_comparison

    tree = _results_tree()

    def cfg(res):
        return {"results": str(res), "model": {"name": tree.MODEL},
                "placement": {"policies": tree.POLICIES, "residency": tree.RESIDENCIES, "bandwidths": "h200"}}

    cpu = tree.build_results_tree(tmp_path / "cpu", bytes_run="cpu")
    rows = comparison_rows({tree.MODEL: cfg(cpu)})
    assert len(rows) == len(tree.POLICIES) * len(tree.RESIDENCIES)
    for r in rows:
        assert r["speed_source"].startswith("predicted (h200 speed model, perfect overlap: upper estimate of tok/s)")
        assert "CPU bench" in r["speed_source"]
        # the tree's prediction at batch 1: a 1 ms perfect-overlap step for every placement
        assert (r["tok_s"], r["batch_size"]) == (pytest.approx(1000.0), 1)
        assert r["tok_s_per_gib"] in (None, 0.0)  # equal predictions: no gain per GiB
    html = render_comparison({tree.MODEL: cfg(cpu)}, tmp_path / "models.html").read_text()
    cells = re.findall(r"<td>((?:measured|predicted|none)[^<]*)</td>", html)
    assert len(cells) == len(rows) and not any(c.startswith("measured") for c in cells)
    assert "lower bound" not in html

    gpu = tree.build_results_tree(tmp_path / "gpu", bytes_run="gpu")
    path = Layout(gpu, tree.MODEL).bench("positional", 1.0)
    doc = json.loads(path.read_text())
    doc["batches"][0]["repeat_spread"] = 1.6  # batch 1 of positional 1.0: repeats disagree
    path.write_text(json.dumps(doc))
    rows = {(r["policy"], r["residency"]): r for r in comparison_rows({tree.MODEL: cfg(gpu)})}
    gib = (tree.RESIDENCIES[1] - tree.RESIDENCIES[0]) * tree.LAYERS * tree.EXPERTS * tree.GIB_PER_EXPERT
    ug = rows[("usage_global", "1.0")]
    assert ug["speed_source"] == "measured on NVIDIA H200" and ug["tok_s"] == pytest.approx(tree._tok_s("usage_global", 1.0, 1))
    assert ug["tok_s_per_gib"] == pytest.approx((tree._tok_s("usage_global", 1.0, 1) - tree._tok_s("usage_global", 0.5, 1)) / gib)
    assert rows[("usage_global", "0.5")]["tok_s_per_gib"] is None  # the policy's smallest residency
    noisy = rows[("positional", "1.0")]
    assert noisy["tok_s_per_gib"] is None and "noisy: repeats disagree by 1.60x" in noisy["speed_source"]
