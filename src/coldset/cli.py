"""``python -m coldset STAGE``: run one stage where Snakemake is not installed (the GPU host).

Stages read and write exactly the files the Snakefile's rules do (coldset.workflow.config.Layout), through
the same functions (coldset.workflow.pipeline), so results made here are picked up by a later
``snakemake`` run on another machine (copy results/ over; Snakemake judges them by time stamps).

``python -m coldset bench kernel|step|cache|render|replay ...``: the GPU measurements at real shape
(:mod:`coldset.measure`); ``python -m coldset bench`` alone is the bench stage.
"""

from __future__ import annotations

import argparse
import logging
import sys

from coldset.workflow.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) > 1 and argv[0] == "bench":
        # ``bench COMMAND``: a GPU measurement or its tables (coldset.measure.cli), not the bench stage
        from coldset.measure.cli import COMMANDS
        from coldset.measure.cli import main as bench_main

        if argv[1] in COMMANDS:
            return bench_main(argv[1:])
    from coldset.workflow import pipeline
    from coldset.core.trace import TraceError

    parser = argparse.ArgumentParser(prog="python -m coldset", description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=[*pipeline.STAGES, "report_models", "gpu-stages", "sweep"],
                        help="a stage, or gpu-stages: model, fixtures, routing, stats, placement, "
                             "autotune, parity (every placement), parity_gate, bench in order, or "
                             "sweep: every model of models: through track, then the comparison report; "
                             "bench kernel|step|cache|render|replay: the GPU measurements (python -m coldset bench "
                             "kernel -h)")
    parser.add_argument("--config", action="append",
                        help="workflow config (YAML; default config/config.yaml); repeat to layer overlays, "
                             "later files overriding earlier ones as Snakemake's --configfile does")
    parser.add_argument("--placement", action="append",
                        help="for parity/bench: a placement name such as usage_global-0.50 "
                             "(repeatable; default: every configured placement)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        config_files = args.config or ["config/config.yaml"]
        config = load_config(config_files)
        if args.stage == "sweep":
            from coldset.workflow.sweep import run_sweep

            print(run_sweep(config))
            return 0
        if args.stage == "report_models":  # a stage of coldset.workflow.sweep, which sits above the pipeline
            from coldset.workflow.sweep import report_models

            pipeline.run_stage(report_models, config)
            return 0
        if config.get("models"):
            raise ConfigError(f"{' + '.join(config_files)} sets models: (a sweep); run `python -m coldset sweep` for it")
        stages = pipeline.GPU_STAGES if args.stage == "gpu-stages" else [args.stage]
        for stage in stages:
            pipeline.run_stage(stage, config, placements=args.placement)
    except (ConfigError, pipeline.StageError, TraceError) as exc:  # a bad input file: its message, no traceback
        print(f"coldset: {exc}", file=sys.stderr)
        return 1
    return 0
