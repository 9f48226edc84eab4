"""``bench cache --host-tier compressed``: the compressed host tier's build, the decoder's rate measured in
the same run, and the columns of a row whose fills read that tier.

A compressed row's simulated-step columns (``sim_step_ms``, ``sim_over_measured``, ``bound_ms``,
``fraction_of_bound``, ``overlap``, the management ones) come from
:func:`coldset.analysis.time_model.simulate_time` with the compressed tier in its model
(:attr:`~coldset.analysis.time_model.TimeModel.compressed_ratio`: the tier's measured ratio for this
model's experts; :attr:`~coldset.analysis.time_model.TimeModel.decode_gb_s`: the decoder's rate
measured here, :func:`decode_rate`, or ``--decode-gb-s``): fills cross the link as records and are
usable after their decode, misses read in place cross raw, and the bound counts the decoder's work.
A raw row's columns are :func:`coldset.bench.metrics.time_columns`' (raw bytes).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from coldset.analysis.simulate import simulate
from coldset.analysis.time_model import TimeModel, manage_ms_per_group, simulate_time
from coldset.bench.metrics import ENGINE_TIME
from coldset.kernels.compressed_tier import compressed_host_tier
from coldset.measure.harness import MeasureError, log

#: Experts of layer 0 whose records :func:`decode_rate` decodes (a b8 step's misses of a layer are at
#: most ``8 * top_k``; 32 records keep every decode program busy at a few ms of GPU work).
DECODE_EXPERTS = 32
DECODE_REPS = 5


def build_compressed_tier(pools, R: dict):
    """``--host-tier compressed``: every expert's codec records in pinned memory (encoded on the GPU),
    its ratio and build time recorded in ``R["compressed_tier"]``."""
    t0 = time.perf_counter()
    tier = compressed_host_tier(pools)
    coded = sorted({p.name for row in tier.parts for p in row if p.coded})
    R["compressed_tier"] = {"ratio": tier.ratio, "host_gb": tier.nbytes / 1e9, "raw_gb": tier.raw_nbytes / 1e9,
                            "coded_parts": coded, "max_record_mb": tier.max_record_bytes / 1e6,
                            "build_s": round(time.perf_counter() - t0, 1)}
    log("compressed host tier built", R["compressed_tier"])
    return tier


def decode_rate(tier, pools, experts: int = DECODE_EXPERTS, reps: int = DECODE_REPS, blocks: int = 128) -> dict:
    """The decoder's rate on this GPU: layer 0's first ``experts`` records copied once into HBM
    staging (:func:`coldset.kernels.triton_codec_fill.copy_records`), then their decode alone
    (:func:`~coldset.kernels.triton_codec_fill.decode_records`, the captured step's launch, ``blocks``
    as its demand fill) timed ``reps`` times into scratch rows, raw bytes out per second (the median);
    alone on the GPU, not beside the step's compute. The scratch rows are checked bitwise against the
    all-HBM ``pools``' rows of the same experts (:class:`MeasureError` otherwise)."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs
    from coldset.kernels.triton_codec_fill import copy_records, decode_records  # GPU only: triton

    n = min(int(experts), tier.num_experts)
    dev = pools.w13_hot.device
    parts = tier.parts[0]
    # scratch slots: what decode_records reads of a pool is each part's "<name>_hot" rows
    scratch = SimpleNamespace(**{f"{p.name}_hot": torch.empty((n, *p.shape), dtype=p.dtype, device=dev)
                                 for p in parts})
    ids = torch.arange(n, device=dev)
    count = torch.tensor(n, device=dev)
    staging = torch.empty((n, -(-tier.max_record_bytes // 16) * 16), dtype=torch.uint8, device=dev)
    copy_records(tier, ids, count, staging, n, blocks)
    times = []
    for _ in range(reps + 1):  # the first launch compiles and warms: not timed
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        decode_records(tier, scratch, ids, ids, count, staging, blocks)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    for p in parts:
        got, want = getattr(scratch, f"{p.name}_hot"), getattr(pools, f"{p.name}_hot")[:n]
        if not torch.equal(got.view(torch.uint8), want.reshape(got.shape).view(torch.uint8)):
            raise MeasureError(f"decode_rate: layer 0's decoded {p.name} rows differ from the all-HBM experts'")
    raw = n * sum(p.raw_nbytes for p in parts)
    ms = statistics.median(times[1:])
    return {"decode_gb_s": raw / (ms * 1e6), "decode_ms": ms, "experts": n, "raw_mb": raw / 1e6}


def decode_gb_s_for_run(args, tier, pools, R: dict) -> None:
    """The run's decoder rate into ``R["compressed_tier"]``: ``--decode-gb-s`` where given, else
    :func:`decode_rate` measured now; ``decode_gb_s_basis`` says which."""
    ct = R["compressed_tier"]
    if args.decode_gb_s is not None:
        ct.update(decode_gb_s=float(args.decode_gb_s), decode_gb_s_basis="--decode-gb-s")
    else:
        m = decode_rate(tier, pools)
        ct.update(decode_gb_s=m["decode_gb_s"], decode_ms=m["decode_ms"], decode_experts=m["experts"],
                  decode_gb_s_basis=f"measured: {m['experts']} records of layer 0 decoded alone on the GPU")
    log("decoder rate", {k: ct[k] for k in ("decode_gb_s", "decode_gb_s_basis")})


def copied_bytes(record_bytes: np.ndarray, sim, instances: np.ndarray, raw_bytes: int) -> tuple[int, str]:
    """Bytes the fills of a compressed-tier cache moved over the link in replay ``sim`` of the
    selections ``instances``, and how they were counted: with the replay's victims, each admitted
    expert's record (``record_bytes`` by host row) plus each prefetched one's (``sim.issued``) plus
    the misses read in place at ``raw_bytes`` ("records"); without, the fills and prefetches at the
    mean record ("mean record")."""
    prefetched = 0 if sim.issued is None else int(record_bytes[sim.issued[sim.issued >= 0]].sum())
    if sim.victims is None:
        copies = int(sim.fills.sum()) + (0 if sim.prefetches is None else int(sim.prefetches.sum()))
        return int(round(copies * float(record_bytes.mean()))), "mean record"
    admitted = sim.victims >= 0
    in_place = int(sim.fills.sum()) - int(admitted.sum())
    return int(record_bytes[instances[admitted]].sum()) + prefetched + in_place * raw_bytes, "records"


def compressed_link_columns(c, bt, raw_name: str, sim, tokens: int) -> dict:
    """A compressed-tier row's link columns: its copied bytes per token (:func:`copied_bytes`), how
    they were counted, and (where the same row over the raw tier ran) its link bytes over the raw one's."""
    moved, basis = copied_bytes(np.diff(np.asarray(c.compressed.starts)), sim, bt.acc.instances, c.per_expert)
    out = {"link_gb_per_token": moved / tokens / 1e9, "link_bytes_basis": basis}
    raw = bt.replays.get(raw_name)
    if raw is not None and raw[0]["link_gb_per_token"] > 0:
        out["link_over_raw"] = out["link_gb_per_token"] / raw[0]["link_gb_per_token"]
    return out


def with_victims(acc, sim, capacity: int, counts, lists, budget, lead_unit: int | None = None):
    """nexttoken's checked replay ``sim`` (no victims) replayed again on ``acc`` with its victims
    recorded (the compressed tier's time model tells fills from reads in place by them), from the
    profile ``counts``' warm set and the engine's ``lists`` (its gate's ``lead_unit``); None where
    its decisions differ from ``sim``'s."""
    again = simulate(acc, "nexttoken", capacity, counts, predictions=lists, prefetch_budget=budget,
                     lead_unit=lead_unit, record_victims=True)
    same = all(np.array_equal(getattr(again, name), getattr(sim, name)) for name in ("hit", "fills", "prefetches"))
    return again if same else None


def compressed_time_columns(step_ms: float, bsz: int, allhbm_ms: float, link_gb_s: float, acc, sim,
                            per_expert: int, ratio: float, decode_gb_s: float,
                            full_step_ms: float | None = None) -> dict:
    """A compressed row's time columns under bench cache's JSON names: replay ``sim`` of ``acc``
    through :func:`simulate_time` with the engine's link and join (:data:`coldset.bench.metrics.ENGINE_TIME`)
    and the compressed tier (``ratio``, ``decode_gb_s``): the simulated step over the measured
    ``step_ms``; the bound (all-HBM, the link's bytes, the decoder's work: the model's), its
    fraction; the overlap of the model's link time; the model's link, wasted bytes and stall per
    token; with ``full_step_ms`` the management columns as the raw rows' (None without)."""
    if sim.victims is None:
        raise MeasureError("compressed_time_columns: the replay carries no victims (fills and reads in place apart)")
    model = TimeModel(allhbm_ms, per_expert, link_gb_s, **ENGINE_TIME, compressed_ratio=ratio,
                      decode_gb_s=decode_gb_s)
    ts = simulate_time(acc, sim, model)
    link_ms = 1e3 * ts.link_gb_per_token * bsz / link_gb_s
    out = {"overlap": 1.0 - (step_ms - allhbm_ms) / link_ms if link_ms > 0 else None, "bound_ms": ts.bound_ms,
           "fraction_of_bound": ts.bound_ms / step_ms, "sim_step_ms": ts.step_ms,
           "sim_over_measured": ts.step_ms / step_ms, "sim_link_gb_per_token": ts.link_gb_per_token,
           "sim_stall_ms_per_token": ts.stall_ms_per_token, "wasted_gb_per_token": ts.wasted_gb_per_token,
           "manage_ms_per_group": None, "sim_managed_step_ms": None, "sim_managed_over_measured": None}
    if full_step_ms is not None:
        manage = manage_ms_per_group(full_step_ms, allhbm_ms, acc.num_moe_layers)
        managed = simulate_time(acc, sim, replace(model, manage_ms=manage)).step_ms if manage > 0 else ts.step_ms
        out.update(manage_ms_per_group=manage, sim_managed_step_ms=managed, sim_managed_over_measured=managed / step_ms)
    return out
