"""The slot cache's miss fill on CUDA: copy host-tier rows into slots, reading pinned host memory
in place, only for the step's actual misses.

Why a kernel and not a copy: the rows to copy (which instances, into which slots) are decided on
the device inside the captured decode step, so a ``cudaMemcpyAsync`` (addresses fixed at capture)
cannot express it without a host round trip. The grid is fixed by the step's maximum number of
misses (``min(T * k, E)``) times a fixed split of each row over many blocks (the pinned link is
only filled when each row is read by many blocks, DESIGN.md §6); a block whose miss index is past
the step's miss count (a device scalar) returns before touching memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per load
SPLIT = 64  # blocks per row


@triton.jit
def _fill_kernel(src_ptr, dst_ptr, slots_ptr, inst_ptr, count_ptr, row_elems,
                 BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    j = tl.program_id(0)
    part = tl.program_id(1)
    m = tl.load(count_ptr)
    if j < m:
        slot = tl.load(slots_ptr + j).to(tl.int64)
        inst = tl.load(inst_ptr + j).to(tl.int64)
        src = src_ptr + inst * row_elems
        dst = dst_ptr + slot * row_elems
        for start in range(part * BLOCK, row_elems, SPLIT * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < row_elems
            tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)


def fill_slots(host: torch.Tensor, slots: torch.Tensor, victims: torch.Tensor, instances: torch.Tensor,
               count: torch.Tensor) -> None:
    """``slots[victims[j]] = host[instances[j]]`` for ``j < count`` (``count`` a device scalar).

    ``host`` ``[rows, ...]`` (pinned host memory, read in place) and ``slots`` ``[C, ...]`` (device)
    are contiguous with equal row shapes and dtypes; ``victims``/``instances`` int64 ``[M]``.
    """
    if host.shape[1:] != slots.shape[1:] or host.dtype != slots.dtype:
        raise ValueError(f"fill_slots: host rows {tuple(host.shape[1:])} {host.dtype} differ from slots "
                         f"{tuple(slots.shape[1:])} {slots.dtype}")
    if not (host.is_contiguous() and slots.is_contiguous()):
        raise ValueError("fill_slots: host tier and slots must be contiguous")
    row = slots[0].numel()
    _fill_kernel[(victims.numel(), SPLIT)](host, slots, victims, instances, count.reshape(1), row,
                                          BLOCK=BLOCK, SPLIT=SPLIT, num_warps=4)
