import re
from pathlib import Path

from coldset.core.layout import Layout
from coldset.workflow.config import (
    check_config,
    comparison_path,
    model_configs,
    residency_label,
    skipped_stages,
)
from coldset.trace.fixtures import source_files

# models: (a sweep) makes the model a wildcard of every per-model rule; SWEEP holds each model's
# validated config (coldset.workflow.config.model_configs), which its jobs' scripts run with.
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
# nexttoken placements carry their forecaster's tables beside the JSON (coldset.core.placement.forecaster_path)
FORECASTED = [f"nexttoken-{r}" for r in RESIDENCIES] if "nexttoken" in POLICIES else []
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


# Input functions of the rules (`snakemake --lint`: rules and functions in separate files).
def fixture_sources(wildcards=None):
    """The prompt file or templates the fixtures are made from (an edit reruns what they feed)."""
    fx = config["fixtures"]
    return [str(p) for p in source_files(fx["domains"], fx["template_dir"], fx["prompts"])]


def model_sources(wildcards):
    """A local model's config.json; the synthetic model learns its domains from the fixtures' sources."""
    path = model_cfg(wildcards)["model"]["path"]
    return [str(Path(path) / "config.json")] if path else fixture_sources()


def routing_inputs(wildcards):
    """An imported trace needs only its file; a capture needs the model and the fixtures."""
    trace = model_cfg(wildcards)["routing"]["trace"]
    if trace:
        return {"trace": trace}  # checked against model.path when set
    return {
        "manifest": model_inputs(wildcards),
        "fixtures": expand(f"{RESULTS}/fixtures/{{domain}}.jsonl", domain=DOMAINS),
    }


def track_inputs(wildcards):
    """Bench, parity and autotune results when the model is decoded; placements and stats always."""
    m = model_name(wildcards)
    inputs = {
        "placement": expand(f"{RESULTS}/placement/{m}/{{placement}}.json", placement=PLACEMENTS),
        "skew": concrete(rules.stats.output.skew, wildcards),
        "locality": concrete(rules.stats.output.locality, wildcards),
        "cache": concrete(rules.cache.output.simulation, wildcards),
        # the parent run's MLflow datasets (coldset.workflow.stages.publish.track_datasets): the trace, and the
        # fixtures where the workflow generates them
        "trace": concrete(rules.routing.output.trace, wildcards),
    }
    if decodes(wildcards) or not model_cfg(wildcards)["routing"]["trace"]:
        inputs["fixtures"] = expand(f"{RESULTS}/fixtures/{{domain}}.jsonl", domain=DOMAINS)
    if decodes(wildcards):
        inputs["bench"] = expand(f"{RESULTS}/bench/{m}/{{placement}}.json", placement=PLACEMENTS)
        inputs["parity"] = expand(f"{RESULTS}/parity/{m}/{{placement}}.json", placement=PLACEMENTS)
        inputs["autotune"] = concrete(rules.autotune.output.entry, wildcards)
    return inputs


def report_inputs(wildcards):
    """The parity gate only when the model is decoded (a shape-only model skips it, DECODES)."""
    inputs = {
        "track": rules.track.output.done,
        "skew": rules.stats.output.skew,
        "coverage": rules.placement.output.coverage,
        "cache": rules.cache.output.simulation,
    }
    if DECODES:
        inputs["gate"] = rules.parity_gate.output.gate
    return inputs


# Bench figures exist only when the bench ran.
BENCH_BATCHES = config["bench"]["batch_sizes"] if DECODES else []
