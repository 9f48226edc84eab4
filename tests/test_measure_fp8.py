"""``bench step`` and ``bench cache`` with ``--weight-format fp8``, on the CPU: the
argument checks (bad combinations refused by name before CUDA is asked), the in-memory model's
FP8 pools (:func:`coldset.measure.harness.fp8_expert_pools`) against coldset.core.fp8's dequantization,
block scales computed here block by block and float64 error bounds, the bf16 / FP8 step ratio
from hand-made rows, and the renderer's exact markdown of hand-made results; on a GPU (marked),
both commands on the small synthetic model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from coldset.core import fp8
from coldset.cli import main
from coldset.measure.cli import build_parser
from coldset.measure.harness import MeasureError, expert_format, fp8_expert_pools
from coldset.measure.render import render
from coldset.kernels.tiers import ExpertPools, host_tier

PROV = {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "commit": "0123456789abcdef", "dirty": False}


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_weight_format_defaults_to_bf16_and_takes_only_bf16_or_fp8(capsys):
    p = build_parser()
    for cmd in ("step", "cache"):
        assert p.parse_args([cmd, "--out", "o"]).weight_format == "bf16"
        assert p.parse_args([cmd, "--out", "o", "--weight-format", "fp8"]).weight_format == "fp8"
        with pytest.raises(SystemExit):
            p.parse_args([cmd, "--out", "o", "--weight-format", "mxfp4"])
        assert "invalid choice: 'mxfp4'" in capsys.readouterr().err
    assert p.parse_args(["step", "--out", "o"]).tuned_fp8 is None and not p.parse_args(["step", "--out", "o"]).tune_fp8
    with pytest.raises(SystemExit):
        p.parse_args(["step", "--out", "o", "--tune-fp8", "--tuned-fp8", "t.json"])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["step", "--tuned-fp8", "t.json"], "--tuned-fp8 t.json needs --weight-format fp8"),
    (["step", "--weight-format", "fp8", "--tune", "--tuned-fp8", "t.json"], "--tune tunes the FP8 kernel too"),
    (["step", "--weight-format", "fp8", "--tune", "--tune-fp8"], "--tune-fp8 with --tune"),
    (["step", "--tune-fp8"], "--tune-fp8 needs --weight-format fp8"),
    (["step", "--weight-format", "fp8", "--tuned-fp8", "{tmp}/none.json"], "none.json: no such file"),
    (["step", "--weight-format", "fp8", "--tuned", "config/examples/h200-tuned/decode_step_tuned.json",
      "--baseline-module", "src/coldset/kernels/triton_moe.py", "--engines", "fused,fused@base"],
     "does not run with --weight-format fp8"),
    (["step", "--tuned", "{tmp}/none.json"], "--tuned {tmp}/none.json: no such file"),
    (["step", "--weight-format", "fp8", "--engines", "fused,turbo"], "unknown engine 'turbo'"),
    (["cache", "--decisions-only", "--weight-format", "fp8"], "--weight-format fp8 does not apply"),
    (["cache", "--weight-format", "fp8", "--residencies", "0.25,1.5"], "each must be in (0, 1]"),
])
def test_bad_combinations_are_named_before_cuda_is_asked(args, message, tmp_path, capsys, no_cuda):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = tmp_path / "out"
    assert main(["bench", *args, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert message.replace("{tmp}", str(tmp_path)) in err and "CUDA" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("command", [["step", "--weight-format", "fp8"],
                                     ["step", "--weight-format", "fp8", "--tune-fp8", "--tuned",
                                      "config/examples/h200-tuned/decode_step_tuned.json"],
                                     ["step", "--weight-format", "fp8", "--tuned-fp8",
                                      "config/examples/h200-tuned/decode_step_tuned.json"],
                                     ["cache", "--weight-format", "fp8", "--residencies", "0.25,0.5,0.75"]])
def test_fp8_commands_refuse_cleanly_without_cuda(command, tmp_path, capsys, no_cuda):
    out = tmp_path / "out"
    assert main(["bench", *command, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"coldset bench {command[0]}: needs a CUDA GPU") and "Traceback" not in err
    assert not out.exists()


def test_expert_format_gives_the_published_bytes_an_expert():
    """At Qwen3-30B-A3B's shape (the H200 config): bf16 9,437,184 B, block-FP8 with scales 4,719,744 B (NOTES.md)."""
    import yaml

    from coldset.analysis.placement import expert_bytes
    from coldset.engine.synthetic import SyntheticSpec, synthetic_model_config

    with open("config/examples/qwen3-30b-a3b-h200.yaml") as f:
        cfg = synthetic_model_config(SyntheticSpec(**yaml.safe_load(f)["model"]["synthetic"]))
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    assert expert_bytes(cfg, expert_format("bf16")) == 3 * H * I * 2 == 9_437_184
    scales = (2 * math.ceil(I / 128) * math.ceil(H / 128) + math.ceil(H / 128) * math.ceil(I / 128)) * 4
    assert expert_bytes(cfg, expert_format("fp8")) == 3 * H * I + scales == 4_719_744
    with pytest.raises(MeasureError, match="'int4' not among bf16, fp8"):
        expert_format("int4")


def _pools(L=2, E=3, I=160, H=200, dtype=torch.bfloat16, seed=0):
    """All-hot pools of a tiny shape whose I and H leave partial 128-blocks; one expert zero (scale 1)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn((L, E, 2 * I, H), generator=g) * torch.logspace(-3, 1, H)  # blocks of unlike magnitudes
    w2 = torch.randn((L, E, H, I), generator=g) / 7
    w13[1, 2] = 0
    return ExpertPools.all_hot(w13.to(dtype), w2.to(dtype))


def _block_scales(w: torch.Tensor) -> torch.Tensor:
    """``weight_scale_inv`` of one ``[rows, cols]`` weight, block by block: max|w| / 448 in float32,
    1 for a zero block."""
    rows, cols = w.shape
    out = torch.empty((math.ceil(rows / 128), math.ceil(cols / 128)), dtype=torch.float32)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            amax = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float().abs().max()
            out[i, j] = amax / 448 if amax > 0 else 1.0
    return out


def test_fp8_expert_pools_against_block_scales_and_float64():
    """Every expert of the converted pools: all-hot layout (row = layer * E + expert), scales equal
    to max|block| / 448 computed here (w13: gate's grid then up's), and its dequantization
    (coldset.core.fp8's) within e4m3's rounding of the bf16 weight in float64 (half an ulp: 2^-4 of the
    value for normals, 2^-10 of the scale for subnormals); the layer-by-layer conversion is
    bitwise quantize_w13 / quantize_weight of the whole model at once."""
    pools = _pools()
    L, E = pools.num_moe_layers, pools.num_experts
    I, H = pools.w2_hot.shape[2], pools.w2_hot.shape[1]
    got = fp8_expert_pools(pools)
    assert got.is_fp8 and got.num_cold == 0 and got.num_hot == L * E
    assert torch.equal(got.row_map.reshape(-1), torch.arange(L * E, dtype=torch.int32))
    assert got.w13_hot.dtype == fp8.FP8_DTYPE and got.w13_scale_hot.shape == (L * E, 4, 2)
    assert got.w2_scale_hot.shape == (L * E, 2, 2)
    for layer in range(L):
        for e in range(E):
            w13, w2 = (w.double() for w in pools.expert_weights(layer, e))
            q13, q2 = got.expert_weights(layer, e)
            s13, s2 = got.expert_scales(layer, e)
            assert torch.equal(s13, torch.cat([_block_scales(w13[:I]), _block_scales(w13[I:])]))
            assert torch.equal(s2, _block_scales(w2))
            scale13 = torch.cat([fp8.expand_scales(s13[:2], I, H), fp8.expand_scales(s13[2:], I, H)])  # per element
            for w, deq, s in ((w13, fp8.dequantize_w13(q13, s13, torch.float64), scale13),
                              (w2, fp8.dequantize_weight(q2, s2, torch.float64), fp8.expand_scales(s2, H, I))):
                bound = w.abs() * 2.0**-4 + s.double() * 2.0**-10
                assert ((deq - w).abs() <= bound * (1 + 1e-6)).all(), (layer, e)
    assert torch.equal(got.expert_scales(1, 2)[0], torch.ones_like(s13)) and not got.w13_hot[5].float().any()
    (q13, s13), (q2, s2) = fp8.quantize_w13(pools.w13_hot.view(L, E, 2 * I, H)), fp8.quantize_weight(
        pools.w2_hot.view(L, E, H, I))
    assert torch.equal(got.w13_hot.view(torch.uint8), q13.reshape(L * E, 2 * I, H).view(torch.uint8))
    assert torch.equal(got.w2_hot.view(torch.uint8), q2.reshape(L * E, H, I).view(torch.uint8))
    assert torch.equal(got.w13_scale_hot, s13.reshape(L * E, 4, 2))
    assert torch.equal(got.w2_scale_hot, s2.reshape(L * E, 2, 2))


def test_fp8_expert_pools_run_the_engine_and_fill_the_host_tier():
    """The converted pools are what the engine and the cache take: the torch experts path on them
    (the FP8 kernel's semantics) against float64 experts on the dequantized weights, and a host tier
    of them carries the scales (FP8 bytes an expert: weights + scales)."""
    from coldset.kernels import torch_experts

    L, E, I, H = 2, 4, 128, 256
    pools = _pools(L, E, I, H, torch.float32, seed=1)
    got = fp8_expert_pools(pools)
    g = torch.Generator().manual_seed(2)
    x = torch.randn((5, H), generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(5)])
    w = torch.rand((5, 2), generator=g)
    out = torch_experts(got, 1, x, ids, w)
    ref = torch.zeros((5, H), dtype=torch.float64)
    for t in range(5):
        for j in range(2):
            q13, q2 = got.expert_weights(1, int(ids[t, j]))
            s13, s2 = got.expert_scales(1, int(ids[t, j]))
            gu = fp8.dequantize_w13(q13, s13, torch.float64) @ x[t].double()
            act = torch.nn.functional.silu(gu[:I]) * gu[I:]
            ref[t] += w[t, j].double() * (fp8.dequantize_weight(q2, s2, torch.float64) @ act)
    # activations quantized per group of 128 (e4m3: 2^-4 relative) at two points: a few percent
    assert (out.double() - ref).norm() / ref.norm() < 0.05
    host = host_tier(got)
    assert host.w13_scale is not None and torch.equal(host.w13_scale, got.w13_scale_hot)
    assert host.nbytes == L * E * (3 * H * I + (got.w13_scale_hot[0].numel() + got.w2_scale_hot[0].numel()) * 4)


def test_fp8_expert_pools_refusals():
    pools = _pools()
    with pytest.raises(MeasureError, match="already hold block-FP8"):
        fp8_expert_pools(fp8_expert_pools(pools))
    import numpy as np

    from coldset.analysis.placement import hot_mask_usage_global, row_map_from_mask

    placed = pools.placed(row_map_from_mask(hot_mask_usage_global(np.arange(6.0).reshape(2, 3), 3)))
    with pytest.raises(ValueError, match="needs the all-hot layout"):
        fp8_expert_pools(placed)


def test_fp8_speedup_from_rows():
    """bf16 step / FP8 step per engine and batch from the rows (median over median, range slowest
    over fastest), floors' ratio; the step without experts and engines timed in one format only
    are left out; JSON's string batch keys read alike."""
    from coldset.measure.step import fp8_speedup

    def row(mode, fmt, b, runs, experts="full"):
        return {"mode": mode, "weight_format": fmt, "batch": b, "experts": experts,
                "step_ms_spread": {"median": sorted(runs)[1], "min": min(runs), "max": max(runs), "runs": runs}}

    rows = [row("fused", "bf16", 1, [2.7, 2.6, 2.8]), row("fused", "bf16", 1, [1.3, 1.3, 1.3], "no_experts"),
            row("fused", "fp8", 1, [1.8, 1.75, 2.0]), row("eager", "bf16", 1, [5.0, 5.0, 5.0])]
    got = fp8_speedup(rows, {"1": {"floor_ms": 1.35}}, {1: {"floor_ms": 0.9}})
    assert list(got) == ["fused/b1"]
    assert got["fused/b1"]["bf16_over_fp8"] == pytest.approx(2.7 / 1.8)
    assert got["fused/b1"]["range"] == pytest.approx([2.6 / 2.0, 2.8 / 1.75])
    assert got["fused/b1"]["floor_ratio"] == pytest.approx(1.5)



def _row(mode, fmt, batch, experts, runs, floor=None):
    med = sorted(runs)[len(runs) // 2]
    r = {"mode": mode, "weight_format": fmt, "batch": batch, "experts": experts,
         "step_ms": med, "step_ms_spread": {"median": med, "min": min(runs), "max": max(runs), "runs": runs},
         "tok_s": batch * 1e3 / med, "profile": {"kernels_per_step": 300.0}}
    if floor is not None:
        r.update(floor_ms=floor, fraction_of_floor=floor / med,
                 fraction_of_floor_range=[floor / max(runs), floor / min(runs)])
    return r


STEP_FP8 = {
    "kind": "step", "command": "python -m coldset bench step --out o --engines fused --weight-format fp8",
    "date": "2026-12-01 20:00 UTC", "provenance": PROV, "args": {"reps": 50, "rounds": 3},
    "hbm_read_GBps": 4500.0, "expert_bytes": {"bf16": 9437184, "fp8": 4719744},
    "fp8_configs_from": "triton_fp8.default_config",
    "floor": {"1": {"floor_ms": 1.35, "bytes_per_step": 6.08e9}, "8": {"floor_ms": 4.2, "bytes_per_step": 18.9e9}},
    "floor_fp8": {"1": {"floor_ms": 0.95, "bytes_per_step": 4.27e9}, "8": {"floor_ms": 2.3, "bytes_per_step": 10.35e9}},
    "rows": [_row("fused", "bf16", 1, "full", [2.7, 2.6, 2.8], 1.35),
             _row("fused", "bf16", 1, "no_experts", [1.3, 1.3, 1.3]),
             _row("fused", "bf16", 8, "full", [6.0, 6.2, 6.4], 4.2),
             _row("fused", "fp8", 1, "full", [1.8, 1.75, 2.0], 0.95),
             _row("fused", "fp8", 8, "full", [4.0, 4.0, 4.0], 2.3)],
    "fp8_speedup": {"fused/b1": {"bf16_over_fp8": 2.7 / 1.8, "range": [2.6 / 2.0, 2.8 / 1.75], "floor_ratio": 1.35 / 0.95},
                    "fused/b8": {"bf16_over_fp8": 6.2 / 4.0, "range": [6.0 / 4.0, 6.4 / 4.0], "floor_ratio": 4.2 / 2.3}},
    "checks": {"fused/b1": {"token_match": 1.0, "max_abs_logit_diff": 0.0},
               "fused fp8/b1": {"token_match": 1.0, "max_abs_logit_diff": 0.0}},
    "checks_against": "fused",
    "fp8_vs_bf16": {"fused/b1": {"token_match": 0.875, "max_abs_logit_diff": 0.75}},
}


CACHE_FP8 = {
    "kind": "cache", "command": "python -m coldset bench cache --out o --weight-format fp8",
    "date": "2026-12-01 20:10 UTC",
    "provenance": PROV, "model": "qwen3-30b-a3b-synthetic", "router": "synthetic router",
    "args": {"steps": 32, "repeats": 2, "prefetch_budget": None},
    "ceilings": {"hbm_read_gb_s": 4500.0, "link_read_gb_s": 51.0}, "fails": [], "weight_format": "fp8",
    "expert_bytes": 4719744,
    "rows": [
        {"batch": 1, "placement": "all-HBM", "residency": 1.0, "step_ms_mean": 2.0, "tok_s": 500.0, "hit_rate": 1.0,
         "misses_per_token": 0.0, "link_gb_per_token": 0.0,
         "step_ms_mean_spread": {"median": 2.0, "min": 1.9, "max": 2.1, "runs": [1.9, 2.0, 2.1]}},
        {"batch": 1, "placement": "usage_global-0.5", "residency": 0.5, "step_ms_mean": 5.0, "tok_s": 200.0,
         "hit_rate": 0.88, "misses_per_token": 46.0, "link_gb_per_token": 0.22,
         "step_ms_mean_spread": {"median": 5.0, "min": 5.0, "max": 5.0, "runs": [5.0, 5.0]}},
        {"batch": 1, "placement": "lru-0.5", "residency": 0.5, "step_ms_mean": 4.0, "tok_s": 250.0, "hit_rate": 0.95,
         "sim_hit_rate": 0.95, "misses_per_token": 19.0, "prefetches_per_token": 0.0,
         "wasted_prefetches_per_token": 0.0, "link_gb_per_token": 0.085, "overlap": 0.2, "fraction_of_bound": 0.5,
         "sim_over_measured": 0.97,
         "step_ms_mean_spread": {"median": 4.0, "min": 3.9, "max": 4.1, "runs": [3.9, 4.0, 4.1]}},
    ],
}


STEP_FP8_MD = """\
**Decode step, block-FP8 experts beside bf16 (all in HBM, one process)** · NVIDIA H200 · torch 2.11.0, triton \
3.6.0 · commit 0123456789 · 2026-12-01 20:00 UTC

`python -m coldset bench step --out o --engines fused --weight-format fp8`

HBM read ceiling in this run 4500 GB/s; bytes floor per step: bf16 experts (9.44 MB an expert) b1 1.350 ms \
(6.08 GB), b8 4.200 ms (18.90 GB); block-FP8 experts (4.72 MB an expert with its scales) b1 0.950 ms (4.27 \
GB), b8 2.300 ms (10.35 GB). Step ms: median of 3 rounds of 50 calls (min-max).

The FP8 experts are the same model's bf16 experts quantized to 128 x 128 blocks \
(coldset.measure.harness.fp8_expert_pools); non-expert weights bf16 in both; FP8 kernel configs: \
triton_fp8.default_config.

| engine | experts format | batch | experts | step ms | tok/s | floor ms | of floor | kernels/step |
|---|---|---|---|---|---|---|---|---|
| fused | bf16 | 1 | full | 2.700 (2.600-2.800) | 370.4 | 1.350 | 50.0% (48.2-51.9%) | 300 |
| fused | bf16 | 1 | no_experts | 1.300 (1.300-1.300) | 769.2 | - | - | 300 |
| fused | bf16 | 8 | full | 6.200 (6.000-6.400) | 1290.3 | 4.200 | 67.7% (65.6-70.0%) | 300 |
| fused | fp8 | 1 | full | 1.800 (1.750-2.000) | 555.6 | 0.950 | 52.8% (47.5-54.3%) | 300 |
| fused | fp8 | 8 | full | 4.000 (4.000-4.000) | 2000.0 | 2.300 | 57.5% (57.5-57.5%) | 300 |

| engine / batch | bf16 step / FP8 step (range over rounds) | bf16 floor / FP8 floor |
|---|---|---|
| fused/b1 | 1.500x (1.300-1.600) | 1.421x |
| fused/b8 | 1.550x (1.500-1.600) | 1.826x |

Against fused of the same format: fused/b1 tokens 1.000, max logit diff 0; fused fp8/b1 tokens 1.000, max \
logit diff 0

FP8 against bf16, the same engine (other weights: reported, not checked): fused/b1 tokens 0.875, max logit \
diff 0.75"""


CACHE_FP8_MD = """\
**Slot cache and lookahead prefetch, block-FP8 experts** · NVIDIA H200 · torch 2.11.0, triton 3.6.0 · commit \
0123456789 · 2026-12-01 20:10 UTC

`python -m coldset bench cache --out o --weight-format fp8`

qwen3-30b-a3b-synthetic, 32 decode steps x 2 timed passes (+1 checked), held-out fixture prompts, synthetic \
router. Ceilings in this run: HBM read 4500 GB/s, link read 51.0 GB/s. Checks: all passed.

Experts: block-FP8 (e4m3, 128 x 128 scales) in every tier, 4.72 MB an expert with its scales; all-HBM (the \
bitwise reference) runs the same kernel all hot.

| batch | placement | tok/s | x usage_global | x all-HBM | hit rate | sim hit | misses/token | \
prefetches/token | link GB/token | mean step ms (min-max of passes) | wasted prefetches/token | overlap | of \
bound | simulated / measured step |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
| 1 | all-HBM | 500.0 | - | 1.000 | 1.0000 | - | 0.00 | - | 0.0000 | 2.000 (1.900-2.100) | - | - | - | - |
| 1 | usage_global-0.5 | 200.0 | 1.00 | 0.400 | 0.8800 | - | 46.00 | - | 0.2200 | 5.000 (5.000-5.000) | - | - \
| - | - |
| 1 | lru-0.5 | 250.0 | 1.25 | 0.500 | 0.9500 | 0.9500 | 19.00 | 0.00 | 0.0850 | 4.000 (3.900-4.100) | 0.00 | \
0.20 | 0.50 | 0.970 |

overlap = 1 - (step - all-HBM step) / link time; bound = max(all-HBM step, link time); simulated: \
time_model.simulate_time."""



def test_render_step_fp8_exact_markdown():
    """The format column, each format's floor with its bytes an expert, the ratio table and both
    kinds of token comparison; a bf16-only result renders without them."""
    assert render(STEP_FP8) == STEP_FP8_MD
    bf16_only = {**STEP_FP8, "rows": [{k: v for k, v in r.items() if k != "weight_format"}
                                      for r in STEP_FP8["rows"] if r["weight_format"] == "bf16"]}
    for key in ("floor_fp8", "fp8_speedup", "fp8_vs_bf16", "expert_bytes"):
        del bf16_only[key]
    text = render(bf16_only)
    assert "FP8" not in text and "experts format" not in text and "| fused | 1 | full | 2.700" in text
    # --tune-fp8 keeps every candidate's time: a table, fastest at the first batch first, "-" where unmeasured
    won, lost = (json.dumps(dict(block_n1=n, num_warps=4, pdl=2, **q)) for n, q in ((32, {}), (128, {"quant_x": 1})))
    tuned = render({**STEP_FP8, "fp8_tune_timings_us": {"1": {lost: 30.25, won: 24.0}, "8": {won: 40.0}}})
    assert ("| config | b1 | b8 |\n|---|---|---|\n| n1=32 w=4 pdl=2 | 24.0 | 40.0 |\n"
            "| n1=128 w=4 pdl=2 qx=1 | 30.2 | - |") in tuned


def test_render_cache_fp8_exact_markdown():
    assert render(CACHE_FP8) == CACHE_FP8_MD
    old = {k: v for k, v in CACHE_FP8.items() if k not in ("weight_format", "expert_bytes")}  # before the option
    assert "Experts:" not in render(old) and "FP8" not in render(old)


@pytest.mark.gpu
def test_fp8_expert_pools_on_the_gpu_within_e4m3_rounding():
    """Quantized on the GPU (as the commands do): the scales are the CPU's (max|block| / 448, within
    one float32 ulp), and every weight dequantizes to within e4m3's rounding of the bf16 weight
    (the CPU test's bound). Not bit for bit the CPU's bytes: on the H200 the w13 weights' bytes
    differ (this shape has values subnormal in e4m3 after scaling)."""
    pools = _pools()
    L, E = pools.num_moe_layers, pools.num_experts
    cpu = fp8_expert_pools(pools)
    gpu = fp8_expert_pools(ExpertPools.all_hot(pools.w13_hot.view(2, 3, 320, 200).cuda(),
                                               pools.w2_hot.view(2, 3, 200, 160).cuda()))
    for name in ("w13_scale_hot", "w2_scale_hot"):
        torch.testing.assert_close(getattr(gpu, name).cpu(), getattr(cpu, name), rtol=2.0**-23, atol=0)
    I, H = pools.w2_hot.shape[2], pools.w2_hot.shape[1]
    for layer in range(L):
        for e in range(E):
            w13, w2 = (w.double() for w in pools.expert_weights(layer, e))
            q13, q2 = (w.cpu() for w in gpu.expert_weights(layer, e))
            s13, s2 = (s.cpu() for s in gpu.expert_scales(layer, e))
            scale13 = torch.cat([fp8.expand_scales(s13[:2], I, H), fp8.expand_scales(s13[2:], I, H)])
            for w, deq, s in ((w13, fp8.dequantize_w13(q13, s13, torch.float64), scale13),
                              (w2, fp8.dequantize_weight(q2, s2, torch.float64), fp8.expand_scales(s2, H, I))):
                bound = w.abs() * 2.0**-4 + s.double() * 2.0**-10
                assert ((deq - w).abs() <= bound * (1 + 1e-6)).all(), (layer, e)


@pytest.mark.gpu
def test_step_and_cache_fp8_on_the_gpu(tmp_path, capsys):
    """Both commands on the small synthetic model (config/examples/gpu-smoke.yaml), few repeats: the
    table printed is the JSON's rendering; step has bf16 and FP8 rows of one engine, a floor each
    (FP8's below bf16's), the ratio, FP8 tokens equal across the engine's own check; cache's checks
    (bitwise against FP8 all-HBM, engine = simulator) pass at the FP8 bytes an expert."""
    out = tmp_path / "s"
    assert main(["bench", "step", "--config", "config/examples/gpu-smoke.yaml", "--out", str(out), "--engines",
                 "eager", "--reps", "2", "--rounds", "1", "--weight-format", "fp8"]) == 0
    res = json.loads((out / "decode_step.json").read_text())
    assert capsys.readouterr().out == "\n" + render(res) + "\n"
    assert {(r["weight_format"], r["batch"], r["experts"]) for r in res["rows"]} == {
        ("bf16", 1, "full"), ("bf16", 1, "no_experts"), ("bf16", 8, "full"), ("fp8", 1, "full"), ("fp8", 8, "full")}
    for b in ("1", "8"):
        assert res["floor_fp8"][b]["expert_bytes_per_step"] < res["floor"][b]["expert_bytes_per_step"]
    assert set(res["fp8_speedup"]) == {"eager/b1", "eager/b8"} and not res.get("errors")
    assert res["checks"]["eager fp8/b1"]["token_match"] == 1.0
    out = tmp_path / "c"
    assert main(["bench", "cache", "--config", "config/examples/gpu-smoke.yaml", "--out", str(out), "--steps", "4",
                 "--repeats", "1", "--residencies", "0.5", "--batches", "1", "--policies", "lru,lookahead",
                 "--depths", "1", "--weight-format", "fp8"]) == 0
    res = json.loads((out / "cache_bench.json").read_text())
    assert res["weight_format"] == "fp8" and not res["fails"] and all(res["checks"].values())
    assert {r["placement"] for r in res["rows"]} == {"all-HBM", "usage_global-0.5", "lru-0.5", "lookahead-0.5 d1"}


def test_step_compare_reports_the_first_step_apart_from_the_run():
    """bench step's engine check: over the whole run, the token match and the largest logit
    difference; over the first decode step alone, its largest difference and the reference's
    smallest top-2 gap (a near tie that flipped shows as a first-step difference above that gap,
    after which the sequences part), each against a brute-force computation."""
    from types import SimpleNamespace

    from coldset.measure.step import NEW_TOKENS, compare

    gen = torch.Generator().manual_seed(5)
    bsz, vocab = 2, 11
    la = torch.randn(bsz, NEW_TOKENS - 1, vocab, generator=gen)
    lb = la.clone()
    lb[1, 0, 3] += 0.25  # the first step differs at one logit
    lb[:, 4:] += torch.randn(bsz, NEW_TOKENS - 5, vocab, generator=gen)  # later steps part
    ta = [[int(t) for t in torch.randint(vocab, (NEW_TOKENS,), generator=gen)] for _ in range(bsz)]
    tb = [row[:5] + [(t + 1) % vocab for t in row[5:]] for row in ta]
    s = SimpleNamespace(tokens_by_mode={"a": ta, "b": tb}, logits_by_mode={"a": la, "b": lb})
    got = compare(s, "a", "b", bsz)
    gaps = []
    for b in range(bsz):
        best = sorted(la[b, 0].tolist(), reverse=True)
        gaps.append(best[0] - best[1])
    assert got["token_match"] == 5 / NEW_TOKENS
    assert got["max_abs_logit_diff"] == (la - lb).abs().max().item()
    assert got["first_step_max_abs_logit_diff"] == pytest.approx(0.25)
    assert got["first_step_top2_gap_min"] == pytest.approx(min(gaps))
    assert compare(s, "a", "missing", bsz) is None
    from coldset.measure.render import _engine_check

    assert _engine_check("compiled/b2", got) == (
        f"compiled/b2 tokens {5 / NEW_TOKENS:.3f}, max logit diff {got['max_abs_logit_diff']:.3g} (first step 0.25, "
        f"its top-2 gap {min(gaps):.3g})")
    old_check = {k: got[k] for k in ("token_match", "max_abs_logit_diff")}  # JSON written before the first-step fields
    want = f"b tokens {5 / NEW_TOKENS:.3f}, max logit diff {got['max_abs_logit_diff']:.3g}"
    assert _engine_check("b", old_check) == want
