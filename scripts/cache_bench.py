"""Time the cache simulator on a large trace (the target: 10 million rows well under a minute, 2 cores).

Writes a random trace of ``--rows`` decode rows in the project's format (Qwen3-30B-A3B routing
shape by default: 48 MoE layers, 128 experts, top-8; Zipf popularity, each (request, layer) keeps
an expert from the previous token with probability ``--keep``), then times the read
(``trace_decode_rows``), the stream build (``stream_from_frame``) and ``simulate`` for every
policy of ``TIMED`` at each residency. The first simulate call of a process includes numba's
compilation (or a load from its on-disk cache): every policy runs once on a small stream first,
outside the timings.

Usage: python scripts/cache_bench.py [--rows 10000000] [--residency 0.5] [--keep 0.5] [--trace PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from coldset.analysis.policies import POLICIES, policy_for
from coldset.analysis.simulate import capacity_for_residency, simulate
from coldset.analysis.streams import AccessStream, counts_from_rows, select_rows, stream_from_frame, trace_decode_rows
from coldset.core.trace import TraceMeta, write_trace


# every policy that replays from the trace alone, and forecast with the transition forecaster's lists
# (nexttoken's lists come from its own fitted forecaster: `python -m coldset bench cache` times it)
TIMED = tuple(p for p in POLICIES if policy_for(p).lists is None) + ("forecast",)


def random_trace(path: Path, rows: int, layers: int, experts: int, top_k: int, keep: float, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    tokens_per_request = 128
    per_token = layers * top_k
    n_tokens = -(-rows // per_token)
    n_req = -(-n_tokens // tokens_per_request)
    p = 1.0 / np.arange(1, experts + 1) ** 1.0
    p /= p.sum()
    perm = np.stack([rng.permutation(experts) for _ in range(layers)])
    sel = np.empty((n_tokens, layers, top_k), dtype=np.int16)
    for t in range(n_tokens):
        fresh = perm[np.arange(layers)[:, None], rng.choice(experts, size=(layers, 3 * top_k), p=p)]
        if t % tokens_per_request and keep > 0:
            prev = sel[t - 1]
            kept = rng.random((layers, top_k)) < keep
            cand = np.where(kept, prev, -1)
            fresh = np.concatenate([cand, fresh], axis=1)
        for li in range(layers):  # first top_k distinct candidates (kept ones first)
            row = fresh[li][fresh[li] >= 0]
            _, first = np.unique(row, return_index=True)
            sel[t, li] = row[np.sort(first)][:top_k]
    req = np.repeat(np.arange(n_tokens) // tokens_per_request, per_token)
    pos = np.repeat(np.arange(n_tokens) % tokens_per_request, per_token)
    names = np.array([f"r{i:06d}" for i in range(n_req)])
    table = pa.table({
        "request": names[req][:rows], "domain": np.full(rows, "bench"), "position": pos[:rows].astype(np.int32),
        "phase": np.full(rows, "decode"),
        "layer": np.tile(np.repeat(np.arange(layers, dtype=np.int16), top_k), n_tokens)[:rows],
        "rank": np.tile(np.arange(top_k, dtype=np.int8), n_tokens * layers)[:rows],
        "expert": sel.reshape(-1)[:rows],
        "split": np.where(req % 2 == 0, "profile", "heldout")[:rows],
    })
    meta = TraceMeta("bench", layers, experts, top_k, list(range(layers)), "scripts/cache_bench.py")
    return write_trace(path, meta, table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--keep", type=float, default=0.5)
    ap.add_argument("--residency", type=float, nargs="+", default=[0.5])
    ap.add_argument("--trace", type=Path, help="an existing trace to time instead (replays both splits)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    # warm-up: compile (or load) the numba kernels outside the timings
    tiny = AccessStream(np.array([0, 1, 2, 3]), np.array([0, 2, 4]), 2, 1, 4)
    for p in TIMED:
        simulate(tiny, p, 2, np.ones((1, 4)), predictions=np.array([[1], [2]]) if p == "forecast" else None)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.trace
        if path is None:
            t0 = time.perf_counter()
            path = random_trace(Path(tmp) / "bench.parquet", args.rows, args.layers, args.experts, args.top_k,
                                args.keep, args.seed)
            print(f"wrote {args.rows:,} rows in {time.perf_counter() - t0:.1f} s (not timed below)")
        t0 = time.perf_counter()
        rows, meta = trace_decode_rows(path)
        t_read = time.perf_counter() - t0
        t0 = time.perf_counter()
        stream = stream_from_frame(rows, meta.num_moe_layers, meta.num_experts)
        t_stream = time.perf_counter() - t0
        profile = counts_from_rows(select_rows(rows, "profile"), meta.num_moe_layers, meta.num_experts)
        print(f"rows {len(rows):,}  groups {stream.num_groups:,}  tokens {stream.tokens:,}")
        print(f"read {t_read:.2f} s  stream {t_stream:.2f} s")
        total = t_read + t_stream
        from coldset.analysis.forecast import TransitionForecaster, stream_predictions

        t0 = time.perf_counter()
        forecaster = TransitionForecaster.fit(select_rows(rows, "profile"), meta.num_moe_layers, meta.num_experts,
                                              meta.top_k)
        pred = stream_predictions(forecaster, stream)
        t_fc = time.perf_counter() - t0
        total += t_fc
        print(f"forecaster fit + prefetch lists {t_fc:.2f} s")
        for r in args.residency:
            cap = capacity_for_residency(r, meta.num_moe_layers, meta.num_experts)
            for p in TIMED:
                t0 = time.perf_counter()
                st = simulate(stream, p, cap, profile, predictions=pred if p == "forecast" else None).stats()
                dt = time.perf_counter() - t0
                total += dt
                print(f"residency {r} {p:7s} {dt:6.2f} s  hit rate {st.hit_rate:.4f}")
        print(f"total (read + stream + every policy) {total:.2f} s")


if __name__ == "__main__":
    main()
