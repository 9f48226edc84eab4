"""The stages before any placement is decoded: model, fixtures, routing, stats, placement, cache, autotune.

Each takes the :class:`coldset.workflow.context.StageContext` and translates it into library
calls; the logic lives in the modules each body names.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, replace

from coldset.analysis.cache import run_cache
from coldset.analysis.forecast import NextTokenForecaster
from coldset.analysis.placement import run_placement
from coldset.analysis.stats import run_stats
from coldset.analysis.streams import select_rows, token_array, trace_decode_rows
from coldset.core import fp8, mxfp4
from coldset.core.files import write_json
from coldset.core.placement import ProfileSpec
from coldset.engine.gpt_oss import GptOssConfig
from coldset.engine.loading import read_config
from coldset.engine.synthetic import synthetic_model_config, write_synthetic_checkpoint
from coldset.kernels.tune import TuneShape, autotune as tune, write_entry
from coldset.serve.vllm_backend import capture_routing_vllm
from coldset.trace.capture import capture_routing_engine
from coldset.trace.fixtures import make_fixtures
from coldset.trace.importers import import_trace
from coldset.verify.fingerprint import model_files
from coldset.verify.gate import experts_functions
from coldset.workflow.context import IN_MEMORY_SOURCE, StageContext, StageError
from coldset.workflow.process_engine import domain_texts, experts_format, load_engine, release_engine

log = logging.getLogger("coldset")


def model(ctx: StageContext, **_) -> None:
    """Generate the synthetic checkpoint, or check the configured local folder; write the manifest.

    An in-memory synthetic model (``model.synthetic.in_memory``) writes only the manifest (its
    spec and the config its build will have): its weights are made by each process that uses it.
    """
    if not ctx.in_memory:
        release_engine()  # a cached engine may come from the checkpoint this stage rewrites
    if ctx.model_path is not None and ctx.model["synthetic"]:
        raise StageError("config sets both model.path and model.synthetic: choose one")
    if ctx.in_memory:
        spec = ctx.synthetic_spec
        cfg = synthetic_model_config(spec, domain_texts(ctx), ctx.dtype)
        log.info("in-memory synthetic model %s: manifest only (%d layers x %d experts, hidden %d)",
                 ctx.model_name, cfg.num_layers, cfg.num_experts, cfg.hidden_size)
        write_json(ctx.manifest_path, {
            "name": ctx.model_name, "path": None, "source": IN_MEMORY_SOURCE,
            "config": asdict(cfg), "spec": asdict(spec),
        })
        return
    path = ctx.model_dir
    if ctx.decoding is not None:
        shape = ctx.model_shape
        log.info("shape-only model %s (%s): %d layers, %d MoE layers x %d experts, top-%d, %s experts; "
                 "decoding stages are skipped", ctx.model_name, ctx.decoding, shape.num_layers,
                 shape.num_moe_layers, shape.num_experts, shape.top_k, shape.expert_format)
        write_json(ctx.manifest_path, {
            "name": ctx.model_name, "path": str(path.resolve()), "source": "shape-only",
            "decodes": False, "reason": ctx.decoding, "shape": shape.to_dict(),
        })
        return
    if ctx.model_path is not None:
        source = "local"
    else:
        spec = ctx.synthetic_spec
        log.info("writing synthetic checkpoint %s to %s", spec, path)
        write_synthetic_checkpoint(spec, path, domain_texts=domain_texts(ctx))
        source = "synthetic"
    cfg = read_config(path)  # the loader's own checks: clear errors on a bad folder
    if not (path / "tokenizer.json").is_file():
        raise StageError(f"model folder {path} has no tokenizer.json")
    fmt = experts_format(ctx)  # what the engine runs (refused here, before any job, if it cannot)
    if fmt == mxfp4.FORMAT_NAME:  # kept 4-bit: the engine's config says so (coldset.engine.gpt_oss.load)
        cfg = replace(cfg, expert_format=fmt)
    log.info("model %s: routed experts stored as %s, run as %s", ctx.model_name, ctx.model_shape.expert_format, fmt)
    write_json(ctx.manifest_path, {
        "name": ctx.model_name, "path": str(path.resolve()), "source": source,
        "experts_format": fmt, "checkpoint_experts_format": ctx.model_shape.expert_format,
        "config": {k: v for k, v in asdict(cfg).items()},
        "files": model_files(path),  # what the parity fingerprint's model digest covers
    })


def fixtures(ctx: StageContext, **_) -> None:
    fx = ctx.fixtures
    make_fixtures(ctx.layout.fixtures_dir, fx["domains"], fx["per_domain"],
                  fx["heldout_fraction"], fx["max_new_tokens"], fx["seed"],
                  template_dir=fx["template_dir"], user_prompts=fx["prompts"])


def routing(ctx: StageContext, **_) -> None:
    """Capture the trace with the embedded engine, or import the configured one."""
    out = ctx.layout.trace
    out.parent.mkdir(parents=True, exist_ok=True)
    rc = ctx.routing
    if rc["trace"]:
        # An external trace must match a configured real model (model.path); with the synthetic
        # default it stands alone (statistics of another model's traffic, e.g. a public trace).
        expect = ctx.model_shape if ctx.model_path is not None else None
        report = import_trace(rc["trace"], out, kind=rc["trace_format"], expect=expect,
                              model_name=ctx.model_name,
                              heldout_fraction=ctx.stats["heldout_fraction"],
                              domains=rc.get("trace_domains") or None)
        log.info("imported %s: %s", rc["trace"], report)
        return
    if rc["backend"] == "vllm":  # vLLM runs families the embedded engine does not; it needs the weights
        if ctx.model_path is not None and not any(ctx.model_path.glob("*.safetensors")):
            raise StageError(f"routing.backend vllm needs the model's weights; {ctx.model_path} holds "
                             "none. Set routing.trace to a trace the model's server exported instead")
        capture_routing_vllm(ctx.model_dir, list(ctx.fixture_paths), out, dtype=ctx.dtype,
                             model_name=ctx.model_name, method=rc["vllm_method"],
                             llm_kwargs=dict(rc["vllm_args"]))
        return
    ctx.require_decoding("routing (capture; set routing.trace to import a trace instead)")
    engine, tokenizer = load_engine(ctx)
    saved = engine.experts_fn
    # The unmodified experts path with its default launch configs (Triton on CUDA, the torch path
    # on the CPU): what serving without offload computes; the torch path on CUDA would be far slower.
    engine.experts_fn = experts_functions(engine.device, None)[0]
    try:
        capture_routing_engine(engine, tokenizer, list(ctx.fixture_paths), out, batch_size=rc["batch_size"],
                               model_name=ctx.model_name,
                               source_detail="in-memory synthetic" if ctx.in_memory else None)
    finally:
        engine.experts_fn = saved


def stats(ctx: StageContext, **_) -> None:
    run_stats(ctx.layout.trace, ctx.layout.stats_dir, heldout_fraction=ctx.stats["heldout_fraction"],
              locality_seed=ctx.stats["locality_seed"],
              max_pairwise_domains=ctx.stats["max_pairwise_domains"])


def _domain_weights(ctx: StageContext) -> str | None:
    return "equal" if ctx.placement["weight_domains"] else None


def placement(ctx: StageContext, **_) -> None:
    pc = ctx.placement
    forecaster = _fit_nexttoken(ctx) if "nexttoken" in pc["policies"] else None
    run_placement(ctx.layout.stats_dir / "histogram.csv", ctx.model_shape, ctx.layout.placement_dir,
                  pc["policies"], pc["residency"], pc["profile_domains"], phase=pc["phase"],
                  weight_format=experts_format(ctx),
                  domain_weights=_domain_weights(ctx),
                  bandwidths=(pc["bandwidths"], *({"h200", "gb300"} - {pc["bandwidths"]})),
                  batch_sizes=ctx.bench["batch_sizes"], model=ctx.model_name,
                  lookahead_depth=ctx.cache["lookahead_depth"], forecaster=forecaster,
                  prefetch_budget=ctx.cache["prefetch_budget"], lookahead_fit=ctx.cache["lookahead_fit"])


def _fit_nexttoken(ctx: StageContext):
    """The ``nexttoken`` placement's forecaster: fitted on the profile split's decode tokens of the
    trace (the profile domains of ``placement``), with ``cache.nexttoken_extra`` candidates beyond
    top_k, exactly as the cache stage fits its own (:func:`coldset.analysis.cache.run_cache`). Fitted here
    once and saved in the placement (not refitted by parity or bench), so the gate and the bench
    run the tables the fingerprint covers."""
    pc = ctx.placement
    trace = ctx.layout.trace
    rows, meta = trace_decode_rows(trace, ctx.stats["heldout_fraction"], expect=ctx.model_shape)
    spec = ProfileSpec.make(pc["profile_domains"], pc["phase"], _domain_weights(ctx))
    tokens, seq = token_array(select_rows(rows, "profile", spec.domains), meta.num_moe_layers, meta.num_experts)
    if tokens.shape[0] == 0:
        raise StageError(f"placement nexttoken: the trace {trace} has no profile decode tokens to fit the "
                         "forecaster on")
    return NextTokenForecaster.fit_tuned(tokens, seq, meta.top_k, meta.num_experts,
                                         extra=ctx.cache["nexttoken_extra"])


def cache(ctx: StageContext, **_) -> None:
    """Replay the held-out decode routing through the cache policies (coldset.analysis.cache.run_cache)."""
    layout, pc, cc = ctx.layout, ctx.placement, ctx.cache
    run_cache(layout.trace, layout.stats_dir / "histogram.csv", ctx.model_shape, layout.cache_dir,
              cc["policies"], pc["residency"], pc["profile_domains"], phase=pc["phase"],
              domain_weights=_domain_weights(ctx), weight_format=experts_format(ctx),
              heldout_fraction=ctx.stats["heldout_fraction"],
              locality_json=layout.stats_dir / "locality.json", time=cc["time"],
              prefetch_budget=cc["prefetch_budget"], nexttoken_extra=cc["nexttoken_extra"],
              compressed=cc.get("compressed_tier"))


def _tuned_activation(cfg):
    """The experts' activation (gpt_oss's config names it; every other family's experts are SiLU,
    the kernels' default, None): the autotune key's field."""
    return cfg.activation if isinstance(cfg, GptOssConfig) else None


def autotune(ctx: StageContext, **_) -> None:
    """Tune the experts kernel for the model's shape (cache hit in seconds); copy the entry to results/.

    The kernel is the same for every placement, so it is tuned once per model, on the all-hot
    layout, for the configured bench batch sizes; every placement then runs with that entry.
    """
    ctx.require_decoding("autotune")
    cfg = ctx.model_config
    fmt = experts_format(ctx)  # the kernel of the experts' format that runs: its own configs and key
    shape = TuneShape(num_experts=cfg.num_experts, hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size,
                      top_k=cfg.top_k, dtype=ctx.dtype, num_moe_layers=cfg.num_moe_layers,
                      num_hot=cfg.num_moe_layers * cfg.num_experts, num_cold=0,
                      weight_format=fmt if fmt in (fp8.FORMAT_NAME, mxfp4.FORMAT_NAME) else None,
                      expert_bias=cfg.expert_bias, activation=_tuned_activation(cfg))
    result = tune(shape, ctx.bench["batch_sizes"], ctx.device, ctx.autotune["cache_dir"])
    log.info("autotune key %s: %s (%s)", result.key[:16], "cache hit" if result.hit else "tuned", result.path)
    write_entry(result, ctx.layout.autotune)
