"""A cache's copies a token by decode position, on a routing trace: do they fall or grow along a
request's decode?

    python scripts/trace_by_position.py [TRACE] [--residencies 0.25,0.5] [--policies static,lru]
        [--windows 16,32,128] [--positions 0,8,32,64,127]

Why: a cache warmed from the profile split copies most at a request's first tokens and less as the
request's own experts become resident, so its ratio to the all-HBM step depends on the decode's
length (``python -m coldset bench cache --steps N`` measures it on the engine; BENCHMARKS.md names
this script beside its decode-length table). Each held-out request of the trace (default: the
shared Llama-4-Maverick MMLU trace) is replayed alone by :func:`coldset.analysis.simulate.simulate`
from the profile split's warm set (every request starts warm, as every pass of ``bench cache``
does). The table gives, per residency and policy, the copies (fills: link transfers) a token
averaged over the requests that reach each decode step, over the first N steps of each window
and at a few steps ("-": no request reaches it). A few seconds on the shared trace.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from coldset.analysis.simulate import capacity_for_residency, simulate
from coldset.analysis.streams import counts_from_rows, select_rows, stream_from_frame, trace_decode_rows

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "../shared/data/traces/llama4-maverick-mmlu.parquet"


def copies_by_position(rows, meta, residency: float, policy: str) -> tuple[np.ndarray, np.ndarray]:
    """Per decode step s of a request (0 = its first decode token): the copies a token at step s
    averaged over the held-out requests that reach s, and how many requests reach s (``rows``,
    ``meta``: :func:`coldset.analysis.streams.trace_decode_rows`)."""
    num_layers, num_experts = meta.num_moe_layers, meta.num_experts
    counts = counts_from_rows(select_rows(rows, "profile"), num_layers, num_experts)
    capacity = capacity_for_residency(residency, num_layers, num_experts)
    per_request = []
    for _, group in select_rows(rows, "heldout").groupby("request", observed=True):
        result = simulate(stream_from_frame(group, num_layers, num_experts), policy, capacity, counts)
        per_request.append(result.fills.reshape(-1, num_layers).sum(axis=1))
    steps = max((f.size for f in per_request), default=0)
    total, seen = np.zeros(steps), np.zeros(steps, dtype=np.int64)
    for fills in per_request:
        total[:fills.size] += fills
        seen[:fills.size] += 1
    return total / np.maximum(seen, 1), seen


def table_lines(trace: str | Path, residencies: list[float], policies: list[str], windows: list[int],
                positions: list[int]) -> list[str]:
    """The markdown table: one row per (residency, policy)."""
    head = ["residency", "policy", *(f"first {n}" for n in windows), *(f"at {s}" for s in positions)]
    rows, meta = trace_decode_rows(trace)
    lines = ["| " + " | ".join(head) + " |", "|--:|---|" + "--:|" * (len(windows) + len(positions))]
    for residency in residencies:
        for policy in policies:
            mean, seen = copies_by_position(rows, meta, residency, policy)
            cells = [f"{mean[:n][seen[:n] > 0].mean():.2f}" if seen[:n].any() else "-" for n in windows]
            cells += [f"{mean[s]:.2f}" if s < seen.size and seen[s] else "-" for s in positions]
            lines.append(f"| {residency} | {policy} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE), help="a routing trace (docs/design.md §2)")
    p.add_argument("--residencies", default="0.25,0.5")
    p.add_argument("--policies", default="static,lru", help="simulator policies without prefetch lists")
    p.add_argument("--windows", default="16,32,128", help="the first N decode steps averaged, per N")
    p.add_argument("--positions", default="0,8,32,64,127", help="decode steps shown alone")
    args = p.parse_args()
    for line in table_lines(args.trace, [float(r) for r in args.residencies.split(",")], args.policies.split(","),
                            [int(n) for n in args.windows.split(",")], [int(s) for s in args.positions.split(",")]):
        print(line)


if __name__ == "__main__":
    main()
