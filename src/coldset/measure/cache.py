"""``python -m coldset bench cache``: the slot cache and the lookahead prefetch at real shape on
one GPU: correctness first, then decode speed against static placement and all-HBM.

Builds the config's in-memory synthetic model (decode region compiled as the pipeline does), checks
that its largest placement fits in the GPU's free memory beside the all-HBM reference
(:func:`coldset.measure.cache_memory.check_placement_fits`: else it exits 1 before anything is
pinned or written, naming the ``--moe-layers`` and ``--residencies`` that fit), pins one host copy
of every expert, and renders the config's fixtures as the workflow does
(:func:`coldset.trace.fixtures.render_domain`: profile and held-out split). The profile prompts' routing
on the unmodified path gives the profile counts (the warm set: ``usage_global``'s hot set at each
residency); the timed prompts are cut from the held-out fixtures' token stream
(:func:`coldset.bench.decode.bench_prompts`). Where the decode region is ``torch.compile``d, one
discarded decode per batch size first (:func:`warm_compiled_region`). Per batch size, every step one CUDA graph
(:class:`coldset.bench.decode.Decoder`, its one timed loop ``timed_steps``), each variant captured once
and decoded ``1 + --repeats`` passes from its warm state (:meth:`coldset.engine.cache.pool.SlotCache.reset`):
all-HBM (the unmodified path, its routing recorded), ``usage_global`` (static, cold experts read
in place), each ``--policies`` cache (``lru``, ``lru_guard``, ``lfu``; ``lookahead`` at each ``--depths``:
decisions in one Triton launch a layer, prefetch copies on a side stream inside the graph, its
prefetch gate in this run's time units: :func:`gate_lead_unit`;
``nexttoken``: its :class:`coldset.analysis.forecast.NextTokenForecaster` fitted on the profile
routing with ``--nexttoken-extra`` candidates a token, at most ``--prefetch-budget`` copies a
group), at each ``--residencies`` (at 1.0 every selection hits: the cache's work in the step;
lookahead there at depth 1 only).

Checks (the command exits 1 if one fails): every variant's logits at every step of every pass
bitwise the all-HBM run's; a cache's per-(step, layer) hits, misses and fills, and lookahead's
prefetches per group, equal :func:`coldset.analysis.simulate.simulate` on the all-HBM routing (lookahead: on
the lists the engine recorded; nexttoken: through :func:`coldset.bench.decode.simulate_engine_pass`, its
lists equal to :func:`coldset.analysis.forecast.nexttoken_lists` on the same tokens, no commit refused), in
every pass; row map, owners and slot contents consistent after the run. Timed: tok/s = 1000 / mean
step (:func:`coldset.bench.decode.pass_timing`: each pass's mean step, the median over the timed passes,
with the slowest and fastest pass), ratios to
``usage_global`` and to all-HBM of the same batch in the same run, hit rate, misses, prefetches
(and the wasted ones) and link GB per token; per cache row the overlap of its copies with the
compute, the fraction of its bound (max of all-HBM and link time) and
:func:`coldset.analysis.time_model.simulate_time`'s step (link "share", join "step") over the measured one.

``--analysis`` adds, per batch: the next-token forecaster (:mod:`coldset.analysis.forecast`, fitted on the
profile routing): its recall on the timed tokens, its GPU cost, the ``forecast`` policy simulated
beside ``lru``; the next-layer lookahead's recall on lru's misses; at the first residency the
cache-management work of all-hit groups alone and inside the step; the fill kernel's read rate
from pinned memory against the copy engine's. ``--decisions-only``: only the split of the
cache's work per layer at the config's shape (no model). Writes ``cache_bench.json`` under ``--out``.

``--host-tier raw,compressed``: every cache row (the same policies, residencies and batches) once per
host tier its fills read: ``raw`` (the pinned rows, read in place by the fill kernel) and
``compressed`` (:func:`coldset.kernels.compressed_tier.compressed_host_tier`, built once beside the raw
tier: each fill copies the expert's lossless codec record into HBM staging and decodes it into the
slot inside the captured step, :mod:`coldset.kernels.triton_codec_fill`; rows named ``... compressed``).
Every row says its ``host_tier``; a compressed row's link bytes are the bytes its copies moved (the
admitted and prefetched experts' records, misses read in place at their raw bytes) and it carries
its link bytes and tok/s over the same raw row's. Static rows read the raw tier in place. A
compressed row's simulated columns (simulated step, bound, its fraction, overlap, wasted bytes) are
the time model's with the compressed tier (:mod:`coldset.measure.cache_compressed`): the tier's
measured ratio (``compressed_ratio``) and the decoder's rate (``decode_gb_s``: a timed decode of
layer 0's records in the same run, or ``--decode-gb-s``; ``decode_gb_s_basis`` says which).

``--weight-format fp8``: the same measurement with the model's experts quantized to the
published block-FP8 format (:func:`coldset.measure.harness.fp8_expert_pools`, on the GPU layer by
layer; the bf16 experts are freed after), so every tier holds FP8 weights with their 128 x 128
scales: the HBM pools, the slots and the pinned host tier, and its attention projections as a
published FP8 checkpoint holds them (:func:`coldset.engine.loading.attach_fp8_attention`, read as FP8 at one
token; not yet run on a GPU in this command: bench step's FP8 rows run it) (half the bytes an expert:
:func:`coldset.core.shapes.expert_bytes` of ``fp8_block128``, scales included, 4.72 MB at
Qwen3-30B-A3B against 9.44 MB). The reference is the FP8 all-HBM run (the FP8 kernel, every expert
hot, the row map compiled out): every variant's logits bitwise its, the engine's decisions the
simulator's, link bytes and bounds at the FP8 bytes an expert; the same checks as bf16.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coldset.measure.cache_analysis import (forecast_analysis, lookahead_recall_analysis, management_overhead,
                                            moe_routers)
from coldset.analysis.forecast import (
    LOOKAHEAD_FIT_SHRINK,
    NextTokenForecaster,
    fit_lookahead_routers,
    lookahead_predictions,
)
from coldset.analysis.placement import expert_bytes
from coldset.analysis.policies import REGISTRY
from coldset.analysis.simulate import simulate
from coldset.analysis.time_model import TimeModel
from coldset.analysis.streams import AccessStream
from coldset.bench import decode as bn
from coldset.bench.metrics import time_columns
from coldset.engine.cache.pool import SlotCache
from coldset.engine.generate import encode_prompts, router_inputs
from coldset.engine.loading import attach_fp8_attention
from coldset.engine.synthetic import SyntheticSpec, build_synthetic_model, synthetic_tokenizer
from coldset.kernels.tiers import host_tier
from coldset.measure.cache_compressed import (build_compressed_tier, compressed_link_columns,
                                              compressed_time_columns, decode_gb_s_for_run, with_victims)
from coldset.measure.cache_decisions import decisions_split
from coldset.measure.cache_memory import preflight_placement
from coldset.trace.fixtures import render_domain, template_texts
from coldset.verify.gate import experts_functions
from coldset.workflow.config import load_config
from coldset.measure.harness import (FP8_NONEXPERT, RANDOM_FAMILIES, WEIGHT_FORMATS, MeasureError,
                                     add_family_arguments, check_family_arguments, expert_format, fp8_expert_pools,
                                     kernel_profile, log, new_result, random_family_model,
                                     require_cuda, spread, write_result)

PROMPT_TOKENS = 32
REPLAY_DEPTHS = (1, 2, 3, 4, 6, 8, 12, 16)  # --save-replays: the lookahead depths whose lists are kept
POLICIES = ("lru", "lru_guard", "lfu", "lookahead", "nexttoken")
HOST_TIERS = ("raw", "compressed")
# the rows --in-order, --other-fork, --lookahead-fit and --high-priority add
LOOKAHEAD_VARIANTS = ("in-order", "list-after-fill", "list-after-experts", "fit", "high-priority")
FIT_CHUNK = 512  # --lookahead-fit: the profile stream prefilled in chunks of this many tokens


def add_arguments(p) -> None:
    p.add_argument("--config", default="config/examples/qwen3-30b-a3b-h200.yaml",
                   help="workflow config whose model.synthetic shape and fixtures are measured")
    p.add_argument("--out", required=True, help="folder for cache_bench.json")
    p.add_argument("--steps", type=int, default=128,
                   help="decode steps per pass (a cache's copies a token fall over a request's first tens of steps: "
                        "scripts/trace_by_position.py)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes (after one checked warm-up pass)")
    p.add_argument("--residencies", default="0.5,1.0")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--policies", default="lru,lookahead", help=f"comma-separated, of {', '.join(POLICIES)}")
    p.add_argument("--depths", default="1,2,3", help="lookahead depths (at residency 1.0: depth 1 only)")
    p.add_argument("--prefetch-blocks", type=int, default=32, help="blocks per weight of the prefetch copy")
    p.add_argument("--host-tier", default="raw",
                   help=f"comma-separated, of {', '.join(HOST_TIERS)}: the host tiers the cache rows fill from, each "
                        "row once per tier (compressed: the lossless codec records, rows named '... compressed')")
    p.add_argument("--decode-gb-s", type=float, default=None,
                   help="--host-tier compressed: the decoder's rate (raw GB/s out) the compressed rows' simulated "
                        "columns use (default: measured in the run, a timed decode of layer 0's records)")
    p.add_argument("--nexttoken-extra", type=int, default=3,
                   help="nexttoken: the forecaster's candidates per token beyond top_k (config cache.nexttoken_extra)")
    p.add_argument("--prefetch-budget", type=int, default=None,
                   help="nexttoken: prefetch copies per (step, layer) group (config cache.prefetch_budget; "
                        "default: no cut)")
    p.add_argument("--analysis", action="store_true",
                   help="also the forecaster, lookahead recall on lru's misses, cache overhead and fill rate")
    p.add_argument("--save-replays", action="store_true",
                   help="also cache_replays.npz: per batch the all-HBM routing and the pre-gated lists at "
                        f"depths {','.join(map(str, REPLAY_DEPTHS))} (k and k + 4 candidates), with the profile "
                        "counts: the calibrated time simulator replays policies on them without a GPU")
    p.add_argument("--in-order", action="store_true",
                   help="also each lookahead variant with its prefetch fills on the compute stream (rows named "
                        "'... in-order': no fork to the side stream, no join back): at residency 1.0 nothing is "
                        "copied, so its step against the forked one's is what the per-layer stream hops cost")
    p.add_argument("--high-priority", action="store_true",
                   help="also each lookahead variant with its prefetch's streams (decisions and fill) at a high "
                        "CUDA priority (rows named '... high-priority'): the fill's blocks are scheduled ahead of "
                        "the step's queued compute instead of behind it; same decisions, other overlap")
    p.add_argument("--other-fork", action="store_true",
                   help="also each lookahead variant with its list and prefetch forked where its depth does not "
                        "fork them (Lookahead.list_after_experts): after the layer's demand fill at depth >= 2 "
                        "(rows named '... list-after-fill'), after the layer's experts at depth 1 ('... "
                        "list-after-experts'); at residency 1.0 what the list beside the w13 launch costs")
    p.add_argument("--lookahead-fit", action="store_true",
                   help="also each lookahead variant with its forecast matrices fitted on the profile fixtures' "
                        "router inputs (coldset.engine.generate.router_inputs' first LOOKAHEAD_FIT_TOKENS prompt "
                        "tokens; "
                        "coldset.analysis.forecast.fit_lookahead_routers) in "
                        "place of the later layers' routers (rows named '... fit'): the same launches, other rows")
    p.add_argument("--profile", action="store_true",
                   help="also a kernel profile of each row's captured step (after its timed passes): kernels, "
                        "their device time and the idle time between them per step, the top kernels")
    p.add_argument("--decisions-only", action="store_true",
                   help="only the split of the cache's work per layer at the config's shape (no model)")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="bf16",
                   help="fp8: the experts quantized to block FP8 in every tier (HBM, slots, pinned host), checked "
                        "bitwise against the FP8 all-HBM run")
    add_family_arguments(p)


def check_arguments(args) -> None:
    """:class:`MeasureError` naming a bad policy, residency or count before anything is built."""
    bad = [p for p in args.policies.split(",") if p not in POLICIES]
    if bad:
        raise MeasureError(f"--policies {bad} not among {', '.join(POLICIES)}")
    try:
        res = [float(r) for r in args.residencies.split(",")]
        [int(b) for b in args.batches.split(",")] + [int(d) for d in args.depths.split(",")]
    except ValueError as exc:
        raise MeasureError(f"--residencies/--batches/--depths: {exc}") from exc
    if not all(0 < r <= 1 for r in res):
        raise MeasureError(f"--residencies {res}: each must be in (0, 1]")
    tiers = args.host_tier.split(",")
    if not tiers or any(t not in HOST_TIERS for t in tiers) or len(set(tiers)) != len(tiers):
        raise MeasureError(f"--host-tier {args.host_tier!r}: distinct names of {', '.join(HOST_TIERS)}")
    if args.decode_gb_s is not None and ("compressed" not in tiers or not args.decode_gb_s > 0):
        raise MeasureError(f"--decode-gb-s {args.decode_gb_s} is the compressed tier's decoder rate: > 0, with "
                           "--host-tier ...,compressed")
    if args.nexttoken_extra < 0 or (args.prefetch_budget is not None and args.prefetch_budget < 0):
        raise MeasureError(f"--nexttoken-extra {args.nexttoken_extra} and --prefetch-budget {args.prefetch_budget}: "
                           "each must be >= 0")
    if args.prefetch_budget is not None and "nexttoken" not in args.policies.split(","):
        raise MeasureError(f"--prefetch-budget {args.prefetch_budget} is nexttoken's: add nexttoken to --policies")
    if args.in_order and "lookahead" not in args.policies.split(","):
        raise MeasureError("--in-order varies lookahead's prefetch fills: add lookahead to --policies")
    if args.high_priority and "lookahead" not in args.policies.split(","):
        raise MeasureError("--high-priority varies lookahead's prefetch streams: add lookahead to --policies")
    if args.lookahead_fit and "lookahead" not in args.policies.split(","):
        raise MeasureError("--lookahead-fit varies lookahead's forecast: add lookahead to --policies")
    if args.other_fork and "lookahead" not in args.policies.split(","):
        raise MeasureError("--other-fork varies lookahead's fork: add lookahead to --policies")
    if args.save_replays and args.decisions_only:
        raise MeasureError("--save-replays keeps a model run's routing: --decisions-only runs no model")
    if args.steps < 2 or args.repeats < 1:
        raise MeasureError(f"--steps {args.steps} (>= 2) and --repeats {args.repeats} (>= 1)")
    check_family_arguments(args)
    if args.model_family != "synthetic" and (args.weight_format != "bf16" or args.decisions_only):
        raise MeasureError(f"--model-family {args.model_family} runs its published expert format "
                           f"({RANDOM_FAMILIES[args.model_family].expert_format}) on a model; --weight-format fp8 "
                           "and --decisions-only are the synthetic model's")
    if args.decisions_only and args.weight_format != "bf16":
        raise MeasureError(f"--decisions-only times the cache's decisions on stand-in experts of a few bytes; "
                           f"--weight-format {args.weight_format} does not apply to it")


@dataclass
class CacheRun:
    """What every row of the run shares: the arguments, the result being written (``R``, its
    ``fails``), the model (decode region compiled) and its pinned host tier, the shape, the bytes
    of one expert, the ceilings, the all-HBM and row-map experts functions, and the profile
    routing's counts with the forecasts fitted on it."""

    args: object
    R: dict
    out_path: Path
    model: object
    host: object
    dev: object
    per_expert: int
    ceilings: dict
    ref_fn: object
    rowmap_fn: object
    counts: object = None
    prof_routing: object = None
    forecaster: object = None
    fitted: dict = field(default_factory=dict)
    compressed: object = None  # --host-tier compressed: the compressed host tier of every expert

    @property
    def fails(self) -> list[str]:
        return self.R["fails"]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(MoE layers, experts, top k)."""
        cfg = self.model.config
        return cfg.num_moe_layers, cfg.num_experts, cfg.top_k


@dataclass
class BatchRun:
    """One batch size's reference: its prompts, the all-HBM passes (logits, routing, router
    inputs), the routing as the simulator's access stream, the all-HBM mean step, and the cache
    rows with their replays (the management columns)."""

    bsz: int
    prompts: object
    base: list
    inst: object  # the routing's instances in the engine's group order
    acc: object
    allhbm_ms: float = 0.0
    lead_unit: int | None = None  # the prefetch gate's, from this batch's all-HBM step and the link (gate_lead_unit)
    replays: dict = field(default_factory=dict)

    @property
    def routing(self):
        return self.base[0]["routing"]


def build_family(args, dev, config: dict, R: dict):
    """``--model-family``'s random model (:func:`coldset.measure.harness.random_family_model`) with
    the config's synthetic tokenizer (its ids lie within every family's vocabulary), and the bytes
    of one expert that move between tiers (:func:`coldset.bench.decode.moved_bytes_per_expert`: rows
    and scale rows; its biases stay resident). Returns ``(model, tokenizer, bytes)``."""
    spec = SyntheticSpec(**config["model"]["synthetic"])
    R["router"] = (f"random router weights ({args.model_family} at its published shape): routing without a trained "
                   "model's locality, so hit rates are a random router's; step times are the real shape's")
    R["model"] = args.model_family
    fx = config["fixtures"]
    texts = template_texts(fx["domains"], 200, seed=fx["seed"] + 1, template_dir=fx["template_dir"])
    tokenizer = synthetic_tokenizer(spec, texts)[0]
    model = random_family_model(args.model_family, dev, args.moe_layers, R)
    R["weight_format"] = RANDOM_FAMILIES[args.model_family].expert_format
    return model, tokenizer, bn.moved_bytes_per_expert(model.pools)


def build(args, dev, config: dict, R: dict):
    """The config's in-memory synthetic model (``--model-family``: that family's random model,
    :func:`build_family`) with its decode region compiled (``--weight-format fp8``: its experts and
    attention projections quantized as published), its pinned host tier and the run's HBM and link
    ceilings. Returns ``(CacheRun, tokenizer)``."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    if args.model_family != "synthetic":
        model, tokenizer, per_expert = build_family(args, dev, config, R)
        model.compile_decode()
        return _cache_run(args, dev, R, model, per_expert), tokenizer
    spec = SyntheticSpec(**config["model"]["synthetic"])
    # Which routing these numbers are measured on: the synthetic router and its temporal knobs.
    R["router"] = (f"synthetic router (temporal_gain {spec.temporal_gain}, temporal_continuity "
                   f"{spec.temporal_continuity}, topic_context {spec.topic_context}; its lift: "
                   "scripts/locality_calibrate.py on the same config)")
    fx = config["fixtures"]
    texts = template_texts(fx["domains"], 200, seed=fx["seed"] + 1, template_dir=fx["template_dir"])
    model, tokenizer = build_synthetic_model(spec, dev, getattr(torch, config["model"]["dtype"]), domain_texts=texts)
    model.compile_decode()
    R["weight_format"] = args.weight_format
    if args.weight_format == "fp8":
        model.pools = fp8_expert_pools(model.pools)  # the model held the bf16 pools' only reference: freed
        attach_fp8_attention(model)  # and its attention as published (the float weights not restored here)
        R["fp8_nonexpert"] = FP8_NONEXPERT
        torch.cuda.empty_cache()
        log("experts and attention projections quantized to block FP8")
    return _cache_run(args, dev, R, model, expert_bytes(model.config, expert_format(args.weight_format))), tokenizer


def _cache_run(args, dev, R: dict, model, per_expert: int) -> CacheRun:
    """The run's state around a built model (its placements checked to fit, :func:`preflight_placement`):
    its pinned host tier, the ceilings, the experts functions."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    preflight_placement(args, model)
    R["expert_bytes"] = per_expert
    host = host_tier(model.pools)
    # the HBM and link ceilings of this run, for its provenance (FP8 and MXFP4 weights read as the same bytes in bf16)
    ceilings = bn.measure_ceilings(host.w13 if host.w13.dtype == torch.bfloat16 else host.w13.view(torch.bfloat16))
    R["ceilings"] = ceilings
    log("model built and host tier pinned; ceilings", ceilings)
    ref_fn, rowmap_fn, _ = experts_functions(dev, None)
    return CacheRun(args, R, Path(args.out) / "cache_bench.json", model, host, dev, per_expert, ceilings, ref_fn,
                    rowmap_fn)


def fixture_streams(config: dict, tokenizer) -> tuple[list[int], list[int]]:
    """The profile and the held-out fixtures' prompt tokens, rendered as the workflow renders them."""

    fx = config["fixtures"]
    fixtures = [f for d in fx["domains"] for f in render_domain(d, fx["per_domain"], fx["heldout_fraction"],
                                                                  fx["max_new_tokens"], fx["seed"], fx["template_dir"])]

    def stream(split: str) -> list[int]:
        return [t for ids in encode_prompts(tokenizer, [f.prompt for f in fixtures if f.split == split]) for t in ids]

    return stream("profile"), stream("heldout")


def decode(c: CacheRun, experts_fn, pools, bsz, prompts, passes, cache=None, record=False) -> list[dict]:
    """The one timed loop: captured decode, ``passes`` passes from the same start (a cache reset
    to its warm state before each): per pass step ms and logits; the first pass's routing
    [steps, L, B, k] and router inputs [steps, L, B, H] (``record``); a cache's counters, group
    history and (lookahead) lists and prefetches."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    model, (L, _, k), steps = c.model, c.shape, c.args.steps
    saved = model.pools, model.experts_fn
    rec = torch.zeros((L, bsz, k), dtype=torch.long, device=c.dev)
    rec_h = torch.zeros((L, bsz, model.config.hidden_size), dtype=model.dtype, device=c.dev)

    def recording(p, layer, x, ids, w):
        if x.shape[0] == bsz:
            rec[layer].copy_(ids)
            rec_h[layer].copy_(x)
        return experts_fn(p, layer, x, ids, w)

    model.pools, model.experts_fn = pools, recording if record else experts_fn
    res = []
    try:
        dec = bn.Decoder(model, bsz, PROMPT_TOKENS, steps + 1, True)
        tok0 = dec.prefill(prompts.to(c.dev))
        dec.set_step(tok0, 1)
        dec.capture()
        for i in range(passes):
            if cache is not None:
                cache.reset()  # the capture's warm-up steps (or the last pass) ran the cache: start warm
            ms, logits, routing, hidden = [], [], [], []
            for step_ms, lg, _ in dec.timed_steps(tok0, steps):
                ms.append(step_ms)
                logits.append(lg.clone())
                if record and i == 0:
                    routing.append(rec.cpu().numpy().copy())
                    hidden.append(rec_h.clone())
            p = {"ms": ms, "logits": torch.stack(logits)}
            if record and i == 0:
                p["routing"], p["hidden"] = np.stack(routing), torch.stack(hidden)
            if cache is not None:
                p["counters"] = cache.counters()
                p["history"] = cache.group_history()
                if cache.policy in ("lookahead", "nexttoken"):
                    p["lists"] = cache.prefetch_lists()
                    p["prefetches"] = cache.prefetch_counts()
            res.append(p)
        if c.args.profile:  # a diagnosis after the timed passes (its steps change no checked number)
            res[-1]["profile"] = kernel_profile(dec.step, layers=L)
        del dec
    finally:
        model.pools, model.experts_fn = saved
    return res


def profile_routing(c: CacheRun, profile_stream: list[int]) -> None:
    """The profile fixtures' routing on the unmodified path and its counts (the warm set), and the
    forecasts fitted on it that the run's policies use (``nexttoken``, ``--lookahead-fit``)."""

    L, E, k = c.shape
    c.prof_routing = decode(c, c.ref_fn, c.model.pools, 8, bn.bench_prompts(profile_stream, 8, PROMPT_TOKENS), 1,
                            record=True)[0]["routing"]
    c.counts = np.zeros((L, E), dtype=np.float64)
    for layer in range(L):
        np.add.at(c.counts[layer], c.prof_routing[:, layer].reshape(-1), 1)
    if "nexttoken" in c.args.policies.split(","):
        c.forecaster = _fit_nexttoken(c.prof_routing, k, E, c.args.nexttoken_extra, c.R)
    if c.args.lookahead_fit:
        c.fitted = _fit_lookahead(c.model, c.ref_fn, profile_stream, c.args, c.R)


def add_row(c: CacheRun, bt: BatchRun, name: str, res: list[dict], residency: float, extra: dict) -> dict:
    """A row of the table: the timed passes' step (the first pass is checked, not timed), every
    pass's logits checked bitwise against the all-HBM run's, the profile where taken."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    timed = [p["ms"] for p in res[1:]]  # the timed passes (the first one is checked, not timed)
    mean, p50, p90 = bn.pass_timing(timed)
    r = {"batch": bt.bsz, "placement": name, "residency": residency, "step_ms_mean": mean,
         "step_ms_mean_spread": spread([statistics.fmean(ms) for ms in timed]), "step_ms_p50": p50,
         "step_ms_p90": p90, "tok_s": 1e3 / mean, "step_ms_by_length": bn.step_ms_by_length(timed), **extra}
    for i, p in enumerate(res):
        same = bool(torch.equal(p["logits"], bt.base[0]["logits"]))
        c.R["checks"][f"{name}/b{bt.bsz} pass {i} logits bitwise"] = same
        if not same:
            c.fails.append(f"{name}/b{bt.bsz} pass {i}: logits differ from all-HBM's")
    if "profile" in res[-1]:
        r["profile"] = res[-1]["profile"]
        log(name, {k_: v for k_, v in r["profile"].items() if k_ != "top"},
            [(t["name"][:40], t["per_step"], t["us_per_step"]) for t in r["profile"]["top"][:10]])
    c.R["rows"].append(r)
    log({k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in r.items()
         if k_ not in ("step_ms_mean_spread", "profile")})
    return r


def warm_compiled_region(c: CacheRun, heldout_stream: list[int], batches: list[int]) -> int:
    """One discarded decode at each batch size before any all-HBM reference, where the decode region
    is ``torch.compile``d: a row's passes then run the compiled graphs its reference ran (Dynamo runs
    the newest graph whose guards pass, and a batch size's first decode can compile graphs later
    ones supersede: :func:`coldset.verify.gate.warm_compiled_decode`). Returns the decodes run."""
    if not c.model.decode_is_dynamo_compiled:
        return 0
    for bsz in sorted(set(batches)):
        log(f"warming the compiled decode region at batch {bsz}")
        decode(c, c.ref_fn, c.model.pools, bsz, bn.bench_prompts(heldout_stream, bsz, PROMPT_TOKENS), 1)
    return len(set(batches))


def all_hbm_batch(c: CacheRun, bsz: int, heldout_stream: list[int], passes: int) -> BatchRun:
    """The batch's reference: the all-HBM passes (routing recorded) and their row."""

    L, E, k = c.shape
    prompts = bn.bench_prompts(heldout_stream, bsz, PROMPT_TOKENS)
    base = decode(c, c.ref_fn, c.model.pools, bsz, prompts, passes, record=True)
    routing = base[0]["routing"]
    inst = (routing + (np.arange(L) * E)[None, :, None, None]).reshape(-1)  # the engine's group order
    bt = BatchRun(bsz, prompts, base, inst,
                  AccessStream(inst, np.arange(0, inst.size + 1, bsz * k), bsz * c.args.steps, L, E))
    r = add_row(c, bt, "all-HBM", base, 1.0, {"hit_rate": 1.0, "misses_per_token": 0.0, "link_gb_per_token": 0.0,
                                               "host_tier": "raw"})
    bt.allhbm_ms = r["step_ms_mean"]
    bt.lead_unit = gate_lead_unit(bt.allhbm_ms, c.per_expert, c.ceilings["link_read_gb_s"], L)
    c.R.setdefault("lead_unit", {})[bsz] = bt.lead_unit
    return bt


def gate_lead_unit(allhbm_ms: float, per_expert: int, link_gb_s: float, num_moe_layers: int) -> int:
    """The gated policies' prefetch gate unit in this run: one group's compute of the measured
    all-HBM step in parts of one expert copy's time over the measured link
    (:meth:`coldset.analysis.time_model.TimeModel.lead_unit`, the time model the rows' time columns
    use). Why: the gate weighs a useful prefetch's saving against a wasted one's cost in these
    units, so it must count the run's own times; the default (one group hides one copy) overstates
    the saving wherever a copy takes longer than a layer's compute (large experts, a slow link)."""
    return TimeModel(allhbm_ms, per_expert, link_gb_s).lead_unit(num_moe_layers)


def static_row(c: CacheRun, bt: BatchRun, residency: float, row_map, passes: int) -> None:
    """``usage_global`` at ``residency``: the profile's hot set in HBM, cold experts read in place."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    L, _, _ = c.shape
    steps, tokens, inst = c.args.steps, bt.bsz * c.args.steps, bt.inst
    pools = c.model.pools.placed(row_map, c.host)
    got = decode(c, c.rowmap_fn, pools, bt.bsz, bt.prompts, passes)
    del pools
    torch.cuda.empty_cache()
    cold = row_map.reshape(-1)[inst] < 0
    cold_steps = cold.reshape(steps, L, bt.bsz * c.shape[2])
    reads = sum(len(set(inst.reshape(steps, L, -1)[s, l][cold_steps[s, l]].tolist()))
                for s in range(steps) for l in range(L))
    add_row(c, bt, f"usage_global-{residency}", got, residency,
            {"hit_rate": 1.0 - float(cold.mean()), "misses_per_token": int(cold.sum()) / tokens,
             "link_gb_per_token": reads * c.per_expert / tokens / 1e9, "host_tier": "raw"})


def cache_variants(args, residency: float) -> list[tuple[str, int, str]]:
    """The cache rows at ``residency``: (policy, lookahead depth or 0, lookahead variant or "")."""
    policies = args.policies.split(",")
    variants = [(p, 0, "") for p in policies if p != "lookahead"]
    if "lookahead" in policies:
        depths = [1] if residency == 1.0 else [int(d) for d in args.depths.split(",")]
        variants += [("lookahead", d, v) for d in depths
                     for v in ("", *(["in-order"] if args.in_order else []),
                               *(["high-priority"] if args.high_priority else []),
                               *([_other_fork(d)] if args.other_fork else []),
                               *(["fit"] if args.lookahead_fit else []))]
    return variants


def build_cache(c: CacheRun, bt: BatchRun, pol: str, depth: int, variant: str, row_map, warm_counts,
                tier: str = "raw"):
    """The slot cache of one row, warm with the static placement's hot set, filling from ``tier``."""

    nt = pol == "nexttoken"
    forecast = None
    if depth:  # lookahead: the forecast reads the routers in the model dtype
        forecast = c.fitted[depth] if variant == "fit" else [r.to(c.model.dtype) for r in moe_routers(c.model)]
    cache = SlotCache.build(c.model.pools, c.host, row_map, warm_counts, pol, bt.bsz, c.shape[2],
                            history=c.args.steps * c.shape[0] + 8, routers=forecast,
                            depth=max(depth, 1), forecaster=c.forecaster if nt else None,
                            prefetch_budget=c.args.prefetch_budget if nt else None,
                            lead_unit=bt.lead_unit if REGISTRY[pol].gated else None,
                            compressed=c.compressed if tier == "compressed" else None)
    cache.prefetch_blocks = c.args.prefetch_blocks
    if variant == "in-order":
        cache.rules.side_stream = None  # the prefetch fill in stream order after the decisions, never forked
    if variant == "high-priority" and cache.rules.side_stream is not None:  # CUDA (no streams on the CPU)
        import torch  # GPU-only path: torch and the kernels load when a measurement runs

        dev = cache.owner.device  # priority -1: torch maps it to the device's highest (CUDA graphs capture it)
        cache.rules.side_stream = torch.cuda.Stream(dev, priority=-1)
        cache.rules.decide_stream = torch.cuda.Stream(dev, priority=-1)
    if variant in ("list-after-fill", "list-after-experts"):
        cache.rules.list_after_experts = variant == "list-after-experts"
    return cache


def check_decisions(c: CacheRun, bt: BatchRun, name: str, cache, got: list[dict], sim, depth: int) -> None:
    """Every pass's per-group hits, misses and fills (and lookahead's lists and prefetches) equal
    the simulator's; nexttoken commits none refused; the cache's state consistent after the run."""
    nt, bsz = cache.policy == "nexttoken", bt.bsz
    sim_hist = np.stack([sim.hits, sim.misses, sim.fills], axis=1)
    for i, p in enumerate(got):
        ok = bool(np.array_equal(p["history"], sim_hist))
        if depth or nt:
            ok = ok and bool(np.array_equal(p["lists"], got[-1 if nt else 0]["lists"])) \
                and bool(np.array_equal(p["prefetches"], sim.prefetches))
        if nt:
            ok = ok and p["counters"]["stale"] == 0  # no commit refused: every copy had landed
        c.R["checks"][f"{name}/b{bsz} pass {i} == simulator"] = ok
        if not ok:
            c.fails.append(f"{name}/b{bsz} pass {i}: per-group decisions differ from the simulator's"
                           + (f" (stale commits {p['counters']['stale']})" if nt else ""))
    try:
        cache.check(contents=True)
        c.R["checks"][f"{name}/b{bsz} state consistent"] = True
    except ValueError as exc:
        c.fails.append(f"{name}/b{bsz}: {exc}")


def simulate_row(c: CacheRun, bt: BatchRun, name: str, cache, got: list[dict], pol: str, capacity: int):
    """The simulator's replay of the row's policy on the all-HBM routing (lookahead: on the lists
    the engine recorded; nexttoken: through :func:`coldset.bench.decode.simulate_engine_pass`, its
    lists checked against :func:`coldset.analysis.forecast.nexttoken_lists`, and over the compressed
    tier replayed again with its victims, :func:`coldset.measure.cache_compressed.with_victims`); None
    (a fail recorded) when the nexttoken lists or the two replays differ."""

    if pol != "nexttoken":  # the victims recorded: a compressed row's copied bytes name the admitted experts
        return simulate(bt.acc, pol, capacity, c.counts, predictions=got[0].get("lists"),
                        lead_unit=bn.gate_lead(cache), record_victims=cache.compressed is not None)
    # the forecast checked too: the cache's last recorded lists against nexttoken_lists on the
    # same tokens (bench.simulate_engine_pass), every pass's lists against those below
    try:
        sim = bn.simulate_engine_pass(cache, np.ascontiguousarray(bt.routing.transpose(2, 0, 1, 3)),
                                      forecaster=c.forecaster)
    except bn.CacheSimulatorMismatch as exc:
        c.fails.append(f"{name}/b{bt.bsz}: {exc}")
        c.R["checks"][f"{name}/b{bt.bsz} lists == nexttoken_lists"] = False
        return None
    c.R["checks"][f"{name}/b{bt.bsz} lists == nexttoken_lists"] = True
    if cache.compressed is None:
        return sim
    again = with_victims(bt.acc, sim, capacity, c.counts, cache.prefetch_lists(), cache.rules.prefetch_budget,
                         bn.gate_lead(cache))
    c.R["checks"][f"{name}/b{bt.bsz} replay with victims == checked replay"] = again is not None
    if again is None:
        c.fails.append(f"{name}/b{bt.bsz}: nexttoken's replay with victims decides otherwise than its checked replay")
    return again


def cache_row(c: CacheRun, bt: BatchRun, variant: tuple[str, int, str], residency: float, capacity: int, row_map,
              warm_counts, passes: int, first_of_residency: bool, tier: str = "raw") -> None:
    """One cache row filling from host tier ``tier``: decoded, checked against the simulator, timed,
    its time columns; with ``--analysis`` lru's lookahead recall and the first row's management overhead."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    pol, depth, var = variant
    args, bsz, tokens, k = c.args, bt.bsz, bt.bsz * c.args.steps, c.shape[2]
    raw_name = f"{pol}-{residency}" + (f" d{depth}" if depth else "") + (f" {var}" if var else "")
    name = raw_name + (" compressed" if tier == "compressed" else "")
    cache = build_cache(c, bt, pol, depth, var, row_map, warm_counts, tier)
    got = decode(c, cache.wrap(c.rowmap_fn), cache.pools, bsz, bt.prompts, passes, cache=cache)
    sim = simulate_row(c, bt, name, cache, got, pol, capacity)
    if sim is None:
        del cache, got
        torch.cuda.empty_cache()
        return
    check_decisions(c, bt, name, cache, got, sim, depth)
    counters, st = got[1]["counters"], sim.stats()
    r = add_row(c, bt, name, got, residency, {
        "hit_rate": counters["hits"] / (counters["hits"] + counters["misses"]), "sim_hit_rate": st.hit_rate,
        "misses_per_token": counters["misses"] / tokens, "fills_per_token": counters["fills"] / tokens,
        "prefetches_per_token": st.prefetches / tokens,
        "useful_prefetches_per_token": st.useful_prefetches / tokens,
        "wasted_prefetches_per_token": st.wasted_prefetches / tokens,
        "link_gb_per_token": st.link_gb_per_token(c.per_expert), "host_tier": tier,
        **({"lead_unit": bn.gate_lead(cache)} if REGISTRY[pol].gated else {}),
        **(compressed_link_columns(c, bt, raw_name, sim, tokens) if tier == "compressed" else {}),
        **(compressed_model_inputs(c) if tier == "compressed" else {}),
        **({"list_recall": list_recall(got[0]["lists"], bt.routing, depth, c.shape[1])} if depth else {})})
    r.update(_time_columns(r, bt.allhbm_ms, c.ceilings["link_read_gb_s"], bsz, bt.acc, sim, c.per_expert))
    bt.replays[name] = (r, sim)
    log(f"{name}/b{bsz}", {k_: round(r[k_], 4) for k_ in ("overlap", "fraction_of_bound", "sim_over_measured")
                            if r[k_] is not None})
    if tier == "compressed" and "link_over_raw" in r:
        r["tok_s_over_raw"] = r["tok_s"] / bt.replays[raw_name][0]["tok_s"]
        log(f"{name}/b{bsz} against raw: link bytes raw/compressed {1 / r['link_over_raw']:.3f}, "
            f"tok/s compressed/raw {r['tok_s_over_raw']:.3f}")
    if tier != "raw":  # the analyses below are the raw tier's
        del cache, got
        torch.cuda.empty_cache()
        return
    if args.analysis and pol == "lru" and residency < 1.0:
        c.R.setdefault("lookahead_recall", {})[f"{name}/b{bsz}"] = lookahead_recall_analysis(
            c.model, bt.base[0]["hidden"], bt.routing, sim, bt.acc, capacity, c.counts, k, tokens, c.per_expert)
    if args.analysis and first_of_residency:
        c.R.setdefault("overhead", {})[bsz] = management_overhead(
            functools.partial(decode, c), cache, c.ref_fn, c.rowmap_fn, c.model, bsz, bt.prompts, c.shape[0], k,
            c.per_expert, residency == 1.0)
    del cache, got
    torch.cuda.empty_cache()


def measure_residency(c: CacheRun, bt: BatchRun, residency: float, passes: int) -> None:
    """``usage_global`` and every cache row at ``residency``, warm with the profile's hot set."""
    from coldset.analysis.placement import (  # GPU-only path: loads when a measurement runs
        hot_count_for_residency, hot_mask_usage_global, row_map_from_mask)

    L, E, _ = c.shape
    capacity = hot_count_for_residency(residency, L * E)
    row_map = row_map_from_mask(hot_mask_usage_global(c.counts, capacity))
    static_row(c, bt, residency, row_map, passes)
    warm_counts = np.empty(capacity)
    flat = row_map.reshape(-1)
    hot = np.flatnonzero(flat >= 0)
    warm_counts[flat[hot]] = c.counts.reshape(-1)[hot]
    variants = cache_variants(c.args, residency)
    for variant in variants:
        first = residency == [float(r) for r in c.args.residencies.split(",")][0] and variant[0] == variants[0][0]
        for tier in c.args.host_tier.split(","):
            cache_row(c, bt, variant, residency, capacity, row_map, warm_counts, passes, first, tier)
    write_result(c.out_path, c.R, c.ceilings)


def run(args, argv=None) -> dict:
    """Measure (see module doc); returns the result written to ``--out``/cache_bench.json."""
    check_arguments(args)
    dev = require_cuda()
    if args.decisions_only:
        return decisions_split(args, argv)

    Path(args.out).mkdir(parents=True, exist_ok=True)
    config = load_config(args.config)
    R = new_result("cache", argv, args)
    R.update(config=args.config, model=config["model"]["name"], rows=[], checks={})
    R["fails"] = []
    c, tokenizer = build(args, dev, config, R)
    if "compressed" in args.host_tier.split(","):
        c.compressed = build_compressed_tier(c.model.pools, R)
        decode_gb_s_for_run(args, c.compressed, c.model.pools, R)
    profile_stream, heldout_stream = fixture_streams(config, tokenizer)
    profile_routing(c, profile_stream)
    passes = 1 + args.repeats
    L, E, k = c.shape
    replay_arrays = {"profile_counts": c.counts, "expert_bytes": np.array(c.per_expert)}  # --save-replays
    batches = [int(b) for b in args.batches.split(",")]
    warm_compiled_region(c, heldout_stream, batches)
    for bsz in batches:
        bt = all_hbm_batch(c, bsz, heldout_stream, passes)
        if args.save_replays:
            replay_arrays.update(_replay_arrays(bsz, bt.routing, bt.base[0]["hidden"], moe_routers(c.model), k))
        if args.analysis:
            R.setdefault("forecast", {})[bsz] = forecast_analysis(c.prof_routing, bt.routing,
                                                          [float(r) for r in args.residencies.split(",")], c.counts,
                                                          L, E, k, bsz, bsz * args.steps, c.per_expert, dev)
        for residency in (float(r) for r in args.residencies.split(",")):
            measure_residency(c, bt, residency, passes)
        if bt.replays:
            _manage_columns(bt.replays, bt.allhbm_ms, c.ceilings["link_read_gb_s"], bsz, bt.acc, c.per_expert)
        write_result(c.out_path, R, c.ceilings)
    write_result(c.out_path, R, c.ceilings)
    if args.save_replays:
        np.savez_compressed(Path(args.out) / "cache_replays.npz", **replay_arrays)
        log("replays written", Path(args.out) / "cache_replays.npz")
    return R


def _replay_arrays(bsz: int, routing, hidden, routers, k: int) -> dict:
    """``--save-replays``' arrays of one batch size: the all-HBM routing ``[steps, L, B, k]`` (the
    engine's group order) and, per depth d of :data:`REPLAY_DEPTHS` below the layer count, the
    ``lookahead`` policy's lists of :func:`coldset.analysis.forecast.lookahead_predictions` (layer l + d's
    router on layer l's router inputs ``hidden [steps, L, B, H]``) with ``k`` and ``k + 4``
    candidates a token: what :func:`coldset.analysis.simulate.simulate` replays as ``predictions``."""

    L = len(routers)
    out = {f"b{bsz}_routing": np.asarray(routing, dtype=np.int16)}
    for d in (d for d in REPLAY_DEPTHS if d < L):
        for n in (k, k + 4):
            out[f"b{bsz}_lookahead_d{d}_n{n}"] = lookahead_predictions(hidden, routers, d, n).astype(np.int32)
    return out


def compressed_model_inputs(c: CacheRun) -> dict:
    """A compressed row's time-model inputs: the tier's ratio and the run's decoder rate with its basis."""
    ct = c.R["compressed_tier"]
    return {"compressed_ratio": c.compressed.ratio, "decode_gb_s": ct["decode_gb_s"],
            "decode_gb_s_basis": ct["decode_gb_s_basis"]}


def list_recall(lists, routing, depth: int, num_experts: int) -> float:
    """The share of layer ``l + depth``'s selections (of every token of the step) that the lookahead
    list issued after group (step, ``l``) names: ``lists`` int ``[steps * L, W]`` instances (-1
    padded, the engine's :meth:`~coldset.engine.cache.pool.SlotCache.prefetch_lists`), ``routing`` int
    ``[steps, L, B, k]`` expert ids."""
    steps, L = routing.shape[:2]
    named = np.asarray(lists).reshape(steps, L, -1)
    hit = total = 0
    for s in range(steps):
        for layer in range(L - depth):
            t = layer + depth
            want = routing[s, t].reshape(-1) + t * num_experts
            hit += int(np.isin(want, named[s, layer]).sum())
            total += want.size
    return hit / total if total else float("nan")


def _fit_lookahead(model, ref_fn, profile_stream: list[int], args, R: dict) -> dict:
    """``--lookahead-fit``: the profile fixtures' router inputs at every MoE layer (the first
    :data:`coldset.engine.generate.LOOKAHEAD_FIT_TOKENS` prompt tokens, prefilled :data:`FIT_CHUNK`
    at a time on the unmodified path: :func:`coldset.engine.generate.router_inputs`), and per
    lookahead depth of the run (and 1, residency 1.0's) the fitted forecast matrices of
    :func:`coldset.analysis.forecast.fit_lookahead_routers`,
    in the routers' dtype."""
    import torch  # GPU-only path: loads when a measurement runs

    L = model.config.num_moe_layers
    chunks = [profile_stream[i:i + FIT_CHUNK] for i in range(0, len(profile_stream), FIT_CHUNK)]
    chunks = [c for c in chunks if len(c) == FIT_CHUNK]
    if not chunks:
        raise MeasureError(f"--lookahead-fit: the profile fixtures hold {len(profile_stream)} prompt tokens, "
                           f"fewer than one chunk of {FIT_CHUNK}")
    t0 = time.perf_counter()
    saved = model.experts_fn
    model.experts_fn = ref_fn
    try:
        hidden = router_inputs(model, chunks)
    finally:
        model.experts_fn = saved
    routers = moe_routers(model)
    depths = sorted({1, *(int(d) for d in args.depths.split(","))})
    fits = {d: fit_lookahead_routers(hidden, routers, d) for d in depths if d < L}
    R["lookahead_fit"] = {"profile_tokens": int(hidden.shape[0]), "shrink": LOOKAHEAD_FIT_SHRINK,
                          "depths": sorted(fits), "seconds": round(time.perf_counter() - t0, 1)}
    log("lookahead forecast fitted", R["lookahead_fit"])
    del hidden
    torch.cuda.empty_cache()
    return fits


def _other_fork(depth: int) -> str:
    """The ``--other-fork`` row's variant at ``depth``: the fork :meth:`SlotCache.build` does not
    choose there (it forks after the experts at depth >= 2)."""
    return "list-after-fill" if depth >= 2 else "list-after-experts"


def _manage_columns(replays: dict, allhbm_ms: float, link_gb_s: float, bsz: int, acc, per_expert: int) -> None:
    """The management columns, once every residency of the batch is measured: each cache row whose
    policy has a residency-1.0 row in the same run and batch (every selection a hit; lookahead: its
    depth-1 row; its ``--in-order`` and ``--other-fork`` rows: their own) gets
    :func:`_time_columns` again with that row's step, i.e. ``manage_ms_per_group`` and
    ``sim_managed_step_ms`` / ``sim_managed_over_measured``; rows whose policy has none keep None
    there."""
    def kind(name: str) -> str:  # the policy, lookahead's variants and the host tiers apart
        tier = " compressed" if name.endswith(" compressed") else ""
        name = name.removesuffix(tier)
        variant = next((v for v in LOOKAHEAD_VARIANTS if name.endswith(f" {v}")), None)
        return name.split("-")[0] + (f" {variant}" if variant else "") + tier

    full = {kind(name): r for name, (r, _) in replays.items() if r["residency"] == 1.0}
    for name, (r, sim) in replays.items():
        f = full.get(kind(name))
        if f is not None:
            r.update(_time_columns(r, allhbm_ms, link_gb_s, bsz, acc, sim, per_expert, f["step_ms_mean"]))


def _fit_nexttoken(prof_routing, k: int, E: int, extra: int, R: dict):
    """The ``nexttoken`` forecaster fitted on the profile routing [steps, L, B, k], each batch row
    one sequence (:meth:`coldset.analysis.forecast.NextTokenForecaster.fit_tuned`: its history parameters
    chosen on profile sequences only, as the workflow fits it on the profile split); recorded in ``R``."""

    S, L, B, _ = prof_routing.shape
    tokens = prof_routing.transpose(2, 0, 1, 3).reshape(-1, L, k)  # row by row, in decode order
    sequence = np.repeat(np.arange(B), S)
    t0 = time.perf_counter()
    F = NextTokenForecaster.fit_tuned(tokens, sequence, k, E, extra=extra)
    R["forecaster"] = {"terms": [list(t) for t in F.terms], "hist_unit": int(F.hist_unit),
                       "hist_shift": int(F.hist_shift), "n": int(F.num_predictions), "table_mb": F.nbytes / 1e6,
                       "fit_s": time.perf_counter() - t0}
    log("nexttoken forecaster", R["forecaster"])
    return F


#: bench cache's JSON names of :func:`coldset.bench.metrics.time_columns`' columns (committed results and
#: :mod:`coldset.measure.render` read these names).
_TIME_JSON_NAMES = {"overlap": "overlap", "bound_ms": "bound_ms", "bound_fraction": "fraction_of_bound",
                    "simulated_step_ms": "sim_step_ms", "simulated_over_measured": "sim_over_measured",
                    "manage_ms_per_group": "manage_ms_per_group", "simulated_managed_step_ms": "sim_managed_step_ms",
                    "simulated_managed_over_measured": "sim_managed_over_measured"}


def _time_columns(r: dict, allhbm_ms: float, link_gb_s: float, bsz: int, acc, sim, per_expert: int,
                  full_step_ms: float | None = None) -> dict:
    """A cache row's time columns under bench cache's JSON names: :func:`coldset.bench.metrics.time_columns`
    (the workflow bench's own) of its step against the all-HBM row's, the measured link read rate,
    its one replay ``sim`` of ``acc`` and, with ``full_step_ms`` (its policy's residency-1.0 step),
    the management columns (None without). A row over the compressed host tier: the time model with
    its ``compressed_ratio`` and ``decode_gb_s`` (:func:`coldset.measure.cache_compressed.compressed_time_columns`)."""

    if r.get("host_tier") == "compressed":
        return compressed_time_columns(r["step_ms_mean"], bsz, allhbm_ms, link_gb_s, acc, sim, per_expert,
                                       r["compressed_ratio"], r["decode_gb_s"], full_step_ms)
    cols = time_columns(r["step_ms_mean"], bsz, r["link_gb_per_token"], allhbm_ms, link_gb_s,
                           [(acc, sim, per_expert)], full_step_ms)
    return {_TIME_JSON_NAMES[name]: value for name, value in cols.items() if name in _TIME_JSON_NAMES}
