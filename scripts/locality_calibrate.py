"""Locality and cache hit rates of the synthetic model's routing, side by side with a real trace.

For a workflow config (default config/config.yaml) with optional ``model.synthetic`` overrides,
runs the model, fixtures and routing stages into a scratch results folder (in memory: the
synthetic weights are built from the seed by the routing stage, on the config's device), then
prints one JSON line per routing: decode Gini (mean over layers), top-25% share (mean over
layers), consecutive overlap, shuffled overlap and lift (stats.locality_stats, seed 0), and the
static / lru / lfu / belady hit rates at residencies 0.25, 0.5, 0.75 (coldset.cache: warm from the
profile split's decode counts, all domains; replay the held-out split). ``--real`` adds the same
line for the shared Llama-4-Maverick trace (profile abstract_algebra + anatomy, held-out
astronomy, its README).

CPU (default shape):   PYTHONPATH=src python scripts/locality_calibrate.py --real
Knob override:         PYTHONPATH=src python scripts/locality_calibrate.py --set temporal_gain=0
Real shape on the GPU: PYTHONPATH=src python scripts/locality_calibrate.py \\
                           --config config/examples/qwen3-30b-a3b-h200.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REAL_TRACE = Path(__file__).resolve().parents[1] / "../shared/data/traces/llama4-maverick-mmlu.parquet"
RESIDENCIES = (0.25, 0.5, 0.75)
POLICIES = ("static", "lru", "lfu", "belady")


def routing_summary(rows, meta, profile_rows, replay_rows) -> dict:
    from coldset.cache import capacity_for_residency, counts_from_rows, simulate, stream_from_frame
    from coldset.stats import gini, locality_stats, top_share

    L, E = meta.num_moe_layers, meta.num_experts
    counts = counts_from_rows(rows, L, E)
    loc = locality_stats(rows, meta, seed=0)
    out = {
        "gini_decode": float(np.mean([gini(c) for c in counts])),
        "top25_share_decode": float(np.mean([top_share(c, 25) for c in counts])),
        "consecutive_overlap": loc["consecutive_overlap"]["mean"],
        "shuffled_overlap": loc["shuffled_overlap"]["mean"],
        "lift": loc["lift"],
        "reuse_1": loc["reuse_distance"]["1"],
        "tokens": loc["tokens"],
    }
    profile = counts_from_rows(profile_rows, L, E)
    stream = stream_from_frame(replay_rows, L, E)
    for r in RESIDENCIES:
        cap = capacity_for_residency(r, L, E)
        for p in POLICIES:
            out[f"{p}@{r}"] = round(simulate(stream, p, cap, profile).stats().hit_rate, 4)
    return out


def synthetic_routing(config_path: Path, overrides: dict, workdir: Path, device: str | None) -> dict:
    from coldset.cache import select_rows, trace_decode_rows
    from coldset.config import Layout, load_config
    from coldset.pipeline import run_stage

    config = load_config(config_path)
    config["results"] = str(workdir)
    config["model"]["synthetic"] = {**config["model"]["synthetic"], **overrides, "in_memory": True}
    config["model"]["path"] = None
    if device:
        config["device"] = device
    for stage in ("model", "fixtures", "routing"):
        run_stage(stage, config)
    rows, meta = trace_decode_rows(Layout.from_config(config).trace)
    return routing_summary(rows, meta, select_rows(rows, "profile"), select_rows(rows, "heldout"))


def real_routing(path: Path) -> dict:
    from coldset.cache import select_rows, trace_decode_rows

    rows, meta = trace_decode_rows(path)
    return routing_summary(rows, meta, select_rows(rows, None, ["abstract_algebra", "anatomy"]),
                           select_rows(rows, None, ["astronomy"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("config/config.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                    help="model.synthetic override (JSON value), repeatable")
    ap.add_argument("--device", help="override the config's device")
    ap.add_argument("--real", action="store_true", help="also summarise the shared Llama-4 trace")
    ap.add_argument("--real-trace", type=Path, default=REAL_TRACE)
    ap.add_argument("--no-synthetic", action="store_true")
    ap.add_argument("--out", type=Path, help="also write the lines to this JSON file")
    args = ap.parse_args()
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    lines = []
    if args.real:
        lines.append({"routing": "real: llama4-maverick-mmlu", **real_routing(args.real_trace)})
        print(json.dumps(lines[-1]), flush=True)
    if not args.no_synthetic:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            summary = synthetic_routing(args.config, overrides, Path(tmp), args.device)
        lines.append({"routing": f"synthetic: {args.config} {json.dumps(overrides)}", **summary,
                      "seconds": round(time.perf_counter() - t0, 1)})
        print(json.dumps(lines[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(lines, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
