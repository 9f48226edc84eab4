"""MLflow sink: one parent run per workflow invocation of a model, one child run per (policy,
residency, batch size), idempotent across reruns.

MLflow is where people compare runs (``mlflow ui --backend-store-uri sqlite:///$PWD/results/
mlflow.db``, then the shared views :data:`VIEWS`: tok/s per GiB where a GPU measured, coverage
and hit rates on the CPU); it is never a dependency of a computing stage, so it is imported only
inside the functions here and ``import coldset.reporting.track`` works without it.

Run times: a run starts when the track job creates it and ends when that job has logged it. A
later job that updates it (a rerun) leaves both: MLflow cannot move a run's start, and a second
end would stretch the run over the time between the two jobs.

Store: by default SQLite under results/ with an absolute URI (``default_tracking_uri``), created
with its experiment by ``ensure_store`` in the track stage: built beside and renamed into place
under a lock (six processes creating a fresh SQLite store at once fail in the schema migration;
parallel writers to an existing one are fine), and a half-made store is rebuilt with a warning.
``tracking.uri`` in the config may name any tracking server instead (a team's ``mlflow server`` on
PostgreSQL, README). The experiment is tagged ``mlflow.experimentKind = custom_model_development``.

Runs. An *invocation* is (config hash, absolute results folder) (``invocation_id``): the parent
run's key is ``{model}@{invocation}``, a child's ``{model}@{invocation}/{policy}/{residency}/
{batch_size}``. Two result trees (two colleagues on one server) are two parents and never
overwrite each other's children; rerunning in the same tree updates the same runs. A model that
is not decoded (shape-only) has children from its placements' predictions
(``records_from_placements``).

Idempotency: MLflow does not let users choose run ids, so each run carries the tag
``coldset.run_key``, searched before a run is created. A rerun updates that run: new tags
overwrite, only metrics whose value changed get a new (later-timestamped) point, so the run shows
the new value as its latest. Parameters are immutable in MLflow: if a rerun brings a different
value for one (the placement changed under a child's key; a new commit, software versions or
remeasured ceilings under the parent's), the old run is deleted and a fresh one created, so there
is still exactly one active run per key (children then point at the new parent). Duplicates left
by an earlier race are deleted, keeping the oldest.

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
- metrics: DESIGN.md §6 names from the bench (tok_s, step_ms_mean, step_ms_p50, step_ms_p90, prefill_ms,
  hbm_expert_gib, host_expert_gib, cold_share, link_gb_per_token, hit_rate, misses_per_token,
  tok_s_per_gib, fetch_tax; hit_rate and misses_per_token as the slot cache counted them for a
  dynamic placement),
  predicted_step_ms, the bytes metrics (hbm_gb_per_token, bytes_step_ms, fraction_of_bytes_bound,
  predicted_step_ms_calibrated), issue 28's time bound (allhbm_step_ms, bound_ms, bound_fraction,
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

A metric undefined for a run (tok_s_per_gib at a policy's smallest residency, for one; the bytes
metrics and ceilings of a CPU run) is not logged; if the run had a value for it from an earlier
run, NaN is logged so it does not keep showing a stale number.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from coldset.core.files import write_json
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

RUN_KEY_TAG = "coldset.run_key"
DEFAULT_DB_NAME = "mlflow.db"
ARTIFACT_DIR_NAME = "mlartifacts"


class TrackingError(RuntimeError):
    """The tracking store or a run could not be written as asked."""


# ----------------------------------------------------------------------------------------------
# Store
# ----------------------------------------------------------------------------------------------


def default_tracking_uri(results_dir: str | os.PathLike = "results") -> str:
    """``sqlite:////abs/path/results/mlflow.db``: one absolute URI for every rule and the UI
    (a relative SQLite URI resolves against each process's working directory)."""
    return "sqlite:///" + str((Path(results_dir) / DEFAULT_DB_NAME).resolve())


def _sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, else None (a server or another database)."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    path = tracking_uri[len(prefix):]
    if not path or path == ":memory:":
        return None
    return Path(path if path.startswith("/") else path)


def _client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


STORE_LOCK_SUFFIX = ".lock"


@contextlib.contextmanager
def _store_lock(db: Path):
    """An exclusive lock beside the SQLite store: one process creates or heals it at a time."""
    import fcntl

    with open(db.with_name(db.name + STORE_LOCK_SUFFIX), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _store_runs(db: Path) -> int | None:
    """Rows in the store's ``runs`` table; None when the file has no such table or is no database."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            return int(con.execute("SELECT COUNT(*) FROM runs").fetchone()[0])
        finally:
            con.close()
    except sqlite3.Error:
        return None


def _store_error(db: Path) -> Exception | None:
    """Why MLflow would refuse the SQLite store ``db`` (tables missing, a half-migrated schema, not
    a database), or None. Checked on a fresh engine: MLflow checks a store once per process."""
    import sqlalchemy
    from mlflow.store.db import utils as db_utils

    engine = sqlalchemy.create_engine(f"sqlite:///{db}")
    try:
        if not db_utils._all_tables_exist(engine):
            return RuntimeError("MLflow's tables are missing")
        db_utils._verify_schema(engine)
    except Exception as exc:  # MLflow, SQLAlchemy and sqlite3 each raise their own kinds
        return exc
    finally:
        engine.dispose()
    return None


def _forget_cached_store(tracking_uri: str) -> None:
    """MLflow keeps one engine and one store per URI in a process; once the file under the URI is
    replaced they would keep using the old one, so drop them (no-op where MLflow has none)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.tracking._tracking_service import utils as service_utils

    engine = getattr(SqlAlchemyStore, "_engine_map", {}).pop(tracking_uri, None)
    if engine is not None:
        engine.dispose()
    get_store = getattr(getattr(service_utils, "_tracking_store_registry", None), "get_store", None)
    if hasattr(get_store, "cache_clear"):
        get_store.cache_clear()


def _build_store(db: Path, experiment: str, artifact_location: str) -> None:
    """Create a fresh store beside ``db``, then rename it into place: ``db`` is whole or absent."""
    tmp = db.with_name(f".{db.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        client = _client("sqlite:///" + str(tmp))
        client.create_experiment(experiment, artifact_location=artifact_location)
        _forget_cached_store("sqlite:///" + str(tmp))  # close the temporary file's connections first
        os.replace(tmp, db)
    finally:
        tmp.unlink(missing_ok=True)


def _ensure_sqlite_store(db: Path, tracking_uri: str, experiment: str, artifact_location: str) -> None:
    """Create the SQLite store atomically under a lock; heal a half-made one.

    A creation interrupted by a full disk, a SIGKILL or a second process migrating the same fresh
    file leaves a store MLflow cannot open ("table ... already exists", "out-of-date database
    schema") and that holds no runs: it is moved aside (kept, named in the warning) and rebuilt. A
    store that MLflow cannot open but that holds runs is never touched: that is an error naming it.
    Temporary stores of killed creators (``.mlflow.db.*.tmp``) are removed.
    """
    db.parent.mkdir(parents=True, exist_ok=True)
    with _store_lock(db):
        for orphan in db.parent.glob(f".{db.name}.*.tmp"):
            orphan.unlink(missing_ok=True)  # we hold the lock: no other creator is writing it
        if db.exists():
            error = _store_error(db)
            if error is not None:
                runs = _store_runs(db)
                if runs:
                    raise TrackingError(f"MLflow store {db} cannot be opened ({str(error).splitlines()[0]}) and "
                                        f"holds {runs} runs; it is left as it is: back it up, then "
                                        f"'mlflow db upgrade sqlite:///{db}' or move it away")
                aside = db.with_name(f"{db.name}.broken-{time.strftime('%Y%m%dT%H%M%S')}")
                os.replace(db, aside)
                warnings.warn(f"MLflow store {db} was half-made ({str(error).splitlines()[0]}) and holds no runs; "
                              f"moved it to {aside} and building a new one")
        if not db.exists():
            _build_store(db, experiment, artifact_location)
            _forget_cached_store(tracking_uri)


def ensure_store(tracking_uri: str, experiment: str) -> str:
    """Create (or find) the tracking store and the experiment; returns the experiment id.

    For a SQLite URI the database's folder is created, the store is created atomically under a
    lock and a half-made one is healed (``_ensure_sqlite_store``), and the experiment's artifacts
    go to ``mlartifacts/`` beside the database (absolute ``file://`` location), so the results
    folder holds everything. For a tracking server the server decides where artifacts go. Called
    by the ``track`` stage itself (never at workflow start: stages that do not log to MLflow must
    not fail on it); safe to call again and from a process racing another one.
    """
    from mlflow.exceptions import MlflowException

    db = _sqlite_path(tracking_uri)
    artifact_location = None
    if db is not None:
        if not db.is_absolute():
            raise TrackingError(f"tracking URI {tracking_uri!r}: use an absolute SQLite path (sqlite:////abs/path)")
        artifact_location = (db.parent / ARTIFACT_DIR_NAME / experiment).as_uri()
        _ensure_sqlite_store(db, tracking_uri, experiment, artifact_location)
    client = _client(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        try:
            return client.create_experiment(experiment, artifact_location=artifact_location)
        except MlflowException as exc:  # created meanwhile by another process
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                raise TrackingError(f"cannot create experiment {experiment!r} in {tracking_uri}: {exc}") from exc
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    return exp.experiment_id


def done_is_stale(done_path: str | os.PathLike) -> str | None:
    """Why the track stage's ``done`` file no longer holds (its SQLite store was deleted), or None.

    The Snakefile asks this before building the DAG and dates a stale done file back to 1970
    (older than its inputs), so that ``snakemake report`` recreates the runs after ``mlflow.db``
    was deleted.
    """
    import json

    try:
        doc = json.loads(Path(done_path).read_text())
    except (OSError, ValueError):
        return None
    db = _sqlite_path(str(doc.get("tracking_uri", ""))) if isinstance(doc, dict) else None
    if db is not None and not db.exists():
        return f"its MLflow store {db} no longer exists"
    return None


# ----------------------------------------------------------------------------------------------
# Records
# ----------------------------------------------------------------------------------------------


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


def _cache_metrics(simulation_csv: Path | None) -> dict[str, dict[str, float | None]]:
    """canonical residency -> {cache_{policy}_{metric}: value} from the cache simulation."""
    if simulation_csv is None:
        return {}
    out: dict[str, dict[str, float | None]] = {}
    table = load_simulation(simulation_csv)
    # issue 28: one row per batch size too; the legacy names keep the smallest batch's counts and
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
    from coldset.bench.provenance import TAG_FIELDS

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
    cache_metrics = _cache_metrics(None if simulation_csv is None else Path(simulation_csv))
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
    cache_metrics = _cache_metrics(None if simulation_csv is None else Path(simulation_csv))
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


# ----------------------------------------------------------------------------------------------
# The parent run: one per workflow invocation of a model
# ----------------------------------------------------------------------------------------------

# MLflow 3 records an experiment's kind in this tag. The 3.17 UI, though, takes the kind from its
# global GenAI / machine-learning switch (the sidebar, remembered per browser, default GenAI, which
# opens an experiment on its traces overview) or from the URL's ``workflowType``: the links we
# hand out (``experiment_link``, ``view_link``) carry workflowType=machine_learning.
UI_WORKFLOW = "workflowType=machine_learning"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
BENCH_TABLE = "bench_rows.json"
VERSIONED_PACKAGES = ("coldset", "torch", "triton", "mlflow", "snakemake")


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
    from importlib import metadata

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


# ----------------------------------------------------------------------------------------------
# Logging
# ----------------------------------------------------------------------------------------------


def _find_runs(client, experiment_id: str, run_key: str):
    from mlflow.entities import ViewType

    if "'" in run_key or "\\" in run_key:
        raise TrackingError(f"run key {run_key!r} holds a quote or backslash")
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'",
        run_view_type=ViewType.ACTIVE_ONLY,
        max_results=100,
        order_by=["attributes.start_time ASC"],
    )
    return list(runs)


def _same_float(a: float, b: float) -> bool:
    if math.isnan(a) and math.isnan(b):
        return True
    return a == b


def mark_experiment_kind(client, experiment_id: str) -> None:
    """Record the experiment's kind (custom model development: runs, not GenAI traces) in MLflow's
    own tag. Two trackers racing to set it is harmless."""
    exp = client.get_experiment(experiment_id)
    if exp.tags.get(EXPERIMENT_KIND_TAG) == EXPERIMENT_KIND:
        return
    try:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    except Exception:  # a concurrent tracker inserted the same tag first
        if client.get_experiment(experiment_id).tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
            raise


# The README's comparisons, saved in the experiment as shared views of its runs table. Both filter
# on batch size 1, which also lists the children flat (the UI nests children under a collapsed
# parent only without a filter or sort), and pick their columns, so the headline numbers show
# without a click. Speed: where one more GiB of experts in HBM buys the most decode speed (measured
# with a host tier, a GPU). Coverage: on the CPU measured speed compares nothing (coldset.core.timing),
# so which experts each placement keeps: coverage of the profiled and held-out traffic, the slot
# cache's hit rate and the cache simulation's.
SHARED_VIEW_TAG_PREFIX = "mlflow.sharedViewState."
SPEED_VIEW = "coldset-speed"
COVERAGE_VIEW = "coldset-coverage"
_COMMON_COLUMNS = ("params.`policy`", "params.`residency`", "params.`batch_size`", "metrics.`hbm_expert_gib`")
VIEWS: dict[str, dict] = {
    SPEED_VIEW: {
        "searchFilter": "params.batch_size = '1'",
        "orderByKey": "metrics.`tok_s_per_gib`",
        "orderByAsc": False,
        "selectedColumns": [*_COMMON_COLUMNS, "metrics.`tok_s`", "metrics.`tok_s_per_gib`", "metrics.`fetch_tax`",
                            "metrics.`bound_fraction`", "metrics.`overlap`"],
    },
    COVERAGE_VIEW: {
        "searchFilter": "params.batch_size = '1'",
        "orderByKey": "metrics.`coverage_heldout`",
        "orderByAsc": False,
        "selectedColumns": [*_COMMON_COLUMNS, "metrics.`coverage_profile`", "metrics.`coverage_heldout`",
                            "metrics.`hit_rate`", "metrics.`cache_static_hit_rate`", "metrics.`cache_lru_hit_rate`"],
    },
}


def view_link(experiment_id: str, view: str) -> str:
    """The UI route that opens the experiment's runs table in the shared view ``view``."""
    return f"#/experiments/{experiment_id}/runs?{UI_WORKFLOW}&viewStateShareKey={view}"


def headline_view(records: Sequence[RunRecord]) -> str:
    """The view whose columns these runs fill: speed where a bench measured with a host tier
    (:func:`coldset.core.timing.speed_compares_placements`), coverage otherwise (a CPU bench, or a
    model that is not decoded)."""
    from coldset.core.timing import speed_compares_placements

    measured = [r.tags.get("device") for r in records if r.tags.get("decoded") != "false"]
    return SPEED_VIEW if any(d and speed_compares_placements(d) for d in measured) else COVERAGE_VIEW


def share_views(client, experiment_id: str) -> dict[str, str]:
    """Save :data:`VIEWS` in the experiment the way the UI's "Share" does (an experiment tag
    ``mlflow.sharedViewState.<key>`` holding the view state as JSON); returns view -> UI route."""
    import json

    for view, state in VIEWS.items():
        tag = SHARED_VIEW_TAG_PREFIX + view
        value = json.dumps(state)
        if client.get_experiment(experiment_id).tags.get(tag) != value:
            try:
                client.set_experiment_tag(experiment_id, tag, value)
            except Exception:  # a concurrent tracker wrote it first
                if client.get_experiment(experiment_id).tags.get(tag) != value:
                    raise
    return {view: view_link(experiment_id, view) for view in VIEWS}


def _upsert_run(client, experiment_id: str, key: str, run_name: str, params: dict[str, str],
                metrics: dict[str, float | None], tags: dict[str, str]) -> tuple[str, bool]:
    """Find the run of ``key`` (deleting duplicates an earlier race left, keeping the oldest) or
    create it; replace it when a param changed (params are immutable in MLflow); log the params it
    lacks, the metrics whose value changed (NaN over a value that became undefined) and the tags.
    Returns the run id and whether the run still needs its end (:func:`_finish`)."""
    import time

    from mlflow.entities import Metric, Param, RunTag

    found = _find_runs(client, experiment_id, key)
    for dup in found[1:]:
        warnings.warn(f"MLflow: deleting duplicate run {dup.info.run_id} for {key} (keeping the oldest)")
        client.delete_run(dup.info.run_id)
    run = found[0] if found else None
    if run is not None:
        conflicts = {k: (run.data.params[k], v) for k, v in params.items() if k in run.data.params and run.data.params[k] != v}
        if conflicts:
            warnings.warn(
                f"MLflow: run {run.info.run_id} ({key}) has different params {conflicts} (old, new); "
                "params are immutable, so it is replaced by a new run"
            )
            client.delete_run(run.info.run_id)
            run = None
    if run is None:
        run = client.create_run(experiment_id, run_name=run_name, tags={RUN_KEY_TAG: key})
    run_id = run.info.run_id
    old_params, old_metrics = run.data.params, run.data.metrics

    now = int(time.time() * 1000)
    new_metrics = []
    for name, value in metrics.items():
        if value is None:
            if name in old_metrics and not math.isnan(old_metrics[name]):
                new_metrics.append(Metric(name, float("nan"), now, 0))
            continue
        value = float(value)
        if name in old_metrics and _same_float(old_metrics[name], value):
            continue
        new_metrics.append(Metric(name, value, now, 0))
    new_params = [Param(k, v) for k, v in params.items() if k not in old_params]
    all_tags = {**tags, RUN_KEY_TAG: key, "mlflow.runName": run_name}
    client.log_batch(run_id, metrics=new_metrics, params=new_params, tags=[RunTag(k, v) for k, v in all_tags.items()])
    return run_id, run.info.end_time is None or run.info.status != "FINISHED"


def _finish(client, run_id: str, open_: bool) -> None:
    """End a run this job created (or one a killed job left open) now. A run an earlier job
    finished keeps its start and end: MLflow cannot move a run's start, so ending it again would
    stretch its duration over the time between the two jobs (a re-track 25 minutes later read as a
    25-minute run); its updated values carry their own timestamps."""
    if open_:
        client.set_terminated(run_id, "FINISHED")


def _log_files(client, run_id: str, key: str, artifacts: dict[str, list[Path]]) -> None:
    for folder, paths in artifacts.items():
        for p in paths:
            if not Path(p).is_file():
                raise ReportInputError(f"missing artifact for {key}: {p}")
            client.log_artifact(run_id, str(p), artifact_path=folder)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _log_datasets(client, run_id: str, datasets: Sequence[DatasetRef]) -> None:
    """Record each file as an MLflow dataset input (name, local source, content digest; the data
    is not copied). MLflow reuses a dataset of the same name and digest in the experiment, and a
    run's existing input link, so a rerun adds nothing; a tracker racing another one to insert the
    same dataset retries once, when it exists."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    inputs = []
    for ref in datasets:
        path = Path(ref.path)
        if not path.is_file():
            raise ReportInputError(f"missing dataset file {path} ({ref.name})")
        ds = MetaDataset(source=resolve_dataset_source(str(path.resolve())), name=ref.name, digest=_file_digest(path))
        inputs.append(DatasetInput(dataset=ds._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, ref.context)]))
    if not inputs:
        return
    try:
        client.log_inputs(run_id, datasets=inputs)
    except Exception:
        client.log_inputs(run_id, datasets=inputs)


def _log_table_replacing(client, run_id: str, rows: list[dict[str, object]], artifact_file: str) -> None:
    """The bench rows as an MLflow table artifact. ``MlflowClient.log_table`` appends to an
    existing table, which would duplicate rows on every rerun: the first time it logs through
    ``log_table``; later, an unchanged table is left alone and a changed one is rewritten in
    ``log_table``'s own format (pandas ``orient="split"``) over the old file."""
    import tempfile

    import pandas as pd

    df = pd.DataFrame(rows)
    existing = {f.path for f in client.list_artifacts(run_id)}
    if artifact_file not in existing:
        client.log_table(run_id, data=df, artifact_file=artifact_file)
        return
    with tempfile.TemporaryDirectory() as tmp:
        old = pd.read_json(client.download_artifacts(run_id, artifact_file, tmp), orient="split")
        new_path = Path(tmp) / "new" / artifact_file
        new_path.parent.mkdir(parents=True)
        df.to_json(new_path, orient="split", index=False, date_format="iso")
        if old.equals(pd.read_json(new_path, orient="split")):
            return
        client.log_artifact(run_id, str(new_path))


@dataclass
class TrackedRuns:
    experiment_id: str
    parent_id: str | None
    run_ids: list[str]  # the children, in record order
    comparison_view: str  # UI route of the README's comparison that fits these runs (``headline_view``)
    views: dict[str, str] = field(default_factory=dict)  # every shared view -> its UI route


def log_runs(
    tracking_uri: str,
    experiment: str,
    records: Sequence[RunRecord],
    tags: dict[str, str] | None = None,
    artifacts: Sequence[str | os.PathLike] = (),
    parent: ParentRecord | None = None,
) -> "TrackedRuns":
    """Create or update one run per record; returns the experiment id, the parent's run id and
    the children's run ids in record order.

    With ``parent``, its run is created or updated first and every record becomes its child
    (``mlflow.parentRunId``). ``tags`` are added to
    every run (commit, config_hash, ...), ``artifacts`` are logged to every child under
    ``common/``. See the module docstring for how reruns update instead of duplicating.
    """
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    experiment_id = ensure_store(tracking_uri, experiment)
    client = _client(tracking_uri)
    mark_experiment_kind(client, experiment_id)
    views = share_views(client, experiment_id)
    common_tags = {str(k): str(v) for k, v in (tags or {}).items() if v is not None}
    if "commit" in common_tags:
        common_tags.setdefault("mlflow.source.git.commit", common_tags["commit"])
    common_artifacts = [Path(a) for a in artifacts]
    for a in common_artifacts:
        if not a.is_file():
            raise ReportInputError(f"missing artifact: {a}")

    parent_id = None
    if parent is not None:
        parent_id, parent_open = _upsert_run(client, experiment_id, parent.run_key, parent.run_name, parent.params,
                                             {}, {**common_tags, **parent.tags})
        _log_files(client, parent_id, parent.run_key, parent.artifacts)
        _log_datasets(client, parent_id, parent.datasets)
        _log_table_replacing(client, parent_id, parent.rows, BENCH_TABLE)

    run_ids = []
    for rec in _progress(records, "mlflow runs"):
        key = rec.run_key
        run_tags = {**common_tags, **rec.tags}
        if parent_id is not None:
            run_tags[MLFLOW_PARENT_RUN_ID] = parent_id
        run_id, run_open = _upsert_run(client, experiment_id, key, rec.run_name, rec.params, rec.metrics, run_tags)
        _log_files(client, run_id, key, rec.artifacts)
        for p in common_artifacts:
            client.log_artifact(run_id, str(p), artifact_path="common")
        _finish(client, run_id, run_open)
        run_ids.append(run_id)
    if parent_id is not None:
        _finish(client, parent_id, parent_open)
    return TrackedRuns(experiment_id=experiment_id, parent_id=parent_id, run_ids=run_ids,
                       comparison_view=views[headline_view(records)], views=views)


def _progress(items: Sequence, desc: str):
    from tqdm import tqdm

    return tqdm(items, desc=desc, file=sys.stderr, disable=len(items) < 2)


def experiment_link(experiment_id: str) -> str:
    """The UI route that opens the experiment on its runs table (append to the server's address)."""
    return f"#/experiments/{experiment_id}?{UI_WORKFLOW}"


def run_track(
    bench_jsons: Iterable[str | os.PathLike],
    parity_jsons: Iterable[str | os.PathLike],
    placement_jsons: Iterable[str | os.PathLike],
    stats_json: str | os.PathLike,
    tracking_uri: str,
    experiment: str,
    tags: dict[str, str] | None,
    done_path: str | os.PathLike,
    autotune_jsons: Iterable[str | os.PathLike] = (),
    locality_json: str | os.PathLike | None = None,
    simulation_csv: str | os.PathLike | None = None,
    datasets: Sequence[DatasetRef] = (),
    results_dir: str | os.PathLike | None = None,
) -> list[str]:
    """The ``track`` stage: one parent run for this invocation (``invocation_id`` of the config
    hash and ``results_dir``, default the folder above ``done_path``'s), a child per (placement,
    batch size), then ``done_path`` (JSON: tracking URI, experiment and its id, the parent's run
    id, run key -> child run id, the UI routes of the experiment's runs table, of every shared
    view (``views``) and of the one whose columns these runs fill (``comparison_view``))
    written atomically. Returns the children's run ids. Without bench results (a model that is
    not decoded) the children come from the placements and their predictions. ``tags``
    (config_hash, ...) go on every run; the commit, versions and device come from each bench
    JSON's provenance (:func:`provenance_tags`), never from the machine running ``track``: the
    parent's ``commit`` param is the commit its children's bench files recorded (``unknown``
    without one, as for a model that is not decoded)."""
    autotune_paths = [Path(p) for p in autotune_jsons]
    bench_jsons, placement_jsons = list(bench_jsons), list(placement_jsons)
    if bench_jsons:
        records = records_from_results(bench_jsons, parity_jsons, placement_jsons, stats_json, autotune_paths,
                                       locality_json, simulation_csv)
    else:  # a model that is not decoded: its placements and their predictions
        records = records_from_placements(placement_jsons, stats_json, locality_json, simulation_csv)
    tags = {k: v for k, v in (tags or {}).items() if k != "commit"}
    measured_commits = sorted({r.tags["commit"] for r in records if r.tags.get("commit")})
    parent_tags = {**tags, "commit": ",".join(measured_commits) or "unknown"}
    results_dir = Path(done_path).resolve().parent.parent if results_dir is None else Path(results_dir)
    invocation = invocation_id(str(tags.get("config_hash", "unknown")), results_dir)
    for rec in records:
        rec.invocation = invocation
    parent = parent_record(records, invocation, parent_tags, stats_json, autotune_paths, datasets)
    tracked = log_runs(tracking_uri, experiment, records, tags, parent=parent)
    write_json(done_path, {
        "tracking_uri": tracking_uri,
        "experiment": experiment,
        "experiment_id": tracked.experiment_id,
        "experiment_link": experiment_link(tracked.experiment_id),
        "comparison_view": tracked.comparison_view,
        "views": tracked.views,
        "parent_run_id": tracked.parent_id,
        "runs": {rec.run_key: run_id for rec, run_id in zip(records, tracked.run_ids)},
    })
    print(f"MLflow: {len(records)} runs under parent {tracked.parent_id} in experiment {experiment!r}; "
          f"their headline numbers at <server>/{tracked.comparison_view} (runs table: "
          f"<server>/{experiment_link(tracked.experiment_id)})", file=sys.stderr)
    return tracked.run_ids


def log_report(done_path: str | os.PathLike, html: str | os.PathLike, figures: Sequence[str | os.PathLike]) -> str:
    """Attach the rendered report (HTML under ``report/``, figures under ``report/figures/``) to
    the parent run that ``track`` recorded in ``done_path``; returns its run id. The report is
    rendered after ``track``, so it joins the parent here."""
    done = read_json(done_path)
    if not isinstance(done, dict) or not done.get("parent_run_id") or not done.get("tracking_uri"):
        raise ReportInputError(f"{done_path}: missing field parent_run_id or tracking_uri")
    client = _client(done["tracking_uri"])
    run_id = done["parent_run_id"]
    _log_files(client, run_id, f"parent {run_id}", {"report": [Path(html)], "report/figures": [Path(f) for f in figures]})
    return run_id
