"""An MXFP4 GEMV tile (one token) whose products are fp16 pairs: each int32 word's 8 codes become 4 f16x2
registers by shifts and masks (the e2m1 bits placed in fp16's exponent and mantissa, the value times 2^-14,
subnormal codes included), multiplied with the token's inputs prepared once per call as f16x2 pairs scaled
per scale group by a power of two; 4 products a word summed in fp16 (fma.rn.f16x2), a group's 32 in fp16,
then float32 across groups. Standalone probe: one matrix, one token."""
import torch, triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _hfma2(a, b, c):
    return gl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _hmul2(a, b):
    return gl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _hadd2(a, b):
    return gl.inline_asm_elementwise("add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _pair16(q, EEM: gl.constexpr, SGN: gl.constexpr):
    """Codes n and n + 4 of each word (n = (9 - EEM) / 4) as an fp16 pair times 2^-14."""
    if EEM >= 0:
        e = q << EEM
    else:
        e = q >> (-EEM)
    if SGN > 0:
        s = q << SGN
    else:
        s = q
    return (e & 0x0E000E00) | (s & -2147450880)


@gluon.jit
def _h2f(h):
    lo = h.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    hi = (h >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    return lo + hi


@gluon.jit
def _step(acc, q, sc, xb, xok, xe, MODE: gl.constexpr, BN: gl.constexpr, G: gl.constexpr):
    x0 = gl.load(xb, mask=xok, other=0)
    x1 = gl.load(xb + 4, mask=xok, other=0)
    x2 = gl.load(xb + 8, mask=xok, other=0)
    x3 = gl.load(xb + 12, mask=xok, other=0)
    if MODE == 0:
        h = _hmul2(_pair16(q, 9, 12), x0[None])
        h = _hfma2(_pair16(q, 5, 8), x1[None], h)
        h = _hfma2(_pair16(q, 1, 4), x2[None], h)
        h = _hfma2(_pair16(q, -3, 0), x3[None], h)
        h4 = gl.reshape(h, [BN, G, 2, 2])
        ha, hb = gl.split(h4)
        hs = _hadd2(ha, hb)
        h0, h1 = gl.split(hs)
        hs = gl.convert_layout(_hadd2(h0, h1), sc.type.layout)
        f = ((sc.to(gl.int32) + xe[None, :]) << 23).to(gl.float32, bitcast=True)
        return gl.fma(_h2f(hs), f, acc)
    else:  # loads only: the same loads, an xor a word
        t = q ^ x0[None] ^ x1[None] ^ x2[None] ^ x3[None]
        t4 = gl.reshape(t, [BN, G, 2, 2])
        ta, tb = gl.split(t4)
        t2 = ta ^ tb
        t0, t1 = gl.split(t2)
        t0 = gl.convert_layout(t0 ^ t1, sc.type.layout)
        return acc + ((t0 ^ sc.to(gl.int32) ^ xe[None, :]) & 1).to(gl.float32)


@gluon.jit
def f16_gemv_kernel(w_ptr, s_ptr, xp_ptr, xe_ptr, out_ptr, N, K: gl.constexpr, R: gl.constexpr, W: gl.constexpr,
                    G: gl.constexpr, PREFETCH: gl.constexpr, MODE: gl.constexpr):
    L3: gl.constexpr = gl.BlockedLayout([R, 1, 4], [1, 32, 1], [W, 1, 1], [2, 1, 0])
    L2: gl.constexpr = gl.SliceLayout(2, L3)   # [BN, G]
    LX: gl.constexpr = gl.SliceLayout(0, L3)   # [G, 4]
    BN: gl.constexpr = R * W
    KG: gl.constexpr = K // 32
    pid = gl.program_id(0)
    rows = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, L2))
    g2 = gl.arange(0, G, layout=gl.SliceLayout(0, L2))
    w3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    gx = gl.arange(0, G, layout=gl.SliceLayout(1, LX))
    wx = gl.arange(0, 4, layout=gl.SliceLayout(0, LX))
    r_ok = rows < N
    rows64 = rows.to(gl.int64)
    wp = w_ptr + rows64[:, None, None] * (K // 8) + (g2[None, :, None] * 4 + w3[None, None, :])
    sp = s_ptr + rows64[:, None] * KG + g2[None, :]
    xoff = gx[:, None] * 16 + wx[None, :]
    acc = gl.zeros([BN, G], gl.float32, L2)
    steps: gl.constexpr = (KG + G - 1) // G
    if PREFETCH:
        ok2 = r_ok[:, None] & (g2 < KG)[None, :]
        q = gl.load(wp, mask=ok2[:, :, None], other=0)
        sc = gl.load(sp, mask=ok2, other=0)
        for i in range(1, steps):
            ok2n = r_ok[:, None] & ((i * G + g2) < KG)[None, :]
            qn = gl.load(wp + i * G * 4, mask=ok2n[:, :, None], other=0)
            scn = gl.load(sp + i * G, mask=ok2n, other=0)
            j = i - 1
            xe = gl.load(xe_ptr + j * G + g2, mask=(j * G + g2) < KG, other=0)
            acc = _step(acc, q, sc, xp_ptr + j * G * 16 + xoff, ((j * G + gx) < KG)[:, None], xe, MODE, BN, G)
            q = qn
            sc = scn
        j = steps - 1
        xe = gl.load(xe_ptr + j * G + g2, mask=(j * G + g2) < KG, other=0)
        acc = _step(acc, q, sc, xp_ptr + j * G * 16 + xoff, ((j * G + gx) < KG)[:, None], xe, MODE, BN, G)
    else:
        for j in range(0, steps):
            ok2 = r_ok[:, None] & ((j * G + g2) < KG)[None, :]
            q = gl.load(wp + j * G * 4, mask=ok2[:, :, None], other=0)
            sc = gl.load(sp + j * G, mask=ok2, other=0)
            xe = gl.load(xe_ptr + j * G + g2, mask=(j * G + g2) < KG, other=0)
            acc = _step(acc, q, sc, xp_ptr + j * G * 16 + xoff, ((j * G + gx) < KG)[:, None], xe, MODE, BN, G)
    out = gl.sum(acc, axis=1)
    gl.store(out_ptr + rows, out, mask=r_ok)


@triton.jit
def xprep_kernel(x_ptr, xp_ptr, xe_ptr, KG, BG: tl.constexpr):
    """A token's inputs as f16x2 pairs in the tile's order (group g, pair n, word w: codes 8w + n and
    8w + n + 4), each group scaled by the power of two that puts its largest magnitude in [2^14, 2^15);
    xe: that group's exponent, unbiased (the tile's factor is 2^(scale + xe - 127))."""
    g = tl.program_id(0) * BG + tl.arange(0, BG)
    ok = g < KG
    x = tl.load(x_ptr + g[:, None] * 32 + tl.arange(0, 32)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    ex = tl.max((x.to(tl.int32, bitcast=True) >> 23) & 0xFF, axis=1)
    ex = tl.maximum(ex, 14)
    f = ((268 - ex) << 23).to(tl.float32, bitcast=True)
    xs = (x * f[:, None]).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    xs = tl.reshape(xs, [BG, 4, 2, 4])           # [g, w, half, n]: input 8w + 4 half + n
    xs = tl.permute(xs, [0, 3, 1, 2])            # [g, n, w, half]
    xs = tl.reshape(xs, [BG, 16, 2])
    lo, hi = tl.split(xs)
    tl.store(xp_ptr + g[:, None] * 16 + tl.arange(0, 16)[None, :], lo | (hi << 16), mask=ok[:, None])
    tl.store(xe_ptr + g, ex - 127, mask=ok)


def xprep(x, xp=None, xe=None):
    K = x.numel()
    KG = K // 32
    xp = torch.empty(KG * 16, dtype=torch.int32, device=x.device) if xp is None else xp
    xe = torch.empty(KG, dtype=torch.int32, device=x.device) if xe is None else xe
    xprep_kernel[(triton.cdiv(KG, 32),)](x, xp, xe, KG, 32, num_warps=4)
    return xp, xe


def f16_gemv(w_words, scales, xp, xe, R=4, W=4, G=32, prefetch=True, mode=0, out=None):
    N, K8 = w_words.shape
    K = K8 * 8
    out = torch.empty(N, dtype=torch.float32, device=w_words.device) if out is None else out
    f16_gemv_kernel[(triton.cdiv(N, R * W),)](w_words, scales, xp, xe, out, N, K, R, W, G, prefetch, mode,
                                             num_warps=W)
    return out
