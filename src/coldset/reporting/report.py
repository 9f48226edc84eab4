"""The HTML report: one self-contained page (figures inline) over everything the workflow wrote.

``render_report`` reads the result files of the stats, placement, parity, bench and autotune
stages (DESIGN.md §1; paths below), re-plots every figure with matplotlib (Agg, no display) so
that each one states the device, batch size and dtype it describes, embeds them as base64 data
URIs (the page needs no network and no side files) and writes ``results/report/index.html``
atomically.

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

import base64
import io
import json
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coldset.core.files import write_bytes
from coldset.reporting.results import (
    BENCH_METRICS,
    CEILING_FIELDS,
    BenchResult,
    PlacementSummary,
    TIME_BOUND_METRICS,
    ReportInputError,
    load_bench,
    load_locality,
    load_parity,
    load_simulation,
    load_placement_summary,
    load_skew,
    opt_float,
    read_json,
    require_fields,
)
from coldset.core.shapes import MoEShape
from coldset.core.shapes import describe as describe_shape
from coldset.core.timing import NOISY_P90_OVER_P50, noisy_reason, speed_compares_placements, timing_noisy

# ----------------------------------------------------------------------------------------------
# Machine
# ----------------------------------------------------------------------------------------------


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
    import torch

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
        import triton  # noqa: PLC0415

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not installed"
    return info


# ----------------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------------


@dataclass
class FigureOut:
    """One inline figure: what it shows, the conditions it was measured under, the PNG."""

    id: str
    title: str
    caption: str
    device: str
    batch_size: str
    dtype: str
    png: bytes

    @property
    def data_uri(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png).decode("ascii")

    @property
    def conditions(self) -> str:
        return f"device: {self.device} · batch size: {self.batch_size} · dtype: {self.dtype}"


def _new_figure(width: float = 7.0, height: float = 4.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _png(fig, conditions: str) -> bytes:
    fig.text(0.99, 0.005, conditions, ha="right", va="bottom", fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _join(values) -> str:
    vals = sorted({str(v) for v in values})
    return ", ".join(vals) if vals else "unknown"


def _routing_figures(histogram_csv: Path, device: str, batch: str, dtype: str, model: str) -> list[FigureOut]:
    import numpy as np
    import pandas as pd

    try:
        hist = pd.read_csv(histogram_csv)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise ReportInputError(f"{histogram_csv}: cannot read ({exc})") from exc
    need = ["domain", "phase", "layer", "expert", "count"]
    missing = [c for c in need if c not in hist.columns]
    if missing:
        raise ReportInputError(f"{histogram_csv}: missing column(s) {', '.join(missing)}")
    if hist.empty:
        raise ReportInputError(f"{histogram_csv}: no rows")
    phase = "decode" if (hist["phase"] == "decode").any() else str(hist["phase"].iloc[0])
    h = hist[hist["phase"] == phase]
    conditions = f"device: {device} · batch size: {batch} · dtype: {dtype}"
    figs = []

    grid = h.pivot_table(index="layer", columns="expert", values="count", aggfunc="sum", fill_value=0)
    counts = grid.to_numpy(dtype=np.float64)
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
    fig = _new_figure(7.5, max(2.8, min(8.0, 0.9 + 0.18 * counts.shape[0])))
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(share, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_yticks(range(len(grid.index)))
    ax.set_yticklabels([str(v) for v in grid.index], fontsize=6 if len(grid.index) > 16 else 8)
    ax.set_title(f"{model}: share of {phase} selections per layer")
    fig.colorbar(im, ax=ax, label="share of the layer's selections")
    figs.append(
        FigureOut(
            "heatmap",
            "Routing heatmap",
            f"Share of each layer's {phase} routing selections that went to each expert "
            f"(all domains and splits). A flat row is uniform routing; bright columns are hot experts.",
            device, batch, dtype, _png(fig, conditions),
        )
    )

    fig = _new_figure(6.0, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([0, 1], [0, 1], color="#999999", linestyle=":", label="uniform")
    domains = sorted(h["domain"].astype(str).unique())
    for dom in ["(all)", *domains] if len(domains) > 1 else domains:
        sub = h if dom == "(all)" else h[h["domain"].astype(str) == dom]
        per_pair = sub.groupby(["layer", "expert"])["count"].sum()
        # Every (layer, expert) of the model counts, also the never-selected ones.
        per_pair = per_pair.reindex(grid.stack().index, fill_value=0).to_numpy(dtype=np.float64)
        c = np.sort(per_pair)
        total = c.sum()
        if total <= 0:
            continue
        y = np.concatenate([[0.0], np.cumsum(c) / total])
        x = np.linspace(0.0, 1.0, len(y))
        ax.plot(x, y, label=dom, linewidth=2.2 if dom == "(all)" else 1.4)
    ax.set_xlabel("fraction of (layer, expert) pairs, least used first")
    ax.set_ylabel(f"fraction of {phase} selections")
    ax.set_title(f"{model}: Lorenz curves of expert use")
    ax.legend(fontsize=8)
    figs.append(
        FigureOut(
            "lorenz",
            "Lorenz curves",
            f"Cumulative share of {phase} selections against the share of (layer, expert) pairs, "
            "per traffic domain. The further below the diagonal, the more skewed the routing and "
            "the more a cold set can hold without being read.",
            device, batch, dtype, _png(fig, conditions),
        )
    )
    return figs


def _policy_styles(policies: list[str]) -> dict[str, str]:
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
    return {p: colors[i % len(colors)] for i, p in enumerate(policies)}


def _coverage_figure(placements: list[PlacementSummary], device: str, batch: str, dtype: str, model: str) -> FigureOut:
    policies = sorted({p.policy for p in placements})
    color = _policy_styles(policies)
    fig = _new_figure(7.0, 4.4)
    ax = fig.add_subplot(1, 1, 1)
    any_heldout = False
    for pol in policies:
        pts = sorted(
            (p.achieved_residency, p.coverage_profile, p.coverage_heldout) for p in placements if p.policy == pol
        )
        xs = [t[0] for t in pts]
        ax.plot(xs, [t[1] for t in pts], marker="o", color=color[pol], label=f"{pol} (profile)")
        held = [(x, t[2]) for x, t in zip(xs, pts) if t[2] is not None]
        if held:
            any_heldout = True
            ax.plot([h[0] for h in held], [h[1] for h in held], marker="s", linestyle="--", color=color[pol],
                    label=f"{pol} (held-out)")
    ax.set_xlabel("achieved residency (fraction of routed experts in HBM)")
    ax.set_ylabel("coverage (fraction of selections served from HBM)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{model}: coverage vs residency")
    ax.legend(fontsize=7, ncol=2)
    return FigureOut(
        "coverage",
        "Coverage vs residency",
        "Fraction of decode routing selections whose expert is in HBM, on the profiling traffic (solid)"
        + (" and on held-out traffic (dashed)" if any_heldout else "; there is no held-out coverage (the trace has no held-out split)")
        + ", per placement policy, against the residency each placement achieved (positional offloads "
        "whole layers, so it can fall short of the requested residency).",
        device, batch, dtype, _png(fig, f"device: {device} · batch size: {batch} · dtype: {dtype}"),
    )


def _noisy(b: BenchResult) -> bool:
    m = b.metrics
    return timing_noisy(m["step_ms_p50"], m["step_ms_p90"], m.get("repeat_spread"))


def _segment_slope(prev: BenchResult, cur: BenchResult) -> tuple[float | None, str | None]:
    """The tok_s_per_gib a residency segment may be labelled with, or why none: the bench's own
    value (DESIGN.md §6: the slope from the same policy's next smaller residency), published only
    where measured speed compares placements (a host tier: not on the CPU) and neither end's
    timing is noise (coldset.core.timing); the same guards as the bench's, re-checked here so a bench
    file written before them publishes nothing either."""
    if not (speed_compares_placements(cur.device) and speed_compares_placements(prev.device)):
        return None, "cpu"
    if _noisy(prev) or _noisy(cur):
        return None, "noisy"
    return cur.metrics.get("tok_s_per_gib"), None


def _residency_figure(bench: list[BenchResult], batch_size: int, model: str) -> FigureOut:
    rows = [b for b in bench if b.batch_size == batch_size]
    device, dtype = _join(b.device for b in rows), _join(b.dtype for b in rows)
    policies = sorted({b.policy for b in rows})
    color = _policy_styles(policies)
    fig = _new_figure(7.5, 4.6)
    ax = fig.add_subplot(1, 1, 1)
    slope_texts, unpublished = [], {"cpu": [], "noisy": []}
    for pol in policies:
        pts = sorted((b for b in rows if b.policy == pol), key=lambda b: (b.metrics["hbm_expert_gib"], float(b.residency)))
        xs, ys = [b.metrics["hbm_expert_gib"] for b in pts], [b.metrics["tok_s"] for b in pts]
        ax.plot(xs, ys, marker="o", color=color[pol], label=pol)
        for prev, cur in zip(pts, pts[1:]):
            x0, x1 = prev.metrics["hbm_expert_gib"], cur.metrics["hbm_expert_gib"]
            slope, why = _segment_slope(prev, cur)
            segment = f"{pol} {x0:.3g}→{x1:.3g} GiB"
            if why:
                unpublished[why].append(segment)
            if slope is None:
                continue
            slope_texts.append(f"{segment}: {slope:+.3g} tok/s per GiB")
            ax.annotate(
                f"{slope:+.3g}/GiB",
                ((x0 + x1) / 2, (prev.metrics["tok_s"] + cur.metrics["tok_s"]) / 2),
                fontsize=7,
                color=color[pol],
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
            )
    ax.set_xlabel("GiB of routed experts in HBM")
    ax.set_ylabel("decode tok/s per sequence")
    ax.set_title(f"{model}: residency curve, batch size {batch_size}")
    ax.legend(fontsize=8)
    caption = "Decode speed per sequence against the HBM spent on routed experts, per policy. "
    if slope_texts:
        caption += ("Segments measured with a host tier and timings that are not noise are annotated with "
                    "their tok_s_per_gib (tok/s gained per GiB moved into HBM from the same policy's next "
                    "smaller residency): " + "; ".join(slope_texts) + ". ")
    if unpublished["cpu"]:
        caption += ("No slope is shown for segments measured on the CPU, where there is no host tier: every "
                    "placement runs the same in-memory computation, so these speeds differ by timing noise "
                    "alone and tok_s_per_gib is undefined (" + "; ".join(unpublished["cpu"]) + "). ")
    if unpublished["noisy"]:
        caption += ("No slope is shown for segments with a noisy timing at either end (repeats disagree "
                    f"beyond {NOISY_P90_OVER_P50}x): " + "; ".join(unpublished["noisy"]) + ". ")
    if not (slope_texts or unpublished["cpu"] or unpublished["noisy"]):
        caption += "No segment (a single residency per policy, or no smaller residency measured). "
    return FigureOut(
        f"residency-b{batch_size}",
        f"tok/s vs GiB of experts in HBM (batch size {batch_size})",
        caption.rstrip(),
        device, str(batch_size), dtype,
        _png(fig, f"device: {device} · batch size: {batch_size} · dtype: {dtype}"),
    )


def _ratio_range(pairs: list[tuple[float, float]]) -> str:
    """``lo–hi×`` of measured / predicted over ``(measured, predicted)`` pairs."""
    ratios = [m / p for m, p in pairs if p > 0]
    if not ratios:
        return "undefined"
    return f"{min(ratios):.2f}–{max(ratios):.2f}×"


def _step_axes_ends(ax, values: list[float]) -> list[float]:
    """Axis ends covering ``values``; log-log when they span more than 20× (e.g. a CPU
    measurement against a GPU preset) so that every point stays visible."""
    lo, hi = min(values), max(values)
    if lo > 0 and hi / lo > 20:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers at 1, 2, 5 × 10^k (ms reads better than 2×10^0)
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())
        return [lo / 1.2, hi * 1.2]
    pad = 0.05 * (hi - lo) if hi > lo else 0.05 * max(hi, 1e-3)
    return [lo - pad, hi + pad]


def _step_time_figure(bench: list[BenchResult], batch_size: int, model: str) -> FigureOut | None:
    """Measured step time against a prediction, one point per placement at ``batch_size``.

    Where the run measured its read ceilings (CUDA), the additive model is plotted (the policy's
    measured all-HBM step plus the cold bytes' extra time over the link, same run), with the
    bytes-only speed model beside it as hollow markers; otherwise the speed model
    alone, as before the bench measured ceilings. None when there is neither."""
    at_batch = [b for b in bench if b.batch_size == batch_size]
    if any(b.metrics.get("predicted_step_ms_calibrated") is not None for b in at_batch):
        return _calibrated_step_time_figure(at_batch, batch_size, model)
    return _speed_model_step_time_figure(at_batch, batch_size, model)


def _calibrated_step_time_figure(at_batch: list[BenchResult], batch_size: int, model: str) -> FigureOut:
    rows = [b for b in at_batch if b.metrics.get("predicted_step_ms_calibrated") is not None]
    left_out = sorted(f"{b.policy}-{b.residency}" for b in at_batch if b not in rows)
    device, dtype = _join(b.device for b in rows), _join(b.dtype for b in rows)
    policies = sorted({b.policy for b in rows})
    color = _policy_styles(policies)
    fig = _new_figure(6.4, 5.0)
    ax = fig.add_subplot(1, 1, 1)
    cal = {id(b): b.metrics["predicted_step_ms_calibrated"] for b in rows}
    speed = [b for b in rows if b.predicted_step_ms is not None]
    values = [v for b in rows for v in (cal[id(b)], b.metrics["step_ms_mean"])] + [b.predicted_step_ms for b in speed]
    ends = _step_axes_ends(ax, values)
    ax.plot(ends, ends, color="#999999", linestyle=":", label="measured = predicted")
    for pol in policies:
        sub = [b for b in rows if b.policy == pol]
        ax.scatter([cal[id(b)] for b in sub], [b.metrics["step_ms_mean"] for b in sub], color=color[pol],
                   label=f"{pol}: additive model", zorder=3)
        sub_speed = [b for b in sub if b.predicted_step_ms is not None]
        if sub_speed:
            ax.scatter([b.predicted_step_ms for b in sub_speed], [b.metrics["step_ms_mean"] for b in sub_speed],
                       facecolors="none", edgecolors=color[pol], label=f"{pol}: speed model", zorder=2)
            for b in sub_speed:
                ax.plot([b.predicted_step_ms, cal[id(b)]], [b.metrics["step_ms_mean"]] * 2, color=color[pol],
                        alpha=0.3, linewidth=0.8)
        for b in sub:
            ax.annotate(b.residency, (cal[id(b)], b.metrics["step_ms_mean"]), fontsize=6,
                        textcoords="offset points", xytext=(3, 3))
    presets = _join(b.extra.get("predicted_preset", "unnamed") for b in speed) if speed else None
    xlabel = "predicted step time (ms): additive model, same run (filled)"
    if presets:
        xlabel += f"; bytes-only speed model, preset {presets} (hollow)"
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(f"measured mean step time (ms, {device})")
    ax.set_title(f"{model}: measured vs additive model\nbatch size {batch_size}", fontsize=10)
    ax.legend(fontsize=7)
    caption = (
        "Mean decode step time (a pass's time over its steps, median over repeats) measured against the additive model (filled markers, labelled with "
        "the residency; field predicted_step_ms_calibrated): the same policy's measured residency-1.0 "
        "step at this batch size plus the time this run's measured cold bytes take over the host link "
        "instead of HBM, at the read rates measured in the same run. Every input comes from the run it "
        "is compared with, so agreement checks that link time adds to the step; it is not a prediction "
        "made apart from the measurement. Measured / additive: "
        f"{_ratio_range([(b.metrics['step_ms_mean'], cal[id(b)]) for b in rows])} over {len(rows)} placements."
    )
    if speed:
        caption += (
            f" Hollow markers: the placement stage's bytes-only speed model (preset {presets}; perfect "
            "overlap of HBM and link, tokens of a batch picking experts independently, so batches whose "
            "tokens share experts can run faster than it: an estimate, not a bound) "
            f"for the same measurements; measured / speed model: "
            f"{_ratio_range([(b.metrics['step_ms_mean'], b.predicted_step_ms) for b in speed])}."
        )
    if left_out:
        caption += f" Not plotted (no additive model: no residency-1.0 run of the policy): {', '.join(left_out)}."
    caption += " Points above the diagonal ran slower than predicted."
    return FigureOut(
        f"step-time-b{batch_size}",
        f"Measured step time vs the additive model (batch size {batch_size})",
        caption,
        device, str(batch_size), dtype,
        _png(fig, f"device: {device} · batch size: {batch_size} · dtype: {dtype}"),
    )


def _speed_model_step_time_figure(at_batch: list[BenchResult], batch_size: int, model: str) -> FigureOut | None:
    rows = [b for b in at_batch if b.predicted_step_ms is not None]
    if not rows:
        return None
    device, dtype = _join(b.device for b in rows), _join(b.dtype for b in rows)
    policies = sorted({b.policy for b in rows})
    color = _policy_styles(policies)
    fig = _new_figure(6.0, 4.8)
    ax = fig.add_subplot(1, 1, 1)
    def upper(b):
        u = b.extra.get("predicted_step_ms_sum")
        return float(u) if isinstance(u, (int, float)) else b.predicted_step_ms

    ends = _step_axes_ends(ax, [v for b in rows for v in (b.predicted_step_ms, upper(b), b.metrics["step_ms_mean"])])
    ax.plot(ends, ends, color="#999999", linestyle=":", label="measured = predicted")
    for pol in policies:
        sub = [b for b in rows if b.policy == pol]
        ax.scatter([b.predicted_step_ms for b in sub], [b.metrics["step_ms_mean"] for b in sub], color=color[pol], label=pol)
        for b in sub:
            if upper(b) > b.predicted_step_ms:
                ax.plot([b.predicted_step_ms, upper(b)], [b.metrics["step_ms_mean"]] * 2, color=color[pol], alpha=0.5)
        for b in sub:
            ax.annotate(b.residency, (b.predicted_step_ms, b.metrics["step_ms_mean"]), fontsize=6,
                        textcoords="offset points", xytext=(3, 3))
    presets = _join(b.extra.get("predicted_preset", "unnamed") for b in rows)
    ax.set_xlabel(f"predicted step time (ms, speed model preset {presets})")
    ax.set_ylabel(f"measured mean step time (ms, {device})")
    ax.set_title(f"{model}: measured vs predicted, batch size {batch_size}")
    ax.legend(fontsize=8)
    mismatch = ""
    if device.lower() == "cpu" or all(p.lower() not in device.lower() for p in presets.split(", ")):
        mismatch = (f" The prediction is for the preset's hardware ({presets}), not for the measuring "
                    f"device ({device}): compare shapes across placements, not absolute times.")
    return FigureOut(
        f"step-time-b{batch_size}",
        f"Measured vs predicted step time (batch size {batch_size})",
        "Mean decode step time (a pass's time over its steps, median over repeats) measured against the placement stage's speed-model prediction "
        f"(bytes only, preset {presets}; an estimate: batches whose tokens share experts can run faster), "
        "one point per placement (labelled with its residency); "
        "a horizontal bar reaches the no-overlap prediction where the bench recorded it. Points "
        "above the diagonal ran slower than predicted. No additive model: the run measured "
        "no read ceilings (CPU run, or a bench file from before they were measured)." + mismatch,
        device, str(batch_size), dtype,
        _png(fig, f"device: {device} · batch size: {batch_size} · dtype: {dtype}"),
    )


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}g}"
    return str(value)


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
        {"hbm": _fmt(hbm), "link": _fmt(link), "placements": ", ".join(sorted(names))}
        for (hbm, link), names in sorted(seen.items(), key=lambda kv: sorted(kv[1]))
    ]


def _expected_paths(results_dir: Path, stage: str, model: str, config: dict) -> list[Path] | None:
    """Every configured placement's file of ``stage`` (placement, parity or bench), named by
    ``coldset.workflow.config.Layout`` (the one place that names stage files), or None when the config
    names no policies (then the stage's files are discovered by glob)."""
    from coldset.workflow.config import Layout

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


def _locality_figure(locality, table, device: str, batch: str, dtype: str, model: str) -> FigureOut:
    from coldset.analysis.locality_figure import draw_locality

    fig = _new_figure(13.0, 4.0)
    draw_locality(fig, table, locality, model)
    return FigureOut("locality", "Temporal locality and cache simulation",
                     "Left: mean overlap of the experts of consecutive decode tokens of a request per layer, against "
                     "the same tokens shuffled within their request (lift = ratio of the means). Middle: reuse "
                     "distances of (layer, expert) instances. Right: held-out hit rate of one slot pool shared by "
                     "every MoE layer, warm from the usage_global set, per policy and residency.",
                     device, batch, dtype, _png(fig, f"device: {device} · batch size: {batch} · dtype: {dtype}"))


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
    from coldset.bench.provenance import TAG_FIELDS

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
            row[m] = _fmt(b.metrics[m])
            row[f"profile_{m}"] = _fmt(p.metrics[m])
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
    design to the reason (``coldset.workflow.pipeline.skipped_stages``): its files are not read and the
    page says why it is absent. The page is written atomically.
    """
    import jinja2

    results_dir = Path(results_dir)
    out_html = Path(out_html)
    config = config or {}
    model_cfg = config.get("model") or {}
    model = model_cfg.get("name")
    if not model:
        models = sorted(p.name for p in (results_dir / "stats").glob("*") if p.is_dir())
        if len(models) != 1:
            raise ReportInputError(
                f"config names no model.name and {results_dir / 'stats'} holds {len(models)} models ({models})"
            )
        model = models[0]
    if machine_info is None:
        machine_info = collect_machine_info(str(config.get("device", "auto")))
    machine_device = str(machine_info.get("device", "unknown"))

    stats_dir = results_dir / "stats" / model
    skew = load_skew(stats_dir / "skew.json")
    placements = [load_placement_summary(p) for p in _stage_files(results_dir, "placement", model, config)]
    skipped = dict(skipped or {})
    moe_shape = _manifest_shape(results_dir, model)
    shape = None if moe_shape is None else {k: _fmt(v) for k, v in describe_shape(moe_shape).items()}
    parity = [] if "parity" in skipped else [load_parity(p) for p in _stage_files(results_dir, "parity", model, config)]
    bench = [] if "bench" in skipped else [
        b for p in _stage_files(results_dir, "bench", model, config) for b in load_bench(p)]
    configured_batches = (config.get("bench") or {}).get("batch_sizes")
    if configured_batches:
        for pl in {(b.path, b.policy, b.residency) for b in bench}:
            have = {b.batch_size for b in bench if b.path == pl[0]}
            missing = sorted(set(int(x) for x in configured_batches) - have)
            if missing:
                raise ReportInputError(f"{pl[0]}: no measurement for configured batch size(s) {missing}")
    autotune = _autotune_rows(results_dir)

    profile_bench = [] if "bench" in skipped else [
        b for p in _stage_files(results_dir, "bench", model, config) for b in load_bench(p, "profile_batches")]
    split_rows = _split_rows(bench, profile_bench)
    provenance_line = _provenance_line(bench)
    prompt_split = _join(str(b.extra.get("prompt_split") or "not recorded") for b in bench) if bench else "—"
    run_device = _join(b.device for b in bench) if bench else machine_device
    # A shape-only model runs nowhere: its dtype is the one its config.json declares, not the
    # workflow's engine dtype (model.dtype, float32 by default).
    dtype = moe_shape.dtype if moe_shape is not None else str(model_cfg.get("dtype") or _join(b.dtype for b in bench))
    routing_batch = str((config.get("routing") or {}).get("batch_size", "n/a"))
    routing_batch_label = f"{routing_batch} (routing capture)"

    figures: dict[str, list[FigureOut]] = {}
    # Routing is captured where the GPU stages run (the bench's device), or imported from a trace
    # recorded elsewhere, which the trace's source names.
    source = str(skew.trace.get("source") or "")
    routing_device = run_device if (not source or "embedded" in source) else f"external trace: {source}"
    figures["routing"] = _routing_figures(stats_dir / "histogram.csv", routing_device, routing_batch_label, dtype, model)
    figures["coverage"] = [_coverage_figure(placements, routing_device, routing_batch_label, dtype, model)]
    batch_sizes = sorted({b.batch_size for b in bench})
    figures["residency"] = [_residency_figure(bench, bs, model) for bs in batch_sizes]
    step_figs = [_step_time_figure(bench, bs, model) for bs in batch_sizes]
    figures["step_time"] = [f for f in step_figs if f is not None]
    locality, cache_table = _locality_inputs(results_dir, model)
    figures["locality"] = [] if locality is None and cache_table is None else [
        _locality_figure(locality, cache_table, routing_device, routing_batch_label, dtype, model)]
    cache_rows = [] if cache_table is None else [
        {"policy": r.policy, "residency": _fmt(r.residency), "capacity": int(r.capacity), "hit_rate": _fmt(r.hit_rate),
         "misses_per_token": _fmt(r.misses_per_token), "link_gb_per_token": _fmt(r.link_gb_per_token),
         # issue 28: the batch replayed and the simulated time (coldset.analysis.cache.simulate_time), when present
         **{c: _fmt(getattr(r, c, None)) for c in ("batch", "step_ms", "bound_ms", "bound_fraction", "overlap",
                                                   "stall_ms_per_token", "wasted_gb_per_token")}}
        for r in cache_table.itertuples()]
    routing_provenance = _routing_provenance(bench, locality, skew)

    failed = [p for p in parity if not p.passed]
    # On the CPU measured speed compares nothing (coldset.core.timing): the summary leads with what holds.
    cpu_run = bool(bench) and not any(speed_compares_placements(b.device) for b in bench)
    bench_rows = []
    for b in sorted(bench, key=lambda b: (b.batch_size, b.policy, float(b.residency))):
        p50, p90, spread = b.metrics["step_ms_p50"], b.metrics["step_ms_p90"], b.metrics.get("repeat_spread")
        bench_rows.append(
            {
                "timing": noisy_reason(p50, p90, spread) if timing_noisy(p50, p90, spread) else "ok",
                "policy": b.policy,
                "residency": b.residency,
                "batch_size": b.batch_size,
                **{m: _fmt(b.metrics[m]) for m in BENCH_METRICS},
                # ratios of speeds only where speed compares placements and the timing is not noise
                # (coldset.core.timing; the bench leaves them None there, bench files from before it did not)
                **({} if speed_compares_placements(b.device) and not _noisy(b) else
                   {m: "—" for m in ("tok_s_per_gib", "fetch_tax", *TIME_BOUND_METRICS)}),
                "allhbm_placement": b.extra.get("allhbm_placement") or "—",
                "predicted_step_ms": _fmt(b.predicted_step_ms),
                # share of the timed loop's tokens equal to generate()'s (the bench fails below 1)
                "timed_token_match": _fmt(opt_float(b.extra.get("timed_token_match"), f"{b.path}: timed_token_match")),
                "device": b.device,
                "dtype": b.dtype,
            }
        )
    # Bench table columns: the measured metrics, then the two predictions side by side.
    bench_columns = [m for m in BENCH_METRICS if m != "predicted_step_ms_calibrated"] + [
        "allhbm_placement", "predicted_step_ms", "predicted_step_ms_calibrated", "timed_token_match"]
    ceilings_rows = _ceilings_rows(bench)
    no_ceilings = sorted({f"{b.policy}-{b.residency}" for b in bench if b.ceilings is None})
    placement_rows = [
        {
            "policy": p.policy,
            "residency": p.residency,
            "num_hot": p.num_hot,
            "num_cold": p.num_cold,
            "hbm_expert_gib": _fmt(p.hbm_expert_gib),
            "host_expert_gib": _fmt(p.host_expert_gib),
            "coverage_profile": _fmt(p.coverage_profile),
            "coverage_heldout": _fmt(p.coverage_heldout),
            "predicted": "; ".join(
                f"{q['preset']} b{q['batch_size']}: {_fmt(q['step_ms_lower'])}–{_fmt(q['step_ms_sum'])} ms"
                f" (up to {_fmt(q['batch_size'] * 1e3 / q['step_ms_lower'])} tok/s)"
                for q in p.predictions
            )
            or "—",
        }
        for p in sorted(placements, key=lambda p: (p.policy, float(p.residency)))
    ]
    parity_rows = [
        {
            "placement": f"{p.policy}-{p.residency}",
            "passed": p.passed,
            "tokens": f"{p.tokens_matched} / {p.tokens_total}",
            "max_abs_logit_diff": _fmt(p.max_abs_logit_diff),
            "mismatches": "; ".join(
                f"{m.get('fixture')}@{m.get('position')}: expected {m.get('expected')}, got {m.get('got')}"
                f" (gap {_fmt(m.get('logit_gap'))})"
                for m in p.mismatches[:5]
            )
            + (f"; … {len(p.mismatches) - 5} more" if len(p.mismatches) > 5 else "")
            or "none",
            "device": p.device,
            "dtype": p.dtype,
        }
        for p in sorted(parity, key=lambda p: (p.policy, float(p.residency)))
    ]
    top_keys = skew.xs
    skew_table = [
        {
            "phase": r.phase,
            "domain": r.domain,
            "selections": _fmt(r.selections),
            "mean_gini": _fmt(r.mean_gini),
            "top": [_fmt(r.top_share.get(k)) for k in top_keys],
            "top_model_wide": [_fmt(r.top_share_model_wide.get(k)) for k in top_keys],
            "oracle": _fmt(r.oracle_cache_hit_rate),
        }
        for r in skew.rows
    ]
    spearman_rows = [
        {"what": f"{d['phase']}: {d['a']} vs {d['b']}", "mean": _fmt(d["mean"]), "layers": _fmt(d["layers_defined"])}
        for d in skew.spearman_between_domains
    ] + [
        {"what": f"{name}: prefill vs decode", "mean": _fmt(v), "layers": "—"}
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
                    {"profile": a, "values": [_fmt((row or {}).get(b)) for b in heldout_names]}
                    for a, row in by_profile.items()
                ],
            }
        )

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("coldset.reporting", "templates"),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    html = env.get_template("index.html.j2").render(
        model=model,
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
        skew_top_keys=top_keys,
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

    out_html.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(out_html, html.encode("utf-8"))
    if figures_dir is not None:
        figures_dir = Path(figures_dir)
        figures_dir.mkdir(parents=True, exist_ok=True)
        for figs in figures.values():
            for f in figs:
                write_bytes(figures_dir / f"{f.id}.png", f.png)
    return out_html


