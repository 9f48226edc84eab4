"""The torch experts path: the CPU implementation and the reference the Triton kernel is checked against."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # annotations only: the kernels do not import the tiers (no import circle)
    from coldset.tiers import ExpertPools


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
) -> torch.Tensor:
    """Routed-expert output for tokens ``x`` ``[T, H]`` of MoE layer ``layer``.

    Loops over the experts the batch selected (as Hugging Face's reference MoE blocks do), reads
    each expert's weights through the row map, and accumulates ``weight * expert(x)`` per token in
    ``x``'s dtype. The loop order depends only on the expert ids, never on where an expert lives,
    so any placement gives bitwise the same result as the all-hot layout.

    ``token_chunk`` (the CPU path's tunable knob, see :mod:`coldset.tune`) processes the tokens
    in chunks of that many rows; ``None`` is one chunk. For a fixed chunk size the result is still
    placement-independent bit for bit; different chunk sizes may differ in the last bits (the
    GEMM library may pick different kernels for different row counts).
    """
    if token_chunk is not None and token_chunk <= 0:
        raise ValueError(f"torch_experts: token_chunk must be positive, got {token_chunk}")
    num_tokens = x.shape[0]
    if token_chunk is None or token_chunk >= num_tokens:
        return _torch_experts_chunk(pools, layer, x, topk_ids, topk_weights)
    return torch.cat(
        [
            _torch_experts_chunk(pools, layer, x[s : s + token_chunk], topk_ids[s : s + token_chunk],
                                 topk_weights[s : s + token_chunk])
            for s in range(0, num_tokens, token_chunk)
        ]
    )


def _torch_experts_chunk(pools, layer, x, topk_ids, topk_weights):
    out = torch.zeros_like(x)
    rows = pools.row_map[layer].tolist()
    weights = topk_weights.to(x.dtype)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, rank_idx = torch.where(topk_ids == expert)
        row = rows[expert]
        if row >= 0:
            w13, w2 = pools.w13_hot[row], pools.w2_hot[row]
        else:
            w13, w2 = pools.w13_cold[-row - 1], pools.w2_cold[-row - 1]
        w13 = w13.to(x.device, non_blocking=True)
        w2 = w2.to(x.device, non_blocking=True)
        gate, up = F.linear(x[token_idx], w13).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2) * weights[token_idx, rank_idx, None]
        out.index_add_(0, token_idx, y)
    return out
