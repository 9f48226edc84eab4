#!/usr/bin/env python3
"""Issue 7: the workflow's GPU stages at Qwen3-30B-A3B shapes on one H200, in one process.

Why one script: the device time is one call of a few minutes, and the pipeline's model stage
writes checkpoints to disk (61 GB at these shapes). This script runs the same library functions
the stages run (coldset.synthetic, routing, stats, placement, gate, bench) on a model generated in
memory on the GPU, and writes what it has measured after every step, so a time-out still returns
data:

    PYTHONPATH=src python3 scripts/real_shape_h200.py \
        --config config/examples/qwen3-30b-a3b-h200.yaml --out <dir> [--budget-s 330]

Steps: HBM ceilings (a Triton streaming read and a device-to-device copy); the model
(``build_synthetic_model``); routing on the fixtures (unmodified Triton path) into a trace, the
histogram and the skew (``coldset.stats``); every placement (``coldset.placement.place``, with the
``h200`` preset and the bandwidths measured here); one pinned host copy of every expert (the cold
tier) so that each placement is a compact hot pool in HBM (``index_select`` of its hot experts)
plus a row map whose cold rows point into that pinned copy; per placement the parity gate
(``coldset.gate``) and the decode benchmark (``coldset.bench.bench_decode``, CUDA-graphed step)
at each batch size. Placements run in the order residency 1.0, 0.5, 0.25, 0.75 (the all-HBM bound
and the residency-0.5 ratio first); a placement that would start after ``--budget-s`` is skipped
and listed. Kernel launch configs are the documented defaults (no autotune: ``tuned=None``).

Outputs under ``--out``: ``real_shape.json`` (everything, rewritten after every step),
``histogram.csv``, ``bench.csv``; the summary table is printed last on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from coldset.files import write_json
from coldset.tune import eager_time_us

T0 = time.perf_counter()
GIB = 1024**3


def elapsed() -> float:
    return time.perf_counter() - T0


def log(*a) -> None:
    print(f"[{elapsed():7.1f}s]", *a, file=sys.stderr, flush=True)


def measure_ceilings(pinned_view: torch.Tensor | None = None) -> dict:
    """HBM: a Triton streaming read (the kernel benchmark's) and a device-to-device copy (read +
    write bytes), over 8 GiB of random bf16; optionally the in-place read of pinned host memory."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kernel_bench import read_bandwidth

    n = 4 * GIB // 2  # 4 GiB each of src and dst (bf16)
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    out = {}
    out["hbm_read_GBps"] = max(read_bandwidth(src, 4096, it, 20) for it in (4, 16)) / 1e9
    ms = eager_time_us(lambda: dst.copy_(src), 10) / 1e3
    out["hbm_copy_GBps"] = 2 * src.numel() * 2 / (ms * 1e-3) / 1e9  # bytes read + written
    del src, dst
    torch.cuda.empty_cache()
    if pinned_view is not None:
        out["pinned_read_GBps"] = read_bandwidth(pinned_view, 4096, 4, 5) / 1e9
    return out


def pinned_read_GBps(pinned: torch.Tensor) -> float:
    """The Triton streaming read over 1 GiB of the pinned cold tier, in place (zero-copy)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kernel_bench import read_bandwidth

    return read_bandwidth(pinned.view(-1)[: 2**29], 4096, 4, 5) / 1e9


def step_breakdown(model, ids, bench_cfg) -> dict:
    """Graph-replayed batch-1 decode step on the all-HBM model (unmodified experts path), and the
    same step with the routed experts replaced by zeros (router still runs): the difference is
    what the experts cost inside the step, the rest is attention, norms, router and LM head."""
    from coldset import bench as bn
    from coldset.gate import experts_functions

    unmodified = experts_functions(model.device, None)[0]

    def no_experts(pools, layer, x, topk_ids, topk_weights):
        return torch.zeros_like(x)

    stream = [t for x in ids for t in x]
    prompts = bn.bench_prompts(stream, 1, bench_cfg["prompt_tokens"])
    saved = model.experts_fn
    out = {}
    try:
        for name, fn in (("full_ms", unmodified), ("no_experts_ms", no_experts), ("full_again_ms", unmodified)):
            model.experts_fn = fn
            dec = bn.Decoder(model, 1, bench_cfg["prompt_tokens"], bench_cfg["new_tokens"], True)
            token = dec.prefill(prompts)
            dec.set_step(token, 1)
            dec.capture()
            out[name] = eager_time_us(dec.step, 30) / 1e3
            del dec
    finally:
        model.experts_fn = saved
    out["experts_ms"] = out["full_ms"] - out["no_experts_ms"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="config/examples/qwen3-30b-a3b-h200.yaml")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="no new placement starts after this many seconds of the script")
    ap.add_argument("--order", default="1.0,0.5,0.25,0.75", help="residencies in run order")
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a dry run at small shapes)")
    args = ap.parse_args()

    from coldset import bench as bn
    from coldset import gate
    from coldset.config import load_config
    from coldset.fixtures import render_domain, template_texts
    from coldset.model import encode_prompts, generate
    from coldset.placement import (expert_bytes, nonexpert_bytes_breakdown, place, residency_label)
    from coldset.routing import RequestRows, TraceMeta, TraceWriter, read_trace_meta
    from coldset.stats import ALL, histogram_from_trace, skew_stats
    from coldset.synthetic import SyntheticSpec, build_synthetic_model
    from coldset.tiers import ExpertPools

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="real_shape_"))
    config = load_config(args.config)

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    R: dict = {"config_path": args.config, "config": config, "stages_s": {}, "placements": {},
               "gate": {}, "bench": [], "skipped": [], "errors": [], "notes": []}
    dump = lambda: write_json(out / "real_shape.json", R)  # noqa: E731

    def stage_done(name: str, t: float) -> None:
        R["stages_s"][name] = round(time.perf_counter() - t, 2)
        log(f"stage {name}: {R['stages_s'][name]} s")
        dump()

    dev = torch.device(args.device)
    on_gpu = dev.type == "cuda"
    R["device"] = {"name": "cpu", "torch": torch.__version__}
    if on_gpu:
        props = torch.cuda.get_device_properties(dev)
        R["device"] = {"name": props.name, "sms": props.multi_processor_count,
                       "hbm_gib": props.total_memory / GIB, "torch": torch.__version__,
                       "cuda": torch.version.cuda}
    try:
        import triton
        R["device"]["triton"] = triton.__version__
    except ImportError:
        pass
    log("device", R["device"])

    # ---------------------------------------------------------------- ceilings
    t = time.perf_counter()
    R["ceilings"] = measure_ceilings() if on_gpu else {"hbm_read_GBps": 3400.0, "hbm_copy_GBps": 6800.0,
                                                        "note": "cpu dry run: h200 preset values"}
    log("ceilings", R["ceilings"])
    stage_done("ceilings", t)

    # ---------------------------------------------------------------- model
    t = time.perf_counter()
    syn = dict(config["model"]["synthetic"])
    spec = SyntheticSpec(**syn)
    fx = config["fixtures"]
    domain_texts = template_texts(fx["domains"], 200, seed=fx["seed"] + 1, template_dir=fx["template_dir"])
    dtype = getattr(torch, config["model"]["dtype"])
    model, tokenizer = build_synthetic_model(spec, dev, dtype, domain_texts=domain_texts)
    sync()
    cfg = model.config
    per_expert = expert_bytes(cfg)
    L, E = cfg.num_moe_layers, cfg.num_experts
    R["model"] = {"spec": dataclasses.asdict(spec), "config": dataclasses.asdict(cfg),
                  "tokenizer_vocab": tokenizer.get_vocab_size(), "bytes_per_expert": per_expert,
                  "expert_gb": L * E * per_expert / 1e9,
                  "nonexpert_bytes": nonexpert_bytes_breakdown(cfg),
                  "hbm_allocated_gib": torch.cuda.memory_allocated() / GIB if on_gpu else None}
    log("model", {k: v for k, v in R["model"].items() if k not in ("spec", "config")})
    stage_done("model", t)

    # ---------------------------------------------------------------- fixtures + routing + stats
    t = time.perf_counter()
    fixtures = [f for d in fx["domains"] for f in
                render_domain(d, fx["per_domain"], fx["heldout_fraction"], fx["max_new_tokens"], fx["seed"],
                              fx["template_dir"])]
    ids = encode_prompts(tokenizer, [f.prompt for f in fixtures])
    model.experts_fn = gate.experts_functions(dev, None)[0]  # the unmodified path (Triton on CUDA)
    meta = TraceMeta.from_model_config(cfg, config["model"]["name"], "coldset embedded engine (cuda, bfloat16, in-memory synthetic)")
    trace = work / "trace.parquet"
    order = sorted(range(len(fixtures)), key=lambda i: len(ids[i]))
    bs = config["routing"]["batch_size"]
    with TraceWriter(trace, meta, with_weight=True, with_split=True) as w:
        for s in range(0, len(order), bs):
            chunk = order[s:s + bs]
            g = generate(model, [ids[i] for i in chunk], fx["max_new_tokens"], capture_routing=True, progress=False)
            for i, rr in zip(chunk, g.routing):
                f = fixtures[i]
                w.add(RequestRows(f.id, f.domain, np.asarray(rr.experts), int(rr.num_prompt_tokens),
                                  np.asarray(rr.weights, dtype=np.float32), f.split))
    hist = histogram_from_trace(trace, config["stats"]["heldout_fraction"], progress=False)
    hist.to_csv(out / "histogram.csv", index=False)
    skew = skew_stats(hist, read_trace_meta(trace))
    dec = skew["phases"]["decode"]["domains"][ALL]
    pre = skew["phases"]["prefill"]["domains"][ALL]
    R["skew"] = {
        "decode_tokens": int(dec["selections"] // (cfg.top_k * L)),
        "decode_gini_mean": dec["gini"]["mean"],
        "decode_top25_share_mean": dec["top_share"]["25"]["mean_over_layers"],
        "decode_top25_share_model_wide": dec["top_share"]["25"]["model_wide"],
        "decode_gini_per_layer": dec["gini"]["per_layer"],
        "prefill_gini_mean": pre["gini"]["mean"],
        "prefill_top25_share_mean": pre["top_share"]["25"]["mean_over_layers"],
        "spearman_between_domains_decode": skew["phases"]["decode"]["spearman_between_domains"],
    }
    log("skew", {k: v for k, v in R["skew"].items() if "per_layer" not in k and "spearman" not in k})
    stage_done("routing_stats", t)

    # ---------------------------------------------------------------- placements
    t = time.perf_counter()
    pc = config["placement"]
    measured_bw = {"name": "measured", "hbm_gb_s": R["ceilings"]["hbm_read_GBps"],
                   "link_gb_s": 51.0, "source": "HBM read measured in this run; link: NOTES.md 51 GB/s "
                   "(replaced by this run's pinned read below once measured)"}
    placements = {}
    batch_sizes = config["bench"]["batch_sizes"]

    def make_placements(bw):
        ps = {}
        for policy in pc["policies"]:
            for res in pc["residency"]:
                ps[(policy, float(res))] = place(
                    hist, cfg, policy, float(res),
                    profile_domains=None if pc["profile_domains"] == "all" else pc["profile_domains"],
                    phase=pc["phase"], domain_weights="equal" if pc["weight_domains"] else None,
                    bandwidths=("h200", bw), batch_sizes=batch_sizes, model=config["model"]["name"])
        return ps

    placements = make_placements(measured_bw)
    stage_done("placement", t)

    # ---------------------------------------------------------------- pinned cold tier
    t = time.perf_counter()
    ref = model.pools
    n13, n2 = ref.w13_hot.numel(), ref.w2_hot.numel()
    # One pinned copy of every expert: a placement is then a compact hot pool plus a row map.
    # (torch's host allocator may round this up to a power of two: 64 GiB for 58 GB.)
    try:
        pinned = torch.empty(ref.w13_hot.element_size() * (n13 + n2), dtype=torch.uint8, pin_memory=on_gpu)
    except RuntimeError as exc:  # then each placement pins only its cold rows (tiers.build_pools)
        pinned = None
        R["errors"].append({"placement": "pinned_tier", "error": repr(exc), "traceback": traceback.format_exc()})
        log("ERROR pinned tier; falling back to build_pools per placement", repr(exc))
    t_alloc = time.perf_counter() - t
    R["pinned"] = {"gb": 0.0, "alloc_s": round(t_alloc, 2), "d2h_copy_s": None, "is_pinned": False}
    if pinned is not None:
        flat = pinned.view(dtype)
        w13_pin = flat[:n13].view(ref.w13_hot.shape)
        w2_pin = flat[n13:n13 + n2].view(ref.w2_hot.shape)
        t1 = time.perf_counter()
        w13_pin.copy_(ref.w13_hot)
        w2_pin.copy_(ref.w2_hot)
        sync()
        R["pinned"] = {"gb": pinned.numel() / 1e9, "alloc_s": round(t_alloc, 2),
                       "d2h_copy_s": round(time.perf_counter() - t1, 2), "is_pinned": bool(pinned.is_pinned())}
    R["ceilings"]["pinned_read_GBps"] = pinned_read_GBps(w13_pin) if on_gpu and pinned is not None else 51.0
    log("pinned", R["pinned"], "pinned read GB/s", R["ceilings"]["pinned_read_GBps"])
    measured_bw = {"name": "measured", "hbm_gb_s": R["ceilings"]["hbm_read_GBps"],
                   "link_gb_s": R["ceilings"]["pinned_read_GBps"],
                   "source": "HBM streaming read and pinned in-place read, measured in this run"}
    placements = make_placements(measured_bw)
    for (policy, res), pl in placements.items():
        R["placements"][f"{policy}-{residency_label(res)}"] = {
            "num_hot": pl.num_hot, "num_cold": pl.num_cold, "hbm_expert_gib": pl.hbm_expert_gib,
            "host_expert_gib": pl.host_expert_gib, "coverage_profile": pl.coverage_profile,
            "coverage_heldout": pl.coverage_heldout,
            "predictions": [dataclasses.asdict(p) for p in pl.predictions]}
    stage_done("pinned_tier", t)

    # ---------------------------------------------------------------- gate reference
    t = time.perf_counter()
    par = config["parity"]
    per_dom: dict[str, int] = {}
    gate_idx = []
    for i, f in enumerate(fixtures):
        if par["fixtures_per_domain"] is None or per_dom.get(f.domain, 0) < par["fixtures_per_domain"]:
            per_dom[f.domain] = per_dom.get(f.domain, 0) + 1
            gate_idx.append(i)
    gate_prompts = [ids[i] for i in gate_idx]
    gate_ids = [fixtures[i].id for i in gate_idx]
    reference = gate.reference_decode(model, gate_prompts, par["max_new_tokens"], len(gate_prompts),
                                      progress=False, tuned=None)
    R["gate_setup"] = {"fixtures": gate_ids, "max_new_tokens": par["max_new_tokens"]}
    stage_done("gate_reference", t)

    # ---------------------------------------------------------------- where the all-HBM step goes
    if on_gpu:
        t = time.perf_counter()
        try:
            R["step_breakdown_b1"] = step_breakdown(model, ids, config["bench"])
            log("step breakdown b1", R["step_breakdown_b1"])
        except Exception as exc:
            R["errors"].append({"placement": "step_breakdown", "error": repr(exc), "traceback": traceback.format_exc()})
            log("ERROR step breakdown", repr(exc))
        stage_done("step_breakdown", t)

    # ---------------------------------------------------------------- per placement: gate + bench
    bc = config["bench"]
    stream = [tok for x in ids for tok in x]
    run_order = [float(x) for x in args.order.split(",")]
    keys = [(p, r) for r in run_order for p in pc["policies"] if (p, r) in placements]
    for policy, res in keys:
        name = f"{policy}-{residency_label(res)}"
        if elapsed() > args.budget_s:
            R["skipped"].append(name)
            log("skip (time budget)", name)
            dump()
            continue
        pl = placements[(policy, res)]
        t = time.perf_counter()
        try:
            if pinned is None:
                from coldset.tiers import build_pools
                pools = build_pools(ref.w13_hot.view(L, E, *ref.w13_hot.shape[1:]),
                                    ref.w2_hot.view(L, E, *ref.w2_hot.shape[1:]), pl.row_map, dev)
            else:
                rm = torch.as_tensor(pl.row_map).to(torch.int64)
                flat_idx = torch.arange(L * E).view(L, E)
                hot = rm >= 0
                hot_src = torch.empty(pl.num_hot, dtype=torch.int64)
                hot_src[rm[hot]] = flat_idx[hot]  # hot row r of the placement holds (layer, expert)
                phys = torch.where(hot, rm, -flat_idx - 1).to(torch.int32)  # cold -> row of the pinned copy
                idx = hot_src.to(dev)
                pools = ExpertPools(w13_hot=ref.w13_hot.index_select(0, idx),
                                    w2_hot=ref.w2_hot.index_select(0, idx),
                                    w13_cold=w13_pin, w2_cold=w2_pin, row_map=phys.to(dev).contiguous())
            pools.validate()
            sync()
            build_s = time.perf_counter() - t
            got = gate.placement_decode(model, pools, gate_prompts, par["max_new_tokens"], len(gate_prompts),
                                        progress=False, tuned=None)
            pr = gate.compare(name, gate_ids, reference, got, pools, model, backend=gate.experts_functions(dev, None)[2])
            R["gate"][name] = {"passed": pr.passed, "tokens_matched": pr.tokens_matched,
                               "tokens_total": pr.tokens_total, "max_abs_logit_diff": pr.max_abs_logit_diff,
                               "cold_rows_used": pl.num_cold, "hot_rows": pl.num_hot}
            log("gate", name, R["gate"][name])
            gate_s = time.perf_counter() - t - build_s
            dump()
            for b in batch_sizes:
                tb = time.perf_counter()
                r = bn.bench_decode(model, pools, pl, stream, b, bc["prompt_tokens"], bc["new_tokens"],
                                    bc["warmup"], bc["repeats"], replay=None, tuned=None)
                d = r.to_dict()
                pm = pl.prediction("measured", b)
                d["predicted_step_ms_measured_bw"] = pm.step_s_lower * 1e3
                d["predicted_step_ms_sum_measured_bw"] = pm.step_s_sum * 1e3
                d["predicted_link_gb_per_token"] = pm.link_bytes / b / 1e9
                d["wall_s"] = round(time.perf_counter() - tb, 2)
                R["bench"].append(d)
                log(f"bench {name} b{b}: {r.tok_s:.1f} tok/s, step {r.step_ms_p50:.2f} ms (pred h200 "
                    f"{r.predicted_step_ms:.2f}, measured-bw {d['predicted_step_ms_measured_bw']:.2f}), cold "
                    f"{r.cold_share:.3f}, link {r.link_gb_per_token:.3f} GB/tok, match {r.timed_token_match}, "
                    f"{d['wall_s']} s")
                dump()
            R["placement_timing_s"] = R.get("placement_timing_s", {})
            R["placement_timing_s"][name] = {"build": round(build_s, 2), "gate": round(gate_s, 2),
                                             "total": round(time.perf_counter() - t, 2)}
            del pools
        except Exception as exc:  # keep the other placements' data
            R["errors"].append({"placement": name, "error": repr(exc), "traceback": traceback.format_exc()})
            log("ERROR", name, repr(exc))
        if on_gpu:
            torch.cuda.empty_cache()
        dump()

    # ---------------------------------------------------------------- derived + bound
    R["bench"] = bn.derive_metrics(R["bench"])
    nb = nonexpert_bytes_breakdown(cfg)
    per_token_b1 = sum(v for k, v in nb.items() if k != "embed_tokens") + cfg.hidden_size * 2 \
        + L * cfg.top_k * per_expert  # one embedding row; top_k distinct experts per layer
    bound = {"bytes_per_token_b1": per_token_b1, "hbm_read_GBps": R["ceilings"]["hbm_read_GBps"],
             "bound_tok_s": R["ceilings"]["hbm_read_GBps"] * 1e9 / per_token_b1,
             "bound_tok_s_copy_bw": R["ceilings"]["hbm_copy_GBps"] / 2 * 1e9 / per_token_b1}
    full = [r for r in R["bench"] if abs(r["residency"] - 1.0) < 1e-9 and r["batch_size"] == 1]
    if full:
        best = max(full, key=lambda r: r["tok_s"])
        bound["all_hbm_tok_s_b1"] = {r["policy"]: r["tok_s"] for r in full}
        bound["fraction_of_bound"] = best["tok_s"] / bound["bound_tok_s"]
    R["all_hbm_bound"] = bound
    ratios = {}
    for r in R["bench"]:
        if r["policy"] == "usage_global":
            pos = next((x for x in R["bench"] if x["policy"] == "positional" and x["batch_size"] == r["batch_size"]
                        and abs(x["residency"] - r["residency"]) < 1e-9), None)
            if pos:
                ratios[f"{residency_label(r['residency'])}/b{r['batch_size']}"] = r["tok_s"] / pos["tok_s"]
    R["usage_global_over_positional"] = ratios
    R["total_s"] = elapsed()
    dump()
    try:
        import pandas as pd
        pd.DataFrame(R["bench"]).to_csv(out / "bench.csv", index=False)
    except Exception as exc:
        log("bench.csv not written", repr(exc))

    # ---------------------------------------------------------------- summary (last on stdout)
    c = R["ceilings"]
    print(f"\ndevice {R['device']['name']}; HBM read {c['hbm_read_GBps']:.0f} GB/s, copy {c['hbm_copy_GBps']:.0f} GB/s, "
          f"pinned read {c['pinned_read_GBps']:.1f} GB/s; pinned tier {R['pinned']['gb']:.1f} GB alloc "
          f"{R['pinned']['alloc_s']} s")
    s = R["skew"]
    print(f"skew (decode, {s['decode_tokens']} tokens): Gini {s['decode_gini_mean']:.3f}, top-25% share "
          f"{s['decode_top25_share_mean']:.3f}; prefill Gini {s['prefill_gini_mean']:.3f}")
    print(f"all-HBM bound b1: {bound['bytes_per_token_b1'] / 1e9:.2f} GB/token -> {bound['bound_tok_s']:.0f} tok/s; "
          f"measured {bound.get('all_hbm_tok_s_b1')} ({100 * bound.get('fraction_of_bound', float('nan')):.0f}%)")
    print("gate:", {k: v["passed"] for k, v in R["gate"].items()})
    print(f"{'placement':22s} {'b':>2s} {'tok/s':>8s} {'step ms':>8s} {'pred h200':>9s} {'pred meas':>9s} "
          f"{'cold':>6s} {'link GB/t':>9s} {'tok/s/GiB':>9s} {'match':>5s}")
    for r in sorted(R["bench"], key=lambda r: (r["batch_size"], r["residency"], r["policy"])):
        tpg = r.get("tok_s_per_gib")
        print(f"{r['placement']:22s} {r['batch_size']:2d} {r['tok_s']:8.1f} {r['step_ms_p50']:8.2f} "
              f"{r['predicted_step_ms']:9.2f} {r['predicted_step_ms_measured_bw']:9.2f} {r['cold_share']:6.3f} "
              f"{r['link_gb_per_token']:9.3f} {(f'{tpg:9.2f}' if tpg is not None else '        -')} "
              f"{r['timed_token_match']}")
    print("usage_global / positional:", {k: round(v, 3) for k, v in ratios.items()})
    print("skipped:", R["skipped"], "errors:", [e["placement"] for e in R["errors"]], f"total {R['total_s']:.0f} s")
    return 0 if not R["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
