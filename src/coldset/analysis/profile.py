"""The routing histogram (the ``stats`` stage's ``histogram.csv``) and the profile placements rank by.

The histogram's contract is ``HISTOGRAM_COLUMNS`` (one row per domain, split, phase, layer and
expert with its selection count); ``profile_counts`` turns it into the ``[num_moe_layers,
num_experts]`` counts of a :class:`coldset.core.placement.ProfileSpec`: the profile split of the
chosen domains in one phase, domains weighted as the spec says.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from coldset.core.placement import HISTOGRAM_COLUMNS, PHASES, SPLITS, PlacementError, ProfileSpec


def validate_histogram(df: pd.DataFrame, source: str = "histogram") -> pd.DataFrame:
    """Check the histogram contract (architecture.md) and return it with clean dtypes."""
    missing = [c for c in HISTOGRAM_COLUMNS if c not in df.columns]
    if missing:
        raise PlacementError(
            f"{source}: missing column(s) {missing}; expected {list(HISTOGRAM_COLUMNS)}"
        )
    out = df.loc[:, list(HISTOGRAM_COLUMNS)].copy()
    out["domain"] = out["domain"].astype(str)
    for col, allowed in (("split", SPLITS), ("phase", PHASES)):
        out[col] = out[col].astype(str)
        bad = sorted(set(out[col]) - set(allowed))
        if bad:
            raise PlacementError(f"{source}: column {col!r} has values {bad}; allowed {allowed}")
    for col in ("layer", "expert"):
        vals = pd.to_numeric(out[col], errors="coerce")
        if vals.isna().any() or (vals != np.floor(vals)).any():
            raise PlacementError(f"{source}: column {col!r} must hold integers")
        out[col] = vals.astype(np.int64)
    counts = pd.to_numeric(out["count"], errors="coerce")
    if counts.isna().any() or (counts < 0).any() or not np.isfinite(counts).all():
        raise PlacementError(f"{source}: column 'count' must hold finite numbers >= 0")
    out["count"] = counts.astype(np.float64)
    return out


def read_histogram(path: str | os.PathLike) -> pd.DataFrame:
    """Read and validate ``stats/{model}/histogram.csv``."""
    path = Path(path)
    if not path.is_file():
        raise PlacementError(f"{path}: histogram file not found")
    return validate_histogram(pd.read_csv(path), str(path))


def as_histogram(histogram: pd.DataFrame | str | os.PathLike) -> pd.DataFrame:
    if isinstance(histogram, pd.DataFrame):
        return validate_histogram(histogram)
    return read_histogram(histogram)


def count_matrix(
    histogram: pd.DataFrame,
    moe_layers: Sequence[int],
    num_experts: int,
    *,
    split: str,
    phase: str,
    domains: Iterable[str] | None = None,
) -> np.ndarray:
    """Selections as float64 ``[num_moe_layers, num_experts]`` for one split, phase and domains.

    Rows of ``histogram`` use the model's layer index; they are mapped to MoE-layer positions
    through ``moe_layers``. A layer that is not a MoE layer or an expert out of range is an error.
    """
    df = histogram[(histogram["split"] == split) & (histogram["phase"] == phase)]
    if domains is not None:
        df = df[df["domain"].isin(list(domains))]
    index = {int(layer): i for i, layer in enumerate(moe_layers)}
    bad_layers = sorted(set(df["layer"].tolist()) - set(index))
    if bad_layers:
        raise PlacementError(
            f"histogram: layer(s) {bad_layers[:5]} are not MoE layers of the model "
            f"(moe_layers {list(moe_layers)[:8]}{'...' if len(moe_layers) > 8 else ''})"
        )
    bad = df[(df["expert"] < 0) | (df["expert"] >= num_experts)]
    if len(bad):
        r = bad.iloc[0]
        raise PlacementError(
            f"histogram: expert {int(r['expert'])} in layer {int(r['layer'])} is out of range "
            f"[0, {num_experts})"
        )
    out = np.zeros((len(moe_layers), num_experts), dtype=np.float64)
    rows = df["layer"].map(index).to_numpy(dtype=np.int64)
    np.add.at(out, (rows, df["expert"].to_numpy(dtype=np.int64)), df["count"].to_numpy())
    return out


def profile_counts(
    histogram: pd.DataFrame, moe_layers: Sequence[int], num_experts: int, spec: ProfileSpec
) -> np.ndarray:
    """The profile the policies rank by: profile split, chosen domains, phase, domain weighting."""
    prof = histogram[(histogram["split"] == "profile") & (histogram["phase"] == spec.phase)]
    available = sorted(set(prof["domain"]))
    domains = list(spec.domains) if spec.domains is not None else available
    missing = [d for d in domains if d not in available]
    if missing:
        raise PlacementError(
            f"histogram: profile domain(s) {missing} have no {spec.phase} selections on the "
            f"profile split; available: {available}"
        )
    if spec.weighting == "none":
        counts = count_matrix(
            histogram, moe_layers, num_experts, split="profile", phase=spec.phase, domains=domains
        )
    else:
        if spec.weighting == "equal":
            weights = {d: 1.0 for d in domains}
        else:
            weights = dict(spec.weighting)
            unknown = [d for d in weights if d not in domains]
            unweighted = [d for d in domains if d not in weights]
            if unknown or unweighted:
                raise PlacementError(
                    f"domain weights {weights} must name exactly the profile domains {domains}"
                )
        total_w = sum(weights.values())
        per_domain = {
            d: count_matrix(histogram, moe_layers, num_experts, split="profile", phase=spec.phase, domains=[d])
            for d in domains
        }
        # A weighted domain with no selections cannot be normalised (0/0 would make every count,
        # coverage and prediction NaN and the row map arbitrary): refuse it by name.
        empty = [d for d in domains if weights[d] > 0 and not per_domain[d].sum() > 0]
        if empty:
            raise PlacementError(
                f"histogram: profile domain(s) {empty} have zero {spec.phase} selections on the profile "
                f"split, so weighting {spec.describe()['weighting']!r} cannot normalise them; drop them from "
                "placement.profile_domains or profile traffic for them"
            )
        counts = np.zeros((len(moe_layers), num_experts), dtype=np.float64)
        for d in domains:
            if weights[d] > 0:
                counts += per_domain[d] * (weights[d] / total_w / per_domain[d].sum())
    if counts.sum() <= 0:
        raise PlacementError(f"histogram: the profile ({spec.describe()}) has no selections")
    return counts
