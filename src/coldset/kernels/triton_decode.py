"""The decode step's non-expert work in few launches (CUDA, Triton): one token per sequence.

Why: at decode batch sizes the step outside the routed experts is latency, not bytes. The
compiled region (Inductor) still ran ~13 kernels a layer for ~38 MB of attention and router
weights: the input norm, the qkv GEMV, qk-norm + RoPE, the KV write, the mask's expansion, SDPA,
the o_proj GEMV and its split-K reduction, the residual add and the post-attention norm, each with
its launch gap, then the router's GEMM, top-k and weights cast. Here a MoE layer is four launches
before its experts (:func:`coldset.engine.model.fused_layer_before_experts`):

* the residual add that ends the previous layer, the input RMSNorm and the qkv projection: at one
  token :func:`gemv` with ``add`` (every program computes the row's norm beside its product, 4 KB of
  input; program 0 writes the new residual stream), from 2 tokens on :func:`rms_norm` with ``add``
  and cuBLAS;
* :func:`decode_attention`: per (sequence, kv head), qk-norm, RoPE, the KV-cache write and
  attention of the head's query group over the valid cache slots (GQA without repeating K/V);
* o_proj plus the residual add: :func:`gemv` at one token, :func:`norm_linear` above;
* :func:`route`: the post-attention norm (the experts' input), the router GEMV and its softmax +
  top-k (a dense layer: :func:`rms_norm`).

The step's end (the add, the final norm and the LM head) is one :func:`gemv` at one token.

Numerics follow the engine's (:mod:`coldset.engine.model`) up to rounding: norms in float32 (in
:func:`norm_linear` the input is ``weight * x`` rounded once and the product scaled by the row's
rstd in float32, the same function with one rounding fewer), softmax in float32 with the
probabilities cast to the model dtype for the value product (as flash attention does). Every
reduction has a fixed order (no split-K; the one atomic, :func:`route`'s ticket, only picks which
program ranks the finished logits), so a step is bitwise reproducible and
independent of where experts live; it is not bitwise equal to the eager or Inductor-compiled step
(other reduction orders), which is why runs that compare tokens run one engine on both sides.

Each kernel can also be launched as a programmatic dependent launch (``pdl``, Hopper): it lets
its successor launch at once, and reads what its predecessor does not write (weights, rotary
rows, cached keys of earlier steps) before waiting on it; every write and every read of the
predecessor's output comes after the wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from coldset.core import fp8
from coldset.kernels.triton_slots import (PER_LAYER_ARGS, PER_LAYER_VIEWS, ahead_group, group_scalars, pdl_available,
                                          record_group)


@dataclass(frozen=True)
class LinearConfig:
    """Launch configuration of :func:`norm_linear`. ``block_m == 1`` multiplies on the CUDA
    cores (a GEMV, one token); otherwise ``block_m`` (>= 16) tokens go through ``tl.dot``. The
    reduction order depends on ``block_k`` and the path, so one config per shape is fixed in
    :func:`linear_config` (no run-time autotuning: two processes must compute the same bits)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def linear_config(m: int, n: int, k: int) -> LinearConfig:
    """The fixed launch config for ``m`` tokens against an ``[n, k]`` weight: the fastest of the
    H200 sweeps over Qwen3-30B-A3B's qkv ``[5120, 2048]`` and o_proj ``[2048, 4096]`` (48 layers'
    weights; at 8 tokens o_proj with its residual, the engine's one use of it from 2 tokens on).
    (The engine runs one token through :func:`gemv`.)"""
    if m == 1:
        return LinearConfig(1, 16, 1024, num_warps=8, num_stages=3) if k >= 4096 else \
            LinearConfig(1, 8, 512, num_warps=4, num_stages=1)
    return LinearConfig(16, 16, 512, num_warps=4, num_stages=4)


@triton.jit
def _norm_linear_kernel(x_ptr, add_ptr, sum_ptr, nw_ptr, w_ptr, res_ptr, out_ptr,
                        M, N, K, eps,
                        stride_xm, stride_am, stride_sm, stride_wn, stride_rm, stride_om,
                        NORM: tl.constexpr, ADD: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    dt = out_ptr.dtype.element_ty
    if PDL:  # the next kernel may start its own prologue now (it waits for this grid before reading)
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    a_rows = add_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    if BLOCK_M == 1:
        # Weights are never written by the previous kernel: the first tile is read before
        # waiting on it, and each next tile before the current one's arithmetic (two in flight).
        w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & (rk[None, :] < K), other=0.0)
        acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:  # tl.dot: Triton's pipeliner streams the tiles (num_stages)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if NORM:
        nw = tl.load(nw_ptr + rk, mask=rk < K, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    out_ok = m_ok[:, None] & n_ok[None, :]
    if RESIDUAL:
        r = tl.load(res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :], mask=out_ok, other=0.0)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + rk
        ok = m_ok[:, None] & (offs_k[None, :] < K)
        a = tl.load(x_rows + offs_k[None, :], mask=ok, other=0.0)
        if ADD:  # the residual stream x + add, in the model dtype, written once (program 0)
            a = (a.to(tl.float32) + tl.load(a_rows + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)).to(dt)
            tl.store(sum_ptr + offs_m.to(tl.int64)[:, None] * stride_sm + offs_k[None, :], a,
                     mask=ok & (pid_n == 0))
        nk = offs_k + BLOCK_K
        if BLOCK_M == 1:
            w_next = tl.load(w_rows + nk[None, :], mask=n_ok[:, None] & (nk[None, :] < K), other=0.0)
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k[None, :] < K), other=0.0)
        if NORM:
            # RMSNorm(x) @ W.T = rstd * ((weight * x) @ W.T): the mean square accumulates in the
            # same pass, so the weights stream from the first instruction on.
            nw_next = tl.load(nw_ptr + nk, mask=nk < K, other=0.0)
            af = a.to(tl.float32)
            ss += tl.sum(af * af, axis=1)
            a = (af * nw.to(tl.float32)[None, :]).to(dt)
            nw = nw_next
        if BLOCK_M == 1:
            acc1 += a.to(tl.float32) * w.to(tl.float32)
            w = w_next
        else:
            acc2 += tl.dot(a, tl.trans(w))
    if BLOCK_M == 1:
        acc = tl.sum(acc1, axis=1)[None, :]
    else:
        acc = acc2
    if NORM:
        acc = acc * tl.rsqrt(ss / K + eps)[:, None]
    y = acc.to(dt)
    if RESIDUAL:
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], y, mask=out_ok)


def _rows(t: torch.Tensor, name: str, k: int) -> torch.Tensor:
    if t.dim() != 2 or t.shape[1] != k:
        raise ValueError(f"norm_linear: {name} must be [M, {k}], got {tuple(t.shape)}")
    return t if t.stride(1) == 1 else t.contiguous()


def norm_linear(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                eps: float = 0.0, add: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                config: LinearConfig | None = None, pdl: bool = False):
    """``x @ weight.T`` for a few tokens ``x`` ``[M, K]`` and ``weight`` ``[N, K]``, with what
    sits around the decode step's GEMVs fused in:

    * ``norm_weight``: the input is ``RMSNorm(x)`` (``eps``) instead of ``x``, computed as
      ``rstd * ((norm_weight * x) @ weight.T)`` (float32 accumulation, one pass);
    * ``add`` (with ``norm_weight``): the input is ``RMSNorm(x + add)``; returns
      ``(x + add, out)``, the residual stream and the product;
    * ``residual``: returns ``residual + x @ weight.T``.

    ``pdl``: launch as a programmatic dependent launch (Hopper): the first weight tile is read
    while the previous kernel finishes. Returns ``out`` ``[M, N]`` in ``x``'s dtype (or the pair above).
    """
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape != (n, k) or weight.stride(1) != 1:
        raise ValueError(f"norm_linear: weight must be a row-major [N, {k}], got {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    if add is not None and norm_weight is None:
        raise ValueError("norm_linear: add is fused into the input norm only (give norm_weight)")
    x = _rows(x, "x", k)
    cfg = config or linear_config(m, n, k)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x) if add is not None else None
    add = _rows(add, "add", k) if add is not None else None
    if residual is not None:
        if residual.shape != (m, n):
            raise ValueError(f"norm_linear: residual must be [{m}, {n}], got {tuple(residual.shape)}")
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_linear: norm_weight must be [{k}], got {tuple(norm_weight.shape)}")
    if m:
        grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
        _norm_linear_kernel[grid](
            x, add if add is not None else x, summed if summed is not None else x,
            norm_weight if norm_weight is not None else x, weight,
            residual if residual is not None else x, out,
            m, n, k, float(eps),
            x.stride(0), add.stride(0) if add is not None else 0, summed.stride(0) if summed is not None else 0,
            weight.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
            NORM=norm_weight is not None, ADD=add is not None, RESIDUAL=residual is not None, PDL=pdl,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_pdl_launch(pdl))
    return (summed, out) if add is not None else out


def _pdl_launch(pdl: bool) -> dict:
    """The launch option of a programmatic dependent launch (only when asked: the interpreter has none)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def _rms_norm_kernel(x_ptr, add_ptr, sum_ptr, w_ptr, out_ptr, N, eps, stride_x, stride_a, stride_s, stride_o,
                     ADD: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    dt = out_ptr.dtype.element_ty
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(add_ptr + row * stride_a + offs, mask=ok, other=0.0).to(tl.float32)).to(dt)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=ok)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(out_ptr + row * stride_o + offs, (w * (x * rstd).to(dt).to(tl.float32)).to(dt), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None,
             pdl: bool = False):
    """``weight * RMSNorm(x)`` of rows ``x`` ``[M, N]`` (the engine's :class:`~coldset.engine.model.RMSNorm`),
    one launch; with ``add``, of ``x + add``, returning ``(x + add, normed)``."""
    m, n = x.shape
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight must be [{n}], got {tuple(weight.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    if add is not None:
        if add.shape != (m, n):
            raise ValueError(f"rms_norm: add must be [{m}, {n}], got {tuple(add.shape)}")
        add = add if add.stride(1) == 1 else add.contiguous()
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if add is not None else None
    block = triton.next_power_of_2(n)
    if m:
        _rms_norm_kernel[(m,)](x, add if add is not None else x, summed if summed is not None else x, weight, out,
                               n, float(eps), x.stride(0), add.stride(0) if add is not None else 0,
                               summed.stride(0) if summed is not None else 0, out.stride(0),
                               ADD=add is not None, PDL=pdl, BLOCK=block, num_warps=min(16, max(1, block // 256)),
                               **_pdl_launch(pdl))
    return (summed, out) if add is not None else out


@triton.jit
def _decode_attention_kernel(qkv_ptr, nw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, mask_ptr, out_ptr,
                             S, eps, scale,
                             stride_qkv, stride_cos, stride_sin, stride_cb, stride_cs,
                             stride_mb, stride_ms, stride_out,
                             NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, REP: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, QK_NORM: tl.constexpr,
                             PDL: tl.constexpr):
    dt = out_ptr.dtype.element_ty
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs_d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    perm = (offs_d + half) % D  # rotate_half reads the other half ...
    sign = tl.where(offs_d < half, -1.0, 1.0)  # ... negating the second half moved to the first
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < REP
    heads = g * REP + offs_h  # the query heads of kv head g (transformers: head h uses kv head h // REP)
    # Before waiting on the previous kernel (the qkv projection), read what it does not write:
    # the slot, the rotary rows, the norm weights and the first block of cached keys and values
    # (earlier steps wrote them; this step's slot is taken from registers below).
    slot = tl.load(slot_ptr)
    cos = tl.load(cos_ptr + b * stride_cos + offs_d).to(tl.float32)
    sin = tl.load(sin_ptr + b * stride_sin + offs_d).to(tl.float32)
    if QK_NORM:  # per head: weight * RMSNorm, rows of nw are the q heads then the kv heads
        wq_ptrs = nw_ptr + heads[:, None] * D
        wq = tl.load(wq_ptrs + offs_d[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
        wq_sw = tl.load(wq_ptrs + perm[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
        wk_ptr = nw_ptr + (NH + g) * D
        wk = tl.load(wk_ptr + offs_d).to(tl.float32)
        wk_sw = tl.load(wk_ptr + perm).to(tl.float32)
    cache_b = b * stride_cb + g * D
    offs_s = tl.arange(0, BLOCK_S)
    valid = tl.load(mask_ptr + b * stride_mb + offs_s * stride_ms, mask=offs_s < S, other=0) != 0
    kv_off = cache_b + offs_s.to(tl.int64)[:, None] * stride_cs + offs_d[None, :]
    kt = tl.load(kc_ptr + kv_off, mask=valid[:, None], other=0.0)
    vt = tl.load(vc_ptr + kv_off, mask=valid[:, None], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    row = qkv_ptr + b * stride_qkv
    q_ptrs = row + heads[:, None] * D
    q = tl.load(q_ptrs + offs_d[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
    q_sw = tl.load(q_ptrs + perm[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
    k_ptr = row + (NH + g) * D
    k = tl.load(k_ptr + offs_d).to(tl.float32)
    k_sw = tl.load(k_ptr + perm).to(tl.float32)
    v = tl.load(row + (NH + NKV + g) * D + offs_d)
    if QK_NORM:
        rq = tl.rsqrt(tl.sum(q * q, axis=1) / D + eps)
        q = (wq * (q * rq[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        q_sw = (wq_sw * (q_sw * rq[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        rk = tl.rsqrt(tl.sum(k * k, axis=0) / D + eps)
        k = (wk * (k * rk).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        k_sw = (wk_sw * (k_sw * rk).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    q = (q * cos[None, :] + sign[None, :] * q_sw * sin[None, :]).to(dt)
    k = (k * cos + sign * k_sw * sin).to(dt)
    tl.store(kc_ptr + cache_b + slot * stride_cs + offs_d, k)
    tl.store(vc_ptr + cache_b + slot * stride_cs + offs_d, v)
    # Attention over the first S slots where the mask allows, online softmax in float32. The
    # slot written above is taken from registers (another thread of this program wrote it), and
    # each block's successor is loaded before the block's arithmetic.
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, D), dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        cur = s0 + offs_s
        nxt = cur + BLOCK_S
        valid_n = tl.load(mask_ptr + b * stride_mb + nxt * stride_ms, mask=nxt < S, other=0) != 0
        off_n = cache_b + nxt.to(tl.int64)[:, None] * stride_cs + offs_d[None, :]
        kt_n = tl.load(kc_ptr + off_n, mask=valid_n[:, None], other=0.0)
        vt_n = tl.load(vc_ptr + off_n, mask=valid_n[:, None], other=0.0)
        new = (cur == slot)[:, None]
        kt = tl.where(new, k[None, :], kt)
        vt = tl.where(new, v[None, :], vt)
        s = tl.dot(q, tl.trans(kt)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block of masked keys only
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dt), vt)
        m_i = m_new
        kt, vt, valid = kt_n, vt_n, valid_n
    o = (acc / l_i[:, None]).to(dt)
    tl.store(out_ptr + b * stride_out + heads[:, None] * D + offs_d[None, :], o, mask=h_ok[:, None])


def decode_attention(qkv: torch.Tensor, qk_norm_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                     num_heads: int, num_kv_heads: int, head_dim: int, eps: float, block_s: int = 64,
                     pdl: bool = False) -> torch.Tensor:
    """One decode token per sequence: ``[B, num_heads * head_dim]`` attention output.

    ``qkv`` ``[B, (nh + 2 nkv) D]`` (q heads, k heads, v heads: the engine's fused projection);
    ``qk_norm_weight`` ``[nh + nkv, D]`` or None; ``cos``/``sin`` ``[B, 1, D]``; caches
    ``[B, max_seq, nkv, D]`` (contiguous), written at slot ``slots[0]``; ``mask`` bool
    ``[B, 1, 1, S]``: which of the first ``S`` slots each sequence attends to. Softmax scale
    ``1/sqrt(D)``, as SDPA's default. ``pdl``: a programmatic dependent launch (Hopper): the
    cached keys and values are read while the qkv projection finishes.
    """
    bsz = qkv.shape[0]
    nh, nkv, d = num_heads, num_kv_heads, head_dim
    if d & (d - 1) or d < 16:
        raise ValueError(f"decode_attention: head_dim {d} must be a power of two >= 16")
    if nh % nkv:
        raise ValueError(f"decode_attention: {nh} query heads are not a multiple of {nkv} kv heads")
    if qkv.shape != (bsz, (nh + 2 * nkv) * d) or qkv.stride(1) != 1:
        raise ValueError(f"decode_attention: qkv must be row-major [B, {(nh + 2 * nkv) * d}], got {tuple(qkv.shape)}")
    want = (bsz, k_cache.shape[1], nkv, d)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if tuple(c.shape) != want or not c.is_contiguous():
            raise ValueError(f"decode_attention: {name} must be contiguous {want}, got {tuple(c.shape)}")
    if mask.dim() != 4 or mask.shape[:3] != (bsz, 1, 1) or mask.dtype != torch.bool:
        raise ValueError(f"decode_attention: mask must be bool [B, 1, 1, S], got {tuple(mask.shape)} {mask.dtype}")
    seq_len = mask.shape[-1]
    if seq_len > k_cache.shape[1]:
        raise ValueError(f"decode_attention: mask covers {seq_len} slots, the cache holds {k_cache.shape[1]}")
    if slots.numel() != 1:
        raise ValueError(f"decode_attention: one token per sequence (one slot), got {slots.numel()} slots")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (bsz, 1, d) or t.stride(-1) != 1:
            raise ValueError(f"decode_attention: {name} must be [B, 1, {d}], got {tuple(t.shape)}")
    if qk_norm_weight is not None and (qk_norm_weight.shape != (nh + nkv, d) or not qk_norm_weight.is_contiguous()):
        raise ValueError(f"decode_attention: qk_norm_weight must be contiguous [{nh + nkv}, {d}]")
    out = torch.empty((bsz, nh * d), dtype=qkv.dtype, device=qkv.device)
    mask_u8 = mask.view(torch.uint8)
    rep = nh // nkv
    if bsz:
        _decode_attention_kernel[(bsz, nkv)](
            qkv, qk_norm_weight if qk_norm_weight is not None else qkv, cos, sin, k_cache, v_cache, slots,
            mask_u8, out, seq_len, float(eps), d ** -0.5,
            qkv.stride(0), cos.stride(0), sin.stride(0), k_cache.stride(0), k_cache.stride(1),
            mask_u8.stride(0), mask_u8.stride(3), out.stride(0),
            NH=nh, NKV=nkv, D=d, REP=rep, BLOCK_H=max(16, triton.next_power_of_2(rep)), BLOCK_S=block_s,
            QK_NORM=qk_norm_weight is not None, PDL=pdl, num_warps=4, **_pdl_launch(pdl))
    return out


# --------------------------------------------------------------------------------------------
# One token: the GEMV and the router
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemvConfig:
    """Launch configuration of :func:`gemv`: each program reads ``block_n`` whole weight rows
    (all of K in one load, so every byte of the tile is in flight at once and, with ``pdl``, read
    before the previous kernel finishes), ``iters`` such row blocks one after the other (the next
    block's load issued before the current block's arithmetic; the input row and its norm are
    computed once per program), ``num_warps`` warps. The reduction order depends on the config,
    so one config per shape is fixed in :func:`gemv_config`."""

    block_n: int
    iters: int = 1
    num_warps: int = 4


def gemv_config(n: int, k: int, weight_bytes: int = 2) -> GemvConfig:
    """The fixed config for an ``[n, k]`` weight at one token, from an H200 sweep over
    Qwen3-30B-A3B's weights (48 layers'), where it beat ``norm_linear`` and cuBLAS for qkv and
    o_proj: 8 KB of weight rows a program, and for matrices over 64 MB (the LM head) 16 KB row
    blocks in a loop of 4, 8 warps.

    ``weight_bytes``: bytes of one weight element (2: bf16/fp16, the sweep's; 1: block-FP8 weights,
    ``gemv(..., weight_scale=...)``). The rule is in bytes, so FP8 gets the same 8 KB (16 KB) a
    program, twice the rows of a 2-byte weight of the same K (qkv: 4 rows of 2,048 where bf16 has 2).
    Why bytes: a program's rows are all in flight at once, and the read rate needs bytes in flight
    per SM, not elements. FP8 at this rule was timed against bf16 once (docs/history.md, "FP8
    attention GEMVs"); it has no sweep of its own."""
    if weight_bytes not in (1, 2):
        raise ValueError(f"gemv_config: weight_bytes must be 1 (FP8) or 2 (bf16/fp16), got {weight_bytes}")
    kp = triton.next_power_of_2(k)
    block_n = max(1, 8192 // (kp * weight_bytes))
    if n * k * weight_bytes > 64 * 2**20:
        return GemvConfig(max(block_n, 8 // weight_bytes), 4, 8)
    return GemvConfig(block_n, 1, 4)


def pdl_default(m: int, device: torch.device) -> bool:
    """Whether the fused decode step launches its kernels as programmatic dependent launches when
    not told (:meth:`coldset.engine.model.MoEModel.compile_decode`): at one token on Hopper or newer,
    where each kernel's weights stream while its predecessor finishes and the step was faster on the
    H200; not at 8 tokens, where it was slower. The kernels' arithmetic is the same either way: the
    same bits."""
    return m == 1 and pdl_available(device)


@triton.jit
def _gemv_rows(w_ptr, s_ptr, offs_n, n_ok, rk, k_ok, stride_wn, stride_sn, K: tl.constexpr, GP: tl.constexpr,
               FP8: tl.constexpr):
    """A block of whole weight rows: ``[BLOCK_N, KP]``, or for FP8 ``[BLOCK_N, GP, 128]`` (the
    row's 128-column groups apart) with the rows' scales ``[BLOCK_N, GP]``."""
    if FP8:
        rg = tl.arange(0, GP)
        rc = tl.arange(0, 128)
        col = rg[:, None] * 128 + rc[None, :]  # [GP, 128]
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None, None] * stride_wn + col[None, :, :],
                    mask=n_ok[:, None, None] & (col < K)[None, :, :], other=0.0)
        sc = tl.load(s_ptr + offs_n.to(tl.int64)[:, None] * stride_sn + rg[None, :],
                     mask=n_ok[:, None] & (rg * 128 < K)[None, :], other=0.0)
    else:
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + rk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        sc = w  # unused
    return w, sc


@triton.jit
def _gemv_kernel(x_ptr, add_ptr, sum_ptr, nw_ptr, w_ptr, s_ptr, res_ptr, out_ptr, N, eps, stride_wn, stride_sn,
                 K: tl.constexpr, KP: tl.constexpr, GP: tl.constexpr, FP8: tl.constexpr,
                 NORM: tl.constexpr, ADD: tl.constexpr,
                 RESIDUAL: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, ITERS: tl.constexpr):
    dt = out_ptr.dtype.element_ty
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rk = tl.arange(0, KP)
    k_ok = rk < K
    offs_n = tl.program_id(0) * (BLOCK_N * ITERS) + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # The first row block's weights (never written by the previous kernel) before the wait.
    w, sc = _gemv_rows(w_ptr, s_ptr, offs_n, n_ok, rk, k_ok, stride_wn, stride_sn, K, GP, FP8)
    if NORM:
        nw = tl.load(nw_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    a = tl.load(x_ptr + rk, mask=k_ok, other=0.0)
    if ADD:  # the residual stream x + add in the model dtype, written once (program 0)
        a = (a.to(tl.float32) + tl.load(add_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)).to(dt)
        tl.store(sum_ptr + rk, a, mask=k_ok & (tl.program_id(0) == 0))
    af = a.to(tl.float32)
    if NORM:  # RMSNorm(x) @ W.T = rstd * ((weight * x) @ W.T), as norm_linear computes it
        rstd = tl.rsqrt(tl.sum(af * af, axis=0) / K + eps)
        af = (af * nw).to(dt).to(tl.float32)
    for i in tl.static_range(ITERS):
        if i + 1 < ITERS:
            offs_nn = offs_n + BLOCK_N
            n_ok_n = offs_nn < N
            w_next, sc_next = _gemv_rows(w_ptr, s_ptr, offs_nn, n_ok_n, rk, k_ok, stride_wn, stride_sn, K, GP, FP8)
        if FP8:  # each row's 128-column group summed in fp32, times the group's scale, the groups summed
            part = tl.sum(w.to(tl.float32) * tl.reshape(af, (GP, 128))[None, :, :], axis=2)
            acc = tl.sum(part * sc, axis=1)
        else:
            acc = tl.sum(w.to(tl.float32) * af[None, :], axis=1)
        if NORM:
            acc = acc * rstd
        y = acc.to(dt)
        if RESIDUAL:
            y = (y.to(tl.float32) + tl.load(res_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)).to(dt)
        tl.store(out_ptr + offs_n, y, mask=n_ok)
        if i + 1 < ITERS:
            w = w_next
            sc = sc_next
            offs_n = offs_nn
            n_ok = n_ok_n


def _check_weight_scale(weight: torch.Tensor, weight_scale: torch.Tensor | None, n: int, k: int) -> None:
    """:class:`ValueError` naming the tensor when ``weight`` / ``weight_scale`` are not a pair
    :func:`gemv` reads: a bf16/fp16 weight alone, or a float8_e4m3fn weight with its float32
    per-row scale table ``[N, ceil(K / 128)]`` on the same device."""
    if weight.dtype == fp8.FP8_DTYPE:
        if weight_scale is None:
            raise ValueError(f"gemv: weight is {weight.dtype}: give its block scales as weight_scale, a float32 "
                             f"[{n}, {fp8.scale_grid(n, k)[1]}] per-row table (coldset.core.fp8.row_scales)")
        want = (n, fp8.scale_grid(n, k)[1])
        if weight_scale.dtype != torch.float32:
            raise ValueError(f"gemv: weight_scale must be float32, got {weight_scale.dtype}")
        if tuple(weight_scale.shape) != want:
            raise ValueError(f"gemv: weight_scale must be the per-row table {list(want)} of a [{n}, {k}] weight "
                             f"(one scale per row and {fp8.BLOCK}-column group: each row's block scales, "
                             f"coldset.core.fp8.row_scales), got {list(weight_scale.shape)}")
        if weight_scale.stride(1) != 1:
            raise ValueError(f"gemv: weight_scale must be row-major (stride 1 along its groups), got strides "
                             f"{weight_scale.stride()}")
        if weight_scale.device != weight.device:
            raise ValueError(f"gemv: weight_scale is on {weight_scale.device}, weight on {weight.device}")
        return
    if weight.dtype == torch.float8_e5m2:
        raise ValueError(f"gemv: weight dtype {weight.dtype} is not supported (block-FP8 weights are "
                         f"{fp8.FP8_DTYPE})")
    if weight_scale is not None:
        raise ValueError(f"gemv: weight_scale is given but weight is {weight.dtype}; scales go with a "
                         f"{fp8.FP8_DTYPE} weight only")


def gemv(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         add: torch.Tensor | None = None, residual: torch.Tensor | None = None, config: GemvConfig | None = None,
         pdl: bool = False, weight_scale: torch.Tensor | None = None):
    """:func:`norm_linear` for one token (``x`` ``[1, K]``), the same options and results
    (``norm_weight``, ``add`` returning ``(x + add, out)``, ``residual``), as a GEMV built to stream
    the weights at the HBM rate: each program loads whole weight rows at once (all of K), so the
    bytes in flight per SM are what the read rate needs and, with ``pdl``, a program's first tile is
    read while the previous kernel finishes. Why beside norm_linear: at one token that kernel's
    K loop keeps two tiles in flight, too few bytes for the HBM read rate at one token.

    ``weight_scale`` (block-FP8 weights, weight-only): ``weight`` is float8_e4m3fn ``[N, K]`` and
    ``weight_scale`` its float32 per-row scale table ``[N, ceil(K / 128)]`` (:func:`coldset.core.fp8.row_scales`
    of a checkpoint's ``weight_scale_inv``). Each program converts its e4m3 rows to float32 in
    registers (exact), multiplies them by the float32 input (normed and rounded to x's dtype as for
    bf16), sums each row's 128-column groups in fp32, multiplies each group's sum by its scale and
    sums the groups in fp32: ``sum_g s[n, g] * sum_{k in g} q[n, k] * a[k]``, the order of a
    block-scaled GEMM (the scale on the group's partial sum, one multiply per 128 products; the
    weight is never rounded to bf16, so this is not bitwise the dequantized bf16 weight's GEMV).
    A partial last group (K not a multiple of 128) has its own scale, as the checkpoint grid does;
    any K and N. The norm, add and residual are the bf16 path's, and a bf16/fp16 weight runs the
    arithmetic it ran before (the FP8 code is compiled out). Reference:
    :func:`coldset.kernels.reference.torch_gemv`.
    """
    m, k = x.shape
    n = weight.shape[0]
    if m != 1:
        raise ValueError(f"gemv: one token (x [1, K]), got x {tuple(x.shape)}; use norm_linear")
    if weight.shape != (n, k) or weight.stride(1) != 1:
        raise ValueError(f"gemv: weight must be a row-major [N, {k}], got {tuple(weight.shape)} strides {weight.stride()}")
    _check_weight_scale(weight, weight_scale, n, k)
    fp8_weight = weight_scale is not None
    if add is not None and norm_weight is None:
        raise ValueError("gemv: add is fused into the input norm only (give norm_weight)")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"gemv: norm_weight must be [{k}], got {tuple(norm_weight.shape)}")
    x = _rows(x, "x", k)
    add = _rows(add, "add", k) if add is not None else None
    if add is not None and add.shape[0] != 1:
        raise ValueError(f"gemv: add must be [1, {k}], got {tuple(add.shape)}")
    if residual is not None:
        if residual.shape != (1, n):
            raise ValueError(f"gemv: residual must be [1, {n}], got {tuple(residual.shape)}")
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
    cfg = config or gemv_config(n, k, 1 if fp8_weight else 2)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x) if add is not None else None
    # FP8: whole 128-column groups a row in registers (KP at least 128), GP of them (a power of two)
    kp = max(128, triton.next_power_of_2(k)) if fp8_weight else triton.next_power_of_2(k)
    grid = (triton.cdiv(n, cfg.block_n * cfg.iters),)
    _gemv_kernel[grid](
        x, add if add is not None else x, summed if summed is not None else x,
        norm_weight if norm_weight is not None else x, weight, weight_scale if fp8_weight else x,
        residual if residual is not None else x, out,
        n, float(eps), weight.stride(0), weight_scale.stride(0) if fp8_weight else 0, K=k, KP=kp,
        GP=max(1, kp // 128), FP8=fp8_weight,
        NORM=norm_weight is not None, ADD=add is not None, RESIDUAL=residual is not None, PDL=pdl,
        BLOCK_N=cfg.block_n, ITERS=cfg.iters, num_warps=cfg.num_warps, **_pdl_launch(pdl))
    return (summed, out) if add is not None else out


# The register cap of the router launch with lookahead's decision (``route(..., ahead=...)``) where
# its grid needs more than two blocks an SM. ptxas gives that launch the registers its last
# program's decision asks for, and a launch has one count for all its programs (seen by compiling it
# for sm90 on the CPU). Uncapped, a grid of 8 tokens at E 128 fits two or three blocks of
# 4 warps an SM: two waves on the H200's 132 SMs, the second loading its router rows after the first.
# At 128 registers four fit (one wave) with a few bytes of stack; below 128 it spills more, so a
# grid past four blocks an SM keeps 128. The cap changes the register allocation and the schedule,
# not the operations, so the routing's bits are the same (bench cache's checked pass at b8 compares
# the logits).
ROUTE_AHEAD_MAXNREG = 128
ROUTE_WARPS = 4  # the router launch's warps (its routing's bits depend on them)
_SM_REGISTERS = 65536  # registers an SM (sm70 to sm90)


def _route_register_cap(programs: int, num_warps: int, sms: int) -> int | None:
    """``maxnreg`` for the router launch with lookahead's decision: ``None`` (no cap) where the grid
    fits two blocks an SM (any count up to 255 does), else the most that lets one wave hold it
    (a multiple of 8), never below ``ROUTE_AHEAD_MAXNREG``."""
    per_sm = -(-int(programs) // int(sms))
    if per_sm <= 2:
        return None
    return max(ROUTE_AHEAD_MAXNREG, min(255, _SM_REGISTERS // (per_sm * num_warps * 32)) // 8 * 8)


_SM_COUNTS: dict = {}


def _sm_count(device: torch.device) -> int:
    """The device's SM count (a property read once per device)."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNTS:
        _SM_COUNTS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNTS[key]


@triton.jit(do_not_specialize=PER_LAYER_ARGS, do_not_specialize_on_alignment=PER_LAYER_VIEWS)
def _route_kernel(x_ptr, nw_ptr, w_ptr, h_ptr, logit_ptr, count_ptr, ids_ptr, wts_ptr, eps,
                  stride_x, stride_h, stride_we,
                  layer, row_map_ptr, last_use_ptr, use_count_ptr, tick_ptr, totals_ptr, history_ptr, groups_ptr,
                  hist_cap, new_ptr, m_ptr,
                  owner_ptr, victims_ptr, C, inflight_ptr, new_step, fw_ptr, fc_ptr, target, pf_victims_ptr,
                  pf_new_ptr, pf_m_ptr, pred_hist_ptr, pf_hist_ptr, width, guard, gate_ptr, L, WM, lead_unit, gate_on,
                  M: tl.constexpr, MP: tl.constexpr,
                  H: tl.constexpr, HP: tl.constexpr, E: tl.constexpr, EP: tl.constexpr,
                  K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr,
                  PDL: tl.constexpr, RECORD: tl.constexpr, TRIGGER: tl.constexpr,
                  LOOKAHEAD: tl.constexpr = False, FORECAST: tl.constexpr = False, SCAN: tl.constexpr = 2,
                  MV: tl.constexpr = 2, TP: tl.constexpr = 2, WP: tl.constexpr = 2, MPV: tl.constexpr = 2,
                  ZB: tl.constexpr = 2, NI: tl.constexpr = 2, WMP: tl.constexpr = 2, COPY: tl.constexpr = 1,
                  SHIFT: tl.constexpr = 1):
    dt = h_ptr.dtype.element_ty
    if PDL and not TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    rk = tl.arange(0, HP)
    k_ok = rk < H
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    w = tl.load(w_ptr + offs_e.to(tl.int64)[:, None] * stride_we + rk[None, :],
                mask=e_ok[:, None] & k_ok[None, :], other=0.0)
    nw = tl.load(nw_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
    if FORECAST:  # lookahead: the same rows of layer `target`'s router (contiguous [E, H]), also before the wait
        fw = tl.load(fw_ptr + offs_e.to(tl.int64)[:, None] * H + rk[None, :], mask=e_ok[:, None] & k_ok[None, :],
                     other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if TRIGGER:  # the next launch (a slot cache's fill) may start; not before the previous kernel is done,
        tl.extra.cuda.gdc_launch_dependents()  # so its waiting blocks take no SM from a kernel still running
    # Token m = program_id(1): the post-attention norm, as rms_norm computes it (every program the
    # same bits; program (0, m) writes it: the experts' input), then this program's router logits
    # in the model dtype. (One token a program: in a loop over the tokens in one program each
    # token's loads would wait on the previous token's sums.)
    m = tl.program_id(1)
    x = tl.load(x_ptr + m * stride_x + rk, mask=k_ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    h = (nw * (x * rstd).to(dt).to(tl.float32)).to(dt)
    tl.store(h_ptr + m * stride_h + rk, h, mask=k_ok & (pid == 0))
    logit = tl.sum(w.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
    tl.store(logit_ptr + m * E + offs_e, logit.to(logit_ptr.dtype.element_ty), mask=e_ok)
    if FORECAST:  # the forecast of layer `target` on the same input, float32 (the decisions rank it)
        fl = tl.sum(fw.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
        tl.store(fc_ptr + m * E + offs_e, fl, mask=e_ok)
    # The last program to arrive ranks every token's E logits (a ticket counter: the barrier and
    # the acquire-release atomic order every program's logit stores before the last one's loads;
    # the last one resets the counter for the next launch). Then _softmax_topk_kernel's arithmetic.
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
        if RECORD or LOOKAHEAD:  # a slot cache's scalars, loaded while the logits are ranked
            scalars = group_scalars(tick_ptr, totals_ptr, groups_ptr)
        # All tokens at once ([MP, EP], a token's logits within one warp), so the k rounds cost
        # the same at 8 tokens as at one. Rows past M repeat row M - 1 and are not stored.
        offs = tl.arange(0, EP)
        ok = offs < E
        offs_m = tl.arange(0, MP)
        rows = tl.minimum(offs_m, M - 1)
        ranks = tl.arange(0, KP)
        keep = (offs_m < M)[:, None] & (ranks < K)[None, :]
        lg = tl.load(logit_ptr + rows[:, None] * E + offs[None, :], mask=ok[None, :], other=float("-inf"),
                     cache_modifier=".cg").to(tl.float32)
        top = tl.max(lg, axis=1)
        denom = tl.sum(tl.where(ok[None, :], tl.exp(lg - top[:, None]), 0.0), axis=1)
        ids = tl.zeros((MP, KP), dtype=tl.int64)
        probs = tl.zeros((MP, KP), dtype=tl.float32)
        left = tl.where(ok[None, :], lg, float("-inf"))
        for r in tl.static_range(K):
            best = tl.max(left, axis=1)
            idx = tl.min(tl.where(left == best[:, None], offs[None, :], EP), axis=1)
            ids = tl.where(ranks[None, :] == r, idx.to(tl.int64)[:, None], ids)
            probs = tl.where(ranks[None, :] == r, (tl.exp(best - top) / denom)[:, None], probs)
            left = tl.where(offs[None, :] == idx[:, None], float("-inf"), left)
        if RENORMALIZE:
            probs = probs / tl.sum(probs, axis=1)[:, None]
        out = offs_m[:, None] * K + ranks[None, :]
        tl.store(ids_ptr + out, ids, mask=keep)
        tl.store(wts_ptr + out, probs.to(wts_ptr.dtype.element_ty), mask=keep)
        tl.store(count_ptr, 0)
        if RECORD or LOOKAHEAD:  # the selections as one lane each: token-major, rank within the token
            pos = tl.arange(0, MP * KP)
            tok = pos // KP
            rank = pos % KP
            lanes, sel, valid = tl.reshape(ids, (MP * KP,)), tok * K + rank, (tok < M) & (rank < K)
        if RECORD:  # a slot cache's decisions up to its victims, on the selections in registers
            record_group(lanes, sel, valid, M * K, layer,
                         row_map_ptr, last_use_ptr, use_count_ptr, tick_ptr, totals_ptr, history_ptr, groups_ptr,
                         hist_cap, new_ptr, m_ptr, scalars, E)
        if LOOKAHEAD:  # lookahead's record and demand decisions likewise (the list: ahead_list's launch)
            ahead_group(lanes, sel, valid, M * K, layer, scalars, 0,
                        row_map_ptr, owner_ptr, last_use_ptr, use_count_ptr, tick_ptr, totals_ptr, history_ptr,
                        groups_ptr, hist_cap, victims_ptr, new_ptr, m_ptr, C, inflight_ptr, new_step, fc_ptr, M,
                        target, pf_victims_ptr, pf_new_ptr, pf_m_ptr, pred_hist_ptr, pf_hist_ptr, width, guard,
                        gate_ptr, L, WM, lead_unit, gate_on, E, SCAN, MV, FORECAST, K, KP, TP, EP, WP, MPV, ZB, NI, WMP,
                        COPY, SHIFT, False, False)


def route(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor, top_k: int,
          renormalize: bool, counter: torch.Tensor, weights_dtype: torch.dtype = torch.float32,
          block_e: int = 2, pdl: bool = False, return_logits: bool = False, record: tuple | None = None,
          trigger: bool = False, ahead: tuple | None = None):
    """The post-attention norm, the router GEMV and its softmax + top-k in one launch, for a few
    decode tokens ``x`` ``[M, H]``: ``(h, topk_ids, topk_weights)`` with ``h = weight * RMSNorm(x)``
    (:func:`rms_norm`'s arithmetic) the experts' input ``[M, H]``, ``topk_ids`` ``[M, k]`` int64 and
    ``topk_weights`` ``[M, k]`` in ``weights_dtype`` (float32 as :func:`coldset.kernels.softmax_topk`
    gives them, or the model dtype: the same values cast once, as the engine casts them for the
    experts). With ``return_logits`` also the router logits ``[M, E]`` (model dtype, what was ranked).

    Why one launch: at decode the router would otherwise be a cuBLAS GEMM, a top-k launch, a norm
    launch and a cast launch a layer, each mostly launch latency. Here ``cdiv(E, block_e)`` programs per token each read
    ``block_e`` router rows (before waiting on the previous kernel, with ``pdl``), compute the
    token's norm and their logits (float32 sums, rounded to the model dtype as F.linear's output
    is), and the last program to finish (a ticket on ``counter``, an int32 ``[1]`` zero that the launch leaves zero again;
    one per call site, not shared by launches that may overlap) ranks the logits exactly as
    :func:`coldset.kernels.triton_route.triton_softmax_topk` does: ties to the lowest expert id,
    ranking on the logits, softmax in float32. No result depends on which program finishes last.
    That program ranks all tokens at once (an ``[M, E]`` tile), not one after the other.

    ``record`` (:func:`coldset.kernels.triton_slots.route_record_args`): the same program then
    records the group for a slot cache (hits, recency, counts, counters, the missed instances:
    :func:`coldset.kernels.triton_slots.record_group`) on the selections it holds in registers,
    so a cached layer spends no launch on its decisions; the victims and the fill are the next
    launch's (:func:`coldset.kernels.triton_slots.choose_and_fill`). The routing arithmetic (and
    the launch's warps) are the same with or without it: the same bits. ``trigger``: let the next
    launch (a programmatic dependent one) start once the kernel before this one is done, with or
    without ``pdl``.

    ``ahead`` (:func:`coldset.kernels.triton_slots.route_ahead_args`, instead of ``record``):
    ``lookahead``'s record and demand decisions in the same launch. Every program also reads the
    same ``block_e`` rows of layer ``l + depth``'s router (before the wait, as its own) and writes
    its token's float32 forecast logits on ``h`` (the router input) into the cache's
    ``forecast_out``; the last program then runs :func:`coldset.kernels.triton_slots.ahead_group`
    without its list (the group's record, the in-flight clearing of a new step, the demand victims
    with the in-flight rule and their commit) on the selections in registers. The forecast's list
    and the prefetch decisions are the next launch's on the cache's decisions stream
    (:func:`coldset.kernels.triton_slots.ahead_list`, beside the layer's experts). Why: a cached
    lookahead layer then costs the router's launch and the demand fill on the critical path, not
    a forecast GEMV launch and a decisions launch more, nor the list in this launch's last program
    (``bench cache --profile`` at residency 1.0 times each: BENCHMARKS.md section 4). The routing (``h``, ids, weights) is the
    same bits with or without it (the same arithmetic and warps; checked under Triton's interpreter
    and on the H200). Where the grid needs more than two blocks an SM the launch is capped at
    :func:`_route_register_cap`'s registers (b8: 128, one wave).
    """
    m, hidden = x.shape
    num_experts = gate_weight.shape[0]
    if gate_weight.shape != (num_experts, hidden) or gate_weight.stride(1) != 1:
        raise ValueError(f"route: gate_weight must be a row-major [E, {hidden}], got {tuple(gate_weight.shape)}")
    if norm_weight.shape != (hidden,):
        raise ValueError(f"route: norm_weight must be [{hidden}], got {tuple(norm_weight.shape)}")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"route: top_k={top_k} must be in [1, {num_experts}]")
    if counter.dtype != torch.int32 or counter.numel() != 1 or counter.device != x.device:
        raise ValueError(f"route: counter must be an int32 [1] on {x.device}, got {counter.dtype} "
                         f"{tuple(counter.shape)} on {counter.device}")
    x = x if x.stride(1) == 1 else x.contiguous()
    h = torch.empty((m, hidden), dtype=x.dtype, device=x.device)
    logits = torch.empty((m, num_experts), dtype=x.dtype, device=x.device)
    ids = torch.empty((m, top_k), dtype=torch.int64, device=x.device)
    weights = torch.empty((m, top_k), dtype=weights_dtype, device=x.device)
    if record is not None and len(record) != 11:
        raise ValueError(f"route: record must be triton_slots.route_record_args(...) (11 values), got {len(record)}")
    meta = {}
    if ahead is not None:
        if record is not None:
            raise ValueError("route: record and ahead are two policies' decisions; give one")
        if len(ahead) != 3 or len(ahead[0]) != 11 or len(ahead[1]) != 20:
            raise ValueError("route: ahead must be triton_slots.route_ahead_args(...) (record, ahead, sizes)")
        record, extra, sizes = ahead
        fw, fc = extra[5], extra[6]
        if sizes["FORECAST"] and (fw.shape != (num_experts, hidden) or not fw.is_contiguous()):
            raise ValueError(f"route: the forecast router must be a contiguous [{num_experts}, {hidden}], got "
                             f"{tuple(fw.shape)}")
        if fc.dtype != torch.float32 or not fc.is_contiguous() or fc.dim() != 2 or fc.shape[0] < m \
                or fc.shape[1] != num_experts:
            raise ValueError(f"route: the forecast buffer must be float32 contiguous [>= {m}, {num_experts}], got "
                             f"{fc.dtype} {tuple(fc.shape)}")
        meta = dict(LOOKAHEAD=True, TP=max(2, triton.next_power_of_2(m)), **sizes)
        if x.is_cuda:
            cap = _route_register_cap(triton.cdiv(num_experts, block_e) * m, ROUTE_WARPS, _sm_count(x.device))
            if cap is not None:
                meta["maxnreg"] = cap
    else:
        extra = (counter, counter, 0, counter, 0, counter, counter, 0) + (counter,) * 5 + (0, 0, counter, 0, 0, 0, 0)
    if m:
        rec = record if record is not None else (0,) + (counter,) * 7 + (1, counter, counter)
        _route_kernel[(triton.cdiv(num_experts, block_e), m)](
            x, norm_weight, gate_weight, h, logits, counter, ids, weights, float(eps),
            x.stride(0), h.stride(0), gate_weight.stride(0), *rec, *extra, M=m, MP=triton.next_power_of_2(m),
            H=hidden, HP=triton.next_power_of_2(hidden), E=num_experts, EP=triton.next_power_of_2(num_experts),
            K=top_k, KP=triton.next_power_of_2(top_k), BLOCK_E=block_e, RENORMALIZE=renormalize, PDL=pdl,
            RECORD=record is not None and ahead is None, TRIGGER=bool(trigger), num_warps=ROUTE_WARPS, **meta,
            **_pdl_launch(pdl))
    return (h, ids, weights, logits) if return_logits else (h, ids, weights)
