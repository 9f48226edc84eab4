"""``python -m coldset bench kernel --weight-format fp8``: the block-FP8 experts kernel
(:mod:`coldset.kernels.triton_fp8`) beside the bf16 kernel at Qwen3-30B-A3B shapes, written as
``kernel_bench.json`` of kind ``kernel-fp8`` (:func:`coldset.measure.render.render_kernel_fp8`).

E=128, H=2048, I=768, top-8, bf16 activations; the same random weights in bf16 and quantized to
FP8 (:func:`coldset.core.fp8.quantize_w13`, :func:`~coldset.core.fp8.quantize_weight`). Per batch:
correctness first (the FP8 kernel against the torch path, rel. error; bitwise with the row map
compiled out), then the FP8 kernel's time with each config of the FP8 search space for its
regime (:data:`coldset.kernels.tune.TRITON_FP8_SEARCH_SPACE`, or ``--fp8-configs``' list at every
batch; the fastest reported with all timings) and the fastest one's launches timed
cumulatively (``fp8_stages_us``: :func:`coldset.kernels.triton_fp8.fp8_launches`; with
``--fp8-configs`` every config's, ``fp8_candidates_stages_us``), the bf16 kernel with
``--configs``' tuned config (its default without), and a plain read of each format's distinct
expert bytes (weights and scales) measured now (up to 64 tokens also of w13's and w2's parts
apart, ``fp8_stage_read_us``: the stages' own reads). Up to 4 tokens also all-cold FP8 (weights
and scales read in place from pinned host memory), bitwise against hot.

Built in :func:`build`, measured in :func:`measure_batch` and :func:`measure_cold`; the JSON is
the rows (the table is :mod:`coldset.measure.render`'s).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from coldset.core import fp8
from coldset.core.timing import eager_time_us, graph_time_us
from coldset.kernels import triton_experts
from coldset.kernels.reference import torch_experts, torch_softmax_topk
from coldset.kernels.tiers import ExpertPools, check_host_allocation, host_tier
from coldset.kernels.tune import TRITON_FP8_SEARCH_SPACE
from coldset.measure.harness import MeasureError, cumulative_stage_us, log, new_result, write_result

E, H, I, TOP_K = 128, 2048, 768, 8


@dataclass
class Fp8Bench:
    """What every timing of the run shares: the arguments, the generator of its inputs, both
    formats' all-hot pools (the same weights) and the ceilings measured in this process."""

    args: object
    layers: int
    gen: object
    w13: object  # the bf16 w13 weights [L, E, 2I, H] (plain reads of bf16 bytes)
    q13: object  # the FP8 w13 weights (plain reads of FP8 bytes)
    bf16_pools: object
    fp8_pools: object
    fp8_w13_bytes: int
    fp8_expert_bytes: int
    bf16_expert_bytes: int
    ceilings: dict | None = None
    hbm: float = 0.0
    bf16_rate: float = 0.0
    fp8_rate: float = 0.0


def build(args) -> Fp8Bench:
    """The same random weights in bf16 and block FP8, drawn and quantized a layer at a time
    (float32 temporaries), as all-hot pools."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    L = args.layers
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.time()
    w13 = torch.empty(L, E, 2 * I, H, dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty(L, E, H, I, dtype=torch.bfloat16, device="cuda")
    q13 = torch.empty(w13.shape, dtype=fp8.FP8_DTYPE, device="cuda")
    q2 = torch.empty(w2.shape, dtype=fp8.FP8_DTYPE, device="cuda")
    s13 = torch.empty(L, E, fp8.w13_scale_rows(I), fp8.scale_grid(I, H)[1], device="cuda")
    s2 = torch.empty(L, E, *fp8.scale_grid(H, I), device="cuda")
    for layer in range(L):  # drawn and quantized a layer at a time (float32 temporaries)
        w13[layer] = torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H**0.5
        w2[layer] = torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5
        (q13[layer], s13[layer]), (q2[layer], s2[layer]) = fp8.quantize_w13(w13[layer]), fp8.quantize_weight(w2[layer])
    fp8_w13_bytes = q13[0, 0].numel() + s13[0, 0].numel() * 4  # w13's part of an expert (weights and scales)
    b = Fp8Bench(args, L, gen, w13, q13, ExpertPools.all_hot(w13, w2), ExpertPools.all_hot(q13, q2, s13, s2),
                 fp8_w13_bytes, fp8_w13_bytes + q2[0, 0].numel() + s2[0, 0].numel() * 4,
                 (w13[0, 0].numel() + w2[0, 0].numel()) * 2)
    torch.cuda.synchronize()
    log(f"pools ready in {time.time() - t0:.1f}s; bytes per expert fp8 {b.fp8_expert_bytes}, "
        f"bf16 {b.bf16_expert_bytes}")
    return b


def measure_ceilings(b: Fp8Bench) -> dict:
    """The HBM read rate and the bf16 and FP8 matmul rates, measured in this process."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    from coldset.kernels.bandwidth import HBM_READ_SHAPES, best_read_bandwidth  # triton: GPU-only

    b.hbm = best_read_bandwidth(b.w13.view(-1), HBM_READ_SHAPES, b.args.reps)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b.bf16_rate = 2 * 8192**3 / (eager_time_us(lambda: a @ a, 10) * 1e-6)
    af, one = a.to(fp8.FP8_DTYPE), torch.ones((), device="cuda")
    b.fp8_rate = 2 * 8192**3 / (eager_time_us(
        lambda: torch._scaled_mm(af, af.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 10) * 1e-6)
    del a, af
    b.ceilings = {"hbm_read_GBps": b.hbm / 1e9, "bf16_matmul_TFLOPs": b.bf16_rate / 1e12,
                  "fp8_matmul_TFLOPs": b.fp8_rate / 1e12}
    log("ceilings", b.ceilings)
    return b.ceilings


def load_fp8_configs(path: str) -> list[dict]:
    """The FP8 candidates of ``--fp8-configs`` ``path``: a non-empty JSON list of dicts of
    :class:`~coldset.kernels.triton_moe.KernelConfig` fields (integers; the others at their
    defaults), each checked as the FP8 kernel checks its config
    (:func:`coldset.kernels.triton_fp8._check_config`); returned complete (``to_dict``).
    :class:`MeasureError` naming the file, the entry and the field otherwise."""
    where = f"--fp8-configs {path}"
    if not Path(path).is_file():
        raise MeasureError(f"{where}: no such file")
    try:
        entries = json.loads(Path(path).read_text())
    except ValueError as exc:
        raise MeasureError(f"{where}: not JSON: {exc}") from exc
    if not isinstance(entries, list) or not entries:
        raise MeasureError(f"{where}: a non-empty JSON list of KernelConfig dicts expected, got {entries!r:.80}")
    try:  # the kernel's own checks (triton: present wherever the kernel can run)
        from coldset.kernels.triton_fp8 import _check_config  # triton: GPU-only
        from coldset.kernels.triton_moe import KernelConfig
    except ImportError as exc:
        raise MeasureError(f"{where}: checking its configs needs triton ({exc})") from exc
    fields = list(KernelConfig.__dataclass_fields__)
    configs: list[dict] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise MeasureError(f"{where}: entry {i} is not a dict of KernelConfig fields: {entry!r:.80}")
        for field, value in entry.items():
            if field not in fields:
                raise MeasureError(f"{where}: entry {i}: unknown field {field!r} (KernelConfig fields: "
                                   f"{', '.join(fields)})")
            if type(value) is not int:
                raise MeasureError(f"{where}: entry {i}: field {field!r} must be an integer, got {value!r}")
        cfg = KernelConfig(**entry)
        try:
            _check_config(cfg)
        except ValueError as exc:
            raise MeasureError(f"{where}: entry {i}: {exc}") from exc
        if cfg.to_dict() in configs:
            raise MeasureError(f"{where}: entry {i} repeats entry {configs.index(cfg.to_dict())}")
        configs.append(cfg.to_dict())
    return configs


def case(b: Fp8Bench, num_tokens: int):
    """``num_tokens`` random tokens a layer and their softmax top-k routing (bf16 weights)."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    xs = [torch.randn(num_tokens, H, device="cuda", generator=b.gen).to(torch.bfloat16) for _ in range(b.layers)]
    rs = []
    for _ in range(b.layers):
        ids, w = torch_softmax_topk(torch.randn(num_tokens, E, device="cuda", generator=b.gen), TOP_K, True)
        rs.append((ids, w.to(torch.bfloat16)))
    return xs, rs


def run_all(b: Fp8Bench, pools, xs, rs, cfg, use_row_map=True, outs=None):
    """A call of every layer's experts (the kernel of the pools' format); ``outs`` gets the outputs."""

    def fn():
        got = [triton_experts(pools, l, xs[l], rs[l][0], rs[l][1], cfg, use_row_map) for l in range(b.layers)]
        if outs is not None:
            outs[:] = got
    return fn


def plain_read_us(b: Fp8Bench, pool_tensor, nbytes) -> float:
    """µs a layer of a plain read of ``nbytes`` of the pool's own bytes, one read launch a layer, in one graph."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    from coldset.kernels.bandwidth import best_read_bandwidth  # triton: GPU-only

    flat = pool_tensor.view(-1).view(torch.bfloat16)
    rate = best_read_bandwidth(flat[: b.layers * (int(nbytes) // 2)], ((4096, 1), (4096, 4), (4096, 16)),
                               b.args.reps, launches=b.layers)
    return nbytes / rate * 1e6


def stages_us(b: Fp8Bench, cfg, xs, rs) -> dict:
    """Cumulative µs a layer after each of the FP8 call's launches (all hot, the row map on)."""
    from coldset.kernels.triton_fp8 import fp8_experts_launches, fp8_launches  # triton: GPU-only

    return cumulative_stage_us(lambda l: fp8_experts_launches(b.fp8_pools, l, xs[l], rs[l][0], rs[l][1], cfg, True),
                               fp8_launches(cfg), b.layers, b.args.reps)


def time_candidates(b: Fp8Bench, B: int, xs, rs, candidates, row: dict) -> tuple[dict, dict]:
    """µs a layer of each FP8 candidate config (by its sorted JSON) and its outputs; a config that
    cannot run here is recorded in ``row["fp8_failed_configs"]``, not fatal."""
    from coldset.kernels.triton_moe import KernelConfig  # triton: GPU-only

    timings, outs_by = {}, {}
    for cand in candidates:
        cfg = KernelConfig.from_dict(cand)
        outs: list = []
        try:
            timings[json.dumps(cand, sort_keys=True)] = graph_time_us(
                run_all(b, b.fp8_pools, xs, rs, cfg, True, outs), b.args.reps) / b.layers
            outs_by[json.dumps(cand, sort_keys=True)] = outs
        except Exception as exc:  # noqa: BLE001 - a config that cannot run here is reported, not fatal
            log("fp8 config failed", B, cand, repr(exc)[:300])
            row.setdefault("fp8_failed_configs", []).append({"config": cand, "error": repr(exc)[:300]})
    if not timings:
        raise MeasureError(f"batch {B}: no FP8 config of {b.args.fp8_configs or 'the search space'} ran "
                           "(fp8_failed_configs)")
    return timings, outs_by


def candidate_errors(b: Fp8Bench, xs, rs, outs_by: dict) -> dict:
    """Every candidate's rel. error against the torch path of its own numerics (w8a16: no
    activation quantized), the worst of the first and last layer."""

    L = b.layers
    refs_by_mode = {m: [torch_experts(b.fp8_pools, l, xs[l], *rs[l], w8a16=m).float() for l in (0, L - 1)]
                    for m in {bool(json.loads(k).get("w8a16", 0)) for k in outs_by}}
    errs = {}
    for key, outs in outs_by.items():
        refs = refs_by_mode[bool(json.loads(key).get("w8a16", 0))]
        errs[key] = max(float((outs[l].float() - ref).norm() / ref.norm()) for l, ref in zip((0, L - 1), refs))
    return errs


def measure_batch(b: Fp8Bench, B: int, given: list | None, bf16_tuned: dict) -> dict:
    """One batch's row: the FP8 candidates (correctness, time, the fastest one's stages), the bf16
    kernel, the plain reads of both formats' bytes and the bytes and FLOP bounds."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    from coldset.kernels.triton_moe import KernelConfig, default_config  # triton: GPU-only

    L = b.layers
    xs, rs = case(b, B)
    distinct = sum(int(torch.unique(r[0]).numel()) for r in rs) / L
    row: dict = {"batch": B, "distinct_experts_per_layer": distinct}
    regime = "decode" if B <= TRITON_FP8_SEARCH_SPACE["decode_max_tokens"] else "prefill"
    timings, outs_by = time_candidates(b, B, xs, rs, given or TRITON_FP8_SEARCH_SPACE[regime], row)
    best = min(timings, key=timings.get)
    cfg = KernelConfig.from_dict(json.loads(best))
    outs_on, outs_off = outs_by[best], []
    graph_time_us(run_all(b, b.fp8_pools, xs, rs, cfg, False, outs_off), 3)
    cand_errs = candidate_errors(b, xs, rs, outs_by)
    row.update({"fp8_us": timings[best], "fp8_config": json.loads(best), "fp8_candidates_us": timings,
                "fp8_rel_err_vs_torch": cand_errs[best], "fp8_candidates_rel_err_vs_torch": cand_errs,
                "fp8_bitwise_rowmap_vs_off": all(torch.equal(x_, y_) for x_, y_ in zip(outs_on, outs_off))})
    # where the time goes: each launch cumulatively (the fastest config; with --fp8-configs every one)
    if given:
        row["fp8_candidates_stages_us"] = {k: stages_us(b, KernelConfig.from_dict(json.loads(k)), xs, rs)
                                           for k in timings}
    row["fp8_stages_us"] = row["fp8_candidates_stages_us"][best] if given else stages_us(b, cfg, xs, rs)
    bcfg = KernelConfig.from_dict(bf16_tuned[B]) if B in bf16_tuned else default_config(B, TOP_K)
    row["bf16_config"], row["bf16_config_tuned"] = bcfg.to_dict(), B in bf16_tuned
    row["bf16_us"] = graph_time_us(run_all(b, b.bf16_pools, xs, rs, bcfg), b.args.reps) / L
    fp8_bytes, bf16_bytes = distinct * b.fp8_expert_bytes, distinct * b.bf16_expert_bytes
    flops = 6.0 * B * TOP_K * H * I
    if B <= 64:  # the stages' own ceilings: a plain read of w13's and of w2's part of the bytes
        row["fp8_stage_read_us"] = {"w13": plain_read_us(b, b.q13, distinct * b.fp8_w13_bytes),
                                    "w2": plain_read_us(b, b.q13, distinct * (b.fp8_expert_bytes - b.fp8_w13_bytes))}
    row.update({"fp8_MB": fp8_bytes / 1e6, "fp8_plain_read_us": plain_read_us(b, b.q13, fp8_bytes),
                "bf16_plain_read_us": plain_read_us(b, b.w13, bf16_bytes),
                "fp8_bytes_bound_us": fp8_bytes / b.hbm * 1e6, "bf16_bytes_bound_us": bf16_bytes / b.hbm * 1e6,
                "fp8_flop_bound_us": flops / b.fp8_rate * 1e6, "bf16_flop_bound_us": flops / b.bf16_rate * 1e6})
    return row


def measure_cold(b: Fp8Bench, cold_rows: list[dict]) -> None:
    """All-cold FP8 (every expert read in place from pinned host memory) for ``cold_rows``, each
    with its fastest config: µs, bitwise against hot, the link bound; the pinned read ceiling."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    from coldset.kernels.bandwidth import best_read_bandwidth  # triton: GPU-only
    from coldset.kernels.triton_moe import KernelConfig  # triton: GPU-only

    L, fp8_pools = b.layers, b.fp8_pools
    check_host_allocation(L * E * b.fp8_expert_bytes, "benchmark pinned FP8 cold tier")
    host = host_tier(fp8_pools)
    cold_map = -torch.arange(L * E, dtype=torch.int32, device="cuda").reshape(L, E) - 1
    cold_pools = ExpertPools(fp8_pools.w13_hot, fp8_pools.w2_hot, host.w13, host.w2, cold_map,
                             w13_scale_hot=fp8_pools.w13_scale_hot, w2_scale_hot=fp8_pools.w2_scale_hot,
                             w13_scale_cold=host.w13_scale, w2_scale_cold=host.w2_scale)
    cold_pools.validate()
    pinned = best_read_bandwidth(host.w13.view(-1).view(torch.bfloat16)[: 2**28], ((4096, 1), (4096, 4)), 10)
    b.ceilings["pinned_read_GBps"] = pinned / 1e9
    for row in cold_rows:
        xs, rs = case(b, row["batch"])
        cfg = KernelConfig.from_dict(row["fp8_config"])
        outs_c, outs_h = [], []
        row["fp8_cold_us"] = graph_time_us(run_all(b, cold_pools, xs, rs, cfg, True, outs_c), 5) / L
        run_all(b, fp8_pools, xs, rs, cfg, True, outs_h)()
        row["fp8_cold_bitwise_vs_hot"] = all(torch.equal(x_, y_) for x_, y_ in zip(outs_c, outs_h))
        distinct = sum(int(torch.unique(r[0]).numel()) for r in rs) / L
        row["fp8_cold_link_bound_us"] = distinct * b.fp8_expert_bytes / pinned * 1e6


def fails(rows: list[dict]) -> list[str]:
    """What fails the run: a row's correctness check, and a search-space config that cannot run or
    computes another function (it fails the run, not only its row)."""
    out = [f"batch {r['batch']}: {what}" for r in rows for what, bad in
           (("FP8 kernel not bitwise with the row map compiled out", not r["fp8_bitwise_rowmap_vs_off"]),
            ("FP8 all-cold not bitwise all-hot", r.get("fp8_cold_bitwise_vs_hot") is False),
            ("FP8 rel. error vs the torch path >= 2e-2", r["fp8_rel_err_vs_torch"] >= 2e-2)) if bad]
    out += [f"batch {r['batch']}: FP8 config failed: {f['config']}: {f['error'][:120]}"
            for r in rows for f in r.get("fp8_failed_configs", [])]
    out += [f"batch {r['batch']}: FP8 config {k} rel. error vs its torch path {e:.1e} >= 2e-2"
            for r in rows for k, e in r["fp8_candidates_rel_err_vs_torch"].items() if e >= 2e-2]
    return out


def run_fp8(args, argv=None) -> dict:
    """Measure (see module doc); returns the result written to ``--out``/kernel_bench.json."""
    out_path = Path(args.out) / "kernel_bench.json"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    batches = [int(x) for x in args.batches.split(",")]
    b = build(args)
    res = new_result("kernel-fp8", argv, args)
    res["shape"] = dict(E=E, H=H, I=I, top_k=TOP_K, layers=b.layers, activations="bfloat16")
    res["bytes_per_expert"] = {"fp8": b.fp8_expert_bytes, "bf16": b.bf16_expert_bytes}
    res["ceilings"] = measure_ceilings(b)
    bf16_tuned = {}
    if args.configs:
        bf16_tuned = {int(x): c for x, c in json.loads(Path(args.configs).read_text())["autotune"]["configs"].items()}
    res["bf16_configs_from"] = args.configs
    given = load_fp8_configs(args.fp8_configs) if args.fp8_configs else None
    res["fp8_configs_from"] = args.fp8_configs
    res["batches"] = rows = []
    for B in batches:
        row = measure_batch(b, B, given, bf16_tuned)
        rows.append(row)
        log(B, {k: v for k, v in row.items() if k != "fp8_candidates_us"})
        write_result(out_path, res, res["ceilings"])
    cold_batches = [r for r in rows if r["batch"] <= 4]
    if cold_batches:
        measure_cold(b, cold_batches)
        write_result(out_path, res, res["ceilings"])
    res["fails"] = fails(rows)
    write_result(out_path, res, res["ceilings"])
    return res
