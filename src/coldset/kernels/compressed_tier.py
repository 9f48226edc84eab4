"""The compressed host tier: every routed expert once in host memory as lossless codec records.

The raw host tier (:class:`coldset.kernels.tiers.HostTier`) keeps each expert's bytes as they are,
so a kernel can read a cold expert in place over the host link. This tier keeps the same experts
(row ``layer * E + expert``) as :mod:`coldset.core.codec` records in one host allocation (pinned
when the experts are on CUDA): the host memory, and the bytes a fill sends over the link, drop by
the codec's ratio. Each expert is one contiguous *record* holding its parts (``w13``, ``w2`` and,
for block-FP8 or MXFP4 experts, ``w13_scale`` and ``w2_scale``); a part is stored coded where the
codec takes its dtype and the coded bytes are fewer than the raw ones (FP8's float32 scales, and
parts too small to carry a decode table, are stored raw), so a fill copies one record per expert.

A fill (:func:`fill_slots`) copies an expert's record into a device staging buffer with one copy
and decodes each part into the destination slot's rows (the Triton decoder on CUDA, the torch
decoder on the CPU); raw parts are copied byte for byte. The slot then holds exactly the bytes a
raw fill would have copied: every output stays bitwise the unmodified path's. Inside the captured
decode step the slot cache's fills are listed on the device instead
(:mod:`coldset.kernels.triton_codec_fill`), reading the descriptor tables built here with the tier.

Coded weights cannot be read in place (a kernel reads a weight element by address, a coded stream
has no addresses). So the two tiers serve different placements: a placement whose cold experts are
read in place (static cold sets, and a slot cache whose misses read the host row in place) needs
the raw tier; a path that fills every cold expert into a slot before the compute reads it can use
this one. :meth:`CompressedHostTier.check_matches` (which :meth:`ExpertPools.placed` calls on its
host tier) refuses this tier by name, so a compressed tier can never be handed to an in-place
reader. A process that runs both keeps both tiers (host bytes 1 + ratio of raw); the speed model
(:func:`coldset.analysis.speed.cold_path_choice`) says which one a given link and decode rate
favour.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from coldset.core import codec
from coldset.kernels.tiers import ExpertPools, _pinned_block_bytes, check_host_allocation

_ALIGN = 16  # every array in a record starts 16-byte aligned, so byte views cast to int16/int32


class CompressedTierError(ValueError):
    """A compressed host tier used where it cannot work, or with pools it does not hold."""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Part:
    """Where one tensor of an expert lies in its record (byte offsets from the record's start).

    Coded: ``arrays`` are the offsets of the codec record's ``words``, ``lane_words``, ``table`` and
    ``raw`` (-1 where there is no raw plane). Raw: ``arrays`` is ``(offset,)`` of its bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    coded: bool
    arrays: tuple[int, ...]
    num_lanes: int = 0
    num_words: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def raw_nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()

    def record(self, buf: torch.Tensor) -> codec.Compressed:
        """The codec record of this (coded) part as views of ``buf``, the expert's record bytes."""
        words_at, lanes_at, table_at, raw_at = self.arrays
        words = buf[words_at:words_at + 4 * (self.num_words + 1)].view(torch.int32)
        lane_words = buf[lanes_at:lanes_at + 4 * (self.num_lanes + 1)].view(torch.int32)
        table = buf[table_at:table_at + 2 * (1 << codec.MAX_CODE_BITS)].view(torch.int16)
        raw = None if raw_at < 0 else buf[raw_at:raw_at + self.numel]
        return codec.Compressed(self.shape, self.dtype, self.numel, self.num_lanes, self.num_words, words,
                                lane_words, table, raw)

    def raw_bytes(self, buf: torch.Tensor) -> torch.Tensor:
        """The stored bytes of this (raw) part, a view of ``buf``."""
        return buf[self.arrays[0]:self.arrays[0] + self.raw_nbytes]


@dataclass(frozen=True)
class CompressedHostTier:
    """Every routed expert of one model, row ``layer * E + expert``, as one record each in ``data``
    (uint8, one host allocation, pinned when the experts are on CUDA): row ``r``'s record is
    ``data[starts[r]:starts[r + 1]]`` laid out as ``parts[r]`` says (module doc)."""

    data: torch.Tensor
    starts: tuple[int, ...]
    parts: tuple[tuple[Part, ...], ...]
    num_moe_layers: int
    num_experts: int
    pinned: bool
    reserved_bytes: int
    raw_nbytes: int  # the same experts' bytes in the raw host tier
    # The descriptor tables a fill listed on the device reads (:func:`descriptor_tables`), on the
    # experts' device: int64 ``[rows, 2]`` and ``[rows, parts, 5]``.
    record_table: torch.Tensor
    part_table: torch.Tensor
    # Per part: the lanes of its coded records (every coded record of a part has the same count: it
    # depends on the element count and ``lane_symbols`` only), 0 where no record codes it.
    part_lanes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Host bytes of the records (what fills copy over the link, all experts together)."""
        return int(self.data.numel())

    @property
    def ratio(self) -> float:
        """Compressed over raw bytes of the whole tier (lower is better)."""
        return self.nbytes / max(1, self.raw_nbytes)

    @property
    def max_record_bytes(self) -> int:
        """The largest expert record: the staging buffer a fill needs."""
        return max(b - a for a, b in zip(self.starts[:-1], self.starts[1:]))

    def record_bytes(self, row: int) -> int:
        """Bytes of host row ``row``'s record (what filling that expert copies)."""
        return self.starts[row + 1] - self.starts[row]

    def check_matches(self, pools: ExpertPools) -> None:
        """Refused: a compressed tier is never read in place (module doc). :meth:`ExpertPools.placed`
        and every in-place reader call this on their host tier."""
        raise CompressedTierError(
            "CompressedHostTier cannot serve as the cold pool of a placement: kernels read cold experts in "
            "place and coded weights cannot be read in place; pass the raw tier (coldset.kernels.tiers.host_tier) "
            "and use the compressed tier only to fill slots (coldset.kernels.compressed_tier.fill_slots)")

    def check_fills(self, pools: ExpertPools) -> None:
        """Refuse slot pools whose expert tensors differ in shape or dtype from this tier's, naming the part."""
        if (pools.num_moe_layers, pools.num_experts) != (self.num_moe_layers, self.num_experts):
            raise CompressedTierError(
                f"compressed host tier holds {self.num_moe_layers} x {self.num_experts} experts, the pools "
                f"{pools.num_moe_layers} x {pools.num_experts}")
        names = pools.expert_parts
        if tuple(p.name for p in self.parts[0]) != names:
            raise CompressedTierError(f"compressed host tier holds parts {[p.name for p in self.parts[0]]}, the pools "
                                      f"{list(names)} (scaled experts carry their scales)")
        for part in self.parts[0]:
            hot = getattr(pools, f"{part.name}_hot")
            if tuple(hot.shape[1:]) != part.shape or hot.dtype != part.dtype:
                raise CompressedTierError(f"compressed host tier part {part.name} is {part.shape} {part.dtype}, the "
                                          f"pools' {part.name}_hot rows {tuple(hot.shape[1:])} {hot.dtype}")


def _pack(tensors: Sequence[tuple[str, torch.Tensor]], lane_symbols: int) -> tuple[torch.Tensor, tuple[Part, ...]]:
    """One expert's record: its parts, each coded where that is smaller (module doc), in one uint8
    CPU tensor, every array 16-byte aligned."""
    chunks: list[tuple[int, torch.Tensor]] = []
    parts = []
    size = 0

    def put(t: torch.Tensor) -> int:
        nonlocal size
        at = _aligned(size)
        b = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        chunks.append((at, b))
        size = at + b.numel()
        return at

    for name, t in tensors:
        raw_nbytes = t.numel() * t.element_size()
        rec = codec.encode(t, lane_symbols=lane_symbols) if t.dtype in codec.FORMATS and t.numel() else None
        if rec is not None and rec.nbytes < raw_nbytes:
            arrays = (put(rec.words), put(rec.lane_words), put(rec.table), -1 if rec.raw is None else put(rec.raw))
            parts.append(Part(name, tuple(t.shape), t.dtype, True, arrays, rec.num_lanes, rec.num_words))
        else:
            parts.append(Part(name, tuple(t.shape), t.dtype, False, (put(t),)))
    out = torch.zeros(_aligned(size), dtype=torch.uint8)
    for at, b in chunks:
        out[at:at + b.numel()] = b
    return out, tuple(parts)


def descriptor_tables(starts: Sequence[int], parts: Sequence[Sequence[Part]], device
                      ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """The records' descriptors as a device-listed fill reads them, built once with the tier:

    - ``record_table`` int64 ``[rows, 2]``: row ``r``'s record as (first 8-byte word in ``data``,
      words), every record being a multiple of 16 bytes at a 16-byte offset;
    - ``part_table`` int64 ``[rows, parts, 5]``: per part (``coded``, then the byte offsets in the
      record of the codec's ``words``, ``lane_words``, ``table`` and ``raw`` plane (-1: none)) where
      coded, ``(0, offset of its bytes, 0, 0, 0)`` where stored raw;
    - ``part_lanes``: per part the lanes of its coded records (0: none coded), refused if two coded
      records of one part disagree (a decode launch takes the count as an argument)."""
    rows = len(starts) - 1
    num_parts = len(parts[0])
    records = torch.tensor([[a // 8, (b - a) // 8] for a, b in zip(starts[:-1], starts[1:])], dtype=torch.int64)
    table = torch.zeros((rows, num_parts, 5), dtype=torch.int64)
    lanes = [0] * num_parts
    for r, layout in enumerate(parts):
        if len(layout) != num_parts:
            raise CompressedTierError(f"compressed host tier: row {r} has {len(layout)} parts, row 0 {num_parts}")
        for p, part in enumerate(layout):
            if part.coded:
                table[r, p] = torch.tensor((1, *part.arrays), dtype=torch.int64)
                if lanes[p] not in (0, part.num_lanes):
                    raise CompressedTierError(f"compressed host tier: part {part.name} is coded in {lanes[p]} lanes "
                                              f"at one row and {part.num_lanes} at row {r}")
                lanes[p] = part.num_lanes
            else:
                table[r, p, 1] = part.arrays[0]
    return records.to(device), table.to(device), tuple(lanes)


def compressed_host_tier(pools: ExpertPools, host_available_bytes: int | None = None,
                         lane_symbols: int = codec.LANE_SYMBOLS) -> CompressedHostTier:
    """Every expert of the all-hot ``pools`` as codec records in one host allocation (module doc).

    Encoded on the pools' device, expert by expert; the records are gathered in plain memory, then
    copied into one allocation (pinned when the pools are on CUDA) checked against the host's
    memory first (:func:`coldset.kernels.tiers.check_host_allocation`; ``host_available_bytes``
    overrides MemAvailable for tests): building holds the records twice, briefly.
    """
    pools._require_all_hot("compressed_host_tier")
    names = pools.expert_parts
    records, layouts, starts = [], [], [0]
    for row in range(pools.num_hot):
        buf, parts = _pack([(n, getattr(pools, f"{n}_hot")[row]) for n in names], lane_symbols)
        records.append(buf)
        layouts.append(parts)
        starts.append(starts[-1] + buf.numel())
    pin = pools.w13_hot.device.type == "cuda"
    reserved = _pinned_block_bytes(starts[-1]) if pin else starts[-1]
    check_host_allocation(reserved, "pinned compressed host tier (every routed expert)" if pin else
                          "compressed host tier (every routed expert)", host_available_bytes)
    data = torch.empty(starts[-1], dtype=torch.uint8, pin_memory=pin)
    for row, buf in enumerate(records):
        data[starts[row]:starts[row + 1]].copy_(buf)
    raw = sum(getattr(pools, f"{n}_hot").numel() * getattr(pools, f"{n}_hot").element_size() for n in names)
    record_table, part_table, part_lanes = descriptor_tables(starts, layouts, pools.w13_hot.device)
    return CompressedHostTier(data=data, starts=tuple(starts), parts=tuple(layouts),
                              num_moe_layers=pools.num_moe_layers, num_experts=pools.num_experts, pinned=pin,
                              reserved_bytes=reserved, raw_nbytes=raw, record_table=record_table,
                              part_table=part_table, part_lanes=part_lanes)


def staging_buffer(tier: CompressedHostTier, device) -> torch.Tensor:
    """Two device buffers, uint8 ``[2, max_record_bytes]``, each holding any one expert's record:
    what :func:`fill_slots` stages through (on CUDA the copy of one expert lands in one while the
    other is decoded)."""
    return torch.empty((2, tier.max_record_bytes), dtype=torch.uint8, device=device)


_COPY_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def _copy_stream(device: torch.device):
    """The side stream the CUDA fill copies records on (one per device, made once)."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def _decode_parts(parts: Sequence[Part], staged: torch.Tensor, pools: ExpertPools, slot: int, decode_into) -> None:
    """Each part of one staged record into slot ``slot`` of ``pools``: decoded, or copied when stored raw."""
    for part in parts:
        dst = getattr(pools, f"{part.name}_hot")[slot]
        if not part.coded:
            dst.view(-1).view(torch.uint8).copy_(part.raw_bytes(staged))
        elif decode_into is not None:
            decode_into(part.record(staged), dst)
        else:
            dst.copy_(codec.decode(part.record(staged)))


def fill_slots(tier: CompressedHostTier, pools: ExpertPools, host_rows: Sequence[int], slots: Sequence[int],
               staging: torch.Tensor | None = None) -> None:
    """Fill hot rows ``slots[i]`` of ``pools`` (weights and, when scaled, scales) with the expert of
    host row ``host_rows[i]``: its record copied into a staging buffer (one copy), each part decoded
    into the slot (Triton decoder on CUDA, torch decoder on the CPU) or, if stored raw, copied.

    Bitwise what copying the raw host tier's rows would write. On CUDA the records are copied on a
    side stream into the two staging buffers in turn and decoded on the current stream, so the copy
    of expert ``i + 1`` overlaps the decode of expert ``i`` (the timeline of
    :func:`coldset.analysis.speed.compressed_fill_s`); the current stream waits for every copy
    before it returns, and no host synchronisation is made, so a CUDA graph can capture a fill.
    Host indices: the captured step's fills, decided on the device, are
    :func:`coldset.kernels.triton_codec_fill.fill_listed`'s."""
    tier.check_fills(pools)
    if len(host_rows) != len(slots):
        raise CompressedTierError(f"fill_slots: {len(host_rows)} host rows for {len(slots)} slots")
    device = pools.w13_hot.device
    if staging is None:
        staging = staging_buffer(tier, device)
    if staging.dtype != torch.uint8 or staging.device != device or staging.dim() != 2 or staging.shape[0] != 2 \
            or staging.shape[1] < tier.max_record_bytes:
        raise CompressedTierError(f"fill_slots: staging {staging.dtype} {tuple(staging.shape)} on {staging.device}, "
                                  f"expected uint8 (2, >= {tier.max_record_bytes}) on {device} (staging_buffer)")
    num_rows = len(tier.starts) - 1
    pairs = [(int(r), int(s)) for r, s in zip(host_rows, slots)]
    for row, slot in pairs:
        if not 0 <= row < num_rows or not 0 <= slot < pools.num_hot:
            raise CompressedTierError(f"fill_slots: host row {row} (of {num_rows}) or slot {slot} "
                                      f"(of {pools.num_hot}) out of range")
    if device.type != "cuda":
        for row, slot in pairs:
            staged = staging[0, :tier.record_bytes(row)]
            staged.copy_(tier.data[tier.starts[row]:tier.starts[row + 1]])
            _decode_parts(tier.parts[row], staged, pools, slot, None)
        return
    from coldset.kernels.triton_codec import decode_into  # GPU-only path (Triton)

    current, side = torch.cuda.current_stream(device), _copy_stream(device)
    side.wait_stream(current)  # the staging buffers and slots are free once earlier work is done
    decoded: list[torch.cuda.Event] = []
    for i, (row, slot) in enumerate(pairs):
        staged = staging[i % 2, :tier.record_bytes(row)]
        with torch.cuda.stream(side):
            if i >= 2:
                side.wait_event(decoded[i - 2])  # the decode that last read this buffer
            staged.copy_(tier.data[tier.starts[row]:tier.starts[row + 1]], non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(side)
        current.wait_event(landed)
        _decode_parts(tier.parts[row], staged, pools, slot, decode_into)
        done = torch.cuda.Event()
        done.record(current)
        decoded.append(done)
    current.wait_stream(side)
