"""The MXFP4 experts kernel's tensor-core tile in Gluon, for CUDA: the codes unpacked once for all of
a chunk of an expert's pairs.

The GEMV tile (:mod:`coldset.kernels.gluon_mxfp4`) unpacks and multiplies every weight once a pair:
its time grows with the pairs, and from about 16 tokens an expert has two or more. The dot tiles of
:mod:`coldset.kernels.triton_mxfp4` unpack once a chunk, but Triton lays the unpacked tile out for
the MMA through shared memory. Here the MMA (``mma.sync`` m16n8k16, bf16, float32 sums) takes both
operands from registers, and the codes are unpacked in the MMA's own register layout:

- The weights are the MMA's A operand (``[block_n rows, 128]`` a k step; the pairs are its N, one
  chunk of ``block_m`` = 8 or 16). In that layout (``k_width`` 8) a thread holds, for each of its
  rows, 8 k positions in each of 4 runs; the four lanes of a quad hold the rest. The reduction does
  not care which input sits at which k position, so the tile puts input ``p`` of a 128-input step
  at k position ``kk`` with kk's bits 0, 1, 2 = p's bits 2, 0, 1, kk's 3, 4 = p's 5, 6 (the group:
  one a lane of a quad) and kk's 5, 6 = p's 3, 4 (the word in the group). So a thread's 32
  positions of a row are one whole scale group, its codes one 16-byte load and its scale one byte,
  and each 32-bit register the MMA reads holds codes n and n + 4 of a word (a mask, a multiply
  and a mask a pair: :func:`_bf16_pair`). The inputs, the B operand, are read in the same order: a
  thread's 32 positions of a token are again one group of 32 consecutive inputs (four 16-byte
  loads, reordered by a byte permute a register).
- A code becomes bf16 by bits alone: its three magnitude bits into the bf16 field's bits 6-8 and its
  sign into bit 15 read as ``e2m1 * 2^-126`` (exact for the subnormal code 0.5 too); one bf16 pair
  multiply by ``2^(s - 1 - 63)`` (``s`` the group's e8m0 scale) makes it ``w * 2^-63``, exact for
  ``s`` in [65, 191] (scales 2^-62 to 2^64; :data:`SCALE_RANGE`), and the float32 sums are times 2^63
  after the last step. Each product is exact; the MMA sums them in float32. Below 65 weights lose
  bits to bf16's subnormals (an all-zero group's scale byte 0 stays exact); above 191 the
  multiplier is inf, so that such a weight makes its outputs inf or NaN, never a wrong finite
  value.
- w13's tile interleaves gate and up rows by eights (rows 16 b + i: gate, 16 b + 8 + i: up, of output
  8 b + i), so that a thread's two accumulator rows are an output's gate and up and the activation
  runs in registers. The intermediate is stored in input order, as w2 reads it.
- ``num_stages`` says how far ahead a k step's bytes are loaded. 1: at the step; 2: one step ahead,
  into registers. From 3 the codes and inputs of a step are copied ``num_stages - 1`` steps ahead
  into rings in shared memory (``cp.async``: no registers held while they are in flight), and the
  scales, a byte a row and step (no ``cp.async`` size), two steps ahead in registers, so that a step
  rarely waits on a load issued one step before it, as the register paths' steps do
  (docs/measurements/mxfp4/profile, mma_ring). Every path makes the same products in the same order.

Other sums than the GEMV tiles' (float32 MMA sums of exact products, in the MMA's order). A config's
bits depend on the path, never on the placement: the row map only moves the base pointers.
"""

from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

try:  # cp.async for num_stages 3 to 6 (a Gluon without it keeps the register paths: 1 and 2)
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # pragma: no cover - triton 3.6 and 3.8 have it
    async_copy = None

from coldset.kernels.gluon_mxfp4 import _block_expert
from coldset.kernels.triton_moe import (_activation, _block_ids, _expert_base, _expert_bias, gdc_launch_dependents,
                                       gdc_wait)

#: Inputs a k step of the tile (4 scale groups, one a lane of each quad).
STEP_K = 128
#: e8m0 scale bytes the tile's unpacking is exact for (module doc): 2^-62 to 2^64.
SCALE_RANGE = (65, 191)
#: The deepest ``num_stages``: its rings take ``num_stages - 1`` steps of codes and inputs in shared memory.
MAX_STAGES = 6
#: The power of two the weights carry in bf16 (``w * 2^-63``), undone on the float32 sums.
_SHIFT = tl.constexpr(63)


def tile_fits(block_n: int, block_m: int, num_warps: int) -> bool:
    """Whether a tile of ``block_n`` weight rows and ``block_m`` pairs lays out over ``num_warps``
    warps: 8 or 16 pairs (the MMA's N), whole 16-row MMA blocks, a power of two of them a warp."""
    blocks, rest = divmod(block_n, 16 * num_warps)
    return block_m in (8, 16) and not rest and blocks > 0 and not blocks & (blocks - 1)


@gluon.jit
def _bf16x2_mul(a, b):
    """``a * b`` on int32 registers each holding two bf16 lanes (exact here: ``b`` a power of two)."""
    return gl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, gl.full_like(a, -2147450880)],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _bf16_pair(q, NIBBLES: gl.constexpr, MAG_SHIFT: gl.constexpr, SIGN_SHIFT: gl.constexpr):
    """The two codes ``NIBBLES`` keeps of each word (16 bits apart) as the two bf16 lanes ``e2m1 *
    2^-126`` of an int32: three magnitude bits into bits 6-8, the sign into bit 15. One multiply
    does both shifts: the codes times ``2^MAG_SHIFT + 2^SIGN_SHIFT`` are two shifted copies whose
    other bits (the sign into bit 9, the magnitude into bits 12-14) overlap nothing, so the sum has
    no carries and the mask keeps the lanes: three instructions a pair."""
    t = (q & NIBBLES) * ((1 << MAG_SHIFT) + (1 << SIGN_SHIFT))
    return t & -2118090304  # the int32 0x81C081C0: bits 6-8 and 15 of each lane


@gluon.jit
def _halves(p):
    """The low and high bf16 lanes of int32 ``p``."""
    lo = p.to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (p >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return lo, hi


@gluon.jit
def _load_step(w_ptrs, s_ptrs, x_rows, step, K: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr,
               TAIL: gl.constexpr, LQ: gl.constexpr, LX: gl.constexpr):
    """k step ``step``'s loads: each thread's group of 4 words (one 16-byte load) and scale byte of
    each of its rows, and its 32 consecutive inputs (four 16-byte loads) of its token. ``TAIL``: the
    last step, past K: groups past K read as code 0 and inputs as 0 (no other load is masked: rows
    past N and pairs past the chunk read valid rows, never stored)."""
    ph = step * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, LX))
    x_ptrs = x_rows[:, None] + ph[None, :]
    if TAIL:
        L2: gl.constexpr = gl.SliceLayout(2, LQ)
        g = gl.arange(0, 4, layout=gl.SliceLayout(0, L2))
        ok = gl.full([BN, 4], 1, gl.int1, L2) & (g < K // 32 - step * 4)[None, :]
        q = gl.load(w_ptrs + step * 16, mask=ok[:, :, None], other=0)
        s = gl.load(s_ptrs + step * 4, mask=ok, other=127)
        x = gl.load(x_ptrs, mask=gl.full([BM, 128], 1, gl.int1, LX) & (ph < K)[None, :], other=0.0)
    else:
        q = gl.load(w_ptrs + step * 16)
        s = gl.load(s_ptrs + step * 4)
        x = gl.load(x_ptrs)
    return q, s, x


@gluon.jit
def _mma_step(acc, q, s, x, BN: gl.constexpr, BM: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr):
    """``acc + A @ B`` for one k step's loads: the codes unpacked to ``w * 2^-63`` bf16 in the MMA's A
    layout (module doc), the inputs reordered to its k positions in B's (within each thread: a
    thread's 32 inputs are its own)."""
    m = gl.minimum(s.to(gl.int32) + (126 - _SHIFT), 255) << 7  # bf16 2^(s - 1 - 63); past SCALE_RANGE: inf
    m = (m | (m << 16))[:, :, None]
    r = q >> 8  # codes 2 and 6 where 0 and 4 are, 3 and 7 where 1 and 5 are
    p0 = _bf16x2_mul(_bf16_pair(q, 0x000F000F, 6, 12), m)
    p1 = _bf16x2_mul(_bf16_pair(q, 0x00F000F0, 2, 8), m)
    p2 = _bf16x2_mul(_bf16_pair(r, 0x000F000F, 6, 12), m)
    p3 = _bf16x2_mul(_bf16_pair(r, 0x00F000F0, 2, 8), m)
    j = gl.join(gl.join(p0, p2), gl.join(p1, p3))  # [BN, g, w, j1, j0]
    lo, hi = _halves(j)
    t = gl.join(lo, hi)  # [BN, g, w, j1, j0, h]
    t = gl.permute(t, [0, 2, 1, 3, 4, 5])  # kk = h + 2 j0 + 4 j1 + 8 g + 32 w
    a = gl.convert_layout(gl.reshape(t, [BN, 128]), LA)
    x = gl.reshape(x, [BM, 4, 4, 2, 2, 2])  # [m, g, w, b2, b1, b0]
    x = gl.permute(x, [0, 2, 1, 4, 5, 3])  # [m, w, g, j1 = b1, j0 = b0, h = b2]
    b = gl.convert_layout(gl.permute(gl.reshape(x, [BM, 128]), [1, 0]), LB)
    return mma_v2(a, b, acc)


@gluon.jit
def _chunk_sums(w_ptrs, s_ptrs, x_rows, K: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, NS: gl.constexpr,
                LQ: gl.constexpr, LX: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr, LC: gl.constexpr):
    """float32 ``[BN, BM]``: the weight rows' products with the chunk's input rows, over all of K: the
    whole steps unmasked, then the part step. ``NS`` 2 loads each step one step ahead, into
    registers, so that its bytes are in flight while the step before is unpacked and multiplied (the
    same products in the same order: the same bits); 1 loads at the step; from 3,
    :func:`_ring_sums`."""
    acc = gl.zeros([BN, BM], gl.float32, LC)
    FULL: gl.constexpr = K // 128
    if NS >= 3:
        acc = _ring_sums(acc, w_ptrs, s_ptrs, x_rows, K, BN, BM, NS, LQ, LX, LA, LB)
    elif NS == 2 and FULL > 0:
        # Unrolled by two, so that the step loaded ahead is the loop's carried value only every
        # second step (no register copies between steps); the last steps unrolled at compile time.
        STEPS: gl.constexpr = FULL + (K % 128 > 0)
        q, s, x = _load_step(w_ptrs, s_ptrs, x_rows, 0, K, BN, BM, False, LQ, LX)
        for i in range((FULL - 1) // 2):
            q1, s1, x1 = _load_step(w_ptrs, s_ptrs, x_rows, 2 * i + 1, K, BN, BM, False, LQ, LX)
            acc = _mma_step(acc, q, s, x, BN, BM, LA, LB)
            q, s, x = _load_step(w_ptrs, s_ptrs, x_rows, 2 * i + 2, K, BN, BM, False, LQ, LX)
            acc = _mma_step(acc, q1, s1, x1, BN, BM, LA, LB)
        for j in gl.static_range((FULL - 1) // 2 * 2 + 1, STEPS):
            qn, sn, xn = _load_step(w_ptrs, s_ptrs, x_rows, j, K, BN, BM, j == FULL, LQ, LX)
            acc = _mma_step(acc, q, s, x, BN, BM, LA, LB)
            q, s, x = qn, sn, xn
        acc = _mma_step(acc, q, s, x, BN, BM, LA, LB)
    else:
        for i in range(FULL):
            q, s, x = _load_step(w_ptrs, s_ptrs, x_rows, i, K, BN, BM, False, LQ, LX)
            acc = _mma_step(acc, q, s, x, BN, BM, LA, LB)
        if K % 128:
            q, s, x = _load_step(w_ptrs, s_ptrs, x_rows, FULL, K, BN, BM, True, LQ, LX)
            acc = _mma_step(acc, q, s, x, BN, BM, LA, LB)
    return acc * 9.223372036854775808e18  # 2^63


@gluon.jit
def _groups_in_k(every_s, g, step, K: gl.constexpr):
    """``[BN, 4]``: which of k step ``step``'s four scale groups ``g`` lie before K, for every row."""
    return every_s & (g < K // 32 - step * 4)[None, :]


@gluon.jit
def _step_scales(s_ptrs, step, K: gl.constexpr, g, every_s):
    """k step ``step``'s scale bytes ``[BN, 4]``; 127 (a factor of one) past K."""
    return gl.load(s_ptrs + step * 4, mask=_groups_in_k(every_s, g, step, K), other=127)


@gluon.jit
def _copy_step(codes, tokens, w_ptrs, x_rows, step, K: gl.constexpr, g, col, every_s, every_x):
    """One commit group of :func:`_ring_sums`: k step ``step``'s codes (each thread its own 16 bytes)
    and tokens into ring slots ``codes`` and ``tokens``; past K zero-filled."""
    async_copy.async_copy_global_to_shared(codes, w_ptrs + step * 16,
                                           mask=_groups_in_k(every_s, g, step, K)[:, :, None])
    ph = step * 128 + col
    async_copy.async_copy_global_to_shared(tokens, x_rows[:, None] + ph[None, :], mask=every_x & (ph < K)[None, :])
    async_copy.commit_group()


@gluon.jit
def _ring_sums(acc, w_ptrs, s_ptrs, x_rows, K: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr,
               NS: gl.constexpr, LQ: gl.constexpr, LX: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr):
    """``acc`` plus :func:`_chunk_sums`'s products for ``NS`` >= 3: each step's codes and inputs
    copied ``NS - 1`` steps ahead into rings in shared memory, the scales two steps ahead in
    registers (module doc). Every step is masked as the part step is (past K: code 0, scale 127,
    input 0, each copy past K zero-filled), so the products are those of the register paths, in the
    same order."""
    D: gl.constexpr = NS - 1
    W: gl.constexpr = gl.num_warps()
    STEPS: gl.constexpr = K // 128 + (K % 128 > 0)
    L2: gl.constexpr = gl.SliceLayout(2, LQ)
    # a thread copies the 16 bytes of codes it reads back; the inputs' copy splits them over the
    # block (LX holds every token in every warp): 16-byte pieces, 8-byte ones where the warps outnumber
    # the tokens' halves
    if 2 * W <= BM:
        LXC: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [W, 1], [1, 0])
    else:
        LXC: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])
    ring = gl.allocate_shared_memory(gl.int32, [D, BN, 4, 4], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    xring = gl.allocate_shared_memory(gl.bfloat16, [D, BM, 128], gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
    xr = gl.convert_layout(x_rows, gl.SliceLayout(1, LXC))
    col = gl.arange(0, 128, layout=gl.SliceLayout(0, LXC))
    g = gl.arange(0, 4, layout=gl.SliceLayout(0, L2))
    every_x = gl.full([BM, 128], 1, gl.int1, LXC)
    every_s = gl.full([BN, 4], 1, gl.int1, L2)
    for j in gl.static_range(D):
        _copy_step(ring.index(j), xring.index(j), w_ptrs, xr, j, K, g, col, every_s, every_x)
    s0 = _step_scales(s_ptrs, 0, K, g, every_s)
    s1 = _step_scales(s_ptrs, 1, K, g, every_s)
    for i in range(STEPS):
        s2 = _step_scales(s_ptrs, i + 2, K, g, every_s)
        async_copy.wait_group(D - 1)  # step i's copies have landed
        slot = i % D
        q = ring.index(slot).load(LQ)
        x = xring.index(slot).load(LX)
        # into the slot just read
        _copy_step(ring.index(slot), xring.index(slot), w_ptrs, xr, i + D, K, g, col, every_s, every_x)
        acc = _mma_step(acc, q, s0, x, BN, BM, LA, LB)
        s0 = s1
        s1 = s2
    async_copy.wait_group(0)  # no copy outlives the rings
    return acc


def tile_layouts(block_n: int, block_m: int, num_warps: int) -> tuple:
    """The tile's layouts (constexpr arguments of the kernels): words ``[block_n, 4 groups, 4 words]``
    (a thread's 4 words of a group in consecutive registers: one 16-byte load), inputs as loaded
    ``[block_m, 128]`` (a thread's 32 consecutive inputs of a token), the MMA's A, B and accumulator."""
    rows = [[16 * num_warps << i, 0, 0] for i in range((block_n // (16 * num_warps)).bit_length() - 1)]
    warps = [[16 << i, 0, 0] for i in range(num_warps.bit_length() - 1)]
    lq = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]] + rows,
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]], warp_bases=warps, block_bases=[],
        shape=[block_n, 4, 4])
    tokens = [[1 << i, 0] for i in range(3, block_m.bit_length() - 1)]  # tokens past 8: registers
    lx = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]] + tokens,
        lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]], warp_bases=[[0, 0]] * (num_warps.bit_length() - 1),
        block_bases=[], shape=[block_m, 128])
    lc = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
    la = gl.DotOperandLayout(operand_index=0, parent=lc, k_width=8)
    lb = gl.DotOperandLayout(operand_index=1, parent=lc, k_width=8)
    return lq, lx, la, lb, lc


@gluon.jit
def _row_ptrs(w_base, s_base, rows, K: gl.constexpr, LQ: gl.constexpr):
    """Pointers to step 0's words ``[BN, 4, 4]`` (int32: 16 bytes a group) and scale bytes ``[BN, 4]``
    of weight rows ``rows`` (in ``SliceLayout(1, SliceLayout(2, LQ))``)."""
    L2: gl.constexpr = gl.SliceLayout(2, LQ)
    r = rows.to(gl.int64)
    g = gl.arange(0, 4, layout=gl.SliceLayout(0, L2))
    w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LQ)))
    w_ptrs = w_base + r[:, None, None] * (K // 8) + g[None, :, None] * 4 + w[None, None, :]
    s_ptrs = s_base + r[:, None] * (K // 32) + g[None, :]
    return w_ptrs, s_ptrs


@gluon.jit(do_not_specialize=["num_pairs", "layer", "NB"])  # one compile for every layer and batch
def _w13_mma_kernel(
    x_ptr, ids_ptr, sorted_pairs_ptr, expert_off_ptr, row_map_ptr, w_hot_ptr, w_cold_ptr, s_hot_ptr, s_cold_ptr,
    b13_ptr, act_ptr, num_pairs, layer, NB,
    E: gl.constexpr, EP: gl.constexpr, TOPK: gl.constexpr, H: gl.constexpr, I: gl.constexpr, BM: gl.constexpr,
    BN: gl.constexpr, USE_ROW_MAP: gl.constexpr, USE_GDC: gl.constexpr, ORDER: gl.constexpr,
    HAS_BIAS: gl.constexpr, ACT: gl.constexpr, ALPHA: gl.constexpr, LIMIT: gl.constexpr, NS: gl.constexpr,
    W: gl.constexpr, LQ: gl.constexpr, LX: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr, LC: gl.constexpr,
):
    """w13 for a chunk of ``BM`` of the block's expert's pairs at a time: ``BN / 2`` outputs' gate and
    up rows (module doc), biases, the activation, rounded once into the per-pair intermediate."""
    slot, pid_n, _split = _block_ids(NB, ORDER)
    if USE_GDC:
        gdc_launch_dependents()
    expert, cnt, start, c_begin, c_end = _block_expert(ids_ptr, expert_off_ptr, num_pairs, slot, E, EP, 1, BM, 1,
                                                       W)
    w_base = _expert_base(row_map_ptr, w_hot_ptr, w_cold_ptr, layer, expert, 2 * I * (H // 8), E, USE_ROW_MAP)
    s_base = _expert_base(row_map_ptr, s_hot_ptr, s_cold_ptr, layer, expert, 2 * I * (H // 32), E, USE_ROW_MAP)
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, LQ)))
    n_r = pid_n * (BN // 2) + (r // 16) * 8 + r % 8  # the output of tile row r; rows 8-15 of a 16: its up row
    # rows past I read row I - 1, never stored
    w_ptrs, s_ptrs = _row_ptrs(w_base, s_base, gl.minimum(n_r, I - 1) + ((r // 8) % 2) * I, H, LQ)
    LGO: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [W, 1], [1, 0])
    offs_o = pid_n * (BN // 2) + gl.arange(0, BN // 2, layout=gl.SliceLayout(1, LGO))
    o_ok = offs_o < I
    bg = _expert_bias(b13_ptr, layer, expert, offs_o, o_ok, 2 * I, E, HAS_BIAS)
    bu = _expert_bias(b13_ptr, layer, expert, I + offs_o, o_ok, 2 * I, E, HAS_BIAS)
    if USE_GDC:
        gdc_wait()
    m = gl.arange(0, BM, layout=gl.SliceLayout(1, LX))
    m_o = gl.arange(0, BM, layout=gl.SliceLayout(0, LGO))
    c = c_begin
    while c < c_end:
        pair = gl.load(sorted_pairs_ptr + start + gl.minimum(c + m, cnt - 1))  # past the chunk: its last, not stored
        acc = _chunk_sums(w_ptrs, s_ptrs, x_ptr + (pair // TOPK).to(gl.int64) * H, H, BN, BM, NS, LQ, LX, LA, LB,
                          LC)
        gu = gl.permute(gl.reshape(acc, [BN // 16, 2, 8, BM]), [0, 2, 3, 1])  # [b, i, m, gate / up]
        g, u = gl.split(gu)
        g = gl.convert_layout(gl.reshape(g, [BN // 2, BM]), LGO)
        u = gl.convert_layout(gl.reshape(u, [BN // 2, BM]), LGO)
        act = _activation(g + bg[:, None], u + bu[:, None], ACT, ALPHA, LIMIT)
        ok_o = c + m_o < cnt
        pair_o = gl.load(sorted_pairs_ptr + start + c + m_o, mask=ok_o, other=0)
        gl.store(act_ptr + pair_o.to(gl.int64)[None, :] * I + offs_o[:, None], act.to(act_ptr.dtype.element_ty),
                 mask=o_ok[:, None] & ok_o[None, :])
        c += BM


@gluon.jit(do_not_specialize=["num_pairs", "layer", "NB"])
def _w2_mma_kernel(
    act_ptr, ids_ptr, sorted_pairs_ptr, expert_off_ptr, row_map_ptr, w_hot_ptr, w_cold_ptr, s_hot_ptr, s_cold_ptr,
    b2_ptr, topk_w_ptr, buf_ptr, num_pairs, layer, NB,
    E: gl.constexpr, EP: gl.constexpr, H: gl.constexpr, I: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
    USE_ROW_MAP: gl.constexpr, USE_GDC: gl.constexpr, ORDER: gl.constexpr, HAS_BIAS: gl.constexpr,
    NS: gl.constexpr, W: gl.constexpr, LQ: gl.constexpr, LX: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr,
    LC: gl.constexpr,
):
    """w2 for a chunk of ``BM`` of the block's expert's pairs at a time: their intermediate rows times
    w2's rows n (of H), plus w2's bias, times the routing weight, into the per-pair buffer."""
    slot, pid_n, _split = _block_ids(NB, ORDER)
    expert, cnt, start, c_begin, c_end = _block_expert(ids_ptr, expert_off_ptr, num_pairs, slot, E, EP, 1, BM, 1,
                                                       W)
    w_base = _expert_base(row_map_ptr, w_hot_ptr, w_cold_ptr, layer, expert, H * (I // 8), E, USE_ROW_MAP)
    s_base = _expert_base(row_map_ptr, s_hot_ptr, s_cold_ptr, layer, expert, H * (I // 32), E, USE_ROW_MAP)
    r = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, LQ)))
    w_ptrs, s_ptrs = _row_ptrs(w_base, s_base, gl.minimum(r, H - 1), I, LQ)
    offs_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LC))
    n_ok = offs_n < H
    b2 = _expert_bias(b2_ptr, layer, expert, offs_n, n_ok, H, E, HAS_BIAS)
    if USE_GDC:
        gdc_launch_dependents()
        gdc_wait()
    m = gl.arange(0, BM, layout=gl.SliceLayout(1, LX))
    m_c = gl.arange(0, BM, layout=gl.SliceLayout(0, LC))
    c = c_begin
    while c < c_end:
        pair = gl.load(sorted_pairs_ptr + start + gl.minimum(c + m, cnt - 1))
        acc = _chunk_sums(w_ptrs, s_ptrs, act_ptr + pair.to(gl.int64) * I, I, BN, BM, NS, LQ, LX, LA, LB, LC)
        ok_c = c + m_c < cnt
        pair_c = gl.load(sorted_pairs_ptr + start + c + m_c, mask=ok_c, other=0)
        wt = gl.load(topk_w_ptr + pair_c, mask=ok_c, other=0.0).to(gl.float32)
        gl.store(buf_ptr + pair_c.to(gl.int64)[None, :] * H + offs_n[:, None],
                 ((acc + b2[:, None]) * wt[None, :]).to(buf_ptr.dtype.element_ty), mask=n_ok[:, None] & ok_c[None, :])
        c += BM
