"""The stages that publish the results: track (MLflow runs) and report (the HTML page)."""

from __future__ import annotations

import logging
from pathlib import Path

from coldset.core.files import read_json
from coldset.reporting.report import render_report
from coldset.reporting.track import log_report, run_track
from coldset.reporting.track_runs import DatasetRef
from coldset.workflow.config import config_hash, tracking_uri
from coldset.workflow.context import StageContext

log = logging.getLogger("coldset")


def track_datasets(ctx: StageContext, decoded: bool) -> list:
    """What the track stage records as the parent run's MLflow datasets: the routing trace, and
    the fixtures where the workflow generated them (it does not for a model that is not decoded
    and whose trace is imported). The track rule lists the same files as its inputs."""
    layout = ctx.layout
    refs = [DatasetRef(f"{layout.model}-routing-trace", layout.trace, "routing")]
    if decoded or not ctx.routing["trace"]:
        refs += [DatasetRef(f"fixtures-{d}", layout.fixtures(d), "fixtures") for d in ctx.fixtures["domains"]]
    return refs


def track(ctx: StageContext, **_) -> None:
    layout = ctx.layout
    names = ctx.placement_names()
    skipped = ctx.skipped
    decoded = "bench" not in skipped  # a shape-only model: runs from the placements' predictions
    tags = {"config_hash": config_hash(ctx.config), "model": ctx.model_name}
    if decoded:
        tags["autotune_key"] = read_json(layout.autotune)["key"]
    else:
        tags["stages_skipped"] = ",".join(skipped)
    run_track(
        datasets=track_datasets(ctx, decoded),
        results_dir=layout.results,
        bench_jsons=[layout.bench(*n.rsplit("-", 1)) for n in names] if decoded else [],
        parity_jsons=[layout.parity(*n.rsplit("-", 1)) for n in names] if decoded else [],
        placement_jsons=[layout.placement_dir / f"{n}.json" for n in names],
        stats_json=layout.stats_dir / "skew.json",
        tracking_uri=tracking_uri(ctx.config),
        experiment=ctx.tracking["experiment"],
        tags=tags,
        done_path=layout.track_done,
        autotune_jsons=[layout.autotune] if decoded else [],
        locality_json=_optional_input(layout.stats_dir / "locality.json", "stats"),
        simulation_csv=_optional_input(layout.cache_dir / "simulation.csv", "cache"),
    )


def _optional_input(path: Path, stage: str) -> Path | None:
    """A file of a stage that ``python -m coldset`` flows may not have run (gpu-stages runs no
    cache stage): absent = its metrics are not logged, with a warning naming the stage to run."""
    if path.is_file():
        return path
    log.warning("%s not found: its metrics are not logged (run the %s stage first)", path, stage)
    return None


def report(ctx: StageContext, **_) -> None:
    layout = ctx.layout
    figures_dir = layout.report.parent / "figures"
    render_report(layout.results, layout.report, ctx.config, figures_dir=figures_dir,
                  skipped=dict(ctx.skipped))
    if layout.track_done.is_file():  # the report joins the invocation's parent run in MLflow
        run_id = log_report(layout.track_done, layout.report, sorted(figures_dir.glob("*.png")))
        log.info("report logged to MLflow parent run %s", run_id)
    else:
        log.info("no %s: the report is not logged to MLflow (run track first)", layout.track_done)
