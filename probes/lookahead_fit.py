# Probe, not a tool: the fitted lookahead forecast (coldset.analysis.forecast.fit_lookahead_routers) against the
# pre-gated router on the CPU; on the H200 at real shape `python -m coldset bench cache --lookahead-fit`.
"""Does a forecast matrix fitted on profile router inputs name layer l + d's experts better than
layer l + d's own router applied to layer l's input? (issue 28, the lookahead's forecast)

    PYTHONPATH=src python3 probes/lookahead_fit.py [--profile-prompts 8] [--prompts 6] [--steps 48]

Builds the synthetic router at Qwen3-30B-A3B's routing shape and the H200 example's router knobs
(48 MoE layers x 128 experts, top-8; hidden 256 and tiny experts so that it runs on a CPU, as
scripts/synthetic_routing_trace.py: its locality differs from the real-shape router's, so the
numbers are a direction, not the GPU's), records every MoE layer's router input on profile prompts
(prompt and decode tokens) and on held-out prompts (decode tokens, batch 1), fits
:func:`coldset.analysis.forecast.fit_lookahead_routers` at each depth, and prints per residency and depth
the recall of layer l + d's selections by the list made after layer l, and the ``lookahead``
policy replayed by :func:`coldset.analysis.cache.simulate` and timed by :func:`coldset.analysis.cache.simulate_time`
at the H200's figures (all-HBM step 2.957 ms at b1, link 51.2 GB/s, 9.44 MB an expert, lookahead's
measured management 6.8 us a group), beside lru. About 2.5 min on 2 threads.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

STEP_MS, EXPERT_BYTES, LINK_GB_S, MANAGE_MS = 2.957, 9437184, 51.2, 0.0068


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile-prompts", type=int, default=8, help="per domain")
    ap.add_argument("--prompts", type=int, default=6, help="held-out requests per domain")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--shrink", type=float, default=None, help="default: forecast.LOOKAHEAD_FIT_SHRINK")
    ap.add_argument("--depths", default="1,4")
    ap.add_argument("--residencies", default="0.25,0.5,0.75")
    args = ap.parse_args()

    from coldset.analysis.simulate import simulate
    from coldset.analysis.streams import AccessStream
    from coldset.analysis.time_model import TimeModel, simulate_time
    from coldset.trace.fixtures import template_texts
    from coldset.analysis.forecast import LOOKAHEAD_FIT_SHRINK, fit_lookahead_routers, lookahead_predictions
    from coldset.engine.generate import generate
    from coldset.analysis.placement import hot_count_for_residency
    from coldset.engine.synthetic import SyntheticSpec, build_synthetic_model

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    spec = SyntheticSpec(layers=48, experts=128, top_k=8, hidden=256, moe_intermediate=16, heads=4, kv_heads=2,
                         head_dim=64, zipf_exponent=1.2, popularity_scale=1.6, domain_affinity=1.0,
                         router_noise=0.6, temporal_gain=2.5, temporal_continuity=0.75, topic_context=3.0,
                         temporal_dims=8, seed=0)
    domains = ["agent", "prose", "code"]
    model, tok = build_synthetic_model(spec, domain_texts=template_texts(domains, 200, seed=1))
    cfg = model.config
    L, E, k = cfg.num_moe_layers, cfg.num_experts, cfg.top_k
    routers = [model.layers[i].mlp.gate.weight.detach().float() for i in cfg.moe_layers]

    def prompts_from(seed, n):
        tx = template_texts(domains, n, seed=seed)
        return [tok.encode(t).ids[:64] for d in domains for t in tx[d]]

    def record(prompts, decode_only):
        """Per prompt: router inputs [T, L, H] and selections [T, L, k] (T: decode tokens, or all)."""
        rec, saved, hid, sel = [], model.experts_fn, [], []

        def recording(p, layer, x, ids, w):
            if not decode_only or x.shape[0] == 1:
                rec.append((x.detach().float().clone(), ids.detach().clone()))
            return saved(p, layer, x, ids, w)

        model.experts_fn = recording
        try:
            for p in prompts:
                rec.clear()
                generate(model, [p], args.steps, progress=False)
                hid.append(torch.stack([torch.cat([x for x, _ in rec[layer::L]]) for layer in range(L)], 1))
                sel.append(torch.stack([torch.cat([i for _, i in rec[layer::L]]) for layer in range(L)], 1).numpy())
        finally:
            model.experts_fn = saved
        return hid, sel

    prof_h, prof_s = record(prompts_from(101, args.profile_prompts), decode_only=False)
    X = torch.cat(prof_h)
    counts = np.zeros((L, E))
    for s in prof_s:
        for layer in range(L):
            np.add.at(counts[layer], s[:, layer].reshape(-1), 1)
    held_h, held_s = record(prompts_from(202, args.prompts), decode_only=True)
    hidden = torch.cat(held_h)[:, :, None, :]  # [S, L, 1, H]: one request after the other, batch 1
    routing = np.concatenate(held_s)[:, :, None, :]
    S = routing.shape[0]
    inst = (routing + (np.arange(L) * E)[None, :, None, None]).reshape(-1)
    stream = AccessStream(inst, np.arange(0, inst.size + 1, k), S, L, E)
    shrink = LOOKAHEAD_FIT_SHRINK if args.shrink is None else args.shrink
    print(f"{L} MoE layers x {E} experts, top {k}, hidden {cfg.hidden_size}; {X.shape[0]} profile tokens, "
          f"{S} held-out decode tokens; shrink {shrink}; {time.perf_counter() - t0:.0f} s")

    def recall(lists, d):
        got = lists.reshape(S, L, -1)
        hits = sum(len(set((routing[t, layer, 0] + layer * E).tolist()) & set(got[t, layer - d].tolist()))
                   for t in range(S) for layer in range(d, L))
        return hits / (S * (L - d) * k)

    def timed(res, manage):
        ts = simulate_time(stream, res, TimeModel(STEP_MS, EXPERT_BYTES, LINK_GB_S, link="share", join="step",
                                                  manage_ms=manage))
        return STEP_MS / ts.step_ms, ts.link_gb_per_token

    depths = [int(d) for d in args.depths.split(",")]
    fits = {d: fit_lookahead_routers(X, routers, d, shrink) for d in depths}
    print("| residency | forecast | depth | recall of layer l + d | x all-HBM (simulated) | link GB/token | hit rate |")
    print("|---|---|---|---|---|---|---|")
    for r in (float(x) for x in args.residencies.split(",")):
        C = hot_count_for_residency(r, L * E)
        res = simulate(stream, "lru", C, counts)
        x, gb = timed(res, 0.0)
        print(f"| {r} | lru | - | - | {x:.3f} | {gb:.3f} | {res.stats().hit_rate:.4f} |")
        for d in depths:
            for name, rt in (("router", routers), ("fitted", fits[d])):
                lists = lookahead_predictions(hidden, rt, d, k)
                res = simulate(stream, "lookahead", C, counts, predictions=lists)
                x, gb = timed(res, MANAGE_MS)
                print(f"| {r} | {name} | {d} | {recall(lists, d):.3f} | {x:.3f} | {gb:.3f} | {res.stats().hit_rate:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
