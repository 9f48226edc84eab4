"""The stats stage's figures: routing heatmaps per domain and Lorenz curves, as PNG files.

pyplot is imported where a figure is drawn, after selecting the Agg backend: importing this module
leaves an interactive backend alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from coldset.analysis.skew import ALL, gini, lorenz_curve, nanmean
from coldset.core.files import atomic_path
from coldset.core.trace import TraceMeta


def figure_heatmaps(h, meta: TraceMeta, phase: str, path: Path, max_panels: int = 6) -> None:
    """Layer x expert (raw ids) heatmap per domain of ``h`` (the stats stage's dense histogram, its
    ``get(phase, domain)``): selections relative to uniform, log colour."""
    import matplotlib  # pyplot only when drawing, on Agg (module doc)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pyplot only when drawing (module doc)
    from matplotlib.colors import LogNorm  # with pyplot

    ranked = sorted(h.domains, key=lambda d: -int(h.get(phase, d).sum()))[:max_panels]
    panels = [ALL] + ranked
    L, E = meta.num_moe_layers, meta.num_experts
    fig, axes = plt.subplots(1, len(panels), figsize=(min(4 + 3.2 * len(panels), 26), 1.5 + 0.18 * L + 1.5),
                             squeeze=False)
    im = None
    for ax, name in zip(axes[0], panels):
        c = h.get(phase, name).astype(np.float64)
        tot = c.sum(axis=1, keepdims=True)
        rel = np.where(tot > 0, c * E / np.where(tot > 0, tot, 1), np.nan)
        top = max(10.0, float(np.nanmax(rel)) if np.isfinite(rel).any() else 10.0)
        im = ax.imshow(np.where(rel > 0, rel, 1e-2), aspect="auto", interpolation="nearest", cmap="magma",
                       norm=LogNorm(vmin=1e-2, vmax=top))
        ax.set_title(f"{name} ({int(c.sum()):,})", fontsize=9)
        ax.set_xlabel("expert id")
        ticks = np.linspace(0, L - 1, min(L, 8)).round().astype(int)
        ax.set_yticks(ticks, [str(meta.moe_layers[t]) for t in ticks])
    axes[0][0].set_ylabel("layer")
    fig.colorbar(im, ax=axes[0].tolist(), label="selections / uniform share")
    fig.suptitle(f"{meta.model}: {phase} selections per layer and expert (raw ids)", fontsize=10)
    _save(fig, path)


def figure_lorenz(h, meta: TraceMeta, phase: str, path: Path, max_lines: int = 12) -> None:
    """Lorenz curves (mean over layers of the per-layer curve) per domain, with mean Gini."""
    import matplotlib  # pyplot only when drawing, on Agg (module doc)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pyplot only when drawing (module doc)

    E = meta.num_experts
    fig, ax = plt.subplots(figsize=(5.5, 5))
    frac = np.arange(E + 1) / E
    ax.plot(frac, frac, color="grey", lw=0.8, ls="--", label="uniform")
    ranked = sorted(h.domains, key=lambda d: -int(h.get(phase, d).sum()))[:max_lines]
    for name in [ALL] + ranked:
        c = h.get(phase, name)
        curves = np.array([lorenz_curve(row) for row in c if row.sum() > 0])
        if not len(curves):
            continue
        g = nanmean([gini(row) for row in c])
        ax.plot(frac, curves.mean(axis=0), lw=2.0 if name == ALL else 1.2, label=f"{name} (Gini {g:.3f})")
    ax.set_xlabel("share of experts (least used first)")
    ax.set_ylabel("share of selections")
    ax.set_title(f"{meta.model}: {phase} Lorenz curves (mean over layers)", fontsize=10)
    ax.legend(fontsize=7)
    _save(fig, path)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt  # pyplot only when drawing (module doc)

    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
