"""The lossless expert codec of the compressed host tier: fewer bytes over the host link, every bit kept.

Trained weights' exponents carry little information (bf16: about 2.6 of 8 bits on Gaussian-like
weights), their signs and mantissas nearly none that can be squeezed. So each element is split in
two bytes: a **symbol** entropy-coded with a canonical Huffman code, and an optional **raw** byte
stored as it is.

- bf16: symbol = the 8 exponent bits, raw = sign and 7 mantissa bits (``(s << 7) | m``);
- one-byte formats (``float8_e4m3fn``, ``uint8``, ``int8``; block-FP8 and MXFP4 blocks): symbol =
  the whole byte, no raw plane.

The code is length-limited to :data:`MAX_CODE_BITS` so that a decoder reads one table entry per
symbol. Symbols are dealt to ``num_lanes`` independent bit streams: element ``n`` is symbol
``n // num_lanes`` of lane ``n % num_lanes``. A GPU decoder then runs one lane per thread and, at
each step, all threads write consecutive elements (coalesced), though each reads its own stream.
Each lane's stream starts at a 32-bit word boundary (``lane_words`` is the prefix sum of the lanes'
word counts); codes are written most significant bit first. The last lanes may hold one symbol
fewer than the first; the encoder pads them with the shortest code, and decoders write only the
first ``numel`` elements.

:func:`encode` runs on any device (torch ops only); :func:`decode` is the torch decoder, the
reference of :mod:`coldset.kernels.triton_codec`. Both are exact: the round trip returns every bit
pattern (NaN payloads, infinities, subnormals, negative zero) as it was.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

#: Longest code: a decoder's table has ``2 ** MAX_CODE_BITS`` entries (8 KiB of int16).
MAX_CODE_BITS = 12
#: Symbols per lane the encoder aims at: more lanes decode in parallel, each costs a 4-byte offset.
LANE_SYMBOLS = 256
#: Formats the codec takes, and whether each has a raw plane beside its symbols.
FORMATS = {torch.bfloat16: True, torch.float8_e4m3fn: False, torch.uint8: False, torch.int8: False}


class CodecError(ValueError):
    """A tensor or compressed record the codec does not take; the message names it."""


@dataclass(frozen=True)
class Compressed:
    """One tensor, compressed. ``words`` int32 ``[W + 1]``: the lanes' bit streams (the last word is
    padding, so a decoder may always read two words); ``lane_words`` int32 ``[num_lanes + 1]``: where
    each lane's stream starts, in words; ``table`` int16 ``[2 ** MAX_CODE_BITS]``: for every
    ``MAX_CODE_BITS``-bit window the symbol it starts with times 16 plus that code's length;
    ``raw`` uint8 ``[numel]`` or None. ``num_words`` (W) is kept as a Python int so that a decoder
    launch checks the record without reading a device tensor (which a CUDA graph capture forbids)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    num_lanes: int
    num_words: int
    words: torch.Tensor
    lane_words: torch.Tensor
    table: torch.Tensor
    raw: torch.Tensor | None

    @property
    def lane_symbols(self) -> int:
        """Symbols in the longest lane (every lane but the last few has this many)."""
        return -(-self.numel // self.num_lanes)

    @property
    def nbytes(self) -> int:
        """Bytes the record occupies (and copies over the link): streams, offsets, table, raw plane."""
        parts = [self.words, self.lane_words, self.table] + ([self.raw] if self.raw is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the uncompressed tensor."""
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def ratio(self) -> float:
        """Compressed over uncompressed bytes (lower is better)."""
        return self.nbytes / max(1, self.raw_nbytes)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Compressed":
        """The same record with its tensors on ``device``."""
        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return Compressed(self.shape, self.dtype, self.numel, self.num_lanes, self.num_words, move(self.words),
                          move(self.lane_words), move(self.table), move(self.raw))


def code_lengths(freq: torch.Tensor, max_bits: int = MAX_CODE_BITS) -> torch.Tensor:
    """Huffman code lengths int64 ``[256]`` for symbol counts ``freq`` (0 for an absent symbol),
    limited to ``max_bits``: lengths over the limit are cut to it and the Kraft sum restored by
    lengthening the longest codes still under it (the usual heuristic; near-optimal where, as here,
    only very rare symbols are cut). A lone symbol gets a 1-bit code."""
    counts = [int(c) for c in freq.tolist()]
    present = [s for s, c in enumerate(counts) if c > 0]
    lengths = [0] * len(counts)
    if len(present) == 1:
        lengths[present[0]] = 1
        return torch.tensor(lengths, dtype=torch.int64)
    heap = [(counts[s], s, (s,)) for s in present]
    heapq.heapify(heap)
    while len(heap) > 1:
        c1, t1, s1 = heapq.heappop(heap)
        c2, t2, s2 = heapq.heappop(heap)
        for s in s1 + s2:
            lengths[s] += 1
        heapq.heappush(heap, (c1 + c2, min(t1, t2), s1 + s2))
    lengths = [min(length, max_bits) for length in lengths]
    budget = 1 << max_bits  # Kraft sum in units of 2**-max_bits
    used = sum(1 << (max_bits - length) for length in lengths if length)
    by_length = sorted(present, key=lambda s: (-lengths[s], -counts[s]))
    while used > budget:
        s = next(s for s in by_length if lengths[s] < max_bits)
        used -= 1 << (max_bits - lengths[s] - 1)
        lengths[s] += 1
        by_length = sorted(present, key=lambda s: (-lengths[s], -counts[s]))
    return torch.tensor(lengths, dtype=torch.int64)


def canonical_codes(lengths: torch.Tensor) -> torch.Tensor:
    """Canonical code values int64 ``[256]`` for ``lengths`` (symbols ordered by length, then value)."""
    codes = torch.zeros_like(lengths)
    code, prev = 0, 0
    for s in sorted((s for s in range(lengths.numel()) if lengths[s] > 0), key=lambda s: (int(lengths[s]), s)):
        code <<= int(lengths[s]) - prev
        prev = int(lengths[s])
        codes[s] = code
        code += 1
    return codes


def decode_table(lengths: torch.Tensor, codes: torch.Tensor, max_bits: int = MAX_CODE_BITS) -> torch.Tensor:
    """int16 ``[2 ** max_bits]``: ``symbol * 16 + length`` of the code every window starts with."""
    table = torch.zeros(1 << max_bits, dtype=torch.int16)
    for s in range(lengths.numel()):
        n = int(lengths[s])
        if n:
            first = int(codes[s]) << (max_bits - n)
            table[first:first + (1 << (max_bits - n))] = s * 16 + n
    return table


def split_planes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(symbols uint8 [numel], raw uint8 [numel] or None)`` of tensor ``t`` (see the module doc)."""
    if t.dtype not in FORMATS:
        raise CodecError(f"codec: dtype {t.dtype} is not supported (supported: "
                         f"{', '.join(str(d) for d in FORMATS)})")
    flat = t.contiguous().reshape(-1)
    if not FORMATS[t.dtype]:
        return flat.view(torch.uint8), None
    bits = flat.view(torch.int16).to(torch.int32) & 0xFFFF
    symbols = ((bits >> 7) & 0xFF).to(torch.uint8)
    raw = (((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)
    return symbols, raw


def join_planes(symbols: torch.Tensor, raw: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`split_planes`: a flat tensor of ``dtype``."""
    if raw is None:
        return symbols.to(torch.uint8).view(dtype)
    s = symbols.to(torch.int32)
    r = raw.to(torch.int32)
    bits = ((r & 0x80) << 8) | (s << 7) | (r & 0x7F)
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(dtype)


def encode(t: torch.Tensor, lane_symbols: int = LANE_SYMBOLS) -> Compressed:
    """Compress tensor ``t`` (bf16 or a one-byte format) on its own device. Deterministic: the same
    tensor gives the same bytes."""
    if lane_symbols <= 0:
        raise CodecError(f"codec: lane_symbols must be positive, got {lane_symbols}")
    symbols, raw = split_planes(t)
    numel = symbols.numel()
    if numel == 0:
        raise CodecError(f"codec: tensor of shape {tuple(t.shape)} is empty")
    device = symbols.device
    lengths = code_lengths(torch.bincount(symbols.to(torch.int64).cpu(), minlength=256))
    codes = canonical_codes(lengths)
    num_lanes = -(-numel // lane_symbols)
    depth = -(-numel // num_lanes)
    pad = min(range(256), key=lambda s: (int(lengths[s]) if lengths[s] > 0 else 99, s))
    grid = torch.full((depth * num_lanes,), pad, dtype=torch.int64, device=device)
    grid[:numel] = symbols.to(torch.int64)
    grid = grid.view(depth, num_lanes)  # row i: symbol i of every lane
    sym_len = lengths.to(device)[grid]
    sym_code = codes.to(device)[grid]
    lane_bits = sym_len.sum(dim=0)
    lane_word_count = (lane_bits + 31) // 32
    lane_words = torch.zeros(num_lanes + 1, dtype=torch.int64, device=device)
    lane_words[1:] = torch.cumsum(lane_word_count, dim=0)
    start = lane_words[:-1] * 32 + torch.cumsum(sym_len, dim=0) - sym_len  # first bit of each code
    total = int(lane_words[-1])
    # A code (<= MAX_CODE_BITS bits) occupies bits [s, e) of the 64-bit window of words w and w + 1,
    # counted from the most significant bit. Codes never share a bit, so summing their parts into
    # the words is or-ing them.
    s = start % 32
    e = s + sym_len
    in_first = e <= 32
    hi = torch.where(in_first, sym_code << (32 - e).clamp(min=0), sym_code >> (e - 32).clamp(min=0)).reshape(-1)
    lo = torch.where(in_first, torch.zeros_like(sym_code),
                     (sym_code << (64 - e).clamp(max=31)) & 0xFFFFFFFF).reshape(-1)
    word = (start // 32).reshape(-1)
    acc = torch.zeros(total + 2, dtype=torch.int64, device=device)
    acc.index_add_(0, word, hi)
    acc.index_add_(0, word + 1, lo)
    words = acc[: total + 1]
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return Compressed(tuple(t.shape), t.dtype, numel, num_lanes, total, words,
                      lane_words.to(torch.int32), decode_table(lengths, codes).to(device), raw)


def check_record(c: Compressed) -> None:
    """Refuse a record whose parts disagree (a truncated or mixed-up copy), naming the part."""
    if c.dtype not in FORMATS:
        raise CodecError(f"codec record: dtype {c.dtype} is not supported")
    if c.numel != math.prod(c.shape):
        raise CodecError(f"codec record: numel {c.numel} != prod(shape {c.shape})")
    if c.lane_words.numel() != c.num_lanes + 1:
        raise CodecError(f"codec record: lane_words has {c.lane_words.numel()} entries, expected {c.num_lanes + 1}")
    if c.words.numel() != c.num_words + 1:
        raise CodecError(f"codec record: words has {c.words.numel()} entries, expected {c.num_words + 1}")
    if c.table.numel() != 1 << MAX_CODE_BITS:
        raise CodecError(f"codec record: table has {c.table.numel()} entries, expected {1 << MAX_CODE_BITS}")
    if FORMATS[c.dtype] != (c.raw is not None) or (c.raw is not None and c.raw.numel() != c.numel):
        raise CodecError(f"codec record: raw plane {None if c.raw is None else c.raw.numel()} does not fit "
                         f"{c.numel} elements of {c.dtype}")


def decode(c: Compressed) -> torch.Tensor:
    """The torch decoder: all lanes at once, one symbol a step, on the record's device."""
    check_record(c)
    if int(c.lane_words[-1]) != c.num_words:
        raise CodecError(f"codec record: lane_words ends at {int(c.lane_words[-1])}, the streams hold "
                         f"{c.num_words} words")
    words = c.words.to(torch.int64) & 0xFFFFFFFF
    table = c.table.to(torch.int64)
    pos = c.lane_words[:-1].to(torch.int64) * 32
    lanes = torch.arange(c.num_lanes, device=words.device)
    symbols = torch.empty(c.lane_symbols * c.num_lanes, dtype=torch.int64, device=words.device)
    mask = (1 << MAX_CODE_BITS) - 1
    for i in range(c.lane_symbols):
        w, s = pos // 32, pos % 32
        tail = s + MAX_CODE_BITS - 32  # bits of the window in the next word (<= 0: none)
        window = torch.where(tail <= 0, words[w] >> (-tail).clamp(min=0),
                             (words[w] << tail.clamp(min=0)) | (words[w + 1] >> (32 - tail).clamp(max=32)))
        entry = table[window & mask]
        symbols[i * c.num_lanes + lanes] = entry >> 4
        pos = pos + (entry & 15)
    return join_planes(symbols[: c.numel], c.raw, c.dtype).view(c.shape)
