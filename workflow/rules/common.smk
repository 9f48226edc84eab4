import sys
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir) / "src"))  # a plain clone works without `pip install -e`

import re

from coldset.config import Layout, check_config, residency_label
from coldset.pipeline import skipped_stages
from coldset.sweep import comparison_path, model_configs

# models: (a sweep) makes the model a wildcard of every per-model rule; SWEEP holds each model's
# validated config (coldset.sweep.model_configs), which its jobs' scripts run with.
SWEEPING = bool(config.get("models"))
SWEEP = model_configs(config)
MODELS = list(SWEEP)
RESULTS = config["results"]
MODEL = "{model}" if SWEEPING else config["model"]["name"]
LAYOUT = Layout(Path(RESULTS), MODEL)


wildcard_constraints:
    model="|".join(re.escape(m) for m in MODELS),


# Cross-field and file checks before any job starts: a job that fails on a setting has already
# had its old outputs deleted by Snakemake (config/schema.yaml holds the rest). Every model of a
# sweep is checked with its own config.
for _name, _cfg in SWEEP.items():
    check_config(_cfg, f"config models.{_name}" if SWEEPING else "config")
POLICIES = config["placement"]["policies"]
RESIDENCIES = [residency_label(r) for r in config["placement"]["residency"]]
PLACEMENTS = [f"{p}-{r}" for p in POLICIES for r in RESIDENCIES]
DOMAINS = config["fixtures"]["domains"]


def model_name(wildcards) -> str:
    """The model a job is for: its wildcard in a sweep, else the one model."""
    return wildcards.model if SWEEPING else MODEL


def model_cfg(wildcards) -> dict:
    """The validated config of a job's model."""
    return SWEEP[model_name(wildcards)]


def concrete(patterns, wildcards) -> list[str]:
    """Paths with the job's model filled in (an input function must return concrete paths)."""
    return expand(patterns, model=model_name(wildcards), allow_missing=True)


# A shape-only model (config.json without weights, or a family the engine does not run) skips the
# decoding stages (autotune, parity, bench); track and report then read stats and placements only.
def decodes(wildcards) -> bool:
    return not skipped_stages(model_cfg(wildcards))


SKIPPED = {} if SWEEPING else skipped_stages(config)
DECODES = not SKIPPED


def model_inputs(wildcards):
    """The model stage's manifest: every model-reading rule depends on it."""
    return Layout(Path(RESULTS), model_name(wildcards)).model_dir / "manifest.json"
