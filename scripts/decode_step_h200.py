#!/usr/bin/env python3
"""The decode step at real shape on one GPU: where its time goes, per engine, at batch 1 and 8.

    PYTHONPATH=src python3 scripts/decode_step_h200.py --config config/examples/qwen3-30b-a3b-h200.yaml \
        --out <dir> [--tune | --tuned <autotune entry.json>] [--engines eager,compiled,fused] [--sweep [gemv,router]]

Builds the config's in-memory synthetic model (every expert in HBM), measures the HBM read
ceiling (``coldset.bench.measure_ceilings``: best of several rounds), then for each engine (the
eager step; ``compiled``: ``compile_decode(fused=False)``, the Inductor-compiled region; ``fused``:
``compile_decode()``, the fused Triton kernels of ``coldset.kernels.triton_decode`` with their
default launch mode, ``fused-pdl`` / ``fused-nopdl`` with dependent launch forced on / off; ``NAME@base``: engine
NAME with the experts kernel of ``--baseline-module``, a before/after in one process), each captured in one CUDA graph
by ``coldset.bench.Decoder``, times the full step at batch 1 and 8 (8 different prompts cut from
fixture-like text, as the bench cuts them) and the step with the routed experts replaced by zeros
at batch 1, with a kernel profile of each full step (kernels per step, per layer, the top kernels).

The bytes floor of a step is what it must read from HBM (non-expert weights with the LM head,
the batch's embedding rows, and per MoE layer each distinct expert the batch's tokens chose, from
an eager pass with routing capture over the same tokens: ``coldset.bench.measure_routing``) over
the measured read rate; ``of floor`` = floor / measured step. Checks: every engine decodes the
eager engine's greedy tokens (16 steps, both batch sizes); the largest logit difference.
``--tune`` runs the experts autotune (coldset.tune) for batch 1 and 8 first; ``--tuned`` reads
the configs of an autotune entry instead (e.g. the bench's results/autotune/<model>.json; a
speed choice only). ``--sweep`` also times (before building the model, random weights of the real shapes)
:func:`coldset.kernels.triton_decode.gemv`'s launch configs against cuBLAS and ``norm_linear`` at
the qkv, o_proj and LM head shapes, and the fused router against what it replaces (``gemv_sweep``);
``--sweep linear8`` times ``norm_linear``'s configs at 8 tokens (qkv with the input add and norm,
o_proj with the residual) against the engine's batch-8 way.
Writes ``decode_step.json``; the table is printed last.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

T0 = time.perf_counter()
# The fused engines: compile_decode's default (dependent launch where it measured faster: batch 1
# on Hopper), and each way forced.
FUSED_PDL = {"fused": None, "fused-pdl": True, "fused-nopdl": False}


def log(*a) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, file=sys.stderr, flush=True)


def kernel_profile(step, n: int = 3, layers: int = 1) -> dict:
    """Kernels per step (and per layer: per step / ``layers``) and their summed device time,
    from the profiler over ``n`` calls; the top kernels by time with their count per step."""
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


def gemv_sweep(dev, dtype, layers: int = 48, reps: int = 20, parts=("gemv", "router")) -> list[dict]:
    """µs per launch of the one-token GEMV (``triton_decode.gemv``) configs against what ran
    before (``norm_linear``'s default, cuBLAS) at Qwen3-30B-A3B's qkv (with the input add and norm),
    o_proj (with the residual) and LM head (add + final norm) shapes, and of the fused router
    (``triton_decode.route``) against the rms_norm + cuBLAS + softmax_topk + cast it replaces, at 1
    and 8 tokens: each a CUDA graph over ``layers`` weight copies (3 of the LM head), nothing left
    in L2. Random weights: no model needed. Every config's output is checked against cuBLAS first."""
    import torch.nn.functional as F

    from coldset.kernels import softmax_topk
    from coldset.kernels.triton_decode import GemvConfig, gemv, gemv_config, norm_linear, rms_norm, route
    from coldset.tune import graph_time_us

    rows: list[dict] = []
    shapes = {"qkv": (5120, 2048, layers), "o_proj": (2048, 4096, layers), "lm_head": (151936, 2048, 3)}
    cands = {"qkv": [(2, 1, 4), (4, 1, 4), (4, 1, 8), (8, 1, 8), (4, 2, 4)],
             "o_proj": [(1, 1, 4), (2, 1, 4), (2, 1, 8), (4, 1, 8)],
             "lm_head": [(4, 1, 4), (4, 4, 4), (8, 4, 8), (8, 2, 8), (16, 4, 8)]}

    def record(**r):
        rows.append(r)
        log("sweep", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()})

    def case(name: str, n: int, k: int, copies: int, m: int):
        """``copies`` random ``[n, k]`` weights, ``m`` tokens ``x`` and the shape's other input
        (o_proj: the residual ``[m, n]``; qkv and the LM head: the add ``[m, k]`` before a unit
        norm); ``apply(op, w, **kw)`` runs ``gemv`` or ``norm_linear`` with them as the engine
        does, ``want(w)`` is float32 torch's result."""
        g = torch.Generator(device=dev).manual_seed(n if m == 1 else n + m)
        ws = [torch.randn(n, k, device=dev, dtype=dtype, generator=g) * k ** -0.5 for _ in range(copies)]
        x = torch.randn(m, k, device=dev, dtype=dtype, generator=g)
        extra = torch.randn(m, n if name == "o_proj" else k, device=dev, dtype=dtype, generator=g)
        nw = torch.ones(k, device=dev, dtype=dtype)

        def apply(op, w, **kw):
            if name == "o_proj":
                return op(x, w, residual=extra, **kw)
            return op(x, w, norm_weight=nw, eps=1e-6, add=extra, **kw)[1]

        def want(w):
            if name == "o_proj":
                return extra.float() + x.float() @ w.float().T
            return F.rms_norm((x + extra).float(), (k,), eps=1e-6) @ w.float().T

        return ws, x, extra, nw, apply, want

    def timed(shape: str, n: int, k: int, copies: int, label: str, fn, **fields):
        us = graph_time_us(fn, reps) / copies
        record(shape=shape, n=n, k=k, config=label, us=us, GBps=n * k * 2 / us / 1e3, **fields)

    def checked(shape: str, label: str, got, want) -> bool:
        """Whether a config's output is within 1e-2 of float32 torch (recorded as an error if not)."""
        err = ((got.float() - want).norm() / want.norm()).item()
        if err > 1e-2:
            record(shape=shape, config=label, error=f"relative error {err:.3g}")
        return err <= 1e-2

    for name, (n, k, copies) in (shapes.items() if "gemv" in parts else ()):
        ws, x, extra, nw, apply, want = case(name, n, k, copies, 1)
        timed(name, n, k, copies, "cublas F.linear (no norm)", lambda: [F.linear(x, w) for w in ws])
        if name != "lm_head":
            timed(name, n, k, copies, "norm_linear default", lambda: [apply(norm_linear, w) for w in ws])
        default = gemv_config(n, k)
        for c in [default] + [GemvConfig(*t) for t in cands[name] if GemvConfig(*t) != default]:
            if checked(name, str(c), apply(gemv, ws[0], config=c), want(ws[0])):
                timed(name, n, k, copies, str(c), lambda c=c: [apply(gemv, w, config=c) for w in ws], default=c == default)
        timed(name, n, k, copies, f"{default} pdl", lambda: [apply(gemv, w, config=default, pdl=True) for w in ws],
              default=True, pdl=True)
        ws.clear()  # free the copies before the next shape

    if "linear8" in parts:  # batch 8: the engine's way (rms_norm + cuBLAS qkv, norm_linear o_proj) against norm_linear configs
        from coldset.kernels.triton_decode import LinearConfig, linear_config

        m = 8
        lin_cands = [(16, 16, 512, 4, 3), (16, 16, 256, 4, 4), (16, 16, 128, 4, 6), (16, 32, 256, 4, 4), (16, 32, 256, 4, 6),
                     (16, 32, 512, 4, 3), (16, 32, 512, 8, 4), (16, 64, 256, 4, 4), (16, 64, 256, 8, 5), (16, 64, 128, 4, 6),
                     (16, 16, 1024, 8, 2), (16, 32, 128, 4, 8)]
        for name in ("qkv", "o_proj"):
            n, k, copies = shapes[name]
            ws, x, extra, nw, apply, want = case(name, n, k, copies, m)
            label = f"{name} m={m}"

            def engine(w):
                if name == "o_proj":
                    return norm_linear(x, w, residual=extra)
                return F.linear(rms_norm(x, nw, 1e-6, add=extra)[1], w)

            timed(label, n, k, copies, "cublas F.linear (no norm)", lambda: [F.linear(x, w) for w in ws])
            timed(label, n, k, copies, "engine (qkv: rms_norm + cuBLAS; o_proj: norm_linear default)",
                  lambda: [engine(w) for w in ws])
            default = linear_config(m, n, k)
            for c in [default] + [LinearConfig(*t) for t in lin_cands if LinearConfig(*t) != default]:
                try:
                    ok = checked(label, str(c), apply(norm_linear, ws[0], config=c), want(ws[0]))
                except Exception as exc:  # out of resources
                    record(shape=label, config=str(c), error=repr(exc)[:200])
                    continue
                if ok:
                    timed(label, n, k, copies, str(c), lambda c=c: [apply(norm_linear, w, config=c) for w in ws],
                          default=c == default)
            ws.clear()

    if "router" not in parts:
        return rows
    E, H, topk = 128, 2048, 8
    g = torch.Generator(device=dev).manual_seed(7)
    gws = [torch.randn(E, H, device=dev, dtype=dtype, generator=g) * H ** -0.5 for _ in range(layers)]
    nw = torch.ones(H, device=dev, dtype=dtype)
    counters = [torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(layers)]
    for m in (1, 8):
        x = torch.randn(m, H, device=dev, dtype=dtype, generator=g) * 3

        def before():
            for w in gws:
                h = rms_norm(x, nw, 1e-6)
                ids, wt = softmax_topk(F.linear(h, w), topk, True)
                wt.to(dtype)

        ref_ids = softmax_topk(F.linear(rms_norm(x, nw, 1e-6), gws[0]), topk, True)[0]
        us = graph_time_us(before, reps) / layers
        record(shape=f"router m={m}", config="rms_norm + cuBLAS + softmax_topk + cast", us=us)
        for be in (1, 2, 4):
            ids = route(x, nw, 1e-6, gws[0], topk, True, counters[0], weights_dtype=dtype, block_e=be)[1]
            same = (ids == ref_ids).all(dim=-1).float().mean().item()
            us = graph_time_us(lambda be=be: [route(x, nw, 1e-6, w, topk, True, c, weights_dtype=dtype, block_e=be)
                                              for w, c in zip(gws, counters)], reps) / layers
            record(shape=f"router m={m}", config=f"route block_e={be}", us=us, rows_same_ids_as_before=same,
                   default=be == 2)
        us = graph_time_us(lambda: [route(x, nw, 1e-6, w, topk, True, c, weights_dtype=dtype, pdl=True)
                                    for w, c in zip(gws, counters)], reps) / layers
        record(shape=f"router m={m}", config="route block_e=2 pdl", us=us, default=True, pdl=True)
    assert all(int(c.item()) == 0 for c in counters), "route left a ticket counter non-zero"
    return rows


def baseline_experts(path: str, result) -> callable:
    """The engine's experts function with the triton_experts of another copy of triton_moe.py
    (the unmodified path, as ``tuned_experts(result, use_row_map=False)``), each batch size on its
    tuned config restricted to the fields that copy knows."""
    import importlib.util

    from coldset.tune import config_for

    spec = importlib.util.spec_from_file_location("baseline_triton_moe", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    known = set(mod.KernelConfig.__dataclass_fields__)
    chosen: dict[int, dict] = {}

    def experts(pools, layer, x, topk_ids, topk_weights):
        bs = int(x.shape[0])
        if bs not in chosen:
            chosen[bs] = {k: v for k, v in config_for(result, bs).items() if k in known}
        return mod.triton_experts(pools, layer, x, topk_ids, topk_weights, config=chosen[bs], use_row_map=False)

    return experts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="config/examples/qwen3-30b-a3b-h200.yaml")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tuned", help="an autotune cache entry (JSON) whose experts configs to use")
    ap.add_argument("--engines", default="eager,compiled,fused")
    ap.add_argument("--sweep", nargs="?", const="gemv,router", default=None,
                    help="comma-separated parts: gemv (one-token GEMV configs), router (the fused router), linear8 "
                         "(norm_linear configs at 8 tokens)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--baseline-module",
                    help="another triton_moe.py (e.g. `git show main:src/coldset/kernels/triton_moe.py`): an engine "
                         "named NAME@base runs engine NAME with that module's triton_experts on the same tuned "
                         "configs (needs --tuned or --tune), for a before/after of the experts kernel in one process")
    args = ap.parse_args()

    from coldset import bench as bn
    from coldset.config import load_config
    from coldset.files import write_json
    from coldset.fixtures import template_texts
    from coldset.gate import experts_functions
    from coldset.placement import expert_bytes
    from coldset.synthetic import SyntheticSpec, build_synthetic_model
    from coldset.tune import TuneResult, TuneShape, autotune, eager_time_us, tuned_experts

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = load_config(args.config)
    dev = torch.device("cuda")
    R: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "config": args.config}

    R["hbm_read_GBps"] = bn.measure_ceilings()["hbm_read_gb_s"]
    log("HBM read GB/s", R["hbm_read_GBps"])
    if args.sweep:  # before the model: random weights of the real shapes
        R["gemv_sweep"] = gemv_sweep(dev, getattr(torch, config["model"]["dtype"]), parts=args.sweep.split(","))
        write_json(out / "decode_step.json", R)
        torch.cuda.empty_cache()

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
    if args.tune:
        t = time.perf_counter()
        result = autotune(shape, [1, 8], "cuda", "/tmp/coldset-autotune")
        R["autotune_s"] = time.perf_counter() - t
        experts = tuned_experts(result, use_row_map=False)
        R["tuned_configs"] = result.configs
        log("autotune", R["autotune_s"], "s")
    elif args.tuned:
        import json

        entry = json.loads(Path(args.tuned).read_text())
        result = TuneResult(key=entry["key"], hit=True, backend=entry["backend"], shape=shape,
                            batch_sizes=[int(b) for b in entry["configs"]],
                            configs={int(b): c for b, c in entry["configs"].items()})
        experts = tuned_experts(result, use_row_map=False)
        R["tuned_configs"] = result.configs
        R["tuned_from"] = args.tuned
    experts_by_name = {"": experts}
    if args.baseline_module:
        if not (args.tune or args.tuned):
            raise SystemExit("--baseline-module needs --tune or --tuned (the configs both kernels run)")
        experts_by_name["base"] = baseline_experts(args.baseline_module, result)
        R["baseline_module"] = args.baseline_module


    def no_experts(pools, layer, x, topk_ids, topk_weights):
        return torch.zeros_like(x)

    plen, new = 32, 16
    stream = [t for d in fx["domains"] for text in texts[d][:4] for t in tokenizer.encode(text).ids]
    prompts_by_b = {b: bn.bench_prompts(stream, b, plen) for b in (1, 8)}
    # The bytes floor per step: every non-expert weight once (the batch's embedding rows), and
    # each distinct expert the batch chose per layer (eager routing capture over the same tokens).
    ebytes = expert_bytes(cfg)
    R["floor"] = {}
    model.experts_fn = experts
    for b, prompts in prompts_by_b.items():
        _, _, hot_per_token, _ = bn.measure_routing(model, prompts, new, ebytes)
        step_bytes = bn._nonexpert_read_bytes(cfg, b, model.dtype) + hot_per_token * b
        R["floor"][b] = {"bytes_per_step": step_bytes, "expert_bytes_per_step": hot_per_token * b,
                         "floor_ms": step_bytes / (R["hbm_read_GBps"] * 1e6)}
    log("floor", R["floor"])

    rows: list[dict] = []
    tokens_by_mode: dict[str, list] = {}
    logits_by_mode: dict[str, torch.Tensor] = {}
    import torch._dynamo as dynamo

    def run_engine(mode: str, t: float, experts) -> None:
        for bsz in (1, 8):
            for name in (("full", "no_experts") if bsz == 1 else ("full",)):
                model.experts_fn = experts if name == "full" else no_experts
                dec = bn.Decoder(model, bsz, plen, new, True)
                tok = dec.prefill(prompts_by_b[bsz])
                dec.set_step(tok, 1)
                dec.capture()
                if bsz == 1 and name == "full":
                    R.setdefault("compile_s", {})[mode] = time.perf_counter() - t
                toks, logs = [tok], []
                for step in range(1, new):
                    dec.set_step(tok, step)
                    lg = dec.step()
                    logs.append(lg.float().clone())
                    tok = torch.argmax(lg, dim=-1)
                    toks.append(tok)
                if name == "full":
                    tokens_by_mode[f"{mode}/b{bsz}"] = torch.stack(toks, 1).tolist()
                    logits_by_mode[f"{mode}/b{bsz}"] = torch.stack(logs, 1)
                ms = eager_time_us(dec.step, args.reps) / 1e3
                row = {"mode": mode, "batch": bsz, "experts": name, "step_ms": ms, "tok_s": bsz * 1e3 / ms}
                if name == "full":
                    row["floor_ms"] = R["floor"][bsz]["floor_ms"]
                    row["fraction_of_floor"] = row["floor_ms"] / ms
                    try:
                        row["profile"] = kernel_profile(dec.step, layers=len(model.layers))
                    except Exception as exc:  # the profiler is a diagnosis, not the measurement
                        row["profile"] = {"error": repr(exc)}
                rows.append(row)
                log({k: v for k, v in row.items() if k != "profile"},
                    {k: v for k, v in row.get("profile", {}).items() if k != "top"})
                del dec
                write_json(out / "decode_step.json", {**R, "rows": rows})

    engines = args.engines.split(",")
    for mode in engines:
        dynamo.reset()
        model._compiled_before_experts = None
        t = time.perf_counter()
        engine, _, which = mode.partition("@")
        if which not in experts_by_name:
            raise SystemExit(f"engine {mode!r}: @{which} needs --baseline-module")
        if engine == "compiled":
            model.compile_decode(fused=False)
        elif engine in FUSED_PDL:
            model.compile_decode(fused=True, pdl=FUSED_PDL[engine])
        elif engine != "eager":
            raise SystemExit(f"unknown engine {mode!r} (eager, compiled, {', '.join(FUSED_PDL)}; NAME@base)")
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
        for bsz in (1, 8):
            if f"{mode}/b{bsz}" not in tokens_by_mode or f"{ref}/b{bsz}" not in tokens_by_mode:
                continue
            e, c = tokens_by_mode[f"{ref}/b{bsz}"], tokens_by_mode[f"{mode}/b{bsz}"]
            same = sum(a == b for x, y in zip(e, c) for a, b in zip(x, y)) / (bsz * new)
            diff = (logits_by_mode[f"{ref}/b{bsz}"] - logits_by_mode[f"{mode}/b{bsz}"]).abs().max().item()
            R["checks"][f"{mode}/b{bsz}"] = {"token_match": same, "max_abs_logit_diff": diff}
    write_json(out / "decode_step.json", {**R, "rows": rows})
    print(f"\n{R['device']}: HBM read {R['hbm_read_GBps']:.0f} GB/s; floor ms b1 {R['floor'][1]['floor_ms']:.3f} "
          f"({R['floor'][1]['bytes_per_step'] / 1e9:.2f} GB), b8 {R['floor'][8]['floor_ms']:.3f} "
          f"({R['floor'][8]['bytes_per_step'] / 1e9:.2f} GB); compile s {R.get('compile_s')}")
    print(f"checks (against {ref}):", R["checks"])
    if R.get("errors"):
        print("errors:", R["errors"])
    if args.sweep:
        for r in R["gemv_sweep"]:
            print(f"sweep {r['shape']:12s} {r['config']:60s} " + (f"{r['us']:7.2f} us" if "us" in r else r.get("error", ""))
                  + (f" {r['GBps']:6.0f} GB/s" if "GBps" in r else "")
                  + (f" same ids {r['rows_same_ids_as_before']:.2f}" if "rows_same_ids_as_before" in r else "")
                  + (" (default)" if r.get("default") else ""))
    for r in rows:
        if "top" in r.get("profile", {}):
            print(r["mode"], f"b{r['batch']}", "top kernels (name, per step, us per step):",
                  [(t["name"][:48], t["per_step"], t["us_per_step"]) for t in r["profile"]["top"][:12]])
    print(f"{'engine':10s} {'b':>2s} {'experts':10s} {'step ms':>8s} {'tok/s':>8s} {'floor ms':>8s} {'of floor':>8s} "
          f"{'kernels':>8s} {'k/layer':>8s} {'kern us':>8s}")
    for r in rows:
        p = r.get("profile", {})
        nan = float("nan")
        print(f"{r['mode']:10s} {r['batch']:2d} {r['experts']:10s} {r['step_ms']:8.3f} {r['tok_s']:8.1f} "
              f"{r.get('floor_ms', nan):8.3f} {r.get('fraction_of_floor', nan):8.3f} {p.get('kernels_per_step', nan):8.1f} "
              f"{p.get('kernels_per_layer', nan):8.1f} {p.get('kernel_us_per_step', nan):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
