"""Skew statistics against hand-computed values and brute-force references."""

from __future__ import annotations

import itertools
import json
import math
from functools import lru_cache

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from coldset.core.trace import RequestRows, TraceMeta, TraceWriter, split_of, write_trace
from coldset.analysis.skew import ALL, average_ranks, coverage, gini, hot_sets, oracle_cache_hits, spearman, top_share
from coldset.analysis.stats import coverage_table, histogram_from_trace, run_stats, scan_trace, skew_stats

# ---------------------------------------------------------------------------------------------
# elementary statistics


def test_gini_known_vectors():
    assert gini([1, 1, 1, 1]) == pytest.approx(0.0)
    assert gini([0, 0, 0, 4]) == pytest.approx(0.75)  # (n-1)/n: one expert takes everything
    # [1,2,3,4]: sum_ij |xi-xj| = 2*(1+2+3+1+2+1) = 20; G = 20 / (2 * 16 * 2.5) = 0.25
    assert gini([4, 1, 3, 2]) == pytest.approx(0.25)
    assert math.isnan(gini([0, 0, 0]))


def test_gini_matches_pairwise_definition():
    rng = np.random.default_rng(1)
    for _ in range(20):
        x = rng.integers(0, 50, size=rng.integers(2, 30)).astype(float)
        if x.sum() == 0:
            continue
        n = x.size
        ref = np.abs(x[:, None] - x[None, :]).sum() / (2 * n * n * x.mean())
        assert gini(x) == pytest.approx(ref)


def test_top_share_by_hand():
    c = [1, 10, 3, 5, 1]  # total 20, sorted 10, 5, 3, 1, 1
    assert top_share(c, 10) == pytest.approx(10 / 20)  # ceil(0.5) = 1 expert
    assert top_share(c, 25) == pytest.approx(15 / 20)  # ceil(1.25) = 2 experts
    assert top_share(c, 50) == pytest.approx(18 / 20)  # ceil(2.5) = 3
    assert top_share(c, 73) == pytest.approx(19 / 20)  # ceil(3.65) = 4
    # 25% of 8 experts is exactly 2
    assert top_share([8, 0, 0, 0, 0, 0, 0, 2], 25) == pytest.approx(1.0)


def _brute_ranks(x):
    x = np.asarray(x)
    return np.array([(x < v).sum() + ((x == v).sum() + 1) / 2 for v in x])


def test_spearman_matches_brute_force_ranks():
    rng = np.random.default_rng(2)
    for _ in range(30):
        n = int(rng.integers(3, 40))
        a = rng.integers(0, 6, n)  # many ties
        b = rng.integers(0, 6, n)
        np.testing.assert_allclose(average_ranks(a), _brute_ranks(a))
        ra, rb = _brute_ranks(a), _brute_ranks(b)
        if ra.std() == 0 or rb.std() == 0:
            assert math.isnan(spearman(a, b))
        else:
            assert spearman(a, b) == pytest.approx(np.corrcoef(ra, rb)[0, 1])
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_coverage_and_hot_sets_by_hand():
    prof = np.array([[5, 3, 1, 0], [0, 2, 2, 9]])
    held = np.array([[1, 1, 4, 2], [3, 0, 1, 0]])
    # x=25 -> 1 expert per layer: layer0 {0}, layer1 {3}; held-out hits 1 + 0 of 12
    assert coverage(prof, held, 25) == pytest.approx(1 / 12)
    # x=50 -> 2 per layer: layer0 {0,1}, layer1 {3, 1} (tie 2 vs 2 -> lower id 1): 2 + 0
    assert hot_sets(prof, 50).tolist() == [[True, True, False, False], [False, True, False, True]]
    assert coverage(prof, held, 50) == pytest.approx(2 / 12)
    assert coverage(prof, held, 73) == pytest.approx((6 + 1) / 12)  # 3 per layer: l0 {0,1,2}, l1 {3,1,2}


# ---------------------------------------------------------------------------------------------
# oracle cache


def test_oracle_cache_by_hand():
    # k=1, 2 slots, A B C A B: A miss, B miss, C miss evicts B (next use 4 vs A's 3), A hit, B miss
    hits, sels = oracle_cache_hits(np.array([[[0], [1], [2], [0], [1]]]), slots=2)
    assert (hits.tolist(), sels.tolist()) == ([1], [5])
    # k=2, 3 slots: {0,1} {2,0} {1,3} {0,2}
    # t0: miss 0,1 -> {0,1}; t1: 0 hit; 2 miss, fills the empty slot -> {0,1,2}
    # t2: 1 hit; 3 miss, evict among 0 (next t3), 2 (next t3) -> tie, either is used at t3 -> 1 more miss
    # t3: one of 0/2 hits. Total hits = 3 of 8.
    steps = np.array([[[0, 1], [2, 0], [1, 3], [0, 2]]])
    hits, sels = oracle_cache_hits(steps, slots=3)
    assert (hits.tolist(), sels.tolist()) == ([3], [8])
    # padding (-1) is not a selection; sequences are independent
    both = np.array([[[0], [0], [-1]], [[1], [2], [1]]])
    hits, sels = oracle_cache_hits(both, slots=1)
    assert hits.tolist() == [1, 0] and sels.tolist() == [2, 3]


def _brute_optimum(seq, slots):
    """Most hits any cache policy of ``slots`` experts reaches (exhaustive search)."""

    @lru_cache(maxsize=None)
    def best(t, cache):
        if t == len(seq):
            return 0
        need = frozenset(seq[t])
        gained = len(need & cache)
        others = sorted((cache | need) - need)
        room = slots - len(need)
        return gained + max(best(t + 1, need | frozenset(keep))
                            for r in range(0, min(room, len(others)) + 1)
                            for keep in itertools.combinations(others, r))

    return best(0, frozenset())


@pytest.mark.parametrize("k,slots", [(1, 2), (1, 3), (2, 3), (2, 4), (3, 4)])
def test_oracle_cache_is_optimal_on_small_sequences(k, slots):
    rng = np.random.default_rng(10 * k + slots)
    for _ in range(25):
        T = int(rng.integers(1, 8))
        seq = [tuple(rng.choice(6, size=k, replace=False).tolist()) for _ in range(T)]
        hits, _ = oracle_cache_hits(np.array([seq]), slots)
        assert int(hits[0]) == _brute_optimum(tuple(seq), slots), seq


# ---------------------------------------------------------------------------------------------
# streaming pass over a trace


META = TraceMeta("toy", num_layers=3, num_experts=6, top_k=2, moe_layers=[0, 2], source="test")


def _random_requests(n_req=12, seed=0, split_column=True):
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n_req):
        dom = ["agent", "prose", "code"][i % 3]
        n_tok = int(rng.integers(3, 12))
        # distinct top-2 per token, skewed toward low ids for "agent"
        p = np.array([6, 5, 4, 3, 2, 1.0]) if dom == "agent" else np.ones(6)
        ex = np.stack([np.stack([rng.choice(6, 2, replace=False, p=p / p.sum()) for _ in range(2)])
                       for _ in range(n_tok)])
        reqs.append(RequestRows(f"{dom}-{i:03d}", dom, ex, int(rng.integers(1, n_tok)),
                                rng.random(ex.shape).astype(np.float32),
                                ("heldout" if i % 4 == 0 else "profile") if split_column else None))
    return reqs


def _write(path, reqs, split_column=True, row_group_rows=40):
    with TraceWriter(path, META, with_weight=True, with_split=split_column, row_group_rows=row_group_rows) as w:
        for r in reqs:
            w.add(r)
    return path


def _expected_histogram(reqs, heldout_fraction, split_column=True):
    rows = []
    for r in reqs:
        split = r.split if split_column else split_of(r.request, heldout_fraction)
        for t in range(r.experts.shape[0]):
            for li, layer in enumerate(META.moe_layers):
                for rank in range(2):
                    rows.append((r.domain, split, "prefill" if t < r.num_prompt_tokens else "decode", layer,
                                 int(r.experts[t, li, rank])))
    df = pd.DataFrame(rows, columns=["domain", "split", "phase", "layer", "expert"])
    return df.value_counts().rename("count")


def _reference_oracle(reqs, slots):
    """Per (domain, layer) hits with a plain Python Belady loop (independent of the numpy one)."""
    out = {}
    for r in reqs:
        for li, layer in enumerate(META.moe_layers):
            seq = [set(r.experts[t, li].tolist()) for t in range(r.num_prompt_tokens, r.experts.shape[0])]
            cache: set[int] = set()
            hits = 0
            for t, need in enumerate(seq):
                hits += len(need & cache)
                for e in need - cache:
                    if len(cache) >= slots:
                        def next_use(x):
                            return next((u for u in range(t + 1, len(seq)) if x in seq[u]), len(seq) + 1)
                        victim = max(sorted(cache - need), key=next_use)
                        cache.remove(victim)
                    cache.add(e)
            h, s = out.get((r.domain, layer), (0, 0))
            out[(r.domain, layer)] = (h + hits, s + 2 * len(seq))
    return out


@pytest.mark.parametrize("split_column", [True, False])
def test_histogram_from_trace_counts_every_row(tmp_path, split_column):
    reqs = _random_requests(split_column=split_column)
    path = _write(tmp_path / "t.parquet", reqs, split_column)
    hist = histogram_from_trace(path, heldout_fraction=0.3, progress=False)
    assert list(hist.columns) == ["domain", "split", "phase", "layer", "expert", "count"]
    nz = hist[hist["count"] > 0].set_index(["domain", "split", "phase", "layer", "expert"])["count"]
    exp = _expected_histogram(reqs, 0.3, split_column)
    pd.testing.assert_series_equal(nz.sort_index(), exp.sort_index(), check_names=False, check_dtype=False)
    # zeros are listed: every (domain, split, phase, layer, expert)
    assert len(hist) == 3 * 2 * 2 * 2 * 6


def test_streaming_oracle_matches_reference_across_batches(tmp_path):
    reqs = _random_requests(n_req=15, seed=3)
    path = _write(tmp_path / "t.parquet", reqs, row_group_rows=30)
    ref = _reference_oracle(reqs, slots=6)
    for batch_rows in (7, 50, 100_000):  # requests spanning many batches, and one batch
        scan = scan_trace(path, progress=False, batch_rows=batch_rows)
        got = {(r.domain, r.layer): (r.hits, r.selections) for r in scan.oracle.itertuples()}
        assert got == ref


def test_oracle_falls_back_when_requests_interleave(tmp_path):
    reqs = _random_requests(n_req=9, seed=4)
    path = _write(tmp_path / "t.parquet", reqs)
    table = pa.Table.from_pandas(pd.read_parquet(path).sample(frac=1.0, random_state=0), preserve_index=False)
    shuffled = write_trace(tmp_path / "s.parquet", META, table, row_group_rows=25)
    with pytest.warns(UserWarning, match="reappears"):
        scan = scan_trace(shuffled, progress=False, batch_rows=25)
    got = {(r.domain, r.layer): (r.hits, r.selections) for r in scan.oracle.itertuples()}
    assert got == _reference_oracle(reqs, slots=6)


def test_cached_prefill_rows_are_skipped_and_counted(tmp_path):
    df = pd.DataFrame({
        "request": ["a"] * 6, "domain": ["d"] * 6, "position": [0, 0, 1, 1, 2, 2],
        "phase": ["prefill"] * 4 + ["decode"] * 2, "layer": [0, 2] * 3, "rank": [0] * 6,
        "expert": [-1, -1, 3, 4, 5, 5],
    })
    meta = TraceMeta("toy", 3, 6, 1, [0, 2], "test")
    path = write_trace(tmp_path / "c.parquet", meta, pa.Table.from_pandas(df, preserve_index=False))
    scan = scan_trace(path, progress=False)
    assert scan.cached_prefix_rows_skipped == 2
    assert int(scan.histogram["count"].sum()) == 4


# ---------------------------------------------------------------------------------------------
# skew_stats and the stage


def _hist_frame(counts):
    """counts: {(domain, split, phase): [[layer0 counts], [layer2 counts]]} -> histogram frame."""
    rows = []
    for (d, s, p), mat in counts.items():
        for li, layer in enumerate([0, 2]):
            for e, c in enumerate(mat[li]):
                rows.append((d, s, p, layer, e, c))
    return pd.DataFrame(rows, columns=["domain", "split", "phase", "layer", "expert", "count"])


def test_skew_stats_by_hand():
    meta = TraceMeta("toy", 3, 4, 1, [0, 2], "test")
    h = _hist_frame({
        ("a", "profile", "decode"): [[4, 0, 0, 0], [1, 1, 1, 1]],
        ("a", "heldout", "decode"): [[0, 0, 0, 0], [0, 0, 2, 2]],
        ("b", "profile", "decode"): [[1, 2, 3, 4], [0, 0, 4, 0]],
        ("b", "heldout", "decode"): [[1, 0, 0, 1], [0, 0, 0, 0]],
        ("a", "profile", "prefill"): [[1, 2, 3, 4], [2, 2, 2, 2]],
    })
    s = skew_stats(h, meta, xs=(25, 50))
    a = s["phases"]["decode"]["domains"]["a"]
    # domain a, decode, both splits: layer0 [4,0,0,0] G=.75, layer2 [1,1,3,3] G = 16/(2*16*2) = .25
    assert a["gini"]["per_layer"] == {"0": pytest.approx(0.75), "2": pytest.approx(0.25)}
    assert a["gini"]["mean"] == pytest.approx(0.5)
    # top-25% (1 expert): layer0 4/4, layer2 3/8 -> mean 0.6875; model wide top ceil(.25*8)=2 pairs: 4+3 of 12
    assert a["top_share"]["25"]["mean_over_layers"] == pytest.approx((1 + 3 / 8) / 2)
    assert a["top_share"]["25"]["model_wide"] == pytest.approx(7 / 12)
    # Spearman a vs b in decode: layer0 [4,0,0,0] vs [2,2,3,5]; layer2 [1,1,3,3] vs [0,0,4,0]
    l0 = np.corrcoef(_brute_ranks([4, 0, 0, 0]), _brute_ranks([2, 2, 3, 5]))[0, 1]
    l2 = np.corrcoef(_brute_ranks([1, 1, 3, 3]), _brute_ranks([0, 0, 4, 0]))[0, 1]
    pair = s["phases"]["decode"]["spearman_between_domains"][0]
    assert (pair["a"], pair["b"]) == ("a", "b")
    assert pair["mean"] == pytest.approx((l0 + l2) / 2)
    # prefill has only domain a's layer0 varying against decode -> layer2 prefill constant: undefined
    pvd = s["spearman_prefill_vs_decode"]["a"]
    assert pvd["layers_defined"] == 1
    assert pvd["mean"] == pytest.approx(np.corrcoef(_brute_ranks([1, 2, 3, 4]), _brute_ranks([4, 0, 0, 0]))[0, 1])
    # coverage at 25%: profile a -> hot {0} in layer0, {0} in layer2 (tie -> lowest id)
    # heldout b = [1,0,0,1],[0,0,0,0] -> 1 of 2
    assert s["coverage"]["25"]["a"]["b"] == pytest.approx(0.5)
    # profile b -> {3} and {2}; heldout a = [0,0,0,0],[0,0,2,2] -> 2 of 4
    assert s["coverage"]["25"]["b"]["a"] == pytest.approx(0.5)
    # (all) profile: layer0 [5,2,3,4] -> {0}; layer2 [1,1,5,1] -> {2}; heldout (all) [1,0,0,1],[0,0,2,2]
    assert s["coverage"]["25"][ALL][ALL] == pytest.approx(3 / 6)
    table = coverage_table(h, meta, xs=(25,))
    row = table[(table.profile_domain == "a") & (table.heldout_domain == "b")].iloc[0]
    assert row.coverage == pytest.approx(0.5) and row.cold_share == pytest.approx(0.5)
    json.dumps(s, allow_nan=False)  # NaN is written as null


def test_run_stats_writes_all_outputs(tmp_path):
    reqs = _random_requests(n_req=12, seed=5)
    path = _write(tmp_path / "t.parquet", reqs)
    out = run_stats(path, tmp_path / "stats", progress=False)
    for name in ("histogram", "skew", "coverage", "heatmap_decode", "heatmap_prefill", "lorenz_decode", "lorenz_prefill"):
        assert out[name].is_file(), name
    for name in ("heatmap_decode", "lorenz_decode"):
        assert out[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    skew = json.loads(out["skew"].read_text())
    ref = _reference_oracle(reqs, slots=6)
    hits = sum(v[0] for k, v in ref.items() if k[0] == "agent")
    sels = sum(v[1] for k, v in ref.items() if k[0] == "agent")
    assert skew["phases"]["decode"]["domains"]["agent"]["oracle_cache"]["hit_rate"] == pytest.approx(hits / sels)
    assert skew["trace"]["rows"] == sum(r.experts.size for r in reqs)
    cov = pd.read_csv(out["coverage"])
    assert set(cov.x) == {10, 25, 50, 73}
    hist = pd.read_csv(out["histogram"])
    assert int(hist["count"].sum()) == sum(r.experts.size for r in reqs)
    # the stage's dense path agrees with skew_stats on the written histogram
    scan = scan_trace(path, progress=False)
    again = skew_stats(hist, scan.meta, scan.oracle)
    skew.pop("trace")
    assert json.loads(json.dumps(again)) == skew
    # the agent domain was generated skewed toward low ids, the others uniform
    g = {d: skew["phases"]["decode"]["domains"][d]["gini"]["mean"] for d in ("agent", "prose")}
    assert g["agent"] > g["prose"]


# ---------------------------------------------------------------------------------------------
# checks that survived mutation before (issue 18): each test names its mutant


def test_split_of_honours_heldout_fraction():
    """Mutant: split_of ignores ``heldout_fraction`` (a fixed threshold). Checked against an
    independent sha256 computation per id, and the held-out share over 4,000 ids at several
    fractions (binomial sd <= 0.008, bound 0.03)."""
    import hashlib

    ids = [f"req-{i}" for i in range(4000)]
    for fraction in (0.0, 0.1, 0.3, 0.7, 1.0):
        got = [split_of(r, fraction) for r in ids]
        want = ["heldout" if int.from_bytes(hashlib.sha256(r.encode()).digest()[:8], "big") / 2**64 < fraction
                else "profile" for r in ids[:200]]
        assert got[:200] == want
        assert got.count("heldout") / len(ids) == pytest.approx(fraction, abs=0.03)
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_of("x", 1.5)


def test_held_out_coverage_ranks_on_the_profile_split_only():
    """Mutant: coverage_table ranks experts on both splits pooled (the held-out traffic leaks into
    the hot set) or measures pooled selections. Profile and held-out disagree here, so each
    leakage changes the number: by hand, profile top-1 per layer = expert 0 (layer 0) and 3
    (layer 1), held out 1 of 20 in those."""
    meta = TraceMeta("toy", num_layers=2, num_experts=4, top_k=1, moe_layers=[0, 1], source="test")
    prof = np.array([[5, 0, 0, 0], [0, 0, 0, 4]])
    held = np.array([[0, 9, 0, 1], [0, 0, 9, 1]])  # leaked ranking would pick 1 and 2: 18/20
    rows = [("d", split, "decode", layer, e, int(c[layer, e]))
            for split, c in (("profile", prof), ("heldout", held)) for layer in range(2) for e in range(4)]
    hist = pd.DataFrame(rows, columns=["domain", "split", "phase", "layer", "expert", "count"])
    table = coverage_table(hist, meta, xs=[25])
    row = table[(table.profile_domain == "d") & (table.heldout_domain == "d")].iloc[0]
    assert row.coverage == pytest.approx(1 / 20) == pytest.approx(coverage(prof, held, 25))
    assert row.profile_selections == 9 and row.heldout_selections == 20


def _raw_trace(path, columns: dict, meta=META):
    """A Parquet file with §2 columns and metadata written by pyarrow directly (not validated on
    write), so the reader's validation is what is tested."""
    import pyarrow.parquet as pq

    table = pa.table(columns)
    table = table.replace_schema_metadata(meta.to_metadata())
    pq.write_table(table, path)
    return path


def _good_columns(n=4):
    return {"request": ["r0"] * n, "domain": ["code"] * n, "position": list(range(n)),
            "phase": ["decode"] * n, "layer": pa.array([0, 2, 0, 2][:n], pa.int16()),
            "rank": pa.array([0] * n, pa.int8()), "expert": pa.array([1, 2, 3, 4][:n], pa.int16()),
            "split": ["profile"] * n}


@pytest.mark.parametrize("column,value,message", [
    ("position", pa.array([0, 1, -3, 3], pa.int32()), r"row 2: column 'position' holds position -3"),
    ("split", ["profile", "train", "profile", "heldout"], r"row 1: column 'split' holds 'train'"),
    ("split", pa.array(["profile", "profile", "train", "heldout"]).dictionary_encode(),
     r"row 2: column 'split' holds 'train'"),
    ("request", ["r0", None, "r0", "r0"], r"row 1: column 'request' is null"),
    ("domain", ["code", "code", "code", None], r"row 3: column 'domain' is null"),
])
def test_trace_validator_refuses_each_bad_column(tmp_path, column, value, message):
    """Mutants: the validator without its position >= 0 check, its split-value check (plain and
    dictionary-encoded columns), or its null request / null domain checks: each bad file is then
    read into the statistics. Refused on read (iter_trace_batches, every reader's path) and on
    write (write_trace), naming the row and column."""
    from coldset.core.trace import TraceError, iter_trace_batches

    cols = _good_columns()
    path = _raw_trace(tmp_path / "ok.parquet", cols)
    assert sum(b.num_rows for b in iter_trace_batches(path)) == 4  # the good file reads
    cols[column] = value
    bad = _raw_trace(tmp_path / "bad.parquet", cols)
    with pytest.raises(TraceError, match=message):
        list(iter_trace_batches(bad))
    with pytest.raises(TraceError, match=message):
        histogram_from_trace(bad, progress=False)
    with pytest.raises(TraceError, match=message):
        write_trace(tmp_path / "w.parquet", META, pa.table(cols))
def test_pairwise_tables_are_bounded_to_the_most_selected_domains():
    """Issue 16: pairwise tables grew with the square of the domains (300 domains: a 72 MB
    skew.json). They keep the most selected domains; their values equal the unbounded ones."""
    meta = TraceMeta("toy", 3, 4, 1, [0, 2], "test")
    rng = np.random.default_rng(0)
    counts = {}
    for i in range(9):  # domain d{i} has about (i + 1) * 40 selections per split
        for split in ("profile", "heldout"):
            counts[(f"d{i}", split, "decode")] = rng.multinomial((i + 1) * 40, [0.4, 0.3, 0.2, 0.1], size=2).tolist()
    h = _hist_frame(counts)
    full = skew_stats(h, meta, xs=(25,), max_pairwise_domains=100)
    small = skew_stats(h, meta, xs=(25,), max_pairwise_domains=3)
    assert small["pairwise_domains"] == ["d6", "d7", "d8"] and len(full["pairwise_domains"]) == 9
    assert len(small["phases"]["decode"]["spearman_between_domains"]) == 3
    assert len(full["phases"]["decode"]["spearman_between_domains"]) == 36
    kept = {(p["a"], p["b"]): p["mean"] for p in small["phases"]["decode"]["spearman_between_domains"]}
    assert kept == {(p["a"], p["b"]): p["mean"] for p in full["phases"]["decode"]["spearman_between_domains"]
                    if (p["a"], p["b"]) in kept}
    assert set(small["coverage"]["25"]) == {"d6", "d7", "d8", ALL}
    assert small["coverage"]["25"]["d6"] == {k: full["coverage"]["25"]["d6"][k] for k in ("d6", "d7", "d8", ALL)}
    assert set(small["phases"]["decode"]["domains"]) == {f"d{i}" for i in range(9)} | {ALL}  # per domain: all
    assert len(coverage_table(h, meta, xs=(25,), max_domains=3)) == 4 * 4
