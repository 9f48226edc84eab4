"""A team's MLflow server: PostgreSQL backend store, artifacts served by the server, two `track`s
from two result trees at once (tests/test_report.py builds the trees). The reference for what
must be there is each tree's own bench JSON, read here; the server is read through its REST API.
Then the runs table in the real UI, in headless Chromium (screenshot kept under
$COLDSET_TEST_ARTIFACTS, default tests_server/artifacts/, which git ignores: the run leaves no
tracked file changed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import ROOT, get_json

import test_report as tree  # tests/ is on sys.path (conftest)
from coldset.core.layout import Layout

EXPERIMENT = "coldset-team"
TAGS = {"commit": "c0ffee12", "config_hash": "cfg-team"}
ARTIFACTS = Path(os.environ.get("COLDSET_TEST_ARTIFACTS", ROOT / "tests_server" / "artifacts"))
N_RUNS = len(tree.POLICIES) * len(tree.RESIDENCIES) * len(tree.BATCH_SIZES)

TRACK = """
import json, sys
from pathlib import Path
from coldset.core.layout import Layout
from coldset.reporting.track import run_track
res, uri, exp, tags = Path(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
lay = Layout(results=res, model={model!r})
pl = [(p, r) for p in {policies!r} for r in {residencies!r}]
run_track([lay.bench(p, r) for p, r in pl], [lay.parity(p, r) for p, r in pl], [lay.placement(p, r) for p, r in pl],
          lay.stats_dir / "skew.json", uri, exp, tags, res / "track" / "done.json",
          autotune_jsons=sorted((res / "autotune").glob("*.json")))
""".format(model=tree.MODEL, policies=tree.POLICIES, residencies=tree.RESIDENCIES)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as resp:
        return json.loads(resp.read())


def _track_both(trees: list[Path], url: str) -> list[dict]:
    """Two `track` processes at once against the server; returns their done JSONs."""
    def one(res: Path):
        return subprocess.run([sys.executable, "-c", TRACK, str(res), url, EXPERIMENT, json.dumps(TAGS)],
                              capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(one, trees))
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads((res / "track" / "done.json").read_text()) for res in trees]


def _all_runs(url: str, exp_id: str) -> list[dict]:
    runs, token = [], None
    while True:
        body = {"experiment_ids": [exp_id], "max_results": 100, **({"page_token": token} if token else {})}
        page = _post(f"{url}/api/2.0/mlflow/runs/search", body)
        runs += page.get("runs", [])
        token = page.get("next_page_token")
        if not token:
            return runs


def _tags(run: dict) -> dict:
    return {t["key"]: t["value"] for t in run["data"].get("tags", [])}


def _scale_speed(res: Path, scale: float) -> None:
    """Make a tree's bench ``scale`` times faster, with every metric derived from tok/s or the step
    recomputed by its definition (DESIGN.md §6): tok_s_per_gib is the tok/s difference to the same
    policy's next smaller residency over the GiB added, fetch_tax 1 - tok/s / tok/s at residency
    1.0, the bytes bound's fraction its floor over the step, the additive model the residency-1.0
    step plus the same link time."""
    lay = Layout(res, tree.MODEL)
    docs = {(p, r): json.loads(lay.bench(p, r).read_text()) for p in tree.POLICIES for r in tree.RESIDENCIES}
    entry = {(p, r, e["batch_size"]): e for (p, r), d in docs.items() for e in d["batches"]}
    old_full_step = {(p, b): entry[(p, 1.0, b)]["step_ms_mean"] for p in tree.POLICIES for b in tree.BATCH_SIZES}
    for e in entry.values():
        e["tok_s"] *= scale
        for k in ("step_ms_mean", "step_ms_p50", "step_ms_p90"):
            e[k] /= scale
    for (p, r, b), e in entry.items():
        full = entry[(p, 1.0, b)]
        e["fetch_tax"] = 1.0 - e["tok_s"] / full["tok_s"]
        smaller = [q for q in tree.RESIDENCIES if q < r]
        if smaller:
            prev = entry[(p, max(smaller), b)]
            e["tok_s_per_gib"] = (e["tok_s"] - prev["tok_s"]) / (e["hbm_expert_gib"] - prev["hbm_expert_gib"])
        e["fraction_of_bytes_bound"] = e["bytes_step_ms"] / e["step_ms_mean"]
        e["predicted_step_ms_calibrated"] += full["step_ms_mean"] - old_full_step[(p, b)]
    for (p, r), d in docs.items():
        lay.bench(p, r).write_text(json.dumps(d))


@pytest.fixture(scope="module")
def team(mlflow_server, tmp_path_factory):
    """Two result trees of a GPU bench (the second twice as fast, to tell them apart, its derived
    metrics recomputed), tracked at once."""
    trees = []
    for name, scale in (("alice", 1.0), ("bob", 2.0)):
        res = tree.build_results_tree(tmp_path_factory.mktemp(name), bytes_run="gpu")
        _scale_speed(res, scale)
        trees.append(res)
    done = _track_both(trees, mlflow_server.url)
    return trees, done


def test_two_concurrent_tracks_on_postgres_lose_and_duplicate_nothing(mlflow_server, team):
    trees, done = team
    url = mlflow_server.url
    exp = get_json(f"{url}/api/2.0/mlflow/experiments/get-by-name?experiment_name={EXPERIMENT}")["experiment"]
    assert {t["key"]: t["value"] for t in exp.get("tags", [])}["mlflow.experimentKind"] == "custom_model_development"
    runs = _all_runs(url, exp["experiment_id"])
    parents = [r for r in runs if "mlflow.parentRunId" not in _tags(r)]
    children = [r for r in runs if "mlflow.parentRunId" in _tags(r)]
    print(f"PostgreSQL-backed server: {len(parents)} parent runs, {len(children)} child runs")
    assert len(parents) == 2 and len(children) == 2 * N_RUNS
    assert len({_tags(r)["coldset.run_key"] for r in runs}) == len(runs)  # no key twice
    assert {p["info"]["run_id"] for p in parents} == {d["parent_run_id"] for d in done}

    for res, d in zip(trees, done):
        mine = [r for r in children if _tags(r)["mlflow.parentRunId"] == d["parent_run_id"]]
        assert sorted(r["info"]["run_id"] for r in mine) == sorted(d["runs"].values())
        assert len(mine) == N_RUNS
        for r in mine:  # every measurement arrived, in the tree it came from
            params = {p["key"]: p["value"] for p in r["data"]["params"]}
            metrics = {m["key"]: m["value"] for m in r["data"]["metrics"]}
            bench = json.loads(Layout(res, tree.MODEL).bench(params["policy"], float(params["residency"])).read_text())
            (entry,) = [e for e in bench["batches"] if e["batch_size"] == int(params["batch_size"])]
            for name in ("tok_s", "tok_s_per_gib", "fetch_tax", "fraction_of_bytes_bound"):
                if entry[name] is None:
                    assert name not in metrics
                else:
                    assert metrics[name] == pytest.approx(entry[name]), name

    # artifacts went through the server into the folder it serves
    some = children[0]
    listed = get_json(f"{url}/api/2.0/mlflow/artifacts/list?run_id={some['info']['run_id']}&path=placement")
    (art,) = listed["files"]
    on_disk = list(mlflow_server.artifacts.rglob(Path(art["path"]).name))
    assert len(on_disk) >= 1

    # both again at once: idempotent, the same runs
    again = _track_both(trees, url)
    assert [d["runs"] for d in again] == [d["runs"] for d in done]
    assert [d["parent_run_id"] for d in again] == [d["parent_run_id"] for d in done]
    assert len(_all_runs(url, exp["experiment_id"])) == len(runs)


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not installed (apt-get install -y chromium); the README's test command installs it")
    return path


def _browse(url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = ["timeout", "120", _chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1920,1000",
           "--virtual-time-budget=30000", *extra, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=150)


def test_ui_opens_the_experiment_on_its_runs_table(mlflow_server, team, tmp_path):
    trees, done = team
    # the experiment link track hands out: the runs table, both invocations' parent runs listed
    page = _browse(f"{mlflow_server.url}/{done[0]['experiment_link']}", tmp_path / "p1", "--dump-dom")
    assert page.returncode == 0, page.stderr[-2000:]
    assert "<title>Runs - Experiment" in page.stdout, re.findall(r"<title>[^<]*</title>", page.stdout)
    assert len(set(re.findall(rf"{tree.MODEL} \(cfg-team-[0-9a-f]+\)", page.stdout))) == 2
    # the README's speed view: its columns, batch size 1 children listed flat, ordered by tok_s_per_gib
    view = f"{mlflow_server.url}/{done[0]['comparison_view']}"
    page = _browse(view, tmp_path / "p2", "--dump-dom")
    assert page.returncode == 0, page.stderr[-2000:]
    assert done[0]["comparison_view"].endswith("viewStateShareKey=coldset-speed")  # a GPU bench
    for column in ("policy", "residency", "batch_size", "hbm_expert_gib", "tok_s", "tok_s_per_gib", "fetch_tax"):
        assert re.search(rf">\s*{column}\s*<", page.stdout), f"column {column} not in the runs table"
    shown = re.findall(r"(?:positional|usage_global)-[0-9.]+-b[0-9]+", page.stdout)
    assert shown and all(name.endswith("-b1") for name in shown), shown
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "mlflow-runs-table.png"
    res = _browse(view, tmp_path / "p3", f"--screenshot={shot}")
    assert res.returncode == 0 and shot.stat().st_size > 20_000, res.stderr[-2000:]
    print(f"screenshot of the runs table: {shot}")
    assert _git_status(shot) == "", f"the screenshot {shot} changed a file git tracks or shows"


def _git_status(path: Path) -> str:
    """``git status`` of ``path`` when it lies in this checkout (empty: untracked and ignored, or
    unchanged); empty outside a git checkout."""
    path = path.resolve()
    if shutil.which("git") is None or not (ROOT / ".git").exists() or ROOT.resolve() not in path.parents:
        return ""
    proc = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout
