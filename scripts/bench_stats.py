"""Benchmark the ``stats`` stage on a large synthetic trace (a benchmark, not a test).

Generates a skewed random trace of about ``--rows`` rows (default 10 million) in the project's
trace format, then times :func:`coldset.analysis.stats.run_stats` on it in a fresh child process and
reports wall time and the child's peak resident memory. The target is under 30 s on
a 2-core machine, with memory proportional to the histogram, not the trace.

Shape: 16 MoE layers (of 32), 64 experts, top-4 (64 rows per token), 3 domains, requests of
128 prompt + 133 decode tokens. Popularity per (domain, layer) is Zipf(1.1) over a permutation
that domains partly share; each token draws its top-4 without replacement (Gumbel top-k).

    python scripts/bench_stats.py [--rows 10000000] [--dir /tmp/coldset-bench] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def make_trace(path: Path, rows: int, seed: int = 0) -> int:
    from coldset.core.trace import RequestRows, TraceMeta, TraceWriter

    L, E, k = 16, 64, 4
    prompt, decode = 128, 133
    per_req = (prompt + decode) * L * k
    n_req = max(1, -(-rows // per_req))
    meta = TraceMeta("bench-skewed", 32, E, k, list(range(1, 32, 2)), "scripts/bench_stats.py")
    rng = np.random.default_rng(seed)
    domains = ["agent", "prose", "code"]
    zipf = 1.0 / np.arange(1, E + 1) ** 1.1
    base = np.stack([rng.permutation(E) for _ in range(L)])  # shared popularity order per layer
    logp = {}
    for d in domains:
        perm = base.copy()
        for layer in range(L):  # each domain reshuffles a third of the order
            idx = rng.choice(E, E // 3, replace=False)
            perm[layer, idx] = perm[layer, rng.permutation(idx)]
        p = np.empty((L, E))
        for layer in range(L):
            p[layer, perm[layer]] = zipf
        logp[d] = np.log(p / p.sum(axis=1, keepdims=True))
    with TraceWriter(path, meta, with_weight=False, with_split=False) as w:
        for i in range(n_req):
            d = domains[i % 3]
            g = logp[d][None] - np.log(-np.log(rng.random((prompt + decode, L, E))))
            top = np.argpartition(-g, k, axis=-1)[..., :k]
            # order ranks by score, as a router's top-k would
            order = np.argsort(-np.take_along_axis(g, top, -1), axis=-1)
            experts = np.take_along_axis(top, order, -1).astype(np.int16)
            w.add(RequestRows(f"{d}-{i:05d}", d, experts, prompt))
        return w.rows_written


CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from coldset.analysis.stats import run_stats
t1 = time.perf_counter()
paths = run_stats(sys.argv[1], sys.argv[2], progress=False)
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "run_stats_s": t2 - t1,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/coldset-bench-stats"))
    ap.add_argument("--keep", action="store_true", help="keep the generated trace and outputs")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    trace = args.dir / f"trace-{args.rows}.parquet"
    if not trace.exists():
        t = time.perf_counter()
        n = make_trace(trace, args.rows)
        print(f"generated {n:,} rows in {time.perf_counter() - t:.1f} s -> {trace} "
              f"({trace.stat().st_size / 2**20:.0f} MiB)", file=sys.stderr)
    import pyarrow.parquet as pq

    rows = pq.ParquetFile(trace).metadata.num_rows
    wall = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, str(trace), str(args.dir / "stats")],
                         check=True, capture_output=True, text=True)
    wall = time.perf_counter() - wall
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res.update({"rows": rows, "wall_s_including_interpreter": wall,
                "rows_per_s": rows / res["run_stats_s"]})
    print(json.dumps(res, indent=1))
    if not args.keep:
        shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
