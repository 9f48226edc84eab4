"""The placement file: the row map, the JSON that records how it was chosen, and their one validator.

A placement decides which routed experts live in HBM (the hot pool) and which in pinned host memory
(the cold pool). It is written as an int32 row map (docs/design.md §3) beside a JSON that records
how it was chosen and what it is expected to do; a ``nexttoken`` placement also carries its
forecaster's tables in ``{name}.forecaster.npy``. The row map is what the kernel, the parity gate
and the benchmark consume, so it is validated on every load (``validate_row_map``, also the tiers'
check of their pools).

Row numbering: hot rows ``0..num_hot-1`` and cold rows ``0..num_cold-1`` (encoded ``-1..-num_cold``),
each row used by exactly one (layer, expert).

The policies that choose placements are :mod:`coldset.analysis.placement`; the speed model that
predicts their decode step is :mod:`coldset.analysis.speed`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from coldset.core.files import remove_orphans, share_mode

STATIC_POLICIES = ("positional", "usage_layer", "usage_global", "permute")
# Dynamic placements: the slot cache of coldset.engine.cache.pool (same names as the simulator's policies;
# lru_guard = lru without a victim the last step used (misses past the rest read in place: no thrash);
# lookahead = lru + the prefetch of layer l + d's router forecast, d = cache_lookahead_depth;
# nexttoken = the next-token forecast of every layer, its forecaster carried by the placement).
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
    # routers themselves (False; a JSON without the field reads as False).
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
    """``{policy}-{label}.json`` (docs/design.md §1)."""
    return f"{policy}-{label}.json"



def lookahead_depths(depth: int | Mapping[int, int], num_layers: int | None, name: str) -> int | dict[int, int]:
    """``depth`` checked: one depth for every batch size, or ``{batch size: depth}`` whose smallest
    key is 1 (so every batch has one: :func:`lookahead_depth_for`); each depth an integer in [1,
    num_layers - 1] (layer l + d must exist; ``None``: the model not known yet, >= 1). Why per
    batch: lookahead's best depth on the H200 differs between b1 and b8 (BENCHMARKS.md section 4).
    Refused naming ``name``."""
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


def check_forecaster(fields: Mapping[str, Any], tables: np.ndarray, num_layers: int, num_experts: int,
                      where: str) -> None:
    want = (len(fields["terms"]), num_layers, num_experts, num_experts)
    if tables.dtype != np.int32 or tables.shape != want:
        raise PlacementError(f"{where}: tables must be int32 {list(want)} (terms x MoE layers x experts x experts), "
                             f"got {tables.dtype} {list(tables.shape)}")


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
    JSON); if the JSON rename fails the new npy is removed again, and on any error before that nothing
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
        check_forecaster(placement.cache_forecaster, placement.cache_forecaster_tables, placement.num_moe_layers,
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
    npy_path, row_map = _load_recorded_npy(json_path, doc["row_map_file"], doc["row_map_sha256"], "row map",
                                           "row_map_sha256")
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
        fit = bool(fit)  # absent: the routers' own forecast
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


def _load_recorded_npy(json_path: Path, name: str, sha256: str, what: str, field: str) -> tuple[Path, np.ndarray]:
    """The ``.npy`` file ``name`` beside ``json_path`` (its ``what``), checked against the sha256 the
    JSON records (``field``) so that a mismatched pair is refused, loaded without pickles:
    (path, array)."""
    path = json_path.with_name(name)
    if not path.is_file():
        raise PlacementError(f"{json_path}: its {what} file {path} is missing")
    if hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
        raise PlacementError(f"{path}: sha256 differs from the one recorded in {json_path} ({field}); the pair is "
                             "mismatched (an interrupted write or an edited file): rerun the placement stage")
    try:
        return path, np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise PlacementError(f"{path}: not a readable .npy file ({e})") from None


def _load_forecaster(json_path: Path, fc: Any, num_layers: int, num_experts: int) -> tuple[dict, np.ndarray]:
    """A nexttoken placement's forecaster: its fields from the JSON, its tables from the file the
    JSON names, checked against the recorded sha256 (as the row map)."""
    need = (*FORECASTER_FIELDS, "tables_file", "tables_sha256")
    if not isinstance(fc, dict) or any(f not in fc for f in need):
        raise PlacementError(f"{json_path}: field 'cache_forecaster' must hold {list(need)} for policy 'nexttoken'")
    path, tables = _load_recorded_npy(json_path, fc["tables_file"], fc["tables_sha256"], "forecaster tables",
                                      "cache_forecaster.tables_sha256")
    fields = {f: fc[f] for f in FORECASTER_FIELDS}
    check_forecaster(fields, tables, num_layers, num_experts, f"{path} (for {json_path.name})")
    return fields, tables
