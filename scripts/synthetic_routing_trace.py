"""Capture a routing trace of the synthetic router at a real model's routing shape on the CPU.

Why: the forecast and the cache policies need a synthetic trace at Qwen3-30B-A3B's routing shape
(48 MoE layers, 128 experts, top-8) beside the real one, and the real-shape model (61 GB) does
not fit a CPU. The router's behaviour (popularity, domains, topics) lives in its directions, not
in the width of the experts, so this builds :func:`coldset.engine.synthetic.build_synthetic_model` at the
routing shape with a narrow hidden size and tiny experts, renders the fixtures (held-out prompts of
every domain) and writes the trace with :func:`coldset.trace.capture.capture_routing_engine`. It is not
the GPU's real-shape router (hidden 2048): its locality differs (say so beside any number).

Usage: python scripts/synthetic_routing_trace.py OUT.parquet [--per-domain 24] [--new-tokens 64]
       [--layers 48 --experts 128 --top-k 8 --hidden 256]
"""

from __future__ import annotations

import argparse
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--per-domain", type=int, default=24)
    ap.add_argument("--heldout-fraction", type=float, default=0.25)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    from coldset.trace.fixtures import make_fixtures
    from coldset.trace.capture import capture_routing_engine
    from coldset.engine.synthetic import SyntheticSpec, build_synthetic_model

    torch.set_num_threads(args.threads)
    spec = SyntheticSpec(layers=args.layers, experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                         moe_intermediate=16, heads=4, kv_heads=2, head_dim=64)
    t0 = time.perf_counter()
    model, tokenizer = build_synthetic_model(spec)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_fixtures(tmp, ["agent", "prose", "code"], args.per_domain, args.heldout_fraction,
                              args.new_tokens, 0)
        capture_routing_engine(model, tokenizer, paths, args.out, batch_size=8,
                               model_name=f"synthetic-{args.layers}x{args.experts}-top{args.top_k}-h{args.hidden}",
                               progress=False)
    print(f"{args.out}: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
