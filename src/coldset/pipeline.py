"""The stages of the workflow as functions of the validated config (DESIGN.md §1).

Each stage reads and writes the files :class:`coldset.config.Layout` names, so the Snakemake
rules (through workflow/scripts/, which only call :func:`run_from_snakemake`) and
``python -m coldset STAGE`` (for the GPU host, which has no Snakemake) run the same code on the
same paths. The stage bodies only translate config into library calls; logic lives in the
modules named in each body.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import asdict, fields
from pathlib import Path

from coldset.config import Layout, config_hash, resolve_device
from coldset.files import read_json, write_json

log = logging.getLogger("coldset")


class StageError(RuntimeError):
    """A stage could not run with this configuration (the message says why)."""


# ------------------------------------------------------------------------------------ helpers

def model_dir(config: dict) -> Path:
    """The Hugging Face folder every model-reading stage loads."""
    if config["model"]["path"]:
        return Path(config["model"]["path"])
    return Layout.from_config(config).model_dir / "hf"


def _torch_dtype(config: dict):
    import torch

    return getattr(torch, config["model"]["dtype"])


def _fixture_paths(config: dict) -> list[Path]:
    layout = Layout.from_config(config)
    return [layout.fixtures(d) for d in config["fixtures"]["domains"]]


def _placement_names(config: dict, only: list[str] | None) -> list[str]:
    from coldset.placement import residency_label

    names = [f"{p}-{residency_label(r)}" for p in config["placement"]["policies"]
             for r in config["placement"]["residency"]]
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise StageError(f"unknown placement(s) {unknown}; configured: {names}")
        names = [n for n in names if n in only]
    return names


def _load_engine(config: dict):
    from coldset.model import load_model, load_tokenizer

    device = resolve_device(config)
    path = model_dir(config)
    log.info("loading %s on %s (%s)", path, device, config["model"]["dtype"])
    return load_model(path, device=device, dtype=_torch_dtype(config)), load_tokenizer(path)


def _tuned(config: dict):
    """The autotune stage's entry for this model, as a TuneResult (the tuned launch configs)."""
    from coldset.tune import result_from_entry

    return result_from_entry(read_json(Layout.from_config(config).autotune, "autotune entry"))


def _domain_texts(config: dict) -> dict[str, list[str]]:
    """Training text per traffic domain for the synthetic checkpoint (its tokenizer and domain
    clusters), so the default model routes the fixture domains differently, as real MoEs do.
    Rendered from the same templates with another seed than the fixtures, or the user's prompts."""
    from coldset.fixtures import read_user_prompts, template_texts

    fx = config["fixtures"]
    if fx["prompts"]:
        texts: dict[str, list[str]] = {}
        for f in read_user_prompts(fx["prompts"], fx["heldout_fraction"], fx["max_new_tokens"]):
            texts.setdefault(f.domain, []).append(f.prompt)
        return texts
    return template_texts(fx["domains"], 200, seed=fx["seed"] + 1, template_dir=fx["template_dir"])


# ------------------------------------------------------------------------------------ stages

def model(config: dict, **_) -> None:
    """Generate the synthetic checkpoint, or check the configured local folder; write the manifest."""
    from coldset.model import ModelConfig

    layout = Layout.from_config(config)
    path = model_dir(config)
    if config["model"]["path"]:
        if config["model"]["synthetic"]:
            raise StageError("config sets both model.path and model.synthetic: choose one")
        source = "local"
    else:
        from coldset.synthetic import SyntheticSpec, write_synthetic_checkpoint

        known = {f.name for f in fields(SyntheticSpec)}
        unknown = sorted(set(config["model"]["synthetic"]) - known)
        if unknown:
            raise StageError(f"config model.synthetic: unknown setting(s) {unknown}; known: {sorted(known)}")
        spec = SyntheticSpec(**config["model"]["synthetic"])
        log.info("writing synthetic checkpoint %s to %s", spec, path)
        write_synthetic_checkpoint(spec, path, domain_texts=_domain_texts(config))
        source = "synthetic"
    cfg = ModelConfig.from_pretrained(path)  # the loader's own checks: clear errors on a bad folder
    if not (path / "tokenizer.json").is_file():
        raise StageError(f"model folder {path} has no tokenizer.json")
    write_json(layout.model_dir / "manifest.json", {
        "name": config["model"]["name"], "path": str(path.resolve()), "source": source,
        "config": {k: v for k, v in asdict(cfg).items()},
    })


def fixtures(config: dict, **_) -> None:
    from coldset.fixtures import make_fixtures

    fx = config["fixtures"]
    make_fixtures(Layout.from_config(config).fixtures_dir, fx["domains"], fx["per_domain"],
                  fx["heldout_fraction"], fx["max_new_tokens"], fx["seed"],
                  template_dir=fx["template_dir"], user_prompts=fx["prompts"])


def routing(config: dict, **_) -> None:
    """Capture the trace with the embedded engine, or import the configured one."""
    from coldset import routing as trace

    layout = Layout.from_config(config)
    out = layout.trace
    out.parent.mkdir(parents=True, exist_ok=True)
    rc = config["routing"]
    if rc["trace"]:
        # An external trace must match a configured real model (model.path); with the synthetic
        # default it stands alone (statistics of another model's traffic, e.g. a public trace).
        from coldset.model import ModelConfig

        expect = ModelConfig.from_pretrained(config["model"]["path"]) if config["model"]["path"] else None
        report = trace.import_trace(rc["trace"], out, kind=rc["trace_format"], expect=expect,
                                    model_name=config["model"]["name"],
                                    heldout_fraction=config["stats"]["heldout_fraction"])
        log.info("imported %s: %s", rc["trace"], report)
        return
    if rc["backend"] == "vllm":
        from coldset.vllm_backend import capture_routing_vllm

        capture_routing_vllm(model_dir(config), _fixture_paths(config), out, dtype=config["model"]["dtype"],
                             model_name=config["model"]["name"], method=rc["vllm_method"],
                             llm_kwargs=rc["vllm_args"])
        return
    trace.capture_routing(model_dir(config), _fixture_paths(config), out, device=resolve_device(config),
                          dtype=config["model"]["dtype"], batch_size=rc["batch_size"],
                          model_name=config["model"]["name"])


def stats(config: dict, **_) -> None:
    from coldset.stats import run_stats

    layout = Layout.from_config(config)
    run_stats(layout.trace, layout.stats_dir, heldout_fraction=config["stats"]["heldout_fraction"])


def placement(config: dict, **_) -> None:
    from coldset.placement import run_placement

    layout = Layout.from_config(config)
    pc = config["placement"]
    run_placement(layout.stats_dir / "histogram.csv", model_dir(config), layout.placement_dir,
                  pc["policies"], pc["residency"], pc["profile_domains"], phase=pc["phase"],
                  domain_weights="equal" if pc["weight_domains"] else None,
                  bandwidths=(pc["bandwidths"], *({"h200", "gb300"} - {pc["bandwidths"]})),
                  batch_sizes=config["bench"]["batch_sizes"], model=config["model"]["name"])


def autotune(config: dict, **_) -> None:
    """Tune the experts kernel for the model's shape (cache hit in seconds); copy the entry to results/.

    The kernel is the same for every placement, so it is tuned once per model, on the all-hot
    layout, for the configured bench batch sizes; every placement then runs with that entry.
    """
    from coldset.model import ModelConfig
    from coldset.tune import TuneShape, autotune as tune, write_entry

    layout = Layout.from_config(config)
    cfg = ModelConfig.from_pretrained(model_dir(config))
    shape = TuneShape(num_experts=cfg.num_experts, hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size,
                      top_k=cfg.top_k, dtype=config["model"]["dtype"], num_moe_layers=cfg.num_moe_layers,
                      num_hot=cfg.num_moe_layers * cfg.num_experts, num_cold=0)
    result = tune(shape, config["bench"]["batch_sizes"], resolve_device(config), config["autotune"]["cache_dir"])
    log.info("autotune key %s: %s (%s)", result.key[:16], "cache hit" if result.hit else "tuned", result.path)
    write_entry(result, layout.autotune)


def parity(config: dict, placements: list[str] | None = None, **_) -> None:
    """Decode the parity fixtures on the unmodified path once, then with every placement."""
    from coldset import gate
    from coldset.fixtures import read_fixtures
    from coldset.model import encode_prompts
    from coldset.placement import load_placement

    layout = Layout.from_config(config)
    pc = config["parity"]
    fxs = read_fixtures(_fixture_paths(config))
    if pc["fixtures_per_domain"]:
        kept: dict[str, list] = {}
        for f in fxs:
            kept.setdefault(f.domain, []).append(f)
        fxs = [f for group in kept.values() for f in group[:pc["fixtures_per_domain"]]]
    engine, tokenizer = _load_engine(config)
    prompts = encode_prompts(tokenizer, [f.prompt for f in fxs])
    ids = [f.id for f in fxs]
    batch = config["routing"]["batch_size"]
    tuned = _tuned(config)
    reference = gate.reference_decode(engine, prompts, pc["max_new_tokens"], batch, tuned=tuned)
    for name in _placement_names(config, placements):
        pl = load_placement(layout.placement_dir / f"{name}.json")
        pools = engine.pools.placed(pl.row_map)
        got = gate.placement_decode(engine, pools, prompts, pc["max_new_tokens"], batch, tuned=tuned)
        result = gate.compare(name, ids, reference, got, pools, engine, backend=tuned.backend)
        log.info("parity %s: %d/%d tokens match, max |dlogit| %.3g", name, result.tokens_matched,
                 result.tokens_total, result.max_abs_logit_diff)
        write_json(layout.parity(*name.rsplit("-", 1)), result.to_dict())
        del pools


def parity_gate(config: dict, placements: list[str] | None = None, **_) -> None:
    from coldset.gate import gate_verdict

    layout = Layout.from_config(config)
    results = [read_json(layout.parity(*n.rsplit("-", 1)), "parity report")
               for n in _placement_names(config, placements)]
    summary = gate_verdict(results)  # raises, naming the failed placements
    write_json(layout.parity_gate, summary)
    log.info("parity gate passed: %d placements token-exact", len(results))


def bench(config: dict, placements: list[str] | None = None, **_) -> None:
    from coldset import bench as bn
    from coldset.fixtures import read_fixtures
    from coldset.model import encode_prompts
    from coldset.placement import load_placement

    layout = Layout.from_config(config)
    bc = config["bench"]
    engine, tokenizer = _load_engine(config)
    tuned = _tuned(config)
    stream = [t for ids in encode_prompts(tokenizer, [f.prompt for f in read_fixtures(_fixture_paths(config))])
              for t in ids]
    records: dict[str, list[dict]] = {}
    for name in _placement_names(config, placements):
        pl = load_placement(layout.placement_dir / f"{name}.json")
        pools = engine.pools.placed(pl.row_map)
        for batch_size in bc["batch_sizes"]:
            replay = None
            if bc["routing_trace"]:
                replay = bn.RoutingReplay.from_trace(bc["routing_trace"], engine.config, batch_size,
                                                     bc["new_tokens"] - 1, engine.device)
            r = bn.bench_decode(engine, pools, pl, stream, batch_size, bc["prompt_tokens"], bc["new_tokens"],
                                bc["warmup"], bc["repeats"], replay=replay, tuned=tuned)
            log.info("bench %s batch %d: %.1f tok/s, step p50 %.3f ms, cold share %.3f", name, batch_size,
                     r.tok_s, r.step_ms_p50, r.cold_share)
            records.setdefault(name, []).append(r.to_dict())
        del pools
    derived = bn.derive_metrics([r for rs in records.values() for r in rs])
    for name in records:
        write_json(layout.bench(*name.rsplit("-", 1)),
                   {"placement": name, "batches": [r for r in derived if r["placement"] == name]})


def track(config: dict, **_) -> None:
    from coldset.track import run_track

    layout = Layout.from_config(config)
    names = _placement_names(config, None)
    run_track(
        bench_jsons=[layout.bench(*n.rsplit("-", 1)) for n in names],
        parity_jsons=[layout.parity(*n.rsplit("-", 1)) for n in names],
        placement_jsons=[layout.placement_dir / f"{n}.json" for n in names],
        stats_json=layout.stats_dir / "skew.json",
        tracking_uri=layout.tracking_uri(config),
        experiment=config["tracking"]["experiment"],
        tags={"config_hash": config_hash(config), "autotune_key": read_json(layout.autotune)["key"]},
        done_path=layout.track_done,
        autotune_jsons=[layout.autotune],
    )


def report(config: dict, **_) -> None:
    from coldset.report import render_report

    layout = Layout.from_config(config)
    render_report(layout.results, layout.report, config, figures_dir=layout.report.parent / "figures")


STAGES = {f.__name__: f for f in (model, fixtures, routing, stats, placement, autotune, parity,
                                  parity_gate, bench, track, report)}
GPU_STAGES = ["model", "fixtures", "routing", "stats", "placement", "autotune", "parity", "parity_gate", "bench"]


def run_stage(name: str, config: dict, placements: list[str] | None = None) -> None:
    """Run one stage; the stage's own errors propagate with their messages."""
    if name not in STAGES:
        raise StageError(f"unknown stage {name!r}; stages: {list(STAGES)}")
    # Before torch loads its OpenMP runtime: idle threads sleep instead of spinning, so a stage
    # sharing the CPU with another job slows down in proportion instead of about tenfold.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    log.info("stage %s", name)
    STAGES[name](config, placements=placements)


def run_from_snakemake(smk, name: str) -> None:
    """Entry of every workflow script: log to the rule's log file, run the stage."""
    log_path = Path(smk.log[0])
    log_path.parent.mkdir(parents=True, exist_ok=True)
    stream = open(log_path, "w", buffering=1)
    sys.stderr = stream  # progress bars and warnings go to the rule's log too
    logging.basicConfig(level=logging.INFO, stream=stream, force=True,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    # Torch's CPU threads = the rule's threads: Snakemake then never runs two jobs whose threads
    # fight for one core (decode on 2 threads slows about tenfold when the other core is busy).
    import torch

    torch.set_num_threads(max(1, int(smk.threads)))
    try:
        run_stage(name, smk.config)
    except Exception:
        log.exception("stage %s failed", name)
        raise
