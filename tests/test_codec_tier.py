"""The compressed host tier: a slot filled from it holds bitwise what a fill from the raw host tier
copies (bf16, block-FP8 with its float32 scales, MXFP4 with its e8m0 scales; adversarial bit
patterns), the host bytes drop, and an in-place reader refuses it by name."""

import numpy as np
import pytest
import torch

from coldset.core import codec, fp8, mxfp4
from coldset.analysis.placement import row_map_from_mask
from coldset.kernels.compressed_tier import (CompressedTierError, compressed_host_tier, fill_slots,
                                             staging_buffer)
from coldset.kernels.tiers import ExpertPools, host_tier
from interpreter_helpers import run_interpreted

L, E = 2, 3


def gaussian(shape, fan_in, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) / fan_in ** 0.5


def bf16_pools(H=128, I=128, seed=0):
    return ExpertPools.all_hot(gaussian((L, E, 2 * I, H), H, seed).to(torch.bfloat16),
                               gaussian((L, E, H, I), I, seed + 1).to(torch.bfloat16))


def adversarial_pools(H=128, I=128):
    """Experts of bit patterns a codec must keep: every bf16 pattern, NaN payloads, infinities,
    subnormals, signed zeros, all-equal tensors, every exponent."""
    n13, n2 = 2 * I * H, H * I
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    special = torch.tensor([0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x8001, 0x007F, 0x0000, 0x8000],
                           dtype=torch.int32).to(torch.int16)
    exponents = (torch.arange(256, dtype=torch.int32) << 7).to(torch.int16)
    g = torch.Generator().manual_seed(7)
    sources = [every, special, exponents, torch.full((1,), 0x3C80, dtype=torch.int16),
               every[torch.randperm(every.numel(), generator=g)], (torch.randn(999, generator=g) * 1e-3)
               .to(torch.bfloat16).view(torch.int16)]
    w13 = torch.stack([s.repeat(-(-n13 // s.numel()))[:n13] for s in sources]).view(torch.bfloat16)
    w2 = torch.stack([s.flip(0).repeat(-(-n2 // s.numel()))[:n2] for s in sources]).view(torch.bfloat16)
    return ExpertPools.all_hot(w13.reshape(L, E, 2 * I, H), w2.reshape(L, E, H, I))


def fp8_pools(H=256, I=256, seed=2):
    q13, s13 = fp8.quantize_w13(gaussian((L, E, 2 * I, H), H, seed))
    q2, s2 = fp8.quantize_weight(gaussian((L, E, H, I), I, seed + 1))
    return ExpertPools.all_hot(q13, q2, s13, s2)


def mxfp4_pools(H=256, I=256, seed=4):
    b13, s13 = mxfp4.quantize(gaussian((L, E, 2 * I, H), H, seed))
    b2, s2 = mxfp4.quantize(gaussian((L, E, H, I), I, seed + 1))
    return ExpertPools.all_hot(b13.flatten(-2), b2.flatten(-2), s13, s2)


def names_of(pools):
    return ("w13", "w2", "w13_scale", "w2_scale") if pools.has_scales else ("w13", "w2")


def all_hot_on(pools, device):
    """All-hot ``pools``' experts (weights, and scales where they have them) as all-hot pools on ``device``."""
    fields = {n: getattr(pools, f"{n}_hot").reshape(L, E, *getattr(pools, f"{n}_hot").shape[1:]).to(device)
              for n in names_of(pools)}
    return ExpertPools.all_hot(fields["w13"], fields["w2"], fields.get("w13_scale"), fields.get("w2_scale"))


def slot_pools(all_hot):
    """The raw tier's placed pools with half the experts in slots (poisoned), and the host rows each
    slot must receive, in a shuffled order."""
    mask = np.zeros((L, E), dtype=bool)
    mask.reshape(-1)[[4, 0, 5]] = True
    pools = all_hot.placed(row_map_from_mask(mask), host_tier(all_hot))
    for n in names_of(pools):
        getattr(pools, f"{n}_hot").view(torch.uint8).fill_(0xA5)
    return pools


def raw_fill(pools, host_rows, slots):
    for n in names_of(pools):
        hot, cold = getattr(pools, f"{n}_hot"), getattr(pools, f"{n}_cold")
        for r, s in zip(host_rows, slots):
            hot[s].copy_(cold[r])


def bytes_of(pools):
    return [getattr(pools, f"{n}_hot").contiguous().view(-1).view(torch.uint8).clone() for n in names_of(pools)]


@pytest.mark.parametrize("make", [bf16_pools, fp8_pools, mxfp4_pools], ids=["bf16", "fp8", "mxfp4"])
def test_all_hot_on_a_device_holds_every_part_bitwise(make):
    """:func:`all_hot_on` (the GPU tests' copy of the pools to CUDA), here to the CPU: all hot, every
    part bitwise the pools'."""
    pools = make()
    moved = all_hot_on(pools, "cpu")
    assert moved.num_cold == 0 and names_of(moved) == names_of(pools)
    for n, a, b in zip(names_of(pools), bytes_of(moved), bytes_of(pools)):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("make", [bf16_pools, adversarial_pools, fp8_pools, mxfp4_pools],
                         ids=["bf16", "adversarial-bf16", "fp8", "mxfp4"])
def test_a_compressed_fill_writes_bitwise_what_a_raw_fill_copies(make):
    all_hot = make()
    tier = compressed_host_tier(all_hot)
    host_rows, slots = [5, 1, 3], [2, 0, 1]
    raw = slot_pools(all_hot)
    raw_fill(raw, host_rows, slots)
    got = slot_pools(all_hot)
    fill_slots(tier, got, host_rows, slots, staging_buffer(tier, "cpu"))
    for n, a, b in zip(names_of(raw), bytes_of(raw), bytes_of(got)):
        assert torch.equal(a, b), n
    # each slot holds its expert as the unmodified pools hold it (the raw fill is itself right)
    for r, s in zip(host_rows, slots):
        assert torch.equal(got.w13_hot[s].view(torch.uint8), all_hot.w13_hot[r].view(torch.uint8))


def test_gaussian_bf16_and_fp8_tiers_code_their_weights_and_shrink_the_host_bytes():
    """The host bytes are the codec records' (plus at most 15 bytes of alignment per array), so they
    drop by the codec's ratio; at these tiny shapes each part's 8 KiB decode table weighs more than
    at a real expert's (scripts/codec_ratios.py gives the ratios at real shapes)."""
    for pools, most in ((bf16_pools(), 0.86), (fp8_pools(), 0.95)):
        tier = compressed_host_tier(pools)
        raw = host_tier(pools)
        assert tier.raw_nbytes == raw.nbytes
        assert all(p.coded for parts in tier.parts for p in parts if p.name in ("w13", "w2"))
        records = [codec.encode(getattr(pools, f"{n}_hot")[r]) for r in range(L * E) for n in ("w13", "w2")]
        scales = raw.nbytes - sum(getattr(pools, f"{n}_hot").numel() * getattr(pools, f"{n}_hot").element_size()
                                  for n in ("w13", "w2"))
        arrays = 4 * len(records) + (2 * L * E if pools.has_scales else 0)
        assert 0 <= tier.nbytes - sum(r.nbytes for r in records) - scales <= 15 * arrays
        assert tier.nbytes < most * raw.nbytes, (pools.w13_hot.dtype, tier.ratio)
        assert sum(tier.record_bytes(r) for r in range(L * E)) == tier.nbytes
    # FP8's float32 scales are not a codec format: stored raw beside the coded weights
    assert [p.coded for p in compressed_host_tier(fp8_pools()).parts[0]] == [True, True, False, False]


def test_parts_the_codec_would_grow_are_stored_raw():
    """Every-pattern bf16 has uniform exponents: coding it costs more than its bytes, so it is stored raw."""
    tier = compressed_host_tier(adversarial_pools())
    coded = [[p.coded for p in parts] for parts in tier.parts]
    assert coded[0] == [False, False] and coded[3] == [True, True]  # every pattern raw, all-equal coded
    assert tier.record_bytes(0) == tier.raw_nbytes // (L * E)  # stored as it is, no overhead
    assert tier.record_bytes(3) < 0.75 * tier.record_bytes(0)  # the raw plane (sign, mantissa) stays


def test_in_place_readers_and_mismatched_fills_are_refused_by_name():
    all_hot = bf16_pools()
    tier = compressed_host_tier(all_hot)
    mask = np.zeros((L, E), dtype=bool)
    mask[0, 0] = True
    with pytest.raises(CompressedTierError, match="cannot be read in place"):
        all_hot.placed(row_map_from_mask(mask), tier)
    other = slot_pools(bf16_pools(H=64, I=128))
    with pytest.raises(CompressedTierError, match="part w13"):
        fill_slots(tier, other, [0], [0])
    with pytest.raises(CompressedTierError, match="scales"):
        fill_slots(compressed_host_tier(fp8_pools()), slot_pools(bf16_pools(H=256, I=256)), [0], [0])
    pools = slot_pools(all_hot)
    with pytest.raises(CompressedTierError, match="out of range"):
        fill_slots(tier, pools, [L * E], [0])
    with pytest.raises(CompressedTierError, match="staging"):
        fill_slots(tier, pools, [0], [0], torch.empty((2, tier.max_record_bytes - 1), dtype=torch.uint8))
    with pytest.raises(ValueError, match="all-hot"):
        compressed_host_tier(pools)


_INTERPRETED = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_codec_tier import adversarial_pools, bf16_pools
from coldset.kernels.compressed_tier import compressed_host_tier
from coldset.kernels.triton_codec import decode_into
for make, rows in ((bf16_pools, (4,)), (adversarial_pools, (3, 5))):
    pools = make()
    tier = compressed_host_tier(pools, lane_symbols=64)
    assert all(part.coded for row in rows for part in tier.parts[row])
    for row in rows:
        rec = tier.data[tier.starts[row]:tier.starts[row + 1]].clone()
        for part in tier.parts[row]:
            want = getattr(pools, part.name + "_hot")[row]
            if not part.coded:
                continue
            out = torch.empty_like(want)
            out.view(torch.uint8).fill_(0xA5)
            decode_into(part.record(rec), out)
            assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), (make.__name__, row, part.name)
print("INTERPRETED OK")
"""


def test_triton_decoder_fills_from_the_tiers_records_under_the_interpreter():
    """The records as the CUDA fill reads them (views of one expert's staged bytes) through the Triton
    decoder under Triton's interpreter, into poisoned outputs: every byte of every coded part (bf16
    experts; the one-byte path's interpreter test is tests/test_codec.py's)."""
    run_interpreted(_INTERPRETED)


@pytest.mark.gpu
@pytest.mark.parametrize("make", [bf16_pools, adversarial_pools, fp8_pools, mxfp4_pools],
                         ids=["bf16", "adversarial-bf16", "fp8", "mxfp4"])
def test_a_compressed_fill_on_the_gpu_is_bitwise_the_raw_fill_and_replays_in_a_graph(make):
    cpu = make()
    all_hot = all_hot_on(cpu, "cuda")
    tier = compressed_host_tier(all_hot)
    assert tier.pinned and tier.data.is_pinned()
    host_rows, slots = [5, 1, 3], [2, 0, 1]
    raw = slot_pools(all_hot)
    raw_fill(raw, host_rows, slots)
    got = slot_pools(all_hot)
    staging = staging_buffer(tier, "cuda")
    fill_slots(tier, got, host_rows, slots, staging)
    torch.cuda.synchronize()
    for n, a, b in zip(names_of(raw), bytes_of(raw), bytes_of(got)):
        assert torch.equal(a, b), n
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fill_slots(tier, got, host_rows, slots, staging)
    for n in names_of(got):
        getattr(got, f"{n}_hot").view(torch.uint8).fill_(0xA5)
    graph.replay()
    torch.cuda.synchronize()
    for n, a, b in zip(names_of(raw), bytes_of(raw), bytes_of(got)):
        assert torch.equal(a, b), n
