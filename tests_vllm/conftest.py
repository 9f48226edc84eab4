"""The vLLM cross-engine tests: run only in the separate vLLM environment (``.ci/vllm``).

They live outside tests/ so the main suite never collects them. tests/hf_fixtures.py (the tiny
transformers-built checkpoints) is shared with the main suite.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402

import pytest  # noqa: E402
import yaml  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
#: The workflow stages up to the gate, as `python -m coldset` runs them (the functions the rules call).
GATE_STAGES = ("model", "fixtures", "routing", "stats", "placement", "autotune", "parity", "parity_gate")
#: Placements of the plugin tests: two policies at half residency and an all-cold one.
PLUGIN_PLACEMENTS = ("usage_global-0.5", "positional-0.5", "positional-0.0")
#: Short (domain, prompt) fixtures of the workflow tests (the default fixtures' are hundreds of the
#: tiny tokenizers' tokens), two per domain.
PROMPTS = [
    ("agent", '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
    ("agent", '{"name": "add", "arguments": {"a": 1, "b": 2}}'),
    ("code", "def add(a, b):\n    return a + b"),
    ("code", "for i in range(10):\n    print(i * i)"),
    ("prose", "The quick brown fox jumps over the lazy dog."),
    ("prose", "Mixture of experts models route every token."),
]


#: A token of a log line that holds a "/": a path (the model folder, a placement, the venv's files in
#: warnings) or a URL. A path may hold any word, the package's name too (a checkout cloned into its
#: default folder, ``coldset``), so the plugin's words are looked for outside these.
PATH_TOKEN = re.compile(r"""[^\s'"]*/[^\s'"]*""")


def coldset_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])))


def plugin_lines(log: str) -> list[str]:
    """The lines of a vLLM log in which coldset's plugin speaks: its logger's messages (``coldset:
    ...``, vLLM's ``[vllm_plugin.py:N]`` source tag), its refusals (``coldset vLLM plugin (...)``,
    ``PluginError``), its custom op; looked for with every path and URL masked."""
    return [line for line in log.splitlines()
            if re.search(r"coldset|vllm_plugin|PluginError", PATH_TOKEN.sub("<path>", line), re.IGNORECASE)]


def vllm_capture(root: Path, fixtures: list[tuple], checkpoints: dict[str, Path], **job) -> tuple[dict, dict, str]:
    """One run of tests_vllm/run_vllm_capture.py (vLLM in a subprocess) over ``checkpoints`` (name ->
    folder), each captured on ``fixtures`` ((id, domain, split, prompt, max_new_tokens) rows, written to
    ``root``/fixtures.jsonl) into ``root``/<name>.vllm.parquet and .vllm.tokens.jsonl; ``job``: the job
    file's other keys. Returns (each name's run as the job file holds it, the script's result, its stderr)."""
    path = root / "fixtures.jsonl"
    path.write_text("".join(json.dumps(dict(id=i, domain=d, split=s, prompt=p, max_new_tokens=n)) + "\n"
                            for i, d, s, p, n in fixtures))
    runs = {name: dict(model_dir=str(folder), fixtures=str(path), out=str(root / f"{name}.vllm.parquet"),
                       tokens_out=str(root / f"{name}.vllm.tokens.jsonl"), method="auto")
            for name, folder in checkpoints.items()}
    job_path, result = root / "job.json", root / "result.json"
    job_path.write_text(json.dumps({"runs": list(runs.values()), **job}))
    script = REPO / "tests_vllm" / "run_vllm_capture.py"
    proc = subprocess.run([sys.executable, str(script), str(job_path), str(result)], capture_output=True, text=True,
                          timeout=600, env=coldset_env())
    assert proc.returncode == 0, f"vLLM capture failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    return runs, json.loads(result.read_text()), proc.stderr


class ServerProcess:
    """A vLLM API server process in its own session (stopped by its process group id), its
    output in ``log``; ``base`` is the URL it answers on."""

    def __init__(self, argv: list[str], log: Path, env: dict, base: str, cwd: Path | None = None):
        self.base, self.log = base, log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> bool:
        """True once /health answers; False if the process exited first."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM server not ready after {timeout} s; log {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._out.close()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def embedded_tokens(model_dir: Path, placement_dir: Path, name: str | None, prompts: list[list[int]],
                    max_tokens: int) -> list[list[int]]:
    """coldset's embedded engine, one prompt at a time, at placement ``name`` (None: all hot)."""
    import torch  # the engine (torch) loads only where a test decodes

    from coldset.core.placement import load_placement
    from coldset.engine.loading import load_model
    from coldset.verify import gate

    mdl = load_model(model_dir, dtype=torch.float32)
    if name is None:
        return [gate.reference_decode(mdl, [p], max_tokens, 1, progress=False).tokens[0] for p in prompts]
    pools = mdl.pools.placed(load_placement(placement_dir / f"{name}.json").row_map)
    return [gate.placement_decode(mdl, pools, [p], max_tokens, 1, progress=False).tokens[0] for p in prompts]


@pytest.fixture(scope="session")
def gated_workflow(tmp_path_factory):
    """The workflow up to the parity gate on the default synthetic checkpoint (config/config.yaml's
    model, CPU, float32), with few fixtures and the plugin tests' placements: the results folder
    and the config's path.

    It runs in a folder named ``coldset``, the folder ``git clone`` makes: every path vLLM prints
    (model folder, placement) then holds the package's name, in any checkout, so no test can pass
    only because its checkout's folder is named otherwise."""
    root = tmp_path_factory.mktemp("workflow") / "coldset"
    root.mkdir()
    config = {
        "results": str(root / "results"),
        "model": {"name": "synthetic-moe", "synthetic": {}, "dtype": "float32"},
        "device": "cpu",
        "fixtures": {"domains": ["agent", "prose", "code"], "per_domain": 2, "max_new_tokens": 8},
        "placement": {"policies": ["positional", "usage_global"], "residency": [0.0, 0.5]},
        "parity": {"max_new_tokens": 8},
    }
    cfg_path = root / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    for stage in GATE_STAGES:
        proc = subprocess.run([sys.executable, "-m", "coldset", stage, "--config", str(cfg_path)], cwd=root,
                              capture_output=True, text=True, timeout=600, env=coldset_env())
        assert proc.returncode == 0, f"stage {stage} failed:\n{proc.stderr[-6000:]}"
    gate = json.loads((root / "results" / "parity" / "synthetic-moe" / "gate.json").read_text())
    assert gate["passed"] and set(PLUGIN_PLACEMENTS) <= set(gate["placements"])
    return {"root": root, "results": root / "results", "config": cfg_path,
            "model_dir": root / "results" / "model" / "synthetic-moe" / "hf",
            "placement_dir": root / "results" / "placement" / "synthetic-moe"}
