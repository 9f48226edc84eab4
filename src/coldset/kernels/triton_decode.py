"""The decode step's non-expert work in few launches (CUDA, Triton): one token per sequence.

Why: at decode batch sizes the step outside the routed experts is latency, not bytes. The
compiled region (Inductor) still ran ~13 kernels a layer for ~38 MB of attention and router
weights: the input norm, the qkv GEMV, qk-norm + RoPE, the KV write, the mask's expansion, SDPA,
the o_proj GEMV and its split-K reduction, the residual add and the post-attention norm, each with
its launch gap. Here a layer is four launches up to the router's input
(:func:`coldset.model.fused_layer_before_experts`):

* :func:`norm_linear` with ``add``: the residual add that ends the previous layer, the input
  RMSNorm and the qkv projection (every program accumulates the row's mean square beside its
  product, 4 KB of input; program 0 writes the new residual stream). From 2 tokens on the
  engine runs :func:`rms_norm` with ``add`` and cuBLAS instead (:func:`fuse_norm_into_linear`);
* :func:`decode_attention`: per (sequence, kv head), qk-norm, RoPE, the KV-cache write and
  attention of the head's query group over the valid cache slots (GQA without repeating K/V);
* :func:`norm_linear` with ``residual``: o_proj plus the residual add;
* :func:`rms_norm`: the post-attention norm (the router's input).

Numerics follow the engine's (:mod:`coldset.model`) up to rounding: norms in float32 (in
:func:`norm_linear` the input is ``weight * x`` rounded once and the product scaled by the row's
rstd in float32, the same function with one rounding fewer), softmax in float32 with the
probabilities cast to the model dtype for the value product (as flash attention does). Every
reduction has a fixed order (no atomics, no split-K), so a step is bitwise reproducible and
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
    """The fixed launch config for ``m`` tokens against an ``[n, k]`` weight: the fastest of
    BENCHMARKS.md's sweep (issue 13, fourth session; H200, Qwen3-30B-A3B's qkv ``[5120, 2048]``
    and o_proj ``[2048, 4096]`` over 48 layers' weights) for its ``k``."""
    if m == 1:
        return LinearConfig(1, 16, 1024, num_warps=8, num_stages=3) if k >= 4096 else \
            LinearConfig(1, 8, 512, num_warps=4, num_stages=1)
    return LinearConfig(16, 16, 256, num_warps=4, num_stages=4)


def fuse_norm_into_linear(m: int) -> bool:
    """Whether the decode step's input norm goes into the qkv GEMV (:func:`norm_linear`) at ``m``
    tokens, or runs as :func:`rms_norm` before cuBLAS: the fused GEMV is the faster at one token,
    cuBLAS at 8 (15.5 against 8.0 µs for the qkv projection on the H200, BENCHMARKS.md)."""
    return m == 1


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
    """``weight * RMSNorm(x)`` of rows ``x`` ``[M, N]`` (the engine's :class:`~coldset.model.RMSNorm`),
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
