"""``python -m coldset bench kernel``: the experts kernel at Qwen3-30B-A3B shapes (E=128, H=2048,
I=768, top-8, bf16) on one CUDA GPU, against the read bound measured in the same process.

Measures the HBM streaming-read and the pinned zero-copy read ceilings (a Triton read kernel,
:func:`coldset.kernels.bandwidth.best_read_bandwidth`) and a bf16 matmul rate, then the Triton
experts kernel per MoE layer, CUDA-graph replayed (:func:`coldset.kernels.tune.graph_time_us`: median of
``--reps`` replays), on fresh random weights and activations, with ``--layers`` layers' experts
rotated inside each graph so that no layer's weights are served from L2 (8 layers x 75 MB
selected at batch 1, L2 is 60 MB): all-hot with the row map, with the indirection compiled out
(``--rounds`` interleaved rounds of both: median and spread), all-cold (every expert read in place
from pinned host memory), mixed (4 hot + 4 cold) against the sum of its two parts, and each batch
of ``--batches`` against the torch reference (eager) and the bound (distinct expert bytes over the
HBM ceiling, or the FLOPs over the matmul rate).

``--weight-format fp8`` (issue 29) times instead the block-FP8 experts kernel
(:mod:`coldset.kernels.triton_fp8`: the same random weights quantized to 128 x 128 blocks) beside
the bf16 kernel per batch, each against a plain read of its own distinct expert bytes (one read
launch a layer, in one graph, this process) and the bytes and FLOP bounds (FP8 and bf16 matmul
rates measured here): :func:`run_fp8`. Checks bitwise identity across placements and the
error against the torch path, and times the FP8 call's launches cumulatively at every batch
(:func:`cumulative_stage_us` with the kernel's ``_stop_after``: the tokens' quantization, + w13,
+ the intermediate's quantization, + w2, + top-k sum, as the config launches them), beside a plain
read of w13's and w2's own bytes up to 64 tokens. ``--fp8-configs FILE`` (a JSON list of
KernelConfig dicts, :func:`load_fp8_configs`) times those configs at every batch instead of the
search space, each with its stages. The bf16 kernel's stages (grouping + w13 + act, + w2, + top-k
sum) are timed the same way at batch 1, up to 64 tokens and at the largest batch.

vLLM's figures are NOT measured here: :data:`VLLM_STORED` holds those of an earlier run
(NOTES.md), shown as "stored vLLM figure" with their source; a ratio against them carries the
run-to-run spread of two processes.

``--baseline-module FILE`` also times another copy of triton_moe.py on the same inputs and configs
and checks its output bit for bit; ``--configs JSON`` takes an earlier run's tuned configs instead
of tuning; ``--variants`` times config variants beside the tuned one; ``--sweep`` times batch-1
configs hot and cold. Writes ``kernel_bench.json`` under ``--out``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from coldset.measure.harness import MeasureError, log, new_result, require_cuda, spread, write_result

#: vLLM's fused_moe Triton kernel with its H200-tuned config at these shapes, all hot, µs per layer,
#: its token-alignment step not included: measured on the lent H200 by an earlier session, not in
#: this process (/work/shared/NOTES.md; re-measured beside ours on 2026-12-01 at tree 75c2981 as
#: speed ratios within 0.97-1.13x of these).
VLLM_STORED = {"source": "stored vLLM figure (earlier run on the lent H200, NOTES.md; re-checked 2026-12-01)",
               "us": {1: 30.4, 4: 78.8, 16: 196.6, 64: 295.5, 256: 318.9, 2048: 482.2}}


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="folder for kernel_bench.json")
    p.add_argument("--layers", type=int, default=8,
                   help="layers whose experts are rotated in each graph (8: no layer's weights served from L2 at "
                        "batch 1; 1: one layer's, L2-resident at FP8 batch 1, but then each replay's launch overhead "
                        "is one layer's time too: the FP8 stage times at 1 token read 10-17 µs for the first launch "
                        "alone on the H200, so compare --layers 1 runs with each other only)")
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
                        "of the same bytes, with the FP8 launches' cumulative stage times at every batch (issue 29)")
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


def load_fp8_configs(path: str) -> list[dict]:
    """The FP8 candidates of ``--fp8-configs`` ``path``: a non-empty JSON list of dicts of
    :class:`~coldset.kernels.triton_moe.KernelConfig` fields (integers; the others at their
    defaults), each checked as the FP8 kernel checks its config
    (:func:`coldset.kernels.triton_fp8._check_config`); returned complete (``to_dict``).
    :class:`MeasureError` naming the file, the entry and the field otherwise."""
    where = f"--fp8-configs {path}"
    if not Path(path).is_file():
        raise MeasureError(f"{where}: no such file")
    try:
        entries = json.loads(Path(path).read_text())
    except ValueError as exc:
        raise MeasureError(f"{where}: not JSON: {exc}") from exc
    if not isinstance(entries, list) or not entries:
        raise MeasureError(f"{where}: a non-empty JSON list of KernelConfig dicts expected, got {entries!r:.80}")
    try:  # the kernel's own checks (triton: present wherever the kernel can run)
        from coldset.kernels.triton_fp8 import _check_config
        from coldset.kernels.triton_moe import KernelConfig
    except ImportError as exc:
        raise MeasureError(f"{where}: checking its configs needs triton ({exc})") from exc
    fields = list(KernelConfig.__dataclass_fields__)
    configs: list[dict] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise MeasureError(f"{where}: entry {i} is not a dict of KernelConfig fields: {entry!r:.80}")
        for field, value in entry.items():
            if field not in fields:
                raise MeasureError(f"{where}: entry {i}: unknown field {field!r} (KernelConfig fields: "
                                   f"{', '.join(fields)})")
            if type(value) is not int:
                raise MeasureError(f"{where}: entry {i}: field {field!r} must be an integer, got {value!r}")
        cfg = KernelConfig(**entry)
        try:
            _check_config(cfg)
        except ValueError as exc:
            raise MeasureError(f"{where}: entry {i}: {exc}") from exc
        if cfg.to_dict() in configs:
            raise MeasureError(f"{where}: entry {i} repeats entry {configs.index(cfg.to_dict())}")
        configs.append(cfg.to_dict())
    return configs


def cumulative_stage_us(call, stops, layers: int, reps: int) -> dict:
    """Cumulative µs a layer after each of ``stops``: ``call(layer, stop)`` (a kernel call that
    stops after launch ``stop``) for every layer in one CUDA graph, median of ``reps`` replays, per
    stop. How both kernels' stages are timed (their ``_stop_after``)."""
    from coldset.core.timing import graph_time_us

    return {stop: graph_time_us(lambda: [call(layer, stop) for layer in range(layers)], reps) / layers
            for stop in stops}


def _load_module(path: str, name: str = "baseline_triton_moe"):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise FileNotFoundError(f"bench kernel: --baseline-module {path} is not a Python file")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def run(args, argv=None) -> dict:
    """Measure (see module doc); returns the result written to ``--out``/kernel_bench.json."""
    check_arguments(args)
    require_cuda()
    if args.weight_format == "fp8":
        return run_fp8(args, argv)
    import torch

    from coldset.kernels.bandwidth import HBM_READ_SHAPES, best_read_bandwidth
    from coldset.kernels.reference import torch_experts, torch_softmax_topk
    from coldset.kernels.triton_moe import (DEFAULT_DECODE_CONFIG, DEFAULT_PREFILL_CONFIG, KernelConfig,
                                            group_pairs, triton_experts)
    from coldset.kernels.tiers import ExpertPools, check_host_allocation
    from coldset.core.timing import eager_time_us, graph_time_us
    from coldset.kernels.tune import TuneResult, TuneShape, autotune, config_for

    out_path = Path(args.out) / "kernel_bench.json"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    variants = {int(b): v for b, v in json.loads(args.variants).items()} if args.variants else {}
    batches = [int(b) for b in args.batches.split(",")]
    baseline = _load_module(args.baseline_module) if args.baseline_module else None
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    E, H, I, K, L = 128, 2048, 768, 8, args.layers
    dtype = torch.bfloat16
    res = new_result("kernel", argv, args)
    res["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    res["shape"] = dict(E=E, H=H, I=I, top_k=K, dtype="bfloat16", layers=L)
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
    all_cold_map = -all_hot_map - 1
    pools = ExpertPools(w13_hot, w2_hot, w13_cold, w2_cold, all_hot_map.clone().cuda())
    pools.validate()
    unmodified = ExpertPools.all_hot(w13_hot.view(L, E, 2 * I, H), w2_hot.view(L, E, H, I))
    cold_reps = max(5, args.reps // 3)

    # --- ceilings, measured now
    hbm = best_read_bandwidth(w13_hot.view(-1), HBM_READ_SHAPES, args.reps)
    pinned_candidates: dict[str, float] = {}
    pinned = best_read_bandwidth(w13_cold.view(-1)[: 2**29], ((1024, 1), (4096, 1), (4096, 4), (8192, 8)), 10,
                                 rates=pinned_candidates)
    mats = [torch.randn(8192, 8192, device="cuda", dtype=dtype) for _ in range(2)]
    mm_rate = 2 * 8192**3 / (eager_time_us(lambda: mats[0] @ mats[1], 10) * 1e-6)
    mats.clear()
    res["ceilings"] = {"hbm_read_GBps": hbm / 1e9, "pinned_read_GBps": pinned / 1e9,
                       "pinned_candidates_GBps": {k: v / 1e9 for k, v in pinned_candidates.items()},
                       "bf16_matmul_TFLOPs": mm_rate / 1e12}
    log("ceilings", res["ceilings"])

    def routing(num_tokens):
        logits = torch.randn(num_tokens, E, generator=gen, device="cuda")
        ids, w = torch_softmax_topk(logits, K, renormalize=True)
        return ids, w.to(dtype)

    def make_case(num_tokens):
        xs = [torch.randn(num_tokens, H, device="cuda", generator=gen).to(dtype) for _ in range(L)]
        return xs, [routing(num_tokens) for _ in range(L)]

    def run_all(pl, xs, rs, cfg, use_row_map=True, outs=None):
        def fn():
            got = [triton_experts(pl, layer, xs[layer], rs[layer][0], rs[layer][1], cfg, use_row_map) for layer in range(L)]
            if outs is not None:
                outs[:] = got
        return fn

    def timed(fn, reps, row_map=None):
        """µs per layer of ``fn`` replayed in a graph, with the pools' row map set first (hot after)."""
        if row_map is not None:
            pools.set_row_map(row_map)
        us = graph_time_us(fn, reps) / L
        pools.set_row_map(all_hot_map)
        return us

    def stage_times(cfg, xs, rs, reps):
        """Cumulative µs per layer after each launch ({1: w13 + act (with the grouping), 2: + w2, 3: + sum})."""
        return cumulative_stage_us(
            lambda l, stop: triton_experts(pools, l, xs[l], rs[l][0], rs[l][1], cfg, True, stop), (1, 2, 3), L, reps)

    def sized_read_rate(nbytes):
        """B/s of a plain read of ``nbytes`` of the hot pool a launch, L launches in one graph (as the
        graph's layers read), best of three read shapes."""
        part = int(nbytes) // w13_hot.element_size()
        return best_read_bandwidth(w13_hot.view(-1)[: L * part], ((4096, 1), (4096, 4), (4096, 16)), args.reps,
                                   launches=L)

    def distinct_bytes(rs):
        return sum(int(torch.unique(r[0]).numel()) for r in rs) * expert_bytes / L

    def equal(xs_, ys_):
        return all(torch.equal(x_, y_) for x_, y_ in zip(xs_, ys_))

    def max_err(outs, xs, rs):
        errs = []
        for l in range(L):
            ref = torch_experts(pools, l, xs[l], *rs[l]).float()
            errs.append(float((outs[l].float() - ref).norm() / ref.norm()))
        return max(errs)

    def time_variant(B, cfg, fields, xs, rs, bound_us, out_tuned):
        """One config variant at batch B, all hot: µs (median of two graph medians, with their
        spread), bitwise against the row map compiled out and against the tuned config, error vs
        torch; up to 64 tokens also all cold (µs, bitwise equal to all hot); cumulative stage
        times, above 64 also the grouping alone."""
        cfg_v = KernelConfig.from_dict({**cfg.to_dict(), **fields})
        out_v, out_o = [], []
        us = spread([graph_time_us(run_all(pools, xs, rs, cfg_v, True, out_v), args.reps) / L for _ in range(2)])
        graph_time_us(run_all(unmodified, xs, rs, cfg_v, False, out_o), 3)
        r = {"fields": fields, "config": cfg_v.to_dict(), "us": us["median"], "us_spread": us,
             "pct_of_bound": 100 * bound_us / us["median"], "bitwise_rowmap_vs_off": equal(out_v, out_o),
             "bitwise_vs_tuned": equal(out_v, out_tuned), "max_rel_err_vs_torch": max_err(out_v, xs, rs)}
        if B <= 64:  # the cold tier read in place: the variant's cost on the link, and its bits there
            out_c = []
            r["cold_us"] = timed(run_all(pools, xs, rs, cfg_v, True, out_c), cold_reps, all_cold_map)
            r["bitwise_cold_vs_hot"] = equal(out_v, out_c)
        r["stages_us"] = stage_times(cfg_v, xs, rs, max(5, args.reps // 2))
        if B > 64 and not fields:
            r["grouping_us"] = graph_time_us(lambda: [group_pairs(rs[l][0].reshape(-1), E) for l in range(L)],
                                             max(5, args.reps // 2)) / L
        log("variant", B, {k: v for k, v in r.items() if k != "config"})
        return r

    # --- autotune (the package's cache machinery), then the same call again: a hit
    shape = TuneShape(num_experts=E, hidden=H, intermediate=I, top_k=K, dtype="bfloat16", num_moe_layers=48,
                      num_hot=48 * E, num_cold=0)
    tuned_for_provenance = None
    if args.configs:
        with open(args.configs) as f:
            given = json.load(f)["autotune"]
        tuned = TuneResult(key=given["key"], hit=False, backend="triton", shape=shape, batch_sizes=batches,
                           configs={int(b): c for b, c in given["configs"].items()})
        res["autotune"] = {"skipped": True, "configs_from": args.configs, "key_of_that_run": given["key"],
                           "configs": given["configs"]}
    else:
        t0 = time.time()
        tuned = tuned_for_provenance = autotune(shape, batches, "cuda", cache_dir=args.cache_dir)
        miss_s = time.time() - t0
        t0 = time.time()
        tuned2 = autotune(shape, batches, "cuda", cache_dir=args.cache_dir)
        res["autotune"] = {"key": tuned.key, "first_hit": tuned.hit, "first_s": miss_s, "second_hit": tuned2.hit,
                           "second_s": time.time() - t0, "configs": {str(b): c for b, c in tuned.configs.items()},
                           "timings_us": {str(b): t for b, t in tuned.timings_us.items()}}
    log("autotune", res["autotune"])
    torch.cuda.empty_cache()

    def save():
        write_result(out_path, res, res["ceilings"], tuned_for_provenance)

    # --- config sweep at batch 1 (hot and cold): the split of weight rows over blocks
    sweep = []
    if args.sweep:
        xs, rs = make_case(1)
        cands = [KernelConfig(16, n1, k1, n2, k2, w, s) for (n1, n2) in ((16, 16), (32, 32), (64, 64), (16, 32), (32, 64))
                 for (k1, k2) in ((128, 128), (256, 256)) for (w, s) in ((4, 3),)]
        cands += [KernelConfig(16, 32, 128, 32, 128, 4, 4), KernelConfig(16, 16, 128, 16, 128, 2, 4),
                  KernelConfig(16, 32, 64, 32, 64, 4, 5)]
        for cfg in cands:
            try:
                hot_us = timed(run_all(pools, xs, rs, cfg), args.reps, all_hot_map)
                cold_us = timed(run_all(pools, xs, rs, cfg), cold_reps, all_cold_map)
            except Exception as exc:  # e.g. out of shared memory for a large tile: skip that config
                log("sweep", cfg, "failed:", repr(exc)[:200])
                continue
            sweep.append({"config": cfg.to_dict(), "hot_us": hot_us, "cold_us": cold_us})
            log("sweep", cfg, f"hot {hot_us:.1f} us cold {cold_us:.1f} us")
        res["sweep_batch1"] = sweep
    best_hot = min(sweep, key=lambda r: r["hot_us"])["config"] if sweep else tuned.configs.get(1, DEFAULT_DECODE_CONFIG.to_dict())
    best_cold = min(sweep, key=lambda r: r["cold_us"])["config"] if sweep else best_hot
    res["best_hot_config"], res["best_cold_config"] = best_hot, best_cold

    # --- per batch size
    res["vllm_stored"] = {"source": VLLM_STORED["source"], "us": {str(b): us for b, us in VLLM_STORED["us"].items()}}
    rows = res["batches"] = []
    for B in batches:
        cfg = KernelConfig.from_dict(config_for(tuned, B))
        dflt = DEFAULT_DECODE_CONFIG if B <= 64 else DEFAULT_PREFILL_CONFIG
        xs, rs = make_case(B)
        nbytes = distinct_bytes(rs)
        flops = 2 * B * K * (2 * I * H + H * I)
        bound_us = max(nbytes / hbm, flops / mm_rate) * 1e6
        out_on, out_off, out_cold = [], [], []
        pools.set_row_map(all_hot_map)
        on_runs, off_runs = [], []
        for i in range(args.rounds):  # interleaved, as the row-map cost compares the two
            on_runs.append(graph_time_us(run_all(pools, xs, rs, cfg, True, out_on if i == 0 else None), args.reps) / L)
            off_runs.append(graph_time_us(run_all(unmodified, xs, rs, cfg, False, out_off if i == 0 else None),
                                          args.reps) / L)
        hot, off = spread(on_runs), spread(off_runs)
        dflt_us = timed(run_all(pools, xs, rs, dflt), args.reps, all_hot_map)
        base = {}
        if baseline is not None:
            # the baseline's own fields only (an older kernel has no split_k / tile_order / half_buf:
            # it runs the same tiles unsplit, so its bits equal ours only where those are off)
            known = set(baseline.KernelConfig.__dataclass_fields__)
            bcfg = baseline.KernelConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k in known})
            out_base = []

            def base_fn():
                out_base[:] = [baseline.triton_experts(pools, l, xs[l], rs[l][0], rs[l][1], bcfg, True) for l in range(L)]
            base = {"baseline_config": bcfg.to_dict(), "baseline_us": graph_time_us(base_fn, args.reps) / L,
                    "bitwise_vs_baseline": equal(out_on, out_base)}
        row = {"batch": B, "config": cfg.to_dict(), "default_config_us": dflt_us, "distinct_expert_MB": nbytes / 1e6,
               "bound_us": bound_us, "hot_us": hot["median"], "hot_us_spread": hot, "off_us": off["median"],
               "off_us_spread": off, **base}
        if B <= 64:
            # The read ceiling at this size: L launches each streaming nbytes of the hot pool (the
            # graph's layers read as much, once each), best of three read shapes.
            sized = sized_read_rate(nbytes)
            row["sized_read_GBps"] = sized / 1e9
            row["pct_of_sized_read"] = 100 * nbytes / sized / (row["hot_us"] * 1e-6)
            # Where the time goes: each launch (cumulative stages) against a plain read of its own
            # bytes (w13 two thirds of the distinct bytes, w2 one third), one launch a layer.
            st = stage_times(cfg, xs, rs, args.reps)
            row["stages_us"] = {"w13_act": st[1], "w13_act+w2": st[2], "all_three": st[3]}
            row["stage_read_us"] = {name: part_bytes / sized_read_rate(part_bytes) * 1e6
                                    for name, part_bytes in (("w13", nbytes * 2 / 3), ("w2", nbytes / 3))}
        if B in VLLM_STORED["us"]:
            row["vllm_stored_us"] = VLLM_STORED["us"][B]
            row["speed_vs_stored_vllm"] = VLLM_STORED["us"][B] / row["hot_us"]
        row["hot_GBps"] = nbytes / (row["hot_us"] * 1e-6) / 1e9
        row["rowmap_cost_pct"] = 100 * (row["hot_us"] / row["off_us"] - 1)
        if B <= 64:
            row["cold_us"] = timed(run_all(pools, xs, rs, cfg, True, out_cold), cold_reps, all_cold_map)
            row["cold_GBps"] = nbytes / (row["cold_us"] * 1e-6) / 1e9
            row["cold_pct_pinned"] = 100 * row["cold_GBps"] * 1e9 / pinned
        row["torch_us"] = eager_time_us(lambda: [torch_experts(pools, l, xs[l], *rs[l]) for l in range(L)],
                                        5 if B > 64 else 10) / L
        # correctness: bitwise across placements, error vs torch
        row.update({"bitwise_rowmap_vs_off": equal(out_on, out_off),
                    "bitwise_cold_vs_hot": equal(out_on, out_cold) if out_cold else None,
                    "max_rel_err_vs_torch": max_err(out_on, xs, rs)})
        if B in variants:
            pools.set_row_map(all_hot_map)
            row["variants"] = [time_variant(B, cfg, v, xs, rs, bound_us, out_on) for v in [{}] + variants[B]]
        rows.append(row)
        log("batch", B, {k: v for k, v in row.items() if k != "config"})
        save()

    if not args.no_batch1:
        # --- batch 1 stage breakdown (w13+act alone, + w2, + top-k sum), tuned config, all hot
        xs, rs = make_case(1)
        cfg1 = KernelConfig.from_dict(best_hot)
        pools.set_row_map(all_hot_map)
        st = stage_times(cfg1, xs, rs, args.reps)
        res["batch1_stages_us"] = {"w13_act": st[1], "w13_act+w2": st[2], "all_three": st[3],
                                   "w13_MB": 8 * 2 * I * H * 2 / 1e6, "w2_MB": 8 * H * I * 2 / 1e6}
        log("stages", res["batch1_stages_us"])

        # --- dependent launch off / with w2 prefetch / launch only, at batch 1, else the tuned config
        pdl_ab = {}
        for pdl in (0, 1, 2):
            cfgp = KernelConfig.from_dict({**best_hot, "pdl": pdl})
            hot = spread([timed(run_all(pools, xs, rs, cfgp), args.reps, all_hot_map) for _ in range(2)])
            pdl_ab[pdl] = {"hot_us": hot["median"], "hot_spread": hot,
                           "cold_us": timed(run_all(pools, xs, rs, cfgp), cold_reps, all_cold_map)}
        res["batch1_pdl_ab"] = pdl_ab
        log("pdl a/b", pdl_ab)

        # --- best decode config at batch 1 for hot, cold, off (from the sweep, if run)
        if sweep:
            xs, rs = make_case(1)
            nbytes = distinct_bytes(rs)
            r1 = {}
            for name, cfgd in (("best_hot", best_hot), ("best_cold", best_cold)):
                cfg = KernelConfig.from_dict(cfgd)
                on, off = [], []
                for _ in range(2):
                    on.append(timed(run_all(pools, xs, rs, cfg), args.reps, all_hot_map))
                    off.append(graph_time_us(run_all(unmodified, xs, rs, cfg, False), args.reps) / L)
                cold = timed(run_all(pools, xs, rs, cfg), cold_reps, all_cold_map)
                hot, off_ = spread(on), spread(off)
                r1[name] = {"config": cfgd, "hot_us": hot["median"], "hot_spread": hot, "off_us": off_["median"],
                            "off_spread": off_, "cold_us": cold,
                            "hot_pct_hbm": 100 * nbytes / (hot["median"] * 1e-6) / hbm,
                            "cold_pct_pinned": 100 * nbytes / (cold * 1e-6) / pinned,
                            "rowmap_cost_pct": 100 * (hot["median"] / off_["median"] - 1)}
            res["batch1_tuned"] = r1
            log("batch1 tuned", r1)

        # --- mixed: 4 hot + 4 cold of the 8 selected, against the sum of the two parts (top-4 each)
        cfg = KernelConfig.from_dict(best_cold)
        xs, rs = make_case(1)
        mixed_map = all_hot_map.clone()
        for l in range(L):
            for e in rs[l][0][0, 4:].tolist():
                mixed_map[l, e] = -(l * E + e) - 1
        hot_part = [(r[0][:, :4].contiguous(), r[1][:, :4].contiguous()) for r in rs]
        cold_part = [(r[0][:, 4:].contiguous(), r[1][:, 4:].contiguous()) for r in rs]
        out_mixed, out_hot = [], []
        mixed_us = timed(run_all(pools, xs, rs, cfg, True, out_mixed), cold_reps, mixed_map)
        hot4_us = timed(run_all(pools, xs, hot_part, cfg), args.reps)
        graph_time_us(run_all(pools, xs, rs, cfg, True, out_hot), 3)
        cold4_us = timed(run_all(pools, xs, cold_part, cfg), cold_reps, all_cold_map)
        res["mixed"] = {"config": cfg.to_dict(), "mixed_us": mixed_us, "hot4_us": hot4_us, "cold4_us": cold4_us,
                        "sum_parts_us": hot4_us + cold4_us, "mixed_over_sum": mixed_us / (hot4_us + cold4_us),
                        "bitwise_mixed_vs_hot": equal(out_mixed, out_hot)}
        log("mixed", res["mixed"])
    save()

    # --- the largest batch's stages (prefill: where its time goes)
    big = max(batches)
    if big > 64:
        xs, rs = make_case(big)
        cfgb = KernelConfig.from_dict(config_for(tuned, big))
        pools.set_row_map(all_hot_map)
        sb = stage_times(cfgb, xs, rs, max(5, args.reps // 2))
        res["largest_batch_stages_us"] = {"batch": big, "config": cfgb.to_dict(), "grouping+w13_act": sb[1],
                                          "+w2": sb[2], "+sum": sb[3]}
        save()
    return res



def run_fp8(args, argv=None) -> dict:
    """The block-FP8 experts kernel beside the bf16 kernel (``--weight-format fp8``), written as
    ``kernel_bench.json`` of kind ``kernel-fp8`` (:func:`coldset.measure.render.render_kernel_fp8`).

    E=128, H=2048, I=768, top-8, bf16 activations; the same random weights in bf16 and quantized to
    FP8 (:func:`coldset.core.fp8.quantize_w13`, :func:`~coldset.core.fp8.quantize_weight`). Per batch:
    correctness first (the FP8 kernel against the torch path, rel. error; bitwise with the row map
    compiled out), then the FP8 kernel's time with each config of the FP8 search space for its
    regime (:data:`coldset.kernels.tune.TRITON_FP8_SEARCH_SPACE`, or ``--fp8-configs``' list at every
    batch; the fastest reported with all timings) and the fastest one's launches timed
    cumulatively (``fp8_stages_us``: :func:`coldset.kernels.triton_fp8.fp8_launches`; with
    ``--fp8-configs`` every config's, ``fp8_candidates_stages_us``),
    the bf16 kernel with ``--configs``' tuned config (its default without), and a plain read of
    each format's distinct expert bytes (weights and scales) measured now (up to 64 tokens also of
    w13's and w2's parts apart, ``fp8_stage_read_us``: the stages' own reads). Up to 4 tokens also
    all-cold FP8 (weights and scales read in place from pinned host memory), bitwise against hot.
    """
    import torch

    from coldset.core import fp8
    from coldset.kernels.bandwidth import HBM_READ_SHAPES, best_read_bandwidth
    from coldset.kernels.reference import torch_experts, torch_softmax_topk
    from coldset.kernels import triton_experts  # picks the FP8 or the bf16 kernel by the pools' format
    from coldset.kernels.triton_fp8 import fp8_launches, triton_fp8_experts
    from coldset.kernels.triton_moe import KernelConfig, default_config
    from coldset.kernels.tiers import ExpertPools, check_host_allocation, host_tier
    from coldset.core.timing import eager_time_us, graph_time_us
    from coldset.kernels.tune import TRITON_FP8_SEARCH_SPACE

    out_path = Path(args.out) / "kernel_bench.json"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    E, H, I, K, L = 128, 2048, 768, 8, args.layers
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.time()
    w13 = torch.empty(L, E, 2 * I, H, dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty(L, E, H, I, dtype=torch.bfloat16, device="cuda")
    q13 = torch.empty(w13.shape, dtype=fp8.FP8_DTYPE, device="cuda")
    q2 = torch.empty(w2.shape, dtype=fp8.FP8_DTYPE, device="cuda")
    s13 = torch.empty(L, E, fp8.w13_scale_rows(I), fp8.scale_grid(I, H)[1], device="cuda")
    s2 = torch.empty(L, E, *fp8.scale_grid(H, I), device="cuda")
    for layer in range(L):  # drawn and quantized a layer at a time (float32 temporaries)
        w13[layer] = torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H**0.5
        w2[layer] = torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5
        (q13[layer], s13[layer]), (q2[layer], s2[layer]) = fp8.quantize_w13(w13[layer]), fp8.quantize_weight(w2[layer])
    bf16_pools = ExpertPools.all_hot(w13, w2)
    fp8_pools = ExpertPools.all_hot(q13, q2, s13, s2)
    fp8_w13_bytes = q13[0, 0].numel() + s13[0, 0].numel() * 4  # w13's part of an expert (weights and scales)
    fp8_expert_bytes = fp8_w13_bytes + q2[0, 0].numel() + s2[0, 0].numel() * 4
    bf16_expert_bytes = (w13[0, 0].numel() + w2[0, 0].numel()) * 2
    torch.cuda.synchronize()
    log(f"pools ready in {time.time() - t0:.1f}s; bytes per expert fp8 {fp8_expert_bytes}, bf16 {bf16_expert_bytes}")
    res = new_result("kernel-fp8", argv, args)
    res["shape"] = dict(E=E, H=H, I=I, top_k=K, layers=L, activations="bfloat16")
    res["bytes_per_expert"] = {"fp8": fp8_expert_bytes, "bf16": bf16_expert_bytes}

    # --- ceilings, this process
    hbm = best_read_bandwidth(w13.view(-1), HBM_READ_SHAPES, args.reps)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    bf16_rate = 2 * 8192**3 / (eager_time_us(lambda: a @ a, 10) * 1e-6)
    af, one = a.to(fp8.FP8_DTYPE), torch.ones((), device="cuda")
    fp8_rate = 2 * 8192**3 / (eager_time_us(
        lambda: torch._scaled_mm(af, af.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 10) * 1e-6)
    del a, af
    res["ceilings"] = {"hbm_read_GBps": hbm / 1e9, "bf16_matmul_TFLOPs": bf16_rate / 1e12,
                       "fp8_matmul_TFLOPs": fp8_rate / 1e12}
    log("ceilings", res["ceilings"])
    bf16_tuned = {}
    if args.configs:
        bf16_tuned = {int(b): c for b, c in json.loads(Path(args.configs).read_text())["autotune"]["configs"].items()}
    res["bf16_configs_from"] = args.configs
    given = load_fp8_configs(args.fp8_configs) if args.fp8_configs else None
    res["fp8_configs_from"] = args.fp8_configs

    def case(num_tokens):
        xs = [torch.randn(num_tokens, H, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(L)]
        rs = []
        for _ in range(L):
            ids, w = torch_softmax_topk(torch.randn(num_tokens, E, device="cuda", generator=gen), K, True)
            rs.append((ids, w.to(torch.bfloat16)))
        return xs, rs

    def run_all(pools, xs, rs, cfg, use_row_map=True, outs=None):
        def fn():
            got = [triton_experts(pools, l, xs[l], rs[l][0], rs[l][1], cfg, use_row_map) for l in range(L)]
            if outs is not None:
                outs[:] = got
        return fn

    def plain_read_us(pool_tensor, nbytes):
        """µs a layer of a plain read of ``nbytes`` of the pool's own bytes, one read launch a layer, in one graph."""
        flat = pool_tensor.view(-1).view(torch.bfloat16)
        rate = best_read_bandwidth(flat[: L * (int(nbytes) // 2)], ((4096, 1), (4096, 4), (4096, 16)), args.reps,
                                   launches=L)
        return nbytes / rate * 1e6

    def stages_us(cfg, xs, rs):
        """Cumulative µs a layer after each of the FP8 call's launches (all hot, the row map on)."""
        return cumulative_stage_us(
            lambda l, stop: triton_fp8_experts(fp8_pools, l, xs[l], rs[l][0], rs[l][1], cfg, True, stop),
            fp8_launches(cfg), L, args.reps)

    def save():
        write_result(out_path, res, res["ceilings"])

    space = TRITON_FP8_SEARCH_SPACE
    res["batches"] = rows = []
    for B in batches:
        xs, rs = case(B)
        distinct = sum(int(torch.unique(r[0]).numel()) for r in rs) / L
        row: dict = {"batch": B, "distinct_experts_per_layer": distinct}
        regime = "decode" if B <= space["decode_max_tokens"] else "prefill"
        timings, outs_by = {}, {}
        for cand in given or space[regime]:
            cfg = KernelConfig.from_dict(cand)
            outs: list = []
            try:
                timings[json.dumps(cand, sort_keys=True)] = graph_time_us(
                    run_all(fp8_pools, xs, rs, cfg, True, outs), args.reps) / L
                outs_by[json.dumps(cand, sort_keys=True)] = outs
            except Exception as exc:  # noqa: BLE001 - a config that cannot run here is reported, not fatal
                log("fp8 config failed", B, cand, repr(exc)[:300])
                row.setdefault("fp8_failed_configs", []).append({"config": cand, "error": repr(exc)[:300]})
        if not timings:
            raise MeasureError(f"batch {B}: no FP8 config of {args.fp8_configs or 'the search space'} ran "
                               "(fp8_failed_configs)")
        best = min(timings, key=timings.get)
        cfg = KernelConfig.from_dict(json.loads(best))
        outs_on, outs_off = outs_by[best], []
        graph_time_us(run_all(fp8_pools, xs, rs, cfg, False, outs_off), 3)
        # every candidate against the torch path of its own numerics (w8a16: no activation quantized)
        refs_by_mode = {m: [torch_experts(fp8_pools, l, xs[l], *rs[l], w8a16=m).float() for l in (0, L - 1)]
                        for m in {bool(json.loads(k).get("w8a16", 0)) for k in outs_by}}
        cand_errs = {}
        for key, outs in outs_by.items():
            refs = refs_by_mode[bool(json.loads(key).get("w8a16", 0))]
            cand_errs[key] = max(float((outs[l].float() - ref).norm() / ref.norm())
                                 for l, ref in zip((0, L - 1), refs))
        row.update({"fp8_us": timings[best], "fp8_config": json.loads(best), "fp8_candidates_us": timings,
                    "fp8_rel_err_vs_torch": cand_errs[best], "fp8_candidates_rel_err_vs_torch": cand_errs,
                    "fp8_bitwise_rowmap_vs_off": all(torch.equal(x_, y_) for x_, y_ in zip(outs_on, outs_off))})
        # where the time goes: each launch cumulatively (the fastest config; with --fp8-configs every one)
        if given:
            row["fp8_candidates_stages_us"] = {k: stages_us(KernelConfig.from_dict(json.loads(k)), xs, rs)
                                               for k in timings}
        row["fp8_stages_us"] = row["fp8_candidates_stages_us"][best] if given else stages_us(cfg, xs, rs)
        bcfg = KernelConfig.from_dict(bf16_tuned[B]) if B in bf16_tuned else default_config(B, K)
        row["bf16_config"], row["bf16_config_tuned"] = bcfg.to_dict(), B in bf16_tuned
        row["bf16_us"] = graph_time_us(run_all(bf16_pools, xs, rs, bcfg), args.reps) / L
        fp8_bytes, bf16_bytes = distinct * fp8_expert_bytes, distinct * bf16_expert_bytes
        flops = 6.0 * B * K * H * I
        if B <= 64:  # the stages' own ceilings: a plain read of w13's and of w2's part of the bytes
            row["fp8_stage_read_us"] = {"w13": plain_read_us(q13, distinct * fp8_w13_bytes),
                                        "w2": plain_read_us(q13, distinct * (fp8_expert_bytes - fp8_w13_bytes))}
        row.update({"fp8_MB": fp8_bytes / 1e6, "fp8_plain_read_us": plain_read_us(q13, fp8_bytes),
                    "bf16_plain_read_us": plain_read_us(w13, bf16_bytes),
                    "fp8_bytes_bound_us": fp8_bytes / hbm * 1e6, "bf16_bytes_bound_us": bf16_bytes / hbm * 1e6,
                    "fp8_flop_bound_us": flops / fp8_rate * 1e6, "bf16_flop_bound_us": flops / bf16_rate * 1e6})
        rows.append(row)
        log(B, {k: v for k, v in row.items() if k != "fp8_candidates_us"})
        save()

    cold_batches = [r for r in rows if r["batch"] <= 4]
    if cold_batches:  # every expert read in place from pinned host memory
        check_host_allocation(L * E * fp8_expert_bytes, "benchmark pinned FP8 cold tier")
        host = host_tier(fp8_pools)
        cold_map = -torch.arange(L * E, dtype=torch.int32, device="cuda").reshape(L, E) - 1
        cold_pools = ExpertPools(fp8_pools.w13_hot, fp8_pools.w2_hot, host.w13, host.w2, cold_map,
                                 w13_scale_hot=fp8_pools.w13_scale_hot, w2_scale_hot=fp8_pools.w2_scale_hot,
                                 w13_scale_cold=host.w13_scale, w2_scale_cold=host.w2_scale)
        cold_pools.validate()
        pinned = best_read_bandwidth(host.w13.view(-1).view(torch.bfloat16)[: 2**28], ((4096, 1), (4096, 4)), 10)
        res["ceilings"]["pinned_read_GBps"] = pinned / 1e9
        for row in cold_batches:
            xs, rs = case(row["batch"])
            cfg = KernelConfig.from_dict(row["fp8_config"])
            outs_c, outs_h = [], []
            row["fp8_cold_us"] = graph_time_us(run_all(cold_pools, xs, rs, cfg, True, outs_c), 5) / L
            run_all(fp8_pools, xs, rs, cfg, True, outs_h)()
            row["fp8_cold_bitwise_vs_hot"] = all(torch.equal(x_, y_) for x_, y_ in zip(outs_c, outs_h))
            distinct = sum(int(torch.unique(r[0]).numel()) for r in rs) / L
            row["fp8_cold_link_bound_us"] = distinct * fp8_expert_bytes / pinned * 1e6
        save()
    res["fails"] = [f"batch {r['batch']}: {what}" for r in rows for what, bad in
                    (("FP8 kernel not bitwise with the row map compiled out", not r["fp8_bitwise_rowmap_vs_off"]),
                     ("FP8 all-cold not bitwise all-hot", r.get("fp8_cold_bitwise_vs_hot") is False),
                     ("FP8 rel. error vs the torch path >= 2e-2", r["fp8_rel_err_vs_torch"] >= 2e-2)) if bad]
    # a search-space config that cannot run, or computes another function, fails the run (not only its row)
    res["fails"] += [f"batch {r['batch']}: FP8 config failed: {f['config']}: {f['error'][:120]}"
                     for r in rows for f in r.get("fp8_failed_configs", [])]
    res["fails"] += [f"batch {r['batch']}: FP8 config {k} rel. error vs its torch path {e:.1e} >= 2e-2"
                     for r in rows for k, e in r["fp8_candidates_rel_err_vs_torch"].items() if e >= 2e-2]
    save()
    return res
