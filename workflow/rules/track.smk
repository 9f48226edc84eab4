# The track stage creates (or heals) the MLflow store itself, atomically under a lock
# (coldset.track.ensure_store): stages that never touch MLflow cannot fail on it. A done file whose
# SQLite store was deleted is stale: it is dated back to 1970 before the DAG is built, so that it is
# older than its inputs and `snakemake report` logs the runs again and re-renders the report.
# (Deleting it would not do: Snakemake does not rerun up-to-date jobs for a missing intermediate.)
import os

from snakemake.logging import logger

from coldset.track import done_is_stale

if (_why := done_is_stale(LAYOUT.track_done)) is not None:
    logger.warning(f"{LAYOUT.track_done}: {_why}; the track stage will run again to recreate the runs")
    os.utime(LAYOUT.track_done, (0, 0))


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


rule track:
    input:
        unpack(track_inputs),
    output:
        done=f"{RESULTS}/track/{MODEL}.done",
    log:
        f"logs/track/{MODEL}.log",
    params:
        tracking=config["tracking"],
    conda:
        "../envs/coldset.yaml"
    script:
        "../scripts/track.py"
