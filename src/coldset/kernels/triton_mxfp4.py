"""The fused MoE experts kernel for MXFP4 experts (gpt-oss as published), reading each expert through the row map.

The bf16 kernel's structure (:mod:`coldset.kernels.triton_moe`: its grouping of (token, rank)
pairs by expert, its block numbering, its one row-map load per block for the weights and one for
the scales, its top-k sum launch), three launches a layer, with the weights read as the pools hold
them (:mod:`coldset.kernels.tiers`): packed e2m1 bytes, uint8 ``[rows, N, K / 2]``, and their e8m0
scales, uint8 ``[rows, N, K / 32]``, from the same tier at the same row. Hopper has no FP4 tensor
cores, so each k step unpacks its codes in registers (element ``2j`` of a row is byte ``j``'s low
nibble). Weight-only, as vLLM's Hopper path for gpt-oss: the tokens stay bf16, no activation is
quantized, every sum is float32 (but ``w8a16`` 4's, below). Two paths, the config's choice:

- the dot path (``block_m`` >= 16): bf16 tiles ``e2m1 * 2^(s - 127)`` dotted with the tokens'
  tile. ``w8a16`` 0 unpacks value by value (:func:`_upcast`: each code's float32 by bits, times the
  scale, rounded to bf16); 2 by 32-bit words (:func:`_e2m1_words`: four loads' worth of codes per
  thread as int32 words, two codes a word operation as fp16 lanes holding ``e2m1 * 2^-14`` exactly,
  widened, times 2^14, times the scale). Both give every weight a scale byte of 2..254 gives as
  bf16 exactly (:func:`coldset.core.mxfp4.dequantize`'s values), so the same output bits: a speed
  choice, as the FP8 kernel's ``w8a16`` 2.
- ``w8a16`` 3: fp16 dots, one per scale group (:func:`_f16_rows`, ``block_k / 32`` of them a k
  step): the words' fp16 lanes ``e2m1 * 2^-14`` go to the dot as they are; each token row (or intermediate row) is
  scaled by a power of two into fp16's range first (:func:`_pow2_factors`: exact for every value
  down to 2^-28 of the row's largest), each group's sum times its scale, the powers of two undone
  at the end. Other float32 sums, and scale bytes below 40 (weights below 2^-87) lose bits to
  float32 subnormals.
- the GEMV path (``block_m`` 1 or 2, ``w8a16`` 2): no dot, which would pad a
  decode tile to 16 rows; each block takes ``block_m`` pairs and the codes unpacked by words to
  float32 ``e2m1 * 2^-14`` and sums each pair's products per group of 32 in registers, then times
  ``2^14 * 2^(s - 127)`` once per group (:func:`_gemv_step`): the scale is applied per group sum,
  not per weight. Other float32 sums than the dot path's: a config's bits depend on the path, never
  on the placement. ``num_stages`` 1 loads a k step's codes and scales at that step; 2 loads them
  one step ahead, into registers, so the next step's bytes are in flight while this step's sums
  run (the same sums in the same order: the same bits). At one token the tile waits on its loads
  with few warps resident, and the prefetch is worth its registers there (BENCHMARKS.md section 9).
- ``w8a16`` 4 (``block_m`` 1 or 2, CUDA only): the GEMV path in Gluon with fp16-pair products
  (:mod:`coldset.kernels.gluon_mxfp4`, whose doc gives its arithmetic): the tokens and the
  intermediate go through one more launch each, as per-group scaled fp16 pairs, and each word's 4
  pair products are summed in fp16 (about 2^-11 of their sum each), the rest in float32. Fewer
  instructions a weight than the Triton tile's float32 products (docs/measurements/mxfp4/f16x2);
  :func:`default_config`'s tile on CUDA from 3 to 64 tokens.
- ``w8a16`` 5 (``block_m`` 8 or 16, ``block_k1`` = ``block_k2`` = 128, CUDA only): the tensor-core
  tile in Gluon (:mod:`coldset.kernels.gluon_mxfp4_mma`, whose doc gives its arithmetic): a chunk of
  up to ``block_m`` of an expert's pairs shares one unpacking of the codes, which go to the MMA from
  registers; the tokens and the intermediate are read as they are. Exact products (scale bytes 65
  to 191: :data:`coldset.kernels.gluon_mxfp4_mma.SCALE_RANGE`), float32 sums. ``num_stages`` 1
  to 6: from 3 the codes and tokens go through rings in shared memory (the module's doc), the same
  bits. :func:`default_config`'s tile on CUDA above :data:`MMA_FROM` tokens, to 64.

Scale bytes 0 and 1 give weights below 2^-126, which the GPU may flush to zero (the torch path
keeps them); 255 (NaN in the OCP MX spec) is refused when pools are built.

The w13 epilogue adds the expert's biases and applies the pools' activation in float32
(:func:`coldset.kernels.triton_moe._gated`: SiLU, or gpt-oss's clamped SwiGLU), rounding the
intermediate once to bf16; the w2 epilogue adds w2's bias and multiplies by the routing weight.
Biases are read by (layer, expert id), never through the row map (they stay resident).

The torch path (:func:`coldset.kernels.reference.torch_experts` on MXFP4 pools: exact
dequantization, float32 GEMMs, the same rounding points) computes the same quantity; the two agree
to float32 summation order. Tiling and accumulation order never depend on where an expert lives,
so every placement is bitwise the all-hot (``use_row_map=False``) output.

Config fields used: ``block_m``, ``block_n1``, ``block_k1``, ``block_n2``, ``block_k2`` (a multiple of
32: whole scale groups per k step), ``num_warps``, ``num_stages`` (the dot paths' pipelining depth; the
GEMV path's prefetch, above), ``slot_max_pairs``, ``pdl`` (0, or 2: the w2 and sum launches start
early and wait), ``tile_order``, ``half_buf``, ``w8a16`` (0, 2, 3, 4 or 5, above). Split-K, ``half_tail``,
``swap_ab`` and the FP8 kernel's quantization options are refused by name.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Generator
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from coldset.core import mxfp4
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
    gdc_launch_dependents,
    gdc_wait,
    issue_all,
    pair_tiles,
    prepare_call,
)

try:  # Gluon, Triton's layout-explicit dialect (triton >= 3.5): the GEMV tile of w8a16 4
    import coldset.kernels.gluon_mxfp4 as gluon_mxfp4
except ImportError:  # pragma: no cover - older triton: configs with w8a16 4 are refused by name
    gluon_mxfp4 = None
try:  # the tensor-core tile of w8a16 5 (Gluon's mma_v2)
    import coldset.kernels.gluon_mxfp4_mma as gluon_mxfp4_mma
except ImportError:  # pragma: no cover - older triton: configs with w8a16 5 are refused by name
    gluon_mxfp4_mma = None

if TYPE_CHECKING:
    from coldset.kernels.tiers import ExpertPools

GROUP = mxfp4.BLOCK  # inputs per e8m0 scale
GEMV_MAX_ROWS = 2  # block_m up to this: the GEMV path (sums in registers, no dot); a dot needs 16 rows
GEMV_PREFETCH = tl.constexpr(2)  # the GEMV path's num_stages that loads each k step one step ahead into registers
FEW_TOKENS = 2  # up to this many tokens a call, the default is the GEMV tile with the prefetch and pdl 2

# The defaults when no tuned entry exists (coldset.kernels.configs: triton_mxfp4.json).
# pdl 0 where triton has no grid-dependency control: the same bits, the launches one after the other
DEFAULT_FEW_TOKENS_CONFIG = KernelConfig.from_dict({**load_kernel_configs("triton_mxfp4")["defaults"]["few_tokens"],
                                                    **({} if gdc_wait is not None else {"pdl": 0})})
DEFAULT_DECODE_CONFIG = KernelConfig.from_dict(load_kernel_configs("triton_mxfp4")["defaults"]["decode"])
DEFAULT_PREFILL_CONFIG = KernelConfig.from_dict(load_kernel_configs("triton_mxfp4")["defaults"]["prefill"])
# On CUDA above FEW_TOKENS, to 64 tokens: the Gluon GEMV tile (w8a16 4), where Gluon and grid-dependency control exist;
# above MMA_FROM the Gluon tensor-core tile (w8a16 5)
DEFAULT_CUDA_DECODE_CONFIG = KernelConfig.from_dict(load_kernel_configs("triton_mxfp4")["defaults"]["cuda_decode"])
DEFAULT_CUDA_MMA_CONFIG = KernelConfig.from_dict(load_kernel_configs("triton_mxfp4")["defaults"]["cuda_mma"])
# where Gluon lacks cp.async: the same tile one step ahead in registers (the same products, bitwise)
DEFAULT_CUDA_MMA_REGISTER_CONFIG = KernelConfig.from_dict({**DEFAULT_CUDA_MMA_CONFIG.to_dict(), "num_stages": 2})
MMA_FROM = 18  # above this many tokens (to 64) the CUDA default is the tensor-core tile

#: The launches of a :func:`triton_mxfp4_experts` call, in order (the grouping goes with the first).
LAUNCHES = ("w13_act", "w2", "sum")


def default_config(num_tokens: int, top_k: int = 4, cuda: bool = False) -> KernelConfig:
    """Up to :data:`FEW_TOKENS` tokens the Triton GEMV tile with its prefetch and pdl 2 (the fastest
    there, in the decode step too); from there to 64 tokens, on CUDA, the Gluon GEMV tile (``w8a16``
    4, the faster step there: docs/measurements/mxfp4/cuda_default) with the pairs grouped by expert
    before the launch (``slot_max_pairs`` 1: a block reads its expert's range, it does not scan the
    routing; the faster step at 8 tokens: docs/measurements/mxfp4/sorted_default), and above
    :data:`MMA_FROM` tokens the Gluon tensor-core tile (``w8a16`` 5: an expert's pairs share one
    unpacking) with its k steps copied four ahead through shared memory (``num_stages`` 5; the faster
    kernel there, measured on both sides of the threshold: docs/measurements/mxfp4/mma_ring; one
    step ahead in registers where Gluon lacks ``cp.async``, the same sums), where this triton has
    Gluon and grid-dependency control; elsewhere (Triton's interpreter runs no Gluon) the Triton GEMV tile
    without the prefetch (its registers cost more than it saves there). Prefill tiles above 64."""
    if cuda and FEW_TOKENS < num_tokens <= 64 and gluon_mxfp4 is not None and gdc_wait is not None:
        if num_tokens <= MMA_FROM or gluon_mxfp4_mma is None:
            return DEFAULT_CUDA_DECODE_CONFIG
        return DEFAULT_CUDA_MMA_CONFIG if gluon_mxfp4_mma.async_copy is not None else DEFAULT_CUDA_MMA_REGISTER_CONFIG
    if num_tokens <= FEW_TOKENS:
        return DEFAULT_FEW_TOKENS_CONFIG
    return DEFAULT_DECODE_CONFIG if num_tokens <= 64 else DEFAULT_PREFILL_CONFIG


@triton.jit
def _group_scale(s):
    """float32 ``2^(s - 127)`` of e8m0 bytes (s = 0: 2^-127, a float32 subnormal)."""
    s = s.to(tl.int32)
    return tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)


@triton.jit
def _upcast(packed, scales, BN: tl.constexpr, BK: tl.constexpr):
    """bf16 ``[BN, BK]`` weights from packed e2m1 ``[BN, BK // 2]`` uint8 and e8m0 ``[BN, BK // 32]``
    uint8: ``e2m1(code) * 2^(s - 127)``, one value at a time. A code's magnitude m (0..7) is the
    float32 ``(m + 252) << 22`` for m >= 2 (exponent ``(m >> 1) + 126``, mantissa bit ``m & 1``: 1,
    1.5, 2, 3, 4, 6), 0.5 for m = 1 and 0 for m = 0; bit 3 is the sign."""
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BN, BK)).to(tl.int32)  # low nibble first
    m = codes & 7
    mag = tl.where(m > 1, (m + 252) << 22, tl.where(m == 1, 0x3F000000, 0))
    v = (mag | ((codes & 8) << 28)).to(tl.float32, bitcast=True)
    scale = _group_scale(scales)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, BK // 32, 32)), (BN, BK))
    return (v * scale).to(tl.bfloat16)


@triton.jit
def _e2m1_pair(q, EEM_SHIFT: tl.constexpr, SIGN_SHIFT: tl.constexpr, F32: tl.constexpr):
    """Nibbles k and k + 4 of each int32 word ``q`` (k = (9 - EEM_SHIFT) / 4) as ``e2m1 * 2^-14``: one
    word of two fp16 lanes built by bit operations on the whole word (the code's 3 magnitude bits as
    an fp16 exponent's low 2 bits and mantissa's top bit, its sign as the sign: exactly e2m1 times
    2^-14, code 1 an fp16 subnormal); fp16, or each lane widened exactly to float32 (``F32``)."""
    if EEM_SHIFT >= 0:
        e = q << EEM_SHIFT
    else:
        e = q >> (-EEM_SHIFT)
    p = (e & 0x0E000E00) | ((q << SIGN_SHIFT) & -2147450880)  # -2147450880: the int32 0x80008000
    lo = p.to(tl.int16).to(tl.float16, bitcast=True)
    hi = (p >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    if F32:
        lo = lo.to(tl.float32)
        hi = hi.to(tl.float32)
    return lo, hi


@triton.jit
def _e2m1_words(q, F32: tl.constexpr):
    """``e2m1 * 2^-14`` (float32 with ``F32``, else fp16) of the 8 codes of each int32 word of ``q``
    ``[...]``, as ``[..., 2, 2, 2]`` in element order (``reshape`` to ``[..., 8]``: element j of a word is
    nibble j, low first)."""
    v0, v4 = _e2m1_pair(q, 9, 12, F32)
    v1, v5 = _e2m1_pair(q, 5, 8, F32)
    v2, v6 = _e2m1_pair(q, 1, 4, F32)
    v3, v7 = _e2m1_pair(q, -3, 0, F32)
    return tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))


@triton.jit
def _load_rows(w_ptrs, s_ptrs, k0, n_ok, K: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
               EVEN_N: tl.constexpr, WORDS: tl.constexpr):
    """The packed codes and e8m0 bytes of inputs ``[k0, k0 + BK)`` of the rows ``w_ptrs`` / ``s_ptrs``
    point at: ``WORDS`` int32 words ``[BN, BK // 32, 4]``, else bytes ``[BN, BK // 2]``; scales
    ``[BN, BK // 32]``. Rows past N and inputs past K (whole groups of 32) read as code 0."""
    if WORDS:
        step = k0 // 8
    else:
        step = k0 // 2
    if EVEN_K and EVEN_N:
        packed = tl.load(w_ptrs + step)
        sc = tl.load(s_ptrs + k0 // 32)
    else:
        kg_ok = (k0 // 32 + tl.arange(0, BK // 32)) < K // 32
        if WORDS:
            w_ok = n_ok[:, None, None] & kg_ok[None, :, None]
        else:
            w_ok = n_ok[:, None] & ((k0 // 2 + tl.arange(0, BK // 2)) < K // 2)[None, :]
        packed = tl.load(w_ptrs + step, mask=w_ok, other=0)
        sc = tl.load(s_ptrs + k0 // 32, mask=n_ok[:, None] & kg_ok[None, :], other=127)
    return packed, sc


@triton.jit
def _weight_tile(w_ptrs, s_ptrs, k0, n_ok, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, WORDS: tl.constexpr):
    """The bf16 ``[BN, BK]`` weight tile of inputs ``[k0, k0 + BK)`` for a dot: ``WORDS`` by
    :func:`_e2m1_words` (times 2^14 then the scale: the same bits as :func:`_upcast`), else
    :func:`_upcast`."""
    packed, sc = _load_rows(w_ptrs, s_ptrs, k0, n_ok, K, BK, EVEN_K, EVEN_N, WORDS)
    if WORDS:
        v = _e2m1_words(packed, True) * 16384.0  # exact: e2m1 values
        v = v * _group_scale(sc)[:, :, None, None, None, None]
        w = tl.reshape(v, (BN, BK)).to(tl.bfloat16)
    else:
        w = _upcast(packed, sc, BN, BK)
    return w


@triton.jit
def _gemv_step(acc, a, v, f):
    """``acc [BN, G] += (sum over each group of 32 of a [G, 32] * v [BN, G, 32]) * 2^14 * f [BN, G]``:
    one row's float32 products summed in registers (a thread holds whole groups: the weights' load
    layout), the group's scale once per group sum."""
    part = tl.sum(v * a[None, :, :], axis=2)
    return acc + part * 16384.0 * f


@triton.jit
def _gemv_rows_out(r0, r1, BM: tl.constexpr):
    """``[BM, BN]`` of one or two ``[BN]`` rows."""
    if BM == 1:
        out = r0[None, :]
    else:
        out = tl.where((tl.arange(0, BM) == 0)[:, None], r0[None, :], r1[None, :])
    return out


@triton.jit
def _pair_of(pair, valid, i: tl.constexpr, BM: tl.constexpr):
    """Pair ``i`` of a chunk and whether it exists, as scalars."""
    sel = tl.arange(0, BM) == i
    return tl.sum(tl.where(sel, pair, 0), axis=0), tl.sum(tl.where(sel, valid.to(tl.int32), 0), axis=0) > 0


@triton.jit
def _gemv_x(a_ptrs, k0, ok, offs_g, K: tl.constexpr, EVEN_K: tl.constexpr):
    """One row's float32 inputs ``[G, 32]`` of a k step (zeros where ``ok`` is false or past K)."""
    if EVEN_K:
        a = tl.load(a_ptrs + k0, mask=(offs_g >= 0) & ok, other=0.0)
    else:
        a = tl.load(a_ptrs + k0, mask=((k0 + offs_g) < K) & ok, other=0.0)
    return a.to(tl.float32)


@triton.jit
def _row_ptrs(w_base, s_base, offs_n, K: tl.constexpr, BK: tl.constexpr, WORDS: tl.constexpr):
    """Pointers to the first k step of rows ``offs_n`` of one expert's packed matrix (int32 words
    ``[BN, BK // 32, 4]`` with ``WORDS``, bytes ``[BN, BK // 2]`` else) and of its scales
    ``[BN, BK // 32]``. Rows are K / 2 bytes: a multiple of 16 (K is a multiple of 32)."""
    rows = offs_n.to(tl.int64)
    if WORDS:
        words = tl.arange(0, BK // 32)[:, None] * 4 + tl.arange(0, 4)[None, :]
        w_ptrs = w_base.to(tl.pointer_type(tl.int32)) + rows[:, None, None] * (K // 8) + words[None, :, :]
    else:
        w_ptrs = w_base + rows[:, None] * (K // 2) + tl.arange(0, BK // 2)[None, :]
    s_ptrs = s_base + rows[:, None] * (K // 32) + tl.arange(0, BK // 32)[None, :]
    return w_ptrs, s_ptrs


@triton.jit
def _w13_mx_chunk(x_ptr, ids_ptr, sorted_pairs_ptr, act_ptr, wg_ptrs, wu_ptrs, sg_ptrs, su_ptrs, offs_n, n_ok, bg,
                  bu, num_pairs, expert, start, c, cnt, stride_xt,
                  TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, NP: tl.constexpr, MODE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                  HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
                  WORDS: tl.constexpr, F16: tl.constexpr, NS: tl.constexpr):
    """One chunk [c, c + BM) of the expert's pairs times its gate and up rows (bf16 dots, or fp16 ones
    with ``F16``: :func:`_f16_rows`), then the activation (biases first) rounded to bf16 into the
    per-pair scratch."""
    offs_k = tl.arange(0, BK)
    pair, valid = _chunk_pairs(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, c, cnt, BM, NP, MODE)
    tok = (pair // TOPK).to(tl.int64)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    if F16:
        acc_g, acc_u = _f16_rows(x_ptr + tok[:, None] * stride_xt, valid, wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs, n_ok, H,
                                 BM, BN, BK, EVEN_K, EVEN_N, NS, True)
    else:
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, H, BK):
            if EVEN_K:
                a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs + k0, mask=valid[:, None] & ((k0 + offs_k) < H)[None, :], other=0.0)
            wg = _weight_tile(wg_ptrs, sg_ptrs, k0, n_ok, H, BN, BK, EVEN_K, EVEN_N, WORDS)
            wu = _weight_tile(wu_ptrs, su_ptrs, k0, n_ok, H, BN, BK, EVEN_K, EVEN_N, WORDS)
            acc_g = tl.dot(a, tl.trans(wg), acc_g)
            acc_u = tl.dot(a, tl.trans(wu), acc_u)
    act = _gated(acc_g, acc_u, bg, bu, HAS_BIAS, ACT, ALPHA, LIMIT)
    out_ptrs = act_ptr + pair[:, None].to(tl.int64) * I + offs_n[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _gemv_unpack(packed, sc, BN: tl.constexpr, BK: tl.constexpr):
    """For the GEMV path, from a k step's int32 words and scale bytes (:func:`_load_rows` with
    ``WORDS``): float32 ``e2m1 * 2^-14`` ``[BN, BK // 32, 32]`` (unscaled: the scale is applied to
    each group's sum) and the groups' ``2^(s - 127)`` ``[BN, BK // 32]``."""
    return tl.reshape(_e2m1_words(packed, True), (BN, BK // 32, 32)), _group_scale(sc)


@triton.jit
def _gemv_rows_sums(acc0, acc1, pw, ps, a0, a1, k0, ok0, ok1, offs_g, K: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """One k step of :func:`_gemv_rows` on codes and scales already loaded (``pw``, ``ps``)."""
    v, f = _gemv_unpack(pw, ps, BN, BK)
    acc0 = _gemv_step(acc0, _gemv_x(a0, k0, ok0, offs_g, K, EVEN_K), v, f)
    if BM == 2:
        acc1 = _gemv_step(acc1, _gemv_x(a1, k0, ok1, offs_g, K, EVEN_K), v, f)
    return acc0, acc1


@triton.jit
def _gemv_rows(a_base, stride_a, pair, valid, w_ptrs, s_ptrs, n_ok, K: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, NS: tl.constexpr):
    """fp32 ``[BM, BN]``: rows ``pair`` (``valid``) of ``a_base`` (bf16, row stride ``stride_a``) times the
    weight rows ``w_ptrs`` / ``s_ptrs`` point at, without a dot (:func:`_gemv_step`); BM is 1 or 2.
    ``NS`` 2: each k step's codes and scales are loaded one step ahead (:data:`GEMV_PREFETCH`)."""
    offs_g = tl.arange(0, BK // 32)[:, None] * 32 + tl.arange(0, 32)[None, :]
    p0, ok0 = _pair_of(pair, valid, 0, BM)
    p1, ok1 = _pair_of(pair, valid, BM - 1, BM)
    a0 = a_base + p0.to(tl.int64) * stride_a + offs_g
    a1 = a_base + p1.to(tl.int64) * stride_a + offs_g
    acc0 = tl.zeros((BN, BK // 32), dtype=tl.float32)
    acc1 = tl.zeros((BN, BK // 32), dtype=tl.float32)
    if NS == GEMV_PREFETCH:
        steps: tl.constexpr = (K + BK - 1) // BK
        pw, ps = _load_rows(w_ptrs, s_ptrs, 0, n_ok, K, BK, EVEN_K, EVEN_N, True)
        for i in range(1, steps):
            nw, ns = _load_rows(w_ptrs, s_ptrs, i * BK, n_ok, K, BK, EVEN_K, EVEN_N, True)
            acc0, acc1 = _gemv_rows_sums(acc0, acc1, pw, ps, a0, a1, (i - 1) * BK, ok0, ok1, offs_g, K, BM, BN, BK,
                                         EVEN_K)
            pw, ps = nw, ns
        acc0, acc1 = _gemv_rows_sums(acc0, acc1, pw, ps, a0, a1, (steps - 1) * BK, ok0, ok1, offs_g, K, BM, BN, BK,
                                     EVEN_K)
    else:
        for k0 in range(0, K, BK):
            pw, ps = _load_rows(w_ptrs, s_ptrs, k0, n_ok, K, BK, EVEN_K, EVEN_N, True)
            acc0, acc1 = _gemv_rows_sums(acc0, acc1, pw, ps, a0, a1, k0, ok0, ok1, offs_g, K, BM, BN, BK, EVEN_K)
    return _gemv_rows_out(tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), BM)


@triton.jit
def _w13_gemv_sums(g0, u0, g1, u1, pg, cg, pu, cu, a0, a1, k0, ok0, ok1, offs_g, H: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """One k step of :func:`_w13_gemv_chunk` on the gate and up rows' codes and scales already
    loaded (``pg``, ``cg``, ``pu``, ``cu``)."""
    vg, fg = _gemv_unpack(pg, cg, BN, BK)
    vu, fu = _gemv_unpack(pu, cu, BN, BK)
    x0 = _gemv_x(a0, k0, ok0, offs_g, H, EVEN_K)
    g0 = _gemv_step(g0, x0, vg, fg)
    u0 = _gemv_step(u0, x0, vu, fu)
    if BM == 2:
        x1 = _gemv_x(a1, k0, ok1, offs_g, H, EVEN_K)
        g1 = _gemv_step(g1, x1, vg, fg)
        u1 = _gemv_step(u1, x1, vu, fu)
    return g0, u0, g1, u1


@triton.jit
def _w13_gemv_chunk(x_ptr, ids_ptr, sorted_pairs_ptr, act_ptr, wg_ptrs, wu_ptrs, sg_ptrs, su_ptrs, offs_n, n_ok,
                    bg, bu, num_pairs, expert, start, c, cnt, stride_xt,
                    TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, NP: tl.constexpr, MODE: tl.constexpr, EVEN_K: tl.constexpr,
                    EVEN_N: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr,
                    LIMIT: tl.constexpr, NS: tl.constexpr):
    """:func:`_w13_mx_chunk` without a dot (:func:`_gemv_step`): ``BM`` (1 or 2) pairs, the gate and
    up rows' loads of a k step issued together, one step ahead with ``NS`` 2 (:data:`GEMV_PREFETCH`)."""
    pair, valid = _chunk_pairs(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, c, cnt, BM, NP, MODE)
    offs_g = tl.arange(0, BK // 32)[:, None] * 32 + tl.arange(0, 32)[None, :]
    t0, ok0 = _pair_of(pair // TOPK, valid, 0, BM)
    t1, ok1 = _pair_of(pair // TOPK, valid, BM - 1, BM)
    a0 = x_ptr + t0.to(tl.int64) * stride_xt + offs_g
    a1 = x_ptr + t1.to(tl.int64) * stride_xt + offs_g
    g0 = tl.zeros((BN, BK // 32), dtype=tl.float32)
    u0 = tl.zeros((BN, BK // 32), dtype=tl.float32)
    g1 = tl.zeros((BN, BK // 32), dtype=tl.float32)
    u1 = tl.zeros((BN, BK // 32), dtype=tl.float32)
    if NS == GEMV_PREFETCH:
        steps: tl.constexpr = (H + BK - 1) // BK
        pg, cg = _load_rows(wg_ptrs, sg_ptrs, 0, n_ok, H, BK, EVEN_K, EVEN_N, True)
        pu, cu = _load_rows(wu_ptrs, su_ptrs, 0, n_ok, H, BK, EVEN_K, EVEN_N, True)
        for i in range(1, steps):
            npg, ncg = _load_rows(wg_ptrs, sg_ptrs, i * BK, n_ok, H, BK, EVEN_K, EVEN_N, True)
            npu, ncu = _load_rows(wu_ptrs, su_ptrs, i * BK, n_ok, H, BK, EVEN_K, EVEN_N, True)
            g0, u0, g1, u1 = _w13_gemv_sums(g0, u0, g1, u1, pg, cg, pu, cu, a0, a1, (i - 1) * BK, ok0, ok1, offs_g, H,
                                            BM, BN, BK, EVEN_K)
            pg, cg, pu, cu = npg, ncg, npu, ncu
        g0, u0, g1, u1 = _w13_gemv_sums(g0, u0, g1, u1, pg, cg, pu, cu, a0, a1, (steps - 1) * BK, ok0, ok1, offs_g, H,
                                        BM, BN, BK, EVEN_K)
    else:
        for k0 in range(0, H, BK):
            pg, cg = _load_rows(wg_ptrs, sg_ptrs, k0, n_ok, H, BK, EVEN_K, EVEN_N, True)
            pu, cu = _load_rows(wu_ptrs, su_ptrs, k0, n_ok, H, BK, EVEN_K, EVEN_N, True)
            g0, u0, g1, u1 = _w13_gemv_sums(g0, u0, g1, u1, pg, cg, pu, cu, a0, a1, k0, ok0, ok1, offs_g, H, BM, BN,
                                            BK, EVEN_K)
    g = _gemv_rows_out(tl.sum(g0, axis=1), tl.sum(g1, axis=1), BM)
    u = _gemv_rows_out(tl.sum(u0, axis=1), tl.sum(u1, axis=1), BM)
    act = _gated(g, u, bg, bu, HAS_BIAS, ACT, ALPHA, LIMIT)
    out_ptrs = act_ptr + pair[:, None].to(tl.int64) * I + offs_n[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _pow2_factors(a_row, valid, K: tl.constexpr, BM: tl.constexpr):
    """Per row ``a_row`` points at (``[BM, 1]``, bf16 rows of K): ``2^t`` that puts the row's largest magnitude in
    ``[2^14, 2^15)`` (fp16 holds every bf16 value of the row scaled by it exactly down to 2^-28 of
    that largest, the rest within 2^-25 of it), and ``2^(14 - t)``, which undoes it and the weights'
    2^-14. Rows of zeros get 2^127."""
    offs = tl.arange(0, 256)
    m = tl.zeros((BM,), dtype=tl.float32)
    for k0 in range(0, K, 256):
        x = tl.load(a_row + k0 + offs[None, :], mask=valid[:, None] & ((k0 + offs) < K)[None, :], other=0.0)
        m = tl.maximum(m, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    eb = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of the largest magnitude
    t = tl.minimum(141 - eb, 127)
    return ((127 + t) << 23).to(tl.float32, bitcast=True), ((141 - t) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _f16_step(acc, a16, packed, sc, BN: tl.constexpr):
    """``acc [BM, BN] += dot(a16 [BM, 32], e2m1 * 2^-14 [32, BN]) * 2^(s - 127)``: one scale group,
    an fp16 dot (float32 sums), the group's scale on the sum."""
    v = tl.reshape(_e2m1_words(tl.reshape(packed, (BN, 4)), False), (BN, 32))
    return acc + tl.dot(a16, tl.trans(v)) * tl.reshape(_group_scale(sc), (BN,))[None, :]


@triton.jit
def _f16_rows(a_row, valid, w1_ptrs, s1_ptrs, w2_ptrs, s2_ptrs, n_ok, K: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, NS: tl.constexpr,
              TWO: tl.constexpr):
    """fp32 ``[BM, BN]`` products of the bf16 rows ``a_row`` points at (``[BM, 1]``, rows of K) with the
    weight rows ``w1_ptrs`` / ``s1_ptrs`` (and ``w2_ptrs`` / ``s2_ptrs`` with ``TWO``: the same rows'
    loads of a step together) by fp16 dots: the rows scaled by a power of two each into fp16's range
    (:func:`_pow2_factors`), the weights ``e2m1 * 2^-14`` exactly in fp16, one dot per scale group,
    ``BK // 32`` groups a step (:func:`_f16_step`), the powers of two undone at the end."""
    f, back = _pow2_factors(a_row, valid, K, BM)
    offs = tl.arange(0, 32)
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=NS):
        for gi in tl.static_range(BK // 32):
            kg = k0 + gi * 32
            p1, c1 = _load_rows(w1_ptrs, s1_ptrs, kg, n_ok, K, 32, EVEN_K, EVEN_N, True)
            if TWO:
                p2, c2 = _load_rows(w2_ptrs, s2_ptrs, kg, n_ok, K, 32, EVEN_K, EVEN_N, True)
            if EVEN_K:
                a = tl.load(a_row + kg + offs[None, :], mask=valid[:, None], other=0.0)
            else:
                a = tl.load(a_row + kg + offs[None, :], mask=valid[:, None] & ((kg + offs) < K)[None, :], other=0.0)
            a16 = (a.to(tl.float32) * f[:, None]).to(tl.float16)
            acc1 = _f16_step(acc1, a16, p1, c1, BN)
            if TWO:
                acc2 = _f16_step(acc2, a16, p2, c2, BN)
    return acc1 * back[:, None], acc2 * back[:, None]


@triton.jit(do_not_specialize=["num_pairs", "layer", "NB"])  # one compile for every layer and batch
def _w13_mx_kernel(
    x_ptr, ids_ptr, sorted_pairs_ptr, expert_off_ptr, row_map_ptr, w_hot_ptr, w_cold_ptr, s_hot_ptr, s_cold_ptr,
    b13_ptr, act_ptr, num_pairs, layer, stride_xt, NB,
    E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NP: tl.constexpr, MODE: tl.constexpr,
    USE_ROW_MAP: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_GDC: tl.constexpr,
    ORDER: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    GEMV: tl.constexpr, WORDS: tl.constexpr, F16: tl.constexpr, NS: tl.constexpr,
):
    slot, pid_n, _ = _block_ids(NB, ORDER)
    if USE_GDC:
        gdc_launch_dependents()  # a plain launch: its inputs are complete; the w2 kernel may start now
    expert, cnt, start, c_begin, c_end = _block_expert(ids_ptr, expert_off_ptr, num_pairs, slot, E, EP, NP, BM, MODE)
    # the one place the expert id is used: one row-map lookup for the packed weights, the same for the scales
    w_base = _expert_base(row_map_ptr, w_hot_ptr, w_cold_ptr, layer, expert, 2 * I * (H // 2), E, USE_ROW_MAP)
    s_base = _expert_base(row_map_ptr, s_hot_ptr, s_cold_ptr, layer, expert, 2 * I * (H // 32), E, USE_ROW_MAP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < I
    wg_ptrs, sg_ptrs = _row_ptrs(w_base, s_base, offs_n, H, 32 if F16 else BK, WORDS)  # gate rows n
    wu_ptrs, su_ptrs = _row_ptrs(w_base, s_base, I + offs_n, H, 32 if F16 else BK, WORDS)  # up rows I + n
    bg = _expert_bias(b13_ptr, layer, expert, offs_n, n_ok, 2 * I, E, HAS_BIAS)
    bu = _expert_bias(b13_ptr, layer, expert, I + offs_n, n_ok, 2 * I, E, HAS_BIAS)
    c = c_begin
    while c < c_end:  # chunks of this expert's pairs (a while loop: dynamic bound)
        if GEMV:
            _w13_gemv_chunk(x_ptr, ids_ptr, sorted_pairs_ptr, act_ptr, wg_ptrs, wu_ptrs, sg_ptrs, su_ptrs, offs_n,
                            n_ok, bg, bu, num_pairs, expert, start, c, cnt, stride_xt,
                            TOPK, H, I, BM, BN, BK, NP, MODE, EVEN_K, EVEN_N, HAS_BIAS, ACT, ALPHA, LIMIT, NS)
        else:
            _w13_mx_chunk(x_ptr, ids_ptr, sorted_pairs_ptr, act_ptr, wg_ptrs, wu_ptrs, sg_ptrs, su_ptrs, offs_n,
                          n_ok, bg, bu, num_pairs, expert, start, c, cnt, stride_xt,
                          TOPK, H, I, BM, BN, BK, NP, MODE, EVEN_K, EVEN_N, HAS_BIAS, ACT, ALPHA, LIMIT, WORDS, F16,
                          NS)
        c += BM


@triton.jit
def _w2_mx_chunk(act_ptr, ids_ptr, sorted_pairs_ptr, topk_w_ptr, buf_ptr, w_ptrs, s_ptrs, offs_n, n_ok, b2,
                 num_pairs, expert, start, c, cnt,
                 H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 NP: tl.constexpr, MODE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                 HAS_BIAS: tl.constexpr, GEMV: tl.constexpr, WORDS: tl.constexpr, F16: tl.constexpr,
                 NS: tl.constexpr):
    """One chunk [c, c + BM) of the expert's pairs: the intermediate times w2's rows (bf16 dots, fp16
    ones with ``F16``, or ``GEMV`` sums in registers), plus w2's bias, times the routing weight, into
    the per-pair buffer."""
    pair, valid = _chunk_pairs(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, c, cnt, BM, NP, MODE)
    pair64 = pair.to(tl.int64)
    if GEMV:
        acc = _gemv_rows(act_ptr, I, pair, valid, w_ptrs, s_ptrs, n_ok, I, BM, BN, BK, EVEN_K, EVEN_N, NS)
    elif F16:
        acc, _ = _f16_rows(act_ptr + pair64[:, None] * I, valid, w_ptrs, s_ptrs, w_ptrs, s_ptrs, n_ok, I, BM, BN, BK,
                           EVEN_K, EVEN_N, NS, False)
    else:
        offs_k = tl.arange(0, BK)
        a_ptrs = act_ptr + pair64[:, None] * I + offs_k[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, I, BK):
            if EVEN_K:
                a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs + k0, mask=valid[:, None] & ((k0 + offs_k) < I)[None, :], other=0.0)
            w = _weight_tile(w_ptrs, s_ptrs, k0, n_ok, I, BN, BK, EVEN_K, EVEN_N, WORDS)
            acc = tl.dot(a, tl.trans(w), acc)
    if HAS_BIAS:
        acc += b2[None, :]
    wt = tl.load(topk_w_ptr + pair64, mask=valid, other=0.0).to(tl.float32)
    acc = acc * wt[:, None]
    tl.store(buf_ptr + pair64[:, None] * H + offs_n[None, :], acc.to(buf_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "layer", "NB"])
def _w2_mx_kernel(
    act_ptr, ids_ptr, sorted_pairs_ptr, expert_off_ptr, row_map_ptr, w_hot_ptr, w_cold_ptr, s_hot_ptr, s_cold_ptr,
    b2_ptr, topk_w_ptr, buf_ptr, num_pairs, layer, NB,
    E: tl.constexpr, EP: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NP: tl.constexpr, MODE: tl.constexpr,
    USE_ROW_MAP: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_GDC: tl.constexpr,
    ORDER: tl.constexpr, HAS_BIAS: tl.constexpr, GEMV: tl.constexpr, WORDS: tl.constexpr, F16: tl.constexpr,
    NS: tl.constexpr,
):
    slot, pid_n, _ = _block_ids(NB, ORDER)
    expert, cnt, start, c_begin, c_end = _block_expert(ids_ptr, expert_off_ptr, num_pairs, slot, E, EP, NP, BM, MODE)
    w_base = _expert_base(row_map_ptr, w_hot_ptr, w_cold_ptr, layer, expert, H * (I // 2), E, USE_ROW_MAP)
    s_base = _expert_base(row_map_ptr, s_hot_ptr, s_cold_ptr, layer, expert, H * (I // 32), E, USE_ROW_MAP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < H
    w_ptrs, s_ptrs = _row_ptrs(w_base, s_base, offs_n, I, 32 if F16 else BK, WORDS)  # w2 rows n (of H)
    b2 = _expert_bias(b2_ptr, layer, expert, offs_n, n_ok, H, E, HAS_BIAS)
    if USE_GDC:  # launched early: only the launch and the lookups above overlap the w13 launch
        gdc_launch_dependents()
        gdc_wait()
    c = c_begin
    while c < c_end:
        _w2_mx_chunk(act_ptr, ids_ptr, sorted_pairs_ptr, topk_w_ptr, buf_ptr, w_ptrs, s_ptrs, offs_n, n_ok, b2,
                     num_pairs, expert, start, c, cnt, H, I, BM, BN, BK, NP, MODE, EVEN_K, EVEN_N, HAS_BIAS,
                     GEMV, WORDS, F16, NS)
        c += BM


def _check_config(c: KernelConfig) -> None:
    """Refuse, by field, what this kernel does not implement."""
    for name in ("block_k1", "block_k2"):
        v = getattr(c, name)
        if v < GROUP or v & (v - 1):
            raise ValueError(f"triton_mxfp4_experts: config {name} must be a power of two >= {GROUP} (whole e8m0 "
                             f"scale groups per k step), got {v}")
    if c.w8a16 not in (0, 2, 3, 4, 5):
        raise ValueError(f"triton_mxfp4_experts: config w8a16={c.w8a16} is not implemented for MXFP4 (0: the dot "
                         "path unpacks value by value, 2: by 32-bit words, 3: fp16 dots, one per scale group, 4: "
                         "the GEMV tile in Gluon, 5: the tensor-core tile in Gluon)")
    if c.w8a16 == 5:
        _check_mma_config(c)  # its own block_m; the fields every path shares are checked below
    elif c.block_m not in (1, 2) and (c.block_m < 16 or c.block_m & (c.block_m - 1)):
        raise ValueError(f"triton_mxfp4_experts: block_m must be 1 or 2 (the GEMV path) or a power of two >= 16 (a "
                         f"dot's rows), got {c.block_m}")
    if c.w8a16 == 4:
        if c.block_m > GEMV_MAX_ROWS:
            raise ValueError(f"triton_mxfp4_experts: w8a16=4 (the GEMV tile in Gluon) needs block_m <= "
                             f"{GEMV_MAX_ROWS}, got {c.block_m}")
        if gluon_mxfp4 is None:
            raise ValueError(f"triton_mxfp4_experts: w8a16=4 (the GEMV tile in Gluon) needs triton with Gluon "
                             f"(triton.experimental.gluon, triton >= 3.5), this is triton {triton.__version__}")
        if not gluon_mxfp4.layout_fits(c.block_n1, c.block_k1, c.block_n2, c.block_k2, c.num_warps):
            raise ValueError(f"triton_mxfp4_experts: w8a16=4: block_n1={c.block_n1} / block_n2={c.block_n2} do not "
                             f"lay out over num_warps={c.num_warps} at block_k1={c.block_k1} / block_k2={c.block_k2} "
                             "(rows a multiple of the warps times the lanes left by min(block_k / 32, 32) groups)")
    if c.w8a16 == 3 and c.block_m < 16:
        raise ValueError(f"triton_mxfp4_experts: w8a16=3 (fp16 dots, one per scale group) needs block_m >= 16 (a "
                         f"dot's rows), got {c.block_m}")
    if c.block_m <= GEMV_MAX_ROWS and c.w8a16 not in (2, 4):
        raise ValueError(f"triton_mxfp4_experts: block_m={c.block_m} (<= {GEMV_MAX_ROWS}: the GEMV path, no dot) "
                         f"unpacks 32-bit words: config w8a16 must be 2 (Triton) or 4 (Gluon), got {c.w8a16}")
    if c.block_m <= GEMV_MAX_ROWS and c.num_stages not in (1, GEMV_PREFETCH):
        raise ValueError(f"triton_mxfp4_experts: block_m={c.block_m} (the GEMV path) takes num_stages 1 (loads at "
                         f"each k step) or 2 (loads one step ahead), got {c.num_stages}")
    if c.pdl not in (0, 2):
        raise ValueError(f"triton_mxfp4_experts: config pdl must be 0 or 2 (no L2 prefetch, no chained first "
                         f"launch here), got {c.pdl}")
    for name in ("split_k1", "split_k2"):
        if getattr(c, name) != 1:
            raise ValueError(f"triton_mxfp4_experts: split-K ({name} > 1) is not implemented for MXFP4")
    for name in ("half_tail", "quant_x", "quant_act", "swap_ab"):
        if getattr(c, name) != 0:
            raise ValueError(f"triton_mxfp4_experts: config {name}={getattr(c, name)} is not implemented for MXFP4 "
                             "(weight-only bf16 dots; no activation quantization)")
    if c.tile_order not in (0, 1) or c.half_buf not in (0, 1):
        raise ValueError(f"triton_mxfp4_experts: tile_order and half_buf must be 0 or 1, got {c.tile_order}, "
                         f"{c.half_buf}")


def _check_mma_config(c: KernelConfig) -> None:
    """Refuse, by field, what ``w8a16`` 5 (the tensor-core tile) does not implement beyond what no
    path of this kernel does (:func:`_check_config`)."""
    name = "triton_mxfp4_experts: w8a16=5 (the tensor-core tile in Gluon)"
    if gluon_mxfp4_mma is None:
        raise ValueError(f"{name} needs triton with Gluon (triton.experimental.gluon, triton >= 3.5), this is triton "
                         f"{triton.__version__}")
    step = gluon_mxfp4_mma.STEP_K
    if (c.block_k1, c.block_k2) != (step, step):
        raise ValueError(f"{name} reads {step} inputs a k step: block_k1 and block_k2 must be {step}, got "
                         f"{c.block_k1}, {c.block_k2}")
    if not (gluon_mxfp4_mma.tile_fits(2 * c.block_n1, c.block_m, c.num_warps)
            and gluon_mxfp4_mma.tile_fits(c.block_n2, c.block_m, c.num_warps)):
        raise ValueError(f"{name} takes block_m 8 or 16 (the MMA's N) and tiles of whole 16-row MMA blocks over the "
                         f"warps (2 block_n1 and block_n2 multiples of 16 num_warps, powers of two): got block_m="
                         f"{c.block_m}, block_n1={c.block_n1}, block_n2={c.block_n2}, num_warps={c.num_warps}")
    if c.num_stages >= 3 and gluon_mxfp4_mma.async_copy is None:
        raise ValueError(f"{name} with num_stages {c.num_stages} copies through shared memory with Gluon's "
                         f"cp.async, which triton {triton.__version__} lacks: num_stages 1 or 2")
    if not 1 <= c.num_stages <= gluon_mxfp4_mma.MAX_STAGES:
        raise ValueError(f"{name} takes num_stages 1 to {gluon_mxfp4_mma.MAX_STAGES} (loads at each k step, one step "
                         f"ahead, or from 3 through rings of num_stages - 1 steps in shared memory), got "
                         f"{c.num_stages}")
    if c.slot_max_pairs != 1:
        raise ValueError(f"{name} takes slot_max_pairs 1 (the pairs grouped by expert), got {c.slot_max_pairs}")


def triton_mxfp4_experts(
    pools: ExpertPools,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: KernelConfig | dict | None = None,
    use_row_map: bool = True,
) -> torch.Tensor:
    """Routed-expert output ``[T, H]`` of MXFP4 ``pools`` for bf16 tokens ``x`` ``[T, H]`` of MoE
    layer ``layer``: the contract of :func:`coldset.kernels.triton_experts`, including
    ``use_row_map=False`` (the unmodified all-hot path)."""
    return issue_all(mxfp4_experts_launches(pools, layer, x, topk_ids, topk_weights, config, use_row_map))


def mxfp4_experts_launches(
    pools: ExpertPools,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: KernelConfig | dict | None = None,
    use_row_map: bool = True,
) -> Generator[str, None, torch.Tensor]:
    """The launches of one :func:`triton_mxfp4_experts` call (its checks first), issued one at a
    time: yields each launch's name of :data:`LAUNCHES` after issuing it, returns the output (as
    :func:`coldset.kernels.triton_moe.experts_launches`)."""
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"triton_mxfp4_experts: x [T, H], topk_ids [T, k], topk_weights [T, k] expected, got "
                         f"{tuple(x.shape)}, {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    if not getattr(pools, "is_mxfp4", False):
        raise ValueError("triton_mxfp4_experts: the pools hold no MXFP4 experts (coldset.kernels.triton_experts "
                         "picks the kernel by format)")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"triton_mxfp4_experts: x dtype {x.dtype} must be bfloat16 (the weights are unpacked to bf16)")
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts = pools.num_experts
    inter = 2 * pools.w2_hot.shape[2]
    if pools.w13_hot.shape[1:] != (2 * inter, hidden // 2) or pools.w2_hot.shape[1] != hidden:
        raise ValueError(f"triton_mxfp4_experts: pools hold packed w13 {tuple(pools.w13_hot.shape[1:])} and w2 "
                         f"{tuple(pools.w2_hot.shape[1:])} ([2I, H/2], [H, I/2]), x has H = {hidden}")
    config, x, ids, weights = prepare_call("triton_mxfp4_experts", pools, x, topk_ids, topk_weights, config,
                                           use_row_map, functools.partial(default_config, cuda=x.is_cuda))
    c = config
    _check_config(c)
    pdl = c.pdl > 0
    if pdl and gdc_wait is None:
        raise RuntimeError(f"triton_mxfp4_experts: config pdl={c.pdl} needs triton.language.extra.cuda.gdc_wait "
                           "(triton >= 3.3)")
    if c.w8a16 in (4, 5) and not x.is_cuda:
        raise ValueError(f"triton_mxfp4_experts: w8a16={c.w8a16} (a tile in Gluon) runs on CUDA only, x is on "
                         f"{x.device} (Triton's interpreter runs no Gluon: w8a16 2 is the GEMV in Triton)")
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    num_pairs = num_tokens * top_k
    device = x.device
    # the tensor-core tile reads the pairs grouped by expert whatever their number
    mode, slots, np_, sorted_pairs, expert_off = pair_tiles(
        ids, num_pairs, num_experts, dataclasses.replace(c, slot_max_pairs=0) if c.w8a16 == 5 else c)
    w13_cold, w2_cold, s13_cold, s2_cold = cold_or_hot(pools, "w13", "w2", "w13_scale", "w2_scale")
    has_bias = pools.has_bias
    b13 = pools.w13_bias if has_bias else x  # not read without biases
    b2 = pools.w2_bias if has_bias else x
    act_fn = pools.activation
    act_kw = dict(HAS_BIAS=has_bias, ACT=act_fn.code, ALPHA=act_fn.alpha or 0.0, LIMIT=act_fn.limit or 0.0)
    ep = _next_pow2(num_experts)
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=device)
    buf = torch.empty((num_pairs, hidden), dtype=x.dtype if c.half_buf else torch.float32, device=device)
    nb1, nb2 = triton.cdiv(inter, c.block_n1), triton.cdiv(hidden, c.block_n2)

    def grid(nb):
        return (slots, nb, 1) if c.tile_order == 0 else (slots * nb, 1, 1)

    if c.w8a16 == 5:
        yield from _gluon_mma_launches(c, grid, nb1, nb2, x, ids, sorted_pairs, expert_off, pools, layer, act, buf,
                                       weights, num_pairs, ep, top_k, hidden, inter, use_row_map, pdl,
                                       (w13_cold, w2_cold, s13_cold, s2_cold), b13, b2, act_kw)
        yield from _sum_launch(buf, out, num_pairs, num_tokens, hidden, top_k, pdl)
        return out
    if c.w8a16 == 4:
        yield from _gluon_gemv_launches(c, grid, nb1, nb2, x, ids, sorted_pairs, expert_off, pools, layer, act, buf,
                                        weights, num_pairs, mode, np_, ep, top_k, hidden, inter, use_row_map, pdl,
                                        (w13_cold, w2_cold, s13_cold, s2_cold), b13, b2, act_kw)
        yield from _sum_launch(buf, out, num_pairs, num_tokens, hidden, top_k, pdl)
        return out
    gemv = c.block_m <= GEMV_MAX_ROWS
    path = dict(GEMV=gemv, WORDS=gemv or c.w8a16 >= 2, F16=c.w8a16 == 3, NS=c.num_stages)
    _w13_mx_kernel[grid(nb1)](
        x, ids, sorted_pairs, expert_off, pools.row_map, pools.w13_hot, w13_cold, pools.w13_scale_hot, s13_cold,
        b13, act, num_pairs, layer, x.stride(0), nb1,
        E=num_experts, EP=ep, TOPK=top_k, H=hidden, I=inter, BM=c.block_m, BN=c.block_n1, BK=c.block_k1, NP=np_,
        MODE=mode, USE_ROW_MAP=use_row_map, EVEN_K=hidden % c.block_k1 == 0, EVEN_N=inter % c.block_n1 == 0,
        USE_GDC=pdl, ORDER=c.tile_order, **act_kw, **path, num_warps=c.num_warps, num_stages=c.num_stages,
    )
    yield "w13_act"
    _w2_mx_kernel[grid(nb2)](
        act, ids, sorted_pairs, expert_off, pools.row_map, pools.w2_hot, w2_cold, pools.w2_scale_hot, s2_cold,
        b2, weights, buf, num_pairs, layer, nb2,
        E=num_experts, EP=ep, H=hidden, I=inter, BM=c.block_m, BN=c.block_n2, BK=c.block_k2, NP=np_, MODE=mode,
        USE_ROW_MAP=use_row_map, EVEN_K=inter % c.block_k2 == 0, EVEN_N=hidden % c.block_n2 == 0, USE_GDC=pdl,
        ORDER=c.tile_order, HAS_BIAS=has_bias, **path, num_warps=c.num_warps, num_stages=c.num_stages,
        launch_pdl=pdl,
    )
    yield "w2"
    yield from _sum_launch(buf, out, num_pairs, num_tokens, hidden, top_k, pdl)
    return out


def _sum_launch(buf, out, num_pairs, num_tokens, hidden, top_k, pdl) -> Generator[str, None, None]:
    """The third launch: each token's top-k rows of the per-pair buffer summed in rank order."""
    block = min(1024, _next_pow2(hidden))
    _sum_topk_kernel[(num_tokens, triton.cdiv(hidden, block))](
        buf, out, num_pairs, H=hidden, TOPK=top_k, BLOCK=block, USE_GDC=pdl, SPLIT=1, num_warps=4, launch_pdl=pdl)
    yield "sum"


def _words(packed: torch.Tensor) -> torch.Tensor:
    """A pool of packed codes as the Gluon tiles read it: K / 2 bytes a row are whole int32 words (so
    that the compiler knows each group's 16 bytes aligned and loads them at once)."""
    return packed.view(torch.int32)


def _gluon_gemv_launches(c, grid, nb1, nb2, x, ids, sorted_pairs, expert_off, pools, layer, act, buf, weights,
                         num_pairs, mode, np_, ep, top_k, hidden, inter, use_row_map, pdl, colds, b13, b2,
                         act_kw) -> Generator[str, None, None]:
    """The launches of w8a16 4, :mod:`coldset.kernels.gluon_mxfp4`'s GEMV tile: the tokens' input pairs,
    w13, the intermediate's pairs, w2."""
    w13_cold, w2_cold, s13_cold, s2_cold = colds
    num_experts = pools.num_experts
    common = dict(E=num_experts, EP=ep, BM=c.block_m, NP=np_, MODE=mode, USE_ROW_MAP=use_row_map, USE_GDC=pdl,
                  ORDER=c.tile_order, NS=c.num_stages, W=c.num_warps)
    xp, xe = gluon_mxfp4.input_pairs(x, pdl, dependent=False)  # a plain launch: what came before is complete
    gluon_mxfp4._w13_gemv_kernel[grid(nb1)](
        xp, xe, ids, sorted_pairs, expert_off, pools.row_map, _words(pools.w13_hot), _words(w13_cold),
        pools.w13_scale_hot, s13_cold, b13, act, num_pairs, layer, nb1,
        TOPK=top_k, H=hidden, I=inter, BN=c.block_n1, BK=c.block_k1, **act_kw, **common, num_warps=c.num_warps,
        launch_pdl=pdl,
    )
    yield "w13_act"
    ap, ae = gluon_mxfp4.input_pairs(act, pdl, dependent=pdl)
    gluon_mxfp4._w2_gemv_kernel[grid(nb2)](
        ap, ae, ids, sorted_pairs, expert_off, pools.row_map, _words(pools.w2_hot), _words(w2_cold),
        pools.w2_scale_hot, s2_cold, b2, weights, buf, num_pairs, layer, nb2,
        H=hidden, I=inter, BN=c.block_n2, BK=c.block_k2, HAS_BIAS=act_kw["HAS_BIAS"], **common,
        num_warps=c.num_warps, launch_pdl=pdl,
    )
    yield "w2"


def _gluon_mma_launches(c, grid, nb1, nb2, x, ids, sorted_pairs, expert_off, pools, layer, act, buf, weights,
                        num_pairs, ep, top_k, hidden, inter, use_row_map, pdl, colds, b13, b2,
                        act_kw) -> Generator[str, None, None]:
    """The launches of w8a16 5, :mod:`coldset.kernels.gluon_mxfp4_mma`'s tensor-core tile: w13 (a plain
    launch: what came before is complete), w2."""
    w13_cold, w2_cold, s13_cold, s2_cold = colds
    common = dict(E=pools.num_experts, EP=ep, BM=c.block_m, USE_ROW_MAP=use_row_map, USE_GDC=pdl,
                  ORDER=c.tile_order, NS=c.num_stages, W=c.num_warps)
    lq, lx, la, lb, lc = gluon_mxfp4_mma.tile_layouts(2 * c.block_n1, c.block_m, c.num_warps)
    gluon_mxfp4_mma._w13_mma_kernel[grid(nb1)](
        x, ids, sorted_pairs, expert_off, pools.row_map, _words(pools.w13_hot), _words(w13_cold),
        pools.w13_scale_hot, s13_cold, b13, act, num_pairs, layer, nb1,
        TOPK=top_k, H=hidden, I=inter, BN=2 * c.block_n1, **act_kw, **common, LQ=lq, LX=lx, LA=la, LB=lb, LC=lc,
        num_warps=c.num_warps,
    )
    yield "w13_act"
    lq, lx, la, lb, lc = gluon_mxfp4_mma.tile_layouts(c.block_n2, c.block_m, c.num_warps)
    gluon_mxfp4_mma._w2_mma_kernel[grid(nb2)](
        act, ids, sorted_pairs, expert_off, pools.row_map, _words(pools.w2_hot), _words(w2_cold),
        pools.w2_scale_hot, s2_cold, b2, weights, buf, num_pairs, layer, nb2,
        H=hidden, I=inter, BN=c.block_n2, HAS_BIAS=act_kw["HAS_BIAS"], **common, LQ=lq, LX=lx, LA=la, LB=lb, LC=lc,
        num_warps=c.num_warps, launch_pdl=pdl,
    )
    yield "w2"
