"""The GPU decoder of the lossless expert codec (:mod:`coldset.core.codec`), in Triton.

One thread decodes one lane: at step ``i`` every lane reads its next code (two 32-bit words of its
own stream and one entry of the 8 KiB decode table, both cached close to the core) and writes
element ``i * num_lanes + lane``, so a warp's writes and raw-plane reads are consecutive. A launch
takes one record; it reads only device tensors and needs no host synchronisation, so it can be
captured in a CUDA graph. :func:`coldset.core.codec.decode` is its torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coldset.core.codec import MAX_CODE_BITS, CodecError, Compressed, check_record

LANES_PER_PROGRAM = 128


@triton.jit
def decode_lanes(words_ptr, pos, lanes, live, table_ptr, raw_ptr, out_ptr, numel, num_lanes, depth,
                 HAS_RAW: tl.constexpr, MAX_BITS: tl.constexpr):
    """The decode loop of the lanes ``lanes`` (``live`` of them), each starting at bit ``pos`` of
    ``words_ptr``: element ``i * num_lanes + lane`` at step ``i``; with ``HAS_RAW`` the sign and
    mantissa byte of ``raw_ptr`` joins each decoded exponent into a bf16 bit pattern. One loop for a
    record's own launch (:func:`decode_into`) and the captured step's listed fills
    (:mod:`coldset.kernels.triton_codec_fill`)."""
    for i in range(depth):
        word = pos >> 5
        first = tl.load(words_ptr + word, mask=live, other=0).to(tl.int64) & 0xFFFFFFFF
        second = tl.load(words_ptr + word + 1, mask=live, other=0).to(tl.int64) & 0xFFFFFFFF
        window = (first << 32) | second  # bits [0, 12) read below never reach the sign bit
        peek = (window >> (64 - MAX_BITS - (pos & 31))) & ((1 << MAX_BITS) - 1)
        entry = tl.load(table_ptr + peek, mask=live, other=0).to(tl.int32)
        n = i * num_lanes + lanes
        ok = live & (n < numel)
        symbol = entry >> 4
        if HAS_RAW:
            raw = tl.load(raw_ptr + n, mask=ok, other=0).to(tl.int32)
            bits = ((raw & 0x80) << 8) | (symbol << 7) | (raw & 0x7F)
            tl.store(out_ptr + n, bits.to(tl.int16), mask=ok)
        else:
            tl.store(out_ptr + n, symbol.to(tl.uint8), mask=ok)
        pos += entry & 15


@triton.jit
def _decode_kernel(words_ptr, lane_words_ptr, table_ptr, raw_ptr, out_ptr, numel, num_lanes, depth,
                   HAS_RAW: tl.constexpr, BLOCK: tl.constexpr, MAX_BITS: tl.constexpr):
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = lanes < num_lanes
    pos = tl.load(lane_words_ptr + lanes, mask=live, other=0).to(tl.int64) * 32
    decode_lanes(words_ptr, pos, lanes, live, table_ptr, raw_ptr, out_ptr, numel, num_lanes, depth, HAS_RAW, MAX_BITS)


def decode_into(c: Compressed, out: torch.Tensor) -> torch.Tensor:
    """Decode record ``c`` into ``out`` (``c.numel`` elements of ``c.dtype``, contiguous, on the
    record's device) in one launch; returns ``out``."""
    check_record(c)
    if out.dtype != c.dtype or out.numel() != c.numel or not out.is_contiguous():
        raise CodecError(f"codec: output {out.dtype} x {out.numel()} (contiguous={out.is_contiguous()}) does not "
                         f"fit the record's {c.numel} x {c.dtype}")
    if c.numel >= 1 << 31:
        raise CodecError(f"codec: a record of {c.numel} elements exceeds the decoder's int32 index")
    flat = out.view(-1)
    target = flat.view(torch.int16) if c.raw is not None else flat.view(torch.uint8)
    grid = (triton.cdiv(c.num_lanes, LANES_PER_PROGRAM),)
    _decode_kernel[grid](c.words, c.lane_words, c.table, c.raw if c.raw is not None else c.words, target,
                         c.numel, c.num_lanes, c.lane_symbols, HAS_RAW=c.raw is not None,
                         BLOCK=LANES_PER_PROGRAM, MAX_BITS=MAX_CODE_BITS)
    return out


def decode(c: Compressed) -> torch.Tensor:
    """Decode record ``c`` into a new tensor on its device."""
    out = torch.empty(c.shape, dtype=c.dtype, device=c.words.device)
    return decode_into(c, out)
