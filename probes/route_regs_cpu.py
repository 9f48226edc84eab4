"""Probe (not a tool of the package): the router launch's registers, stack, blocks an SM and waves
at the launch parameters :func:`coldset.kernels.triton_decode.route` picks, compiled for sm90 on the
CPU, no GPU (issue 28 item 4: lookahead's management at residency 1.0).

    PYTHONPATH=<triton 3.6>:src python probes/route_regs_cpu.py [--batches 1,8] [--sms 132] [--slots 6144]

At Qwen3-30B-A3B's router shape (E 128, H 2048, top-8, bf16, 2 experts a program, 4 warps) for each
batch: the plain launch, lru's record, and lookahead's decision with the forecast and without (the
last layer), with the register cap ``route`` passes (``_route_register_cap`` on ``--sms`` SMs, the
H200's 132 by default) and, for lookahead, also without it; then the list's launch
(:func:`coldset.kernels.triton_slots.ahead_list`, on the decisions stream). Per variant: registers
a thread, stack bytes and local loads/stores (spills), blocks of 4 warps an SM by registers (65,536
an SM), programs and waves (programs over blocks x SMs), SASS instructions in all and after the
ticket (the last program's decision, a static proxy of its serial path: every branch's code,
executed or not), and barriers, shuffles and global loads after the ticket (the list's launch: in
all). Static facts of the code only: nothing here is a time.
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

from coldset.kernels import triton_decode as td
from coldset.kernels import triton_slots as ts

L, E, H, K = 48, 128, 2048, 8
PTR = {"x_ptr": "*bf16", "nw_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "logit_ptr": "*bf16",
       "count_ptr": "*i32", "wts_ptr": "*bf16", "row_map_ptr": "*i32", "use_count_ptr": "*fp64",
       "inflight_ptr": "*u8", "fw_ptr": "*bf16", "fc_ptr": "*fp32", "logits_ptr": "*fp32", "eps": "fp32"}


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compile_route(const: dict, maxnreg: int | None, fn=None, num_warps: int | None = None):
    fn = fn or td._route_kernel
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in const else PTR.get(n, "*i64" if n.endswith("_ptr") else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    opts = dict(num_warps=num_warps or td.ROUTE_WARPS)
    if maxnreg is not None:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def sass_facts(cubin: bytes, whole: bool = False) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(cubin)
        path = fh.name
    try:
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)", usage)
    if m is None:
        raise SystemExit(f"route_regs_cpu: no REG/STACK in cuobjdump's output: {usage[-300:]}")
    ins = [mm.group(1).strip() for ln in sass.splitlines() if (mm := re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", ln))]
    at = 0 if whole else next((i for i, s in enumerate(ins) if "ATOMG" in s), len(ins))  # the ticket
    after = ins[at:]

    def count(pattern, seq):
        return sum(1 for s in seq if re.search(pattern, s))

    return {"regs": int(m.group(1)), "stack_B": int(m.group(2)), "spill_ld_st": count(r"\b(STL|LDL)\b", ins),
            "sass": len(ins), "after_ticket": len(after), "BAR": count(r"\bBAR\b", after),
            "SHFL": count(r"\bSHFL\b", after), "LDG": count(r"\bLDG\b", after)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--sms", type=int, default=132, help="SMs of the device the cap is picked for (H200: 132)")
    p.add_argument("--slots", type=int, default=L * E, help="cache slots (residency 1.0: every expert)")
    args = p.parse_args(argv)
    for m in (int(b) for b in args.batches.split(",")):
        programs = triton.cdiv(E, 2) * m
        base = dict(M=m, MP=ts._next_pow2(m), H=H, HP=H, E=E, EP=E, K=K, KP=K, BLOCK_E=2, RENORMALIZE=True, PDL=True,
                    TRIGGER=True, LOOKAHEAD=False, FORECAST=False,
                    **{k: 2 for k in ("SCAN", "MV", "TP", "WP", "MPV", "ZB", "NI")})
        mv = max(2, ts._next_pow2(min(m * K, E)))  # the victims and the prefetch span alike: min(m k, E)
        sizes = dict(SCAN=ts._scan_size(args.slots, mv), MV=mv, WP=max(2, ts._next_pow2(m * K)), MPV=mv, ZB=1024,
                     NI=L * E, TP=max(2, ts._next_pow2(m)))  # TP: route()'s choice
        cap = td._route_register_cap(programs, td.ROUTE_WARPS, args.sms)
        variants = [("plain", dict(RECORD=False), None), ("lru record", dict(RECORD=True), None)]
        for fc in (True, False):
            name = "lookahead" + ("" if fc else " last")
            extra = dict(RECORD=False, LOOKAHEAD=True, FORECAST=fc, **sizes)
            variants.append((name + " (route's cap)", extra, cap))
            if cap is not None:
                variants.append((name + " (no cap)", extra, None))
        for name, extra, mx in variants:
            f = sass_facts(compile_route({**base, **extra}, mx).asm["cubin"])
            warp_regs = -(-f["regs"] * 32 // 256) * 256  # allotted a warp in units of 256
            blocks = min(16, 65536 // (warp_regs * td.ROUTE_WARPS))
            waves = -(-programs // (blocks * args.sms))
            print(f"b{m} {name:26s} maxnreg={mx} " + " ".join(f"{k}={v}" for k, v in f.items())
                  + f" blocks/SM={blocks} programs={programs} waves={waves}", flush=True)
        # the list's launch on the decisions stream (one program, off the router's critical path)
        warps = 16 if ts._next_pow2(args.slots) >= 4096 else 8
        const = dict(E=E, K=K, KP=K, TP=sizes["TP"], EP=E, WP=sizes["WP"], SCAN=sizes["SCAN"], MPV=sizes["MPV"])
        f = sass_facts(compile_route(const, None, ts._ahead_list_kernel, warps).asm["cubin"], whole=True)
        print(f"b{m} {'ahead_list launch':26s} warps={warps} " + " ".join(f"{k}={v}" for k, v in f.items()
                                                                        if k != "after_ticket"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
