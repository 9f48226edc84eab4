"""The HTML report: one self-contained page (figures inline) over everything the workflow wrote.

``render_report`` reads the result files of the stats, placement, parity, bench and autotune
stages (docs/design.md §1; paths below), re-plots every figure with matplotlib (Agg, no display) so
that each one states the device, batch size and dtype it describes, embeds them as base64 data
URIs (the page needs no network and no side files) and writes ``results/report/index.html``
atomically. The figures are drawn by :mod:`coldset.reporting.figures`.

Inputs, relative to ``results_dir``, for ``model = config["model"]["name"]``:

- ``stats/{model}/skew.json`` and ``stats/{model}/histogram.csv`` (required);
- ``placement/{model}/{policy}-{residency}.json`` for every configured policy and residency
  (required);
- ``parity/{model}/{policy}-{residency}.json`` (required: the report depends on a passed gate);
- ``bench/{model}/{policy}-{residency}.json`` (required);
- ``autotune/*.json`` (optional: a CPU run has no Triton kernel to tune; the section then says so).

A missing required file is an error naming it; a section whose stage legitimately did not run
says so in the page, never renders empty. Every file is read by :mod:`coldset.reporting.results`, the loaders
the report shares with ``coldset.reporting.track`` and ``coldset.workflow.sweep``.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import jinja2

from coldset.bench.metrics import TIME_BOUND_METRICS
from coldset.bench.provenance import TAG_FIELDS
from coldset.core.files import write_bytes
from coldset.core.layout import Layout
from coldset.core.shapes import MoEShape
from coldset.core.shapes import describe as describe_shape
from coldset.core.timing import NOISY_P90_OVER_P50, noisy_reason, speed_compares_placements, timing_noisy
from coldset.reporting.answer import (budget_answers, cache_note, human, pct_text, row_cold_path, size_text,
                                      tok_s_text)
from coldset.reporting.cold_path import ColdPathPick, cold_path_pick
from coldset.reporting.cold_experts import ColdExperts, id_ranges, read_cold_experts
from coldset.reporting.figures import (
    FigureOut,
    coverage_figure,
    join_values,
    locality_figure,
    residency_figure,
    routing_figures,
    step_time_figure,
    timing_is_noisy,
)
from coldset.reporting.results import (
    BENCH_METRICS,
    CEILING_FIELDS,
    BenchResult,
    ReportInputError,
    load_bench,
    load_locality,
    load_parity,
    load_placement_summary,
    load_simulation,
    load_skew,
    opt_float,
    read_json,
    require_fields,
)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def collect_machine_info(device: str = "auto") -> dict[str, str]:
    """What the report shows about the machine it was rendered on: device, torch version,
    CPU and GPU names, OS and Python. Torch is imported here (it is a core dependency)."""
    import torch  # torch-heavy: only where the page is rendered

    cuda = torch.cuda.is_available()
    resolved = ("cuda" if cuda else "cpu") if device == "auto" else device
    info = {
        "device": resolved,
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "cpu_count": str(os.cpu_count()),
        "gpu": torch.cuda.get_device_name(0) if cuda else "none",
        "cuda": str(torch.version.cuda) if cuda else "none",
        "python": platform.python_version(),
        "os": platform.platform(),
    }
    try:
        import triton  # optional dependency (GPU)

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not installed"
    return info


def _ceilings_rows(bench: list[BenchResult]) -> list[dict[str, str]]:
    """One row per distinct pair of measured read ceilings: ``{hbm, link, placements}``. A run
    measures them once, so normally there is one row; several mean the bench files come from
    different runs (the page then says which placement used which)."""
    seen: dict[tuple, set[str]] = {}
    for b in bench:
        if b.ceilings is not None:
            key = tuple(b.ceilings.get(name) for name in CEILING_FIELDS)
            seen.setdefault(key, set()).add(f"{b.policy}-{b.residency}")
    return [
        {"hbm": human(hbm), "link": human(link), "placements": ", ".join(sorted(names))}
        for (hbm, link), names in sorted(seen.items(), key=lambda kv: sorted(kv[1]))
    ]


def _expected_paths(results_dir: Path, stage: str, model: str, config: dict) -> list[Path] | None:
    """Every configured placement's file of ``stage`` (placement, parity or bench), named by
    ``coldset.core.layout.Layout`` (the one place that names stage files), or None when the config
    names no policies (then the stage's files are discovered by glob)."""
    placement_cfg = (config or {}).get("placement") or {}
    policies, residencies = placement_cfg.get("policies"), placement_cfg.get("residency")
    if not policies or not residencies:
        return None
    layout = Layout(results=results_dir, model=model)
    name = getattr(layout, stage)
    return [name(p, r) for p in policies for r in residencies]


def _stage_files(results_dir: Path, stage: str, model: str, config: dict) -> list[Path]:
    expected = _expected_paths(results_dir, stage, model, config)
    if expected is None:
        found = sorted(p for p in (results_dir / stage / model).glob("*-*.json"))
        if not found:
            raise ReportInputError(f"missing required input: no {stage} results under {results_dir / stage / model}")
        return found
    for p in expected:
        if not p.is_file():
            raise ReportInputError(f"missing required input: {p}")
    return expected


def _autotune_rows(results_dir: Path) -> list[dict[str, str]]:
    """The autotune entries under ``results/autotune/`` (``coldset.kernels.tune`` cache entries copied by
    the rule: key, backend, device fingerprint, configs per batch size, and ``hit`` when the
    writer records it)."""
    rows = []
    for path in sorted((results_dir / "autotune").glob("*.json")):
        doc = read_json(path)
        if not isinstance(doc, dict):
            raise ReportInputError(f"{path}: expected a JSON object")
        require_fields(doc, ("key",), str(path))
        best = next((doc[k] for k in ("configs", "best", "best_configs") if k in doc), None)
        if best is None:
            raise ReportInputError(f"{path}: missing field configs (best configuration per batch size)")
        device = doc.get("device", "unknown")
        if isinstance(device, dict):
            device = " · ".join(
                str(device[k]) for k in ("name", "capability", "driver", "torch", "triton") if device.get(k)
            )
        hit = doc.get("hit")
        rows.append(
            {
                "key": str(doc["key"]),
                "hit": "not recorded" if hit is None else ("hit" if hit else "miss"),
                "backend": str(doc.get("backend", "—")),
                "device": str(device),
                "best": "; ".join(
                    f"batch {bs}: " + json.dumps(cfg, sort_keys=True, separators=(", ", ": "))
                    for bs, cfg in sorted(best.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0)
                )
                if isinstance(best, dict)
                else json.dumps(best),
                "file": path.name,
            }
        )
    return rows


def _locality_inputs(results_dir: Path, model: str):
    """(locality.json document or None, simulation.csv frame or None): optional stage outputs."""
    loc_path = results_dir / "stats" / model / "locality.json"
    sim_path = results_dir / "cache" / model / "simulation.csv"
    locality = load_locality(loc_path) if loc_path.is_file() else None
    table = load_simulation(sim_path) if sim_path.is_file() else None
    return locality, table


def _routing_provenance(bench: list, locality: dict | None, skew) -> str:
    """Which routing the bench numbers were measured on: the model's router (with the trace's
    lift when the locality statistic exists) or a replayed trace."""
    sources = sorted({str(b.extra.get("routing_source", "router")) for b in bench})
    lift = None if locality is None else locality.get("lift")
    lift_txt = f"lift {lift:.2f}x (consecutive-token expert overlap / shuffled)" if lift else "lift not measured"
    model_src = str(skew.trace.get("source") or "")
    parts = []
    if "router" in sources or not bench:
        parts.append(f"the model's own router ({model_src or 'source unknown'}; its captured trace: {lift_txt})")
    if "trace" in sources:
        parts.append("routing replayed from a recorded trace (bench.routing_trace)")
    return "; ".join(parts)


def _provenance_line(bench: list[BenchResult]) -> str:
    """The header's "what measured this" line from the bench files' provenance (written on the
    measuring machine), each distinct value once; never this machine's state."""
    provs = [b.provenance for b in bench if b.provenance]
    if not provs:
        return "not recorded (bench files without provenance)"
    parts = []
    for name in TAG_FIELDS:
        values = list(dict.fromkeys(str(p.get(name)) for p in provs if p.get(name) is not None))
        if values:
            parts.append(f"{name} {' / '.join(values)}")
    if len(provs) < len(bench):
        parts.append(f"{len(bench) - len(provs)} bench entries without provenance")
    return " · ".join(parts)


def _split_rows(bench: list[BenchResult], profile: list[BenchResult]) -> list[dict[str, str]]:
    """Held-out (published) next to profile-split (in-sample) numbers, per placement and batch
    size, where the bench measured both (``bench.profile_beside``)."""
    by_key = {(b.policy, b.residency, b.batch_size): b for b in profile}
    rows = []
    for b in sorted(bench, key=lambda b: (b.batch_size, b.policy, float(b.residency))):
        p = by_key.get((b.policy, b.residency, b.batch_size))
        if p is None:
            continue
        row = {"policy": b.policy, "residency": b.residency, "batch_size": b.batch_size,
               "split": str(b.extra.get("prompt_split") or "—")}
        for m in ("tok_s", "cold_share", "link_gb_per_token"):
            row[m] = human(b.metrics[m])
            row[f"profile_{m}"] = human(p.metrics[m])
        rows.append(row)
    return rows


def _manifest_shape(results_dir: Path, model: str) -> "MoEShape | None":
    """A shape-only model's ``MoEShape`` as the model stage recorded it, or None for a model the
    engine decodes (its manifest holds no ``shape``)."""
    path = results_dir / "model" / model / "manifest.json"
    if not path.is_file():
        return None
    doc = read_json(path)
    if not isinstance(doc, dict) or not doc.get("shape"):
        return None
    return MoEShape.from_dict(doc["shape"], f"{path} shape")


def _report_model(results_dir: Path, model_cfg: dict) -> str:
    """The model the page is about: ``model.name``, or the one model the stats folder holds."""
    model = model_cfg.get("name")
    if not model:
        models = sorted(p.name for p in (results_dir / "stats").glob("*") if p.is_dir())
        if len(models) != 1:
            raise ReportInputError(
                f"config names no model.name and {results_dir / 'stats'} holds {len(models)} models ({models})"
            )
        model = models[0]
    return model


def _check_batches(bench: list[BenchResult], configured_batches) -> None:
    """Every placement's bench file measured every configured batch size."""
    if configured_batches:
        for pl in {(b.path, b.policy, b.residency) for b in bench}:
            have = {b.batch_size for b in bench if b.path == pl[0]}
            missing = sorted(set(int(x) for x in configured_batches) - have)
            if missing:
                raise ReportInputError(f"{pl[0]}: no measurement for configured batch size(s) {missing}")


def _cache_rows(cache_table) -> list[dict]:
    """The cache simulation's table (``cache/{model}/simulation.csv``), formatted."""
    return [] if cache_table is None else [
        {"policy": r.policy, "residency": human(r.residency), "capacity": int(r.capacity),
         "hit_rate": human(r.hit_rate),
         "misses_per_token": human(r.misses_per_token), "link_gb_per_token": human(r.link_gb_per_token),
         # the batch replayed and the simulated time (coldset.analysis.time_model), when present
         **{c: human(getattr(r, c, None)) for c in ("batch", "step_ms", "bound_ms", "bound_fraction", "overlap",
                                                   "stall_ms_per_token", "wasted_gb_per_token")},
         "cold_path": row_cold_path(r.policy, getattr(r, "host_tier", None))}
        for r in cache_table.itertuples()]


def _bench_table(bench: list[BenchResult]) -> tuple[list[dict], list[str]]:
    """The bench table's rows (one per placement and batch size) and its columns."""
    bench_rows = []
    for b in sorted(bench, key=lambda b: (b.batch_size, b.policy, float(b.residency))):
        p50, p90, spread = b.metrics["step_ms_p50"], b.metrics["step_ms_p90"], b.metrics.get("repeat_spread")
        bench_rows.append(
            {
                "timing": noisy_reason(p50, p90, spread) if timing_noisy(p50, p90, spread) else "ok",
                "policy": b.policy,
                "residency": b.residency,
                "batch_size": b.batch_size,
                **{m: human(b.metrics[m]) for m in BENCH_METRICS},
                # ratios of speeds only where speed compares placements and the timing is not noise
                # (coldset.core.timing; the bench leaves them None there too)
                **({} if speed_compares_placements(b.device) and not timing_is_noisy(b) else
                   {m: "—" for m in ("tok_s_per_gib", "fetch_tax", *TIME_BOUND_METRICS)}),
                "allhbm_placement": b.extra.get("allhbm_placement") or "—",
                "predicted_step_ms": human(b.predicted_step_ms),
                # share of the timed loop's tokens equal to generate()'s (the bench fails below 1)
                "timed_token_match": human(opt_float(b.extra.get("timed_token_match"), f"{b.path}: timed_token_match")),
                "device": b.device,
                "dtype": b.dtype,
            }
        )
    # Bench table columns: the measured metrics, then the two predictions side by side.
    bench_columns = [m for m in BENCH_METRICS if m != "predicted_step_ms_calibrated"] + [
        "allhbm_placement", "predicted_step_ms", "predicted_step_ms_calibrated", "timed_token_match"]
    return bench_rows, bench_columns


def _placement_rows(placements: list) -> list[dict]:
    """One row per placement: tiers, coverage and the speed model's predictions."""
    return [
        {
            "policy": p.policy,
            "residency": p.residency,
            "num_hot": p.num_hot,
            "num_cold": p.num_cold,
            "hbm_expert_gib": size_text(p.hbm_expert_gib),
            "host_expert_gib": size_text(p.host_expert_gib),
            "coverage_profile": pct_text(p.coverage_profile),
            "coverage_heldout": ("n/a (no held-out split)" if p.coverage_heldout is None
                                 else pct_text(p.coverage_heldout)),
            "predicted": "; ".join(
                f"{q['preset']} b{q['batch_size']}: {human(q['step_ms_lower'])}–{human(q['step_ms_sum'])} ms"
                f" (up to {tok_s_text(q['batch_size'] * 1e3 / q['step_ms_lower'])})"
                for q in p.predictions
            )
            or "—",
        }
        for p in sorted(placements, key=lambda p: (p.policy, float(p.residency)))
    ]


def _parity_rows(parity: list) -> list[dict]:
    """One row per parity report: verdict, tokens matched and the first mismatches."""
    return [
        {
            "placement": f"{p.policy}-{p.residency}",
            "passed": p.passed,
            "tokens": f"{p.tokens_matched} / {p.tokens_total}",
            "max_abs_logit_diff": human(p.max_abs_logit_diff),
            "mismatches": "; ".join(
                f"{m.get('fixture')}@{m.get('position')}: expected {m.get('expected')}, got {m.get('got')}"
                f" (gap {human(m.get('logit_gap'))})"
                for m in p.mismatches[:5]
            )
            + (f"; … {len(p.mismatches) - 5} more" if len(p.mismatches) > 5 else "")
            or "none",
            "device": p.device,
            "dtype": p.dtype,
        }
        for p in sorted(parity, key=lambda p: (p.policy, float(p.residency)))
    ]


def _skew_tables(skew) -> tuple[list[dict], list[dict], list[dict]]:
    """The routing statistics' tables: skew per phase and domain, Spearman rank correlations,
    held-out coverage by profile."""
    top_keys = skew.xs
    skew_table = [
        {
            "phase": r.phase,
            "domain": r.domain,
            "selections": human(r.selections),
            "mean_gini": human(r.mean_gini),
            "top": [human(r.top_share.get(k)) for k in top_keys],
            "top_model_wide": [human(r.top_share_model_wide.get(k)) for k in top_keys],
            "oracle": human(r.oracle_cache_hit_rate),
        }
        for r in skew.rows
    ]
    spearman_rows = [
        {"what": f"{d['phase']}: {d['a']} vs {d['b']}", "mean": human(d["mean"]), "layers": human(d["layers_defined"])}
        for d in skew.spearman_between_domains
    ] + [
        {"what": f"{name}: prefill vs decode", "mean": human(v), "layers": "—"}
        for name, v in sorted(skew.spearman_prefill_vs_decode.items())
    ]
    coverage_tables = []
    for x, by_profile in skew.heldout_coverage.items():
        if not isinstance(by_profile, dict):
            continue
        heldout_names = sorted({b for row in by_profile.values() if isinstance(row, dict) for b in row})
        coverage_tables.append(
            {
                "x": x,
                "columns": heldout_names,
                "rows": [
                    {"profile": a, "values": [human((row or {}).get(b)) for b in heldout_names]}
                    for a, row in by_profile.items()
                ],
            }
        )
    return skew_table, spearman_rows, coverage_tables


# The cold-experts section lists every id inline up to this many (all chosen placements together);
# above it, a per-layer count with the row map's file and the command that prints the ids.
COLD_IDS_INLINE = 1536


def _preset(config: dict) -> str | None:
    """The speed model's preset the run predicts with (``placement.bandwidths``): its name."""
    bw = (config.get("placement") or {}).get("bandwidths")
    return bw if isinstance(bw, str) else (bw or {}).get("name") if isinstance(bw, dict) else None


def _cold_view(answers, placements: list, out_html: Path) -> dict[str, Any]:
    """The cold experts of each budget's chosen placement: per layer the ids (compact ranges)
    when they are few, else per layer their count; each with its row map (a link relative to
    the page) and the command that prints them."""
    by_name = {f"{p.policy}-{p.residency}": p for p in placements}
    chosen: list[ColdExperts] = []
    for a in answers:
        if a.choice is not None and a.choice in by_name:
            chosen.extend(read_cold_experts(by_name[a.choice].path))
    inline = sum(c.num_cold for c in chosen) <= COLD_IDS_INLINE
    layers = chosen[0].layers if chosen else []
    return {
        "placements": [{"name": c.name, "num_cold": c.num_cold, "total": len(c.layers) * c.num_experts,
                        "dynamic": c.dynamic, "file": os.path.relpath(c.source, out_html.parent),
                        "command": f"python -m coldset cold-experts {by_name[c.name].path.as_posix()}"}
                       for c in chosen],
        "inline": inline,
        "rows": [{"layer": layer, "cells": [id_ranges(c.cold[i]) if inline else f"{len(c.cold[i])} of {c.num_experts}"
                                            for c in chosen]}
                 for i, layer in enumerate(layers)] if all(c.layers == layers for c in chosen) else [],
    }


def _answer_rows(answers) -> list[dict[str, Any]]:
    """The answer table's rows: one per budget, its speed lines per batch size."""
    return [{"residency": a.residency, "residency_pct": human(100 * float(a.residency), 3),
             "choice": a.choice or "none",
             "why": a.why, "estimate": a.estimate, "hbm": a.hbm_text, "host": a.host_text,
             "speeds": a.speeds, "notes": a.notes} for a in answers]


def _answer_context(placements: list, bench: list, parity: list, config: dict, out_html: Path,
                    cache_table, pick: ColdPathPick | str | None) -> dict[str, Any]:
    """The template's answer and cold-experts sections (coldset.reporting.answer); ``pick``: the
    speed model's cold path (:func:`coldset.reporting.cold_path.cold_path_pick`)."""
    answers = budget_answers(placements, bench, parity, _preset(config))
    for a in answers:
        note = cache_note(cache_table, a.residency, pick.short() if isinstance(pick, ColdPathPick) else None)
        if note:
            a.notes.append(note)
    return {"answer_rows": _answer_rows(answers),
            "answer_estimate": not any(speed_compares_placements(b.device) for b in bench),
            "preset": _preset(config) or "the speed model's preset",
            "cold": _cold_view(answers, placements, out_html)}


def _cold_path_text(pick: ColdPathPick | str | None) -> str | None:
    """The cache section's sentence on the speed model's cold path, its first letter capital."""
    text = pick.text() if isinstance(pick, ColdPathPick) else pick
    return None if text is None else text[0].upper() + text[1:]


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("coldset.reporting", "templates"),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def _write_page(out_html: Path, html: str, figures: dict[str, list[FigureOut]],
                figures_dir: str | os.PathLike | None) -> None:
    """The page, atomically; each figure also as a PNG in ``figures_dir`` when given."""
    out_html.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(out_html, html.encode("utf-8"))
    if figures_dir is not None:
        figures_dir = Path(figures_dir)
        figures_dir.mkdir(parents=True, exist_ok=True)
        for figs in figures.values():
            for f in figs:
                write_bytes(figures_dir / f"{f.id}.png", f.png)


def render_report(
    results_dir: str | os.PathLike,
    out_html: str | os.PathLike,
    config: dict,
    machine_info: dict[str, Any] | None = None,
    *,
    figures_dir: str | os.PathLike | None = None,
    skipped: dict[str, str] | None = None,
) -> Path:
    """Render ``out_html`` (normally ``results/report/index.html``) from the result tree.

    ``config`` is the validated workflow config (defaults filled): ``model.name``,
    ``model.dtype``, ``placement.policies``/``residency`` (to know which files must exist),
    ``bench.batch_sizes``, ``routing.batch_size``. ``machine_info`` is shown as the machine
    section (``collect_machine_info()`` when None). ``figures_dir``, when given, also receives
    every figure as a PNG (for Snakemake's ``--report``). ``skipped`` maps a stage left out by
    design to the reason (``coldset.workflow.config.skipped_stages``): its files are not read and the
    page says why it is absent. The page is written atomically.
    """
    results_dir = Path(results_dir)
    out_html = Path(out_html)
    config = config or {}
    model_cfg = config.get("model") or {}
    model = _report_model(results_dir, model_cfg)
    if machine_info is None:
        machine_info = collect_machine_info(str(config.get("device", "auto")))
    machine_device = str(machine_info.get("device", "unknown"))

    stats_dir = results_dir / "stats" / model
    skew = load_skew(stats_dir / "skew.json")
    placements = [load_placement_summary(p) for p in _stage_files(results_dir, "placement", model, config)]
    skipped = dict(skipped or {})
    moe_shape = _manifest_shape(results_dir, model)
    shape = None if moe_shape is None else {k: human(v) for k, v in describe_shape(moe_shape).items()}
    parity = [] if "parity" in skipped else [load_parity(p) for p in _stage_files(results_dir, "parity", model, config)]
    bench = [] if "bench" in skipped else [
        b for p in _stage_files(results_dir, "bench", model, config) for b in load_bench(p)]
    _check_batches(bench, (config.get("bench") or {}).get("batch_sizes"))
    autotune = _autotune_rows(results_dir)

    profile_bench = [] if "bench" in skipped else [
        b for p in _stage_files(results_dir, "bench", model, config) for b in load_bench(p, "profile_batches")]
    split_rows = _split_rows(bench, profile_bench)
    provenance_line = _provenance_line(bench)
    prompt_split = join_values(str(b.extra.get("prompt_split") or "not recorded") for b in bench) if bench else "—"
    run_device = join_values(b.device for b in bench) if bench else machine_device
    # A shape-only model runs nowhere: its dtype is the one its config.json declares, not the
    # workflow's engine dtype (model.dtype, float32 by default).
    dtype = (moe_shape.dtype if moe_shape is not None
             else str(model_cfg.get("dtype") or join_values(b.dtype for b in bench)))
    routing_batch = str((config.get("routing") or {}).get("batch_size", "n/a"))
    routing_batch_label = f"{routing_batch} (routing capture)"

    figures: dict[str, list[FigureOut]] = {}
    # Routing is captured where the GPU stages run (the bench's device), or imported from a trace
    # recorded elsewhere, which the trace's source names.
    source = str(skew.trace.get("source") or "")
    routing_device = run_device if (not source or "embedded" in source) else f"external trace: {source}"
    figures["routing"] = routing_figures(stats_dir / "histogram.csv", routing_device, routing_batch_label, dtype, model)
    figures["coverage"] = [coverage_figure(placements, routing_device, routing_batch_label, dtype, model)]
    batch_sizes = sorted({b.batch_size for b in bench})
    figures["residency"] = [residency_figure(bench, bs, model, placements, _preset(config)) for bs in batch_sizes]
    step_figs = [step_time_figure(bench, bs, model, placements, _preset(config)) for bs in batch_sizes]
    figures["step_time"] = [f for f in step_figs if f is not None]
    locality, cache_table = _locality_inputs(results_dir, model)
    raw_rows = cache_table  # the figure's hit rates: the compressed tier's rows have the same hits
    if cache_table is not None and "host_tier" in cache_table:
        raw_rows = cache_table[cache_table["host_tier"] == "raw"]
    figures["locality"] = [] if locality is None and cache_table is None else [
        locality_figure(locality, raw_rows, routing_device, routing_batch_label, dtype, model)]
    cache_rows = _cache_rows(cache_table)
    pick = cold_path_pick(cache_table, config, bench, placements, results_dir, model,
                          len(skew.trace.get("moe_layers") or []),
                          estimate=not any(speed_compares_placements(b.device) for b in bench))
    routing_provenance = _routing_provenance(bench, locality, skew)

    failed = [p for p in parity if not p.passed]
    # On the CPU measured speed compares nothing (coldset.core.timing): the summary leads with what holds.
    cpu_run = bool(bench) and not any(speed_compares_placements(b.device) for b in bench)
    bench_rows, bench_columns = _bench_table(bench)
    ceilings_rows = _ceilings_rows(bench)
    no_ceilings = sorted({f"{b.policy}-{b.residency}" for b in bench if b.ceilings is None})
    placement_rows, parity_rows = _placement_rows(placements), _parity_rows(parity)
    skew_table, spearman_rows, coverage_tables = _skew_tables(skew)

    html = _environment().get_template("index.html.j2").render(
        model=model,
        **_answer_context(placements, bench, parity, config, out_html, cache_table, pick),
        cold_path_text=_cold_path_text(pick),
        dtype=dtype,
        run_device=run_device,
        machine=[{"name": k, "value": str(v)} for k, v in machine_info.items()],
        config_json=json.dumps(config, sort_keys=True, indent=1, default=str),
        figures=figures,
        bench_columns=bench_columns,
        ceilings_rows=ceilings_rows,
        no_ceilings=no_ceilings,
        bench_rows=bench_rows,
        placement_rows=placement_rows,
        cpu_run=cpu_run,
        noisy_threshold=NOISY_P90_OVER_P50,
        parity_rows=parity_rows,
        parity_failed=[f"{p.policy}-{p.residency}" for p in failed],
        autotune_rows=autotune,
        skew_table=skew_table,
        skew_top_keys=skew.xs,
        spearman_rows=spearman_rows,
        coverage_tables=coverage_tables,
        batch_sizes=batch_sizes,
        skipped=skipped,
        locality=locality,
        cache_rows=cache_rows,
        routing_provenance=routing_provenance,
        provenance_line=provenance_line,
        prompt_split=prompt_split,
        split_rows=split_rows,
        shape=shape,
        expert_format=None if moe_shape is None else moe_shape.expert_format,
        routing_source=source or "a trace without a recorded source",
    )

    _write_page(out_html, html, figures, figures_dir)
    return out_html
