"""The fused MoE experts kernel in Triton, reading each expert through the int32 row map.

Three launches per call, all with grid shapes fixed by the batch size (CUDA-graph capturable):

1. ``_w13_act_kernel``: for each (expert, block of ``block_n1`` columns of I), the tokens routed to
   that expert times the gate and up rows of w13, then SiLU(gate) * up, written to a per-pair
   activation scratch ``[T*k, I]`` in the activation dtype;
2. ``_w2_kernel``: for each (expert, block of ``block_n2`` rows of H), that scratch times w2,
   scaled by the routing weight, written (fp32; with ``half_buf`` in the activation dtype) to a
   per-pair buffer ``[T*k, H]``;
3. ``_sum_topk_kernel``: out[t] = sum over rank 0..k-1 of the buffer, in that fixed order.

Experts with biases and another activation (the pools' ``w13_bias``, ``w2_bias`` and
``activation``: :mod:`coldset.kernels.activation`, gpt-oss's clamped SwiGLU) compile other code
through constexprs (``HAS_BIAS``, ``ACT``, ``ALPHA``, ``LIMIT``: :func:`epilogue_args`): w13's bias
is added to the fp32 gate and up sums before the activation, w2's to the fp32 product before the
routing weight (in split 0's partial sum under split-K), as transformers' ``GptOssExperts``
orders them. Biases are ``[L, E, n]`` tensors read at (layer, expert id), the block's expert, never
through the row map: they stay resident, so a placement or a slot fill never moves them. Without
them (``HAS_BIAS=0``, ``ACT=0``) the SiLU kernels compile to the code they are without this.

With ``pdl`` (Hopper's programmatic dependent launch) the second and third launch start while the
one before still runs and wait on the grid dependency before reading its output; with ``pdl=3``
the first launch (and the grouping's) too: it starts while whatever kernel came before still runs
(the router, a cache update: unknown here) and waits on it before reading anything. In the
decode step the router releases its dependents at its start, so those early w13 blocks sit
resident from before the router's own wait: the tuned decode configs keep ``pdl=2``.

With ``split_k1`` / ``split_k2`` > 1 (split-K, for small batches where one block per column slice
leaves too few bytes in flight) step 1 writes fp32 partial gate and up sums per split instead of
the activation, and step 2 adds them (split 0 first) and forms SiLU(gate) * up as it loads its A
operand; step 2's own splits go to separate fp32 buffers that step 3 adds after the ranks' order
(rank 0's splits, then rank 1's, ...). Every sum has a fixed order, so split-K is deterministic too.
``tile_order=1`` numbers the blocks so that one tile's column blocks are neighbours (vLLM's grid
order): at prefill its gathered activation tile is then shared through L2 instead of being read
from HBM once per column block. Split-K was slower at every batch size at Qwen3-30B-A3B shapes on
the H200, so the autotuner does not search it.

Splitting the weight rows of every expert over many blocks (step 1 over the 2I rows of w13, step 2
over the H rows of w2) is what lets reads of the cold pool in pinned host memory fill the PCIe link:
one block per expert leaves the link mostly idle (docs/design.md §6). There are no atomics and every
reduction has a fixed order, so outputs are bitwise reproducible.

The expert id enters in exactly one place, :func:`_expert_base`: one load of the row map picks the
pool (hot device pointer or cold pinned host pointer) and the row, uniformly for the whole block.
With ``USE_ROW_MAP=False`` that helper compiles to ``row = layer * E + expert`` on the hot pool:
the unmodified path the parity gate compares against. Tiling and accumulation order do not depend
on where an expert lives, so both give bitwise the same output for any placement.

Tokens are grouped by expert in one of two ways (same per-expert pair order, ascending pair index):
- ``MODE_SLOTS`` (T*k <= min(E, config.slot_max_pairs), decode): grid dimension 0 is min(E, T*k) *slots*; block s finds the
  s-th distinct selected expert and compacts that expert's pairs inside the kernel: no host-side
  preparation at all, so a decode step is exactly three launches;
- ``MODE_SORTED`` (larger batches, prefill): the pairs grouped by expert (the order of a stable
  sort of their expert ids, and each expert's range: :func:`group_pairs`, one launch up to
  ``GROUP_KERNEL_MAX_PAIRS`` pairs, two above: a counting sort over chunks); grid dimension 0 is
  the *tiles*, one per (expert, chunk of block_m pairs), numbered expert by expert inside the
  kernel (an in-register prefix sum over the per-expert counts, no host sync), so an expert's
  chunks run side by side and share its weight slices through L2; the grid is sized for the most
  tiles T*k pairs can need.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from coldset.kernels.configs import load as load_kernel_configs

if TYPE_CHECKING:  # annotations only: the kernels do not import the tiers (no import circle)
    from coldset.kernels.tiers import ExpertPools

try:  # grid dependency control (programmatic dependent launch, sm90+), in triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton: configs with pdl=1 cannot be used
    gdc_launch_dependents = gdc_wait = None

MODE_SLOTS = 0
MODE_SORTED = 1

# Up to this many (token, rank) pairs the sorted grouping is one launch of _group_pairs_kernel
# (one block: a bitonic sort and a histogram in registers); above it, two launches of a counting sort
# over chunks of GROUP_CHUNK pairs (_group_count_kernel, _group_scatter_kernel). Both replace
# torch's stable sort + searchsorted (several launches and a sizeable share of a prefill layer).
GROUP_KERNEL_MAX_PAIRS = 1024
GROUP_CHUNK = 1024


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the three kernels (the autotune search space's elements).

    ``block_m``: tokens per tile; ``block_n1``: columns of I per block in the w13 step (the split
    of w13's rows); ``block_k1``: slice of H per step; ``block_n2``: rows of H per block in the w2
    step; ``block_k2``: slice of I per step; ``num_warps``/``num_stages``: as in Triton;
    ``slot_max_pairs``: up to this many (token, rank) pairs (and at most E) the tokens are grouped
    inside the kernel (``MODE_SLOTS``, no host preparation), above it by a sort on the device
    (``MODE_SORTED``, :func:`group_pairs`). Both give the same pair order and chunking, so the
    choice changes speed, not results. ``pdl``: 1 launches the w2 and sum kernels with programmatic dependent launch
    (Hopper): the w2 blocks start while the w13 blocks still run, stream their weight slice into
    L2 (kept with evict_last while w13's once-read weights go evict_first), then wait for the
    activations; the arithmetic is unchanged, so results are the same bits as with ``pdl=0``.
    ``pdl=2``: the same early launch of the w2 and sum kernels without the prefetch (their blocks
    look up their expert and wait): it hides the launch gaps only, and reads each weight once.
    ``pdl=3``: as 2, and the grouping and w13 launches are dependent launches as well: their
    blocks start while the kernel before them (any kernel) still runs and wait for it before
    reading anything; the w13 blocks let the w2 kernel launch only after that wait (w2 looks up
    ids and the row map before its own wait). The same bits again.

    ``split_k1`` / ``split_k2``: split-K, the reduction dimension of w13 (H) / of w2 (I) cut into
    that many ranges of whole ``block_k`` steps, one block each, so a small batch runs more blocks
    (more bytes in flight) for the same weights. The partial sums go to fp32 buffers and are added
    in a fixed order (split 0 first) by the next launch: w13's by the w2 kernel as it loads its
    activations (SiLU(gate) * up formed there), w2's by the top-k sum (rank-major, then split).
    They change the rounding of the fp32 sums, so a config's bits depend on them, never on the
    placement. ``tile_order``: 0 numbers the blocks tile-fastest (all tiles' first column block,
    then the second, ...), 1 column-fastest (one tile's column blocks are neighbours, as vLLM's
    grid with GROUP_SIZE_M=1): at prefill the gathered activation tile is then read from HBM once
    and shared through L2 by its column blocks instead of once per column block. It changes the
    order blocks are scheduled in, not any block's arithmetic: the same bits either way.
    ``half_buf``: 1 has the w2 kernel write each (token, rank) product rounded to the activation
    dtype (bf16 / fp16, as vLLM's intermediate cache) instead of fp32; the top-k sum still adds in
    fp32 in rank order. It halves the per-pair buffer's bytes (at 2,048 tokens of Qwen3-30B-A3B
    134 -> 67 MB written and read back) and rounds each product once more: a config's bits depend
    on it, never on the placement (the autotuner's torch-path check bounds its error like any other).
    ``half_tail``: 1 runs an expert's last chunk as a tile of ``block_m // 2`` rows when it holds at
    most that many pairs, 2 also as one of ``block_m // 4`` rows when it fits there (needs
    ``block_m >= 32`` / ``64``: a dot needs 16 rows). At prefill the pairs of an expert rarely fill
    their last tile: at 2,048 tokens of top-8 over 128 experts an expert has ~128 +- 11 pairs, so
    tiles of 128 rows do ~1.5x the MMA work of the real rows (1.25x with halves, 1.125x with
    quarters), and w13 and w2 are bound by that work there rather than by the weights' bytes. A
    smaller tile's rows take the same k steps in the same order, and which tile a pair falls in
    depends on the routing alone, never on the placement.

    ``quant_x`` / ``quant_act``: the block-FP8 kernel's (:mod:`coldset.kernels.triton_fp8`) points
    of activation quantization; the bf16 kernel has none and ignores them. ``quant_x``: 0 the
    tokens are quantized per group of 128 by a launch of their own before w13, 1 by the w13 launch
    itself, each block its ``[block_m, 128]`` tile per k step (no separate launch). ``quant_act``:
    0 the intermediate is quantized by the w13 launch's epilogue when ``block_n1`` is a multiple of
    128 (a block then holds whole groups), else by a launch of its own (the rule before the field
    existed); 1 always by the w13 epilogue (refused unless ``block_n1`` is a multiple of 128);
    2 always by its own launch. Every choice gives the same bits: they choose speed, not results.
    ``w8a16``: 1 runs the block-FP8 kernel weight-only (its decode mode): no activation is
    quantized, each FP8 weight tile is converted to the activation dtype (exact) and dotted with the
    bf16/fp16 tokens and intermediate, so a layer runs three launches as here. Unlike the options
    above it changes the numbers (no activation rounding to e4m3): a config's bits depend on it,
    never on the placement. 2: the same with bf16 activations' weight tiles converted by bit
    operations instead of triton's per-value conversion (the same bits for every finite e4m3 value:
    a speed choice). The bf16 kernel ignores it.
    ``swap_ab``: 1 has the block-FP8 kernel's dots compute the transposed products (the weights'
    rows as the MMA's M, the tokens as its N), which Hopper runs as FP8 warpgroup MMAs where a
    16-token tile otherwise runs f16 ``mma.sync`` on converted weights (its docstring); other fp32
    sums within a k step, so a config's bits depend on it, never on the placement. The bf16 kernel
    ignores it.
    """

    block_m: int = 16
    block_n1: int = 32
    block_k1: int = 128
    block_n2: int = 32
    block_k2: int = 128
    num_warps: int = 4
    num_stages: int = 3
    slot_max_pairs: int = 32
    pdl: int = 0
    split_k1: int = 1
    split_k2: int = 1
    tile_order: int = 0
    half_buf: int = 0
    half_tail: int = 0
    quant_x: int = 0
    quant_act: int = 0
    w8a16: int = 0
    swap_ab: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KernelConfig":
        return cls(**{k: int(v) for k, v in d.items()})


# The defaults when no tuned entry exists (coldset.kernels.configs: triton_moe.json): small tiles
# spread over many blocks for decode, where the weights' bytes bound the time; large tiles (wgmma)
# for prefill.
DEFAULT_DECODE_CONFIG = KernelConfig.from_dict(load_kernel_configs("triton_moe")["defaults"]["decode"])
DEFAULT_PREFILL_CONFIG = KernelConfig.from_dict(load_kernel_configs("triton_moe")["defaults"]["prefill"])


def default_config(num_tokens: int, top_k: int = 8) -> KernelConfig:
    """The documented default: decode tiles up to 64 tokens, prefill tiles above."""
    return DEFAULT_DECODE_CONFIG if num_tokens <= 64 else DEFAULT_PREFILL_CONFIG


@triton.jit
def _group_pairs_kernel(ids_ptr, sorted_pairs_ptr, expert_off_ptr, num_pairs,
                        E: tl.constexpr, EP1: tl.constexpr, NP: tl.constexpr, USE_GDC: tl.constexpr):
    """Pairs grouped by expert in one block: the same permutation as a stable sort of the ids, and
    the same offsets as searchsorted(sorted ids, 0..E) (expert e's pairs are sorted_pairs[off[e]:off[e+1]]).

    The sort key ``expert * NP + pair`` is unique and orders pairs of one expert by pair index,
    which is what a stable sort gives; pads carry expert E and sort after every real pair. Ids
    outside [0, E) are moved to E as well: no expert's range includes them and the histogram
    never indexes past its bins.
    ``USE_GDC``: launched as a dependent of the kernel before (which may write the ids): wait for
    it, then let the w13 kernel launch (which waits on this one in turn).
    """
    if USE_GDC:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.arange(0, NP)
    ok = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=ok, other=E).to(tl.int32)
    ids = tl.where((ids >= 0) & (ids < E), ids, E)  # an id outside [0, E) is in no expert's range, like a pad
    key = tl.sort(ids * NP + offs)
    tl.store(sorted_pairs_ptr + offs, key % NP, mask=ok)
    counts = tl.histogram(ids, EP1)  # bins 0..E-1 real, bin E the pads
    offs_e = tl.arange(0, EP1)
    tl.store(expert_off_ptr + offs_e, tl.cumsum(counts, 0) - counts, mask=offs_e <= E)


@triton.jit
def _group_count_kernel(ids_ptr, counts_ptr, num_pairs, E: tl.constexpr, EP1: tl.constexpr, CH: tl.constexpr,
                        USE_GDC: tl.constexpr):
    """counts[c, e]: how many of chunk c's pairs (c * CH .. c * CH + CH - 1) chose expert e; bin E
    holds ids outside [0, E) and the last chunk's pads."""
    if USE_GDC:
        gdc_wait()
        gdc_launch_dependents()
    c = tl.program_id(0)
    offs = c * CH + tl.arange(0, CH)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=E).to(tl.int32)
    ids = tl.where((ids >= 0) & (ids < E), ids, E)
    tl.store(counts_ptr + c * EP1 + tl.arange(0, EP1), tl.histogram(ids, EP1))


@triton.jit
def _group_scatter_kernel(ids_ptr, counts_ptr, scratch_ptr, sorted_pairs_ptr, expert_off_ptr, num_pairs, num_chunks,
                          E: tl.constexpr, EP1: tl.constexpr, CH: tl.constexpr, USE_GDC: tl.constexpr):
    """Chunk c's pairs to their places in the stable grouping: expert e's range starts after every
    pair of experts 0..e-1 (offsets, written by chunk 0), then come its pairs of chunks 0..c-1,
    then chunk c's own in pair order (its rank among the chunk's pairs of e, from the same sort
    key as :func:`_group_pairs_kernel`). So the result is the one-launch kernel's: a stable sort's
    permutation and searchsorted's offsets, for any number of pairs."""
    if USE_GDC:
        gdc_wait()
        gdc_launch_dependents()  # the w13 kernel waits on this one before reading anything
    c = tl.program_id(0)
    offs_e = tl.arange(0, EP1)
    total = tl.zeros((EP1,), dtype=tl.int32)
    before = tl.zeros((EP1,), dtype=tl.int32)
    for cc in range(0, num_chunks):  # every chunk's counts, in chunk order
        row = tl.load(counts_ptr + cc * EP1 + offs_e)
        total += row
        before += tl.where(cc < c, row, 0)
    total = tl.where(offs_e < E, total, 0)  # bin E (invalid ids, pads) goes after every expert
    start = tl.cumsum(total, 0) - total  # expert e's first position; start[E]: the invalid ids'
    mine = tl.load(counts_ptr + c * EP1 + offs_e)
    local = tl.cumsum(mine, 0) - mine  # where e's pairs start in this chunk's sorted order
    if c == 0:
        tl.store(expert_off_ptr + offs_e, start, mask=offs_e <= E)
    # position of the j-th of the chunk's sorted pairs = (start + before - local)[its expert] + j:
    # a per-expert table gathered by expert id, through this block's scratch row
    tl.store(scratch_ptr + c * EP1 + offs_e, start + before - local)
    tl.debug_barrier()
    offs = tl.arange(0, CH)
    ids = tl.load(ids_ptr + c * CH + offs, mask=c * CH + offs < num_pairs, other=E).to(tl.int32)
    ids = tl.where((ids >= 0) & (ids < E), ids, E)
    key = tl.sort(ids * CH + offs)
    expert = key // CH
    pair = c * CH + key % CH
    dest = tl.load(scratch_ptr + c * EP1 + expert) + offs
    tl.store(sorted_pairs_ptr + dest, pair, mask=pair < num_pairs)


@triton.jit
def _expert_bias(b_ptr, layer, expert, offs, ok, N: tl.constexpr, E: tl.constexpr, HAS_BIAS: tl.constexpr):
    """fp32 values ``offs`` of the bias row of (layer, expert) in ``[L, E, N]`` biases (read by
    expert id, never through the row map: module doc); zeros without biases, in ``offs``' layout (so
    that the Gluon kernels of :mod:`coldset.kernels.gluon_mxfp4`, whose tensors carry one, call it
    too)."""
    if HAS_BIAS:
        b = tl.load(b_ptr + (layer * E + expert).to(tl.int64) * N + offs, mask=ok, other=0.0).to(tl.float32)
    else:
        b = offs.to(tl.float32) * 0.0
    return b


@triton.jit
def _gated(g, u, bg, bu, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """The activation of fp32 gate and up sums ``[BM, BN]`` plus their biases ``[BN]``: ``ACT`` 0
    SiLU(g) * u, 1 gpt-oss's clamped SwiGLU (``(clamp(u, -LIMIT, LIMIT) + 1) * g' * sigmoid(ALPHA *
    g')`` with ``g' = min(g, LIMIT)``), in fp32 (:func:`coldset.kernels.activation.torch_activation`)."""
    if HAS_BIAS:
        g = g + bg[None, :]
        u = u + bu[None, :]
    return _activation(g, u, ACT, ALPHA, LIMIT)


@triton.jit
def _activation(g, u, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """:func:`_gated` after its biases, elementwise on fp32 gate and up sums of any shape (the Gluon
    GEMV tile's epilogue calls it on its rows)."""
    if ACT == 0:
        out = g / (1.0 + tl.exp(-g)) * u
    else:
        g = tl.minimum(g, LIMIT)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        out = g / (1.0 + tl.exp(-(g * ALPHA))) * (u + 1.0)
    return out


@triton.jit
def _expert_base(row_map_ptr, hot_ptr, cold_ptr, layer, expert, row_stride,
                 E: tl.constexpr, USE_ROW_MAP: tl.constexpr):
    """Base pointer of one expert's weight matrix: the only place the expert id is used."""
    if USE_ROW_MAP:
        row = tl.load(row_map_ptr + layer * E + expert).to(tl.int64)
        if row >= 0:
            base = hot_ptr + row * row_stride
        else:
            base = cold_ptr + (-row - 1) * row_stride
    else:
        base = hot_ptr + (layer * E + expert).to(tl.int64) * row_stride
    return base


@triton.jit
def _block_expert(ids_ptr, expert_off_ptr, num_pairs, slot,
                  E: tl.constexpr, EP: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr, MODE: tl.constexpr):
    """(expert, its pair count, start of its range in the sorted pair list, first and end chunk offset).

    ``MODE_SLOTS``: block ``slot`` takes the slot-th distinct selected expert and all its chunks.
    ``MODE_SORTED``: block ``slot`` is one *tile*, one chunk of ``BM`` pairs of one expert; tiles
    are numbered expert by expert (expert e's ceil(count / BM) tiles follow expert e-1's), found
    from the per-expert offsets by an in-register prefix sum, so the chunks of one expert run as
    neighbouring blocks at the same time (their weight slices are read from HBM once and shared
    through L2) instead of one after the other in one block. Blocks past the last tile do nothing.
    Either way a pair's chunk is the same (chunk c of an expert is its pairs [c, c + BM) in
    ascending pair order), so the arithmetic per output element does not change with the mode.
    """
    if MODE == 0:
        offs_p = tl.arange(0, NP)
        ids = tl.load(ids_ptr + offs_p, mask=offs_p < num_pairs, other=-1).to(tl.int32)
        offs_e = tl.arange(0, EP)
        present = tl.max((ids[None, :] == offs_e[:, None]).to(tl.int32), axis=1)
        rank = tl.cumsum(present, 0) - 1
        hit = (present > 0) & (rank == slot)
        found = tl.sum(hit.to(tl.int32), axis=0)
        expert = tl.sum(tl.where(hit, offs_e, 0), axis=0)
        cnt = tl.sum((ids == expert).to(tl.int32), axis=0) * found
        start = 0
        c_begin = cnt * 0
        c_end = cnt
    else:
        offs_e = tl.arange(0, EP)
        in_e = offs_e < E
        lo = tl.load(expert_off_ptr + offs_e, mask=in_e, other=0)
        hi = tl.load(expert_off_ptr + offs_e + 1, mask=in_e, other=0)
        ntiles = (hi - lo + BM - 1) // BM
        tiles_through = tl.cumsum(ntiles, 0)  # tiles of experts 0..e
        expert = tl.sum((tiles_through <= slot).to(tl.int32), axis=0)  # E: past the last tile
        sel = offs_e == expert
        first_tile = tl.sum(tl.where(offs_e < expert, ntiles, 0), axis=0)
        start = tl.sum(tl.where(sel, lo, 0), axis=0)
        cnt = tl.sum(tl.where(sel, hi - lo, 0), axis=0)  # 0 past the last tile
        c_begin = (slot - first_tile) * BM
        c_end = tl.minimum(cnt, c_begin + BM)
        expert = tl.minimum(expert, E - 1)  # an address to form; no chunk is computed past the last tile
    return expert, cnt, start, c_begin, c_end


@triton.jit
def _chunk_pairs(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, c, cnt,
                 BM: tl.constexpr, NP: tl.constexpr, MODE: tl.constexpr):
    """Pair indices (t * k + rank) of the chunk [c, c + BM) of this expert's pairs, and a mask."""
    offs_m = c + tl.arange(0, BM)
    valid = offs_m < cnt
    if MODE == 0:
        offs_p = tl.arange(0, NP)
        ids = tl.load(ids_ptr + offs_p, mask=offs_p < num_pairs, other=-1).to(tl.int32)
        match = ids == expert
        pos = tl.cumsum(match.to(tl.int32), 0) - 1
        sel = match[None, :] & (pos[None, :] == offs_m[:, None])
        pair = tl.sum(tl.where(sel, offs_p[None, :], 0), axis=1)
    else:
        pair = tl.load(sorted_pairs_ptr + start + offs_m, mask=valid, other=0)
    return pair, valid


@triton.jit
def _block_ids(NB, ORDER: tl.constexpr):
    """(tile or slot, column block, split) of this block; ``ORDER`` 1: a tile's NB column blocks are
    consecutive program ids (grid (tiles * NB, 1, splits)), 0: grid (tiles, NB, splits)."""
    if ORDER == 0:
        slot = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:
        pid = tl.program_id(0)
        slot = pid // NB
        pid_n = pid % NB
    return slot, pid_n, tl.program_id(2)


@triton.jit
def _k_range(pid_s, K: tl.constexpr, KS: tl.constexpr, SPLIT: tl.constexpr):
    """[lo, hi) of the reduction dimension for split ``pid_s``: KS (whole block_k steps) each; a
    split starting past K is empty (its block stores zeros)."""
    if SPLIT == 1:
        lo = 0
        hi = K
    else:
        lo = pid_s * KS
        hi = lo + KS
        if hi > K:
            hi = K
    return lo, hi


@triton.jit
def _w13_chunk(x_ptr, ids_ptr, sorted_pairs_ptr, act_ptr, part_ptr, wg_ptrs, wu_ptrs, offs_n, n_ok,
               num_pairs, expert, start, c, cnt, stride_xt, pid_s, k_lo, k_hi, bg, bu,
               TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, NP: tl.constexpr, MODE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
               PREFETCH: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
               ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """One chunk [c, c + BM) of the expert's pairs times its gate and up rows, then the epilogue."""
    offs_k = tl.arange(0, BK)
    pair, valid = _chunk_pairs(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, c, cnt, BM, NP, MODE)
    tok = (pair // TOPK).to(tl.int64)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        if EVEN_K:
            a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0)
            if EVEN_N:
                if PREFETCH:  # read once: do not push the w2 prefetch out of L2
                    wg = tl.load(wg_ptrs + k0, eviction_policy="evict_first")
                    wu = tl.load(wu_ptrs + k0, eviction_policy="evict_first")
                else:
                    wg = tl.load(wg_ptrs + k0)
                    wu = tl.load(wu_ptrs + k0)
            else:
                wg = tl.load(wg_ptrs + k0, mask=n_ok[None, :], other=0.0)
                wu = tl.load(wu_ptrs + k0, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + offs_k) < H
            a = tl.load(a_ptrs + k0, mask=valid[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(wg_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            wu = tl.load(wu_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, wg, acc_g)
        acc_u = tl.dot(a, wu, acc_u)
    if SPLIT == 1:
        act = _gated(acc_g, acc_u, bg, bu, HAS_BIAS, ACT, ALPHA, LIMIT)
        out_ptrs = act_ptr + pair[:, None].to(tl.int64) * I + offs_n[None, :]
        tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])
    else:  # partial gate and up sums of this split: [split, pair, 2I] fp32, added (then the bias) by the w2 kernel
        part_ptrs = part_ptr + (pid_s * num_pairs + pair[:, None]).to(tl.int64) * (2 * I) + offs_n[None, :]
        tl.store(part_ptrs, acc_g, mask=valid[:, None] & n_ok[None, :])
        tl.store(part_ptrs + I, acc_u, mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _w13_act_kernel(
    x_ptr, ids_ptr, sorted_pairs_ptr, expert_off_ptr, row_map_ptr, w_hot_ptr, w_cold_ptr, act_ptr, part_ptr,
    b13_ptr, num_pairs, layer, stride_xt, NB,
    E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NP: tl.constexpr, MODE: tl.constexpr,
    USE_ROW_MAP: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_GDC: tl.constexpr,
    PREFETCH: tl.constexpr, SPLIT: tl.constexpr, KS: tl.constexpr, ORDER: tl.constexpr, WAIT: tl.constexpr,
    HALF_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):
    slot, pid_n, pid_s = _block_ids(NB, ORDER)
    k_lo, k_hi = _k_range(pid_s, H, KS, SPLIT)
    if WAIT:
        # Launched as a dependent of whatever kernel came before (the router, the grouping, a
        # cache update: unknown here): everything this block reads below (ids, sorted pairs, the
        # row map, x, weights) may be that kernel's output, so wait for its grid first; only the
        # block numbering above depends on launch arguments alone. Then let the w2 kernel start:
        # not earlier, since it looks up ids and the row map before its own wait.
        gdc_wait()
        gdc_launch_dependents()
    elif USE_GDC:
        gdc_launch_dependents()  # a plain launch: its inputs are complete; the w2 kernel may start now
    expert, cnt, start, c_begin, c_end = _block_expert(ids_ptr, expert_off_ptr, num_pairs, slot, E, EP, NP, BM, MODE)
    w_base = _expert_base(row_map_ptr, w_hot_ptr, w_cold_ptr, layer, expert, 2 * I * H, E, USE_ROW_MAP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    n_ok = offs_n < I
    wg_ptrs = w_base + offs_n[None, :] * H + offs_k[:, None]  # [BK, BN]: gate rows n, cols k
    wu_ptrs = wg_ptrs + I * H  # up rows I + n
    bg = _expert_bias(b13_ptr, layer, expert, offs_n, n_ok, 2 * I, E, HAS_BIAS)  # split-K: the w2 kernel adds them
    bu = _expert_bias(b13_ptr, layer, expert, I + offs_n, n_ok, 2 * I, E, HAS_BIAS)  # up half
    c = c_begin
    while c < c_end:  # chunks of this expert's pairs (a while loop: dynamic bound)
        # an expert's last chunk of at most a half (a quarter) of a tile: that many rows of MMA
        if HALF_TAIL == 2 and c_end - c <= BM // 4:
            _w13_chunk(x_ptr, ids_ptr, sorted_pairs_ptr, act_ptr, part_ptr, wg_ptrs, wu_ptrs, offs_n, n_ok,
                       num_pairs, expert, start, c, cnt, stride_xt, pid_s, k_lo, k_hi, bg, bu,
                       TOPK, H, I, BM // 4, BN, BK, NP, MODE, EVEN_K, EVEN_N, PREFETCH, SPLIT,
                       HAS_BIAS, ACT, ALPHA, LIMIT)
        elif HALF_TAIL >= 1 and c_end - c <= BM // 2:
            _w13_chunk(x_ptr, ids_ptr, sorted_pairs_ptr, act_ptr, part_ptr, wg_ptrs, wu_ptrs, offs_n, n_ok,
                       num_pairs, expert, start, c, cnt, stride_xt, pid_s, k_lo, k_hi, bg, bu,
                       TOPK, H, I, BM // 2, BN, BK, NP, MODE, EVEN_K, EVEN_N, PREFETCH, SPLIT,
                       HAS_BIAS, ACT, ALPHA, LIMIT)
        else:
            _w13_chunk(x_ptr, ids_ptr, sorted_pairs_ptr, act_ptr, part_ptr, wg_ptrs, wu_ptrs, offs_n, n_ok,
                       num_pairs, expert, start, c, cnt, stride_xt, pid_s, k_lo, k_hi, bg, bu,
                       TOPK, H, I, BM, BN, BK, NP, MODE, EVEN_K, EVEN_N, PREFETCH, SPLIT,
                       HAS_BIAS, ACT, ALPHA, LIMIT)
        c += BM


@triton.jit
def _act_from_parts(g_ptrs, mask, num_pairs, bg, bu, DT: tl.constexpr, I: tl.constexpr, BM: tl.constexpr,
                    BK: tl.constexpr, SPLIT1: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                    ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """The activation from w13's split-K partial sums, added split 0 first (a fixed order), then
    the biases ``bg``, ``bu``, in the activation dtype: the formula of the unsplit w13 kernel's epilogue."""
    g = tl.zeros((BM, BK), dtype=tl.float32)
    u = tl.zeros((BM, BK), dtype=tl.float32)
    for s in tl.static_range(SPLIT1):
        off = s * num_pairs * (2 * I)
        g += tl.load(g_ptrs + off, mask=mask, other=0.0)
        u += tl.load(g_ptrs + off + I, mask=mask, other=0.0)
    return _gated(g, u, bg, bu, HAS_BIAS, ACT, ALPHA, LIMIT).to(DT)


@triton.jit
def _w2_chunk(act_ptr, part_ptr, ids_ptr, sorted_pairs_ptr, topk_w_ptr, buf_ptr, w_ptrs, offs_n, n_ok,
              num_pairs, expert, start, c, cnt, pid_s, k_lo, k_hi, b13_ptr, layer, b2,
              H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              NP: tl.constexpr, MODE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
              SPLIT1: tl.constexpr, E: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
              ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """One chunk [c, c + BM) of the expert's pairs: activations times w2's rows, plus w2's bias
    ``b2`` (zeros past split 0), times the routing weight."""
    offs_k = tl.arange(0, BK)
    pair, valid = _chunk_pairs(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, c, cnt, BM, NP, MODE)
    pair64 = pair.to(tl.int64)
    a_ptrs = act_ptr + pair64[:, None] * I + offs_k[None, :]
    g_ptrs = part_ptr + pair64[:, None] * (2 * I) + offs_k[None, :]  # split_k1 > 1: w13's partial sums
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        if SPLIT1 > 1:
            kk_ok = (k0 + offs_k) < I
            a = _act_from_parts(g_ptrs + k0, valid[:, None] & kk_ok[None, :], num_pairs,
                                _expert_bias(b13_ptr, layer, expert, k0 + offs_k, kk_ok, 2 * I, E, HAS_BIAS),
                                _expert_bias(b13_ptr, layer, expert, I + k0 + offs_k, kk_ok, 2 * I, E, HAS_BIAS),
                                act_ptr.dtype.element_ty, I, BM, BK, SPLIT1, HAS_BIAS, ACT, ALPHA, LIMIT)
            if EVEN_K and EVEN_N:
                w = tl.load(w_ptrs + k0)
            else:
                k_ok = (k0 + offs_k) < I
                w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        elif EVEN_K:
            a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs + k0)
            else:
                w = tl.load(w_ptrs + k0, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + offs_k) < I
            a = tl.load(a_ptrs + k0, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
    if HAS_BIAS:
        acc += b2[None, :]
    wt = tl.load(topk_w_ptr + pair64, mask=valid, other=0.0).to(tl.float32)
    acc = acc * wt[:, None]
    row = pid_s * num_pairs + pair64  # [split, pair, H]
    tl.store(buf_ptr + row[:, None] * H + offs_n[None, :], acc.to(buf_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _w2_kernel(
    act_ptr, part_ptr, ids_ptr, sorted_pairs_ptr, expert_off_ptr, row_map_ptr, w_hot_ptr, w_cold_ptr, topk_w_ptr,
    buf_ptr, sink_ptr, b13_ptr, b2_ptr,
    num_pairs, layer, NB,
    E: tl.constexpr, EP: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NP: tl.constexpr, MODE: tl.constexpr,
    USE_ROW_MAP: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_GDC: tl.constexpr,
    PREFETCH: tl.constexpr, SPLIT: tl.constexpr, KS: tl.constexpr, SPLIT1: tl.constexpr, ORDER: tl.constexpr,
    HALF_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):
    slot, pid_n, pid_s = _block_ids(NB, ORDER)
    k_lo, k_hi = _k_range(pid_s, I, KS, SPLIT)
    expert, cnt, start, c_begin, c_end = _block_expert(ids_ptr, expert_off_ptr, num_pairs, slot, E, EP, NP, BM, MODE)
    w_base = _expert_base(row_map_ptr, w_hot_ptr, w_cold_ptr, layer, expert, H * I, E, USE_ROW_MAP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    n_ok = offs_n < H
    w_ptrs = w_base + offs_n[None, :] * I + offs_k[:, None]  # [BK, BN]: w2 rows n (of H), cols k (of I)
    b2 = _expert_bias(b2_ptr, layer, expert, offs_n, n_ok & (pid_s == 0), H, E, HAS_BIAS)  # once: in split 0's sum
    if PREFETCH:
        # Launched early (programmatic dependent launch): ids, row map and weights are inputs of
        # the step, ready before the w13 kernel began; the activations are not. Stream this
        # block's weight slice into L2 now, keep a trivial reduction of it in a sink so the loads
        # are not removed, then wait for the w13 kernel to finish before reading activations.
        gdc_launch_dependents()
        sink = tl.zeros((BN,), dtype=tl.float32)
        if cnt > 0:
            for k0 in range(k_lo, k_hi, BK):
                if EVEN_K and EVEN_N:
                    wp = tl.load(w_ptrs + k0, eviction_policy="evict_last")
                else:
                    k_ok = (k0 + offs_k) < I
                    wp = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0,
                                 eviction_policy="evict_last")
                sink = tl.maximum(sink, tl.max(wp.to(tl.float32), axis=0))
        blk = (pid_s * tl.num_programs(0) * tl.num_programs(1) + slot * NB + pid_n).to(tl.int64)
        tl.store(sink_ptr + blk * BN + tl.arange(0, BN), sink)
        gdc_wait()
    elif USE_GDC:  # launched early, no prefetch: only the launch and the lookups above overlap w13
        gdc_launch_dependents()
        gdc_wait()
    c = c_begin
    while c < c_end:  # chunks of this expert's pairs (a while loop: dynamic bound)
        # an expert's last chunk of at most a half (a quarter) of a tile: that many rows of MMA
        if HALF_TAIL == 2 and c_end - c <= BM // 4:
            _w2_chunk(act_ptr, part_ptr, ids_ptr, sorted_pairs_ptr, topk_w_ptr, buf_ptr, w_ptrs, offs_n, n_ok,
                      num_pairs, expert, start, c, cnt, pid_s, k_lo, k_hi, b13_ptr, layer, b2,
                      H, I, BM // 4, BN, BK, NP, MODE, EVEN_K, EVEN_N, SPLIT1, E, HAS_BIAS, ACT, ALPHA, LIMIT)
        elif HALF_TAIL >= 1 and c_end - c <= BM // 2:
            _w2_chunk(act_ptr, part_ptr, ids_ptr, sorted_pairs_ptr, topk_w_ptr, buf_ptr, w_ptrs, offs_n, n_ok,
                      num_pairs, expert, start, c, cnt, pid_s, k_lo, k_hi, b13_ptr, layer, b2,
                      H, I, BM // 2, BN, BK, NP, MODE, EVEN_K, EVEN_N, SPLIT1, E, HAS_BIAS, ACT, ALPHA, LIMIT)
        else:
            _w2_chunk(act_ptr, part_ptr, ids_ptr, sorted_pairs_ptr, topk_w_ptr, buf_ptr, w_ptrs, offs_n, n_ok,
                      num_pairs, expert, start, c, cnt, pid_s, k_lo, k_hi, b13_ptr, layer, b2,
                      H, I, BM, BN, BK, NP, MODE, EVEN_K, EVEN_N, SPLIT1, E, HAS_BIAS, ACT, ALPHA, LIMIT)
        c += BM


@triton.jit
def _sum_topk_kernel(buf_ptr, out_ptr, num_pairs, H: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                     USE_GDC: tl.constexpr, SPLIT: tl.constexpr):
    if USE_GDC:
        gdc_wait()  # launched early: wait for the w2 kernel's buffer
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(TOPK):  # fixed order over ranks, then w2's splits: deterministic
        for s in tl.static_range(SPLIT):
            acc += tl.load(buf_ptr + (s * num_pairs + t * TOPK + r) * H + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def group_pairs(ids: torch.Tensor, num_experts: int, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair indices grouped by expert, ascending within an expert; per-expert offsets ``[E + 1]``), int32.

    The order of a stable sort of ``ids`` (flattened ``topk_ids``) and the offsets of
    searchsorted over it: one Triton launch up to ``GROUP_KERNEL_MAX_PAIRS`` pairs, two above (a
    counting sort over chunks of ``GROUP_CHUNK`` pairs). Both give the same tensors, so which one
    runs never changes the experts' output. Ids outside [0, E) are in no expert's range (placed
    after every expert's pairs). ``pdl``: the launches are programmatic dependent launches
    (Hopper; the experts' configs with pdl=3).
    """
    num_pairs = ids.numel()
    if num_pairs <= GROUP_KERNEL_MAX_PAIRS:
        sorted_pairs = torch.empty(num_pairs, dtype=torch.int32, device=ids.device)
        expert_off = torch.empty(num_experts + 1, dtype=torch.int32, device=ids.device)
        _group_pairs_kernel[(1,)](ids, sorted_pairs, expert_off, num_pairs, E=num_experts,
                                  EP1=_next_pow2(num_experts + 1), NP=_next_pow2(num_pairs), USE_GDC=pdl,
                                  num_warps=4, launch_pdl=pdl)
        return sorted_pairs, expert_off
    if num_pairs >= 2**31 - GROUP_CHUNK or (num_experts + 1) * GROUP_CHUNK >= 2**31:
        raise ValueError(f"group_pairs: {num_pairs} pairs of {num_experts} experts overflow the int32 sort keys")
    ep1 = _next_pow2(num_experts + 1)
    chunks = triton.cdiv(num_pairs, GROUP_CHUNK)
    counts = torch.empty((chunks, ep1), dtype=torch.int32, device=ids.device)
    scratch = torch.empty((chunks, ep1), dtype=torch.int32, device=ids.device)
    sorted_pairs = torch.empty(num_pairs, dtype=torch.int32, device=ids.device)
    expert_off = torch.empty(num_experts + 1, dtype=torch.int32, device=ids.device)
    _group_count_kernel[(chunks,)](ids, counts, num_pairs, E=num_experts, EP1=ep1, CH=GROUP_CHUNK, USE_GDC=pdl,
                                   num_warps=4, launch_pdl=pdl)
    _group_scatter_kernel[(chunks,)](ids, counts, scratch, sorted_pairs, expert_off, num_pairs, chunks,
                                     E=num_experts, EP1=ep1, CH=GROUP_CHUNK, USE_GDC=pdl, num_warps=4,
                                     launch_pdl=pdl)
    return sorted_pairs, expert_off


def pair_tiles(ids: torch.Tensor, num_pairs: int, num_experts: int, config, pdl_first: bool = False) -> tuple:
    """How every experts kernel lays out a call's (token, expert) pairs: ``(mode, slots, np_,
    sorted_pairs, expert_off)``. Few pairs (at most ``slot_max_pairs`` and the experts): one block
    per pair slot, read straight from ``ids`` (``MODE_SLOTS``; the last two are unused). Else one
    block per (expert, chunk of ``block_m`` pairs) tile, at most this many tiles existing, over the
    pairs grouped by expert (``MODE_SORTED``, :func:`group_pairs`)."""
    if num_pairs <= min(num_experts, config.slot_max_pairs):
        return MODE_SLOTS, num_pairs, _next_pow2(num_pairs), ids, ids
    sorted_pairs, expert_off = group_pairs(ids, num_experts, pdl_first)
    return MODE_SORTED, triton.cdiv(num_pairs, config.block_m) + min(num_experts, num_pairs), 1, sorted_pairs, expert_off


def cold_or_hot(pools, *names: str) -> tuple:
    """The cold pools named (``w13``, ``w2_scale``, ...), or, where no expert is cold, the hot ones
    standing in as pointers (never read then)."""
    tier = "cold" if pools.num_cold > 0 else "hot"
    return tuple(getattr(pools, f"{name}_{tier}") for name in names)


def prepare_call(name: str, pools, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 config: KernelConfig | dict | None, use_row_map: bool, default) -> tuple:
    """What every experts kernel (bf16 here, block-FP8 in :mod:`coldset.kernels.triton_fp8`) checks
    and flattens before its launches, after its own shape and dtype checks: the pools' layout, the
    row map (validated only when written since its last validation: no host sync otherwise, so the
    call can be captured), the config (``default(num_tokens, top_k)`` when None) and the routing as
    flat contiguous ``ids`` / ``weights``. Returns ``(config, x, ids, weights)``."""
    pools.check_layout()  # contiguous pools, row map, scale grids (attribute reads only)
    if use_row_map:
        pools.ensure_validated()
    elif pools.num_hot < pools.num_moe_layers * pools.num_experts:
        raise ValueError(f"{name}: use_row_map=False needs every expert in the hot pool (all_hot layout)")
    if config is None:
        config = default(x.shape[0], topk_ids.shape[1])
    elif isinstance(config, dict):
        config = KernelConfig.from_dict(config)
    if x.stride(1) != 1:
        x = x.contiguous()
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    return config, x, ids, topk_weights.reshape(-1).contiguous()


def epilogue_args(pools) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(w13_bias, w2_bias, constexprs)`` of the pools' biases and activation for the experts
    kernels (this module's and :mod:`coldset.kernels.triton_fp8`'s): without biases the row map
    stands in for both pointers (never read) and ``HAS_BIAS=0``. ``ALPHA`` / ``LIMIT`` are compiled
    in (constexprs) only for the clamped SwiGLU: the SiLU kernels' compile key is unchanged."""
    act = pools.activation
    clamped = act.kind == "swiglu_clamped"
    consts = dict(HAS_BIAS=pools.has_bias, ACT=act.code, ALPHA=act.alpha if clamped else 0.0,
                  LIMIT=act.limit if clamped else 0.0)
    if not pools.has_bias:
        return pools.row_map, pools.row_map, consts
    return pools.w13_bias, pools.w2_bias, consts


#: The launches of a :func:`triton_experts` call, in order (the grouping, where it runs, goes
#: with the first): what :func:`experts_launches` yields after each.
LAUNCHES = ("w13_act", "w2", "sum")


def triton_experts(
    pools: ExpertPools,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: KernelConfig | dict | None = None,
    use_row_map: bool = True,
) -> torch.Tensor:
    """Routed-expert output ``[T, H]`` for tokens ``x`` ``[T, H]`` of MoE layer ``layer`` (CUDA).

    Same contract as :func:`coldset.kernels.torch_experts`. ``use_row_map=False`` compiles the
    row-map indirection out and reads (layer, expert) from hot row ``layer * E + expert``: valid
    only for the all-hot module-order layout (:meth:`ExpertPools.all_hot`), it is the unmodified
    path. The row map is validated here only when it was written since its last validation (no
    host sync otherwise, so the call can be captured in a CUDA graph). Block-FP8 pools are
    refused: :func:`coldset.kernels.triton_experts` sends them to
    :func:`coldset.kernels.triton_fp8.triton_fp8_experts` (this module is below that one).
    """
    return issue_all(experts_launches(pools, layer, x, topk_ids, topk_weights, config, use_row_map))


def issue_all(launches: Generator[str, None, torch.Tensor]) -> torch.Tensor:
    """Every launch of a call's launch generator (:func:`experts_launches`,
    :func:`coldset.kernels.triton_fp8.fp8_experts_launches`), in order; the call's output."""
    while True:
        try:
            next(launches)
        except StopIteration as done:
            return done.value


def issue_through(launches: Generator[str, None, torch.Tensor], stop: str) -> None:
    """The launches of a call's launch generator up to and including the one named ``stop``, none
    after it: how a benchmark times a call's stages cumulatively (:mod:`coldset.measure.kernel`).
    ``ValueError`` naming the launches when the call makes none named ``stop``."""
    seen = []
    for name in launches:
        seen.append(name)
        if name == stop:
            launches.close()
            return
    raise ValueError(f"{stop!r} is not a launch of this config (its launches: {', '.join(seen)})")


def experts_launches(
    pools: ExpertPools,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: KernelConfig | dict | None = None,
    use_row_map: bool = True,
) -> Generator[str, None, torch.Tensor]:
    """The launches of one :func:`triton_experts` call (its checks first), issued one at a time: a
    generator that yields each launch's name of :data:`LAUNCHES` after issuing it and returns the
    output. :func:`triton_experts` issues them all (:func:`issue_all`); a benchmark stops after one
    (:func:`issue_through`). One body for both, so the stages timed are the call's launches."""
    if getattr(pools, "is_fp8", False):
        raise ValueError("triton_experts (coldset.kernels.triton_moe) runs bf16/fp16 pools; block-FP8 pools run "
                         "coldset.kernels.triton_fp8.triton_fp8_experts (coldset.kernels.triton_experts picks by format)")
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"triton_experts: x [T, H], topk_ids [T, k], topk_weights [T, k] expected, got "
            f"{tuple(x.shape)}, {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}"
        )
    if x.dtype not in (torch.bfloat16, torch.float16) or pools.w13_hot.dtype != x.dtype:
        raise ValueError(
            f"triton_experts: x dtype {x.dtype} must be bfloat16 or float16 and equal the pools' "
            f"{pools.w13_hot.dtype}"
        )
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts = pools.num_experts
    inter = pools.w2_hot.shape[2]
    if pools.w13_hot.shape[1:] != (2 * inter, hidden) or pools.w2_hot.shape[1:] != (hidden, inter):
        raise ValueError(
            f"triton_experts: pools hold w13 {tuple(pools.w13_hot.shape[1:])} and w2 "
            f"{tuple(pools.w2_hot.shape[1:])}, x has H = {hidden}"
        )
    config, x, ids, weights = prepare_call("triton_experts", pools, x, topk_ids, topk_weights, config, use_row_map,
                                           default_config)
    b13, b2, epilogue = epilogue_args(pools)
    c = config
    # Row-major [T, H], whatever x's strides (empty_like would keep a transposed x's layout, and
    # the sum kernel writes row-major).
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    num_pairs = num_tokens * top_k
    device = x.device
    if c.pdl not in (0, 1, 2, 3):
        raise ValueError(f"triton_experts: config pdl must be 0, 1, 2 or 3, got {c.pdl}")
    if c.tile_order not in (0, 1):
        raise ValueError(f"triton_experts: config tile_order must be 0 or 1, got {c.tile_order}")
    if c.half_buf not in (0, 1):
        raise ValueError(f"triton_experts: config half_buf must be 0 or 1, got {c.half_buf}")
    if c.half_buf and c.split_k2 > 1:  # split partial sums rounded to 16 bits each: not a config to offer
        raise ValueError("triton_experts: config half_buf=1 needs split_k2=1 (w2's split partial sums stay fp32)")
    if c.half_tail not in (0, 1, 2) or c.block_m < 16 << c.half_tail:
        raise ValueError(f"triton_experts: config half_tail must be 0, 1 or 2, and needs block_m >= 16 * 2**half_tail "
                         f"(its smallest tile's dot needs 16 rows), got half_tail={c.half_tail}, block_m={c.block_m}")
    if min(c.split_k1, c.split_k2) < 1:
        raise ValueError(f"triton_experts: config split_k1, split_k2 must be >= 1, got {c.split_k1}, {c.split_k2}")
    pdl, prefetch, first = c.pdl > 0, c.pdl == 1, c.pdl == 3
    if pdl and gdc_wait is None:
        raise RuntimeError(f"triton_experts: config pdl={c.pdl} needs triton.language.extra.cuda.gdc_wait (triton >= 3.3)")
    mode, slots, np_, sorted_pairs, expert_off = pair_tiles(ids, num_pairs, num_experts, config, first)
    w13_cold, w2_cold = cold_or_hot(pools, "w13", "w2")
    ep = _next_pow2(num_experts)
    s1, s2 = c.split_k1, c.split_k2
    if max(s1 * 2 * inter, s2 * hidden) * num_pairs >= 2**31:  # the split buffers' offsets are int32 inside the kernels
        raise ValueError(f"triton_experts: split_k1={s1}, split_k2={s2} at {num_pairs} pairs needs a buffer past "
                         f"2**31 elements; use split 1 for this batch")
    # split s covers [s * ks, (s + 1) * ks) of the reduction dimension: whole block_k steps
    ks1 = triton.cdiv(triton.cdiv(hidden, s1), c.block_k1) * c.block_k1
    ks2 = triton.cdiv(triton.cdiv(inter, s2), c.block_k2) * c.block_k2
    act = torch.empty((num_pairs if s1 == 1 else 1, inter), dtype=x.dtype, device=device)
    part = torch.empty((s1, num_pairs, 2 * inter) if s1 > 1 else (1,), dtype=torch.float32, device=device)
    buf = torch.empty((s2, num_pairs, hidden), dtype=x.dtype if c.half_buf else torch.float32, device=device)
    nb1, nb2 = triton.cdiv(inter, c.block_n1), triton.cdiv(hidden, c.block_n2)

    def grid(nb, splits):
        return (slots, nb, splits) if c.tile_order == 0 else (slots * nb, 1, splits)

    grid2 = grid(nb2, s2)
    sink = torch.empty((slots * nb2 * s2 * c.block_n2,) if prefetch else (1,), dtype=torch.float32, device=device)
    _w13_act_kernel[grid(nb1, s1)](
        x, ids, sorted_pairs, expert_off, pools.row_map, pools.w13_hot, w13_cold, act, part,
        b13, num_pairs, layer, x.stride(0), nb1,
        E=num_experts, EP=ep, TOPK=top_k, H=hidden, I=inter,
        BM=c.block_m, BN=c.block_n1, BK=c.block_k1, NP=np_, MODE=mode, USE_ROW_MAP=use_row_map,
        EVEN_K=hidden % c.block_k1 == 0, EVEN_N=inter % c.block_n1 == 0, USE_GDC=pdl, PREFETCH=prefetch,
        SPLIT=s1, KS=ks1, ORDER=c.tile_order, WAIT=first, HALF_TAIL=c.half_tail, **epilogue,
        num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=first,
    )
    yield "w13_act"
    _w2_kernel[grid2](
        act, part, ids, sorted_pairs, expert_off, pools.row_map, pools.w2_hot, w2_cold, weights, buf, sink,
        b13, b2, num_pairs, layer, nb2,
        E=num_experts, EP=ep, H=hidden, I=inter,
        BM=c.block_m, BN=c.block_n2, BK=c.block_k2, NP=np_, MODE=mode, USE_ROW_MAP=use_row_map,
        EVEN_K=inter % c.block_k2 == 0, EVEN_N=hidden % c.block_n2 == 0, USE_GDC=pdl, PREFETCH=prefetch,
        SPLIT=s2, KS=ks2, SPLIT1=s1, ORDER=c.tile_order, HALF_TAIL=c.half_tail, **epilogue,
        num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=pdl,
    )
    yield "w2"
    block = min(1024, _next_pow2(hidden))
    _sum_topk_kernel[(num_tokens, triton.cdiv(hidden, block))](
        buf, out, num_pairs, H=hidden, TOPK=top_k, BLOCK=block, USE_GDC=pdl, SPLIT=s2, num_warps=4, launch_pdl=pdl)
    yield "sum"
    return out
