"""The stages of the workflow by name, and :func:`run_stage` (docs/design.md §1).

Each stage reads and writes the files :class:`coldset.core.layout.Layout` names, so the
Snakemake rules (through workflow/scripts/, which only call
:func:`coldset.workflow.entry.run_from_snakemake`) and ``python -m coldset STAGE`` (for the GPU
host, which has no Snakemake) run the same code on the same paths. A stage takes the
:class:`coldset.workflow.context.StageContext` built once from the validated config; the stage
bodies (coldset.workflow.stages) only translate it into library calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from coldset.workflow.context import StageContext, StageError
from coldset.workflow.stages.bench import bench
from coldset.workflow.stages.prepare import autotune, cache, fixtures, model, placement, routing, stats
from coldset.workflow.stages.publish import report, track
from coldset.workflow.stages.verify import parity, parity_gate

log = logging.getLogger("coldset")

STAGES = {f.__name__: f for f in (model, fixtures, routing, stats, placement, cache, autotune, parity,
                                  parity_gate, bench, track, report)}
GPU_STAGES = ["model", "fixtures", "routing", "stats", "placement", "autotune", "parity", "parity_gate", "bench"]


def run_stage(stage: str | Callable[..., None], config: dict | StageContext,
              placements: list[str] | None = None) -> None:
    """Run one stage: a name of :data:`STAGES`, or the stage function of a module above the
    pipeline (``coldset.workflow.sweep.report_models``), on the context (built here from a
    validated config once per call; a caller running several stages builds it once and passes
    it); the stage's own errors propagate with their messages."""
    fn = stage if callable(stage) else STAGES.get(stage)
    if fn is None:
        raise StageError(f"unknown stage {stage!r}; stages: {list(STAGES)}")
    ctx = config if isinstance(config, StageContext) else StageContext.from_config(config)
    name = fn.__name__
    log.info("stage %s", name)
    t0 = time.perf_counter()
    fn(ctx, placements=placements)
    log.info("stage %s done in %.1f s", name, time.perf_counter() - t0)
