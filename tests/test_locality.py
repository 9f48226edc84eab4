"""The locality statistic (issue 17 item 1) against brute force and traces of known overlap."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from coldset.trace import TraceMeta, write_trace
from coldset.stats import (
    consecutive_overlap,
    decode_tokens,
    locality_stats,
    reuse_distances,
    reuse_histogram,
    run_stats,
    shuffled_overlap,
)


def _rows(seqs: dict[str, list[list[list[int]]]], start: int = 5) -> pd.DataFrame:
    """seqs: request -> tokens -> layers -> experts (rank order); positions from ``start``."""
    out = []
    for req, toks in seqs.items():
        for t, layers in enumerate(toks):
            for li, experts in enumerate(layers):
                for r, e in enumerate(experts):
                    out.append((req, start + t, li, r, e))
    return pd.DataFrame(out, columns=["request", "position", "layer_index", "rank", "expert"])


def _random_seqs(rng, n_req=5, n_layers=3, n_experts=7, k=2, stay=0.6):
    seqs = {}
    for i in range(n_req):
        toks, prev = [], None
        for _ in range(int(rng.integers(1, 12))):
            layers = []
            for li in range(n_layers):
                if prev is not None and rng.random() < stay:
                    keep = [e for e in prev[li] if rng.random() < 0.7]
                else:
                    keep = []
                rest = [e for e in rng.permutation(n_experts).tolist() if e not in keep]
                layers.append((keep + rest)[:k])
            toks.append(layers)
            prev = layers
        seqs[f"r{rng.integers(0, 10**6)}-{i}"] = toks
    return seqs


def test_consecutive_overlap_and_reuse_match_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(10):
        k, L = int(rng.integers(1, 4)), 3
        seqs = _random_seqs(rng, k=k, n_layers=L)
        sel, req, pos = decode_tokens(_rows(seqs), L, k)
        # brute force: per layer, mean over consecutive pairs of |A & B| / k
        per_layer = []
        for li in range(L):
            vals = [len(set(toks[t][li]) & set(toks[t - 1][li])) / k
                    for toks in seqs.values() for t in range(1, len(toks))]
            per_layer.append(np.mean(vals) if vals else np.nan)
        np.testing.assert_allclose(consecutive_overlap(sel, req, pos), per_layer)
        # reuse distances in (token, layer, rank) order of the sorted requests
        ref = []
        for name in sorted(seqs):
            last = {}
            for t, layers in enumerate(seqs[name]):
                for li, experts in enumerate(layers):
                    for e in experts:
                        ref.append(t - last[(li, e)] if (li, e) in last else 0)
                        last[(li, e)] = t
        np.testing.assert_array_equal(reuse_distances(sel, req, pos), ref)


def test_known_overlap_and_shuffled_baseline():
    # every consecutive pair shares exactly 2 of 4 experts; the request's set rotates through 8
    # experts, so shuffled neighbours overlap less; position gaps break pairs
    k, n = 4, 40
    toks = [[[(2 * t + r) % 16 for r in range(k)]] for t in range(n)]
    seqs = {"a": toks, "b": toks[:10]}
    rows = _rows(seqs)
    sel, req, pos = decode_tokens(rows, 1, k)
    assert consecutive_overlap(sel, req, pos)[0] == pytest.approx(0.5)
    s0 = shuffled_overlap(sel, req, seed=0)
    assert s0 == pytest.approx(shuffled_overlap(sel, req, seed=0))  # deterministic from the seed
    assert s0[0] < 0.3 and s0 != pytest.approx(shuffled_overlap(sel, req, seed=1))
    gap = rows[~((rows.request == "a") & (rows.position == 5 + 20))]  # drop a token: 2 pairs fewer
    sel2, req2, pos2 = decode_tokens(gap, 1, k)
    assert consecutive_overlap(sel2, req2, pos2)[0] == pytest.approx(0.5)
    # a request that repeats one expert set: overlap 1 and shuffled 1 (lift 1: all of it is mix)
    same = {"c": [[[1, 2, 3, 4]]] * 6}
    sel3, req3, pos3 = decode_tokens(_rows(same), 1, k)
    assert consecutive_overlap(sel3, req3, pos3)[0] == 1.0 and shuffled_overlap(sel3, req3)[0] == 1.0


def test_reuse_histogram_buckets():
    h = reuse_histogram(np.array([0, 1, 1, 2, 3, 4, 5, 64, 65, 0]))
    assert h["first"] == 0.2 and h["1"] == 0.2 and h["2"] == 0.1 and h["3-4"] == 0.2
    assert h["5-8"] == 0.1 and h["33-64"] == 0.1 and h[">64"] == 0.1
    assert sum(h.values()) == pytest.approx(1.0)


def test_run_stats_writes_locality(tmp_path):
    rng = np.random.default_rng(4)
    seqs = _random_seqs(rng, n_req=6, n_layers=2, n_experts=6, k=2, stay=0.9)
    rows = _rows(seqs)
    meta = TraceMeta("toy", num_layers=2, num_experts=6, top_k=2, moe_layers=[0, 1], source="test")
    table = pd.DataFrame({"request": rows.request, "domain": "d", "position": rows.position.astype("int32"),
                          "phase": "decode", "layer": rows.layer_index.astype("int16"),
                          "rank": rows["rank"].astype("int8"), "expert": rows.expert.astype("int16")})
    path = write_trace(tmp_path / "t.parquet", meta, pa.Table.from_pandas(table, preserve_index=False))
    paths = run_stats(path, tmp_path / "out", figures=False, progress=False, locality_seed=3)
    doc = json.loads(paths["locality"].read_text())
    ref = locality_stats(rows, meta, seed=3)
    assert doc["lift"] == pytest.approx(ref["lift"]) and doc["seed"] == 3
    assert doc["consecutive_overlap"]["per_layer"].keys() == {"0", "1"}
    assert doc["lift"] > 1.2  # stay=0.9: strong continuity


def test_the_lift_of_a_request_prefix_is_lower_and_the_prefix_is_each_requests_first_tokens():
    # scripts/locality_calibrate.py's like-for-like lift (issue 17, fourth session): each request's
    # first n decode tokens (counted from its own first position), against brute force; and the
    # length effect the window corrects: the same routing (the 4 experts slide by one of 256 every
    # token) has a far lower lift over a short prefix, since a short request's shuffled
    # neighbours lie few tokens apart, where the sets still overlap
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "locality_calibrate.py"
    spec = importlib.util.spec_from_file_location("locality_calibrate", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    toks = [[[t + r for r in range(4)]] for t in range(128)]
    rows = pd.concat([_rows({"a": toks}, start=3), _rows({"b": toks[:20]}, start=50)], ignore_index=True)
    for n in (1, 16, 31, 200):
        got = script.first_decode_tokens(rows, n)
        want = rows[((rows.request == "a") & (rows.position < 3 + n)) | ((rows.request == "b") & (rows.position < 50 + n))]
        assert got.equals(want)
    meta = TraceMeta(model="m", num_layers=1, num_experts=256, top_k=4, moe_layers=[0])
    short = locality_stats(script.first_decode_tokens(rows, 16), meta)["lift"]
    assert locality_stats(rows, meta)["lift"] > 2 * short > 4
