"""The experts computation: torch path against a float64 reference, placement independence, and
(on CUDA) the Triton kernel against the torch path, across placements and under CUDA-graph replay."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from coldset.kernels import torch_experts
from coldset.kernels.tiers import ExpertPools, build_pools
from expert_helpers import hot_cold_mixed_maps, random_row_map, rel_err, routing, signed_bias

gpu = pytest.mark.gpu  # CUDA-only: skipped without CUDA by tests/conftest.py


def make_weights(num_layers, num_experts, hidden, inter, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_layers, num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_layers, num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    return w13.to(device), w2.to(device)


def float64_experts(w13, w2, layer, x, ids, weights):
    """Independent reference: per token, per rank, in float64 from the original [L, E, ...] tensors."""
    inter = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for r in range(ids.shape[1]):
            e = int(ids[t, r])
            h = w13[layer, e].double().cpu() @ x[t].double().cpu()
            act = F.silu(h[:inter]) * h[inter:]
            out[t] += float(weights[t, r]) * (w2[layer, e].double().cpu() @ act)
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_torch_path_matches_float64_reference(dtype, tol):
    w13, w2 = make_weights(2, 8, 32, 24, dtype)
    pools = ExpertPools.all_hot(w13, w2)
    for layer in range(2):
        x, ids, w = routing(7, 8, 2, 32, dtype, seed=layer)
        out = torch_experts(pools, layer, x, ids, w)
        assert out.dtype == dtype and out.shape == x.shape
        assert rel_err(out, float64_experts(w13, w2, layer, x, ids, w)) < tol


def test_torch_path_row_map_bitwise_equals_all_hot():
    w13, w2 = make_weights(3, 8, 32, 16, torch.bfloat16)
    ref_pools = ExpertPools.all_hot(w13, w2)
    x, ids, w = routing(11, 8, 3, 32, torch.bfloat16)
    outs = []
    for seed, frac in [(0, 0.0), (1, 0.3), (2, 0.7), (3, 1.0)]:
        pools = build_pools(w13, w2, random_row_map(3, 8, frac, seed), "cpu")
        for layer in range(3):
            ref = torch_experts(ref_pools, layer, x, ids, w)
            out = torch_experts(pools, layer, x, ids, w)
            assert torch.equal(out, ref), (seed, layer)
            outs.append(out)
    assert not torch.equal(outs[0], outs[1])  # layers differ, so the check can fail


def test_torch_path_token_chunking_keeps_placement_independence():
    w13, w2 = make_weights(1, 8, 32, 16, torch.float32)
    ref_pools = ExpertPools.all_hot(w13, w2)
    pools = build_pools(w13, w2, random_row_map(1, 8, 0.5, 4), "cpu")
    x, ids, w = routing(9, 8, 2, 32, torch.float32)
    full = torch_experts(ref_pools, 0, x, ids, w)
    for chunk in (1, 4, 64):
        a = torch_experts(ref_pools, 0, x, ids, w, token_chunk=chunk)
        b = torch_experts(pools, 0, x, ids, w, token_chunk=chunk)
        assert torch.equal(a, b)
        torch.testing.assert_close(a, full, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- GPU (Triton) ----------------

def _dup_pools(w13, w2, device="cuda"):
    """Pools that hold every expert in both tiers (hot on the GPU, cold pinned), all-hot map."""
    num_layers, num_experts = w13.shape[:2]
    n = num_layers * num_experts
    w13_hot = w13.reshape(n, *w13.shape[2:]).to(device).contiguous()
    w2_hot = w2.reshape(n, *w2.shape[2:]).to(device).contiguous()
    w13_cold = torch.empty(w13_hot.shape, dtype=w13.dtype, pin_memory=True)
    w2_cold = torch.empty(w2_hot.shape, dtype=w2.dtype, pin_memory=True)
    w13_cold.copy_(w13_hot)
    w2_cold.copy_(w2_hot)
    row_map = torch.arange(n, dtype=torch.int32, device=device).reshape(num_layers, num_experts)
    pools = ExpertPools(w13_hot, w2_hot, w13_cold, w2_cold, row_map)
    pools.validate()
    return pools


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 4, 16, 33, 300])
def test_triton_matches_torch_and_float64(dtype, num_tokens):
    from coldset.kernels.triton_moe import triton_experts

    E, H, I, K = 16, 256, 192, 4
    w13, w2 = make_weights(2, E, H, I, dtype, device="cuda")
    pools = ExpertPools.all_hot(w13, w2)
    for layer in range(2):
        x, ids, w = routing(num_tokens, E, K, H, dtype, seed=10 + layer, device="cuda")
        ref64 = float64_experts(w13, w2, layer, x, ids, w)
        out = triton_experts(pools, layer, x, ids, w)
        torch_out = torch_experts(pools, layer, x, ids, w)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref64) < 1e-2
        assert rel_err(out, torch_out.double().cpu()) < 2e-2


@gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 257])
def test_triton_bitwise_identical_across_placements_with_pinned_cold_pool(num_tokens):
    from coldset.kernels.triton_moe import KernelConfig, triton_experts

    E, H, I, K, L = 32, 256, 128, 4, 2
    w13, w2 = make_weights(L, E, H, I, torch.bfloat16)
    unmodified = ExpertPools.all_hot(w13.cuda(), w2.cuda())
    x, ids, w = routing(num_tokens, E, K, H, torch.bfloat16, device="cuda")
    configs = [None, KernelConfig(16, 16, 64, 16, 64, 4, 2, 1), KernelConfig(16, 16, 64, 16, 64, 4, 2, 128),
               KernelConfig(32, 64, 32, 32, 32, 4, 3), KernelConfig(16, 32, 64, 32, 64, 4, 3, 32, 1),
               KernelConfig(16, 32, 64, 32, 64, 4, 3, 32, 2), KernelConfig(16, 32, 64, 32, 64, 4, 3, 1, 2),
               # split-K (H = 256 in 3 splits of 128: the third is empty) and the column-fastest order
               KernelConfig(16, 32, 64, 32, 64, 4, 3, 32, 2, split_k1=2, split_k2=2),
               KernelConfig(16, 16, 64, 16, 64, 4, 2, 1, 0, split_k1=3, split_k2=2, tile_order=1),
               # the per-pair buffer in bf16 (the prefill option), with the column-fastest order
               KernelConfig(32, 64, 32, 32, 32, 4, 3, 1, 3, tile_order=1, half_buf=1)]
    for cfg in configs:
        refs = [triton_experts(unmodified, layer, x, ids, w, cfg, use_row_map=False) for layer in range(L)]
        assert not torch.equal(refs[0], refs[1])
        for seed, frac in [(0, 0.0), (1, 0.5), (2, 1.0), (3, 0.2)]:
            pools = build_pools(w13, w2, random_row_map(L, E, frac, seed), "cuda")
            if pools.num_cold:
                assert pools.w13_cold.is_pinned() and pools.w2_cold.is_pinned()
            for layer in range(L):
                out = triton_experts(pools, layer, x, ids, w, cfg)
                assert torch.equal(out, refs[layer]), (cfg, seed, layer)
    # in-kernel grouping (slots) and sorted grouping give the same pair order and chunks: same bits
    sorted_grouping = KernelConfig(16, 16, 64, 16, 64, 4, 2, 1)
    slot_grouping = KernelConfig(16, 16, 64, 16, 64, 4, 2, 128)
    for layer in range(L):
        assert torch.equal(triton_experts(unmodified, layer, x, ids, w, sorted_grouping),
                           triton_experts(unmodified, layer, x, ids, w, slot_grouping))


@gpu
@pytest.mark.parametrize("num_experts", [8, 60, 128])
def test_group_pairs_equals_a_stable_torch_sort(num_experts):
    """The grouping (one launch up to GROUP_KERNEL_MAX_PAIRS pairs, a chunked counting sort above)
    gives a stable sort's permutation and searchsorted's offsets, on both sides of the limit, with
    empty and crowded experts, with and without dependent launch."""
    from coldset.kernels.triton_moe import GROUP_KERNEL_MAX_PAIRS, group_pairs

    g = torch.Generator().manual_seed(num_experts)
    # one launch up to GROUP_KERNEL_MAX_PAIRS, then the chunked counting sort (GROUP_CHUNK = 1024):
    # one chunk and a bit, whole chunks, 2,048 tokens x top-8, a ragged last chunk
    sizes = [1, 2, 7, 32, 33, 100, 512, GROUP_KERNEL_MAX_PAIRS - 3, GROUP_KERNEL_MAX_PAIRS, GROUP_KERNEL_MAX_PAIRS + 1, 5000,
             4096, 16384, 40001]
    for n in sizes:
        for crowded in (False, True):
            hi = max(1, num_experts // 8) if crowded else num_experts  # few experts: long runs of equal ids
            ids = torch.randint(0, hi, (n,), generator=g).cuda()
            sorted_ids, order = torch.sort(ids, stable=True)
            want_off = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, device="cuda"))
            for pdl in (False, True):
                sorted_pairs, expert_off = group_pairs(ids, num_experts, pdl)
                assert sorted_pairs.dtype == expert_off.dtype == torch.int32
                assert torch.equal(sorted_pairs.long(), order), (n, crowded, pdl)
                assert torch.equal(expert_off.long(), want_off), (n, crowded, pdl)


@gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 40, 300])
def test_triton_split_k_and_tile_order(num_tokens):
    """Split-K (partial sums added in a fixed split order by the next launch) against float64 and
    the torch path, on sizes where splits are ragged or empty (H = 320 in 4 splits of 128, I = 160
    in 3 splits of 64), in both grouping modes and every launch mode; the column-fastest block
    order gives the same bits as the tile-fastest one; every config the same bits for every placement."""
    from coldset.kernels.triton_moe import KernelConfig, triton_experts

    E, H, I, K, L = 16, 320, 160, 4, 2
    dtype = torch.bfloat16
    w13, w2 = make_weights(L, E, H, I, dtype, seed=21)
    unmodified = ExpertPools.all_hot(w13.cuda(), w2.cuda())
    placed = build_pools(w13, w2, random_row_map(L, E, 0.5, num_tokens), "cuda")
    x, ids, w = routing(num_tokens, E, K, H, dtype, seed=22, device="cuda")
    ref = float64_experts(w13, w2, 1, x, ids, w)
    torch_out = torch_experts(unmodified, 1, x, ids, w)
    for slot_max in (32, 1):  # in-kernel grouping where the pairs fit, sorted otherwise
        base = KernelConfig(16, 32, 64, 32, 64, 4, 3, slot_max)
        for fields in ({}, dict(split_k1=2, split_k2=2, pdl=2), dict(split_k1=4, split_k2=3, pdl=1),
                       dict(split_k1=3, split_k2=2), dict(half_buf=1), dict(half_buf=1, split_k1=2, pdl=3)):
            outs = {}
            for order in (0, 1):
                cfg = KernelConfig(**{**base.to_dict(), **fields, "tile_order": order})
                out = triton_experts(unmodified, 1, x, ids, w, cfg, use_row_map=False)
                assert torch.equal(triton_experts(placed, 1, x, ids, w, cfg), out), cfg
                assert torch.isfinite(out).all()
                assert rel_err(out, ref) < 1e-2, cfg
                assert abs(signed_bias(out, ref.to(out.device))) < 1e-3, cfg
                assert rel_err(out, torch_out.double().cpu()) < 2e-2, cfg
                outs[order] = out
            assert torch.equal(outs[0], outs[1]), fields  # block order never changes a block's arithmetic


@gpu
def test_triton_half_tail():
    """An expert's last chunk as a half or quarter tile (``half_tail`` 1 / 2): against float64 and
    the torch path, the same bits for every placement, at routings where every tail kind occurs
    (a last chunk of <= block_m / 4, <= block_m / 2 and more pairs), in both grouping modes."""
    from coldset.kernels.triton_moe import KernelConfig, triton_experts

    E, H, I, K, L = 16, 256, 192, 4, 2
    dtype = torch.bfloat16
    w13, w2 = make_weights(L, E, H, I, dtype, seed=31)
    unmodified = ExpertPools.all_hot(w13.cuda(), w2.cuda())
    placed = build_pools(w13, w2, random_row_map(L, E, 0.5, 7), "cuda")
    tails = set()
    for num_tokens in (9, 100, 333, 700):
        x, ids, w = routing(num_tokens, E, K, H, dtype, seed=num_tokens, device="cuda")
        ref = float64_experts(w13, w2, 1, x, ids, w)
        torch_out = torch_experts(unmodified, 1, x, ids, w).double().cpu()
        for tail in torch.bincount(ids.flatten().cpu(), minlength=E).tolist():
            tail = tail % 64 or (64 if tail else 0)  # pairs in the last chunk of 64
            tails.add(0 if tail == 0 else 1 if tail <= 16 else 2 if tail <= 32 else 3)
        for half_tail in (1, 2):
            for fields in (dict(slot_max_pairs=1), dict(slot_max_pairs=128), dict(slot_max_pairs=1, tile_order=1,
                                                                                 half_buf=1, pdl=2)):
                cfg = KernelConfig(**{**KernelConfig(64, 64, 64, 64, 64, 4, 3).to_dict(), **fields,
                                      "half_tail": half_tail})
                out = triton_experts(unmodified, 1, x, ids, w, cfg, use_row_map=False)
                assert torch.equal(triton_experts(placed, 1, x, ids, w, cfg), out), (num_tokens, cfg)
                assert torch.isfinite(out).all()
                assert rel_err(out, ref) < 1e-2, (num_tokens, cfg)
                assert abs(signed_bias(out, ref.to(out.device))) < 1e-3, (num_tokens, cfg)
                assert rel_err(out, torch_out) < 2e-2, (num_tokens, cfg)
    assert tails >= {1, 2, 3}, tails  # quarter, half and whole last tiles all ran


@gpu
def test_triton_refuses_bad_split_and_order():
    from coldset.kernels.triton_moe import KernelConfig, triton_experts

    w13, w2 = make_weights(1, 8, 64, 32, torch.bfloat16, device="cuda")
    x, ids, w = routing(3, 8, 2, 64, torch.bfloat16, device="cuda")
    pools = ExpertPools.all_hot(w13, w2)
    with pytest.raises(ValueError, match="tile_order must be 0 or 1"):
        triton_experts(pools, 0, x, ids, w, KernelConfig(tile_order=2))
    with pytest.raises(ValueError, match="split_k1, split_k2 must be >= 1"):
        triton_experts(pools, 0, x, ids, w, KernelConfig(split_k2=0))
    with pytest.raises(ValueError, match="half_buf must be 0 or 1"):
        triton_experts(pools, 0, x, ids, w, KernelConfig(half_buf=2))
    with pytest.raises(ValueError, match="half_buf=1 needs split_k2=1"):
        triton_experts(pools, 0, x, ids, w, KernelConfig(half_buf=1, split_k2=2))
    with pytest.raises(ValueError, match="half_tail must be 0, 1 or 2"):
        triton_experts(pools, 0, x, ids, w, KernelConfig(block_m=32, half_tail=2))  # a quarter of 32 rows: 8
    with pytest.raises(ValueError, match="half_tail must be 0, 1 or 2"):
        triton_experts(pools, 0, x, ids, w, KernelConfig(block_m=128, half_tail=3))


@gpu
def test_triton_refuses_unknown_pdl_mode():
    from coldset.kernels.triton_moe import KernelConfig, triton_experts

    w13, w2 = make_weights(1, 8, 64, 32, torch.bfloat16, device="cuda")
    x, ids, w = routing(3, 8, 2, 64, torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="pdl must be 0, 1, 2 or 3"):
        triton_experts(ExpertPools.all_hot(w13, w2), 0, x, ids, w, KernelConfig(pdl=4))


@gpu
@pytest.mark.parametrize("num_tokens", [2, 40])
@pytest.mark.parametrize("pdl,split,order", [(0, 1, 0), (1, 1, 0), (2, 1, 0), (3, 1, 1), (0, 2, 1), (2, 2, 0)])
def test_cuda_graph_replay_after_row_map_change(num_tokens, pdl, split, order):
    from coldset.kernels.triton_moe import KernelConfig
    from coldset.kernels.triton_moe import triton_experts as _triton_experts

    triton_experts = partial(_triton_experts, config=KernelConfig(16, 32, 128, 64, 128, 4, 3, 32, pdl, split_k1=split,
                                                                  split_k2=split, tile_order=order))

    E, H, I, K, L = 16, 256, 128, 4, 2
    w13, w2 = make_weights(L, E, H, I, torch.bfloat16, seed=5)
    pools = _dup_pools(w13, w2)
    x, ids, w = routing(num_tokens, E, K, H, torch.bfloat16, seed=6, device="cuda")
    layer = 1
    expected_hot = triton_experts(pools, layer, x, ids, w)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) outside capture
        triton_experts(pools, layer, x, ids, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = triton_experts(pools, layer, x, ids, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, expected_hot)

    # 1. every expert now read from the pinned cold pool: same weights, same bits
    n = L * E
    pools.set_row_map((-torch.arange(n, dtype=torch.int32) - 1).reshape(L, E))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, expected_hot)

    # 2. a mixed placement
    pools.set_row_map(torch.as_tensor(
        np.where(np.arange(n).reshape(L, E) % 3 == 0, -np.arange(n).reshape(L, E) - 1, np.arange(n).reshape(L, E)
                 ).astype(np.int32)))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, expected_hot)

    # 3. the replay really re-reads the map: swap two selected experts' rows, output must follow
    e0, e1 = int(ids[0, 0]), int(ids[0, 1])
    swapped = torch.arange(n, dtype=torch.int32).reshape(L, E).clone()
    swapped[layer, e0], swapped[layer, e1] = swapped[layer, e1].clone(), swapped[layer, e0].clone()
    pools.set_row_map(swapped)
    graph.replay()
    torch.cuda.synchronize()
    eager = triton_experts(pools, layer, x, ids, w)
    assert torch.equal(static_out, eager)
    assert not torch.equal(static_out, expected_hot)
    w13s, w2s = w13.clone(), w2.clone()
    w13s[layer, [e0, e1]] = w13[layer, [e1, e0]]
    w2s[layer, [e0, e1]] = w2[layer, [e1, e0]]
    ref = torch_experts(ExpertPools.all_hot(w13s.cuda(), w2s.cuda()), layer, x, ids, w)
    assert rel_err(static_out, ref.double().cpu()) < 2e-2


@gpu
@pytest.mark.parametrize("num_tokens", [1, 8])
def test_pdl_modes_bitwise_equal_after_a_late_writing_kernel(num_tokens):
    """With pdl 3 every launch, the w13 kernel's (and the grouping's) included, is a programmatic
    dependent launch that may start before the kernel before it ends, so it must wait before
    reading anything that kernel writes (with pdl 1 and 2 the first launch is a plain one). The
    kernel before is a late writer here: it releases dependents at once and writes x, the ids, the
    routing weights and the row map only after 500 µs, over stale contents (other tokens, other
    experts, a row map pointing every expert at its neighbour's rows). Every pdl mode must give
    pdl 0's bits, for hot, cold and mixed maps, in both grouping modes; a launch that read before
    waiting would see the stale inputs. Each config runs once first, so that compiling it does not
    hold its launch back past the delay."""
    from late_writer import output_after_a_late_write

    from coldset.kernels.triton_moe import KernelConfig, triton_experts

    E, H, I, K, L = 32, 256, 128, 4, 2
    dtype = torch.bfloat16
    w13, w2 = make_weights(L, E, H, I, dtype, seed=31)
    pools = _dup_pools(w13, w2)
    x, ids, w = routing(num_tokens, E, K, H, dtype, seed=32, device="cuda")
    x_old, ids_old, w_old = routing(num_tokens, E, K, H, dtype, seed=33, device="cuda")
    layer = 1
    ref = float64_experts(w13, w2, layer, x, ids, w)
    for slot_max in (32, 1):  # in-kernel grouping at 4 and 32 pairs; the grouping launch before w13
        outs = {}
        for pdl in (0, 1, 2, 3):
            cfg = KernelConfig(16, 32, 64, 32, 64, 4, 3, slot_max, pdl)
            triton_experts(pools, layer, x, ids, w, cfg)  # compiled before the timing-sensitive calls
            for name, m in hot_cold_mixed_maps(L, E).items():
                out, landed = output_after_a_late_write(pools, (x, ids, w), (x_old, ids_old, w_old), m,
                                                        partial(triton_experts, pools, layer, config=cfg))
                assert landed  # the late write landed
                outs[(pdl, name)] = out
        base = outs[(0, "hot")]
        assert rel_err(base, ref) < 1e-2  # pdl 0 waited for the writer: the real inputs
        stale = triton_experts(pools, layer, x_old, ids_old, w_old, KernelConfig(16, 32, 64, 32, 64, 4, 3, slot_max))
        assert not torch.equal(stale, base)  # stale inputs would be seen
        for key, out in outs.items():
            assert torch.equal(out, base), (slot_max, key)


# ---------------------------------------------------------------------------------- layouts ---
# vLLM's kernel tests build expert weights as padded views (rows longer than H); weights also
# arrive transposed (stored [.., H, 2I]) or sliced (every other expert). The kernel reads pools
# row-major with no padding, so pools must be contiguous: all_hot and build_pools copy such views,
# a hand-built ExpertPools with a view is refused naming the tensor.

def strided_views(w13, w2, kind):
    """``(w13, w2)`` with the same values as the inputs but laid out as a ``kind`` view."""
    if kind == "padded":  # vLLM's test_moe: randn(E, 2N, K + 128)[..., :K]
        pad13 = torch.zeros(*w13.shape[:-1], w13.shape[-1] + 13, dtype=w13.dtype, device=w13.device)
        pad2 = torch.zeros(*w2.shape[:-1], w2.shape[-1] + 7, dtype=w2.dtype, device=w2.device)
        pad13[..., :w13.shape[-1]] = w13
        pad2[..., :w2.shape[-1]] = w2
        v13, v2 = pad13[..., :w13.shape[-1]], pad2[..., :w2.shape[-1]]
    elif kind == "transposed":  # stored [L, E, H, 2I] and [L, E, I, H]
        v13 = w13.transpose(-1, -2).contiguous().transpose(-1, -2)
        v2 = w2.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif kind == "sliced":  # every other expert of a model with twice as many
        big13 = torch.stack([w13, torch.full_like(w13, 7.0)], dim=2).flatten(1, 2)
        big2 = torch.stack([w2, torch.full_like(w2, 7.0)], dim=2).flatten(1, 2)
        v13, v2 = big13[:, ::2], big2[:, ::2]
    else:
        raise ValueError(kind)
    assert not v13.is_contiguous() and not v2.is_contiguous() and torch.equal(v13, w13) and torch.equal(v2, w2)
    return v13, v2


LAYOUTS = ["padded", "transposed", "sliced"]


@pytest.mark.parametrize("kind", LAYOUTS)
def test_pools_from_strided_views_are_contiguous_and_compute_the_same(kind):
    w13, w2 = make_weights(2, 8, 32, 24, torch.bfloat16)
    v13, v2 = strided_views(w13, w2, kind)
    x, ids, w = routing(7, 8, 2, 32, torch.bfloat16)
    ref = ExpertPools.all_hot(w13, w2)
    for pools in (ExpertPools.all_hot(v13, v2), build_pools(v13, v2, random_row_map(2, 8, 0.5, 1), "cpu")):
        for name in ("w13_hot", "w2_hot", "w13_cold", "w2_cold", "row_map"):
            assert getattr(pools, name).is_contiguous(), name
        for layer in range(2):
            assert torch.equal(torch_experts(pools, layer, x, ids, w), torch_experts(ref, layer, x, ids, w))


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("field", ["w13_hot", "w2_hot", "w13_cold", "w2_cold"])
def test_hand_built_pools_refuse_a_strided_view_naming_it(kind, field):
    w13, w2 = make_weights(1, 4, 32, 16, torch.float32)
    v13, v2 = strided_views(w13, w2, kind)
    parts = {"w13_hot": w13[0].contiguous(), "w2_hot": w2[0].contiguous(),
             "w13_cold": w13[0].contiguous(), "w2_cold": w2[0].contiguous()}
    parts[field] = (v13 if field.startswith("w13") else v2)[0]
    row_map = torch.arange(4, dtype=torch.int32).reshape(1, 4)
    with pytest.raises(ValueError, match=f"ExpertPools.{field}: .* not contiguous"):
        ExpertPools(**parts, row_map=row_map)
    with pytest.raises(ValueError, match="ExpertPools.row_map: .* not contiguous"):
        ExpertPools(w13[0].contiguous(), w2[0].contiguous(), w13[0].contiguous(), w2[0].contiguous(),
                    torch.arange(8, dtype=torch.int32).reshape(1, 8)[:, ::2])


def test_no_test_skips_for_cuda_outside_the_gpu_marker():
    """``pytest -m gpu`` must collect every CUDA-only test: the only skip for a missing CUDA device
    is the one tests/conftest.py applies to tests marked ``gpu``, so no test file asks torch
    whether CUDA is available itself (a skipif there would hide a CUDA test from ``-m gpu``)."""
    from pathlib import Path

    here = Path(__file__).parent
    needle = "cuda." + "is_available"
    offenders = [p.name for p in sorted(here.glob("test_*.py")) if needle in p.read_text()]
    assert offenders == [], f"{offenders}: mark CUDA-only tests @pytest.mark.gpu instead of testing CUDA"


def float64_moe(w13, w2, layer, x, ids, weights):
    """Independent float64 reference on x's device: per selected expert, F.linear in float64 of
    the original ``[L, E, ...]`` tensors (vectorised over tokens, unlike :func:`float64_experts`)."""
    inter = w2.shape[-1]
    xd, wd = x.double(), weights.double()
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, rank = torch.where(ids == e)
        h = F.linear(xd[tok], w13[layer, e].double())
        y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], w2[layer, e].double())
        out.index_add_(0, tok, y * wd[tok, rank, None])
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_bias_statistic_sees_a_half_percent_scale_error(dtype):
    """The bias bound used on the GPU (|bias| < 1e-3) passes the torch path in bf16/fp16 and fails
    the same output scaled by 1.005, which the max-error tolerances (rel_err < 1e-2) pass."""
    w13, w2 = make_weights(1, 16, 64, 48, dtype, seed=2)
    pools = ExpertPools.all_hot(w13, w2)
    x, ids, w = routing(64, 16, 4, 64, dtype, seed=3)
    ref = float64_moe(w13, w2, 0, x, ids, w)
    out = torch_experts(pools, 0, x, ids, w)
    assert abs(signed_bias(out, ref)) < 1e-3
    scaled = (out.double() * 1.005).to(dtype)
    assert rel_err(scaled, ref) < 1e-2  # the max/norm tolerance alone would pass it
    assert signed_bias(scaled, ref) > 3e-3


# vLLM-style grid (tests/kernels/moe/test_moe.py: several E, N, K, top-k, odd sizes):
# (tokens, E, H = K, I = N, top_k).
SHAPE_GRID = [
    (1, 128, 2048, 768, 8),  # Qwen3-30B-A3B decode
    (64, 128, 2048, 768, 8),
    (33, 8, 511, 1024, 2),  # odd K
    (222, 64, 1024, 511, 6),  # odd N, many tokens
    (7, 60, 320, 96, 4),  # E not a power of two
    (300, 16, 128, 128, 1),
]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,E,H,I,K", SHAPE_GRID)
def test_triton_unbiased_against_float64_over_vllm_grid(dtype, tokens, E, H, I, K):
    """The kernel's own arithmetic against an outside reference: max/norm error and the mean signed
    relative error (|bias| < 1e-3: a 0.5% systematic scale error fails), both use_row_map paths and
    a placement with cold rows, on padded-view weights as vLLM builds them."""
    from coldset.kernels.triton_moe import triton_experts

    g = torch.Generator(device="cuda").manual_seed(tokens)  # real-shape weights: drawn on the GPU
    w13 = (torch.randn(1, E, 2 * I, H, generator=g, device="cuda") / H**0.5).to(dtype)
    w2 = (torch.randn(1, E, H, I, generator=g, device="cuda") / I**0.5).to(dtype)
    x, ids, w = routing(tokens, E, K, H, dtype, seed=tokens + 1, device="cuda")
    ref = float64_moe(w13, w2, 0, x, ids, w)
    v13, v2 = strided_views(w13, w2, "padded")
    outs = {"all_hot": triton_experts(ExpertPools.all_hot(v13, v2), 0, x, ids, w, use_row_map=False),
            "placed": triton_experts(build_pools(v13, v2, random_row_map(1, E, 0.5, 7), "cuda"), 0, x, ids, w)}
    assert torch.equal(outs["all_hot"], outs["placed"])
    out = outs["placed"]
    assert torch.isfinite(out).all()
    assert rel_err(out, ref.cpu()) < 1e-2
    assert abs(signed_bias(out, ref)) < 1e-3, signed_bias(out, ref)


@gpu
@pytest.mark.parametrize("kind", LAYOUTS)
def test_triton_on_strided_weights_and_activations(kind):
    """Issue 13's defect: weights given as padded, transposed or sliced views gave relative errors
    above 1 with no error. Pools built from them are contiguous and right; x given as such a view
    gives bitwise the contiguous x's output; a pool field swapped for a view is refused at launch."""
    from coldset.kernels.triton_moe import triton_experts

    E, H, I, K, L = 16, 256, 192, 4, 2
    w13, w2 = make_weights(L, E, H, I, torch.bfloat16, seed=11, device="cuda")
    v13, v2 = strided_views(w13, w2, kind)
    x, ids, w = routing(9, E, K, H, torch.bfloat16, seed=12, device="cuda")
    want = triton_experts(ExpertPools.all_hot(w13, w2), 1, x, ids, w)
    assert rel_err(want, float64_moe(w13, w2, 1, x, ids, w).cpu()) < 1e-2
    for pools in (ExpertPools.all_hot(v13, v2), build_pools(v13, v2, random_row_map(L, E, 0.5, 3), "cuda")):
        assert torch.equal(triton_experts(pools, 1, x, ids, w), want)
    xv = {"padded": torch.nn.functional.pad(x, (0, 24))[:, :H],
          "transposed": x.t().contiguous().t(),
          "sliced": torch.stack([x, torch.zeros_like(x)], 1).flatten(0, 1)[::2]}[kind]
    assert not xv.is_contiguous() and torch.equal(xv, x)
    got = triton_experts(ExpertPools.all_hot(w13, w2), 1, xv, ids, w)
    assert got.is_contiguous() and torch.equal(got, want)
    pools = ExpertPools.all_hot(w13, w2)
    pools.w2_hot = v2.flatten(0, 1)  # a view of the strided weights, bypassing construction
    assert not pools.w2_hot.is_contiguous()
    with pytest.raises(ValueError, match="ExpertPools.w2_hot"):
        triton_experts(pools, 1, x, ids, w)
