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
        ax.set_title("expert overlap |E(t) & E(t-1)| / k" + (f" (lift {lift:.2f}x)" if lift else ""), fontsize=9)
        ax.set_xlabel("layer")
        ax.set_ylabel("overlap")
        ax.legend(fontsize=7)
        reuse = locality["reuse_distance"]
        axes[1].bar(list(reuse), [v or 0.0 for v in reuse.values()], color="tab:gray")
        axes[1].set_title("reuse distance (decode tokens, same request)", fontsize=9)
        axes[1].set_ylabel("share of decode selections")
        axes[1].tick_params(axis="x", labelrotation=45)
    else:
        for a in axes[:2]:
            a.text(0.5, 0.5, "no locality statistic", ha="center", va="center")
            a.set_axis_off()
    ax = axes[2]
    if table is not None and len(table):
        batch1 = table[table["batch"] == table["batch"].min()] if "batch" in table.columns else table
        for policy, sub in batch1.groupby("policy", sort=False):
            ax.plot(sub["residency"], sub["hit_rate"], marker="o", label=policy)
        ax.set_xlabel("residency (share of routed experts in the pool)")
        ax.set_ylabel("hit rate (held-out decode selections)")
        ax.set_title("cache simulation, warm from usage_global", fontsize=9)
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no cache simulation", ha="center", va="center")
        ax.set_axis_off()
    if timed:
        ax = axes[3]
        for (policy, batch), sub in table.groupby(["policy", "batch"], sort=False):
            ax.plot(sub["residency"], sub["bound_fraction"], marker="o" if batch == table["batch"].min() else "s",
                    label=f"{policy} b{batch}")
        ax.set_xlabel("residency")
        ax.set_ylabel("bound / simulated step")
        ax.set_ylim(0, 1.05)
        ax.set_title("simulated time: fraction of max(all-HBM step, link time)", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"{model}: temporal locality of decode routing", fontsize=10)


def figure_locality(table: pd.DataFrame, locality: Mapping[str, Any] | None, meta: Any, path: Path) -> None:
    """The cache stage's figure (:func:`draw_locality`) as a PNG at ``path``, atomically."""
    fig = Figure(figsize=(20 if "bound_fraction" in table.columns else 15, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    draw_locality(fig, table, locality, str(getattr(meta, "model", "")))
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", bbox_inches="tight")
