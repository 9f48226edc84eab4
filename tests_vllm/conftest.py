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
import subprocess  # noqa: E402

import pytest  # noqa: E402
import yaml  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
#: The workflow stages up to the gate, as `python -m coldset` runs them (the functions the rules call).
GATE_STAGES = ("model", "fixtures", "routing", "stats", "placement", "autotune", "parity", "parity_gate")
#: Placements of the plugin tests: two policies at half residency and an all-cold one.
PLUGIN_PLACEMENTS = ("usage_global-0.5", "positional-0.5", "positional-0.0")


def coldset_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])))


@pytest.fixture(scope="session")
def gated_workflow(tmp_path_factory):
    """The workflow up to the parity gate on the default synthetic checkpoint (config/config.yaml's
    model, CPU, float32), with few fixtures and the plugin tests' placements: the results folder
    and the config's path."""
    root = tmp_path_factory.mktemp("workflow")
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
