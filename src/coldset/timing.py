"""When a measured speed means something (issue 16): shared by the bench and the report.

On the CPU there is no host tier: every placement runs the same in-memory computation, so
measured speeds differ between placements by timing noise alone (with a second job on a 2-core
machine, 1.4 tok/s beside 150). Ratios of such speeds (tok_s_per_gib, fetch_tax) would publish
noise divided by a small GiB difference. And any timing whose repeats disagree is noise too.
"""

from __future__ import annotations

#: A timing whose steps disagree beyond this (p90 / p50) is flagged ``timing_noisy`` and never
#: enters a derived ratio. A CUDA-graph replayed step on an idle H200 stays within a few percent.
NOISY_P90_OVER_P50 = 1.25


def timing_noisy(step_ms_p50: float | None, step_ms_p90: float | None) -> bool:
    """Whether a timing's steps disagree (p90 / p50 above :data:`NOISY_P90_OVER_P50`)."""
    return bool(step_ms_p50 and step_ms_p90 and step_ms_p90 / step_ms_p50 > NOISY_P90_OVER_P50)


def speed_compares_placements(device: str | None) -> bool:
    """Whether measured speed can differ between placements for a reason: only with a host tier
    (CUDA), never on the CPU."""
    return not str(device or "").startswith("cpu")
