"""MLflow tracking: idempotent runs in a SQLite store, read back through the real MLflow server.

The results tree is the one test_report.py builds (stage file contracts). The reference for
"what was logged" is independent of coldset.reporting.track: the MLflow client's own search, and in the slow
test the MLflow server's REST API read with urllib.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from coldset.core.layout import Layout
from coldset.reporting.track import BENCH_TABLE, EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, RUN_KEY_TAG, run_track
from coldset.reporting.track_runs import DatasetRef, invocation_id
from coldset.reporting.track_store import default_tracking_uri, ensure_store

_spec = importlib.util.spec_from_file_location("_coldset_results_tree", Path(__file__).with_name("test_report.py"))
_tree = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tree)
MODEL, POLICIES, RESIDENCIES, BATCH_SIZES = _tree.MODEL, _tree.POLICIES, _tree.RESIDENCIES, _tree.BATCH_SIZES
EXPERIMENT = "coldset-test"
# A commit passed by the caller (the machine running track) must never replace the bench's own.
TAGS = {"commit": "track-machine-commit", "config_hash": "cfg42"}
PROVENANCE = _tree.PROVENANCE


def _inputs(res: Path) -> dict:
    layout = Layout(results=res, model=MODEL)
    placements = [(p, r) for p in POLICIES for r in RESIDENCIES]
    return {
        "bench_jsons": [layout.bench(p, r) for p, r in placements],
        "parity_jsons": [layout.parity(p, r) for p, r in placements],
        "placement_jsons": [layout.placement(p, r) for p, r in placements],
        "stats_json": layout.stats_dir / "skew.json",
        "autotune_jsons": sorted((res / "autotune").glob("*.json")),
    }


def _track(res: Path, uri: str, tags: dict | None = None, datasets=()) -> list[str]:
    return run_track(**_inputs(res), tracking_uri=uri, experiment=EXPERIMENT, tags=tags or TAGS,
                     done_path=res / "track" / f"{MODEL}.done", datasets=datasets)


def _key(res: Path, policy: str, residency: str, batch: int, config_hash: str = TAGS["config_hash"]) -> str:
    """A child's run key, spelled out here: model@{config hash}-{results folder digest}/..."""
    return f"{MODEL}@{invocation_id(config_hash, res)}/{policy}/{residency}/{batch}"


def _bench_value(res: Path, policy: str, r: float, batch: int, name: str) -> float:
    doc = json.loads(Layout(res, MODEL).bench(policy, r).read_text())
    return next(e[name] for e in doc["batches"] if e["batch_size"] == batch)


def _all_active_runs(uri: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    return list(client.search_runs([exp.experiment_id], max_results=1000))


def _active_runs(uri: str) -> list:
    """The children (one per placement and batch size)."""
    return [r for r in _all_active_runs(uri) if "mlflow.parentRunId" in r.data.tags]


def _parents(uri: str) -> list:
    return [r for r in _all_active_runs(uri) if "mlflow.parentRunId" not in r.data.tags]


def test_rerun_updates_runs_instead_of_duplicating(tmp_path):
    res = _tree.build_results_tree(tmp_path)
    uri = default_tracking_uri(res)
    assert uri == "sqlite:///" + str((res / "mlflow.db").resolve()) and uri.startswith("sqlite:////")
    exp_id = ensure_store(uri, EXPERIMENT)
    assert ensure_store(uri, EXPERIMENT) == exp_id  # a second call finds it

    first = _track(res, uri)
    expected_runs = len(POLICIES) * len(RESIDENCIES) * len(BATCH_SIZES)
    assert len(first) == len(set(first)) == expected_runs
    runs = _active_runs(uri)
    assert len(runs) == expected_runs
    by_key = {r.data.tags[RUN_KEY_TAG]: r for r in runs}
    run = by_key[_key(res, "usage_global", "0.5", 4)]
    assert run.data.params == {
        "model": MODEL, "policy": "usage_global", "residency": "0.5", "batch_size": "4",
        "dtype": "bfloat16", "num_hot": "12", "num_cold": "12",
    }
    assert run.data.metrics["tok_s"] == pytest.approx(_bench_value(res, "usage_global", 0.5, 4, "tok_s"))
    assert run.data.metrics["cold_share"] == pytest.approx(0.5)
    assert run.data.metrics["parity_passed"] == 1.0 and run.data.metrics["parity_tokens_total"] == 96
    assert run.data.metrics["timed_token_match"] == 1.0  # the timed loop decoded generate()'s tokens
    assert run.data.metrics["coverage_heldout"] == pytest.approx(0.7)
    assert "tok_s_per_gib" not in run.data.metrics  # undefined at the smallest residency
    assert by_key[_key(res, "usage_global", "1.0", 1)].data.metrics["tok_s_per_gib"] == pytest.approx(50 / 1.5)
    # hand-computed, all domains pooled: expert j gets (j+1)^2 from code and ((j+3)%8+1)^2 from
    # prose: 17, 29, 45, 65, 89, 37, 53, 73 (sum 408); the top 10% (1 of 8) is expert 4 with 89
    assert run.data.metrics["routing_top10_share_decode"] == pytest.approx(89 / 408)
    tags = run.data.tags
    assert (tags["device"], tags["dtype"], tags["commit"], tags["config_hash"], tags["autotune_key"]) == (
        "cpu", "bfloat16", PROVENANCE["commit"], "cfg42", "abc123")
    # provenance of the measuring machine, as tags (issue 18 item 5)
    assert tags["mlflow.source.git.commit"] == PROVENANCE["commit"] and tags["dirty"] == "false"
    assert (tags["torch"], tags["triton"], tags["cuda"], tags["driver"], tags["device_name"]) == (
        "2.11.0+cu130", "3.6.0", "13.0", "580.95.05", "NVIDIA H200")
    assert tags["autotune_hit"] == "false" and tags["ceiling.hbm_read_gb_s"] == "4500"
    assert tags["mlflow.runName"] == "usage_global-0.5-b4"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    listed = {f.path for folder in ("placement", "parity", "bench", "stats")
              for f in client.list_artifacts(run.info.run_id, folder)}
    name = Layout(res, MODEL).placement("usage_global", 0.5).name
    assert listed == {f"placement/{name}", f"parity/{name}", f"bench/{name}"}
    done = json.loads((res / "track" / f"{MODEL}.done").read_text())
    assert done["runs"][_key(res, "usage_global", "0.5", 4)] == run.info.run_id
    (parent,) = _parents(uri)
    assert done["parent_run_id"] == parent.info.run_id == run.data.tags["mlflow.parentRunId"]

    # rerun with one changed measurement: same runs, the new value is the latest, no duplicate
    bench = Layout(res, MODEL).bench("usage_global", 0.5)
    doc = json.loads(bench.read_text())
    doc["batches"][1]["tok_s"] = 123.25
    bench.write_text(json.dumps(doc))
    second = _track(res, uri)
    assert second == first
    runs = _active_runs(uri)
    assert len(runs) == expected_runs
    rerun = {r.data.tags[RUN_KEY_TAG]: r for r in runs}[_key(res, "usage_global", "0.5", 4)]
    assert rerun.data.metrics["tok_s"] == 123.25
    assert [m.value for m in client.get_metric_history(run.info.run_id, "tok_s")] == [
        pytest.approx(_tree._tok_s("usage_global", 0.5, 4)), 123.25]
    assert len(client.get_metric_history(run.info.run_id, "cold_share")) == 1  # unchanged: not re-logged

    # a changed placement under the same key (params are immutable in MLflow): replaced, not duplicated
    pl = Layout(res, MODEL).placement("positional", 1.0)
    doc = json.loads(pl.read_text())
    doc["num_hot"], doc["num_cold"] = 23, 1
    pl.write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match="params are immutable"):
        third = _track(res, uri)
    changed = {i for i, (a, b) in enumerate(zip(first, third)) if a != b}
    assert len(changed) == len(BATCH_SIZES)
    runs = _active_runs(uri)
    assert len(runs) == expected_runs
    assert {r.data.tags[RUN_KEY_TAG]: r for r in runs}[_key(res, "positional", "1.0", 1)].data.params["num_hot"] == "23"
    assert [p.info.run_id for p in _parents(uri)] == [parent.info.run_id]  # one parent throughout


def test_track_names_the_missing_input(tmp_path):
    res = _tree.build_results_tree(tmp_path)
    inputs = _inputs(res)
    inputs["parity_jsons"] = inputs["parity_jsons"][1:]
    missing_for = inputs["bench_jsons"][0]
    with pytest.raises(ValueError, match=f"{missing_for}: no parity report"):
        run_track(**inputs, tracking_uri=default_tracking_uri(res), experiment=EXPERIMENT, tags=TAGS,
                  done_path=res / "track" / "x.done")
    assert not (res / "track" / "x.done").exists()


def test_package_imports_without_mlflow():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('mlflow', 'snakemake'): raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import coldset.reporting.track, coldset.reporting.report\n"
        "assert 'mlflow' not in sys.modules\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ---------------------------------------------------------------- the real MLflow server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
def test_mlflow_server_serves_the_logged_runs(tmp_path):
    res = _tree.build_results_tree(tmp_path)
    uri = default_tracking_uri(res)
    ensure_store(uri, EXPERIMENT)  # the store exists before the server opens it

    mlflow_bin = Path(sys.executable).with_name("mlflow")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [str(mlflow_bin), "server", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path,  # its ./mlartifacts
        env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"},
    )
    try:
        run_ids = _track(res, uri)  # while the server starts (15-20 s here): it reads the database per request
        deadline = time.monotonic() + 90
        while True:
            try:
                exp = _get(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name={EXPERIMENT}")
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if server.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail(f"mlflow server did not answer: {(tmp_path / 'server.log').read_text()[-3000:]}")
                time.sleep(0.5)
        exp_id = exp["experiment"]["experiment_id"]
        found = _post(f"{base}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp_id], "max_results": 1000})
        runs = found["runs"]
        done = json.loads((res / "track" / f"{MODEL}.done").read_text())
        assert sorted(r["info"]["run_id"] for r in runs) == sorted(run_ids + [done["parent_run_id"]])
        key = _key(res, "usage_global", "1.0", 1)
        (run,) = [r for r in runs if {"key": RUN_KEY_TAG, "value": key} in r["data"]["tags"]]
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert params["policy"] == "usage_global" and params["residency"] == "1.0" and params["batch_size"] == "1"
        assert metrics["tok_s"] == pytest.approx(_bench_value(res, "usage_global", 1.0, 1, "tok_s"))
        assert metrics["tok_s_per_gib"] == pytest.approx(50 / 1.5)
        assert metrics["fetch_tax"] == 0.0 and math.isclose(metrics["hbm_expert_gib"], 3.0)
        assert tags["device"] == "cpu" and tags["commit"] == PROVENANCE["commit"] and tags["autotune_key"] == "abc123"

        # compare tok_s_per_gib across runs server-side, as the README shows in the UI
        best = _post(f"{base}/api/2.0/mlflow/runs/search", {
            "experiment_ids": [exp_id], "filter": "params.batch_size = '1' and metrics.tok_s_per_gib > 0",
            "order_by": ["metrics.tok_s_per_gib DESC"],
        })["runs"]
        assert [{t["key"]: t["value"] for t in r["data"]["tags"]}[RUN_KEY_TAG] for r in best] == [
            _key(res, "usage_global", "1.0", 1), _key(res, "positional", "1.0", 1)]

        arts = _get(f"{base}/api/2.0/mlflow/artifacts/list?run_id={run['info']['run_id']}&path=placement")
        assert [f["path"] for f in arts["files"]] == [f"placement/{Layout(res, MODEL).placement('usage_global', 1.0).name}"]

        # config may name a tracking server instead of the SQLite store: the same stage, twice
        inputs = _inputs(res)
        inputs["bench_jsons"] = inputs["bench_jsons"][:1]  # one placement's batch sizes keep it quick
        via = [run_track(**inputs, tracking_uri=base, experiment="via-server", tags=TAGS,
                         done_path=tmp_path / f"via{i}.done") for i in range(2)]
        assert via[0] == via[1] and len(via[0]) == len(BATCH_SIZES)
        exp2 = _get(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=via-server")["experiment"]
        runs2 = _post(f"{base}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp2["experiment_id"]]})["runs"]
        parent2 = json.loads((tmp_path / "via1.done").read_text())["parent_run_id"]
        assert sorted(r["info"]["run_id"] for r in runs2) == sorted(via[0] + [parent2])
        arts2 = _get(f"{base}/api/2.0/mlflow/artifacts/list?run_id={parent2}&path=stats")
        assert [f["path"] for f in arts2["files"]] == ["stats/skew.json"]
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait(timeout=5)
        log.close()


# ---------------------------------------------------------------- bytes metrics and ceilings

BYTES_METRICS = ("hbm_gb_per_token", "bytes_step_ms", "fraction_of_bytes_bound", "predicted_step_ms_calibrated")


def test_bytes_metrics_and_ceilings_are_logged_when_measured(tmp_path):
    gpu = _tree.build_results_tree(tmp_path / "gpu", bytes_run="gpu", with_autotune=False)
    uri = default_tracking_uri(gpu)
    first = _track(gpu, uri)
    by_key = {r.data.tags[RUN_KEY_TAG]: r for r in _active_runs(uri)}
    run = by_key[_key(gpu, "usage_global", "0.5", 4)]
    expect = _tree.bytes_fields("usage_global", 0.5, 4)
    for name in BYTES_METRICS:
        assert run.data.metrics[name] == pytest.approx(expect[name]), name
    bound = _tree.time_fields("usage_global", 0.5, 4)  # issue 28's time bound, logged as measured
    for name in ("allhbm_step_ms", "bound_ms", "bound_fraction", "overlap", "stall_ms_per_token"):
        assert run.data.metrics[name] == pytest.approx(bound[name]), name
    assert "wasted_gb_per_token" not in run.data.metrics  # a static placement: undefined, not logged
    assert "manage_ms_per_group" not in run.data.metrics  # no cache management: undefined, not logged
    assert run.data.tags["allhbm_placement"] == "usage_global-1.0"
    assert run.data.metrics["hbm_read_gb_s"] == _tree.HBM_GB_S
    assert run.data.metrics["link_read_gb_s"] == _tree.LINK_GB_S
    assert run.data.tags["device"] == "NVIDIA H200"
    (parent,) = _parents(uri)
    assert {k: parent.data.params[k] for k in ("device", "device_name", "hbm_read_gb_s", "link_read_gb_s")} == {
        "device": "NVIDIA H200", "device_name": "NVIDIA H200", "hbm_read_gb_s": str(_tree.HBM_GB_S),
        "link_read_gb_s": str(_tree.LINK_GB_S)}

    # a rerun with remeasured ceilings updates the same runs (ceilings are metrics, not immutable
    # params); unchanged metrics get no new point
    for policy in POLICIES:
        for r in RESIDENCIES:
            bench = Layout(gpu, MODEL).bench(policy, r)
            doc = json.loads(bench.read_text())
            doc["ceilings"]["link_read_gb_s"] = 51.5
            if (policy, r) == ("usage_global", 0.5):  # a management column, as a cache row carries it
                next(e for e in doc["batches"] if e["batch_size"] == 4)["manage_ms_per_group"] = 0.0625
            bench.write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match="params are immutable"):  # the parent's ceilings params
        assert _track(gpu, uri) == first
    runs = _active_runs(uri)
    assert len(runs) == len(first)
    (new_parent,) = _parents(uri)  # replaced, and every child follows it
    assert new_parent.info.run_id != parent.info.run_id and new_parent.data.params["link_read_gb_s"] == "51.5"
    assert {r.data.tags["mlflow.parentRunId"] for r in runs} == {new_parent.info.run_id}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "link_read_gb_s")] == [_tree.LINK_GB_S, 51.5]
    assert len(client.get_metric_history(run.info.run_id, "predicted_step_ms_calibrated")) == 1
    assert [m.value for m in client.get_metric_history(run.info.run_id, "manage_ms_per_group")] == [0.0625]

    # a CPU run: hbm_gb_per_token only; nothing logged for the undefined ones
    cpu = _tree.build_results_tree(tmp_path / "cpu", bytes_run="cpu", with_autotune=False)
    uri = default_tracking_uri(cpu)
    _track(cpu, uri)
    run = {r.data.tags[RUN_KEY_TAG]: r for r in _active_runs(uri)}[_key(cpu, "usage_global", "0.5", 4)]
    assert run.data.metrics["hbm_gb_per_token"] == pytest.approx(0.055)
    absent = {"bytes_step_ms", "fraction_of_bytes_bound", "predicted_step_ms_calibrated", "hbm_read_gb_s",
              "link_read_gb_s", "bound_ms", "bound_fraction", "overlap", "stall_ms_per_token", "allhbm_step_ms"}
    assert absent.isdisjoint(run.data.metrics)


# ---------------------------------------------------------------------------------------------
# issue 16 item 7: the store heals


def _half_made_store(db, runs=0):
    """What an interrupted creation leaves: some of MLflow's tables (here the one the race names)."""
    import sqlite3

    db.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE secrets (secret_id TEXT PRIMARY KEY)")
    if runs:
        con.execute("CREATE TABLE runs (run_uuid TEXT PRIMARY KEY)")
        con.executemany("INSERT INTO runs VALUES (?)", [(f"r{i}",) for i in range(runs)])
    con.commit()
    con.close()


def test_half_made_store_is_moved_aside_and_rebuilt_with_a_warning(tmp_path):
    from mlflow.tracking import MlflowClient

    from coldset.reporting.track_store import ensure_store

    db = tmp_path / "results" / "mlflow.db"
    _half_made_store(db)
    with pytest.raises(Exception, match="table secrets already exists"):  # what every invocation hit
        MlflowClient(f"sqlite:///{db}").search_experiments()
    (db.parent / ".mlflow.db.12345.tmp").write_bytes(b"half a store of a killed creator")
    with pytest.warns(UserWarning, match=rf"MLflow store {db} was half-made .* moved it to {db}.broken-"):
        exp_id = ensure_store(f"sqlite:///{db}", "coldset")
    assert MlflowClient(f"sqlite:///{db}").get_experiment(exp_id).name == "coldset"
    assert len(list(db.parent.glob("mlflow.db.broken-*"))) == 1  # kept, not deleted
    assert not list(db.parent.glob(".mlflow.db.*.tmp"))


def test_unopenable_store_with_runs_is_never_touched(tmp_path):
    from coldset.reporting.track_store import TrackingError, ensure_store

    db = tmp_path / "mlflow.db"
    _half_made_store(db, runs=2)
    before = db.read_bytes()
    with pytest.raises(TrackingError, match=rf"MLflow store {db} cannot be opened .* holds 2 runs"):
        ensure_store(f"sqlite:///{db}", "coldset")
    assert db.read_bytes() == before and not list(tmp_path.glob("mlflow.db.broken-*"))


def test_done_file_is_stale_once_its_store_is_gone(tmp_path):
    from coldset.reporting.track_store import done_is_stale

    db = tmp_path / "mlflow.db"
    done = tmp_path / "tiny.done"
    done.write_text(json.dumps({"tracking_uri": f"sqlite:///{db}", "experiment": "coldset", "runs": {}}))
    assert done_is_stale(done) == f"its MLflow store {db} no longer exists"
    db.write_bytes(b"")
    assert done_is_stale(done) is None
    assert done_is_stale(tmp_path / "absent.done") is None


def test_locality_and_cache_simulation_are_logged_per_residency(tmp_path):
    import pandas as pd

    res = _tree.build_results_tree(tmp_path, with_autotune=False)
    layout = Layout(res, MODEL)
    loc = {"consecutive_overlap": {"mean": 0.6}, "shuffled_overlap": {"mean": 0.4}, "lift": 1.5,
           "reuse_distance": {"1": 0.5}}  # the stats stage's locality.json contract (coldset.reporting.results)
    (layout.stats_dir / "locality.json").write_text(json.dumps(loc))
    rows = [{"policy": p, "residency": r, "capacity": 1, "accesses": 10, "tokens": 5,
             "hit_rate": 0.1 * i + r / 10, "misses_per_token": i + r, "link_gb_per_token": 0.01 * i}
            for r in RESIDENCIES for i, p in enumerate(("static", "lru", "belady"))]
    layout.cache_dir.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(layout.cache_dir / "simulation.csv", index=False)
    uri = default_tracking_uri(res)
    run_track(**_inputs(res), tracking_uri=uri, experiment=EXPERIMENT, tags=TAGS,
              done_path=res / "track" / f"{MODEL}.done", locality_json=layout.stats_dir / "locality.json",
              simulation_csv=layout.cache_dir / "simulation.csv")
    by_key = {r.data.tags[RUN_KEY_TAG]: r for r in _active_runs(uri)}
    for r in RESIDENCIES:
        m = by_key[_key(res, "usage_global", repr(float(r)), BATCH_SIZES[0])].data.metrics
        assert m["routing_overlap_lift_decode"] == 1.5 and m["routing_consecutive_overlap_decode"] == 0.6
        for row in (x for x in rows if x["residency"] == r):
            assert m[f"cache_{row['policy']}_hit_rate"] == pytest.approx(row["hit_rate"])
            assert m[f"cache_{row['policy']}_misses_per_token"] == pytest.approx(row["misses_per_token"])
            assert m[f"cache_{row['policy']}_link_gb_per_token"] == pytest.approx(row["link_gb_per_token"])


def test_track_never_substitutes_its_own_commit(tmp_path):
    """Mutant: track tags runs with the commit of the machine running it (git there, or the
    caller's tag) instead of the bench JSON's provenance. A bench without provenance gets no
    commit at all, and says so."""
    from coldset.reporting.track_runs import provenance_tags, records_from_results

    assert provenance_tags(None) == {"provenance": "missing"}
    res = _tree.build_results_tree(tmp_path, provenance=False)
    inputs = _inputs(res)
    recs = records_from_results(inputs["bench_jsons"], inputs["parity_jsons"], inputs["placement_jsons"],
                                inputs["stats_json"], inputs["autotune_jsons"])
    assert all("commit" not in r.tags and r.tags["provenance"] == "missing" for r in recs)
    uri = default_tracking_uri(res)
    _track(res, uri)
    assert all("commit" not in r.data.tags for r in _active_runs(uri))
# ---------------------------------------------------------------- parent and children, as MLflow users expect


def _sha16(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def test_parent_run_per_invocation_with_children_table_datasets_and_report(tmp_path, monkeypatch):
    import shutil

    from mlflow.tracking import MlflowClient

    from coldset.reporting.track import log_report

    res = _tree.build_results_tree(tmp_path / "a")
    data = tmp_path / "data"
    data.mkdir()
    (data / "trace.parquet").write_bytes(b"PAR1 not really a trace, only bytes to digest")
    (data / "code.jsonl").write_text('{"id": "c0", "prompt": "def f():"}\n')
    datasets = [DatasetRef("synthetic-routing-trace", data / "trace.parquet", "routing"),
                DatasetRef("fixtures-code", data / "code.jsonl", "fixtures")]
    uri = default_tracking_uri(res)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # MlflowClient.load_table searches the default store
    import mlflow

    previous_uri = mlflow.get_tracking_uri()  # another test may have set the process-wide store
    mlflow.set_tracking_uri(uri)
    children = _track(res, uri, datasets=datasets)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND  # the UI opens it on its runs table

    (parent,) = _parents(uri)
    kids = _active_runs(uri)
    assert sorted(r.info.run_id for r in kids) == sorted(children)
    assert {r.data.tags["mlflow.parentRunId"] for r in kids} == {parent.info.run_id}
    p = parent.data.params
    # the commit is the one the bench files recorded where they were measured, not the caller's tag
    assert (p["model"], p["device"], p["dtype"], p["config_hash"], p["commit"]) == (
        MODEL, "cpu", "bfloat16", "cfg42", PROVENANCE["commit"])
    import importlib.metadata as md

    assert p["version.mlflow"] == md.version("mlflow") and p["version.torch"] == md.version("torch")
    assert p["version.python"] == ".".join(map(str, sys.version_info[:3]))
    assert "device_name" not in p and "hbm_read_gb_s" not in p  # CPU run: no GPU name, no ceilings

    # datasets: the files' names, sources, digests (sha256 computed here) and contexts
    inputs = {d.dataset.name: d for d in client.get_run(parent.info.run_id).inputs.dataset_inputs}
    assert set(inputs) == {"synthetic-routing-trace", "fixtures-code"}
    assert inputs["synthetic-routing-trace"].dataset.digest == _sha16(data / "trace.parquet")
    assert inputs["fixtures-code"].dataset.digest == _sha16(data / "code.jsonl")
    assert str(data / "code.jsonl") in inputs["fixtures-code"].dataset.source
    assert {t.key: t.value for t in inputs["fixtures-code"].tags}["mlflow.data.context"] == "fixtures"

    # the bench rows as a table: one row per child, values as in the bench JSON read here
    table = client.load_table(exp.experiment_id, BENCH_TABLE, run_ids=[parent.info.run_id])
    assert len(table) == len(children)
    row = table[(table.policy == "usage_global") & (table.residency == 0.5) & (table.batch_size == 4)]
    assert row.tok_s.item() == pytest.approx(_bench_value(res, "usage_global", 0.5, 4, "tok_s"))
    arts = {f.path for f in client.list_artifacts(parent.info.run_id, "stats")}
    assert arts == {"stats/skew.json"}

    # the report joins the parent
    html, fig = tmp_path / "index.html", tmp_path / "residency-b1.png"
    html.write_text("<html>report</html>")
    fig.write_bytes(b"\x89PNG fake")
    assert log_report(res / "track" / f"{MODEL}.done", html, [fig]) == parent.info.run_id
    assert {f.path for f in client.list_artifacts(parent.info.run_id, "report")} == {"report/index.html", "report/figures"}

    # a rerun: same parent and children, no duplicated dataset input, table rows not appended
    bench = Layout(res, MODEL).bench("usage_global", 0.5)
    doc = json.loads(bench.read_text())
    doc["batches"][1]["tok_s"] = 77.5
    bench.write_text(json.dumps(doc))
    assert _track(res, uri, datasets=datasets) == children
    assert [r.info.run_id for r in _parents(uri)] == [parent.info.run_id]
    assert len(client.get_run(parent.info.run_id).inputs.dataset_inputs) == 2
    table = client.load_table(exp.experiment_id, BENCH_TABLE, run_ids=[parent.info.run_id])
    assert len(table) == len(children)
    row = table[(table.policy == "usage_global") & (table.residency == 0.5) & (table.batch_size == 4)]
    assert row.tok_s.item() == 77.5

    # another results tree (same config hash) is another invocation: its own parent and children,
    # the first tree's runs untouched
    other = tmp_path / "b" / "results"
    shutil.copytree(res, other)
    for f in ("mlflow.db",):
        (other / f).unlink()
    shutil.rmtree(other / "mlartifacts", ignore_errors=True)
    children_b = _track(other, uri, datasets=datasets)
    assert set(children_b).isdisjoint(children)
    assert len(_parents(uri)) == 2 and len(_active_runs(uri)) == 2 * len(children)

    # the bench re-measured by a new commit: the parent's params change, so the parent is
    # replaced; children stay and follow
    for bench_json in (res / "bench" / MODEL).glob("*.json"):
        doc = json.loads(bench_json.read_text())
        doc["provenance"]["commit"] = "fedcba98"
        bench_json.write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match="params are immutable"):
        assert _track(res, uri, datasets=datasets) == children
    new_parent = [r for r in _parents(uri) if r.data.params["commit"] == "fedcba98"]
    assert len(new_parent) == 1 and len(_parents(uri)) == 2
    assert {client.get_run(c).data.tags["mlflow.parentRunId"] for c in children} == {new_parent[0].info.run_id}
    mlflow.set_tracking_uri(previous_uri)


# ---------------------------------------------------------------- issue 30 item 7: MLflow from the docs

README = Path(__file__).resolve().parents[1] / "docs" / "deployment.md"  # the README links to it


def _readme_snippet() -> str:
    """The Python block of docs/deployment.md's "Compare runs in MLflow" section, as a user copies it."""
    text = README.read_text()
    section = text[text.index("## Compare runs in MLflow"):]
    return section[section.index("```python\n") + len("```python\n"):section.index("\n```", section.index("```python"))]


def _tracked_run(root: Path, device: str) -> Path:
    """A tracked results tree as the default workflow leaves it, under ``root/results`` with the
    default experiment: ``cpu``, a CPU bench (tok_s_per_gib and fetch_tax null, as
    coldset.bench.decode.derive_metrics writes them there) with the cache simulation; ``gpu``, a CUDA bench."""
    import pandas as pd

    res = _tree.build_results_tree(root, bytes_run=device, with_autotune=False)
    layout = Layout(res, MODEL)
    if device == "cpu":
        for p in POLICIES:
            for r in RESIDENCIES:
                doc = json.loads(layout.bench(p, r).read_text())
                for e in doc["batches"]:
                    e.update(tok_s_per_gib=None, fetch_tax=None)
                layout.bench(p, r).write_text(json.dumps(doc))
    rows = [{"policy": p, "residency": r, "capacity": 1, "accesses": 10, "tokens": 5, "hit_rate": 0.2 * i + r / 5,
             "misses_per_token": 1.0, "link_gb_per_token": 0.01} for r in RESIDENCIES for i, p in enumerate(("static", "lru"))]
    layout.cache_dir.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(layout.cache_dir / "simulation.csv", index=False)
    run_track(**_inputs(res), tracking_uri=default_tracking_uri(res), experiment="coldset", tags=TAGS,
              done_path=res / "track" / f"{MODEL}.done", simulation_csv=layout.cache_dir / "simulation.csv")
    return res


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> dict[str, Path]:
    """device -> the folder holding a tracked ``results/`` (:func:`_tracked_run`), one of each."""
    return {d: _tracked_run(tmp_path_factory.mktemp(d), d).parent for d in ("cpu", "gpu")}


def test_readme_snippet_prints_the_headline_numbers_of_the_default_run(tracked):
    """docs/deployment.md's Python block, run as a user would (from the folder holding results/), on the
    default run's store (the CPU: no tok_s_per_gib anywhere) prints coverage and hit rates, best
    held-out coverage first; on a GPU run it prints tok/s per GiB, best first."""
    snippet = _readme_snippet()
    assert "search_runs" in snippet
    cpu = tracked["cpu"]
    out = subprocess.run([sys.executable, "-c", snippet], cwd=cpu, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    header, *lines = out.stdout.strip().splitlines()
    assert "metrics.coverage_heldout" in header and "metrics.cache_lru_hit_rate" in header
    assert "tok_s" not in header and len(lines) == len(POLICIES) * len(RESIDENCIES)  # batch size 1 children
    assert header.split()[3] == "metrics.coverage_heldout"
    # the tree's held-out coverage, min(1, 1.4 r) for usage_global and r for positional, best first
    assert [float(line.split()[3]) for line in lines] == sorted(
        (min(1.0, r * (1.4 if p == "usage_global" else 1.0)) for p in POLICIES for r in RESIDENCIES), reverse=True)
    gpu = tracked["gpu"]
    out = subprocess.run([sys.executable, "-c", snippet], cwd=gpu, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    header, first, *_ = out.stdout.strip().splitlines()
    assert "metrics.tok_s_per_gib" in header
    # usage_global 0.5 -> 1.0 at batch 1: (120 - 70) tok/s over 1.5 GiB, the largest slope
    assert header.split()[3] == "metrics.tok_s_per_gib"
    assert first.split()[:2] == ["usage_global", "1.0"] and float(first.split()[3]) == pytest.approx(50 / 1.5, rel=1e-3)


def test_the_done_file_links_the_view_whose_columns_the_runs_fill(tracked):
    """A CPU run links the coverage view (sorted by held-out coverage, which every child has; no
    tok_s_per_gib column), a GPU run the speed view (sorted by tok_s_per_gib, which its children
    have); both views are saved in the experiment and filter on batch size 1."""
    from mlflow.tracking import MlflowClient

    for device, view, key in (("cpu", "coldset-coverage", "coverage_heldout"), ("gpu", "coldset-speed", "tok_s_per_gib")):
        res = tracked[device] / "results"
        done = json.loads((res / "track" / f"{MODEL}.done").read_text())
        assert done["comparison_view"].endswith(f"/runs?workflowType=machine_learning&viewStateShareKey={view}")
        assert set(done["views"]) == {"coldset-coverage", "coldset-speed"} and done["views"][view] == done["comparison_view"]
        client = MlflowClient(tracking_uri=default_tracking_uri(res))
        state = json.loads(client.get_experiment(done["experiment_id"]).tags[f"mlflow.sharedViewState.{view}"])
        assert state["orderByKey"] == f"metrics.`{key}`" and state["orderByAsc"] is False
        assert state["searchFilter"] == "params.batch_size = '1'"  # children only, listed flat
        children = client.search_runs([done["experiment_id"]], filter_string=state["searchFilter"])
        assert len(children) == len(POLICIES) * len(RESIDENCIES)
        assert all(key in c.data.metrics for c in children if float(c.data.params["residency"]) > RESIDENCIES[0]
                   or key != "tok_s_per_gib")
        shown = [c.split("`")[1] for c in state["selectedColumns"] if c.startswith("metrics.")]
        assert all(any(m in c.data.metrics for c in children) for m in shown if m != "hit_rate"), shown
        if device == "cpu":
            assert "tok_s_per_gib" not in shown and not any("tok_s_per_gib" in c.data.metrics for c in children)


def test_a_rerun_does_not_stretch_a_run_over_the_time_between_jobs(tmp_path):
    """A run's start and end are those of the track job that created it: a re-track a while later
    that updates its values leaves them, so its duration is still that job's."""
    res = _tree.build_results_tree(tmp_path)
    uri = default_tracking_uri(res)
    _track(res, uri)
    before = {r.info.run_id: (r.info.start_time, r.info.end_time) for r in _all_active_runs(uri)}
    assert all(end is not None and 0 <= end - start < 60_000 for start, end in before.values())
    time.sleep(1.5)
    bench = Layout(res, MODEL).bench("usage_global", 0.5)
    doc = json.loads(bench.read_text())
    doc["batches"][0]["tok_s"] = 71.5  # a changed value: the run is updated, not replaced
    bench.write_text(json.dumps(doc))
    _track(res, uri)
    after = {r.info.run_id: (r.info.start_time, r.info.end_time) for r in _all_active_runs(uri)}
    assert after == before
