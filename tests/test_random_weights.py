"""coldset.engine.random_weights: random models of published configs, each family through its own
model class, at tiny widths of the published configs on the CPU: they decode, their pools hold the
format asked for at the drawn std, the same seed gives the same model, a subset keeps what it says.
And ``bench step`` / ``bench cache --model-family`` run dry on the CPU on those models, with the
H200 script's commands checked."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from coldset.analysis.policies.base import DEFAULT_LEAD_UNIT, prefetch_lead_unit
from coldset.bench import decode as bn
from coldset.cli import main
from coldset.core import fp8, mxfp4
from coldset.core.files import write_json
from coldset.core.shapes import get_weight_format, nonexpert_bytes_breakdown
from coldset.engine.deepseek_v3 import DeepseekV3Model
from coldset.engine.generate import generate
from coldset.engine.glm4_moe import Glm4MoeModel
from coldset.engine.gpt_oss import GPT_OSS_20B_CONFIG, GptOssModel
from coldset.engine.model import ModelLoadError, MoEModel
from coldset.engine.random_weights import (SHAPE_FORMAT, build_random_model, family_config,
                                           mxfp4_scale_exponent, subset_note, tiny_config)
from coldset.measure import cache, harness, step
from coldset.measure.cli import build_parser
from coldset.measure.harness import RANDOM_FAMILIES
from coldset.measure.render import family_summary
from coldset.measure.render import render
from coldset.verify.gate import experts_functions

SHAPES = Path(__file__).resolve().parents[1] / "config" / "examples" / "shapes"
PROMPTS = [[5, 9, 2, 7], [3, 1]]
FAMILY_CONFIGS = {"qwen3_moe": "qwen3-30b-a3b-fp8", "mixtral": "mixtral-8x7b", "deepseek_v3": "deepseek-v3",
                  "glm4_moe": "glm-4.5-air", "gpt_oss": "gpt-oss-120b"}


def published(name: str) -> dict:
    return json.loads((SHAPES / name / "config.json").read_text())


def tiny(family: str) -> dict:
    """The family's published config at tiny widths (every other key as published)."""
    return tiny_config(published(FAMILY_CONFIGS[family]), vocab_size=300)


def test_tiny_config_keeps_the_family_and_narrows_it():
    for family in FAMILY_CONFIGS:
        cfg = family_config(tiny(family))
        assert cfg.model_type == family and cfg.hidden_size == 64 and cfg.num_moe_layers == 2
    ds = tiny("deepseek_v3")
    assert (ds["first_k_dense_replace"], ds["num_hidden_layers"]) == (1, 3)
    assert (ds["n_group"], ds["num_key_value_heads"]) == (2, 4)


CASES = [("qwen3_moe", "bf16", MoEModel), ("qwen3_moe", "fp8", MoEModel), ("mixtral", "bf16", MoEModel), ("deepseek_v3", "fp8", DeepseekV3Model),
         ("glm4_moe", "bf16", Glm4MoeModel), ("gpt_oss", "bf16", GptOssModel), ("gpt_oss", "mxfp4", GptOssModel)]


@pytest.mark.parametrize("family, fmt, model_class", CASES)
def test_each_family_decodes_deterministically_through_its_own_class(family, fmt, model_class):
    raw = tiny(family)
    model = build_random_model(raw, "cpu", fmt, seed=3)
    assert type(model) is model_class and not any(p.is_meta for p in model.parameters())
    cfg = model.config
    assert cfg.expert_format == {"bf16": "bfloat16", "fp8": fp8.FORMAT_NAME, "mxfp4": mxfp4.FORMAT_NAME}[fmt]
    assert model.pools.is_fp8 == (fmt == "fp8") and model.pools.is_mxfp4 == (fmt == "mxfp4")
    assert model.pools.has_bias == (family == "gpt_oss")
    if family == "gpt_oss":  # its clamped SwiGLU and the sliding window on the layers layer_types names
        assert model.pools.activation.kind == "swiglu_clamped" and model.layers[0].self_attn.window == 4
    first = generate(model, PROMPTS, 4, progress=False)
    again = generate(build_random_model(raw, "cpu", fmt, seed=3), PROMPTS, 4, progress=False)
    other = generate(build_random_model(raw, "cpu", fmt, seed=4), PROMPTS, 4, progress=False)
    assert first.tokens == again.tokens and first.tokens != other.tokens
    assert all(0 <= t < cfg.vocab_size for seq in first.tokens for t in seq)


def _dequantized_experts(pools, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 and w2 of MoE layer ``layer`` in float32, by the core formats' own dequantizers."""
    E = pools.num_experts
    w13, w2 = pools.w13_hot[layer * E:(layer + 1) * E], pools.w2_hot[layer * E:(layer + 1) * E]
    if pools.is_fp8:
        s13, s2 = pools.w13_scale_hot[layer * E:(layer + 1) * E], pools.w2_scale_hot[layer * E:(layer + 1) * E]
        return fp8.dequantize_w13(w13, s13), fp8.dequantize_weight(w2, s2)
    if pools.is_mxfp4:
        s13, s2 = pools.w13_scale_hot[layer * E:(layer + 1) * E], pools.w2_scale_hot[layer * E:(layer + 1) * E]
        return (mxfp4.dequantize(w13.unflatten(-1, (-1, 16)), s13, torch.float32),
                mxfp4.dequantize(w2.unflatten(-1, (-1, 16)), s2, torch.float32))
    return w13.float(), w2.float()


@pytest.mark.parametrize("family, fmt", [("qwen3_moe", "bf16"), ("qwen3_moe", "fp8"), ("gpt_oss", "mxfp4")])
def test_pools_hold_the_format_at_std_one_over_sqrt_fan_in(family, fmt):
    raw = {**tiny(family), "hidden_size": 128, "moe_intermediate_size": 64, "intermediate_size": 64}
    model = build_random_model(raw, "cpu", fmt, seed=1)
    cfg, pools = model.config, model.pools
    L, E, I, H = cfg.num_moe_layers, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    packed = 2 if fmt == "mxfp4" else 1
    assert tuple(pools.w13_hot.shape) == (L * E, 2 * I, H // packed)
    assert tuple(pools.w2_hot.shape) == (L * E, H, I // packed)
    w13, w2 = _dequantized_experts(pools)
    rel = 2 ** 0.5 if fmt == "mxfp4" else 1.15  # MXFP4: power-of-two scales (test below), else the draw's std
    for w, fan_in in ((w13, H), (w2, I)):
        assert fan_in ** -0.5 / rel <= w.std().item() <= fan_in ** -0.5 * rel
    attn = model.layers[0].self_attn
    linear = attn.qkv_proj if hasattr(attn, "qkv_proj") else attn.q_a_proj
    assert linear.weight.dtype == torch.bfloat16 and linear.weight.float().std().item() == pytest.approx(
        H ** -0.5, rel=0.15)
    assert torch.equal(model.layers[0].input_layernorm.weight.float(), torch.ones(H))


def test_the_mxfp4_scale_gives_the_std_of_uniform_codes():
    codes = torch.tensor(mxfp4.E2M1_VALUES, dtype=torch.float64)
    rms = codes.pow(2).mean().sqrt().item()
    for fan_in in (64, 2880, 7168):  # scales: the exponent -1, 0 or +1, equally likely
        std = rms * (sum(4.0 ** (mxfp4_scale_exponent(fan_in) + j - 127) for j in (-1, 0, 1)) / 3) ** 0.5
        assert fan_in ** -0.5 / 2 ** 0.5 <= std <= fan_in ** -0.5 * 2 ** 0.5


def test_a_subset_keeps_the_dense_layers_and_the_first_moe_layers():
    raw = {**tiny("deepseek_v3"), "num_hidden_layers": 6, "first_k_dense_replace": 2}  # 2 dense, 4 MoE
    model = build_random_model(raw, "cpu", "fp8", moe_layers=2)
    cfg = model.config
    assert (cfg.num_layers, cfg.moe_layers, model.pools.num_moe_layers) == (4, (2, 3), 2)
    note = subset_note(raw, cfg, "fp8")
    assert (note["moe_layers"], note["published_moe_layers"], note["dense_layers"], note["subset"]) == (2, 4, 2, True)
    assert "first 2 of 4 MoE layers" in note["note"]
    assert generate(model, PROMPTS, 2, progress=False).tokens
    g = family_config(tiny("gpt_oss"), 1)  # 2 MoE layers, the first kept
    assert (g.num_layers, g.layer_types) == (1, ("sliding_attention",))
    with pytest.raises(ModelLoadError, match="moe_layers=3"):
        family_config(tiny("gpt_oss"), 3)


def test_published_configs_parse_at_full_size_without_drawing():
    """The real shapes the H200 tables measure: the configs parse, the bytes are the published ones."""
    oss = family_config(GPT_OSS_20B_CONFIG)
    assert (oss.num_moe_layers, oss.num_experts, oss.top_k) == (24, 32, 4)
    big = family_config(published("gpt-oss-120b"))
    assert (big.num_moe_layers, big.num_experts, big.hidden_size, big.moe_intermediate_size) == (36, 128, 2880, 2880)
    ds = family_config(published("deepseek-v3"), 4)
    assert (ds.num_layers, ds.num_moe_layers, ds.num_experts) == (7, 4, 256)
    glm = family_config(published("glm-4.5-air"), 12)
    assert (glm.num_layers, glm.num_moe_layers) == (13, 12)


def test_unknown_family_and_format_are_refused_by_name():
    with pytest.raises(ModelLoadError, match="llama4"):
        build_random_model({"model_type": "llama4"})
    with pytest.raises(ModelLoadError, match="int4"):
        build_random_model(tiny("qwen3_moe"), "cpu", "int4")
    with pytest.raises(ModelLoadError, match="moe_intermediate_size 48"):
        build_random_model({**tiny("gpt_oss"), "intermediate_size": 48}, "cpu", "mxfp4")


@pytest.mark.parametrize("family, fmt", [("qwen3_moe", "bf16"), ("deepseek_v3", "fp8"), ("glm4_moe", "bf16"),
                                         ("gpt_oss", "mxfp4")])
def test_the_step_floor_counts_every_non_expert_weight_once(family, fmt):
    """bench step's non-expert bytes (:func:`coldset.measure.step.nonexpert_read_bytes`, from the
    shape) against the random model's own parameters and router correction biases, each counted in
    bf16 (the engine keeps routers and gpt_oss's norms in float32: a few MB at real shape), with one
    embedding row of the table read; the experts' biases are counted with each chosen expert
    (harness.expert_read_bytes: its pool rows, scale rows and biases)."""
    model = build_random_model(tiny(family), "cpu", fmt)
    pools, cfg = model.pools, model.config
    rows = sum(getattr(pools, f"{n}_hot")[0].numel() * getattr(pools, f"{n}_hot").element_size()
               for n in ("w13", "w2", "w13_scale", "w2_scale") if getattr(pools, f"{n}_hot", None) is not None)
    bias = (2 * cfg.moe_intermediate_size + cfg.hidden_size) * 2 if family == "gpt_oss" else 0
    assert harness.expert_read_bytes(pools) == rows + bias
    tensors = {id(p): p for p in model.parameters()}
    tensors.update({id(b): b for name, b in model.named_buffers() if name.endswith("e_score_correction_bias")})
    counted = sum(t.numel() * 2 for t in tensors.values())
    emb = model.embed_tokens.weight
    assert counted - emb.numel() * 2 + emb.shape[1] * 2 == step.nonexpert_read_bytes(cfg, 1, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# --model-family: a CPU dry run of bench step and bench cache on each published family at tiny
# widths (coldset.engine.random_weights.tiny_config): arguments, model build, floors, the rows and
# the rendered table, with the CUDA-only parts (device check, ceilings, graph capture, event
# timing, profiler, provenance) replaced by stand-ins.
# --------------------------------------------------------------------------------------------


@pytest.fixture
def cpu_bench(monkeypatch):
    """bench step / bench cache runnable on the CPU: every family's config tiny (a default subset 1
    MoE layer), the CUDA-only calls stood in for (step times 1 ms; the HBM read rate 1000 GB/s,
    the link 50 GB/s)."""
    raw = harness.RandomFamily.raw
    monkeypatch.setattr(harness.RandomFamily, "raw", lambda self: tiny_config(raw(self)))
    for name, fam in list(harness.RANDOM_FAMILIES.items()):  # a default subset: 1 of the tiny config's 2 MoE layers
        if fam.moe_layers:
            monkeypatch.setitem(harness.RANDOM_FAMILIES, name, dataclasses.replace(fam, moe_layers=1))

    def write(path, result, ceilings=None, tuned=None):
        result["provenance"] = {"device": "cpu dry run"}
        write_json(path, result)

    for mod in (step, cache):
        monkeypatch.setattr(mod, "require_cuda", lambda: torch.device("cpu"))
        monkeypatch.setattr(mod, "write_result", write)
        monkeypatch.setattr(mod, "kernel_profile", lambda fn, n=3, layers=1: {"kernels_per_step": 0.0})
    monkeypatch.setattr(step, "eager_time_us", lambda fn, reps: (fn(), 1000.0)[1])
    monkeypatch.setattr(bn, "measure_ceilings", lambda pinned=None: {"hbm_read_gb_s": 1000.0, "link_read_gb_s": 50.0})
    monkeypatch.setattr(bn.Decoder, "capture", lambda self: None)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the decode region runs eagerly
    return lambda family: tiny_config(raw(harness.RANDOM_FAMILIES[family]))  # the tiny config a family builds


@pytest.mark.parametrize("family, fmt, extra", [("gpt-oss-20b", "bf16", []), ("gpt-oss-120b", "mxfp4", []),
                                                ("deepseek-v3", "fp8", []),
                                                ("glm-4.5-air", "bf16", ["--moe-layers", "2"]),
                                                ("qwen3-30b-a3b", "bf16", [])])
def test_step_model_family_dry_run_on_cpu(family, fmt, extra, tmp_path, capsys, cpu_bench):
    """Every family through bench step: its published format's floor (bytes per chosen expert with
    scales and biases, the non-expert weights in bf16), the fused engine an error row (no CUDA, or
    the family refuses it), the step without experts and its share, the table rendered; the float32
    check of the engine that ran (bf16 rounding: small and nonzero)."""
    out = tmp_path / "out"
    assert main(["bench", "step", "--model-family", family, "--engines", "eager,fused", "--reps", "1",
                 "--rounds", "1", "--float32-check", "--out", str(out), *extra]) == 0
    res = json.loads((out / "decode_step.json").read_text())
    assert set(res["float32_check"]) == {"eager/b1", "eager/b8"}  # the fused engine failed: nothing to check
    assert all(0 < c["first_step_max_abs_logit_diff"] < 0.1 * c["logit_abs_max"] for c in res["float32_check"].values())
    built = res["model_family"]
    layers = int(extra[1]) if extra else RANDOM_FAMILIES[family].moe_layers
    cfg = family_config(cpu_bench(family), layers)
    assert (built["name"], built["expert_format"], built["moe_layers"]) == (family, fmt, cfg.num_moe_layers)
    f = get_weight_format(SHAPE_FORMAT[fmt])  # gate and up [I, H] and down [H, I], each with its scales
    weights = 2 * f.matrix_bytes(cfg.moe_intermediate_size, cfg.hidden_size) + f.matrix_bytes(
        cfg.hidden_size, cfg.moe_intermediate_size)
    bias = (2 * cfg.moe_intermediate_size + cfg.hidden_size) * 2 if family.startswith("gpt-oss") else 0
    assert (built["expert_bytes"], built["expert_read_bytes"]) == (weights, weights + bias)
    assert built["subset"] == (family == "deepseek-v3")  # the default subset, 1 of 2 MoE layers
    assert {(r["mode"], r["batch"], r["experts"]) for r in res["rows"]} == {
        ("eager", 1, "full"), ("eager", 1, "no_experts"), ("eager", 8, "full")}
    assert "fused" in res["errors"] and res["checks"]["eager/b1"]["token_match"] == 1.0
    for b in ("1", "8"):
        fl = res["floor"][b]
        chosen = fl["expert_bytes_per_step"] / built["expert_read_bytes"]  # distinct experts read a step (mean)
        assert cfg.num_moe_layers * cfg.top_k <= chosen <= cfg.num_moe_layers * min(cfg.num_experts, cfg.top_k * int(b))
        assert fl["floor_ms"] == pytest.approx(fl["bytes_per_step"] / 1e9)  # 1000 GB/s
    share = res["step_shares"]["eager"]
    assert share["without_routed_experts"] == 1.0  # the stand-in timer: every step 1 ms
    assert share["nonexpert_bytes_of_floor"] == pytest.approx(res["floor"]["1"]["nonexpert_bytes_per_step"]
                                                              / res["floor"]["1"]["bytes_per_step"])
    text = render(res)
    assert "Decode step" in text and "no_experts" in text and "Engines that failed: fused" in text
    summary = family_summary([{"kind": "cache", "rows": [], "checks_against": "other"}, res])
    assert f"| {family} ({fmt}, {cfg.num_moe_layers}/" in summary and "| eager | 8 |" in summary
    assert "| token match, the run's first engine |" in summary and "| eager/b1 | 1.000 |" in summary


@pytest.mark.parametrize("family, fmt, extra", [("gpt-oss-120b", "mxfp4", []),
                                                ("deepseek-v3", "fp8", ["--moe-layers", "2"])])  # lookahead: >= 2
def test_cache_model_family_dry_run_on_cpu(family, fmt, extra, tmp_path, cpu_bench):
    """bench cache on a family's random model: all-HBM, static and lru / lookahead rows at each
    residency, every row's logits bitwise all-HBM's and its decisions the simulator's (the
    command's own checks), link bytes at the bytes an expert moves (biases stay resident), the
    time columns present, lookahead's prefetch gate in this run's time units, the table rendered."""
    out = tmp_path / "out"
    assert main(["bench", "cache", "--model-family", family, "--residencies", "0.25,0.5,0.75", "--batches", "1",
                 "--policies", "lru,lookahead", "--depths", "1", "--steps", "4", "--repeats", "1",
                 "--out", str(out), *extra]) == 0
    res = json.loads((out / "cache_bench.json").read_text())
    assert res["fails"] == [] and res["checks"] and all(res["checks"].values())
    cfg = family_config(cpu_bench(family), int(extra[1]) if extra else RANDOM_FAMILIES[family].moe_layers)
    f = get_weight_format(SHAPE_FORMAT[fmt])  # what a copy moves: weights and scales, the biases resident
    weights = 2 * f.matrix_bytes(cfg.moe_intermediate_size, cfg.hidden_size) + f.matrix_bytes(
        cfg.hidden_size, cfg.moe_intermediate_size)
    assert res["expert_bytes"] == weights == res["model_family"]["expert_bytes"]
    assert (res["model"], res["weight_format"]) == (family, fmt) and "random router" in res["router"]
    names = [r["placement"] for r in res["rows"]]
    assert names[0] == "all-HBM" and {f"{p}-{r}" for p in ("usage_global", "lru") for r in (0.25, 0.5, 0.75)} \
        <= set(names) and sum(n.startswith("lookahead-") for n in names) == 3
    for r in res["rows"]:
        if r["placement"].startswith(("lru", "lookahead")):
            assert r["link_gb_per_token"] == pytest.approx(r["fills_per_token"] * res["expert_bytes"] / 1e9, rel=1e-9) \
                if r["placement"].startswith("lru") else r["link_gb_per_token"] >= 0
            assert "fraction_of_bound" in r and "overlap" in r
    # the gated policy's prefetch gate counts this run's times: its unit from the all-HBM step and the link
    # (1 ms stand-in step, 50 GB/s), the engine deciding with it and the simulator replaying with it
    allhbm = next(r for r in res["rows"] if r["placement"] == "all-HBM")
    copy_ms = res["expert_bytes"] / 50.0e9 * 1e3
    want = prefetch_lead_unit(allhbm["step_ms_mean"], 0.1, cfg.num_moe_layers, copy_ms)
    assert want != DEFAULT_LEAD_UNIT and res["lead_unit"] == {"1": want}
    assert [r["lead_unit"] for r in res["rows"] if r["placement"].startswith("lookahead")] == [want] * 3
    assert not any("lead_unit" in r for r in res["rows"] if r["placement"].startswith(("lru", "usage")))
    text = render(res)
    assert "Slot cache" in text and family in text
    summary = family_summary([res])
    assert summary.count(f"| {family} ({fmt}") == len(res["rows"]) and "| all-HBM | " in summary


def test_the_h200_script_commands_parse_and_pass_their_checks(tmp_path):
    """Every command of scripts/h200_family_tables.sh is a valid bench step / bench cache command
    line for a known family (the checks each command makes before it asks for CUDA)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "h200_family_tables.sh"
    lines = [ln.partition(" && ")[2] for ln in script.read_text().splitlines() if ln.startswith("want ")]
    assert len(lines) >= 9 and all(ln.startswith("run ") for ln in lines)
    seen = set()
    for ln in lines:  # a subset array ("${..._layers[@]}") may be empty: parsed without it
        words = [w for w in shlex.split(ln.replace('"$W', f'"{tmp_path}')) if not w.startswith("${")]
        _, family, cap, bench, command, *rest = words
        args = build_parser().parse_args([command, *rest])
        (step if command == "step" else cache).check_arguments(args)
        assert bench == "bench" and args.model_family == family in RANDOM_FAMILIES and int(cap) <= 150
        assert command == "cache" or args.float32_check
        assert args.out == f"{tmp_path}/{family}"
        seen.add((family, command))
    assert {f for f, _ in seen} == set(RANDOM_FAMILIES)
    assert {f for f, c in seen if c == "cache"} >= {"gpt-oss-20b", "gpt-oss-120b", "deepseek-v3", "qwen3-30b-a3b"}


def test_the_h200_script_skips_what_its_budget_leaves_no_time_for_and_still_collects(tmp_path):
    """With no time left every command is skipped (named in skipped.txt) and $OUT still gets its two
    files: the archive and the summary (the device returns few files)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OUT": str(tmp_path / "out"), "W": str(tmp_path / "w"), "BUDGET_S": "0",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "scripts/h200_family_tables.sh"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["families.tar.gz", "summary.md"]
    assert (tmp_path / "out" / "summary.md").read_text().strip() == "no bench step or bench cache results"
    assert len((tmp_path / "w" / "skipped.txt").read_text().splitlines()) == done.stdout.count("skipped (") >= 9
    with tarfile.open(tmp_path / "out" / "families.tar.gz") as tar:
        assert "w/skipped.txt" in tar.getnames()


@pytest.mark.parametrize("family, fmt, weight_format", [("gpt_oss", "mxfp4", "mxfp4"),
                                                         ("deepseek_v3", "fp8", "fp8_block128"),
                                                         ("qwen3_moe", "bf16", None)])
def test_the_step_autotune_shape_carries_the_family_format(family, fmt, weight_format):
    model = build_random_model(tiny(family), "cpu", fmt)
    shape = step.tune_shape({"model": {"dtype": "bfloat16"}}, model.config, model.pools)
    assert (shape.weight_format, shape.expert_bias) == (weight_format, family == "gpt_oss")
    assert shape.num_hot == model.pools.num_moe_layers * model.pools.num_experts


def test_each_family_default_fits_one_h200_with_a_slot_pool_at_residency_075():
    """Why the defaults subset deepseek-v3 and glm-4.5-air: every family's experts (in its published
    format, scales included) plus a slot pool of 0.75 of them plus its bf16 non-expert weights stay
    under 120 GiB of the H200's ~139 GiB (bench cache holds all-HBM pools beside the slot pool)."""
    for name, fam in RANDOM_FAMILIES.items():
        cfg = family_config(fam.raw(), fam.moe_layers)
        f = get_weight_format(SHAPE_FORMAT[fam.expert_format])
        I, H = cfg.moe_intermediate_size, cfg.hidden_size
        experts = (2 * f.matrix_bytes(I, H) + f.matrix_bytes(H, I)) * cfg.num_moe_layers * cfg.num_experts
        nonexpert = sum(nonexpert_bytes_breakdown(cfg, "bfloat16").values())
        assert 1.75 * experts + nonexpert < 120 * 2**30, name
        assert experts > 35e9, name  # and each measures tens of GB of experts, as the real model's step streams


@pytest.mark.gpu
@pytest.mark.parametrize("family, fmt, model_class", CASES)
def test_random_models_decode_on_the_gpu_eager_and_compiled(family, fmt, model_class):
    """On CUDA (the bench's path): drawn on the device, decoded by the Triton experts kernels of
    their format, eagerly (the same seed the same tokens) and with the decode region compile_decode
    installs (other reduction orders, so only its running and its vocabulary are checked)."""
    dev = torch.device("cuda")
    got = []
    for compiled in (False, False, True):
        model = build_random_model(tiny(family), dev, fmt, seed=3)
        model.experts_fn = experts_functions(dev)[0]
        if compiled:
            model.compile_decode(fused=False)
        got.append(generate(model, PROMPTS, 4, progress=False).tokens)
    assert got[0] == got[1]
    assert [len(t) for t in got[2]] == [len(t) for t in got[0]] and all(0 <= t < 300 for seq in got[2] for t in seq)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_the_float32_check_measures_each_engine_against_the_weights_upcast(fmt):
    """bench step --float32-check: each engine's first decode step against the same weights in
    float32, fed the engine's own first token, against a float32 model built here apart (every
    expert dequantized by the core format's own dequantizer into all-hot float32 pools, the torch
    experts): the bf16 engine's difference is the brute-force one and nonzero (it rounds), an engine
    whose first-step logits are off by 1.0 at one logit shows that, the first token's agreement and
    the float32 top-2 gap are the brute-force ones, an engine fed another first token before them
    changes none of theirs; the model it checked is left as it was."""
    import copy
    from types import SimpleNamespace

    from coldset.kernels.reference import torch_experts
    from coldset.kernels.tiers import ExpertPools

    model = build_random_model(tiny("gpt_oss"), "cpu", fmt, seed=2)
    model.experts_fn = torch_experts
    prompts = torch.randint(3, 290, (1, step.PROMPT_TOKENS), generator=torch.Generator().manual_seed(4))
    dec = bn.Decoder(model, 1, step.PROMPT_TOKENS, step.NEW_TOKENS, False)
    toks, logits = step.decode_tokens(None, dec, dec.prefill(prompts))
    off = logits.clone()
    off[0, 0, 7] += 1.0
    other = toks.clone()  # an engine whose prefill chose another first token, checked first
    other[:, 0] = (other[:, 0] + 1) % 290
    s = SimpleNamespace(model=model, prompts_by_b={1: prompts},
                        tokens_by_mode={"other/b1": other.tolist(), "eager/b1": toks.tolist(), "off/b1": toks.tolist()},
                        logits_by_mode={"other/b1": logits, "eager/b1": logits, "off/b1": off})
    pools_before = model.pools
    got = step.float32_check(s, ["other", "eager", "off"])
    assert model.pools is pools_before and next(model.parameters()).dtype == torch.bfloat16

    ref = copy.deepcopy(model).float()  # the independent reference: every expert float32, all hot
    p, L = model.pools, model.pools.num_moe_layers
    w13, w2 = (torch.stack(ws) for ws in zip(*(_dequantized_experts(p, layer) for layer in range(L))))
    ref.pools = ExpertPools.all_hot(w13, w2, w13_bias=p.w13_bias.float(), w2_bias=p.w2_bias.float(),
                                    activation=p.activation)
    ref.experts_fn = torch_experts

    def first_step(token):  # a fresh prefill each: the step after the prompt, fed ``token``
        ref.cache_shape = None
        dec32 = bn.Decoder(ref, 1, step.PROMPT_TOKENS, step.NEW_TOKENS, False)
        dec32.prefill(prompts)
        dec32.set_step(token, 1)
        return dec32.step().float()

    want_other = first_step(other[:, 0])
    assert got["other/b1"]["first_step_max_abs_logit_diff"] == pytest.approx(
        (logits[:, 0] - want_other).abs().max().item(), rel=1e-5, abs=1e-6)
    want = first_step(toks[:, 0])
    assert not torch.equal(want, want_other)  # the fed token matters: a stale cache slot would show
    best = sorted(want[0].tolist(), reverse=True)
    for name, lg in (("eager/b1", logits), ("off/b1", off)):
        diff = (lg[:, 0] - want).abs().max().item()
        assert got[name]["first_step_max_abs_logit_diff"] == pytest.approx(diff, rel=1e-5, abs=1e-6)
        assert got[name]["first_token_agrees"] == bool(lg[0, 0].argmax() == want[0].argmax())
        assert got[name]["float32_top2_gap_min"] == pytest.approx(best[0] - best[1], rel=1e-5, abs=1e-6)
        assert got[name]["logit_abs_max"] == pytest.approx(want.abs().max().item(), rel=1e-6)
    assert 0 < got["eager/b1"]["first_step_max_abs_logit_diff"] < 0.5  # bf16 rounds; it computes the same model
    assert got["off/b1"]["first_step_max_abs_logit_diff"] > 1.0 - got["eager/b1"]["first_step_max_abs_logit_diff"]


def test_cache_high_priority_rows_decide_as_the_plain_rows_and_need_lookahead(tmp_path, cpu_bench):
    """bench cache --high-priority: each lookahead row again with its prefetch streams at a high
    CUDA priority ('... high-priority'), checked as every row is (logits bitwise, engine = the
    simulator) and deciding as the plain row does (the same hits, fills and prefetches); refused
    without lookahead among the policies, before anything is built."""
    from coldset.measure.harness import MeasureError

    out = tmp_path / "out"
    assert main(["bench", "cache", "--model-family", "deepseek-v3", "--moe-layers", "2", "--residencies", "0.5",
                 "--batches", "1", "--policies", "lru,lookahead", "--depths", "1", "--steps", "4", "--repeats", "1",
                 "--high-priority", "--out", str(out)]) == 0
    res = json.loads((out / "cache_bench.json").read_text())
    assert res["fails"] == [] and all(res["checks"].values())
    rows = {r["placement"]: r for r in res["rows"]}
    plain, high = rows["lookahead-0.5 d1"], rows["lookahead-0.5 d1 high-priority"]
    for key in ("hit_rate", "fills_per_token", "prefetches_per_token", "link_gb_per_token", "lead_unit"):
        assert high[key] == plain[key]
    args = build_parser().parse_args(["cache", "--out", str(tmp_path), "--policies", "lru", "--high-priority"])
    with pytest.raises(MeasureError, match="--high-priority varies lookahead"):
        cache.check_arguments(args)
