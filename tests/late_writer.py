"""A CUDA kernel that lets dependent launches start at once and writes its outputs only after a
delay: the kernel before a programmatic dependent launch in a test that checks the dependent
waits for it (a launch that read its inputs before waiting would see the old contents); and the
experts kernels' call behind it.

Imports triton: import this module inside GPU tests only (CPU CI has no triton).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _copy(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _late_copy_kernel(s0, d0, n0, s1, d1, n1, s2, d2, n2, s3, d3, n3, delay_ns, BLOCK: tl.constexpr):
    tl.extra.cuda.gdc_launch_dependents()  # a dependent launch may start now, before anything is written
    t0 = _now_ns()
    t = t0
    while t - t0 < delay_ns:
        t = _now_ns()
    _copy(s0, d0, n0, BLOCK)
    _copy(s1, d1, n1, BLOCK)
    _copy(s2, d2, n2, BLOCK)
    _copy(s3, d3, n3, BLOCK)


def late_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]], delay_us: float = 50.0) -> None:
    """``dst.copy_(src)`` for up to four (src, dst) pairs of contiguous CUDA tensors, in ONE launch
    that first releases dependent launches, then spins ``delay_us``, then copies (bytewise)."""
    if not 1 <= len(pairs) <= 4:
        raise ValueError(f"late_copy: 1 to 4 (src, dst) pairs, got {len(pairs)}")
    args = []
    for src, dst in pairs + [pairs[-1]] * (4 - len(pairs)):
        if src.shape != dst.shape or src.dtype != dst.dtype or not (src.is_contiguous() and dst.is_contiguous()):
            raise ValueError("late_copy: src and dst must be contiguous with the same shape and dtype")
        args += [src.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8), src.numel() * src.element_size()]
    _late_copy_kernel[(1,)](*args, int(delay_us * 1000), BLOCK=1024, num_warps=4)


def output_after_a_late_write(pools, inputs, stale_inputs, row_map: np.ndarray, experts) -> tuple[torch.Tensor, bool]:
    """``experts(x, ids, weights)`` launched right behind a late writer: the inputs hold
    ``stale_inputs`` and the row map points every expert at its neighbour's rows (expert e -> e + 1's)
    until, 500 µs after it released the launch, the writer puts ``inputs`` and ``row_map`` in place.
    Returns the output and whether the late write landed (the row map and the ids are the real ones)."""
    real = torch.as_tensor(row_map.astype(np.int32)).cuda()
    pools.set_row_map(np.roll(row_map, -1, axis=1).astype(np.int32))  # expert e -> e + 1's rows
    x_in, ids_in, w_in = (t.clone() for t in stale_inputs)
    torch.cuda.synchronize()
    x, ids, w = inputs
    late_copy([(x, x_in), (ids, ids_in), (w, w_in), (real, pools.row_map)], delay_us=500.0)
    out = experts(x_in, ids_in, w_in)
    torch.cuda.synchronize()
    return out, torch.equal(pools.row_map, real) and torch.equal(ids_in, ids)
