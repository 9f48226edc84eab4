#!/usr/bin/env python3
"""The slot cache at real shape on one GPU: CUDA correctness, then decode speed against static placement.

    PYTHONPATH=src python3 scripts/cache_h200.py --config config/examples/qwen3-30b-a3b-h200.yaml --out <dir>

Builds the config's in-memory synthetic model (every expert in HBM, decode region compiled as the
pipeline does), pins one host copy of every expert, and profiles routing on profile prompts
(template texts, one seed) with the unmodified path: the profile counts choose the warm set
(``usage_global``'s hot set at each residency). Then on held-out prompts (another seed), for batch
1 and 8, every step captured in one CUDA graph (``coldset.bench.Decoder``):

- all-HBM: the unmodified path (row map compiled out), its routing recorded per step;
- at residency 0.25 / 0.5 / 0.75: ``usage_global`` (static: cold experts read in place over the
  link) and the slot cache ``lru`` and ``lfu`` (``coldset.slots``: decisions and fills inside the
  graph), each run warm from the same state.

Checks (the script exits 1 if one fails): every variant's logits at every step are bitwise the
all-HBM run's; the cache's per-(step, layer) hits, misses and fills equal ``coldset.cache.simulate``
on the all-HBM run's routing; the cache's row map and slot contents agree with its owners after the
run. Timed: tok/s from the mean decode step (the cache's steps vary with its misses), hit rate,
misses and link GB per token (static: cold selections and distinct cold experts per step and layer;
cache: its own counters), the cache-management work of all-hit groups in every layer, alone
(graph-captured) and inside the step (the row-map step with every expert hot, with and without
it), as a fraction of the all-HBM step, the fill kernel's read rate from pinned memory against
the copy engine's on the same rows, and the next-token forecaster (``coldset.forecast``, fitted
on the profile routing): its recall on the timed tokens, its GPU cost, and the ``forecast``
policy simulated on the engine's routing beside ``lru``. Writes ``cache_h200.json`` and the
recorded routing (``profile_routing.npy``, ``routing_b{B}.npy``); the table is printed last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

T0 = time.perf_counter()


def log(*a) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, file=sys.stderr, flush=True)


def graph_time_ms(fn, reps: int = 20) -> float:
    """Median ms of one replay of ``fn`` captured in a CUDA graph (the autotuner's timer)."""
    from coldset.tune import graph_time_us

    return graph_time_us(fn, reps) / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="config/examples/qwen3-30b-a3b-h200.yaml")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=48, help="decode steps per run")
    ap.add_argument("--residencies", default="0.5,1.0")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--policies", default="lru")
    args = ap.parse_args()

    from coldset import bench as bn
    from coldset.cache import AccessStream, simulate
    from coldset.config import load_config
    from coldset.files import write_json
    from coldset.fixtures import template_texts
    from coldset.gate import experts_functions
    from coldset.placement import expert_bytes, hot_count_for_residency, hot_mask_usage_global, row_map_from_mask
    from coldset.slots import SlotCache
    from coldset.synthetic import SyntheticSpec, build_synthetic_model
    from coldset.tiers import host_tier

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = load_config(args.config)
    dev = torch.device("cuda")
    R: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "config": args.config,
               "rows": [], "checks": {}}
    fails: list[str] = []

    spec = SyntheticSpec(**config["model"]["synthetic"])
    # Which routing these numbers are measured on (issue 17): the synthetic router and its temporal knobs.
    R["router"] = (f"synthetic router (temporal_gain {spec.temporal_gain}, temporal_continuity "
                   f"{spec.temporal_continuity}, topic_context {spec.topic_context}; its lift: "
                   "scripts/locality_calibrate.py on the same config)")
    fx = config["fixtures"]
    texts = template_texts(fx["domains"], 200, seed=fx["seed"] + 1, template_dir=fx["template_dir"])
    model, tokenizer = build_synthetic_model(spec, dev, getattr(torch, config["model"]["dtype"]), domain_texts=texts)
    model.compile_decode()
    cfg = model.config
    L, E, k = cfg.num_moe_layers, cfg.num_experts, cfg.top_k
    routers = [model.layers[i].mlp.gate.weight.detach() for i in cfg.moe_layers]
    per_expert = expert_bytes(cfg)
    log("model built", L, "MoE layers x", E, "experts, top", k)
    t = time.perf_counter()
    host = host_tier(model.pools)
    log(f"host tier pinned in {time.perf_counter() - t:.1f} s")
    ref_fn, rowmap_fn, _ = experts_functions(dev, None)
    plen, steps = 32, args.steps

    def prompts_from(seed: int, n: int) -> torch.Tensor:
        tx = template_texts(fx["domains"], n, seed=seed, template_dir=fx["template_dir"])
        rows = []
        for d in fx["domains"]:
            for text in tx[d]:
                ids = tokenizer.encode(text).ids
                while len(ids) < plen:
                    ids = ids + ids
                rows.append(ids[:plen])
        return torch.tensor(rows[:n], dtype=torch.long)

    hidden_rec: dict = {}  # bsz -> router inputs [steps, L, B, H] of the last recorded run

    def run(experts_fn, pools, bsz: int, prompts: torch.Tensor, record: bool = False, cache=None):
        """Graph-captured decode: per-step ms, logits [steps, B, V] (GPU), routing [steps, L, B, k]."""
        saved = model.pools, model.experts_fn
        rec = torch.zeros((L, bsz, k), dtype=torch.long, device=dev)
        rec_h = torch.zeros((L, bsz, cfg.hidden_size), dtype=model.dtype, device=dev)
        hidden = []
        fn = experts_fn
        if record:
            def fn(p, layer, x, ids, w):
                if x.shape[0] == bsz:
                    rec[layer].copy_(ids)
                    rec_h[layer].copy_(x)
                return experts_fn(p, layer, x, ids, w)
        model.pools, model.experts_fn = pools, fn
        try:
            dec = bn.Decoder(model, bsz, plen, steps + 1, True)
            tok = dec.prefill(prompts.to(dev))
            dec.set_step(tok, 1)
            dec.capture()
            if cache is not None:
                cache.reset()  # the capture's warm-up steps ran the cache: start warm
            ms, logits, routing = [], [], []
            for step_ms, lg, tok in dec.timed_steps(tok, steps):
                ms.append(step_ms)
                logits.append(lg.clone())
                if record:
                    routing.append(rec.cpu().numpy().copy())
                    hidden.append(rec_h.clone())
            del dec
        finally:
            model.pools, model.experts_fn = saved
        if record:
            hidden_rec[bsz] = torch.stack(hidden)
        return ms, torch.stack(logits), (np.stack(routing) if record else None)

    # Profile: routing of profile prompts on the unmodified path -> counts -> warm sets.
    prof = prompts_from(fx["seed"] + 101, 8)
    _, _, prof_routing = run(ref_fn, model.pools, prof.shape[0], prof, record=True)
    counts = np.zeros((L, E), dtype=np.float64)
    for layer in range(L):
        np.add.at(counts[layer], prof_routing[:, layer].reshape(-1), 1)
    log("profile routing", prof_routing.shape)
    np.save(out / "profile_routing.npy", prof_routing)
    from coldset.forecast import TransitionForecaster, forecast_recall, stream_predictions

    def routing_rows(rt: np.ndarray):
        """Trace-like decode rows of a recorded routing [steps, L, B, k] (request = batch row)."""
        st_, l_, b_, k_ = np.indices(rt.shape).reshape(4, -1)
        return pd.DataFrame({"request": [f"r{b}" for b in b_], "position": st_, "layer_index": l_, "rank": k_,
                             "expert": rt.reshape(-1)})

    forecaster = TransitionForecaster.fit(routing_rows(prof_routing), L, E, k)
    R["forecast"] = {}

    residencies = [float(r) for r in args.residencies.split(",")]
    policies = args.policies.split(",")
    for bsz in (int(b) for b in args.batches.split(",")):
        prompts = prompts_from(fx["seed"] + 202, bsz)
        _, ref_logits, routing = run(ref_fn, model.pools, bsz, prompts, record=True)
        np.save(out / f"routing_b{bsz}.npy", routing)
        ms_full, _, _ = run(ref_fn, model.pools, bsz, prompts)
        ms = ms_full
        full_ms = statistics.mean(ms)
        R["rows"].append({"batch": bsz, "placement": "all-HBM", "residency": 1.0, "step_ms": full_ms,
                          "step_ms_p50": statistics.median(ms), "tok_s": 1e3 / full_ms, "hit_rate": 1.0,
                          "misses_per_token": 0.0, "link_gb_per_token": 0.0})
        log(R["rows"][-1])
        tokens = bsz * steps
        inst = routing + (np.arange(L) * E)[None, :, None, None]  # [steps, L, B, k]
        # The forecaster on these tokens: recall, the forecast policy simulated on the engine's stream.
        fc = forecast_recall(forecaster, routing_rows(routing), L, E)
        fc["extra"] = forecaster.extra
        fstream = AccessStream(inst.reshape(-1), np.arange(0, inst.size + 1, bsz * k), tokens, L, E)
        fpred = stream_predictions(forecaster, fstream)
        fc["simulated"] = []
        for r in residencies:
            C_ = hot_count_for_residency(r, L * E)
            lru_ = simulate(fstream, "lru", C_, counts).stats()
            fst = simulate(fstream, "forecast", C_, counts, predictions=fpred).stats()
            fc["simulated"].append({"residency": r, "lru_hit": lru_.hit_rate, "forecast_hit": fst.hit_rate,
                                    "prefetches_per_token": fst.prefetches / tokens,
                                    "useful_share": fst.useful_prefetches / max(fst.prefetches, 1),
                                    "lru_link": lru_.link_gb_per_token(per_expert),
                                    "forecast_link": fst.link_gb_per_token(per_expert)})
        tab = torch.as_tensor(forecaster.table, device=dev)
        step_ids = torch.as_tensor(routing[0], device=dev)  # [L, B, k]
        lidx = torch.arange(L, device=dev)[:, None, None]
        bonus = torch.full(step_ids.shape, float(k), device=dev)

        def forecast_step():
            sc = tab[lidx, step_ids].sum(2)  # [L, B, E]
            sc.scatter_add_(2, step_ids, bonus)
            return torch.sort(-sc, dim=2, stable=True).indices[..., :forecaster.num_predictions]

        fc["gpu_ms"] = graph_time_ms(forecast_step)
        R["forecast"][bsz] = fc
        log("forecast", {k_: v for k_, v in fc.items() if k_ != "simulated"}, fc["simulated"])
        for r in residencies:
            C = hot_count_for_residency(r, L * E)
            row_map = row_map_from_mask(hot_mask_usage_global(counts, C))
            # static usage_global
            pools = model.pools.placed(row_map, host)
            ms, lg, _ = run(rowmap_fn, pools, bsz, prompts)
            del pools
            cold = row_map.reshape(-1)[inst] < 0
            cold_reads = sum(len(set(inst[s, layer][cold[s, layer]].tolist())) for s in range(steps) for layer in range(L))
            same = bool(torch.equal(lg, ref_logits))
            R["checks"][f"usage_global-{r}/b{bsz} logits bitwise"] = same
            fails += [] if same else [f"usage_global-{r}/b{bsz} logits differ"]
            R["rows"].append({"batch": bsz, "placement": "usage_global", "residency": r, "step_ms": statistics.mean(ms),
                              "step_ms_p50": statistics.median(ms), "tok_s": 1e3 / statistics.mean(ms),
                              "hit_rate": 1.0 - float(cold.mean()), "misses_per_token": int(cold.sum()) / tokens,
                              "link_gb_per_token": cold_reads * per_expert / tokens / 1e9})
            log(R["rows"][-1])
            warm_counts = np.empty(C)
            flat = row_map.reshape(-1)
            hot = np.flatnonzero(flat >= 0)
            warm_counts[flat[hot]] = counts.reshape(-1)[hot]
            for pol in policies:
                cache = SlotCache.build(model.pools, host, row_map, warm_counts, pol, bsz, k,
                                        history=steps * L + 8)
                ms, lg, _ = run(cache.wrap(rowmap_fn), cache.pools, bsz, prompts, cache=cache)
                c = cache.counters()
                hist = cache.group_history()
                ids = inst.reshape(-1)  # steps, layers, then tokens x ranks: the engine's group order
                ptr = np.arange(0, ids.size + 1, bsz * k)
                sim = simulate(AccessStream(ids, ptr, tokens, L, E), pol, C, counts)
                sim_hist = np.stack([sim.hits, sim.misses, sim.fills], axis=1)
                name = f"{pol}-{r}/b{bsz}"
                checks = {"logits bitwise": bool(torch.equal(lg, ref_logits)),
                          "per-group hits/misses/fills == simulator": bool(np.array_equal(hist, sim_hist))}
                try:
                    cache.check(contents=True)
                    checks["state consistent"] = True
                except ValueError as exc:
                    checks["state consistent"] = repr(exc)
                for what, ok in checks.items():
                    R["checks"][f"{name} {what}"] = ok
                    if ok is not True:
                        fails.append(f"{name} {what}: {ok}")
                acc = c["hits"] + c["misses"]
                R["rows"].append({"batch": bsz, "placement": pol, "residency": r, "step_ms": statistics.mean(ms),
                                  "step_ms_p50": statistics.median(ms), "tok_s": 1e3 / statistics.mean(ms),
                                  "hit_rate": c["hits"] / acc, "sim_hit_rate": float(sim.hits.sum()) / acc,
                                  "misses_per_token": c["misses"] / tokens,
                                  "link_gb_per_token": c["fills"] * per_expert / tokens / 1e9})
                log(R["rows"][-1], checks)
                if pol == "lru" and r < 1.0:
                    # The next-layer lookahead (router of layer l on layer l - d's router input) on
                    # the selections this lru run missed, and the lookahead policy simulated.
                    from coldset.forecast import lookahead_predictions, lookahead_recall

                    missed = ~sim.hit.reshape(routing.shape)
                    la = []
                    for depth in (1, 2):
                        for extra in (0, 3):
                            got = lookahead_recall(hidden_rec[bsz], routers, routing, missed, depth, extra)
                            lpred = lookahead_predictions(hidden_rec[bsz], routers, depth, k + extra)
                            lsim = simulate(AccessStream(ids, ptr, tokens, L, E), "lookahead", C, counts,
                                            predictions=lpred).stats()
                            got.update(sim_hit=lsim.hit_rate, sim_misses_per_token=lsim.misses_per_token,
                                       prefetches_per_token=lsim.prefetches / tokens,
                                       useful_share=lsim.useful_prefetches / max(lsim.prefetches, 1),
                                       link_gb_per_token=lsim.link_gb_per_token(per_expert))
                            la.append(got)
                            log("lookahead", name, got)
                    R.setdefault("lookahead", {})[name] = la
                if r == residencies[0] and pol == policies[0]:
                    # The cache-management work alone: every layer's decisions on a step whose
                    # selections all hit (the fill kernel launches and finds nothing to copy).
                    rm = cache.pools.row_map
                    hit_ids = []
                    for layer in range(L):
                        resident = torch.nonzero(rm[layer] >= 0).flatten()
                        if resident.numel() < k:
                            raise RuntimeError(f"layer {layer} has {resident.numel()} resident experts < top_k")
                        hit_ids.append(resident[:k].view(1, k).expand(bsz, k).contiguous())

                    def decisions():
                        for layer in range(L):
                            cache.admit(layer, hit_ids[layer])

                    alone = graph_time_ms(decisions)
                    # Inside the real step, interleaved repeats (median of each): the all-HBM step,
                    # the row-map step over the same all-hot pools, and at residency 1.0 (every
                    # group hits) the cache both ways.
                    head, old = "router records, fill = its dependent (HEAD)", "decisions launch + fill (fifth session)"
                    reps: dict = {"all-HBM": [], "row-map": [], head: [], old: []}
                    for _ in range(3):
                        reps["all-HBM"].append(statistics.mean(run(ref_fn, model.pools, bsz, prompts)[0]))
                        reps["row-map"].append(statistics.mean(run(rowmap_fn, model.pools, bsz, prompts)[0]))
                        if r == 1.0:
                            reps[head].append(statistics.mean(
                                run(cache.wrap(rowmap_fn), cache.pools, bsz, prompts, cache=cache)[0]))
                            cache.records_in_route = lambda n: False  # admit() decides: its own launch
                            reps[old].append(statistics.mean(
                                run(cache.wrap(rowmap_fn), cache.pools, bsz, prompts, cache=cache)[0]))
                            del cache.records_in_route
                    step_full, step_rowmap = statistics.median(reps["all-HBM"]), statistics.median(reps["row-map"])
                    ways = {w: {"step_ms": statistics.median(v), "step_fraction": statistics.median(v) / step_full - 1,
                                "over_rowmap_fraction": (statistics.median(v) - step_rowmap) / step_full, "reps": v}
                            for w, v in reps.items() if v and w in (head, old)}
                    over_torch = None
                    if bsz == 1:
                        cache.use_kernel = False  # the same decisions as torch ops, for comparison
                        over_torch = graph_time_ms(decisions)
                        cache.use_kernel = True
                    R.setdefault("overhead", {})[bsz] = {
                        "all_hbm_step_ms": step_full, "rowmap_step_ms": step_rowmap, "decisions_ms": alone,
                        "fraction": alone / step_full, "ways": ways, "pdl_available": cache.pdl, "reps": reps,
                        "torch_ops_decisions_ms": over_torch}
                    log("overhead", bsz, R["overhead"][bsz])
                    # Fill: k rows (one layer's worst case at batch 1) by the kernel vs the copy engine.
                    from coldset.kernels.triton_slots import fill

                    victims = torch.arange(k, device=dev)
                    src = torch.arange(k, device=dev) * 7
                    m = torch.full((1,), k, dtype=torch.int64, device=dev)
                    p = cache.pools

                    def kernel_fill():
                        fill(p, victims, src, m)

                    def copy_engine():
                        for j in range(k):
                            p.w13_hot[j].copy_(p.w13_cold[7 * j], non_blocking=True)
                            p.w2_hot[j].copy_(p.w2_cold[7 * j], non_blocking=True)

                    nbytes = k * per_expert
                    R.setdefault("fill", {})[bsz] = {"rows": k, "bytes": nbytes,
                                 "kernel_gb_s": nbytes / graph_time_ms(kernel_fill) / 1e6,
                                 "copy_engine_gb_s": nbytes / graph_time_ms(copy_engine) / 1e6}
                    log("fill", R["fill"][bsz])
                    cache.reset()
                    # the closures hold the cache (its slots: residency x all experts of HBM)
                    del decisions, kernel_fill, copy_engine, p
                del cache
                torch.cuda.empty_cache()
            write_json(out / "cache_h200.json", {**R, "fails": fails})
    write_json(out / "cache_h200.json", {**R, "fails": fails})

    print(f"\n{R['device']}, {config['model']['name']} bf16, {steps} decode steps per run, router: {R['router']}")
    print("checks:", "all passed" if not fails else f"FAILED: {fails}")
    print("tok/s: per sequence (DESIGN.md §6), from the mean step; x all-HBM / x ug: ratios of it")
    print(f"{'b':>2s} {'placement':13s} {'res':>5s} {'tok/s':>8s} {'x all-HBM':>9s} {'x ug':>6s} {'hit':>6s} "
          f"{'sim hit':>7s} {'miss/tok':>8s} {'link GB/tok':>11s} {'p50 ms':>7s}")
    for row in R["rows"]:
        full = next(x for x in R["rows"] if x["batch"] == row["batch"] and x["placement"] == "all-HBM")
        ug = next((x for x in R["rows"] if x["batch"] == row["batch"] and x["placement"] == "usage_global"
                   and x["residency"] == row["residency"]), None)
        print(f"{row['batch']:2d} {row['placement']:13s} {row['residency']:5.2f} {row['tok_s']:8.1f} "
              f"{row['tok_s'] / full['tok_s']:9.3f} {row['tok_s'] / ug['tok_s'] if ug else float('nan'):6.2f} "
              f"{row['hit_rate']:6.3f} {row.get('sim_hit_rate', float('nan')):7.3f} {row['misses_per_token']:8.2f} "
              f"{row['link_gb_per_token']:11.4f} {row['step_ms_p50']:7.3f}")
    for bsz_, ov in R.get("overhead", {}).items():
        print(f"cache management, batch {bsz_}, all-hit groups in every layer (all-HBM step {ov['all_hbm_step_ms']:.3f} "
              f"ms; the row-map step with every expert hot {ov['rowmap_step_ms']:.3f} ms; PDL {ov['pdl_available']}):")
        print(f"  decisions + fill alone in a graph {ov['decisions_ms']:.4f} ms = {100 * ov['fraction']:.2f}% of the "
              "all-HBM step")
        for way, w in ov["ways"].items():
            print(f"  {way:44s} step {w['step_ms']:.3f} ms = +{100 * w['step_fraction']:.2f}% over all-HBM "
                  f"(+{100 * w['over_rowmap_fraction']:.2f}% over the row-map step)")
        if ov["torch_ops_decisions_ms"] is not None:
            print(f"  torch ops (CPU path's decisions) alone: {ov['torch_ops_decisions_ms']:.3f} ms")
    for name, rows in R.get("lookahead", {}).items():
        print(f"lookahead on {name}'s misses (router of layer l on layer l-d's input):")
        for g in rows:
            print(f"  d={g['depth']} top {g['predictions']}: recall on missed {g['recall_on_missed']:.3f} (unreachable "
                  f"share {g['missed_unreachable_share']:.3f}), recall {g['recall']:.3f}, precision {g['precision']:.3f}; "
                  f"lookahead policy simulated: hit {g['sim_hit']:.4f}, misses/token {g['sim_misses_per_token']:.2f}, "
                  f"prefetches/token {g['prefetches_per_token']:.2f} (useful {g['useful_share']:.2f}), link GB/token "
                  f"{g['link_gb_per_token']:.4f}")
    for bsz_, fc in R.get("forecast", {}).items():
        print(f"forecaster, batch {bsz_}: recall of top k+{fc['extra']} one token ahead {fc['recall']:.3f} (previous "
              f"token's experts {fc['previous_token_recall']:.3f}); table {fc['table_bytes'] / 1e6:.1f} MB; all layers "
              f"of a step on the GPU (torch ops, graph) {fc.get('gpu_ms', float('nan')):.4f} ms")
        for row in fc["simulated"]:
            print(f"  simulated on the engine's routing, res {row['residency']}: lru hit {row['lru_hit']:.4f} "
                  f"forecast hit {row['forecast_hit']:.4f}, prefetches/token {row['prefetches_per_token']:.2f} "
                  f"(useful {row['useful_share']:.2f}), link GB/token lru {row['lru_link']:.4f} forecast "
                  f"{row['forecast_link']:.4f}")
    print("fill of one layer's k rows from pinned memory:", R.get("fill"))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
