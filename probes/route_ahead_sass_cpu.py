"""Probe (not a tool of the package): the router launch with lookahead's whole decision in its last
program, compiled to sm90 cubins on the CPU, no GPU (issue 28 item 4).

    PYTHONPATH=<triton 3.6>:src python probes/route_ahead_sass_cpu.py [--tile SLOTS]

Compiles :func:`coldset.kernels.triton_decode._route_kernel` at Qwen3-30B-A3B's router shape (E 128,
H 2048, top-8, bf16, 2 experts a program, 4 warps: the launch config the routing's bits depend on)
for 1 and 8 tokens: plain, recording an lru group (``RECORD``), and with lookahead's decision
(``LOOKAHEAD``; with the forecast rows of the target layer, and without: the last layers), at 1536
slots (residency 0.25), 3072 (0.5) and 6144 (1.0); and ``_ahead_kernel`` (decide_ahead's launch, 8 or
16 warps) at the same shapes for comparison; the victim scans in the tiles the package picks
(``triton_slots._scan_size``; ``--tile``: another ``SCAN_TILE``). Prints what ptxas allotted
(registers a thread, stack bytes: spills) and SASS counts (:func:`fp8_w13_sass_cpu.stats`). Static facts of the code only:
nothing here is a time.

``--order``: also, for the launch with the forecast at 6144 slots, the global loads and barriers
the last program issues after the ticket, in SASS order, each with its source line (``ahead_group``
issues the forecast's loads and the list's row-map gather ahead of the group's record: this shows
where ptxas put them; predicated loads under a branch are the victim scans).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).parent))
from fp8_w13_sass_cpu import stats  # noqa: E402

from coldset.kernels import triton_decode as td  # noqa: E402
from coldset.kernels import triton_slots as ts  # noqa: E402

L, E, H, K = 48, 128, 2048, 8
PTR = {"x_ptr": "*bf16", "nw_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "logit_ptr": "*bf16",
       "count_ptr": "*i32", "wts_ptr": "*bf16", "row_map_ptr": "*i32", "use_count_ptr": "*fp64", "count_ptr_f": "*fp64",
       "inflight_ptr": "*u8", "fw_ptr": "*bf16", "fc_ptr": "*fp32", "logits_ptr": "*fp32", "w_out_ptr": "*bf16",
       "eps": "fp32"}


def compile_kernel(fn, const: dict, num_warps: int, ptr: dict):
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in const else ptr.get(n, "*i64" if n.endswith("_ptr") else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


def sizes(C: int, m: int) -> dict:
    mv = max(2, ts._next_pow2(min(m * K, E)))  # the victims and the prefetch span alike: min(m K, E)
    return dict(SCAN=ts._scan_size(C, mv), MV=mv, WP=max(2, ts._next_pow2(m * K)), MPV=mv, ZB=1024, NI=L * E,
                TP=max(2, ts._next_pow2(m)))


def issue_order(cubin: bytes) -> list[str]:
    """The global loads (``LDG``), barriers (``BAR``) and branches after the first global atomic
    (the ticket) in SASS order, each as ``file:line instruction`` (nvdisasm's line info)."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(cubin)
        path = fh.name
    try:
        sass = subprocess.run([str(tools / "nvdisasm"), "-c", "-g", path], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(path)
    out, where, started = [], "?", False
    for ln in sass.splitlines():
        m = re.search(r'//## File ".*/([\w.]+)", line (\d+)', ln)
        if m:
            where = f"{m.group(1)}:{m.group(2)}"
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", ln)
        if m is None:
            continue
        ins = m.group(1).strip()
        started = started or "ATOMG" in ins
        if started and re.search(r"\b(ATOMG|LDG|BAR|BRA)\b", ins):
            out.append(f"{where:24s} {ins}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tile", type=int, default=ts.SCAN_TILE, help="slots a victim scan's tile holds (a power of two)")
    p.add_argument("--order", action="store_true", help="print the loads and barriers after the ticket (C6144)")
    args = p.parse_args(argv)
    ts.SCAN_TILE = args.tile
    for m in (1, 8):
        base = dict(M=m, MP=ts._next_pow2(m), H=H, HP=H, E=E, EP=E, K=K, KP=K, BLOCK_E=2, RENORMALIZE=True, PDL=True,
                    TRIGGER=True, LOOKAHEAD=False, FORECAST=False,
                    **{k: 2 for k in ("SCAN", "MV", "TP", "WP", "MPV", "ZB", "NI")})
        variants = [("plain", dict(RECORD=False), 0), ("lru record", dict(RECORD=True), 0)]
        for C in (1536, 3072, 6144):
            variants += [(f"lookahead C{C}", dict(RECORD=False, LOOKAHEAD=True, FORECAST=True, **sizes(C, m)), C),
                         (f"lookahead C{C} last", dict(RECORD=False, LOOKAHEAD=True, FORECAST=False, **sizes(C, m)), C)]
        for name, extra, C in variants:
            cubin = compile_kernel(td._route_kernel, {**base, **extra}, 4, PTR).asm["cubin"]
            s = stats(cubin)
            print(f"b{m} route {name:22s} w4  " + " ".join(f"{k}={v}" for k, v in s.items()), flush=True)
            if args.order and name == "lookahead C6144":
                print("\n".join(f"    {ln}" for ln in issue_order(cubin)), flush=True)
        for C in (1536, 3072, 6144):
            sz = sizes(C, m)
            warps = 16 if ts._next_pow2(C) >= 4096 else 8  # decide_ahead's choice
            const = dict(E=E, NP=max(2, ts._next_pow2(m * K)), CAST=True, USE_GDC=True, AHEAD=True, K=K, KP=K,
                         EP=E, WAIT_LOGITS=True, **sz)
            ptr = {**PTR, "w_ptr": "*fp32", "count_ptr": "*fp64"}
            s = stats(compile_kernel(ts._ahead_kernel, const, warps, ptr).asm["cubin"])
            print(f"b{m} decide_ahead C{C:<5d}            w{warps:<2d} " + " ".join(f"{k}={v}" for k, v in s.items()),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
