"""Cold-set selection: the placement policies, HBM budgets and the placement stage.

Given the routing histogram (``stats`` stage, :mod:`coldset.analysis.profile`) and the model's
shapes, decide which routed experts are hot and write each decision as a placement file
(:mod:`coldset.core.placement`) with its coverage and, for static policies, its predicted decode
step (:mod:`coldset.analysis.speed`).

Policies (docs/design.md §3):

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

Row numbering: rows are handed out in layer-major, expert-minor order; for ``permute`` in each
layer's popularity order instead.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

from coldset.analysis.profile import as_histogram, count_matrix, profile_counts, read_histogram
from coldset.analysis.speed import Bandwidths, predict_step
from coldset.core import shapes
from coldset.core.files import atomic_path
from coldset.core.placement import (
    DYNAMIC_POLICIES,
    FORECASTER_FIELDS,
    GIB,
    POLICIES,
    Placement,
    PlacementError,
    ProfileSpec,
    check_forecaster,
    lookahead_depths,
    placement_filename,
    save_placement,
    validate_row_map,
)
from coldset.core.shapes import MoEShape, WeightFormat

# Weight formats and bytes live in coldset.core.shapes (one byte model for every stage); these wrappers
# raise placement's error type.


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
    """The docs/design.md §3 row map for a hot mask.

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


def _coverage(counts: np.ndarray, hot_mask: np.ndarray) -> float | None:
    total = counts.sum()
    return None if total <= 0 else float(counts[hot_mask].sum() / total)



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
    hist = as_histogram(histogram)
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
                raise PlacementError(f"cache.prefetch_budget must be >= 0 copies per group or null, got "
                                     f"{prefetch_budget}")
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
                             "(coldset.analysis.forecast.NextTokenForecaster; the placement stage fits it from the "
                             "trace)")
    missing = [f for f in (*FORECASTER_FIELDS, "tables") if not hasattr(forecaster, f)]
    if missing:
        raise PlacementError(f"nexttoken forecaster: lacks {missing}")
    tables = np.ascontiguousarray(forecaster.tables, dtype=np.int32)
    fields = {f: getattr(forecaster, f) for f in FORECASTER_FIELDS}
    fields["terms"] = [[int(a), int(d)] for a, d in fields["terms"]]
    for f in ("hist_unit", "hist_shift", "top_k", "extra", "horizon"):
        fields[f] = int(fields[f])
    fields["self_boost"] = float(fields["self_boost"])
    check_forecaster(fields, tables, num_layers, num_experts, "nexttoken forecaster")
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
            row[f"link_gb_per_token_{tag}"] = s.link_bytes / s.batch_size / 1e9  # docs/design.md §6
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

