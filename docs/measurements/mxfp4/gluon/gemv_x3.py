"""Probe: an MXFP4 GEMV (one token) in Gluon with an explicit register layout: each thread holds R rows x one
scale group (4 int32 words = 16 bytes, one vector load) per k step; the group's 32 inputs loaded straight into
the slice of that layout; no layout conversion, barrier or shuffle in the k loop."""
import torch, triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _pair(q, EEM: gl.constexpr, SGN: gl.constexpr):
    if EEM >= 0:
        e = q << EEM
    else:
        e = q >> (-EEM)
    p = (e & 0x0E000E00) | ((q << SGN) & -2147450880)
    lo = p.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    hi = (p >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    return lo, hi


@gluon.jit
def _xload(x_ptr, offs, ok, j: gl.constexpr):
    return gl.load(x_ptr + offs + j, mask=ok, other=0.0).to(gl.float32)[None, :, :]


@gluon.jit
def _xsplit(x_ptr, xoffs, xok, LXS: gl.constexpr):
    xv = gl.load(x_ptr + xoffs, mask=xok, other=0.0).to(gl.float32)  # [G, 32]
    xv = gl.reshape(xv, [xv.shape[0], 4, 2, 2, 2])  # input 8w + 4a + 2b + c
    xa, xb = gl.split(xv)
    x00, x01 = gl.split(xa)
    x10, x11 = gl.split(xb)
    x0, x4 = gl.split(x00)
    x2, x6 = gl.split(x01)
    x1, x5 = gl.split(x10)
    x3, x7 = gl.split(x11)
    return (gl.convert_layout(x0, LXS)[None], gl.convert_layout(x1, LXS)[None], gl.convert_layout(x2, LXS)[None],
            gl.convert_layout(x3, LXS)[None], gl.convert_layout(x4, LXS)[None], gl.convert_layout(x5, LXS)[None],
            gl.convert_layout(x6, LXS)[None], gl.convert_layout(x7, LXS)[None])


@gluon.jit
def _step(acc, q, sc, x_ptr, xoffs, xok, LXS: gl.constexpr):
    v0, v4 = _pair(q, 9, 12)
    v1, v5 = _pair(q, 5, 8)
    v2, v6 = _pair(q, 1, 4)
    v3, v7 = _pair(q, -3, 0)
    x0, x1, x2, x3, x4, x5, x6, x7 = _xsplit(x_ptr, xoffs, xok, LXS)
    part = v0 * x0
    part = gl.fma(v4, x4, part)
    part = gl.fma(v1, x1, part)
    part = gl.fma(v5, x5, part)
    part = gl.fma(v2, x2, part)
    part = gl.fma(v6, x6, part)
    part = gl.fma(v3, x3, part)
    part = gl.fma(v7, x7, part)
    f = (sc.to(gl.int32) << 23).to(gl.float32, bitcast=True)
    return gl.fma(part, f[:, :, None], acc)


@gluon.jit
def mx_gemv_kernel(w_ptr, s_ptr, x_ptr, out_ptr, N, K: gl.constexpr, R: gl.constexpr, W: gl.constexpr,
                   G: gl.constexpr, PREFETCH: gl.constexpr):
    L3: gl.constexpr = gl.BlockedLayout([R, 1, 4], [1, 32, 1], [W, 1, 1], [2, 1, 0])
    L2: gl.constexpr = gl.SliceLayout(2, L3)   # [BN, G]
    LX: gl.constexpr = gl.SliceLayout(0, L3)   # [G, 4]
    BN: gl.constexpr = R * W
    KG: gl.constexpr = K // 32
    pid = gl.program_id(0)
    rows = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, L2))
    g2 = gl.arange(0, G, layout=gl.SliceLayout(0, L2))
    w3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    L5: gl.constexpr = gl.BlockedLayout([1, 4, 2, 2, 2], [32, 1, 1, 1, 1], [W, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    gx = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, L5)))))
    wx = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, L5)))))
    ax = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, L5)))))
    bx = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, L5)))))
    cx = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L5)))))
    r_ok = rows < N
    rows64 = rows.to(gl.int64)
    wp = w_ptr + rows64[:, None, None] * (K // 8) + (g2[None, :, None] * 4 + w3[None, None, :])
    sp = s_ptr + rows64[:, None] * KG + g2[None, :]
    LX2: gl.constexpr = gl.BlockedLayout([1, 32], [32, 1], [W, 1], [1, 0])
    gx2 = gl.arange(0, G, layout=gl.SliceLayout(1, LX2))
    xoffs = gx2[:, None] * 32 + gl.arange(0, 32, layout=gl.SliceLayout(0, LX2))[None, :]
    g5 = gx2[:, None]
    acc = gl.zeros([BN, G, 4], gl.float32, L3)
    steps: gl.constexpr = (KG + G - 1) // G
    if PREFETCH:
        ok2 = r_ok[:, None] & (g2 < KG)[None, :]
        q = gl.load(wp, mask=ok2[:, :, None], other=0)
        sc = gl.load(sp, mask=ok2, other=0)
        for i in range(1, steps):
            ok2n = r_ok[:, None] & ((i * G + g2) < KG)[None, :]
            qn = gl.load(wp + i * G * 4, mask=ok2n[:, :, None], other=0)
            scn = gl.load(sp + i * G, mask=ok2n, other=0)
            acc = _step(acc, q, sc, x_ptr + (i - 1) * G * 32, xoffs, ((i - 1) * G + g5) < KG, LX)
            q = qn
            sc = scn
        acc = _step(acc, q, sc, x_ptr + (steps - 1) * G * 32, xoffs, ((steps - 1) * G + g5) < KG, LX)
    else:
        for i in range(0, steps):
            ok2 = r_ok[:, None] & ((i * G + g2) < KG)[None, :]
            q = gl.load(wp + i * G * 4, mask=ok2[:, :, None], other=0)
            sc = gl.load(sp + i * G, mask=ok2, other=0)
            acc = _step(acc, q, sc, x_ptr + i * G * 32, xoffs, (i * G + g5) < KG, LX)
    out = gl.sum(gl.sum(acc, axis=2), axis=1) * 16384.0
    gl.store(out_ptr + rows, out, mask=r_ok)


def mx_gemv(w_words, scales, x, R=4, W=4, G=32, prefetch=False):
    N, K8 = w_words.shape
    K = K8 * 8
    out = torch.empty(N, dtype=torch.float32, device=x.device)
    BN = R * W
    mx_gemv_kernel[(triton.cdiv(N, BN),)](w_words, scales, x, out, N, K, R, W, G, prefetch, num_warps=W)
    return out
