"""The report's figures: each re-plotted with matplotlib (Agg, no display) from the result files,
stating the device, batch size and dtype it describes, as PNG bytes the page embeds.

Routing (heatmap and cumulative share), coverage by residency, decode speed by residency and the
step time measured against its byte bounds, and the locality statistic with the cache simulation.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from coldset.analysis.locality_figure import draw_locality
from coldset.core.timing import NOISY_P90_OVER_P50, speed_compares_placements, timing_noisy
from coldset.reporting.results import BenchResult, PlacementSummary, ReportInputError


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
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _png(fig, conditions: str) -> bytes:
    fig.text(0.99, 0.005, conditions, ha="right", va="bottom", fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def join_values(values) -> str:
    vals = sorted({str(v) for v in values})
    return ", ".join(vals) if vals else "unknown"


def routing_figures(histogram_csv: Path, device: str, batch: str, dtype: str, model: str) -> list[FigureOut]:
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


def coverage_figure(placements: list[PlacementSummary], device: str, batch: str, dtype: str, model: str) -> FigureOut:
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
        + (" and on held-out traffic (dashed)" if any_heldout
           else "; there is no held-out coverage (the trace has no held-out split)")
        + ", per placement policy, against the residency each placement achieved (positional offloads "
        "whole layers, so it can fall short of the requested residency).",
        device, batch, dtype, _png(fig, f"device: {device} · batch size: {batch} · dtype: {dtype}"),
    )


def timing_is_noisy(b: BenchResult) -> bool:
    m = b.metrics
    return timing_noisy(m["step_ms_p50"], m["step_ms_p90"], m.get("repeat_spread"))


def _segment_slope(prev: BenchResult, cur: BenchResult) -> tuple[float | None, str | None]:
    """The tok_s_per_gib a residency segment may be labelled with, or why none: the bench's own
    value (docs/design.md §6: the slope from the same policy's next smaller residency), published only
    where measured speed compares placements (a host tier: not on the CPU) and neither end's
    timing is noise (coldset.core.timing); the same guards as the bench's, re-checked here so a bench
    file without them publishes nothing either."""
    if not (speed_compares_placements(cur.device) and speed_compares_placements(prev.device)):
        return None, "cpu"
    if timing_is_noisy(prev) or timing_is_noisy(cur):
        return None, "noisy"
    return cur.metrics.get("tok_s_per_gib"), None


def residency_figure(bench: list[BenchResult], batch_size: int, model: str,
                     placements: list[PlacementSummary] = (), preset: str | None = None) -> FigureOut:
    """tok/s against the GiB of experts in HBM per policy at ``batch_size``: measured where speed
    compares placements (a host tier); on the CPU, where every placement runs the same computation,
    the speed model's estimate for ``preset`` instead (:func:`_estimated_residency_figure`)."""
    rows = [b for b in bench if b.batch_size == batch_size]
    if rows and not any(speed_compares_placements(b.device) for b in rows):
        return _estimated_residency_figure(rows, placements, batch_size, model, preset)
    device, dtype = join_values(b.device for b in rows), join_values(b.dtype for b in rows)
    policies = sorted({b.policy for b in rows})
    color = _policy_styles(policies)
    fig = _new_figure(7.5, 4.6)
    ax = fig.add_subplot(1, 1, 1)
    slope_texts, unpublished = [], {"cpu": [], "noisy": []}
    for pol in policies:
        pts = sorted((b for b in rows if b.policy == pol),
                     key=lambda b: (b.metrics["hbm_expert_gib"], float(b.residency)))
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


def _estimated_residency_figure(rows: list[BenchResult], placements: list[PlacementSummary], batch_size: int,
                                model: str, preset: str | None) -> FigureOut:
    """The CPU's residency curve: the speed model's tok/s (perfect overlap, its upper estimate) per
    static placement, never the CPU's timings (they differ by noise alone)."""
    device, dtype = join_values(b.device for b in rows), join_values(b.dtype for b in rows)
    presets = sorted({q["preset"] for p in placements for q in p.predictions})
    preset = preset if preset in presets else (presets[0] if presets else None)
    points: dict[str, list[tuple[float, float]]] = {}
    for p in placements:
        for q in p.predictions:
            if q["preset"] == preset and q["batch_size"] == batch_size and q["step_ms_lower"] > 0:
                points.setdefault(p.policy, []).append((p.hbm_expert_gib, batch_size * 1e3 / q["step_ms_lower"]))
    color = _policy_styles(sorted(points))
    fig = _new_figure(7.5, 4.6)
    ax = fig.add_subplot(1, 1, 1)
    for pol, pts in sorted(points.items()):
        pts.sort()
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=color[pol], label=pol)
    if points:
        ax.legend(fontsize=8)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}"))
    else:
        ax.text(0.5, 0.5, f"no speed-model prediction at batch size {batch_size}", ha="center", va="center")
    ax.set_xlabel("GiB of routed experts in HBM")
    ax.set_ylabel(f"estimated tok/s (speed model, {preset or 'no preset'})")
    ax.set_title(f"{model}: residency curve, batch size {batch_size}")
    caption = ("Measured on the CPU, where there is no host tier: every placement runs the same in-memory "
               "computation, so the measured speeds would rank placements by timing noise and are not plotted "
               "(they are in the engine check table). Plotted instead: the placement stage's speed model, "
               f"bytes over the {preset or 'preset'} bandwidths with perfect overlap (an upper estimate, not a "
               "measurement), per static placement; slot caches have no speed-model prediction.")
    return FigureOut(
        f"residency-b{batch_size}",
        f"Estimated tok/s vs GiB of experts in HBM (batch size {batch_size})",
        caption, device, str(batch_size), dtype,
        _png(fig, f"device: {device} (estimate for {preset}) · batch size: {batch_size} · dtype: {dtype}"),
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
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers at 1, 2, 5 × 10^k (ms reads better than 2×10^0)
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())
        return [lo / 1.2, hi * 1.2]
    pad = 0.05 * (hi - lo) if hi > lo else 0.05 * max(hi, 1e-3)
    return [lo - pad, hi + pad]


def step_time_figure(bench: list[BenchResult], batch_size: int, model: str,
                     placements: list[PlacementSummary] = (), preset: str | None = None) -> FigureOut | None:
    """Measured step time against a prediction, one point per placement at ``batch_size``.

    Where the run measured its read ceilings (CUDA), the additive model is plotted (the policy's
    measured all-HBM step plus the cold bytes' extra time over the link, same run), with the
    bytes-only speed model beside it as hollow markers; otherwise the speed model
    alone. None when there is neither."""
    at_batch = [b for b in bench if b.batch_size == batch_size]
    if at_batch and not any(speed_compares_placements(b.device) for b in at_batch):
        return _estimated_step_time_figure(at_batch, placements, batch_size, model, preset)
    if any(b.metrics.get("predicted_step_ms_calibrated") is not None for b in at_batch):
        return _calibrated_step_time_figure(at_batch, batch_size, model)
    return _speed_model_step_time_figure(at_batch, batch_size, model)


def _estimated_step_time_figure(rows: list[BenchResult], placements: list[PlacementSummary], batch_size: int,
                                model: str, preset: str | None) -> FigureOut | None:
    """The CPU's step-time figure: per static placement the speed model's step on ``preset``, from
    perfect overlap of HBM and link reads to none; never the CPU's timings, which differ between
    placements by noise alone. None without a prediction at ``batch_size``."""
    presets = sorted({q["preset"] for p in placements for q in p.predictions})
    preset = preset if preset in presets else (presets[0] if presets else None)
    bars = sorted((f"{p.policy}-{p.residency}", q["step_ms_lower"], q["step_ms_sum"]) for p in placements
                  for q in p.predictions if q["preset"] == preset and q["batch_size"] == batch_size)
    if not bars:
        return None
    device, dtype = join_values(b.device for b in rows), join_values(b.dtype for b in rows)
    fig = _new_figure(7.0, max(2.6, 1.2 + 0.35 * len(bars)))
    ax = fig.add_subplot(1, 1, 1)
    ax.barh(range(len(bars)), [hi - lo for _, lo, hi in bars], left=[lo for _, lo, _ in bars], color="#1f77b4",
            height=0.5)
    for i, (_, lo, hi) in enumerate(bars):  # the ends, visible where they meet (nothing read over the link)
        ax.plot([lo, hi], [i, i], linestyle="none", marker="|", markersize=12, color="#1f77b4")
    ax.set_yticks(range(len(bars)), [name for name, _, _ in bars], fontsize=8)
    ax.set_xlim(0, max(hi for _, _, hi in bars) * 1.1)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.set_xlabel(f"estimated step time (ms, speed model preset {preset}): perfect overlap – no overlap")
    ax.set_title(f"{model}: estimated step time, batch size {batch_size}")
    return FigureOut(
        f"step-time-b{batch_size}",
        f"Estimated step time per placement (batch size {batch_size})",
        f"The placement stage's speed model on {preset}: each bar runs from the step with perfect overlap of HBM "
        "and link reads to the step with none (bytes over the preset's bandwidths; an estimate: batches whose "
        "tokens share experts can run faster). Measured on the CPU, where every placement runs the same "
        "in-memory computation: the CPU's step times differ by noise alone and are not compared with it "
        "(they are in the engine check table).",
        device, str(batch_size), dtype,
        _png(fig, f"device: {device} (estimate for {preset}) · batch size: {batch_size} · dtype: {dtype}"),
    )


def _calibrated_step_time_figure(at_batch: list[BenchResult], batch_size: int, model: str) -> FigureOut:
    rows = [b for b in at_batch if b.metrics.get("predicted_step_ms_calibrated") is not None]
    left_out = sorted(f"{b.policy}-{b.residency}" for b in at_batch if b not in rows)
    device, dtype = join_values(b.device for b in rows), join_values(b.dtype for b in rows)
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
    presets = join_values(b.extra.get("predicted_preset", "unnamed") for b in speed) if speed else None
    xlabel = "predicted step time (ms): additive model, same run (filled)"
    if presets:
        xlabel += f"; bytes-only speed model, preset {presets} (hollow)"
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(f"measured mean step time (ms, {device})")
    ax.set_title(f"{model}: measured vs additive model\nbatch size {batch_size}", fontsize=10)
    ax.legend(fontsize=7)
    caption = (
        "Mean decode step time (a pass's time over its steps, median over repeats) measured against the "
        "additive model (filled markers, labelled with "
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
    device, dtype = join_values(b.device for b in rows), join_values(b.dtype for b in rows)
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
        ax.scatter([b.predicted_step_ms for b in sub], [b.metrics["step_ms_mean"] for b in sub], color=color[pol],
                   label=pol)
        for b in sub:
            if upper(b) > b.predicted_step_ms:
                ax.plot([b.predicted_step_ms, upper(b)], [b.metrics["step_ms_mean"]] * 2, color=color[pol], alpha=0.5)
        for b in sub:
            ax.annotate(b.residency, (b.predicted_step_ms, b.metrics["step_ms_mean"]), fontsize=6,
                        textcoords="offset points", xytext=(3, 3))
    presets = join_values(b.extra.get("predicted_preset", "unnamed") for b in rows)
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
        "Mean decode step time (a pass's time over its steps, median over repeats) measured against the "
        "placement stage's speed-model prediction "
        f"(bytes only, preset {presets}; an estimate: batches whose tokens share experts can run faster), "
        "one point per placement (labelled with its residency); "
        "a horizontal bar reaches the no-overlap prediction where the bench recorded it. Points "
        "above the diagonal ran slower than predicted. No additive model: the run measured "
        "no read ceilings (a CPU run, or a bench file without them)." + mismatch,
        device, str(batch_size), dtype,
        _png(fig, f"device: {device} · batch size: {batch_size} · dtype: {dtype}"),
    )


def locality_figure(locality, table, device: str, batch: str, dtype: str, model: str) -> FigureOut:
    fig = _new_figure(13.0, 4.8)
    draw_locality(fig, table, locality, model)
    return FigureOut("locality", "Temporal locality and cache simulation",
                     "Left: mean overlap of the experts of consecutive decode tokens of a request per layer, against "
                     "the same tokens shuffled within their request (lift = ratio of the means). Middle: reuse "
                     "distances of (layer, expert) instances. Right: held-out hit rate of one slot pool shared by "
                     "every MoE layer, warm from the usage_global set, per policy and residency.",
                     device, batch, dtype, _png(fig, f"device: {device} · batch size: {batch} · dtype: {dtype}"))
