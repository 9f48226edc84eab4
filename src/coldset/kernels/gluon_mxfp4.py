"""The MXFP4 experts kernel's GEMV tile in Gluon (Triton's layout-explicit dialect), for CUDA.

:mod:`coldset.kernels.triton_mxfp4`'s GEMV path (``block_m`` 1 or 2: a decode step's few pairs an
expert, sums in registers, no dot) computes the same quantity as these two kernels, but Triton picks
its register layouts: the tile's codes are loaded one layout, its inputs another, and every k step
converts between them through shared memory (barriers in the loop) and sums each scale group across
four threads (shuffles). Here the layout is written down: each thread holds ``R`` rows times
``SG`` whole scale groups (four int32 words of codes, one 16-byte load a group) and the same groups'
32 inputs (four 16-byte loads), so a k step is loads, bit operations and FMAs in registers, and the
rows' sums cross threads once, after the last step.

Arithmetic: fp16 pairs, so that a weight costs about 3.5 instructions, not the 5 to 6 of float32
products: the arithmetic, not the loads, is what bounds such a tile (docs/measurements/mxfp4/f16x2
times the tile with and without it). A word's 8 codes become 4 int32 registers of two fp16 lanes
each, ``e2m1 * 2^-14`` (:func:`coldset.kernels.triton_mxfp4._e2m1_pair`'s bit operations, exact for
the subnormal codes too), multiplied with the inputs by ``fma.rn.f16x2``.
The inputs come as :func:`input_pairs` writes them, once a call: each scale group of 32 times the
power of two ``2^(141 - e)`` that puts its largest magnitude in [2^14, 2^15) (``e``: that magnitude's
float32 exponent field, at least 14), in fp16 (exact for a bf16 input down to 2^-28 of its group's
largest), paired in the words' order. A product of an e2m1 code and such an input is exact in fp16;
a word's 4 pair products are summed in its two fp16 lanes (the only roundings outside float32: 3
a lane, about 2^-11 of the lane's sum each), the lanes and the group's 4 words then added in
float32, times ``2^(e - 127)`` and the scale's ``2^(s - 127)``, and across groups. Other sums than the
Triton path's (a config's bits depend on the path, never on the placement: the row map only moves
the base pointers).

Triton's interpreter runs no Gluon: on CPU tensors a ``w8a16`` 4 config is refused by name (``w8a16``
2 is the same GEMV in Triton); :func:`input_pairs`' launch is Triton and runs there. The tile's
shape comes from the config: ``block_k`` / 32 groups a step, spread over ``min(groups, 32)`` lanes
(``SG`` groups a lane above 32), the remaining lanes and the warps over the ``block_n`` rows (``R``
rows a thread); :func:`layout_fits` says which configs lay out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from coldset.kernels.triton_moe import (_activation, _block_ids, _expert_base, _expert_bias, gdc_launch_dependents,
                                       gdc_wait)


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


#: Scale groups a program of :func:`_pairs_kernel` converts.
PAIRS_GROUPS = 32


@triton.jit(do_not_specialize=["stride_a"])
def _pairs_kernel(a_ptr, p_ptr, e_ptr, stride_a, K: tl.constexpr, BG: tl.constexpr, USE_GDC: tl.constexpr):
    """Row ``program_id(0)`` of bf16 ``a`` ``[R, K]``, groups ``program_id(1) * BG`` on, as the tile
    reads its inputs (module doc): ``p [R, K / 2]`` int32 fp16 pairs (group g's words ``16 g + 4 n + w``:
    inputs ``32 g + 8 w + n`` in the low lane, ``+ 4`` in the high one) and ``e [R, K / 32]`` int32."""
    if USE_GDC:
        gdc_launch_dependents()
        gdc_wait()  # a programmatic dependent launch: ``a`` is complete after this
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BG + tl.arange(0, BG)
    ok = g < K // 32
    x = tl.load(a_ptr + row * stride_a + g[:, None] * 32 + tl.arange(0, 32)[None, :], mask=ok[:, None],
                other=0.0).to(tl.float32)
    e = tl.maximum(tl.max((x.to(tl.int32, bitcast=True) >> 23) & 0xFF, axis=1), 14)
    h = (x * ((268 - e) << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16)
    h = h.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    h = tl.reshape(tl.permute(tl.reshape(h, [BG, 4, 2, 4]), [0, 3, 1, 2]), [BG, 16, 2])  # [g, n, w, lane]
    lo, hi = tl.split(h)
    tl.store(p_ptr + row * (K // 2) + g[:, None] * 16 + tl.arange(0, 16)[None, :], lo | (hi << 16),
             mask=ok[:, None])
    tl.store(e_ptr + row * (K // 32) + g, e, mask=ok)


def input_pairs(a: torch.Tensor, pdl: bool, dependent: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows ``a [R, K]`` (K a multiple of 32) as the GEMV tile reads its inputs: ``(pairs
    [R, K / 2], exponents [R, K / 32])``, int32 (:func:`_pairs_kernel`). One launch: with ``pdl`` it
    lets the next launch start early; ``dependent`` makes it a programmatic dependent launch itself
    (it waits for the launch before it to complete before reading ``a``)."""
    rows, k = a.shape
    if k % 32 or a.stride(1) != 1 or a.dtype != torch.bfloat16:
        raise ValueError(f"input_pairs: bf16 rows [R, K] with K a multiple of 32 and unit stride along K expected, "
                         f"got {a.dtype} {tuple(a.shape)} strides {a.stride()}")
    pairs = torch.empty((rows, k // 2), dtype=torch.int32, device=a.device)
    exps = torch.empty((rows, k // 32), dtype=torch.int32, device=a.device)
    if rows:
        _pairs_kernel[(rows, triton.cdiv(k // 32, PAIRS_GROUPS))](a, pairs, exps, a.stride(0), K=k, BG=PAIRS_GROUPS,
                                                                 USE_GDC=pdl, num_warps=4, launch_pdl=dependent)
    return pairs, exps


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
def _input_pairs(p_row, e_row, step, ok, K: gl.constexpr, G: gl.constexpr, L3: gl.constexpr):
    """Step ``step``'s inputs of one row of :func:`input_pairs`' output (``p_row``: its f16 pairs,
    ``e_row``: its groups' exponents; zeros where ``ok`` is false or past K): the 4 tensors ``x_n
    [1, G, 4]`` (word w's codes n and n + 4: inputs ``32 g + 8 w + n`` and ``+ 4``) in the words'
    layout, one 16-byte load a group each, and ``[1, G]`` float32 ``2^(e - 127)``."""
    LX: gl.constexpr = gl.SliceLayout(0, L3)
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    g = gl.arange(0, G, layout=gl.SliceLayout(1, LX))
    offs = (step * G + g[:, None]) * 16 + gl.arange(0, 4, layout=gl.SliceLayout(0, LX))[None, :]
    m = ((g < K // 32 - step * G) & ok)[:, None]
    x0 = gl.load(p_row + offs, mask=m, other=0)
    x1 = gl.load(p_row + offs + 4, mask=m, other=0)
    x2 = gl.load(p_row + offs + 8, mask=m, other=0)
    x3 = gl.load(p_row + offs + 12, mask=m, other=0)
    ge = gl.arange(0, G, layout=gl.SliceLayout(0, L2))
    e = gl.load(e_row + step * G + ge, mask=(ge < K // 32 - step * G) & ok, other=127)
    return x0[None], x1[None], x2[None], x3[None], (e << 23).to(gl.float32, bitcast=True)[None, :]


@gluon.jit
def _hfma2(a, b, c):
    """``a * b + c`` on int32 registers each holding two fp16 lanes, rounded once a lane."""
    return gl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _pair(q, EEM_SHIFT: gl.constexpr, SIGN_SHIFT: gl.constexpr):
    """Nibbles n and n + 4 of each word as the two fp16 lanes ``e2m1 * 2^-14`` of an int32
    (:func:`coldset.kernels.triton_mxfp4._e2m1_pair`'s bit operations)."""
    if EEM_SHIFT >= 0:
        e = q << EEM_SHIFT
    else:
        e = q >> (-EEM_SHIFT)
    if SIGN_SHIFT > 0:
        sgn = q << SIGN_SHIFT
    else:
        sgn = q
    return (e & 0x0E000E00) | (sgn & -2147450880)  # -2147450880: the int32 0x80008000


@gluon.jit
def _step(acc, q, sc, x0, x1, x2, x3, fx):
    """``acc [BN, G] += (sum of each group's 32 products) * 2^(s - 127) * 2^(e - 127)``: a word's 4
    pairs of products summed in its two fp16 lanes, the lanes and the group's 4 words added in
    float32, times the two powers of two (the inputs' ``2^(141 - e)`` and the codes' ``2^-14``
    cancel)."""
    h = _hfma2(_pair(q, 9, 12), x0, gl.zeros_like(q))
    h = _hfma2(_pair(q, 5, 8), x1, h)
    h = _hfma2(_pair(q, 1, 4), x2, h)
    h = _hfma2(_pair(q, -3, 0), x3, h)
    lanes = (h.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
             + (h >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32))
    words = gl.sum(lanes, axis=2)  # a thread's own 4 words: no shuffle
    s = sc.to(gl.int32)
    fs = gl.where(s == 0, 0x00400000, s << 23).to(gl.float32, bitcast=True)
    return gl.fma(words * fx, fs, acc)


@gluon.jit
def _rows_times(p0, e0, ok0, p1, e1, ok1, w_ptrs, s_ptrs, n_ok, K: gl.constexpr, BM: gl.constexpr,
                BN: gl.constexpr, G: gl.constexpr, NS: gl.constexpr, L3: gl.constexpr):
    """fp32 ``[BN]`` products of the input rows ``p0`` / ``e0`` (and ``p1`` / ``e1`` with ``BM`` 2;
    :func:`input_pairs`' layout) with the weight rows ``w_ptrs`` / ``s_ptrs`` point at. ``NS`` 2
    loads each step's codes one step ahead, into registers; 1 at the step."""
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    acc0 = gl.zeros([BN, G], gl.float32, L2)
    acc1 = gl.zeros([BN, G], gl.float32, L2)
    steps: gl.constexpr = (K // 32 + G - 1) // G
    if NS == 2:
        q, sc = _load_codes(w_ptrs, s_ptrs, 0, n_ok, K, G, L3)
    for i in range(steps):
        if NS == 2:
            qn, scn = _load_codes(w_ptrs, s_ptrs, i + 1, n_ok, K, G, L3)  # past the last step: all masked
        else:
            q, sc = _load_codes(w_ptrs, s_ptrs, i, n_ok, K, G, L3)
        x0, x1, x2, x3, fx = _input_pairs(p0, e0, i, ok0, K, G, L3)
        acc0 = _step(acc0, q, sc, x0, x1, x2, x3, fx)
        if BM == 2:
            x0, x1, x2, x3, fx = _input_pairs(p1, e1, i, ok1, K, G, L3)
            acc1 = _step(acc1, q, sc, x0, x1, x2, x3, fx)
        if NS == 2:
            q, sc = qn, scn
    return gl.sum(acc0, axis=1), gl.sum(acc1, axis=1)


@gluon.jit
def _gate_up(r, BN: gl.constexpr, LO: gl.constexpr):
    """The gate and up sums ``[BN]`` (layout ``LO``) of a w13 tile's row sums ``[2 BN]`` (gate and up
    rows interleaved: :func:`_w13_gemv_kernel`)."""
    g, u = gl.split(gl.reshape(r, [BN, 2]))
    return gl.convert_layout(g, LO), gl.convert_layout(u, LO)


@gluon.jit(do_not_specialize=["num_pairs", "layer", "NB"])  # one compile for every layer and batch
def _w13_gemv_kernel(
    xp_ptr, xe_ptr, ids_ptr, sorted_pairs_ptr, expert_off_ptr, row_map_ptr, w_hot_ptr, w_cold_ptr, s_hot_ptr,
    s_cold_ptr, b13_ptr, act_ptr, num_pairs, layer, NB,
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
        gdc_launch_dependents()  # the intermediate's pairs launch may start now (it waits for this one)
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
    bg = _expert_bias(b13_ptr, layer, expert, offs_n, n_ok, 2 * I, E, HAS_BIAS)
    bu = _expert_bias(b13_ptr, layer, expert, I + offs_n, n_ok, 2 * I, E, HAS_BIAS)
    if USE_GDC:  # launched early: the lookups above read what the call's launches do not write
        gdc_wait()
    c = c_begin
    while c < c_end:  # chunks of this expert's pairs (a while loop: dynamic bound)
        p0, ok0 = _chunk_pair(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, c, cnt, NP, MODE, W)
        p1, ok1 = _chunk_pair(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, c + BM - 1, cnt, NP, MODE, W)
        t0 = (p0 // TOPK).to(gl.int64)
        t1 = (p1 // TOPK).to(gl.int64)
        r0, r1 = _rows_times(xp_ptr + t0 * (H // 2), xe_ptr + t0 * (H // 32), ok0, xp_ptr + t1 * (H // 2),
                             xe_ptr + t1 * (H // 32), ok1, w_ptrs, s_ptrs, t_ok, H, BM, 2 * BN, G, NS, L3)
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
    ap_ptr, ae_ptr, ids_ptr, sorted_pairs_ptr, expert_off_ptr, row_map_ptr, w_hot_ptr, w_cold_ptr, s_hot_ptr,
    s_cold_ptr, b2_ptr, topk_w_ptr, buf_ptr, num_pairs, layer, NB,
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
    b2 = _expert_bias(b2_ptr, layer, expert, offs_n, n_ok, H, E, HAS_BIAS)
    if USE_GDC:  # launched early: only the launch and the lookups above overlap the w13 launch
        gdc_launch_dependents()
        gdc_wait()
    c = c_begin
    while c < c_end:
        p0, ok0 = _chunk_pair(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, c, cnt, NP, MODE, W)
        p1, ok1 = _chunk_pair(ids_ptr, sorted_pairs_ptr, num_pairs, expert, start, c + BM - 1, cnt, NP, MODE, W)
        q0 = p0.to(gl.int64)
        q1 = p1.to(gl.int64)
        r0, r1 = _rows_times(ap_ptr + q0 * (I // 2), ae_ptr + q0 * (I // 32), ok0, ap_ptr + q1 * (I // 2),
                             ae_ptr + q1 * (I // 32), ok1, w_ptrs, s_ptrs, n_ok, I, BM, BN, G, NS, L3)
        wt0 = gl.load(topk_w_ptr + p0, mask=ok0, other=0.0).to(gl.float32)
        gl.store(buf_ptr + p0.to(gl.int64) * H + offs_n, ((r0 + b2) * wt0).to(buf_ptr.dtype.element_ty),
                 mask=n_ok & ok0)
        if BM == 2:
            wt1 = gl.load(topk_w_ptr + p1, mask=ok1, other=0.0).to(gl.float32)
            gl.store(buf_ptr + p1.to(gl.int64) * H + offs_n, ((r1 + b2) * wt1).to(buf_ptr.dtype.element_ty),
                     mask=n_ok & ok1)
        c += BM
