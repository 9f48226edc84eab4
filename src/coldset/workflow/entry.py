"""How a run enters the stages: the Snakemake scripts (:func:`run_from_snakemake`), the Snakefile's
hooks (:func:`rerun_restored_outputs`, :class:`InterruptWatch`) and ``python -m coldset``
(:func:`passive_omp_threads`, :func:`interrupted_line`).

Light on purpose: the Snakefile imports it while Snakemake builds the DAG, and a script must set
``OMP_WAIT_POLICY`` before torch loads, so the stages (coldset.workflow.pipeline, which loads
torch) are imported by :func:`run_from_snakemake` after that.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coldset.workflow.config import model_configs

log = logging.getLogger("coldset")

#: The exit status of an interrupted stage (128 + SIGINT, as a shell reports a Ctrl-C).
INTERRUPTED_STATUS = 130


def interrupted_line(what: str = "the run") -> str:
    """The one line an interrupt prints: what was kept and how to resume."""
    return (f"coldset: {what} was interrupted. Every finished step's outputs are kept, and no file is left "
            "half-written (each is written whole, then moved into place); re-run the same command to resume "
            "where it stopped.")


def passive_omp_threads() -> None:
    """Idle OpenMP threads sleep instead of spinning, so a stage sharing the CPU with another job
    slows down in proportion instead of about tenfold. Effective only before torch loads its
    OpenMP runtime (the runtime reads the variable once, when it loads)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def run_from_snakemake(smk, stage: str | Callable[..., None]) -> None:
    """Entry of every workflow script: log to the rule's log file, run the stage
    (:func:`coldset.workflow.pipeline.run_stage`; a name of its stages, ``report_models`` or
    ``vllm_parity``, or a stage function). An interrupt (Ctrl-C) ends the job with
    :data:`INTERRUPTED_STATUS` and a line in its log, no traceback: the Snakefile's ``onerror``
    prints the one line for the whole run (:class:`InterruptWatch`)."""
    log_path = Path(smk.log[0])
    log_path.parent.mkdir(parents=True, exist_ok=True)
    stream = open(log_path, "w", buffering=1)
    sys.stderr = stream  # progress bars and warnings go to the rule's log too
    logging.basicConfig(level=logging.INFO, stream=stream, force=True,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    name = getattr(stage, "__name__", stage)
    try:
        _run_in_job(smk, stage)
    except KeyboardInterrupt:
        log.warning("stage %s interrupted: the files it finished are whole; its job runs again next time", name)
        raise SystemExit(INTERRUPTED_STATUS) from None
    except Exception as exc:
        log.exception("stage %s failed", name)
        # The console (Snakemake's own stderr, not the log) gets the reason too: Snakemake's
        # summary says only "check log file(s)".
        print(f"coldset stage {name} failed: {type(exc).__name__}: {exc}\n  (traceback: {log_path})",
              file=sys.__stderr__, flush=True)
        raise


def _run_in_job(smk, stage: str | Callable[..., None]) -> None:
    """The stage with the job's threads and its model's config (a sweep's job: that model's)."""
    # Torch's CPU threads = the rule's threads: Snakemake then never runs two jobs whose threads
    # fight for one core (decode on 2 threads slows about tenfold when the other core is busy).
    passive_omp_threads()
    import torch  # after passive_omp_threads(): the OpenMP runtime reads OMP_WAIT_POLICY when torch loads

    from coldset.workflow import pipeline, sweep, vllm_parity  # they load torch: after passive_omp_threads(), as above

    above = {"report_models": sweep.report_models, "vllm_parity": vllm_parity.vllm_parity}  # stages above the pipeline
    torch.set_num_threads(max(1, int(smk.threads)))
    config = smk.config
    model = getattr(smk.wildcards, "model", None)
    if config.get("models") and model is not None:  # a sweep: this job's model's own config
        config = model_configs(config)[model]
    pipeline.run_stage(above.get(stage, stage) if isinstance(stage, str) else stage, config)


# What Snakemake logs when it puts back an ``update``-flagged output of a failed job.
_RESTORED = re.compile(r"^Restored previous version of (.+?)(?: \(update\))? \(updating job failed\)\.$")


def rerun_restored_outputs(snakemake_logs: str | os.PathLike | list, forget: Callable[[Path], Any]) -> list[Path]:
    """Make the next run redo the jobs whose previous outputs Snakemake restored after they failed.

    The rules flag their outputs ``update``, so a failing job leaves the previous run's good
    files in place (Snakemake otherwise deletes a job's outputs before it runs and again after
    it fails). But Snakemake puts them back by a copy dated now and records the failed job's
    inputs and params as those that made them: the next run would skip the job ("Nothing to be
    done") and hand the old results to the stages after it. Here each restored file (found in
    the run's log) loses that record (``forget``: Snakemake's ``cleanup_metadata``) and is dated
    one second after 1970, older than every input, so its contents stay and its job runs again.
    Called from the Snakefile's ``onerror`` with the run's log file(s); returns the files."""
    logs = [snakemake_logs] if isinstance(snakemake_logs, (str, os.PathLike)) else snakemake_logs
    lines = [line for p in logs if Path(p).is_file() for line in Path(p).read_text(errors="replace").splitlines()]
    kept = []
    for line in lines:
        m = _RESTORED.match(line.strip())
        if m and Path(m.group(1)).exists():
            path = Path(m.group(1))
            forget(path)
            os.utime(path, (1, 1))  # 0 would not do: Snakemake takes an mtime of 0 for no time
            kept.append(path)
    return kept


class InterruptWatch(logging.Filter):
    """The Snakefile's view of a Ctrl-C: :meth:`install` records the interrupt (then raises
    KeyboardInterrupt as Python's own handler does, which Snakemake handles) and, from then on,
    drops Snakemake's error reports of the jobs it stopped (a RuleException per job, "Error in
    rule", the closing WorkflowError), which read like a crash though nothing was lost; the
    ``onerror`` hook then prints :func:`interrupted_line` instead."""

    DROPPED = ("RuleException", "WorkflowError", "CalledProcessError")

    def __init__(self) -> None:
        super().__init__()
        self.interrupted = False

    def install(self, logger: logging.Logger) -> InterruptWatch:
        if threading.current_thread() is threading.main_thread():  # only there can Python set a handler
            signal.signal(signal.SIGINT, self._on_interrupt)
            logger.addFilter(self)
        return self

    def _on_interrupt(self, signum, frame) -> None:
        self.interrupted = True
        signal.default_int_handler(signum, frame)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.interrupted or record.levelno < logging.ERROR:
            return True
        stopped_job = getattr(record, "exception", None) in self.DROPPED or \
            str(record.msg).startswith(("Error in rule", "Error in group"))
        return not stopped_job
