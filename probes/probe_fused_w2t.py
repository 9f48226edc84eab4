# Probe, not a tool: an experiment kept for its finding (BENCHMARKS.md, issue 13); the measurements are `python -m coldset bench ...`.
"""Probe, not package code (issue 13, ninth session): the decode experts as ONE GEMM launch plus a
reduce launch, timed beside ``triton_experts``' tuned three launches.

The three-launch kernel (w13 + act, then w2, then the top-k sum) waits for all of w13 before w2
starts. Here block (slot s, column slice j of I) multiplies the s-th selected expert's pairs by
its gate / up rows j*BN .. j*BN+BN-1 over all of H, forms SiLU(gate) * up rounded to bf16 (as the
three-launch kernel's activation scratch), then multiplies that [BM, BN] by w2's columns j*BN ..
(read from w2^T, ``[I, H]`` per expert, where they are whole 4 KB rows, or from the pools' own
``[H, I]``, where they are BN * 2-byte pieces of each row: the seventh session's ``fuse_w2`` read
64-byte ones): fp32 partial sums part[j, pair, :], with no w13 -> w2 dependency. A reduce launch
adds, per token, rank by rank, the routing weight times the tree sum over j (a fixed order:
deterministic; not the three-launch kernel's bits). Qwen3-30B-A3B shapes (E=128, H=2048, I=768,
top-8, bf16), 8 layers' experts rotated in one CUDA graph (no layer's weights served from L2),
median of ``--reps`` replays, better of two graphs; the bound and a plain read of the same bytes a
launch measured in the same process. The three-launch configs are the tuned H200 entries of
BENCHMARKS.md (issue 13, eighth session, kernel table).

    PYTHONPATH=src python3 probes/probe_fused_w2t.py
"""
import argparse

import torch
import triton
import triton.language as tl

from coldset.kernels.bandwidth import HBM_READ_SHAPES, best_read_bandwidth
from coldset.kernels.reference import torch_experts, torch_softmax_topk
from coldset.kernels.triton_moe import (KernelConfig, _block_expert, _chunk_pairs, gdc_launch_dependents, gdc_wait,
                                        triton_experts)
from coldset.kernels.tiers import ExpertPools
from coldset.core.timing import graph_time_us


@triton.jit
def _fused_kernel(x_ptr, ids_ptr, w13_ptr, w2t_ptr, part_ptr, num_pairs, layer,
                  E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr, NP: tl.constexpr,
                  GDC: tl.constexpr, W2T: tl.constexpr):
    """Block (slot, j): the slot-th selected expert's pairs (at most BM), w13 slice j, then w2's columns of slice j."""
    slot = tl.program_id(0)
    j = tl.program_id(1)
    # the package's in-kernel grouping (MODE_SLOTS): the slot-th selected expert and its pairs
    expert, cnt, start, _, _ = _block_expert(ids_ptr, ids_ptr, num_pairs, slot, E, EP, NP, BM, 0)
    if cnt > 0:
        pair, valid = _chunk_pairs(ids_ptr, ids_ptr, num_pairs, expert, start, 0, cnt, BM, NP, 0)
        tok = (pair // TOPK).to(tl.int64)
        row = (layer * E + expert).to(tl.int64)
        offs_n = j * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        wg = w13_ptr + row * (2 * I * H) + offs_n[None, :] * H + offs_k[:, None]
        a_ptrs = x_ptr + tok[:, None] * H + offs_k[None, :]
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, H, BK):
            a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0)
            acc_g = tl.dot(a, tl.load(wg + k0), acc_g)
            acc_u = tl.dot(a, tl.load(wg + I * H + k0), acc_u)
        act = (acc_g / (1.0 + tl.exp(-acc_g)) * acc_u).to(x_ptr.dtype.element_ty)
        offs_h = tl.arange(0, BH)
        if W2T:  # w2^T [I, H]: rows offs_n of it, BH columns a step
            w2p = w2t_ptr + row * (I * H) + offs_n[:, None] * H + offs_h[None, :]
            step = 1
        else:  # the pools' w2 [H, I]: columns offs_n of BH rows a step (BN * 2 bytes of each row)
            w2p = w2t_ptr + row * (I * H) + offs_h[None, :] * I + offs_n[:, None]
            step = I
        pp = part_ptr + (j * num_pairs + pair).to(tl.int64)[:, None] * H + offs_h[None, :]
        for h0 in range(0, H, BH):
            part = tl.dot(act, tl.load(w2p + h0 * step))
            tl.store(pp + h0, part, mask=valid[:, None])
    if GDC == 2:  # let the reduce launch once every GEMM block got here (its wait still orders the data)
        gdc_launch_dependents()


@triton.jit
def _reduce_kernel(part_ptr, w_ptr, out_ptr, num_pairs, NB, H: tl.constexpr, TOPK: tl.constexpr,
                   BLOCK: tl.constexpr, NBP: tl.constexpr, GDC: tl.constexpr):
    """out[t, block] = sum over ranks r (in order) of w[t, r] * (tree sum over j of part[j, t * TOPK + r, block])."""
    if GDC:
        gdc_wait()
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    offs_j = tl.arange(0, NBP)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(TOPK):
        p = t * TOPK + r
        v = tl.load(part_ptr + (offs_j[:, None] * num_pairs + p).to(tl.int64) * H + offs[None, :],
                    mask=(offs_j < NB)[:, None], other=0.0)
        acc += tl.load(w_ptr + p).to(tl.float32) * tl.sum(v, axis=0)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty))


def fused(x, ids, w, w13, w2t, layer, E, BN, BK, BH, warps, stages, block, gdc, reduce=True, warps2=4, w2t_layout=True):
    T, H = x.shape
    K = ids.shape[1]
    I = w2t.shape[1] if w2t_layout else w2t.shape[2]
    num_pairs = T * K
    if T > 16 or I % BN or H % BH or H % BK:  # an expert has at most T pairs (distinct ids per token): one 16-row tile
        raise ValueError(f"probe: {T} tokens, I={I}, H={H} against BN={BN}, BK={BK}, BH={BH}")
    nb = I // BN
    part = torch.empty((nb, num_pairs, H), dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    _fused_kernel[(num_pairs, nb)](x, ids, w13, w2t, part, num_pairs, layer, E=E, EP=triton.next_power_of_2(E), TOPK=K,
                                   H=H, I=I, BM=16, BN=BN, BK=BK, BH=BH, NP=triton.next_power_of_2(num_pairs), GDC=gdc,
                                   W2T=w2t_layout, num_warps=warps, num_stages=stages)
    if not reduce:
        return out
    _reduce_kernel[(T, H // block)](part, w.reshape(-1), out, num_pairs, nb, H=H, TOPK=K, BLOCK=block,
                                    NBP=triton.next_power_of_2(nb), GDC=gdc > 0, num_warps=warps2, launch_pdl=gdc > 0)
    return out


# triton_experts' tuned H200 configs at 1 and 4 tokens (the eighth session's kernel table)
TUNED = {1: KernelConfig(16, 32, 128, 64, 128, 4, 3, 32, pdl=2),
         4: KernelConfig(16, 64, 128, 128, 128, 4, 2, 32, pdl=2)}
# One probe each: tiles (BN columns of I a block, BK of H a w13 step, BH of H a w2 step), warps and
# stages; w2 as w2^T [I, H] ("t") or as the pools store it, [H, I] ("hi": BN * 2 bytes of each of
# BH rows a step); the reduce as a second launch ("launch": block columns a program, its warps, gdc
# 0 plain / 2 a dependent launch released at the GEMM blocks' end) or left out ("none": the GEMM
# launch alone). (Folding the reduce into the GEMM launch, the block that completes a (token,
# column slice) adding it after an atomic count, was tried in the ninth session: 4-14x slower, and
# not bitwise stable at BN 32; removed.)
def _v(bn, bh, w2, reduce, block=16, warps2=1, gdc=2, bk=128, warps=4, stages=3):
    return dict(BN=bn, BK=bk, BH=bh, warps=warps, stages=stages, w2=w2, reduce=reduce, block=block, warps2=warps2,
                gdc=gdc)


VARIANTS = [_v(32, 256, "t", "none"), _v(32, 256, "t", "launch", 8), _v(32, 256, "t", "launch", 16),
            _v(64, 128, "t", "none"), _v(64, 128, "t", "launch"), _v(64, 128, "t", "launch", 8),
            _v(32, 256, "hi", "none"), _v(32, 256, "hi", "launch", 8),
            _v(64, 128, "hi", "none"), _v(64, 128, "hi", "launch"), _v(64, 128, "hi", "launch", 8),
            _v(64, 256, "hi", "none"), _v(64, 256, "hi", "launch")]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    reps = p.parse_args().reps
    E, H, I, K, L = 128, 2048, 768, 8, 8
    dt = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = L * E
    w13 = torch.randn(n, 2 * I, H, device="cuda", dtype=dt, generator=gen) / H**0.5
    w2 = torch.randn(n, H, I, device="cuda", dtype=dt, generator=gen) / I**0.5
    w2t = w2.transpose(1, 2).contiguous()
    pools = ExpertPools.all_hot(w13.view(L, E, 2 * I, H), w2.view(L, E, H, I))
    hbm = best_read_bandwidth(w13.view(-1), HBM_READ_SHAPES, reps)
    print(f"HBM read {hbm / 1e9:.0f} GB/s", flush=True)
    rows = []
    for T in (1, 4):
        xs = [torch.randn(T, H, device="cuda", dtype=dt, generator=gen) for _ in range(L)]
        rs = []
        for _ in range(L):
            ids, w = torch_softmax_topk(torch.randn(T, E, device="cuda", generator=gen), K, renormalize=True)
            rs.append((ids, w.to(dt)))
        cfg = TUNED[T]
        distinct = sum(int(torch.unique(r[0]).numel()) for r in rs) / L
        nbytes = distinct * 3 * I * H * 2
        read_us = nbytes / best_read_bandwidth(w13.view(-1)[: L * int(nbytes) // 2], ((4096, 1), (4096, 4), (4096, 16)),
                                               reps, launches=L) * 1e6
        bound_us = nbytes / hbm * 1e6
        ref = [torch_experts(pools, l, xs[l], *rs[l]).float() for l in range(L)]
        base_outs = []
        def run_base():
            base_outs[:] = [triton_experts(pools, l, xs[l], *rs[l], cfg) for l in range(L)]
        t_base = min(graph_time_us(run_base, reps) / L for _ in range(2))
        err_base = max(float((o.float() - r).norm() / r.norm()) for o, r in zip(base_outs, ref))
        rows.append((T, "tuned 3 launches", t_base, bound_us, read_us, err_base, None, None))
        same_tiles = {}
        for v in VARIANTS:
            w2_in = w2t if v["w2"] == "t" else w2
            red = v["reduce"] == "launch"
            name = (f"BN{v['BN']} BH{v['BH']} w2 {'[I, H]' if v['w2'] == 't' else '[H, I]'}, reduce "
                    + {"none": "left out (the GEMM launch alone)",
                       "launch": f"launch ({v['block']} columns, {v['warps2']} warps, pdl {v['gdc']})"}[v["reduce"]])

            def run(outs):
                outs[:] = [fused(xs[l], rs[l][0], rs[l][1], w13, w2_in, l, E, v["BN"], v["BK"], v["BH"], v["warps"],
                                 v["stages"], v["block"], v["gdc"], red, v["warps2"], v["w2"] == "t") for l in range(L)]
            outs, outs2 = [], []
            try:
                t = min(graph_time_us(lambda: run(outs), reps) / L for _ in range(2))
            except Exception as e:  # a config that does not compile / fit
                print("failed", name, repr(e)[:200], flush=True)
                continue
            if not red:
                rows.append((T, name, t, bound_us, read_us, float("nan"), None, None))
                continue
            err = max(float((o.float() - r).norm() / r.norm()) for o, r in zip(outs, ref))
            run(outs2)
            repeat = all(torch.equal(a, b) for a, b in zip(outs, outs2))  # run to run
            # against the first variant of the same GEMM tiles (another reduce shape may sum in another tree)
            first = same_tiles.setdefault((v["BN"], v["BH"]), outs)
            rows.append((T, name, t, bound_us, read_us, err, repeat, all(torch.equal(a, b) for a, b in zip(outs, first))))
        print(f"T={T}: distinct MB {nbytes / 1e6:.1f}, bound {bound_us:.1f} µs, plain read a launch {read_us:.1f} µs",
              flush=True)
    print("\n| tokens | kernel | µs | % of bound | % of a plain read | vs tuned | rel err vs torch | bitwise run to run "
          "| bitwise = the first of its tiles |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = {}
    for T, name, t, b, rd, err, repeat, same in rows:
        base.setdefault(T, t)
        print(f"| {T} | {name} | {t:.1f} | {100 * b / t:.0f}% | {100 * rd / t:.0f}% | {base[T] / t:.3f}x | {err:.1e} "
              f"| {repeat} | {same} |")


if __name__ == "__main__":
    main()
