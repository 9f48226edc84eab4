"""Expert pools: placement of weights by the row map, checked host allocation, row-map validation
before any launch, and placement switches (a row-map write, or a move of weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coldset.kernels.tiers import ExpertPools, PoolAllocationError, build_pools, check_host_allocation

L, E, H, I = 2, 4, 8, 6


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, E, 2 * I, H, generator=g), torch.randn(L, E, H, I, generator=g)


def mixed_map():
    # layer 0: experts 0, 2 hot; 1, 3 cold. layer 1: 1 hot, others cold; rows shuffled.
    return np.array([[2, -3, 0, -1], [-2, 1, -4, -5]], dtype=np.int32)


def test_build_pools_puts_each_expert_in_its_row():
    w13, w2 = weights()
    pools = build_pools(w13, w2, mixed_map(), "cpu")
    assert (pools.num_hot, pools.num_cold) == (3, 5)
    assert pools.row_map.dtype == torch.int32 and pools.row_map.tolist() == mixed_map().tolist()
    for layer in range(L):
        for expert in range(E):
            a, b = pools.expert_weights(layer, expert)
            assert torch.equal(a, w13[layer, expert]) and torch.equal(b, w2[layer, expert])
    assert torch.equal(pools.w13_hot[2], w13[0, 0]) and torch.equal(pools.w13_cold[4], w13[1, 3])


def test_all_hot_is_module_order():
    w13, w2 = weights()
    pools = ExpertPools.all_hot(w13, w2)
    assert pools.row_map.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and pools.num_cold == 0
    assert torch.equal(pools.expert_weights(1, 2)[0], w13[1, 2])


@pytest.mark.parametrize("row_map,match", [
    (np.array([[0, 1, 2, 3], [4, 5, 6, 8]], dtype=np.int32), "outside the pools|out of range"),
    (np.array([[0, 1, 2, 3], [4, 5, 6, -1]], dtype=np.int32), "outside the pools|out of range"),
    (np.array([[0, 1, 2, 3], [4, 5, 6, 6]], dtype=np.int32), "more than once"),
    (np.array([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=np.int64), "int32"),
    (np.array([[0, 1, 2, 3, 4, 5, 6, 7]], dtype=np.int32), "shape"),
])
def test_bad_row_maps_are_refused_before_anything_is_written(row_map, match):
    w13, w2 = weights()
    pools = ExpertPools.all_hot(w13, w2)
    before = pools.row_map.clone()
    with pytest.raises(ValueError, match=match):
        pools.set_row_map(torch.as_tensor(row_map))
    assert torch.equal(pools.row_map, before)
    with pytest.raises(ValueError, match=match):
        build_pools(w13, w2, row_map, "cpu", num_hot=8, num_cold=0)


def test_build_pools_refuses_out_of_range_rows_of_explicit_pool_sizes():
    w13, w2 = weights()
    with pytest.raises(ValueError, match="outside the pools|out of range"):
        build_pools(w13, w2, mixed_map(), "cpu", num_hot=2, num_cold=6)


def test_direct_write_to_row_map_is_caught_before_a_launch():
    w13, w2 = weights()
    pools = ExpertPools.all_hot(w13, w2)
    pools.ensure_validated()  # valid: no error
    pools.row_map[0, 0] = 99  # bypasses set_row_map
    with pytest.raises(ValueError, match="outside the pools|out of range"):
        pools.ensure_validated()


def test_allocation_check_fails_early_with_both_sizes():
    w13, w2 = weights()
    need = 5 * (2 * I * H + H * I) * 4  # the cold pool of mixed_map in float32
    with pytest.raises(PoolAllocationError) as err:
        build_pools(w13, w2, mixed_map(), "cpu", host_available_bytes=need - 1)
    msg = str(err.value)
    assert f"({need + 3 * (2 * I * H + H * I) * 4} bytes)" in msg  # on CPU hot rows are host memory too
    assert f"({need - 1} bytes)" in msg
    with pytest.raises(PoolAllocationError, match="needs 1024.00 GiB"):
        check_host_allocation(1024 * 2**30, "pinned cold pool", available=2**30)
    check_host_allocation(10, "tiny")  # the real host has 10 bytes


def test_apply_placement_moves_weights_and_keeps_outputs():
    from coldset.kernels import torch_experts

    w13, w2 = weights()
    pools = build_pools(w13, w2, mixed_map(), "cpu")
    addr = (pools.w13_hot.data_ptr(), pools.w13_cold.data_ptr(), pools.row_map.data_ptr())
    x = torch.randn(3, H)
    ids = torch.tensor([[0, 1], [2, 3], [1, 3]])
    w = torch.full((3, 2), 0.5)
    before = [torch_experts(pools, layer, x, ids, w) for layer in range(L)]
    new = np.array([[-1, 0, -2, -3], [1, -4, 2, -5]], dtype=np.int32)  # same pool sizes, other experts
    pools.apply_placement(new)
    assert (pools.w13_hot.data_ptr(), pools.w13_cold.data_ptr(), pools.row_map.data_ptr()) == addr
    assert pools.row_map.tolist() == new.tolist()
    for layer in range(L):
        assert torch.equal(torch_experts(pools, layer, x, ids, w), before[layer])
        for expert in range(E):
            assert torch.equal(pools.expert_weights(layer, expert)[1], w2[layer, expert])
