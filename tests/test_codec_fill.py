"""Compressed slot fills listed on the device (coldset.kernels.triton_codec_fill): the tier's descriptor
tables against the records they describe, the fill under Triton's interpreter bitwise a row copy from
the raw tier (bf16, adversarial bf16, block-FP8 with its scales, MXFP4 with its scales; fewer filled
rows than listed lanes), and on CUDA a slot cache over the compressed tier bitwise the raw tier's
(the same decisions, the same slots, the captured step's logits)."""

import numpy as np
import pytest
import torch

from coldset.core import codec, mxfp4
from coldset.kernels.compressed_tier import compressed_host_tier
from coldset.kernels.tiers import ExpertPools
from interpreter_helpers import run_interpreted
from test_codec_tier import L, E, adversarial_pools, all_hot_on, bf16_pools, fp8_pools, gaussian
from test_slots import graphed_model  # noqa: F401 (pytest fixture: the synthetic model the slot tests capture)


def sparse_mxfp4_pools(H=256, I=128, seed=6):
    """MXFP4 experts whose e2m1 codes are mostly zero (nine weights in ten zeroed before the
    quantization): the codec codes their weight bytes, so the fill decodes one-byte parts."""
    def draw(shape, fan_in, s):
        w = gaussian(shape, fan_in, s)
        keep = torch.rand(*shape, generator=torch.Generator().manual_seed(s + 50)) < 0.1
        return w * keep

    b13, s13 = mxfp4.quantize(draw((L, E, 2 * I, H), H, seed))
    b2, s2 = mxfp4.quantize(draw((L, E, H, I), I, seed + 1))
    return ExpertPools.all_hot(b13.flatten(-2), b2.flatten(-2), s13, s2)


@pytest.mark.parametrize("make", [bf16_pools, adversarial_pools, fp8_pools, sparse_mxfp4_pools],
                         ids=["bf16", "adversarial-bf16", "fp8", "mxfp4"])
def test_descriptor_tables_locate_every_record_and_part(make):
    """Each row's record table entry spans exactly its record's bytes; each part's descriptor leads,
    read from the table alone, to arrays the torch decoder turns back into the expert's bytes (coded)
    or to the expert's bytes themselves (stored raw)."""
    pools = make()
    tier = compressed_host_tier(pools, lane_symbols=64)
    records, parts = tier.record_table.numpy(), tier.part_table.numpy()
    assert records.shape == (L * E, 2) and parts.shape == (L * E, len(pools.expert_parts), 5)
    assert records[0, 0] == 0 and (records[1:, 0] == records[:-1].sum(axis=1)).all()
    assert records[:, 1].sum() * 8 == tier.data.numel()
    data = tier.data
    for row in range(L * E):
        rec = data[records[row, 0] * 8:(records[row, 0] + records[row, 1]) * 8]
        for p, name in enumerate(pools.expert_parts):
            want = getattr(pools, f"{name}_hot")[row]
            coded, a, b, c, d = (int(v) for v in parts[row, p])
            if coded:
                n = want.numel()
                lanes = tier.part_lanes[p]
                words = rec[a:].view(torch.int32)
                lane_words = rec[b:b + 4 * (lanes + 1)].view(torch.int32)
                num_words = int(lane_words[-1])
                raw = None if d < 0 else rec[d:d + n]
                got = codec.decode(codec.Compressed(tuple(want.shape), want.dtype, n, lanes, num_words,
                                                    words[:num_words + 1], lane_words,
                                                    rec[c:c + 2 * (1 << codec.MAX_CODE_BITS)].view(torch.int16), raw))
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (row, name)
            else:
                nbytes = want.numel() * want.element_size()
                assert torch.equal(rec[a:a + nbytes], want.reshape(-1).view(torch.uint8)), (row, name)
    coded_parts = {name for row in tier.parts for name, part in zip(pools.expert_parts, row) if part.coded}
    assert coded_parts, "no coded part: the descriptors' coded path went untested"


_INTERPRETED = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_codec_tier import adversarial_pools, bf16_pools, bytes_of, fp8_pools, names_of, raw_fill, slot_pools
from test_codec_fill import sparse_mxfp4_pools
from coldset.kernels import triton_slots
from coldset.kernels.compressed_tier import compressed_host_tier
from coldset.kernels.triton_codec_fill import ListedFill, fill_listed

# four lanes listed, three filled: the fourth (slot 0 <- row 0) must not write
host_rows, slots, m = [5, 1, 3, 0], [2, 0, 1, 0], 3
for make in (bf16_pools, adversarial_pools, fp8_pools, sparse_mxfp4_pools):
    all_hot = make()
    tier = compressed_host_tier(all_hot, lane_symbols=64)
    coded = {p.name for row in tier.parts for p in row if p.coded}
    stored = {p.name for row in tier.parts for p in row if not p.coded}
    assert coded, make.__name__  # the decode in every format (adversarial, fp8, mxfp4: raw parts beside)
    assert stored or make is bf16_pools, make.__name__
    want = slot_pools(all_hot)
    raw_fill(want, host_rows[:m], slots[:m])
    got = slot_pools(all_hot)
    staging = torch.empty((4, -(-tier.max_record_bytes // 16) * 16), dtype=torch.uint8)
    done = torch.full((all_hot.num_hot,), -1, dtype=torch.int64)
    ticket = torch.zeros(1, dtype=torch.int32)
    tags = torch.tensor([11, 12, 13, 14])
    # one block: 8 decode programs, fewer than the work items (each program takes several)
    fill_listed(tier, got, torch.tensor(slots), torch.tensor(host_rows), torch.tensor(m), staging, blocks=1,
                tags=(tags, done, ticket))
    for n, a, b in zip(names_of(want), bytes_of(want), bytes_of(got)):
        assert torch.equal(a, b), (make.__name__, n)
    assert done[[2, 0, 1]].tolist() == [11, 12, 13] and int(ticket) == 0, (done, ticket)
    if make is not adversarial_pools:
        print(make.__name__, "coded", sorted(coded), "stored", sorted(stored))
        continue
    # the raw fill's dispatch: pools carrying a listed fill decode through it
    via = slot_pools(all_hot)
    via.compressed_fill = ListedFill(tier, 4)
    triton_slots.fill(via, torch.tensor(slots), torch.tensor(host_rows), torch.tensor(m), blocks=3)
    for n, a, b in zip(names_of(want), bytes_of(want), bytes_of(via)):
        assert torch.equal(a, b), ("dispatch", make.__name__, n)
print("INTERPRETED OK")
"""


def test_listed_fill_under_the_interpreter_is_bitwise_the_row_copy_and_tags_after_landing():
    """The record copy and decode launches under Triton's interpreter, from device lists with fewer
    filled rows than listed lanes, into poisoned slots: every byte of every part (coded and stored
    raw, weights and scales) as the raw tier's row copy; the masked lane writes nothing; the tags of
    the filled slots land and the ticket is back to zero; and triton_slots.fill on pools carrying a
    listed fill dispatches to it."""
    run_interpreted(_INTERPRETED)


# ------------------------------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("make", [bf16_pools, adversarial_pools, fp8_pools, sparse_mxfp4_pools],
                         ids=["bf16", "adversarial-bf16", "fp8", "mxfp4"])
def test_listed_fill_on_cuda_is_bitwise_the_raw_fill_and_replays_in_a_graph(make):
    from coldset.kernels import triton_slots
    from coldset.kernels.triton_codec_fill import ListedFill
    from test_codec_tier import bytes_of, names_of, slot_pools

    cpu = make()
    all_hot = all_hot_on(cpu, "cuda")
    tier = compressed_host_tier(all_hot, lane_symbols=64)
    assert tier.pinned and tier.record_table.is_cuda
    slots, rows = torch.tensor([2, 0, 1, 0], device="cuda"), torch.tensor([5, 1, 3, 0], device="cuda")
    count = torch.tensor(3, device="cuda")
    raw = slot_pools(all_hot)
    triton_slots.fill(raw, slots, rows, count)
    got = slot_pools(all_hot)
    got.compressed_fill = ListedFill(tier, 4)
    triton_slots.fill(got, slots, rows, count)
    torch.cuda.synchronize()
    for n, a, b in zip(names_of(raw), bytes_of(raw), bytes_of(got)):
        assert torch.equal(a, b), n
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_slots.fill(got, slots, rows, count)
    for n in names_of(got):
        getattr(got, f"{n}_hot").view(torch.uint8).fill_(0xA5)
    count.fill_(3)
    graph.replay()
    torch.cuda.synchronize()
    for n, a, b in zip(names_of(raw), bytes_of(raw), bytes_of(got)):
        assert torch.equal(a, b), n


def _graphed_runs(model, policy, tier, bsz=2, residency=0.25, steps=12, depth=1):
    """The captured decode step (one CUDA graph a step) through a slot cache of ``policy`` over the raw
    tier and over ``tier`` (compressed), beside the unmodified path: per run (cache, logits, group
    history, row map), and the reference logits."""
    from coldset.analysis.placement import hot_count_for_residency
    from coldset.engine.cache.pool import SlotCache
    from coldset.kernels.tiers import host_tier
    from test_slots import _warm, graphed_runner

    cfg = model.config
    L_, E_, k = cfg.num_moe_layers, cfg.num_experts, cfg.top_k
    run, recording, ref_fn, rowmap_fn = graphed_runner(model, bsz, steps)

    all_hot = model.pools
    out = {}
    try:
        ref, routing = run(recording, all_hot)
        counts = np.random.default_rng(3).integers(0, 20, size=(L_, E_)).astype(np.float64)
        row_map, _, wc = _warm(counts, hot_count_for_residency(residency, L_ * E_))
        extra = {}
        if policy == "lookahead":
            extra = dict(routers=[model.layers[i].mlp.gate.weight.detach() for i in cfg.moe_layers], depth=depth)
        if policy == "nexttoken":  # fitted on the run's own routing, without the gate: prefetches are issued
            from coldset.analysis.forecast import NextTokenForecaster

            S, _, B, _ = routing.shape
            extra = dict(forecaster=NextTokenForecaster.fit(routing.transpose(2, 0, 1, 3).reshape(-1, L_, k),
                                                            np.repeat(np.arange(B), S), k, E_, terms=((0, 0),),
                                                            weights=(1.0,), extra=1), prefetch_gate=False)
        for name, compressed in (("raw", None), ("compressed", tier)):
            cache = SlotCache.build(all_hot, host_tier(all_hot), row_map, wc, policy, bsz, k,
                                    history=(steps + 8) * L_, compressed=compressed, **extra)
            logits, _ = run(cache.wrap(rowmap_fn), cache.pools, cache)
            cache.check(contents=True)
            out[name] = (cache, logits, cache.group_history(), cache.pools.row_map.cpu().clone())
    finally:
        model.pools, model.experts_fn = all_hot, ref_fn
    return out, ref


@pytest.mark.gpu
@pytest.mark.parametrize("policy,bsz", [("lru", 1), ("lru", 2), ("lfu", 2), ("lookahead", 2), ("nexttoken", 2)])
def test_a_graphed_cache_over_the_compressed_tier_decides_and_computes_as_over_the_raw_tier(graphed_model, policy,
                                                                                          bsz):
    """The bench's captured step through a CUDA slot cache whose fills decode the compressed tier
    inside the graph: every step's logits bitwise the unmodified path's, the per-group hits, misses
    and fills and the final row map those of the same cache over the raw tier, every slot holding
    its owner's host row (``check(contents=True)``), and fills happened."""
    model = graphed_model
    tier = compressed_host_tier(model.pools)
    assert any(p.coded for row in tier.parts for p in row), "nothing coded: the decode went untested"
    out, ref = _graphed_runs(model, policy, tier, bsz=bsz)
    (raw, raw_logits, raw_hist, raw_map), (comp, logits, hist, rmap) = out["raw"], out["compressed"]
    assert comp.compressed is tier and raw.compressed is None
    # every built-in policy records its groups in the router's launch over either tier
    assert comp.records_in_route(bsz) and raw.records_in_route(bsz)
    for s, (a, b, c) in enumerate(zip(logits, raw_logits, ref)):
        assert torch.equal(a, c) and torch.equal(b, c), f"step {s + 1}: logits differ from the unmodified path's"
    np.testing.assert_array_equal(hist, raw_hist)
    assert torch.equal(rmap, raw_map)
    assert hist[:, 2].sum() > 0, "no fill: the compressed path went untested"

