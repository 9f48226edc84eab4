"""The fused MoE experts kernel for block-FP8 experts, reading each expert through the row map.

The bf16 kernel's structure (:mod:`coldset.kernels.triton_moe`: its grouping of (token, rank)
pairs by expert, its block numbering, its one row-map load per block, its top-k sum launch) with
FP8 operands on both sides of every GEMM, as vLLM's and DeepGEMM's block-FP8 MoE paths run:

- weights are the pools' float8_e4m3fn bytes; each expert's float32 ``weight_scale_inv`` blocks
  come from the scale pool of the same tier, at the same row (:mod:`coldset.kernels.tiers`), through
  the same row-map load (:func:`~coldset.kernels.triton_moe._expert_base` on the scale pools);
- activations are quantized per token and group of 128 columns
  (:func:`coldset.core.fp8.quantize_activations`: ``scale = max(max|a|, 1e-10) / 448``, IEEE
  divisions, round-to-nearest-even cast) by default once per call, not inside a GEMM's k loop,
  where the row max and the divisions would sit between each load and its dot;
- the GEMMs read FP8 activations and their scales directly: each k step is one 128-column group
  and one weight block (``block_k1 = block_k2 = 128``), one FP8 tensor-core dot (fp32 accumulate)
  times the activation scale of each row and the weight scale of each column's block:
  ``acc += dot(a_q, w_q) * a_s[:, None] * w_s[None, :]`` (vLLM's block-FP8 fused_moe
  accumulation); the w2 products go to a per-pair fp32 (with ``half_buf`` activation-dtype) buffer
  that the top-k sum adds in rank order.

Where each quantization runs is the config's choice
(:class:`~coldset.kernels.triton_moe.KernelConfig`), always with the formula above on the same
values, hence the same FP8 bytes and scales and the same result bits; fewer launches a layer
against more quantization work inside them is a speed trade the tuner measures:

- ``quant_x=0``: the tokens by their own launch (:func:`_quant_groups_kernel`, one block per
  token); ``1``: by the w13 launch, each block quantizing its ``[block_m, 128]`` tile of ``x`` per
  k step (:func:`_quantize_rows`), every column block of an expert again;
- ``quant_act=0``: the intermediate SiLU(gate) * up (rounded to the activation dtype first) by the
  w13 epilogue when ``block_n1`` is a multiple of 128 (a block then owns whole groups), else by a
  launch of its own over the activation-dtype scratch; ``1``: the epilogue (refused unless
  ``block_n1`` is a multiple of 128); ``2``: its own launch at any ``block_n1``.

``w8a16`` 1 or 2 is the weight-only mode: no activation is quantized; each FP8 weight tile is
converted to the tokens' dtype in registers (exact: e4m3 fits bf16 and fp16) and
``acc += dot(x, w) * w_s[None, :]`` per k block, three launches a layer as the bf16 kernel. Its
numbers are another function than the w8a8 path's (no e4m3 rounding of the activations): its
reference is ``torch_experts(..., w8a16=True)``. ``2`` converts by bits
(:func:`_bf16_of_e4m3_bits`) where triton converts each value through f16 with a conversion-pipe
instruction: the same bits for every finite weight, a speed choice.

``swap_ab=1`` computes each k step's product transposed (``dot(trans(w), trans(x))``): the
weights' rows are the MMA's M and the tokens its N, so a decode tile of a few tokens runs as FP8
warpgroup MMAs instead of f16 ``mma.sync`` on converted weights. It needs 64 rows a block in both
launches and FP8 tokens from their own launch; the sums within a k step are another instruction's,
so a config's bits depend on it (as on ``split_k``), never on the placement.

``pdl`` (Hopper's programmatic dependent launch; the arithmetic never changes, so every mode gives
``pdl=0``'s bits): ``2`` makes every launch after the tokens' quantization a dependent launch that
looks up its expert, rows and scale rows while the launch before runs, then waits before reading
its output; ``1`` adds a bulk L2 prefetch of the hot weight rows while the blocks wait (up to
:data:`PREFETCH_L2_BYTES` a launch); ``3`` makes the first launch (and the grouping's) a dependent
launch of whatever kernel came before, waiting before it reads anything, as the bf16 kernel's
``pdl=3``.

The torch path (:func:`coldset.kernels.reference._torch_scaled_experts_chunk`) computes the same
quantity (same quantization points; float32 GEMMs); the two agree to float32 summation order.
Tiling and accumulation order never depend on where an expert lives, so every placement is
bitwise the all-hot (``use_row_map=False``) output. Split-K and ``half_tail`` are refused (not
implemented here).

Expert biases and the activation variant (gpt-oss's clamped SwiGLU) are the bf16 kernel's
(:mod:`coldset.kernels.triton_moe`, its :func:`~coldset.kernels.triton_moe.epilogue_args`): w13's
bias added to the fp32 gate and up sums (after their scales) before the activation, which is then
rounded to the activation dtype and quantized as the SiLU intermediate is; w2's added to the fp32
product before the routing weight; both read by (layer, expert id), never through the row map.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from coldset.kernels.configs import load as load_kernel_configs
from coldset.kernels.triton_moe import (
    KernelConfig,
    _block_expert,
    _block_ids,
    _chunk_pairs,
    _expert_base,
    _expert_bias,
    _gated,
    _next_pow2,
    _sum_topk_kernel,
    cold_or_hot,
    epilogue_args,
    gdc_launch_dependents,
    gdc_wait,
    issue_all,
    pair_tiles,
    prepare_call,
)

if TYPE_CHECKING:
    from coldset.kernels.tiers import ExpertPools

GROUP = 128  # weight block and activation group (coldset.core.fp8.BLOCK)
# swap_ab: the rows of a Hopper warpgroup MMA (wgmma's M), which the weights' rows fill when the
# tokens are the dot's N (KernelConfig.swap_ab)
SWAP_MIN_ROWS = 64
# pdl 1: at most this many bytes of weights a launch bulk-prefetches into L2 (the H200's is
# 50 MB) while the quantization launch before it runs
PREFETCH_L2_BYTES = 16 << 20

# The defaults when no tuned entry exists (coldset.kernels.configs: triton_fp8.json): decode tiles
# of 16 rows with 64 columns of gate and up per w13 block (as vLLM's H200 fp8_w8a8 table at E=128,
# N=768) and the intermediate quantized by its own launch; prefill 64-row tiles with the same 64
# columns.
DEFAULT_DECODE_CONFIG = KernelConfig.from_dict(load_kernel_configs("triton_fp8")["defaults"]["decode"])
DEFAULT_PREFILL_CONFIG = KernelConfig.from_dict(load_kernel_configs("triton_fp8")["defaults"]["prefill"])


def default_config(num_tokens: int, top_k: int = 8) -> KernelConfig:
    """Decode tiles up to 64 tokens, prefill tiles above (both with k steps of one 128-column group)."""
    return DEFAULT_DECODE_CONFIG if num_tokens <= 64 else DEFAULT_PREFILL_CONFIG


@triton.jit
def _quantize_rows(a, BM: tl.constexpr, BK: tl.constexpr):
    """``(a_q float8e4nv [BM, BK], scale float32 [BM])`` of a float32 tile whose rows are one group
    each: ``scale = max(max|a|, 1e-10) / 448``, ``a_q = rtne(clamp(a / scale, -448, 448))``, the
    divisions IEEE round-to-nearest (``div_rn``), as :func:`coldset.core.fp8.quantize_activations`."""
    amax = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-10)
    scale = tl.math.div_rn(amax, tl.full([BM], 448.0, tl.float32))
    q = tl.math.div_rn(a, tl.broadcast_to(scale[:, None], (BM, BK)))
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    return q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), scale


@triton.jit
def _bf16_of_e4m3_bits(w):
    """bf16 of float8_e4m3fn ``w`` by bit operations (``w8a16=2``): the e4m3 -> f16 unpack (exact,
    always a normal f16 or zero), then per f16 half of a 32-bit register the exponent and mantissa
    moved into bf16's fields (``(h & 0x7fff) >> 3``, the sign kept) and one bf16x2 multiply by
    2^112 (the exponent biases' difference, 127 - 15): four ALU instructions per two values where
    triton 3.6 converts each f16 to bf16 by its own F2F. Bitwise Triton's conversion for every finite
    e4m3 value (zeros and signs included); e4m3fn's NaN (0x7f, 0xff) reads as +-122880 instead of
    NaN (a quantizer writes none: :func:`coldset.core.fp8.quantize_weight` clamps to +-448; the loader
    refuses a checkpoint tensor that holds one, by name: ``coldset.engine.loading._read_linear``)."""
    h = w.to(tl.float16)
    return tl.inline_asm_elementwise(
        "{ .reg .b32 u, s, k; and.b32 u, $1, 0x7fff7fff; shr.b32 u, u, 3; and.b32 s, $1, 0x80008000; "
        "or.b32 u, u, s; mov.b32 k, 0x77807780; mul.rn.bf16x2 $0, u, k; }",
        "=r,r", [h], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _w8a16_operand(w, a, W8A16: tl.constexpr):
    """The FP8 weight tile ``w`` in the dtype of the activation tile ``a`` (exact either way):
    triton's conversion (``W8A16`` 1), or for bf16 :func:`_bf16_of_e4m3_bits` (2)."""
    if W8A16 == 2 and a.dtype == tl.bfloat16:
        return _bf16_of_e4m3_bits(w)
    else:
        return w.to(a.dtype)


@triton.jit
def _quant_groups_kernel(src_ptr, q_ptr, s_ptr, stride_src, K: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                         WAIT: tl.constexpr, TRIGGER: tl.constexpr):
    """Row ``program_id(0)`` of ``src`` ``[R, K]`` (bf16/fp16) quantized per group of 128 columns:
    ``q`` ``[R, K]`` float8_e4m3fn and ``s`` ``[R, G]`` float32 (G = ceil(K / 128), GP its next
    power of two). ``WAIT``: a programmatic dependent launch: wait for the kernel before (which
    may write ``src``) before reading anything. ``TRIGGER``: then let the next launch (a dependent
    one, which waits on this one before reading ``q`` and ``s``) start at once."""
    if WAIT:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, GP)
    cols = offs_g[:, None] * 128 + tl.arange(0, 128)[None, :]
    ok = (offs_g[:, None] < G) & (cols < K)
    a = tl.load(src_ptr + row * stride_src + cols, mask=ok, other=0.0).to(tl.float32)
    q, s = _quantize_rows(a, GP, 128)
    tl.store(q_ptr + row * K + cols, q, mask=ok)
    tl.store(s_ptr + row * G + offs_g, s, mask=offs_g < G)


@triton.jit
def _prefetch_l2(addr, nbytes):
    """One bulk L2 prefetch (sm90's ``cp.async.bulk.prefetch.L2``) of ``nbytes`` (int32, a multiple
    of 16) from the 16-byte aligned address ``addr`` (int64), issued by thread 0 of the block
    alone: a hint that moves nothing into registers or shared memory and changes no result."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_rows(row_map_ptr, layer, expert, cnt, first_row_ptr, rows, ROW_BYTES: tl.constexpr, budget,
                   E: tl.constexpr, USE_ROW_MAP: tl.constexpr):
    """Bulk-prefetch into L2 up to ``budget`` bytes of the ``rows`` consecutive weight rows from
    ``first_row_ptr`` (never past them: the 16-byte aligned part), when this block has pairs and
    its expert is a hot row (a cold expert's bytes stay in host memory: zero-copy reads are the
    link's)."""
    hot = (cnt > 0) & (rows > 0)
    if USE_ROW_MAP:
        hot = hot & (tl.load(row_map_ptr + layer * E + expert) >= 0)
    if hot:
        lo = first_row_ptr.to(tl.int64)
        hi = lo + tl.minimum(rows.to(tl.int64) * ROW_BYTES, budget.to(tl.int64))
        lo16 = (lo + 15) // 16 * 16
        n = (hi - lo16) // 16 * 16
        if n > 0:
            _prefetch_l2(lo16, n.to(tl.int32))


@triton.jit
def _w13_fp8_chunk(xq_ptr, xs_ptr, ids_ptr, sorted_pairs_ptr, act_ptr, actq_ptr, acts_ptr, wg_ptrs, wu_ptrs,
                   sg_ptrs, su_ptrs, offs_n, n_ok, pid_n, num_pairs, expert, start, c, cnt, stride_x, bg, bu,
                   TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr, GH: tl.constexpr, GI: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NP: tl.constexpr, MODE: tl.constexpr,
                   EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, FUSE_Q: tl.constexpr, QUANT_X: tl.constexpr,
                   W8A16: tl.constexpr, SWAP: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                   ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """One chunk [c, c + BM) of the expert's pairs (FP8 tokens) times its gate and up rows, then
    the activation (SiLU(gate) * up; with biases ``bg``, ``bu`` added first:
    :func:`~coldset.kernels.triton_moe._gated`) rounded to the activation dtype; with ``FUSE_Q``
    quantized per group here.
    ``QUANT_X``: ``xq_ptr`` is the tokens ``x`` themselves (bf16/fp16, rows ``stride_x`` apart),
    each k step's ``[BM, 128]`` tile quantized here by :func:`_quantize_rows` (the quantization
    launch's formula on the same values: the same FP8 bytes and scales; ``xs_ptr`` unused).
    ``W8A16``: ``xq_ptr`` is ``x`` too, never quantized: each weight tile is converted to x's dtype
    (exact for e4m3) and the k step's product scaled by the weight block's scale alone.
    ``SWAP`` (``swap_ab``): the transposed products, weights as the dot's left operand (its M: the
    block's rows) and the tokens as its right (its N), accumulated ``[BN, BM]`` and transposed
    back before the epilogue."""
    offs_k = tl.arange(0, BK)
    pair, valid = _chunk_pairs(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, c, cnt, BM, NP, MODE)
    tok = (pair // TOPK).to(tl.int64)
    if QUANT_X or W8A16:
        a_ptrs = xq_ptr + tok[:, None] * stride_x + offs_k[None, :]
    else:
        a_ptrs = xq_ptr + tok[:, None] * H + offs_k[None, :]
    as_ptrs = xs_ptr + tok * GH
    if SWAP:
        acc_g = tl.zeros((BN, BM), dtype=tl.float32)
        acc_u = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, GH):
        k0 = kb * BK
        if EVEN_K:
            a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0)
            if EVEN_N:
                wg = tl.load(wg_ptrs + k0)
                wu = tl.load(wu_ptrs + k0)
            else:
                wg = tl.load(wg_ptrs + k0, mask=n_ok[None, :], other=0.0)
                wu = tl.load(wu_ptrs + k0, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + offs_k) < H
            a = tl.load(a_ptrs + k0, mask=valid[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(wg_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            wu = tl.load(wu_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        sg = tl.load(sg_ptrs + kb, mask=n_ok, other=0.0)
        su = tl.load(su_ptrs + kb, mask=n_ok, other=0.0)
        if W8A16:  # e4m3 -> bf16/fp16 is exact; the dot accumulates in fp32, then the block's weight scale
            acc_g += tl.dot(a, _w8a16_operand(wg, a, W8A16)) * sg[None, :]
            acc_u += tl.dot(a, _w8a16_operand(wu, a, W8A16)) * su[None, :]
        else:
            if QUANT_X:  # the group's columns past H (a partial group) and invalid rows loaded as 0, as the launch's
                a, a_s = _quantize_rows(a.to(tl.float32), BM, BK)
            else:
                a_s = tl.load(as_ptrs + kb, mask=valid, other=0.0)
            if SWAP:  # the same products and scales, transposed: wgmma's M is the weights' rows
                acc_g += tl.dot(tl.trans(wg), tl.trans(a)) * (sg[:, None] * a_s[None, :])
                acc_u += tl.dot(tl.trans(wu), tl.trans(a)) * (su[:, None] * a_s[None, :])
            else:
                acc_g += tl.dot(a, wg) * (a_s[:, None] * sg[None, :])
                acc_u += tl.dot(a, wu) * (a_s[:, None] * su[None, :])
    if SWAP:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    act = _gated(acc_g, acc_u, bg, bu, HAS_BIAS, ACT, ALPHA, LIMIT).to(act_ptr.dtype.element_ty)  # its rounding
    pair64 = pair.to(tl.int64)
    if FUSE_Q:  # this block holds whole groups (BN = NG * 128): quantize them here
        NG: tl.constexpr = BN // BK
        q, s = _quantize_rows(tl.reshape(act.to(tl.float32), (BM * NG, BK)), BM * NG, BK)
        tl.store(actq_ptr + pair64[:, None] * I + offs_n[None, :], tl.reshape(q, (BM, BN)),
                 mask=valid[:, None] & n_ok[None, :])
        offs_g = pid_n * NG + tl.arange(0, NG)
        tl.store(acts_ptr + pair64[:, None] * GI + offs_g[None, :], tl.reshape(s, (BM, NG)),
                 mask=valid[:, None] & (offs_g < GI)[None, :])
    else:
        tl.store(act_ptr + pair64[:, None] * I + offs_n[None, :], act, mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _w13_fp8_kernel(
    xq_ptr, xs_ptr, ids_ptr, sorted_pairs_ptr, expert_off_ptr, row_map_ptr, w_hot_ptr, w_cold_ptr, s_hot_ptr,
    s_cold_ptr, act_ptr, actq_ptr, acts_ptr, b13_ptr, num_pairs, layer, NB, pf_bytes,
    E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    GI: tl.constexpr, GH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NP: tl.constexpr,
    MODE: tl.constexpr, USE_ROW_MAP: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    USE_GDC: tl.constexpr, PREFETCH: tl.constexpr, ORDER: tl.constexpr, FUSE_Q: tl.constexpr,
    QUANT_X: tl.constexpr, WAIT_FIRST: tl.constexpr, stride_x, W8A16: tl.constexpr, SWAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):
    slot, pid_n, _ = _block_ids(NB, ORDER)
    if WAIT_FIRST:
        # QUANT_X with pdl 3: this launch is the call's first, a dependent launch of whatever kernel
        # came before (it may write x, the ids, the row map): wait for it before reading anything
        gdc_wait()
    if USE_GDC:
        # A dependent launch of the tokens' quantization launch, which began only once every kernel
        # before it had finished (a plain launch; with pdl=3 a dependent one that waited first):
        # the ids, the grouping and the row map are complete, the FP8 tokens are not. Let the
        # next launch start (it waits on this one before reading what this one writes).
        gdc_launch_dependents()
    expert, cnt, start, c_begin, c_end = _block_expert(ids_ptr, expert_off_ptr, num_pairs, slot, E, EP, NP, BM, MODE)
    # the one place the expert id is used: one row-map lookup for the weights, the same for the scales
    w_base = _expert_base(row_map_ptr, w_hot_ptr, w_cold_ptr, layer, expert, 2 * I * H, E, USE_ROW_MAP)
    s_base = _expert_base(row_map_ptr, s_hot_ptr, s_cold_ptr, layer, expert, 2 * GI * GH, E, USE_ROW_MAP)
    if PREFETCH:  # while the quantization launch runs, HBM would idle: stream this block's gate and up rows into L2
        rows = tl.minimum(I - pid_n * BN, BN)
        _prefetch_rows(row_map_ptr, layer, expert, cnt, w_base + pid_n * BN * H, rows, H, pf_bytes, E, USE_ROW_MAP)
        _prefetch_rows(row_map_ptr, layer, expert, cnt, w_base + (I + pid_n * BN) * H, rows, H, pf_bytes, E,
                       USE_ROW_MAP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    n_ok = offs_n < I
    wg_ptrs = w_base + offs_n[None, :] * H + offs_k[:, None]  # [BK, BN]: gate rows n, cols k
    wu_ptrs = wg_ptrs + I * H  # up rows I + n
    sg_ptrs = s_base + (offs_n // BK) * GH  # gate's scale grid rows, then up's (coldset.core.fp8)
    su_ptrs = s_base + (GI + offs_n // BK) * GH
    bg = _expert_bias(b13_ptr, layer, expert, offs_n, n_ok, 2 * I, E, HAS_BIAS)  # gate's half of the bias
    bu = _expert_bias(b13_ptr, layer, expert, I + offs_n, n_ok, 2 * I, E, HAS_BIAS)  # up's half
    if USE_GDC:
        gdc_wait()  # the FP8 tokens and their scales
    c = c_begin
    while c < c_end:  # chunks of this expert's pairs (a while loop: dynamic bound)
        _w13_fp8_chunk(xq_ptr, xs_ptr, ids_ptr, sorted_pairs_ptr, act_ptr, actq_ptr, acts_ptr, wg_ptrs, wu_ptrs,
                       sg_ptrs, su_ptrs, offs_n, n_ok, pid_n, num_pairs, expert, start, c, cnt, stride_x, bg, bu,
                       TOPK, H, I, GH, GI, BM, BN, BK, NP, MODE, EVEN_K, EVEN_N, FUSE_Q, QUANT_X, W8A16, SWAP,
                       HAS_BIAS, ACT, ALPHA, LIMIT)
        c += BM


@triton.jit
def _w2_fp8_chunk(actq_ptr, acts_ptr, ids_ptr, sorted_pairs_ptr, topk_w_ptr, buf_ptr, w_ptrs, s_ptrs, offs_n, n_ok,
                  num_pairs, expert, start, c, cnt, b2,
                  H: tl.constexpr, I: tl.constexpr, GI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, NP: tl.constexpr, MODE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                  W8A16: tl.constexpr, SWAP: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One chunk [c, c + BM) of the expert's pairs: FP8 intermediate times w2's rows, plus w2's
    bias ``b2`` (``HAS_BIAS``), times the routing weight.
    ``W8A16``: ``actq_ptr`` is the intermediate in the activation dtype (never quantized), each
    weight tile converted to it (exact) and the k step's product scaled by the weight block's scale.
    ``SWAP``: the transposed products (weights the dot's M), as :func:`_w13_fp8_chunk`."""
    offs_k = tl.arange(0, BK)
    pair, valid = _chunk_pairs(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, c, cnt, BM, NP, MODE)
    pair64 = pair.to(tl.int64)
    a_ptrs = actq_ptr + pair64[:, None] * I + offs_k[None, :]
    as_ptrs = acts_ptr + pair64 * GI
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, GI):
        k0 = kb * BK
        if EVEN_K:
            a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs + k0)
            else:
                w = tl.load(w_ptrs + k0, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + offs_k) < I
            a = tl.load(a_ptrs + k0, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        ws = tl.load(s_ptrs + kb, mask=n_ok, other=0.0)
        if W8A16:
            acc += tl.dot(a, _w8a16_operand(w, a, W8A16)) * ws[None, :]
        else:
            a_s = tl.load(as_ptrs + kb, mask=valid, other=0.0)
            if SWAP:
                acc += tl.dot(tl.trans(w), tl.trans(a)) * (ws[:, None] * a_s[None, :])
            else:
                acc += tl.dot(a, w) * (a_s[:, None] * ws[None, :])
    if SWAP:
        acc = tl.trans(acc)
    if HAS_BIAS:
        acc += b2[None, :]
    wt = tl.load(topk_w_ptr + pair64, mask=valid, other=0.0).to(tl.float32)
    acc = acc * wt[:, None]
    tl.store(buf_ptr + pair64[:, None] * H + offs_n[None, :], acc.to(buf_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _w2_fp8_kernel(
    actq_ptr, acts_ptr, ids_ptr, sorted_pairs_ptr, expert_off_ptr, row_map_ptr, w_hot_ptr, w_cold_ptr, s_hot_ptr,
    s_cold_ptr, topk_w_ptr, buf_ptr, b2_ptr, num_pairs, layer, NB, pf_bytes,
    E: tl.constexpr, EP: tl.constexpr, H: tl.constexpr, I: tl.constexpr, GI: tl.constexpr, GH: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NP: tl.constexpr, MODE: tl.constexpr,
    USE_ROW_MAP: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_GDC: tl.constexpr,
    PREFETCH: tl.constexpr, ORDER: tl.constexpr, W8A16: tl.constexpr, SWAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):
    slot, pid_n, _ = _block_ids(NB, ORDER)
    expert, cnt, start, c_begin, c_end = _block_expert(ids_ptr, expert_off_ptr, num_pairs, slot, E, EP, NP, BM, MODE)
    w_base = _expert_base(row_map_ptr, w_hot_ptr, w_cold_ptr, layer, expert, H * I, E, USE_ROW_MAP)
    s_base = _expert_base(row_map_ptr, s_hot_ptr, s_cold_ptr, layer, expert, GH * GI, E, USE_ROW_MAP)
    if PREFETCH:  # launched early behind the intermediate's quantization launch: w2's rows of this block into L2
        rows = tl.minimum(H - pid_n * BN, BN)
        _prefetch_rows(row_map_ptr, layer, expert, cnt, w_base + pid_n * BN * I, rows, I, pf_bytes, E, USE_ROW_MAP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    n_ok = offs_n < H
    w_ptrs = w_base + offs_n[None, :] * I + offs_k[:, None]  # [BK, BN]: w2 rows n (of H), cols k (of I)
    s_ptrs = s_base + (offs_n // BK) * GI
    b2 = _expert_bias(b2_ptr, layer, expert, offs_n, n_ok, H, E, HAS_BIAS)
    if USE_GDC:  # launched early: only the launch and the lookups above overlap the launch before
        gdc_launch_dependents()
        gdc_wait()
    c = c_begin
    while c < c_end:
        _w2_fp8_chunk(actq_ptr, acts_ptr, ids_ptr, sorted_pairs_ptr, topk_w_ptr, buf_ptr, w_ptrs, s_ptrs, offs_n,
                      n_ok, num_pairs, expert, start, c, cnt, b2, H, I, GI, BM, BN, BK, NP, MODE, EVEN_K, EVEN_N,
                      W8A16, SWAP, HAS_BIAS)
        c += BM


def quantize_groups(src: torch.Tensor, wait: bool = False, trigger: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn [R, K], scales float32 [R, ceil(K / 128)])`` of a CUDA ``[R, K]`` bf16/fp16
    tensor, per row and group of 128 columns: :func:`coldset.core.fp8.quantize_activations` bit for bit,
    one launch (one block per row). ``wait``: a programmatic dependent launch that waits for the
    kernel before; ``trigger``: the next launch may start at once (see the kernel)."""
    rows, k = src.shape
    g = triton.cdiv(k, GROUP)
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=src.device)
    s = torch.empty((rows, g), dtype=torch.float32, device=src.device)
    if rows:
        _quant_groups_kernel[(rows,)](src, q, s, src.stride(0), K=k, G=g, GP=_next_pow2(g), WAIT=wait,
                                      TRIGGER=trigger, num_warps=4, launch_pdl=wait)
    return q, s


def _prefetch_bytes(slice_bytes: int, programs: int) -> int:
    """Bytes each of ``programs`` blocks bulk-prefetches of its ``slice_bytes`` slice (per weight
    matrix it reads): all of it while the launch's slices together fit ``PREFETCH_L2_BYTES``, else
    an equal share of that, so that the prefetched lines are not evicted by one another before the
    blocks' own loads read them."""
    return min(slice_bytes, PREFETCH_L2_BYTES // max(1, programs))


def _check_config(c: KernelConfig) -> None:
    if c.block_k1 != GROUP or c.block_k2 != GROUP:
        raise ValueError(f"triton_fp8_experts: block_k1 and block_k2 must be {GROUP} (one weight block and one "
                         f"activation group per k step), got {c.block_k1}, {c.block_k2}")
    if c.split_k1 != 1 or c.split_k2 != 1:
        raise ValueError("triton_fp8_experts: split-K (split_k1/split_k2 > 1) is not implemented for FP8")
    if c.pdl not in (0, 1, 2, 3):
        raise ValueError(f"triton_fp8_experts: config pdl must be 0, 1, 2 or 3, got {c.pdl}")
    if c.half_tail != 0:
        raise ValueError("triton_fp8_experts: half_tail is not implemented for FP8")
    if c.tile_order not in (0, 1) or c.half_buf not in (0, 1):
        raise ValueError(f"triton_fp8_experts: tile_order and half_buf must be 0 or 1, got {c.tile_order}, {c.half_buf}")
    if c.block_m < 16:
        raise ValueError(f"triton_fp8_experts: block_m must be >= 16 (a dot needs 16 rows), got {c.block_m}")
    if c.block_n1 > GROUP and c.block_n1 % GROUP:
        raise ValueError(f"triton_fp8_experts: block_n1 above {GROUP} must be a multiple of {GROUP} (whole activation "
                         f"groups per block), got {c.block_n1}")
    if c.quant_x not in (0, 1):
        raise ValueError(f"triton_fp8_experts: config quant_x must be 0 (the tokens' own quantization launch) or 1 "
                         f"(quantized by the w13 launch), got {c.quant_x}")
    if c.quant_act not in (0, 1, 2):
        raise ValueError(f"triton_fp8_experts: config quant_act must be 0 (by block_n1), 1 (the w13 epilogue) or 2 "
                         f"(the intermediate's own launch), got {c.quant_act}")
    if c.w8a16 not in (0, 1, 2):
        raise ValueError(f"triton_fp8_experts: config w8a16 must be 0 (FP8 activations), 1 or 2 (weight-only: the "
                         f"activations stay in their dtype; 2 converts the weights to bf16 by bits), got {c.w8a16}")
    if c.w8a16 and (c.quant_x or c.quant_act):
        raise ValueError(f"triton_fp8_experts: config w8a16=1 quantizes no activation: quant_x and quant_act must be "
                         f"0, got quant_x={c.quant_x}, quant_act={c.quant_act}")
    if c.swap_ab not in (0, 1):
        raise ValueError(f"triton_fp8_experts: config swap_ab must be 0 or 1, got {c.swap_ab}")
    if c.swap_ab and (c.w8a16 or c.quant_x):
        raise ValueError(f"triton_fp8_experts: config swap_ab=1 takes FP8 tokens from their own launch: w8a16 and "
                         f"quant_x must be 0, got w8a16={c.w8a16}, quant_x={c.quant_x}")
    if c.swap_ab and (c.block_n1 < SWAP_MIN_ROWS or c.block_n2 < SWAP_MIN_ROWS or c.num_warps % 4
                      or c.block_m % 8 or c.block_m > 256):
        raise ValueError(f"triton_fp8_experts: config swap_ab=1 makes the weights' rows the dot's M (a warpgroup's "
                         f"{SWAP_MIN_ROWS} rows) and the tokens its N: block_n1 and block_n2 >= {SWAP_MIN_ROWS}, "
                         f"num_warps a multiple of 4, block_m a multiple of 8 up to 256; got block_n1={c.block_n1}, "
                         f"block_n2={c.block_n2}, num_warps={c.num_warps}, block_m={c.block_m}")
    if c.quant_act == 1 and c.block_n1 % GROUP:
        raise ValueError(f"triton_fp8_experts: config quant_act=1 (the intermediate quantized by the w13 epilogue) "
                         f"needs block_n1 a multiple of {GROUP} (a block owning whole groups of the intermediate), "
                         f"got block_n1={c.block_n1}")


def _fuses_act_quant(c: KernelConfig) -> bool:
    """Whether the w13 launch's epilogue quantizes the intermediate (its blocks hold whole groups)
    rather than a launch of its own (w8a16: nothing quantizes it)."""
    return not c.w8a16 and (c.quant_act == 1 or (c.quant_act == 0 and c.block_n1 % GROUP == 0))


def fp8_launches(config: KernelConfig) -> tuple[str, ...]:
    """The launches a :func:`triton_fp8_experts` call with ``config`` makes after the grouping, in
    order, by name: ``quant_x`` (the tokens' quantization; none with ``quant_x=1`` or ``w8a16``),
    ``w13``, ``quant_act`` (the intermediate's; none when the w13 epilogue quantizes it or with
    ``w8a16``), ``w2``, ``sum``: the names :func:`fp8_experts_launches` yields, the stages
    ``bench kernel --weight-format fp8`` times cumulatively."""
    return tuple(name for name, launched in (("quant_x", not (config.quant_x or config.w8a16)), ("w13", True),
                                             ("quant_act", not _fuses_act_quant(config) and not config.w8a16),
                                             ("w2", True), ("sum", True)) if launched)


def triton_fp8_experts(
    pools: ExpertPools,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: KernelConfig | dict | None = None,
    use_row_map: bool = True,
) -> torch.Tensor:
    """Routed-expert output ``[T, H]`` of block-FP8 ``pools`` for tokens ``x`` ``[T, H]`` (bf16 or
    fp16) of MoE layer ``layer`` (CUDA, FP8 dots: sm89+). The contract of
    :func:`coldset.kernels.triton_experts` (which calls this for FP8 pools), including
    ``use_row_map=False``: the unmodified all-hot path."""
    return issue_all(fp8_experts_launches(pools, layer, x, topk_ids, topk_weights, config, use_row_map))


def fp8_experts_launches(
    pools: ExpertPools,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: KernelConfig | dict | None = None,
    use_row_map: bool = True,
) -> Generator[str, None, torch.Tensor]:
    """The launches of one :func:`triton_fp8_experts` call (its checks first), issued one at a
    time: a generator that yields each launch's name (:func:`fp8_launches` of the config) after
    issuing it and returns the output, as
    :func:`coldset.kernels.triton_moe.experts_launches` for the bf16 kernel."""
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"triton_fp8_experts: x [T, H], topk_ids [T, k], topk_weights [T, k] expected, got "
                         f"{tuple(x.shape)}, {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    if not pools.is_fp8:
        raise ValueError("triton_fp8_experts: the pools hold no FP8 experts (use triton_experts)")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"triton_fp8_experts: x dtype {x.dtype} must be bfloat16 or float16")
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts = pools.num_experts
    inter = pools.w2_hot.shape[2]
    if pools.w13_hot.shape[1:] != (2 * inter, hidden) or pools.w2_hot.shape[1:] != (hidden, inter):
        raise ValueError(f"triton_fp8_experts: pools hold w13 {tuple(pools.w13_hot.shape[1:])} and w2 "
                         f"{tuple(pools.w2_hot.shape[1:])}, x has H = {hidden}")
    config, x, ids, weights = prepare_call("triton_fp8_experts", pools, x, topk_ids, topk_weights, config, use_row_map,
                                           default_config)
    c = config
    _check_config(c)
    b13, b2, epilogue = epilogue_args(pools)
    pdl, prefetch, first = c.pdl > 0, c.pdl == 1, c.pdl == 3
    if pdl and gdc_wait is None:
        raise RuntimeError(f"triton_fp8_experts: config pdl={c.pdl} needs triton.language.extra.cuda.gdc_wait "
                           "(triton >= 3.3)")
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    num_pairs = num_tokens * top_k
    device = x.device
    mode, slots, np_, sorted_pairs, expert_off = pair_tiles(ids, num_pairs, num_experts, c, first)
    w13_cold, w2_cold, s13_cold, s2_cold = cold_or_hot(pools, "w13", "w2", "w13_scale", "w2_scale")
    gi, gh = triton.cdiv(inter, GROUP), triton.cdiv(hidden, GROUP)
    ep = _next_pow2(num_experts)
    w8a16 = c.w8a16  # 0, or the weight-only mode's conversion (1, 2)
    # the intermediate quantized by the w13 launch's epilogue (its blocks hold whole groups) or by its own launch
    fuse_q = _fuses_act_quant(c)
    # the intermediate: FP8 with its group scales (w2's operand); the activation-dtype scratch only
    # when a separate launch quantizes it, or w2 reads it as it is (w8a16)
    act = torch.empty((1 if fuse_q else num_pairs, inter), dtype=x.dtype, device=device)
    if w8a16:
        actq, acts = act, act  # w2's operand is act itself; acts unused
    else:
        actq = torch.empty((num_pairs, inter), dtype=torch.float8_e4m3fn, device=device)
        acts = torch.empty((num_pairs, gi), dtype=torch.float32, device=device)
    buf = torch.empty((num_pairs, hidden), dtype=x.dtype if c.half_buf else torch.float32, device=device)
    nb1, nb2 = triton.cdiv(inter, c.block_n1), triton.cdiv(hidden, c.block_n2)

    def grid(nb):
        return (slots, nb, 1) if c.tile_order == 0 else (slots * nb, 1, 1)

    x_raw = bool(c.quant_x or w8a16)
    if x_raw:
        # the w13 launch reads the tokens themselves (quant_x: quantizing them; w8a16: as they are):
        # it is the call's first launch (after the grouping's), so nothing before it to prefetch
        # behind; with pdl 3 a dependent launch that waits first, with 1 and 2 a plain launch whose
        # blocks let the launch after them start (pdl 1 is 2 here)
        xq, xs = x, x  # xs unused
        w13_pdl, w13_prefetch = first, False
    else:
        # the tokens, once per call; with pdl the w13 launch starts behind it (lookups, prefetch) and waits for it
        xq, xs = quantize_groups(x, wait=first, trigger=pdl)
        w13_pdl, w13_prefetch = pdl, prefetch
        yield "quant_x"
    _w13_fp8_kernel[grid(nb1)](
        xq, xs, ids, sorted_pairs, expert_off, pools.row_map, pools.w13_hot, w13_cold, pools.w13_scale_hot, s13_cold,
        act, actq, acts, b13, num_pairs, layer, nb1,
        _prefetch_bytes(c.block_n1 * hidden, 2 * slots * nb1) if w13_prefetch else 0,
        E=num_experts, EP=ep, TOPK=top_k, H=hidden, I=inter, GI=gi, GH=gh,
        BM=c.block_m, BN=c.block_n1, BK=GROUP, NP=np_, MODE=mode, USE_ROW_MAP=use_row_map,
        EVEN_K=hidden % GROUP == 0, EVEN_N=inter % c.block_n1 == 0, USE_GDC=pdl, PREFETCH=w13_prefetch,
        ORDER=c.tile_order, FUSE_Q=fuse_q, QUANT_X=bool(c.quant_x), WAIT_FIRST=x_raw and first,
        stride_x=x.stride(0), W8A16=w8a16, SWAP=bool(c.swap_ab), **epilogue, num_warps=c.num_warps,
        num_stages=c.num_stages, launch_pdl=w13_pdl,
    )
    yield "w13"
    if not fuse_q and not w8a16:  # every pair's row (pairs of invalid ids too: never read by w2)
        _quant_groups_kernel[(num_pairs,)](act, actq, acts, act.stride(0), K=inter, G=gi, GP=_next_pow2(gi),
                                           WAIT=pdl, TRIGGER=pdl, num_warps=4, launch_pdl=pdl)
        yield "quant_act"
    # behind the intermediate's quantization launch, not beside w13's reads (w8a16: no launch between them)
    prefetch2 = prefetch and not fuse_q and not w8a16
    _w2_fp8_kernel[grid(nb2)](
        actq, acts, ids, sorted_pairs, expert_off, pools.row_map, pools.w2_hot, w2_cold, pools.w2_scale_hot, s2_cold,
        weights, buf, b2, num_pairs, layer, nb2, _prefetch_bytes(c.block_n2 * inter, slots * nb2) if prefetch2 else 0,
        E=num_experts, EP=ep, H=hidden, I=inter, GI=gi, GH=gh,
        BM=c.block_m, BN=c.block_n2, BK=GROUP, NP=np_, MODE=mode, USE_ROW_MAP=use_row_map,
        EVEN_K=inter % GROUP == 0, EVEN_N=hidden % c.block_n2 == 0, USE_GDC=pdl, PREFETCH=prefetch2,
        ORDER=c.tile_order, W8A16=w8a16, SWAP=bool(c.swap_ab), **epilogue, num_warps=c.num_warps,
        num_stages=c.num_stages, launch_pdl=pdl,
    )
    yield "w2"
    block = min(1024, _next_pow2(hidden))
    _sum_topk_kernel[(num_tokens, triton.cdiv(hidden, block))](
        buf, out, num_pairs, H=hidden, TOPK=top_k, BLOCK=block, USE_GDC=pdl, SPLIT=1, num_warps=4, launch_pdl=pdl)
    yield "sum"
    return out
