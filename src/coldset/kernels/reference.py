"""The torch experts path: the CPU implementation and the reference the Triton kernel is checked against.

Block-FP8 pools (``pools.is_fp8``, :mod:`coldset.core.fp8`) run :func:`_torch_scaled_experts_chunk`: each
expert's weights dequantized (``fp8.float() * scale_inv`` per 128 x 128 block) and the activations
quantized per token group of 128 (:func:`coldset.core.fp8.quantize_activations`) at the two points the
Triton FP8 kernel quantizes them (the tokens once per call; the intermediate SiLU(gate) * up once,
after its rounding to the activation dtype), with float32 GEMMs, so that the CPU and CUDA
paths compute the same quantity (the order of the float32 sums differs, so they agree to a
tolerance, not bitwise). ``w8a16=True`` is the reference of the FP8 kernel's weight-only mode
(KernelConfig ``w8a16``): the same with no activation quantized (the tokens and the intermediate,
rounded to the activation dtype, enter the float32 GEMMs as they are).

MXFP4 pools (``pools.is_mxfp4``, :mod:`coldset.core.mxfp4`) run the same function weight-only, as
the Triton MXFP4 kernel computes: each expert's weights dequantized exactly
(:func:`coldset.core.mxfp4.dequantize`, e2m1 times 2^(s - 127), which bf16 and float32 both hold),
the tokens and the intermediate (rounded to the activation dtype) unquantized, float32 GEMMs.

Expert biases and the activation (``pools.w13_bias``, ``pools.w2_bias``, ``pools.activation``:
:mod:`coldset.kernels.tiers`, :mod:`coldset.kernels.activation`) enter where transformers'
``GptOssExperts`` adds them. On float pools every step rounds in the model dtype as there: the
w13 product, then ``+ w13_bias``, then the activation op by op
(:func:`~coldset.kernels.activation.torch_activation`), the w2 product, then ``+ w2_bias``, then the
routing weight. On block-FP8 pools the biases are added to the float32 products (the kernel's
accumulators) before the activation and before the routing weight. Biases are read by expert id
(``w13_bias[layer, expert]``), so they never depend on the placement either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from coldset.core import fp8, mxfp4
from coldset.kernels.activation import torch_activation

if TYPE_CHECKING:  # annotations only: the kernels do not import the tiers (no import circle)
    from coldset.kernels.tiers import ExpertPools


def torch_softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids [T, k] int64, topk_weights [T, k] float32)``: the router's choice as Hugging
    Face computes it (softmax in float32 over ``logits`` ``[T, E]``, top-k, optional
    renormalisation over the k). The CPU path and the reference for the Triton kernel."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_ids, topk_weights


def torch_experts(
    pools: ExpertPools,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    token_chunk: int | None = None,
    w8a16: bool = False,
) -> torch.Tensor:
    """Routed-expert output for tokens ``x`` ``[T, H]`` of MoE layer ``layer``.

    Loops over the experts the batch selected (as Hugging Face's reference MoE blocks do), reads
    each expert's weights through the row map, and accumulates ``weight * expert(x)`` per token in
    ``x``'s dtype. The loop order depends only on the expert ids, never on where an expert lives,
    so any placement gives bitwise the same result as the all-hot layout.

    ``token_chunk`` (the CPU path's tunable knob, see :mod:`coldset.kernels.tune`) processes the tokens
    in chunks of that many rows; ``None`` is one chunk. For a fixed chunk size the result is still
    placement-independent bit for bit; different chunk sizes may differ in the last bits (the
    GEMM library may pick different kernels for different row counts).

    ``w8a16`` (block-FP8 pools only): the activations are not quantized (the FP8 kernel's
    weight-only mode, see the module doc).
    """
    if token_chunk is not None and token_chunk <= 0:
        raise ValueError(f"torch_experts: token_chunk must be positive, got {token_chunk}")
    if w8a16 and not pools.is_fp8:
        raise ValueError("torch_experts: w8a16=True needs block-FP8 pools (it leaves their activations unquantized; "
                         "MXFP4 pools always run weight-only)")
    num_tokens = x.shape[0]
    if token_chunk is None or token_chunk >= num_tokens:
        return _torch_experts_chunk(pools, layer, x, topk_ids, topk_weights, w8a16)
    return torch.cat(
        [
            _torch_experts_chunk(pools, layer, x[s : s + token_chunk], topk_ids[s : s + token_chunk],
                                 topk_weights[s : s + token_chunk], w8a16)
            for s in range(0, num_tokens, token_chunk)
        ]
    )


def _torch_experts_chunk(pools, layer, x, topk_ids, topk_weights, w8a16=False):
    if pools.has_scales:
        return _torch_scaled_experts_chunk(pools, layer, x, topk_ids, topk_weights, w8a16 or pools.is_mxfp4)
    out = torch.zeros_like(x)
    rows = pools.row_map[layer].tolist()
    weights = topk_weights.to(x.dtype)
    act, bias = pools.activation, pools.has_bias
    for expert in torch.unique(topk_ids).tolist():
        token_idx, rank_idx = torch.where(topk_ids == expert)
        row = rows[expert]
        if row >= 0:
            w13, w2 = pools.w13_hot[row], pools.w2_hot[row]
        else:
            w13, w2 = pools.w13_cold[-row - 1], pools.w2_cold[-row - 1]
        w13 = w13.to(x.device, non_blocking=True)
        w2 = w2.to(x.device, non_blocking=True)
        gate_up = F.linear(x[token_idx], w13)
        if bias:  # rounded after the product, then after the sum, as transformers' `x @ W + b`
            gate_up = gate_up + pools.w13_bias[layer, expert].to(x.device)
        gate, up = gate_up.chunk(2, dim=-1)
        y = F.linear(torch_activation(act, gate, up), w2)
        if bias:
            y = y + pools.w2_bias[layer, expert].to(x.device)
        out.index_add_(0, token_idx, y * weights[token_idx, rank_idx, None])
    return out


def _dequantized_expert(pools, layer, expert, device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(w13 [2I, H], w2 [H, I])`` of one scaled expert, read from the tier the row map gives."""
    row = int(pools.row_map[layer, expert])
    tier, r = ("hot", row) if row >= 0 else ("cold", -row - 1)
    w13, w2 = (getattr(pools, f"{w}_{tier}")[r].to(device) for w in ("w13", "w2"))
    s13, s2 = (getattr(pools, f"{w}_scale_{tier}")[r].to(device) for w in ("w13", "w2"))
    if pools.is_mxfp4:  # packed rows [N, K / 2] are the checkpoint's blocks [N, K / 32, 16]
        return (mxfp4.dequantize(w13.unflatten(-1, (-1, mxfp4.BLOCK_BYTES)), s13, torch.float32, name="w13"),
                mxfp4.dequantize(w2.unflatten(-1, (-1, mxfp4.BLOCK_BYTES)), s2, torch.float32, name="w2"))
    return fp8.dequantize_w13(w13, s13), fp8.dequantize_weight(w2, s2)


def _torch_scaled_experts_chunk(pools, layer, x, topk_ids, topk_weights, w8a16=False):
    """Block-FP8 and MXFP4 experts, the Triton kernels' semantics in torch (float32 throughout):

    ``a = deq(quant(x))`` per token group of 128; ``g, u = a @ deq(w13).T (+ w13_bias)``;
    ``act = activation(g, u)`` (``SiLU(g) * u`` by default) in float32, rounded to ``x``'s dtype
    (the kernel's activation scratch); ``y = deq(quant(act)) @ deq(w2).T (+ w2_bias)`` times the
    routing weight; the top-k products summed in float32 and rounded to ``x``'s dtype
    once. The loop order depends only on the expert ids, never on where an expert lives, so any
    placement gives bitwise the same result. ``w8a16`` (always, for MXFP4): ``quant`` is the
    identity (``a = x``, the intermediate after its rounding to ``x``'s dtype enters w2's GEMM as it
    is); ``deq`` is the format's exact dequantization.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    def through_fp8(a):  # the activation operand of a GEMM, float32
        return a.float() if w8a16 else fp8.dequantize_activations(*fp8.quantize_activations(a))

    a_all = through_fp8(x)
    weights = topk_weights.float()
    for expert in torch.unique(topk_ids).tolist():
        token_idx, rank_idx = torch.where(topk_ids == expert)
        w13, w2 = _dequantized_expert(pools, layer, expert, x.device)
        gate_up = a_all[token_idx] @ w13.T
        if pools.has_bias:
            gate_up = gate_up + pools.w13_bias[layer, expert].to(x.device).float()
        gate, up = gate_up.chunk(2, dim=-1)
        act = torch_activation(pools.activation, gate, up).to(x.dtype)
        y = through_fp8(act) @ w2.T
        if pools.has_bias:
            y = y + pools.w2_bias[layer, expert].to(x.device).float()
        out.index_add_(0, token_idx, y * weights[token_idx, rank_idx, None])
    return out.to(x.dtype)


def torch_gemv(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               add: torch.Tensor | None = None, residual: torch.Tensor | None = None,
               weight_scale: torch.Tensor | None = None):
    """The torch reference of :func:`coldset.kernels.triton_decode.gemv` (any device, the CPU
    included; no triton): the same options and results contract (``add`` returns ``(x + add, out)``)
    and the same quantities, float32 throughout: the residual stream ``x + add`` rounded to x's
    dtype; with ``norm_weight`` the input ``(norm_weight * s)`` rounded to x's dtype and the product
    scaled by ``rsqrt(mean(s^2) + eps)``; a block-FP8 ``weight`` (float8_e4m3fn, with its per-row
    table ``weight_scale`` ``[N, ceil(K / 128)]``, :func:`coldset.core.fp8.row_scales`) dequantized per
    128-column group in float32 (``q.float() * scale``, never rounded to x's dtype); the product
    rounded to x's dtype, then ``residual`` added in float32 and rounded. The kernel sums in
    another order (per group, then the groups), so the two agree to float32 summation order."""
    dt = x.dtype
    s = (x.float() + add.float()).to(dt) if add is not None else x
    a = s.float()
    if weight_scale is not None:
        w = weight.float() * weight_scale.float().repeat_interleave(128, dim=1)[:, :weight.shape[1]]
    else:
        w = weight.float()
    if norm_weight is not None:
        rstd = torch.rsqrt(a.pow(2).mean(dim=-1, keepdim=True) + eps)
        out = ((a * norm_weight.float()).to(dt).float() @ w.T) * rstd
    else:
        out = a @ w.T
    y = out.to(dt)
    if residual is not None:
        y = (y.float() + residual.float()).to(dt)
    return (s, y) if add is not None else y
