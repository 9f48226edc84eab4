"""The fused MoE experts computation: w13 GEMM, SiLU·mul, w2 GEMM, weighted sum over top-k.

One function signature for every backend, so the engine calls one replaceable function:
``experts(pools, layer, x, topk_ids, topk_weights) -> out``, with ``x`` ``[T, H]``, ``topk_ids``
``[T, k]`` int64, ``topk_weights`` ``[T, k]`` and ``out`` ``[T, H]`` in ``x``'s dtype. ``layer``
is the MoE layer's index into the row map (not the model's layer index).

``torch_experts`` (the CPU path and the GPU reference) lives in :mod:`coldset.kernels.reference`;
the Triton kernel is imported lazily, only on CUDA.
"""

from coldset.kernels.reference import torch_experts

__all__ = ["torch_experts"]
