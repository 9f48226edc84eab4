"""``python -m coldset bench kernel``: the experts kernel at Qwen3-30B-A3B shapes (E=128, H=2048,
I=768, top-8, bf16) on one CUDA GPU, against the read bound measured in the same process.

Measures the HBM streaming-read and the pinned zero-copy read ceilings (a Triton read kernel,
:func:`coldset.kernels.bandwidth.best_read_bandwidth`) and a bf16 matmul rate, then the Triton
experts kernel per MoE layer, CUDA-graph replayed (:func:`coldset.core.timing.graph_time_us`: median of
``--reps`` replays), on fresh random weights and activations, with ``--layers`` layers' experts
rotated inside each graph so that no layer's weights are served from L2 (8 layers x 75 MB
selected at batch 1, L2 is 60 MB): all-hot with the row map, with the indirection compiled out
(``--rounds`` interleaved rounds of both: median and spread), all-cold (every expert read in place
from pinned host memory), mixed (4 hot + 4 cold) against the sum of its two parts, and each batch
of ``--batches`` against the torch reference (eager) and the bound (distinct expert bytes over the
HBM ceiling, or the FLOPs over the matmul rate). The kernel's stages (grouping + w13 + act, + w2,
+ top-k sum: :func:`coldset.measure.harness.cumulative_stage_us`) are timed at batch 1, up to 64
tokens and at the largest batch.

``--weight-format fp8`` times instead the block-FP8 experts kernel beside the bf16 kernel
(:mod:`coldset.measure.kernel_fp8`).

vLLM's figures are NOT measured here: :data:`VLLM_STORED` holds those of another run, shown as
"stored vLLM figure" with their source; a ratio against them carries the run-to-run spread of two
processes.

``--baseline-module FILE`` also times another copy of triton_moe.py on the same inputs and configs
and checks its output bit for bit; ``--configs JSON`` takes an earlier run's tuned configs instead
of tuning; ``--variants`` times config variants beside the tuned one; ``--sweep`` times batch-1
configs hot and cold. Writes ``kernel_bench.json`` under ``--out``.

Built in :func:`build` (weights, placements) and :func:`tune`; measured in :func:`measure_batch`,
:func:`sweep_batch1`, :func:`batch1_extras` and :func:`largest_batch_stages`; the JSON is the rows
(the table is :mod:`coldset.measure.render`'s).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from coldset.measure.harness import (MeasureError, cumulative_stage_us, load_module, log, new_result, require_cuda,
                                     spread, write_result)
from coldset.core.timing import eager_time_us, graph_time_us
from coldset.kernels.reference import torch_experts, torch_softmax_topk
from coldset.kernels.tiers import ExpertPools, check_host_allocation
from coldset.kernels.tune import TuneResult, TuneShape, autotune, config_for
from coldset.measure.kernel_fp8 import load_fp8_configs, run_fp8

E, H, I, TOP_K = 128, 2048, 768, 8

#: vLLM's fused_moe Triton kernel with its H200-tuned config at these shapes, all hot, µs per layer,
#: its token-alignment step not included: stored, not measured in this process.
VLLM_STORED = {"source": "stored vLLM figure (earlier run on the lent H200, NOTES.md; re-checked 2026-12-01)",
               "us": {1: 30.4, 4: 78.8, 16: 196.6, 64: 295.5, 256: 318.9, 2048: 482.2}}


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="folder for kernel_bench.json")
    p.add_argument("--layers", type=int, default=8,
                   help="layers whose experts are rotated in each graph (8: no layer's weights served from L2 at "
                        "batch 1; 1: one layer's, L2-resident at FP8 batch 1, but then each replay's launch overhead "
                        "is one layer's time too, so compare --layers 1 runs with each other only)")
    p.add_argument("--reps", type=int, default=30, help="graph replays per timing (their median)")
    p.add_argument("--rounds", type=int, default=2,
                   help="interleaved rounds of the hot and row-map-off timings per batch (median and spread)")
    p.add_argument("--batches", default="1,4,16,64,2048")
    p.add_argument("--sweep", type=int, default=0)
    p.add_argument("--cache-dir", default="/tmp/coldset-autotune")
    p.add_argument("--configs", default=None,
                   help="a kernel_bench.json of an earlier run: time its autotuned config per batch instead of "
                        "tuning now (the autotune cache is then not consulted; the table says so)")
    p.add_argument("--baseline-module", default=None,
                   help="path of another triton_moe.py (e.g. `git show <rev>:src/coldset/kernels/triton_moe.py`): "
                        "its triton_experts is timed on the same inputs with the same config per batch")
    p.add_argument("--no-batch1", action="store_true",
                   help="skip the batch-1 extras (stages, pdl A/B, sweep winners, mixed placement)")
    p.add_argument("--weight-format", choices=("bf16", "fp8"), default="bf16",
                   help="fp8: the block-FP8 experts kernel (best of the FP8 search space per batch, or of "
                        "--fp8-configs) beside the bf16 kernel (--configs' configs, else its defaults) and plain reads "
                        "of the same bytes, with the FP8 launches' cumulative stage times at every batch")
    p.add_argument("--fp8-configs", default=None, metavar="FILE",
                   help="with --weight-format fp8: a JSON list of KernelConfig dicts (e.g. "
                        "config/examples/fp8_stage_sweep.json), timed with their stages at every batch instead of "
                        "the FP8 search space")
    p.add_argument("--variants", default=None,
                   help='JSON {"batch": [{field: value, ...}, ...]}: each dict overrides fields of that batch\'s '
                        'tuned config; each variant is timed beside it (all hot), checked bit for bit against the '
                        'row map compiled out and against the torch path, and above 64 tokens timed by stage')


def check_arguments(args) -> None:
    """:class:`MeasureError` naming a bad batch list or count before anything is allocated."""
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError as exc:
        raise MeasureError(f"--batches {args.batches!r}: {exc}") from exc
    if not batches or min(batches) < 1 or args.layers < 1 or args.reps < 1 or args.rounds < 1:
        raise MeasureError(f"--batches {batches}, --layers {args.layers}, --reps {args.reps}, --rounds {args.rounds}: "
                           "each must be at least 1")
    if getattr(args, "weight_format", "bf16") == "fp8":
        extra = [flag for flag, on in (("--variants", args.variants), ("--sweep", args.sweep),
                                        ("--baseline-module", args.baseline_module)) if on]
        if extra:
            raise MeasureError(f"--weight-format fp8 does not take {', '.join(extra)} (bf16 kernel options); "
                               "it times the FP8 kernel's search space beside the bf16 kernel")
        if args.configs and not Path(args.configs).is_file():
            raise MeasureError(f"--configs {args.configs}: no such file (the bf16 configs of --weight-format fp8)")
        if getattr(args, "fp8_configs", None):
            load_fp8_configs(args.fp8_configs)
    elif getattr(args, "fp8_configs", None):
        raise MeasureError(f"--fp8-configs {args.fp8_configs} needs --weight-format fp8")
    if args.variants:
        try:
            {int(b): list(v) for b, v in json.loads(args.variants).items()}
        except (ValueError, AttributeError) as exc:
            raise MeasureError(f"--variants is not JSON {{batch: [fields, ...]}}: {exc}") from exc


@dataclass
class Bf16Bench:
    """What every timing of the run shares: the arguments, the generator of its inputs, the pools
    (every expert in both tiers; the row map picks), the unmodified all-hot view of the same hot
    weights, the two placements' row maps and the ceilings measured in this process."""

    args: object
    layers: int
    gen: object
    w13_hot: object
    pools: object
    unmodified: object
    all_hot_map: object
    all_cold_map: object
    cold_reps: int
    expert_bytes: int
    hbm: float = 0.0
    pinned: float = 0.0
    mm_rate: float = 0.0


def build(args) -> Bf16Bench:
    """Random bf16 experts of ``--layers`` layers in HBM and a pinned host copy of each (the cold
    tier), in one set of pools whose row map places them."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    L, dtype = args.layers, torch.bfloat16
    n = L * E
    expert_bytes = (2 * I * H + H * I) * 2
    t0 = time.time()
    w13_hot = torch.randn(n, 2 * I, H, device="cuda", dtype=dtype) / H**0.5
    w2_hot = torch.randn(n, H, I, device="cuda", dtype=dtype) / I**0.5
    check_host_allocation(n * expert_bytes, "benchmark pinned cold pool")
    w13_cold = torch.empty(w13_hot.shape, dtype=dtype, pin_memory=True)
    w2_cold = torch.empty(w2_hot.shape, dtype=dtype, pin_memory=True)
    w13_cold.copy_(w13_hot)
    w2_cold.copy_(w2_hot)
    torch.cuda.synchronize()
    log(f"pools: {n} experts in each tier, {n * expert_bytes / 2**30:.1f} GiB each, {time.time() - t0:.1f}s")
    all_hot_map = torch.arange(n, dtype=torch.int32).reshape(L, E)
    pools = ExpertPools(w13_hot, w2_hot, w13_cold, w2_cold, all_hot_map.clone().cuda())
    pools.validate()
    unmodified = ExpertPools.all_hot(w13_hot.view(L, E, 2 * I, H), w2_hot.view(L, E, H, I))
    return Bf16Bench(args, L, gen, w13_hot, pools, unmodified, all_hot_map, -all_hot_map - 1,
                     max(5, args.reps // 3), expert_bytes)


def measure_ceilings(b: Bf16Bench) -> dict:
    """The HBM and pinned zero-copy read rates and the bf16 matmul rate, measured now."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    from coldset.kernels.bandwidth import HBM_READ_SHAPES, best_read_bandwidth  # triton: GPU-only

    b.hbm = best_read_bandwidth(b.w13_hot.view(-1), HBM_READ_SHAPES, b.args.reps)
    pinned_candidates: dict[str, float] = {}
    b.pinned = best_read_bandwidth(b.pools.w13_cold.view(-1)[: 2**29], ((1024, 1), (4096, 1), (4096, 4), (8192, 8)),
                                   10, rates=pinned_candidates)
    mats = [torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    b.mm_rate = 2 * 8192**3 / (eager_time_us(lambda: mats[0] @ mats[1], 10) * 1e-6)
    mats.clear()
    ceilings = {"hbm_read_GBps": b.hbm / 1e9, "pinned_read_GBps": b.pinned / 1e9,
                "pinned_candidates_GBps": {k: v / 1e9 for k, v in pinned_candidates.items()},
                "bf16_matmul_TFLOPs": b.mm_rate / 1e12}
    log("ceilings", ceilings)
    return ceilings


def make_case(b: Bf16Bench, num_tokens: int):
    """``num_tokens`` random tokens a layer and their softmax top-k routing (bf16 weights)."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    def routing():
        logits = torch.randn(num_tokens, E, generator=b.gen, device="cuda")
        ids, w = torch_softmax_topk(logits, TOP_K, renormalize=True)
        return ids, w.to(torch.bfloat16)

    xs = [torch.randn(num_tokens, H, device="cuda", generator=b.gen).to(torch.bfloat16) for _ in range(b.layers)]
    return xs, [routing() for _ in range(b.layers)]


def run_all(b: Bf16Bench, pl, xs, rs, cfg, use_row_map=True, outs=None):
    """A call of every layer's experts on pools ``pl``; ``outs`` gets the outputs."""
    from coldset.kernels.triton_moe import triton_experts  # triton: GPU-only

    def fn():
        got = [triton_experts(pl, layer, xs[layer], rs[layer][0], rs[layer][1], cfg, use_row_map)
               for layer in range(b.layers)]
        if outs is not None:
            outs[:] = got
    return fn


def timed(b: Bf16Bench, fn, reps, row_map=None) -> float:
    """µs per layer of ``fn`` replayed in a graph, with the pools' row map set first (hot after)."""

    if row_map is not None:
        b.pools.set_row_map(row_map)
    us = graph_time_us(fn, reps) / b.layers
    b.pools.set_row_map(b.all_hot_map)
    return us


def stage_times(b: Bf16Bench, cfg, xs, rs, reps) -> dict:
    """Cumulative µs per layer after each launch (w13_act: w13 + act with the grouping, w2: + w2, sum: + sum)."""
    from coldset.kernels.triton_moe import LAUNCHES, experts_launches  # triton: GPU-only

    return cumulative_stage_us(lambda l: experts_launches(b.pools, l, xs[l], rs[l][0], rs[l][1], cfg, True),
                               LAUNCHES, b.layers, reps)


def sized_read_rate(b: Bf16Bench, nbytes) -> float:
    """B/s of a plain read of ``nbytes`` of the hot pool a launch, L launches in one graph (as the
    graph's layers read), best of three read shapes."""
    from coldset.kernels.bandwidth import best_read_bandwidth  # triton: GPU-only

    part = int(nbytes) // b.w13_hot.element_size()
    return best_read_bandwidth(b.w13_hot.view(-1)[: b.layers * part], ((4096, 1), (4096, 4), (4096, 16)),
                               b.args.reps, launches=b.layers)


def distinct_bytes(b: Bf16Bench, rs) -> float:
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    return sum(int(torch.unique(r[0]).numel()) for r in rs) * b.expert_bytes / b.layers


def equal(xs_, ys_) -> bool:
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    return all(torch.equal(x_, y_) for x_, y_ in zip(xs_, ys_))


def max_err(b: Bf16Bench, outs, xs, rs) -> float:
    """The largest rel. error of a layer's output against the torch path."""

    errs = []
    for l in range(b.layers):
        ref = torch_experts(b.pools, l, xs[l], *rs[l]).float()
        errs.append(float((outs[l].float() - ref).norm() / ref.norm()))
    return max(errs)


def time_variant(b: Bf16Bench, B, cfg, fields, xs, rs, bound_us, out_tuned) -> dict:
    """One config variant at batch B, all hot: µs (median of two graph medians, with their
    spread), bitwise against the row map compiled out and against the tuned config, error vs
    torch; up to 64 tokens also all cold (µs, bitwise equal to all hot); cumulative stage
    times, above 64 also the grouping alone."""
    from coldset.kernels.triton_moe import KernelConfig, group_pairs  # triton: GPU-only

    args, L = b.args, b.layers
    cfg_v = KernelConfig.from_dict({**cfg.to_dict(), **fields})
    out_v, out_o = [], []
    us = spread([graph_time_us(run_all(b, b.pools, xs, rs, cfg_v, True, out_v), args.reps) / L for _ in range(2)])
    graph_time_us(run_all(b, b.unmodified, xs, rs, cfg_v, False, out_o), 3)
    r = {"fields": fields, "config": cfg_v.to_dict(), "us": us["median"], "us_spread": us,
         "pct_of_bound": 100 * bound_us / us["median"], "bitwise_rowmap_vs_off": equal(out_v, out_o),
         "bitwise_vs_tuned": equal(out_v, out_tuned), "max_rel_err_vs_torch": max_err(b, out_v, xs, rs)}
    if B <= 64:  # the cold tier read in place: the variant's cost on the link, and its bits there
        out_c = []
        r["cold_us"] = timed(b, run_all(b, b.pools, xs, rs, cfg_v, True, out_c), b.cold_reps, b.all_cold_map)
        r["bitwise_cold_vs_hot"] = equal(out_v, out_c)
    # keyed by launch count (1: w13 + act, 2: + w2, 3: + sum), as the variants' JSON holds them
    r["stages_us"] = dict(zip((1, 2, 3), stage_times(b, cfg_v, xs, rs, max(5, args.reps // 2)).values()))
    if B > 64 and not fields:
        r["grouping_us"] = graph_time_us(lambda: [group_pairs(rs[l][0].reshape(-1), E) for l in range(L)],
                                         max(5, args.reps // 2)) / L
    log("variant", B, {k: v for k, v in r.items() if k != "config"})
    return r


def tune(args, batches: list[int], res: dict):
    """The configs per batch: ``--configs``' (not tuned now), else the package's autotune (its
    cache machinery), then the same call again (a hit). Returns ``(tuned, tuned for the
    provenance or None)`` and records the tune in ``res["autotune"]``."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    shape = TuneShape(num_experts=E, hidden=H, intermediate=I, top_k=TOP_K, dtype="bfloat16", num_moe_layers=48,
                      num_hot=48 * E, num_cold=0)
    tuned_for_provenance = None
    if args.configs:
        with open(args.configs) as f:
            given = json.load(f)["autotune"]
        tuned = TuneResult(key=given["key"], hit=False, backend="triton", shape=shape, batch_sizes=batches,
                           configs={int(x): c for x, c in given["configs"].items()})
        res["autotune"] = {"skipped": True, "configs_from": args.configs, "key_of_that_run": given["key"],
                           "configs": given["configs"]}
    else:
        t0 = time.time()
        tuned = tuned_for_provenance = autotune(shape, batches, "cuda", cache_dir=args.cache_dir)
        miss_s = time.time() - t0
        t0 = time.time()
        tuned2 = autotune(shape, batches, "cuda", cache_dir=args.cache_dir)
        res["autotune"] = {"key": tuned.key, "first_hit": tuned.hit, "first_s": miss_s, "second_hit": tuned2.hit,
                           "second_s": time.time() - t0, "configs": {str(x): c for x, c in tuned.configs.items()},
                           "timings_us": {str(x): t for x, t in tuned.timings_us.items()}}
    log("autotune", res["autotune"])
    torch.cuda.empty_cache()
    return tuned, tuned_for_provenance


def sweep_batch1(b: Bf16Bench) -> list[dict]:
    """``--sweep``: batch-1 configs hot and cold (the split of weight rows over blocks); a config
    that cannot run here (e.g. out of shared memory for a large tile) is skipped."""
    from coldset.kernels.triton_moe import KernelConfig  # triton: GPU-only

    args, sweep = b.args, []
    xs, rs = make_case(b, 1)
    cands = [KernelConfig(16, n1, k1, n2, k2, w, s) for (n1, n2) in ((16, 16), (32, 32), (64, 64), (16, 32), (32, 64))
             for (k1, k2) in ((128, 128), (256, 256)) for (w, s) in ((4, 3),)]
    cands += [KernelConfig(16, 32, 128, 32, 128, 4, 4), KernelConfig(16, 16, 128, 16, 128, 2, 4),
              KernelConfig(16, 32, 64, 32, 64, 4, 5)]
    for cfg in cands:
        try:
            hot_us = timed(b, run_all(b, b.pools, xs, rs, cfg), args.reps, b.all_hot_map)
            cold_us = timed(b, run_all(b, b.pools, xs, rs, cfg), b.cold_reps, b.all_cold_map)
        except Exception as exc:  # e.g. out of shared memory for a large tile: skip that config
            log("sweep", cfg, "failed:", repr(exc)[:200])
            continue
        sweep.append({"config": cfg.to_dict(), "hot_us": hot_us, "cold_us": cold_us})
        log("sweep", cfg, f"hot {hot_us:.1f} us cold {cold_us:.1f} us")
    return sweep


def baseline_columns(b: Bf16Bench, baseline, cfg, xs, rs, out_on) -> dict:
    """The ``--baseline-module`` kernel on the same inputs: its own fields of the config only (an
    older kernel has no split_k / tile_order / half_buf: it runs the same tiles unsplit, so its
    bits equal ours only where those are off)."""

    known = set(baseline.KernelConfig.__dataclass_fields__)
    bcfg = baseline.KernelConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k in known})
    out_base = []

    def base_fn():
        out_base[:] = [baseline.triton_experts(b.pools, l, xs[l], rs[l][0], rs[l][1], bcfg, True)
                       for l in range(b.layers)]
    return {"baseline_config": bcfg.to_dict(), "baseline_us": graph_time_us(base_fn, b.args.reps) / b.layers,
            "bitwise_vs_baseline": equal(out_on, out_base)}


def small_batch_columns(b: Bf16Bench, cfg, xs, rs, nbytes, hot_us: float) -> dict:
    """Up to 64 tokens: the read ceiling at this size (L launches each streaming ``nbytes`` of the
    hot pool, as the graph's layers read) and where the time goes (cumulative stages against a
    plain read of each launch's own bytes: w13 two thirds of the distinct bytes, w2 one third)."""
    sized = sized_read_rate(b, nbytes)
    st = stage_times(b, cfg, xs, rs, b.args.reps)
    return {"sized_read_GBps": sized / 1e9, "pct_of_sized_read": 100 * nbytes / sized / (hot_us * 1e-6),
            "stages_us": {"w13_act": st["w13_act"], "w13_act+w2": st["w2"], "all_three": st["sum"]},
            "stage_read_us": {name: part_bytes / sized_read_rate(b, part_bytes) * 1e6
                              for name, part_bytes in (("w13", nbytes * 2 / 3), ("w2", nbytes / 3))}}


def measure_batch(b: Bf16Bench, B: int, cfg, baseline, variants: dict) -> dict:
    """One batch's row: the tuned config hot with the row map and with it compiled out
    (``--rounds`` interleaved), the default config, the baseline module, the stages and sized
    reads, cold, the torch path, the correctness checks and the variants."""
    from coldset.kernels.triton_moe import DEFAULT_DECODE_CONFIG, DEFAULT_PREFILL_CONFIG  # triton: GPU-only

    args, L, pools = b.args, b.layers, b.pools
    dflt = DEFAULT_DECODE_CONFIG if B <= 64 else DEFAULT_PREFILL_CONFIG
    xs, rs = make_case(b, B)
    nbytes = distinct_bytes(b, rs)
    flops = 2 * B * TOP_K * (2 * I * H + H * I)
    bound_us = max(nbytes / b.hbm, flops / b.mm_rate) * 1e6
    out_on, out_off, out_cold = [], [], []
    pools.set_row_map(b.all_hot_map)
    on_runs, off_runs = [], []
    for i in range(args.rounds):  # interleaved, as the row-map cost compares the two
        on_runs.append(graph_time_us(run_all(b, pools, xs, rs, cfg, True, out_on if i == 0 else None), args.reps) / L)
        off_runs.append(graph_time_us(run_all(b, b.unmodified, xs, rs, cfg, False, out_off if i == 0 else None),
                                      args.reps) / L)
    hot, off = spread(on_runs), spread(off_runs)
    dflt_us = timed(b, run_all(b, pools, xs, rs, dflt), args.reps, b.all_hot_map)
    base = baseline_columns(b, baseline, cfg, xs, rs, out_on) if baseline is not None else {}
    row = {"batch": B, "config": cfg.to_dict(), "default_config_us": dflt_us, "distinct_expert_MB": nbytes / 1e6,
           "bound_us": bound_us, "hot_us": hot["median"], "hot_us_spread": hot, "off_us": off["median"],
           "off_us_spread": off, **base}
    if B <= 64:
        row.update(small_batch_columns(b, cfg, xs, rs, nbytes, row["hot_us"]))
    if B in VLLM_STORED["us"]:
        row["vllm_stored_us"] = VLLM_STORED["us"][B]
        row["speed_vs_stored_vllm"] = VLLM_STORED["us"][B] / row["hot_us"]
    row["hot_GBps"] = nbytes / (row["hot_us"] * 1e-6) / 1e9
    row["rowmap_cost_pct"] = 100 * (row["hot_us"] / row["off_us"] - 1)
    if B <= 64:
        row["cold_us"] = timed(b, run_all(b, pools, xs, rs, cfg, True, out_cold), b.cold_reps, b.all_cold_map)
        row["cold_GBps"] = nbytes / (row["cold_us"] * 1e-6) / 1e9
        row["cold_pct_pinned"] = 100 * row["cold_GBps"] * 1e9 / b.pinned
    row["torch_us"] = eager_time_us(lambda: [torch_experts(pools, l, xs[l], *rs[l]) for l in range(L)],
                                    5 if B > 64 else 10) / L
    # correctness: bitwise across placements, error vs torch
    row.update({"bitwise_rowmap_vs_off": equal(out_on, out_off),
                "bitwise_cold_vs_hot": equal(out_on, out_cold) if out_cold else None,
                "max_rel_err_vs_torch": max_err(b, out_on, xs, rs)})
    if B in variants:
        pools.set_row_map(b.all_hot_map)
        row["variants"] = [time_variant(b, B, cfg, v, xs, rs, bound_us, out_on) for v in [{}] + variants[B]]
    return row


def batch1_stages_and_pdl(b: Bf16Bench, best_hot: dict, res: dict) -> None:
    """At batch 1 with ``best_hot``, all hot: the stage breakdown (w13 + act alone, + w2, + top-k
    sum), then dependent launch off / with w2 prefetch / launch only (hot twice, cold once)."""
    from coldset.kernels.triton_moe import KernelConfig  # triton: GPU-only

    args = b.args
    xs, rs = make_case(b, 1)
    b.pools.set_row_map(b.all_hot_map)
    st = stage_times(b, KernelConfig.from_dict(best_hot), xs, rs, args.reps)
    res["batch1_stages_us"] = {"w13_act": st["w13_act"], "w13_act+w2": st["w2"], "all_three": st["sum"],
                               "w13_MB": 8 * 2 * I * H * 2 / 1e6, "w2_MB": 8 * H * I * 2 / 1e6}
    log("stages", res["batch1_stages_us"])
    pdl_ab = {}
    for pdl in (0, 1, 2):
        cfgp = KernelConfig.from_dict({**best_hot, "pdl": pdl})
        hot = spread([timed(b, run_all(b, b.pools, xs, rs, cfgp), args.reps, b.all_hot_map) for _ in range(2)])
        pdl_ab[pdl] = {"hot_us": hot["median"], "hot_spread": hot,
                       "cold_us": timed(b, run_all(b, b.pools, xs, rs, cfgp), b.cold_reps, b.all_cold_map)}
    res["batch1_pdl_ab"] = pdl_ab
    log("pdl a/b", pdl_ab)


def batch1_sweep_winners(b: Bf16Bench, best_hot: dict, best_cold: dict) -> dict:
    """The sweep's best hot and best cold config at batch 1: hot and row map off (twice each,
    interleaved), cold, against the HBM and pinned ceilings."""
    from coldset.kernels.triton_moe import KernelConfig  # triton: GPU-only

    args, L = b.args, b.layers
    xs, rs = make_case(b, 1)
    nbytes = distinct_bytes(b, rs)
    r1 = {}
    for name, cfgd in (("best_hot", best_hot), ("best_cold", best_cold)):
        cfg = KernelConfig.from_dict(cfgd)
        on, off = [], []
        for _ in range(2):
            on.append(timed(b, run_all(b, b.pools, xs, rs, cfg), args.reps, b.all_hot_map))
            off.append(graph_time_us(run_all(b, b.unmodified, xs, rs, cfg, False), args.reps) / L)
        cold = timed(b, run_all(b, b.pools, xs, rs, cfg), b.cold_reps, b.all_cold_map)
        hot, off_ = spread(on), spread(off)
        r1[name] = {"config": cfgd, "hot_us": hot["median"], "hot_spread": hot, "off_us": off_["median"],
                    "off_spread": off_, "cold_us": cold,
                    "hot_pct_hbm": 100 * nbytes / (hot["median"] * 1e-6) / b.hbm,
                    "cold_pct_pinned": 100 * nbytes / (cold * 1e-6) / b.pinned,
                    "rowmap_cost_pct": 100 * (hot["median"] / off_["median"] - 1)}
    log("batch1 tuned", r1)
    return r1


def mixed_placement(b: Bf16Bench, best_cold: dict) -> dict:
    """4 hot + 4 cold of the 8 selected at batch 1, against the sum of the two parts (top-4 each)."""
    from coldset.kernels.triton_moe import KernelConfig  # triton: GPU-only

    args, L = b.args, b.layers
    cfg = KernelConfig.from_dict(best_cold)
    xs, rs = make_case(b, 1)
    mixed_map = b.all_hot_map.clone()
    for l in range(L):
        for e in rs[l][0][0, 4:].tolist():
            mixed_map[l, e] = -(l * E + e) - 1
    hot_part = [(r[0][:, :4].contiguous(), r[1][:, :4].contiguous()) for r in rs]
    cold_part = [(r[0][:, 4:].contiguous(), r[1][:, 4:].contiguous()) for r in rs]
    out_mixed, out_hot = [], []
    mixed_us = timed(b, run_all(b, b.pools, xs, rs, cfg, True, out_mixed), b.cold_reps, mixed_map)
    hot4_us = timed(b, run_all(b, b.pools, xs, hot_part, cfg), args.reps)
    graph_time_us(run_all(b, b.pools, xs, rs, cfg, True, out_hot), 3)
    cold4_us = timed(b, run_all(b, b.pools, xs, cold_part, cfg), b.cold_reps, b.all_cold_map)
    mixed = {"config": cfg.to_dict(), "mixed_us": mixed_us, "hot4_us": hot4_us, "cold4_us": cold4_us,
             "sum_parts_us": hot4_us + cold4_us, "mixed_over_sum": mixed_us / (hot4_us + cold4_us),
             "bitwise_mixed_vs_hot": equal(out_mixed, out_hot)}
    log("mixed", mixed)
    return mixed


def largest_batch_stages(b: Bf16Bench, tuned, big: int) -> dict:
    """The largest batch's stages (prefill: where its time goes), its tuned config, all hot."""
    from coldset.kernels.triton_moe import KernelConfig  # triton: GPU-only

    xs, rs = make_case(b, big)
    cfgb = KernelConfig.from_dict(config_for(tuned, big))
    b.pools.set_row_map(b.all_hot_map)
    sb = stage_times(b, cfgb, xs, rs, max(5, b.args.reps // 2))
    return {"batch": big, "config": cfgb.to_dict(), "grouping+w13_act": sb["w13_act"], "+w2": sb["w2"],
            "+sum": sb["sum"]}


def run(args, argv=None) -> dict:
    """Measure (see module doc); returns the result written to ``--out``/kernel_bench.json."""
    check_arguments(args)
    require_cuda()
    if args.weight_format == "fp8":
        return run_fp8(args, argv)
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    from coldset.kernels.triton_moe import DEFAULT_DECODE_CONFIG, KernelConfig  # triton: GPU-only

    out_path = Path(args.out) / "kernel_bench.json"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    variants = {int(x): v for x, v in json.loads(args.variants).items()} if args.variants else {}
    batches = [int(x) for x in args.batches.split(",")]
    baseline = load_module(args.baseline_module) if args.baseline_module else None
    res = new_result("kernel", argv, args)
    res["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    res["shape"] = dict(E=E, H=H, I=I, top_k=TOP_K, dtype="bfloat16", layers=args.layers)
    b = build(args)
    res["ceilings"] = measure_ceilings(b)
    tuned, tuned_for_provenance = tune(args, batches, res)

    def save():
        write_result(out_path, res, res["ceilings"], tuned_for_provenance)

    sweep = []
    if args.sweep:
        sweep = res["sweep_batch1"] = sweep_batch1(b)
    best_hot = (min(sweep, key=lambda r: r["hot_us"])["config"] if sweep
                else tuned.configs.get(1, DEFAULT_DECODE_CONFIG.to_dict()))
    best_cold = min(sweep, key=lambda r: r["cold_us"])["config"] if sweep else best_hot
    res["best_hot_config"], res["best_cold_config"] = best_hot, best_cold
    res["vllm_stored"] = {"source": VLLM_STORED["source"], "us": {str(x): us for x, us in VLLM_STORED["us"].items()}}
    rows = res["batches"] = []
    for B in batches:
        rows.append(measure_batch(b, B, KernelConfig.from_dict(config_for(tuned, B)), baseline, variants))
        log("batch", B, {k: v for k, v in rows[-1].items() if k != "config"})
        save()
    if not args.no_batch1:
        batch1_stages_and_pdl(b, best_hot, res)
        if sweep:
            res["batch1_tuned"] = batch1_sweep_winners(b, best_hot, best_cold)
        res["mixed"] = mixed_placement(b, best_cold)
    save()
    if max(batches) > 64:
        res["largest_batch_stages_us"] = largest_batch_stages(b, tuned, max(batches))
        save()
    return res
