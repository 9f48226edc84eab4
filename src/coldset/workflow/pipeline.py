"""The stages of the workflow as functions of the validated config (DESIGN.md §1).

Each stage reads and writes the files :class:`coldset.workflow.config.Layout` names, so the Snakemake
rules (through workflow/scripts/, which only call :func:`run_from_snakemake`) and
``python -m coldset STAGE`` (for the GPU host, which has no Snakemake) run the same code on the
same paths. The stage bodies only translate config into library calls; logic lives in the
modules named in each body.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from coldset.workflow.config import Layout, bench_request_count, config_hash, decoding_support, model_configs, resolve_device
from coldset.core.files import read_json, write_json

log = logging.getLogger("coldset")


class StageError(RuntimeError):
    """A stage could not run with this configuration (the message says why)."""


# ------------------------------------------------------------------------------------ helpers

IN_MEMORY_SOURCE = "synthetic-in-memory"


def in_memory(config: dict) -> bool:
    """Whether the model is generated in memory by each process that uses it (no folder, no files).

    ``model.synthetic.in_memory: true``: real shapes (61 GB at Qwen3-30B-A3B's) are cheaper to
    regenerate from the seed on the GPU than to write and reload.
    """
    return not config["model"]["path"] and bool((config["model"]["synthetic"] or {}).get("in_memory"))


def synthetic_spec(config: dict):
    """The config's ``model.synthetic`` as a :class:`coldset.engine.synthetic.SyntheticSpec` (unknown keys refused)."""
    from coldset.engine.synthetic import SyntheticSpec

    known = {f.name for f in fields(SyntheticSpec)}
    unknown = sorted(set(config["model"]["synthetic"]) - known)
    if unknown:
        raise StageError(f"config model.synthetic: unknown setting(s) {unknown}; known: {sorted(known)}")
    return SyntheticSpec(**config["model"]["synthetic"])


def model_dir(config: dict) -> Path:
    """The Hugging Face folder every model-reading stage loads (refused for an in-memory model)."""
    if in_memory(config):
        raise StageError(
            f"config model.synthetic.in_memory is true: model {config['model']['name']!r} is generated in "
            "memory by each process that uses it and has no folder (stages read its shape with "
            "coldset.workflow.pipeline.model_config and its weights through the engine); a stage that needs a "
            "folder (e.g. routing.backend: vllm) cannot run it: set in_memory: false to write a checkpoint")
    if config["model"]["path"]:
        return Path(config["model"]["path"])
    return Layout.from_config(config).model_dir / "hf"


def _manifest_path(config: dict) -> Path:
    return Layout.from_config(config).model_dir / "manifest.json"


def model_config(config: dict):
    """The model's architecture (:class:`coldset.engine.model.ModelConfig`) for stages that need only its shape.

    A folder's ``config.json``; for an in-memory model, the model stage's manifest (the config
    :func:`coldset.engine.synthetic.synthetic_model_config` gave), refused if its spec is not the config's.
    """
    from coldset.engine.model import ModelConfig

    if not in_memory(config):
        return ModelConfig.from_pretrained(model_dir(config))
    path = _manifest_path(config)
    try:
        manifest = read_json(path, "model manifest")
    except FileNotFoundError as exc:
        raise StageError(f"{exc}: run the model stage first") from None
    spec = asdict(synthetic_spec(config))
    if manifest.get("source") != IN_MEMORY_SOURCE or manifest.get("spec") != spec:
        raise StageError(f"model manifest {path} was not written for this config's in-memory model "
                         f"(source {manifest.get('source')!r}, spec {manifest.get('spec')}); run the model stage again")
    try:
        return ModelConfig.from_dict(manifest["config"], f"model manifest {path} field 'config'")
    except ValueError as exc:
        raise StageError(f"{exc}; run the model stage again") from None


def model_shape(config: dict):
    """The model's shape and weight bytes (:class:`coldset.core.shapes.MoEShape`) for the stages that do
    not decode (placement, the speed model, the cache simulation): a folder's ``config.json`` of
    any family :mod:`coldset.core.shapes` reads (weights not needed), or an in-memory model's manifest."""
    from coldset.core import shapes

    if in_memory(config):  # its ModelConfig is a shape, in the dtype the model is built in
        return model_config(config)
    try:
        return shapes.read_shape(model_dir(config))
    except shapes.ShapeError as exc:
        raise StageError(str(exc)) from None


# Stages that decode with the embedded engine (or feed only those): skipped for a shape-only model.
DECODING_STAGES = ("autotune", "parity", "parity_gate", "bench")


def skipped_stages(config: dict) -> dict[str, str]:
    """The stages the workflow leaves out for this config, each with the reason (the report shows
    them): the decoding stages of a shape-only model."""
    reason = decoding_support(config)
    if reason is None:
        return {}
    return {stage: f"{reason}; {stage} decodes the model" for stage in DECODING_STAGES}


def require_decoding(config: dict, stage: str) -> None:
    """Refuse a decoding stage for a shape-only model, saying what does work."""
    reason = decoding_support(config)
    if reason is None:
        return
    raise StageError(
        f"stage {stage} cannot run for model {config['model']['name']!r}: {reason}. Routing capture, "
        "autotune, parity and bench decode with the embedded engine, which needs a qwen3_moe or mixtral "
        "folder with its weights. What works with config.json alone: set routing.trace to a recorded "
        "trace (this project's parquet, vLLM's routed_experts export or an SGLang dump), then run "
        "stats, placement and report (`snakemake --cores all report` skips the decoding stages)")


# The engine of this process: (model, tokenizer) and the host tier of its experts, built or loaded
# once for every stage that runs here (gpu-stages: routing, parity and bench share one 61 GB
# model). Snakemake runs each rule in its own process, so there it holds one stage's engine.
_ENGINE: dict[str, Any] = {}


def _engine_key(config: dict, router: bool = True) -> str:
    """What determines the engine: the model section, the device and dtype, and for an in-memory
    model the fixtures (its tokenizer and domain directions learn from their text) or else the folder.
    ``router=False`` leaves out an in-memory model's router knobs (coldset.engine.synthetic.ROUTER_KNOBS),
    which :func:`coldset.engine.synthetic.set_router_knobs` changes on the built model."""
    from coldset.engine.synthetic import ROUTER_KNOBS

    model = config["model"]
    if in_memory(config):
        where = {"fixtures": config["fixtures"]}
        if not router:
            model = {**model, "synthetic": {k: v for k, v in model["synthetic"].items() if k not in ROUTER_KNOBS}}
    else:
        where = {"folder": str(model_dir(config).resolve())}
    return json.dumps({"model": model, "device": resolve_device(config), **where}, sort_keys=True, default=str)


def release_engine() -> None:
    """Forget this process's engine and host tier (their memory is freed once nothing else holds them)."""
    _ENGINE.clear()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _torch_dtype(config: dict):
    import torch

    return getattr(torch, config["model"]["dtype"])


def _fixture_paths(config: dict) -> list[Path]:
    layout = Layout.from_config(config)
    return [layout.fixtures(d) for d in config["fixtures"]["domains"]]


def parity_fixtures(config: dict) -> list:
    """The fixtures the parity gate decodes (coldset's engine and vLLM's alike): every fixture, or
    the first ``parity.fixtures_per_domain`` of each domain in file order."""
    from coldset.trace.fixtures import read_fixtures

    fxs = read_fixtures(_fixture_paths(config))
    per_domain = config["parity"]["fixtures_per_domain"]
    if not per_domain:
        return fxs
    kept: dict[str, list] = {}
    for f in fxs:
        kept.setdefault(f.domain, []).append(f)
    return [f for group in kept.values() for f in group[:per_domain]]


def _placement_names(config: dict, only: list[str] | None) -> list[str]:
    from coldset.core.placement import residency_label

    names = [f"{p}-{residency_label(r)}" for p in config["placement"]["policies"]
             for r in config["placement"]["residency"]]
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise StageError(f"unknown placement(s) {unknown}; configured: {names}")
        names = [n for n in names if n in only]
    return names


def _load_engine(config: dict):
    """``(model, tokenizer)`` of the configured model, loaded or built once per process (see ``_ENGINE``).

    An in-memory synthetic model is generated on the configured device from its seed
    (:func:`coldset.engine.synthetic.build_synthetic_model`) and must have the manifest's config.
    """
    require_decoding(config, "decode")
    key = _engine_key(config)
    if _ENGINE.get("key") == key:
        return _ENGINE["model"], _ENGINE["tokenizer"]
    if in_memory(config) and _ENGINE.get("key_without_router") == _engine_key(config, router=False):
        # Only the router knobs changed (a calibration sweep): remake the routers from the parts
        # the build drew; the model is then the one a fresh build gives (coldset.engine.synthetic).
        from coldset.engine.synthetic import set_router_knobs

        set_router_knobs(_ENGINE["model"], synthetic_spec(config))
        _ENGINE["key"] = key
        log.info("in-memory synthetic model: routers remade for the new router knobs")
        return _ENGINE["model"], _ENGINE["tokenizer"]
    release_engine()  # one engine per process: free the previous one before making another
    device, dtype = resolve_device(config), _torch_dtype(config)
    t0 = time.perf_counter()
    if in_memory(config):
        from coldset.engine.synthetic import build_synthetic_model

        expected = model_config(config)
        log.info("building in-memory synthetic model %s on %s (%s)", config["model"]["name"], device,
                 config["model"]["dtype"])
        mdl, tok = build_synthetic_model(synthetic_spec(config), device, dtype,
                                         domain_texts=_domain_texts(config), progress=True)
        if mdl.config != expected:
            raise StageError(f"the in-memory model built here has config {mdl.config}, but the model "
                             f"manifest {_manifest_path(config)} says {expected}; run the model stage again")
    else:
        from coldset.engine.loading import load_model, load_tokenizer

        path = model_dir(config)
        log.info("loading %s on %s (%s)", path, device, config["model"]["dtype"])
        mdl, tok = load_model(path, device=device, dtype=dtype), load_tokenizer(path)
    if mdl.device.type == "cuda":
        mdl.compile_decode()  # every stage's decode steps (routing, parity, bench) run the fast region (fused kernels)
    log.info("engine ready in %.1f s", time.perf_counter() - t0)
    _ENGINE.update(key=key, model=mdl, tokenizer=tok, host=None,
                   key_without_router=_engine_key(config, router=False) if in_memory(config) else None)
    return mdl, tok


def _host_tier(config: dict):
    """The engine's host tier (:func:`coldset.kernels.tiers.host_tier`), made once per process: every
    placement's cold rows point into it, so parity and bench pin host memory once in all."""
    from coldset.kernels.tiers import host_tier

    engine, _ = _load_engine(config)
    if _ENGINE.get("host") is None:
        t0 = time.perf_counter()
        _ENGINE["host"] = host_tier(engine.pools)
        tier = _ENGINE["host"]
        log.info("host tier: %.2f GB of experts (%s, %.2f GB reserved) in %.1f s", tier.nbytes / 1e9,
                 "pinned" if tier.pinned else "plain memory", tier.reserved_bytes / 1e9, time.perf_counter() - t0)
    return _ENGINE["host"]


def _tuned(config: dict):
    """The autotune stage's entry for this model, as a TuneResult (the tuned launch configs)."""
    from coldset.kernels.tune import result_from_entry

    return result_from_entry(read_json(Layout.from_config(config).autotune, "autotune entry"))


def _domain_texts(config: dict) -> dict[str, list[str]]:
    """Training text per traffic domain for the synthetic checkpoint (its tokenizer and domain
    clusters), so the default model routes the fixture domains differently, as real MoEs do.
    Rendered from the same templates with another seed than the fixtures, or the user's prompts."""
    from coldset.trace.fixtures import read_user_prompts, template_texts

    fx = config["fixtures"]
    if fx["prompts"]:
        texts: dict[str, list[str]] = {}
        for f in read_user_prompts(fx["prompts"], fx["heldout_fraction"], fx["max_new_tokens"]):
            texts.setdefault(f.domain, []).append(f.prompt)
        return texts
    return template_texts(fx["domains"], 200, seed=fx["seed"] + 1, template_dir=fx["template_dir"])


# ------------------------------------------------------------------------------------ stages

def model(config: dict, **_) -> None:
    """Generate the synthetic checkpoint, or check the configured local folder; write the manifest.

    An in-memory synthetic model (``model.synthetic.in_memory``) writes only the manifest (its
    spec and the config its build will have): its weights are made by each process that uses it.
    """
    from coldset.engine.model import ModelConfig

    if not in_memory(config):
        release_engine()  # a cached engine may come from the checkpoint this stage rewrites
    layout = Layout.from_config(config)
    if config["model"]["path"] and config["model"]["synthetic"]:
        raise StageError("config sets both model.path and model.synthetic: choose one")
    if in_memory(config):
        from coldset.engine.synthetic import synthetic_model_config

        spec = synthetic_spec(config)
        cfg = synthetic_model_config(spec, _domain_texts(config), config["model"]["dtype"])
        log.info("in-memory synthetic model %s: manifest only (%d layers x %d experts, hidden %d)",
                 config["model"]["name"], cfg.num_layers, cfg.num_experts, cfg.hidden_size)
        write_json(layout.model_dir / "manifest.json", {
            "name": config["model"]["name"], "path": None, "source": IN_MEMORY_SOURCE,
            "config": asdict(cfg), "spec": asdict(spec),
        })
        return
    path = model_dir(config)
    shape_only = decoding_support(config)
    if shape_only is not None:
        shape = model_shape(config)
        log.info("shape-only model %s (%s): %d layers, %d MoE layers x %d experts, top-%d, %s experts; "
                 "decoding stages are skipped", config["model"]["name"], shape_only, shape.num_layers,
                 shape.num_moe_layers, shape.num_experts, shape.top_k, shape.expert_format)
        write_json(layout.model_dir / "manifest.json", {
            "name": config["model"]["name"], "path": str(path.resolve()), "source": "shape-only",
            "decodes": False, "reason": shape_only, "shape": shape.to_dict(),
        })
        return
    if config["model"]["path"]:
        source = "local"
    else:
        from coldset.engine.synthetic import write_synthetic_checkpoint

        spec = synthetic_spec(config)
        log.info("writing synthetic checkpoint %s to %s", spec, path)
        write_synthetic_checkpoint(spec, path, domain_texts=_domain_texts(config))
        source = "synthetic"
    cfg = ModelConfig.from_pretrained(path)  # the loader's own checks: clear errors on a bad folder
    if not (path / "tokenizer.json").is_file():
        raise StageError(f"model folder {path} has no tokenizer.json")
    from coldset.verify.fingerprint import model_files

    write_json(layout.model_dir / "manifest.json", {
        "name": config["model"]["name"], "path": str(path.resolve()), "source": source,
        "config": {k: v for k, v in asdict(cfg).items()},
        "files": model_files(path),  # what the parity fingerprint's model digest covers
    })


def fixtures(config: dict, **_) -> None:
    from coldset.trace.fixtures import make_fixtures

    fx = config["fixtures"]
    make_fixtures(Layout.from_config(config).fixtures_dir, fx["domains"], fx["per_domain"],
                  fx["heldout_fraction"], fx["max_new_tokens"], fx["seed"],
                  template_dir=fx["template_dir"], user_prompts=fx["prompts"])


def routing(config: dict, **_) -> None:
    """Capture the trace with the embedded engine, or import the configured one."""
    from coldset.trace.importers import import_trace
    from coldset.trace.capture import capture_routing_engine

    layout = Layout.from_config(config)
    out = layout.trace
    out.parent.mkdir(parents=True, exist_ok=True)
    rc = config["routing"]
    if rc["trace"]:
        # An external trace must match a configured real model (model.path); with the synthetic
        # default it stands alone (statistics of another model's traffic, e.g. a public trace).
        expect = model_shape(config) if config["model"]["path"] else None
        report = import_trace(rc["trace"], out, kind=rc["trace_format"], expect=expect,
                              model_name=config["model"]["name"],
                              heldout_fraction=config["stats"]["heldout_fraction"],
                              domains=rc.get("trace_domains") or None)
        log.info("imported %s: %s", rc["trace"], report)
        return
    if rc["backend"] == "vllm":  # vLLM runs families the embedded engine does not; it needs the weights
        if config["model"]["path"] and not any(Path(config["model"]["path"]).glob("*.safetensors")):
            raise StageError(f"routing.backend vllm needs the model's weights; {config['model']['path']} holds "
                             "none. Set routing.trace to a trace the model's server exported instead")
        from coldset.serve.vllm_backend import capture_routing_vllm

        capture_routing_vllm(model_dir(config), _fixture_paths(config), out, dtype=config["model"]["dtype"],
                             model_name=config["model"]["name"], method=rc["vllm_method"],
                             llm_kwargs=rc["vllm_args"])
        return
    from coldset.verify.gate import experts_functions

    require_decoding(config, "routing (capture; set routing.trace to import a trace instead)")
    engine, tokenizer = _load_engine(config)
    saved = engine.experts_fn
    # The unmodified experts path with its default launch configs (Triton on CUDA, the torch path
    # on the CPU): what serving without offload computes; the torch path on CUDA would be far slower.
    engine.experts_fn = experts_functions(engine.device, None)[0]
    try:
        capture_routing_engine(engine, tokenizer, _fixture_paths(config), out, batch_size=rc["batch_size"],
                                     model_name=config["model"]["name"],
                                     source_detail="in-memory synthetic" if in_memory(config) else None)
    finally:
        engine.experts_fn = saved


def stats(config: dict, **_) -> None:
    from coldset.analysis.stats import run_stats

    layout = Layout.from_config(config)
    run_stats(layout.trace, layout.stats_dir, heldout_fraction=config["stats"]["heldout_fraction"],
              locality_seed=config["stats"]["locality_seed"],
              max_pairwise_domains=config["stats"]["max_pairwise_domains"])


def placement(config: dict, **_) -> None:
    from coldset.analysis.placement import run_placement

    layout = Layout.from_config(config)
    pc = config["placement"]
    forecaster = _fit_nexttoken(config) if "nexttoken" in pc["policies"] else None
    run_placement(layout.stats_dir / "histogram.csv", model_shape(config), layout.placement_dir,
                  pc["policies"], pc["residency"], pc["profile_domains"], phase=pc["phase"],
                  domain_weights="equal" if pc["weight_domains"] else None,
                  bandwidths=(pc["bandwidths"], *({"h200", "gb300"} - {pc["bandwidths"]})),
                  batch_sizes=config["bench"]["batch_sizes"], model=config["model"]["name"],
                  lookahead_depth=config["cache"]["lookahead_depth"], forecaster=forecaster,
                  prefetch_budget=config["cache"]["prefetch_budget"], lookahead_fit=config["cache"]["lookahead_fit"])


def _fit_nexttoken(config: dict):
    """The ``nexttoken`` placement's forecaster: fitted on the profile split's decode tokens of the
    trace (the profile domains of ``placement``), with ``cache.nexttoken_extra`` candidates beyond
    top_k, exactly as the cache stage fits its own (:func:`coldset.analysis.cache.run_cache`). Fitted here
    once and saved in the placement (not refitted by parity or bench), so the gate and the bench
    run the tables the fingerprint covers."""
    from coldset.analysis.streams import select_rows, token_array, trace_decode_rows
    from coldset.analysis.forecast import NextTokenForecaster
    from coldset.core.placement import ProfileSpec

    layout = Layout.from_config(config)
    pc = config["placement"]
    rows, meta = trace_decode_rows(layout.trace, config["stats"]["heldout_fraction"], expect=model_shape(config))
    spec = ProfileSpec.make(pc["profile_domains"], pc["phase"], "equal" if pc["weight_domains"] else None)
    tokens, seq = token_array(select_rows(rows, "profile", spec.domains), meta.num_moe_layers, meta.num_experts)
    if tokens.shape[0] == 0:
        raise StageError(f"placement nexttoken: the trace {layout.trace} has no profile decode tokens to fit the "
                         "forecaster on")
    return NextTokenForecaster.fit_tuned(tokens, seq, meta.top_k, meta.num_experts,
                                         extra=config["cache"]["nexttoken_extra"])



def cache(config: dict, **_) -> None:
    """Replay the held-out decode routing through the cache policies (coldset.analysis.cache.run_cache)."""
    from coldset.analysis.cache import run_cache

    layout = Layout.from_config(config)
    pc = config["placement"]
    run_cache(layout.trace, layout.stats_dir / "histogram.csv", model_shape(config), layout.cache_dir,
              config["cache"]["policies"], pc["residency"], pc["profile_domains"], phase=pc["phase"],
              domain_weights="equal" if pc["weight_domains"] else None,
              heldout_fraction=config["stats"]["heldout_fraction"],
              locality_json=layout.stats_dir / "locality.json", time=config["cache"]["time"],
              prefetch_budget=config["cache"]["prefetch_budget"], nexttoken_extra=config["cache"]["nexttoken_extra"])


def autotune(config: dict, **_) -> None:
    """Tune the experts kernel for the model's shape (cache hit in seconds); copy the entry to results/.

    The kernel is the same for every placement, so it is tuned once per model, on the all-hot
    layout, for the configured bench batch sizes; every placement then runs with that entry.
    """
    from coldset.kernels.tune import TuneShape, autotune as tune, write_entry

    require_decoding(config, "autotune")
    layout = Layout.from_config(config)
    cfg = model_config(config)
    shape = TuneShape(num_experts=cfg.num_experts, hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size,
                      top_k=cfg.top_k, dtype=config["model"]["dtype"], num_moe_layers=cfg.num_moe_layers,
                      num_hot=cfg.num_moe_layers * cfg.num_experts, num_cold=0,
                      weight_format="fp8_block128" if cfg.expert_format == "fp8_block128" else None)  # issue 29
    result = tune(shape, config["bench"]["batch_sizes"], resolve_device(config), config["autotune"]["cache_dir"])
    log.info("autotune key %s: %s (%s)", result.key[:16], "cache hit" if result.hit else "tuned", result.path)
    write_entry(result, layout.autotune)


def parity(config: dict, placements: list[str] | None = None, **_) -> None:
    """Decode the parity fixtures on the unmodified path once, then with every placement."""
    require_decoding(config, "parity")
    from coldset.verify import gate
    from coldset.engine.generate import check_prompts_fit, encode_prompts
    from coldset.core.placement import load_placement

    layout = Layout.from_config(config)
    pc = config["parity"]
    # Every placement is read, validated and fingerprinted before anything is decoded: a bad or
    # edited row map fails in seconds, naming its file, not after the reference decode.
    names = _placement_names(config, placements)
    fingerprints = {name: _fingerprint(config, name) for name in names}
    loaded = {name: load_placement(layout.placement_dir / f"{name}.json") for name in names}
    fxs = parity_fixtures(config)
    engine, tokenizer = _load_engine(config)
    prompts = encode_prompts(tokenizer, [f.prompt for f in fxs])
    ids = [f.id for f in fxs]
    check_prompts_fit(engine.config, ids, prompts, pc["max_new_tokens"])
    # Fewer, larger decodes: by default every parity fixture in one batch (both paths batch alike,
    # so the comparison stays like for like); on a busy 2-core CPU that halved the decode time.
    batch = pc["batch_size"] or len(prompts)
    tuned = _tuned(config)
    # The unmodified path is decoded once per batch size in use: a dynamic placement decodes at most
    # as many prompts at once as its slots hold one step's selections for (coldset.engine.cache.pool), and the
    # comparison is like for like only at the same batch size (the kernel's launch depends on it).
    references: dict[int, object] = {}
    host = _host_tier(config)
    fit = _lookahead_fit(config, engine, tokenizer)
    for name in names:
        pl = loaded[name]
        b = batch if not pl.dynamic else max(1, min(batch, int((pl.row_map >= 0).sum()) // engine.config.top_k))
        if b not in references:
            references[b] = gate.reference_decode(engine, prompts, pc["max_new_tokens"], b, tuned=tuned)
        reference = references[b]
        depths = _parity_depths(pl)
        results = []
        for depth in depths:
            cache = _slot_cache(engine, host, pl, b, depth=depth, fit=fit)
            pools = engine.pools.placed(pl.row_map, host) if cache is None else cache.pools
            got = gate.placement_decode(engine, pools, prompts, pc["max_new_tokens"], b, tuned=tuned, cache=cache)
            if cache is not None:
                cache.check()  # the row map and the slot owners still agree after every decision
            results.append(gate.compare(name, ids, reference, got, pools, engine, backend=tuned.backend))
            log.info("parity %s (batch %d%s): %d/%d tokens match, max |dlogit| %.3g", name, b,
                     "" if depth is None else f", lookahead depth {depth}", results[-1].tokens_matched,
                     results[-1].tokens_total, results[-1].max_abs_logit_diff)
            # Freed before the next cache's pools are built: a slot cache kept alive by the loop
            # variable doubled the HBM of two placements (out of memory at real shape, lru 0.5 -> 0.75).
            del pools, cache, got
        # the verdict: the first depth that failed, else the last (all passed); the depths decoded beside it
        result = next((r for r in results if not r.passed), results[-1])
        doc = {**result.to_dict(), "fingerprint": fingerprints[name]}
        if depths != [None]:
            doc["lookahead_depths"] = depths
            if not result.passed:
                doc["lookahead_depth_failed"] = depths[results.index(result)]
        write_json(layout.parity(*name.rsplit("-", 1)), doc)


def _fingerprint_files(config: dict, name: str) -> dict[str, Path]:
    """The file each fingerprint field digests (coldset.verify.fingerprint), for placement ``name``."""
    from coldset.core.placement import row_map_path

    layout = Layout.from_config(config)
    placement = layout.placement_dir / f"{name}.json"
    return {"row_map_sha256": row_map_path(placement), "placement": placement,
            "model": _manifest_path(config), "kernel": layout.autotune}


def _fingerprint(config: dict, name: str) -> dict[str, str]:
    """What placement ``name``'s parity verdict depends on, as on disk now (coldset.verify.fingerprint)."""
    from coldset.verify.fingerprint import StaleReportError, current_fingerprint

    files = _fingerprint_files(config, name)
    try:
        return current_fingerprint(files["row_map_sha256"], files["placement"], files["model"], files["kernel"])
    except (StaleReportError, FileNotFoundError, ValueError) as exc:
        raise StageError(f"placement {name}: {exc}") from None


def _check_report(config: dict, name: str, report: dict, where: Path | str) -> dict[str, str]:
    """Refuse a parity report whose fingerprint is not that of the files on disk; returns it."""
    from coldset.verify.fingerprint import StaleReportError, check_fingerprint

    current = _fingerprint(config, name)
    try:
        check_fingerprint(report.get("fingerprint"), current, str(where),
                          _fingerprint_files(config, name))
    except StaleReportError as exc:
        raise StageError(str(exc)) from None
    return current


def _slot_cache(engine, host, placement, max_tokens: int, depth: int | None = None, fit=None):
    """The slot cache of a dynamic placement (``lru-0.5``), fresh from its warm state, deciding for
    decode steps of up to ``max_tokens`` tokens (a lookahead's ``depth``: its depth for them unless
    given); None for a static placement. A lookahead placement with ``cache_lookahead_fit`` forecasts
    with the matrices fitted on the profile split's router inputs (``fit``: :func:`_lookahead_fit`,
    shared by the stage's placements); else with the later layers' routers."""
    if not placement.dynamic:
        return None
    from coldset.core.placement import lookahead_depth_for
    from coldset.engine.cache.pool import SlotCache

    routers = [engine.layers[i].mlp.gate.weight.detach() for i in engine.config.moe_layers]
    if placement.policy == "lookahead" and placement.cache_lookahead_fit:
        if fit is None:
            raise StageError(f"placement {placement.label}: a fitted lookahead forecast needs the profile router "
                             "inputs (the stage's fit)")
        routers = fit(depth if depth is not None else lookahead_depth_for(placement.cache_lookahead_depth, max_tokens),
                      routers)
    from coldset.bench.decode import placement_forecaster

    return SlotCache.from_placement(engine.pools, host, placement, max_tokens, engine.config.top_k, routers=routers,
                                    forecaster=placement_forecaster(placement),
                                    prefetch_budget=placement.cache_prefetch_budget, depth=depth)


def _lookahead_fit(config: dict, engine, tokenizer):
    """The function :func:`_slot_cache` fits a lookahead forecast with, its work done once a stage
    and only if a placement asks: ``fit(depth, routers)`` is
    :func:`coldset.analysis.forecast.fit_lookahead_routers` on the router inputs of the profile split's
    fixture prompts (:func:`coldset.analysis.forecast.router_inputs`, one prefill each on the unmodified
    path), memoized per depth. The placement stage never saw hidden states (its inputs are routing
    counts); the parity and bench stages, which load the model, fit the same matrices from the same
    prompts."""
    from coldset.analysis.forecast import fit_lookahead_routers, router_inputs
    from coldset.engine.generate import encode_prompts

    memo: dict = {}

    def fit(depth: int, routers: list):
        if "hidden" not in memo:
            fxs = _split_fixtures(config, "profile", "cache.lookahead_fit (the fit's prompts): split")
            memo["hidden"] = router_inputs(engine, encode_prompts(tokenizer, [f.prompt for f in fxs]))
            log.info("lookahead forecast: %d profile tokens' router inputs", memo["hidden"].shape[0])
        if depth not in memo:
            memo[depth] = fit_lookahead_routers(memo["hidden"], routers, int(depth))
        return memo[depth]

    return fit


def _parity_depths(placement) -> list[int | None]:
    """The lookahead depths the parity stage decodes a placement with: every depth of a per-batch
    mapping (the bench runs each at its batch size, the gate must have checked each), else the one
    the cache picks (None)."""
    depth = placement.cache_lookahead_depth
    return sorted(set(depth.values())) if isinstance(depth, dict) else [None]


def parity_gate(config: dict, placements: list[str] | None = None, **_) -> None:
    from coldset.verify.gate import gate_verdict

    layout = Layout.from_config(config)
    names = _placement_names(config, placements)
    paths = [layout.parity(*n.rsplit("-", 1)) for n in names]
    results = [read_json(p, "parity report") for p in paths]
    # A verdict about other files than those on disk now is refused before it is counted.
    fingerprints = {n: _check_report(config, n, r, p) for n, r, p in zip(names, results, paths)}
    summary = gate_verdict(results)  # raises, naming the failed placements
    write_json(layout.parity_gate, {**summary, "fingerprints": fingerprints})
    log.info("parity gate passed: %d placements token-exact", len(results))


def _check_gate_passed(config: dict, names: list[str]) -> None:
    """The bench runs only placements the gate passed in their current form (coldset.verify.fingerprint)."""
    layout = Layout.from_config(config)
    try:
        gate = read_json(layout.parity_gate, "parity gate summary")
    except FileNotFoundError as exc:
        raise StageError(f"{exc}: run the parity gate first (the bench runs only gated placements)") from None
    for name in names:
        entry = (gate.get("placements") or {}).get(name)
        if not gate.get("passed") or not entry or not entry.get("passed"):
            raise StageError(f"placement {name}: the parity gate {layout.parity_gate} did not pass it; "
                             "run the parity stage and the gate")
        _check_report(config, name, {"fingerprint": (gate.get("fingerprints") or {}).get(name)},
                      f"{layout.parity_gate} (placement {name})")


def _split_fixtures(config: dict, split: str, purpose: str = "bench.prompt_split") -> list:
    """The fixtures of ``split`` (``heldout`` | ``profile`` | ``all``), in fixture order; refused if
    none, naming ``purpose`` (what asked for them)."""
    from coldset.trace.fixtures import read_fixtures

    fxs = [f for f in read_fixtures(_fixture_paths(config)) if split == "all" or f.split == split]
    if not fxs:
        raise StageError(f"{purpose} {split!r}: no fixture is in that split (fixtures.heldout_fraction "
                         f"{config['fixtures']['heldout_fraction']}); choose another split or hold out fixtures")
    return fxs


def _bench_requests(config: dict, tokenizer, split: str) -> dict[int, list]:
    """Per bench batch size, the distinct requests of ``split`` it times
    (:func:`coldset.bench.decode.select_bench_requests`, :func:`coldset.workflow.config.bench_request_count`: ``bench.requests_per_domain`` of every domain,
    round-robin across domains, at least one full batch)."""
    from coldset.bench import decode as bn
    from coldset.engine.generate import encode_prompts

    bc = config["bench"]
    fxs = _split_fixtures(config, split)
    ids = encode_prompts(tokenizer, [f.prompt for f in fxs])
    candidates = [(f.id, f.domain, t) for f, t in zip(fxs, ids)]
    domains = len({f.domain for f in fxs})
    out = {}
    for b in bc["batch_sizes"]:
        try:
            out[b] = bn.select_bench_requests(candidates, bench_request_count(domains, bc["requests_per_domain"], b),
                                              bc["prompt_tokens"])
        except ValueError as exc:
            raise StageError(f"bench batch size {b} on the {split} split: {exc} (bench.prompt_tokens, "
                             "fixtures.per_domain, fixtures.heldout_fraction)") from None
    return out


def _prompt_overlap(config: dict, tokenizer, requests: list, n: int = 8) -> dict:
    """How much of the bench prompts the profile prompts contain (:func:`coldset.bench.decode.ngram_overlap`),
    overall and per domain: a bench on text the placement was fitted on flatters it."""
    from coldset.bench import decode as bn
    from coldset.engine.generate import encode_prompts

    profile = encode_prompts(tokenizer, [f.prompt for f in _split_fixtures(config, "profile")])
    unique = list({r.id: r for r in requests}.values())
    per_domain: dict[str, list] = {}
    for r in unique:
        per_domain.setdefault(r.domain, []).append(list(r.tokens))
    return {"ngram": n, "against": "profile", "requests": [r.id for r in unique],
            "share": bn.ngram_overlap([list(r.tokens) for r in unique], profile, n),
            "domains": {d: bn.ngram_overlap(t, profile, n) for d, t in per_domain.items()}}


def bench(config: dict, placements: list[str] | None = None, **_) -> None:
    """Bench every placement on prompts of ``bench.prompt_split`` (held-out traffic by default: the
    placement was fitted on the profile split), and with ``bench.profile_beside`` also on the
    profile split, written beside as ``profile_batches`` (labelled, never the published numbers).
    Each bench JSON records its provenance (:func:`coldset.bench.provenance.collect_provenance`)."""
    require_decoding(config, "bench")
    from coldset.bench import decode as bn
    from coldset.core.placement import load_placement
    from coldset.bench.provenance import collect_provenance

    layout = Layout.from_config(config)
    bc = config["bench"]
    _check_gate_passed(config, _placement_names(config, placements))  # before the engine loads
    engine, tokenizer = _load_engine(config)
    tuned = _tuned(config)
    splits = [bc["prompt_split"]] + (["profile"] if bc["profile_beside"] and bc["prompt_split"] != "profile" else [])
    requests = {split: _bench_requests(config, tokenizer, split) for split in splits}
    overlap = _prompt_overlap(config, tokenizer, [r for rs in requests[splits[0]].values() for r in rs])
    log.info("bench prompts (%s split): %s; %.0f%% of their %d-token sequences occur in the profile prompts "
             "(per domain: %s)", splits[0], overlap["requests"], 100 * (overlap["share"] or 0), overlap["ngram"],
             {d: None if v is None else round(v, 3) for d, v in overlap["domains"].items()})
    records: dict[str, list[dict]] = {}
    host = _host_tier(config)
    ceilings = None
    if engine.device.type == "cuda":  # the read rates this run's ratios are taken against
        ceilings = bn.measure_ceilings(host.w13 if host.pinned else None)
        log.info("ceilings (GB/s): %s", ceilings)
    names = _placement_names(config, placements)
    fit = _lookahead_fit(config, engine, tokenizer)
    for name in names:
        pl = load_placement(layout.placement_dir / f"{name}.json")
        pools = engine.pools.placed(pl.row_map, host) if not pl.dynamic else None
        for split in splits:
            for batch_size in bc["batch_sizes"]:
                batches = bn.request_batches(requests[split][batch_size], batch_size)
                results = []
                for batch in batches:  # distinct requests, batch_size at a time
                    cache = None
                    if pl.dynamic:  # a fresh warm cache per batch; the previous one's slots freed first
                        pools = None
                        cache = _slot_cache(engine, host, pl, batch_size, fit=fit)
                        pools = cache.pools
                    replay = None
                    if bc["routing_trace"]:
                        replay = bn.RoutingReplay.from_trace(
                            bc["routing_trace"], engine.config, batch_size, bc["new_tokens"] - 1, engine.device,
                            split=None if split == "all" else split,
                            heldout_fraction=config["stats"]["heldout_fraction"])
                    try:
                        results.append(bn.bench_decode(
                            engine, pools, pl, bn.batch_stream(batch), batch_size, bc["prompt_tokens"],
                            bc["new_tokens"], bc["warmup"], bc["repeats"], replay=replay, tuned=tuned,
                            prompt_split=split, cache=cache))
                    except bn.TimedLoopMismatch as exc:
                        raise StageError(str(exc)) from None
                    del cache
                r = bn.pool_results(results, batches)
                log.info("bench %s (%s prompts) batch %d over %d requests: %.1f tok/s, mean step %.3f ms (p50 %.3f), "
                         "cold share %.3f; per domain %s", name, split, batch_size, len(r["requests"]), r["tok_s"],
                         r["step_ms_mean"], r["step_ms_p50"], r["cold_share"], r["domains"])
                records.setdefault(split, []).append(r)
        del pools
    provenance = collect_provenance(engine.device, tuned, ceilings)
    derived = {split: bn.derive_metrics(rs, ceilings) for split, rs in records.items()}
    main = splits[0]
    for name in names:
        doc = {"placement": name, "prompt_split": main, "ceilings": ceilings, "provenance": provenance,
               "prompt_overlap": overlap, "batches": [r for r in derived[main] if r["placement"] == name]}
        if "profile" in derived and main != "profile":
            doc["profile_batches"] = [r for r in derived["profile"] if r["placement"] == name]
        write_json(layout.bench(*name.rsplit("-", 1)), doc)


def track_datasets(config: dict, decoded: bool) -> list:
    """What the track stage records as the parent run's MLflow datasets: the routing trace, and
    the fixtures where the workflow generated them (it does not for a model that is not decoded
    and whose trace is imported). The track rule lists the same files as its inputs."""
    from coldset.reporting.track_runs import DatasetRef

    layout = Layout.from_config(config)
    refs = [DatasetRef(f"{layout.model}-routing-trace", layout.trace, "routing")]
    if decoded or not config["routing"]["trace"]:
        refs += [DatasetRef(f"fixtures-{d}", layout.fixtures(d), "fixtures") for d in config["fixtures"]["domains"]]
    return refs


def track(config: dict, **_) -> None:
    from coldset.reporting.track import run_track

    layout = Layout.from_config(config)
    names = _placement_names(config, None)
    skipped = skipped_stages(config)
    decoded = "bench" not in skipped  # a shape-only model: runs from the placements' predictions
    tags = {"config_hash": config_hash(config), "model": config["model"]["name"]}
    if decoded:
        tags["autotune_key"] = read_json(layout.autotune)["key"]
    else:
        tags["stages_skipped"] = ",".join(skipped)
    run_track(
        datasets=track_datasets(config, decoded),
        results_dir=layout.results,
        bench_jsons=[layout.bench(*n.rsplit("-", 1)) for n in names] if decoded else [],
        parity_jsons=[layout.parity(*n.rsplit("-", 1)) for n in names] if decoded else [],
        placement_jsons=[layout.placement_dir / f"{n}.json" for n in names],
        stats_json=layout.stats_dir / "skew.json",
        tracking_uri=layout.tracking_uri(config),
        experiment=config["tracking"]["experiment"],
        tags=tags,
        done_path=layout.track_done,
        autotune_jsons=[layout.autotune] if decoded else [],
        locality_json=_optional_input(layout.stats_dir / "locality.json", "stats"),
        simulation_csv=_optional_input(layout.cache_dir / "simulation.csv", "cache"),
    )


def _optional_input(path: Path, stage: str) -> Path | None:
    """A file of a stage that ``python -m coldset`` flows may not have run (gpu-stages runs no
    cache stage): absent = its metrics are not logged, with a warning naming the stage to run."""
    if path.is_file():
        return path
    log.warning("%s not found: its metrics are not logged (run the %s stage first)", path, stage)
    return None


def report(config: dict, **_) -> None:
    from coldset.reporting.report import render_report

    layout = Layout.from_config(config)
    figures_dir = layout.report.parent / "figures"
    render_report(layout.results, layout.report, config, figures_dir=figures_dir, skipped=skipped_stages(config))
    if layout.track_done.is_file():  # the report joins the invocation's parent run in MLflow
        from coldset.reporting.track import log_report

        run_id = log_report(layout.track_done, layout.report, sorted(figures_dir.glob("*.png")))
        log.info("report logged to MLflow parent run %s", run_id)
    else:
        log.info("no %s: the report is not logged to MLflow (run track first)", layout.track_done)


STAGES = {f.__name__: f for f in (model, fixtures, routing, stats, placement, cache, autotune, parity,
                                  parity_gate, bench, track, report)}
GPU_STAGES = ["model", "fixtures", "routing", "stats", "placement", "autotune", "parity", "parity_gate", "bench"]


def _passive_omp_threads() -> None:
    """Idle OpenMP threads sleep instead of spinning, so a stage sharing the CPU with another job
    slows down in proportion instead of about tenfold. Effective only before torch loads its
    OpenMP runtime (the runtime reads the variable once, when it loads)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def run_stage(stage: str | Callable[..., None], config: dict, placements: list[str] | None = None) -> None:
    """Run one stage: a name of :data:`STAGES`, or the stage function of a module above the
    pipeline (``coldset.workflow.sweep.report_models``); the stage's own errors propagate with their messages."""
    fn = stage if callable(stage) else STAGES.get(stage)
    if fn is None:
        raise StageError(f"unknown stage {stage!r}; stages: {list(STAGES)}")
    name = fn.__name__
    _passive_omp_threads()
    log.info("stage %s", name)
    t0 = time.perf_counter()
    fn(config, placements=placements)
    log.info("stage %s done in %.1f s", name, time.perf_counter() - t0)


# What Snakemake logs when it puts back an ``update``-flagged output of a failed job.
_RESTORED = re.compile(r"^Restored previous version of (.+?)(?: \(update\))? \(updating job failed\)\.$")


def rerun_restored_outputs(snakemake_logs: str | os.PathLike | list, forget: Callable[[Path], Any]) -> list[Path]:
    """Make the next run redo the jobs whose previous outputs Snakemake restored after they failed.

    The rules flag their outputs ``update``, so a failing job leaves the previous run's good
    files in place (Snakemake otherwise deletes a job's outputs before it runs and again after
    it fails). But Snakemake puts them back by a copy dated now and records the failed job's
    inputs and params as those that made them: the next run would skip the job ("Nothing to be
    done") and hand the old results to the stages after it. Here each restored file (found in
    the run's log) loses that record (``forget``: Snakemake's ``cleanup_metadata``) and is dated
    one second after 1970, older than every input, so its contents stay and its job runs again.
    Called from the Snakefile's ``onerror`` with the run's log file(s); returns the files."""
    logs = [snakemake_logs] if isinstance(snakemake_logs, (str, os.PathLike)) else snakemake_logs
    lines = [line for p in logs if Path(p).is_file() for line in Path(p).read_text(errors="replace").splitlines()]
    kept = []
    for line in lines:
        m = _RESTORED.match(line.strip())
        if m and Path(m.group(1)).exists():
            path = Path(m.group(1))
            forget(path)
            os.utime(path, (1, 1))  # 0 would not do: Snakemake takes an mtime of 0 for no time
            kept.append(path)
    return kept


def run_from_snakemake(smk, stage: str | Callable[..., None]) -> None:
    """Entry of every workflow script: log to the rule's log file, run the stage (as :func:`run_stage`)."""
    log_path = Path(smk.log[0])
    log_path.parent.mkdir(parents=True, exist_ok=True)
    stream = open(log_path, "w", buffering=1)
    sys.stderr = stream  # progress bars and warnings go to the rule's log too
    logging.basicConfig(level=logging.INFO, stream=stream, force=True,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    # Torch's CPU threads = the rule's threads: Snakemake then never runs two jobs whose threads
    # fight for one core (decode on 2 threads slows about tenfold when the other core is busy).
    _passive_omp_threads()  # before the import below loads the OpenMP runtime (run_stage's call came too late here)
    import torch

    torch.set_num_threads(max(1, int(smk.threads)))
    config = smk.config
    model = getattr(smk.wildcards, "model", None)
    if config.get("models") and model is not None:  # a sweep: this job's model's own config
        config = model_configs(config)[model]
    try:
        run_stage(stage, config)
    except Exception as exc:
        name = getattr(stage, "__name__", stage)
        log.exception("stage %s failed", name)
        # The console (Snakemake's own stderr, not the log) gets the reason too: Snakemake's
        # summary says only "check log file(s)".
        print(f"coldset stage {name} failed: {type(exc).__name__}: {exc}\n  (traceback: {log_path})",
              file=sys.__stderr__, flush=True)
        raise
