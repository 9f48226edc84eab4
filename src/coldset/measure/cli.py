"""``python -m coldset bench kernel|step|cache|render|replay``: the GPU measurements' command line.

Each measuring command writes its JSON under ``--out`` and prints its table (the rendering of
that JSON, :mod:`coldset.measure.render`) last on stdout; progress goes to stderr. ``replay``
(:mod:`coldset.measure.replay`) runs on the CPU: it simulates cache policies on what a ``bench
cache --save-replays`` run kept. Exit status 1
with a one-line reason when it cannot run here (no CUDA) or its input is wrong, and when a
correctness check of the measurement failed (the JSON says which).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from coldset.core.files import write_bytes
from coldset.measure import cache, kernel, replay, step
from coldset.measure.harness import MeasureError
from coldset.measure.render import refresh_page, render_files
from coldset.workflow.config import ConfigError

MEASUREMENTS = {"kernel": (kernel, "kernel_bench.json"), "step": (step, "decode_step.json"),
                "cache": (cache, "cache_bench.json")}
COMMANDS = (*MEASUREMENTS, "render", "replay")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m coldset bench",
                                     description="GPU measurements at real shape (CUDA), and their tables")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, _) in MEASUREMENTS.items():
        module.add_arguments(sub.add_parser(name, help=module.__doc__.split(":", 1)[1].strip().split(".")[0],
                                            description=module.__doc__.split("\n\n")[0]))
    rp = sub.add_parser("render", help="markdown tables of result JSON files")
    rp.add_argument("files", nargs="*", help="JSON written by bench kernel / step / cache")
    rp.add_argument("--out", help="write the markdown here instead of stdout")
    rp.add_argument("--into", help="a markdown page (e.g. BENCHMARKS.md) whose '<!-- rendered: PATH -->' blocks are "
                                   "re-rendered from their JSON in place; refused, naming both, where two blocks are "
                                   "the same measurement (coldset.measure.render.measurement_key)")
    replay.add_arguments(sub.add_parser("replay", description=replay.__doc__.split("\n\n")[0],
                                        help="cache policies by simulated time from a --save-replays run (CPU)"))
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "render" and args.into:
            page = Path(args.into)
            write_bytes(page, refresh_page(page.read_text(), page.parent).encode())
            return 0
        if args.command == "render":
            if not args.files:
                raise MeasureError("render: name result JSON files, or a page to refresh with --into")
            text = render_files(args.files)
            if args.out:
                write_bytes(args.out, text.encode())
            else:
                print(text, end="")
            return 0
        if args.command == "replay":
            print(replay.render_replay(replay.run(args)), end="")
            return 0
        module, name = MEASUREMENTS[args.command]
        result = module.run(args, argv)
        written = Path(args.out) / ("cache_decisions.json" if result.get("kind") == "cache-decisions" else name)
        print("\n" + render_files([str(written)]), end="")
        return 1 if result.get("fails") else 0
    except MeasureError as exc:
        print(f"coldset bench {args.command}: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, FileNotFoundError) as exc:
        print(f"coldset bench {args.command}: {exc}", file=sys.stderr)
        return 1
