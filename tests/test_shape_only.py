"""A model given by config.json alone (no weights, a family the engine does not run): the workflow
runs stats, placement, track and report from a trace and skips the decoding stages, saying why."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from coldset.workflow.config import decoding_support, skipped_stages, validate_config
from coldset.workflow.context import StageContext, StageError
from coldset.core.trace import TraceMeta, write_trace

REPO = Path(__file__).resolve().parents[1]

# A small DeepSeek-V3-shaped model: 4 layers, the first dense, 16 routed + 1 shared expert, top-2,
# fp8 block-scaled weights; written as its config.json fields are named.
TINY_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 1, "n_routed_experts": 16, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "kv_lora_rank": 64, "q_lora_rank": 96, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "qk_nope_head_dim": 32, "topk_method": "noaux_tc", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}
MOE_LAYERS = [1, 2, 3]


def random_trace(path: Path, seed: int = 0) -> None:
    """Skewed random routing for 12 requests in two domains, prefill and decode rows."""
    rng = np.random.default_rng(seed)
    cols = {k: [] for k in ("request", "domain", "position", "phase", "layer", "rank", "expert")}
    popularity = rng.dirichlet(np.full(16, 0.3), size=len(MOE_LAYERS))
    for r in range(12):
        domain = "code" if r % 2 else "prose"
        for pos in range(10):
            for li, layer in enumerate(MOE_LAYERS):
                experts = rng.choice(16, size=2, replace=False, p=popularity[li])
                for rank, e in enumerate(experts):
                    cols["request"].append(f"{domain}-{r}")
                    cols["domain"].append(domain)
                    cols["position"].append(pos)
                    cols["phase"].append("prefill" if pos < 6 else "decode")
                    cols["layer"].append(layer)
                    cols["rank"].append(rank)
                    cols["expert"].append(int(e))
    table = pa.table({
        "request": pa.array(cols["request"]), "domain": pa.array(cols["domain"]),
        "position": pa.array(cols["position"], pa.int32()), "phase": pa.array(cols["phase"]),
        "layer": pa.array(cols["layer"], pa.int16()), "rank": pa.array(cols["rank"], pa.int8()),
        "expert": pa.array(cols["expert"], pa.int16()),
    })
    write_trace(path, TraceMeta("tiny-v3", 4, 16, 2, MOE_LAYERS, "test: random"), table)


def test_shape_only_folder_is_refused_by_decoding_stages(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_V3))
    config = {"model": {"name": "tiny-v3", "path": str(tmp_path), "synthetic": None}}
    assert "holds no weights (*.safetensors), only the model's shape" in decoding_support(config)
    assert set(skipped_stages(config)) == {"autotune", "parity", "parity_gate", "bench"}
    with pytest.raises(StageError, match=r"stage bench cannot run .* What works with config.json alone: set "
                                         r"routing.trace"):
        StageContext.from_config(validate_config({"model": {"name": "tiny-v3", "path": str(tmp_path)}})).require_decoding("bench")
    # another engine family without weights is shape-only too; the synthetic default decodes
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    assert "holds no weights" in decoding_support(config)
    assert decoding_support({"model": {"name": "x", "path": None, "synthetic": {}}}) is None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    wd = tmp_path_factory.mktemp("shape-only")
    (wd / "model").mkdir()
    (wd / "model" / "config.json").write_text(json.dumps(TINY_V3))
    random_trace(wd / "trace.parquet")
    (wd / "cfg.yaml").write_text(
        "model: {name: tiny-v3, path: model}\nrouting: {trace: trace.parquet}\n"
        "placement: {policies: [positional, usage_global], residency: [0.5, 1.0]}\nbench: {batch_sizes: [1, 4]}\n")
    exe = Path(sys.executable).with_name("snakemake")

    def smk(*args):
        return subprocess.run([str(exe), "-s", str(REPO / "Snakefile"), "--configfile", "cfg.yaml", "--cores", "2",
                               *args], cwd=wd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(REPO / "src")})

    return wd, smk


def test_report_end_to_end_skips_decoding_stages(run):
    wd, smk = run
    done = smk("report")
    assert done.returncode == 0, done.stderr[-3000:]
    html = (wd / "results" / "report" / "index.html").read_text()
    assert 'id="skipped"' in html and "<b>bench</b>" in html and "<b>parity</b>" in html
    assert "holds no weights" in html
    assert 'id="model-shape"' in html and "bytes_per_expert <b>98328</b>" in html  # 3*256*128 + 6 fp32 scales
    assert 'id="bench-table"' not in html and 'data-section="parity"' not in html
    for stage in ("parity", "bench", "autotune"):
        assert not (wd / "results" / stage).exists()
    # placements use the shape's bytes: fp8 experts with one fp32 scale per 128x128 block
    pl = json.loads((wd / "results" / "placement" / "tiny-v3" / "usage_global-0.5.json").read_text())
    assert pl["weight_format"] == "fp8_block128"
    assert pl["bytes_per_expert"] == 3 * 256 * 128 + 4 * (2 * 1 * 2 + 2 * 1)
    assert pl["num_hot"] + pl["num_cold"] == 3 * 16
    manifest = json.loads((wd / "results" / "model" / "tiny-v3" / "manifest.json").read_text())
    assert manifest["source"] == "shape-only" and manifest["decodes"] is False
    runs = json.loads((wd / "results" / "track" / "tiny-v3.done").read_text())["runs"]
    # run keys: model@{invocation (config hash, results folder)}/policy/residency/batch (coldset.reporting.track)
    assert len({k.split("/", 1)[0] for k in runs}) == 1 and next(iter(runs)).startswith("tiny-v3@")
    assert sorted(k.split("/", 1)[1] for k in runs) == sorted(
        f"{p}/{r}/{b}" for p in ("positional", "usage_global") for r in ("0.5", "1.0") for b in (1, 4))


def test_asking_for_a_decoding_stage_fails_saying_what_works(run):
    wd, smk = run
    failed = smk("parity_gate")
    assert failed.returncode != 0
    log = (wd / "logs" / "autotune" / "tiny-v3.log").read_text()
    assert "stage autotune cannot run for model 'tiny-v3'" in log and "set routing.trace" in log
