# The track stage creates (or heals) the MLflow store itself, atomically under a lock
# (coldset.reporting.track.ensure_store): stages that never touch MLflow cannot fail on it. A done file whose
# SQLite store was deleted is stale: it is dated back to 1970 before the DAG is built, so that it is
# older than its inputs and `snakemake report` logs the runs again and re-renders the report.
# (Deleting it would not do: Snakemake does not rerun up-to-date jobs for a missing intermediate.)
import os

from snakemake.logging import logger

from coldset.reporting.track_store import done_is_stale

for _model in MODELS:
    _done = Layout(Path(RESULTS), _model).track_done
    if (_why := done_is_stale(_done)) is not None:
        logger.warning(f"{_done}: {_why}; the track stage will run again to recreate the runs")
        os.utime(_done, (0, 0))


rule track:
    input:
        unpack(track_inputs),
    output:
        done=update(f"{RESULTS}/track/{MODEL}.done"),
    log:
        f"logs/track/{MODEL}.log",
    conda:
        "../envs/coldset.yaml"
    params:
        tracking=config["tracking"],
    script:
        "../scripts/track.py"
