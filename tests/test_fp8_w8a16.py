"""The block-FP8 kernel's weight-only decode mode (KernelConfig ``w8a16=1``): FP8 weight
tiles converted to the activation dtype in registers, the tokens and the intermediate never
quantized, each 128-wide k block's fp32 product scaled by its weight block's ``weight_scale_inv``.

References and tolerances (float64 is the independent one: weights dequantized in float64 from the
e4m3 bytes and the scale grid here, not by :mod:`coldset.core.fp8`; activations exact):
- the torch path ``torch_experts(w8a16=True)`` (float32 GEMMs of the dequantized weights) against
  that float64 loop with the intermediate rounded to x's dtype as the kernel writes it: rel. error
  < 1e-5 in float32 (summation order only), < 1e-2 with bf16 activations (the output rounded to
  bf16 once: 2^-9 at worst), signed bias < 1e-3;
- the w8a16 kernel under Triton's interpreter (fp16 activations: the interpreter's bf16 dot is
  wrong in the triton 3.6 used here, 1e10 errors on a 16 x 16 product, while its fp16 dot is exact
  to float32) against the torch path of its mode and the float64 loop: < 1e-3 (measured 0 against
  the torch path: the fp16 output hides float32 summation order), and against the w8a8 torch path
  (the activations through e4m3) it differs by ~4% (3.8% at 200 x 72; 4.2% at Qwen3-30B-A3B shape
  in float64): the two modes are other functions, so a run's reference and its placements must
  use the same config (the gate's :func:`coldset.verify.gate.experts_functions` gives both paths the
  tuned config; ``bench step`` times one tuned config per batch; ``autotune`` and ``bench kernel``
  check each candidate against the torch path of its own mode);
- (gpu) the kernel in bf16 against the torch path of its mode and the float64 loop: < 1e-2 (bf16
  roundings of the intermediate and the output; no e4m3 rounding of activations), signed bias
  < 1e-3, and closer to the float64 dequantize-then-matmul value than the w8a8 path is.

Placement independence as for every FP8 config: all hot with the row map compiled out, hot/cold
(zero-copy pinned) placements, the unmodified pools placed over the host tier, and a slot cache's
pools right after a fill, bitwise.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from coldset.kernels import torch_experts
from coldset.kernels.tiers import ExpertPools, build_pools
from expert_helpers import (captured, hot_cold_mixed_maps, random_row_map, rel_err, replays_over_row_maps, routing,
                            signed_bias)
from interpreter_helpers import run_interpreted
from test_fp8_experts import _CONFIG_HELPERS, _PDL_STUBS, _PRELUDE, dup_fp8_pools, fp8_placements, make_fp8

gpu = pytest.mark.gpu
W8A16 = {"w8a16": 1}


def dequant64(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float64 ``q * scale`` with ``s`` one float32 per 128 x 128 block of ``q`` (partial blocks at the edges),
    written here from the format's definition (independent of :mod:`coldset.core.fp8`)."""
    rows, cols = q.shape
    grid = s.double().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return q.double() * grid


def float64_w8a16(q, layer, x, ids, weights):
    """Independent float64 computation on the CPU, per selected expert: its weights dequantized here
    (w13's scale grid: gate's ceil(I / 128) block rows, then up's), activations exact, the
    intermediate rounded to x's dtype (what the kernel writes and w2 reads), each (token, rank)
    product times its routing weight, summed per token."""
    q13, q2, s13, s2 = (t.cpu() for t in q)
    x, ids, weights = x.cpu(), ids.cpu(), weights.cpu()
    inter = q2.shape[-1]
    gi = -(-inter // 128)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in torch.unique(ids).tolist():
        tok, rank = torch.where(ids == e)
        a = x[tok].double()
        gate = a @ dequant64(q13[layer, e, :inter], s13[layer, e, :gi]).T
        up = a @ dequant64(q13[layer, e, inter:], s13[layer, e, gi:]).T
        act = (F.silu(gate) * up).to(x.dtype).double()
        y = act @ dequant64(q2[layer, e], s2[layer, e]).T
        out.index_add_(0, tok, y * weights[tok, rank, None].double())
    return out


def test_w8a16_float64_reference_reads_the_format_as_coldset_fp8():
    """The test's own dequantization (per 128 x 128 block, gate's and up's scale rows apart) is the
    format's: equal to :mod:`coldset.core.fp8`'s in float32 (partial blocks at 200 x 72)."""
    from coldset.core import fp8

    _, _, (q13, q2, s13, s2) = make_fp8(1, 2, 200, 72)
    gi = 1
    d13 = torch.cat([dequant64(q13[0, 1, :72], s13[0, 1, :gi]), dequant64(q13[0, 1, 72:], s13[0, 1, gi:])])
    assert torch.equal(d13.float(), fp8.dequantize_w13(q13[0, 1], s13[0, 1]).float())
    assert torch.equal(dequant64(q2[0, 1], s2[0, 1]).float(), fp8.dequantize_weight(q2[0, 1], s2[0, 1]).float())


@pytest.mark.parametrize("hidden,inter", [(256, 128), (200, 72)])
def test_torch_w8a16_path_against_float64(hidden, inter):
    _, _, q = make_fp8(2, 8, hidden, inter, seed=2)
    pools = ExpertPools.all_hot(*q[:2], *q[2:])
    for layer in range(2):
        x, ids, w = routing(9, 8, 3, hidden, torch.float32, seed=20 + layer)
        ref = float64_w8a16(q, layer, x, ids, w)
        out = torch_experts(pools, layer, x, ids, w, w8a16=True)
        assert rel_err(out, ref) < 1e-5
        # the w8a8 path is another function: its activations' e4m3 rounding shows at the percent level
        assert rel_err(torch_experts(pools, layer, x, ids, w), ref) > 1e-2
    x, ids, w = routing(16, 8, 2, hidden, torch.bfloat16, seed=5)
    out = torch_experts(pools, 0, x, ids, w, w8a16=True)
    ref = float64_w8a16(q, 0, x, ids, w)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2 and abs(signed_bias(out, ref)) < 1e-3


def test_torch_w8a16_refuses_pools_without_fp8_experts():
    pools = ExpertPools.all_hot(torch.randn(1, 4, 16, 8), torch.randn(1, 4, 8, 8))
    x, ids, w = routing(2, 4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="w8a16=True needs block-FP8 pools"):
        torch_experts(pools, 0, x, ids, w, w8a16=True)


_INTERPRETED_W8A16 = _PRELUDE + _CONFIG_HELPERS + r"""
from test_fp8_w8a16 import float64_w8a16
from coldset.engine.cache.pool import SlotCache
from coldset.kernels.tiers import host_tier
from coldset.kernels import triton_fp8

# weight-only: no activation quantization launch may run (the tokens' nor the intermediate's)
class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("w8a16 launched the activation quantization kernel")

_quant_kernel, triton_fp8._quant_groups_kernel = triton_fp8._quant_groups_kernel, _NoLaunch()

def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())

CASES = [  # (hidden, inter, tokens, config): in-kernel grouping, sorted, partial blocks, 32-row tiles
    (256, 128, 2, KernelConfig(16, 32, 128, 64, 128, 4, 3, 32, w8a16=1)),
    (200, 72, 7, KernelConfig(16, 128, 128, 64, 128, 4, 3, 1, w8a16=1)),
    (384, 200, 9, KernelConfig(16, 64, 128, 128, 128, 4, 3, 1, tile_order=1, w8a16=1)),
    (200, 136, 6, KernelConfig(32, 64, 128, 64, 128, 4, 3, 1, half_buf=1, w8a16=1)),
]
for hidden, inter, tokens, cfg in CASES:
    _, _, qq = make_fp8(2, 8, hidden, inter, seed=tokens)
    x, ids, w = routing(tokens, 8, 3, hidden, torch.float16, seed=tokens)
    all_hot = ExpertPools.all_hot(*qq[:2], *qq[2:])
    base = triton_experts(all_hot, 1, x, ids, w, cfg, use_row_map=False)
    assert torch.isfinite(base).all(), cfg
    e_torch = rel(base, torch_experts(all_hot, 1, x, ids, w, w8a16=True))
    e64 = rel(base, float64_w8a16(qq, 1, x, ids, w))
    e_w8a8 = rel(base, torch_experts(all_hot, 1, x, ids, w))
    print(f"w8a16 H={hidden} I={inter} T={tokens}: rel err vs torch w8a16 {e_torch:.1e}, float64 {e64:.1e}, "
          f"torch w8a8 {e_w8a8:.1e}")
    assert e_torch < 1e-3 and e64 < 1e-3, (cfg, e_torch, e64)
    assert e_w8a8 > 1e-2, (cfg, e_w8a8)  # the activations' e4m3 rounding is not in this mode
    placed = build_pools(qq[0], qq[1], random_row_map(2, 8, 0.5, tokens), "cpu", w13_scale=qq[2], w2_scale=qq[3])
    cold = build_pools(qq[0], qq[1], random_row_map(2, 8, 1.0, tokens), "cpu", w13_scale=qq[2], w2_scale=qq[3])
    warm_map = random_row_map(2, 8, 0.5, 7)  # its hot rows are the slots; the cache fills cold experts into them
    h = int((warm_map >= 0).sum())
    cache = SlotCache.build(all_hot, host_tier(all_hot), warm_map, np.ones(h), "lru", max_tokens=2, top_k=3)
    cache.admit(1, ids[:2])  # cold experts of the first two tokens filled into slots (weights and scales)
    assert (cache.pools.row_map[1].numpy() != warm_map[1]).any() and (cache.pools.row_map[1].numpy() < 0).any()
    for name, pools in (("hot/cold", placed), ("all cold", cold), ("slots", cache.pools)):
        assert torch.equal(triton_experts(pools, 1, x, ids, w, cfg), base), (name, cfg)
    # w8a16=2 (bf16 weight tiles by bits; fp16 ones as 1): accepted, no quantization launch, 1's bits
    assert torch.equal(triton_experts(placed, 1, x, ids, w, variant(cfg, w8a16=2)), base), cfg

# refused by name: w8a16 with a quantization option, a value outside 0 / 1
_, _, qq = make_fp8(1, 8, 256, 128)
x, ids, w = routing(2, 8, 2, 256, torch.float16)
assert_refused(lambda f: triton_experts(ExpertPools.all_hot(*qq[:2], *qq[2:]), 0, x, ids, w,
                                        variant(KernelConfig(16, 32, 128, 64, 128), **f)),
               [(dict(w8a16=1, quant_x=1), "w8a16=1 quantizes no activation"),
                (dict(w8a16=1, block_n1=128, quant_act=1), "w8a16=1 quantizes no activation"),
                (dict(w8a16=3), "w8a16 must be 0")])

# pdl 1-3 (grid-dependency instructions as no-ops, the prefetch recorded): pdl 0's bits; nothing
# prefetched (no launch before w13 nor between w13 and w2 to hide a prefetch behind)
""" + _PDL_STUBS + r"""
_, _, qq = make_fp8(2, 8, 200, 72, seed=4)
x, ids, w = routing(5, 8, 3, 200, torch.float16, seed=4)
placed = build_pools(qq[0], qq[1], random_row_map(2, 8, 0.5, 4), "cpu", w13_scale=qq[2], w2_scale=qq[3])
for cfg in (KernelConfig(16, 32, 128, 64, 128, 4, 4, 32, w8a16=1),
            KernelConfig(16, 64, 128, 64, 128, 4, 3, 1, w8a16=1)):
    base = triton_experts(ExpertPools.all_hot(*qq[:2], *qq[2:]), 1, x, ids, w, cfg, use_row_map=False)
    for pdl in (1, 2, 3):
        PREFETCHED.clear()
        assert torch.equal(triton_experts(placed, 1, x, ids, w, variant(cfg, pdl=pdl)), base), (cfg, pdl)
        assert not PREFETCHED, (cfg, pdl, PREFETCHED)

# and the w8a8 default still quantizes (the stub above is what these checks rely on)
try:
    triton_experts(placed, 1, x, ids, w, KernelConfig(16, 32, 128, 64, 128, 4, 3, 32))
except AssertionError as exc:
    assert "quantization kernel" in str(exc)
else:
    raise AssertionError("the w8a8 path ran without its quantization launch")
print("INTERPRETED OK")
"""


def test_w8a16_kernel_under_the_interpreter_against_float64_bitwise_across_placements_and_slots():
    """The w8a16 kernel under Triton's interpreter (fp16 activations): against the torch path of its
    mode and the independent float64 loop (< 1e-3), ~percent away from the w8a8 path; no activation
    quantization launch runs (the launch replaced by one that raises); bitwise the all-hot output on
    hot/cold, all-cold and slot-cache rows (a CPU slot cache right after a fill), in-kernel and
    sorted grouping, partial blocks of H and I, 16- and 32-row tiles, half_buf; pdl 1-3 bitwise pdl
    0 with nothing prefetched; refusals by name."""
    run_interpreted(_INTERPRETED_W8A16)


def test_fp8_search_space_times_w8a16_at_decode_only():
    """The FP8 decode candidates include weight-only ones (16-, 32- and 64-column tiles, pdl 2 and 3,
    both conversions), every one passes the kernel's config check, none at prefill, and the defaults stay w8a8 (w8a16 is
    another function: picked by the tune per batch, never by a default)."""
    pytest.importorskip("triton")
    from coldset.kernels.triton_fp8 import DEFAULT_DECODE_CONFIG, DEFAULT_PREFILL_CONFIG, _check_config
    from coldset.kernels.triton_moe import KernelConfig
    from coldset.kernels.tune import TRITON_FP8_SEARCH_SPACE

    decode = [KernelConfig.from_dict(d) for d in TRITON_FP8_SEARCH_SPACE["decode"]]
    for c in decode:
        _check_config(c)
    w8 = [c for c in decode if c.w8a16]
    assert {c.block_n1 for c in w8} == {16, 32, 64} and {c.pdl for c in w8} == {2, 3}
    assert {c.w8a16 for c in w8} == {1, 2}
    assert all(c.quant_x == c.quant_act == 0 for c in w8)
    assert not any(KernelConfig.from_dict(d).w8a16 for d in TRITON_FP8_SEARCH_SPACE["prefill"])
    assert DEFAULT_DECODE_CONFIG.w8a16 == DEFAULT_PREFILL_CONFIG.w8a16 == KernelConfig().w8a16 == 0


def test_untimed_candidates_names_what_the_tune_excluded():
    """``bench step --tune-fp8`` fails a run whose tune lost a candidate: :func:`coldset.kernels.tune.untimed_candidates`
    lists the search space's candidates with no time, per batch and regime."""
    from coldset.kernels.tune import TRITON_FP8_SEARCH_SPACE, TuneResult, TuneShape, _canonical, untimed_candidates

    shape = TuneShape(128, 2048, 768, 8, "bfloat16", 1, 128, 0, weight_format="fp8_block128")
    space = TRITON_FP8_SEARCH_SPACE
    timed = {1: {_canonical(c): 1.0 for c in space["decode"]}, 2048: {_canonical(c): 1.0 for c in space["prefill"]}}
    full = TuneResult("k", False, "triton", shape, [1, 2048], {}, timed)
    assert untimed_candidates(full, space) == {}
    lost = space["decode"][-1]
    del timed[1][_canonical(lost)]
    assert untimed_candidates(full, space) == {1: [lost]}


# ---------------------------------------------------------------- GPU --------------------------

def _cfg(**fields):
    from coldset.kernels.triton_moe import KernelConfig

    return KernelConfig(**{**KernelConfig(16, 32, 128, 64, 128, 4, 4, 32).to_dict(), **W8A16, **fields})


@gpu
@pytest.mark.parametrize("hidden,inter", [(256, 128), (200, 72), (384, 192)])
@pytest.mark.parametrize("num_tokens", [1, 33, 300])
def test_w8a16_matches_torch_path_and_float64_closer_than_w8a8(hidden, inter, num_tokens):
    from coldset.kernels import triton_experts

    _, _, q = make_fp8(2, 16, hidden, inter, seed=num_tokens, device="cuda")
    pools = ExpertPools.all_hot(*q[:2], *q[2:])
    for layer in range(2):
        x, ids, w = routing(num_tokens, 16, 4, hidden, torch.bfloat16, seed=10 + layer, device="cuda")
        out = triton_experts(pools, layer, x, ids, w, _cfg(pdl=2))
        ref64 = float64_w8a16(q, layer, x, ids, w)
        errs = (rel_err(out, torch_experts(pools, layer, x, ids, w, w8a16=True).double().cpu()), rel_err(out, ref64))
        w8a8 = rel_err(triton_experts(pools, layer, x, ids, w), ref64)
        print(f"w8a16 H={hidden} I={inter} T={num_tokens} layer {layer}: rel err vs torch w8a16 {errs[0]:.2e}, "
              f"vs float64 {errs[1]:.2e} (w8a8 kernel {w8a8:.2e}), signed bias {signed_bias(out, ref64):+.1e}")
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        assert max(errs) < 1e-2, errs
        assert abs(signed_bias(out, ref64)) < 1e-3
        assert errs[1] < w8a8, (errs, w8a8)


@gpu
@pytest.mark.parametrize("hidden,inter", [(256, 128), (384, 200)])
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 300])
def test_w8a16_bitwise_across_placements_and_slots(hidden, inter, num_tokens):
    """The search space's w8a16 tiles (and a 64-row tile) bitwise the all-hot output with the
    row map compiled out on built placements (hot, half cold, all cold: pinned zero-copy), the
    unmodified pools placed over the host tier, and a slot cache's pools right after a fill."""
    from coldset.kernels import triton_experts
    from coldset.kernels.triton_moe import KernelConfig
    from coldset.kernels.tune import TRITON_FP8_SEARCH_SPACE

    L, E, K = 2, 32, 4
    _, _, q = make_fp8(L, E, hidden, inter, seed=50 + num_tokens)
    x, ids, w = routing(num_tokens, E, K, hidden, torch.bfloat16, seed=51, device="cuda")
    unmodified, pools_list = fp8_placements(q, ids, "cuda")
    configs = {}  # the search space's w8a16 tiles, one per tile (stages and pdl change no bits: tested apart)
    for d in TRITON_FP8_SEARCH_SPACE["decode"]:
        c = KernelConfig.from_dict(d)
        if c.w8a16:
            configs.setdefault((c.block_n1, c.block_n2, c.num_warps, c.tile_order, c.w8a16), c)
    configs = list(configs.values())
    configs.append(_cfg(block_m=64, block_n1=64, block_n2=128, slot_max_pairs=1, tile_order=1, half_buf=1))
    for cfg in configs:
        ref = triton_experts(unmodified, 1, x, ids, w, cfg, use_row_map=False)
        assert torch.isfinite(ref).all()
        assert rel_err(ref, float64_w8a16(q, 1, x.cpu(), ids.cpu(), w.cpu())) < 1e-2, cfg
        for name, pools in pools_list:
            assert torch.equal(triton_experts(pools, 1, x, ids, w, cfg), ref), (cfg, name)


@gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64])
def test_w8a16_bit_conversion_bitwise_triton_conversion_on_every_finite_e4m3(num_tokens):
    """``w8a16=2`` (bf16 weight tiles by bit operations, :func:`~coldset.kernels.triton_fp8._bf16_of_e4m3_bits`)
    gives ``w8a16=1``'s bits (triton's conversion) with weights holding every finite e4m3 byte (zeros,
    negative zero, subnormals, +-448), on all-hot and half-cold rows, at the search space's tiles."""
    from coldset.kernels import triton_experts

    L, E, H, I = 1, 8, 256, 128
    _, _, q = make_fp8(L, E, H, I, seed=60)
    every = torch.arange(256, dtype=torch.uint8)
    every = every[(every & 0x7F) != 0x7F]  # e4m3fn's NaN (0x7f, 0xff) left out: no quantizer writes it
    for t in (q[0], q[1]):  # each expert's bytes: every finite value, repeated, shuffled per expert
        g = torch.Generator().manual_seed(t.numel())
        n = t[0, 0].numel()
        for e in range(E):
            t.view(torch.uint8)[0, e].view(-1).copy_(every[torch.randint(0, every.numel(), (n,), generator=g)])
            t.view(torch.uint8)[0, e].view(-1)[: every.numel()] = every
    x, ids, w = routing(num_tokens, E, 4, H, torch.bfloat16, seed=61, device="cuda")
    unmodified = ExpertPools.all_hot(*(t.cuda() for t in q[:2]), *(t.cuda() for t in q[2:]))
    placed = build_pools(q[0], q[1], random_row_map(L, E, 0.5, 6), "cuda", w13_scale=q[2], w2_scale=q[3])
    for n1, n2, st in ((32, 64, 4), (64, 128, 3)):
        one = triton_experts(unmodified, 0, x, ids, w, _cfg(block_n1=n1, block_n2=n2, num_stages=st), use_row_map=False)
        assert torch.isfinite(one).all()
        for pools, use in ((unmodified, False), (placed, True)):
            two = triton_experts(pools, 0, x, ids, w, _cfg(block_n1=n1, block_n2=n2, num_stages=st, w8a16=2),
                                 use_row_map=use)
            assert torch.equal(two, one), (n1, use)


@gpu
@pytest.mark.parametrize("num_tokens,pdl,mode", [(1, 0, 1), (1, 2, 1), (4, 3, 1), (64, 2, 1), (1, 2, 2), (4, 3, 2)])
def test_w8a16_cuda_graph_replay_after_row_map_change(num_tokens, pdl, mode):
    """A captured step re-reads the row map: hot, every expert cold (weights and scales in place in
    pinned memory), mixed; each replay bitwise the unmodified path."""
    from coldset.kernels import triton_experts

    L, E = 2, 16
    _, _, q = make_fp8(L, E, 256, 128, seed=8)
    pools = dup_fp8_pools(q)
    unmodified = ExpertPools.all_hot(*(t.cuda() for t in q[:2]), *(t.cuda() for t in q[2:]))
    x, ids, w = routing(num_tokens, E, 4, 256, torch.bfloat16, seed=9, device="cuda")
    cfg = _cfg(pdl=pdl, w8a16=mode)
    ref = triton_experts(unmodified, 1, x, ids, w, _cfg(pdl=0), use_row_map=False)  # mode 2: mode 1's bits
    graph, out = captured(partial(triton_experts, pools, 1, x, ids, w, cfg))
    for name in replays_over_row_maps(pools, graph):  # hot, every expert cold, mixed
        assert torch.equal(out, ref), name


@gpu
@pytest.mark.parametrize("num_tokens", [1, 12])
def test_w8a16_pdl_modes_bitwise_after_a_late_writing_kernel(num_tokens):
    """No launch of the call comes before w13 in this mode (at 12 tokens: the grouping's): with pdl 1-2
    it is a plain launch, with 3 a dependent launch of the kernel before, which must wait before
    reading x, the ids and the row map. The kernel before is a late writer (releases dependents at
    once, writes after 500 µs over stale inputs); every pdl mode gives pdl 0's bits on hot, cold and
    mixed maps, and pdl 0 the float64 value."""
    from late_writer import output_after_a_late_write

    from coldset.kernels import triton_experts

    L, E, H, I, K = 2, 32, 256, 128, 4
    _, _, q = make_fp8(L, E, H, I, seed=31)
    pools = dup_fp8_pools(q)
    x, ids, w = routing(num_tokens, E, K, H, torch.bfloat16, seed=32, device="cuda")
    x_old, ids_old, w_old = routing(num_tokens, E, K, H, torch.bfloat16, seed=33, device="cuda")
    layer = 1
    outs = {}
    for pdl in (0, 1, 2, 3):
        cfg = _cfg(pdl=pdl)
        triton_experts(pools, layer, x, ids, w, cfg)  # compiled before the timing-sensitive calls
        for name, m in hot_cold_mixed_maps(L, E).items():
            out, landed = output_after_a_late_write(pools, (x, ids, w), (x_old, ids_old, w_old), m,
                                                    partial(triton_experts, pools, layer, config=cfg))
            assert landed  # the late write landed
            outs[(pdl, name)] = out
    base = outs[(0, "hot")]
    assert rel_err(base, float64_w8a16(q, layer, x.cpu(), ids.cpu(), w.cpu())) < 1e-2
    assert not torch.equal(triton_experts(pools, layer, x_old, ids_old, w_old, _cfg()), base)
    for key, out in outs.items():
        assert torch.equal(out, base), key
