"""MLflow sink: one parent run per workflow invocation of a model, one child run per (policy,
residency, batch size), idempotent across reruns.

MLflow is where people compare runs (``mlflow ui --backend-store-uri sqlite:///$PWD/results/
mlflow.db``, then the shared views :data:`VIEWS`: tok/s per GiB where a GPU measured, coverage
and hit rates on the CPU); it is never a dependency of a computing stage, so it is imported only
inside the functions of the tracking modules and ``import coldset.reporting.track`` works without it.

Run times: a run starts when the track job creates it and ends when that job has logged it. A
later job that updates it (a rerun) leaves both: MLflow cannot move a run's start, and a second
end would stretch the run over the time between the two jobs.

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
is still exactly one active run per key (children then point at the new parent). Duplicates (two
processes racing) are deleted, keeping the oldest.

What each run holds (params, metrics, tags, artifacts) is :mod:`coldset.reporting.track_runs`; the store
(SQLite under results/ or a tracking server) is :mod:`coldset.reporting.track_store`.

A metric undefined for a run (tok_s_per_gib at a policy's smallest residency, for one; the bytes
metrics and ceilings of a CPU run) is not logged; if the run had a value for it from a previous
run, NaN is logged so it does not keep showing a stale number.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import pandas as pd
from tqdm import tqdm

from coldset.core.files import write_json
from coldset.core.timing import speed_compares_placements
from coldset.reporting.results import ReportInputError, read_json
from coldset.reporting.track_runs import (
    DatasetRef,
    ParentRecord,
    RunRecord,
    invocation_id,
    parent_record,
    records_from_placements,
    records_from_results,
)
from coldset.reporting.track_store import TrackingError, ensure_store, tracking_client

RUN_KEY_TAG = "coldset.run_key"
# MLflow 3 records an experiment's kind in this tag. The 3.17 UI, though, takes the kind from its
# global GenAI / machine-learning switch (the sidebar, remembered per browser, default GenAI, which
# opens an experiment on its traces overview) or from the URL's ``workflowType``: the links we
# hand out (``experiment_link``, ``view_link``) carry workflowType=machine_learning.
UI_WORKFLOW = "workflowType=machine_learning"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
BENCH_TABLE = "bench_rows.json"


def _find_runs(client, experiment_id: str, run_key: str):
    from mlflow.entities import ViewType  # optional dependency

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
    measured = [r.tags.get("device") for r in records if r.tags.get("decoded") != "false"]
    return SPEED_VIEW if any(d and speed_compares_placements(d) for d in measured) else COVERAGE_VIEW


def share_views(client, experiment_id: str) -> dict[str, str]:
    """Save :data:`VIEWS` in the experiment the way the UI's "Share" does (an experiment tag
    ``mlflow.sharedViewState.<key>`` holding the view state as JSON); returns view -> UI route."""
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
    """Find the run of ``key`` (deleting duplicates two racing jobs left, keeping the oldest) or
    create it; replace it when a param changed (params are immutable in MLflow); log the params it
    lacks, the metrics whose value changed (NaN over a value that became undefined) and the tags.
    Returns the run id and whether the run still needs its end (:func:`_finish`)."""
    from mlflow.entities import Metric, Param, RunTag  # optional dependency

    found = _find_runs(client, experiment_id, key)
    for dup in found[1:]:
        warnings.warn(f"MLflow: deleting duplicate run {dup.info.run_id} for {key} (keeping the oldest)")
        client.delete_run(dup.info.run_id)
    run = found[0] if found else None
    if run is not None:
        conflicts = {k: (run.data.params[k], v) for k, v in params.items()
                     if k in run.data.params and run.data.params[k] != v}
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
    """End a run this job created (or one a killed job left open) now. A run a previous job
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
    from mlflow.data.dataset_source_registry import resolve_dataset_source  # optional dependency
    from mlflow.data.meta_dataset import MetaDataset  # optional dependency
    from mlflow.entities import DatasetInput, InputTag  # optional dependency
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT  # optional dependency

    inputs = []
    for ref in datasets:
        path = Path(ref.path)
        if not path.is_file():
            raise ReportInputError(f"missing dataset file {path} ({ref.name})")
        ds = MetaDataset(source=resolve_dataset_source(str(path.resolve())), name=ref.name, digest=_file_digest(path))
        inputs.append(DatasetInput(dataset=ds._to_mlflow_entity(),
                                   tags=[InputTag(MLFLOW_DATASET_CONTEXT, ref.context)]))
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
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID  # optional dependency

    experiment_id = ensure_store(tracking_uri, experiment)
    client = tracking_client(tracking_uri)
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
    client = tracking_client(done["tracking_uri"])
    run_id = done["parent_run_id"]
    _log_files(client, run_id, f"parent {run_id}",
               {"report": [Path(html)], "report/figures": [Path(f) for f in figures]})
    return run_id
