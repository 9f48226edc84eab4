#!/usr/bin/env python3
"""The batch-1 decode step at real shape on one GPU: where its time goes, eager vs compiled.

    PYTHONPATH=src python3 scripts/decode_step_h200.py --config config/examples/qwen3-30b-a3b-h200.yaml \
        --out <dir> [--tune]

Builds the config's in-memory synthetic model (every expert in HBM), measures the HBM read
ceiling (a Triton streaming read), then for four engines, the eager step and the step with
``MoEModel.compile_decode``, each with the router's top-k by ``torch.topk`` (the engine before
this script's session) and by the one-launch kernel (``coldset.kernels.softmax_topk``), each
captured in one CUDA graph by ``coldset.bench.Decoder``, times: the full step and the step with
the routed experts replaced by zeros (router still runs) at batch 1, the full step at batch 8,
plus a kernel profile of the batch-1 step. Checks: each engine decodes the first one's greedy
tokens (16 steps), and the largest logit difference. The bound is bytes read per token at batch 1 (non-expert weights, one
embedding row, top_k experts per layer) over the measured read bandwidth. ``--tune`` runs the
autotune (coldset.tune) for batch 1 and 8 first and uses its launch configs. Writes
``decode_step.json``; the table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

T0 = time.perf_counter()


def log(*a) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, file=sys.stderr, flush=True)


def kernel_profile(step, n: int = 3) -> dict:
    """Kernels per step and their summed device time, from the profiler over ``n`` calls."""
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
    top = sorted(((k, len(v) / n, sum(v) / n) for k, v in by_name.items()), key=lambda r: -r[2])[:15]
    return {"kernels_per_step": len(kernels) / n, "kernel_us_per_step": total_us / n,
            "top": [{"name": k, "per_step": c, "us_per_step": round(us, 1)} for k, c, us in top]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="config/examples/qwen3-30b-a3b-h200.yaml")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()

    from coldset import bench as bn
    from coldset.config import load_config
    from coldset.files import write_json
    from coldset.fixtures import template_texts
    from coldset.gate import experts_functions
    from coldset.placement import expert_bytes, nonexpert_bytes_breakdown
    from coldset.synthetic import SyntheticSpec, build_synthetic_model
    from coldset.tune import TuneShape, autotune, eager_time_us, tuned_experts

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = load_config(args.config)
    dev = torch.device("cuda")
    R: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "config": args.config}

    R["hbm_read_GBps"] = bn.measure_ceilings()["hbm_read_gb_s"]
    log("HBM read GB/s", R["hbm_read_GBps"])

    spec = SyntheticSpec(**config["model"]["synthetic"])
    fx = config["fixtures"]
    texts = template_texts(fx["domains"], 200, seed=fx["seed"] + 1, template_dir=fx["template_dir"])
    model, tokenizer = build_synthetic_model(spec, dev, getattr(torch, config["model"]["dtype"]), domain_texts=texts)
    cfg = model.config
    L = cfg.num_moe_layers
    per_token = sum(v for k, v in nonexpert_bytes_breakdown(cfg).items() if k != "embed_tokens") \
        + cfg.hidden_size * 2 + L * cfg.top_k * expert_bytes(cfg)
    R["bytes_per_token_b1"] = per_token
    R["bound_tok_s"] = R["hbm_read_GBps"] * 1e9 / per_token
    log("model built; bound", R["bound_tok_s"], "tok/s")

    experts = experts_functions(dev, None)[0]
    if args.tune:
        shape = TuneShape(num_experts=cfg.num_experts, hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size,
                          top_k=cfg.top_k, dtype=config["model"]["dtype"], num_moe_layers=L,
                          num_hot=L * cfg.num_experts, num_cold=0)
        t = time.perf_counter()
        result = autotune(shape, [1, 8], "cuda", "/tmp/coldset-autotune")
        R["autotune_s"] = time.perf_counter() - t
        experts = tuned_experts(result, use_row_map=False)
        R["tuned_configs"] = {str(k): dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                              for k, v in result.configs.items()} if hasattr(result, "configs") else None
        log("autotune", R["autotune_s"], "s")

    def no_experts(pools, layer, x, topk_ids, topk_weights):
        return torch.zeros_like(x)

    prompt = torch.tensor([t for t in tokenizer.encode("def parse_args(items, limit):").ids] * 8)[:32]
    rows: list[dict] = []
    tokens_by_mode: dict[str, list] = {}
    logits_by_mode: dict[str, torch.Tensor] = {}
    import torch._dynamo as dynamo
    from coldset import model as engine

    from coldset.kernels import torch_softmax_topk

    engine_route = engine.MoEBlock.route

    def torch_topk_route(self, flat):  # the engine's router before the one-launch kernel
        return torch_softmax_topk(torch.nn.functional.linear(flat, self.gate.weight), self.top_k,
                                  self.norm_topk_prob)

    variants = {
        "eager, torch top-k": dict(compile=False, route=torch_topk_route),
        "compiled, torch top-k": dict(compile=True, route=torch_topk_route),
        "eager": dict(compile=False),
        "compiled": dict(compile=True),
    }
    for mode, v in variants.items():
        engine.MoEBlock.route = v.get("route", engine_route)
        dynamo.reset()
        model._compiled_before_experts = None
        t = time.perf_counter()
        if v["compile"]:
            model.compile_decode()
        for bsz, names in ((1, ("full", "no_experts")), (8, ("full",))):
            prompts = prompt[None].expand(bsz, -1).contiguous()
            for name in names:
                model.experts_fn = experts if name == "full" else no_experts
                dec = bn.Decoder(model, bsz, 32, 16, True)
                tok = dec.prefill(prompts)
                dec.set_step(tok, 1)
                dec.capture()
                if bsz == 1 and name == "full":
                    R.setdefault("compile_s", {})[mode] = time.perf_counter() - t
                toks, logs = [tok], []
                for step in range(1, 16):
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
                if bsz == 1:
                    row["fraction_of_bound"] = row["tok_s"] / R["bound_tok_s"]
                if bsz == 1 and name == "full":
                    try:
                        row["profile"] = kernel_profile(dec.step)
                    except Exception as exc:  # the profiler is a diagnosis, not the measurement
                        row["profile"] = {"error": repr(exc)}
                rows.append(row)
                log(row if "profile" not in row else {k: v for k, v in row.items() if k != "profile"},
                    {k: v for k, v in row.get("profile", {}).items() if k != "top"})
                del dec
                write_json(out / "decode_step.json", {**R, "rows": rows})
    engine.MoEBlock.route = engine_route
    from torch._dynamo.utils import counters

    R["dynamo"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break", "recompiles")}
    R["checks"] = {}
    for mode in variants:
        for bsz in (1, 8):
            e, c = tokens_by_mode[f"eager, torch top-k/b{bsz}"], tokens_by_mode[f"{mode}/b{bsz}"]
            same = sum(a == b for x, y in zip(e, c) for a, b in zip(x, y)) / (bsz * 16)
            diff = (logits_by_mode[f"eager, torch top-k/b{bsz}"] - logits_by_mode[f"{mode}/b{bsz}"]).abs().max().item()
            R["checks"][f"{mode}/b{bsz}"] = {"token_match": same, "max_abs_logit_diff": diff}
    write_json(out / "decode_step.json", {**R, "rows": rows})
    print(f"\n{R['device']}: HBM read {R['hbm_read_GBps']:.0f} GB/s; {per_token / 1e9:.2f} GB/token at batch 1 "
          f"-> bound {R['bound_tok_s']:.0f} tok/s; compile s {R.get('compile_s')}; dynamo {R['dynamo'].get('stats')}")
    print("checks (against eager, torch top-k):", R["checks"])
    print(f"{'mode':22s} {'b':>2s} {'experts':10s} {'step ms':>8s} {'tok/s':>8s} {'of bound':>8s} {'kernels':>8s} {'kern us':>8s}")
    for r in rows:
        p = r.get("profile", {})
        print(f"{r['mode']:22s} {r['batch']:2d} {r['experts']:10s} {r['step_ms']:8.3f} {r['tok_s']:8.1f} "
              f"{r.get('fraction_of_bound', float('nan')):8.3f} {p.get('kernels_per_step', float('nan')):8.1f} "
              f"{p.get('kernel_us_per_step', float('nan')):8.1f}")
    for r in rows:
        if "top" in r.get("profile", {}):
            print(r["mode"], "top kernels:", [(t["name"][:40], t["per_step"], t["us_per_step"]) for t in r["profile"]["top"][:10]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
