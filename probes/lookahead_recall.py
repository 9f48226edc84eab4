# Probe, not a tool: the issue 12 experiment on the CPU model; at real shape `python -m coldset bench cache --analysis` measures the same.
"""Does a next-layer lookahead know the experts an LRU slot cache misses? (issue 12, item 3)

    PYTHONPATH=src python3 probes/lookahead_recall.py --config config/config.yaml

Builds the config's synthetic model in memory (its device and dtype; the engine's torch path on
the CPU), profiles routing on profile prompts (template texts, one seed: the warm set's counts),
then decodes held-out prompts (another seed) one request at a time (batch 1), recording each MoE
layer's router input and selections per decode step. ``lru`` is replayed by
:func:`coldset.analysis.cache.simulate` over those steps at each residency (warm from the profile counts,
as the engine's cache), and :func:`coldset.analysis.forecast.lookahead_recall` measures, for depths 1 and
2 and forecasts of top k and top k + 3, the share of lru's missed selections that the router of
layer ``l`` applied to layer ``l - depth``'s router input names (pre-gated MoE's lookahead), and
the ``lookahead`` policy of the simulator fed with those forecasts (hit rate, demand misses and
prefetches per token). Prints one line per (residency, depth, forecast size).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="config/config.yaml")
    ap.add_argument("--profile-prompts", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=6, help="held-out requests, decoded one at a time")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per request")
    ap.add_argument("--residencies", default="0.25,0.5")
    args = ap.parse_args()

    from coldset.analysis.simulate import simulate
    from coldset.analysis.streams import AccessStream
    from coldset.workflow.config import load_config
    from coldset.trace.fixtures import template_texts
    from coldset.analysis.forecast import lookahead_predictions, lookahead_recall
    from coldset.engine.generate import generate
    from coldset.analysis.placement import hot_count_for_residency
    from coldset.engine.synthetic import SyntheticSpec, build_synthetic_model

    config = load_config(args.config)
    spec = SyntheticSpec(**config["model"]["synthetic"])
    dev = torch.device("cuda" if config.get("device") == "cuda" else "cpu")
    fx = config["fixtures"]
    texts = template_texts(fx["domains"], 200, seed=fx["seed"] + 1, template_dir=fx.get("template_dir"))
    model, tokenizer = build_synthetic_model(spec, dev, getattr(torch, config["model"]["dtype"]), domain_texts=texts)
    cfg = model.config
    L, E, k = cfg.num_moe_layers, cfg.num_experts, cfg.top_k
    routers = [model.layers[i].mlp.gate.weight.detach() for i in cfg.moe_layers]

    def prompts_from(seed: int, n: int) -> list[list[int]]:
        tx = template_texts(fx["domains"], n, seed=seed, template_dir=fx.get("template_dir"))
        rows = [tokenizer.encode(t).ids for d in fx["domains"] for t in tx[d]]
        return rows[:n]

    def decode(prompts):
        """Per request: router inputs [S, L, 1, H] and selections [S, L, 1, k] of its decode steps."""
        rec: list = []
        saved = model.experts_fn

        def recording(p, layer, x, ids, w):
            if x.shape[0] == 1:
                rec.append((x.detach().clone(), ids.detach().clone()))
            return saved(p, layer, x, ids, w)

        model.experts_fn = recording
        hid, sel = [], []
        try:
            for p in prompts:
                rec.clear()
                generate(model, [p], args.steps, progress=False)
                steps = len(rec) // L
                hid.append(torch.stack([x for x, _ in rec]).reshape(steps, L, 1, -1))
                sel.append(torch.stack([i for _, i in rec]).reshape(steps, L, 1, k).cpu().numpy())
        finally:
            model.experts_fn = saved
        return torch.cat(hid), np.concatenate(sel)

    _, prof = decode(prompts_from(fx["seed"] + 101, args.profile_prompts))
    counts = np.zeros((L, E))
    for layer in range(L):
        np.add.at(counts[layer], prof[:, layer].reshape(-1), 1)
    hidden, routing = decode(prompts_from(fx["seed"] + 202, args.prompts))
    S = routing.shape[0]
    inst = (routing + (np.arange(L) * E)[None, :, None, None]).reshape(-1)
    stream = AccessStream(inst, np.arange(0, inst.size + 1, k), S, L, E)
    print(f"{cfg.model_type} {L} MoE layers x {E} experts, top {k}, {args.config}; {S} decode tokens "
          f"({args.prompts} held-out requests x {args.steps} steps, batch 1)")
    rows = []
    for r in (float(x) for x in args.residencies.split(",")):
        C = hot_count_for_residency(r, L * E)
        res = simulate(stream, "lru", C, counts)
        missed = ~res.hit.reshape(routing.shape)
        for depth in (1, 2):
            for extra in (0, 3):
                got = lookahead_recall(hidden, routers, routing, missed, depth, extra)
                lk = simulate(stream, "lookahead", C, counts,
                              predictions=lookahead_predictions(hidden, routers, depth, k + extra)).stats()
                got.update(residency=r, lru_hit=float(res.hit.mean()), misses_per_token=float(missed.sum() / S),
                           lookahead_hit=lk.hit_rate, lookahead_misses_per_token=lk.misses_per_token,
                           prefetches_per_token=lk.prefetches / S,
                           useful_share=lk.useful_prefetches / max(lk.prefetches, 1))
                rows.append(got)
                print(json.dumps(got))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
