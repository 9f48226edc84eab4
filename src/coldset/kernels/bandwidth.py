"""The read-bandwidth ceiling: a Triton kernel that streams a buffer once (CUDA).

Why a kernel of our own: the benchmark's ratios (decode tok/s against bytes over bandwidth) need
the bandwidth the experts kernel could reach on this device, in this run: a streaming read by many
programs, the same access pattern as the experts' weight reads. Pointed at pinned host memory it
reads in place over the host link (zero-copy), which is how the cold tier is read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coldset.tune import graph_time_us


@triton.jit
def _read_kernel(ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    base = pid * BLOCK * ITERS
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read_bandwidth(buf: torch.Tensor, block: int = 4096, iters: int = 4, reps: int = 20) -> float:
    """Bytes/s of one streaming read of ``buf`` (flattened; device or pinned host memory), the
    median of ``reps`` CUDA-graph replays. Fill ``buf`` with real data first: zeros can read faster."""
    flat = buf.reshape(-1)
    n = flat.numel()
    grid = triton.cdiv(n, block * iters)
    out = torch.empty(grid, dtype=torch.float32, device="cuda")
    us = graph_time_us(lambda: _read_kernel[(grid,)](flat, out, n, BLOCK=block, ITERS=iters, num_warps=8), reps)
    return n * flat.element_size() / (us * 1e-6)
