"""Triton kernels checked on the CPU under Triton's interpreter: a child Python with
``TRITON_INTERPRET=1`` runs a check script (this folder on its ``sys.path`` as ``sys.argv[1]``) that
prints INTERPRETED OK when every check held; and the pieces the kernel tests' scripts start with.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# torch's round-to-nearest-even casts stand in for the interpreter's float casts (triton's
# _convert_float drops the mantissa carry into the exponent: 124.3 -> 64 in e4m3); then this
# folder on sys.path
ROUNDED_CASTS = r"""
import sys
import numpy as np
import torch
from triton.runtime import interpreter

_T = {"fp8e4nv": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_I = {8: (np.int8, torch.uint8), 16: (np.int16, torch.int16), 32: (np.int32, torch.int32)}
_orig_convert = interpreter._convert_float

def _convert_float(data, src_ty, dst_ty, rounding_mode):
    src, dst = _T.get(src_ty.name), _T.get(dst_ty.name)
    if src is None or dst is None:
        return _orig_convert(data, src_ty, dst_ty, rounding_mode)
    t = torch.from_numpy(np.ascontiguousarray(data).copy().view(_I[src_ty.primitive_bitwidth][0])).view(src)
    out = t.to(dst).view(_I[dst_ty.primitive_bitwidth][1]).numpy()
    return out.view(np.dtype(f"uint{dst_ty.primitive_bitwidth}"))

interpreter._convert_float = _convert_float
sys.path.insert(0, sys.argv[1])
"""


# Script text (before any launch) that takes two repeated lookups out of the interpreter (triton 3.8),
# which with many small programs were half of a kernel test's time; what runs and computes is the same:
# - triton.language patched once a launch: the interpreter re-patches the language modules it finds
#   in a jit function's globals (inspect.getmembers over tl, tl.core, tl.tensor, tl.math) at each
#   call of a @triton.jit helper in each program, and drops that scope, so those patches hold until
#   the launch's own scope is restored. A device function whose modules the launch (or an earlier
#   device function of it) already patched would install the same closures again: skipped. The
#   launches themselves patch and restore as before.
# - a plain dtype's numpy storage type looked up once: _get_np_dtype builds its table of every dtype
#   at each call (each tensor op); pointers, tuples and the like still go to it.
LEAN_INTERPRETER = r"""
import triton.language as _tl
from triton.runtime import interpreter as _interpreter

_launch_langs = []  # the language modules patched in the launch in progress (empty between launches)
_langs_of = {}  # jit function -> the language modules among its globals (what _patch_lang patches)
_triton_patch_lang = _interpreter._patch_lang


def _patch_lang_once(fn):
    langs = _langs_of.get(fn)
    if langs is None:
        langs = _langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is _tl or v is _tl.core)
    if _launch_langs and langs and langs <= _launch_langs[-1]:
        return None  # triton discards a device function's scope
    scope = _triton_patch_lang(fn)
    if _launch_langs:  # a device function's patches (never restored) hold for the rest of the launch
        _launch_langs[-1] |= langs
    else:  # a launch: its patches hold until its scope is restored
        _launch_langs.append(set(langs))
        restore = scope.restore

        def _restore():
            _launch_langs.clear()
            restore()

        scope.restore = _restore
    return scope


_interpreter._patch_lang = _patch_lang_once

_triton_np_dtype = _interpreter._get_np_dtype
_np_dtypes = {}  # a plain dtype's name -> its numpy storage type (dtypes compare by name)


def _np_dtype_once(tt_dtype):
    if type(tt_dtype) is _tl.block_type and type(tt_dtype.element_ty) is _tl.dtype:
        tt_dtype = tt_dtype.element_ty  # a block is stored as its elements
    if type(tt_dtype) is not _tl.dtype:
        return _triton_np_dtype(tt_dtype)
    np_dtype = _np_dtypes.get(tt_dtype.name)
    if np_dtype is None:
        np_dtype = _np_dtypes[tt_dtype.name] = _triton_np_dtype(tt_dtype)
    return np_dtype


_interpreter._get_np_dtype = _np_dtype_once
"""


def pdl_no_ops(*modules: str) -> str:
    """Script text that makes the grid-dependency instructions (``gdc_wait``,
    ``gdc_launch_dependents``) of the named :mod:`coldset.kernels` modules no-ops: the interpreter
    runs launches one after the other, so pdl modes run their launches' plumbing only."""
    names = ", ".join(modules)
    return rf"""
import triton
import triton.language as tl  # noqa: F401 - the interpreter wants it visible to the stubs below
from coldset.kernels import {names}

@triton.jit
def _no_op():
    pass

for mod in ({names},):
    mod.gdc_wait = mod.gdc_launch_dependents = _no_op
"""


def run_interpreted(script: str, timeout: int = 600) -> str:
    """Run ``script`` in a child Python with ``TRITON_INTERPRET=1`` (skipped where triton is not
    importable; the test extra installs it); it must exit 0 printing INTERPRETED OK. Returns its stdout."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not importable here")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0 and "INTERPRETED OK" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout
