"""``bench cache --decisions-only``: the split of the slot cache's work per layer at the
config's shape, on stand-in experts (no model)."""

from __future__ import annotations

from pathlib import Path

from coldset.analysis.placement import hot_mask_usage_global, row_map_from_mask
from coldset.core.timing import graph_time_us
from coldset.engine.cache.pool import SlotCache
from coldset.kernels.tiers import ExpertPools, host_tier
from coldset.measure.harness import log, new_result, write_result
from coldset.workflow.config import load_config


def decisions_split(args, argv=None) -> dict:
    """Where lookahead's extra work a layer goes, at the config's shape (L, E, top k, hidden), with
    stand-in experts of a few bytes (the decisions do not depend on the experts' size) at residency
    1.0 (every selection and every forecast a hit: the work alone, no copy), each part captured in a
    CUDA graph over every MoE layer (:func:`coldset.core.timing.graph_time_us`): lru's decisions + fill,
    lookahead's whole group (GEMV, decisions, demand fill, fork, prefetch fill, join), the forecast's
    GEMV alone, and lookahead's decisions launch alone; then as the fused decode step runs them
    (:meth:`coldset.engine.cache.pool.SlotCache.route`): the router's launch alone (no cache), lru's group in it
    (the router recording + the fill choosing and copying) and lookahead's (the router with the
    forecast and the whole decision + the demand fill + fork, prefetch fill, join); a cached group's
    cost is its row minus the router's."""
    import numpy as np  # GPU-only path: loads when a measurement runs
    import torch

    from coldset.kernels import triton_decode as td
    from coldset.kernels.triton_slots import decide_ahead

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
    out = new_result("cache-decisions", argv, args)
    out.update(shape={"layers": L, "experts": E, "top_k": k, "hidden": H, "slots": C}, us_per_step={})
    for bsz in (int(b) for b in args.batches.split(",")):
        g = torch.Generator(device=dev).manual_seed(bsz)
        ids = [torch.randint(0, E, (bsz, k), device=dev, generator=g) for _ in range(L)]
        w = torch.rand((bsz, k), device=dev)
        x = torch.randn((bsz, H), device=dev, dtype=torch.bfloat16)
        lru = SlotCache.build(all_hot, host, row_map, wc, "lru", bsz, k)
        la = SlotCache.build(all_hot, host, row_map, wc, "lookahead", bsz, k, routers=routers, depth=1)
        logits = la.rules.forecast_logits(la, x, 1)
        flat = [i.reshape(-1).contiguous() for i in ids]
        # the fused step's router launch (routers = the MoE layers' gates, as in the model)
        norm_w = torch.ones(H, device=dev, dtype=torch.bfloat16)
        counter = torch.zeros(1, dtype=torch.int32, device=dev)
        pdl = td.pdl_default(bsz, dev)
        lru_r = SlotCache.build(all_hot, host, row_map, wc, "lru", bsz, k)
        la_r = SlotCache.build(all_hot, host, row_map, wc, "lookahead", bsz, k, routers=routers, depth=1)

        def run_router():
            for layer in range(L):
                td.route(x, norm_w, 1e-6, routers[layer], k, True, counter, weights_dtype=x.dtype, pdl=pdl)

        def routed(cache):
            def run():
                for layer in range(L):
                    _, ids_r, w_r = cache.route(layer, x, norm_w, 1e-6, routers[layer], k, True, counter, pdl=pdl)
                    cache.admit(layer, ids_r, w_r, x.dtype)  # the experts' admit: decided already, no launch
            return run

        def run_lru():
            for layer in range(L):
                lru.admit(layer, ids[layer], w, torch.bfloat16)

        def run_la():
            for layer in range(L):
                la.admit(layer, ids[layer], w, torch.bfloat16, hidden=x)

        def run_gemv():
            for layer in range(L - 1):
                la.rules.forecast_logits(la, x, layer + 1)

        def run_decide():
            for layer in range(L):
                decide_ahead(la, layer, flat[layer], layer == 0, logits if layer < L - 1 else None,
                             min(layer + 1, L - 1))

        res = {}
        for name, fn in (("lru group", run_lru), ("lookahead group", run_la), ("forecast GEMV", run_gemv),
                         ("lookahead decisions launch", run_decide), ("router launch", run_router),
                         ("lru routed group", routed(lru_r)), ("lookahead routed group", routed(la_r))):
            # the first call compiles its launches (tens of seconds each on the H200's host at b8)
            log(f"b{bsz}: {name} (compiling on first use, then 50 graphed replays)")
            res[name] = graph_time_us(fn, 50)
        out["us_per_step"][bsz] = res
        log(f"b{bsz}: per step of {L} layers (us):", {n: round(v, 1) for n, v in res.items()})
        la.join()
        la_r.join()
    write_result(Path(args.out) / "cache_decisions.json", out)
    return out
