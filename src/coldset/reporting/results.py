"""The stage files the report and MLflow read, each read by one loader that validates it.

Every stage writes its results as files under ``results/`` (docs/design.md §1, the file contracts of
docs/architecture.md). The report (:mod:`coldset.reporting.report`), the MLflow tracker
(:mod:`coldset.reporting.track`) and the sweep (:mod:`coldset.workflow.sweep`) all read the same files; this module
is where they are read, so a field is named, checked and converted in one place: a missing file
or field is a :class:`ReportInputError` naming the file and the field, never a ``KeyError`` deep
in a figure. Loaders: :func:`load_placement_summary`, :func:`load_parity`, :func:`load_bench`,
:func:`load_skew`, :func:`load_locality`, :func:`load_simulation` (the cache stage's table, through
the cache module's own reader).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coldset.bench.metrics import BYTES_METRICS, TIME_BOUND_METRICS

CACHE_TIME_METRICS: tuple[str, ...] = (*TIME_BOUND_METRICS, "wasted_gb_per_token")
# Metric names of docs/design.md §6 and the bytes metrics, as they appear in bench JSON, MLflow and
# the report.
BENCH_METRICS: tuple[str, ...] = (
    "tok_s",
    "step_ms_mean",
    "step_ms_p50",
    "step_ms_p90",
    "prefill_ms",
    "hbm_expert_gib",
    "host_expert_gib",
    "cold_share",
    "link_gb_per_token",
    "hit_rate",
    "misses_per_token",
    "simulator_hit_rate",
    "repeat_spread",
    "tok_s_per_gib",
    "fetch_tax",
    *BYTES_METRICS,
    *CACHE_TIME_METRICS,
)
# Bench metrics that are legitimately undefined for some placements: tok_s_per_gib has no
# smaller residency to compare with at a policy's smallest residency, fetch_tax needs the
# policy's residency-1.0 run, predicted_step_ms needs a speed-model preset for the device, and
# the bytes metrics need this run's measured read ceilings (None on CPU, absent in bench files
# without them); hit_rate and misses_per_token may be absent from a bench file too.
NULLABLE_BENCH_FIELDS: frozenset[str] = frozenset({"tok_s_per_gib", "fetch_tax", "predicted_step_ms", "hit_rate",
                                                   "misses_per_token", "simulator_hit_rate", "repeat_spread",
                                                   *BYTES_METRICS, *CACHE_TIME_METRICS})
# The read-rate ceilings a CUDA bench measures once per run (top-level "ceilings" of a bench JSON).
CEILING_FIELDS: tuple[str, ...] = ("hbm_read_gb_s", "link_read_gb_s")
REQUIRED_BENCH_FIELDS: tuple[str, ...] = tuple(
    m for m in BENCH_METRICS if m not in NULLABLE_BENCH_FIELDS
) + ("batch_size", "device", "dtype")
REQUIRED_PLACEMENT_FIELDS: tuple[str, ...] = (
    "policy",
    "residency",
    "num_hot",
    "num_cold",
    "hbm_expert_gib",
    "host_expert_gib",
    "coverage_profile",
    "coverage_heldout",
)
REQUIRED_PARITY_FIELDS: tuple[str, ...] = ("passed", "tokens_matched", "tokens_total")


class ReportInputError(ValueError):
    """A result file the report or the tracker needs is missing or malformed (names the file)."""


# ----------------------------------------------------------------------------------------------
# Loaders
# ----------------------------------------------------------------------------------------------


def read_json(path: str | os.PathLike) -> Any:
    """JSON from ``path``; a missing or unparsable file is a ``ReportInputError`` naming it."""
    path = Path(path)
    if not path.is_file():
        raise ReportInputError(f"missing required input: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportInputError(f"{path}: not valid JSON ({exc})") from exc


def placement_key_from_path(path: str | os.PathLike) -> tuple[str, str, str]:
    """``(model, policy, residency)`` from ``.../{model}/{policy}-{residency}.json``.

    Policy names use underscores (``usage_global``), so the residency is after the last ``-``.
    The residency stays the string of the file name: it is the join key between stages.
    """
    path = Path(path)
    stem = path.stem
    if "-" not in stem:
        raise ReportInputError(f"{path}: file name is not {{policy}}-{{residency}}.json")
    policy, residency = stem.rsplit("-", 1)
    try:
        float(residency)
    except ValueError as exc:
        raise ReportInputError(f"{path}: residency {residency!r} in the file name is not a number") from exc
    return path.parent.name, policy, residency


def _check_key_fields(doc: dict, path: Path, policy: str, residency: str) -> None:
    """A file's own policy/residency fields, where present, must agree with its name."""
    if "policy" in doc and doc["policy"] != policy:
        raise ReportInputError(f"{path}: field policy={doc['policy']!r} disagrees with the file name ({policy!r})")
    if "residency" in doc and doc["residency"] is not None:
        try:
            same = math.isclose(float(doc["residency"]), float(residency), abs_tol=1e-9)
        except (TypeError, ValueError):
            same = False
        if not same:
            raise ReportInputError(
                f"{path}: field residency={doc['residency']!r} disagrees with the file name ({residency!r})"
            )


def require_fields(doc: dict, fields: tuple[str, ...], where: str) -> None:
    missing = [f for f in fields if f not in doc]
    if missing:
        raise ReportInputError(f"{where}: missing field(s) {', '.join(missing)}")


def _key_fields(path: Path) -> dict[str, Any]:
    """A placement's result file's ``path``, ``model``, ``policy`` and ``residency`` fields (from its name)."""
    model, policy, residency = placement_key_from_path(path)
    return {"path": path, "model": model, "policy": policy, "residency": residency}


def _keyed_object(path: Path, required: tuple[str, ...]) -> tuple[dict, dict[str, Any]]:
    """A placement's one-object result file (JSON object holding ``required``) and its :func:`_key_fields`."""
    doc = read_json(path)
    if not isinstance(doc, dict):
        raise ReportInputError(f"{path}: expected a JSON object")
    key = _key_fields(path)
    require_fields(doc, required, str(path))
    return doc, key


@dataclass
class PlacementSummary:
    """The parts of a placement JSON (``coldset.core.placement.save_placement``) the report and the
    tracker use."""

    path: Path
    model: str
    policy: str
    residency: str  # as in the file name (the join key)
    achieved_residency: float  # num_hot / (num_hot + num_cold); positional may fall short
    num_hot: int
    num_cold: int
    hbm_expert_gib: float
    host_expert_gib: float
    coverage_profile: float
    coverage_heldout: float | None  # None when the trace has no held-out split
    predictions: list[dict[str, Any]] = field(default_factory=list)  # {preset, batch_size, step_ms_lower, step_ms_sum}
    nonexpert_gib: float | None = None  # the weights other than routed experts (always in HBM); None if not recorded


def _placement_predictions(doc: dict, path: Path) -> list[dict[str, Any]]:
    """Speed-model predictions as ``[{preset, batch_size, step_ms_lower, step_ms_sum}]`` from the
    placement JSON's ``predictions`` list (``StepPrediction`` fields, seconds) or a
    ``predicted: {preset: {batch_size: {step_ms_lower, step_ms_sum}}}`` object."""
    out = []
    preds = doc.get("predictions")
    if preds is not None:
        if not isinstance(preds, list):
            raise ReportInputError(f"{path}: field predictions must be a list")
        for i, p in enumerate(preds):
            if not isinstance(p, dict) or not {"preset", "batch_size", "step_s_lower", "step_s_sum"} <= p.keys():
                raise ReportInputError(f"{path}: predictions[{i}] lacks preset, batch_size, step_s_lower or step_s_sum")
            out.append(
                {
                    "preset": str(p["preset"]),
                    "batch_size": int(p["batch_size"]),
                    "step_ms_lower": float(p["step_s_lower"]) * 1e3,
                    "step_ms_sum": float(p["step_s_sum"]) * 1e3,
                }
            )
    predicted = doc.get("predicted")
    if predicted is not None:
        if not isinstance(predicted, dict):
            raise ReportInputError(f"{path}: field predicted must be an object {{preset: {{batch_size: ...}}}}")
        for preset, by_bs in predicted.items():
            for bs, vals in (by_bs or {}).items():
                if not isinstance(vals, dict) or not {"step_ms_lower", "step_ms_sum"} <= vals.keys():
                    raise ReportInputError(f"{path}: predicted/{preset}/{bs} lacks step_ms_lower or step_ms_sum")
                out.append(
                    {
                        "preset": str(preset),
                        "batch_size": int(bs),
                        "step_ms_lower": float(vals["step_ms_lower"]),
                        "step_ms_sum": float(vals["step_ms_sum"]),
                    }
                )
    return sorted(out, key=lambda p: (p["preset"], p["batch_size"]))


def load_placement_summary(path: str | os.PathLike) -> PlacementSummary:
    path = Path(path)
    doc, key = _keyed_object(path, REQUIRED_PLACEMENT_FIELDS)
    _check_key_fields(doc, path, key["policy"], key["residency"])
    num_hot, num_cold = int(doc["num_hot"]), int(doc["num_cold"])
    if num_hot < 0 or num_cold < 0 or num_hot + num_cold == 0:
        raise ReportInputError(f"{path}: num_hot={num_hot}, num_cold={num_cold} is not a placement")
    held = doc["coverage_heldout"]
    return PlacementSummary(
        **key,
        achieved_residency=float(doc.get("achieved_residency", num_hot / (num_hot + num_cold))),
        num_hot=num_hot,
        num_cold=num_cold,
        hbm_expert_gib=float(doc["hbm_expert_gib"]),
        host_expert_gib=float(doc["host_expert_gib"]),
        coverage_profile=float(doc["coverage_profile"]),
        coverage_heldout=None if held is None else float(held),
        predictions=_placement_predictions(doc, path),
        nonexpert_gib=opt_float(doc.get("nonexpert_gib"), f"{path}: field nonexpert_gib"),
    )


@dataclass
class ParityResult:
    """One placement's parity gate outcome."""

    path: Path
    model: str
    policy: str
    residency: str
    passed: bool
    tokens_matched: int
    tokens_total: int
    mismatches: list[dict]
    max_abs_logit_diff: float | None
    device: str
    dtype: str


def load_parity(path: str | os.PathLike) -> ParityResult:
    path = Path(path)
    doc, key = _keyed_object(path, REQUIRED_PARITY_FIELDS)
    mismatches = doc.get("mismatches") or []
    if not isinstance(mismatches, list):
        raise ReportInputError(f"{path}: field mismatches must be a list")
    mad = doc.get("max_abs_logit_diff")
    return ParityResult(
        **key,
        passed=bool(doc["passed"]),
        tokens_matched=int(doc["tokens_matched"]),
        tokens_total=int(doc["tokens_total"]),
        mismatches=mismatches,
        max_abs_logit_diff=None if mad is None else float(mad),
        device=str(doc.get("device", "unknown")),
        dtype=str(doc.get("dtype", "unknown")),
    )


@dataclass
class BenchResult:
    """One (placement, batch size) decode measurement; ``metrics`` holds docs/design.md §6 names."""

    path: Path
    model: str
    policy: str
    residency: str
    batch_size: int
    device: str
    dtype: str
    metrics: dict[str, float | None]  # every BENCH_METRICS name; None where undefined
    predicted_step_ms: float | None
    extra: dict[str, Any]  # any other scalar fields of the entry (e.g. autotune_key)
    # The file's measured read ceilings {hbm_read_gb_s, link_read_gb_s} (GB/s); None on CPU runs
    # and in bench files without them.
    ceilings: dict[str, float | None] | None = None
    # What measured it (coldset.bench.provenance.collect_provenance, written by the bench stage on the
    # measuring machine); None in bench files without it.
    provenance: dict[str, Any] | None = None
    # The distinct requests timed (fixture ids) and per domain their count and, at batch size 1,
    # the domain's own tok_s / step_ms_mean / cold_share; empty in bench files without them.
    requests: list[str] = field(default_factory=list)
    domains: dict[str, dict[str, float]] = field(default_factory=dict)
    # How much of the bench prompts occurs in the profile prompts (coldset.bench.decode.ngram_overlap:
    # {"ngram", "share", "domains", ...}); None in bench files without it.
    prompt_overlap: dict[str, Any] | None = None


def _bench_domains(entry: dict, where: str) -> tuple[list[str], dict[str, dict[str, float]]]:
    """An entry's ``requests`` (distinct ids) and ``domains`` ({domain: {requests, tok_s, ...}}), checked."""
    requests, domains = entry.get("requests", []), entry.get("domains", {})
    if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests) \
            or len(set(requests)) != len(requests):
        raise ReportInputError(f"{where}: field requests must be a list of distinct request ids")
    if not isinstance(domains, dict) or not all(isinstance(v, dict) for v in domains.values()):
        raise ReportInputError(f"{where}: field domains must map each domain to an object")
    out = {}
    for d, v in domains.items():
        try:
            out[d] = {k: float(x) for k, x in v.items() if x is not None and not isinstance(x, bool)}
        except (TypeError, ValueError) as exc:
            raise ReportInputError(f"{where}: field domains.{d} holds a non-number ({exc})") from None
    if requests and sum(v.get("requests", 0) for v in out.values()) != len(requests):
        raise ReportInputError(f"{where}: field domains counts other requests than the {len(requests)} listed")
    return requests, out


def _bench_entries(doc: Any, path: Path, section: str = "batches") -> list[dict]:
    """The per-batch-size entries of a bench JSON (``{"placement": ..., "batches": [entry, ...]}``,
    as the bench stage writes it; ``section="profile_batches"`` for the profile split's numbers
    written beside), top-level scalars merged in as defaults."""
    if not isinstance(doc, dict) or not isinstance(doc.get(section), list) or not doc[section]:
        raise ReportInputError(f"{path}: expected an object with a non-empty {section!r} list")
    top = {k: v for k, v in doc.items() if k not in ("batches", "profile_batches") and not isinstance(v, (dict, list))}
    out = []
    for i, entry in enumerate(doc[section]):
        if not isinstance(entry, dict):
            raise ReportInputError(f"{path}: {section}[{i}] is not an object")
        out.append({**top, **entry})
    return out


def _bench_ceilings(doc: dict, path: Path) -> dict[str, float | None] | None:
    """The top-level ``ceilings`` object of a bench JSON: None when absent or null (CPU runs,
    older files); otherwise each of ``CEILING_FIELDS`` a number or null."""
    ceilings = doc.get("ceilings")
    if ceilings is None:
        return None
    if not isinstance(ceilings, dict):
        raise ReportInputError(f"{path}: field ceilings must be an object {{{', '.join(CEILING_FIELDS)}}} or null")
    out = {}
    for name in CEILING_FIELDS:
        value = ceilings.get(name)
        if isinstance(value, bool):
            raise ReportInputError(f"{path}: field ceilings/{name}={value!r} is not a number")
        out[name] = opt_float(value, f"{path}: field ceilings/{name}")
    return out


def load_bench(path: str | os.PathLike, section: str = "batches") -> list[BenchResult]:
    """Every batch size's measurement in one bench JSON, sorted by batch size: the published
    numbers (``batches``, on ``prompt_split``: held out by default), or with
    ``section="profile_batches"`` the profile split's beside them (``[]`` when not measured)."""
    path = Path(path)
    doc = read_json(path)
    key = _key_fields(path)
    if section != "batches" and isinstance(doc, dict) and not doc.get(section):
        return []
    entries = _bench_entries(doc, path, section)
    ceilings = _bench_ceilings(doc, path)
    provenance = doc.get("provenance")
    if provenance is not None and not isinstance(provenance, dict):
        raise ReportInputError(f"{path}: field provenance must be an object or null")
    overlap = doc.get("prompt_overlap")
    if overlap is not None and not isinstance(overlap, dict):
        raise ReportInputError(f"{path}: field prompt_overlap must be an object or null")
    results = []
    for entry in entries:
        where = f"{path} (batch_size={entry.get('batch_size', '?')})"
        require_fields(entry, REQUIRED_BENCH_FIELDS, where)
        _check_key_fields(entry, path, key["policy"], key["residency"])
        metrics: dict[str, float | None] = {}
        for name in BENCH_METRICS:
            value = entry.get(name)
            if value is None:
                metrics[name] = None
                continue
            try:
                if isinstance(value, bool):
                    raise TypeError("a boolean")
                metrics[name] = float(value)
            except (TypeError, ValueError) as exc:
                raise ReportInputError(f"{where}: field {name}={value!r} is not a number") from exc
        pred = entry.get("predicted_step_ms")
        used = set(BENCH_METRICS) | {"batch_size", "device", "dtype", "predicted_step_ms", "policy", "residency",
                                     "model"}
        results.append(
            BenchResult(
                **key,
                batch_size=int(entry["batch_size"]),
                device=str(entry["device"]),
                dtype=str(entry["dtype"]),
                metrics=metrics,
                predicted_step_ms=opt_float(pred, f"{where}: field predicted_step_ms"),
                extra={k: v for k, v in entry.items() if k not in used and not isinstance(v, (dict, list))},
                ceilings=ceilings,
                provenance=provenance,
                requests=_bench_domains(entry, where)[0],
                domains=_bench_domains(entry, where)[1],
                prompt_overlap=overlap,
            )
        )
    batch_sizes = [r.batch_size for r in results]
    if len(set(batch_sizes)) != len(batch_sizes):
        raise ReportInputError(f"{path}: batch sizes repeat ({batch_sizes})")
    return sorted(results, key=lambda r: r.batch_size)


@dataclass
class SkewRow:
    """One (phase, domain) row of ``skew.json`` (``coldset.analysis.stats.skew_stats``)."""

    phase: str
    domain: str
    selections: int | None
    mean_gini: float | None
    top_share: dict[str, float | None]  # x -> mean over layers of the top-x% share
    top_share_model_wide: dict[str, float | None]
    oracle_cache_hit_rate: float | None  # decode only


@dataclass
class SkewSummary:
    """What the report and the tracker take from ``skew.json``."""

    rows: list[SkewRow]
    xs: list[str]
    spearman_between_domains: list[dict[str, Any]]  # {phase, a, b, mean, layers_defined}
    spearman_prefill_vs_decode: dict[str, float | None]  # domain -> mean
    heldout_coverage: dict[str, dict[str, dict[str, float | None]]]  # x -> profile dom -> heldout dom
    trace: dict[str, Any]

    def row(self, phase: str, domain: str) -> SkewRow | None:
        return next((r for r in self.rows if r.phase == phase and r.domain == domain), None)


def opt_float(value: Any, where: str) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise ReportInputError(f"{where}: {value!r} is not a number") from exc


def load_skew(path: str | os.PathLike) -> SkewSummary:
    """Read ``stats/{model}/skew.json`` as written by ``coldset.analysis.stats.run_stats``:
    ``{"phases": {phase: {"domains": {name: {selections, gini: {mean}, top_share: {x:
    {mean_over_layers, model_wide}}, oracle_cache: {hit_rate}}}, "spearman_between_domains":
    [{a, b, mean, layers_defined}]}}, "spearman_prefill_vs_decode": {name: {mean}}, "coverage":
    {x: {profile_domain: {heldout_domain: value}}}, "xs": [...], "trace": {...}}``."""
    path = Path(path)
    doc = read_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("phases"), dict):
        raise ReportInputError(f"{path}: missing field phases (expected coldset.analysis.stats.skew_stats output)")
    rows: list[SkewRow] = []
    spearman_dom: list[dict[str, Any]] = []
    for phase, pdoc in doc["phases"].items():
        where = f"{path}: phases/{phase}"
        if not isinstance(pdoc, dict) or not isinstance(pdoc.get("domains"), dict):
            raise ReportInputError(f"{where}: missing field domains")
        for name, d in pdoc["domains"].items():
            w = f"{where}/domains/{name}"
            if not isinstance(d, dict) or "gini" not in d or "top_share" not in d:
                raise ReportInputError(f"{w}: missing field gini or top_share")
            gini = d["gini"]["mean"] if isinstance(d["gini"], dict) else d["gini"]
            tops = d["top_share"]
            if not isinstance(tops, dict):
                raise ReportInputError(f"{w}/top_share: expected an object keyed by x")
            oracle = d.get("oracle_cache")
            rows.append(
                SkewRow(
                    phase=str(phase),
                    domain=str(name),
                    selections=None if d.get("selections") is None else int(d["selections"]),
                    mean_gini=opt_float(gini, f"{w}/gini/mean"),
                    top_share={
                        str(x): opt_float(v.get("mean_over_layers") if isinstance(v, dict) else v, f"{w}/top_share/{x}")
                        for x, v in tops.items()
                    },
                    top_share_model_wide={
                        str(x): opt_float(v.get("model_wide"), f"{w}/top_share/{x}/model_wide")
                        for x, v in tops.items()
                        if isinstance(v, dict)
                    },
                    oracle_cache_hit_rate=opt_float(oracle.get("hit_rate"), f"{w}/oracle_cache/hit_rate")
                    if isinstance(oracle, dict)
                    else None,
                )
            )
        for pair in pdoc.get("spearman_between_domains") or []:
            spearman_dom.append(
                {
                    "phase": str(phase),
                    "a": str(pair.get("a")),
                    "b": str(pair.get("b")),
                    "mean": opt_float(pair.get("mean"), f"{where}/spearman_between_domains"),
                    "layers_defined": pair.get("layers_defined"),
                }
            )
    if not rows:
        raise ReportInputError(f"{path}: no phase/domain statistics")
    xs = [str(x) for x in doc.get("xs") or sorted({x for r in rows for x in r.top_share}, key=float)]
    pvd = {
        str(name): opt_float(v.get("mean") if isinstance(v, dict) else v, f"{path}: spearman_prefill_vs_decode/{name}")
        for name, v in (doc.get("spearman_prefill_vs_decode") or {}).items()
    }
    coverage = doc.get("coverage") or {}
    if not isinstance(coverage, dict):
        raise ReportInputError(f"{path}: field coverage must be an object {{x: {{profile: {{heldout: value}}}}}}")
    return SkewSummary(
        rows=rows,
        xs=xs,
        spearman_between_domains=spearman_dom,
        spearman_prefill_vs_decode=pvd,
        heldout_coverage=coverage,
        trace=doc.get("trace") or {},
    )


LOCALITY_FIELDS: tuple[str, ...] = ("consecutive_overlap", "shuffled_overlap", "lift", "reuse_distance")


def load_locality(path: str | os.PathLike) -> dict[str, Any]:
    """The stats stage's ``locality.json`` (``coldset.analysis.stats.locality_stats``), its fields checked:
    ``consecutive_overlap`` and ``shuffled_overlap`` hold a ``mean``, ``lift`` is a number or null."""
    path = Path(path)
    doc = read_json(path)
    if not isinstance(doc, dict):
        raise ReportInputError(f"{path}: expected a JSON object")
    require_fields(doc, LOCALITY_FIELDS, str(path))
    for name in ("consecutive_overlap", "shuffled_overlap"):
        if not isinstance(doc[name], dict) or "mean" not in doc[name]:
            raise ReportInputError(f"{path}: field {name!r} has no 'mean'")
        opt_float(doc[name]["mean"], f"{path}: field {name}.mean")
    opt_float(doc["lift"], f"{path}: field 'lift'")
    return doc


def load_simulation(path: str | os.PathLike):
    """The cache stage's ``simulation.csv`` as a DataFrame (``coldset.analysis.cache.read_simulation``, which
    owns its columns), a malformed one a :class:`ReportInputError` naming it."""
    from coldset.analysis.cache import read_simulation  # torch-heavy (the simulator's modules): only for this file
    from coldset.analysis.streams import CacheError  # with read_simulation

    try:
        return read_simulation(path)
    except CacheError as exc:
        raise ReportInputError(str(exc)) from None
