"""The simulator's replay loops compiled by numba where it is importable, plain Python otherwise.

Why: the loops walk every selection of a trace one by one, which numba makes fast; the GPU host's
image has no numba, and there the same source runs uncompiled with the same results, slower.
Every loop of :mod:`coldset.analysis.policies` and :mod:`coldset.analysis.time_model` is
decorated with :func:`jit`.
"""

from __future__ import annotations

try:  # optional: numba compiles the replay loops; without it the same code runs as plain Python
    from numba import njit as _njit

    def jit(fn):
        """``fn`` compiled by numba (nopython, cached on disk, the GIL released)."""
        return _njit(cache=True, nogil=True)(fn)
except ImportError:  # pragma: no cover - exercised only where numba is absent
    def jit(fn):
        """``fn`` itself: numba is absent, the loop runs as plain Python."""
        return fn
