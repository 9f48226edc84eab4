"""Row maps the experts kernels' tests place their pools with, and a captured step replayed over them."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


def hot_cold_mixed_maps(num_layers: int, num_experts: int) -> dict[str, np.ndarray]:
    """Row maps of pools that hold every expert in both tiers (row i of each tier: flat expert i):
    ``hot`` every expert read from the hot rows, ``cold`` every one from the cold rows, ``mixed``
    every third flat expert cold (0, 3, 6, ...), the others hot. int32 ``[L, E]``."""
    idx = np.arange(num_layers * num_experts, dtype=np.int32).reshape(num_layers, num_experts)
    return {"hot": idx, "cold": -idx - 1, "mixed": np.where(idx % 3 == 0, -idx - 1, idx)}


def replays_over_row_maps(pools, graph) -> Iterator[str]:
    """Replay the captured ``graph`` once under each of :func:`hot_cold_mixed_maps`' maps set on
    ``pools`` (CUDA), each time synchronized; yields the map's name after its replay."""
    for name, row_map in hot_cold_mixed_maps(*pools.row_map.shape).items():
        pools.set_row_map(torch.as_tensor(row_map))
        graph.replay()
        torch.cuda.synchronize()
        yield name
