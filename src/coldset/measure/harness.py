"""What every GPU measurement shares: the CUDA check, repeats summarised as median and spread,
and the result file with its provenance.

Why median and spread: a figure that is the best of several runs publishes the lucky one (issue
30: the decode step at batch 8 met 65% of its floor in one run of three). Every timed figure a
command reports is the median over its repeats, with the slowest and fastest beside it
(:func:`spread`); the renderer prints all three.
"""

from __future__ import annotations

import datetime
import shlex
import statistics
import sys
import time
from pathlib import Path

_T0 = time.perf_counter()


class MeasureError(RuntimeError):
    """A measurement that cannot run here (no CUDA) or was asked for wrongly; its message says why."""


def require_cuda():
    """The CUDA device a measurement runs on; :class:`MeasureError` naming what is missing
    when torch is absent or sees no CUDA device (a CPU timing of these kernels means nothing)."""
    try:
        import torch
    except ImportError as exc:
        raise MeasureError(f"needs a CUDA GPU: torch is not importable here ({exc})") from exc
    if not torch.cuda.is_available():
        raise MeasureError(f"needs a CUDA GPU; torch {torch.__version__} sees none here "
                           "(torch.cuda.is_available() is False). Run it on the GPU host.")
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise MeasureError("needs triton (the kernels it times), which is not installed here")
    return torch.device("cuda")


def log(*parts) -> None:
    """Progress to stderr with the seconds since start (the table goes to stdout, last)."""
    print(f"[{time.perf_counter() - _T0:7.1f}s]", *parts, file=sys.stderr, flush=True)


def spread(runs: list[float]) -> dict:
    """``{"median", "min", "max", "runs"}`` of repeated timings of one thing (see module doc)."""
    if not runs:
        raise ValueError("spread: no runs")
    runs = [float(r) for r in runs]
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}


def new_result(kind: str, argv: list[str] | None, args) -> dict:
    """The head of a result: its kind (which table renders it), the command line that reproduces
    it, the parsed arguments and the UTC date."""
    line = "python -m coldset bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    return {"kind": kind, "command": line, "args": {k: v for k, v in vars(args).items() if k != "func"},
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def write_result(path: Path, result: dict, ceilings: dict | None = None, tuned=None) -> Path:
    """Write ``result`` (atomically, complete or absent) with its provenance: the code's commit,
    the software stack, the device and the ceilings measured in this run
    (:func:`coldset.provenance.collect_provenance`)."""
    import torch

    from coldset.files import write_json
    from coldset.provenance import collect_provenance

    if "provenance" not in result or ceilings is not None:
        result["provenance"] = collect_provenance(torch.device("cuda"), tuned, ceilings)
    write_json(path, result)
    return path
