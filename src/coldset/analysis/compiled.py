"""The simulator's replay loops compiled by numba where it is installed, plain Python otherwise.

Why: the loops walk every selection of a trace one by one, which numba makes fast; the GPU host's
image has no numba, and there the same source runs uncompiled with the same results, slower.
Every loop of :mod:`coldset.analysis.policies` and :mod:`coldset.analysis.time_model` is
decorated with :func:`jit`.

numba is imported when a loop first runs, not when the simulator is imported: importing numba
loads llvmlite, whose module object breaks vLLM's CPU engine when both live in one process (vLLM
scans every loaded module's namespace), and the workflow's vLLM stages import the stages but
never replay a cache. On the first call every decorated loop is compiled together and each
module's name for a loop is rebound to its numba dispatcher, so loops that call one another
are compiled as one nopython program, as with eager decoration.
"""

from __future__ import annotations

import importlib.util
import sys

_LOOPS: list["Loop"] = []


def numba_installed() -> bool:
    """Whether numba can be imported here (without importing it)."""
    if "numba" in sys.modules:
        return sys.modules["numba"] is not None
    try:
        return importlib.util.find_spec("numba") is not None
    except (ImportError, ValueError):
        return False


class Loop:
    """A replay loop to be compiled on first use; calls go to the compiled dispatcher."""

    def __init__(self, fn):
        self.fn = fn
        self.dispatcher = None
        self.__name__ = fn.__name__
        self.__qualname__ = fn.__qualname__
        self.__module__ = fn.__module__
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __call__(self, *args, **kwargs):
        if self.dispatcher is None:
            compile_loops()
        return self.dispatcher(*args, **kwargs)


def compile_loops() -> None:
    """Compile every registered loop not yet compiled with numba and rebind the defining
    modules' names for loops to their dispatchers."""
    pending = [loop for loop in _LOOPS if loop.dispatcher is None]
    if not pending:
        return
    from numba import njit  # optional, and loaded only here (the module doc says why)

    for loop in pending:
        loop.dispatcher = njit(cache=True, nogil=True)(loop.fn)
    for loop in _LOOPS:
        namespace = loop.fn.__globals__
        for name, value in list(namespace.items()):
            if isinstance(value, Loop) and value.dispatcher is not None:
                namespace[name] = value.dispatcher


def jit(fn):
    """``fn`` to be compiled by numba (nopython, cached on disk, the GIL released) on first use;
    ``fn`` itself where numba is absent."""
    if not numba_installed():
        return fn
    loop = Loop(fn)
    _LOOPS.append(loop)
    return loop
