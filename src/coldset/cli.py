"""``python -m coldset STAGE``: run one stage where Snakemake is not installed (the GPU host).

Stages read and write exactly the files the Snakefile's rules do (coldset.core.layout.Layout), through
the same functions (coldset.workflow.pipeline), so results made here are picked up by a later
``snakemake`` run on another machine (copy results/ over; Snakemake judges them by time stamps).

``python -m coldset bench kernel|step|cache|render|replay ...``: the GPU measurements at real shape
(:mod:`coldset.measure`); ``python -m coldset bench`` alone is the bench stage.

``python -m coldset cold-experts TARGET [--budget R]``: per MoE layer, the experts a placement keeps
in host memory (:mod:`coldset.reporting.cold_experts`).
"""

from __future__ import annotations

import argparse
import logging
import sys

from coldset.core.trace import TraceError
from coldset.reporting import cold_experts
from coldset.workflow.config import ConfigError, load_config
from coldset.workflow.entry import INTERRUPTED_STATUS, interrupted_line, passive_omp_threads

STAGE_HELP = ("a stage (model, fixtures, routing, stats, placement, cache, autotune, parity, parity_gate, bench, "
              "track, report, report_models), or gpu-stages: model, fixtures, routing, stats, placement, "
              "autotune, parity (every placement), parity_gate, bench in order, or sweep: every model of "
              "models: through track, then the comparison report; bench kernel|step|cache|render|replay: the "
              "GPU measurements (python -m coldset bench kernel -h); cold-experts TARGET [--budget R]: the experts a "
              "placement keeps in host memory, per layer")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m coldset", description=__doc__.splitlines()[0])
    parser.add_argument("stage", help=STAGE_HELP)
    parser.add_argument("--config", action="append",
                        help="workflow config (YAML; default config/config.yaml); repeat to layer overlays, "
                             "later files overriding earlier ones as Snakemake's --configfile does")
    parser.add_argument("--placement", action="append",
                        help="for parity/bench: a placement name such as usage_global-0.50 "
                             "(repeatable; default: every configured placement)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "cold-experts":
        return cold_experts.main(argv[1:])
    if len(argv) > 1 and argv[0] == "bench":
        # ``bench COMMAND``: a GPU measurement or its tables, not the bench stage
        from coldset.measure.cli import COMMANDS  # GPU-only path: the measurements load torch and triton
        from coldset.measure.cli import main as bench_main

        if argv[1] in COMMANDS:
            return bench_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    passive_omp_threads()
    # the stages load torch: imported after passive_omp_threads(), as OpenMP reads OMP_WAIT_POLICY when torch loads
    from coldset.workflow import pipeline, sweep
    from coldset.workflow.context import StageContext, StageError

    if args.stage not in [*pipeline.STAGES, "report_models", "gpu-stages", "sweep"]:
        parser.error(f"argument stage: invalid choice: {args.stage!r} ({STAGE_HELP})")
    running = args.stage
    try:
        config_files = args.config or ["config/config.yaml"]
        config = load_config(config_files)
        if args.stage == "sweep":
            print(sweep.run_sweep(config))
            return 0
        if args.stage == "report_models":  # a stage of coldset.workflow.sweep, which sits above the pipeline
            pipeline.run_stage(sweep.report_models, config)
            return 0
        if config.get("models"):
            raise ConfigError(f"{' + '.join(config_files)} sets models: (a sweep); run `python -m coldset sweep` for it")
        ctx = StageContext.from_config(config)
        for running in pipeline.GPU_STAGES if args.stage == "gpu-stages" else [args.stage]:
            pipeline.run_stage(running, ctx, placements=args.placement)
    except (ConfigError, StageError, TraceError) as exc:  # a bad input file: its message, no traceback
        print(f"coldset: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(interrupted_line(f"stage {running}"), file=sys.stderr)
        return INTERRUPTED_STATUS
    return 0
