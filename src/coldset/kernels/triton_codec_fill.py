"""Compressed slot fills listed on the device: the slot cache's fills from the compressed host tier, in the step.

On CUDA the slot cache decides its victims and admitted instances on the device
(:mod:`coldset.kernels.triton_slots`): the fill gets device tensors (slots, instances, a device
count ``m``) and must not read them on the host. This fill takes the same tensors as
:func:`coldset.kernels.triton_slots.fill` and writes bitwise what that raw fill writes, reading the
compressed host tier (:mod:`coldset.kernels.compressed_tier`) instead of the raw one, from launches
whose grids are fixed by the list's length (graph-capturable, no host synchronisation). Two kinds of work:

- **the record copy** (:func:`_copy_stripes`): every program copies its stripe of each listed
  expert's record from the pinned host allocation, read in place over UVA as the raw fill reads its
  rows, into row ``j`` of an HBM staging buffer; the record's place comes from the tier's
  ``record_table``;
- **the decode** (:func:`_decode_part`): a program per (stripe, part) decodes lane blocks of the
  staged records into the slots' rows (one thread a lane, as :mod:`coldset.kernels.triton_codec`),
  reading each record's layout from the tier's ``part_table``; a part stored raw (too small to carry
  its decode table, FP8's float32 scales, or not smaller coded) is copied element for element from
  the staged record. A scaled expert's scales are parts of its record: they land with its weights.

The copy crosses the link and the decode reads HBM, so they overlap: the listed rows are split in
halves (the first ``ceil(m / 2)``, the rest) and :func:`fill_listed` runs three launches, (1) the
first half's copy, (2) the first half's decode, whose grid starts with programs of its own that copy
the second half meanwhile, (3) the second half's decode.

Why staged and not decoded straight from pinned memory: a lane reads its own stream a word at a
time at its own pace and every symbol looks up the 8 KiB decode table, scattered small reads that
over the host link would cost a transaction each; the copy instead moves each record once in
coalesced 8-byte words at the link's rate, and the decode then reads HBM and cache. Why halves in
launches and not per-record landed flags in one launch: the decode of a record needs all of it
landed, and a wait inside one launch would depend on which programs the hardware schedules first;
the copy programs of launch (2) wait on nothing.

Tags (nexttoken's prefetch, ``tags=(tag list, done, ticket)``): as the raw fill, the last program of
the last decode launch to finish writes each filled slot's tag into ``done`` (an acq_rel ticket), so a
commit that finds its tag knows the slot's rows, weights and scales, have landed.

Staging: a buffer of ``list_rows`` records (the longest list the cache hands a fill) per CUDA
stream the fills run on, made at its first fill on that stream and kept (the fills of one stream
run in order, so they share it; a demand fill and a prefetch on another stream never do). Its bytes
are ``list_rows x`` the largest record: HBM beside the slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from coldset.core.codec import MAX_CODE_BITS
from coldset.kernels.compressed_tier import CompressedHostTier, CompressedTierError
from coldset.kernels.triton_codec import decode_lanes

COPY_BLOCK = 1024  # 8-byte words per load in the record copy (8 KiB, the raw fill's 4096 bf16)
LANES = 128  # lanes a decode work item decodes (one thread each)
RAW_BLOCK = 1024  # elements per load of a part stored raw
# What a part's elements are, for the decode: bf16 (a coded record has a raw plane: int16 stores),
# a one-byte format (a coded record is the byte itself), or a dtype the codec does not take
# (float32 scales: always stored raw).
KIND_BF16, KIND_BYTE, KIND_UNCODED = 0, 1, 2
_ELEMENT_VIEWS = {torch.bfloat16: (torch.int16, KIND_BF16), torch.float8_e4m3fn: (torch.uint8, KIND_BYTE),
                  torch.uint8: (torch.uint8, KIND_BYTE), torch.int8: (torch.uint8, KIND_BYTE),
                  torch.float32: (torch.int32, KIND_UNCODED)}
MAX_PARTS = 4  # w13, w2 and, scaled, w13_scale, w2_scale
# Decode programs per part for each block per weight a fill is given (the raw fill's ``blocks``):
# enough that every (record, lane block) of a layer's misses decodes at once; programs past the
# filled rows' work return at once.
DECODE_PROGRAMS_PER_BLOCK = 8


@triton.jit
def _half_range(m, HALF: tl.constexpr):
    """The listed rows ``[lo, hi)`` of ``HALF``: 0 all ``m``, 1 the first ``ceil(m / 2)``, 2 the rest."""
    split = (m + 1) // 2
    lo = m * 0
    hi = m
    if HALF == 1:
        hi = split
    if HALF == 2:
        lo = split
    return lo, hi


@triton.jit
def _copy_stripes(data_ptr, record_ptr, inst_ptr, lo, hi, stage_ptr, stage_words, pid,
                  NP: tl.constexpr, BLOCK: tl.constexpr, MV: tl.constexpr):
    """Row ``j`` of the staging (int64 words) = host row ``inst[j]``'s record, ``lo <= j < hi``;
    program ``pid``'s stripe: ``BLOCK`` words every ``NP * BLOCK``."""
    for j in range(0, MV):  # a constant bound (j in [lo, hi) inside): the same loop in Triton's interpreter
        if (j >= lo) & (j < hi):
            inst = tl.load(inst_ptr + j).to(tl.int64)
            first = tl.load(record_ptr + inst * 2)
            words = tl.load(record_ptr + inst * 2 + 1)
            src = data_ptr + first
            dst = stage_ptr + tl.cast(j, tl.int64) * stage_words
            for start in range(0, stage_words, NP * BLOCK):
                offs = start + pid * BLOCK + tl.arange(0, BLOCK)
                ok = offs < words
                tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)


@triton.jit
def _copy_records_kernel(data_ptr, record_ptr, inst_ptr, count_ptr, stage_ptr, stage_words,
                         NP: tl.constexpr, BLOCK: tl.constexpr, MV: tl.constexpr, HALF: tl.constexpr):
    """The records of the listed rows of ``HALF`` (:func:`_half_range`) into their staging rows."""
    lo, hi = _half_range(tl.load(count_ptr), HALF)
    _copy_stripes(data_ptr, record_ptr, inst_ptr, lo, hi, stage_ptr, stage_words, tl.program_id(0), NP, BLOCK, MV)


@triton.jit
def _decode_lanes(desc, base, b, dst, numel, num_lanes, depth, stage_u8, stage_i16, stage_i32,
                  KIND: tl.constexpr, LANES: tl.constexpr, MAX_BITS: tl.constexpr):
    """Lanes ``[b * LANES, (b + 1) * LANES)`` of the coded part whose descriptor is at ``desc``, in
    the record staged at byte ``base``, into ``dst`` (one row): :mod:`coldset.kernels.triton_codec`'s
    decode with the record's arrays at their staged offsets."""
    lanes = b * LANES + tl.arange(0, LANES)
    live = lanes < num_lanes
    words = stage_i32 + (base + tl.load(desc + 1)) // 4
    pos = tl.load(stage_i32 + (base + tl.load(desc + 2)) // 4 + lanes, mask=live, other=0).to(tl.int64) * 32
    table = stage_i16 + (base + tl.load(desc + 3)) // 2
    raw = stage_u8 + base + tl.load(desc + 4)
    decode_lanes(words, pos, lanes, live, table, raw, dst, numel, num_lanes, depth, KIND == 0, MAX_BITS)


@triton.jit
def _copy_stored(src, dst, numel, b, chunk, RAW_BLOCK: tl.constexpr):
    """Elements ``[b * chunk, (b + 1) * chunk)`` of a part stored raw, ``src`` to ``dst`` (one row)."""
    for start in range(0, chunk, RAW_BLOCK):
        offs = b * chunk + start + tl.arange(0, RAW_BLOCK)
        ok = (offs < numel) & (offs < (b + 1) * chunk)
        tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)


@triton.jit
def _decode_part(p, num_parts, part_ptr, inst_ptr, slots_ptr, lo, hi, rows, stage_u8, stage_i16, stage_i32, stage_el,
                 stage_bytes, dst_ptr, numel, num_lanes, depth, blocks, chunk, pid,
                 KIND: tl.constexpr, NP: tl.constexpr, LANES: tl.constexpr, RAW_BLOCK: tl.constexpr,
                 MAX_BITS: tl.constexpr):
    """Part ``p`` of the staged records ``lo <= j < hi`` into rows ``slots[j]`` of ``dst_ptr`` (elements of
    the part's width, ``numel`` a row). Work item ``w = j * blocks + b`` (``b < blocks``) is program
    ``w % NP``'s, so every (record, block) of the filled rows runs at once where ``NP`` covers them:
    coded, lanes ``[b * LANES, (b + 1) * LANES)`` decoded (a lane's symbols are a chain of dependent
    reads: parallel lanes are the decode's rate); stored raw, elements ``[b * chunk, (b + 1) * chunk)``
    copied from ``stage_el``, the staging viewed in the part's element width."""
    for w0 in range(0, rows * blocks, NP):
        w = w0 + pid
        j = w // blocks
        if (j >= lo) & (j < hi):
            b = w % blocks
            inst = tl.load(inst_ptr + j).to(tl.int64)
            slot = tl.load(slots_ptr + j).to(tl.int64)
            desc = part_ptr + (inst * num_parts + p) * 5
            coded = tl.load(desc)
            base = tl.cast(j, tl.int64) * stage_bytes  # the staging's byte offsets may pass 2**31
            dst = dst_ptr + slot * numel
            if KIND == 0:
                src = stage_el + (base + tl.load(desc + 1)) // 2
            elif KIND == 1:
                src = stage_el + base + tl.load(desc + 1)
            else:
                src = stage_el + (base + tl.load(desc + 1)) // 4
            if KIND == 2:
                _copy_stored(src, dst, numel, b, chunk, RAW_BLOCK)
            elif coded == 0:
                _copy_stored(src, dst, numel, b, chunk, RAW_BLOCK)
            elif b * LANES < num_lanes:
                _decode_lanes(desc, base, b, dst, numel, num_lanes, depth, stage_u8, stage_i16, stage_i32,
                              KIND, LANES, MAX_BITS)


@triton.jit
def _decode_records_kernel(part_ptr, inst_ptr, slots_ptr, count_ptr, rows, stage_u8, stage_i16, stage_i32,
                           stage_bytes, num_parts, tags_ptr, done_ptr, ticket_ptr,
                           d0, e0, n0, l0, k0, b0, c0, d1, e1, n1, l1, k1, b1, c1,
                           d2, e2, n2, l2, k2, b2, c2, d3, e3, n3, l3, k3, b3, c3,
                           data_ptr, record_ptr, stage_i64, stage_words,
                           K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
                           NP: tl.constexpr, LANES: tl.constexpr, RAW_BLOCK: tl.constexpr, MAX_BITS: tl.constexpr,
                           MV: tl.constexpr, TAGS: tl.constexpr, HALF: tl.constexpr, COPY_NP: tl.constexpr,
                           COPY_BLOCK: tl.constexpr):
    """Program ``(i, p)``, ``i >= COPY_NP``: its stripe of part ``p`` of the staged records of ``HALF``
    (:func:`_half_range`, :func:`_decode_part`; per part: destination, staging view, elements, lanes,
    depth, work items, raw chunk, kind). Programs ``i < COPY_NP`` of ``p == 0`` copy the second half's
    records into the staging meanwhile (``HALF`` 1 with ``COPY_NP > 0``: the copy beside the decode).
    With ``TAGS`` the last program to finish writes ``done[slots[j]] = tags[j]``, ``j < m``."""
    pid = tl.program_id(0) - COPY_NP
    p = tl.program_id(1)
    m = tl.load(count_ptr)
    lo, hi = _half_range(m, HALF)
    if pid < 0:  # a copy program (first, so the hardware starts them first; they wait on nothing)
        if p == 0:
            split, end = _half_range(m, 2)
            _copy_stripes(data_ptr, record_ptr, inst_ptr, split, end, stage_i64, stage_words, pid + COPY_NP,
                          COPY_NP, COPY_BLOCK, MV)
    elif p == 0:
        _decode_part(0, num_parts, part_ptr, inst_ptr, slots_ptr, lo, hi, rows, stage_u8, stage_i16, stage_i32, e0,
                     stage_bytes, d0, n0, l0, k0, b0, c0, pid, K0, NP, LANES, RAW_BLOCK, MAX_BITS)
    elif p == 1:
        _decode_part(1, num_parts, part_ptr, inst_ptr, slots_ptr, lo, hi, rows, stage_u8, stage_i16, stage_i32, e1,
                     stage_bytes, d1, n1, l1, k1, b1, c1, pid, K1, NP, LANES, RAW_BLOCK, MAX_BITS)
    elif p == 2:
        _decode_part(2, num_parts, part_ptr, inst_ptr, slots_ptr, lo, hi, rows, stage_u8, stage_i16, stage_i32, e2,
                     stage_bytes, d2, n2, l2, k2, b2, c2, pid, K2, NP, LANES, RAW_BLOCK, MAX_BITS)
    else:
        _decode_part(3, num_parts, part_ptr, inst_ptr, slots_ptr, lo, hi, rows, stage_u8, stage_i16, stage_i32, e3,
                     stage_bytes, d3, n3, l3, k3, b3, c3, pid, K3, NP, LANES, RAW_BLOCK, MAX_BITS)
    if TAGS:
        # as the raw fill: the last program to finish writes each slot's tag, once every row landed
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
            jv = tl.arange(0, MV)
            ok = jv < m
            s = tl.load(slots_ptr + jv, mask=ok, other=0)
            tl.store(done_ptr + s, tl.load(tags_ptr + jv, mask=ok, other=0), mask=ok)
            tl.store(ticket_ptr, 0)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass
class ListedFill:
    """A slot cache's compressed fills listed on the device (module doc): the tier, the longest list
    a fill is given (``list_rows``, the staging's rows) and the staging buffers by CUDA stream."""

    tier: CompressedHostTier
    list_rows: int
    staging: dict[int, torch.Tensor] = field(default_factory=dict)

    def staging_for(self, device: torch.device) -> torch.Tensor:
        """uint8 ``[list_rows, record bytes]`` of the current stream (made at its first fill)."""
        key = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        if key not in self.staging:
            width = -(-self.tier.max_record_bytes // 16) * 16
            self.staging[key] = torch.empty((self.list_rows, width), dtype=torch.uint8, device=device)
        return self.staging[key]

    def fill(self, pools, slots: torch.Tensor, instances: torch.Tensor, count: torch.Tensor,
             blocks: int = 128, tags: tuple | None = None) -> None:
        """:func:`fill_listed` with this cache's tier and staging (the dispatch of
        :func:`coldset.kernels.triton_slots.fill`)."""
        fill_listed(self.tier, pools, slots, instances, count, self.staging_for(pools.w13_hot.device),
                    blocks=blocks, tags=tags)


def part_launch_args(tier: CompressedHostTier, pools, programs: int) -> tuple[list, list]:
    """Per part of ``tier``'s records: the decode's arguments (the slots viewed in the part's element
    width, that view's dtype (the staging is read in it where the part is stored raw), elements a
    row, lanes, depth, work items a record, elements a raw work item copies) and its kind, for
    :func:`_decode_records_kernel`. A part coded anywhere has a work item per lane block (a record
    of it stored raw is copied in as many chunks); one never coded, at most ``programs`` chunks of
    at least :data:`RAW_BLOCK` elements."""
    args, kinds = [], []
    for p, part in enumerate(tier.parts[0]):
        view, kind = _ELEMENT_VIEWS.get(part.dtype, (None, None))
        if view is None:
            raise CompressedTierError(f"fill_listed: part {part.name} of dtype {part.dtype} has no element view "
                                      f"(known: {', '.join(str(d) for d in _ELEMENT_VIEWS)})")
        lanes = tier.part_lanes[p]
        if kind == KIND_UNCODED and lanes:
            raise CompressedTierError(f"fill_listed: part {part.name} ({part.dtype}) is coded in some record")
        numel = part.numel
        blocks = -(-lanes // LANES) if lanes else max(1, min(programs, -(-numel // RAW_BLOCK)))
        chunk = -(-numel // blocks)
        depth = -(-numel // lanes) if lanes else 0
        dst = getattr(pools, f"{part.name}_hot").view(view)
        args.append([dst, view, numel, lanes, depth, blocks, chunk])
        kinds.append(kind)
    return args, kinds


def fill_listed(tier: CompressedHostTier, pools, slots: torch.Tensor, instances: torch.Tensor,
                count: torch.Tensor, staging: torch.Tensor, blocks: int = 128, tags: tuple | None = None) -> None:
    """``slot[slots[j]] = decode(record of host row instances[j])`` for every part (weights and, when
    scaled, scales) and ``j < count`` (a device scalar, at most ``slots.numel()``): bitwise
    :func:`coldset.kernels.triton_slots.fill` from the raw host tier (module doc). ``staging``: uint8
    ``[>= slots.numel(), >= max record bytes]`` on the slots' device. ``blocks``: the raw fill's
    blocks per weight; a copy runs ``2 * blocks`` programs, a decode
    ``DECODE_PROGRAMS_PER_BLOCK * blocks`` per part; three launches, the second half's copy beside
    the first half's decode (module doc).
    ``tags``: ``(tag list, done, ticket)`` as the raw fill's."""
    tier.check_fills(pools)
    device = pools.w13_hot.device
    rows = slots.numel()
    if instances.numel() < rows or count.numel() != 1:
        raise CompressedTierError(f"fill_listed: {instances.numel()} instances for {rows} slots, count of "
                                  f"{count.numel()} elements (one expected)")
    if staging.dtype != torch.uint8 or staging.device != device or staging.dim() != 2 or staging.shape[0] < rows \
            or staging.shape[1] < tier.max_record_bytes or staging.shape[1] % 16 or not staging.is_contiguous():
        raise CompressedTierError(f"fill_listed: staging {staging.dtype} {tuple(staging.shape)} on {staging.device}, "
                                  f"expected contiguous uint8 (>= {rows}, >= {tier.max_record_bytes}, a multiple "
                                  f"of 16) on {device}")
    if tier.record_table.device != device:
        raise CompressedTierError(f"fill_listed: the tier's descriptor tables are on {tier.record_table.device}, the "
                                  f"slots on {device}")
    # the first half's records, then their decode beside the second half's copy, then its decode
    copy_records(tier, instances, count, staging, rows, blocks, half=1)
    decode_records(tier, pools, slots, instances, count, staging, blocks, half=1, copy_second_half=True)
    decode_records(tier, pools, slots, instances, count, staging, blocks, tags, half=2)


def copy_records(tier: CompressedHostTier, instances: torch.Tensor, count: torch.Tensor, staging: torch.Tensor,
                 rows: int, blocks: int = 128, half: int = 0) -> None:
    """Staging row ``j`` = host row ``instances[j]``'s record, read over the link, for the listed rows
    ``j < count`` (at most ``rows``) of ``half`` (0 all, 1 the first ``ceil(count / 2)``, 2 the
    rest; arguments checked by :func:`fill_listed`)."""
    _copy_records_kernel[(2 * int(blocks),)](
        tier.data.view(torch.int64), tier.record_table, instances, count.reshape(1), staging.view(torch.int64),
        staging.shape[1] // 8, NP=2 * int(blocks), BLOCK=COPY_BLOCK, MV=max(2, _next_pow2(rows)), HALF=half,
        num_warps=4)


def decode_records(tier: CompressedHostTier, pools, slots: torch.Tensor, instances: torch.Tensor,
                   count: torch.Tensor, staging: torch.Tensor, blocks: int = 128, tags: tuple | None = None,
                   half: int = 0, copy_second_half: bool = False) -> None:
    """The records staged by :func:`copy_records` decoded into rows ``slots[j]`` for the listed rows
    of ``half`` (as :func:`copy_records`'), reading HBM only (its time alone is the decoder's rate);
    ``copy_second_half``: the launch also runs the second half's record copy, in programs of its own
    placed first in the grid (they wait on nothing), beside this decode."""
    rows = slots.numel()
    mv = max(2, _next_pow2(rows))
    count = count.reshape(1)
    programs = DECODE_PROGRAMS_PER_BLOCK * int(blocks)
    copy_np = 2 * int(blocks) if copy_second_half else 0
    per_part, kinds = part_launch_args(tier, pools, programs)
    views = {torch.uint8: staging, torch.int16: staging.view(torch.int16), torch.int32: staging.view(torch.int32)}
    flat: list = []
    for p in range(MAX_PARTS):
        if p < len(per_part):
            dst, view, numel, lanes, depth, work, chunk = per_part[p]
            flat += [dst, views[view], numel, lanes, depth, work, chunk]
        else:  # no such part: never read (its programs are not launched)
            flat += [staging, staging, 0, 0, 0, 0, 0]
    kinds += [KIND_UNCODED] * (MAX_PARTS - len(kinds))
    tag_list, done, ticket = tags if tags is not None else (count, count, count)
    _decode_records_kernel[(copy_np + programs, len(per_part))](
        tier.part_table, instances, slots, count, rows, staging, views[torch.int16], views[torch.int32],
        staging.shape[1], len(per_part), tag_list, done, ticket, *flat, tier.data.view(torch.int64),
        tier.record_table, staging.view(torch.int64), staging.shape[1] // 8, K0=kinds[0], K1=kinds[1], K2=kinds[2],
        K3=kinds[3], NP=programs, LANES=LANES, RAW_BLOCK=RAW_BLOCK, MAX_BITS=MAX_CODE_BITS, MV=mv,
        TAGS=tags is not None, HALF=half, COPY_NP=copy_np, COPY_BLOCK=COPY_BLOCK, num_warps=4)
