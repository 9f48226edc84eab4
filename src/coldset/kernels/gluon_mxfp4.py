"""The MXFP4 experts kernel's GEMV tile in Gluon (Triton's layout-explicit dialect), for CUDA.

:mod:`coldset.kernels.triton_mxfp4`'s GEMV path (``block_m`` 1 or 2: a decode step's few pairs an
expert, sums in registers, no dot) computes the same quantity as these two kernels, but Triton picks
its register layouts: the tile's codes are loaded one layout, its inputs another, and every k step
converts between them through shared memory (barriers in the loop) and sums each scale group across
four threads (shuffles). Here the layout is written down: each thread holds ``R`` rows times
``SG`` whole scale groups (four int32 words of codes, one 16-byte load a group) and the same groups'
32 inputs (four 16-byte loads), so a k step is loads, bit operations and FMAs in registers, and the
rows' sums cross threads once, after the last step.

Arithmetic, as the Triton GEMV path: a word's 8 codes unpacked two at a time as fp16 lanes
``e2m1 * 2^-14`` (:func:`coldset.kernels.triton_mxfp4._e2m1_pair`'s bit operations), widened
exactly to float32; a word's 8 products summed in one chain (nibbles 0, 4, 1, 5, 2, 6, 3, 7), times
the group's ``2^(s - 127)`` into a per-word float32 accumulator; after the last step the words,
groups and threads summed, times 2^14. Other float32 sums than the Triton path's (a config's bits
depend on the path, never on the placement: the row map only moves the base pointers).

Triton's interpreter runs no Gluon: on CPU tensors the GEMV path is the Triton one. The tile's
shape comes from the config: ``block_k`` / 32 groups a step, spread over ``min(groups, 32)`` lanes
(``SG`` groups a lane above 32), the remaining lanes and the warps over the ``block_n`` rows (``R``
rows a thread); :func:`layout_fits` says which configs lay out.
"""

from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from coldset.kernels.triton_moe import _activation, _block_ids, _expert_base, gdc_launch_dependents, gdc_wait


def tile_shape(block_n: int, block_k: int, num_warps: int) -> tuple[int, int, int, int] | None:
    """(R rows a thread, SG groups a thread, TR lanes over rows, TG lanes over groups) of a GEMV tile
    of ``block_n`` rows and ``block_k`` inputs a step over ``num_warps`` warps, or None where it does
    not lay out (rows fewer than the lanes and warps left for them, or not a multiple)."""
    groups = block_k // 32
    tg = min(groups, 32)
    sg, tr = groups // tg, 32 // tg
    if block_k % 32 or groups % tg or block_n % (tr * num_warps):
        return None
    return block_n // (tr * num_warps), sg, tr, tg


def layout_fits(block_n1: int, block_k1: int, block_n2: int, block_k2: int, num_warps: int) -> bool:
    """Whether both launches' tiles lay out (:func:`tile_shape`; w13's tile is ``2 block_n1`` rows: each
    output's gate and up rows)."""
    return tile_shape(2 * block_n1, block_k1, num_warps) is not None and tile_shape(block_n2, block_k2,
                                                                                      num_warps) is not None


@gluon.jit
def _block_expert(ids_ptr, expert_off_ptr, num_pairs, slot, E: gl.constexpr, EP: gl.constexpr, NP: gl.constexpr,
                  BM: gl.constexpr, MODE: gl.constexpr, W: gl.constexpr):
    """:func:`coldset.kernels.triton_moe._block_expert` with explicit layouts: (expert, its pair
    count, start of its sorted pairs, first and end chunk offset) of block ``slot``."""
    if MODE == 0:
        L2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [W, 1], [1, 0])
        offs_p = gl.arange(0, NP, layout=gl.SliceLayout(0, L2))
        ids = gl.load(ids_ptr + offs_p, mask=offs_p < num_pairs, other=-1).to(gl.int32)
        offs_e = gl.arange(0, EP, layout=gl.SliceLayout(1, L2))
        L1: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])  # a scan's layout
        present = gl.convert_layout(gl.max((ids[None, :] == offs_e[:, None]).to(gl.int32), axis=1), L1)
        rank = tl.cumsum(present, 0) - 1
        hit = (present > 0) & (rank == slot)
        found = gl.sum(hit.to(gl.int32), axis=0)
        expert = gl.sum(gl.where(hit, gl.arange(0, EP, layout=L1), 0), axis=0)
        cnt = gl.sum((ids == expert).to(gl.int32), axis=0) * found
        start = cnt * 0
        c_begin = cnt * 0
        c_end = cnt
    else:
        L1: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
        offs_e = gl.arange(0, EP, layout=L1)
        in_e = offs_e < E
        lo = gl.load(expert_off_ptr + offs_e, mask=in_e, other=0)
        hi = gl.load(expert_off_ptr + offs_e + 1, mask=in_e, other=0)
        ntiles = (hi - lo + BM - 1) // BM
        tiles_through = tl.cumsum(ntiles, 0)
        expert = gl.sum((tiles_through <= slot).to(gl.int32), axis=0)
        sel = offs_e == expert
        first_tile = gl.sum(gl.where(offs_e < expert, ntiles, 0), axis=0)
        start = gl.sum(gl.where(sel, lo, 0), axis=0)
        cnt = gl.sum(gl.where(sel, hi - lo, 0), axis=0)
        c_begin = (slot - first_tile) * BM
        c_end = gl.minimum(cnt, c_begin + BM)
        expert = gl.minimum(expert, E - 1)
    return expert, cnt, start, c_begin, c_end


@gluon.jit
def _chunk_pair(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, m, cnt, NP: gl.constexpr, MODE: gl.constexpr,
                W: gl.constexpr):
    """Pair index (t * k + rank) of the m-th of this expert's pairs (ascending pair order) and
    whether it exists: :func:`coldset.kernels.triton_moe._chunk_pairs` one pair at a time."""
    valid = m < cnt
    if MODE == 0:
        L1: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
        offs_p = gl.arange(0, NP, layout=L1)
        ids = gl.load(ids_ptr + offs_p, mask=offs_p < num_pairs, other=-1).to(gl.int32)
        match = ids == expert
        pos = tl.cumsum(match.to(gl.int32), 0) - 1
        pair = gl.sum(gl.where(match & (pos == m), offs_p, 0), axis=0)
    else:
        pair = gl.load(sorted_pairs_ptr + start + m, mask=valid, other=0)
    return pair, valid


@gluon.jit
def _row_ptrs(w_base, s_base, offs_n, K: gl.constexpr, G: gl.constexpr, L3: gl.constexpr):
    """Pointers to the first k step's int32 words ``[BN, G, 4]`` and scale bytes ``[BN, G]`` of rows
    ``offs_n`` of one expert's packed codes (int32 ``[N, K / 8]``: the pools' bytes viewed as words at
    launch, so that the compiler knows each group's 16 bytes aligned and loads them at once) and
    ``[N, K / 32]`` scales."""
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    rows = offs_n.to(gl.int64)
    g = gl.arange(0, G, layout=gl.SliceLayout(0, L2))
    w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    w_ptrs = w_base + rows[:, None, None] * (K // 8) + g[None, :, None] * 4 + w[None, None, :]
    s_ptrs = s_base + rows[:, None] * (K // 32) + g[None, :]
    return w_ptrs, s_ptrs


@gluon.jit
def _load_codes(w_ptrs, s_ptrs, step, n_ok, K: gl.constexpr, G: gl.constexpr, L3: gl.constexpr):
    """Step ``step``'s words and scale bytes; rows past N and groups past K read as code 0."""
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    g = gl.arange(0, G, layout=gl.SliceLayout(0, L2))
    ok = n_ok[:, None] & (g < K // 32 - step * G)[None, :]
    q = gl.load(w_ptrs + step * G * 4, mask=ok[:, :, None], other=0)
    sc = gl.load(s_ptrs + step * G, mask=ok, other=127)
    return q, sc


@gluon.jit
def _inputs(a_row, step, ok, K: gl.constexpr, G: gl.constexpr, SG: gl.constexpr, TG: gl.constexpr,
            TR: gl.constexpr, W: gl.constexpr, L3: gl.constexpr):
    """Step ``step``'s float32 inputs of the bf16 row ``a_row`` (zeros where ``ok`` is false or past K),
    as the 8 tensors ``x_j [1, G, 4]`` (input ``32 g + 8 w + j``) in the words' layout: loaded 32 a
    group into the lane that holds the group, split in registers."""
    LXL: gl.constexpr = gl.BlockedLayout([SG, 32], [TG, TR], [1, W], [0, 1])
    LX: gl.constexpr = gl.SliceLayout(0, L3)
    g = gl.arange(0, G, layout=gl.SliceLayout(1, LXL))
    offs = g[:, None] * 32 + gl.arange(0, 32, layout=gl.SliceLayout(0, LXL))[None, :]  # the same every step
    xv = gl.load(a_row + step * (G * 32) + offs, mask=((g < K // 32 - step * G) & ok)[:, None], other=0.0)
    xv = xv.to(gl.float32)
    xv = gl.reshape(xv, [G, 4, 2, 2, 2])  # input 8 w + 4 a + 2 b + c of a group
    xa, xb = gl.split(xv)
    x00, x01 = gl.split(xa)
    x10, x11 = gl.split(xb)
    x0, x4 = gl.split(x00)
    x2, x6 = gl.split(x01)
    x1, x5 = gl.split(x10)
    x3, x7 = gl.split(x11)
    return (gl.convert_layout(x0, LX)[None], gl.convert_layout(x1, LX)[None], gl.convert_layout(x2, LX)[None],
            gl.convert_layout(x3, LX)[None], gl.convert_layout(x4, LX)[None], gl.convert_layout(x5, LX)[None],
            gl.convert_layout(x6, LX)[None], gl.convert_layout(x7, LX)[None])


@gluon.jit
def _pair(q, EEM_SHIFT: gl.constexpr, SIGN_SHIFT: gl.constexpr):
    """Nibbles k and k + 4 of each word as float32 ``e2m1 * 2^-14``
    (:func:`coldset.kernels.triton_mxfp4._e2m1_pair`'s bit operations)."""
    if EEM_SHIFT >= 0:
        e = q << EEM_SHIFT
    else:
        e = q >> (-EEM_SHIFT)
    p = (e & 0x0E000E00) | ((q << SIGN_SHIFT) & -2147450880)  # -2147450880: the int32 0x80008000
    lo = p.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    hi = (p >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    return lo, hi


@gluon.jit
def _step(acc, q, sc, x0, x1, x2, x3, x4, x5, x6, x7):
    """``acc [BN, G, 4] += (sum of each word's 8 products) * 2^(s - 127)``."""
    v0, v4 = _pair(q, 9, 12)
    v1, v5 = _pair(q, 5, 8)
    v2, v6 = _pair(q, 1, 4)
    v3, v7 = _pair(q, -3, 0)
    part = v0 * x0
    part = gl.fma(v4, x4, part)
    part = gl.fma(v1, x1, part)
    part = gl.fma(v5, x5, part)
    part = gl.fma(v2, x2, part)
    part = gl.fma(v6, x6, part)
    part = gl.fma(v3, x3, part)
    part = gl.fma(v7, x7, part)
    s = sc.to(gl.int32)
    f = gl.where(s == 0, 0x00400000, s << 23).to(gl.float32, bitcast=True)
    return gl.fma(part, f[:, :, None], acc)


@gluon.jit
def _row_sums(acc):
    """``[BN]``: each row's sum of an accumulator ``[BN, G, 4]``, times 2^14."""
    return gl.sum(gl.sum(acc, axis=2), axis=1) * 16384.0


@gluon.jit
def _rows_times(a0, ok0, a1, ok1, w_ptrs, s_ptrs, n_ok, K: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                G: gl.constexpr, SG: gl.constexpr, TG: gl.constexpr, TR: gl.constexpr, W: gl.constexpr,
                NS: gl.constexpr, L3: gl.constexpr):
    """fp32 ``[BN]`` products of the bf16 input rows ``a0`` (and ``a1`` with ``BM`` 2) with the weight
    rows ``w_ptrs`` / ``s_ptrs`` point at. ``NS`` 2 loads each step's codes one step ahead, into
    registers; 1 at the step."""
    acc0 = gl.zeros([BN, G, 4], gl.float32, L3)
    acc1 = gl.zeros([BN, G, 4], gl.float32, L3)
    steps: gl.constexpr = (K // 32 + G - 1) // G
    if NS == 2:
        q, sc = _load_codes(w_ptrs, s_ptrs, 0, n_ok, K, G, L3)
    for i in range(steps):
        if NS == 2:
            qn, scn = _load_codes(w_ptrs, s_ptrs, i + 1, n_ok, K, G, L3)  # past the last step: all masked
        else:
            q, sc = _load_codes(w_ptrs, s_ptrs, i, n_ok, K, G, L3)
        x0, x1, x2, x3, x4, x5, x6, x7 = _inputs(a0, i, ok0, K, G, SG, TG, TR, W, L3)
        acc0 = _step(acc0, q, sc, x0, x1, x2, x3, x4, x5, x6, x7)
        if BM == 2:
            x0, x1, x2, x3, x4, x5, x6, x7 = _inputs(a1, i, ok1, K, G, SG, TG, TR, W, L3)
            acc1 = _step(acc1, q, sc, x0, x1, x2, x3, x4, x5, x6, x7)
        if NS == 2:
            q, sc = qn, scn
    return _row_sums(acc0), _row_sums(acc1)


@gluon.jit
def _gate_up(r, BN: gl.constexpr, LO: gl.constexpr):
    """The gate and up sums ``[BN]`` (layout ``LO``) of a w13 tile's row sums ``[2 BN]`` (gate and up
    rows interleaved: :func:`_w13_gemv_kernel`)."""
    g, u = gl.split(gl.reshape(r, [BN, 2]))
    return gl.convert_layout(g, LO), gl.convert_layout(u, LO)


@gluon.jit
def _bias(b_ptr, layer, expert, offs, ok, N: gl.constexpr, E: gl.constexpr, HAS_BIAS: gl.constexpr):
    """fp32 values ``offs`` of the bias row of (layer, expert) in ``[L, E, N]`` biases (by expert id,
    never through the row map); zeros without biases."""
    if HAS_BIAS:
        b = gl.load(b_ptr + (layer * E + expert).to(gl.int64) * N + offs, mask=ok, other=0.0).to(gl.float32)
    else:
        b = offs.to(gl.float32) * 0.0
    return b


@gluon.jit(do_not_specialize=["num_pairs", "layer", "NB"])  # one compile for every layer and batch
def _w13_gemv_kernel(
    x_ptr, ids_ptr, sorted_pairs_ptr, expert_off_ptr, row_map_ptr, w_hot_ptr, w_cold_ptr, s_hot_ptr, s_cold_ptr,
    b13_ptr, act_ptr, num_pairs, layer, stride_xt, NB,
    E: gl.constexpr, EP: gl.constexpr, TOPK: gl.constexpr, H: gl.constexpr, I: gl.constexpr,
    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NP: gl.constexpr, MODE: gl.constexpr,
    USE_ROW_MAP: gl.constexpr, USE_GDC: gl.constexpr, ORDER: gl.constexpr, HAS_BIAS: gl.constexpr,
    ACT: gl.constexpr, ALPHA: gl.constexpr, LIMIT: gl.constexpr, NS: gl.constexpr, W: gl.constexpr,
):
    """The w13 launch of :func:`coldset.kernels.triton_mxfp4.triton_mxfp4_experts`'s GEMV path: per
    chunk of ``BM`` pairs of the block's expert, the gate rows n and up rows I + n, biases, the
    activation, rounded once into the per-pair intermediate."""
    G: gl.constexpr = BK // 32  # the tile's layout (tile_shape): groups a step over lanes, rows over lanes and warps
    TG: gl.constexpr = 32 if G >= 32 else G
    SG: gl.constexpr = G // TG
    TR: gl.constexpr = 32 // TG
    L3: gl.constexpr = gl.BlockedLayout([2 * BN // (TR * W), SG, 4], [TR, TG, 1], [W, 1, 1], [2, 1, 0])
    slot, pid_n, _split = _block_ids(NB, ORDER)
    if USE_GDC:
        gdc_launch_dependents()  # a plain launch: its inputs are complete; the w2 kernel may start now
    expert, cnt, start, c_begin, c_end = _block_expert(ids_ptr, expert_off_ptr, num_pairs, slot, E, EP, NP, BM,
                                                       MODE, W)
    # the one place the expert id is used: one row-map lookup for the packed weights, the same for the scales
    w_base = _expert_base(row_map_ptr, w_hot_ptr, w_cold_ptr, layer, expert, 2 * I * (H // 8), E, USE_ROW_MAP)
    s_base = _expert_base(row_map_ptr, s_hot_ptr, s_cold_ptr, layer, expert, 2 * I * (H // 32), E, USE_ROW_MAP)
    # the tile's rows: gate row n and up row I + n side by side (tile row 2 j and 2 j + 1 for output j), so
    # that one tile of 2 BN rows shares each input load, and a thread's neighbouring rows are a pair
    j = gl.arange(0, 2 * BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    n_t = pid_n * BN + j // 2
    t_ok = n_t < I
    w_ptrs, s_ptrs = _row_ptrs(w_base, s_base, n_t + (j % 2) * I, H, G, L3)
    LO: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    offs_n = pid_n * BN + gl.arange(0, BN, layout=LO)
    n_ok = offs_n < I
    bg = _bias(b13_ptr, layer, expert, offs_n, n_ok, 2 * I, E, HAS_BIAS)
    bu = _bias(b13_ptr, layer, expert, I + offs_n, n_ok, 2 * I, E, HAS_BIAS)
    c = c_begin
    while c < c_end:  # chunks of this expert's pairs (a while loop: dynamic bound)
        p0, ok0 = _chunk_pair(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, c, cnt, NP, MODE, W)
        p1, ok1 = _chunk_pair(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, c + BM - 1, cnt, NP, MODE, W)
        a0 = x_ptr + (p0 // TOPK).to(gl.int64) * stride_xt
        a1 = x_ptr + (p1 // TOPK).to(gl.int64) * stride_xt
        r0, r1 = _rows_times(a0, ok0, a1, ok1, w_ptrs, s_ptrs, t_ok, H, BM, 2 * BN, G, SG, TG, TR, W, NS, L3)
        g0, u0 = _gate_up(r0, BN, LO)
        act0 = _activation(g0 + bg, u0 + bu, ACT, ALPHA, LIMIT)
        gl.store(act_ptr + p0.to(gl.int64) * I + offs_n, act0.to(act_ptr.dtype.element_ty), mask=n_ok & ok0)
        if BM == 2:
            g1, u1 = _gate_up(r1, BN, LO)
            act1 = _activation(g1 + bg, u1 + bu, ACT, ALPHA, LIMIT)
            gl.store(act_ptr + p1.to(gl.int64) * I + offs_n, act1.to(act_ptr.dtype.element_ty), mask=n_ok & ok1)
        c += BM


@gluon.jit(do_not_specialize=["num_pairs", "layer", "NB"])
def _w2_gemv_kernel(
    act_ptr, ids_ptr, sorted_pairs_ptr, expert_off_ptr, row_map_ptr, w_hot_ptr, w_cold_ptr, s_hot_ptr, s_cold_ptr,
    b2_ptr, topk_w_ptr, buf_ptr, num_pairs, layer, NB,
    E: gl.constexpr, EP: gl.constexpr, H: gl.constexpr, I: gl.constexpr,
    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NP: gl.constexpr, MODE: gl.constexpr,
    USE_ROW_MAP: gl.constexpr, USE_GDC: gl.constexpr, ORDER: gl.constexpr, HAS_BIAS: gl.constexpr,
    NS: gl.constexpr, W: gl.constexpr,
):
    """The w2 launch of the GEMV path: per pair of the block's expert, its intermediate row times w2's
    rows n (of H), plus w2's bias, times the routing weight, into the per-pair buffer."""
    G: gl.constexpr = BK // 32  # the tile's layout (tile_shape): groups a step over lanes, rows over lanes and warps
    TG: gl.constexpr = 32 if G >= 32 else G
    SG: gl.constexpr = G // TG
    TR: gl.constexpr = 32 // TG
    L3: gl.constexpr = gl.BlockedLayout([BN // (TR * W), SG, 4], [TR, TG, 1], [W, 1, 1], [2, 1, 0])
    slot, pid_n, _split = _block_ids(NB, ORDER)
    expert, cnt, start, c_begin, c_end = _block_expert(ids_ptr, expert_off_ptr, num_pairs, slot, E, EP, NP, BM,
                                                       MODE, W)
    w_base = _expert_base(row_map_ptr, w_hot_ptr, w_cold_ptr, layer, expert, H * (I // 8), E, USE_ROW_MAP)
    s_base = _expert_base(row_map_ptr, s_hot_ptr, s_cold_ptr, layer, expert, H * (I // 32), E, USE_ROW_MAP)
    offs_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    n_ok = offs_n < H
    w_ptrs, s_ptrs = _row_ptrs(w_base, s_base, offs_n, I, G, L3)  # w2 rows n (of H)
    b2 = _bias(b2_ptr, layer, expert, offs_n, n_ok, H, E, HAS_BIAS)
    if USE_GDC:  # launched early: only the launch and the lookups above overlap the w13 launch
        gdc_launch_dependents()
        gdc_wait()
    c = c_begin
    while c < c_end:
        p0, ok0 = _chunk_pair(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, c, cnt, NP, MODE, W)
        p1, ok1 = _chunk_pair(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, c + BM - 1, cnt, NP, MODE, W)
        r0, r1 = _rows_times(act_ptr + p0.to(gl.int64) * I, ok0, act_ptr + p1.to(gl.int64) * I, ok1, w_ptrs, s_ptrs,
                             n_ok, I, BM, BN, G, SG, TG, TR, W, NS, L3)
        wt0 = gl.load(topk_w_ptr + p0, mask=ok0, other=0.0).to(gl.float32)
        gl.store(buf_ptr + p0.to(gl.int64) * H + offs_n, ((r0 + b2) * wt0).to(buf_ptr.dtype.element_ty),
                 mask=n_ok & ok0)
        if BM == 2:
            wt1 = gl.load(topk_w_ptr + p1, mask=ok1, other=0.0).to(gl.float32)
            gl.store(buf_ptr + p1.to(gl.int64) * H + offs_n, ((r1 + b2) * wt1).to(buf_ptr.dtype.element_ty),
                     mask=n_ok & ok1)
        c += BM
