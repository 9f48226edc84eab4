"""The bench stage: every gated placement timed on distinct requests (coldset.bench.decode)."""

from __future__ import annotations

import logging

from coldset.bench import decode as bn
from coldset.bench.provenance import collect_provenance
from coldset.core.files import write_json
from coldset.core.placement import load_placement
from coldset.engine.generate import encode_prompts
from coldset.workflow.config import bench_request_count
from coldset.workflow.context import StageContext, StageError
from coldset.workflow.process_engine import (gate_lead_unit, host_tier, load_engine, lookahead_fit, slot_cache,
                                             split_fixtures, tuned)
from coldset.workflow.stages.verify import check_gate_passed

log = logging.getLogger("coldset")


def _bench_requests(ctx: StageContext, tokenizer, split: str) -> dict[int, list]:
    """Per bench batch size, the distinct requests of ``split`` it times
    (:func:`coldset.bench.decode.select_bench_requests`, :func:`coldset.workflow.config.bench_request_count`:
    ``bench.requests_per_domain`` of every domain, round-robin across domains, at least one full batch)."""
    bc = ctx.bench
    fxs = split_fixtures(ctx, split)
    ids = encode_prompts(tokenizer, [f.prompt for f in fxs])
    candidates = [(f.id, f.domain, t) for f, t in zip(fxs, ids)]
    domains = len({f.domain for f in fxs})
    out = {}
    for b in bc["batch_sizes"]:
        try:
            out[b] = bn.select_bench_requests(candidates, bench_request_count(domains, bc["requests_per_domain"], b),
                                              bc["prompt_tokens"])
        except ValueError as exc:
            raise StageError(f"bench batch size {b} on the {split} split: {exc} (bench.prompt_tokens, "
                             "fixtures.per_domain, fixtures.heldout_fraction)") from None
    return out


def _prompt_overlap(ctx: StageContext, tokenizer, requests: list, n: int = 8) -> dict:
    """How much of the bench prompts the profile prompts contain (:func:`coldset.bench.decode.ngram_overlap`),
    overall and per domain: a bench on text the placement was fitted on flatters it."""
    profile = encode_prompts(tokenizer, [f.prompt for f in split_fixtures(ctx, "profile")])
    unique = list({r.id: r for r in requests}.values())
    per_domain: dict[str, list] = {}
    for r in unique:
        per_domain.setdefault(r.domain, []).append(list(r.tokens))
    return {"ngram": n, "against": "profile", "requests": [r.id for r in unique],
            "share": bn.ngram_overlap([list(r.tokens) for r in unique], profile, n),
            "domains": {d: bn.ngram_overlap(t, profile, n) for d, t in per_domain.items()}}


def _time_placement(ctx: StageContext, engine, host, pl, name: str, requests: dict, splits: list[str],
                    launch, fit) -> dict[str, list[dict]]:
    """One placement's pooled results per split and batch size (its pools or caches freed after)."""
    bc = ctx.bench
    records: dict[str, list[dict]] = {}
    pools = engine.pools.placed(pl.row_map, host) if not pl.dynamic else None
    for split in splits:
        for batch_size in bc["batch_sizes"]:
            batches = bn.request_batches(requests[split][batch_size], batch_size)
            lead_unit = gate_lead_unit(ctx, pl.policy, batch_size)  # once a batch size: every batch's cache has it
            results = []
            for batch in batches:  # distinct requests, batch_size at a time
                cache = None
                if pl.dynamic:  # a fresh warm cache per batch; the previous one's slots freed first
                    pools = None
                    cache = slot_cache(engine, host, pl, batch_size, fit=fit, lead_unit=lead_unit)
                    pools = cache.pools
                replay = None
                if bc["routing_trace"]:
                    replay = bn.RoutingReplay.from_trace(
                        bc["routing_trace"], engine.config, batch_size, bc["new_tokens"] - 1, engine.device,
                        split=None if split == "all" else split, heldout_fraction=ctx.stats["heldout_fraction"])
                try:
                    results.append(bn.bench_decode(
                        engine, pools, pl, bn.batch_stream(batch), batch_size, bc["prompt_tokens"],
                        bc["new_tokens"], bc["warmup"], bc["repeats"], replay=replay, tuned=launch,
                        prompt_split=split, cache=cache))
                except bn.TimedLoopMismatch as exc:
                    raise StageError(str(exc)) from None
                del cache
            r = bn.pool_results(results, batches)
            log.info("bench %s (%s prompts) batch %d over %d requests: %.1f tok/s, mean step %.3f ms (p50 %.3f), "
                     "cold share %.3f; per domain %s", name, split, batch_size, len(r["requests"]), r["tok_s"],
                     r["step_ms_mean"], r["step_ms_p50"], r["cold_share"], r["domains"])
            records.setdefault(split, []).append(r)
    del pools
    return records


def bench(ctx: StageContext, placements: list[str] | None = None, **_) -> None:
    """Bench every placement on prompts of ``bench.prompt_split`` (held-out traffic by default: the
    placement was fitted on the profile split), and with ``bench.profile_beside`` also on the
    profile split, written beside as ``profile_batches`` (labelled, never the published numbers).
    Each bench JSON records its provenance (:func:`coldset.bench.provenance.collect_provenance`)."""
    ctx.require_decoding("bench")
    bc = ctx.bench
    names = ctx.placement_names(placements)
    check_gate_passed(ctx, names)  # before the engine loads
    engine, tokenizer = load_engine(ctx)
    launch = tuned(ctx)
    splits = [bc["prompt_split"]] + (["profile"] if bc["profile_beside"] and bc["prompt_split"] != "profile" else [])
    requests = {split: _bench_requests(ctx, tokenizer, split) for split in splits}
    overlap = _prompt_overlap(ctx, tokenizer, [r for rs in requests[splits[0]].values() for r in rs])
    log.info("bench prompts (%s split): %s; %.0f%% of their %d-token sequences occur in the profile prompts "
             "(per domain: %s)", splits[0], overlap["requests"], 100 * (overlap["share"] or 0), overlap["ngram"],
             {d: None if v is None else round(v, 3) for d, v in overlap["domains"].items()})
    records: dict[str, list[dict]] = {}
    host = host_tier(ctx)
    ceilings = None
    if engine.device.type == "cuda":  # the read rates this run's ratios are taken against
        ceilings = bn.measure_ceilings(host.w13 if host.pinned else None)
        log.info("ceilings (GB/s): %s", ceilings)
    fit = lookahead_fit(ctx, engine, tokenizer)
    for name in names:
        pl = load_placement(ctx.layout.placement_dir / f"{name}.json")
        for split, rs in _time_placement(ctx, engine, host, pl, name, requests, splits, launch, fit).items():
            records.setdefault(split, []).extend(rs)
    provenance = collect_provenance(engine.device, launch, ceilings)
    derived = {split: bn.derive_metrics(rs, ceilings) for split, rs in records.items()}
    main = splits[0]
    for name in names:
        doc = {"placement": name, "prompt_split": main, "ceilings": ceilings, "provenance": provenance,
               "prompt_overlap": overlap, "batches": [r for r in derived[main] if r["placement"] == name]}
        if "profile" in derived and main != "profile":
            doc["profile_batches"] = [r for r in derived["profile"] if r["placement"] == name]
        write_json(ctx.layout.bench(*name.rsplit("-", 1)), doc)
