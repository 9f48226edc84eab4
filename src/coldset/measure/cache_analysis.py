"""``bench cache --analysis``: what a cache row's numbers do not show by themselves, per batch.

The next-token forecaster fitted on the profile routing (its recall on the timed tokens, the
``forecast`` policy simulated beside ``lru``, its GPU cost a step), the next-layer lookahead's
recall on lru's misses, and the cache-management work (the decisions alone and inside the step,
the fill kernel's read rate from pinned memory against the copy engine's).
"""

from __future__ import annotations

import statistics

from coldset.analysis.forecast import (
    TransitionForecaster,
    forecast_recall,
    lookahead_predictions,
    lookahead_recall,
    stream_predictions,
)
from coldset.analysis.placement import hot_count_for_residency
from coldset.analysis.simulate import simulate
from coldset.analysis.streams import AccessStream
from coldset.core.timing import graph_time_us
from coldset.measure.harness import log


def moe_routers(model):
    """The MoE layers' router weights (the lookahead forecast's matrices)."""
    return [model.layers[i].mlp.gate.weight.detach() for i in model.config.moe_layers]


def forecast_analysis(prof_routing, routing, residencies, counts, L, E, k, bsz, tokens, per_expert, dev) -> dict:
    """The next-token forecaster fitted on the profile routing: its recall on the timed tokens, the
    ``forecast`` policy simulated on the engine's routing beside ``lru``, its GPU cost a step."""
    import numpy as np  # GPU-only path: loads when a measurement runs
    import pandas as pd
    import torch

    def routing_rows(rt):
        """Trace-like decode rows of a recorded routing [steps, L, B, k] (request = batch row)."""
        st_, l_, b_, k_ = np.indices(rt.shape).reshape(4, -1)
        return pd.DataFrame({"request": [f"r{b}" for b in b_], "position": st_, "layer_index": l_, "rank": k_,
                             "expert": rt.reshape(-1)})

    forecaster = TransitionForecaster.fit(routing_rows(prof_routing), L, E, k)
    inst = routing + (np.arange(L) * E)[None, :, None, None]
    fc = forecast_recall(forecaster, routing_rows(routing), L, E)
    fc["extra"] = forecaster.extra
    fstream = AccessStream(inst.reshape(-1), np.arange(0, inst.size + 1, bsz * k), tokens, L, E)
    fpred = stream_predictions(forecaster, fstream)
    fc["simulated"] = []
    for r in residencies:
        C = hot_count_for_residency(r, L * E)
        lru = simulate(fstream, "lru", C, counts).stats()
        fst = simulate(fstream, "forecast", C, counts, predictions=fpred).stats()
        fc["simulated"].append({"residency": r, "lru_hit": lru.hit_rate, "forecast_hit": fst.hit_rate,
                                "prefetches_per_token": fst.prefetches / tokens,
                                "useful_share": fst.useful_prefetches / max(fst.prefetches, 1),
                                "lru_link": lru.link_gb_per_token(per_expert),
                                "forecast_link": fst.link_gb_per_token(per_expert)})
    tab = torch.as_tensor(forecaster.table, device=dev)
    step_ids = torch.as_tensor(routing[0], device=dev)  # [L, B, k]
    lidx = torch.arange(L, device=dev)[:, None, None]
    bonus = torch.full(step_ids.shape, float(k), device=dev)

    def forecast_step():
        sc = tab[lidx, step_ids].sum(2)  # [L, B, E]
        sc.scatter_add_(2, step_ids, bonus)
        return torch.sort(-sc, dim=2, stable=True).indices[..., :forecaster.num_predictions]

    fc["gpu_ms"] = graph_time_us(forecast_step, 20) / 1e3
    log("forecast", {k_: v for k_, v in fc.items() if k_ != "simulated"}, fc["simulated"])
    return fc


def lookahead_recall_analysis(model, hidden, routing, sim, acc, C, counts, k, tokens, per_expert) -> list[dict]:
    """The next-layer lookahead (router of layer l on layer l - d's router input) on the
    selections an lru run missed, and the lookahead policy simulated, at depths 1, 2 and forecasts
    of top k and k + 3."""

    routers = moe_routers(model)
    missed = ~sim.hit.reshape(routing.shape)
    out = []
    for depth in (1, 2):
        for extra in (0, 3):
            got = lookahead_recall(hidden, routers, routing, missed, depth, extra)
            lsim = simulate(acc, "lookahead", C, counts,
                            predictions=lookahead_predictions(hidden, routers, depth, k + extra)).stats()
            got.update(sim_hit=lsim.hit_rate, sim_misses_per_token=lsim.misses_per_token,
                       prefetches_per_token=lsim.prefetches / tokens,
                       useful_share=lsim.useful_prefetches / max(lsim.prefetches, 1),
                       link_gb_per_token=lsim.link_gb_per_token(per_expert))
            out.append(got)
            log("lookahead recall", got)
    return out


def management_overhead(decode, cache, ref_fn, rowmap_fn, model, bsz, prompts, L, k, per_expert, all_hit: bool) -> dict:
    """The cache-management work: every layer's decisions on a step whose selections all hit,
    alone in a graph; inside the real step (3 interleaved repeats of the all-HBM step, the row-map
    step over the same all-hot pools and, at residency 1.0, the cache's step: medians); the fill
    kernel's read rate from pinned memory against the copy engine's on one layer's k rows."""
    import torch  # GPU-only path: loads when a measurement runs

    from coldset.kernels.triton_slots import fill  # triton: GPU-only

    def mean_ms(*a, **kw):
        return statistics.fmean(decode(*a, 1, **kw)[0]["ms"])

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

    alone = graph_time_us(decisions, 20) / 1e3
    reps: dict = {"all-HBM": [], "row-map": [], "cache": []}
    for _ in range(3):
        reps["all-HBM"].append(mean_ms(ref_fn, model.pools, bsz, prompts))
        reps["row-map"].append(mean_ms(rowmap_fn, model.pools, bsz, prompts))
        if all_hit:
            reps["cache"].append(mean_ms(cache.wrap(rowmap_fn), cache.pools, bsz, prompts, cache=cache))
    full, rowmap = statistics.median(reps["all-HBM"]), statistics.median(reps["row-map"])
    out = {"all_hbm_step_ms": full, "rowmap_step_ms": rowmap, "decisions_ms": alone, "fraction": alone / full,
           "reps": reps, "pdl_available": cache.pdl}
    if reps["cache"]:
        step = statistics.median(reps["cache"])
        out["cache_step"] = {"step_ms": step, "step_fraction": step / full - 1,
                             "over_rowmap_fraction": (step - rowmap) / full}
    if bsz == 1:
        cache.use_kernel = False  # the same decisions as torch ops, for comparison
        out["torch_ops_decisions_ms"] = graph_time_us(decisions, 20) / 1e3
        cache.use_kernel = True
    dev = rm.device
    victims, src = torch.arange(k, device=dev), torch.arange(k, device=dev) * 7
    m = torch.full((1,), k, dtype=torch.int64, device=dev)
    p = cache.pools

    pairs = [(p.w13_hot, p.w13_cold), (p.w2_hot, p.w2_cold)]
    if p.has_scales:  # a scaled (FP8, MXFP4) expert moves with its scales (its bytes, per_expert, count them)
        pairs += [(p.w13_scale_hot, p.w13_scale_cold), (p.w2_scale_hot, p.w2_scale_cold)]

    def copy_engine():
        for j in range(k):
            for hot, cold in pairs:
                hot[j].copy_(cold[7 * j], non_blocking=True)

    nbytes = k * per_expert
    out["fill"] = {"rows": k, "bytes": nbytes,
                   "kernel_gb_s": nbytes / graph_time_us(lambda: fill(p, victims, src, m), 20) / 1e3,
                   "copy_engine_gb_s": nbytes / graph_time_us(copy_engine, 20) / 1e3}
    cache.reset()
    log("overhead", bsz, out)
    return out
