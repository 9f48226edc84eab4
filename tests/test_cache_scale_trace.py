"""A decode routing trace of any size with next-token locality, written table by table (the scale
tests' input, and the generator of the 1M-token measurement).

Each request: one prefill token (position 0) then ``decode`` tokens; each (token, MoE layer) the
top-k of a layer's popularity (Zipf) plus a bonus for the previous token's experts plus Gumbel
noise, so consecutive tokens reuse experts as real routing does. No split column: the readers
split by a hash of the request id.

Usage: python tests/test_cache_scale_trace.py OUT.parquet --tokens 1000000 [--layers 48 --experts 128 --top-k 8]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pyarrow as pa

from coldset.core.trace import TraceMeta, write_trace

DOMAINS = ("alpha", "beta", "gamma")


def request_lengths(tokens: int, mean: int, seed: int) -> np.ndarray:
    """Decode lengths (mean ``mean``, spread +-40%) summing to ``tokens``."""
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < tokens:
        n = min(int(rng.integers(int(mean * 0.6), int(mean * 1.4) + 1)), tokens - total)
        out.append(n)
        total += n
    return np.asarray(out, dtype=np.int64)


def routing_tables(lengths: np.ndarray, first_request: int, layers: int, experts: int, top_k: int,
                   rng: np.random.Generator, bonus: float = 2.5):
    """Trace rows (one pyarrow table) of the requests ``first_request + i`` with decode ``lengths[i]``."""
    R = lengths.size
    logpop = -1.1 * np.log1p(rng.permuted(np.tile(np.arange(experts, dtype=np.float64), (layers, 1)), axis=1))
    steps = int(lengths.max()) + 1  # the prefill token, then the decode tokens
    sel = np.empty((steps, R, layers, top_k), dtype=np.int16)
    prev = np.zeros((R, layers, experts))
    for s in range(steps):
        score = logpop[None] + bonus * prev + rng.gumbel(size=(R, layers, experts))
        top = np.argpartition(-score, top_k - 1, axis=2)[..., :top_k]
        sel[s] = top
        prev[:] = 0
        np.put_along_axis(prev, top, 1.0, axis=2)
    keep = np.arange(steps)[:, None] <= lengths[None, :]  # [steps, R]
    s_idx, r_idx = np.nonzero(keep.T)[1], np.nonzero(keep.T)[0]  # request then position order
    block = sel[s_idx, r_idx]  # [n_tok, L, k]
    n_tok = block.shape[0]
    per_tok = layers * top_k
    req = np.repeat(r_idx + first_request, per_tok).astype(np.int32)
    names = [f"req{first_request + i:07d}" for i in range(R)]
    return pa.table({
        "request": pa.DictionaryArray.from_arrays(pa.array(np.repeat(r_idx, per_tok).astype(np.int32)), names),
        "domain": pa.DictionaryArray.from_arrays(pa.array((req % len(DOMAINS)).astype(np.int32)), list(DOMAINS)),
        "position": np.repeat(s_idx, per_tok).astype(np.int32),
        "phase": pa.DictionaryArray.from_arrays(pa.array(np.repeat((s_idx > 0).astype(np.int32), per_tok)),
                                                ["prefill", "decode"]),
        "layer": np.tile(np.repeat(np.arange(layers, dtype=np.int16), top_k), n_tok),
        "rank": np.tile(np.arange(top_k, dtype=np.int8), n_tok * layers),
        "expert": block.reshape(-1),
    })


def write_scale_trace(path, tokens: int, layers: int = 48, experts: int = 128, top_k: int = 8,
                      mean_length: int = 1000, seed: int = 0, requests_per_table: int = 50):
    """Write the trace; returns its path."""
    lengths = request_lengths(tokens, mean_length, seed)
    meta = TraceMeta(f"scale-{layers}x{experts}-top{top_k}", num_layers=layers, num_experts=experts,
                     top_k=top_k, moe_layers=list(range(layers)), source="tests/cache_scale_trace.py")
    rng = np.random.default_rng(seed + 1)
    tables = (routing_tables(lengths[i:i + requests_per_table], i, layers, experts, top_k, rng)
              for i in range(0, lengths.size, requests_per_table))
    return write_trace(path, meta, tables)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--mean-length", type=int, default=1000)
    args = ap.parse_args()
    t0 = time.perf_counter()
    write_scale_trace(args.out, args.tokens, args.layers, args.experts, args.top_k, args.mean_length)
    print(f"{args.out}: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
