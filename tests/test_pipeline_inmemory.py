"""The GPU stages on an in-memory synthetic model (``model.synthetic.in_memory``), through the CLI,
on the CPU at tiny shapes: nothing written but the manifest, the model built once per process, the
routing equal to Hugging Face transformers' router on the same weights, the gate passing; and the
host tier every placement shares: the same experts computation as the all-hot layout, with no
host memory allocated per placement."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from coldset import cli
from coldset.workflow import pipeline, process_engine
from coldset.workflow.context import StageContext, StageError
from coldset.kernels import torch_experts
from coldset.analysis.placement import place, row_map_from_mask
from coldset.engine.synthetic import SyntheticSpec
from coldset.kernels.tiers import ExpertPools, HostTier, PoolAllocationError, host_tier

SYNTHETIC = dict(in_memory=True, layers=3, experts=8, top_k=2, hidden=64, moe_intermediate=32, heads=2,
                 kv_heads=1, head_dim=32, vocab_size=512, seed=3)
PLACEMENTS = ["lookahead-0.5", "lookahead-1.0", "lru-0.5", "lru-1.0", "nexttoken-0.5", "nexttoken-1.0", "positional-0.5",
              "positional-1.0", "usage_global-0.5", "usage_global-1.0"]


def _config(root: Path) -> dict:
    return {
        "results": str(root / "results"),
        "model": {"name": "tiny-mem", "synthetic": dict(SYNTHETIC)},
        "device": "cpu",
        "fixtures": {"per_domain": 2, "max_new_tokens": 6},
        # lru: the slot cache (8 slots at 0.5 hold one parity step's 4 tokens x top-2)
        "routing": {"batch_size": 4},
        # lookahead: lru + the prefetch of layer l + d's router forecast, d per batch size (the form
        # whose YAML keys are integers, through every stage): 1 at batch 1, 2 from batch 4
        # nexttoken (issue 28): its forecaster fitted on the trace's profile split by the placement stage
        "placement": {"policies": ["positional", "usage_global", "lru", "lookahead", "nexttoken"],
                      "residency": [0.5, 1.0]},
        "cache": {"lookahead_depth": {1: 1, 4: 2}},
        "parity": {"max_new_tokens": 6},
        "bench": {"new_tokens": 4, "prompt_tokens": 8, "repeats": 1, "warmup": 0},
        "autotune": {"cache_dir": str(root / "autotune-cache")},
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``python -m coldset gpu-stages`` once, counting model builds, host tiers and stage contexts."""
    root = tmp_path_factory.mktemp("inmem")
    cfg_path = root / "tiny.yaml"
    cfg_path.write_text(yaml.safe_dump(_config(root)))
    built, tiers, contexts = [], [], []
    real_build, real_tier = process_engine.build_synthetic_model, process_engine.make_host_tier
    real_context = StageContext.from_config.__func__

    def counting_context(cls, config):
        contexts.append(real_context(cls, config))
        return contexts[-1]

    def counting_build(*args, **kwargs):
        built.append(real_build(*args, **kwargs))
        return built[-1]

    def counting_tier(*args, **kwargs):
        tiers.append(real_tier(*args, **kwargs))
        return tiers[-1]

    process_engine.release_engine()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(process_engine, "build_synthetic_model", counting_build)
        mp.setattr(process_engine, "make_host_tier", counting_tier)
        mp.setattr(StageContext, "from_config", classmethod(counting_context))
        rc = cli.main(["gpu-stages", "--config", str(cfg_path)])
    yield {"rc": rc, "root": root, "results": root / "results", "built": built, "tiers": tiers,
           "contexts": contexts}
    process_engine.release_engine()


def test_gpu_stages_write_no_weights_and_build_the_model_once(run):
    assert run["rc"] == 0
    assert len(run["built"]) == 1, "routing, parity and bench must share one engine"
    assert len(run["tiers"]) == 1, "parity and bench must share one host tier"
    assert len(run["contexts"]) == 1, "the nine stages must share one context, built once from the config"
    files = [p for p in run["root"].rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix in (".safetensors", ".bin", ".pt", ".pth")]
    assert not (run["results"] / "model" / "tiny-mem" / "hf").exists()
    assert sorted(p.name for p in (run["results"] / "model" / "tiny-mem").iterdir()) == ["manifest.json"]
    manifest = json.loads((run["results"] / "model" / "tiny-mem" / "manifest.json").read_text())
    model, _ = run["built"][0]
    assert manifest["source"] == "synthetic-in-memory" and manifest["path"] is None
    assert manifest["spec"] == dataclasses.asdict(SyntheticSpec(**SYNTHETIC))
    assert manifest["config"] == json.loads(json.dumps(dataclasses.asdict(model.config)))


def test_gate_passes_and_every_placement_is_benchmarked(run):
    res = run["results"]
    gate = json.loads((res / "parity" / "tiny-mem" / "gate.json").read_text())
    assert gate["passed"] and sorted(gate["placements"]) == PLACEMENTS
    for name in PLACEMENTS:
        parity = json.loads((res / "parity" / "tiny-mem" / f"{name}.json").read_text())
        placement = json.loads((res / "placement" / "tiny-mem" / f"{name}.json").read_text())
        assert parity["passed"] and parity["tokens_matched"] == parity["tokens_total"] > 0
        # the placement's own hot/cold split, not the shared host tier's row count
        assert (parity["num_hot"], parity["num_cold"]) == (placement["num_hot"], placement["num_cold"])
        # lookahead's depth per batch size, as configured (JSON's string keys); the gate decoded each
        assert placement["cache_lookahead_depth"] == ({"1": 1, "4": 2} if name.startswith("lookahead") else None)
        assert parity.get("lookahead_depths") == ([1, 2] if name.startswith("lookahead") else None)
        # and its forecast fitted on the profile router inputs (cache.lookahead_fit's default), which the
        # parity and bench stages fitted from the profile fixtures before decoding with it
        assert placement["cache_lookahead_fit"] == (True if name.startswith("lookahead") else None)
        bench = json.loads((res / "bench" / "tiny-mem" / f"{name}.json").read_text())
        assert bench["placement"] == name and [b["batch_size"] for b in bench["batches"]] == [1]
        assert bench["batches"][0]["tok_s"] > 0
        # residency 1.0 reads nothing from the host tier; positional 0.5 offloads whole MoE layers,
        # which every token passes through (usage_global and lru may serve these few held-out
        # tokens from HBM alone)
        b = bench["batches"][0]
        if name.endswith("1.0"):
            assert b["cold_share"] == 0
        if name == "positional-0.5":
            assert b["cold_share"] > 0
        assert b["hit_rate"] == pytest.approx(1 - b["cold_share"])
        assert b["misses_per_token"] == pytest.approx(b["cold_share"] * SYNTHETIC["top_k"] * SYNTHETIC["layers"])
        # issue 28's time bound: every row carries the names; on the CPU the timed ones are None
        assert all(b[m] is None for m in ("allhbm_step_ms", "bound_ms", "bound_fraction", "overlap",
                                          "stall_ms_per_token"))
        assert b["allhbm_placement"] == "usage_global-1.0"
        dynamic = name.split("-")[0] in ("lru", "lookahead", "nexttoken")
        assert (b["wasted_gb_per_token"] is not None) == dynamic  # the replay's count, a cache's only
        if name.startswith(("lookahead", "nexttoken")):  # prefetch copies cross the link too, hits or not
            assert (b["link_gb_per_token"] > 0) >= (b["cold_share"] > 0)
        else:
            assert (b["link_gb_per_token"] > 0) == (b["cold_share"] > 0)
    assert (res / "autotune" / "tiny-mem.json").is_file()
    # the nexttoken placements carry the forecaster the engine ran (fitted once, by the placement stage)
    from coldset.bench.decode import placement_forecaster
    from coldset.core.placement import load_placement

    for r in ("0.5", "1.0"):
        f = placement_forecaster(load_placement(res / "placement" / "tiny-mem" / f"nexttoken-{r}.json"))
        assert f.top_k == SYNTHETIC["top_k"] and f.tables.shape[1:] == (SYNTHETIC["layers"], 8, 8)
        assert f.tables.any()


def test_trace_equals_transformers_router_on_the_same_weights(run, tmp_path):
    """The trace's experts at every position of two fixtures = top-k of Hugging Face transformers'
    router logits over HF's own greedy continuation, on the weights the pipeline's engine had."""
    transformers = pytest.importorskip("transformers")
    from coldset.workflow.config import validate_config
    from coldset.trace.fixtures import read_fixtures
    from coldset.engine.generate import encode_prompts
    from coldset.core.trace import read_trace_meta
    from coldset.engine.synthetic import write_synthetic_checkpoint

    res = run["results"]
    trace = res / "routing" / "tiny-mem" / "trace.parquet"
    meta = read_trace_meta(trace)
    assert "in-memory synthetic" in meta.source
    df = pd.read_parquet(trace)
    df["request"] = df["request"].astype(str)
    model, tok = run["built"][0]
    # The same spec written to a folder for transformers (the file writer serializes the CPU
    # float32 build); checked below to hold exactly the engine's weights.
    config = validate_config(_config(run["root"]))
    folder = write_synthetic_checkpoint(SyntheticSpec(**{**SYNTHETIC, "in_memory": False}), tmp_path / "hf",
                                        domain_texts=process_engine.domain_texts(StageContext.from_config(config)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_w = dict(hf.named_parameters())
    assert torch.equal(hf_w["model.embed_tokens.weight"], model.embed_tokens.weight)
    assert torch.equal(hf_w["lm_head.weight"], model.lm_head.weight)
    for layer in model.config.moe_layers:
        assert torch.equal(hf.model.layers[layer].mlp.gate.weight, model.layers[layer].mlp.gate.weight)
    fixtures = read_fixtures(sorted((res / "fixtures").glob("*.jsonl")))
    checked = [next(f for f in fixtures if f.domain == d) for d in ("agent", "code")]
    k = SYNTHETIC["top_k"]
    for fx in checked:
        prompt = encode_prompts(tok, [fx.prompt])[0]
        with torch.no_grad():
            ids = torch.tensor([prompt])
            for _ in range(fx.max_new_tokens):
                ids = torch.cat([ids, hf(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
            router = hf(ids[:, :len(prompt) + fx.max_new_tokens - 1], output_router_logits=True).router_logits
        rows = df[df.request == fx.id]
        assert rows.position.max() == len(prompt) + fx.max_new_tokens - 2
        assert len(rows) == (len(prompt) + fx.max_new_tokens - 1) * len(meta.moe_layers) * k
        for li, layer in enumerate(meta.moe_layers):
            want = torch.topk(router[li].float(), k, dim=-1).indices.numpy()
            got = rows[rows.layer == layer].sort_values(["position", "rank"]).expert.to_numpy().reshape(-1, k)
            np.testing.assert_array_equal(got, want)


def test_stages_read_the_context_not_the_raw_config():
    """No stage function takes the raw config or reads ``ctx.config[...]``: the facts and settings
    are the context's (the whole config goes only to what takes it whole: hash, report, tracking URI)."""
    import ast

    import coldset.workflow.stages as stages_pkg

    for path in sorted(Path(stages_pkg.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                assert "config" not in [a.arg for a in node.args.args], f"{path.name}: {node.name} takes config"
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
                assert node.value.attr != "config", f"{path.name}:{node.lineno} reads ctx.config[...]"


def test_in_memory_model_has_no_folder(tmp_path):
    from coldset.workflow.config import validate_config

    config = validate_config(_config(tmp_path))
    ctx = StageContext.from_config(config)
    with pytest.raises(StageError, match="in_memory.*no folder"):
        ctx.model_dir
    with pytest.raises(StageError, match="run the model stage"):
        ctx.model_config  # no manifest yet


# ---------------------------------------------------------------------------------- host tier

def _all_hot(L=3, E=8, H=16, I=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return ExpertPools.all_hot(torch.randn(L, E, 2 * I, H, generator=g).to(dtype),
                               torch.randn(L, E, H, I, generator=g).to(dtype))


def test_host_tier_pools_compute_what_the_all_hot_pools_compute():
    ref = _all_hot()
    L, E = ref.num_moe_layers, ref.num_experts
    tier = host_tier(ref)
    assert isinstance(tier, HostTier) and not tier.pinned  # plain memory on the CPU
    assert tier.w13.data_ptr() != ref.w13_hot.data_ptr() and torch.equal(tier.w13, ref.w13_hot)
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, 16, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(11)])
    w = torch.rand(11, 3, generator=g)
    placed = []
    for frac in (0.0, 0.4, 1.0):
        mask = rng.random((L, E)) < frac  # True = hot
        pools = ref.placed(row_map_from_mask(mask), tier)
        placed.append(pools)
        assert pools.num_hot == int(mask.sum())  # a compact hot pool: only this placement's hot experts
        rm = pools.row_map.numpy()
        flat = np.arange(L * E).reshape(L, E)
        np.testing.assert_array_equal(rm[~mask], -flat[~mask] - 1)  # cold -> host row layer * E + expert
        for layer in range(L):
            for e in range(E):
                a, b = pools.expert_weights(layer, e), ref.expert_weights(layer, e)
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            assert torch.equal(torch_experts(pools, layer, x, ids, w), torch_experts(ref, layer, x, ids, w))
    # every placement's cold pool is the tier itself: no host allocation per placement
    for pools in placed:
        assert pools.w13_cold.untyped_storage().data_ptr() == tier.w13.untyped_storage().data_ptr()
        assert pools.w2_cold.untyped_storage().data_ptr() == tier.w2.untyped_storage().data_ptr()
        assert pools.w13_cold.data_ptr() == tier.w13.data_ptr() and pools.w2_cold.data_ptr() == tier.w2.data_ptr()


def test_host_tier_refuses_bad_input():
    ref = _all_hot()
    L, E = ref.num_moe_layers, ref.num_experts
    tier = host_tier(ref)
    with pytest.raises(PoolAllocationError, match="host tier"):
        host_tier(ref, host_available_bytes=tier.nbytes - 1)
    bad = row_map_from_mask(np.ones((L, E), dtype=bool))
    bad[0, 1] = bad[0, 0]  # one hot row used twice
    with pytest.raises(ValueError, match="row_map"):
        ref.placed(bad, tier)
    with pytest.raises(ValueError, match="does not hold these pools"):
        ref.placed(row_map_from_mask(np.ones((L, E), dtype=bool)), host_tier(_all_hot(E=4)))
    placed = ref.placed(row_map_from_mask(np.ones((L, E), dtype=bool)), tier)
    with pytest.raises(ValueError, match="all-hot layout"):
        host_tier(placed)


# ---------------------------------------------------------------------------------------------
# issue 16 item 2: a parity verdict is about the files it checked, never about their successors


def _copy_run(run, tmp_path) -> Path:
    """A copy of the run's results (the module's run stays untouched) and a config pointing at it."""
    import shutil

    shutil.copytree(run["results"], tmp_path / "results")
    cfg = _config(run["root"])
    cfg["results"] = str(tmp_path / "results")
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_parity_reports_carry_the_fingerprint_of_what_they_checked(run):
    from coldset.verify.fingerprint import file_sha256, placement_fingerprint

    res = run["results"]
    manifest = res / "model" / "tiny-mem" / "manifest.json"
    gate = json.loads((res / "parity" / "tiny-mem" / "gate.json").read_text())
    for name in PLACEMENTS:
        fp = json.loads((res / "parity" / "tiny-mem" / f"{name}.json").read_text())["fingerprint"]
        placement = json.loads((res / "placement" / "tiny-mem" / f"{name}.json").read_text())
        assert fp["row_map_sha256"] == file_sha256(res / "placement" / "tiny-mem" / f"{name}.rowmap.npy")
        assert fp["row_map_sha256"] == placement["row_map_sha256"]
        assert fp["placement"] == placement_fingerprint(res / "placement" / "tiny-mem" / f"{name}.json")
        assert fp["model"] == file_sha256(manifest)
        assert len(fp["kernel"]) == 64
        assert gate["fingerprints"][name] == fp


def test_rewritten_placement_stale_reports_refused_by_gate_and_bench(run, tmp_path, capsys):
    from coldset.core.placement import load_placement, save_placement

    cfg_path = _copy_run(run, tmp_path)
    res = tmp_path / "results"
    # the placement stage rewrites usage_global-0.5 with another (valid) row map: swap two layers' rows
    path = res / "placement" / "tiny-mem" / "usage_global-0.5.json"
    pl = load_placement(path)
    assert not np.array_equal(pl.row_map[0], pl.row_map[1])
    pl.row_map = np.ascontiguousarray(pl.row_map[::-1])
    save_placement(pl, path)
    capsys.readouterr()
    assert cli.main(["parity_gate", "--config", str(cfg_path)]) == 1
    err = capsys.readouterr().err
    assert "parity/tiny-mem/usage_global-0.5.json is stale" in err and "usage_global-0.5.rowmap.npy" in err
    # the bench refuses the placement the gate passed in its old form, before loading any model
    assert cli.main(["bench", "--config", str(cfg_path)]) == 1
    err = capsys.readouterr().err
    assert "gate.json (placement usage_global-0.5) is stale" in err and "row_map_sha256" in err
    # untouched placements still pass, and a report without a fingerprint is refused too
    assert cli.main(["parity_gate", "--config", str(cfg_path), "--placement", "positional-0.5"]) == 0
    report = res / "parity" / "tiny-mem" / "positional-0.5.json"
    doc = json.loads(report.read_text())
    del doc["fingerprint"]
    report.write_text(json.dumps(doc))
    assert cli.main(["parity_gate", "--config", str(cfg_path), "--placement", "positional-0.5"]) == 1
    assert "has no fingerprint" in capsys.readouterr().err


def test_rewritten_warm_state_of_a_dynamic_placement_makes_its_report_stale(run, tmp_path, capsys):
    """lru-0.5 rewritten with the same warm set (same row map) but another warm eviction order: its
    decisions differ, so the old verdict must not be applied to it."""
    cfg_path = _copy_run(run, tmp_path)
    path = tmp_path / "results" / "placement" / "tiny-mem" / "lru-0.5.json"
    doc = json.loads(path.read_text())
    doc["cache_warm_counts"] = doc["cache_warm_counts"][::-1]
    assert doc["cache_warm_counts"] != json.loads(path.read_text())["cache_warm_counts"]
    path.write_text(json.dumps(doc))
    capsys.readouterr()
    assert cli.main(["parity_gate", "--config", str(cfg_path), "--placement", "lru-0.5"]) == 1
    err = capsys.readouterr().err
    assert "parity/tiny-mem/lru-0.5.json is stale" in err and "placement (" in err and "lru-0.5.json)" in err
    assert "row_map_sha256" not in err
    assert cli.main(["parity_gate", "--config", str(cfg_path), "--placement", "usage_global-0.5"]) == 0


def test_a_placement_rewritten_with_other_statistics_keeps_its_verdict(run, tmp_path, capsys):
    """The placement stage rerun on another machine writes the same row map and warm state with
    other last digits in its coverage sums: the decode is the same, so the verdict stands; the
    policy name the decisions follow is not a statistic."""
    cfg_path = _copy_run(run, tmp_path)
    path = tmp_path / "results" / "placement" / "tiny-mem" / "lru-0.5.json"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "coverage_profile": doc["coverage_profile"] * (1 + 1e-15),
                                "coverage_heldout": 0.123, "profile_selections": 1.0}))
    capsys.readouterr()
    assert cli.main(["parity_gate", "--config", str(cfg_path), "--placement", "lru-0.5"]) == 0
    path.write_text(json.dumps({**doc, "policy": "lfu"}))
    assert cli.main(["parity_gate", "--config", str(cfg_path), "--placement", "lru-0.5"]) == 1
    assert "parity/tiny-mem/lru-0.5.json is stale" in capsys.readouterr().err


def test_changed_kernel_or_model_make_reports_stale(run, tmp_path, capsys):
    cfg_path = _copy_run(run, tmp_path)
    res = tmp_path / "results"
    entry = res / "autotune" / "tiny-mem.json"
    doc = json.loads(entry.read_text())
    doc["configs"] = {b: {**c, "changed": 1} for b, c in doc["configs"].items()}
    entry.write_text(json.dumps(doc))
    capsys.readouterr()
    assert cli.main(["parity_gate", "--config", str(cfg_path)]) == 1
    assert "changed: kernel" in capsys.readouterr().err
    entry.write_text(json.dumps({**doc, "configs": json.loads((run["results"] / "autotune" / "tiny-mem.json")
                                                             .read_text())["configs"]}))
    assert cli.main(["parity_gate", "--config", str(cfg_path)]) == 0
    manifest = res / "model" / "tiny-mem" / "manifest.json"
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**m, "spec": {**m["spec"], "seed": 4}}))
    assert cli.main(["parity_gate", "--config", str(cfg_path)]) == 1
    assert "changed: model" in capsys.readouterr().err

def test_bench_measures_held_out_prompts_with_provenance(run):
    """Bench JSONs say which split their prompts came from (held out by default) and carry the
    provenance of the process that measured (the commit of this checkout, versions, device)."""
    from coldset.bench.provenance import code_commit

    doc = json.loads((run["results"] / "bench" / "tiny-mem" / "usage_global-0.5.json").read_text())
    assert doc["prompt_split"] == "heldout" and "profile_batches" not in doc
    assert all(b["prompt_split"] == "heldout" and b["timed_token_match"] == 1.0 for b in doc["batches"])
    prov = doc["provenance"]
    assert prov["commit"] == code_commit()["commit"] and prov["torch"] == torch.__version__
    assert prov["device_type"] == "cpu" and prov["autotune_key"] and prov["autotune_hit"] in (True, False)


def test_bench_cuts_prompts_from_the_held_out_split_and_reports_profile_beside(run):
    """Mutant: bench prompts cut from every fixture (the profile split the placement was fitted on
    included). The stream the bench decodes must be exactly the held-out fixtures' tokens; with
    bench.profile_beside the profile split's numbers are written beside, labelled."""
    from coldset.bench import decode as bn
    from coldset.workflow.config import validate_config
    from coldset.trace.fixtures import read_fixtures
    from coldset.engine.generate import encode_prompts

    config = validate_config(_config(run["root"]))
    config["bench"]["profile_beside"] = True
    ctx = StageContext.from_config(config)
    _, tokenizer = process_engine.load_engine(ctx)
    fxs = read_fixtures(list(ctx.fixture_paths))
    plen = config["bench"]["prompt_tokens"]
    # each timed request: a fixture of the split, its own first prompt_tokens tokens (issue 30 item 4)
    want = {split: {tuple(ids[:plen]) for ids in encode_prompts(tokenizer, [f.prompt for f in fxs if f.split == split])}
            for split in ("heldout", "profile")}
    assert want["heldout"] and want["profile"]  # (templates share openings: the splits' first tokens may agree)
    seen = []
    real = bn.bench_decode

    def spy(model, pools, placement, stream, *args, **kwargs):
        seen.append((kwargs["prompt_split"], list(stream)))
        return real(model, pools, placement, stream, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bn, "bench_decode", spy)
        pipeline.run_stage("bench", config, placements=["usage_global-0.5"])
    domains = len(config["fixtures"]["domains"])  # b1: one request of each domain, each alone
    assert [s for s, _ in seen] == ["heldout"] * domains + ["profile"] * domains
    assert all(tuple(stream) in want[split] for split, stream in seen)
    assert len({tuple(stream) for split, stream in seen if split == "heldout"}) == domains  # distinct requests
    doc = json.loads((run["results"] / "bench" / "tiny-mem" / "usage_global-0.5.json").read_text())
    assert doc["prompt_split"] == "heldout" and doc["batches"][0]["prompt_split"] == "heldout"
    assert [b["prompt_split"] for b in doc["profile_batches"]] == ["profile"]
    ids = {split: {f.id for f in fxs if f.split == split} for split in ("heldout", "profile")}
    assert len(doc["batches"][0]["requests"]) == domains and set(doc["batches"][0]["requests"]) <= ids["heldout"]
    assert set(doc["profile_batches"][0]["requests"]) <= ids["profile"]


def test_a_timed_loop_that_decodes_other_tokens_fails_the_bench_stage(run):
    """Mutant: a timed loop whose tokens differ from generate() only logs a warning and its speed
    is published. Forced here end to end (the decode step's logits rolled by one vocabulary
    entry): the bench stage fails naming the placement and writes nothing."""
    from coldset.bench import decode as bn

    out = run["results"] / "bench" / "tiny-mem" / "positional-0.5.json"
    before = out.read_bytes()
    real_step = bn.Decoder.step

    def wrong_step(self):
        return torch.roll(real_step(self), 1, dims=-1)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bn.Decoder, "step", wrong_step)
        with pytest.raises(StageError, match=r"positional-0.5 batch 1: the timed decode loop matches generate\(\)"):
            pipeline.run_stage("bench", pipeline_config(run), placements=["positional-0.5"])
        assert cli.main(["bench", "--config", str(run["root"] / "tiny.yaml"), "--placement", "positional-0.5"]) == 1
    assert out.read_bytes() == before


def pipeline_config(run):
    from coldset.workflow.config import validate_config

    return validate_config(_config(run["root"]))


def test_a_router_knob_change_remakes_the_routers_of_the_built_engine(tmp_path, monkeypatch):
    """A config that differs from the engine's only in router knobs (a calibration sweep) reuses
    the built in-memory model with its routers remade, and routes exactly like a fresh build."""
    from coldset.core.layout import Layout
    from coldset.workflow.config import load_config

    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(yaml.safe_dump(_config(tmp_path)))
    config = load_config(cfg_path)
    built = []
    real_build = process_engine.build_synthetic_model
    monkeypatch.setattr(process_engine, "build_synthetic_model",
                        lambda *a, **k: built.append(1) or real_build(*a, **k))

    def trace(**knobs) -> pd.DataFrame:
        c = json.loads(json.dumps(config))
        c["model"]["synthetic"].update(knobs)
        for stage in ("model", "fixtures", "routing"):
            pipeline.run_stage(stage, c)
        return pd.read_parquet(Layout.from_config(c).trace)

    process_engine.release_engine()
    try:
        base = trace()
        swept = trace(popularity_scale=2.0, router_noise=1.5)
        assert len(built) == 1  # routers remade, not rebuilt
        other_seed = trace(popularity_scale=2.0, router_noise=1.5, seed=4)
        assert len(built) == 2  # any other field builds again
        process_engine.release_engine()
        fresh = trace(popularity_scale=2.0, router_noise=1.5)
        assert len(built) == 3
        pd.testing.assert_frame_equal(swept, fresh)
        assert not swept["expert"].equals(base["expert"]) and not swept["expert"].equals(other_seed["expert"])
    finally:
        process_engine.release_engine()


def test_a_gated_cache_decides_with_the_gate_unit_the_cache_stage_timed(run, caplog):
    """The engine's lookahead and nexttoken caches (bench and parity stages) take the prefetch gate
    unit of the time model the cache stage simulated them with: ``cache.time``'s all-HBM step at
    the batch and the link, the experts' bytes in this run's format, against the unit computed here
    by hand (1024 x a layer's compute, 0.9 of the step over the MoE layers, over one copy's time);
    lru has no gate; a batch ``cache.time.steps`` does not list takes the default, logged."""
    import logging

    from coldset.workflow.config import validate_config

    config = _config(run["root"])  # the run's model stage wrote the manifest the shape is read from
    config["cache"]["time"] = {"steps": [{"batch": 1, "all_hbm_step_ms": 0.8}, {"batch": 4, "all_hbm_step_ms": 1.5}],
                               "link_gb_s": 20.0}
    ctx = StageContext.from_config(validate_config(config))
    element = torch.empty((), dtype=getattr(torch, process_engine.experts_format(ctx))).element_size()
    copy_ms = 3 * SYNTHETIC["hidden"] * SYNTHETIC["moe_intermediate"] * element / 20e9 * 1e3
    for batch, step_ms in ((1, 0.8), (4, 1.5)):
        want = round(1024 * step_ms * 0.9 / SYNTHETIC["layers"] / copy_ms)
        assert process_engine.gate_lead_unit(ctx, "lookahead", batch) == want
        assert process_engine.gate_lead_unit(ctx, "nexttoken", batch) == want
    assert process_engine.gate_lead_unit(ctx, "lru", 4) is None
    with caplog.at_level(logging.INFO):
        assert process_engine.gate_lead_unit(ctx, "lookahead", 2) is None
    assert "lists no all-HBM step" in caplog.text
    engine, _ = process_engine.load_engine(ctx)
    try:
        cfg = engine.config
        rows = [{"domain": "d", "split": s, "phase": "decode", "layer": layer, "expert": e, "count": e + layer + 1}
                for s in ("profile", "heldout") for layer in cfg.moe_layers for e in range(cfg.num_experts)]
        pl = place(pd.DataFrame(rows), cfg, "lookahead", 0.5, batch_sizes=(4,), lookahead_depth=1,
                   lookahead_fit=False)
        host = host_tier(engine.pools)
        cache = process_engine.slot_cache(engine, host, pl, 4, lead_unit=process_engine.gate_lead_unit(ctx, "lookahead", 4))
        assert cache.rules.lead_unit == round(1024 * 1.5 * 0.9 / SYNTHETIC["layers"] / copy_ms)
    finally:
        process_engine.release_engine()
