"""The MXFP4 Triton kernel (coldset.kernels.triton_mxfp4) under Triton's interpreter on the CPU and
compiled on CUDA, against the float64 oracle of tests/test_mxfp4_pools.py (same tolerance: each
output within 2^-7 of |oracle| + the oracle's RMS); every placement bitwise the all-hot path."""

from __future__ import annotations

import pytest

from interpreter_helpers import LEAN_INTERPRETER, ROUNDED_CASTS, pdl_no_ops, run_interpreted


# ------------------------------------------- the Triton kernel under Triton's interpreter (CPU) -------

_PRELUDE = ROUNDED_CASTS + LEAN_INTERPRETER + r"""
import triton
import triton.language as tl

# The interpreter keeps bf16 as its raw uint16 bits and its dot multiplies those integers (triton
# 3.8): a dot's bf16 operands go in as float32 (which holds them exactly)
_orig_dot = interpreter.InterpreterBuilder.create_dot

def _bf16_as_f32(h):
    if h.dtype == tl.bfloat16:
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
    if h.dtype == tl.float16:  # numpy's float16 matmul would round its sums to fp16
        return interpreter.TensorHandle(h.data.astype(np.float32), tl.float32)
    return h

def _create_dot(self, a, b, d, *args):
    return _orig_dot(self, _bf16_as_f32(a), _bf16_as_f32(b), d, *args)

interpreter.InterpreterBuilder.create_dot = _create_dot
"""

# pdl 2 runs its launches one after the other with the grid-dependency instructions as no-ops
_INTERPRETED = _PRELUDE + pdl_no_ops("triton_mxfp4", "triton_moe") + r"""
from coldset.core import mxfp4
from coldset.kernels import triton_moe, triton_mxfp4, torch_experts
from coldset.kernels.activation import SILU, swiglu_clamped
from coldset.kernels.tiers import build_pools
from coldset.kernels.triton_moe import KernelConfig
from coldset.kernels.triton_mxfp4 import triton_mxfp4_experts
from test_mxfp4_pools import (assert_close_to_oracle, float64_oracle, make_mxfp4, pools_of, random_row_map,
                               routing)

# (H, I, tokens, config): in-kernel grouping (6 pairs <= 8 experts) and the sorted grouping; a k step
# past I (96 = 64 + 32: masked groups) and past H; partial column blocks; 32-input k steps; tile order
# 1 with half_buf; 32-row tiles; pdl 2. Then the GEMV path (block_m <= 8): one and two pairs a block,
# both groupings, k steps past H and I (128 > 64, 64 > 96 - 64), partial column blocks; the dot
# path unpacking 32-bit words (w8a16 2), whose outputs must be the value-by-value path's bits; the
# fp16 dots, one per scale group (w8a16 3), one and several groups a k step (k steps past H and I),
# both groupings
CASES = [(64, 96, 2, KernelConfig(16, 32, 64, 32, 64, 4, 2, 32)),
         (64, 96, 5, KernelConfig(16, 64, 64, 64, 64, 4, 2, 32)),
         (96, 64, 7, KernelConfig(16, 32, 64, 64, 32, 4, 2, 1, tile_order=1, half_buf=1)),
         (128, 96, 6, KernelConfig(32, 64, 128, 32, 64, 4, 2, 1, pdl=2)),
         (64, 96, 3, KernelConfig(1, 64, 128, 8, 64, 4, 2, 32, pdl=2, w8a16=2)),
         (96, 64, 7, KernelConfig(2, 16, 64, 64, 32, 4, 2, 1, w8a16=2)),
         (96, 96, 5, KernelConfig(16, 64, 64, 32, 64, 4, 2, 32, w8a16=2)),
         (64, 96, 9, KernelConfig(32, 32, 64, 64, 32, 4, 2, 1, tile_order=1, w8a16=2)),
         (96, 64, 3, KernelConfig(16, 32, 32, 64, 64, 4, 2, 32, w8a16=3)),
         (64, 96, 7, KernelConfig(32, 16, 128, 32, 32, 4, 3, 1, w8a16=3))]
for i, (hidden, inter, tokens, cfg) in enumerate(CASES):
    act = (SILU, swiglu_clamped(limit=1.5))[i % 2]
    q = make_mxfp4(2, 8, hidden, inter, seed=tokens)
    x, ids, w = routing(tokens, 8, 3, hidden, seed=tokens)
    all_hot = pools_of(q, act)
    base = triton_mxfp4_experts(all_hot, 1, x, ids, w, cfg, use_row_map=False)
    assert base.dtype == torch.bfloat16 and base.shape == x.shape
    oracle = float64_oracle(q, 1, x, ids, w, act)
    assert_close_to_oracle(base, oracle, (cfg, act))
    if i == 0:
        assert_close_to_oracle(torch_experts(all_hot, 1, x, ids, w), oracle, "torch")
    if cfg.block_m <= 2:  # the GEMV path's loads one step ahead (num_stages 2) or not: the same sums, the same bits
        assert cfg.num_stages == triton_mxfp4.GEMV_PREFETCH, cfg
        plain = triton_mxfp4_experts(all_hot, 1, x, ids, w, {**cfg.to_dict(), "num_stages": 1}, use_row_map=False)
        assert torch.equal(plain, base), cfg
    if cfg.w8a16 == 2 and cfg.block_m >= 16:  # words or values: the same weights, the same bits
        values = triton_mxfp4_experts(all_hot, 1, x, ids, w, {**cfg.to_dict(), "w8a16": 0}, use_row_map=False)
        assert torch.equal(values, base), cfg
    placed = build_pools(*q[:2], random_row_map(2, 8, 0.5, i), "cpu", w13_scale=q[2], w2_scale=q[3],
                         w13_bias=q[4], w2_bias=q[5], activation=act)
    assert placed.num_cold and placed.num_hot
    assert torch.equal(triton_mxfp4_experts(placed, 1, x, ids, w, cfg), base), cfg
# no biases, dot and GEMV paths
q = make_mxfp4(1, 8, 64, 64, seed=9, bias=False)
x, ids, w = routing(3, 8, 2, 64, seed=9)
for cfg in (KernelConfig(16, 32, 64, 32, 64, 4, 2, 32), KernelConfig(1, 32, 64, 32, 64, 4, 2, 32, w8a16=2)):
    out = triton_mxfp4_experts(pools_of(q, SILU), 0, x, ids, w, cfg)
    assert_close_to_oracle(out, float64_oracle(q, 0, x, ids, w, SILU), ("no bias", cfg))


# the word unpack alone: every code in every nibble of a word, against coldset.core.mxfp4.dequantize
@triton.jit
def _words_probe(w_ptr, out_ptr, N: tl.constexpr):
    q = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + tl.arange(0, N))
    v = tl.reshape(triton_mxfp4._e2m1_words(q, True), (N * 8,)) * 16384.0
    h = tl.reshape(triton_mxfp4._e2m1_words(q, False), (N * 8,)).to(tl.float32) * 16384.0  # the fp16 lanes
    tl.store(out_ptr + tl.arange(0, N * 8), v)
    tl.store(out_ptr + N * 8 + tl.arange(0, N * 8), h)

codes = torch.arange(256, dtype=torch.uint8)
blocks = torch.cat([codes, codes.roll(1), codes.roll(2), codes.roll(3)])  # each byte at each of a word's 4 places
got = torch.empty(blocks.numel() * 4, dtype=torch.float32)
_words_probe[(1,)](blocks, got, N=blocks.numel() // 4)
want = mxfp4.dequantize(blocks.view(1, -1, 16), torch.full((1, blocks.numel() // 16), 127, dtype=torch.uint8),
                        torch.float32).flatten()
assert torch.equal(got, torch.cat([want, want])), (got - torch.cat([want, want])).abs().max()
# refused by name
pools = pools_of(q, SILU)
for bad, msg in [(dict(block_k1=48), "block_k1 must be a power of two"), (dict(split_k1=2), "split-K"),
                 (dict(pdl=1), "pdl must be 0 or 2"), (dict(w8a16=1), "w8a16=1 is not implemented"),
                 (dict(half_tail=1), "half_tail=1"), (dict(block_m=4), "block_m must be 1 or 2"),
                 (dict(block_m=2), "w8a16 must be 2"), (dict(swap_ab=1), "swap_ab=1"),
                 (dict(w8a16=3, block_m=2), "w8a16=3 (fp16 dots, one per scale group) needs block_m >= 16"),
                 (dict(block_m=1, w8a16=2, num_stages=3), "takes num_stages 1 (loads at each k step) or 2"),
                 (dict(block_m=16, w8a16=4), "w8a16=4 (the GEMV tile in Gluon) needs block_m <= 2"),
                 (dict(block_m=1, block_n1=2, block_k1=1024, num_warps=8, w8a16=4, num_stages=1), "do not lay out"),
                 (dict(block_m=1, block_n1=8, block_k1=1024, block_n2=16, block_k2=1024, w8a16=4, num_stages=1),
                  "runs on CUDA only"),
                 (dict(block_m=8, block_n1=16, block_k1=256, block_n2=32, block_k2=128, num_warps=2, w8a16=5,
                       num_stages=1, slot_max_pairs=1), "block_k1 and block_k2 must be 128"),
                 (dict(block_m=4, block_n1=16, block_k1=128, block_n2=32, block_k2=128, num_warps=2, w8a16=5,
                       num_stages=1, slot_max_pairs=1), "takes block_m 8 or 16"),
                 (dict(block_m=8, block_n1=16, block_k1=128, block_n2=48, block_k2=128, num_warps=1, w8a16=5,
                       num_stages=1, slot_max_pairs=1), "takes block_m 8 or 16"),
                 (dict(block_m=8, block_n1=16, block_k1=128, block_n2=32, block_k2=128, num_warps=2, w8a16=5,
                       num_stages=7, slot_max_pairs=1), "takes num_stages 1 to 6"),
                 (dict(block_m=8, block_n1=16, block_k1=128, block_n2=32, block_k2=128, num_warps=2, w8a16=5,
                       num_stages=5, slot_max_pairs=32), "takes slot_max_pairs 1"),
                 (dict(block_m=8, block_n1=16, block_k1=128, block_n2=32, block_k2=128, num_warps=2, w8a16=5,
                       num_stages=1, slot_max_pairs=1), "w8a16=5 (a tile in Gluon) runs on CUDA only")]:
    try:
        triton_mxfp4_experts(pools, 0, x, ids, w, {**KernelConfig().to_dict(), **bad})
    except ValueError as e:
        assert msg in str(e), (bad, str(e))
    else:
        raise AssertionError(f"{bad} accepted")
try:
    triton_mxfp4_experts(pools, 0, x.half(), ids, w)
except ValueError as e:
    assert "must be bfloat16" in str(e)
else:
    raise AssertionError("fp16 accepted")
print("INTERPRETED OK")
"""


def test_triton_mxfp4_kernel_under_the_interpreter():
    """The MXFP4 kernel's launches on the CPU through Triton's interpreter, its four paths (bf16 dots
    on tiles unpacked value by value or by 32-bit words, fp16 dots one per scale group, the GEMV
    path): against the float64 oracle (SiLU and the clamped SwiGLU, with and without biases, both
    groupings, masked k steps and column blocks, tile orders, half_buf, pdl 2 with the
    grid-dependency instructions stubbed out), every placement bitwise the all-hot path, the two
    bf16 unpackings bitwise equal, the word unpack of every code in every nibble; refusals by field."""
    run_interpreted(_INTERPRETED, timeout=900)


_MEASURE_TINY = _PRELUDE + r"""
import json, runpy, tempfile
from coldset.kernels import configs as kernel_configs
from coldset.kernels.triton_moe import KernelConfig
from coldset.measure import kernel_mxfp4
first = {}
for c in kernel_configs.load("triton_mxfp4")["search_space"]["decode"]:
    first.setdefault(kernel_mxfp4.variant_of(KernelConfig.from_dict(c)), c)
paths = sorted(set(first) - set(kernel_mxfp4.CUDA_ONLY_VARIANTS))
assert paths == ["dot-f16", "dot-values", "dot-words", "gemv"], paths
configs = tempfile.mktemp(suffix=".json")
json.dump({"decode": [first[p] for p in paths]}, open(configs, "w"))
out = tempfile.mktemp(suffix=".json")
sys.argv = ["kernel_mxfp4", "--tiny", "--batches", "1,3", "--layers", "1", "--configs", configs, "--out", out]
try:
    runpy.run_module("coldset.measure.kernel_mxfp4", run_name="__main__")
except SystemExit as done:  # the command's exit status: 0 when every config was right
    assert done.code == 0, done.code
rows = json.load(open(out))["rows"]
assert [r["tokens"] for r in rows] == [1, 3] and all(r["err_over_tol"] <= 1 for r in rows), rows
assert all(r["failed"] == {} for r in rows), [r["failed"] for r in rows]
assert all(r["configs_checked"] == len(paths) for r in rows), rows
print("INTERPRETED OK")
"""


def test_kernel_mxfp4_measurement_runs_at_tiny_shape_under_the_interpreter():
    """The H200 measurement script (``python -m coldset.measure.kernel_mxfp4``) end to end with
    ``--tiny`` on the CPU, on a configs file of the search space's first decode config of each path
    the CPU runs: its correctness checks against the torch path (no times without CUDA), none
    failed, each row checking one config a path, its table and JSON. (The four paths' kernels are
    checked under the interpreter by :func:`test_triton_mxfp4_kernel_under_the_interpreter`; here,
    the script.)"""
    stdout = run_interpreted(_MEASURE_TINY, timeout=900)
    assert "tokens" in stdout and "err/tol" in stdout


def test_kernel_mxfp4_measurement_takes_a_configs_file_and_refuses_a_bad_one(tmp_path, capsys):
    """``--configs FILE`` runs exactly the file's configs (decode list up to 64 tokens, prefill
    above, none where a list is missing); a file that is not such an object is refused naming it."""
    import json

    from coldset.measure import kernel_mxfp4

    decode = [{"block_m": 1, "block_n1": 8, "block_k1": 256, "block_n2": 8, "block_k2": 256, "w8a16": 2},
              {"block_m": 16, "block_n1": 32, "block_k1": 64, "block_n2": 32, "block_k2": 64}]
    good = tmp_path / "configs.json"
    good.write_text(json.dumps({"decode": decode}))
    args = kernel_mxfp4.parse_args(["--configs", str(good)])
    got = kernel_mxfp4.configs_for(4, None, args.space)
    assert [(c.block_m, c.block_n1, c.block_k1, c.w8a16) for c in got] == [(1, 8, 256, 2), (16, 32, 64, 0)]
    assert [kernel_mxfp4.variant_of(c) for c in kernel_mxfp4.configs_for(4, ("gemv",), args.space)] == ["gemv"]
    assert kernel_mxfp4.configs_for(256, None, args.space) == []
    default = kernel_mxfp4.configs_for(4, None, kernel_mxfp4.parse_args([]).space)
    assert len(default) > 2  # no file: the search space
    for text in ("[1, 2]", '{"decode": {"block_m": 1}}', '{"dekode": []}', "{not json"):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(SystemExit):
            kernel_mxfp4.parse_args(["--configs", str(bad)])
        assert str(bad) in capsys.readouterr().err, text


_PAIRS = r"""
import sys
import numpy as np
import torch
sys.path.insert(0, sys.argv[1])
from coldset.core import mxfp4
from coldset.kernels import gluon_mxfp4

# rows of 96 inputs (3 groups): ordinary values, an all-zero group, outliers 2^20 and 2^-30 apart,
# values past fp16's range (kept by the group's power of two); the second row a whole group of
# bf16 subnormals and one of huge values
g = torch.Generator().manual_seed(3)
a = torch.randn(2, 96, generator=g)
a[0, 32:64] = 0.0
a[0, 64] = 3.0e5
a[0, 65] = 2.0 ** -25
a[1, :32] = torch.randn(32, generator=g) * 1e-39
a[1, 32:64] *= 1e30
a = a.bfloat16()
pairs, exps = gluon_mxfp4.input_pairs(a, pdl=False, dependent=False)
assert pairs.shape == (2, 48) and exps.shape == (2, 3) and pairs.dtype == exps.dtype == torch.int32
for bad in (a[:, :80], a.float(), a.t().contiguous().t()[:, :64]):  # K not a multiple of 32, float32, strided
    try:
        gluon_mxfp4.input_pairs(bad, pdl=False, dependent=False)
    except ValueError as e:
        assert "input_pairs" in str(e), e
    else:
        raise AssertionError(f"input_pairs took {bad.dtype} {tuple(bad.shape)} {bad.stride()}")
p = pairs.numpy().astype(np.uint32)
lanes = [((p >> (16 * h)) & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64) for h in (0, 1)]
x = np.zeros((2, 96))
for grp in range(3):
    for n in range(4):
        for w in range(4):
            for h in (0, 1):  # word w's codes n (low lane) and n + 4 (high lane): inputs 8 w + n (+ 4)
                x[:, 32 * grp + 8 * w + n + 4 * h] = lanes[h][:, 16 * grp + 4 * n + w]
af = a.double().numpy()
field = ((a.float().numpy().view(np.uint32) >> 23) & 0xFF).reshape(2, 3, 32).max(axis=2)
assert (exps.numpy() == np.maximum(field, 14)).all(), (exps, field)
scale = np.repeat(2.0 ** (141.0 - exps.numpy()), 32, axis=1)
want = af * scale
assert np.abs(want).max(axis=1).max() < 2 ** 15
normal = np.abs(af) >= 2.0 ** -126  # bf16 subnormal inputs may be flushed to zero (under 1.2e-38)
big = normal & (np.abs(want) >= 2.0 ** -14)  # fp16's normal range: exact there
assert np.array_equal(x[big], want[big]), np.abs(x - want)[big].max()
assert np.abs(x - want)[normal].max() <= 2.0 ** -25  # below it, fp16's subnormal spacing
# the tile's identity: codes as fp16 lanes e2m1 * 2^-14, times these inputs, times 2^(e - 127) and the
# scale's 2^(s - 127), is the dequantized matrix times the inputs (float64 sums here)
blocks = torch.randint(0, 256, (5, 48), dtype=torch.uint8, generator=g)
scales = torch.randint(118, 131, (5, 3), dtype=torch.uint8, generator=g)
wd = mxfp4.dequantize(blocks.view(5, 3, 16), scales, torch.float32).double().numpy()
codes = np.stack([(blocks.numpy() >> 4 * h) & 0xF for h in (0, 1)], axis=2).reshape(5, 96)
lut = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]) * 2.0 ** -14
factor = np.repeat(2.0 ** (scales.numpy() - 127.0), 32, axis=1)
for r in range(2):
    got = (lut[codes] * x[r] * factor * np.repeat(2.0 ** (exps.numpy()[r] - 127.0), 32)).sum(axis=1)
    ref = wd @ af[r]
    assert np.allclose(got, ref, rtol=1e-12, atol=1e-300 + 1e-12 * np.abs(wd) @ np.abs(af[r])), (got, ref)
print("INTERPRETED OK")
"""


def test_gemv_gluon_input_pairs_under_the_interpreter():
    """The Gluon GEMV tile's inputs (w8a16 4; the tile itself runs on CUDA only, in the GPU tests):
    each scale group's bf16 inputs times the power of two that puts its largest in [2^14, 2^15), as
    fp16 pairs in the words' order, exact in fp16's normal range; its exponent field; and the tile's
    arithmetic identity (codes as ``e2m1 * 2^-14`` times these pairs times ``2^(e - 127)`` and the
    scale's power of two) equal to the dequantized matrix times the inputs, zero and outlier groups
    and bf16 subnormals included."""
    run_interpreted(_PAIRS)


def test_default_config_takes_the_prefetching_pdl_gemv_tile_up_to_two_tokens():
    """One or two tokens a call: the GEMV tile loading one k step ahead (num_stages 2), its w2 and sum
    launches programmatic dependent launches (pdl 2); up to 64 the same tile without either; above,
    the prefill tiles. Each default passes the kernel's own checks."""
    from coldset.kernels import triton_mxfp4 as mx

    got = {n: mx.default_config(n) for n in (1, 2, 3, 64, 65)}
    assert got[1] == got[2] and (got[1].block_m, got[1].num_stages, got[1].pdl) == (1, mx.GEMV_PREFETCH, 2)
    assert got[3] == got[64] and (got[3].block_m, got[3].num_stages, got[3].pdl) == (1, 1, 0)
    assert got[3].to_dict() == {**got[1].to_dict(), "num_stages": 1, "pdl": 0}  # the same tile otherwise
    assert got[65].block_m >= 16
    for cfg in got.values():
        mx._check_config(cfg)
        assert cfg.w8a16 != 4  # the interpreter runs no Gluon


def test_default_config_on_cuda_takes_the_gluon_tiles_from_three_to_64_tokens():
    """On CUDA, 3 to MMA_FROM tokens: the Gluon GEMV tile (w8a16 4, pdl 2, pairs grouped by expert
    before the launch); above, to 64, the Gluon tensor-core tile (w8a16 5); each one config that
    lays out and is in the search space (the tuner and the GPU tests see it); up to 2 and above 64
    the same tiles as on the CPU. Where this triton lacks Gluon or grid-dependency control, the
    CPU's defaults."""
    from coldset.kernels import triton_moe
    from coldset.kernels import triton_mxfp4 as mx
    from coldset.kernels.configs import load

    on_cuda = {n: mx.default_config(n, cuda=True) for n in (1, 2, 3, 8, mx.MMA_FROM, mx.MMA_FROM + 1, 64, 65, 256)}
    assert mx.FEW_TOKENS == 2
    assert all(on_cuda[n] == mx.default_config(n) for n in (1, 2, 65, 256))
    if mx.gluon_mxfp4 is None or triton_moe.gdc_wait is None:
        assert all(on_cuda[n] == mx.default_config(n) for n in on_cuda)
        return
    tile, mma = on_cuda[3], on_cuda[64]
    assert 8 < mx.MMA_FROM < 64 and on_cuda[8] == on_cuda[mx.MMA_FROM] == tile and on_cuda[mx.MMA_FROM + 1] == mma
    assert (tile.w8a16, tile.block_m, tile.pdl) == (4, 1, 2)
    assert tile.slot_max_pairs == 1  # the sorted grouping from 3 tokens (12 pairs): faster at 4 and 8 tokens
    assert mx.gluon_mxfp4.layout_fits(tile.block_n1, tile.block_k1, tile.block_n2, tile.block_k2, tile.num_warps)
    assert (mma.w8a16, mma.pdl) == (5, 2)
    mx._check_config(mma)
    space = [triton_moe.KernelConfig.from_dict(d) for d in load("triton_mxfp4")["search_space"]["decode"]]
    assert tile in space and mma in space


def test_mma_rings_are_refused_by_name_where_gluon_has_no_cp_async(monkeypatch):
    """A Gluon without ``cp.async`` keeps the tensor-core tile's register paths (``num_stages`` 1 and
    2) and refuses its shared-memory rings (3 to 6) by name, before anything launches; its CUDA
    default is the same tile at ``num_stages`` 2 (the same sums, bitwise: the GPU tests)."""
    from coldset.kernels import triton_mxfp4 as mx
    from coldset.kernels.triton_moe import KernelConfig

    if mx.gluon_mxfp4_mma is None:
        pytest.skip("this triton has no Gluon mma_v2: the tile is refused as a whole")
    tile = dict(block_m=8, block_n1=32, block_k1=128, block_n2=64, block_k2=128, num_warps=4, slot_max_pairs=1,
                w8a16=5)
    for stages in (2, 5):
        mx._check_mma_config(KernelConfig.from_dict({**tile, "num_stages": stages}))
    assert mx.DEFAULT_CUDA_MMA_CONFIG.num_stages == 5
    monkeypatch.setattr(mx.gluon_mxfp4_mma, "async_copy", None)
    mx._check_mma_config(KernelConfig.from_dict({**tile, "num_stages": 2}))
    with pytest.raises(ValueError, match=r"num_stages 5 copies through shared memory .* lacks: num_stages 1 or 2"):
        mx._check_mma_config(KernelConfig.from_dict({**tile, "num_stages": 5}))
    if mx.gluon_mxfp4 is not None and mx.gdc_wait is not None:  # the CUDA default keeps the tile, without its rings
        ring = mx.DEFAULT_CUDA_MMA_CONFIG
        assert mx.default_config(64, cuda=True) == KernelConfig.from_dict({**ring.to_dict(), "num_stages": 2})
        mx._check_mma_config(mx.default_config(64, cuda=True))


# ------------------------------------------- the compiled kernel (CUDA) -------

def _search_space():
    from coldset.kernels.configs import load
    from coldset.kernels.triton_moe import KernelConfig

    configs = load("triton_mxfp4")
    space = configs["search_space"]
    entries = space["decode"] + space["prefill"] + list(configs["defaults"].values()) + _MMA_RINGS
    return list(dict.fromkeys(KernelConfig.from_dict(d) for d in entries))  # a default in the space runs once


# the tensor-core tile through its shared-memory rings (num_stages 3 to 6), not yet in the search space:
# the measured one (docs/measurements/mxfp4/mma_ring), 16-token chunks over 2 warps, and 8 warps over
# 8 tokens (the tokens' copy in 8-byte pieces)
_MMA_RINGS = [dict(block_m=8, block_n1=32, block_k1=128, block_n2=64, block_k2=128, num_warps=4, num_stages=5,
                   slot_max_pairs=1, w8a16=5, pdl=2),
              dict(block_m=16, block_n1=16, block_k1=128, block_n2=32, block_k2=128, num_warps=2, num_stages=3,
                   slot_max_pairs=1, w8a16=5),
              dict(block_m=8, block_n1=64, block_k1=128, block_n2=128, block_k2=128, num_warps=8, num_stages=6,
                   slot_max_pairs=1, w8a16=5, pdl=2)]


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,inter", [(256, 128), (192, 320)])  # 192: partial 128-input k steps
@pytest.mark.parametrize("num_tokens", [1, 33, 300])
def test_triton_mxfp4_on_cuda_matches_float64_and_the_torch_path(hidden, inter, num_tokens):
    """Every config of the search space (and the defaults, and the tensor-core tile's rings) on CUDA
    against the float64 oracle, the torch path on CUDA too; placements with a pinned cold tier
    bitwise the all-hot output; the rings bitwise the tile's register path."""
    import torch

    from coldset.kernels import torch_experts, triton_experts
    from coldset.kernels.activation import swiglu_clamped
    from coldset.kernels.tiers import build_pools, host_tier
    from coldset.kernels.triton_mxfp4 import triton_mxfp4_experts
    from test_mxfp4_pools import (assert_close_to_oracle, float64_oracle, make_mxfp4, pools_of, random_row_map,
                                  routing)

    act = swiglu_clamped(limit=7.0)
    q = make_mxfp4(2, 16, hidden, inter, seed=num_tokens)
    x, ids, w = routing(num_tokens, 16, 4, hidden, seed=num_tokens)
    oracle = float64_oracle(q, 1, x, ids, w, act)
    pools = pools_of(tuple(t.cuda() for t in q), act)
    xc, idc, wc = x.cuda(), ids.cuda(), w.cuda()
    assert_close_to_oracle(torch_experts(pools, 1, xc, idc, wc).cpu(), oracle, "torch path on cuda")
    default = triton_experts(pools, 1, xc, idc, wc)  # the dispatch picks the MXFP4 kernel
    assert_close_to_oracle(default.cpu(), oracle, "default config")
    host = host_tier(pools)
    assert host.pinned
    for cfg in _search_space():
        base = triton_mxfp4_experts(pools, 1, xc, idc, wc, cfg, use_row_map=False)
        assert_close_to_oracle(base.cpu(), oracle, cfg)
        for seed in range(2):
            rm = random_row_map(2, 16, 0.5, seed)
            assert torch.equal(triton_mxfp4_experts(pools.placed(rm, host), 1, xc, idc, wc, cfg), base), cfg
        built = build_pools(*q[:2], random_row_map(2, 16, 0.7, 3), "cuda", w13_scale=q[2], w2_scale=q[3],
                            w13_bias=q[4], w2_bias=q[5], activation=act)
        assert built.w13_cold.is_pinned() and torch.equal(triton_mxfp4_experts(built, 1, xc, idc, wc, cfg), base)
        pdl2 = triton_mxfp4_experts(pools, 1, xc, idc, wc, {**cfg.to_dict(), "pdl": 2}, use_row_map=False)
        assert torch.equal(pdl2, base), cfg
        if cfg.w8a16 == 5 and cfg.num_stages >= 3:  # the rings: the register path's products in its order
            registers = {**cfg.to_dict(), "num_stages": 2}
            assert torch.equal(triton_mxfp4_experts(pools, 1, xc, idc, wc, registers, use_row_map=False), base), cfg


_MMA_TILE = dict(block_m=8, block_n1=16, block_k1=128, block_n2=32, block_k2=128, num_warps=2, num_stages=1,
                 slot_max_pairs=1, w8a16=5)  # the tensor-core tile (w8a16 5), as the GPU tests run it


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, cuda_default",
                         [(1, False), (3, False), (3, True), (40, True), (3, "mma"), (1, "mma"), (40, "ring")])
@pytest.mark.parametrize("pdl", [0, 2])
def test_triton_mxfp4_cuda_graph_replay_reads_the_row_map_written_after_capture(num_tokens, pdl, cuda_default):
    """A captured call (the default config of 1 and of 3 tokens: the Triton GEMV tile with and
    without its prefetch, and at 3 on CUDA the Gluon GEMV tile; at 40 on CUDA the tensor-core tile,
    w8a16 5, which also runs at 1 and 3, and at 40 through its shared-memory rings; with pdl 2 the
    launches after the first are programmatic dependent launches inside the graph) replayed after the
    row map moves experts between the tiers (every expert in both: a placement switch is a row-map
    write) gives the eager all-hot pdl 0 output bitwise."""
    import numpy as np
    import torch

    from coldset.kernels.activation import SILU
    from coldset.kernels.tiers import ExpertPools
    from coldset.kernels.triton_mxfp4 import default_config, triton_mxfp4_experts
    from test_mxfp4_pools import make_mxfp4, pools_of, random_row_map, routing

    q = make_mxfp4(2, 16, 256, 128, seed=7)
    x, ids, w = (t.cuda() for t in routing(num_tokens, 16, 4, 256, seed=7))
    hot = pools_of(tuple(t.cuda() for t in q), SILU)
    default = (_MMA_TILE if cuda_default == "mma" else _MMA_RINGS[0] if cuda_default == "ring"
               else default_config(num_tokens, cuda=cuda_default).to_dict())
    base = triton_mxfp4_experts(hot, 1, x, ids, w, {**default, "pdl": 0}, use_row_map=False)
    cfg = {**default, "pdl": pdl}
    both = ExpertPools(hot.w13_hot, hot.w2_hot, hot.w13_hot.cpu().pin_memory(), hot.w2_hot.cpu().pin_memory(),
                       hot.row_map.clone(), w13_scale_hot=hot.w13_scale_hot, w2_scale_hot=hot.w2_scale_hot,
                       w13_scale_cold=hot.w13_scale_hot.cpu().pin_memory(),
                       w2_scale_cold=hot.w2_scale_hot.cpu().pin_memory(), w13_bias=hot.w13_bias, w2_bias=hot.w2_bias)
    out = torch.empty_like(base)
    triton_mxfp4_experts(both, 1, x, ids, w, cfg)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(triton_mxfp4_experts(both, 1, x, ids, w, cfg))
    for seed in range(3):
        cold = random_row_map(2, 16, 0.5, seed) < 0
        flat = np.arange(32, dtype=np.int32).reshape(2, 16)
        both.set_row_map(np.where(cold, -flat - 1, flat).astype(np.int32))
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, base), seed


@pytest.mark.gpu
def test_mma_tile_is_exact_over_its_scale_range_and_loud_past_it():
    """The tensor-core tile (w8a16 5) carries weights as ``w * 2^-63`` in bf16: with every scale of
    w13 at 65, or every scale of w2 at 191 (the ends of :data:`SCALE_RANGE`; the inputs scaled to
    keep the intermediate in range) the output is the float64 oracle's; all-zero groups at scale byte
    0 (how quantizers write them) leave it the oracle's; one scale byte of 192 makes exactly the
    outputs that read it non-finite."""
    import torch

    from coldset.kernels.activation import SILU
    from coldset.kernels.gluon_mxfp4_mma import SCALE_RANGE
    from coldset.kernels.triton_mxfp4 import triton_mxfp4_experts
    from test_mxfp4_pools import assert_close_to_oracle, float64_oracle, make_mxfp4, pools_of, routing

    assert SCALE_RANGE == (65, 191)
    w13, w2, s13, s2, _, _ = make_mxfp4(1, 8, 256, 128, seed=3, bias=False)
    x, ids, w = routing(5, 8, 2, 256, seed=3)
    zeroed, s13_zeroed = w13.clone(), s13.clone()
    zeroed[..., 5:9, 16:32], s13_zeroed[..., 5:9, 1] = 0, 0  # w13 rows 5-8, inputs 32-63: group 1
    cases = {"w13 at 65": ((w13, w2, s13.clone().fill_(65), s2), x * 2.0 ** 62),
             "w2 at 191": ((w13, w2, s13, s2.clone().fill_(191)), x),
             "zero groups at 0": ((zeroed, w2, s13_zeroed, s2), x)}
    for what, (q, xs) in cases.items():
        q = (*q, None, None)
        pools = pools_of(tuple(t.cuda() if t is not None else None for t in q), SILU)
        out = triton_mxfp4_experts(pools, 0, xs.cuda(), ids.cuda(), w.cuda(), _MMA_TILE)
        assert_close_to_oracle(out.cpu(), float64_oracle(q, 0, xs, ids, w, SILU), what)
    past = s2.clone()
    past[..., 7, 0] = 192  # w2 row 7 (output 7), group 0, every expert
    pools = pools_of(tuple(t.cuda() if t is not None else None for t in (w13, w2, s13, past, None, None)), SILU)
    out = triton_mxfp4_experts(pools, 0, x.cuda(), ids.cuda(), w.cuda(), _MMA_TILE).cpu()
    assert not torch.isfinite(out[:, 7]).any()
    assert torch.isfinite(out[:, :7]).all() and torch.isfinite(out[:, 8:]).all()
