"""When a measured speed means something: shared by the bench and the report.

On the CPU there is no host tier: every placement runs the same in-memory computation, so
measured speeds differ between placements by timing noise alone (with a second job on a 2-core
machine, 1.4 tok/s beside 150). Ratios of such speeds (tok_s_per_gib, fetch_tax) would publish
noise divided by a small GiB difference. And any timing whose repeats disagree is noise too.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np

#: A timing whose repeats disagree beyond this ratio is flagged ``timing_noisy`` and never enters a
#: derived ratio. A CUDA-graph replayed step on an idle H200 stays within a few percent.
NOISY_P90_OVER_P50 = 1.25


def repeat_spread(passes: list[list[float]]) -> float | None:
    """How much repeats of the same decode pass disagree: per step index, the slowest repeat's time
    over the fastest's; the 90th percentile over the steps. None with fewer than two repeats.

    Why per step across repeats, not across the steps of one pass: a step's time legitimately
    depends on its token (a slot-cache miss, a cold selection of a static placement), so steps of
    one pass differ for a reason; the same step of two repeats (same tokens, same decisions: the
    bench checks both) differs only by noise."""
    if len(passes) < 2:
        return None
    steps = np.asarray(passes, dtype=np.float64)  # [repeats, steps]
    return float(np.percentile(steps.max(axis=0) / steps.min(axis=0), 90))


def timing_noisy(step_ms_p50: float | None, step_ms_p90: float | None, spread: float | None = None) -> bool:
    """Whether a timing is noise: its repeats disagree (``spread``, :func:`repeat_spread`, above
    :data:`NOISY_P90_OVER_P50`); for a timing of one repeat (or a bench file without the
    spread), its steps disagree (p90 / p50 above the same bound)."""
    if spread is not None:
        return spread > NOISY_P90_OVER_P50
    return bool(step_ms_p50 and step_ms_p90 and step_ms_p90 / step_ms_p50 > NOISY_P90_OVER_P50)


def noisy_reason(step_ms_p50: float | None, step_ms_p90: float | None, spread: float | None = None) -> str:
    """The report's words for a noisy timing (:func:`timing_noisy`)."""
    if spread is not None:
        return f"noisy: repeats disagree by {spread:.2f}x, not a result"
    return f"noisy: p90/p50 = {step_ms_p90 / step_ms_p50:.2f}, not a result"


def speed_compares_placements(device: str | None) -> bool:
    """Whether measured speed can differ between placements for a reason: only with a host tier
    (CUDA), never on the CPU."""
    return not str(device or "").startswith("cpu")


# --------------------------------------------------------------------------------------------
# CUDA timings (torch imported on first use)


def graph_time_us(fn: Callable[[], object], reps: int) -> float:
    """Median over ``reps`` replays of a CUDA graph of ``fn`` (warmed up eagerly first), in µs: the one
    GPU timing of the autotuner, the read ceilings and the measurement commands."""
    import torch  # torch-heavy: only the GPU timings need it

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    del g
    return statistics.median(times)


def eager_time_us(fn: Callable[[], object], reps: int) -> float:
    """Median microseconds of eager calls of ``fn`` by CUDA events, after one warm-up call."""
    import torch  # torch-heavy: only the GPU timings need it

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)
