"""Sweeps over models: ``models:`` expanded into one validated config per model, and the report
that compares them.

``models:`` maps a name to a model section (the keys of ``model:``, which serves as their common
base; the name becomes ``model.name``), plus optionally ``trace`` and ``trace_domains`` for that
model's ``routing.trace`` / ``routing.trace_domains`` (each model serves its own traffic). The
single ``model:`` stays valid: it is a sweep of one. Each model's results stay under its own name
(``Layout``), so the per-model stages are the same functions on the same paths; the comparison
(:func:`render_comparison`) reads them back: residency curves side by side (held-out hit rate
against the fraction of routed-expert bytes in HBM), decode speed per GiB of HBM (measured where
the bench ran, the speed model's prediction otherwise, labelled as such), hit rates by residency.
"""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import Any

import jinja2
import matplotlib

matplotlib.use("Agg")  # no display: the figures are rendered to PNG; before pyplot loads
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)

from coldset.core.files import write_bytes
from coldset.core.timing import noisy_reason, speed_compares_placements, timing_noisy
from coldset.reporting.answer import human
from coldset.reporting.results import load_bench, load_placement_summary
from coldset.workflow import pipeline
from coldset.core.layout import Layout
from coldset.workflow.config import comparison_path, model_configs
from coldset.workflow.context import StageContext


def _placements(cfg: dict):
    layout = Layout.from_config(cfg)
    pc = cfg["placement"]
    return [load_placement_summary(layout.placement(p, r)) for p in pc["policies"] for r in pc["residency"]]


def _bench(cfg: dict):
    layout = Layout.from_config(cfg)
    pc = cfg["placement"]
    paths = [layout.bench(p, r) for p in pc["policies"] for r in pc["residency"]]
    if not all(p.is_file() for p in paths):
        return []
    return [b for p in paths for b in load_bench(p)]


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _prediction_label(preset: str) -> str:
    """The speed model's tok/s is batch / its perfect-overlap step time (the fastest case the model
    allows), so it is the model's upper estimate of tok/s, never a measurement."""
    return f"predicted ({preset} speed model, perfect overlap: upper estimate of tok/s)"


def comparison_rows(configs: dict[str, dict]) -> list[dict[str, Any]]:
    """Per (model, policy, residency): bytes in HBM, held-out hit rate, decode speed and speed per
    GiB of HBM, with ``speed_source`` saying where the speed comes from.

    Measured where the bench ran on a device whose measured speed compares placements (a host
    tier; :func:`coldset.core.timing.speed_compares_placements`), at its smallest batch size, with the
    bench's own ``tok_s_per_gib`` (None at a policy's smallest residency and where a timing was
    noisy: the bench and :func:`coldset.core.timing.timing_noisy` decide, never this table). Otherwise
    (no bench, or a CPU bench, whose placements differ only by timing noise) the speed model's
    prediction for ``placement.bandwidths`` at its smallest batch size, labelled as the upper
    estimate it is, and ``tok_s_per_gib`` the difference of predictions over the same model and
    policy's next smaller residency."""
    rows = []
    for name, cfg in configs.items():
        placements = _placements(cfg)
        bench = _bench(cfg)
        cpu_bench = bool(bench) and not any(speed_compares_placements(b.device) for b in bench)
        for p in placements:
            row = {"model": name, "policy": p.policy, "residency": p.residency,
                   "achieved_residency": p.achieved_residency, "hbm_expert_gib": p.hbm_expert_gib,
                   "coverage_heldout": p.coverage_heldout, "coverage_profile": p.coverage_profile}
            measured = sorted((b for b in bench if (b.policy, b.residency) == (p.policy, p.residency)
                               and speed_compares_placements(b.device)), key=lambda b: b.batch_size)
            if measured:
                b = measured[0]
                m = b.metrics
                noisy = timing_noisy(m["step_ms_p50"], m["step_ms_p90"], m.get("repeat_spread"))
                row.update(tok_s=m["tok_s"], batch_size=b.batch_size,
                           tok_s_per_gib=None if noisy else m.get("tok_s_per_gib"),
                           speed_source=f"measured on {b.device}" + (
                               f" ({noisy_reason(m['step_ms_p50'], m['step_ms_p90'], m.get('repeat_spread'))})"
                               if noisy else ""))
            elif p.predictions:
                preset = cfg["placement"]["bandwidths"]
                q = min((q for q in p.predictions if q["preset"] == preset), key=lambda q: q["batch_size"],
                        default=p.predictions[0])
                row.update(tok_s=q["batch_size"] * 1e3 / q["step_ms_lower"], batch_size=q["batch_size"],
                           tok_s_per_gib=None, speed_source=_prediction_label(q["preset"]) + (
                               "; the CPU bench's timings compare no placements" if cpu_bench else ""))
            else:
                row.update(tok_s=None, batch_size=None, tok_s_per_gib=None, speed_source=(
                    "none (CPU bench: its timings compare no placements; no speed-model prediction)"
                    if cpu_bench else "none"))
            rows.append(row)
    # predicted tok/s per GiB: the difference of predictions over the same model and policy's next
    # smaller residency (measured rows keep the bench's own value)
    for r in rows:
        if not r["speed_source"].startswith("predicted"):
            continue
        prev = [q for q in rows if (q["model"], q["policy"]) == (r["model"], r["policy"])
                and q["hbm_expert_gib"] < r["hbm_expert_gib"] and q["speed_source"] == r["speed_source"]]
        if prev:
            q = max(prev, key=lambda q: q["hbm_expert_gib"])
            r["tok_s_per_gib"] = (r["tok_s"] - q["tok_s"]) / (r["hbm_expert_gib"] - q["hbm_expert_gib"])
    return rows


def render_comparison(configs: dict[str, dict], out_html: str | os.PathLike) -> Path:
    """The report comparing the models of a sweep: figures inline, one table (written atomically)."""
    rows = comparison_rows(configs)
    names = list(configs)
    policies = sorted({r["policy"] for r in rows})
    figs = []
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], names):
        for pol in policies:
            pts = sorted((r["achieved_residency"], r["coverage_heldout"]) for r in rows
                         if r["model"] == name and r["policy"] == pol and r["coverage_heldout"] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=pol)
        ax.set_title(name)
        ax.set_xlabel("routed-expert bytes in HBM (fraction)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out selections served from HBM")
    axes[0][0].legend(fontsize=8)
    figs.append({"title": "Residency curves side by side",
                 "caption": "Held-out hit rate (share of routed-expert selections of held-out requests that "
                            "hit the hot set) against the fraction of routed-expert bytes in HBM, per policy.",
                 "src": _png(fig)})
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name in names:
        pts = sorted((r["hbm_expert_gib"], r["tok_s"]) for r in rows
                     if r["model"] == name and r["policy"] == "usage_global" and r["tok_s"] is not None)
        if pts:
            src = next(r["speed_source"] for r in rows if r["model"] == name and r["policy"] == "usage_global")
            ax.plot(*zip(*pts), marker="o", label=f"{name} ({src})")
    ax.set_xlabel("routed-expert GiB in HBM")
    ax.set_ylabel("decode tok/s (batch)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    figs.append({"title": "Decode speed against HBM spent on experts (usage_global)",
                 "caption": "Measured tok/s where the bench ran with a host tier (a GPU); otherwise (no bench, "
                            "or a CPU bench, whose placements differ by timing noise alone) the speed model's "
                            "perfect-overlap prediction, an upper estimate of tok/s, as the legend says. The "
                            "slope is tok/s per GiB.",
                 "src": _png(fig)})

    table = [{k: human(v) for k, v in r.items()} for r in rows]
    env = jinja2.Environment(loader=jinja2.PackageLoader("coldset.reporting", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]),
                             undefined=jinja2.StrictUndefined)
    html = env.get_template("models.html.j2").render(models=names, figures=figs, rows=table)
    out = Path(out_html)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(out, html.encode("utf-8"))
    return out


def report_models(ctx: StageContext, **_) -> None:
    """The ``report_models`` stage (``models:``): the report comparing every model
    (``results/report/models.html``)."""
    render_comparison(model_configs(ctx.config), comparison_path(ctx.config))


def run_sweep(config: dict) -> Path:
    """Every model through its stages (the decoding ones only where the model decodes; fixtures
    only where routing is captured), MLflow runs tagged by model, then the comparison report."""
    configs = model_configs(config)
    for name, cfg in configs.items():
        ctx = StageContext.from_config(cfg)
        skipped = ctx.skipped
        stages = ["model"] + ([] if ctx.routing["trace"] else ["fixtures"]) + ["routing", "stats", "placement", "cache"]
        stages += [s for s in ("autotune", "parity", "parity_gate", "bench") if s not in skipped] + ["track"]
        for stage in stages:
            pipeline.run_stage(stage, ctx)
    return render_comparison(configs, comparison_path(config))
