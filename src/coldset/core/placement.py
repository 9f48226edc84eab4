"""Cold-set selection: placement policies, budgets, the row map file and a decode speed model.

Given the routing histogram (``stats`` stage) and the model's shapes, decide which routed experts
live in HBM (the hot pool) and which in pinned host memory (the cold pool), and write that decision
as an int32 row map (DESIGN.md §3) beside a JSON that records how it was chosen and what it is
expected to do. The row map is what the kernel, the parity gate and the benchmark consume, so it is
validated on every load.

Policies (DESIGN.md §3):

- ``positional``: vLLM ``--cpu-offload-gb`` semantics restricted to routed experts: whole MoE
  layers' expert tensors go to host memory in module order (first MoE layer first) until the
  host bytes reach the target. vLLM offloads whole parameters, so a layer that is only partly
  needed still goes to host whole: the number of cold layers is ``ceil(cold_target / E)`` and the
  achieved residency is at most the requested one. (vLLM's unit is one parameter, w13 or w2 of a
  layer, and it also offloads non-expert parameters; the row map places an expert's w13 and w2
  together, so the unit here is one layer's experts.)
- ``usage_layer``: every MoE layer keeps the same number, ``floor(num_hot / num_moe_layers)``, of
  its most selected experts hot (ties: lower expert id first); the remainder of the budget is not
  used, so that every layer has the same count.
- ``usage_global``: the ``num_hot`` (layer, expert) pairs with the most profile selections are hot,
  ties broken by (layer, expert) ascending. With equal bytes per expert this maximises the covered
  profile selections for the budget (the tests check it against brute force).
- ``lru`` / ``lfu``: dynamic placements (the engine's slot cache, :mod:`coldset.engine.cache.pool`): the
  row map written here is the *warm* state, exactly ``usage_global``'s at the same residency (the
  hot rows are the slots), plus the profile count of each warm instance (``cache_warm_counts``,
  one per slot) from which the cache's initial eviction order and ``lfu``'s frequencies come.
  The cache changes the row map from step to step while decoding; the coverage and speed-model
  numbers written here describe only the warm state (no prediction is written for them).
- ``nexttoken``: the same warm state, plus the next-token forecaster the engine runs inside the
  step (``cache_forecaster``: its scalar fields in the JSON, its integer tables in
  ``{name}.forecaster.npy``, sha256 recorded like the row map's) and ``cache_prefetch_budget``
  (copies per group, None = no cut). The forecaster is fitted on the profile split's decode tokens
  by the caller (the pipeline's placement stage) and saved, not refitted where it is used: the
  parity gate and the bench then run the very tables the fingerprint covers.
- ``permute``: the expert_map reordering: the same hot and cold layers as ``positional`` at that
  residency, with rows inside each layer reordered by popularity. Its coverage equals
  ``positional``'s: it exists to show that reordering is not placement.

Rounding: a residency ``r`` gives ``num_hot = floor(r * num_moe_layers * num_experts)``, computed
exactly on the decimal value of ``r`` (``Fraction(str(r))``, so 0.29 of 100 experts is 29, not 28);
a budget in GiB (2**30 bytes) for the whole model gives ``num_hot = floor((budget - non-expert
bytes) / bytes_per_expert)``, capped at the number of experts.

Row numbering: hot rows ``0..num_hot-1`` and cold rows ``0..num_cold-1`` (encoded ``-1..-num_cold``)
are handed out in layer-major, expert-minor order; for ``permute`` in each layer's popularity
order instead.

The speed model (``predict_step``) is a bandwidth bound for one decode step, see its docstring.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from coldset.core import shapes
from coldset.core.files import atomic_path, remove_orphans, share_mode
from coldset.core.shapes import WEIGHT_FORMATS, MoEShape, WeightFormat  # noqa: F401 (re-exported)

STATIC_POLICIES = ("positional", "usage_layer", "usage_global", "permute")
# Dynamic placements: the slot cache of coldset.engine.cache.pool (same names as the simulator's policies;
# lru_guard = lru without a victim the last step used (misses past the rest read in place: no thrash);
# lookahead = lru + the prefetch of layer l + d's router forecast, d = cache_lookahead_depth;
# nexttoken = issue 28's next-token forecast of every layer, its forecaster carried by the placement).
DYNAMIC_POLICIES = ("lru", "lru_guard", "lfu", "lookahead", "nexttoken")
#: The scalar fields of a next-token forecaster (coldset.analysis.forecast.NextTokenForecaster) a nexttoken
#: placement records in its JSON; its tables (int32 [terms, L, E, E]) go to ``{name}.forecaster.npy``.
FORECASTER_FIELDS = ("terms", "hist_unit", "hist_shift", "top_k", "extra", "horizon", "self_boost")
POLICIES = STATIC_POLICIES + DYNAMIC_POLICIES
PHASES = ("prefill", "decode")
SPLITS = ("profile", "heldout")
HISTOGRAM_COLUMNS = ("domain", "split", "phase", "layer", "expert", "count")
GIB = 2**30
FORMAT_VERSION = 1


class PlacementError(ValueError):
    """Bad input to placement (histogram, budget, row map, placement file); the message says what."""


# ----------------------------------------------------------------------------------------------
# Weight formats and bytes

# Weight formats and bytes live in coldset.core.shapes (one byte model for every stage); these wrappers
# keep placement's names and its error type.


def get_weight_format(fmt: str | WeightFormat) -> WeightFormat:
    """A ``WeightFormat`` by name (``bfloat16``, ``bf16``, ``fp8_block128``, ``mxfp4``, ...)."""
    try:
        return shapes.get_weight_format(fmt)
    except shapes.ShapeError as e:
        raise PlacementError(str(e)) from None


def expert_bytes(config: MoEShape, fmt: str | WeightFormat | None = None) -> int:
    """Bytes of one routed expert (:func:`coldset.core.shapes.expert_bytes`): w13 ``[2I, H]`` plus
    w2 ``[H, I]`` in ``fmt``, by default the model's own expert format (bfloat16 for an engine config)."""
    try:
        return shapes.expert_bytes(config, fmt)
    except shapes.ShapeError as e:
        raise PlacementError(str(e)) from None


def nonexpert_bytes_breakdown(
    config: MoEShape, fmt: str | WeightFormat | None = None
) -> dict[str, int]:
    """Bytes of everything that always stays in HBM, by part (:func:`coldset.core.shapes.nonexpert_bytes_breakdown`).

    Embeddings, lm_head (not counted again when tied), per layer the attention projections
    (q, k, v, o without biases for an engine config; MLA or linear attention from a shape), two
    RMSNorms and, with ``qk_norm``, the per-head q and k norms; per MoE layer the router ``[E, H]``
    and the shared expert if the config has ``shared_expert_intermediate_size``; per dense layer
    the MLP ``3 * H * intermediate_size``; the final norm. ``fmt`` must be a format without scales;
    ``None``: as the checkpoint stores them (its ``quantization_config`` for a shape).
    """
    try:
        return shapes.nonexpert_bytes_breakdown(config, fmt)
    except shapes.ShapeError as e:
        raise PlacementError(str(e)) from None


def nonexpert_bytes(config: MoEShape, fmt: str | WeightFormat | None = None) -> int:
    """Total of ``nonexpert_bytes_breakdown``."""
    return sum(nonexpert_bytes_breakdown(config, fmt).values())


def nonexpert_format_name(config: MoEShape, fmt: str | WeightFormat | None = None) -> str:
    """How a placement records the non-expert format: ``fmt``'s name, or for ``None`` the
    checkpoint's (``{linear}+{dtype}`` when its linear layers are quantized, e.g.
    ``fp8_block128+bfloat16``)."""
    if fmt is not None:
        return get_weight_format(fmt).name
    s = shapes.as_shape(config)
    return s.dtype if s.linear_format == s.dtype else f"{s.linear_format}+{s.dtype}"


# ----------------------------------------------------------------------------------------------
# Histogram and profile


@dataclass(frozen=True)
class ProfileSpec:
    """Which traffic the profile is taken from, and how domains are weighted.

    ``domains``: the profile split of these domains (``None`` or ``"all"``: every domain in the
    histogram).
    ``phase``: ``decode`` (default) or ``prefill``.
    ``weighting``: ``"none"`` (raw counts: each domain weighs by its share of the traffic),
    ``"equal"`` (each domain's counts normalised to the same total), or a mapping
    ``{domain: weight}`` (each domain's counts normalised to ``weight / sum(weights)`` of the
    total; stored as sorted pairs so the spec stays hashable).
    """

    domains: tuple[str, ...] | None = None
    phase: str = "decode"
    weighting: str | tuple[tuple[str, float], ...] = "none"

    @classmethod
    def make(
        cls,
        domains: str | Iterable[str] | None = None,
        phase: str = "decode",
        weighting: str | Mapping[str, float] | None = None,
    ) -> "ProfileSpec":
        if domains == "all":
            domains = None
        elif isinstance(domains, str):
            domains = (domains,)
        doms = None if domains is None else tuple(sorted(set(domains)))
        if doms is not None and not doms:
            raise PlacementError("profile_domains is empty; give at least one domain or None (all)")
        if phase not in PHASES:
            raise PlacementError(f"phase must be one of {PHASES}, got {phase!r}")
        if weighting is None:
            w: str | tuple[tuple[str, float], ...] = "none"
        elif isinstance(weighting, str):
            if weighting not in ("none", "equal"):
                raise PlacementError(
                    f"domain weighting must be 'none', 'equal' or a mapping domain -> weight, "
                    f"got {weighting!r}"
                )
            w = weighting
        else:
            items = tuple(sorted((str(k), float(v)) for k, v in dict(weighting).items()))
            if not items or any(not math.isfinite(v) or v < 0 for _, v in items):
                raise PlacementError(f"domain weights must be finite and >= 0, got {dict(items)}")
            if sum(v for _, v in items) <= 0:
                raise PlacementError("domain weights sum to 0")
            w = items
        return cls(doms, phase, w)

    def describe(self) -> dict[str, Any]:
        return {
            "split": "profile",
            "domains": None if self.domains is None else list(self.domains),
            "phase": self.phase,
            "weighting": self.weighting if isinstance(self.weighting, str) else dict(self.weighting),
        }

    @classmethod
    def from_description(cls, d: Mapping[str, Any]) -> "ProfileSpec":
        return cls.make(d.get("domains"), d.get("phase", "decode"), d.get("weighting"))


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


def _as_histogram(histogram: pd.DataFrame | str | os.PathLike) -> pd.DataFrame:
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


# ----------------------------------------------------------------------------------------------
# Budgets


def hot_count_for_residency(residency: float, total_experts: int) -> int:
    """``floor(residency * total_experts)`` on the decimal value of ``residency``."""
    try:
        r = float(residency)
    except (TypeError, ValueError):
        raise PlacementError(f"residency must be a number in [0, 1], got {residency!r}") from None
    if not math.isfinite(r) or r < 0 or r > 1:
        raise PlacementError(
            f"residency must be a fraction of routed-expert bytes in [0, 1], got {residency!r}"
        )
    return math.floor(Fraction(str(r)) * total_experts)


def hot_count_for_budget(
    budget_gib: float,
    config: MoEShape,
    fmt: str | WeightFormat | None = None,
    nonexpert_format: str | WeightFormat | None = None,
) -> int:
    """Hot experts that fit in an HBM budget for the whole model (non-expert weights first)."""
    b = float(budget_gib)
    if not math.isfinite(b) or b < 0:
        raise PlacementError(f"budget_gib must be a finite number >= 0, got {budget_gib!r}")
    need = nonexpert_bytes(config, nonexpert_format)
    budget = Fraction(str(b)) * GIB
    if budget < need:
        raise PlacementError(
            f"an HBM budget of {b:g} GiB cannot hold the non-expert weights, which need "
            f"{need / GIB:.3f} GiB ({need} bytes); give at least that much"
        )
    total = len(config.moe_layers) * config.num_experts
    return min(total, math.floor((budget - need) / expert_bytes(config, fmt)))


# ----------------------------------------------------------------------------------------------
# Policies (pure functions on count matrices) and the row map


def hot_mask_positional(num_moe_layers: int, num_experts: int, num_hot: int) -> np.ndarray:
    """Whole layers to host in module order until host experts >= the cold target."""
    total = num_moe_layers * num_experts
    cold_target = total - num_hot
    cold_layers = math.ceil(cold_target / num_experts)
    mask = np.ones((num_moe_layers, num_experts), dtype=bool)
    mask[:cold_layers] = False
    return mask


def _layer_order(counts: np.ndarray) -> np.ndarray:
    """Per layer, expert ids from most to least selected (ties: lower expert id first)."""
    # A stable sort on -count keeps ascending expert order among ties.
    return np.argsort(-counts, axis=1, kind="stable")


def hot_mask_usage_layer(counts: np.ndarray, num_hot: int) -> np.ndarray:
    """Each layer's ``num_hot // num_moe_layers`` most selected experts."""
    num_layers, _ = counts.shape
    per_layer = num_hot // num_layers
    order = _layer_order(counts)
    mask = np.zeros(counts.shape, dtype=bool)
    np.put_along_axis(mask, order[:, :per_layer], True, axis=1)
    return mask


def hot_mask_usage_global(counts: np.ndarray, num_hot: int) -> np.ndarray:
    """The ``num_hot`` most selected (layer, expert) pairs; ties by (layer, expert) ascending."""
    flat = counts.reshape(-1)
    order = np.argsort(-flat, kind="stable")  # stable: ties keep ascending flat (layer, expert)
    mask = np.zeros(flat.shape, dtype=bool)
    mask[order[:num_hot]] = True
    return mask.reshape(counts.shape)


def row_map_from_mask(hot_mask: np.ndarray, expert_order: np.ndarray | None = None) -> np.ndarray:
    """The DESIGN.md §3 row map for a hot mask.

    Rows are handed out layer by layer; inside a layer in ``expert_order[layer]`` (default: by
    expert id). Hot experts get ``0, 1, ...``; cold ones ``-1, -2, ...``.
    """
    num_layers, num_experts = hot_mask.shape
    if expert_order is None:
        expert_order = np.broadcast_to(np.arange(num_experts), hot_mask.shape)
    row_map = np.empty(hot_mask.shape, dtype=np.int32)
    hot = cold = 0
    for layer in range(num_layers):
        for expert in expert_order[layer]:
            if hot_mask[layer, expert]:
                row_map[layer, expert] = hot
                hot += 1
            else:
                row_map[layer, expert] = -cold - 1
                cold += 1
    return row_map


def validate_row_map(
    row_map: Any,
    num_hot: int,
    num_cold: int,
    num_moe_layers: int,
    num_experts: int,
    source: str = "row map",
    allow_unused_rows: bool = False,
) -> None:
    """Check a row map against its pools; raise ``PlacementError`` naming the first problem.

    Checks: numpy int32, shape ``[num_moe_layers, num_experts]`` (so every (layer, expert) has one
    entry), pool sizes consistent with the entries, every row in range, no pool row used twice,
    every pool row used. ``allow_unused_rows`` drops the last rule, for pools built with spare rows
    (e.g. every expert in both tiers, so that a placement switch is only a row-map write).
    """
    if hasattr(row_map, "detach") and hasattr(row_map, "cpu"):  # a torch tensor (tiers' pools)
        if str(row_map.dtype) != "torch.int32":
            raise PlacementError(f"{source}: dtype must be int32, got {row_map.dtype}")
        row_map = row_map.detach().cpu().numpy()
    if not isinstance(row_map, np.ndarray):
        raise PlacementError(
            f"{source}: must be a numpy array or torch tensor, got {type(row_map).__name__}"
        )
    if row_map.dtype != np.int32:
        raise PlacementError(f"{source}: dtype must be int32, got {row_map.dtype}")
    if row_map.shape != (num_moe_layers, num_experts):
        raise PlacementError(
            f"{source}: shape must be [num_moe_layers, num_experts] = "
            f"[{num_moe_layers}, {num_experts}], got {list(row_map.shape)}"
        )
    if num_hot < 0 or num_cold < 0:
        raise PlacementError(f"{source}: pool sizes must be >= 0, got hot {num_hot}, cold {num_cold}")
    flat = row_map.reshape(-1).astype(np.int64)

    def where(i: int) -> str:
        return f"(layer {i // num_experts}, expert {i % num_experts})"

    out_of_range = np.flatnonzero((flat >= num_hot) | (flat < -num_cold))
    if out_of_range.size:
        i = int(out_of_range[0])
        r = int(flat[i])
        what = (
            f"hot row {r} but the hot pool has {num_hot} rows"
            if r >= 0
            else f"cold row {-r - 1} (encoded {r}) but the cold pool has {num_cold} rows"
        )
        raise PlacementError(
            f"{source}: row out of range (falls outside the pools) at {where(i)}: {what}"
        )
    seen: dict[int, int] = {}
    for i, r in enumerate(flat.tolist()):
        if r in seen:
            pool = f"hot row {r}" if r >= 0 else f"cold row {-r - 1} (encoded {r})"
            raise PlacementError(
                f"{source}: {pool} is used more than once: at {where(seen[r])} and again at "
                f"{where(i)}"
            )
        seen[r] = i
    if num_hot + num_cold != flat.size and not allow_unused_rows:
        used = set(seen)
        unused_hot = [r for r in range(num_hot) if r not in used]
        unused_cold = [c for c in range(num_cold) if -c - 1 not in used]
        first = (
            f"hot row {unused_hot[0]}" if unused_hot else f"cold row {unused_cold[0]}"
        )
        raise PlacementError(
            f"{source}: pool sizes inconsistent: hot {num_hot} + cold {num_cold} rows but the map "
            f"has {flat.size} entries; {first} is not used by any (layer, expert)"
        )


# ----------------------------------------------------------------------------------------------
# Bandwidths and the speed model


@dataclass(frozen=True)
class Bandwidths:
    """Read bandwidths in GB/s (1e9 bytes/s) of HBM and of the host link, and where they are from."""

    name: str
    hbm_gb_s: float
    link_gb_s: float
    source: str = "user"


BANDWIDTH_PRESETS: dict[str, Bandwidths] = {
    "h200": Bandwidths(
        "h200",
        3400.0,
        51.0,
        "lent H200, PCIe Gen5 x16: link 51 GB/s measured (Triton kernel reading pinned host memory in "
        "place); HBM 3.4 TB/s from a torch copy probe, a conservative figure: the Triton read kernel "
        "measured 3,974-4,615 GB/s on the same card (BENCHMARKS.md, NOTES.md), and the bench measures "
        "its own ceilings in each run",
    ),
    "gb300": Bandwidths(
        "gb300",
        8000.0,
        340.0,
        "not measured: host link about 340 GB/s over NVLink-C2C (DESIGN.md §6); HBM 8 TB/s is "
        "the GB300 datasheet figure (a lead, peak not sustained)",
    ),
}


def get_bandwidths(spec: str | Bandwidths | Mapping[str, Any]) -> Bandwidths:
    """A preset by name, a ``Bandwidths``, or a mapping ``{hbm_gb_s, link_gb_s[, name]}``."""
    if isinstance(spec, Bandwidths):
        bw = spec
    elif isinstance(spec, str):
        if spec not in BANDWIDTH_PRESETS:
            raise PlacementError(
                f"unknown bandwidth preset {spec!r}; known: {', '.join(BANDWIDTH_PRESETS)} "
                "(or give {'hbm_gb_s': ..., 'link_gb_s': ...})"
            )
        bw = BANDWIDTH_PRESETS[spec]
    else:
        try:
            bw = Bandwidths(
                str(spec.get("name", "user")),
                float(spec["hbm_gb_s"]),
                float(spec["link_gb_s"]),
                str(spec.get("source", "user")),
            )
        except KeyError as e:
            raise PlacementError(f"bandwidths need hbm_gb_s and link_gb_s, missing {e}") from None
    if not (bw.hbm_gb_s > 0 and bw.link_gb_s > 0):
        raise PlacementError(f"bandwidths must be > 0, got {bw}")
    return bw


@dataclass(frozen=True)
class StepPrediction:
    """Predicted bytes and time of one decode step of ``batch_size`` tokens (one per sequence)."""

    preset: str
    batch_size: int
    hbm_gb_s: float
    link_gb_s: float
    hbm_bytes: float
    link_bytes: float
    expected_hot_experts: float  # distinct hot experts touched per step, all MoE layers
    expected_cold_experts: float
    hbm_s: float
    link_s: float
    step_s_lower: float  # max(hbm_s, link_s): perfect overlap
    step_s_sum: float  # hbm_s + link_s: no overlap
    tok_s_lower: float  # batch_size / step_s_lower: tokens/s of the whole batch
    tok_s_sum: float  # batch_size / step_s_sum


def expected_touched(counts: np.ndarray, top_k: int, batch_size: int) -> np.ndarray:
    """Probability that each (layer, expert) is used by at least one of ``batch_size`` tokens.

    Per layer, ``p_e = count_e / tokens`` with ``tokens = sum(count) / top_k`` (one token selects
    ``top_k`` distinct experts), and tokens are independent: ``1 - (1 - p_e) ** batch_size``.
    """
    if batch_size < 1:
        raise PlacementError(f"batch_size must be >= 1, got {batch_size}")
    selections = counts.sum(axis=1)
    empty = np.flatnonzero(selections <= 0)
    if empty.size:
        raise PlacementError(
            f"the profile has no selections in MoE layer position {int(empty[0])}; the speed "
            "model cannot estimate its experts' use"
        )
    tokens = selections / top_k
    p = np.clip(counts / tokens[:, None], 0.0, 1.0)
    return 1.0 - (1.0 - p) ** batch_size


def predict_step(
    placement: "Placement",
    histogram: pd.DataFrame | np.ndarray | str | os.PathLike,
    config: MoEShape,
    bandwidths: str | Bandwidths | Mapping[str, Any],
    batch_size: int,
) -> StepPrediction:
    """Bandwidth bound of one decode step under ``placement``.

    Bytes per step: the non-expert weights once, from HBM; per MoE layer, each expert's bytes
    times the probability that the batch touches it (``expected_touched``), from HBM if hot and
    over the host link if cold (a cold expert is read once per step in place, whatever the
    number of its tokens). Times: ``bytes / bandwidth``; ``step_s_lower = max(hbm_s, link_s)``
    (perfect overlap) and ``step_s_sum = hbm_s + link_s`` (none). KV cache, activations and launch
    overheads are not modelled. These are estimates, not bounds: the touched-expert probability
    treats a batch's tokens as picking experts independently, while real tokens of a batch share
    experts, so fewer bytes are read and measured batch-8 steps fell below ``step_s_lower`` (0.93x
    on the H200, BENCHMARKS.md); at batch 1 they are bytes-only floors for the preset's rates.

    ``histogram`` is the histogram (then the placement's profile spec selects the counts) or
    the profile counts ``[num_moe_layers, num_experts]`` themselves.
    """
    bw = get_bandwidths(bandwidths)
    if isinstance(histogram, np.ndarray):
        counts = np.asarray(histogram, dtype=np.float64)
    else:
        counts = profile_counts(
            _as_histogram(histogram), placement.moe_layers, placement.num_experts, placement.profile
        )
    if counts.shape != placement.row_map.shape:
        raise PlacementError(
            f"profile counts have shape {list(counts.shape)}, the placement's row map "
            f"{list(placement.row_map.shape)}"
        )
    touched = expected_touched(counts, config.top_k, int(batch_size))
    hot = placement.row_map >= 0
    hot_experts = float(touched[hot].sum())
    cold_experts = float(touched[~hot].sum())
    per_expert = placement.bytes_per_expert
    hbm_bytes = placement.nonexpert_gib * GIB + hot_experts * per_expert  # exact: GIB is a power of 2
    link_bytes = cold_experts * per_expert
    hbm_s = hbm_bytes / (bw.hbm_gb_s * 1e9)
    link_s = link_bytes / (bw.link_gb_s * 1e9)
    lower, total = max(hbm_s, link_s), hbm_s + link_s
    return StepPrediction(
        preset=bw.name,
        batch_size=int(batch_size),
        hbm_gb_s=bw.hbm_gb_s,
        link_gb_s=bw.link_gb_s,
        hbm_bytes=hbm_bytes,
        link_bytes=link_bytes,
        expected_hot_experts=hot_experts,
        expected_cold_experts=cold_experts,
        hbm_s=hbm_s,
        link_s=link_s,
        step_s_lower=lower,
        step_s_sum=total,
        tok_s_lower=batch_size / lower,
        tok_s_sum=batch_size / total,
    )


# ----------------------------------------------------------------------------------------------
# The placement


@dataclass
class Placement:
    """One placement: the row map plus how it was chosen and what it is expected to do.

    ``residency`` is the requested fraction (``None`` when a budget was given); the achieved
    fraction of routed-expert bytes in HBM is ``achieved_residency = num_hot / (num_hot +
    num_cold)`` (positional and usage_layer round down to whole layers / equal counts).
    ``coverage_profile`` is the share of the profile's (weighted) selections that hit hot experts;
    ``coverage_heldout`` the same on the held-out split of all domains (``None`` without held-out
    data), per domain in ``coverage_heldout_by_domain``.
    """

    policy: str
    residency: float | None
    budget_gib: float | None
    row_map: np.ndarray
    num_hot: int
    num_cold: int
    moe_layers: tuple[int, ...]
    num_experts: int
    weight_format: str
    nonexpert_format: str
    bytes_per_expert: int
    nonexpert_gib: float
    hbm_expert_gib: float
    host_expert_gib: float
    profile: ProfileSpec
    profile_selections: float
    coverage_profile: float
    coverage_heldout: float | None
    coverage_heldout_by_domain: dict[str, float] = field(default_factory=dict)
    predictions: list[StepPrediction] = field(default_factory=list)
    model: str | None = None
    # Dynamic policies only: the profile count of the instance in each hot row (slot), slot order.
    cache_warm_counts: np.ndarray | None = None
    # lookahead only: the prefetch's depth d (the router of layer l + d on layer l's router input),
    # one for every batch size or per batch size ({batch: depth}: lookahead_depth_for).
    cache_lookahead_depth: int | dict[int, int] | None = None
    # lookahead only: whether the forecast is fitted on the profile split's router inputs
    # (coldset.analysis.forecast.fit_lookahead_routers, by the stages that decode) or the later layers'
    # routers themselves (False; placements written before the field existed read as False).
    cache_lookahead_fit: bool | None = None
    # nexttoken only: the forecaster's FORECASTER_FIELDS and its tables, and the prefetch budget.
    cache_forecaster: dict | None = None
    cache_forecaster_tables: np.ndarray | None = None
    cache_prefetch_budget: int | None = None

    @property
    def dynamic(self) -> bool:
        """Whether this is a slot-cache placement (the row map is its warm state)."""
        return self.policy in DYNAMIC_POLICIES

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def achieved_residency(self) -> float:
        return self.num_hot / (self.num_hot + self.num_cold)

    @property
    def label(self) -> str:
        """``{residency}`` as in file names (``0.5``, ``1.0``), or ``{budget}gib``."""
        if self.residency is not None:
            return residency_label(self.residency)
        return f"{self.budget_gib:g}gib"

    def prediction(self, preset: str, batch_size: int) -> StepPrediction:
        for p in self.predictions:
            if p.preset == preset and p.batch_size == batch_size:
                return p
        raise KeyError(f"no prediction for preset {preset!r} at batch size {batch_size}")


def residency_label(residency: float) -> str:
    """How a residency appears in file names: ``repr(float(r))``, so 0.5 -> ``0.5``, 1 -> ``1.0``."""
    return repr(float(residency))


def placement_filename(policy: str, label: str) -> str:
    """``{policy}-{label}.json`` (DESIGN.md §1)."""
    return f"{policy}-{label}.json"


def _coverage(counts: np.ndarray, hot_mask: np.ndarray) -> float | None:
    total = counts.sum()
    return None if total <= 0 else float(counts[hot_mask].sum() / total)


def lookahead_depths(depth: int | Mapping[int, int], num_layers: int | None, name: str) -> int | dict[int, int]:
    """``depth`` checked: one depth for every batch size, or ``{batch size: depth}`` whose smallest
    key is 1 (so every batch has one: :func:`lookahead_depth_for`); each depth an integer in [1,
    num_layers - 1] (layer l + d must exist; ``None``: the model not known yet, >= 1). Why per
    batch: on the H200 depth 4 was lookahead's best at b1 and depth 1 at b8 (BENCHMARKS.md section
    4). Refused naming ``name``."""
    def one(d, where):
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
            raise PlacementError(f"{name}{where} must be an integer >= 1, got {d!r}")
        if num_layers is not None and d >= num_layers:
            raise PlacementError(f"{name}{where} must lie in [1, {num_layers - 1}] (the model has {num_layers} MoE "
                                 f"layers), got {d!r}")
        return int(d)

    if not isinstance(depth, Mapping):
        return one(depth, "")
    if not depth or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 for b in depth):
        raise PlacementError(f"{name} must map batch sizes (integers >= 1) to depths, got {dict(depth)!r}")
    if min(depth) != 1:
        raise PlacementError(f"{name} must give batch size 1 a depth (a batch takes the depth of the largest "
                             f"batch size <= it), got batch sizes {sorted(depth)}")
    return {int(b): one(depth[b], f"[{b}]") for b in sorted(depth)}


def lookahead_depth_for(depth: int | Mapping[int, int], batch_size: int) -> int:
    """The depth a decode of ``batch_size`` sequences runs: ``depth`` itself, or the entry of the
    largest batch size <= ``batch_size`` (a checked mapping: :func:`lookahead_depths`)."""
    if not isinstance(depth, Mapping):
        return int(depth)
    return int(depth[max(b for b in depth if b <= batch_size)])


def place(
    histogram: pd.DataFrame | str | os.PathLike,
    config: MoEShape,
    policy: str,
    residency: float | None = None,
    *,
    budget_gib: float | None = None,
    profile_domains: str | Iterable[str] | None = None,
    phase: str = "decode",
    domain_weights: str | Mapping[str, float] | None = None,
    weight_format: str | WeightFormat | None = None,
    nonexpert_format: str | WeightFormat | None = None,
    bandwidths: Sequence[str | Bandwidths | Mapping[str, Any]] = ("h200", "gb300"),
    batch_sizes: Sequence[int] = (1,),
    model: str | None = None,
    lookahead_depth: int | Mapping[int, int] = 2,
    forecaster: Any = None,
    prefetch_budget: int | None = None,
    lookahead_fit: bool = True,
) -> Placement:
    """Choose the cold set for one policy and one residency (or HBM budget) and predict its speed.

    Exactly one of ``residency`` (fraction of routed-expert bytes in HBM) and ``budget_gib`` (HBM
    for the whole model, GiB) is given. The profile is the ``profile`` split of
    ``profile_domains`` (``None``: all) in ``phase``, weighted per ``domain_weights`` (see
    ``ProfileSpec``). ``nexttoken`` needs ``forecaster`` (a fitted
    :class:`coldset.analysis.forecast.NextTokenForecaster`, read by its attributes) and takes
    ``prefetch_budget`` (copies per group, None = the whole forecast).
    """
    if policy not in POLICIES:
        raise PlacementError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    if (residency is None) == (budget_gib is None):
        raise PlacementError("give exactly one of residency (fraction) and budget_gib")
    hist = _as_histogram(histogram)
    spec = ProfileSpec.make(profile_domains, phase, domain_weights)
    # None: the formats the checkpoint stores (a coldset.core.shapes.MoEShape's quantization_config;
    # bfloat16 for an engine config).
    fmt = get_weight_format(weight_format or shapes.as_shape(config).expert_format)
    nfmt = nonexpert_format if nonexpert_format is None else get_weight_format(nonexpert_format)
    moe_layers = tuple(int(x) for x in config.moe_layers)
    num_layers, num_experts = len(moe_layers), int(config.num_experts)
    if num_layers == 0 or num_experts == 0:
        raise PlacementError("the model has no routed experts (moe_layers or num_experts empty)")
    total = num_layers * num_experts
    if residency is not None:
        target_hot = hot_count_for_residency(residency, total)
    else:
        target_hot = hot_count_for_budget(budget_gib, config, fmt, nfmt)
    counts = profile_counts(hist, moe_layers, num_experts, spec)

    if policy in ("positional", "permute"):
        mask = hot_mask_positional(num_layers, num_experts, target_hot)
    elif policy == "usage_layer":
        mask = hot_mask_usage_layer(counts, target_hot)
    else:  # usage_global, and the warm state of the dynamic policies
        mask = hot_mask_usage_global(counts, target_hot)
    order = _layer_order(counts) if policy == "permute" else None
    row_map = row_map_from_mask(mask, order)
    num_hot = int(mask.sum())
    num_cold = total - num_hot
    validate_row_map(row_map, num_hot, num_cold, num_layers, num_experts, f"{policy} row map")

    heldout = count_matrix(hist, moe_layers, num_experts, split="heldout", phase=spec.phase)
    by_domain = {}
    for d in sorted(set(hist.loc[(hist["split"] == "heldout") & (hist["phase"] == spec.phase), "domain"])):
        c = count_matrix(
            hist, moe_layers, num_experts, split="heldout", phase=spec.phase, domains=[d]
        )
        cov = _coverage(c, mask)
        if cov is not None:
            by_domain[d] = cov
    per_expert = expert_bytes(config, fmt)
    placement = Placement(
        policy=policy,
        residency=None if residency is None else float(residency),
        budget_gib=None if budget_gib is None else float(budget_gib),
        row_map=row_map,
        num_hot=num_hot,
        num_cold=num_cold,
        moe_layers=moe_layers,
        num_experts=num_experts,
        weight_format=fmt.name,
        nonexpert_format=nonexpert_format_name(config, nfmt),
        bytes_per_expert=per_expert,
        nonexpert_gib=nonexpert_bytes(config, nfmt) / GIB,
        hbm_expert_gib=num_hot * per_expert / GIB,
        host_expert_gib=num_cold * per_expert / GIB,
        profile=spec,
        profile_selections=float(counts.sum()),
        coverage_profile=float(_coverage(counts, mask)),
        coverage_heldout=_coverage(heldout, mask),
        coverage_heldout_by_domain=by_domain,
        model=model,
    )
    if policy in DYNAMIC_POLICIES:
        hot_idx = np.flatnonzero(row_map.reshape(-1) >= 0)
        warm = np.empty(num_hot, dtype=np.float64)
        warm[row_map.reshape(-1)[hot_idx]] = counts.reshape(-1)[hot_idx]
        placement.cache_warm_counts = warm
        if policy == "lookahead":
            placement.cache_lookahead_depth = lookahead_depths(lookahead_depth, num_layers, "cache.lookahead_depth")
            placement.cache_lookahead_fit = bool(lookahead_fit)
        if policy == "nexttoken":
            placement.cache_forecaster, placement.cache_forecaster_tables = _forecaster_record(
                forecaster, num_layers, num_experts)
            if prefetch_budget is not None and int(prefetch_budget) < 0:
                raise PlacementError(f"cache.prefetch_budget must be >= 0 copies per group or null, got {prefetch_budget}")
            placement.cache_prefetch_budget = None if prefetch_budget is None else int(prefetch_budget)
        return placement  # the speed model describes static placements only
    for bw in bandwidths:
        for b in batch_sizes:
            placement.predictions.append(predict_step(placement, counts, config, bw, int(b)))
    return placement


def _forecaster_record(forecaster: Any, num_layers: int, num_experts: int) -> tuple[dict, np.ndarray]:
    """A next-token forecaster as the placement keeps it: its FORECASTER_FIELDS and its tables."""
    if forecaster is None:
        raise PlacementError("policy 'nexttoken' needs a next-token forecaster fitted on the profile split "
                             "(coldset.analysis.forecast.NextTokenForecaster; the placement stage fits it from the trace)")
    missing = [f for f in (*FORECASTER_FIELDS, "tables") if not hasattr(forecaster, f)]
    if missing:
        raise PlacementError(f"nexttoken forecaster: lacks {missing}")
    tables = np.ascontiguousarray(forecaster.tables, dtype=np.int32)
    fields = {f: getattr(forecaster, f) for f in FORECASTER_FIELDS}
    fields["terms"] = [[int(a), int(d)] for a, d in fields["terms"]]
    for f in ("hist_unit", "hist_shift", "top_k", "extra", "horizon"):
        fields[f] = int(fields[f])
    fields["self_boost"] = float(fields["self_boost"])
    _check_forecaster(fields, tables, num_layers, num_experts, "nexttoken forecaster")
    return fields, tables


def _check_forecaster(fields: Mapping[str, Any], tables: np.ndarray, num_layers: int, num_experts: int,
                      where: str) -> None:
    want = (len(fields["terms"]), num_layers, num_experts, num_experts)
    if tables.dtype != np.int32 or tables.shape != want:
        raise PlacementError(f"{where}: tables must be int32 {list(want)} (terms x MoE layers x experts x experts), "
                             f"got {tables.dtype} {list(tables.shape)}")


# ----------------------------------------------------------------------------------------------
# Files


def row_map_path(json_path: str | os.PathLike) -> Path:
    """``x/{policy}-{residency}.json`` -> ``x/{policy}-{residency}.rowmap.npy``."""
    p = Path(json_path)
    if p.suffix != ".json":
        raise PlacementError(f"{p}: a placement file name must end in .json")
    return p.with_name(p.name[: -len(".json")] + ".rowmap.npy")


def forecaster_path(json_path: str | os.PathLike) -> Path:
    """``x/nexttoken-{residency}.json`` -> ``x/nexttoken-{residency}.forecaster.npy`` (its tables)."""
    p = Path(json_path)
    if p.suffix != ".json":
        raise PlacementError(f"{p}: a placement file name must end in .json")
    return p.with_name(p.name[: -len(".json")] + ".forecaster.npy")


def _placement_to_json(placement: Placement, npy_name: str, npy_sha256: str,
                       forecaster_file: tuple[str, str] | None = None) -> dict[str, Any]:
    depth = placement.cache_lookahead_depth  # a per-batch mapping's keys as JSON's strings
    return {
        "format_version": FORMAT_VERSION,
        "model": placement.model,
        "policy": placement.policy,
        "residency": placement.residency,
        "budget_gib": placement.budget_gib,
        "achieved_residency": placement.achieved_residency,
        "num_hot": placement.num_hot,
        "num_cold": placement.num_cold,
        "moe_layers": list(placement.moe_layers),
        "num_experts": placement.num_experts,
        "weight_format": placement.weight_format,
        "nonexpert_format": placement.nonexpert_format,
        "bytes_per_expert": placement.bytes_per_expert,
        "nonexpert_gib": placement.nonexpert_gib,
        "hbm_expert_gib": placement.hbm_expert_gib,
        "host_expert_gib": placement.host_expert_gib,
        "profile": placement.profile.describe(),
        "profile_selections": placement.profile_selections,
        "coverage_profile": placement.coverage_profile,
        "coverage_heldout": placement.coverage_heldout,
        "coverage_heldout_by_domain": placement.coverage_heldout_by_domain,
        "predictions": [asdict(p) for p in placement.predictions],
        "row_map_file": npy_name,
        "row_map_sha256": npy_sha256,
        "cache_warm_counts": None if placement.cache_warm_counts is None else placement.cache_warm_counts.tolist(),
        "cache_lookahead_depth": depth if not isinstance(depth, dict) else {str(b): d for b, d in depth.items()},
        "cache_lookahead_fit": placement.cache_lookahead_fit,
        "cache_forecaster": None if forecaster_file is None else {
            **placement.cache_forecaster, "tables_file": forecaster_file[0], "tables_sha256": forecaster_file[1]},
        "cache_prefetch_budget": placement.cache_prefetch_budget,
    }


def save_placement(placement: Placement, json_path: str | os.PathLike) -> Path:
    """Write ``{name}.json`` and ``{name}.rowmap.npy`` atomically; returns the JSON path.

    Both files are written to temporary names in the target folder first, then renamed (npy, then
    JSON); if the JSON rename fails the new npy is removed again, and on any earlier error nothing
    is left behind. The JSON records the npy's sha256, so even a crash between the two renames
    leaves a pair that ``load_placement`` refuses rather than a silently mismatched one.
    """
    validate_row_map(
        placement.row_map,
        placement.num_hot,
        placement.num_cold,
        placement.num_moe_layers,
        placement.num_experts,
        f"{placement.policy} row map",
    )
    json_path = Path(json_path)
    npy_path = row_map_path(json_path)
    fc_path = forecaster_path(json_path)
    nxt = placement.policy == "nexttoken"
    if nxt:
        if placement.cache_forecaster is None or placement.cache_forecaster_tables is None:
            raise PlacementError(f"{json_path}: a nexttoken placement without its forecaster")
        _check_forecaster(placement.cache_forecaster, placement.cache_forecaster_tables, placement.num_moe_layers,
                          placement.num_experts, f"{json_path}: cache_forecaster")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(npy_path)
    remove_orphans(json_path)
    remove_orphans(fc_path)
    temps: list[str] = []
    try:
        fd, tmp_npy = tempfile.mkstemp(dir=json_path.parent, prefix=f".{npy_path.name}.", suffix=".tmp")
        temps.append(tmp_npy)
        with os.fdopen(fd, "wb") as f:
            np.save(f, placement.row_map, allow_pickle=False)
        sha = hashlib.sha256(Path(tmp_npy).read_bytes()).hexdigest()
        fc_file = None
        if nxt:  # the forecaster's tables, written and renamed beside the row map
            fd, tmp_fc = tempfile.mkstemp(dir=json_path.parent, prefix=f".{fc_path.name}.", suffix=".tmp")
            temps.append(tmp_fc)
            with os.fdopen(fd, "wb") as f:
                np.save(f, placement.cache_forecaster_tables, allow_pickle=False)
            fc_file = (fc_path.name, hashlib.sha256(Path(tmp_fc).read_bytes()).hexdigest())
            share_mode(tmp_fc)
        doc = _placement_to_json(placement, npy_path.name, sha, fc_file)
        fd, tmp_json = tempfile.mkstemp(dir=json_path.parent, prefix=f".{json_path.name}.", suffix=".tmp")
        temps.append(tmp_json)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        share_mode(tmp_npy)
        share_mode(tmp_json)
        os.replace(tmp_npy, npy_path)
        temps.remove(tmp_npy)
        try:
            if nxt:
                os.replace(tmp_fc, fc_path)
                temps.remove(tmp_fc)
            os.replace(tmp_json, json_path)
        except BaseException:
            npy_path.unlink(missing_ok=True)  # no new row map (or tables) without its JSON
            fc_path.unlink(missing_ok=True)
            raise
        temps.clear()
    finally:
        for t in temps:
            try:
                os.unlink(t)
            except FileNotFoundError:
                pass
    return json_path


def load_placement(json_path: str | os.PathLike) -> Placement:
    """Read a placement and validate its row map against the JSON; errors name the file."""
    json_path = Path(json_path)
    if not json_path.is_file():
        raise PlacementError(f"{json_path}: placement file not found")
    try:
        doc = json.loads(json_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlacementError(f"{json_path}: not valid JSON ({e})") from None
    required = (
        "policy", "num_hot", "num_cold", "moe_layers", "num_experts", "row_map_file",
        "row_map_sha256", "bytes_per_expert", "profile", "coverage_profile",
    )
    missing = [k for k in required if k not in doc]
    if missing:
        raise PlacementError(f"{json_path}: missing field(s) {missing}")
    if doc.get("format_version") != FORMAT_VERSION:
        raise PlacementError(
            f"{json_path}: format_version {doc.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    if doc["policy"] not in POLICIES:
        raise PlacementError(f"{json_path}: field 'policy' is {doc['policy']!r}; known {POLICIES}")
    npy_path = json_path.with_name(doc["row_map_file"])
    if not npy_path.is_file():
        raise PlacementError(f"{json_path}: its row map file {npy_path} is missing")
    raw = npy_path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != doc["row_map_sha256"]:
        raise PlacementError(
            f"{npy_path}: sha256 differs from the one recorded in {json_path}; the pair is "
            "mismatched (an interrupted write or an edited file): rerun the placement stage"
        )
    try:
        row_map = np.load(npy_path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise PlacementError(f"{npy_path}: not a readable .npy file ({e})") from None
    moe_layers = tuple(int(x) for x in doc["moe_layers"])
    validate_row_map(
        row_map, int(doc["num_hot"]), int(doc["num_cold"]), len(moe_layers),
        int(doc["num_experts"]), f"{npy_path} (for {json_path.name})",
    )
    warm = doc.get("cache_warm_counts")
    if doc["policy"] in DYNAMIC_POLICIES:
        if not isinstance(warm, list) or len(warm) != int(doc["num_hot"]):
            raise PlacementError(f"{json_path}: field 'cache_warm_counts' must list one profile count per slot "
                                 f"({doc['num_hot']}) for the dynamic policy {doc['policy']!r}")
        warm = np.asarray(warm, dtype=np.float64)
    elif warm is not None:
        raise PlacementError(f"{json_path}: field 'cache_warm_counts' is set for the static policy {doc['policy']!r}")
    depth = doc.get("cache_lookahead_depth")
    if (doc["policy"] == "lookahead") != (depth is not None):
        raise PlacementError(f"{json_path}: field 'cache_lookahead_depth' must be set for policy 'lookahead' and "
                             f"null otherwise, got {depth!r}")
    if depth is not None:
        if isinstance(depth, dict):  # JSON's keys are strings: the batch sizes written by save_placement
            if not all(isinstance(b, str) and b.isdigit() for b in depth):
                raise PlacementError(f"{json_path}: field 'cache_lookahead_depth' maps batch sizes (digits) to "
                                     f"depths, got keys {list(depth)}")
            depth = {int(b): d for b, d in depth.items()}
        depth = lookahead_depths(depth, len(moe_layers), f"{json_path}: field 'cache_lookahead_depth'")
    fit = doc.get("cache_lookahead_fit")
    if fit is not None and (doc["policy"] != "lookahead" or not isinstance(fit, bool)):
        raise PlacementError(f"{json_path}: field 'cache_lookahead_fit' must be true or false for policy 'lookahead' "
                             f"and null otherwise, got {fit!r}")
    if doc["policy"] == "lookahead":
        fit = bool(fit)  # absent (written before the field): the routers' forecast
    fc, fc_tables = doc.get("cache_forecaster"), None
    budget = doc.get("cache_prefetch_budget")
    if doc["policy"] == "nexttoken":
        fc, fc_tables = _load_forecaster(json_path, fc, len(moe_layers), int(doc["num_experts"]))
        if budget is not None and not (isinstance(budget, int) and budget >= 0):
            raise PlacementError(f"{json_path}: field 'cache_prefetch_budget' must be null or an integer >= 0, "
                                 f"got {budget!r}")
    elif fc is not None or budget is not None:
        raise PlacementError(f"{json_path}: fields 'cache_forecaster' / 'cache_prefetch_budget' are set for policy "
                             f"{doc['policy']!r} (nexttoken only)")
    return Placement(
        policy=doc["policy"],
        residency=doc.get("residency"),
        budget_gib=doc.get("budget_gib"),
        row_map=row_map,
        num_hot=int(doc["num_hot"]),
        num_cold=int(doc["num_cold"]),
        moe_layers=moe_layers,
        num_experts=int(doc["num_experts"]),
        weight_format=doc.get("weight_format", "bfloat16"),
        nonexpert_format=doc.get("nonexpert_format", "bfloat16"),
        bytes_per_expert=int(doc["bytes_per_expert"]),
        nonexpert_gib=float(doc.get("nonexpert_gib", float("nan"))),
        hbm_expert_gib=float(doc.get("hbm_expert_gib", float("nan"))),
        host_expert_gib=float(doc.get("host_expert_gib", float("nan"))),
        profile=ProfileSpec.from_description(doc["profile"]),
        profile_selections=float(doc.get("profile_selections", float("nan"))),
        coverage_profile=float(doc["coverage_profile"]),
        coverage_heldout=doc.get("coverage_heldout"),
        coverage_heldout_by_domain=dict(doc.get("coverage_heldout_by_domain", {})),
        predictions=[StepPrediction(**p) for p in doc.get("predictions", [])],
        model=doc.get("model"),
        cache_warm_counts=warm,
        cache_lookahead_depth=depth,
        cache_lookahead_fit=fit,
        cache_forecaster=fc,
        cache_forecaster_tables=fc_tables,
        cache_prefetch_budget=budget,
    )


def _load_forecaster(json_path: Path, fc: Any, num_layers: int, num_experts: int) -> tuple[dict, np.ndarray]:
    """A nexttoken placement's forecaster: its fields from the JSON, its tables from the file the
    JSON names, checked against the recorded sha256 (as the row map)."""
    need = (*FORECASTER_FIELDS, "tables_file", "tables_sha256")
    if not isinstance(fc, dict) or any(f not in fc for f in need):
        raise PlacementError(f"{json_path}: field 'cache_forecaster' must hold {list(need)} for policy 'nexttoken'")
    path = json_path.with_name(fc["tables_file"])
    if not path.is_file():
        raise PlacementError(f"{json_path}: its forecaster tables file {path} is missing")
    raw = path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != fc["tables_sha256"]:
        raise PlacementError(f"{path}: sha256 differs from the one recorded in {json_path} (cache_forecaster."
                             "tables_sha256): rerun the placement stage")
    try:
        tables = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise PlacementError(f"{path}: not a readable .npy file ({e})") from None
    fields = {f: fc[f] for f in FORECASTER_FIELDS}
    _check_forecaster(fields, tables, num_layers, num_experts, f"{path} (for {json_path.name})")
    return fields, tables


def coverage_table(placements: Sequence[Placement]) -> pd.DataFrame:
    """One row per placement: tiers, coverage and predicted step times (ms) and tokens/s."""
    rows = []
    for p in placements:
        row: dict[str, Any] = {
            "policy": p.policy,
            "residency": p.residency,
            "budget_gib": p.budget_gib,
            "achieved_residency": p.achieved_residency,
            "num_hot": p.num_hot,
            "num_cold": p.num_cold,
            "hbm_expert_gib": p.hbm_expert_gib,
            "host_expert_gib": p.host_expert_gib,
            "coverage_profile": p.coverage_profile,
            "coverage_heldout": p.coverage_heldout,
        }
        for d, c in sorted(p.coverage_heldout_by_domain.items()):
            row[f"coverage_heldout_{d}"] = c
        for s in p.predictions:
            tag = f"{s.preset}_b{s.batch_size}"
            row[f"step_ms_lower_{tag}"] = s.step_s_lower * 1e3
            row[f"step_ms_sum_{tag}"] = s.step_s_sum * 1e3
            row[f"tok_s_lower_{tag}"] = s.tok_s_lower
            row[f"link_gb_per_token_{tag}"] = s.link_bytes / s.batch_size / 1e9  # DESIGN.md §6
        rows.append(row)
    return pd.DataFrame(rows)


def _write_csv_atomic(df: pd.DataFrame, path: Path) -> None:
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)


def _resolve_config(model_dir_or_config: Any) -> MoEShape:
    if isinstance(model_dir_or_config, (str, os.PathLike)):
        try:  # a folder's config.json, any MoE family coldset.core.shapes reads; no engine needed
            return shapes.read_shape(model_dir_or_config)
        except shapes.ShapeError as e:
            raise PlacementError(str(e)) from None
    return model_dir_or_config


def run_placement(
    histogram_csv: str | os.PathLike,
    model_dir_or_config: Any,
    out_dir: str | os.PathLike,
    policies: Sequence[str] = POLICIES,
    residencies: Sequence[float] = (0.25, 0.5, 0.75, 1.0),
    profile_domains: str | Iterable[str] | None = None,
    *,
    budgets_gib: Sequence[float] = (),
    phase: str = "decode",
    domain_weights: str | Mapping[str, float] | None = None,
    weight_format: str | WeightFormat | None = None,
    nonexpert_format: str | WeightFormat | None = None,
    bandwidths: Sequence[str | Bandwidths | Mapping[str, Any]] = ("h200", "gb300"),
    batch_sizes: Sequence[int] = (1, 4, 16, 64),
    model: str | None = None,
    progress: bool = True,
    lookahead_depth: int | Mapping[int, int] = 2,
    forecaster: Any = None,
    prefetch_budget: int | None = None,
    lookahead_fit: bool = True,
) -> list[Placement]:
    """The placement stage: every policy x residency (and budget) to ``out_dir``, plus coverage.csv.

    Writes ``{policy}-{residency}.json`` + ``.rowmap.npy`` per placement (``residency_label``
    names the residency; budgets are named ``{budget}gib``) and ``coverage.csv``
    (``coverage_table``), and for ``nexttoken`` ``{name}.forecaster.npy`` (``forecaster``, fitted
    by the caller on the profile split, and ``prefetch_budget``: see :func:`place`). Returns the
    placements in the order written.
    """
    from tqdm import tqdm

    hist = read_histogram(histogram_csv)
    config = _resolve_config(model_dir_or_config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for p in policies:
        if p not in POLICIES:
            raise PlacementError(f"unknown policy {p!r}; known: {', '.join(POLICIES)}")
    jobs = [(p, r, None) for p in policies for r in residencies]
    jobs += [(p, None, b) for p in policies for b in budgets_gib]
    placements = []
    for policy, r, b in tqdm(jobs, desc="placement", disable=not progress):
        pl = place(
            hist, config, policy, r, budget_gib=b, profile_domains=profile_domains, phase=phase,
            domain_weights=domain_weights, weight_format=weight_format,
            nonexpert_format=nonexpert_format, bandwidths=bandwidths,
            batch_sizes=batch_sizes, model=model, lookahead_depth=lookahead_depth, lookahead_fit=lookahead_fit,
            forecaster=forecaster if policy == "nexttoken" else None,
            prefetch_budget=prefetch_budget if policy == "nexttoken" else None,
        )
        save_placement(pl, out / placement_filename(policy, pl.label))
        placements.append(pl)
    _write_csv_atomic(coverage_table(placements), out / "coverage.csv")
    return placements
