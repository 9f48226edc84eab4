"""The block-FP8 experts kernel (issue 29) at Qwen3-30B-A3B-FP8 shape beside the bf16 kernel, on one CUDA GPU.

E=128, H=2048, I=768, top-8, bf16 activations; ``--layers`` layers' experts rotated inside each
CUDA graph so no layer's weights are served from L2; synthetic routing (softmax top-8 of random
logits, as the bf16 kernel bench); the same random weights in bf16 and quantized to FP8 (128 x 128
blocks). Per batch: the FP8 kernel's time (median of ``--reps`` graph replays) with the best of
the FP8 search space (coldset.tune.TRITON_FP8_SEARCH_SPACE, tuned here on these inputs), the bf16
kernel with the H200-tuned configs of config/examples/h200-tuned/kernel_configs.json (the
default where that file has none), and for each a plain read of the same bytes (the distinct
experts' bytes a layer, one read launch a layer, in one graph: coldset.kernels.bandwidth) measured
in this process; the bytes bound (those bytes over the HBM ceiling) and the FLOP bound (6 T k H I
over the FP8 / bf16 matmul rate measured here). Correctness first: FP8 against the torch path
(rel. error) and bitwise with the row map compiled out. All-cold FP8 (every expert read in place
from pinned host memory) at the decode sizes. Prints a table last; writes fp8_kernel_bench.json
under ``--out``.

    PYTHONPATH=src python scripts/fp8_kernel_bench.py --out /tmp/fp8bench
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

E, H, I, K = 128, 2048, 768, 8


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--batches", default="1,4,16,64,256,2048")
    p.add_argument("--bf16-configs", default="config/examples/h200-tuned/kernel_configs.json")
    p.add_argument("--cold-max", type=int, default=4, help="all-cold FP8 timing up to this many tokens")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_kernel_bench: needs CUDA", file=sys.stderr)
        return 2

    from coldset import fp8
    from coldset.kernels.bandwidth import HBM_READ_SHAPES, best_read_bandwidth
    from coldset.kernels.reference import torch_experts, torch_softmax_topk
    from coldset.kernels.triton_moe import KernelConfig, default_config, triton_experts
    from coldset.tiers import ExpertPools, host_tier
    from coldset.tune import TRITON_FP8_SEARCH_SPACE, eager_time_us, graph_time_us

    L = args.layers
    batches = [int(b) for b in args.batches.split(",")]
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
    fp8_expert_bytes = (q13[0, 0].numel() + q2[0, 0].numel()) + (s13[0, 0].numel() + s2[0, 0].numel()) * 4
    bf16_expert_bytes = (w13[0, 0].numel() + w2[0, 0].numel()) * 2
    torch.cuda.synchronize()
    log(f"pools ready in {time.time() - t0:.1f}s; bytes per expert fp8 {fp8_expert_bytes}, bf16 {bf16_expert_bytes}")

    res: dict = {"shape": dict(E=E, H=H, I=I, top_k=K, layers=L), "device": torch.cuda.get_device_name(),
                 "bytes_per_expert": {"fp8": fp8_expert_bytes, "bf16": bf16_expert_bytes}, "batches": {}}
    # --- ceilings, this process
    hbm = best_read_bandwidth(w13.view(-1), HBM_READ_SHAPES, args.reps)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    bf16_rate = 2 * 8192**3 / (eager_time_us(lambda: a @ a, 10) * 1e-6)
    try:
        af = a.to(fp8.FP8_DTYPE)
        one = torch.ones((), device="cuda")
        fp8_rate = 2 * 8192**3 / (eager_time_us(
            lambda: torch._scaled_mm(af, af.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 10) * 1e-6)
    except Exception as exc:  # noqa: BLE001 - reported, the FLOP bound then uses bf16's rate
        log("fp8 matmul rate not measured:", repr(exc)[:200])
        fp8_rate = None
    a = af = None  # noqa: F841 - freed before the pools are timed
    res["ceilings"] = {"hbm_read_GBps": hbm / 1e9, "bf16_matmul_TFLOPs": bf16_rate / 1e12,
                       "fp8_matmul_TFLOPs": None if fp8_rate is None else fp8_rate / 1e12}
    log("ceilings", res["ceilings"])

    bf16_tuned = {}
    if Path(args.bf16_configs).is_file():
        bf16_tuned = {int(b): c for b, c in json.loads(Path(args.bf16_configs).read_text())["autotune"]["configs"].items()}

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
        """µs a layer of a plain read of ``nbytes`` (bf16 elements of the pool's own bytes), one launch a layer."""
        flat = pool_tensor.view(-1).view(torch.bfloat16)
        part = int(nbytes) // 2
        rate = best_read_bandwidth(flat[: L * part], ((4096, 1), (4096, 4), (4096, 16)), args.reps, launches=L)
        return nbytes / rate * 1e6

    space = TRITON_FP8_SEARCH_SPACE
    for B in batches:
        xs, rs = case(B)
        distinct = sum(int(torch.unique(r[0]).numel()) for r in rs) / L
        entry: dict = {"distinct_experts_per_layer": distinct}
        # correctness: FP8 against the torch path, row map on and compiled out bitwise
        outs, outs_off = [], []
        cfg0 = None
        run_all(fp8_pools, xs, rs, cfg0, True, outs)()
        run_all(fp8_pools, xs, rs, cfg0, False, outs_off)()
        errs = []
        for l in (0, L - 1):
            ref = torch_experts(fp8_pools, l, xs[l], *rs[l]).float()
            errs.append(float((outs[l].float() - ref).norm() / ref.norm()))
        entry["fp8_rel_err_vs_torch"] = max(errs)
        entry["fp8_bitwise_rowmap_vs_off"] = all(torch.equal(a_, b_) for a_, b_ in zip(outs, outs_off))
        # FP8: the best of the search space's candidates for this regime (timed, not assumed)
        regime = "decode" if B <= space["decode_max_tokens"] else "prefill"
        timings = {}
        for cand in space[regime]:
            cfg = KernelConfig.from_dict(cand)
            try:
                timings[json.dumps(cand, sort_keys=True)] = graph_time_us(run_all(fp8_pools, xs, rs, cfg), args.reps) / L
            except Exception as exc:  # noqa: BLE001 - a config that cannot run here is reported, not fatal
                log("fp8 config failed", B, cand, repr(exc)[:300])
        best = min(timings, key=timings.get)
        entry["fp8_us"], entry["fp8_config"], entry["fp8_candidates_us"] = timings[best], json.loads(best), timings
        # bf16: the H200-tuned config (default where none)
        bcfg = KernelConfig.from_dict(bf16_tuned[B]) if B in bf16_tuned else default_config(B, K)
        entry["bf16_config_tuned"] = B in bf16_tuned
        entry["bf16_us"] = graph_time_us(run_all(bf16_pools, xs, rs, bcfg), args.reps) / L
        fp8_bytes, bf16_bytes = distinct * fp8_expert_bytes, distinct * bf16_expert_bytes
        entry["fp8_plain_read_us"] = plain_read_us(q13, fp8_bytes)
        entry["bf16_plain_read_us"] = plain_read_us(w13, bf16_bytes)
        entry["fp8_bytes_bound_us"] = fp8_bytes / hbm * 1e6
        entry["bf16_bytes_bound_us"] = bf16_bytes / hbm * 1e6
        flops = 6.0 * B * K * H * I
        entry["fp8_flop_bound_us"] = flops / (fp8_rate or bf16_rate) * 1e6
        entry["bf16_flop_bound_us"] = flops / bf16_rate * 1e6
        res["batches"][B] = entry
        log(B, {k: v for k, v in entry.items() if k != "fp8_candidates_us"})

    if any(B <= args.cold_max for B in batches):  # every expert read in place from pinned host memory
        host = host_tier(fp8_pools)
        cold_map = -torch.arange(L * E, dtype=torch.int32, device="cuda").reshape(L, E) - 1
        n = L * E  # the hot pools stay (never read: every row-map entry names its host row)
        cold_pools = ExpertPools(fp8_pools.w13_hot, fp8_pools.w2_hot, host.w13, host.w2, cold_map,
                                 w13_scale_hot=fp8_pools.w13_scale_hot, w2_scale_hot=fp8_pools.w2_scale_hot,
                                 w13_scale_cold=host.w13_scale, w2_scale_cold=host.w2_scale)
        cold_pools.validate()
        assert host.pinned and cold_pools.num_cold == n
        pinned = best_read_bandwidth(host.w13.view(-1).view(torch.bfloat16)[: 2**28], ((4096, 1), (4096, 4)), 10)
        res["ceilings"]["pinned_read_GBps"] = pinned / 1e9
        for B in [b for b in batches if b <= args.cold_max]:
            xs, rs = case(B)
            entry = res["batches"][B]
            cfg = KernelConfig.from_dict(entry["fp8_config"])
            outs_c, outs_h = [], []
            entry["fp8_cold_us"] = graph_time_us(run_all(cold_pools, xs, rs, cfg, True, outs_c), 5) / L
            run_all(fp8_pools, xs, rs, cfg, True, outs_h)()
            entry["fp8_cold_bitwise_vs_hot"] = all(torch.equal(a_, b_) for a_, b_ in zip(outs_c, outs_h))
            distinct = sum(int(torch.unique(r[0]).numel()) for r in rs) / L
            entry["fp8_cold_link_bound_us"] = distinct * fp8_expert_bytes / pinned * 1e6

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_kernel_bench.json").write_text(json.dumps(res, indent=2, default=str))
    c = res["ceilings"]
    print(f"\n{res['device']}; HBM read {c['hbm_read_GBps']:.0f} GB/s, bf16 mm {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s, "
          f"fp8 mm {c['fp8_matmul_TFLOPs'] and round(c['fp8_matmul_TFLOPs'])} TFLOP/s, pinned {c.get('pinned_read_GBps', 0):.1f} GB/s")
    print("T     | fp8 us | % plain read | % bytes bd | % FLOP bd | bf16 us | % plain read | bf16/fp8 | fp8 err | bitwise | fp8 cold us (% link bd)")
    for B, e in res["batches"].items():
        cold = (f"{e['fp8_cold_us']:.1f} ({100 * e['fp8_cold_link_bound_us'] / e['fp8_cold_us']:.0f}%, "
                f"{'=' if e['fp8_cold_bitwise_vs_hot'] else 'DIFF'})" if "fp8_cold_us" in e else "-")
        print(f"{B:<5} | {e['fp8_us']:6.1f} | {100 * e['fp8_plain_read_us'] / e['fp8_us']:11.0f}% | "
              f"{100 * e['fp8_bytes_bound_us'] / e['fp8_us']:9.0f}% | {100 * e['fp8_flop_bound_us'] / e['fp8_us']:8.0f}% | "
              f"{e['bf16_us']:7.1f} | {100 * e['bf16_plain_read_us'] / e['bf16_us']:11.0f}% | "
              f"{e['bf16_us'] / e['fp8_us']:7.2f}x | {e['fp8_rel_err_vs_torch']:.1e} | "
              f"{'yes' if e['fp8_bitwise_rowmap_vs_off'] else 'NO'}     | {cold}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
