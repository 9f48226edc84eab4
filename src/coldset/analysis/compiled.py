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

Compiled loops are cached on disk in a folder named by a digest of every Python source of the
packages that define loops (:func:`loop_cache_dir`); in a checkout's own cache folder a new
state's first compile deletes the older states' folders (:func:`prune_other_states`), which
nothing reads again. Why a digest: numba keys a cached function on its own
file only, and a loop compiled together with a loop of another file keeps that loop's old code
when only the other file changes (a ``git pull`` that edits ``pool.py`` but not ``lru.py``): the
replay would silently run the old rules.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

_LOOPS: list["Loop"] = []
#: Hex digits of a cache folder's name (:func:`loop_cache_dir`), by which :func:`prune_other_states` knows it.
DIGEST_CHARS = 20


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


def loop_sources(loops: list[Loop]) -> list[Path]:
    """Every Python source a cached loop may have compiled in from another file: all ``.py``
    files under the top-level package of each loop's module (a loop of a module outside any
    package adds none: numba's own key, its file, covers what it compiles from that file)."""
    roots = set()
    for loop in loops:
        top = sys.modules.get(loop.__module__.split(".")[0])
        roots.update(Path(p).resolve() for p in getattr(top, "__path__", None) or ())
    return sorted({f for r in roots for f in r.rglob("*.py")})


def loop_cache_dir(loops: list[Loop], base: Path) -> Path:
    """``base``/the digest of :func:`loop_sources` (their paths and bytes): the cache folder of
    this state of the source. A folder of an older state is not read again (it may be deleted)."""
    digest = hashlib.sha256()
    for f in loop_sources(loops):
        digest.update(str(f).encode() + b"\0" + f.read_bytes() + b"\0")
    return base / digest.hexdigest()[:DIGEST_CHARS]


def prune_other_states(base: Path, current: Path) -> list[Path]:
    """Delete the digest folders (:data:`DIGEST_CHARS` hex digits) under ``base`` other than
    ``current`` (folders of older states of the source, never read again); returns those deleted.
    Only for a checkout's own cache folder:
    a ``NUMBA_CACHE_DIR`` may be shared by checkouts at other states, whose folders are live."""
    gone = []
    if not base.is_dir():
        return gone
    for d in base.iterdir():
        name = d.name
        if d != current and d.is_dir() and len(name) == DIGEST_CHARS and all(c in "0123456789abcdef" for c in name):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def _cache_base() -> Path:
    """Where the digest folders live: under ``NUMBA_CACHE_DIR`` where the user set it, else under
    the top-level package's ``__pycache__`` where it is writable (numba's own default is beside the
    sources), else under the user's cache folder."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"]) / "coldset"
    if os.access(_package_cache_base().parents[1], os.W_OK):
        return _package_cache_base()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "coldset" / "numba"


def _package_cache_base() -> Path:
    """The checkout's own cache folder: ``__pycache__/numba`` of the top-level package."""
    return Path(__file__).resolve().parents[1] / "__pycache__" / "numba"


def compile_loops() -> None:
    """Compile every registered loop not yet compiled with numba (cached in :func:`loop_cache_dir`)
    and rebind the defining modules' names for loops to their dispatchers."""
    pending = [loop for loop in _LOOPS if loop.dispatcher is None]
    if not pending:
        return
    from numba import njit  # optional, and loaded only here (the module doc says why)
    from numba.core import config  # numba's cache folder, read when a dispatcher enables its cache

    base = _cache_base()
    folder = loop_cache_dir(_LOOPS, base)
    if not folder.exists() and base == _package_cache_base():
        prune_other_states(base, folder)  # a new state of the source: the older states' loops are dead
    before = config.CACHE_DIR
    config.CACHE_DIR = str(folder)
    try:
        for loop in pending:
            loop.dispatcher = njit(cache=True, nogil=True)(loop.fn)
    finally:
        config.CACHE_DIR = before
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
