#!/usr/bin/env python3
"""Fused-MoE kernel benchmark on one CUDA GPU at Qwen3-30B-A3B shapes (E=128, H=2048, I=768, top-8).

Measures in ONE process, so every ratio compares numbers taken on the same machine minutes apart:
the HBM streaming-read bandwidth and the pinned zero-copy read bandwidth (a Triton read kernel),
then the Triton experts kernel per MoE layer, CUDA-graph replayed, median of repeats, on fresh
random weights and activations, with ``--layers`` layers' experts rotated inside each graph so that
no layer's weights are served from L2 (8 layers x 75 MB selected at batch 1, L2 is 60 MB):
all-hot with the row map, with the indirection compiled out, all-cold (every expert read in place
from pinned host memory), mixed (4 hot + 4 cold) against the sum of its two parts, and batch 1, 4,
16, 64 and a 2048-token prefill against the torch reference (eager) and the measured bound.
Also checks bitwise identity across placements and the error against the torch path, and times the
stages (grouping + w13 + act, + w2, + top-k sum) cumulatively at batch 1 and at the largest batch.

    PYTHONPATH=src python3 scripts/kernel_bench.py --out results_dir

``--baseline-module FILE`` also times another copy of triton_moe.py (an earlier commit's) on the
same inputs and configs and checks its output bit for bit; ``--configs JSON`` takes an earlier
run's tuned configs instead of tuning (saves the tuning time of a cache miss). The batch sizes
listed in NOTES.md also get vLLM's figures from there as a ratio (another run: see VLLM_H200_US).

Writes ``kernel_bench.json`` under --out and prints a short markdown table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

from coldset.kernels.bandwidth import read_bandwidth
from coldset.kernels.reference import torch_experts, torch_softmax_topk
from coldset.kernels.triton_moe import DEFAULT_DECODE_CONFIG, DEFAULT_PREFILL_CONFIG, KernelConfig, triton_experts
from coldset.tiers import ExpertPools, check_host_allocation
from coldset.tune import TuneResult, TuneShape, autotune, config_for, eager_time_us, graph_time_us


# vLLM's fused_moe Triton kernel with its H200-tuned config at these shapes, all hot, µs per layer,
# its token-alignment step not included: /work/shared/NOTES.md (measured on the lent H200 in an
# earlier run, not in this process; ratios against it carry that run-to-run spread).
VLLM_H200_US = {1: 30.4, 4: 78.8, 16: 196.6, 64: 295.5, 256: 318.9, 2048: 482.2}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def routing(num_tokens, num_experts, top_k, gen):
    logits = torch.randn(num_tokens, num_experts, generator=gen, device="cuda")
    ids, w = torch_softmax_topk(logits, top_k, renormalize=True)
    return ids, w.to(torch.bfloat16)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=30)
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
    p.add_argument("--variants", default=None,
                   help='JSON {"batch": [{field: value, ...}, ...]}: each dict overrides fields of that batch\'s '
                        'tuned config; each variant is timed beside it (all hot), checked bit for bit against the '
                        'row map compiled out and against the torch path, and above 64 tokens timed by stage')
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)  # the JSON is written there along the way
    variants = {int(b): v for b, v in json.loads(args.variants).items()} if args.variants else {}
    baseline = None
    if args.baseline_module:
        import importlib.util

        spec = importlib.util.spec_from_file_location("baseline_triton_moe", args.baseline_module)
        baseline = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = baseline  # dataclasses look their module up there
        spec.loader.exec_module(baseline)
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    E, H, I, K, L = 128, 2048, 768, 8, args.layers
    dtype = torch.bfloat16
    dev = torch.cuda.get_device_properties(0)
    res = {"device": torch.cuda.get_device_name(0), "sms": dev.multi_processor_count,
           "torch": torch.__version__, "triton": triton.__version__, "shape": dict(E=E, H=H, I=I, top_k=K, dtype="bfloat16", layers=L)}
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

    # --- ceilings, measured now
    hbm = max(read_bandwidth(w13_hot.view(-1), 4096, it, args.reps) for it in (4, 16))
    pinned_candidates = {f"block{b}_iters{it}": read_bandwidth(w13_cold.view(-1)[: 2**29], b, it, 10)
                         for b, it in ((1024, 1), (4096, 1), (4096, 4), (8192, 8))}
    pinned = max(pinned_candidates.values())
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    bmat = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    mm_us = eager_time_us(lambda: a @ bmat, 10)
    mm_rate = 2 * 8192**3 / (mm_us * 1e-6)
    del a, bmat
    res["ceilings"] = {"hbm_read_GBps": hbm / 1e9, "pinned_read_GBps": pinned / 1e9,
                       "pinned_candidates_GBps": {k: v / 1e9 for k, v in pinned_candidates.items()},
                       "bf16_matmul_TFLOPs": mm_rate / 1e12}
    log("ceilings", res["ceilings"])

    def make_case(num_tokens, top_k=K):
        xs = [torch.randn(num_tokens, H, device="cuda", generator=gen).to(dtype) for _ in range(L)]
        rs = [routing(num_tokens, E, top_k, gen) for _ in range(L)]
        return xs, rs

    def run_all(pl, xs, rs, cfg, use_row_map=True, outs=None):
        def fn():
            res_ = [triton_experts(pl, layer, xs[layer], rs[layer][0], rs[layer][1], cfg, use_row_map) for layer in range(L)]
            if outs is not None:
                outs[:] = res_
        return fn

    def stage_times(cfg, xs, rs, reps):
        """Cumulative µs per layer after each launch ({1: w13 + act (with the grouping), 2: + w2, 3: + sum})."""
        return {stop: graph_time_us(lambda: [triton_experts(pools, l, xs[l], rs[l][0], rs[l][1], cfg, True, stop)
                                             for l in range(L)], reps) / L for stop in (1, 2, 3)}

    def sized_read_rate(nbytes):
        """B/s of a plain read of ``nbytes`` of the hot pool a launch, L launches in one graph (as the
        graph's layers read), best of three read shapes."""
        part = int(nbytes) // w13_hot.element_size()
        return max(read_bandwidth(w13_hot.view(-1)[: L * part], 4096, it, args.reps, launches=L) for it in (1, 4, 16))

    def distinct_bytes(rs):
        return sum(int(torch.unique(r[0]).numel()) for r in rs) * expert_bytes / L

    def time_variant(B, cfg, fields, xs, rs, bound_us, out_tuned):
        """One config variant at batch B, all hot: µs (better of two graph medians), bitwise against
        the row map compiled out and against the tuned config, error vs torch; up to 64 tokens also
        all cold (µs, bitwise equal to all hot); cumulative stage times, above 64 also the grouping alone."""
        from coldset.kernels.triton_moe import group_pairs

        cfg_v = KernelConfig.from_dict({**cfg.to_dict(), **fields})
        out_v, out_o = [], []
        us = min(graph_time_us(run_all(pools, xs, rs, cfg_v, True, out_v), args.reps) / L for _ in range(2))
        graph_time_us(run_all(unmodified, xs, rs, cfg_v, False, out_o), 3)
        errs = []
        for l in range(L):
            ref = torch_experts(pools, l, xs[l], *rs[l]).float()
            errs.append(float((out_v[l].float() - ref).norm() / ref.norm()))
        r = {"fields": fields, "config": cfg_v.to_dict(), "us": us, "pct_of_bound": 100 * bound_us / us,
             "bitwise_rowmap_vs_off": all(torch.equal(a_, b_) for a_, b_ in zip(out_v, out_o)),
             "bitwise_vs_tuned": all(torch.equal(a_, b_) for a_, b_ in zip(out_v, out_tuned)),
             "max_rel_err_vs_torch": max(errs)}
        if B <= 64:  # the cold tier read in place: the variant's cost on the link, and its bits there
            out_c = []
            pools.set_row_map(all_cold_map)
            r["cold_us"] = graph_time_us(run_all(pools, xs, rs, cfg_v, True, out_c), max(5, args.reps // 3)) / L
            pools.set_row_map(all_hot_map)
            r["bitwise_cold_vs_hot"] = all(torch.equal(a_, b_) for a_, b_ in zip(out_v, out_c))
        # cumulative stages: which launch a variant changes
        r["stages_us"] = stage_times(cfg_v, xs, rs, max(5, args.reps // 2))
        if B > 64 and not fields:
            r["grouping_us"] = graph_time_us(lambda: [group_pairs(rs[l][0].reshape(-1), E) for l in range(L)],
                                             max(5, args.reps // 2)) / L
        log("variant", B, {k: v for k, v in r.items() if k != "config"})
        return r

    # --- autotune (the package's cache machinery), then the same call again: a hit
    batches = [int(b) for b in args.batches.split(",")]
    shape = TuneShape(num_experts=E, hidden=H, intermediate=I, top_k=K, dtype="bfloat16", num_moe_layers=48,
                      num_hot=48 * E, num_cold=0)
    if args.configs:
        with open(args.configs) as f:
            given = json.load(f)["autotune"]
        tuned = TuneResult(key=given["key"], hit=False, backend="triton", shape=shape, batch_sizes=batches,
                           configs={int(b): c for b, c in given["configs"].items()})
        res["autotune"] = {"skipped": True, "configs_from": args.configs, "key_of_that_run": given["key"],
                           "configs": given["configs"]}
    else:
        t0 = time.time()
        tuned = autotune(shape, batches, "cuda", cache_dir=args.cache_dir)
        miss_s = time.time() - t0
        t0 = time.time()
        tuned2 = autotune(shape, batches, "cuda", cache_dir=args.cache_dir)
        hit_s = time.time() - t0
        res["autotune"] = {"key": tuned.key, "first_hit": tuned.hit, "first_s": miss_s, "second_hit": tuned2.hit,
                           "second_s": hit_s, "configs": {str(b): c for b, c in tuned.configs.items()},
                           "timings_us": {str(b): t for b, t in tuned.timings_us.items()}}
    log("autotune", res["autotune"])
    torch.cuda.empty_cache()

    checks = []
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
                pools.set_row_map(all_hot_map)
                hot_us = graph_time_us(run_all(pools, xs, rs, cfg), args.reps) / L
                pools.set_row_map(all_cold_map)
                cold_us = graph_time_us(run_all(pools, xs, rs, cfg), max(5, args.reps // 3)) / L
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
    rows = []
    for B in batches:
        cfg = KernelConfig.from_dict(config_for(tuned, B))
        dflt = DEFAULT_DECODE_CONFIG if B <= 64 else DEFAULT_PREFILL_CONFIG
        xs, rs = make_case(B)
        nbytes = distinct_bytes(rs)
        flops = 2 * B * K * (2 * I * H + H * I)
        bound_us = max(nbytes / hbm, flops / mm_rate) * 1e6
        out_on, out_off, out_cold = [], [], []
        pools.set_row_map(all_hot_map)
        on_us = graph_time_us(run_all(pools, xs, rs, cfg, True, out_on), args.reps) / L
        off_us = graph_time_us(run_all(unmodified, xs, rs, cfg, False, out_off), args.reps) / L
        on2_us = graph_time_us(run_all(pools, xs, rs, cfg, True), args.reps) / L
        off2_us = graph_time_us(run_all(unmodified, xs, rs, cfg, False), args.reps) / L
        pools.set_row_map(all_hot_map)
        dflt_us = graph_time_us(run_all(pools, xs, rs, dflt), args.reps) / L
        base = {}
        if baseline is not None:
            # the baseline's own fields only (an older kernel has no split_k / tile_order / half_buf:
            # it runs the same tiles unsplit, so its bits equal ours only where those are off)
            known = set(baseline.KernelConfig.__dataclass_fields__)
            bcfg = baseline.KernelConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k in known})
            out_base = []

            def base_fn():
                out_base[:] = [baseline.triton_experts(pools, l, xs[l], rs[l][0], rs[l][1], bcfg, True) for l in range(L)]
            base_us = graph_time_us(base_fn, args.reps) / L
            base = {"baseline_config": bcfg.to_dict(), "baseline_us": base_us,
                    "bitwise_vs_baseline": all(torch.equal(a_, b_) for a_, b_ in zip(out_on, out_base))}
        row = {"batch": B, "config": cfg.to_dict(), "default_config_us": dflt_us, "distinct_expert_MB": nbytes / 1e6, "bound_us": bound_us,
               "hot_us": min(on_us, on2_us), "hot_us_runs": [on_us, on2_us], "off_us": min(off_us, off2_us),
               "off_us_runs": [off_us, off2_us], **base}
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
        if B in VLLM_H200_US:
            row["vllm_notes_us"] = VLLM_H200_US[B]
            row["speed_vs_vllm"] = VLLM_H200_US[B] / row["hot_us"]
        row["hot_GBps"] = nbytes / (row["hot_us"] * 1e-6) / 1e9
        row["rowmap_cost_pct"] = 100 * (row["hot_us"] / row["off_us"] - 1)
        if B <= 64:
            pools.set_row_map(all_cold_map)
            row["cold_us"] = graph_time_us(run_all(pools, xs, rs, cfg, True, out_cold), max(5, args.reps // 3)) / L
            row["cold_GBps"] = nbytes / (row["cold_us"] * 1e-6) / 1e9
            row["cold_pct_pinned"] = 100 * row["cold_GBps"] * 1e9 / pinned
            pools.set_row_map(all_hot_map)
        row["torch_us"] = eager_time_us(lambda: [torch_experts(pools, l, xs[l], *rs[l]) for l in range(L)], 5 if B > 64 else 10) / L
        # correctness: bitwise across placements, error vs torch
        bit_cold = all(torch.equal(a_, b_) for a_, b_ in zip(out_on, out_cold)) if out_cold else None
        bit_off = all(torch.equal(a_, b_) for a_, b_ in zip(out_on, out_off))
        errs = []
        for l in range(L):
            ref = torch_experts(pools, l, xs[l], *rs[l]).float()
            errs.append(float((out_on[l].float() - ref).norm() / ref.norm()))
        row.update({"bitwise_rowmap_vs_off": bit_off, "bitwise_cold_vs_hot": bit_cold, "max_rel_err_vs_torch": max(errs)})
        checks.append((B, bit_off, bit_cold, max(errs)))
        if B in variants:
            pools.set_row_map(all_hot_map)
            row["variants"] = [time_variant(B, cfg, v, xs, rs, bound_us, out_on) for v in [{}] + variants[B]]
        rows.append(row)
        log("batch", B, {k: v for k, v in row.items() if k != "config"})
    res["batches"] = rows

    r1 = {}  # the sweep's winners at batch 1 (with --sweep)
    if not args.no_batch1:
        # --- batch 1 stage breakdown (w13+act alone, + w2, + top-k sum), tuned config, all hot
        xs, rs = make_case(1)
        cfg1 = KernelConfig.from_dict(best_hot)
        pools.set_row_map(all_hot_map)
        stages = stage_times(cfg1, xs, rs, args.reps)
        res["batch1_stages_us"] = {"w13_act": stages[1], "w13_act+w2": stages[2], "all_three": stages[3],
                                   "w13_MB": 8 * 2 * I * H * 2 / 1e6, "w2_MB": 8 * H * I * 2 / 1e6}
        log("stages", res["batch1_stages_us"])

        # --- programmatic dependent launch off / with w2 prefetch / launch only, at batch 1, otherwise the tuned config (hot and cold)
        pdl_ab = {}
        for pdl in (0, 1, 2):
            cfgp = KernelConfig.from_dict({**best_hot, "pdl": pdl})
            pools.set_row_map(all_hot_map)
            hot = [graph_time_us(run_all(pools, xs, rs, cfgp), args.reps) / L for _ in range(2)]
            pools.set_row_map(all_cold_map)
            cold = graph_time_us(run_all(pools, xs, rs, cfgp), max(5, args.reps // 3)) / L
            pools.set_row_map(all_hot_map)
            pdl_ab[pdl] = {"hot_us": min(hot), "hot_runs": hot, "cold_us": cold}
        res["batch1_pdl_ab"] = pdl_ab
        log("pdl a/b", pdl_ab)

        # --- best decode config at batch 1 for hot, cold, off (from the sweep, if run)
        if sweep:
            xs, rs = make_case(1)
            nbytes = distinct_bytes(rs)
            for name, cfgd in (("best_hot", best_hot), ("best_cold", best_cold)):
                cfg = KernelConfig.from_dict(cfgd)
                pools.set_row_map(all_hot_map)
                on = graph_time_us(run_all(pools, xs, rs, cfg), args.reps) / L
                off = graph_time_us(run_all(unmodified, xs, rs, cfg, False), args.reps) / L
                on2 = graph_time_us(run_all(pools, xs, rs, cfg), args.reps) / L
                off2 = graph_time_us(run_all(unmodified, xs, rs, cfg, False), args.reps) / L
                pools.set_row_map(all_cold_map)
                cold = graph_time_us(run_all(pools, xs, rs, cfg), max(5, args.reps // 3)) / L
                pools.set_row_map(all_hot_map)
                r1[name] = {"config": cfgd, "hot_us": min(on, on2), "off_us": min(off, off2), "runs": [on, off, on2, off2],
                            "cold_us": cold, "hot_pct_hbm": 100 * nbytes / (min(on, on2) * 1e-6) / hbm,
                            "cold_pct_pinned": 100 * nbytes / (cold * 1e-6) / pinned,
                            "rowmap_cost_pct": 100 * (min(on, on2) / min(off, off2) - 1)}
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
        pools.set_row_map(mixed_map)
        out_mixed = []
        mixed_us = graph_time_us(run_all(pools, xs, rs, cfg, True, out_mixed), max(5, args.reps // 3)) / L
        pools.set_row_map(all_hot_map)
        hot4_us = graph_time_us(run_all(pools, xs, hot_part, cfg), args.reps) / L
        out_hot = []
        graph_time_us(run_all(pools, xs, rs, cfg, True, out_hot), 3)
        pools.set_row_map(all_cold_map)
        cold4_us = graph_time_us(run_all(pools, xs, cold_part, cfg), max(5, args.reps // 3)) / L
        pools.set_row_map(all_hot_map)
        res["mixed"] = {"config": cfg.to_dict(), "mixed_us": mixed_us, "hot4_us": hot4_us, "cold4_us": cold4_us,
                        "sum_parts_us": hot4_us + cold4_us, "mixed_over_sum": mixed_us / (hot4_us + cold4_us),
                        "bitwise_mixed_vs_hot": all(torch.equal(a_, b_) for a_, b_ in zip(out_mixed, out_hot))}
        log("mixed", res["mixed"])

    with open(f"{args.out}/kernel_bench.json", "w") as f:
        json.dump(res, f, indent=1, default=str)

    c = res["ceilings"]
    print(f"\n## {res['device']} ({res['sms']} SMs), torch {res['torch']}, triton {res['triton']}")
    at = res["autotune"]
    if at.get("skipped"):
        print(f"autotune: not run; configs per batch from {at['configs_from']} (its key {at['key_of_that_run'][:16]})")
    else:
        print(f"autotune: first call hit={at['first_hit']} {at['first_s']:.1f} s, second call hit={at['second_hit']} "
              f"{at['second_s']:.2f} s; key {at['key'][:16]}")
    st = res.get("batch1_stages_us")
    ab = res.get("batch1_pdl_ab")
    if ab:
        print("batch 1, tuned tiles: " + "; ".join(f"pdl={p_}: hot {ab[p_]['hot_us']:.1f} µs cold {ab[p_]['cold_us']:.0f} µs"
                                               for p_ in sorted(ab)))
        print(f"batch 1 stages (µs/layer): w13+act {st['w13_act']:.1f} ({st['w13_MB']:.0f} MB), +w2 {st['w13_act+w2']:.1f} "
              f"({st['w2_MB']:.0f} MB), +sum {st['all_three']:.1f}")
    print(f"HBM read {c['hbm_read_GBps']:.0f} GB/s; pinned zero-copy read {c['pinned_read_GBps']:.1f} GB/s; "
          f"bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    print("\n| batch | distinct expert MB/layer | bound µs | Triton hot µs | hot GB/s (% HBM) | row map off µs | row-map cost | "
          "Triton all-cold µs | cold % pinned | torch ref µs | default cfg µs | bitwise off/cold | rel err vs torch | "
          "vLLM (NOTES) µs | speed vs vLLM | baseline µs (bitwise) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cold = f"{r['cold_us']:.0f} | {r['cold_pct_pinned']:.0f}%" if "cold_us" in r else "- | -"
        vllm = f"{r['vllm_notes_us']} | {r['speed_vs_vllm']:.2f}x" if "speed_vs_vllm" in r else "- | -"
        base = f"{r['baseline_us']:.1f} ({r['bitwise_vs_baseline']})" if "baseline_us" in r else "-"
        print(f"| {r['batch']} | {r['distinct_expert_MB']:.1f} | {r['bound_us']:.1f} | {r['hot_us']:.1f} | "
              f"{r['hot_GBps']:.0f} ({100 * r['hot_GBps'] * 1e9 / hbm:.0f}%) | {r['off_us']:.1f} | {r['rowmap_cost_pct']:+.1f}% | "
              f"{cold} | {r['torch_us']:.0f} | {r['default_config_us']:.1f} | {r['bitwise_rowmap_vs_off']}/{r['bitwise_cold_vs_hot']} | "
              f"{r['max_rel_err_vs_torch']:.1e} | {vllm} | {base} |")
    for name, r in r1.items():
        print(f"\nbatch 1 {name} {r['config']}: hot {r['hot_us']:.1f} µs ({r['hot_pct_hbm']:.0f}% HBM), off {r['off_us']:.1f} µs "
              f"(row-map cost {r['rowmap_cost_pct']:+.1f}%), cold {r['cold_us']:.0f} µs ({r['cold_pct_pinned']:.0f}% pinned)")
    m = res.get("mixed")
    if m:
        print(f"\nmixed 4 hot + 4 cold: {m['mixed_us']:.0f} µs vs hot part {m['hot4_us']:.1f} + cold part {m['cold4_us']:.0f} = "
              f"{m['sum_parts_us']:.0f} µs (ratio {m['mixed_over_sum']:.3f}); bitwise vs all-hot {m['bitwise_mixed_vs_hot']}")
    # --- the largest batch's stages (prefill: where its time goes), after the JSON and the full table are written
    big = max(batches)
    if big > 64:
        xs, rs = make_case(big)
        cfgb = KernelConfig.from_dict(config_for(tuned, big))
        pools.set_row_map(all_hot_map)
        sb = stage_times(cfgb, xs, rs, max(5, args.reps // 2))
        res["largest_batch_stages_us"] = {"batch": big, "config": cfgb.to_dict(), "grouping+w13_act": sb[1],
                                          "+w2": sb[2], "+sum": sb[3]}
        with open(f"{args.out}/kernel_bench.json", "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"\nbatch {big} stages (µs/layer, cumulative): grouping + w13 + act {sb[1]:.1f}, + w2 {sb[2]:.1f}, "
              f"+ top-k sum {sb[3]:.1f}")

    for r in rows:
        if "variants" not in r:
            continue
        print(f"\nbatch {r['batch']}: config variants (fields over the tuned config; all hot, µs/layer, better of two "
              f"graph medians; stages cumulative: grouping + w13 + act, + w2, + sum)")
        print("| fields | µs | % of bound | vs tuned | bitwise off | bitwise = tuned | rel err vs torch | stages µs | "
              "grouping µs | cold µs (bitwise = hot) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for v in r["variants"]:
            st = "/".join(f"{v['stages_us'][k]:.1f}" for k in (1, 2, 3)) if "stages_us" in v else "-"
            cold = f"{v['cold_us']:.0f} ({v['bitwise_cold_vs_hot']})" if "cold_us" in v else "-"
            print(f"| {json.dumps(v['fields']) if v['fields'] else 'tuned'} | {v['us']:.1f} | {v['pct_of_bound']:.0f}% | "
                  f"{r['variants'][0]['us'] / v['us']:.3f}x | {v['bitwise_rowmap_vs_off']} | {v['bitwise_vs_tuned']} | "
                  f"{v['max_rel_err_vs_torch']:.2e} | {st} | {v.get('grouping_us', float('nan')):.1f} | {cold} |")
        with open(f"{args.out}/kernel_bench.json", "w") as f:
            json.dump(res, f, indent=1, default=str)

    # last: the issue's table (tokens: µs, % of the bound of this run, ratio to vLLM's figure)
    print("\n| tokens | tuned config (block_m, n1, k1, n2, k2, warps, stages, slot_max_pairs, pdl, split_k1, split_k2, "
          "tile_order) | µs | % of bound | vLLM µs (NOTES) | speed vs vLLM |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cfg_s = ", ".join(str(v) for v in r["config"].values())
        vllm = f"{r['vllm_notes_us']} | {r['speed_vs_vllm']:.2f}x" if "speed_vs_vllm" in r else "- | -"
        print(f"| {r['batch']} | {cfg_s} | {r['hot_us']:.1f} | {100 * r['bound_us'] / r['hot_us']:.0f}% | {vllm} |")
    for r in rows:
        if "sized_read_GBps" in r:
            print(f"batch {r['batch']}: a read of {r['distinct_expert_MB']:.1f} MB a launch streams at "
                  f"{r['sized_read_GBps']:.0f} GB/s ({100 * r['sized_read_GBps'] * 1e9 / hbm:.0f}% of the "
                  f"{hbm / 1e9:.0f} GB/s of a whole-pool read); the kernel reaches {r['pct_of_sized_read']:.0f}% of it")
    for r in rows:
        if "stage_read_us" in r:
            st, rd = r["stages_us"], r["stage_read_us"]
            print(f"batch {r['batch']} stages (µs/layer): w13 + act {st['w13_act']:.1f} (a plain read of its bytes: "
                  f"{rd['w13']:.1f}), w2 {st['w13_act+w2'] - st['w13_act']:.1f} (read: {rd['w2']:.1f}), top-k sum "
                  f"{st['all_three'] - st['w13_act+w2']:.1f}")


if __name__ == "__main__":
    main()
