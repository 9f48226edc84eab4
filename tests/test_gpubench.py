"""The GPU measurement commands (``python -m coldset bench kernel|step|cache|render``): argument
parsing, clean refusals without CUDA, and the renderer's exact markdown from hand-made JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coldset.cli import main
from coldset.measure.cli import build_parser
from coldset.measure.render import render, render_files

ROOT = Path(__file__).resolve().parents[1]

PROV = {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "commit": "0123456789abcdef", "dirty": False}


def test_defaults_are_the_old_scripts():
    """Same repeats and shapes as scripts/kernel_bench.py, decode_step_h200.py, prefetch_h200.py."""
    p = build_parser()
    k = p.parse_args(["kernel", "--out", "o"])
    assert (k.layers, k.reps, k.rounds, k.batches, k.sweep) == (8, 30, 2, "1,4,16,64,2048", 0)
    s = p.parse_args(["step", "--out", "o"])
    assert (s.reps, s.rounds, s.engines, s.config) == (50, 3, "eager,compiled,fused",
                                                        "config/examples/qwen3-30b-a3b-h200.yaml")
    c = p.parse_args(["cache", "--out", "o", "--policies", "lru,lfu", "--analysis"])
    assert (c.steps, c.repeats, c.residencies, c.batches, c.policies, c.depths, c.analysis) == \
        (128, 3, "0.5,1.0", "1,8", "lru,lfu", "1,2,3", True)
    assert (c.nexttoken_extra, c.prefetch_budget) == (3, None)  # the config's cache defaults
    n = p.parse_args(["cache", "--out", "o", "--policies", "lru,nexttoken", "--nexttoken-extra", "16",
                      "--prefetch-budget", "0"])
    assert (n.policies, n.nexttoken_extra, n.prefetch_budget) == ("lru,nexttoken", 16, 0)
    r = p.parse_args(["render", "a.json", "b.json"])
    assert r.files == ["a.json", "b.json"]


def test_out_is_required_and_tune_excludes_tuned(capsys):
    p = build_parser()
    with pytest.raises(SystemExit):
        p.parse_args(["kernel"])
    with pytest.raises(SystemExit):
        p.parse_args(["step", "--out", "o", "--tune", "--tuned", "x.json"])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.fixture
def no_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("command", [["kernel"], ["step"], ["cache"], ["cache", "--decisions-only"],
                                     ["cache", "--policies", "lru,nexttoken", "--nexttoken-extra", "16",
                                      "--prefetch-budget", "0"]])
def test_each_command_refuses_cleanly_without_cuda(command, tmp_path, capsys, no_cuda):
    out = tmp_path / "out"
    assert main(["bench", *command, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"coldset bench {command[0]}: needs a CUDA GPU") and "Traceback" not in err
    assert not out.exists()  # nothing half-written


@pytest.mark.parametrize("args, message", [
    (["kernel", "--batches", "1,x"], "--batches '1,x'"),
    (["kernel", "--rounds", "0"], "--rounds 0"),
    (["step", "--engines", "eager,turbo"], "unknown engine 'turbo'"),
    (["step", "--engines", "fused@base"], "needs --baseline-module"),
    (["cache", "--policies", "lru,fifo"], "['fifo'] not among lru, lru_guard, lfu, lookahead"),
    (["cache", "--residencies", "0.5,1.5"], "each must be in (0, 1]"),
    (["cache", "--policies", "lru,nexttoken", "--prefetch-budget", "-1"], "--prefetch-budget -1"),
    (["cache", "--policies", "nexttoken", "--nexttoken-extra", "-2"], "--nexttoken-extra -2"),
    (["cache", "--policies", "lru", "--prefetch-budget", "2"], "add nexttoken to --policies"),
    (["cache", "--decisions-only", "--save-replays"], "--decisions-only runs no model"),
    (["cache", "--policies", "lru", "--in-order"], "add lookahead to --policies"),
    (["cache", "--policies", "lru", "--other-fork"], "add lookahead to --policies"),
    (["cache", "--policies", "lru", "--lookahead-fit"], "add lookahead to --policies"),
    (["cache", "--host-tier", "raw,zip"], "--host-tier 'raw,zip'"),
    (["cache", "--host-tier", "raw,raw"], "--host-tier 'raw,raw'"),
])
def test_bad_arguments_are_named_before_cuda_is_asked(args, message, tmp_path, capsys, no_cuda):
    assert main(["bench", *args, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert message in err and "CUDA" not in err


def test_bench_alone_is_still_the_stage(tmp_path, capsys):
    """``python -m coldset bench`` (no measurement named) runs the pipeline's bench stage."""
    assert main(["bench", "--config", str(tmp_path / "missing.yaml")]) == 1
    assert "missing.yaml" in capsys.readouterr().err


KERNEL = {
    "kind": "kernel", "command": "python -m coldset bench kernel --out o", "date": "2026-12-01 17:00 UTC",
    "provenance": PROV, "autotune": {"key": "k"},
    "ceilings": {"hbm_read_GBps": 4000.0, "pinned_read_GBps": 50.0, "bf16_matmul_TFLOPs": 700.0},
    "vllm_stored": {"source": "stored vLLM figure (earlier run, NOTES.md)"},
    "batches": [
        {"batch": 1, "distinct_expert_MB": 75.5, "bound_us": 20.0, "hot_us": 25.0,
         "hot_us_spread": {"median": 25.0, "min": 24.0, "max": 26.5, "runs": [24.0, 25.0, 26.5]},
         "hot_GBps": 3000.0, "rowmap_cost_pct": 2.0, "cold_us": 1600.0, "cold_pct_pinned": 94.4, "torch_us": 160.2,
         "bitwise_rowmap_vs_off": True, "bitwise_cold_vs_hot": True, "max_rel_err_vs_torch": 0.00123,
         "vllm_stored_us": 30.4, "speed_vs_stored_vllm": 1.216, "sized_read_GBps": 3500.0, "pct_of_sized_read": 85.7},
        {"batch": 2048, "distinct_expert_MB": 226.5, "bound_us": 100.0, "hot_us": 400.0,
         "hot_us_spread": {"median": 400.0, "min": 400.0, "max": 400.0, "runs": [400.0]},
         "hot_GBps": 566.25, "rowmap_cost_pct": -1.0, "torch_us": 900.4, "bitwise_rowmap_vs_off": True,
         "bitwise_cold_vs_hot": None, "max_rel_err_vs_torch": 0.005, "vllm_stored_us": 482.2,
         "speed_vs_stored_vllm": 1.206},
    ],
}

KERNEL_MD = """\
**Experts kernel per MoE layer** · NVIDIA H200 · torch 2.11.0, triton 3.6.0 · commit 0123456789 · 2026-12-01 17:00 UTC

`python -m coldset bench kernel --out o`

Ceilings in this run: HBM read 4000 GB/s, pinned zero-copy read 50.0 GB/s, bf16 matmul 700 TFLOP/s. \
µs per layer, median of the rounds (min-max).

| tokens | distinct expert MB | bound µs | hot µs | % of bound | hot GB/s (% HBM) | row-map cost | \
all-cold µs (% pinned) | torch µs | bitwise off/cold | rel err vs torch | stored vLLM µs | speed vs stored vLLM |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
| 1 | 75.5 | 20.0 | 25.0 (24.0-26.5) | 80% | 3000 (75%) | +2.0% | 1600 (94%) | 160 | True/True | 1.2e-03 | 30.4 | 1.22x |
| 2048 | 226.5 | 100.0 | 400.0 | 25% | 566 (14%) | -1.0% | - | 900 | True/None | 5.0e-03 | 482.2 | 1.21x |

vLLM column: stored vLLM figure (earlier run, NOTES.md); not timed in this run, so its ratio carries the spread \
between two processes.

- batch 1: a read of 75.5 MB a launch streams at 3500 GB/s; the kernel reaches 86% of it"""

STEP = {
    "kind": "step", "command": "python -m coldset bench step --out o", "date": "2026-12-01 17:05 UTC",
    "provenance": {**PROV, "dirty": True}, "args": {"rounds": 3, "reps": 50}, "hbm_read_GBps": 4500.0,
    "floor": {"1": {"floor_ms": 1.234, "bytes_per_step": 5.5e9}, "8": {"floor_ms": 2.0, "bytes_per_step": 9.0e9}},
    "rows": [
        {"mode": "fused", "batch": 1, "experts": "full", "step_ms": 1.9, "tok_s": 526.3, "floor_ms": 1.234,
         "step_ms_spread": {"median": 1.9, "min": 1.85, "max": 2.0, "runs": [1.85, 1.9, 2.0]},
         "fraction_of_floor": 0.6494, "fraction_of_floor_range": [0.617, 0.667], "profile": {"kernels_per_step": 250.0}},
        {"mode": "fused", "batch": 1, "experts": "no_experts", "step_ms": 0.8, "tok_s": 1250.0,
         "step_ms_spread": {"median": 0.8, "min": 0.8, "max": 0.8, "runs": [0.8, 0.8, 0.8]}},
    ],
    "checks": {"fused/b1": {"token_match": 1.0, "max_abs_logit_diff": 0.0}}, "checks_against": "eager",
}

STEP_MD = """\
**Decode step** · NVIDIA H200 · torch 2.11.0, triton 3.6.0 · commit 0123456789 (dirty) · 2026-12-01 17:05 UTC

`python -m coldset bench step --out o`

HBM read ceiling in this run 4500 GB/s; bytes floor per step: b1 1.234 ms (5.50 GB), b8 2.000 ms (9.00 GB). \
Step ms: median of 3 rounds of 50 calls (min-max).

| engine | batch | experts | step ms | tok/s | floor ms | of floor | kernels/step |
|---|---|---|---|---|---|---|---|
| fused | 1 | full | 1.900 (1.850-2.000) | 526.3 | 1.234 | 64.9% (61.7-66.7%) | 250 |
| fused | 1 | no_experts | 0.800 (0.800-0.800) | 1250.0 | - | - | - |

Against eager: fused/b1 tokens 1.000, max logit diff 0"""


def _row(placement, residency, tok_s, hit, misses, link, runs, **extra):
    return {"batch": 1, "placement": placement, "residency": residency, "tok_s": tok_s, "hit_rate": hit,
            "misses_per_token": misses, "link_gb_per_token": link,
            "step_ms_mean_spread": {"median": sorted(runs)[1], "min": min(runs), "max": max(runs), "runs": runs},
            **extra}


CACHE = {
    "kind": "cache", "command": "python -m coldset bench cache --out o", "date": "2026-12-01 17:10 UTC",
    "provenance": PROV, "model": "qwen3-30b-a3b-synthetic", "router": "synthetic router (t)",
    "args": {"steps": 32, "repeats": 3}, "ceilings": {"hbm_read_gb_s": 4500.0, "link_read_gb_s": 50.5}, "fails": [],
    "rows": [
        _row("all-HBM", 1.0, 100.0, 1.0, 0.0, 0.0, [10.0, 10.1, 9.9]),
        _row("usage_global-0.5", 0.5, 50.0, 0.9, 6.0, 0.1234, [20.0, 20.0, 20.0]),
        _row("lru-0.5", 0.5, 75.0, 0.95, 3.0, 0.05, [13.3, 13.4, 13.2], sim_hit_rate=0.95, prefetches_per_token=0.0),
        _row("usage_global-1.0", 1.0, 80.0, 1.0, 0.0, 0.0, [12.5, 12.4, 12.6]),
    ],
}

CACHE_MD = """\
**Slot cache and lookahead prefetch** · NVIDIA H200 · torch 2.11.0, triton 3.6.0 · commit 0123456789 · \
2026-12-01 17:10 UTC

`python -m coldset bench cache --out o`

qwen3-30b-a3b-synthetic, 32 decode steps x 3 timed passes (+1 checked), held-out fixture prompts, synthetic router (t). \
Ceilings in this run: HBM read 4500 GB/s, link read 50.5 GB/s. Checks: all passed.

| batch | placement | tok/s | x usage_global | x all-HBM | hit rate | sim hit | misses/token | prefetches/token | \
link GB/token | mean step ms (min-max of passes) |
|---|---|---|---|---|---|---|---|---|---|---|
| 1 | all-HBM | 100.0 | - | 1.000 | 1.0000 | - | 0.00 | - | 0.0000 | 10.000 (9.900-10.100) |
| 1 | usage_global-0.5 | 50.0 | 1.00 | 0.500 | 0.9000 | - | 6.00 | - | 0.1234 | 20.000 (20.000-20.000) |
| 1 | lru-0.5 | 75.0 | 1.50 | 0.750 | 0.9500 | 0.9500 | 3.00 | 0.00 | 0.0500 | 13.300 (13.200-13.400) |
| 1 | usage_global-1.0 | 80.0 | 1.00 | 0.800 | 1.0000 | - | 0.00 | - | 0.0000 | 12.500 (12.400-12.600) |"""


_TIMED = {"sim_hit_rate": 0.95, "prefetches_per_token": 0.0, "wasted_prefetches_per_token": 0.0}
CACHE_NT = {
    **CACHE, "command": "python -m coldset bench cache --out o --policies lru,nexttoken --prefetch-budget 0",
    "args": {"steps": 32, "repeats": 3, "prefetch_budget": 0},
    "forecaster": {"terms": [[0, 0], [1, 0], [2, 0]], "hist_unit": 52429, "hist_shift": 5, "n": 11, "table_mb": 0.786,
                   "fit_s": 1.2},
    "rows": [
        _row("all-HBM", 1.0, 100.0, 1.0, 0.0, 0.0, [10.0, 10.1, 9.9]),
        _row("usage_global-0.5", 0.5, 50.0, 0.9, 6.0, 0.1234, [20.0, 20.0, 20.0]),
        _row("lru-0.5", 0.5, 75.0, 0.95, 3.0, 0.05, [13.3, 13.4, 13.2], **_TIMED, overlap=0.125,
             fraction_of_bound=0.752, sim_over_measured=0.9734),
        _row("nexttoken-0.5", 0.5, 74.0, 0.9512, 2.9, 0.052, [13.5, 13.6, 13.4], sim_hit_rate=0.9512,
             prefetches_per_token=0.2, wasted_prefetches_per_token=0.078, overlap=None, fraction_of_bound=0.7407,
             sim_over_measured=0.9671),
    ],
}

CACHE_NT_MD = """\
**Slot cache and lookahead prefetch** · NVIDIA H200 · torch 2.11.0, triton 3.6.0 · commit 0123456789 · \
2026-12-01 17:10 UTC

`python -m coldset bench cache --out o --policies lru,nexttoken --prefetch-budget 0`

qwen3-30b-a3b-synthetic, 32 decode steps x 3 timed passes (+1 checked), held-out fixture prompts, synthetic router (t). \
Ceilings in this run: HBM read 4500 GB/s, link read 50.5 GB/s. Checks: all passed.

nexttoken forecaster (fitted on the profile routing): terms [[0, 0], [1, 0], [2, 0]], history unit 52429 shift 5, \
11 candidates a token, tables 0.79 MB; prefetch budget 0 copies a group.

| batch | placement | tok/s | x usage_global | x all-HBM | hit rate | sim hit | misses/token | prefetches/token | \
link GB/token | mean step ms (min-max of passes) | wasted prefetches/token | overlap | of bound | simulated / measured step |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
| 1 | all-HBM | 100.0 | - | 1.000 | 1.0000 | - | 0.00 | - | 0.0000 | 10.000 (9.900-10.100) | - | - | - | - |
| 1 | usage_global-0.5 | 50.0 | 1.00 | 0.500 | 0.9000 | - | 6.00 | - | 0.1234 | 20.000 (20.000-20.000) | - | - | - | - |
| 1 | lru-0.5 | 75.0 | 1.50 | 0.750 | 0.9500 | 0.9500 | 3.00 | 0.00 | 0.0500 | 13.300 (13.200-13.400) | 0.00 | 0.12 | \
0.75 | 0.973 |
| 1 | nexttoken-0.5 | 74.0 | 1.48 | 0.740 | 0.9512 | 0.9512 | 2.90 | 0.20 | 0.0520 | 13.500 (13.400-13.600) | 0.08 | - | \
0.74 | 0.967 |

overlap = 1 - (step - all-HBM step) / link time; bound = max(all-HBM step, link time); simulated: \
time_model.simulate_time."""


@pytest.mark.parametrize("result, expected", [(KERNEL, KERNEL_MD), (STEP, STEP_MD), (CACHE, CACHE_MD),
                                              (CACHE_NT, CACHE_NT_MD)],
                         ids=["kernel", "step", "cache", "cache-nexttoken"])
def test_render_exact_markdown(result, expected):
    assert render(result) == expected


def test_render_command_reads_files_in_order(tmp_path, capsys):
    paths = []
    for name, res in (("k.json", KERNEL), ("s.json", STEP)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(res))
    assert main(["bench", "render", *map(str, paths)]) == 0
    assert capsys.readouterr().out == KERNEL_MD + "\n\n" + STEP_MD + "\n"
    md = tmp_path / "t.md"
    assert main(["bench", "render", str(paths[1]), "--out", str(md)]) == 0
    assert md.read_text() == STEP_MD + "\n"


def test_render_names_the_file_and_what_is_wrong(tmp_path, capsys):
    other = tmp_path / "bench.json"
    other.write_text(json.dumps({"rows": []}))
    broken = tmp_path / "kernel.json"
    broken.write_text(json.dumps({k: v for k, v in KERNEL.items() if k != "ceilings"}))
    assert main(["bench", "render", str(other)]) == 1
    assert f"{other}: kind None is not one of kernel, step, cache" in capsys.readouterr().err
    assert main(["bench", "render", str(broken)]) == 1
    assert f"{broken}: field 'ceilings' missing or malformed" in capsys.readouterr().err
    with pytest.raises(Exception):
        render_files([str(tmp_path / "absent.json")])


def test_kernel_weight_format_fp8_arguments(tmp_path, capsys, no_cuda):
    """``bench kernel --weight-format fp8``: bf16 by default, only bf16 or fp8, the bf16-only options
    and a missing --configs file refused by name before CUDA is asked, then the CUDA refusal."""
    p = build_parser()
    assert p.parse_args(["kernel", "--out", "o"]).weight_format == "bf16"
    assert p.parse_args(["kernel", "--out", "o", "--weight-format", "fp8"]).weight_format == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["kernel", "--out", "o", "--weight-format", "fp4"])
    assert "invalid choice: 'fp4'" in capsys.readouterr().err
    for extra, message in [(["--sweep", "1"], "does not take --sweep"),
                           (["--variants", '{"1": []}', "--baseline-module", "b.py"], "--variants, --baseline-module"),
                           (["--configs", str(tmp_path / "none.json")], "none.json: no such file")]:
        assert main(["bench", "kernel", "--weight-format", "fp8", *extra, "--out", str(tmp_path / "o")]) == 1
        err = capsys.readouterr().err
        assert message in err and "CUDA" not in err, err
    assert main(["bench", "kernel", "--weight-format", "fp8", "--out", str(tmp_path / "o")]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err and not (tmp_path / "o").exists()


KERNEL_FP8 = {
    "kind": "kernel-fp8", "command": "python -m coldset bench kernel --weight-format fp8 --out o",
    "date": "2026-12-01 17:30 UTC", "provenance": PROV, "bf16_configs_from": "tuned.json",
    "ceilings": {"hbm_read_GBps": 4000.0, "bf16_matmul_TFLOPs": 700.0, "fp8_matmul_TFLOPs": 1400.0,
                 "pinned_read_GBps": 50.0},
    "fails": [],
    "batches": [
        {"batch": 1, "fp8_MB": 40.0, "fp8_us": 20.0, "fp8_plain_read_us": 15.0, "fp8_bytes_bound_us": 10.0,
         "fp8_flop_bound_us": 0.1, "bf16_us": 30.0, "bf16_plain_read_us": 24.0, "bf16_bytes_bound_us": 20.0,
         "bf16_flop_bound_us": 0.2, "fp8_rel_err_vs_torch": 0.004, "fp8_bitwise_rowmap_vs_off": True,
         "fp8_cold_bitwise_vs_hot": True, "fp8_cold_us": 1000.0, "fp8_cold_link_bound_us": 800.0,
         "fp8_config": {"block_m": 16, "block_n1": 64, "block_n2": 128, "num_warps": 4, "num_stages": 3}},
        {"batch": 2048, "fp8_MB": 600.0, "fp8_us": 400.0, "fp8_plain_read_us": 160.0, "fp8_bytes_bound_us": 150.0,
         "fp8_flop_bound_us": 100.0, "bf16_us": 500.0, "bf16_plain_read_us": 320.0, "bf16_bytes_bound_us": 300.0,
         "bf16_flop_bound_us": 200.0, "fp8_rel_err_vs_torch": 0.006, "fp8_bitwise_rowmap_vs_off": False,
         "fp8_config": {"block_m": 64, "block_n1": 128, "block_n2": 128, "num_warps": 4, "num_stages": 4}},
    ],
}

KERNEL_FP8_MD = """\
**Block-FP8 experts kernel per MoE layer, beside bf16** · NVIDIA H200 · torch 2.11.0, triton 3.6.0 · commit \
0123456789 · 2026-12-01 17:30 UTC

`python -m coldset bench kernel --weight-format fp8 --out o`

Ceilings in this run: HBM read 4000 GB/s, bf16 matmul 700 TFLOP/s, FP8 matmul 1400 TFLOP/s, pinned zero-copy read \
50.0 GB/s. µs per layer (median of the graph replays); FP8: the fastest config of the FP8 search space; bf16: configs \
of tuned.json.

| tokens | FP8 MB | FP8 µs | % plain read | % bytes bound | % FLOP bound | bf16 µs | bf16 % plain read | \
bf16 % bound | bf16/FP8 | FP8 rel err vs torch | bitwise off/cold | FP8 all-cold µs (% link) | FP8 config m/n1/n2 |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
| 1 | 40.0 | 20.0 | 75% | 50% | 0% | 30.0 | 80% | 67% | 1.50x | 4.0e-03 | True/True | 1000.0 (80%) | 16/64/128 w4s3 |
| 2048 | 600.0 | 400.0 | 40% | 38% | 25% | 500.0 | 64% | 60% | 1.25x | 6.0e-03 | False/- | - | 64/128/128 w4s4 |

Checks: all passed."""


def test_render_kernel_fp8_exact_markdown():
    assert render(KERNEL_FP8) == KERNEL_FP8_MD


SWEEP = ROOT / "config/examples/fp8_stage_sweep.json"


def _fp8_configs_error(tmp_path, capsys, content, *extra) -> str:
    """``bench kernel --weight-format fp8 --fp8-configs FILE`` with ``content`` (text, or None: no
    file) refused before CUDA is asked: its error, nothing written."""
    path = tmp_path / "configs.json"
    if content is not None:
        path.write_text(content)
    out = tmp_path / "o"
    assert main(["bench", "kernel", *extra, "--fp8-configs", str(path), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"--fp8-configs {path}" in err and "CUDA" not in err and "Traceback" not in err, err
    assert not out.exists()
    return err


@pytest.mark.parametrize("content, extra, message", [
    ('[{"block_m": 16}]', [], "needs --weight-format fp8"),
    (None, ["--weight-format", "fp8"], ": no such file"),
    ("[{block_m: 16}]", ["--weight-format", "fp8"], ": not JSON"),
    ("[]", ["--weight-format", "fp8"], "a non-empty JSON list of KernelConfig dicts expected, got []"),
    ('{"block_m": 16}', ["--weight-format", "fp8"], "a non-empty JSON list of KernelConfig dicts expected"),
])
def test_fp8_configs_file_refused_by_name_on_the_cpu(content, extra, message, tmp_path, capsys, no_cuda):
    """``--fp8-configs``: only with --weight-format fp8, a file that exists, JSON, a non-empty list."""
    assert message in _fp8_configs_error(tmp_path, capsys, content, *extra)


@pytest.mark.parametrize("entries, message", [
    (["n1=32"], "entry 0 is not a dict of KernelConfig fields"),
    ([{"block_m": 16}, {"stages": 4}], "entry 1: unknown field 'stages' (KernelConfig fields: block_m, "),
    ([{"num_stages": 4.5}], "entry 0: field 'num_stages' must be an integer, got 4.5"),
    ([{"num_stages": "4"}], "entry 0: field 'num_stages' must be an integer, got '4'"),
    ([{"pdl": True}], "entry 0: field 'pdl' must be an integer, got True"),
    ([{"block_k1": 64}], "entry 0: triton_fp8_experts: block_k1 and block_k2 must be 128"),
    ([{"block_n1": 64, "quant_act": 1}], "entry 0: triton_fp8_experts: config quant_act=1"),
    ([{"num_stages": 4}, {"num_stages": 5}, {"num_stages": 4, "block_n1": 32}], "entry 2 repeats entry 0"),
])
def test_fp8_configs_fields_refused_by_name_on_the_cpu(entries, message, tmp_path, capsys, no_cuda):
    """Each entry checked as the FP8 kernel checks its config (KernelConfig's fields, integers,
    triton_fp8._check_config; needs triton importable, not a GPU), the entry and field named."""
    pytest.importorskip("triton")
    assert message in _fp8_configs_error(tmp_path, capsys, json.dumps(entries), "--weight-format", "fp8")


def test_fp8_stage_sweep_file_is_the_16x32_64_tile_at_4_to_8_stages(tmp_path, capsys, no_cuda):
    """The committed sweep of the hypothesis that the k loop is latency-bound: the chosen
    decode tile (16 x 32 / 64, w8a8, pdl 2) at 4, 5, 6 and 8 stages, each a config the kernel takes;
    the command reaches the CUDA refusal."""
    pytest.importorskip("triton")
    from coldset.kernels.triton_fp8 import fp8_launches
    from coldset.kernels.triton_moe import KernelConfig
    from coldset.measure.kernel_fp8 import load_fp8_configs

    configs = load_fp8_configs(str(SWEEP))
    assert [c["num_stages"] for c in configs] == [4, 5, 6, 8]
    for c in configs:
        assert {k: c[k] for k in ("block_m", "block_n1", "block_n2", "pdl", "w8a16", "quant_x", "quant_act")} == \
            dict(block_m=16, block_n1=32, block_n2=64, pdl=2, w8a16=0, quant_x=0, quant_act=0)
        # five launches: the stage table shows both quantization handoffs (hypothesis 2)
        assert fp8_launches(KernelConfig.from_dict(c)) == ("quant_x", "w13", "quant_act", "w2", "sum")
    out = tmp_path / "o"
    assert main(["bench", "kernel", "--weight-format", "fp8", "--batches", "1", "--layers", "1",
                 "--fp8-configs", str(SWEEP), "--out", str(out)]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err and not out.exists()


# the same run with the stages timed and two given configs: the first table as before, then the
# configs' timings and their stages
_S4 = {"block_m": 16, "block_n1": 32, "block_k1": 128, "block_n2": 64, "block_k2": 128, "num_warps": 4,
       "num_stages": 4, "slot_max_pairs": 32, "pdl": 2, "quant_x": 0, "quant_act": 0, "tile_order": 0, "w8a16": 0}
_S8, _QX = {**_S4, "num_stages": 8}, {**_S4, "block_n1": 128, "quant_x": 1, "quant_act": 1}
_K4, _K8, _KQ = (json.dumps(c, sort_keys=True) for c in (_S4, _S8, _QX))
KERNEL_FP8_STAGES = {
    **KERNEL_FP8, "fp8_configs_from": "sweep.json",
    "batches": [
        {**KERNEL_FP8["batches"][0], "fp8_config": _S8, "fp8_candidates_us": {_K4: 23.5, _K8: 20.0, _KQ: 21.0},
         "fp8_stages_us": {"quant_x": 2.0, "w13": 12.0, "quant_act": 13.5, "w2": 18.5, "sum": 20.0},
         "fp8_candidates_stages_us": {_K4: {"quant_x": 2.0, "w13": 14.0, "quant_act": 15.5, "w2": 22.0, "sum": 23.5},
                                      _K8: {"quant_x": 2.0, "w13": 12.0, "quant_act": 13.5, "w2": 18.5, "sum": 20.0},
                                      _KQ: {"w13": 13.0, "w2": 19.6, "sum": 21.0}},
         "fp8_stage_read_us": {"w13": 7.4, "w2": 3.7}},
        # the fastest config's stages only (the table's fallback): its three launches
        {**KERNEL_FP8["batches"][1], "fp8_config": _QX, "fp8_candidates_us": {_K4: 900.0, _K8: 950.0, _KQ: 400.0},
         "fp8_stages_us": {"w13": 250.0, "w2": 380.0, "sum": 400.0}},
    ],
}
KERNEL_FP8_STAGES_MD = """\
**Block-FP8 experts kernel per MoE layer, beside bf16** · NVIDIA H200 · torch 2.11.0, triton 3.6.0 · commit \
0123456789 · 2026-12-01 17:30 UTC

`python -m coldset bench kernel --weight-format fp8 --out o`

Ceilings in this run: HBM read 4000 GB/s, bf16 matmul 700 TFLOP/s, FP8 matmul 1400 TFLOP/s, pinned zero-copy read \
50.0 GB/s. µs per layer (median of the graph replays); FP8: the fastest of the configs in sweep.json; bf16: configs \
of tuned.json.

| tokens | FP8 MB | FP8 µs | % plain read | % bytes bound | % FLOP bound | bf16 µs | bf16 % plain read | \
bf16 % bound | bf16/FP8 | FP8 rel err vs torch | bitwise off/cold | FP8 all-cold µs (% link) | FP8 config m/n1/n2 |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
| 1 | 40.0 | 20.0 | 75% | 50% | 0% | 30.0 | 80% | 67% | 1.50x | 4.0e-03 | True/True | 1000.0 (80%) | 16/32/64 w4s8 |
| 2048 | 600.0 | 400.0 | 40% | 38% | 25% | 500.0 | 64% | 60% | 1.25x | 6.0e-03 | False/- | - | 16/128/64 w4s4 |

FP8 configs of sweep.json, µs per layer of each:

| config | b1 | b2048 |
|---|---|---|
| n1=32 n2=64 w=4 s=8 pdl=2 qx=0 qa=0 to=0 w8a16=0 | 20.0 | 950.0 |
| n1=128 n2=64 w=4 s=4 pdl=2 qx=1 qa=1 to=0 w8a16=0 | 21.0 | 400.0 |
| n1=32 n2=64 w=4 s=4 pdl=2 qx=0 qa=0 to=0 w8a16=0 | 23.5 | 900.0 |

FP8 launches timed cumulatively (one CUDA graph of every layer's call stopped after that launch; the grouping, \
where launched, in the first), µs per layer:

| tokens | config | quant x | +w13 | +quant act | +w2 | +sum | w13 plain read | w2 plain read |
|---|---|---|---|---|---|---|---|---|
| 1 | n1=32 n2=64 w=4 s=8 pdl=2 qx=0 qa=0 to=0 w8a16=0 | 2.0 | 12.0 | 13.5 | 18.5 | 20.0 | 7.4 | 3.7 |
| 2048 | n1=128 n2=64 w=4 s=4 pdl=2 qx=1 qa=1 to=0 w8a16=0 | - | 250.0 | - | 380.0 | 400.0 | - | - |

Checks: all passed."""


def test_render_kernel_fp8_stages_and_given_configs_exact_markdown():
    """With stage data (and --fp8-configs) the FP8 table gains the configs' table and the stage
    table after it; the first table is unchanged (a JSON without them renders as before, above)."""
    assert render(KERNEL_FP8_STAGES) == KERNEL_FP8_STAGES_MD


@pytest.mark.gpu
def test_kernel_fp8_given_configs_and_stages_on_the_gpu(tmp_path, capsys):
    """A small real FP8 run of the committed sweep at one layer: every config of the file timed at
    each batch with its cumulative stages (the launches fp8_launches names), the plain reads of
    w13's and w2's parts up to 64 tokens, the checks hold, the table printed is the JSON's rendering."""
    from coldset.kernels.triton_fp8 import fp8_launches
    from coldset.kernels.triton_moe import KernelConfig
    from coldset.measure.kernel_fp8 import load_fp8_configs

    out = tmp_path / "k"
    assert main(["bench", "kernel", "--weight-format", "fp8", "--out", str(out), "--layers", "1", "--reps", "3",
                 "--batches", "1,4", "--fp8-configs", str(SWEEP)]) == 0
    res = json.loads((out / "kernel_bench.json").read_text())
    assert capsys.readouterr().out == "\n" + render(res) + "\n" and not res["fails"]
    keys = {json.dumps(c, sort_keys=True) for c in load_fp8_configs(str(SWEEP))}
    for row in res["batches"]:
        assert set(row["fp8_candidates_us"]) == set(row["fp8_candidates_stages_us"]) == keys
        assert tuple(row["fp8_stages_us"]) == fp8_launches(KernelConfig.from_dict(row["fp8_config"]))
        assert all(v > 0 for st in row["fp8_candidates_stages_us"].values() for v in st.values())
        # both parts' reads recorded (not their order: at one layer a read of a few MB is mostly
        # the graph replay's own overhead, and w2's read timed over w13's on the H200, 17.6 against 16.8 µs)
        assert set(row["fp8_stage_read_us"]) == {"w13", "w2"} and all(v > 0 for v in row["fp8_stage_read_us"].values())


@pytest.mark.gpu
def test_kernel_command_on_the_gpu(tmp_path, capsys):
    """A small real run: two layers, batch 1 and 4, the committed H200 configs (no tuning); the
    table printed is the rendering of the JSON written, the checks hold."""
    out = tmp_path / "k"
    assert main(["bench", "kernel", "--out", str(out), "--layers", "2", "--reps", "3", "--batches", "1,4",
                 "--no-batch1", "--configs", "config/examples/h200-tuned/kernel_configs.json"]) == 0
    res = json.loads((out / "kernel_bench.json").read_text())
    assert capsys.readouterr().out == "\n" + render(res) + "\n"
    assert res["provenance"]["ceilings"]["hbm_read_GBps"] > 0
    for row in res["batches"]:
        assert row["bitwise_rowmap_vs_off"] and row["bitwise_cold_vs_hot"] and row["max_rel_err_vs_torch"] < 2e-2
        assert len(row["hot_us_spread"]["runs"]) == 2


def test_list_recall_counts_the_later_layers_selections_the_lists_name():
    """bench cache's list recall: after group (step, l) the list names instances of layer l + d;
    the share of layer l + d's selections (every token) named, against a hand count."""
    import numpy as np

    from coldset.measure.cache import list_recall

    L, E, d = 3, 4, 1
    routing = np.array([[[[0, 1]], [[2, 3]], [[1, 2]]],      # step 0: layers 0, 1, 2 (B 1, k 2)
                        [[[0, 2]], [[0, 1]], [[3, 0]]]])     # step 1
    lists = -np.ones((2 * L, 3), dtype=np.int64)
    lists[0] = [1 * E + 2, 1 * E + 0, -1]   # after (0, 0): names layer 1's 2 (selected) and 0 (not)
    lists[1] = [2 * E + 1, 2 * E + 2, 2 * E + 3]  # after (0, 1): both of layer 2's
    lists[3] = [1 * E + 3, -1, -1]          # after (1, 0): neither of layer 1's 0, 1
    lists[4] = [2 * E + 0, -1, -1]          # after (1, 1): layer 2's 0 of 3, 0
    assert list_recall(lists, routing, d, E) == pytest.approx((1 + 2 + 0 + 1) / 8)


def test_committed_measurements_render():
    """The JSON BENCHMARKS.md is rendered from (docs/measurements/) stays readable by the renderer."""
    from pathlib import Path

    files = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "docs" / "measurements").glob("*.json"))
    assert files, "docs/measurements/ holds no result JSON"
    text = render_files(files)
    assert text.count("NVIDIA H200") == len(files) and "stored vLLM" in text


def test_cache_nexttoken_fit_and_time_columns_on_cpu():
    """The CPU parts of ``bench cache``'s nexttoken rows: the forecaster fitted on the profile
    routing [steps, L, B, k] with each batch row one sequence in decode order (against the tokens
    laid out by hand), and a row's overlap / bound against hand arithmetic, its simulated step
    simulate_time's at the engine's model (share, step)."""
    import numpy as np

    from coldset.analysis.simulate import simulate
    from coldset.analysis.streams import AccessStream
    from coldset.analysis.time_model import TimeModel, simulate_time
    from coldset.analysis.forecast import NextTokenForecaster
    from coldset.measure.cache import _fit_nexttoken, _time_columns

    S, L, B, k, E = 12, 2, 3, 2, 6
    rng = np.random.default_rng(3)
    prof = np.array([[[rng.choice(E, k, replace=False) for _ in range(B)] for _ in range(L)] for _ in range(S)])
    R = {}
    F = _fit_nexttoken(prof, k, E, 2, R)
    tokens = np.array([prof[s, :, b] for b in range(B) for s in range(S)])  # [B*S, L, k], row by row
    want = NextTokenForecaster.fit_tuned(tokens, np.repeat(np.arange(B), S), k, E, extra=2)
    assert F.terms == want.terms and (F.hist_unit, F.hist_shift) == (want.hist_unit, want.hist_shift)
    assert np.array_equal(np.asarray(F.tables), np.asarray(want.tables))
    assert R["forecaster"]["n"] == k + 2 and R["forecaster"]["terms"] == [list(t) for t in want.terms]

    inst = (prof + (np.arange(L) * E)[None, :, None, None]).reshape(-1)
    acc = AccessStream(inst, np.arange(0, inst.size + 1, B * k), B * S, L, E)
    sim = simulate(acc, "lru", 6, np.ones((L, E)))
    row = {"step_ms_mean": 10.5, "link_gb_per_token": 0.05}  # 3 tokens a step: 0.15 GB a step, 3 ms at 50 GB/s
    got = _time_columns(row, 10.0, 50.0, B, acc, sim, 10**7)
    ts = simulate_time(acc, sim, TimeModel(step_ms=10.0, bytes_per_expert=10**7, link_gb_s=50.0, link="share",
                                           join="step"))
    assert got["overlap"] == pytest.approx(1 - 0.5 / 3.0) and got["bound_ms"] == pytest.approx(10.0)
    assert got["fraction_of_bound"] == pytest.approx(10.0 / 10.5)
    assert got["sim_step_ms"] == ts.step_ms and got["sim_over_measured"] == pytest.approx(ts.step_ms / 10.5)
    assert _time_columns({"step_ms_mean": 10.5, "link_gb_per_token": 0.0}, 10.0, 50.0, B, acc, sim, 10**7)[
        "overlap"] is None

    assert got["manage_ms_per_group"] is None and got["sim_managed_step_ms"] is None  # no residency-1.0 step given

    # the management columns: the policy's residency-1.0 row (12.0 ms against all-HBM 10.0 over L = 2
    # groups: 1 ms a group) re-simulates the 0.5 row with manage_ms; a policy without one keeps None
    from coldset.measure.cache import _manage_columns

    r5, r1 = dict(row, residency=0.5), {"step_ms_mean": 12.0, "residency": 1.0, "link_gb_per_token": 0.0}
    lf = dict(row, residency=0.5)
    for r in (r5, r1, lf):  # as run() does at each row
        r.update(_time_columns(r, 10.0, 50.0, B, acc, sim, 10**7))
    _manage_columns({"lru-0.5": (r5, sim), "lru-1.0": (r1, sim), "lfu-0.5": (lf, sim)}, 10.0, 50.0, B, acc, 10**7)
    managed = simulate_time(acc, sim, TimeModel(step_ms=10.0, bytes_per_expert=10**7, link_gb_s=50.0, link="share",
                                                join="step", manage_ms=1.0))
    assert r5["manage_ms_per_group"] == pytest.approx(1.0) and r5["sim_managed_step_ms"] == managed.step_ms
    assert r5["sim_managed_over_measured"] == pytest.approx(managed.step_ms / 10.5)
    assert managed.step_ms == pytest.approx(ts.step_ms + L * 1.0)
    assert lf["manage_ms_per_group"] is None and lf["sim_managed_step_ms"] is None
    # --in-order rows take their own residency-1.0 row (14.0 ms: 2 ms a group), the forked ones theirs (12.0)
    la, la_io, la1, la1_io = (dict(row, residency=0.5), dict(row, residency=0.5),
                              dict(r1), {"step_ms_mean": 14.0, "residency": 1.0, "link_gb_per_token": 0.0})
    la_ae, la1_ae = dict(row, residency=0.5), {"step_ms_mean": 16.0, "residency": 1.0, "link_gb_per_token": 0.0}
    la_af = dict(row, residency=0.5)
    _manage_columns({"lookahead-0.5 d4": (la, sim), "lookahead-0.5 d4 in-order": (la_io, sim),
                     "lookahead-1.0 d1": (la1, sim), "lookahead-1.0 d1 in-order": (la1_io, sim),
                     "lookahead-0.5 d1 list-after-experts": (la_ae, sim),
                     "lookahead-1.0 d1 list-after-experts": (la1_ae, sim),
                     "lookahead-0.5 d4 list-after-fill": (la_af, sim)},
                    10.0, 50.0, B, acc, 10**7)
    assert la["manage_ms_per_group"] == pytest.approx(1.0) and la_io["manage_ms_per_group"] == pytest.approx(2.0)
    assert la_ae["manage_ms_per_group"] == pytest.approx(3.0)  # --other-fork rows: their own (16.0 ms)
    assert la_af.get("manage_ms_per_group") is None  # no residency-1.0 row forks after the fill (depth 1 there)
    assert r5["sim_step_ms"] == ts.step_ms and r5["overlap"] == pytest.approx(1 - 0.5 / 3.0)  # the rest unchanged
    # the JSON names bench cache keeps (committed results, measure.render) for the shared bench.time_columns
    assert set(got) == {"overlap", "bound_ms", "fraction_of_bound", "sim_step_ms", "sim_over_measured",
                        "manage_ms_per_group", "sim_managed_step_ms", "sim_managed_over_measured"}


def test_cache_nexttoken_check_on_a_cpu_engine():
    """What ``bench cache`` checks for a nexttoken row, on the CPU engine: a cache built as the
    bench builds it (warm set = usage_global of the profile counts, forecaster by
    ``_fit_nexttoken`` on the profile routing), fed a held-out routing [steps, L, B, k] group by
    group; bench.simulate_engine_pass on the routing in the layout the bench passes accepts the
    recorded lists and gives the engine's per-group (hits, misses, fills, prefetches), which also
    equal coldset.analysis.simulate.simulate on the bench's own stream; its time columns come out.
    Each lane mostly takes its last experts' successors (a routing the forecast learns, so the
    prefetch gate, closed at first, opens)."""
    import numpy as np
    import torch

    from coldset.bench import decode as bn
    from coldset.analysis.simulate import simulate
    from coldset.analysis.streams import AccessStream, lanes_from_engine
    from coldset.analysis.forecast import nexttoken_lists
    from coldset.measure.cache import _fit_nexttoken, _time_columns
    from coldset.analysis.placement import hot_mask_usage_global, row_map_from_mask
    from coldset.engine.cache.pool import SlotCache
    from coldset.kernels.tiers import ExpertPools, host_tier

    S, L, B, k, E, C = 30, 3, 2, 2, 8, 9
    rng = np.random.default_rng(5)
    p = rng.dirichlet(np.ones(E) * 0.5, size=L)

    def draw(steps):
        out = np.array([[[rng.choice(E, k, replace=False, p=p[layer]) for _ in range(B)] for layer in range(L)]
                        for _ in range(steps)])
        for s in range(1, steps):  # w.p. 0.8 a lane's experts are its last ones plus one
            succ = rng.random((L, B)) < 0.8
            out[s][succ] = (out[s - 1][succ] + 1) % E
        return out

    prof, routing = draw(16), draw(S)
    counts = np.zeros((L, E))
    for layer in range(L):
        np.add.at(counts[layer], prof[:, layer].reshape(-1), 1)
    F = _fit_nexttoken(prof, k, E, 3, {})
    row_map = row_map_from_mask(hot_mask_usage_global(counts, C))
    flat = row_map.reshape(-1)
    hot = np.flatnonzero(flat >= 0)
    warm = np.empty(C)
    warm[flat[hot]] = counts.reshape(-1)[hot]
    g = torch.Generator().manual_seed(0)
    pools = ExpertPools.all_hot(torch.randn((L, E, 8, 4), generator=g), torch.randn((L, E, 4, 4), generator=g))
    for budget in (None, 1):
        cache = SlotCache.build(pools, host_tier(pools), row_map, warm, "nexttoken", B, k, forecaster=F,
                                prefetch_budget=budget)
        for s in range(S):
            for layer in range(L):
                cache.admit(layer, torch.as_tensor(routing[s, layer]))
        cache.end_step()
        decode = np.ascontiguousarray(routing.transpose(2, 0, 1, 3))
        sim = bn.simulate_engine_pass(cache, decode, forecaster=F)
        engine = np.concatenate([cache.group_history(), cache.prefetch_counts()[:, None]], axis=1)
        np.testing.assert_array_equal(engine, np.stack([sim.hits, sim.misses, sim.fills, sim.prefetches], axis=1))
        assert cache.counters()["stale"] == 0 and sim.prefetches.sum() > 0
        inst = (routing + (np.arange(L) * E)[None, :, None, None]).reshape(-1)
        acc = AccessStream(inst, np.arange(0, inst.size + 1, B * k), B * S, L, E)
        lanes = lanes_from_engine(decode, E)
        ref = simulate(acc, "nexttoken", C, counts, predictions=nexttoken_lists(F, lanes.sel, lanes.start),
                       prefetch_budget=budget)
        np.testing.assert_array_equal(ref.hit, sim.hit)
        np.testing.assert_array_equal(ref.prefetches, sim.prefetches)
        row = {"step_ms_mean": 3.5, "link_gb_per_token": sim.stats().link_gb_per_token(10**7)}
        cols = _time_columns(row, 3.0, 50.0, B, acc, sim, 10**7)
        assert cols["sim_step_ms"] >= 3.0 and cols["fraction_of_bound"] == pytest.approx(cols["bound_ms"] / 3.5)
        # a wrong layout (the recorded [steps, L, B, k] order) is refused, not simulated
        with pytest.raises(bn.CacheSimulatorMismatch):
            bn.simulate_engine_pass(cache, np.ascontiguousarray(routing.transpose(0, 2, 1, 3)), forecaster=F)


def test_cache_save_replays_arrays_are_the_simulators_lookahead_lists():
    """``bench cache --save-replays``: per batch the routing and, per kept depth below the layer
    count, lookahead_predictions' lists at k and k + 4 candidates (what simulate replays); the
    refusal beside --decisions-only: test_bad_arguments_are_named_before_cuda_is_asked."""
    import numpy as np
    import torch

    from coldset.analysis.forecast import lookahead_predictions
    from coldset.measure.cache import REPLAY_DEPTHS, _replay_arrays

    S, L, T, H, E, k = 3, 5, 2, 16, 6, 2
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(S, L, T, H, generator=g)
    routers = [torch.randn(E, H, generator=g) for _ in range(L)]
    routing = np.random.default_rng(0).integers(0, E, (S, L, T, k))
    got = _replay_arrays(2, routing, hidden, routers, k)
    depths = [d for d in REPLAY_DEPTHS if d < L]
    assert depths == [1, 2, 3, 4]
    assert set(got) == {"b2_routing"} | {f"b2_lookahead_d{d}_n{n}" for d in depths for n in (k, k + 4)}
    assert np.array_equal(got["b2_routing"], routing) and got["b2_routing"].dtype == np.int16
    for d in depths:
        for n in (k, k + 4):
            assert np.array_equal(got[f"b2_lookahead_d{d}_n{n}"], lookahead_predictions(hidden, routers, d, n))


def test_replay_chooses_policies_by_simulated_time_from_a_saved_run(tmp_path, capsys):
    """``bench replay`` on a folder as ``bench cache --save-replays`` leaves it (the arrays by
    _replay_arrays, the JSON's all-HBM, residency-1.0 and measured rows by hand): every row is
    simulate + simulate_time at the run's all-HBM step and link rate with the policy's management
    from its residency-1.0 row (or --manage-us; belady and the oracles, references fed the run's own
    selections, none and never a measured ratio; belady no more link bytes than lru), the
    measured ratio beside the same row; the nexttoken evict-only oracles (lists of the next H
    steps, brute force here, prefetch_budget 0) copy only their demand misses, never fewer than
    belady's; the table lists the fastest first; a folder without the npz is refused by name."""
    import json

    import numpy as np
    import torch

    from coldset.analysis.simulate import simulate
    from coldset.analysis.streams import AccessStream
    from coldset.analysis.time_model import TimeModel, simulate_time
    from coldset.cli import main
    from coldset.measure.cache import _replay_arrays
    from coldset.measure.harness import MeasureError
    from coldset.measure.replay import replay_table

    S, L, B, H, E, k = 24, 3, 1, 8, 6, 2
    g = torch.Generator().manual_seed(1)
    # a step's router inputs alike across its layers (a residual stream), each layer routing its own:
    # the lookahead lists (a later router on this input) mostly right, so the prefetch gate can open
    routers = [torch.randn(E, H, generator=g) for _ in range(L)]
    hidden = torch.randn(S, 1, B, H, generator=g) + 0.3 * torch.randn(S, L, B, H, generator=g)
    routing = np.stack([[[torch.topk(routers[layer] @ hidden[t, layer, b], k).indices.numpy() for b in range(B)]
                         for layer in range(L)] for t in range(S)])
    counts = np.bincount((routing[:4] + np.arange(L)[None, :, None, None] * E).reshape(-1),
                         minlength=L * E).reshape(L, E).astype(float)
    arrays = {"profile_counts": counts, "expert_bytes": np.array(10**6),
              **_replay_arrays(B, routing, hidden, routers, k)}
    np.savez_compressed(tmp_path / "cache_replays.npz", **arrays)
    result = {"ceilings": {"link_read_gb_s": 50.0}, "rows": [
        {"batch": 1, "placement": "all-HBM", "step_ms_mean": 1.0},
        {"batch": 1, "placement": "lru-1.0", "step_ms_mean": 1.3},
        {"batch": 1, "placement": "lookahead-1.0 d1", "step_ms_mean": 1.6},
        {"batch": 1, "placement": "lru-0.5", "step_ms_mean": 2.0}]}
    (tmp_path / "cache_bench.json").write_text(json.dumps(result))

    rows = replay_table(result, arrays, [0.5], {})
    keys = [(r["policy"], r["depth"], r["candidates"], r["oracle"], r["evict_horizon"]) for r in rows]
    assert len(keys) == len(set(keys)) and set(keys) == {
        ("lru", 0, None, False, None), ("lru_guard", 0, None, False, None), ("belady", 0, None, False, None),
        ("nexttoken", 0, None, True, None)} | {
        ("lookahead", d, n, False, None) for d in (1, 2) for n in (k, k + 4)} | {
        ("lookahead", d, None, True, None) for d in (1, 2)} | {("nexttoken", 0, None, True, h) for h in (1, 2, 4, 8)}
    inst = (routing + (np.arange(L) * E)[None, :, None, None]).reshape(-1)
    stream = AccessStream(inst, np.arange(0, inst.size + 1, B * k), S * B, L, E)
    belady = simulate(stream, "belady", 9, counts)
    for r in rows:
        if r["evict_horizon"]:  # layer l's experts at steps t + 1 .. t + H, no copy but the demand misses
            lists = _next_steps_lists(routing, E, r["evict_horizon"])
            res = simulate(stream, "nexttoken", 9, counts, predictions=lists, prefetch_budget=0)
            assert res.stats().prefetches == 0 and res.misses.sum() >= belady.misses.sum()
            want = simulate_time(stream, res, TimeModel(1.0, 10**6, 50.0, link="share", join="step"))
            assert r["manage_us"] == 0.0 and r["measured_x_all_hbm"] is None
            assert r["step_ms"] == pytest.approx(want.step_ms) and r["hit_rate"] == pytest.approx(res.stats().hit_rate)
            continue
        if r["oracle"]:  # the experts the run selected: layer l + d of the step, or layer l of the next step
            lists = np.full((S, L, B * k), -1)
            for t in range(S):
                for layer in range(L):
                    src = (t, layer + r["depth"]) if r["depth"] else (t + 1, layer)
                    if src[0] < S and src[1] < L:
                        lists[t, layer] = routing[src].reshape(-1) + src[1] * E
            lists = lists.reshape(S * L, B * k)
        else:
            lists = arrays[f"b1_lookahead_d{r['depth']}_n{r['candidates']}"] if r["policy"] == "lookahead" else None
        # (1.3 - 1.0) / 3 layers, (1.6 - 1.0) / 3; belady and the oracles, references: none
        manage_ms = 0.0 if r["oracle"] else {"lru": 0.1, "lru_guard": 0.1, "lookahead": 0.2, "belady": 0.0}[r["policy"]]
        want = simulate_time(stream, simulate(stream, r["policy"], 9, counts, predictions=lists),
                             TimeModel(1.0, 10**6, 50.0, link="share", join="step", manage_ms=manage_ms))
        assert r["manage_us"] == pytest.approx(manage_ms * 1e3)
        assert r["step_ms"] == pytest.approx(want.step_ms) and r["x_all_hbm"] == pytest.approx(1.0 / want.step_ms)
        assert r["measured_x_all_hbm"] == (pytest.approx(0.5) if r["policy"] == "lru" else None)
    per_use = replay_table(result, arrays, [0.5], {}, join="use")  # the wait only where a copy is selected
    oracle = next(r for r in per_use if r["policy"] == "nexttoken")
    lists = np.full((S, L, B * k), -1)
    lists[:-1] = routing[1:].reshape(S - 1, L, B * k) + (np.arange(L) * E)[None, :, None]
    want = simulate_time(stream, simulate(stream, "nexttoken", 9, counts, predictions=lists.reshape(S * L, B * k)),
                         TimeModel(1.0, 10**6, 50.0, link="share", join="use"))
    assert oracle["step_ms"] == pytest.approx(want.step_ms)
    cheap = replay_table(result, arrays, [0.5], {"lookahead": 0.0})
    assert all(c["manage_us"] == 0.0 and c["step_ms"] < r["step_ms"] for c, r in zip(cheap, rows)
               if c["policy"] == "lookahead" and not c["oracle"])

    # the gate unit: the run's recorded one where its JSON has it, else the default; --gate-unit measured the
    # replay's time model's; --expert-bytes: the same routing with other experts (no measured column)
    from coldset.analysis.policies.base import prefetch_lead_unit

    assert all(r["lead_unit"] is None for r in rows)  # this JSON records none: the policies' default
    lists = arrays["b1_lookahead_d2_n2"]
    default = simulate(stream, "lookahead", 9, counts, predictions=lists)
    for unit, extra, per, result_ in ((7, {}, 10**6, {**result, "lead_unit": {"1": 7}}),
                                      (prefetch_lead_unit(1.0, 0.1, L, 5e7 / 50e9 * 1e3), {"gate_unit": "measured",
                                       "expert_bytes": 5 * 10**7}, 5 * 10**7, result)):
        got = next(r for r in replay_table(result_, arrays, [0.5], {}, **extra)
                   if (r["policy"], r["depth"], r["candidates"], r["oracle"]) == ("lookahead", 2, k, False))
        gated = simulate(stream, "lookahead", 9, counts, predictions=lists, lead_unit=unit)
        assert gated.stats().prefetches != default.stats().prefetches  # the unit decides here
        want = simulate_time(stream, gated, TimeModel(1.0, per, 50.0, link="share", join="step", manage_ms=0.2))
        assert got["lead_unit"] == unit and got["step_ms"] == pytest.approx(want.step_ms)
        assert got["measured_x_all_hbm"] is None and got["link_gb_per_token"] == pytest.approx(want.link_gb_per_token)
    with pytest.raises(MeasureError, match="recorded its gate unit for its own experts"):  # another size's unit
        replay_table({**result, "lead_unit": {"1": 7}}, arrays, [0.5], {}, expert_bytes=5 * 10**7)

    assert main(["bench", "replay", str(tmp_path), "--residencies", "0.5"]) == 0
    text = capsys.readouterr().out
    order = [line.split("|")[1].strip() for line in text.splitlines()
             if line.startswith(("| lru", "| lookahead", "| belady", "| nexttoken"))]
    by_time = sorted(rows, key=lambda r: r["step_ms"])
    assert order == [("belady (offline reference)" if r["policy"] == "belady" else
                      f"nexttoken oracle evict h{r['evict_horizon']}" if r["evict_horizon"] else
                      r["policy"] + " oracle" + (f" d{r['depth']}" if r["depth"] else "") if r["oracle"] else
                      r["policy"] + (f" d{r['depth']} n{r['candidates']}" if r["depth"] else "")) for r in by_time]
    belady, lru = (next(r for r in rows if r["policy"] == p) for p in ("belady", "lru"))
    assert belady["link_gb_per_token"] <= lru["link_gb_per_token"]  # the offline optimum's copies
    (tmp_path / "cache_replays.npz").unlink()
    assert main(["bench", "replay", str(tmp_path)]) == 1
    assert "cache_replays.npz: no such file" in capsys.readouterr().err


def _next_steps_lists(routing, num_experts, horizon):
    """Brute force: after group (t, l), the instances of layer l at steps t + 1 .. t + horizon, one
    block of B * k per step in step order, -1 past the last step."""
    import numpy as np

    S, L, B, k = routing.shape
    out = np.full((S * L, horizon * B * k), -1)
    for t in range(S):
        for layer in range(L):
            row = []
            for j in range(1, horizon + 1):
                row += ([int(e) + layer * num_experts for e in routing[t + j, layer].reshape(-1)] if t + j < S
                        else [-1] * (B * k))
            out[t * L + layer] = row
    return out


def test_oracle_lists_horizon_against_brute_force():
    """``oracle_lists(..., None, H)``: the next H steps' experts of the same layer, exactly as the
    brute force lays them out (also H past the replay's end); H = 1 is the next-token oracle's lists
    unchanged; a horizon below 1, not an integer, or beside a depth is refused."""
    import numpy as np

    from coldset.measure.replay import oracle_lists

    S, L, B, E, k = 5, 3, 2, 7, 2
    rng = np.random.default_rng(3)
    routing = np.stack([[[rng.choice(E, k, replace=False) for _ in range(B)] for _ in range(L)]
                        for _ in range(S)]).astype(np.int16)
    for h in (1, 2, 3, 4, 8):
        got = oracle_lists(routing, E, None, h)
        assert got.dtype == np.int64 and np.array_equal(got, _next_steps_lists(routing, E, h))
    next_step = np.full((S, L, B * k), -1)
    next_step[:-1] = routing[1:].reshape(S - 1, L, B * k) + (np.arange(L) * E)[None, :, None]
    assert np.array_equal(oracle_lists(routing, E, None), next_step.reshape(S * L, B * k))
    assert np.array_equal(oracle_lists(routing, E, None, 1), oracle_lists(routing, E, None))
    for depth, h in ((None, 0), (None, 1.5), (1, 2)):
        with pytest.raises(ValueError, match="horizon"):
            oracle_lists(routing, E, depth, h)


def test_idle_time_is_the_uncovered_part_of_the_span():
    """kernel_profile's idle time, against a brute-force count on a 1-unit grid: unsorted,
    overlapping, nested and touching spans."""
    from coldset.measure.harness import idle_time

    spans = [(10, 14), (0, 3), (2, 5), (20, 30), (22, 25), (14, 16), (31, 32)]
    covered = {t for a, b in spans for t in range(a, b)}
    brute = sum(1 for t in range(0, 32) if t not in covered)
    assert idle_time(spans) == brute == 10  # 5-10, 16-20, 30-31
    assert idle_time([]) == 0.0 and idle_time([(3, 9)]) == 0.0


def test_render_cache_decode_length_table_divides_all_hbm_of_the_same_length():
    """Rows with step_ms_by_length (JSON string keys) get an x all-HBM table by decode length:
    all-HBM's first-n mean over the row's first-n mean, '-' where a row lacks a length."""
    from coldset.measure.render import render_cache

    res = json.loads((ROOT / "docs" / "measurements" / "cache_bench_fit_b1.json").read_text())
    assert "x all-HBM by decode length" not in render_cache(res)  # older results render as before
    res["rows"] = res["rows"][:3]
    res["rows"][0]["step_ms_by_length"] = {"8": 3.0, "16": 3.0}
    res["rows"][1]["step_ms_by_length"] = {"8": 12.0, "16": 6.0}
    res["rows"][2]["step_ms_by_length"] = {"8": 4.0}
    text = render_cache(res)
    assert "| batch | placement | first 8 | first 16 |" in text
    assert f"| 1 | {res['rows'][1]['placement']} | 0.250 | 0.500 |" in text
    assert f"| 1 | {res['rows'][2]['placement']} | 0.750 | - |" in text


def test_render_cache_profile_table_reads_each_rows_profile():
    """--profile rows get a kernel table: each cell is that row's own kernel time and count."""
    from coldset.measure.render import render_cache

    path = ROOT / "docs" / "measurements" / "cache_profile_r1.json"
    res = json.loads(path.read_text())
    text = render_cache(res)
    lines = [ln for ln in text.splitlines() if ln.startswith("| 1 | lookahead-1.0 d1 |")]
    assert len(lines) == 2  # the cache table's row and the profile table's row
    row = next(r for r in res["rows"] if r["placement"] == "lookahead-1.0 d1")
    route = next(t for t in row["profile"]["top"] if t["name"] == "_route_kernel")
    assert f"{route['us_per_step']:.0f} ({route['per_step']:.0f})" in lines[1]
    assert f"| {row['profile']['idle_us_per_step']:.0f} |" in lines[1]
    del res["rows"][0]["profile"]  # a row without a profile is left out of the table, not rendered as zeros
    assert "| 1 | all-HBM | 442 |" not in render_cache(res)
