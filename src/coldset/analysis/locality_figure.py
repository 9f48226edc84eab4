"""The cache stage's figure: the locality statistic beside the simulated hit rates and time.

:func:`draw_locality` draws its panels on any matplotlib figure (the report re-plots it);
:func:`figure_locality` writes the stage's ``locality.png``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from coldset.core.files import atomic_path


def draw_locality(fig, table: pd.DataFrame | None, locality: Mapping[str, Any] | None, model: str) -> None:
    """Panels on ``fig``: consecutive vs shuffled overlap per layer, the reuse-distance
    distribution, hit rate vs residency per policy (the smallest batch), and, where the table has
    the time columns, the simulated step's fraction of its bound per policy and batch (each panel
    says so when its input is absent)."""
    timed = table is not None and "bound_fraction" in table.columns and table["bound_fraction"].notna().any()
    axes = fig.subplots(1, 4 if timed else 3)
    ax = axes[0]
    if locality:
        layers = list(locality["consecutive_overlap"]["per_layer"])
        x = np.arange(len(layers))
        for key, label, marker in (("consecutive_overlap", "consecutive tokens", "o"),
                                   ("shuffled_overlap", "shuffled within request", "s")):
            vals = [locality[key]["per_layer"][k] for k in layers]
            ax.plot(x, [np.nan if v is None else v for v in vals], marker=marker, label=label)
        ticks = x[:: max(1, len(x) // 12)]
        ax.set_xticks(ticks, [layers[i] for i in ticks])
        lift = locality.get("lift")
        ax.set_title("consecutive tokens' expert overlap\n|E(t) & E(t-1)| / k"
                     + (f", lift {lift:.2f}x" if lift else ""), fontsize=9)
        ax.set_xlabel("layer")
        ax.set_ylabel("overlap")
        ax.legend(fontsize=7)
        reuse = locality["reuse_distance"]
        axes[1].bar(list(reuse), [v or 0.0 for v in reuse.values()], color="tab:gray")
        axes[1].set_title("reuse distance\n(decode tokens, same request)", fontsize=9)
        axes[1].set_ylabel("share of decode selections")
        axes[1].tick_params(axis="x", labelrotation=45)
    else:
        for a in axes[:2]:
            a.text(0.5, 0.5, "no locality statistic", ha="center", va="center")
            a.set_axis_off()
    ax = axes[2]
    colors = {}
    if table is not None and len(table):
        colors = {p: f"C{i % 10}" for i, p in enumerate(dict.fromkeys(table["policy"]))}
        first_batch = table["batch"].min() if "batch" in table.columns else None
        batch1 = table[table["batch"] == first_batch] if first_batch is not None else table
        for policy, sub in batch1.groupby("policy", sort=False):
            ax.plot(sub["residency"], sub["hit_rate"], marker="o", color=colors[policy], label=policy)
        ax.set_xlabel("residency (share of routed experts in the pool)")
        ax.set_ylabel("hit rate (held-out decode selections)")
        ax.set_title("cache hit rate, warm from usage_global" + (f"\n(batch {first_batch})" if first_batch else ""),
                     fontsize=9)
        ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    else:
        ax.text(0.5, 0.5, "no cache simulation", ha="center", va="center")
        ax.set_axis_off()
    if timed:
        ax = axes[3]
        batches = sorted(table["batch"].unique())
        markers = dict(zip(batches, "osD^v<>"))
        for (policy, batch), sub in table.groupby(["policy", "batch"], sort=False):
            ax.plot(sub["residency"], sub["bound_fraction"], marker=markers.get(batch, "x"), color=colors[policy],
                    linestyle="-" if batch == batches[0] else "--")
        for batch in batches:  # one legend entry per batch (marker); the colours are the hit-rate panel's
            ax.plot([], [], marker=markers.get(batch, "x"), color="#555555",
                    linestyle="-" if batch == batches[0] else "--", label=f"batch {batch}")
        ax.set_xlabel("residency")
        ax.set_ylabel("bound / simulated step")
        ax.set_ylim(0, 1.05)
        ax.set_title("simulated time: bound / step\n(bound = max(all-HBM step, link time))", fontsize=9)
        ax.legend(fontsize=7, ncol=len(batches), loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    fig.suptitle(f"{model}: temporal locality of decode routing", fontsize=10)


def figure_locality(table: pd.DataFrame, locality: Mapping[str, Any] | None, meta: Any, path: Path) -> None:
    """The cache stage's figure (:func:`draw_locality`) as a PNG at ``path``, atomically."""
    fig = Figure(figsize=(20 if "bound_fraction" in table.columns else 15, 5.2), dpi=110)
    FigureCanvasAgg(fig)
    draw_locality(fig, table, locality, str(getattr(meta, "model", "")))
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", bbox_inches="tight")
