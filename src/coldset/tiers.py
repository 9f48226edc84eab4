"""Routed-expert weights in two pools (hot in HBM, cold in host memory) and the int32 row map.

Every MoE layer's routed experts live in one shared *hot pool* and one shared *cold pool* per
weight (w13 = gate and up fused ``[2I, H]``, w2 = down ``[H, I]``). The row map, int32
``[num_moe_layers, num_experts]``, says where each (layer, expert) is: ``r >= 0`` is row ``r`` of
the hot pool, ``r < 0`` is row ``-r - 1`` of the cold pool (DESIGN.md §3). A placement is a row
map, never code: the model and the kernel are the same for every placement.

The unmodified path is the all-hot layout: the hot pool is the model's stacked expert tensor in
module order, so (layer, expert) is row ``layer * E + expert``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertPools:
    """The routed experts of a whole model, as two pools plus the row map that indexes them."""

    w13_hot: torch.Tensor  # [num_hot, 2I, H], on the compute device
    w2_hot: torch.Tensor  # [num_hot, H, I]
    w13_cold: torch.Tensor  # [num_cold, 2I, H], pinned host memory on CUDA, plain on CPU
    w2_cold: torch.Tensor  # [num_cold, H, I]
    row_map: torch.Tensor  # int32 [num_moe_layers, num_experts], on the compute device

    @classmethod
    def all_hot(cls, w13: torch.Tensor, w2: torch.Tensor) -> "ExpertPools":
        """Every expert in the hot pool in module order: the unmodified (reference) layout.

        ``w13`` is ``[L, E, 2I, H]`` and ``w2`` is ``[L, E, H, I]``; the pools are views of them.
        """
        if w13.dim() != 4 or w2.dim() != 4 or w13.shape[:2] != w2.shape[:2]:
            raise ValueError(
                f"all_hot needs w13 [L, E, 2I, H] and w2 [L, E, H, I], got {tuple(w13.shape)} "
                f"and {tuple(w2.shape)}"
            )
        num_layers, num_experts = w13.shape[:2]
        row_map = torch.arange(num_layers * num_experts, dtype=torch.int32, device=w13.device)
        return cls(
            w13_hot=w13.reshape(num_layers * num_experts, *w13.shape[2:]),
            w2_hot=w2.reshape(num_layers * num_experts, *w2.shape[2:]),
            w13_cold=w13.new_empty((0, *w13.shape[2:])),
            w2_cold=w2.new_empty((0, *w2.shape[2:])),
            row_map=row_map.reshape(num_layers, num_experts),
        )

    @property
    def num_moe_layers(self) -> int:
        return int(self.row_map.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.row_map.shape[1])

    @property
    def num_hot(self) -> int:
        return int(self.w13_hot.shape[0])

    @property
    def num_cold(self) -> int:
        return int(self.w13_cold.shape[0])

    def expert_weights(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) of one expert, wherever it lives; for tests and the torch path."""
        row = int(self.row_map[layer, expert])
        if row >= 0:
            return self.w13_hot[row], self.w2_hot[row]
        return self.w13_cold[-row - 1], self.w2_cold[-row - 1]
