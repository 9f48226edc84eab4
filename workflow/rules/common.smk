import sys
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir) / "src"))  # a plain clone works without `pip install -e`

from coldset.config import Layout, check_config, residency_label
from coldset.pipeline import skipped_stages

if config.get("models"):
    raise ValueError(
        "config sets models: (a sweep over models); the rules run one model: run "
        "`python -m coldset sweep --config FILE` (every model, then results/report/models.html), "
        "or give one model: section per snakemake run"
    )

# Cross-field and file checks before any job starts: a job that fails on a setting has already
# had its old outputs deleted by Snakemake (config/schema.yaml holds the rest).
check_config(config, "config")
LAYOUT = Layout.from_config(config)
POLICIES = config["placement"]["policies"]
RESIDENCIES = [residency_label(r) for r in config["placement"]["residency"]]
PLACEMENTS = [f"{p}-{r}" for p in POLICIES for r in RESIDENCIES]
DOMAINS = config["fixtures"]["domains"]
RESULTS = config["results"]
MODEL = config["model"]["name"]
# A shape-only model (config.json without weights, or a family the engine does not run) skips the
# decoding stages (autotune, parity, bench); track and report then read stats and placements only.
SKIPPED = skipped_stages(config)
DECODES = not SKIPPED


def model_inputs(wildcards=None):
    """The model stage's manifest: every model-reading rule depends on it."""
    return LAYOUT.model_dir / "manifest.json"


def routing_inputs(wildcards):
    """An imported trace needs only its file; a capture needs the model and the fixtures."""
    if config["routing"]["trace"]:
        return {"trace": config["routing"]["trace"]}  # checked against model.path when set
    return {
        "manifest": model_inputs(),
        "fixtures": expand(f"{RESULTS}/fixtures/{{domain}}.jsonl", domain=DOMAINS),
    }


# Input functions of the track and report rules (here: `snakemake --lint` wants rules and
# functions in separate files).
def track_inputs(wildcards):
    """Bench, parity and autotune results when the model is decoded; placements and stats always."""
    inputs = {
        "placement": expand(f"{RESULTS}/placement/{MODEL}/{{placement}}.json", placement=PLACEMENTS),
        "skew": rules.stats.output.skew,
    }
    # the parent run's MLflow datasets (coldset.pipeline.track_datasets): the trace, and the
    # fixtures where the workflow generates them
    inputs["trace"] = rules.routing.output.trace
    if DECODES or not config["routing"]["trace"]:
        inputs["fixtures"] = expand(f"{RESULTS}/fixtures/{{domain}}.jsonl", domain=DOMAINS)
    if DECODES:
        inputs["bench"] = expand(f"{RESULTS}/bench/{MODEL}/{{placement}}.json", placement=PLACEMENTS)
        inputs["parity"] = expand(f"{RESULTS}/parity/{MODEL}/{{placement}}.json", placement=PLACEMENTS)
        inputs["autotune"] = rules.autotune.output.entry
    return inputs


def report_inputs(wildcards):
    """The parity gate only when the model is decoded (a shape-only model skips it, DECODES)."""
    inputs = {
        "track": rules.track.output.done,
        "skew": rules.stats.output.skew,
        "coverage": rules.placement.output.coverage,
    }
    if DECODES:
        inputs["gate"] = rules.parity_gate.output.gate
    return inputs
