#!/usr/bin/env python3
"""The lookahead prefetch at real shape on one GPU: correctness first, then decode speed.

    PYTHONPATH=src python3 scripts/prefetch_h200.py --config config/examples/qwen3-30b-a3b-h200.yaml --out <dir>

Builds the config's in-memory synthetic model (decode region compiled as the pipeline does), pins
one host copy of every expert, and renders the config's fixtures as the workflow does
(:func:`coldset.fixtures.render_domain`: profile and held-out split). The profile prompts' routing on
the unmodified path gives the profile counts (the warm set: ``usage_global``'s hot set at the
residency); the timed prompts are cut from the held-out fixtures' token stream
(:func:`coldset.bench.bench_prompts`). Per batch size, every step one CUDA graph
(:class:`coldset.bench.Decoder`), each variant captured once and decoded ``1 + repeats`` passes
from its warm state (:meth:`coldset.slots.SlotCache.reset`): all-HBM (the unmodified path, its
routing recorded), ``usage_global`` (static, cold experts read in place), ``lru`` and
``lookahead`` at each depth (decisions in one Triton launch a layer, prefetch copies on a side
stream inside the graph, joined before layer ``l + d``'s experts), and at residency 1.0
``usage_global``, ``lru`` and ``lookahead`` (every selection a hit: the cache's work in the step).

Checks (exit 1 if one fails): every variant's logits at every step of every pass bitwise the
all-HBM run's; a cache's per-(step, layer) hits, misses and fills, and lookahead's prefetches per
group, equal :func:`coldset.cache.simulate` on the all-HBM routing (lookahead: the lists the
engine recorded), in every pass; row map, owners and slot contents consistent after the run.
Timed: tok/s = 1000 / mean step (:func:`coldset.bench.pass_timing`: each pass's mean step, the
median over the timed passes), ratios to ``usage_global`` and to all-HBM of the same batch in the
same run, hit rate (engine = simulator), misses, prefetches (used) and link GB per token (fills +
prefetches x bytes per expert). Writes ``prefetch_h200.json``; the table is printed last.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

T0 = time.perf_counter()


def log(*a) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="config/examples/qwen3-30b-a3b-h200.yaml")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per pass")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes (after one checked warm-up pass)")
    ap.add_argument("--residency", type=float, default=0.5)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--prefetch-blocks", type=int, default=32, help="blocks per weight of the prefetch copy")
    ap.add_argument("--no-full", action="store_true", help="skip the residency-1.0 runs")
    ap.add_argument("--decisions-only", action="store_true",
                    help="only the split of the cache's work per layer at the config's shape (no model)")
    args = ap.parse_args()
    if args.decisions_only:
        return decisions_split(args)

    from coldset import bench as bn
    from coldset.cache import AccessStream, simulate
    from coldset.config import load_config
    from coldset.files import write_json
    from coldset.fixtures import render_domain, template_texts
    from coldset.gate import experts_functions
    from coldset.model import encode_prompts
    from coldset.placement import expert_bytes, hot_count_for_residency, hot_mask_usage_global, row_map_from_mask
    from coldset.slots import SlotCache
    from coldset.synthetic import SyntheticSpec, build_synthetic_model
    from coldset.tiers import host_tier

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = load_config(args.config)
    dev = torch.device("cuda")
    R: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "config": args.config,
               "args": vars(args), "rows": [], "checks": {}}
    fails: list[str] = []
    spec = SyntheticSpec(**config["model"]["synthetic"])
    fx = config["fixtures"]
    texts = template_texts(fx["domains"], 200, seed=fx["seed"] + 1, template_dir=fx["template_dir"])
    model, tokenizer = build_synthetic_model(spec, dev, getattr(torch, config["model"]["dtype"]), domain_texts=texts)
    model.compile_decode()
    cfg = model.config
    L, E, k = cfg.num_moe_layers, cfg.num_experts, cfg.top_k
    routers = [model.layers[i].mlp.gate.weight.detach() for i in cfg.moe_layers]
    per_expert = expert_bytes(cfg)
    host = host_tier(model.pools)
    log("model built and host tier pinned")
    ref_fn, rowmap_fn, _ = experts_functions(dev, None)
    plen, steps = 32, args.steps
    fixtures = [f for d in fx["domains"] for f in render_domain(d, fx["per_domain"], fx["heldout_fraction"],
                                                                  fx["max_new_tokens"], fx["seed"], fx["template_dir"])]

    def stream(split: str) -> list[int]:
        return [t for ids in encode_prompts(tokenizer, [f.prompt for f in fixtures if f.split == split]) for t in ids]

    profile_stream, heldout_stream = stream("profile"), stream("heldout")

    def decode(experts_fn, pools, bsz, prompts, passes, cache=None, record=False):
        """Captured decode, ``passes`` passes from the same start: per pass step ms and logits;
        routing [steps, L, B, k] of the first pass (record); the cache's per-pass group history and lists."""
        saved = model.pools, model.experts_fn
        rec = torch.zeros((L, bsz, k), dtype=torch.long, device=dev)
        def recording(p, layer, x, ids, w):
            if x.shape[0] == bsz:
                rec[layer].copy_(ids)
            return experts_fn(p, layer, x, ids, w)

        model.pools, model.experts_fn = pools, recording if record else experts_fn
        res = []
        try:
            dec = bn.Decoder(model, bsz, plen, steps + 1, True)
            tok0 = dec.prefill(prompts.to(dev))
            dec.set_step(tok0, 1)
            dec.capture()
            for _ in range(passes):
                if cache is not None:
                    cache.reset()
                ms, logits, routing = [], [], []
                for step_ms, lg, _ in dec.timed_steps(tok0, steps):
                    ms.append(step_ms)
                    logits.append(lg.clone())
                    if record:
                        routing.append(rec.cpu().numpy().copy())
                p = {"ms": ms, "logits": torch.stack(logits)}
                if record:
                    p["routing"] = np.stack(routing)
                if cache is not None:
                    p["counters"] = cache.counters()
                    p["history"] = cache.group_history()
                    if cache.policy == "lookahead":
                        p["lists"] = cache.prefetch_lists()
                        p["prefetches"] = cache.prefetch_history[:p["counters"]["groups"]].cpu().numpy()
                res.append(p)
            del dec
        finally:
            model.pools, model.experts_fn = saved
        return res

    # profile counts: the profile fixtures' routing on the unmodified path
    prof = bn.bench_prompts(profile_stream, 8, plen)
    pr = decode(ref_fn, model.pools, 8, prof, 1, record=True)[0]["routing"]
    counts = np.zeros((L, E), dtype=np.float64)
    for layer in range(L):
        np.add.at(counts[layer], pr[:, layer].reshape(-1), 1)
    passes = 1 + args.repeats

    for bsz in (int(b) for b in args.batches.split(",")):
        prompts = bn.bench_prompts(heldout_stream, bsz, plen)
        base = decode(ref_fn, model.pools, bsz, prompts, passes, record=True)
        ref_logits, routing = base[0]["logits"], base[0]["routing"]
        tokens = bsz * steps
        inst = (routing + (np.arange(L) * E)[None, :, None, None]).reshape(-1)  # the engine's group order
        acc = AccessStream(inst, np.arange(0, inst.size + 1, bsz * k), tokens, L, E)

        def row(name, res, residency, extra):
            mean, p50, p90 = bn.pass_timing([p["ms"] for p in res[1:]])
            r = {"batch": bsz, "placement": name, "residency": residency, "step_ms_mean": mean, "step_ms_p50": p50,
                 "step_ms_p90": p90, "tok_s": 1e3 / mean, **extra}
            for i, p in enumerate(res):
                same = bool(torch.equal(p["logits"], ref_logits))
                R["checks"][f"{name}/b{bsz} pass {i} logits bitwise"] = same
                if not same:
                    fails.append(f"{name}/b{bsz} pass {i}: logits differ from all-HBM's")
            R["rows"].append(r)
            log({k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in r.items()})

        row("all-HBM", base, 1.0, {"hit_rate": 1.0, "misses_per_token": 0.0, "link_gb_per_token": 0.0})
        residencies = [args.residency] + ([] if args.no_full else [1.0])
        for res_ in residencies:
            C = hot_count_for_residency(res_, L * E)
            row_map = row_map_from_mask(hot_mask_usage_global(counts, C))
            pools = model.pools.placed(row_map, host)
            got = decode(rowmap_fn, pools, bsz, prompts, passes)
            del pools
            torch.cuda.empty_cache()
            cold = row_map.reshape(-1)[inst] < 0
            cold_steps = cold.reshape(steps, L, bsz * k)
            reads = sum(len(set(inst.reshape(steps, L, -1)[s, l][cold_steps[s, l]].tolist()))
                        for s in range(steps) for l in range(L))
            row(f"usage_global-{res_}", got, res_, {"hit_rate": 1.0 - float(cold.mean()),
                                                     "misses_per_token": int(cold.sum()) / tokens,
                                                     "link_gb_per_token": reads * per_expert / tokens / 1e9})
            warm_counts = np.empty(C)
            flat = row_map.reshape(-1)
            hot = np.flatnonzero(flat >= 0)
            warm_counts[flat[hot]] = counts.reshape(-1)[hot]
            variants = [("lru", 0)] + [("lookahead", int(d)) for d in args.depths.split(",")]
            if res_ == 1.0:
                variants = [("lru", 0), ("lookahead", 1)]
            for pol, depth in variants:
                name = f"{pol}-{res_}" + (f" d{depth}" if depth else "")
                cache = SlotCache.build(model.pools, host, row_map, warm_counts, pol, bsz, k,
                                        history=steps * L + 8, routers=routers if depth else None,
                                        depth=max(depth, 1))
                cache.prefetch_blocks = args.prefetch_blocks
                got = decode(cache.wrap(rowmap_fn), cache.pools, bsz, prompts, passes, cache=cache)
                sim = simulate(acc, pol, C, counts, predictions=got[0].get("lists"))
                sim_hist = np.stack([sim.hits, sim.misses, sim.fills], axis=1)
                for i, p in enumerate(got):
                    ok = bool(np.array_equal(p["history"], sim_hist))
                    if depth:
                        ok = ok and bool(np.array_equal(p["lists"], got[0]["lists"])) \
                            and bool(np.array_equal(p["prefetches"], sim.prefetches))
                    R["checks"][f"{name}/b{bsz} pass {i} == simulator"] = ok
                    if not ok:
                        fails.append(f"{name}/b{bsz} pass {i}: per-group decisions differ from the simulator's")
                try:
                    cache.check(contents=True)
                    R["checks"][f"{name}/b{bsz} state consistent"] = True
                except ValueError as exc:
                    fails.append(f"{name}/b{bsz}: {exc}")
                c = got[1]["counters"]
                st = sim.stats()
                row(name, got, res_, {
                    "hit_rate": c["hits"] / (c["hits"] + c["misses"]), "sim_hit_rate": st.hit_rate,
                    "misses_per_token": c["misses"] / tokens, "fills_per_token": c["fills"] / tokens,
                    "prefetches_per_token": st.prefetches / tokens,
                    "useful_prefetches_per_token": st.useful_prefetches / tokens,
                    "link_gb_per_token": st.link_gb_per_token(per_expert)})
                del cache, got
                torch.cuda.empty_cache()
            write_json(out / "prefetch_h200.json", {**R, "fails": fails})
    write_json(out / "prefetch_h200.json", {**R, "fails": fails})

    print(f"\n{R['device']}, {config['model']['name']} bf16, {steps} decode steps x {args.repeats} timed passes "
          f"(+1 checked), held-out fixture prompts, synthetic router; prefetch copy {args.prefetch_blocks} blocks/weight")
    print("checks:", "all passed" if not fails else f"FAILED: {fails}")
    print(f"{'b':>2s} {'placement':22s} {'tok/s':>7s} {'x ug':>5s} {'x HBM':>6s} {'hit':>6s} {'sim hit':>7s} "
          f"{'miss/tok':>8s} {'pf/tok':>6s} {'used':>5s} {'GB/tok':>7s} {'mean ms':>7s} {'p50':>6s} {'p90':>6s}")
    for r in R["rows"]:
        full = next(x for x in R["rows"] if x["batch"] == r["batch"] and x["placement"] == "all-HBM")
        ug = next((x for x in R["rows"] if x["batch"] == r["batch"]
                   and x["placement"] == f"usage_global-{r['residency']}"), None)
        pf = r.get("prefetches_per_token", float("nan"))
        used = r.get("useful_prefetches_per_token", float("nan"))
        print(f"{r['batch']:2d} {r['placement']:22s} {r['tok_s']:7.1f} "
              f"{r['tok_s'] / ug['tok_s'] if ug else float('nan'):5.2f} {r['tok_s'] / full['tok_s']:6.3f} "
              f"{r['hit_rate']:6.4f} {r.get('sim_hit_rate', float('nan')):7.4f} {r['misses_per_token']:8.2f} "
              f"{pf:6.2f} {used:5.2f} {r['link_gb_per_token']:7.4f} {r['step_ms_mean']:7.3f} {r['step_ms_p50']:6.3f} "
              f"{r['step_ms_p90']:6.3f}")
    return 1 if fails else 0


def decisions_split(args) -> int:
    """Where lookahead's extra work a layer goes, at the config's shape (L, E, top k, hidden), with
    stand-in experts of a few bytes (the decisions do not depend on the experts' size) at residency
    1.0 (every selection and every forecast a hit: the work alone, no copy), each part captured in a
    CUDA graph over every MoE layer (:func:`coldset.tune.graph_time_us`): lru's decisions + fill,
    lookahead's whole group (GEMV, decisions, demand fill, fork, prefetch fill, join), the forecast's
    GEMV alone (float32 cast + mm), and lookahead's decisions launch alone."""
    from coldset.config import load_config
    from coldset.files import write_json
    from coldset.kernels.triton_slots import decide_ahead
    from coldset.placement import hot_mask_usage_global, row_map_from_mask
    from coldset.slots import SlotCache
    from coldset.tiers import ExpertPools, host_tier
    from coldset.tune import graph_time_us

    syn = load_config(args.config)["model"]["synthetic"]
    L, E, k, H = syn["layers"], syn["experts"], syn["top_k"], syn["hidden"]
    dev = torch.device("cuda")
    all_hot = ExpertPools.all_hot(torch.randn((L, E, 8, 64), device=dev, dtype=torch.bfloat16),
                                  torch.randn((L, E, 64, 4), device=dev, dtype=torch.bfloat16))
    host = host_tier(all_hot)
    counts = np.random.default_rng(0).random((L, E))
    C = L * E
    row_map = row_map_from_mask(hot_mask_usage_global(counts, C))
    wc = np.sort(counts.reshape(-1))
    routers = [torch.randn((E, H), device=dev, dtype=torch.bfloat16) for _ in range(L)]
    out = {"shape": {"layers": L, "experts": E, "top_k": k, "hidden": H, "slots": C}, "us_per_step": {}}
    for bsz in (int(b) for b in args.batches.split(",")):
        g = torch.Generator(device=dev).manual_seed(bsz)
        ids = [torch.randint(0, E, (bsz, k), device=dev, generator=g) for _ in range(L)]
        w = torch.rand((bsz, k), device=dev)
        x = torch.randn((bsz, H), device=dev, dtype=torch.bfloat16)
        lru = SlotCache.build(all_hot, host, row_map, wc, "lru", bsz, k)
        la = SlotCache.build(all_hot, host, row_map, wc, "lookahead", bsz, k, routers=routers, depth=1)
        logits = la._forecast_logits(x, 1)
        flat = [i.reshape(-1).contiguous() for i in ids]

        def run_lru():
            for layer in range(L):
                lru.admit(layer, ids[layer], w, torch.bfloat16)

        def run_la():
            for layer in range(L):
                la.admit(layer, ids[layer], w, torch.bfloat16, hidden=x)

        def run_gemv():
            for layer in range(L - 1):
                la._forecast_logits(x, layer + 1)

        def run_decide():
            for layer in range(L):
                decide_ahead(la, layer, flat[layer], layer == 0, logits if layer < L - 1 else None, min(layer + 1, L - 1))

        res = {name: graph_time_us(fn, 50) for name, fn in
               (("lru group", run_lru), ("lookahead group", run_la), ("forecast GEMV", run_gemv),
                ("lookahead decisions launch", run_decide))}
        out["us_per_step"][bsz] = res
        log(f"b{bsz}: per step of {L} layers (us):", {n: round(v, 1) for n, v in res.items()})
        la.join()
    write_json(Path(args.out) / "decisions_split.json", out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
