"""Probe (not a tool of the package): the nexttoken slot cache's step time on one GPU beside lru and all-HBM (issue 28).

    PYTHONPATH=src python probes/nexttoken_h200.py --config config/examples/qwen3-30b-a3b-h200.yaml --out <dir>

The config's in-memory synthetic model (decode region compiled, every step one CUDA graph through
coldset.bench.Decoder), one pinned host copy of every expert, the fixtures rendered as the
workflow does: the profile prompts' routing (unmodified path, batch 8) gives the warm set's
counts and fits coldset.forecast.NextTokenForecaster (fit_tuned: its history parameters chosen on
profile sequences only); the timed prompts come from the held-out fixtures. Per batch: all-HBM
(routing recorded), then per residency ``lru`` and ``nexttoken`` from their warm state, one
checked pass and ``--repeats`` timed passes each. Checks: logits bitwise all-HBM's in every pass;
the engine's per-group (hits, misses, fills[, prefetches]) and nexttoken's lists equal
coldset.cache.simulate / coldset.forecast.nexttoken_lists on the all-HBM routing; no commit
refused (stale 0); state consistent. Printed per row: step ms, x all-HBM, link GB per token
(fills and prefetches x expert bytes), overlap = 1 - (step - all-HBM) / (link bytes per step /
the measured link read rate), bound = max(all-HBM, link time) and the fraction of it reached, hit
rate engine == simulator, the simulator's time (coldset.cache.simulate_time, link "share", join
"step") against the measured step. At residency 1.0 the row is the cache's management cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

T0 = time.perf_counter()
PROMPT_TOKENS = 32


def log(*a) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="config/examples/qwen3-30b-a3b-h200.yaml")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--residencies", default="0.5,1.0")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prefetch-blocks", type=int, default=32)
    args = ap.parse_args()

    from coldset import bench as bn
    from coldset.cache import Lanes, TimeModel, simulate, simulate_time
    from coldset.config import load_config
    from coldset.fixtures import render_domain, template_texts
    from coldset.forecast import NextTokenForecaster, nexttoken_lists
    from coldset.gate import experts_functions
    from coldset.model import encode_prompts
    from coldset.placement import expert_bytes, hot_count_for_residency, hot_mask_usage_global, row_map_from_mask
    from coldset.slots import SlotCache
    from coldset.synthetic import SyntheticSpec, build_synthetic_model
    from coldset.tiers import host_tier

    dev = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = load_config(args.config)
    R = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "config": args.config, "rows": [],
         "fails": []}
    spec = SyntheticSpec(**config["model"]["synthetic"])
    fx = config["fixtures"]
    texts = template_texts(fx["domains"], 200, seed=fx["seed"] + 1, template_dir=fx["template_dir"])
    model, tokenizer = build_synthetic_model(spec, dev, getattr(torch, config["model"]["dtype"]), domain_texts=texts)
    model.compile_decode()
    cfg = model.config
    L, E, k = cfg.num_moe_layers, cfg.num_experts, cfg.top_k
    per_expert = expert_bytes(cfg)
    host = host_tier(model.pools)
    ceil = bn.measure_ceilings(host.w13)
    R["ceilings"] = ceil
    link = ceil["link_read_gb_s"]
    log("model built; ceilings", ceil)
    ref_fn, rowmap_fn, _ = experts_functions(dev, None)
    steps = args.steps
    fixtures = [f for d in fx["domains"] for f in render_domain(d, fx["per_domain"], fx["heldout_fraction"],
                                                                  fx["max_new_tokens"], fx["seed"], fx["template_dir"])]

    def stream(split):
        return [t for ids in encode_prompts(tokenizer, [f.prompt for f in fixtures if f.split == split]) for t in ids]

    def decode(experts_fn, pools, bsz, prompts, passes, cache=None, record=False):
        saved = model.pools, model.experts_fn
        rec = torch.zeros((L, bsz, k), dtype=torch.long, device=dev)

        def recording(p, layer, x, ids, w):
            if x.shape[0] == bsz:
                rec[layer].copy_(ids)
            return experts_fn(p, layer, x, ids, w)

        model.pools, model.experts_fn = pools, recording if record else experts_fn
        res = []
        try:
            dec = bn.Decoder(model, bsz, PROMPT_TOKENS, steps + 1, True)
            tok0 = dec.prefill(prompts.to(dev))
            dec.set_step(tok0, 1)
            dec.capture()
            for i in range(passes):
                if cache is not None:
                    cache.reset()
                ms, logits, routing = [], [], []
                for step_ms, lg, _ in dec.timed_steps(tok0, steps):
                    ms.append(step_ms)
                    logits.append(lg.clone())
                    if record and i == 0:
                        routing.append(rec.cpu().numpy().copy())
                p = {"ms": ms, "logits": torch.stack(logits)}
                if record and i == 0:
                    p["routing"] = np.stack(routing)
                if cache is not None:
                    p["counters"] = cache.counters()
                    hist = cache.group_history()
                    if cache.prefetch_history is not None:
                        hist = np.concatenate([hist, cache.prefetch_counts()[:, None]], axis=1)
                        p["lists"] = cache.prefetch_lists()
                    p["history"] = hist
                    p["consistent"] = True
                    if i == 0:  # the checked pass (the check reads every slot back: not before a timed pass's end)
                        try:
                            cache.check(contents=True)
                        except ValueError as exc:
                            p["consistent"] = str(exc)
                res.append(p)
            del dec
        finally:
            model.pools, model.experts_fn = saved
        return res

    prof = decode(ref_fn, model.pools, 8, bn.bench_prompts(stream("profile"), 8, PROMPT_TOKENS), 1,
                  record=True)[0]["routing"]  # [S, L, 8, k]
    counts = np.zeros((L, E))
    for layer in range(L):
        np.add.at(counts[layer], prof[:, layer].reshape(-1), 1)
    tokens = prof.transpose(2, 0, 1, 3).reshape(-1, L, k)  # lane by lane, in order
    sequence = np.repeat(np.arange(prof.shape[2]), prof.shape[0])
    t = time.perf_counter()
    F = NextTokenForecaster.fit_tuned(tokens, sequence, k, E)
    R["forecaster"] = {"terms": list(F.terms), "hist_unit": F.hist_unit, "hist_shift": F.hist_shift,
                       "n": F.num_predictions, "table_mb": F.nbytes / 1e6, "fit_s": time.perf_counter() - t}
    log("forecaster", R["forecaster"])
    heldout = stream("heldout")
    passes = 1 + args.repeats
    for bsz in (int(b) for b in args.batches.split(",")):
        prompts = bn.bench_prompts(heldout, bsz, PROMPT_TOKENS)
        base = decode(ref_fn, model.pools, bsz, prompts, passes, record=True)
        ref_logits, routing = base[0]["logits"], base[0]["routing"].astype(np.int64)
        allhbm = statistics.median(statistics.fmean(p["ms"]) for p in base[1:])
        start = np.zeros((steps, bsz), dtype=bool)
        start[0] = True
        lanes = Lanes(routing, start, E)
        acc = lanes.stream()
        lists = nexttoken_lists(F, routing, start)
        R["rows"].append({"batch": bsz, "placement": "all-HBM", "step_ms": allhbm})
        log(f"b{bsz} all-HBM {allhbm:.3f} ms")
        for res_ in (float(r) for r in args.residencies.split(",")):
            C = hot_count_for_residency(res_, L * E)
            row_map = row_map_from_mask(hot_mask_usage_global(counts, C))
            flat = row_map.reshape(-1)
            hot = np.flatnonzero(flat >= 0)
            warm = np.empty(C)
            warm[flat[hot]] = counts.reshape(-1)[hot]
            for pol in ("lru", "nexttoken"):
                name = f"{pol}-{res_}"
                try:
                    cache = SlotCache.build(model.pools, host, row_map, warm, pol, bsz, k, history=steps * L + 8,
                                            forecaster=F if pol == "nexttoken" else None)
                except Exception as exc:  # noqa: BLE001 - a probe: report and go on
                    R["fails"].append(f"{name}/b{bsz}: build: {exc}")
                    continue
                cache.prefetch_blocks = args.prefetch_blocks
                got = decode(cache.wrap(rowmap_fn), cache.pools, bsz, prompts, passes, cache=cache)
                sim = simulate(acc, pol, C, counts, predictions=lists if pol == "nexttoken" else None)
                want = np.stack([sim.hits, sim.misses, sim.fills], axis=1)
                if pol == "nexttoken":
                    want = np.concatenate([want, sim.prefetches[:, None]], axis=1)
                checks = []
                for i, p in enumerate(got):
                    checks.append(bool(torch.equal(p["logits"], ref_logits)))
                    checks.append(bool(np.array_equal(p["history"], want)))
                    if pol == "nexttoken":
                        checks.append(bool(np.array_equal(p["lists"], lists)))
                        checks.append(p["counters"]["stale"] == 0)
                    checks.append(p["consistent"] is True)
                if not all(checks):
                    R["fails"].append(f"{name}/b{bsz}: checks {checks}")
                step = statistics.median(statistics.fmean(p["ms"]) for p in got[1:])
                st = sim.stats()
                c = got[1]["counters"]
                ntok = bsz * steps
                link_gb_tok = (c["fills"] + c.get("prefetches", 0)) * per_expert / ntok / 1e9
                link_ms = link_gb_tok * bsz / link * 1e3  # per step
                tm = TimeModel(step_ms=allhbm, bytes_per_expert=per_expert, link_gb_s=link, link="share", join="step")
                ts = simulate_time(acc, sim, tm)
                bound = max(allhbm, link_ms)
                r = {"batch": bsz, "placement": name, "residency": res_, "step_ms": step, "x_allhbm": allhbm / step,
                     "link_gb_per_token": link_gb_tok, "overlap": 1 - (step - allhbm) / link_ms if link_ms else None,
                     "bound_ms": bound, "fraction_of_bound": bound / step, "hit_rate": c["hits"] / (c["hits"] + c["misses"]),
                     "sim_hit_rate": st.hit_rate, "prefetches_per_token": c.get("prefetches", 0) / ntok,
                     "wasted_per_token": getattr(sim, "wasted_prefetches", 0) / ntok,
                     "sim_step_ms": ts.step_ms, "sim_over_measured": ts.step_ms / step, "checks_pass": all(checks),
                     "pass_ms": [statistics.fmean(p["ms"]) for p in got]}
                R["rows"].append(r)
                log(r)
                del cache, got
                torch.cuda.empty_cache()
                (out / "nexttoken_h200.json").write_text(json.dumps(R, indent=1, default=str))
    (out / "nexttoken_h200.json").write_text(json.dumps(R, indent=1, default=str))
    print(f"\n{R['device']}; HBM {ceil['hbm_read_gb_s']:.0f} GB/s, link {link:.1f} GB/s; forecaster {R['forecaster']}")
    print("| b | placement | step ms | x all-HBM | link GB/tok | overlap | bound ms | of bound | hit (engine = sim) "
          "| prefetch/tok | wasted/tok | sim ms / measured | checks |")
    print("|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|")
    for r in R["rows"]:
        if r["placement"] == "all-HBM":
            print(f"| {r['batch']} | all-HBM | {r['step_ms']:.3f} | 1 | 0 | | | | | | | | |")
            continue
        ov = "" if r["overlap"] is None else f"{r['overlap']:.2f}"
        print(f"| {r['batch']} | {r['placement']} | {r['step_ms']:.3f} | {r['x_allhbm']:.3f} | "
              f"{r['link_gb_per_token']:.3f} | {ov} | {r['bound_ms']:.3f} | {r['fraction_of_bound']:.2f} | "
              f"{r['hit_rate']:.4f} ({r['sim_hit_rate']:.4f}) | {r['prefetches_per_token']:.2f} | "
              f"{r['wasted_per_token']:.2f} | {r['sim_over_measured']:.2f} | {'ok' if r['checks_pass'] else 'FAIL'} |")
    for f in R["fails"]:
        print("FAIL:", f)
    return 1 if R["fails"] else 0


if __name__ == "__main__":
    sys.exit(main())
