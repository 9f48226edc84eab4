"""``python -m coldset bench cache``: the slot cache and the lookahead prefetch at real shape on
one GPU: correctness first, then decode speed against static placement and all-HBM.

Builds the config's in-memory synthetic model (decode region compiled as the pipeline does), pins
one host copy of every expert, and renders the config's fixtures as the workflow does
(:func:`coldset.trace.fixtures.render_domain`: profile and held-out split). The profile prompts' routing
on the unmodified path gives the profile counts (the warm set: ``usage_global``'s hot set at each
residency); the timed prompts are cut from the held-out fixtures' token stream
(:func:`coldset.bench.decode.bench_prompts`). Per batch size, every step one CUDA graph
(:class:`coldset.bench.decode.Decoder`, its one timed loop ``timed_steps``), each variant captured once
and decoded ``1 + --repeats`` passes from its warm state (:meth:`coldset.engine.cache.pool.SlotCache.reset`):
all-HBM (the unmodified path, its routing recorded), ``usage_global`` (static, cold experts read
in place), each ``--policies`` cache (``lru``, ``lru_guard``, ``lfu``; ``lookahead`` at each ``--depths``:
decisions in one Triton launch a layer, prefetch copies on a side stream inside the graph;
``nexttoken``, issue 28: its :class:`coldset.analysis.forecast.NextTokenForecaster` fitted on the profile
routing with ``--nexttoken-extra`` candidates a token, at most ``--prefetch-budget`` copies a
group), at each ``--residencies`` (at 1.0 every selection hits: the cache's work in the step;
lookahead there at depth 1 only).

Checks (the command exits 1 if one fails): every variant's logits at every step of every pass
bitwise the all-HBM run's; a cache's per-(step, layer) hits, misses and fills, and lookahead's
prefetches per group, equal :func:`coldset.analysis.cache.simulate` on the all-HBM routing (lookahead: on
the lists the engine recorded; nexttoken: through :func:`coldset.bench.decode.simulate_engine_pass`, its
lists equal to :func:`coldset.analysis.forecast.nexttoken_lists` on the same tokens, no commit refused), in
every pass; row map, owners and slot contents consistent after the run. Timed: tok/s = 1000 / mean
step (:func:`coldset.bench.decode.pass_timing`: each pass's mean step, the median over the timed passes,
with the slowest and fastest pass), ratios to
``usage_global`` and to all-HBM of the same batch in the same run, hit rate, misses, prefetches
(and the wasted ones) and link GB per token; per cache row the overlap of its copies with the
compute, the fraction of its bound (max of all-HBM and link time) and
:func:`coldset.analysis.cache.simulate_time`'s step (link "share", join "step") over the measured one.

``--analysis`` adds, per batch: the next-token forecaster (:mod:`coldset.analysis.forecast`, fitted on the
profile routing): its recall on the timed tokens, its GPU cost, the ``forecast`` policy simulated
beside ``lru``; the next-layer lookahead's recall on lru's misses; at the first residency the
cache-management work of all-hit groups alone and inside the step; the fill kernel's read rate
from pinned memory against the copy engine's. ``--decisions-only``: only the split of the
cache's work per layer at the config's shape (no model). Writes ``cache_bench.json`` under ``--out``.

``--weight-format fp8`` (issue 29): the same measurement with the model's experts quantized to the
published block-FP8 format (:func:`coldset.measure.harness.fp8_expert_pools`, on the GPU layer by
layer; the bf16 experts are freed after), so every tier holds FP8 weights with their 128 x 128
scales: the HBM pools, the slots and the pinned host tier, and its attention projections as a
published FP8 checkpoint holds them (:func:`coldset.engine.model.attach_fp8_attention`, read as FP8 at one
token; not yet run on a GPU in this command: bench step's FP8 rows run it) (half the bytes an expert:
:func:`coldset.core.placement.expert_bytes` of ``fp8_block128``, scales included, 4.72 MB at
Qwen3-30B-A3B against 9.44 MB). The reference is the FP8 all-HBM run (the FP8 kernel, every expert
hot, the row map compiled out): every variant's logits bitwise its, the engine's decisions the
simulator's, link bytes and bounds at the FP8 bytes an expert; the same checks as bf16.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from coldset.measure.harness import (FP8_NONEXPERT, WEIGHT_FORMATS, MeasureError, expert_format, fp8_expert_pools,
                                     kernel_profile, log, new_result, require_cuda, spread, write_result)

PROMPT_TOKENS = 32
REPLAY_DEPTHS = (1, 2, 3, 4, 6, 8, 12, 16)  # --save-replays: the lookahead depths whose lists are kept
POLICIES = ("lru", "lru_guard", "lfu", "lookahead", "nexttoken")
# the rows --in-order, --other-fork and --lookahead-fit add
LOOKAHEAD_VARIANTS = ("in-order", "list-after-fill", "list-after-experts", "fit")
FIT_CHUNK = 512  # --lookahead-fit: the profile stream prefilled in chunks of this many tokens


def add_arguments(p) -> None:
    p.add_argument("--config", default="config/examples/qwen3-30b-a3b-h200.yaml",
                   help="workflow config whose model.synthetic shape and fixtures are measured")
    p.add_argument("--out", required=True, help="folder for cache_bench.json")
    p.add_argument("--steps", type=int, default=32, help="decode steps per pass")
    p.add_argument("--repeats", type=int, default=3, help="timed passes (after one checked warm-up pass)")
    p.add_argument("--residencies", default="0.5,1.0")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--policies", default="lru,lookahead", help=f"comma-separated, of {', '.join(POLICIES)}")
    p.add_argument("--depths", default="1,2,3", help="lookahead depths (at residency 1.0: depth 1 only)")
    p.add_argument("--prefetch-blocks", type=int, default=32, help="blocks per weight of the prefetch copy")
    p.add_argument("--nexttoken-extra", type=int, default=3,
                   help="nexttoken: the forecaster's candidates per token beyond top_k (config cache.nexttoken_extra)")
    p.add_argument("--prefetch-budget", type=int, default=None,
                   help="nexttoken: prefetch copies per (step, layer) group (config cache.prefetch_budget; "
                        "default: no cut)")
    p.add_argument("--analysis", action="store_true",
                   help="also the forecaster, lookahead recall on lru's misses, cache overhead and fill rate")
    p.add_argument("--save-replays", action="store_true",
                   help="also cache_replays.npz: per batch the all-HBM routing and the pre-gated lists at "
                        f"depths {','.join(map(str, REPLAY_DEPTHS))} (k and k + 4 candidates), with the profile "
                        "counts: the calibrated time simulator replays policies on them without a GPU")
    p.add_argument("--in-order", action="store_true",
                   help="also each lookahead variant with its prefetch fills on the compute stream (rows named "
                        "'... in-order': no fork to the side stream, no join back): at residency 1.0 nothing is "
                        "copied, so its step against the forked one's is what the per-layer stream hops cost")
    p.add_argument("--other-fork", action="store_true",
                   help="also each lookahead variant with its list and prefetch forked where its depth does not "
                        "fork them (SlotCache.list_after_experts): after the layer's demand fill at depth >= 2 "
                        "(rows named '... list-after-fill'), after the layer's experts at depth 1 ('... "
                        "list-after-experts'); at residency 1.0 what the list beside the w13 launch costs")
    p.add_argument("--lookahead-fit", action="store_true",
                   help="also each lookahead variant with its forecast matrices fitted on the profile fixtures' "
                        "router inputs (coldset.analysis.forecast.router_inputs' first LOOKAHEAD_FIT_TOKENS prompt tokens; "
                        "coldset.analysis.forecast.fit_lookahead_routers) in "
                        "place of the later layers' routers (rows named '... fit'): the same launches, other rows")
    p.add_argument("--profile", action="store_true",
                   help="also a kernel profile of each row's captured step (after its timed passes): kernels, "
                        "their device time and the idle time between them per step, the top kernels")
    p.add_argument("--decisions-only", action="store_true",
                   help="only the split of the cache's work per layer at the config's shape (no model)")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="bf16",
                   help="fp8: the experts quantized to block FP8 in every tier (HBM, slots, pinned host), checked "
                        "bitwise against the FP8 all-HBM run")


def check_arguments(args) -> None:
    """:class:`MeasureError` naming a bad policy, residency or count before anything is built."""
    bad = [p for p in args.policies.split(",") if p not in POLICIES]
    if bad:
        raise MeasureError(f"--policies {bad} not among {', '.join(POLICIES)}")
    try:
        res = [float(r) for r in args.residencies.split(",")]
        [int(b) for b in args.batches.split(",")] + [int(d) for d in args.depths.split(",")]
    except ValueError as exc:
        raise MeasureError(f"--residencies/--batches/--depths: {exc}") from exc
    if not all(0 < r <= 1 for r in res):
        raise MeasureError(f"--residencies {res}: each must be in (0, 1]")
    if args.nexttoken_extra < 0 or (args.prefetch_budget is not None and args.prefetch_budget < 0):
        raise MeasureError(f"--nexttoken-extra {args.nexttoken_extra} and --prefetch-budget {args.prefetch_budget}: "
                           "each must be >= 0")
    if args.prefetch_budget is not None and "nexttoken" not in args.policies.split(","):
        raise MeasureError(f"--prefetch-budget {args.prefetch_budget} is nexttoken's: add nexttoken to --policies")
    if args.in_order and "lookahead" not in args.policies.split(","):
        raise MeasureError("--in-order varies lookahead's prefetch fills: add lookahead to --policies")
    if args.lookahead_fit and "lookahead" not in args.policies.split(","):
        raise MeasureError("--lookahead-fit varies lookahead's forecast: add lookahead to --policies")
    if args.other_fork and "lookahead" not in args.policies.split(","):
        raise MeasureError("--other-fork varies lookahead's fork: add lookahead to --policies")
    if args.save_replays and args.decisions_only:
        raise MeasureError("--save-replays keeps a model run's routing: --decisions-only runs no model")
    if args.steps < 2 or args.repeats < 1:
        raise MeasureError(f"--steps {args.steps} (>= 2) and --repeats {args.repeats} (>= 1)")
    if args.decisions_only and args.weight_format != "bf16":
        raise MeasureError(f"--decisions-only times the cache's decisions on stand-in experts of a few bytes; "
                           f"--weight-format {args.weight_format} does not apply to it")


def run(args, argv=None) -> dict:
    """Measure (see module doc); returns the result written to ``--out``/cache_bench.json."""
    check_arguments(args)
    dev = require_cuda()
    if args.decisions_only:
        return decisions_split(args, argv)
    import numpy as np
    import torch

    from coldset.bench import decode as bn
    from coldset.analysis.simulate import simulate
    from coldset.analysis.streams import AccessStream
    from coldset.workflow.config import load_config
    from coldset.trace.fixtures import render_domain, template_texts
    from coldset.verify.gate import experts_functions
    from coldset.engine.generate import encode_prompts
    from coldset.engine.loading import attach_fp8_attention
    from coldset.analysis.placement import (
        expert_bytes,
        hot_count_for_residency,
        hot_mask_usage_global,
        row_map_from_mask,
    )
    from coldset.engine.cache.pool import SlotCache
    from coldset.engine.synthetic import SyntheticSpec, build_synthetic_model
    from coldset.kernels.tiers import host_tier

    out_path = Path(args.out) / "cache_bench.json"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    config = load_config(args.config)
    R = new_result("cache", argv, args)
    R.update(config=args.config, model=config["model"]["name"], rows=[], checks={})
    fails: list[str] = []
    R["fails"] = fails
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
    R["weight_format"] = args.weight_format
    if args.weight_format == "fp8":
        model.pools = fp8_expert_pools(model.pools)  # the model held the bf16 pools' only reference: freed
        attach_fp8_attention(model)  # and its attention as published (the float weights not restored here)
        R["fp8_nonexpert"] = FP8_NONEXPERT
        torch.cuda.empty_cache()
        log("experts and attention projections quantized to block FP8")
    per_expert = expert_bytes(cfg, expert_format(args.weight_format))
    R["expert_bytes"] = per_expert
    host = host_tier(model.pools)
    # the HBM and link ceilings of this run, for its provenance (FP8 weights read as the same bytes in bf16)
    ceilings = bn.measure_ceilings(host.w13 if args.weight_format == "bf16" else host.w13.view(torch.bfloat16))
    R["ceilings"] = ceilings
    log("model built and host tier pinned; ceilings", ceilings)
    ref_fn, rowmap_fn, _ = experts_functions(dev, None)
    steps = args.steps
    fixtures = [f for d in fx["domains"] for f in render_domain(d, fx["per_domain"], fx["heldout_fraction"],
                                                                  fx["max_new_tokens"], fx["seed"], fx["template_dir"])]

    def stream(split: str) -> list[int]:
        return [t for ids in encode_prompts(tokenizer, [f.prompt for f in fixtures if f.split == split]) for t in ids]

    profile_stream, heldout_stream = stream("profile"), stream("heldout")

    def decode(experts_fn, pools, bsz, prompts, passes, cache=None, record=False):
        """The one timed loop: captured decode, ``passes`` passes from the same start (a cache reset
        to its warm state before each): per pass step ms and logits; the first pass's routing
        [steps, L, B, k] and router inputs [steps, L, B, H] (``record``); a cache's counters, group
        history and (lookahead) lists and prefetches."""
        saved = model.pools, model.experts_fn
        rec = torch.zeros((L, bsz, k), dtype=torch.long, device=dev)
        rec_h = torch.zeros((L, bsz, cfg.hidden_size), dtype=model.dtype, device=dev)

        def recording(p, layer, x, ids, w):
            if x.shape[0] == bsz:
                rec[layer].copy_(ids)
                rec_h[layer].copy_(x)
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
                    cache.reset()  # the capture's warm-up steps (or the last pass) ran the cache: start warm
                ms, logits, routing, hidden = [], [], [], []
                for step_ms, lg, _ in dec.timed_steps(tok0, steps):
                    ms.append(step_ms)
                    logits.append(lg.clone())
                    if record and i == 0:
                        routing.append(rec.cpu().numpy().copy())
                        hidden.append(rec_h.clone())
                p = {"ms": ms, "logits": torch.stack(logits)}
                if record and i == 0:
                    p["routing"], p["hidden"] = np.stack(routing), torch.stack(hidden)
                if cache is not None:
                    p["counters"] = cache.counters()
                    p["history"] = cache.group_history()
                    if cache.policy in ("lookahead", "nexttoken"):
                        p["lists"] = cache.prefetch_lists()
                        p["prefetches"] = cache.prefetch_counts()
                res.append(p)
            if args.profile:  # a diagnosis after the timed passes (its steps change no checked number)
                res[-1]["profile"] = kernel_profile(dec.step, layers=L)
            del dec
        finally:
            model.pools, model.experts_fn = saved
        return res

    # profile counts: the profile fixtures' routing on the unmodified path
    prof_routing = decode(ref_fn, model.pools, 8, bn.bench_prompts(profile_stream, 8, PROMPT_TOKENS), 1,
                          record=True)[0]["routing"]
    counts = np.zeros((L, E), dtype=np.float64)
    for layer in range(L):
        np.add.at(counts[layer], prof_routing[:, layer].reshape(-1), 1)
    passes = 1 + args.repeats
    residencies = [float(r) for r in args.residencies.split(",")]
    policies = args.policies.split(",")
    forecaster = _fit_nexttoken(prof_routing, k, E, args.nexttoken_extra, R) if "nexttoken" in policies else None
    fitted = _fit_lookahead(model, ref_fn, profile_stream, args, R) if args.lookahead_fit else {}

    replay_arrays = {"profile_counts": counts, "expert_bytes": np.array(per_expert)}  # --save-replays
    for bsz in (int(b) for b in args.batches.split(",")):
        prompts = bn.bench_prompts(heldout_stream, bsz, PROMPT_TOKENS)
        base = decode(ref_fn, model.pools, bsz, prompts, passes, record=True)
        ref_logits, routing = base[0]["logits"], base[0]["routing"]
        tokens = bsz * steps
        inst = (routing + (np.arange(L) * E)[None, :, None, None]).reshape(-1)  # the engine's group order
        acc = AccessStream(inst, np.arange(0, inst.size + 1, bsz * k), tokens, L, E)
        replays: dict = {}  # cache rows of this batch with their replays (the management columns)

        def row(name, res, residency, extra):
            timed = [p["ms"] for p in res[1:]]  # the timed passes (the first one is checked, not timed)
            mean, p50, p90 = bn.pass_timing(timed)
            r = {"batch": bsz, "placement": name, "residency": residency, "step_ms_mean": mean,
                 "step_ms_mean_spread": spread([statistics.fmean(ms) for ms in timed]), "step_ms_p50": p50,
                 "step_ms_p90": p90, "tok_s": 1e3 / mean, "step_ms_by_length": bn.step_ms_by_length(timed), **extra}
            for i, p in enumerate(res):
                same = bool(torch.equal(p["logits"], ref_logits))
                R["checks"][f"{name}/b{bsz} pass {i} logits bitwise"] = same
                if not same:
                    fails.append(f"{name}/b{bsz} pass {i}: logits differ from all-HBM's")
            if "profile" in res[-1]:
                r["profile"] = res[-1]["profile"]
                log(name, {k_: v for k_, v in r["profile"].items() if k_ != "top"},
                    [(t["name"][:40], t["per_step"], t["us_per_step"]) for t in r["profile"]["top"][:10]])
            R["rows"].append(r)
            log({k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in r.items()
                 if k_ not in ("step_ms_mean_spread", "profile")})
            return r

        row("all-HBM", base, 1.0, {"hit_rate": 1.0, "misses_per_token": 0.0, "link_gb_per_token": 0.0})
        if args.save_replays:
            replay_arrays.update(_replay_arrays(bsz, routing, base[0]["hidden"], _routers(model), k))
        if args.analysis:
            R.setdefault("forecast", {})[bsz] = _forecast(prof_routing, routing, residencies, counts, L, E, k, bsz,
                                                          tokens, per_expert, dev)
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
            variants = [(p, 0, "") for p in policies if p != "lookahead"]
            if "lookahead" in policies:
                depths = [1] if res_ == 1.0 else [int(d) for d in args.depths.split(",")]
                variants += [("lookahead", d, v) for d in depths
                             for v in ("", *(["in-order"] if args.in_order else []),
                                       *([_other_fork(d)] if args.other_fork else []),
                                       *(["fit"] if args.lookahead_fit else []))]
            for pol, depth, variant in variants:
                name = f"{pol}-{res_}" + (f" d{depth}" if depth else "") + (f" {variant}" if variant else "")
                nt = pol == "nexttoken"
                forecast = (fitted[depth] if variant == "fit" else _routers(model)) if depth else None
                cache = SlotCache.build(model.pools, host, row_map, warm_counts, pol, bsz, k,
                                        history=steps * L + 8, routers=forecast,
                                        depth=max(depth, 1), forecaster=forecaster if nt else None,
                                        prefetch_budget=args.prefetch_budget if nt else None)
                cache.prefetch_blocks = args.prefetch_blocks
                if variant == "in-order":
                    cache.side_stream = None  # the prefetch fill in stream order after the decisions, never forked
                if variant in ("list-after-fill", "list-after-experts"):
                    cache.list_after_experts = variant == "list-after-experts"
                got = decode(cache.wrap(rowmap_fn), cache.pools, bsz, prompts, passes, cache=cache)
                if nt:
                    # the forecast checked too: the cache's last recorded lists against nexttoken_lists on the
                    # same tokens (bench.simulate_engine_pass), every pass's lists against those below
                    try:
                        sim = bn.simulate_engine_pass(cache, np.ascontiguousarray(routing.transpose(2, 0, 1, 3)),
                                                      forecaster=forecaster)
                    except bn.CacheSimulatorMismatch as exc:
                        fails.append(f"{name}/b{bsz}: {exc}")
                        R["checks"][f"{name}/b{bsz} lists == nexttoken_lists"] = False
                        del cache, got
                        torch.cuda.empty_cache()
                        continue
                    R["checks"][f"{name}/b{bsz} lists == nexttoken_lists"] = True
                else:
                    sim = simulate(acc, pol, C, counts, predictions=got[0].get("lists"))
                sim_hist = np.stack([sim.hits, sim.misses, sim.fills], axis=1)
                for i, p in enumerate(got):
                    ok = bool(np.array_equal(p["history"], sim_hist))
                    if depth or nt:
                        ok = ok and bool(np.array_equal(p["lists"], got[-1 if nt else 0]["lists"])) \
                            and bool(np.array_equal(p["prefetches"], sim.prefetches))
                    if nt:
                        ok = ok and p["counters"]["stale"] == 0  # no commit refused: every copy had landed
                    R["checks"][f"{name}/b{bsz} pass {i} == simulator"] = ok
                    if not ok:
                        fails.append(f"{name}/b{bsz} pass {i}: per-group decisions differ from the simulator's"
                                     + (f" (stale commits {p['counters']['stale']})" if nt else ""))
                try:
                    cache.check(contents=True)
                    R["checks"][f"{name}/b{bsz} state consistent"] = True
                except ValueError as exc:
                    fails.append(f"{name}/b{bsz}: {exc}")
                c = got[1]["counters"]
                st = sim.stats()
                r = row(name, got, res_, {
                    "hit_rate": c["hits"] / (c["hits"] + c["misses"]), "sim_hit_rate": st.hit_rate,
                    "misses_per_token": c["misses"] / tokens, "fills_per_token": c["fills"] / tokens,
                    "prefetches_per_token": st.prefetches / tokens,
                    "useful_prefetches_per_token": st.useful_prefetches / tokens,
                    "wasted_prefetches_per_token": st.wasted_prefetches / tokens,
                    "link_gb_per_token": st.link_gb_per_token(per_expert),
                    **({"list_recall": list_recall(got[0]["lists"], routing, depth, E)} if depth else {})})
                allhbm_ms = next(x["step_ms_mean"] for x in R["rows"] if x["batch"] == bsz and x["placement"] == "all-HBM")
                r.update(_time_columns(r, allhbm_ms, ceilings["link_read_gb_s"], bsz, acc, sim, per_expert))
                replays[name] = (r, sim)
                log(f"{name}/b{bsz}", {k_: round(r[k_], 4) for k_ in ("overlap", "fraction_of_bound", "sim_over_measured")
                                        if r[k_] is not None})
                if args.analysis and pol == "lru" and res_ < 1.0:
                    R.setdefault("lookahead_recall", {})[f"{name}/b{bsz}"] = _lookahead_recall(
                        model, base[0]["hidden"], routing, sim, acc, C, counts, k, tokens, per_expert)
                if args.analysis and res_ == residencies[0] and pol == variants[0][0]:
                    R.setdefault("overhead", {})[bsz] = _overhead(decode, cache, ref_fn, rowmap_fn, model, bsz, prompts,
                                                                  L, k, per_expert, res_ == 1.0)
                del cache, got
                torch.cuda.empty_cache()
            write_result(out_path, R, ceilings)
        if replays:
            _manage_columns(replays, allhbm_ms, ceilings["link_read_gb_s"], bsz, acc, per_expert)
        write_result(out_path, R, ceilings)
    write_result(out_path, R, ceilings)
    if args.save_replays:
        np.savez_compressed(Path(args.out) / "cache_replays.npz", **replay_arrays)
        log("replays written", Path(args.out) / "cache_replays.npz")
    return R


def _replay_arrays(bsz: int, routing, hidden, routers, k: int) -> dict:
    """``--save-replays``' arrays of one batch size: the all-HBM routing ``[steps, L, B, k]`` (the
    engine's group order) and, per depth d of :data:`REPLAY_DEPTHS` below the layer count, the
    ``lookahead`` policy's lists of :func:`coldset.analysis.forecast.lookahead_predictions` (layer l + d's
    router on layer l's router inputs ``hidden [steps, L, B, H]``) with ``k`` and ``k + 4``
    candidates a token: what :func:`coldset.analysis.cache.simulate` replays as ``predictions``."""
    import numpy as np

    from coldset.analysis.forecast import lookahead_predictions

    L = len(routers)
    out = {f"b{bsz}_routing": np.asarray(routing, dtype=np.int16)}
    for d in (d for d in REPLAY_DEPTHS if d < L):
        for n in (k, k + 4):
            out[f"b{bsz}_lookahead_d{d}_n{n}"] = lookahead_predictions(hidden, routers, d, n).astype(np.int32)
    return out


def list_recall(lists, routing, depth: int, num_experts: int) -> float:
    """The share of layer ``l + depth``'s selections (of every token of the step) that the lookahead
    list issued after group (step, ``l``) names: ``lists`` int ``[steps * L, W]`` instances (-1
    padded, the engine's :meth:`~coldset.engine.cache.pool.SlotCache.prefetch_lists`), ``routing`` int
    ``[steps, L, B, k]`` expert ids."""
    import numpy as np

    steps, L = routing.shape[:2]
    named = np.asarray(lists).reshape(steps, L, -1)
    hit = total = 0
    for s in range(steps):
        for layer in range(L - depth):
            t = layer + depth
            want = routing[s, t].reshape(-1) + t * num_experts
            hit += int(np.isin(want, named[s, layer]).sum())
            total += want.size
    return hit / total if total else float("nan")


def _fit_lookahead(model, ref_fn, profile_stream: list[int], args, R: dict) -> dict:
    """``--lookahead-fit``: the profile fixtures' router inputs at every MoE layer (the first
    :data:`coldset.analysis.forecast.LOOKAHEAD_FIT_TOKENS` prompt tokens, prefilled :data:`FIT_CHUNK` at a
    time on the unmodified path: :func:`coldset.analysis.forecast.router_inputs`), and per lookahead depth of the run (and 1,
    residency 1.0's) the fitted forecast matrices of :func:`coldset.analysis.forecast.fit_lookahead_routers`,
    in the routers' dtype."""
    import time

    import torch

    from coldset.analysis.forecast import LOOKAHEAD_FIT_SHRINK, fit_lookahead_routers, router_inputs

    L = model.config.num_moe_layers
    chunks = [profile_stream[i:i + FIT_CHUNK] for i in range(0, len(profile_stream), FIT_CHUNK)]
    chunks = [c for c in chunks if len(c) == FIT_CHUNK]
    if not chunks:
        raise MeasureError(f"--lookahead-fit: the profile fixtures hold {len(profile_stream)} prompt tokens, "
                           f"fewer than one chunk of {FIT_CHUNK}")
    t0 = time.perf_counter()
    saved = model.experts_fn
    model.experts_fn = ref_fn
    try:
        hidden = router_inputs(model, chunks)
    finally:
        model.experts_fn = saved
    routers = _routers(model)
    depths = sorted({1, *(int(d) for d in args.depths.split(","))})
    fits = {d: fit_lookahead_routers(hidden, routers, d) for d in depths if d < L}
    R["lookahead_fit"] = {"profile_tokens": int(hidden.shape[0]), "shrink": LOOKAHEAD_FIT_SHRINK,
                          "depths": sorted(fits), "seconds": round(time.perf_counter() - t0, 1)}
    log("lookahead forecast fitted", R["lookahead_fit"])
    del hidden
    torch.cuda.empty_cache()
    return fits


def _other_fork(depth: int) -> str:
    """The ``--other-fork`` row's variant at ``depth``: the fork :meth:`SlotCache.build` does not
    choose there (it forks after the experts at depth >= 2)."""
    return "list-after-fill" if depth >= 2 else "list-after-experts"


def _manage_columns(replays: dict, allhbm_ms: float, link_gb_s: float, bsz: int, acc, per_expert: int) -> None:
    """The management columns, once every residency of the batch is measured: each cache row whose
    policy has a residency-1.0 row in the same run and batch (every selection a hit; lookahead: its
    depth-1 row; its ``--in-order`` and ``--other-fork`` rows: their own) gets
    :func:`_time_columns` again with that row's step, i.e. ``manage_ms_per_group`` and
    ``sim_managed_step_ms`` / ``sim_managed_over_measured``; rows whose policy has none keep None
    there."""
    def kind(name: str) -> str:  # the policy, and lookahead's variants apart
        variant = next((v for v in LOOKAHEAD_VARIANTS if name.endswith(f" {v}")), None)
        return name.split("-")[0] + (f" {variant}" if variant else "")

    full = {kind(name): r for name, (r, _) in replays.items() if r["residency"] == 1.0}
    for name, (r, sim) in replays.items():
        f = full.get(kind(name))
        if f is not None:
            r.update(_time_columns(r, allhbm_ms, link_gb_s, bsz, acc, sim, per_expert, f["step_ms_mean"]))


def _fit_nexttoken(prof_routing, k: int, E: int, extra: int, R: dict):
    """The ``nexttoken`` forecaster fitted on the profile routing [steps, L, B, k], each batch row
    one sequence (:meth:`coldset.analysis.forecast.NextTokenForecaster.fit_tuned`: its history parameters
    chosen on profile sequences only, as the workflow fits it on the profile split); recorded in ``R``."""
    import time

    import numpy as np

    from coldset.analysis.forecast import NextTokenForecaster

    S, L, B, _ = prof_routing.shape
    tokens = prof_routing.transpose(2, 0, 1, 3).reshape(-1, L, k)  # row by row, in decode order
    sequence = np.repeat(np.arange(B), S)
    t0 = time.perf_counter()
    F = NextTokenForecaster.fit_tuned(tokens, sequence, k, E, extra=extra)
    R["forecaster"] = {"terms": [list(t) for t in F.terms], "hist_unit": int(F.hist_unit),
                       "hist_shift": int(F.hist_shift), "n": int(F.num_predictions), "table_mb": F.nbytes / 1e6,
                       "fit_s": time.perf_counter() - t0}
    log("nexttoken forecaster", R["forecaster"])
    return F


#: bench cache's JSON names of :func:`coldset.bench.decode.time_columns`' columns (committed results and
#: :mod:`coldset.measure.render` read these names).
_TIME_JSON_NAMES = {"overlap": "overlap", "bound_ms": "bound_ms", "bound_fraction": "fraction_of_bound",
                    "simulated_step_ms": "sim_step_ms", "simulated_over_measured": "sim_over_measured",
                    "manage_ms_per_group": "manage_ms_per_group", "simulated_managed_step_ms": "sim_managed_step_ms",
                    "simulated_managed_over_measured": "sim_managed_over_measured"}


def _time_columns(r: dict, allhbm_ms: float, link_gb_s: float, bsz: int, acc, sim, per_expert: int,
                  full_step_ms: float | None = None) -> dict:
    """A cache row's time columns under bench cache's JSON names: :func:`coldset.bench.decode.time_columns`
    (the workflow bench's own) of its step against the all-HBM row's, the measured link read rate,
    its one replay ``sim`` of ``acc`` and, with ``full_step_ms`` (its policy's residency-1.0 step),
    the management columns (None without)."""
    from coldset.bench.decode import time_columns

    cols = time_columns(r["step_ms_mean"], bsz, r["link_gb_per_token"], allhbm_ms, link_gb_s,
                           [(acc, sim, per_expert)], full_step_ms)
    return {_TIME_JSON_NAMES[name]: value for name, value in cols.items() if name in _TIME_JSON_NAMES}


def _routers(model):
    return [model.layers[i].mlp.gate.weight.detach() for i in model.config.moe_layers]


def _forecast(prof_routing, routing, residencies, counts, L, E, k, bsz, tokens, per_expert, dev) -> dict:
    """The next-token forecaster fitted on the profile routing: its recall on the timed tokens, the
    ``forecast`` policy simulated on the engine's routing beside ``lru``, its GPU cost a step."""
    import numpy as np
    import pandas as pd
    import torch

    from coldset.analysis.simulate import simulate
    from coldset.analysis.streams import AccessStream
    from coldset.analysis.forecast import TransitionForecaster, forecast_recall, stream_predictions
    from coldset.analysis.placement import hot_count_for_residency
    from coldset.core.timing import graph_time_us

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


def _lookahead_recall(model, hidden, routing, sim, acc, C, counts, k, tokens, per_expert) -> list[dict]:
    """The next-layer lookahead (router of layer l on layer l - d's router input) on the
    selections an lru run missed, and the lookahead policy simulated, at depths 1, 2 and forecasts
    of top k and k + 3."""
    from coldset.analysis.simulate import simulate
    from coldset.analysis.forecast import lookahead_predictions, lookahead_recall

    routers = _routers(model)
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


def _overhead(decode, cache, ref_fn, rowmap_fn, model, bsz, prompts, L, k, per_expert, all_hit: bool) -> dict:
    """The cache-management work: every layer's decisions on a step whose selections all hit,
    alone in a graph; inside the real step (3 interleaved repeats of the all-HBM step, the row-map
    step over the same all-hot pools and, at residency 1.0, the cache's step: medians); the fill
    kernel's read rate from pinned memory against the copy engine's on one layer's k rows."""
    import torch

    from coldset.kernels.triton_slots import fill
    from coldset.core.timing import graph_time_us

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
    if p.is_fp8:  # an FP8 expert moves with its scales (its bytes, per_expert, count them)
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


def decisions_split(args, argv=None) -> dict:
    """Where lookahead's extra work a layer goes, at the config's shape (L, E, top k, hidden), with
    stand-in experts of a few bytes (the decisions do not depend on the experts' size) at residency
    1.0 (every selection and every forecast a hit: the work alone, no copy), each part captured in a
    CUDA graph over every MoE layer (:func:`coldset.kernels.tune.graph_time_us`): lru's decisions + fill,
    lookahead's whole group (GEMV, decisions, demand fill, fork, prefetch fill, join), the forecast's
    GEMV alone, and lookahead's decisions launch alone; then as the fused decode step runs them
    (:meth:`coldset.engine.cache.pool.SlotCache.route`): the router's launch alone (no cache), lru's group in it
    (the router recording + the fill choosing and copying) and lookahead's (the router with the
    forecast and the whole decision + the demand fill + fork, prefetch fill, join); a cached group's
    cost is its row minus the router's."""
    import numpy as np
    import torch

    from coldset.workflow.config import load_config
    from coldset.kernels import triton_decode as td
    from coldset.kernels.triton_slots import decide_ahead
    from coldset.analysis.placement import hot_mask_usage_global, row_map_from_mask
    from coldset.engine.cache.pool import SlotCache
    from coldset.kernels.tiers import ExpertPools, host_tier
    from coldset.core.timing import graph_time_us

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
        logits = la._forecast_logits(x, 1)
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
                la._forecast_logits(x, layer + 1)

        def run_decide():
            for layer in range(L):
                decide_ahead(la, layer, flat[layer], layer == 0, logits if layer < L - 1 else None, min(layer + 1, L - 1))

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
