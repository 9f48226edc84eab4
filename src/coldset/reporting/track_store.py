"""The MLflow tracking store the ``track`` stage logs to, and the ``done`` file that says it holds the runs.

Store: by default SQLite under results/ with an absolute URI (``default_tracking_uri``), created
with its experiment by ``ensure_store`` in the track stage: built beside and renamed into place
under a lock (six processes creating a fresh SQLite store at once fail in the schema migration;
parallel writers to an existing one are fine), and a half-made store is rebuilt with a warning.
``tracking.uri`` in the config may name any tracking server instead (a team's ``mlflow server`` on
PostgreSQL, docs/deployment.md). The experiment is tagged ``mlflow.experimentKind = custom_model_development``.

MLflow is an optional dependency: it is imported inside the functions that use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import time
import warnings
from pathlib import Path

DEFAULT_DB_NAME = "mlflow.db"
ARTIFACT_DIR_NAME = "mlartifacts"
STORE_LOCK_SUFFIX = ".lock"


class TrackingError(RuntimeError):
    """The tracking store or a run could not be written as asked."""


def default_tracking_uri(results_dir: str | os.PathLike = "results") -> str:
    """``sqlite:////abs/path/results/mlflow.db``: one absolute URI for every rule and the UI
    (a relative SQLite URI resolves against each process's working directory)."""
    return "sqlite:///" + str((Path(results_dir) / DEFAULT_DB_NAME).resolve())


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, else None (a server or another database)."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    path = tracking_uri[len(prefix):]
    if not path or path == ":memory:":
        return None
    return Path(path if path.startswith("/") else path)


def tracking_client(tracking_uri: str):
    from mlflow.tracking import MlflowClient  # optional dependency: only where runs are logged

    return MlflowClient(tracking_uri=tracking_uri)



@contextlib.contextmanager
def _store_lock(db: Path):
    """An exclusive lock beside the SQLite store: one process creates or heals it at a time."""
    with open(db.with_name(db.name + STORE_LOCK_SUFFIX), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _store_runs(db: Path) -> int | None:
    """Rows in the store's ``runs`` table; None when the file has no such table or is no database."""
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
    import sqlalchemy  # optional dependency (comes with mlflow)
    from mlflow.store.db import utils as db_utils  # optional dependency

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
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore  # optional dependency
    from mlflow.tracking._tracking_service import utils as service_utils  # optional dependency

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
        client = tracking_client("sqlite:///" + str(tmp))
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
    from mlflow.exceptions import MlflowException  # optional dependency

    db = sqlite_path(tracking_uri)
    artifact_location = None
    if db is not None:
        if not db.is_absolute():
            raise TrackingError(f"tracking URI {tracking_uri!r}: use an absolute SQLite path (sqlite:////abs/path)")
        artifact_location = (db.parent / ARTIFACT_DIR_NAME / experiment).as_uri()
        _ensure_sqlite_store(db, tracking_uri, experiment, artifact_location)
    client = tracking_client(tracking_uri)
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
    try:
        doc = json.loads(Path(done_path).read_text())
    except (OSError, ValueError):
        return None
    db = sqlite_path(str(doc.get("tracking_uri", ""))) if isinstance(doc, dict) else None
    if db is not None and not db.exists():
        return f"its MLflow store {db} no longer exists"
    return None
