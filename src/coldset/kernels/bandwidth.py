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

from coldset.core.timing import graph_time_us


@triton.jit
def _read_kernel(ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    base = pid * BLOCK * ITERS
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read_bandwidth(buf: torch.Tensor, block: int = 4096, iters: int = 4, reps: int = 20, launches: int = 1) -> float:
    """Bytes/s of one streaming read of ``buf`` (flattened; device or pinned host memory), the
    median of ``reps`` CUDA-graph replays. Fill ``buf`` with real data first: zeros can read faster.

    ``launches`` > 1: ``buf`` is read as that many equal consecutive parts, one launch each, in one
    graph, and the rate is that of one launch of one part: the ceiling of a read the size of one
    part (a kernel that reads 75 MB a launch meets the launch's ramp and tail, which a read of
    gigabytes hides), each launch on bytes the one before did not touch (not served from L2)."""
    flat = buf.reshape(-1)
    n = flat.numel() // launches
    if n == 0:
        raise ValueError(f"read_bandwidth: {flat.numel()} elements cannot be read in {launches} launches")
    grid = triton.cdiv(n, block * iters)
    out = torch.empty(grid, dtype=torch.float32, device="cuda")
    parts = [flat[i * n:(i + 1) * n] for i in range(launches)]

    def read():
        for part in parts:
            _read_kernel[(grid,)](part, out, n, BLOCK=block, ITERS=iters, num_warps=8)

    us = graph_time_us(read, reps) / launches
    return n * flat.element_size() / (us * 1e-6)


#: The read shapes (block, iters) of an HBM ceiling: the kernel's rate depends on its tiling by a
#: few percent, and the ceiling is the best the device reached.
HBM_READ_SHAPES = ((4096, 4), (4096, 16))


def best_read_bandwidth(buf: torch.Tensor, shapes=HBM_READ_SHAPES, reps: int = 20, launches: int = 1,
                        rounds: int = 1, rates: dict | None = None) -> float:
    """The ceiling of a read of ``buf``: the best bytes/s of :func:`read_bandwidth` over the read
    ``shapes`` ((block, iters) pairs), ``rounds`` times over (a rate measured once, right after a
    long host-side phase, has come out 12% low on one H200). ``rates``, when given, receives each
    shape's best rate as ``"block{B}_iters{I}"`` (how a result records its candidates).

    The one place a ceiling is taken as the best of several read shapes: the bench's ceilings
    (:func:`coldset.bench.decode.measure_ceilings`) and the GPU measurements (:mod:`coldset.measure`)."""
    if not shapes or rounds < 1:
        raise ValueError(f"best_read_bandwidth: shapes {shapes!r} x rounds {rounds}: nothing to read")
    best = 0.0
    for _ in range(rounds):
        for block, iters in shapes:
            rate = read_bandwidth(buf, block, iters, reps, launches)
            if rates is not None:
                key = f"block{block}_iters{iters}"
                rates[key] = max(rates.get(key, 0.0), rate)
            best = max(best, rate)
    return best
