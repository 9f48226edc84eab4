# Probe, not a tool: an early experiment on the Maverick trace; the workflow's trace-only path (config/examples) is the tool.
"""Placement on the real Llama-4-Maverick MMLU routing trace: coverage and predicted step times.

Reads ../shared/data/traces/llama4-maverick-mmlu.parquet (DESIGN.md §2 format, no split column),
builds the (domain, split, phase, layer, expert, count) histogram with pandas, splitting by domain:
two MMLU subjects are the profile, the third is held out. Then runs the placement stage
(``coldset.core.placement.run_placement``) for positional, usage_layer, usage_global and permute at
residencies 0.25, 0.5, 0.75, 1.0 and prints the coverage table and the predicted H200 and GB300
decode step times at residency 0.5.

The model shape is an approximate stand-in for Llama-4-Maverick-17B-128E (bf16): 48 layers,
routed experts on the trace's moe_layers (odd indices), 128 experts, top-1, hidden 5120, expert
intermediate 8192, 40 heads, 8 kv heads, head_dim 128, vocab 202048, untied lm_head, dense MLP
16384 on dense layers and a shared expert of 8192 on every MoE layer. Not modelled: Llama 4's
attention temperature tuning, chunked attention, biases (none), vision tower.

Usage: python probes/maverick_placement.py [--trace PATH] [--heldout astronomy] [--out DIR]
       [--all-rotations]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from coldset.analysis.placement import expert_bytes, nonexpert_bytes, nonexpert_bytes_breakdown, run_placement
from coldset.analysis.profile import count_matrix
from coldset.analysis.speed import predict_step

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "../shared/data/traces/llama4-maverick-mmlu.parquet"


@dataclass(frozen=True)
class MaverickShape:
    """Approximate Llama-4-Maverick shape with the ModelConfig field names placement reads."""

    moe_layers: tuple[int, ...]
    model_type: str = "llama4_text"
    vocab_size: int = 202048
    hidden_size: int = 5120
    num_layers: int = 48
    num_heads: int = 40
    num_kv_heads: int = 8
    head_dim: int = 128
    num_experts: int = 128
    top_k: int = 1
    moe_intermediate_size: int = 8192
    intermediate_size: int = 16384
    shared_expert_intermediate_size: int = 8192
    norm_topk_prob: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    tie_word_embeddings: bool = False
    qk_norm: bool = False


def trace_histogram(trace: Path, heldout: str) -> tuple[pd.DataFrame, dict]:
    """Histogram of the trace with split = heldout for one domain, profile for the others."""
    pf = pq.ParquetFile(trace)
    meta = {k.decode(): v.decode() for k, v in (pf.schema_arrow.metadata or {}).items()}
    df = pf.read(columns=["domain", "phase", "layer", "expert"]).to_pandas()
    for col in ("domain", "phase"):
        df[col] = df[col].astype(str)
    domains = sorted(df["domain"].unique())
    if heldout not in domains:
        sys.exit(f"--heldout {heldout!r} is not a domain of {trace}: {domains}")
    hist = df.groupby(["domain", "phase", "layer", "expert"], observed=True).size()
    hist = hist.rename("count").reset_index()
    hist["split"] = hist["domain"].map(lambda d: "heldout" if d == heldout else "profile")
    return hist[["domain", "split", "phase", "layer", "expert", "count"]], meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--heldout", default="astronomy")
    ap.add_argument("--out", type=Path, default=Path("results/placement/maverick-mmlu"))
    ap.add_argument("--all-rotations", action="store_true", help="also hold out each other subject")
    ap.add_argument(
        "--hash-split", action="store_true",
        help="also: profile on all subjects with coldset.analysis.stats' request-hash split (25%% held out)",
    )
    args = ap.parse_args()

    heldouts = [args.heldout]
    if args.all_rotations:
        heldouts += [d for d in ("abstract_algebra", "anatomy", "astronomy") if d != args.heldout]
    for heldout in heldouts:
        hist, meta = trace_histogram(args.trace, heldout)
        config = MaverickShape(moe_layers=tuple(json.loads(meta["moe_layers"])))
        assert int(meta["num_experts"]) == config.num_experts and int(meta["top_k"]) == config.top_k
        profile = sorted(d for d in hist["domain"].unique() if d != heldout)
        out = args.out / f"heldout-{heldout}"
        out.mkdir(parents=True, exist_ok=True)
        hist_csv = out / "histogram.csv"
        hist.to_csv(hist_csv, index=False)
        placements = run_placement(
            hist_csv, config, out,
            policies=("positional", "usage_layer", "usage_global", "permute"),
            residencies=(0.25, 0.5, 0.75, 1.0),
            profile_domains=profile,
            batch_sizes=(1, 8, 32),
            model=meta.get("model"),
            progress=False,
        )
        heldout_counts = count_matrix(
            pd.read_csv(hist_csv), config.moe_layers, config.num_experts,
            split="heldout", phase="decode",
        )
        report(placements, config, profile, heldout, heldout_counts)
    if args.hash_split:
        in_domain(args)


def in_domain(args) -> None:
    """Profile and held-out split inside every subject (coldset.analysis.stats' request-hash split)."""
    from coldset.analysis.stats import histogram_from_trace

    meta = {k.decode(): v.decode() for k, v in pq.read_schema(args.trace).metadata.items()}
    config = MaverickShape(moe_layers=tuple(json.loads(meta["moe_layers"])))
    out = args.out / "hash-split"
    out.mkdir(parents=True, exist_ok=True)
    hist_csv = out / "histogram.csv"
    histogram_from_trace(args.trace, progress=False).to_csv(hist_csv, index=False)
    placements = run_placement(
        hist_csv, config, out, policies=("positional", "usage_layer", "usage_global"),
        residencies=(0.25, 0.5, 0.75, 1.0), profile_domains=None, batch_sizes=(1,),
        model=meta.get("model"), progress=False,
    )
    print("\n## Profile: all subjects, request-hash split (25% of requests held out)\n")
    domains = sorted(placements[0].coverage_heldout_by_domain)
    print("| policy | residency | coverage profile | coverage held-out | "
          + " | ".join(f"held-out {d}" for d in domains) + " |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in domains) + " |")
    for p in placements:
        print(
            f"| {p.policy} | {p.residency:.2f} | {p.coverage_profile:.4f} | "
            f"{p.coverage_heldout:.4f} | "
            + " | ".join(f"{p.coverage_heldout_by_domain[d]:.4f}" for d in domains) + " |"
        )


def report(placements, config, profile, heldout, heldout_counts) -> None:
    """Markdown tables: coverage per policy and residency; predicted step times at 0.5."""
    per = expert_bytes(config)
    print(f"\n## Profile {' + '.join(profile)} (decode), held out {heldout}\n")
    print(
        f"Expert {per / 2**20:.1f} MiB (bf16); all routed experts "
        f"{per * len(config.moe_layers) * config.num_experts / 2**30:.1f} GiB; non-expert "
        f"{nonexpert_bytes(config) / 2**30:.2f} GiB (approximate: "
        + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in nonexpert_bytes_breakdown(config).items())
        + ")\n"
    )
    print("| policy | residency | achieved | HBM experts GiB | host experts GiB "
          "| coverage profile | coverage held-out |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for p in placements:
        print(
            f"| {p.policy} | {p.residency:.2f} | {p.achieved_residency:.3f} | "
            f"{p.hbm_expert_gib:.1f} | {p.host_expert_gib:.1f} | {p.coverage_profile:.4f} | "
            f"{p.coverage_heldout:.4f} |"
        )
    print(
        "\nResidency 0.5, predicted decode step (ms): lower = max(HBM, link), sum = no overlap; "
        "tok/s = B / lower. Expert use from the profile histogram (as placement records it) and, "
        "in the last two columns, from the held-out histogram.\n"
    )
    print("| policy | preset | B | HBM GB/step | link GB/step | step lower ms | step sum ms "
          "| tok/s (lower) | held-out: step lower ms | held-out: step sum ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in placements:
        if p.residency != 0.5:
            continue
        for s in p.predictions:
            h = predict_step(p, heldout_counts, config, s.preset, s.batch_size)
            print(
                f"| {p.policy} | {s.preset} | {s.batch_size} | {s.hbm_bytes / 1e9:.2f} | "
                f"{s.link_bytes / 1e9:.2f} | {s.step_s_lower * 1e3:.2f} | "
                f"{s.step_s_sum * 1e3:.2f} | {s.tok_s_lower:.1f} | {h.step_s_lower * 1e3:.2f} | "
                f"{h.step_s_sum * 1e3:.2f} |"
            )


if __name__ == "__main__":
    main()
