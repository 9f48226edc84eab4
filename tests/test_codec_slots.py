"""The slot cache over the compressed host tier (CPU): the same decisions, the same slot bytes after
every group and the same experts' output rows, bitwise, as over the raw host tier, for bf16 and
block-FP8 pools (weights decoded, FP8 scales stored raw); and a CUDA cache refuses a tier built for
CPU experts by name (the CUDA cache over the compressed tier: tests/test_codec_fill.py)."""

import numpy as np
import pytest
import torch

from coldset.core import fp8
from coldset.engine.cache.pool import SlotCache
from coldset.kernels.compressed_tier import CompressedTierError, compressed_host_tier
from coldset.kernels.reference import torch_experts
from coldset.kernels.tiers import ExpertPools, host_tier
from expert_helpers import warm_map

L, E, HOT, K, T = 2, 6, 3, 3, 2  # 3 slots a layer's worth: K * T = 6 = C


def gaussian(shape, fan_in, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) / fan_in ** 0.5


def bf16_pools(H=128, I=128):
    return ExpertPools.all_hot(gaussian((L, E, 2 * I, H), H, 0).to(torch.bfloat16),
                               gaussian((L, E, H, I), I, 1).to(torch.bfloat16))


def fp8_pools(H=384, I=256):
    q13, s13 = fp8.quantize_w13(gaussian((L, E, 2 * I, H), H, 2))
    q2, s2 = fp8.quantize_weight(gaussian((L, E, H, I), I, 3))
    return ExpertPools.all_hot(q13, q2, s13, s2)


def slot_bytes(pools):
    names = ("w13", "w2", "w13_scale", "w2_scale") if pools.has_scales else ("w13", "w2")
    return [getattr(pools, f"{n}_hot").view(-1).view(torch.uint8).clone() for n in names]


@pytest.mark.parametrize("make", [bf16_pools, fp8_pools], ids=["bf16", "fp8"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_cache_over_the_compressed_tier_decides_fills_and_computes_bitwise_as_over_the_raw_tier(make, policy):
    all_hot = make()
    host = host_tier(all_hot)
    tier = compressed_host_tier(all_hot)
    assert all(p.coded for parts in tier.parts for p in parts if p.name in ("w13", "w2"))
    raw = SlotCache.build(all_hot, host, warm_map(L, E, HOT), np.arange(L * HOT, dtype=float), policy, T, K)
    coded = SlotCache.build(all_hot, host, warm_map(L, E, HOT), np.arange(L * HOT, dtype=float), policy, T, K,
                            compressed=tier)
    gen = torch.Generator().manual_seed(5)
    hidden = all_hot.w2_hot.shape[1]
    for step in range(4):
        x = torch.randn(T, hidden, generator=gen).to(torch.bfloat16)
        weights = torch.softmax(torch.randn(T, K, generator=gen), dim=-1)
        for layer in range(L):
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
            for cache in (raw, coded):
                cache.admit(layer, ids)
            assert torch.equal(raw.pools.row_map, coded.pools.row_map) and torch.equal(raw.owner, coded.owner)
            for a, b in zip(slot_bytes(raw.pools), slot_bytes(coded.pools)):
                assert torch.equal(a, b), (step, layer)
            out = [torch_experts(c.pools, layer, x, ids, weights.to(torch.bfloat16)) for c in (raw, coded)]
            assert torch.equal(out[0].view(torch.int16), out[1].view(torch.int16))
    assert raw.counters() == coded.counters() and coded.counters()["fills"] > 0
    coded.check(contents=True)  # every slot holds its owner's host row
    coded.reset()  # the warm refill decodes too
    raw.reset()
    for a, b in zip(slot_bytes(raw.pools), slot_bytes(coded.pools)):
        assert torch.equal(a, b)


def test_a_compressed_tier_of_other_experts_is_refused_at_build():
    all_hot = bf16_pools()
    other = compressed_host_tier(bf16_pools(H=64, I=128))
    with pytest.raises(CompressedTierError, match="part w13"):
        SlotCache.build(all_hot, host_tier(all_hot), warm_map(L, E, HOT), np.ones(L * HOT), "lru", T, K,
                        compressed=other)


@pytest.mark.gpu
def test_a_cuda_cache_refuses_a_compressed_tier_built_for_cpu_experts_by_name():
    """The descriptor tables live on the experts' device: a tier built from CPU experts cannot serve
    the device-listed fills of a CUDA cache."""
    cpu = bf16_pools()
    all_hot = ExpertPools.all_hot(cpu.w13_hot.reshape(L, E, *cpu.w13_hot.shape[1:]).cuda(),
                                  cpu.w2_hot.reshape(L, E, *cpu.w2_hot.shape[1:]).cuda())
    with pytest.raises(CompressedTierError, match="built for experts on cpu"):
        SlotCache.build(all_hot, host_tier(all_hot), warm_map(L, E, HOT), np.ones(L * HOT), "lru", T, K,
                        compressed=compressed_host_tier(cpu))
