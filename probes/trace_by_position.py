# Probe, not a tool: a cache's copies by decode position on the shared real routing trace (issue 28,
# how the x all-HBM ratio depends on the decode's length; the engine's figure: bench cache --steps 256).
"""Do a cache's copies a token fall or grow along a request's decode on real routing?

    PYTHONPATH=src python3 probes/trace_by_position.py [TRACE] [--residencies 0.25,0.5]

Each held-out request of the trace (default: the shared Llama-4-Maverick MMLU trace) is replayed
alone by :func:`coldset.analysis.cache.simulate` from the profile split's warm set (every request starts
warm, as every pass of ``bench cache`` does), for ``static`` (usage_global) and ``lru``; the table
gives the copies (fills) a token averaged over requests, over the first 16, 32 and 128 decode
steps and at a few positions. A few seconds.
"""

from __future__ import annotations

import argparse

import numpy as np

from coldset.analysis.simulate import capacity_for_residency, simulate
from coldset.analysis.streams import counts_from_rows, select_rows, stream_from_frame, trace_decode_rows

DEFAULT_TRACE = "../shared/data/traces/llama4-maverick-mmlu.parquet"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", nargs="?", default=DEFAULT_TRACE)
    p.add_argument("--residencies", default="0.25,0.5")
    args = p.parse_args()
    rows, meta = trace_decode_rows(args.trace)
    L, E = meta.num_moe_layers, meta.num_experts
    counts = counts_from_rows(select_rows(rows, "profile"), L, E)
    held = select_rows(rows, "heldout")
    print("| residency | policy | first 16 | first 32 | first 128 | at 0 | at 8 | at 32 | at 64 | at 127 |")
    print("|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for residency in (float(r) for r in args.residencies.split(",")):
        capacity = capacity_for_residency(residency, L, E)
        for policy in ("static", "lru"):
            total, seen = np.zeros(1024), np.zeros(1024)
            for _, g in held.groupby("request", observed=True):
                fills = simulate(stream_from_frame(g, L, E), policy, capacity, counts).fills.reshape(-1, L).sum(1)
                total[:fills.size] += fills
                seen[:fills.size] += 1
            m = total / np.maximum(seen, 1)
            print(f"| {residency} | {policy} | {m[:16].mean():.2f} | {m[:32].mean():.2f} | {m[:128].mean():.2f} | "
                  + " | ".join(f"{m[s]:.2f}" for s in (0, 8, 32, 64, 127)) + " |")


if __name__ == "__main__":
    main()
