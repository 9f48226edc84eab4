"""``python -m coldset.measure.codec``: the lossless expert codec on one CUDA GPU: ratio, decoder rate
against the host link, alone and beside a matmul stream (the step's compute).

Weights are drawn as trained experts' are distributed (Gaussian, std ``1 / sqrt(fan_in)``, the
scale of Qwen3-30B-A3B's expert weights; block-FP8 as :func:`coldset.core.fp8.quantize_weight`
quantizes those), at Qwen3-30B-A3B's expert shape (w13 ``[2I, H]`` + w2 ``[H, I]``, H=2048,
I=768). Per format and lane length: the round trip checked bit for bit on a poisoned output first,
then the decoder's median time (CUDA events over graph replays, :func:`coldset.core.timing.graph_time_us`)
for 1 and 8 experts in one launch, as decoded bytes a second, over the pinned host-to-device copy
rate of the raw bytes measured in the same run (the link), and, with a bf16 matmul stream running
on another CUDA stream, the same decode's time again, from a stream of the default priority and
from a high-priority one (its blocks scheduled ahead of the matmul's queued ones); and a layer's
misses (8 experts) filled into
slots raw from pinned memory against compressed (copy of the next expert beside the decode of the
one before): the link's useful rate multiplied; and the same through the host tiers themselves
(:func:`coldset.kernels.compressed_tier.fill_slots` against row copies from the raw tier), and as the
captured decode step fills them, from lists on the device (:func:`coldset.kernels.triton_slots.fill`
reading the raw tier in place against :func:`coldset.kernels.triton_codec_fill.fill_listed` copying
the records into staging and decoding them). Prints the tables last; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from coldset.core import codec, fp8
from coldset.core.timing import graph_time_us
from coldset.kernels.compressed_tier import compressed_host_tier, fill_slots, staging_buffer
from coldset.kernels.tiers import ExpertPools, host_tier

H, I = 2048, 768


def expert_weights(n_experts: int, fmt: str, gen: torch.Generator) -> torch.Tensor:
    """``n_experts`` experts' weights, flat, in ``fmt`` (``bf16`` or ``fp8``), on the GPU."""
    w13 = torch.randn(n_experts, 2 * I, H, generator=gen, device="cuda") / math.sqrt(H)
    w2 = torch.randn(n_experts, H, I, generator=gen, device="cuda") / math.sqrt(I)
    if fmt == "bf16":
        return torch.cat([w13.reshape(-1), w2.reshape(-1)]).to(torch.bfloat16)
    q13 = [fp8.quantize_weight(w)[0].reshape(-1) for w in w13]
    q2 = [fp8.quantize_weight(w)[0].reshape(-1) for w in w2]
    return torch.cat(q13 + q2)


def link_gb_s(nbytes: int, reps: int = 20) -> float:
    """Pinned host-to-device copy rate of ``nbytes`` (median of ``reps`` timed copies), GB/s."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times[3:]) / 1e9


def decode_us_beside_matmul(record, out, reps: int, priority: int = 0) -> float:
    """The decode's median time (µs, events on its own stream, of CUDA ``priority``: -1 is torch's
    high one) while a bf16 matmul loop runs on another (of the default priority)."""
    from coldset.kernels.triton_codec import decode_into  # GPU only: triton

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream(priority=priority)
    times = []
    for _ in range(reps):
        for _ in range(4):
            a @ a  # keeps the SMs busy while the decode runs beside it
        with torch.cuda.stream(side):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(side)
            decode_into(record, out)
            end.record(side)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def pinned(record: codec.Compressed) -> codec.Compressed:
    """``record`` with its tensors in pinned host memory (the compressed host tier)."""
    def pin(t):
        return None if t is None else t.cpu().pin_memory()

    return codec.Compressed(record.shape, record.dtype, record.numel, record.num_lanes, record.num_words, pin(record.words),
                            pin(record.lane_words), pin(record.table), pin(record.raw))


def fill_ms(fmt: str, experts: int, reps: int, gen: torch.Generator) -> dict:
    """A layer's misses filled into slots: ``experts`` experts copied raw from pinned memory, against
    their compressed records copied and decoded, expert by expert, the copy of the next beside the
    decode of the one before (two streams). Medians of ``reps``, ms; the decoded slots checked."""
    from coldset.kernels.triton_codec import decode_into  # GPU only: triton

    weights = [expert_weights(1, fmt, gen) for _ in range(experts)]
    host_raw = [w.cpu().pin_memory() for w in weights]
    host = [pinned(codec.encode(w)) for w in weights]
    staged = [r.to("cuda") for r in host]
    slots = [torch.empty_like(w) for w in weights]
    copy_stream, decode_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def raw_fill():
        with torch.cuda.stream(copy_stream):
            for slot, src in zip(slots, host_raw):
                slot.copy_(src, non_blocking=True)

    def compressed_fill():
        for dst, src, slot in zip(staged, host, slots):
            with torch.cuda.stream(copy_stream):
                for name in ("words", "lane_words", "table", "raw"):
                    if getattr(src, name) is not None:
                        getattr(dst, name).copy_(getattr(src, name), non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(copy_stream)
            with torch.cuda.stream(decode_stream):
                decode_stream.wait_event(copied)
                decode_into(dst, slot)

    def timed(fn) -> float:
        times = []
        for _ in range(reps + 2):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy_stream.wait_stream(torch.cuda.current_stream())
            decode_stream.wait_stream(torch.cuda.current_stream())
            fn()
            torch.cuda.current_stream().wait_stream(copy_stream)
            torch.cuda.current_stream().wait_stream(decode_stream)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times[2:])

    for slot in slots:
        slot.view(torch.uint8).fill_(0xA5)
    compressed_ms = timed(compressed_fill)
    exact = all(torch.equal(s.view(torch.uint8), w.view(torch.uint8)) for s, w in zip(slots, weights))
    raw_ms = timed(raw_fill)
    raw_bytes = sum(w.numel() * w.element_size() for w in weights)
    return {"format": fmt, "experts": experts, "exact": exact, "raw_fill_ms": raw_ms,
            "compressed_fill_ms": compressed_ms, "link_multiplier": raw_ms / compressed_ms,
            "ratio": sum(r.nbytes for r in host) / raw_bytes}


def tier_fill_ms(fmt: str, experts: int, reps: int, gen: torch.Generator) -> dict:
    """A layer's misses through the real tiers: ``experts`` slots filled from the raw pinned host tier
    (row copies) against :func:`coldset.kernels.compressed_tier.fill_slots` from the compressed tier
    (its two-stream staging). Medians of ``reps``, ms; the slots checked against the raw fill's."""
    w13 = torch.randn(1, 2 * experts, 2 * I, H, generator=gen, device="cuda") / math.sqrt(H)
    w2 = torch.randn(1, 2 * experts, H, I, generator=gen, device="cuda") / math.sqrt(I)
    if fmt == "bf16":
        all_hot = ExpertPools.all_hot(w13.to(torch.bfloat16), w2.to(torch.bfloat16))
    else:
        (q13, s13), (q2, s2) = fp8.quantize_w13(w13), fp8.quantize_weight(w2)
        all_hot = ExpertPools.all_hot(q13, q2, s13, s2)
    del w13, w2
    host, tier = host_tier(all_hot), compressed_host_tier(all_hot)
    hot = torch.arange(2 * experts).reshape(1, -1) < experts  # experts 0..n-1 in slots, the rest filled in
    ids = torch.arange(2 * experts).reshape(1, -1)
    row_map = torch.where(hot, ids, experts - ids - 1).to(torch.int32)  # placement encoding: cold -1..-n
    pools = all_hot.placed(row_map, host)
    names = pools.expert_parts
    rows, slots = list(range(experts, 2 * experts)), list(range(experts))
    staging = staging_buffer(tier, "cuda")

    def raw_fill():
        for n in names:
            for r, slot in zip(rows, slots):
                getattr(pools, f"{n}_hot")[slot].copy_(getattr(pools, f"{n}_cold")[r], non_blocking=True)

    def timed(fn) -> tuple[float, list[torch.Tensor]]:
        times = []
        for _ in range(reps + 2):
            for n in names:
                getattr(pools, f"{n}_hot").view(torch.uint8).fill_(0xA5)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times[2:]), [getattr(pools, f"{n}_hot").view(torch.uint8).clone() for n in names]

    raw_ms, want = timed(raw_fill)
    compressed_ms, got = timed(lambda: fill_slots(tier, pools, rows, slots, staging))
    listed = listed_fill_ms(tier, pools, rows, slots, timed)
    return {"format": fmt, "experts": experts, "exact": all(torch.equal(a, b) for a, b in zip(want, got))
            and all(torch.equal(a, b) for a, b in zip(want, listed.pop("slots"))),
            "raw_fill_ms": raw_ms, "compressed_fill_ms": compressed_ms, "link_multiplier": raw_ms / compressed_ms,
            "ratio": tier.ratio, "host_tier_bytes": host.nbytes, "compressed_tier_bytes": tier.nbytes, **listed}


def listed_fill_ms(tier, pools, rows: list[int], slots: list[int], timed) -> dict:
    """The same fills as the captured step makes them, from device lists: the raw tier's rows read in
    place by :func:`coldset.kernels.triton_slots.fill` against
    :func:`coldset.kernels.triton_codec_fill.fill_listed` (records into HBM staging, then the decode
    launch); ``timed`` as :func:`tier_fill_ms`'s. The compressed fill's slots are returned for the check."""
    from coldset.kernels import triton_slots  # GPU only: triton
    from coldset.kernels.triton_codec_fill import fill_listed  # GPU only: triton

    dev_slots, dev_rows = torch.tensor(slots, device="cuda"), torch.tensor(rows, device="cuda")
    count = torch.tensor(len(rows), device="cuda")
    staging = torch.empty((len(rows), -(-tier.max_record_bytes // 16) * 16), dtype=torch.uint8, device="cuda")
    kernel_ms, _ = timed(lambda: triton_slots.fill(pools, dev_slots, dev_rows, count))
    listed_ms, got = timed(lambda: fill_listed(tier, pools, dev_slots, dev_rows, count, staging))
    return {"kernel_raw_fill_ms": kernel_ms, "listed_fill_ms": listed_ms,
            "listed_link_multiplier": kernel_ms / listed_ms, "slots": got}


def measure(fmt: str, lane_symbols: int, experts: int, reps: int, gen: torch.Generator) -> dict:
    """One row: ratio, exactness, decode rate alone and beside a matmul, over the link's rate."""
    from coldset.kernels.triton_codec import decode_into  # GPU only: triton

    weights = expert_weights(experts, fmt, gen)
    record = codec.encode(weights, lane_symbols=lane_symbols)
    out = torch.empty_like(weights)
    out.view(torch.uint8).fill_(0xA5)  # poisoned: an element the decoder skips shows
    decode_into(record, out)
    torch.cuda.synchronize()
    exact = bool(torch.equal(out.view(torch.uint8), weights.view(torch.uint8)))
    us = graph_time_us(lambda: decode_into(record, out), reps)
    us_busy = decode_us_beside_matmul(record, out, reps)
    us_high = decode_us_beside_matmul(record, out, reps, priority=-1)
    raw = weights.numel() * weights.element_size()
    return {"format": fmt, "lane_symbols": lane_symbols, "experts": experts, "exact": exact,
            "raw_mb": raw / 1e6, "ratio": record.nbytes / raw, "decode_us": us,
            "decode_gb_s": raw / us / 1e3, "decode_beside_matmul_us": us_busy,
            "decode_beside_matmul_gb_s": raw / us_busy / 1e3, "decode_beside_matmul_high_priority_us": us_high,
            "decode_beside_matmul_high_priority_gb_s": raw / us_high / 1e3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m coldset.measure.codec", description=__doc__.split("\n\n")[0])
    p.add_argument("--lanes", default="64,128,256", help="symbols per lane to try")
    p.add_argument("--formats", default="bf16,fp8")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None, help="folder for codec_bench.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("coldset.measure.codec: needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    link = link_gb_s(8 * 3 * H * I * 2)
    rows = [measure(fmt, int(lanes), experts, args.reps, gen)
            for fmt in args.formats.split(",") for lanes in args.lanes.split(",") for experts in (1, 8)]
    for r in rows:
        r["decode_over_link"] = r["decode_gb_s"] / link
        r["beside_matmul_over_link"] = r["decode_beside_matmul_gb_s"] / link
        r["high_priority_over_link"] = r["decode_beside_matmul_high_priority_gb_s"] / link
    fills = [fill_ms(fmt, 8, args.reps, gen) for fmt in args.formats.split(",")]
    tier_fills = [tier_fill_ms(fmt, 8, args.reps, gen) for fmt in args.formats.split(",")]
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "codec_bench.json").write_text(json.dumps({"link_gb_s": link, "rows": rows, "fills": fills,
                                                                   "tier_fills": tier_fills}, indent=1))
    print(f"device {torch.cuda.get_device_name()}, pinned host->device link {link:.1f} GB/s (raw bytes)")
    print("| format | lane | experts | exact | MB raw | ratio | decode µs | GB/s out | x link | beside matmul GB/s | x link "
          "| high priority GB/s | x link |")
    print("|---|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        print(f"| {r['format']} | {r['lane_symbols']} | {r['experts']} | {r['exact']} | {r['raw_mb']:.1f} | "
              f"{r['ratio']:.4f} | {r['decode_us']:.1f} | {r['decode_gb_s']:.0f} | {r['decode_over_link']:.1f} | "
              f"{r['decode_beside_matmul_gb_s']:.0f} | {r['beside_matmul_over_link']:.1f} | "
              f"{r['decode_beside_matmul_high_priority_gb_s']:.0f} | {r['high_priority_over_link']:.1f} |")
    print("| format | experts | exact | ratio | raw fill ms | compressed fill ms | link x |")
    print("|---|--:|---|--:|--:|--:|--:|")
    for f in fills:
        print(f"| {f['format']} | {f['experts']} | {f['exact']} | {f['ratio']:.4f} | {f['raw_fill_ms']:.3f} | "
              f"{f['compressed_fill_ms']:.3f} | {f['link_multiplier']:.2f} |")
    print("host tiers (fill_slots from the compressed tier against row copies from the raw tier)")
    print("| format | experts | exact | tier ratio | raw fill ms | compressed fill ms | link x |")
    print("|---|--:|---|--:|--:|--:|--:|")
    for f in tier_fills:
        print(f"| {f['format']} | {f['experts']} | {f['exact']} | {f['ratio']:.4f} | {f['raw_fill_ms']:.3f} | "
              f"{f['compressed_fill_ms']:.3f} | {f['link_multiplier']:.2f} |")
    print("the captured step's fills from device lists (triton_slots.fill raw in place against fill_listed)")
    print("| format | experts | exact | raw kernel fill ms | listed compressed fill ms | link x |")
    print("|---|--:|---|--:|--:|--:|")
    for f in tier_fills:
        print(f"| {f['format']} | {f['experts']} | {f['exact']} | {f['kernel_raw_fill_ms']:.3f} | "
              f"{f['listed_fill_ms']:.3f} | {f['listed_link_multiplier']:.2f} |")
    return 0 if all(r["exact"] for r in rows + fills + tier_fills) else 1


if __name__ == "__main__":
    raise SystemExit(main())
