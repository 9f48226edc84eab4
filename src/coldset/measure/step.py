"""``python -m coldset bench step``: the decode step at real shape on one GPU, per engine, at
batch 1 and 8, against its bytes floor measured in the same run.

Builds the config's in-memory synthetic model (every expert in HBM), measures the HBM read
ceiling (:func:`coldset.bench.measure_ceilings`: best of several rounds), then for each engine
(``eager``; ``compiled``: ``compile_decode(fused=False)``, the Inductor-compiled region; ``fused``:
``compile_decode()``, the fused Triton kernels of :mod:`coldset.kernels.triton_decode` with their
default launch mode, ``fused-pdl`` / ``fused-nopdl`` with dependent launch forced on / off;
``NAME@base``: engine NAME with the experts kernel of ``--baseline-module``, a before/after in
one process), each captured in one CUDA graph by :class:`coldset.bench.Decoder`, times the full
step at batch 1 and 8 (prompts cut from fixture-like text, as the bench cuts them) and the step
with the routed experts replaced by zeros at batch 1, with a kernel profile of each full step.
A step's time is the median of ``--reps`` event-timed calls (:func:`coldset.tune.eager_time_us`),
repeated ``--rounds`` times: the median round is reported with the slowest and fastest.

The bytes floor of a step is what it must read from HBM (non-expert weights with the LM head, the
batch's embedding rows, and per MoE layer each distinct expert the batch's tokens chose, from an
eager pass with routing capture over the same tokens: :func:`coldset.bench.measure_routing`) over
the measured read rate; ``of floor`` = floor / measured step. Checks: every engine decodes the
first engine's greedy tokens (16 steps, both batch sizes); the largest logit difference.
``--tune`` runs the experts autotune (:mod:`coldset.tune`) for batch 1 and 8 first; ``--tuned``
reads the configs of an autotune entry instead (e.g. config/examples/h200-tuned/). Writes
``decode_step.json`` under ``--out``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from coldset.measure.harness import MeasureError, log, new_result, require_cuda, spread, write_result

#: The fused engines: compile_decode's default (dependent launch where it measured faster: batch 1
#: on Hopper), and each way forced.
FUSED_PDL = {"fused": None, "fused-pdl": True, "fused-nopdl": False}
ENGINES = ("eager", "compiled", *FUSED_PDL)
PROMPT_TOKENS, NEW_TOKENS, BATCHES = 32, 16, (1, 8)


def add_arguments(p) -> None:
    p.add_argument("--config", default="config/examples/qwen3-30b-a3b-h200.yaml",
                   help="workflow config whose model.synthetic shape and fixtures are measured")
    p.add_argument("--out", required=True, help="folder for decode_step.json")
    tuning = p.add_mutually_exclusive_group()
    tuning.add_argument("--tune", action="store_true", help="autotune the experts kernel for batch 1 and 8 first")
    tuning.add_argument("--tuned", help="an autotune cache entry (JSON) whose experts configs to use")
    p.add_argument("--engines", default="eager,compiled,fused",
                   help=f"comma-separated: {', '.join(ENGINES)}; NAME@base with --baseline-module")
    p.add_argument("--reps", type=int, default=50, help="timed calls of the step per round (their median)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of --reps calls: median and spread of the rounds")
    p.add_argument("--baseline-module",
                   help="another triton_moe.py (e.g. `git show main:src/coldset/kernels/triton_moe.py`): an engine "
                        "named NAME@base runs engine NAME with that module's triton_experts on the same tuned "
                        "configs (needs --tuned or --tune), for a before/after of the experts kernel in one process")


def check_engines(names: list[str], baseline: bool) -> None:
    """:class:`MeasureError` for an unknown engine or an ``@base`` engine without a baseline."""
    for mode in names:
        engine, at, which = mode.partition("@")
        if engine not in ENGINES or (at and which != "base"):
            raise MeasureError(f"unknown engine {mode!r} (one of {', '.join(ENGINES)}; NAME@base)")
        if at and not baseline:
            raise MeasureError(f"engine {mode!r} needs --baseline-module")


def kernel_profile(step, n: int = 3, layers: int = 1) -> dict:
    """Kernels per step (and per layer: per step / ``layers``) and their summed device time,
    from the profiler over ``n`` calls; the top kernels by time with their count per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total_us = sum(e.device_time for e in kernels) if kernels else 0.0
    by_name: dict[str, list] = {}
    for e in kernels:
        by_name.setdefault(e.name[:60], []).append(e.device_time)
    top = sorted(((k, len(v) / n, sum(v) / n) for k, v in by_name.items()), key=lambda r: -r[2])[:25]
    return {"kernels_per_step": len(kernels) / n, "kernels_per_layer": len(kernels) / n / layers,
            "kernel_us_per_step": total_us / n,
            "top": [{"name": k, "per_step": c, "us_per_step": round(us, 1)} for k, c, us in top]}


def baseline_experts(path: str, result):
    """The engine's experts function with the triton_experts of another copy of triton_moe.py
    (the unmodified path, as ``tuned_experts(result, use_row_map=False)``), each batch size on its
    tuned config restricted to the fields that copy knows."""
    from coldset.measure.kernel import _load_module
    from coldset.tune import config_for

    mod = _load_module(path)
    known = set(mod.KernelConfig.__dataclass_fields__)
    chosen: dict[int, dict] = {}

    def experts(pools, layer, x, topk_ids, topk_weights):
        bs = int(x.shape[0])
        if bs not in chosen:
            chosen[bs] = {k: v for k, v in config_for(result, bs).items() if k in known}
        return mod.triton_experts(pools, layer, x, topk_ids, topk_weights, config=chosen[bs], use_row_map=False)

    return experts


def run(args, argv=None) -> dict:
    """Measure (see module doc); returns the result written to ``--out``/decode_step.json."""
    if args.reps < 1 or args.rounds < 1:
        raise MeasureError(f"--reps {args.reps} and --rounds {args.rounds}: each must be at least 1")
    engines = args.engines.split(",")
    check_engines(engines, bool(args.baseline_module))
    if args.baseline_module and not (args.tune or args.tuned):
        raise MeasureError("--baseline-module needs --tune or --tuned (the configs both kernels run)")
    dev = require_cuda()
    import torch
    import torch._dynamo as dynamo

    from coldset import bench as bn
    from coldset.config import load_config
    from coldset.fixtures import template_texts
    from coldset.gate import experts_functions
    from coldset.placement import expert_bytes
    from coldset.synthetic import SyntheticSpec, build_synthetic_model
    from coldset.timing import eager_time_us
    from coldset.tune import TuneResult, TuneShape, autotune, tuned_experts

    out_path = Path(args.out) / "decode_step.json"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    config = load_config(args.config)
    R = new_result("step", argv, args)
    R["config"] = args.config
    ceilings = bn.measure_ceilings()
    R["hbm_read_GBps"] = ceilings["hbm_read_gb_s"]
    log("HBM read GB/s", R["hbm_read_GBps"])

    spec = SyntheticSpec(**config["model"]["synthetic"])
    fx = config["fixtures"]
    texts = template_texts(fx["domains"], 200, seed=fx["seed"] + 1, template_dir=fx["template_dir"])
    model, tokenizer = build_synthetic_model(spec, dev, getattr(torch, config["model"]["dtype"]), domain_texts=texts)
    cfg = model.config
    L = cfg.num_moe_layers
    log("model built")

    experts = experts_functions(dev, None)[0]
    shape = TuneShape(num_experts=cfg.num_experts, hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size,
                      top_k=cfg.top_k, dtype=config["model"]["dtype"], num_moe_layers=L,
                      num_hot=L * cfg.num_experts, num_cold=0)
    result = None
    if args.tune:
        t = time.perf_counter()
        result = autotune(shape, list(BATCHES), "cuda", "/tmp/coldset-autotune")
        R["autotune_s"] = time.perf_counter() - t
        experts = tuned_experts(result, use_row_map=False)
        R["tuned_configs"] = result.configs
        log("autotune", R["autotune_s"], "s")
    elif args.tuned:
        entry = json.loads(Path(args.tuned).read_text())
        result = TuneResult(key=entry["key"], hit=True, backend=entry["backend"], shape=shape,
                            batch_sizes=[int(b) for b in entry["configs"]],
                            configs={int(b): c for b, c in entry["configs"].items()})
        experts = tuned_experts(result, use_row_map=False)
        R["tuned_configs"] = result.configs
        R["tuned_from"] = args.tuned
    experts_by_name = {"": experts}
    if args.baseline_module:
        experts_by_name["base"] = baseline_experts(args.baseline_module, result)
        R["baseline_module"] = args.baseline_module

    def no_experts(pools, layer, x, topk_ids, topk_weights):
        return torch.zeros_like(x)

    stream = [t for d in fx["domains"] for text in texts[d][:4] for t in tokenizer.encode(text).ids]
    prompts_by_b = {b: bn.bench_prompts(stream, b, PROMPT_TOKENS) for b in BATCHES}
    # The bytes floor per step: every non-expert weight once (the batch's embedding rows), and
    # each distinct expert the batch chose per layer (eager routing capture over the same tokens).
    ebytes = expert_bytes(cfg)
    R["floor"] = {}
    model.experts_fn = experts
    for b, prompts in prompts_by_b.items():
        _, _, hot_per_token, _ = bn.measure_routing(model, prompts, NEW_TOKENS, ebytes)
        step_bytes = bn._nonexpert_read_bytes(cfg, b, model.dtype) + hot_per_token * b
        R["floor"][b] = {"bytes_per_step": step_bytes, "expert_bytes_per_step": hot_per_token * b,
                         "floor_ms": step_bytes / (R["hbm_read_GBps"] * 1e6)}
    log("floor", R["floor"])

    rows: list[dict] = []
    R["rows"] = rows
    tokens_by_mode: dict[str, list] = {}
    logits_by_mode: dict[str, torch.Tensor] = {}

    def save():
        write_result(out_path, R, ceilings, result)

    def run_engine(mode: str, t: float, experts_fn) -> None:
        for bsz in BATCHES:
            for name in (("full", "no_experts") if bsz == 1 else ("full",)):
                model.experts_fn = experts_fn if name == "full" else no_experts
                dec = bn.Decoder(model, bsz, PROMPT_TOKENS, NEW_TOKENS, True)
                tok = dec.prefill(prompts_by_b[bsz])
                dec.set_step(tok, 1)
                dec.capture()
                if bsz == 1 and name == "full":
                    R.setdefault("compile_s", {})[mode] = time.perf_counter() - t
                toks, logs = [tok], []
                for step in range(1, NEW_TOKENS):
                    dec.set_step(tok, step)
                    lg = dec.step()
                    logs.append(lg.float().clone())
                    tok = torch.argmax(lg, dim=-1)
                    toks.append(tok)
                if name == "full":
                    tokens_by_mode[f"{mode}/b{bsz}"] = torch.stack(toks, 1).tolist()
                    logits_by_mode[f"{mode}/b{bsz}"] = torch.stack(logs, 1)
                ms = spread([eager_time_us(dec.step, args.reps) / 1e3 for _ in range(args.rounds)])
                row = {"mode": mode, "batch": bsz, "experts": name, "step_ms": ms["median"], "step_ms_spread": ms,
                       "tok_s": bsz * 1e3 / ms["median"]}
                if name == "full":
                    row["floor_ms"] = R["floor"][bsz]["floor_ms"]
                    row["fraction_of_floor"] = row["floor_ms"] / ms["median"]
                    row["fraction_of_floor_range"] = [row["floor_ms"] / ms["max"], row["floor_ms"] / ms["min"]]
                    try:
                        row["profile"] = kernel_profile(dec.step, layers=len(model.layers))
                    except Exception as exc:  # the profiler is a diagnosis, not the measurement
                        row["profile"] = {"error": repr(exc)}
                rows.append(row)
                log({k: v for k, v in row.items() if k != "profile"},
                    {k: v for k, v in row.get("profile", {}).items() if k != "top"})
                del dec
                save()

    for mode in engines:
        dynamo.reset()
        model._compiled_before_experts = None
        t = time.perf_counter()
        engine, _, which = mode.partition("@")
        if engine == "compiled":
            model.compile_decode(fused=False)
        elif engine in FUSED_PDL:
            model.compile_decode(fused=True, pdl=FUSED_PDL[engine])
        try:
            run_engine(mode, t, experts_by_name[which])
        except Exception as exc:  # one engine failing (e.g. a launch mode the driver refuses) is a result
            R.setdefault("errors", {})[mode] = repr(exc)[:500]
            log("engine", mode, "failed:", repr(exc)[:500])

    model.experts_fn = experts
    from torch._dynamo.utils import counters

    R["dynamo"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break", "recompiles")}
    R["checks"] = {}
    ref = engines[0]
    for mode in engines:
        for bsz in BATCHES:
            if f"{mode}/b{bsz}" not in tokens_by_mode or f"{ref}/b{bsz}" not in tokens_by_mode:
                continue
            e, c = tokens_by_mode[f"{ref}/b{bsz}"], tokens_by_mode[f"{mode}/b{bsz}"]
            same = sum(a == b for x, y in zip(e, c) for a, b in zip(x, y)) / (bsz * NEW_TOKENS)
            diff = (logits_by_mode[f"{ref}/b{bsz}"] - logits_by_mode[f"{mode}/b{bsz}"]).abs().max().item()
            R["checks"][f"{mode}/b{bsz}"] = {"token_match": same, "max_abs_logit_diff": diff}
    R["checks_against"] = ref
    save()
    for r in rows:
        if "top" in r.get("profile", {}):
            log(r["mode"], f"b{r['batch']}", "top kernels (name, per step, us per step):",
                [(t["name"][:48], t["per_step"], t["us_per_step"]) for t in r["profile"]["top"][:12]])
    return R

