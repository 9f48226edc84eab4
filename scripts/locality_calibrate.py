"""Locality and cache hit rates of the synthetic model's routing, side by side with a real trace.

For a workflow config (default config/config.yaml) with optional ``model.synthetic`` overrides,
runs the model, fixtures and routing stages into a scratch results folder (in memory: the
synthetic weights are built from the seed by the routing stage, on the config's device), then
prints one JSON line per routing: decode Gini (mean over layers), top-25% share (mean over
layers), consecutive overlap, shuffled overlap and lift (stats.locality_stats, seed 0), and the
static / lru / lfu / belady hit rates at residencies 0.25, 0.5, 0.75 (coldset.analysis.cache; warm from the
profile's decode counts) for two splits, keyed ``{split}:{policy}@{residency}``:

- ``heldout``: same domains. Synthetic: profile = the fixtures' profile split, replay = their
  held-out split. Real: requests split by a hash of their id (coldset.trace.capture.split_of, half
  held out), every subject in both.
- ``cross``: another domain. Synthetic: profile = every fixture of all domains but the last,
  replay = the last domain's (code by default). Real: profile abstract_algebra + anatomy, replay
  astronomy (the trace's README).

A static set chosen on one domain covers another domain's traffic far worse (real trace at 0.25:
78% same-domain, 54% cross-domain), so each synthetic split is compared with the real trace's
split of the same kind. ``--real`` adds the real trace's line.

The lift depends on the request length as much as on the router: its baseline shuffles each
request's tokens, and the shorter the request, the more of those shuffled neighbours lie a few
tokens apart, where the topic still persists. The real trace's requests decode ~126 tokens, the
default fixtures' 31 (``max_new_tokens`` 32: the first new token comes from the prefill), and the
real trace's lift over each request's first 31 decode tokens is well under its lift over whole
requests (docs/cache.md). So the real line also carries
``lift_first{N}``: the lift over each request's first ``N`` decode tokens (``--lift-window``,
default the config's ``fixtures.max_new_tokens - 1``, the synthetic requests' length), the
like-for-like target for the synthetic lift.

``--grid KNOB=V1,V2,...`` (router knobs only, coldset.engine.synthetic.ROUTER_KNOBS; repeatable) runs
every combination on one build: the pipeline remakes only the routers (set_router_knobs), so a
real-shape sweep on the GPU builds the 61 GB model once. ``--seeds`` repeats everything per seed
and adds a line with the mean, min and max over the seeds of every number.

CPU (default shape):   PYTHONPATH=src python scripts/locality_calibrate.py --real --seeds 0 1 2 3
Knob override:         PYTHONPATH=src python scripts/locality_calibrate.py --set temporal_gain=0
Router sweep:          PYTHONPATH=src python scripts/locality_calibrate.py --grid popularity_scale=8,12
Real shape on the GPU: PYTHONPATH=src python scripts/locality_calibrate.py \\
                           --config config/examples/qwen3-30b-a3b-h200.yaml
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REAL_TRACE = Path(__file__).resolve().parents[1] / "../shared/data/traces/llama4-maverick-mmlu.parquet"
REAL_CROSS = (["abstract_algebra", "anatomy"], ["astronomy"])
RESIDENCIES = (0.25, 0.5, 0.75)
POLICIES = ("static", "lru", "lfu", "belady")


def first_decode_tokens(rows, n: int):
    """The rows of each request's first ``n`` decode tokens (positions counted from the request's
    first decode position)."""
    first = rows.groupby("request", observed=True)["position"].transform("min")
    return rows[(rows["position"] - first) < n]


def routing_summary(rows, meta, splits: dict, lift_windows: tuple[int, ...] = (), lags: tuple[int, ...] = ()) -> dict:
    """Skew, locality, the lift over each request's first N decode tokens for N in
    ``lift_windows``, the mean overlap of a request's tokens d apart for d in ``lags`` (with the
    shuffled overlap over all requests' tokens, the floor they fall to without a per-request
    component), and, per split name -> (profile rows, replay rows), the cache hit rates."""
    from coldset.analysis.simulate import capacity_for_residency, simulate
    from coldset.analysis.streams import counts_from_rows, stream_from_frame
    from coldset.analysis.locality import decode_tokens, locality_stats, pair_overlap, shuffled_overlap
    from coldset.analysis.skew import gini, top_share

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
        "tokens_per_request": loc["tokens"] / loc["requests"],
    }
    for n in lift_windows:
        out[f"lift_first{n}"] = locality_stats(first_decode_tokens(rows, n), meta, seed=0)["lift"]
    if lags:
        sel, req, pos = decode_tokens(rows, L, meta.top_k)
        out["global_shuffled_overlap"] = float(np.nanmean(shuffled_overlap(sel, np.zeros_like(req), seed=0)))
        for d in lags:
            pair = (req[d:] == req[:-d]) & (pos[d:] == pos[:-d] + d)
            out[f"overlap_lag{d}"] = (float(pair_overlap(sel[d:][pair], sel[:-d][pair], meta.top_k).mean())
                                      if pair.any() else None)
    for name, (profile_rows, replay_rows) in splits.items():
        profile = counts_from_rows(profile_rows, L, E)
        stream = stream_from_frame(replay_rows, L, E)
        for r in RESIDENCIES:
            cap = capacity_for_residency(r, L, E)
            for p in POLICIES:
                out[f"{name}:{p}@{r}"] = round(simulate(stream, p, cap, profile).stats().hit_rate, 4)
    return out


def _splits(rows, heldout: tuple, cross: tuple) -> dict:
    from coldset.analysis.streams import select_rows

    return {"heldout": (select_rows(rows, heldout[0]), select_rows(rows, heldout[1])),
            "cross": (select_rows(rows, None, cross[0]), select_rows(rows, None, cross[1]))}


def synthetic_routing(config: dict, workdir: Path, lags: tuple[int, ...] = ()) -> dict:
    """Run the model, fixtures and routing stages for ``config`` into ``workdir`` and summarise.

    The pipeline keeps its engine between calls: a config that differs from the last one only
    in router knobs reuses the built model with its routers remade."""
    from coldset.analysis.streams import trace_decode_rows
    from coldset.core.layout import Layout
    from coldset.workflow.pipeline import run_stage

    config = {**config, "results": str(workdir)}
    for stage in ("model", "fixtures", "routing"):
        run_stage(stage, config)
    rows, meta = trace_decode_rows(Layout.from_config(config).trace)
    domains = list(config["fixtures"]["domains"])
    return routing_summary(rows, meta, _splits(rows, ("profile", "heldout"), (domains[:-1], domains[-1:])), (), lags)


def real_routing(path: Path, lift_windows: tuple[int, ...] = (), lags: tuple[int, ...] = ()) -> dict:
    from coldset.analysis.streams import trace_decode_rows

    rows, meta = trace_decode_rows(path, heldout_fraction=0.5)
    return routing_summary(rows, meta, _splits(rows, ("profile", "heldout"), REAL_CROSS), lift_windows, lags)


def seed_summary(lines: list[dict]) -> dict:
    """Mean, min and max over ``lines`` of every number they share."""
    keys = [k for k, v in lines[0].items() if isinstance(v, (int, float)) and k not in ("seconds", "seed")]
    out = {}
    for k in keys:
        v = np.array([line[k] for line in lines], dtype=float)
        out[k] = {"mean": round(float(v.mean()), 4), "min": round(float(v.min()), 4), "max": round(float(v.max()), 4)}
    return out


def _knob_values(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected KNOB=VALUE, got {item!r}")
        out[key] = value
    return out


def main() -> None:
    from coldset.workflow.config import load_config
    from coldset.engine.synthetic import ROUTER_KNOBS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("config/config.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                    help="model.synthetic override (JSON value), repeatable")
    ap.add_argument("--grid", action="append", default=[], metavar="KNOB=V1,V2",
                    help="router knob values to sweep on one build (JSON values), repeatable")
    ap.add_argument("--seeds", type=int, nargs="+", help="model seeds (default: the config's)")
    ap.add_argument("--device", help="override the config's device")
    ap.add_argument("--real", action="store_true", help="also summarise the shared Llama-4 trace")
    ap.add_argument("--real-trace", type=Path, default=REAL_TRACE)
    ap.add_argument("--lift-window", type=int, nargs="+", metavar="N",
                    help="the real line's lift_firstN windows (default: the config's fixtures.max_new_tokens - 1)")
    ap.add_argument("--lags", type=int, nargs="+", default=[], metavar="D",
                    help="also the mean overlap of tokens D apart (overlap_lagD) and the all-request shuffled one")
    ap.add_argument("--no-synthetic", action="store_true")
    ap.add_argument("--out", type=Path, help="also write the lines to this JSON file")
    args = ap.parse_args()
    overrides = {k: json.loads(v) for k, v in _knob_values(args.set).items()}
    grid = {k: [json.loads(x) for x in v.split(",")] for k, v in _knob_values(args.grid).items()}
    not_router = sorted(set(grid) - set(ROUTER_KNOBS))
    if not_router:
        raise SystemExit(f"--grid takes router knobs only ({', '.join(ROUTER_KNOBS)}), not {not_router}: "
                         "use --set for the others (each value needs its own build)")
    lines = []

    def emit(line: dict) -> None:
        lines.append(line)
        print(json.dumps(line), flush=True)

    base = load_config(args.config)
    if args.real:
        windows = args.lift_window or [int(base["fixtures"]["max_new_tokens"]) - 1]
        emit({"routing": f"real: {args.real_trace.stem}",  # the shared trace's stem: llama4-maverick-mmlu
              **real_routing(args.real_trace, tuple(windows), tuple(args.lags))})
    if not args.no_synthetic:
        base["model"]["path"] = None
        if args.device:
            base["device"] = args.device
        seeds = args.seeds or [None]
        variants = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
        per_variant: dict[int, list[dict]] = {i: [] for i in range(len(variants))}
        for seed in seeds:
            with tempfile.TemporaryDirectory() as tmp:
                for i, variant in enumerate(variants):
                    knobs = {**overrides, **({} if seed is None else {"seed": seed}), **variant}
                    config = json.loads(json.dumps(base))
                    config["model"]["synthetic"] = {**config["model"]["synthetic"], **knobs, "in_memory": True}
                    t0 = time.perf_counter()
                    summary = synthetic_routing(config, Path(tmp), tuple(args.lags))
                    emit({"routing": f"synthetic: {args.config} {json.dumps(knobs)}", **summary,
                          "seconds": round(time.perf_counter() - t0, 1)})
                    per_variant[i].append(lines[-1])
        if len(seeds) > 1:
            for i, variant in enumerate(variants):
                emit({"routing": f"synthetic: {args.config} {json.dumps({**overrides, **variant})} "
                                 f"over seeds {seeds}", **seed_summary(per_variant[i])})
    if args.out:
        args.out.write_text(json.dumps(lines, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
