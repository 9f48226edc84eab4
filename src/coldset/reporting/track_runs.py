"""What each MLflow run of the ``track`` stage holds, read from the stage files through
:mod:`coldset.reporting.results`: one :class:`RunRecord` per (policy, residency, batch size) and
one :class:`ParentRecord` per workflow invocation of a model.

Parent run contents:

- params: model, device, dtype, config_hash, commit, version.{python,coldset,torch,triton,mlflow,
  snakemake}; on CUDA device_name and the read ceilings the bench measured (hbm_read_gb_s,
  link_read_gb_s);
- the routing trace and the fixtures as MLflow dataset inputs (name, local source, sha256 digest);
- the bench rows as an MLflow table ``bench_rows.json`` (one row per child);
- artifacts: stats/skew.json, autotune/{entry}; report/index.html and report/figures/ once the
  report stage ran (``log_report``).

Child run contents:

- params: model, policy, residency, batch_size, dtype, num_hot, num_cold;
- metrics: docs/design.md §6 names from the bench (tok_s, step_ms_mean, step_ms_p50, step_ms_p90, prefill_ms,
  hbm_expert_gib, host_expert_gib, cold_share, link_gb_per_token, hit_rate, misses_per_token,
  tok_s_per_gib, fetch_tax; hit_rate and misses_per_token as the slot cache counted them for a
  dynamic placement),
  predicted_step_ms, the bytes metrics (hbm_gb_per_token, bytes_step_ms, fraction_of_bytes_bound,
  predicted_step_ms_calibrated), the time bound (allhbm_step_ms, bound_ms, bound_fraction,
  overlap, stall_ms_per_token, simulated_step_ms, simulated_over_measured, manage_ms_per_group,
  simulated_managed_step_ms, simulated_managed_over_measured, wasted_gb_per_token; the all-HBM row's name as the tag
  allhbm_placement) and the read ceilings the bench measured in the same run
  (hbm_read_gb_s, link_read_gb_s; metrics, not params: they are remeasured on every run, and a
  changed param would replace the run); from the placement coverage_profile, coverage_heldout, achieved_residency;
  from the parity gate parity_passed (1/0), parity_tokens_matched, parity_tokens_total,
  parity_max_abs_logit_diff; from the routing statistics (decode, all domains)
  routing_gini_decode, routing_top{x}_share_decode, oracle_cache_hit_rate_decode; from the
  locality statistic (stats/locality.json) routing_consecutive_overlap_decode,
  routing_shuffled_overlap_decode, routing_overlap_lift_decode; from the cache simulation
  (cache/simulation.csv) at the run's residency cache_{policy}_hit_rate,
  cache_{policy}_misses_per_token, cache_{policy}_link_gb_per_token for every simulated policy;
- tags: coldset.run_key, mlflow.parentRunId, device, dtype, config_hash, autotune_key, plus any the
  caller passes, and
  the provenance the bench recorded on the machine that measured (provenance_tags: commit and
  mlflow.source.git.commit, dirty, torch, triton, cuda, driver, device_name, autotune hit,
  ceiling.*), never the state of the machine running track;
- artifacts: placement/{placement JSON}, parity/{parity report}, bench/{bench JSON}.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Iterable, Sequence

from coldset.bench.provenance import TAG_FIELDS
from coldset.reporting.results import (
    BENCH_METRICS,
    CEILING_FIELDS,
    ReportInputError,
    load_bench,
    load_locality,
    load_parity,
    load_placement_summary,
    load_simulation,
    load_skew,
    read_json,
)

VERSIONED_PACKAGES = ("coldset", "torch", "triton", "mlflow", "snakemake")


def canonical_residency(residency: str | float) -> str:
    """Residency as it appears in run keys and params, independent of the file-name label
    (``0.50`` and ``0.5`` are the same run): ``repr(float(r))``."""
    return repr(float(residency))


@dataclass
class RunRecord:
    """Everything one MLflow run holds; ``run_key`` identifies it across reruns."""

    model: str
    policy: str
    residency: str
    batch_size: int
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float | None] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    artifacts: dict[str, list[Path]] = field(default_factory=dict)  # artifact folder -> local files
    invocation: str = ""  # the parent's invocation id (``invocation_id``); set by ``run_track``
    row: dict[str, object] = field(default_factory=dict)  # the bench entry, for the parent's table

    @property
    def run_key(self) -> str:
        prefix = f"{self.model}@{self.invocation}" if self.invocation else self.model
        return f"{prefix}/{self.policy}/{canonical_residency(self.residency)}/{self.batch_size}"

    @property
    def run_name(self) -> str:
        return f"{self.policy}-{canonical_residency(self.residency)}-b{self.batch_size}"


def _skew_metrics(stats_json: Path) -> dict[str, float | None]:
    skew = load_skew(stats_json)
    row = skew.row("decode", "(all)")
    if row is None:
        raise ReportInputError(f"{stats_json}: no decode statistics for all domains pooled ('(all)')")
    out: dict[str, float | None] = {
        "routing_gini_decode": row.mean_gini,
        "oracle_cache_hit_rate_decode": row.oracle_cache_hit_rate,
    }
    for x, v in row.top_share.items():
        out[f"routing_top{x}_share_decode"] = v
    return out


def _locality_metrics(locality_json: Path | None) -> dict[str, float | None]:
    if locality_json is None:
        return {}
    doc = load_locality(locality_json)
    return {"routing_consecutive_overlap_decode": doc["consecutive_overlap"]["mean"],
            "routing_shuffled_overlap_decode": doc["shuffled_overlap"]["mean"],
            "routing_overlap_lift_decode": doc["lift"]}


def simulation_metrics(simulation_csv: Path | None) -> dict[str, dict[str, float | None]]:
    """canonical residency -> {cache_{policy}_{metric}: value} from the cache simulation."""
    if simulation_csv is None:
        return {}
    out: dict[str, dict[str, float | None]] = {}
    table = load_simulation(simulation_csv)
    # one row per batch size too; the unsuffixed names keep the smallest batch's counts and
    # every batch's counts and simulated time are named cache_{policy}_b{batch}_{metric}
    first = int(table["batch"].min()) if "batch" in table.columns else 1
    timed = [c for c in ("step_ms", "bound_ms", "bound_fraction", "overlap", "stall_ms_per_token",
                         "wasted_gb_per_token") if c in table.columns]
    for row in table.itertuples():
        m = out.setdefault(canonical_residency(row.residency), {})
        batch = int(getattr(row, "batch", 1))
        for name in ("hit_rate", "misses_per_token", "link_gb_per_token"):
            if batch == first:
                m[f"cache_{row.policy}_{name}"] = float(getattr(row, name))
            if timed:
                m[f"cache_{row.policy}_b{batch}_{name}"] = float(getattr(row, name))
        for name in timed:
            value = float(getattr(row, name))
            m[f"cache_{row.policy}_b{batch}_{name}"] = None if math.isnan(value) else value
    return out


def _autotune_key(autotune_jsons: Sequence[Path]) -> str | None:
    keys = []
    for path in autotune_jsons:
        doc = read_json(path)
        if not isinstance(doc, dict) or "key" not in doc:
            raise ReportInputError(f"{path}: missing field key")
        keys.append(str(doc["key"]))
    return ",".join(sorted(set(keys))) if keys else None


def provenance_tags(provenance: dict | None) -> dict[str, str]:
    """MLflow tags from a bench JSON's ``provenance`` (:mod:`coldset.bench.provenance`): the state of the
    machine and code that *measured*, never of the machine running ``track``. ``commit`` is also
    ``mlflow.source.git.commit``. A bench file without provenance gets ``provenance: missing``."""
    if not provenance:
        return {"provenance": "missing"}
    tags = {f"{name}": str(provenance[name]).lower() if isinstance(provenance[name], bool) else str(provenance[name])
            for name in TAG_FIELDS if provenance.get(name) is not None}
    for name, value in (provenance.get("ceilings") or {}).items():
        tags[f"ceiling.{name}"] = f"{value:.6g}" if isinstance(value, (int, float)) else str(value)
    if "commit" in tags:
        tags["mlflow.source.git.commit"] = tags["commit"]
    # The bench's own device name wins over the provenance's generic one only where it has none.
    tags["device_name"] = tags.pop("device", "unknown")
    return tags


def _opt_number(value) -> float | None:
    return None if value is None or isinstance(value, bool) else float(value)


def records_from_results(
    bench_jsons: Iterable[str | os.PathLike],
    parity_jsons: Iterable[str | os.PathLike],
    placement_jsons: Iterable[str | os.PathLike],
    stats_json: str | os.PathLike,
    autotune_jsons: Iterable[str | os.PathLike] = (),
    locality_json: str | os.PathLike | None = None,
    simulation_csv: str | os.PathLike | None = None,
) -> list[RunRecord]:
    """One ``RunRecord`` per (bench placement, batch size), joined with that placement's parity
    report and placement JSON by ``(model, policy, residency)`` from the file names. A bench
    result without its parity report or placement is an error naming the missing one."""
    stats_json = Path(stats_json)
    skew_metrics = _skew_metrics(stats_json)
    skew_metrics.update(_locality_metrics(None if locality_json is None else Path(locality_json)))
    cache_metrics = simulation_metrics(None if simulation_csv is None else Path(simulation_csv))
    autotune_paths = [Path(p) for p in autotune_jsons]
    autotune_key = _autotune_key(autotune_paths)

    def by_key(paths, loader):
        out = {}
        for p in paths:
            item = loader(p)
            key = (item.model, item.policy, canonical_residency(item.residency))
            if key in out:
                raise ReportInputError(f"{p}: same placement as {out[key].path}")
            out[key] = item
        return out

    parity = by_key(parity_jsons, load_parity)
    placements = by_key(placement_jsons, load_placement_summary)
    records: list[RunRecord] = []
    for bench_path in bench_jsons:
        for b in load_bench(bench_path):
            key = (b.model, b.policy, canonical_residency(b.residency))
            if key not in parity:
                raise ReportInputError(f"{b.path}: no parity report for {'/'.join(key)} among the parity inputs")
            if key not in placements:
                raise ReportInputError(f"{b.path}: no placement JSON for {'/'.join(key)} among the placement inputs")
            par, pl = parity[key], placements[key]
            metrics: dict[str, float | None] = {m: b.metrics[m] for m in BENCH_METRICS}
            metrics["predicted_step_ms"] = b.predicted_step_ms
            for name in CEILING_FIELDS:
                metrics[name] = None if b.ceilings is None else b.ceilings.get(name)
            metrics.update(
                coverage_profile=pl.coverage_profile,
                coverage_heldout=pl.coverage_heldout,
                achieved_residency=pl.achieved_residency,
                parity_passed=1.0 if par.passed else 0.0,
                parity_tokens_matched=float(par.tokens_matched),
                parity_tokens_total=float(par.tokens_total),
                parity_max_abs_logit_diff=par.max_abs_logit_diff,
            )
            metrics.update(skew_metrics)
            metrics.update(cache_metrics.get(canonical_residency(b.residency), {}))
            tags = {"device": b.device, "dtype": b.dtype, "model": b.model, **provenance_tags(b.provenance)}
            metrics["timed_token_match"] = _opt_number(b.extra.get("timed_token_match"))
            run_autotune = b.extra.get("autotune_key") or autotune_key
            if run_autotune:
                tags["autotune_key"] = str(run_autotune)
            if b.extra.get("allhbm_placement"):  # the reference of the time bound's metrics
                tags["allhbm_placement"] = str(b.extra["allhbm_placement"])
            # per-invocation files (skew.json, the autotune entry) go to the parent run
            artifacts = {"placement": [pl.path], "parity": [par.path], "bench": [b.path]}
            records.append(
                RunRecord(
                    model=b.model,
                    policy=b.policy,
                    residency=b.residency,
                    batch_size=b.batch_size,
                    params={
                        "model": b.model,
                        "policy": b.policy,
                        "residency": canonical_residency(b.residency),
                        "batch_size": str(b.batch_size),
                        "dtype": b.dtype,
                        "num_hot": str(pl.num_hot),
                        "num_cold": str(pl.num_cold),
                    },
                    metrics=metrics,
                    tags=tags,
                    artifacts=artifacts,
                    row={"placement": f"{b.policy}-{b.residency}", "policy": b.policy,
                         "residency": float(b.residency), "batch_size": b.batch_size, "device": b.device,
                         "dtype": b.dtype, "num_hot": pl.num_hot, "num_cold": pl.num_cold,
                         **{m: metrics[m] for m in BENCH_METRICS}},
                )
            )
    keys = [r.run_key for r in records]
    if len(set(keys)) != len(keys):
        raise ReportInputError(f"bench inputs repeat a run key: {sorted(k for k in keys if keys.count(k) > 1)}")
    return records


def records_from_placements(
    placement_jsons: Iterable[str | os.PathLike], stats_json: str | os.PathLike,
    locality_json: str | os.PathLike | None = None, simulation_csv: str | os.PathLike | None = None,
) -> list[RunRecord]:
    """For a model that is not decoded (a shape-only model: config.json and a trace), one
    ``RunRecord`` per (placement, predicted batch size) with the placement's coverage and the speed
    model's prediction (``predicted_step_ms`` = the first preset's perfect-overlap step, its fastest
    case, so the tok/s it implies is an upper estimate; per preset ``predicted_step_ms_{preset}``
    and the no-overlap ``predicted_step_ms_sum_{preset}``) instead of measurements."""
    stats_json = Path(stats_json)
    skew_metrics = _skew_metrics(stats_json)
    skew_metrics.update(_locality_metrics(None if locality_json is None else Path(locality_json)))
    cache_metrics = simulation_metrics(None if simulation_csv is None else Path(simulation_csv))
    records: list[RunRecord] = []
    for path in placement_jsons:
        pl = load_placement_summary(path)
        for bs in sorted({p["batch_size"] for p in pl.predictions}) or [0]:
            preds = [p for p in pl.predictions if p["batch_size"] == bs]
            metrics: dict[str, float | None] = {
                "coverage_profile": pl.coverage_profile, "coverage_heldout": pl.coverage_heldout,
                "achieved_residency": pl.achieved_residency, "hbm_expert_gib": pl.hbm_expert_gib,
                "host_expert_gib": pl.host_expert_gib,
                "predicted_step_ms": preds[0]["step_ms_lower"] if preds else None,
            }
            for p in preds:
                metrics[f"predicted_step_ms_{p['preset']}"] = p["step_ms_lower"]
                metrics[f"predicted_step_ms_sum_{p['preset']}"] = p["step_ms_sum"]
            metrics.update(skew_metrics)
            metrics.update(cache_metrics.get(canonical_residency(pl.residency), {}))
            records.append(RunRecord(
                model=pl.model, policy=pl.policy, residency=pl.residency, batch_size=bs,
                params={"model": pl.model, "policy": pl.policy, "residency": canonical_residency(pl.residency),
                        "batch_size": str(bs), "num_hot": str(pl.num_hot), "num_cold": str(pl.num_cold)},
                metrics=metrics, tags={"decoded": "false"},
                artifacts={"placement": [pl.path], "stats": [stats_json]},
                row={"placement": f"{pl.policy}-{pl.residency}", "policy": pl.policy,
                     "residency": float(pl.residency), "batch_size": bs, "num_hot": pl.num_hot,
                     "num_cold": pl.num_cold, **metrics},
            ))
    return records



def invocation_id(config_hash: str, results_dir: str | os.PathLike) -> str:
    """What identifies one workflow invocation of a model: the config hash and the results folder
    (absolute). Rerunning in the same folder with the same config updates its runs (idempotent);
    another config or another results tree (a colleague's, on a shared server) is another parent,
    so two trees never overwrite each other's runs."""
    folder = hashlib.sha256(str(Path(results_dir).resolve()).encode()).hexdigest()[:8]
    return f"{config_hash}-{folder}"


def software_versions() -> dict[str, str]:
    """``version.{package}`` params of the process that tracks (``absent`` where not installed)
    and ``version.python``; the GPU stack the bench ran on is pinned by the autotune key tag."""
    out = {"version.python": ".".join(map(str, sys.version_info[:3]))}
    for pkg in VERSIONED_PACKAGES:
        try:
            out[f"version.{pkg}"] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[f"version.{pkg}"] = "absent"
    return out


@dataclass
class DatasetRef:
    """A file recorded as an MLflow dataset input of the parent run (name, context, digest)."""

    name: str
    path: Path
    context: str  # mlflow.data.context: "routing" for the trace, "fixtures" for prompts


@dataclass
class ParentRecord:
    """The parent run of one invocation: what is common to its children, the bench table, the
    per-invocation files and the datasets it read."""

    model: str
    invocation: str
    params: dict[str, str]
    tags: dict[str, str] = field(default_factory=dict)
    artifacts: dict[str, list[Path]] = field(default_factory=dict)
    datasets: list[DatasetRef] = field(default_factory=list)
    rows: list[dict[str, object]] = field(default_factory=list)  # the bench table, one row per child

    @property
    def run_key(self) -> str:
        return f"{self.model}@{self.invocation}"

    @property
    def run_name(self) -> str:
        return f"{self.model} ({self.invocation})"


def parent_record(
    records: Sequence[RunRecord],
    invocation: str,
    tags: dict[str, str],
    stats_json: str | os.PathLike,
    autotune_jsons: Sequence[str | os.PathLike] = (),
    datasets: Sequence[DatasetRef] = (),
) -> ParentRecord:
    """The parent of ``records`` (one model, one invocation). Params: model, device, dtype, config
    hash, commit, software versions; on CUDA also the device name and the read ceilings the bench
    measured (``hbm_read_gb_s``, ``link_read_gb_s``). Children disagreeing on any of these is an
    error: they come from one bench job."""
    if not records:
        raise ReportInputError("no bench results to track")
    models = {r.model for r in records}
    if len(models) != 1:
        raise ReportInputError(f"bench inputs hold several models {sorted(models)}; track one model per invocation")

    def one(field_name: str, values: set) -> str:
        if len(values) != 1:
            raise ReportInputError(f"bench inputs disagree on {field_name}: {sorted(map(str, values))}")
        return str(next(iter(values)))

    # a model that is not decoded (records_from_placements) ran on no device
    device = one("device", {r.tags.get("device", "none") for r in records})
    params = {
        "model": records[0].model,
        "device": device,
        "dtype": one("dtype", {r.tags.get("dtype", "none") for r in records}),
        "config_hash": str(tags.get("config_hash", "unknown")),
        "commit": str(tags.get("commit", "unknown")),
        **software_versions(),
    }
    if device not in ("cpu", "none"):  # a CUDA bench names the GPU (torch.cuda.get_device_name) and measures ceilings
        params["device_name"] = device
        for name in CEILING_FIELDS:
            vals = {r.metrics.get(name) for r in records}
            value = one(name, vals)
            if value != "None":
                params[name] = value
    artifacts: dict[str, list[Path]] = {"stats": [Path(stats_json)]}
    if autotune_jsons:
        artifacts["autotune"] = [Path(p) for p in autotune_jsons]
    return ParentRecord(
        model=records[0].model,
        invocation=invocation,
        params=params,
        tags={k: str(v) for k, v in tags.items() if v is not None},
        artifacts=artifacts,
        datasets=list(datasets),
        rows=[r.row for r in records],
    )
