"""Services for the server tests (PostgreSQL, an ``mlflow server`` on it), started on loopback
by the tests themselves and stopped afterwards; see .ci/mlflow-server for the CI step."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bindir() -> Path | None:
    for cand in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (cand / "initdb").is_file():
            return cand
    return None


@dataclass
class Postgres:
    host: str
    port: int
    user: str
    database: str

    @property
    def sqlalchemy_uri(self) -> str:
        return f"postgresql+psycopg://{self.user}@{self.host}:{self.port}/{self.database}"


@pytest.fixture(scope="session")
def postgres():
    """A throwaway PostgreSQL cluster on 127.0.0.1 (trust auth, loopback only). As root it runs
    as the ``postgres`` user (PostgreSQL refuses root), in a folder that user can reach."""
    bindir = _pg_bindir()
    if bindir is None:
        pytest.fail("PostgreSQL is not installed (apt-get install -y postgresql): .ci/mlflow-server installs it")
    base = Path(tempfile.mkdtemp(prefix="coldset-pg-"))
    base.chmod(0o755)
    data, sock, logs = base / "data", base / "sock", base / "log"
    as_user: list[str] = []
    user = os.environ.get("USER") or "postgres"
    for d in (data, sock, logs):
        d.mkdir()
        if os.geteuid() == 0:
            shutil.chown(d, "postgres", "postgres")
    if os.geteuid() == 0:
        as_user, user = ["runuser", "-u", "postgres", "--"], "postgres"
    port = free_port()

    def run(*cmd: str) -> None:
        proc = subprocess.run([*as_user, *cmd], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            log = (logs / "postgres.log").read_text()[-2000:] if (logs / "postgres.log").exists() else ""
            pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}\n{log}")

    run(str(bindir / "initdb"), "-D", str(data), "-U", user, "--auth=trust", "-E", "UTF8")
    run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(logs / "postgres.log"), "-w", "-t", "60", "-o",
        f"-p {port} -k {sock} -c listen_addresses=127.0.0.1", "start")
    try:
        run(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", user, "mlflow")
        yield Postgres("127.0.0.1", port, user, "mlflow")
    finally:
        subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                       capture_output=True, timeout=120)
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class MlflowServer:
    url: str
    artifacts: Path
    log: Path


def get_json(url: str) -> dict:
    import json

    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="session")
def mlflow_server(postgres, tmp_path_factory):
    """``mlflow server`` with the PostgreSQL backend store and artifacts proxied to a folder it
    serves (``--artifacts-destination``), on 127.0.0.1; as README's team-server command."""
    root = tmp_path_factory.mktemp("mlflow-server")
    artifacts = root / "artifacts"
    port = free_port()
    log = root / "server.log"
    out = open(log, "w")
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", postgres.sqlalchemy_uri,
         "--artifacts-destination", str(artifacts), "--serve-artifacts", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "2"],
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=root,
        env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # 15-20 s on an idle machine; minutes when loaded
        while True:
            try:
                get_json(f"{url}/api/2.0/mlflow/experiments/search?max_results=1")
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if server.poll() is not None or time.monotonic() > deadline:
                    out.flush()
                    pytest.fail(f"mlflow server did not answer: {log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield MlflowServer(url, artifacts, log)
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait(timeout=5)
        out.close()
