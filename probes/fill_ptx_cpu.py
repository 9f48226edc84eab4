"""Probe (not a tool of the package): the slot fill kernel compiled to sm90 PTX on the CPU, no GPU (issue 29).

    PYTHONPATH=<triton 3.6>:src python probes/fill_ptx_cpu.py [--against <git revision>]

Compiles :func:`coldset.kernels.triton_slots._fill_kernel` with ``triton.compile`` for a ``cuda``
9.0 target (AST -> TTIR -> TTGIR -> LLVM IR -> PTX -> cubin, all on the CPU with triton's bundled
ptxas; only the launch needs the GPU) for every choice (plain copy, lru, lfu,
nexttoken; tagged copy) with block-FP8 scale pools (``SCALES``: weights e4m3, scales float32, a
scale row of 1 element specialized to a constant as Triton does for ints equal to 1) and without
(bf16 weights). With ``--against`` the bf16 variants are compared with that revision's kernel:
the PTX instructions must be identical (the scale pools' parameters, unused without ``SCALES``,
and the debug info may differ). Prints one line per variant; exits non-zero on a difference.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

WEIGHTS = ("src13_ptr", "dst13_ptr", "src2_ptr", "dst2_ptr")
SCALES = ("ssrc13_ptr", "sdst13_ptr", "ssrc2_ptr", "sdst2_ptr")
FLOAT = {"key_ptr": "*fp64"}
NUM_SCALE_ARGS = 7  # the new kernel's scale arguments, after done_ptr


def ptx(fn, weight_ty: str, const: dict) -> str:
    names = list(inspect.signature(fn.fn).parameters)
    sig = {}
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif n in WEIGHTS:
            sig[n] = weight_ty
        elif n in SCALES:
            sig[n] = "*fp32"
        elif n.endswith("_ptr"):
            sig[n] = FLOAT.get(n, "*i64")
        else:
            sig[n] = "i32"
    src = ASTSource(fn, sig, {(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]


def instructions(text: str, shift: int) -> list[str]:
    """PTX without debug info and parameter declarations; parameter numbers past the scale
    arguments shifted back by ``shift`` (Triton's scratch parameters follow the kernel's)."""
    out = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith((".loc", ".file", "$L__", "//", ".b8", ".b16", ".b32", ".b64")) or ".param" in s:
            continue
        if shift:
            line = re.sub(r"_param_(\d+)", lambda m: f"_param_{int(m.group(1)) - shift}"
                          if int(m.group(1)) >= 23 + shift else m.group(0), line)
        out.append(line)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="git revision whose bf16 fill kernel must compile to the same PTX")
    args = ap.parse_args()
    from coldset.kernels import triton_slots as new

    old = None
    if args.against:
        text = subprocess.run(["git", "show", f"{args.against}:src/coldset/kernels/triton_slots.py"], check=True,
                              capture_output=True, text=True).stdout
        path = Path(tempfile.mkdtemp()) / "triton_slots_against.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location("triton_slots_against", path)
        old = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = old
        spec.loader.exec_module(old)
    bad = 0
    base = dict(BLOCK=new.BLOCK, NB=new.FILL_BLOCKS, USE_GDC=False, E=8, CP=16, MV=4)
    for choose, tags in [(0, False), (1, False), (2, False), (3, False), (0, True)]:
        const = dict(base, CHOOSE=choose, TAGS=tags)
        for unit_row in (False, True):
            c = dict(const, SCALES=True, **({"srow2": 1} if unit_row else {}))
            lines = ptx(new._fill_kernel, "*fp8e4nv", c).count("\n")
            print(f"CHOOSE {choose} TAGS {int(tags)} fp8 + scales{' (1-element w2 scale row)' if unit_row else ''}: "
                  f"PTX {lines} lines")
        b = ptx(new._fill_kernel, "*bf16", dict(const, SCALES=False))
        if old is not None:
            a = ptx(old._fill_kernel, "*bf16", const)
            same = instructions(a, 0) == instructions(b, NUM_SCALE_ARGS)
            bad += not same
            verdict = "identical to" if same else "DIFFER from"
            print(f"CHOOSE {choose} TAGS {int(tags)} bf16: PTX instructions {verdict} {args.against}'s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
