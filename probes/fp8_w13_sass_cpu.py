"""Probe (not a tool of the package): the FP8 kernel's w13 and w2 launches of every FP8 decode
candidate, compiled to sm90 cubins on the CPU, no GPU (issue 29: the quantization options).

    PYTHONPATH=<triton 3.6>:src python probes/fp8_w13_sass_cpu.py [--extra '[{...}, ...]']

Compiles :func:`coldset.kernels.triton_fp8._w13_fp8_kernel` and ``_w2_fp8_kernel`` at Qwen3-30B-A3B-FP8's shape (E=128,
H=2048, I=768, top-8, bf16 tokens, the row map on, in-kernel grouping as at 1 token) for each
decode config of :data:`coldset.kernels.tune.TRITON_FP8_SEARCH_SPACE` (and ``--extra`` configs, JSON dicts
of KernelConfig fields; w8a16 too) with Triton's own stages, the launch's pointer alignment
(:func:`launch_attrs`) and the ptxas it ships (run on the CPU), then prints per config what ptxas
allotted (registers a thread, stack bytes: spills) and counts in the SASS (instructions, MUFU.RCP
and FCHK: the IEEE divisions of the quantization; local-memory stores and loads: spill traffic;
HMMA and [HQ]GMMA: the dots' tensor-core instructions; F2FP: packed conversions such as the e4m3
unpacks; F2F: one-value conversions such as f16 to bf16; LDSM: shared-memory matrix loads; LDGSTS: the pipelined k loop's async copies). Static
facts of the code only: nothing here is a time.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from coldset.kernels import triton_fp8
from coldset.kernels.triton_moe import KernelConfig
from coldset.kernels.tune import TRITON_FP8_SEARCH_SPACE

E, H, I, TOPK = 128, 2048, 768, 8


def launch_attrs(names: list[str], ptr: dict) -> dict:
    """The specialization a launch gets from Triton's JIT: every pointer argument 16-byte aligned (torch's
    allocations) and ``stride_x`` (H = 2048) divisible by 16. Without it the loads are not known to be
    aligned, so they are not vectorized and the k loop is not software-pipelined (no async copies:
    ``num_stages`` then changes nothing), which is not the code the GPU runs."""
    div = [n for n in names if ptr.get(n, "").startswith("*") or n == "stride_x"]
    return {(names.index(n),): [["tt.divisibility", 16]] for n in div}


def compile_w13(c: KernelConfig):
    """The cubin of the w13 launch ``c`` runs (the same constexprs as triton_fp8_experts passes at 1 token)."""
    qx, w8 = bool(c.quant_x), c.w8a16
    raw = qx or w8  # the w13 launch reads x itself
    fuse = not w8 and (c.quant_act == 1 or (c.quant_act == 0 and c.block_n1 % 128 == 0))
    pdl = c.pdl > 0
    ptr = {"xq_ptr": "*bf16" if raw else "*fp8e4nv", "xs_ptr": "*bf16" if raw else "*fp32", "ids_ptr": "*i64",
           "sorted_pairs_ptr": "*i64", "expert_off_ptr": "*i64", "row_map_ptr": "*i32", "w_hot_ptr": "*fp8e4nv",
           "w_cold_ptr": "*fp8e4nv", "s_hot_ptr": "*fp32", "s_cold_ptr": "*fp32", "act_ptr": "*bf16",
           "actq_ptr": "*bf16" if w8 else "*fp8e4nv", "acts_ptr": "*bf16" if w8 else "*fp32", "num_pairs": "i32",
           "layer": "i32", "NB": "i32", "pf_bytes": "i32", "stride_x": "i32"}
    const = dict(E=E, EP=E, TOPK=TOPK, H=H, I=I, GI=I // 128, GH=H // 128, BM=c.block_m, BN=c.block_n1, BK=128,
                 NP=TOPK, MODE=0, USE_ROW_MAP=True, EVEN_K=True, EVEN_N=I % c.block_n1 == 0, USE_GDC=pdl,
                 PREFETCH=c.pdl == 1 and not raw, ORDER=c.tile_order, FUSE_Q=fuse, QUANT_X=qx,
                 WAIT_FIRST=raw and c.pdl == 3, W8A16=w8, SWAP=bool(c.swap_ab))
    names = list(inspect.signature(triton_fp8._w13_fp8_kernel.fn).parameters)
    missing = [n for n in names if n not in ptr and n not in const]
    if missing:
        raise SystemExit(f"fp8_w13_sass_cpu: the kernel has parameters this probe does not know: {missing}")
    sig = {n: ptr.get(n, "constexpr") for n in names}
    src = ASTSource(fn=triton_fp8._w13_fp8_kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in const.items()}, attrs=launch_attrs(names, ptr))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=c.num_warps, num_stages=c.num_stages))


def compile_w2(c: KernelConfig):
    """The cubin of the w2 launch ``c`` runs at 1 token (its prefetch only behind the intermediate's own launch)."""
    w8 = c.w8a16
    fuse = not w8 and (c.quant_act == 1 or (c.quant_act == 0 and c.block_n1 % 128 == 0))
    ptr = {"actq_ptr": "*bf16" if w8 else "*fp8e4nv", "acts_ptr": "*bf16" if w8 else "*fp32", "ids_ptr": "*i64",
           "sorted_pairs_ptr": "*i64", "expert_off_ptr": "*i64", "row_map_ptr": "*i32", "w_hot_ptr": "*fp8e4nv", "w_cold_ptr": "*fp8e4nv",
           "s_hot_ptr": "*fp32", "s_cold_ptr": "*fp32", "topk_w_ptr": "*bf16",
           "buf_ptr": "*bf16" if c.half_buf else "*fp32", "num_pairs": "i32", "layer": "i32", "NB": "i32",
           "pf_bytes": "i32"}
    const = dict(E=E, EP=E, H=H, I=I, GI=I // 128, GH=H // 128, BM=c.block_m, BN=c.block_n2, BK=128, NP=TOPK, MODE=0,
                 USE_ROW_MAP=True, EVEN_K=True, EVEN_N=H % c.block_n2 == 0, USE_GDC=c.pdl > 0,
                 PREFETCH=c.pdl == 1 and not fuse and not w8, ORDER=c.tile_order, W8A16=w8, SWAP=bool(c.swap_ab))
    names = list(inspect.signature(triton_fp8._w2_fp8_kernel.fn).parameters)
    missing = [n for n in names if n not in ptr and n not in const]
    if missing:
        raise SystemExit(f"fp8_w13_sass_cpu: the w2 kernel has parameters this probe does not know: {missing}")
    src = ASTSource(fn=triton_fp8._w2_fp8_kernel, signature={n: ptr.get(n, "constexpr") for n in names},
                    constexprs={(names.index(k),): v for k, v in const.items()}, attrs=launch_attrs(names, ptr))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=c.num_warps, num_stages=c.num_stages))


def tool_output(tool: str, args: list[str], cubin: bytes) -> str:
    """The stdout of one of the ptxas tools triton ships (cuobjdump, nvdisasm) run on ``cubin``."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(cubin)
        path = fh.name
    try:
        return subprocess.run([str(tools / tool), *args, path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)


def disassemble(cubin: bytes) -> str:
    """nvdisasm's SASS of ``cubin``."""
    return tool_output("nvdisasm", ["-c"], cubin)


def stats(cubin: bytes) -> dict:
    usage = tool_output("cuobjdump", ["--dump-resource-usage"], cubin)
    sass = disassemble(cubin)
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)", usage)
    if m is None:
        raise SystemExit(f"fp8_w13_sass_cpu: no REG/STACK in cuobjdump's output: {usage[-300:]}")
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]

    def count(pattern):
        return sum(1 for ln in lines if re.search(pattern, ln))

    return {"regs": int(m.group(1)), "stack_B": int(m.group(2)), "sass": len(lines), "MUFU.RCP": count(r"MUFU\.RCP"),
            "FCHK": count(r"\bFCHK\b"), "spill_STL_LDL": count(r"\b(STL|LDL)\b"), "HMMA": count(r"\bHMMA\b"),
            "GMMA": count(r"\b[HQ]GMMA\b"), "F2FP": count(r"\bF2FP\b"), "F2F": count(r"\bF2F\."), "LDSM": count(r"\bLDSM\b"),
            "LDGSTS": count(r"\bLDGSTS\b")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--extra", default="[]", help="JSON list of KernelConfig field dicts compiled too")
    args = p.parse_args(argv)
    configs = list(TRITON_FP8_SEARCH_SPACE["decode"]) + json.loads(args.extra)
    for d in configs:
        c = KernelConfig.from_dict(d)
        triton_fp8._check_config(c)
        tile = (f"{c.block_m}x{c.block_n1}/{c.block_n2} w{c.num_warps} s{c.num_stages} pdl{c.pdl} quant_x{c.quant_x} "
                f"quant_act{c.quant_act}" + (f" w8a16={c.w8a16}" if c.w8a16 else "") + (" swap" if c.swap_ab else ""))
        for name, build in (("w13", compile_w13), ("w2", compile_w2)):
            s = stats(build(c).asm["cubin"])
            print(f"{tile:52s} {name:3s} " + " ".join(f"{k}={v}" for k, v in s.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
