"""The fused MoE experts computation: w13 GEMM, gated activation, w2 GEMM, weighted sum over top-k.

The activation is the pools' (:mod:`coldset.kernels.activation`: SiLU(gate) * up, or gpt-oss's
clamped SwiGLU), and pools with expert biases add them after each GEMM
(:class:`coldset.kernels.tiers.ExpertPools`): every backend reads both from the pools, so the
call is the same for every family.

One function signature for every backend, so the engine calls one replaceable function:
``experts(pools, layer, x, topk_ids, topk_weights) -> out``, with ``x`` ``[T, H]``, ``topk_ids``
``[T, k]`` int64, ``topk_weights`` ``[T, k]`` and ``out`` ``[T, H]`` in ``x``'s dtype. ``layer``
is the MoE layer's index into the row map (not the model's layer index).

``torch_experts`` (the CPU path and the GPU reference) lives in :mod:`coldset.kernels.reference`;
the Triton kernel (:mod:`coldset.kernels.triton_moe`) is imported lazily, on first call, so the
package imports without triton.
"""

from coldset.kernels.reference import torch_experts, torch_softmax_topk

# The Triton slot-cache decisions' largest cache (coldset.kernels.triton_slots): a victim scan packs
# a slot into the low 14 bits of its key; a larger cache decides by torch ops (coldset.engine.cache.pool).
KERNEL_MAX_SLOTS = 2**14


def triton_experts(pools, layer, x, topk_ids, topk_weights, config=None, use_row_map=True):
    """The Triton kernel (CUDA) for the pools' weight format: block-FP8 pools
    (:mod:`coldset.kernels.triton_fp8`), else bf16/fp16 (:mod:`coldset.kernels.triton_moe`); same
    contract as :func:`torch_experts`. Imports triton on first use."""
    if getattr(pools, "is_fp8", False):  # triton: imported on first use, so the package imports without it
        from coldset.kernels.triton_fp8 import triton_fp8_experts as _triton_experts
    elif getattr(pools, "is_mxfp4", False):  # MXFP4 pools (coldset.kernels.triton_mxfp4); triton: on first use
        from coldset.kernels.triton_mxfp4 import triton_mxfp4_experts as _triton_experts
    else:
        from coldset.kernels.triton_moe import triton_experts as _triton_experts

    return _triton_experts(pools, layer, x, topk_ids, topk_weights, config=config, use_row_map=use_row_map)


def softmax_topk(logits, k: int, renormalize: bool):
    """The router's ``(topk_ids, topk_weights)`` for ``logits`` ``[T, E]``: one Triton launch on
    CUDA (:mod:`coldset.kernels.triton_route`), :func:`torch_softmax_topk` elsewhere."""
    if logits.is_cuda:  # triton: imported on first use, so the package imports without it
        from coldset.kernels.triton_route import triton_softmax_topk

        return triton_softmax_topk(logits, k, renormalize)
    return torch_softmax_topk(logits, k, renormalize)


__all__ = ["KERNEL_MAX_SLOTS", "softmax_topk", "torch_experts", "torch_softmax_topk", "triton_experts"]
