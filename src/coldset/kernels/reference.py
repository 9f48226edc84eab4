"""The torch experts path: the CPU implementation and the reference the Triton kernel is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from coldset.tiers import ExpertPools


def torch_experts(
    pools: ExpertPools,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Routed-expert output for tokens ``x`` ``[T, H]`` of MoE layer ``layer``.

    Loops over the experts the batch selected (as Hugging Face's reference MoE blocks do), reads
    each expert's weights through the row map, and accumulates ``weight * expert(x)`` per token in
    ``x``'s dtype. The loop order depends only on the expert ids, never on where an expert lives,
    so any placement gives bitwise the same result as the all-hot layout.
    """
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
