"""The workflow on a tiny model (an engine family's checkpoint or a synthetic one), on the CPU, as
every workflow test runs it: the stages in this process on a config overlay, and the parity gate's verdict that every
placement, static and the slot cache's, decodes bitwise the all-hot path's logits."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from coldset.workflow import pipeline, process_engine
from coldset.workflow.config import load_config

DEFAULT = Path(__file__).resolve().parents[1] / "config" / "config.yaml"
STAGES = ["model", "fixtures", "routing", "stats", "placement", "autotune", "parity", "parity_gate"]
PLACEMENTS = [f"{p}-{r}" for p in ("positional", "usage_global", "lru") for r in ("0.5", "1.0")]


def run_stages(root: Path, model: dict, stages=STAGES, base: Path = DEFAULT, **sections) -> dict:
    """Run ``stages`` on the config ``base`` with the ``model`` section (a checkpoint's name, path and
    dtype, or a synthetic model's) and results under ``root``: a few fixtures of 6 tokens, positional /
    usage_global / lru at residency 0.5 and 1.0, and ``sections`` overlaid. Returns the config; the
    caller releases the engine (:func:`process_engine.release_engine`)."""
    overlay = {
        "results": str(root / "results"),
        "model": model,
        "device": "cpu",
        "fixtures": {"per_domain": 2, "max_new_tokens": 6},
        "routing": {"batch_size": 4},
        "placement": {"policies": ["positional", "usage_global", "lru"], "residency": [0.5, 1.0]},
        "parity": {"max_new_tokens": 6},
        "autotune": {"cache_dir": str(root / "autotune-cache")},
        **sections,
    }
    (root / "tiny.yaml").write_text(yaml.safe_dump(overlay))
    config = load_config([base, root / "tiny.yaml"])
    process_engine.release_engine()
    for stage in stages:
        pipeline.run_stage(stage, config)
    return config


def assert_every_placement_bitwise(results: Path, name: str) -> None:
    """The gate passed over every placement of :func:`run_stages`, each decoding every token with
    logits equal to the all-hot path's, and residency 0.5 with cold experts."""
    res = results / "parity" / name
    gate = json.loads((res / "gate.json").read_text())
    assert gate["passed"] and sorted(gate["placements"]) == sorted(PLACEMENTS)
    for placement in PLACEMENTS:
        parity = json.loads((res / f"{placement}.json").read_text())
        assert parity["passed"] and parity["tokens_matched"] == parity["tokens_total"] > 0
        assert parity["max_abs_logit_diff"] == 0.0
        if placement.endswith("0.5"):
            assert parity["num_cold"] > 0
