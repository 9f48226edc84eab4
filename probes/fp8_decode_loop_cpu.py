"""Probe (not a tool of the package): the k loop of the bf16 and the block-FP8 (w8a8) experts kernels
at 1 token, side by side, from their sm90 SASS compiled on the CPU, no GPU (issue 29: why the FP8
kernel reaches ~1.6 TB/s-equivalent at b1 where the bf16 kernel reaches ~2.8).

    PYTHONPATH=<triton 3.6>:src python probes/fp8_decode_loop_cpu.py [--fp8 '{...}'] [--bf16 '{...}']

Compiles the w13 and w2 launches of
- the bf16 kernel (:mod:`coldset.kernels.triton_moe`) with its tuned 1-token config
  (config/examples/h200-tuned/kernel_configs.json, entry "1"), and
- the FP8 kernel (:mod:`coldset.kernels.triton_fp8`) with its best measured 1-token config
  (docs/measurements/fp8_tune_w8a16.json: 16 x 32 / 64, 4 warps, 4 stages, pdl 2: 23.48 µs a layer),
at Qwen3-30B-A3B's shape (E=128, H=2048, I=768, top-8, bf16 tokens, the row map on, the in-kernel
grouping of 1 token: 8 slots), with the launch's pointer alignment; the FP8 cubins come from
probes/fp8_w13_sass_cpu.py's own ``compile_w13`` / ``compile_w2`` (imported), the bf16 ones from the
same recipe here (its ``launch_attrs``, plus ``stride_xt``, the bf16 kernel's name for the tokens' row
stride). ``--fp8`` / ``--bf16``: JSON KernelConfig fields replacing those configs.

What it prints, per launch (read from the SASS unless marked "model"):
- registers a thread, stack, shared memory a block (Triton's metadata), SASS instructions;
- the k loop: the innermost backward branch whose body holds the HMMAs. Per iteration (per warp;
  every warp runs the whole body): instructions, global loads by kind and width (LDGSTS: async copies
  into shared memory, pipelined by Triton; LDG: loads into registers, not pipelined), the bytes they
  request per program (width x threads; the A tile's LDGSTS carry a zero-fill predicate, its rows past
  the pairs move no bytes: at 1 token 1 row of 16 is real), the weight bytes per iteration (from the
  tile: BK x BN x element size, x2 for gate and up), LDSM/LDS, HMMA by type, F2FP/F2F conversions,
  FMUL/FFMA, barriers (BAR.SYNC), cp.async groups committed (LDGDEPBAR) and the DEPBAR wait threshold;
- the pipeline depth: shared-memory buffers (shared bytes over one iteration's LDGSTS bytes) and the
  iterations still in flight at the loop's wait (DEPBAR threshold over groups per iteration);
- every LDG of the loop traced to its readers: where it is issued, its first reader, how many HMMAs
  lie between (the work that hides its latency), whether its value is consumed in the same trip
  (loaded for this iteration, not prefetched) and whether the chain reaches an FFMA into a loop-
  carried accumulator (on the critical path of the accumulation);
- grid at 1 token (8 slots x column blocks), programs per SM over the H200's 132 SMs, and (model)
  weight bytes in flight: programs/SM x iterations in flight x weight bytes per iteration, per SM
  and device-wide, and the latency that device-wide figure covers at 4.6 TB/s (Little's law: a
  loaded HBM latency above it caps the launch below the read rate).

Static facts of the code only: nothing here is a time; the hypotheses drawn from it are in the
issue 29 closing note and need the GPU measurements named there. What it printed at this commit
(triton 3.6, the configs above): both w13 loops run 16 iterations and both w2 loops 6, with 2
barriers each and 16 HMMA a warp (bf16: HMMA.16816.F32.BF16; FP8: HMMA.16816.F32 on f16 after 64
F2FP.F16.E4M3 unpacks a warp, half of them the A tile, which each of the 4 warps unpacks); FP8 moves
8 KiB of weights an iteration against bf16's 16 KiB, with 178 instructions against 113 (w2: 177
against 71, bf16's w2 loop fully unrolled) and 6 LDG.E of scales a thread, issued after the stage
wait and read 16 HMMA later in the same trip (no prefetch) on the way to the accumulator's FFMA;
at the loop's wait, 2 iterations in flight (FP8, 3 buffers) against 1 (bf16, 2 buffers), so the
same 3.0 MiB (w13) / 4.0 MiB (w2) of weights in flight device-wide; the FP8 w13 waits for the
tokens' quantization launch (ACQBULK) before its first copy, the bf16 w13 waits for nothing.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_w13_sass_cpu import E, H, I, TOPK, compile_w13, compile_w2, disassemble, launch_attrs, stats  # noqa: E402

from coldset.kernels import triton_fp8, triton_moe  # noqa: E402
from coldset.kernels.triton_moe import KernelConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMS = 132  # H200 SMs
SM_REGS, SM_SMEM, SMEM_RESERVED = 65536, 228 * 1024, 1024  # sm90: registers, shared memory a SM, reserved a block
HBM_Bps = 4.6e12  # plain read measured on the lent H200 (docs/measurements/kernel_bench_fp8.json: 4605 GB/s)
TOKENS = 1
SLOTS = TOKENS * TOPK  # MODE_SLOTS at 1 token: one block row per selected expert
FP8_BEST = dict(block_m=16, block_n1=32, block_k1=128, block_n2=64, block_k2=128, num_warps=4, num_stages=4,
                slot_max_pairs=32, pdl=2)


def _bf16_compile(kernel, ptr: dict, const: dict, c: KernelConfig):
    names = list(inspect.signature(kernel.fn).parameters)
    missing = [n for n in names if n not in ptr and n not in const]
    if missing:
        raise SystemExit(f"fp8_decode_loop_cpu: {kernel.fn.__name__} has parameters this probe does not know: {missing}")
    attrs = launch_attrs(names, ptr)
    if "stride_xt" in names:  # x.stride(0) = H = 2048: the JIT's divisibility specialization, as stride_x's
        attrs[(names.index("stride_xt"),)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature={n: ptr.get(n, "constexpr") for n in names},
                    constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=c.num_warps, num_stages=c.num_stages))


def compile_bf16_w13(c: KernelConfig):
    """The bf16 w13 launch at 1 token (the same constexprs as triton_experts passes: MODE_SLOTS, no split)."""
    ptr = {"x_ptr": "*bf16", "ids_ptr": "*i64", "sorted_pairs_ptr": "*i64", "expert_off_ptr": "*i64",
           "row_map_ptr": "*i32", "w_hot_ptr": "*bf16", "w_cold_ptr": "*bf16", "act_ptr": "*bf16", "part_ptr": "*fp32",
           "num_pairs": "i32", "layer": "i32", "stride_xt": "i32", "NB": "i32"}
    const = dict(E=E, EP=E, TOPK=TOPK, H=H, I=I, BM=c.block_m, BN=c.block_n1, BK=c.block_k1, NP=SLOTS, MODE=0,
                 USE_ROW_MAP=True, EVEN_K=H % c.block_k1 == 0, EVEN_N=I % c.block_n1 == 0, USE_GDC=c.pdl > 0,
                 PREFETCH=c.pdl == 1, SPLIT=c.split_k1, KS=H, ORDER=c.tile_order, WAIT=c.pdl == 3,
                 HALF_TAIL=c.half_tail)
    return _bf16_compile(triton_moe._w13_act_kernel, ptr, const, c)


def compile_bf16_w2(c: KernelConfig):
    ptr = {"act_ptr": "*bf16", "part_ptr": "*fp32", "ids_ptr": "*i64", "sorted_pairs_ptr": "*i64",
           "expert_off_ptr": "*i64", "row_map_ptr": "*i32", "w_hot_ptr": "*bf16", "w_cold_ptr": "*bf16",
           "topk_w_ptr": "*bf16", "buf_ptr": "*bf16" if c.half_buf else "*fp32", "sink_ptr": "*fp32",
           "num_pairs": "i32", "layer": "i32", "NB": "i32"}
    const = dict(E=E, EP=E, H=H, I=I, BM=c.block_m, BN=c.block_n2, BK=c.block_k2, NP=SLOTS, MODE=0, USE_ROW_MAP=True,
                 EVEN_K=I % c.block_k2 == 0, EVEN_N=H % c.block_n2 == 0, USE_GDC=c.pdl > 0, PREFETCH=c.pdl == 1,
                 SPLIT=c.split_k2, KS=I, SPLIT1=c.split_k1, ORDER=c.tile_order, HALF_TAIL=c.half_tail)
    return _bf16_compile(triton_moe._w2_kernel, ptr, const, c)


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def parse(sass: str) -> tuple[list[tuple[int, str, str, str]], dict[str, int]]:
    """([(address, predicate, opcode, operands)], {label: address of the next instruction})."""
    instrs, labels, pending = [], {}, []
    for line in sass.splitlines():
        m = _LABEL.match(line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.search(line)
        if not m:
            continue
        addr, text = int(m.group(1), 16), m.group(2).strip()
        pred = ""
        if text.startswith("@"):
            pred, text = text.split(None, 1)
        op, _, rest = text.partition(" ")
        for lab in pending:
            labels[lab] = addr
        pending = []
        instrs.append((addr, pred, op, rest))
    return instrs, labels


def k_loop(instrs, labels, hmma_per_iter: int, k_iters: int) -> tuple[int, int, int]:
    """(first, last, k iterations in it) of the k loop: the innermost backward-branch body that holds
    HMMAs. Where ptxas unrolled the whole k loop (that body is then the chunk loop, holding
    ``k_iters`` x ``hmma_per_iter`` HMMAs), the span from its first async copy to its last HMMA
    (the unrolled pipeline, prologue copies included; the chunk's lookups and epilogue left out)."""
    loops = []
    for i, (addr, _, op, rest) in enumerate(instrs):
        m = re.search(r"`\((\.L_x_\d+)\)", rest)
        if op.startswith("BRA") and m and labels.get(m.group(1), addr + 1) <= addr:
            first = next(j for j, ins in enumerate(instrs) if ins[0] == labels[m.group(1)])
            if any(ins[2].startswith("HMMA") for ins in instrs[first:i + 1]):
                loops.append((i - first, first, i))
    if not loops:
        raise SystemExit("fp8_decode_loop_cpu: no backward branch around the HMMAs (no k loop found)")
    _, first, last = min(loops)
    n_hmma = sum(1 for ins in instrs[first:last + 1] if ins[2].startswith("HMMA"))
    if n_hmma == hmma_per_iter:
        return first, last, 1
    if n_hmma != hmma_per_iter * k_iters:
        raise SystemExit(f"fp8_decode_loop_cpu: the innermost loop holds {n_hmma} HMMA, neither one k step's "
                         f"{hmma_per_iter} nor {k_iters} steps' (partial unrolling: not handled)")
    body = range(first, last + 1)
    lo = next(j for j in body if instrs[j][2].startswith("LDGSTS"))
    hi = max(j for j in body if instrs[j][2].startswith("HMMA"))
    return lo, hi, k_iters


def _regs(s: str) -> list[int]:
    return [int(r) for r in re.findall(r"(?<![A-Z])R(\d+)\b", s)]


def _dest_width(op: str) -> int:
    """Registers an instruction's first operand spans (its destination)."""
    if op.startswith("HMMA") or op.startswith("LDSM") and op.endswith(".4"):
        return 4
    m = re.search(r"\.(64|128)\b", op)
    return {"64": 2, "128": 4}[m.group(1)] if m else 1


def defs_uses(op: str, rest: str) -> tuple[set[int], set[int]]:
    """(registers written, registers read) of one instruction, for the def-use walk (stores and
    async copies write no register)."""
    parts = [p.strip() for p in rest.split(",")]
    if not parts or op.startswith(("ST", "LDGSTS", "BAR", "BRA", "DEPBAR", "LDGDEPBAR", "WARPSYNC", "NOP", "ISETP",
                                   "FSETP")):
        return set(), set(_regs(rest))
    d = _regs(parts[0])
    writes = set(range(d[0], d[0] + _dest_width(op))) if d else set()
    reads = set()
    for p in parts[1:]:
        for r in _regs(p):
            reads.update(range(r, r + 2) if re.search(rf"R{r}\.64", p) else (r,))
    return writes, reads


def loop_report(instrs, first: int, last: int, threads: int, iters: int) -> dict:
    """Per k iteration (the span's counts over ``iters``, the iterations it holds) and the LDG chains."""
    body = instrs[first:last + 1]
    ops = [op for _, _, op, _ in body]

    def cnt(pat):
        n = sum(1 for op in ops if re.match(pat, op))
        return n // iters if n % iters == 0 else round(n / iters, 2)

    def width(op):
        m = re.search(r"\.(8|16|32|64|128)$", op) or re.search(r"\.(64|128)\b", op)
        return int(m.group(1)) if m else 32

    # an async copy whose zero-fill predicate is a constant (PT / !PT) is one of the unrolled pipeline's
    # past-the-end iterations (offsets past K): it moves no bytes and is left out of the counts
    ldgsts = [(op, rest) for _, _, op, rest in body if op.startswith("LDGSTS") and not re.search(r",\s*!?PT\s*$", rest)]
    past_end = sum(1 for _, _, op, rest in body if op.startswith("LDGSTS") and re.search(r",\s*!?PT\s*$", rest))
    ldg = [(op, rest) for _, _, op, rest in body if op.startswith("LDG") and not op.startswith(("LDGSTS", "LDGDEPBAR"))]
    hmma = {}
    for op in ops:
        if op.startswith("HMMA"):
            hmma[op] = hmma.get(op, 0) + 1
    hmma = {k: v // iters for k, v in hmma.items()}
    waits = [j for j, op in enumerate(ops) if op == "DEPBAR.LE"]
    thr = int(re.search(r"0x([0-9a-f]+)", body[waits[0]][3]).group(1), 16) if waits else None
    # cp.async groups committed per iteration: between two waits of the unrolled pipeline, else the body's
    span = ops[waits[0]:waits[1]] if len(waits) > 1 else ops
    groups = sum(1 for op in span if op == "LDGDEPBAR")
    per = lambda n: n // iters if n % iters == 0 else round(n / iters, 2)  # noqa: E731
    rep = {
        "instr": per(sum(1 for op in ops if op != "NOP")),
        "LDGSTS": {f"{w}b": per(sum(1 for op, _ in ldgsts if width(op) == w))
                   for w in sorted({width(op) for op, _ in ldgsts})},
        "LDGSTS_past_end": past_end,
        "LDG": {f"{w}b": per(sum(1 for op, _ in ldg if width(op) == w)) for w in sorted({width(op) for op, _ in ldg})},
        "smem_B_per_prog": per(sum(width(op) // 8 for op, _ in ldgsts) * threads),
        "reg_B_requested_per_prog": per(sum(width(op) // 8 for op, _ in ldg) * threads),
        "LDSM": cnt(r"LDSM"), "LDS": cnt(r"LDS(\.|$)"), "HMMA": hmma, "F2FP": cnt(r"F2FP"), "F2F": cnt(r"F2F\."),
        "FMUL": cnt(r"FMUL"), "FFMA": cnt(r"FFMA"), "FADD": cnt(r"FADD"), "BAR.SYNC": cnt(r"BAR\.SYNC"),
        "LDGDEPBAR": groups, "DEPBAR.LE": thr, "iters_in_span": iters,
        "iters_in_flight_at_wait": (thr // groups) if thr is not None and groups else None,
    }
    # every register-load of the loop, followed to its readers
    du = [defs_uses(op, rest) for _, _, op, rest in body]
    acc_regs = set()  # loop-carried FFMA/FADD accumulators: written and read by the same instruction
    for (w, r), (_, _, op, _) in zip(du, body):
        if op.startswith(("FFMA", "FADD")) and w & r:
            acc_regs |= w & r
    chains = []
    for i, (_, pred, op, rest) in enumerate(body):
        if not (op.startswith("LDG") and not op.startswith(("LDGSTS", "LDGDEPBAR"))):
            continue
        dest = du[i][0]
        readers_before = [j for j in range(i) if du[j][1] & dest and not any(du[k][0] & dest for k in range(j))]
        first_use = next((j for j in range(i + 1, len(body)) if du[j][1] & dest), None)
        chain, frontier, to_acc = [], set(dest), None
        for j in range(i + 1, len(body)):
            if du[j][1] & frontier:
                chain.append(j)
                if body[j][2].startswith(("FFMA", "FADD")) and du[j][0] & acc_regs:
                    to_acc = j
                    break
                frontier |= du[j][0]
        chains.append({
            "at": i, "ldg": f"{pred + ' ' if pred else ''}{op} {rest}", "first_use": first_use,
            "first_use_op": body[first_use][2] if first_use is not None else None,
            "hmma_between": sum(1 for k in range(i + 1, first_use or i) if body[k][2].startswith("HMMA")),
            "same_trip": first_use is not None and not readers_before,
            "to_acc_ffma": to_acc, "acc_ffma_op": f"{body[to_acc][2]} {body[to_acc][3]}" if to_acc else None,
        })
    rep["ldg_chains"] = chains
    last_hmma = max((k for k, op in enumerate(ops) if op.startswith("HMMA")), default=None)
    rep["last_hmma_at"] = last_hmma
    rep["body_len"] = len(body)
    return rep


def launch_row(name: str, c: KernelConfig, kernel, bn: int, nb: int, k_iters: int, w_elem: int, a_elem: int,
               mats: int, dependent: bool) -> dict:
    """One launch's row: ``bn`` columns a block, ``nb`` column blocks, ``mats`` weight matrices (gate
    and up: 2) of ``w_elem`` bytes, the A tile of ``a_elem`` bytes, ``k_iters`` k steps of 128;
    ``dependent``: launched as a programmatic dependent launch (else its ACQBULK returns at once)."""
    cubin = kernel.asm["cubin"]
    s = stats(cubin)
    instrs, labels = parse(disassemble(cubin))
    warps_n = c.num_warps  # BM = 16: one m tile, the warps split the columns (mma.sync m16n8k16)
    hmma_per_iter = (c.block_m // 16) * (bn // 8) * (128 // 16) * mats // warps_n
    first, last, iters = k_loop(instrs, labels, hmma_per_iter, k_iters)
    threads = 32 * c.num_warps
    loop = loop_report(instrs, first, last, threads, iters)
    shared = kernel.metadata.shared
    ops = [ins[2] for ins in instrs]
    at = lambda pre: next((j for j, op in enumerate(ops) if op.startswith(pre)), None)  # noqa: E731
    # PREEXIT: griddepcontrol.launch_dependents (the next launch may start); ACQBULK: griddepcontrol.wait
    # (this launch waits for the whole launch before it, and its memory, before going on)
    gdc = {"PREEXIT": at("PREEXIT"), "ACQBULK": at("ACQBULK"), "first_LDGSTS": at("LDGSTS"), "n_instr": len(ops),
           "dependent": dependent}
    weight_B = 128 * bn * w_elem * mats  # BK x BN per matrix, one k step
    a_B = c.block_m * 128 * a_elem
    programs = SLOTS * nb
    buffers = shared / (weight_B + a_B)
    inflight = loop["iters_in_flight_at_wait"] or 0
    per_sm = programs / SMS
    warp_regs = -(-s["regs"] * 32 // 256) * 256  # allocated per warp in units of 256
    max_ctas = min(SM_REGS // (warp_regs * c.num_warps), SM_SMEM // (shared + SMEM_RESERVED), 64 // c.num_warps)
    dev_lo, dev_hi = programs * inflight * weight_B, programs * buffers * weight_B
    return {"name": name, "config": c, "regs": s["regs"], "stack_B": s["stack_B"], "sass": s["sass"], "shared_B": shared,
            "k_iters": k_iters, "weight_B_per_iter": weight_B, "a_B_per_iter": a_B, "programs": programs,
            "per_sm": per_sm, "max_ctas_per_sm": max_ctas, "buffers": buffers, "loop": loop,
            "loop_addr": (instrs[first][0], instrs[last][0]),
            "inflight_weight_B_per_sm": (per_sm * inflight * weight_B, per_sm * buffers * weight_B),
            "inflight_weight_B_device": (dev_lo, dev_hi),
            "latency_covered_ns": (dev_lo / HBM_Bps * 1e9, dev_hi / HBM_Bps * 1e9),
            "launch_read_us": programs * k_iters * weight_B / HBM_Bps * 1e6, "gdc": gdc,
            # values converted by F2FP an iteration (a packed unpack: 2 values a thread) against the
            # weight values of the tile and the A tile's once per warp (each warp unpacks the whole A)
            "f2fp_values": loop["F2FP"] * 2 * threads, "w_values": weight_B // w_elem,
            "a_values_per_warps": c.block_m * 128 * c.num_warps}


def show(rows: list[dict]) -> None:
    for r in rows:
        c, lp = r["config"], r["loop"]
        print(f"\n== {r['name']}: BM{c.block_m} BN{c.block_n1 if 'w13' in r['name'] else c.block_n2} "
              f"w{c.num_warps} s{c.num_stages} pdl{c.pdl}   k loop SASS {r['loop_addr'][0]:#06x}..{r['loop_addr'][1]:#06x}")
        print(f"  regs {r['regs']}  stack {r['stack_B']} B  shared {r['shared_B']} B  SASS {r['sass']}  "
              f"k iterations {r['k_iters']}")
        g = r["gdc"]
        wait = ("none: a plain launch, its weight copies start at once" if g["ACQBULK"] is None else
                f"ACQBULK (griddepcontrol.wait) at instruction {g['ACQBULK']}, "
                f"{'before' if g['ACQBULK'] < g['first_LDGSTS'] else 'after'} the first weight copy "
                f"(instruction {g['first_LDGSTS']})" + ("" if g["dependent"] else
                "; compiled in, but this launch is a plain launch at this pdl: it returns at once"))
        print(f"  grid dependency: PREEXIT (launch_dependents) at instruction {g['PREEXIT']} of {g['n_instr']}; wait: {wait}")
        unrolled = f" (k loop fully unrolled: span / {lp['iters_in_span']})" if lp["iters_in_span"] > 1 else ""
        pe = f" (+{lp['LDGSTS_past_end']} past-the-end copies in the span, zero-filled)" if lp["LDGSTS_past_end"] else ""
        print(f"  per iteration (per warp){unrolled}: {lp['instr']} instr; LDGSTS {lp['LDGSTS']}{pe}; "
              f"LDG {lp['LDG']}; LDSM {lp['LDSM']} LDS {lp['LDS']}; HMMA {lp['HMMA']}; "
              f"F2FP {lp['F2FP']} F2F {lp['F2F']}; FMUL {lp['FMUL']} FFMA {lp['FFMA']} FADD {lp['FADD']}; "
              f"BAR.SYNC {lp['BAR.SYNC']}; LDGDEPBAR {lp['LDGDEPBAR']}, DEPBAR.LE {lp['DEPBAR.LE']}")
        print(f"  bytes per program per iteration: async copies {lp['smem_B_per_prog']} B = weights "
              f"{r['weight_B_per_iter']} B + A tile {r['a_B_per_iter']} B (1 of {c.block_m} rows real at 1 token: the "
              f"others masked, zero-filled): {lp['smem_B_per_prog'] == r['weight_B_per_iter'] + r['a_B_per_iter']}; "
              f"register loads requested {lp['reg_B_requested_per_prog']} B (width x threads; few distinct addresses)")
        print(f"  pipeline: {r['buffers']:g} shared buffers (shared bytes / one stage's), "
              f"{lp['iters_in_flight_at_wait']} iterations still in flight at the loop's wait "
              f"(DEPBAR.LE {lp['DEPBAR.LE']} / {lp['LDGDEPBAR']} groups an iteration)")
        if lp["F2FP"]:
            print(f"  conversions: {lp['F2FP']} F2FP a warp = {r['f2fp_values']} values a block an iteration: the "
                  f"{r['w_values']} weight values once + the A tile's {c.block_m}x128 once per warp "
                  f"({r['a_values_per_warps']}): {r['f2fp_values'] == r['w_values'] + r['a_values_per_warps']}")
        for ch in lp["ldg_chains"]:
            print(f"  LDG @{ch['at']}/{lp['body_len']}: {ch['ldg']}\n      first reader @{ch['first_use']} "
                  f"({ch['first_use_op']}), {ch['hmma_between']} HMMA between; same trip (not prefetched): "
                  f"{ch['same_trip']}; reaches the accumulator FFMA @{ch['to_acc_ffma']} ({ch['acc_ffma_op']}); "
                  f"last HMMA of the body @{lp['last_hmma_at']}")
        lo, hi = r["inflight_weight_B_per_sm"]
        dlo, dhi = r["inflight_weight_B_device"]
        nlo, nhi = r["latency_covered_ns"]
        print(f"  grid at 1 token: {r['programs']} programs = {r['per_sm']:.2f} per SM of {SMS} (registers and shared "
              f"memory allow {r['max_ctas_per_sm']} a SM: one wave, ~{r['per_sm']:.1f} warps a scheduler); "
              f"model: weight bytes "
              f"in flight {lo / 1024:.1f}-{hi / 1024:.1f} KiB per SM, {dlo / 2**20:.2f}-{dhi / 2**20:.2f} MiB device-wide, "
              f"covering {nlo:.0f}-{nhi:.0f} ns of latency at {HBM_Bps / 1e12:.1f} TB/s; a program's {r['k_iters']} "
              f"iterations; the launch's weights at that rate: {r['launch_read_us']:.2f} µs, "
              f"{r['launch_read_us'] / r['k_iters'] * 1e3:.0f} ns an iteration")

    print("\n| launch | prog | /SM | regs | smem B | instr/it | LDGSTS/thr/it | LDG/thr/it | weight B/it | HMMA/warp/it"
          " | F2FP | BAR | in flight (it) | KiB/SM in flight | MiB device | ns covered | read µs | wait vs 1st copy |")
    print("|" + "---|" * 18)
    for r in rows:
        lp = r["loop"]
        ng = sum(lp["LDGSTS"].values())
        g = r["gdc"]
        wait = "-" if g["ACQBULK"] is None or not g["dependent"] else (
            "before" if g["ACQBULK"] < g["first_LDGSTS"] else "after")
        print(f"| {r['name']} | {r['programs']} | {r['per_sm']:.2f} | {r['regs']} | {r['shared_B']} | {lp['instr']} | "
              f"{ng} ({'/'.join(f'{v}x{k}' for k, v in lp['LDGSTS'].items())}) | "
              f"{sum(lp['LDG'].values())} ({'/'.join(f'{v}x{k}' for k, v in lp['LDG'].items()) or '-'}) | "
              f"{r['weight_B_per_iter']} | {sum(lp['HMMA'].values())} {'/'.join(lp['HMMA'])} | {lp['F2FP']} | "
              f"{lp['BAR.SYNC']} | {lp['iters_in_flight_at_wait']}-{r['buffers']:.0f} | "
              f"{r['inflight_weight_B_per_sm'][0] / 1024:.1f}-{r['inflight_weight_B_per_sm'][1] / 1024:.1f} | "
              f"{r['inflight_weight_B_device'][0] / 2**20:.2f}-{r['inflight_weight_B_device'][1] / 2**20:.2f} | "
              f"{r['latency_covered_ns'][0]:.0f}-{r['latency_covered_ns'][1]:.0f} | {r['launch_read_us']:.1f} | {wait} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bf16", default="{}", help="JSON KernelConfig fields replacing the bf16 tuned 1-token config's")
    p.add_argument("--fp8", default="{}", help="JSON KernelConfig fields replacing the FP8 best 1-token config's")
    args = p.parse_args(argv)
    tuned = json.loads((ROOT / "config/examples/h200-tuned/kernel_configs.json").read_text())["autotune"]["configs"]["1"]
    cb = replace(KernelConfig.from_dict(tuned), **{k: int(v) for k, v in json.loads(args.bf16).items()})
    cf = replace(KernelConfig.from_dict(FP8_BEST), **{k: int(v) for k, v in json.loads(args.fp8).items()})
    triton_fp8._check_config(cf)
    if (cb.block_k1, cb.block_k2, cb.split_k1, cb.split_k2, cb.block_m, cf.block_m) != (128, 128, 1, 1, 16, 16):
        raise SystemExit("fp8_decode_loop_cpu: compares unsplit 16-row tiles with k steps of 128 only")
    fmt = f"fp8 w8a16={cf.w8a16}" if cf.w8a16 else ("fp8 quant_x" if cf.quant_x else "fp8")
    a_fp8 = 2 if cf.w8a16 or cf.quant_x else 1  # the w13 A tile: x itself (bf16) when w8a16 or quant_x
    print(f"bf16 config (kernel_configs.json, 1 token): {cb}\nFP8 config (best measured w8a8 at 1 token): {cf}")
    rows = [
        # which launches are dependent launches, as triton_experts / triton_fp8_experts launch them
        launch_row("bf16 w13", cb, compile_bf16_w13(cb), cb.block_n1, -(-I // cb.block_n1), H // 128, 2, 2, 2,
                   cb.pdl == 3),
        launch_row(f"{fmt} w13", cf, compile_w13(cf), cf.block_n1, -(-I // cf.block_n1), H // 128, 1, a_fp8, 2,
                   cf.pdl == 3 if a_fp8 == 2 else cf.pdl > 0),
        launch_row("bf16 w2", cb, compile_bf16_w2(cb), cb.block_n2, -(-H // cb.block_n2), I // 128, 2, 2, 1, cb.pdl > 0),
        launch_row(f"{fmt} w2", cf, compile_w2(cf), cf.block_n2, -(-H // cf.block_n2), I // 128, 1, a_fp8, 1,
                   cf.pdl > 0),
    ]
    show(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
