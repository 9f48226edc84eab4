"""The parity stage and its gate: every placement decodes the parity fixtures to the unmodified
path's tokens, and the gate passes only reports about the files on disk now (coldset.verify.fingerprint).
"""

from __future__ import annotations

import logging
from pathlib import Path

from coldset.core.files import read_json, write_json
from coldset.core.placement import load_placement, row_map_path
from coldset.engine.generate import check_prompts_fit, encode_prompts
from coldset.verify import gate
from coldset.verify.fingerprint import StaleReportError, check_fingerprint, current_fingerprint
from coldset.workflow.context import StageContext, StageError
from coldset.workflow.process_engine import (gate_lead_unit, host_tier, load_engine, lookahead_fit, parity_fixtures,
                                             slot_cache, tuned)

log = logging.getLogger("coldset")


def parity(ctx: StageContext, placements: list[str] | None = None, **_) -> None:
    """Decode the parity fixtures on the unmodified path once, then with every placement."""
    ctx.require_decoding("parity")
    pc = ctx.parity
    # Every placement is read, validated and fingerprinted before anything is decoded: a bad or
    # edited row map fails in seconds, naming its file, not after the reference decode.
    names = ctx.placement_names(placements)
    fingerprints = {name: _fingerprint(ctx, name) for name in names}
    loaded = {name: load_placement(ctx.layout.placement_dir / f"{name}.json") for name in names}
    fxs = parity_fixtures(ctx)
    engine, tokenizer = load_engine(ctx)
    prompts = encode_prompts(tokenizer, [f.prompt for f in fxs])
    ids = [f.id for f in fxs]
    check_prompts_fit(engine.config, ids, prompts, pc["max_new_tokens"])
    # Fewer, larger decodes: by default every parity fixture in one batch (both paths batch alike,
    # so the comparison stays like for like); on a busy 2-core CPU that halved the decode time.
    batch = pc["batch_size"] or len(prompts)
    launch = tuned(ctx)
    # The unmodified path is decoded once per batch size in use: a dynamic placement decodes at most
    # as many prompts at once as its slots hold one step's selections for (coldset.engine.cache.pool), and the
    # comparison is like for like only at the same batch size (the kernel's launch depends on it).
    references: dict[int, object] = {}
    host = host_tier(ctx)
    fit = lookahead_fit(ctx, engine, tokenizer)
    top_k = engine.config.top_k
    batch_of = {name: batch if not pl.dynamic else max(1, min(batch, int((pl.row_map >= 0).sum()) // top_k))
                for name, pl in loaded.items()}
    # a torch.compile'd decode region runs the same graphs in every later decode only once each batch size
    # has been decoded (coldset.verify.gate.warm_compiled_decode)
    gate.warm_compiled_decode(engine, prompts, pc["max_new_tokens"], set(batch_of.values()), tuned=launch)
    for name in names:
        pl = loaded[name]
        b = batch_of[name]
        if b not in references:
            references[b] = gate.reference_decode(engine, prompts, pc["max_new_tokens"], b, tuned=launch)
        reference = references[b]
        depths = _parity_depths(pl)
        lead_unit = gate_lead_unit(ctx, pl.policy, b)
        results = []
        for depth in depths:
            cache = slot_cache(engine, host, pl, b, depth=depth, fit=fit, lead_unit=lead_unit)
            pools = engine.pools.placed(pl.row_map, host) if cache is None else cache.pools
            got = gate.placement_decode(engine, pools, prompts, pc["max_new_tokens"], b, tuned=launch, cache=cache)
            if cache is not None:
                cache.check()  # the row map and the slot owners still agree after every decision
            results.append(gate.compare(name, ids, reference, got, pools, engine, backend=launch.backend))
            log.info("parity %s (batch %d%s): %d/%d tokens match, max |dlogit| %.3g", name, b,
                     "" if depth is None else f", lookahead depth {depth}", results[-1].tokens_matched,
                     results[-1].tokens_total, results[-1].max_abs_logit_diff)
            # Freed before the next cache's pools are built: a slot cache kept alive by the loop
            # variable doubled the HBM of two placements (out of memory at real shape, lru 0.5 -> 0.75).
            del pools, cache, got
        # the verdict: the first depth that failed, else the last (all passed); the depths decoded beside it
        result = next((r for r in results if not r.passed), results[-1])
        doc = {**result.to_dict(), "fingerprint": fingerprints[name]}
        if depths != [None]:
            doc["lookahead_depths"] = depths
            if not result.passed:
                doc["lookahead_depth_failed"] = depths[results.index(result)]
        write_json(ctx.layout.parity(*name.rsplit("-", 1)), doc)


def _fingerprint_files(ctx: StageContext, name: str) -> dict[str, Path]:
    """The file each fingerprint field digests (coldset.verify.fingerprint), for placement ``name``."""
    placement = ctx.layout.placement_dir / f"{name}.json"
    return {"row_map_sha256": row_map_path(placement), "placement": placement,
            "model": ctx.manifest_path, "kernel": ctx.layout.autotune}


def _fingerprint(ctx: StageContext, name: str) -> dict[str, str]:
    """What placement ``name``'s parity verdict depends on, as on disk now (coldset.verify.fingerprint)."""
    files = _fingerprint_files(ctx, name)
    try:
        return current_fingerprint(files["row_map_sha256"], files["placement"], files["model"], files["kernel"])
    except (StaleReportError, FileNotFoundError, ValueError) as exc:
        raise StageError(f"placement {name}: {exc}") from None


def check_report(ctx: StageContext, name: str, report: dict, where: Path | str) -> dict[str, str]:
    """Refuse a parity report whose fingerprint is not that of the files on disk; returns it."""
    current = _fingerprint(ctx, name)
    try:
        check_fingerprint(report.get("fingerprint"), current, str(where), _fingerprint_files(ctx, name))
    except StaleReportError as exc:
        raise StageError(str(exc)) from None
    return current


def _parity_depths(placement) -> list[int | None]:
    """The lookahead depths the parity stage decodes a placement with: every depth of a per-batch
    mapping (the bench runs each at its batch size, the gate must have checked each), else the one
    the cache picks (None)."""
    depth = placement.cache_lookahead_depth
    return sorted(set(depth.values())) if isinstance(depth, dict) else [None]


def parity_gate(ctx: StageContext, placements: list[str] | None = None, **_) -> None:
    names = ctx.placement_names(placements)
    paths = [ctx.layout.parity(*n.rsplit("-", 1)) for n in names]
    results = [read_json(p, "parity report") for p in paths]
    # A verdict about other files than those on disk now is refused before it is counted.
    fingerprints = {n: check_report(ctx, n, r, p) for n, r, p in zip(names, results, paths)}
    summary = gate.gate_verdict(results)  # raises, naming the failed placements
    write_json(ctx.layout.parity_gate, {**summary, "fingerprints": fingerprints})
    log.info("parity gate passed: %d placements token-exact", len(results))


def check_gate_passed(ctx: StageContext, names: list[str]) -> None:
    """The bench runs only placements the gate passed in their current form (coldset.verify.fingerprint)."""
    path = ctx.layout.parity_gate
    try:
        verdict = read_json(path, "parity gate summary")
    except FileNotFoundError as exc:
        raise StageError(f"{exc}: run the parity gate first (the bench runs only gated placements)") from None
    for name in names:
        entry = (verdict.get("placements") or {}).get(name)
        if not verdict.get("passed") or not entry or not entry.get("passed"):
            raise StageError(f"placement {name}: the parity gate {path} did not pass it; "
                             "run the parity stage and the gate")
        check_report(ctx, name, {"fingerprint": (verdict.get("fingerprints") or {}).get(name)},
                     f"{path} (placement {name})")
