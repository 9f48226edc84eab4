"""The experts kernels' tests' inputs and measures: random routing, random, warm and hot/cold/mixed
row maps, a step captured in a CUDA graph and replayed over row maps, the relative and the signed error."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


def routing(num_tokens, num_experts, top_k, hidden, dtype, seed=1, device="cpu"):
    """``(x, ids, weights)``: random tokens, each routed to the top ``top_k`` experts of a random
    softmax, their weights renormalised to sum to 1 (in ``dtype``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    probs = torch.softmax(torch.randn(num_tokens, num_experts, generator=g), dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    return x.to(device), ids.to(device), (w / w.sum(-1, keepdim=True)).to(dtype).to(device)


def random_row_map(num_layers, num_experts, cold_fraction, seed):
    """A random placement: each (layer, expert) hot or cold, rows shuffled within each pool."""
    rng = np.random.default_rng(seed)
    n = num_layers * num_experts
    cold = rng.random(n) < cold_fraction
    rows = np.empty(n, dtype=np.int32)
    rows[~cold] = rng.permutation(int((~cold).sum()))
    rows[cold] = -rng.permutation(int(cold.sum())) - 1
    return rows.reshape(num_layers, num_experts)


def warm_map(num_layers: int, num_experts: int, hot: int) -> np.ndarray:
    """A slot cache's warm row map: experts ``0 .. hot - 1`` of each layer in the hot rows (the
    slots, numbered in (layer, expert) order), the others cold (rows -1, -2, ... in that order)."""
    rm, h, c = np.empty((num_layers, num_experts), dtype=np.int32), 0, 0
    for layer in range(num_layers):
        for e in range(num_experts):
            if e < hot:
                rm[layer, e], h = h, h + 1
            else:
                rm[layer, e], c = -c - 1, c + 1
    return rm


def hot_cold_mixed_maps(num_layers: int, num_experts: int) -> dict[str, np.ndarray]:
    """Row maps of pools that hold every expert in both tiers (row i of each tier: flat expert i):
    ``hot`` every expert read from the hot rows, ``cold`` every one from the cold rows, ``mixed``
    every third flat expert cold (0, 3, 6, ...), the others hot. int32 ``[L, E]``."""
    idx = np.arange(num_layers * num_experts, dtype=np.int32).reshape(num_layers, num_experts)
    return {"hot": idx, "cold": -idx - 1, "mixed": np.where(idx % 3 == 0, -idx - 1, idx)}


def captured(step):
    """``step()`` run once (compiled and checked outside the capture), then captured in a CUDA graph:
    ``(graph, the output tensor its replays write)``."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def replays_over_row_maps(pools, graph) -> Iterator[str]:
    """Replay the captured ``graph`` once under each of :func:`hot_cold_mixed_maps`' maps set on
    ``pools`` (CUDA), each time synchronized; yields the map's name after its replay."""
    for name, row_map in hot_cold_mixed_maps(*pools.row_map.shape).items():
        pools.set_row_map(torch.as_tensor(row_map))
        graph.replay()
        torch.cuda.synchronize()
        yield name


def rel_err(a, ref):
    """Relative Frobenius error of ``a`` against ``ref`` (float64 on the CPU)."""
    return float((a.double().cpu() - ref).norm() / ref.norm())


def signed_bias(out, ref):
    """Mean signed relative error: the least-squares scale of ``out`` against ``ref``, minus 1
    (``<out - ref, ref> / <ref, ref>``). Rounding errors average out of it; a systematic scale
    error of s gives s, which a max-error tolerance of 1-2% lets through."""
    o, r = out.double().flatten().cpu(), ref.double().flatten().cpu()
    return float(torch.dot(o - r, r) / torch.dot(r, r))
