"""The Snakemake workflow end to end on a tiny synthetic model (CPU), as a user runs it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coldset.workflow.entry import INTERRUPTED_STATUS, interrupted_line

REPO = Path(__file__).resolve().parents[1]
# The workflow catalogue's test config (.test/config/config.yaml): what `snakemake --directory
# .test` runs, here in a temporary working directory.
TINY = (REPO / ".test" / "config" / "config.yaml").read_text()
PLACEMENTS = ["positional-0.5", "positional-1.0", "usage_global-0.5", "usage_global-1.0", "lru-0.5", "lru-1.0"]


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("snakemake")
    return subprocess.run([str(exe), "-s", str(REPO / "Snakefile"), "--configfile", "tiny.yaml", "--cores", "2",
                           *args], cwd=workdir, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    wd = tmp_path_factory.mktemp("wf")
    (wd / "tiny.yaml").write_text(TINY)
    return wd


def test_dry_run_lists_the_pipeline(workdir):
    out = snakemake(workdir, "-n")
    assert out.returncode == 0, out.stderr
    for rule in ("model", "fixtures", "routing", "stats", "placement", "cache", "autotune", "parity", "parity_gate",
                 "bench", "track", "report"):
        assert f"rule {rule}:" in out.stdout + out.stderr


@pytest.mark.slow
def test_report_end_to_end_then_nothing_to_do(workdir):
    first = snakemake(workdir, "report")
    assert first.returncode == 0, first.stderr[-4000:]
    results = workdir / "results"
    gate = json.loads((results / "parity/tiny/gate.json").read_text())
    assert gate["passed"] and sorted(gate["placements"]) == sorted(PLACEMENTS)
    for name in PLACEMENTS:
        bench = json.loads((results / f"bench/tiny/{name}.json").read_text())
        entry = bench["batches"][0]
        assert entry["tok_s"] > 0 and 0 <= entry["cold_share"] <= 1
        # issue 30 item 4: distinct held-out requests of every domain, each domain's timing, and how
        # much of their text the profile prompts contain
        assert sorted(entry["domains"]) == ["agent", "code", "prose"] and len(set(entry["requests"])) == 3
        assert all(d["requests"] == 1 and d["tok_s"] > 0 for d in entry["domains"].values())
        heldout = {json.loads(line)["id"] for d in ("agent", "prose", "code")
                   for line in (results / f"fixtures/{d}.jsonl").read_text().splitlines()
                   if json.loads(line)["split"] == "heldout"}
        assert set(entry["requests"]) <= heldout
        assert 0 <= bench["prompt_overlap"]["share"] <= 1 and bench["prompt_overlap"]["ngram"] == 8
        if name.endswith("-1.0"):
            # CPU: no host tier, so measured speed compares nothing and no ratio is derived (issue 16)
            assert entry["cold_share"] == 0 and entry["fetch_tax"] is None and entry["tok_s_per_gib"] is None
    lru = json.loads((results / "bench/tiny/lru-0.5.json").read_text())["batches"][0]
    # the cache's own counts: every missed selection per token (2 layers x top-2 = 4 selections a token)
    assert lru["hit_rate"] == 1 - lru["cold_share"] and lru["misses_per_token"] == pytest.approx(4 * lru["cold_share"])
    html = (results / "report/index.html").read_text()
    assert "data:image/png;base64," in html and "usage_global" in html and "lru" in html and "hit_rate" in html
    for rule in ("model", "routing", "parity", "bench", "track", "report"):
        assert any((workdir / "logs" / rule).iterdir()), f"no log for {rule}"

    # A rerun has nothing to do, and the MLflow store still has one run per placement and batch size.
    again = snakemake(workdir, "report")
    assert again.returncode == 0
    assert "Nothing to be done" in again.stdout + again.stderr
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{results / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["coldset"])
    parents = runs[runs["tags.mlflow.parentRunId"].isna()]
    children = runs[runs["tags.mlflow.parentRunId"].notna()]
    assert len(parents) == 1 and len(children) == len(PLACEMENTS)
    assert set(children["tags.mlflow.parentRunId"]) == set(parents["run_id"])
    assert set(children["params.policy"]) == {"positional", "usage_global", "lru"}
    parent_id = parents["run_id"].item()
    client = mlflow.MlflowClient()
    assert "report/index.html" in {f.path for f in client.list_artifacts(parent_id, "report")}
    inputs = {d.dataset.name for d in client.get_run(parent_id).inputs.dataset_inputs}
    assert inputs == {"tiny-routing-trace", "fixtures-agent", "fixtures-prose", "fixtures-code"}
    assert children.loc[children["params.policy"] == "lru", "metrics.hit_rate"].notna().all()

    # Issue 16 item 7: delete the MLflow store, and `snakemake report` brings the runs back.
    (results / "mlflow.db").unlink()
    healed = snakemake(workdir, "report")
    assert healed.returncode == 0, healed.stderr[-4000:]
    assert "no longer exists" in healed.stderr
    assert _active_runs(results / "mlflow.db") == len(PLACEMENTS) + 1  # and their parent

    # Issue 16 items 5 and 6: bad settings are refused before any job, so nothing is deleted.
    manifest = results / "model/tiny/manifest.json"
    before = manifest.read_bytes()
    victim = workdir / "victim.jsonl"
    victim.write_text("not coldset's\n")
    for name, text, msg in [("typo.yaml", "model: {synthetic: {layerz: 2}}\n", "layerz"),
                            ("victim.yaml", "fixtures: {domains: ['../../victim']}\n", "'../../victim' does not match"),
                            ("dup.yaml", "placement: {residency: [0.5, 0.50]}\n", "non-unique")]:
        (workdir / name).write_text(text)
        bad = snakemake(workdir, "report", "--configfile", "tiny.yaml", name)
        assert bad.returncode != 0 and msg in bad.stdout + bad.stderr, (name, bad.stderr[-2000:])
    assert manifest.read_bytes() == before and victim.read_text() == "not coldset's\n"

    # Snakemake's own report (the catalogue's `--report report.zip`), with the captions in report/.
    smk_report = snakemake(workdir, "--report", "report.zip")
    assert smk_report.returncode == 0, smk_report.stderr[-2000:]
    import zipfile

    with zipfile.ZipFile(workdir / "report.zip") as z:
        names = z.namelist()
    assert any(n.endswith("report.html") for n in names) and len(names) > 10

    # The gate fails, naming the placement, when a parity report says a token differed.
    path = results / "parity/tiny/usage_global-0.5.json"
    doc = json.loads(path.read_text())
    doc.update(passed=False, tokens_matched=doc["tokens_total"] - 1)
    path.write_text(json.dumps(doc))
    failed = snakemake(workdir, "parity_gate")
    assert failed.returncode != 0
    log = (workdir / "logs/parity_gate/tiny.log").read_text()
    assert "usage_global-0.5" in log and "1 of" in log

    # Issue 16 item 2: the placement stage rewrites a placement (another valid row map); the CLI
    # gate refuses the parity report that checked the old one.
    from coldset.core.placement import load_placement, save_placement

    pl = load_placement(results / "placement/tiny/usage_global-0.5.json")
    hot = pl.row_map >= 0
    pl.row_map = pl.row_map.copy()
    pl.row_map[hot] = pl.num_hot - 1 - pl.row_map[hot]
    save_placement(pl, results / "placement/tiny/usage_global-0.5.json")
    cli = subprocess.run([sys.executable, "-m", "coldset", "parity_gate", "--config", "tiny.yaml"], cwd=workdir,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert cli.returncode == 1
    assert "parity/tiny/usage_global-0.5.json is stale" in cli.stderr and "usage_global-0.5.rowmap.npy" in cli.stderr

    # Issue 16 item 1: edit a row map in place; `snakemake parity_gate` reruns parity (the row maps are
    # its inputs), which fails naming the edited file instead of answering "Nothing to be done".
    import numpy as np

    npy = results / "placement/tiny/positional-0.5.rowmap.npy"
    row_map = np.load(npy)
    row_map[row_map >= 0] = row_map[row_map >= 0][::-1]
    np.save(npy, row_map)
    edited = snakemake(workdir, "parity_gate")
    assert edited.returncode != 0
    log = (workdir / "logs/parity/tiny.log").read_text()
    assert f"{npy.relative_to(workdir)}: sha256 differs" in log


def _active_runs(db: Path) -> int:
    """Active runs in an MLflow SQLite store, read with sqlite3 (independent of MLflow's caches)."""
    import sqlite3

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)  # never creates an empty file
    try:
        return con.execute("SELECT COUNT(*) FROM runs WHERE lifecycle_stage = 'active'").fetchone()[0]
    finally:
        con.close()


# ---------------------------------------------------------------- Ctrl-C


def test_an_interrupted_stage_ends_its_job_with_130_and_a_line_in_its_log(tmp_path):
    """A job's script on Ctrl-C: exit status 130, the reason in the rule's log, nothing on the
    console and no traceback (the Snakefile's onerror prints the one line for the run)."""
    script = f"""
from types import SimpleNamespace

from coldset.workflow.config import validate_config
from coldset.workflow.entry import run_from_snakemake


def slow(ctx, **_):
    raise KeyboardInterrupt


config = validate_config({{"results": {str(tmp_path / "results")!r}}})
run_from_snakemake(SimpleNamespace(log=[{str(tmp_path / "job.log")!r}], threads=1, config=config,
                                   wildcards=SimpleNamespace()), slow)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert (out.returncode, out.stdout, out.stderr) == (INTERRUPTED_STATUS, "", "")
    log = (tmp_path / "job.log").read_text()
    assert "stage slow interrupted" in log and "Traceback" not in log


@pytest.mark.slow
def test_ctrl_c_prints_one_line_saying_what_was_kept_and_how_to_resume(tmp_path):
    """Ctrl-C (SIGINT to Snakemake's process group) while a job runs: the console gets
    interrupted_line(), not a RuleException per job, an "Error in rule" block or a traceback;
    running the same command again finishes the job."""
    (tmp_path / "tiny.yaml").write_text(TINY)
    exe = Path(sys.executable).with_name("snakemake")
    cmd = [str(exe), "-s", str(REPO / "Snakefile"), "--configfile", "tiny.yaml", "--cores", "2", "model"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True,  # its own process group, as a terminal's foreground job
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    job_log = tmp_path / "logs" / "model" / "tiny.log"
    deadline = time.monotonic() + 240
    while not job_log.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job_log.exists(), "the model job never started"
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert interrupted_line() in err.splitlines(), err[-3000:]
    for crash in ("RuleException", "Error in rule", "Traceback", "CalledProcessError"):
        assert crash not in err, err[-3000:]
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "results" / "model" / "tiny" / "manifest.json").is_file()


# ---------------------------------------------------------------- the workflow catalogue's conventions


def test_snakemake_lint_reports_nothing():
    exe = Path(sys.executable).with_name("snakemake")
    out = subprocess.run([str(exe), "--lint"], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert out.returncode == 0 and "Congratulations, your workflow is in a good condition" in out.stdout + out.stderr, (
        out.stdout[-3000:] + out.stderr[-3000:])


def test_rules_and_snakefile_are_snakefmt_formatted():
    exe = Path(sys.executable).with_name("snakefmt")
    files = [str(REPO / "Snakefile"), *sorted(str(p) for p in (REPO / "workflow" / "rules").glob("*.smk"))]
    out = subprocess.run([str(exe), "--check", "--diff", *files], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"run `snakefmt Snakefile workflow/rules/`:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"


def _digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (results/ before and after a run on bad input)."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_bad_input_files_keep_the_results_and_say_why(tmp_path):
    """Issue 30 item 1: a bad prompt file, template, model folder or trace is refused before any
    job runs, naming the file and what is wrong; a trace that fails only inside its job leaves the
    previous trace in place, the reason is on the console, and the next run redoes the job."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "tiny.yaml").write_text(TINY)
    trace = "results/routing/tiny/trace.parquet"
    first = snakemake(tmp_path, trace)
    assert first.returncode == 0, first.stderr[-4000:]
    results = tmp_path / "results"
    before = _digests(results)
    assert trace.removeprefix("results/") in before and "model/tiny/manifest.json" in before

    good = pq.read_table(tmp_path / trace)
    pq.write_table(good.drop_columns(["layer"]).replace_schema_metadata(good.schema.metadata),
                   tmp_path / "no_layer.parquet")
    experts = good.column("expert").to_numpy().copy()
    experts[3] = 99  # outside 0..7: only the full scan in the routing job finds it
    pq.write_table(good.set_column(good.schema.get_field_index("expert"), "expert", pa.array(experts, pa.int16()))
                   .replace_schema_metadata(good.schema.metadata), tmp_path / "bad_expert.parquet")
    (tmp_path / "no_domain.jsonl").write_text(json.dumps({"domain": "", "prompt": "hello"}) + "\n")
    (tmp_path / "no_prompt.jsonl").write_text(json.dumps({"domain": "agent", "prompt": "  "}) + "\n")
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates/agent.j2").write_text("\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text("{not json")
    import yaml

    local = yaml.safe_load(TINY)
    local["model"] = {"name": "tiny", "path": "model"}
    (tmp_path / "local.yaml").write_text(yaml.safe_dump(local))
    refused = [  # refused while the workflow is parsed: no job starts
        ("routing: {trace: no_layer.parquet}", "missing column(s) ['layer']"),
        ("fixtures: {prompts: no_domain.jsonl}", "no_domain.jsonl:1: field 'domain' must be a name"),
        ("fixtures: {prompts: no_prompt.jsonl}", "no_prompt.jsonl:1: field 'prompt' must be a non-empty string"),
        ("fixtures: {template_dir: templates}", "templates/agent.j2 is empty"),
        (None, "model/config.json: not valid JSON"),  # local.yaml: model.path, the folder above
    ]
    for i, (overlay, message) in enumerate(refused):
        configs = ["tiny.yaml", f"bad{i}.yaml"] if overlay else ["local.yaml"]
        if overlay:
            (tmp_path / f"bad{i}.yaml").write_text(overlay + "\n")
        bad = snakemake(tmp_path, trace, "--configfile", *configs)
        console = bad.stdout + bad.stderr
        assert bad.returncode != 0 and message in console, (overlay, console[-3000:])
        assert "Error in rule" not in console, overlay
        assert _digests(results) == before, overlay

    (tmp_path / "late.yaml").write_text("routing: {trace: bad_expert.parquet}\n")
    late = snakemake(tmp_path, trace, "--configfile", "tiny.yaml", "late.yaml")
    console = late.stdout + late.stderr
    assert late.returncode != 0 and "Error in rule routing" in console
    assert "column 'expert' holds expert id 99 outside 0..7" in console  # the reason, not only "check log file(s)"
    assert _digests(results) == before
    # the kept trace is not taken for the failed job's output: the next run redoes the job
    again = snakemake(tmp_path, trace, "--configfile", "tiny.yaml", "late.yaml", "-n")
    assert again.returncode == 0 and "rule routing:" in again.stdout + again.stderr
    assert np.array_equal(pq.read_table(tmp_path / trace).column("expert").to_numpy(), good.column("expert").to_numpy())
