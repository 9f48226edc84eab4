"""The engine of this process, and what the decoding stages build around it.

The model and tokenizer, and the host tier of its experts, are built or loaded once for every
stage that runs in this process (gpu-stages: routing, parity and bench share one 61 GB model);
Snakemake runs each rule in its own process, so there it holds one stage's engine. Beside them:
the fixtures a stage decodes, a dynamic placement's slot cache and the lookahead forecast's fit.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from coldset.bench.decode import placement_forecaster
from coldset.core import mxfp4
from coldset.core.files import read_json
from coldset.core.placement import lookahead_depth_for
from coldset.analysis.forecast import fit_lookahead_routers
from coldset.analysis.placement import expert_bytes
from coldset.analysis.policies import REGISTRY
from coldset.analysis.time_model import time_models
from coldset.engine.cache.pool import SlotCache
from coldset.engine.generate import encode_prompts, router_inputs
from coldset.engine.loading import load_model, load_tokenizer
from coldset.engine.synthetic import ROUTER_KNOBS, build_synthetic_model, set_router_knobs
from coldset.kernels.tiers import host_tier as make_host_tier
from coldset.kernels.tune import result_from_entry
from coldset.trace.fixtures import read_fixtures, read_user_prompts, template_texts
from coldset.workflow.config import experts_format_choice
from coldset.workflow.context import StageContext, StageError

log = logging.getLogger("coldset")

_ENGINE: dict[str, Any] = {}


def _engine_key(ctx: StageContext, router: bool = True) -> str:
    """What determines the engine: the model section, the device and dtype, and for an in-memory
    model the fixtures (its tokenizer and domain directions learn from their text) or else the folder.
    ``router=False`` leaves out an in-memory model's router knobs (coldset.engine.synthetic.ROUTER_KNOBS),
    which :func:`coldset.engine.synthetic.set_router_knobs` changes on the built model."""
    model = dict(ctx.model)
    if ctx.in_memory:
        where = {"fixtures": dict(ctx.fixtures)}
        if not router:
            model = {**model, "synthetic": {k: v for k, v in model["synthetic"].items() if k not in ROUTER_KNOBS}}
    else:
        where = {"folder": str(ctx.model_dir.resolve())}
    return json.dumps({"model": model, "device": ctx.device, **where}, sort_keys=True, default=str)


def release_engine() -> None:
    """Forget this process's engine and host tier (their memory is freed once nothing else holds them)."""
    _ENGINE.clear()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def domain_texts(ctx: StageContext) -> dict[str, list[str]]:
    """Training text per traffic domain for the synthetic checkpoint (its tokenizer and domain
    clusters), so the default model routes the fixture domains differently, as real MoEs do.
    Rendered from the same templates with another seed than the fixtures, or the user's prompts."""
    fx = ctx.fixtures
    if fx["prompts"]:
        texts: dict[str, list[str]] = {}
        for f in read_user_prompts(fx["prompts"], fx["heldout_fraction"], fx["max_new_tokens"]):
            texts.setdefault(f.domain, []).append(f.prompt)
        return texts
    return template_texts(fx["domains"], 200, seed=fx["seed"] + 1, template_dir=fx["template_dir"])


def experts_format(ctx: StageContext) -> str:
    """The format of the routed experts this run holds and moves (``model.experts_format``): the
    checkpoint's own (:attr:`StageContext.model_shape`'s ``expert_format``: block FP8 kept FP8, MXFP4
    kept 4-bit, else the stored dtype), or with ``dequantized`` an MXFP4 folder's dequantized to
    ``model.dtype``. What the model manifest records and the placement and cache stages count bytes
    in. Refused by key: ``dequantized`` for experts that are not MXFP4, and MXFP4 kept 4-bit for a
    decoded model whose ``model.dtype`` is not bfloat16 (the MXFP4 kernels' activations)."""
    fmt, problem = experts_format_choice(ctx.model_shape.expert_format, ctx.model["experts_format"], ctx.dtype,
                                         ctx.decoding is None)
    if problem:
        raise StageError(f"config {problem} (model {ctx.model_name!r})")
    return fmt


def load_engine(ctx: StageContext):
    """``(model, tokenizer)`` of the configured model, loaded or built once per process (module doc).

    An in-memory synthetic model is generated on the configured device from its seed
    (:func:`coldset.engine.synthetic.build_synthetic_model`) and must have the manifest's config.
    """
    ctx.require_decoding("decode")
    key = _engine_key(ctx)
    if _ENGINE.get("key") == key:
        return _ENGINE["model"], _ENGINE["tokenizer"]
    if ctx.in_memory and _ENGINE.get("key_without_router") == _engine_key(ctx, router=False):
        # Only the router knobs changed (a calibration sweep): remake the routers from the parts
        # the build drew; the model is then the one a fresh build gives (coldset.engine.synthetic).
        set_router_knobs(_ENGINE["model"], ctx.synthetic_spec)
        _ENGINE["key"] = key
        log.info("in-memory synthetic model: routers remade for the new router knobs")
        return _ENGINE["model"], _ENGINE["tokenizer"]
    release_engine()  # one engine per process: free the previous one before making another
    device, dtype = ctx.device, ctx.torch_dtype
    t0 = time.perf_counter()
    if ctx.in_memory:
        expected = ctx.model_config
        log.info("building in-memory synthetic model %s on %s (%s)", ctx.model_name, device, ctx.dtype)
        mdl, tok = build_synthetic_model(ctx.synthetic_spec, device, dtype,
                                         domain_texts=domain_texts(ctx), progress=True)
        if mdl.config != expected:
            raise StageError(f"the in-memory model built here has config {mdl.config}, but the model "
                             f"manifest {ctx.manifest_path} says {expected}; run the model stage again")
    else:
        path = ctx.model_dir
        fmt = experts_format(ctx)
        keep = fmt == mxfp4.FORMAT_NAME
        log.info("loading %s on %s (%s, routed experts %s%s)", path, device, ctx.dtype, fmt,
                 " kept 4-bit" if keep else " dequantized from mxfp4" if fmt != ctx.model_shape.expert_format else "")
        mdl, tok = load_model(path, device=device, dtype=dtype, keep_mxfp4=keep), load_tokenizer(path)
    if mdl.device.type == "cuda":
        mdl.compile_decode()  # every stage's decode steps (routing, parity, bench) run the fast region (fused kernels)
    log.info("engine ready in %.1f s", time.perf_counter() - t0)
    _ENGINE.update(key=key, model=mdl, tokenizer=tok, host=None,
                   key_without_router=_engine_key(ctx, router=False) if ctx.in_memory else None)
    return mdl, tok


def host_tier(ctx: StageContext):
    """The engine's host tier (:func:`coldset.kernels.tiers.host_tier`), made once per process: every
    placement's cold rows point into it, so parity and bench pin host memory once in all."""
    engine, _ = load_engine(ctx)
    if _ENGINE.get("host") is None:
        t0 = time.perf_counter()
        _ENGINE["host"] = make_host_tier(engine.pools)
        tier = _ENGINE["host"]
        log.info("host tier: %.2f GB of experts (%s, %.2f GB reserved) in %.1f s", tier.nbytes / 1e9,
                 "pinned" if tier.pinned else "plain memory", tier.reserved_bytes / 1e9, time.perf_counter() - t0)
    return _ENGINE["host"]


def tuned(ctx: StageContext):
    """The autotune stage's entry for this model, as a TuneResult (the tuned launch configs)."""
    return result_from_entry(read_json(ctx.layout.autotune, "autotune entry"))


def parity_fixtures(ctx: StageContext) -> list:
    """The fixtures the parity gate decodes (coldset's engine and vLLM's alike): every fixture, or
    the first ``parity.fixtures_per_domain`` of each domain in file order."""
    fxs = read_fixtures(list(ctx.fixture_paths))
    per_domain = ctx.parity["fixtures_per_domain"]
    if not per_domain:
        return fxs
    kept: dict[str, list] = {}
    for f in fxs:
        kept.setdefault(f.domain, []).append(f)
    return [f for group in kept.values() for f in group[:per_domain]]


def split_fixtures(ctx: StageContext, split: str, purpose: str = "bench.prompt_split") -> list:
    """The fixtures of ``split`` (``heldout`` | ``profile`` | ``all``), in fixture order; refused if
    none, naming ``purpose`` (what asked for them)."""
    fxs = [f for f in read_fixtures(list(ctx.fixture_paths)) if split == "all" or f.split == split]
    if not fxs:
        raise StageError(f"{purpose} {split!r}: no fixture is in that split (fixtures.heldout_fraction "
                         f"{ctx.fixtures['heldout_fraction']}); choose another split or hold out fixtures")
    return fxs


def gate_lead_unit(ctx: StageContext, policy: str, batch: int) -> int | None:
    """The prefetch gate unit a gated policy's cache decides with at ``batch``: the one the cache
    stage simulated it with (:meth:`coldset.analysis.time_model.TimeModel.lead_unit` of the config's
    ``cache.time`` at that batch, the experts' bytes in this run's format), so the engine runs the
    decisions the recommendation was timed on; None for a policy without a gate (static ones
    included), and the policies' default unit for a batch ``cache.time.steps`` does not list (logged)."""
    rules = REGISTRY.get(policy)  # a static placement's policy (positional, usage_global) has no cache
    if rules is None or not rules.gated:
        return None
    shape = ctx.model_shape
    models = time_models(ctx.cache["time"], expert_bytes(shape, experts_format(ctx)))
    if batch not in models:
        log.info("cache %s at batch %d: cache.time.steps lists no all-HBM step for it (batches %s): the prefetch "
                 "gate takes its default unit", policy, batch, sorted(models))
        return None
    model = next(iter(models[batch].values()))  # the policies' models differ in manage_ms only, which the unit omits
    return model.lead_unit(shape.num_moe_layers)


def slot_cache(engine, host, placement, max_tokens: int, depth: int | None = None, fit=None,
               lead_unit: int | None = None):
    """The slot cache of a dynamic placement (``lru-0.5``), fresh from its warm state, deciding for
    decode steps of up to ``max_tokens`` tokens (a lookahead's ``depth``: its depth for them unless
    given; a gated policy's ``lead_unit``: :func:`gate_lead_unit`); None for a static placement. A
    lookahead placement with ``cache_lookahead_fit`` forecasts with the matrices fitted on the profile
    split's router inputs (``fit``: :func:`lookahead_fit`, shared by the stage's placements); else
    with the later layers' routers."""
    if not placement.dynamic:
        return None
    routers = [engine.layers[i].mlp.gate.weight.detach() for i in engine.config.moe_layers]
    if placement.policy == "lookahead" and placement.cache_lookahead_fit:
        if fit is None:
            raise StageError(f"placement {placement.label}: a fitted lookahead forecast needs the profile router "
                             "inputs (the stage's fit)")
        routers = fit(depth if depth is not None else lookahead_depth_for(placement.cache_lookahead_depth, max_tokens),
                      routers)
    return SlotCache.from_placement(engine.pools, host, placement, max_tokens, engine.config.top_k, routers=routers,
                                    forecaster=placement_forecaster(placement),
                                    prefetch_budget=placement.cache_prefetch_budget, depth=depth,
                                    lead_unit=lead_unit)


def lookahead_fit(ctx: StageContext, engine, tokenizer) -> Callable:
    """The function :func:`slot_cache` fits a lookahead forecast with, its work done once a stage
    and only if a placement asks: ``fit(depth, routers)`` is
    :func:`coldset.analysis.forecast.fit_lookahead_routers` on the router inputs of the profile split's
    fixture prompts (:func:`coldset.engine.generate.router_inputs`, one prefill each on the unmodified
    path), memoized per depth. The placement stage never saw hidden states (its inputs are routing
    counts); the parity and bench stages, which load the model, fit the same matrices from the same
    prompts."""
    memo: dict = {}

    def fit(depth: int, routers: list):
        if "hidden" not in memo:
            fxs = split_fixtures(ctx, "profile", "cache.lookahead_fit (the fit's prompts): split")
            memo["hidden"] = router_inputs(engine, encode_prompts(tokenizer, [f.prompt for f in fxs]))
            log.info("lookahead forecast: %d profile tokens' router inputs", memo["hidden"].shape[0])
        if depth not in memo:
            memo[depth] = fit_lookahead_routers(memo["hidden"], routers, int(depth))
        return memo[depth]

    return fit
