"""The prefetch gate on a trace's routing: ``lookahead`` against ``lru`` by simulated time.

A trace carries no router inputs, so ``lookahead``'s own lists (the router of layer ``l + 1`` on
layer ``l``'s input) cannot be made from it: the lists here are the trace's own routing, the
experts each lane selects at layer ``l + 1`` of the same step, each entry kept w.p. ``--right``
(else a random expert of that layer; ``1.0``: the oracle). The replay and the time model are the
cache command's (``python -m coldset.analysis.cache``: warm from the profile split's counts,
replay the held-out split in ``--batch`` lanes, the default time model at the H200 steps), the
gate's unit the time model's (``TimeModel.lead_unit``).

``run`` writes one JSON row per (expert bytes, right, batch, residency): lru's and lookahead's
simulated step, prefetches per token and their precision; ``compare OLD NEW`` prints the table
``lookahead / lru`` of two runs, e.g. one on a checkout of the gate's previous rule::

    git archive <commit> | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/src python scripts/gate_on_traces.py run TRACE --out old.json
    python scripts/gate_on_traces.py run TRACE --out new.json
    python scripts/gate_on_traces.py compare old.json new.json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from coldset.analysis.simulate import capacity_for_residency, simulate
from coldset.analysis.streams import read_decode_tokens
from coldset.analysis.time_model import DEFAULT_TIME, TimeModel, simulate_time

STEP_MS = {s["batch"]: s["all_hbm_step_ms"] for s in DEFAULT_TIME["steps"]}


def next_layer_lists(stream, right: float, rng: np.random.Generator) -> np.ndarray:
    """int64 ``[G, W]`` depth-1 lists (-1 padded): after group g, group g + 1's instances where it
    is the next MoE layer of the same step (none after a step's last layer), each kept w.p.
    ``right``, else a random expert of that layer; each instance named once."""
    E, ptr, ids = stream.num_experts, stream.group_ptr, stream.instances
    G = ptr.size - 1
    width = int(np.max(np.diff(ptr)))
    out = np.full((G, width), -1, dtype=np.int64)
    for g in range(G - 1):
        layer, nxt = ids[ptr[g]] // E, ids[ptr[g + 1]] // E
        if nxt != layer + 1:
            continue
        row = ids[ptr[g + 1]:ptr[g + 2]]
        swap = rng.random(row.size) >= right
        row = np.where(swap, nxt * E + rng.integers(0, E, size=row.size), row)
        row = row[np.sort(np.unique(row, return_index=True)[1])]
        out[g, :row.size] = row
    return out


def run(args: argparse.Namespace) -> None:
    rows, meta = read_decode_tokens(args.trace, args.heldout_fraction)
    profile, replay = rows.select("profile"), rows.select("heldout")
    counts = profile.counts()
    L, E = meta.num_moe_layers, meta.num_experts
    out = []
    for batch in args.batch:
        stream = replay.lanes(batch).stream()
        for nbytes in args.bytes_per_expert:
            model = TimeModel(STEP_MS[batch], nbytes, DEFAULT_TIME["link_gb_s"], DEFAULT_TIME["head_share"],
                              DEFAULT_TIME["router_share"], DEFAULT_TIME["link"], DEFAULT_TIME["join"],
                              DEFAULT_TIME["demand_share"])
            lead = model.lead_unit(L)
            for right in args.right:
                lists = next_layer_lists(stream, right, np.random.default_rng(0))
                for residency in args.residency:
                    cap = capacity_for_residency(residency, L, E)
                    lru = simulate(stream, "lru", cap, counts)
                    ahead = simulate(stream, "lookahead", cap, counts, predictions=lists, lead_unit=lead)
                    pf = int(ahead.prefetches.sum())
                    out.append({"bytes": nbytes, "right": right, "batch": batch, "residency": residency,
                                "lead_unit": lead, "lru_ms": simulate_time(stream, lru, model).step_ms,
                                "lookahead_ms": simulate_time(stream, ahead, model).step_ms,
                                "prefetches_per_token": pf / stream.tokens,
                                "precision": ahead.useful_prefetches / pf if pf else None})
                    print(json.dumps(out[-1]), file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump({"trace": str(args.trace), "rows": out}, f, indent=1)


def compare(args: argparse.Namespace) -> None:
    old, new = (json.load(open(p))["rows"] for p in (args.old, args.new))
    key = ("bytes", "right", "batch", "residency")
    by = {tuple(r[k] for k in key): r for r in old}
    print("| expert MB | lists right | batch | residency | lead unit | old: lookahead / lru | new: lookahead / lru "
          "| new prefetches / token (precision) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in new:
        o = by[tuple(r[k] for k in key)]
        prec = "-" if r["precision"] is None else f"{r['precision']:.2f}"
        print(f"| {r['bytes'] / 2**20:.0f} | {r['right']:g} | {r['batch']} | {r['residency']:g} | {r['lead_unit']} "
              f"| {o['lookahead_ms'] / o['lru_ms']:.3f} | {r['lookahead_ms'] / r['lru_ms']:.3f} "
              f"| {r['prefetches_per_token']:.2f} ({prec}) |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("trace")
    r.add_argument("--out", required=True)
    r.add_argument("--heldout-fraction", type=float, default=0.25)
    r.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    r.add_argument("--residency", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    r.add_argument("--right", type=float, nargs="+", default=[1.0, 0.9, 0.7])
    r.add_argument("--bytes-per-expert", type=int, nargs="+", default=[251658240, 15728640])
    c = sub.add_parser("compare")
    c.add_argument("old")
    c.add_argument("new")
    args = ap.parse_args(argv)
    run(args) if args.cmd == "run" else compare(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
