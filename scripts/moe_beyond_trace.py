"""Convert MoE-Beyond's DeepSeek-V2-Lite-Chat expert-activation CSVs into a coldset trace.

github.com/ngavhane/moe-beyond (commit 4dca2eacb7bc0a3086770a4de7a57cc0b81479bd) logs, for each of
1000 prompts, the routed experts every prompt token chose at each MoE layer of DeepSeek-V2-Lite-Chat
(27 layers, layer 0 dense, 64 routed experts, top-6), one forward pass a prompt:
``expert_activation_scripts/training_data_eamc/prompt_<n>_data.csv`` with the header
``Layer ID,Batch Number,Token,Activated Expert IDs`` and rows layer by layer in token order. The
repository carries no licence file, so its data stays out of this one: clone it and point this
script at that folder. It is routing of a model the cache policies were never tuned on.

There are no decode steps. ``--as-streams`` labels every prompt token decode (each prompt replayed
token by token, as if generated; the trace's ``source`` says so), which is what the cache command
replays; without it the trace is prefill only, which the cache command refuses with the reason.

    python scripts/moe_beyond_trace.py CLONE/expert_activation_scripts/training_data_eamc OUT.parquet --as-streams
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

import numpy as np

from coldset.core.trace import RequestRows, TraceMeta, TraceWriter

HEADER = ["Layer ID", "Batch Number", "Token", "Activated Expert IDs"]
MODEL, NUM_LAYERS, MOE_LAYERS, NUM_EXPERTS, TOP_K = "deepseek-ai/DeepSeek-V2-Lite-Chat", 27, list(range(1, 27)), 64, 6
FILE = re.compile(r"prompt_(\d+)_data\.csv")


class ConvertError(ValueError):
    """A source file that is not what this converter reads (its message names the file and row)."""


def read_prompt(path: Path) -> np.ndarray:
    """One prompt's selections as int ``[tokens, MoE layers, top_k]``, refused (naming the file and
    row) where a row is malformed or the layers disagree on the prompt's token count."""
    per_layer: dict[int, list[list[int]]] = {}
    with path.open(newline="", encoding="utf-8") as fh:
        rows = csv.reader(fh)
        if next(rows, None) != HEADER:
            raise ConvertError(f"{path}: header is not {','.join(HEADER)}")
        for n, row in enumerate(rows, start=2):
            try:
                layer, batch, ids = int(row[0]), int(row[1]), json.loads(row[3])
            except (IndexError, ValueError) as exc:
                raise ConvertError(f"{path}: row {n}: {exc}") from None
            if batch != 0 or len(ids) != TOP_K or not all(0 <= e < NUM_EXPERTS for e in ids):
                raise ConvertError(f"{path}: row {n}: batch {batch}, experts {ids}: want batch 0 and {TOP_K} "
                                   f"expert ids in [0, {NUM_EXPERTS})")
            per_layer.setdefault(layer, []).append(ids)
    if sorted(per_layer) != MOE_LAYERS:
        raise ConvertError(f"{path}: layers {sorted(per_layer)}, want the MoE layers {MOE_LAYERS[0]}..{MOE_LAYERS[-1]}")
    counts = {layer: len(ids) for layer, ids in per_layer.items()}
    if len(set(counts.values())) != 1:
        raise ConvertError(f"{path}: token counts differ between layers: {counts}")
    return np.asarray([per_layer[layer] for layer in MOE_LAYERS], dtype=np.int64).transpose(1, 0, 2)


def convert(src: Path, out: Path, as_streams: bool) -> tuple[int, int]:
    """Write the trace of every ``prompt_<n>_data.csv`` under ``src`` (by n); ``(requests, tokens)``."""
    files = sorted((int(m.group(1)), p) for p in src.iterdir() if (m := FILE.fullmatch(p.name)))
    if not files:
        raise ConvertError(f"{src}: no prompt_<n>_data.csv files")
    source = (f"github.com/ngavhane/moe-beyond expert_activation_scripts/training_data_eamc "
              "(DeepSeek-V2-Lite-Chat, prompt forward passes)")
    if as_streams:
        source += "; prompt tokens relabelled decode: each prompt replayed as a stream"
    meta = TraceMeta(MODEL, NUM_LAYERS, NUM_EXPERTS, TOP_K, MOE_LAYERS, source)
    tokens = 0
    with TraceWriter(out, meta, with_weight=False, with_split=False) as writer:
        for i, (n, path) in enumerate(files):
            experts = read_prompt(path)
            tokens += len(experts)
            writer.add(RequestRows(f"prompt-{n}", "puffin", experts, 0 if as_streams else len(experts)))
            if (i + 1) % 100 == 0:
                print(f"{i + 1}/{len(files)} prompts", file=sys.stderr)
    return len(files), tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="the clone's expert_activation_scripts/training_data_eamc folder")
    ap.add_argument("out", type=Path, help="the trace to write (.parquet)")
    ap.add_argument("--as-streams", action="store_true",
                    help="label every prompt token decode (each prompt replayed as a stream)")
    args = ap.parse_args(argv)
    try:
        requests, tokens = convert(args.src, args.out, args.as_streams)
    except (ConvertError, OSError) as exc:
        print(f"moe_beyond_trace: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: {requests} requests, {tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
