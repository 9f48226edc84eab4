"""The cache command's compact trace path (coldset.analysis.streams.read_decode_tokens and what is
built from it) against a brute force over the trace's rows, and its memory per selection."""

from __future__ import annotations

import io
import tracemalloc

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from coldset.analysis import streams
from coldset.analysis.cache import main
from coldset.analysis.streams import CacheError, read_decode_tokens
from coldset.core.trace import TraceMeta, split_of, write_trace
from test_cache_scale_trace import write_scale_trace


def brute_force_tokens(path, heldout_fraction=0.25):
    """{(request, position): (domain, heldout, {(layer index, rank): expert})} from every decode row."""
    meta = pq.read_schema(path).metadata
    moe = [int(x) for x in meta[b"moe_layers"].decode().strip("[]").split(",")]
    df = pq.read_table(path).to_pandas()
    out = {}
    for r in df.itertuples():
        if str(r.phase) != "decode":
            continue
        split = str(r.split) if "split" in df.columns else split_of(str(r.request), heldout_fraction)
        dom, held, sel = out.setdefault((str(r.request), int(r.position)), (str(r.domain), split == "heldout", {}))
        sel[moe.index(int(r.layer)), int(r.rank)] = int(r.expert)
    return out


def mixed_trace(path):
    """Rows out of order, a split column, prefill rows (some cached, -1), a request with a gap in its
    positions and a token lacking one layer (three MoE layers of five, top-2, 6 experts)."""
    meta = TraceMeta("mixed", num_layers=5, num_experts=6, top_k=2, moe_layers=[0, 2, 4], source="test")
    rng = np.random.default_rng(2)
    rows = []
    for r, (dom, split, positions) in enumerate([("a", "profile", [3, 4, 5, 6]), ("b", "heldout", [2, 3, 7, 8]),
                                                 ("a", "heldout", [5, 6, 7]), ("c", "profile", [1, 2, 3])]):
        for pos in range(positions[0]):
            for layer in (0, 2, 4):
                rows += [(f"q{r}", dom, pos, "prefill", layer, rank, -1 if pos == 0 else int(rng.integers(6)), split)
                         for rank in range(2)]
        for pos in positions:
            for layer in (0, 2, 4):
                if r == 3 and pos == 2 and layer == 2:
                    continue
                ex = rng.choice(6, 2, replace=False)
                rows += [(f"q{r}", dom, pos, "decode", layer, rank, int(ex[rank]), split) for rank in range(2)]
    frame = pd.DataFrame(rows, columns=["request", "domain", "position", "phase", "layer", "rank", "expert", "split"])
    frame = frame.sample(frac=1.0, random_state=3).reset_index(drop=True)
    return write_trace(path, meta, pa.Table.from_pandas(frame, preserve_index=False))


@pytest.mark.parametrize("kind", ["mixed", "generated"])
def test_decode_tokens_equal_the_rows(tmp_path, kind):
    """Every decode selection lands in its token's row (request then position order, -1 where the
    trace has none); domain and split per token as the rows say; the stream and the profile counts
    are the rows' in replay order."""
    path = tmp_path / "t.parquet"
    if kind == "mixed":
        mixed_trace(path)
    else:
        write_scale_trace(path, 300, layers=3, experts=8, top_k=2, mean_length=25, seed=4)
    tok, meta = read_decode_tokens(path)
    want = brute_force_tokens(path)
    keys = sorted(want)
    L, E, k = meta.num_moe_layers, meta.num_experts, meta.top_k
    assert tok.tokens == len(keys) and tok.experts.dtype == np.int16
    assert [(str(tok.request_names[r]), int(p)) for r, p in zip(tok.request, tok.position)] == keys
    expect = np.full((len(keys), L, k), -1)
    for t, key in enumerate(keys):
        for (layer, rank), e in want[key][2].items():
            expect[t, layer, rank] = e
    np.testing.assert_array_equal(tok.experts, expect)
    assert [str(tok.domain_names[d]) for d in tok.domain] == [want[key][0] for key in keys]
    assert tok.heldout.tolist() == [want[key][1] for key in keys]
    ids = [layer * E + e for key in keys for layer in range(L) for e in expect[keys.index(key), layer] if e >= 0]
    sizes = [int((expect[t, layer] >= 0).sum()) for t in range(len(keys)) for layer in range(L)]
    stream = tok.stream()
    assert stream.instances.tolist() == ids and np.diff(stream.group_ptr).tolist() == [s for s in sizes if s]
    counts = np.zeros((L, E))
    for t in np.flatnonzero(~tok.heldout):
        for layer in range(L):
            for e in expect[t, layer][expect[t, layer] >= 0]:
                counts[layer, e] += 1
    np.testing.assert_array_equal(tok.select("profile").counts(), counts)
    if kind == "mixed":
        assert tok.select("heldout", ["a"]).tokens == 3 and tok.domains == ["a", "b", "c"]
        with pytest.raises(CacheError, match=r"domain\(s\) \['z'\] have no decode rows"):
            tok.select(None, ["z"])
        with pytest.raises(CacheError, match="must hold all 3 MoE layers"):
            tok.token_array()


def test_a_duplicate_selection_and_a_request_in_two_domains_are_refused(tmp_path):
    meta = TraceMeta("dup", num_layers=1, num_experts=4, top_k=1, moe_layers=[0], source="test")
    base = {"request": ["x", "x", "y"], "domain": ["a", "a", "a"], "position": [0, 1, 0], "phase": ["decode"] * 3,
            "layer": [0, 0, 0], "rank": [0, 0, 0], "expert": [1, 2, 3]}
    write_trace(tmp_path / "dup.parquet", meta, pa.table({**base, "position": [0, 0, 0]}))
    with pytest.raises(CacheError, match="request 'x' has two rows for position 0, MoE layer index 0, rank 0"):
        read_decode_tokens(tmp_path / "dup.parquet")
    write_trace(tmp_path / "dom.parquet", meta, pa.table({**base, "domain": ["a", "b", "a"]}))
    with pytest.raises(CacheError, match="request 'x' has decode rows of two domains"):
        read_decode_tokens(tmp_path / "dom.parquet")


def test_the_command_prints_what_the_row_path_computes(tmp_path, capsys):
    """The command's table (compact path) equals the simulation of the rows' stream built by the
    frame functions (trace_decode_rows, select_rows, stream_from_frame / lanes_from_frame,
    counts_from_rows), for every policy at batch 1 and 3."""
    from coldset.analysis.cache import simulation_table
    from coldset.analysis.forecast import NextTokenForecaster, TransitionForecaster

    path = write_scale_trace(tmp_path / "t.parquet", 400, layers=3, experts=8, top_k=2, mean_length=20, seed=5)
    assert main([str(path), "--residency", "0.5", "0.75", "--batch", "1", "3", "--step-ms", "2", "3",
                 "--bytes-per-expert", "1000000"]) == 0
    got = pd.read_csv(io.StringIO(capsys.readouterr().out))
    rows, meta = streams.trace_decode_rows(path)
    profile, replay = streams.select_rows(rows, "profile"), streams.select_rows(rows, "heldout")
    L, E, k = meta.num_moe_layers, meta.num_experts, meta.top_k
    fc = TransitionForecaster.fit(profile, L, E, k)
    nt = NextTokenForecaster.fit_tuned(*streams.token_array(profile, L, E), k, E)
    from coldset.analysis.policies import POLICIES
    from coldset.analysis.time_model import DEFAULT_TIME as D, TimeModel

    for batch, step in ((1, 2.0), (3, 3.0)):
        lanes = streams.lanes_from_frame(replay, L, E, batch)
        if batch == 1:
            ref = streams.stream_from_frame(replay, L, E)
            np.testing.assert_array_equal(lanes.stream().instances, ref.instances)
        want = simulation_table(lanes.stream(), streams.counts_from_rows(profile, L, E), list(POLICIES), (0.5, 0.75),
                                10**6, fc, lanes=lanes, nexttoken=nt, batch=batch,
                                time_model=TimeModel(step, 10**6, D["link_gb_s"], D["head_share"], D["router_share"],
                                                     D["link"], D["join"], D["demand_share"]))
        mine = got[got.batch == batch].reset_index(drop=True)
        assert mine.policy.tolist() == want.policy.tolist()
        for col in ("hit_rate", "misses_per_token", "prefetches_per_token", "tokens", "accesses"):
            np.testing.assert_allclose(mine[col].to_numpy(float), want[col].to_numpy(float), rtol=1e-5, err_msg=col)


def test_reading_holds_a_few_bytes_a_selection(tmp_path, monkeypatch):
    """read_decode_tokens' peak numpy memory (tracemalloc) is the int16 token block (2 bytes a
    selection) plus per-token arrays and one read batch's, not a frame row per selection."""
    path = write_scale_trace(tmp_path / "t.parquet", 3000, layers=16, experts=32, top_k=8, mean_length=300, seed=6)
    monkeypatch.setattr(streams, "READ_BATCH_ROWS", 1 << 12)
    tracemalloc.start()
    tok, _ = read_decode_tokens(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    selections = tok.experts.size
    assert selections == 3000 * 16 * 8
    assert tok.experts.nbytes == 2 * selections
    bound = tok.experts.nbytes + 64 * tok.tokens + 128 * streams.READ_BATCH_ROWS
    assert peak < bound, f"{peak / selections:.2f} bytes a selection"


def test_the_table_is_the_same_in_small_chunks(tmp_path, capsys, monkeypatch):
    """The per-group counts taken a few groups at a time and the time model's link queues starting at
    one slot (grown and wrapped many times) print the same table, every policy and the compressed
    tier included, as with chunks larger than the trace."""
    from coldset.analysis import simulate, time_model

    path = write_scale_trace(tmp_path / "t.parquet", 300, layers=3, experts=8, top_k=2, mean_length=20, seed=7)
    argv = [str(path), "--residency", "0.5", "--batch", "1", "3", "--step-ms", "2", "3", "--bytes-per-expert",
            "30000000", "--compressed-ratio", "0.6", "--decode-gb-s", "20"]
    assert main(argv) == 0
    whole = capsys.readouterr().out
    groups = pd.read_csv(io.StringIO(whole)).accesses.max() // 2
    monkeypatch.setattr(simulate, "SUM_GROUPS", 7)
    monkeypatch.setattr(time_model, "QUEUE_SLOTS", 1)
    assert groups > 20 * 7
    assert main(argv) == 0
    assert capsys.readouterr().out == whole


def test_the_time_model_keeps_no_array_per_selection():
    """simulate_time's peak numpy memory (tracemalloc) on a prefetching replay of 400k selections is a
    few arrays per instance and per copy in flight, far below one byte a selection (the compressed
    tier adds its bool flags of the admitted misses)."""
    from coldset.analysis.simulate import simulate
    from coldset.analysis.streams import AccessStream
    from coldset.analysis.time_model import TimeModel, simulate_time, with_compressed_tier

    rng = np.random.default_rng(0)
    L, E, k, steps = 8, 32, 4, 12500
    experts = np.argsort(rng.random((steps * L, E)), axis=1)[:, :k]  # k distinct a group
    ids = (experts + (np.arange(steps * L) % L * E)[:, None]).reshape(-1)
    stream = AccessStream(ids, np.arange(0, ids.size + 1, k), steps, L, E)
    lists = (ids.reshape(-1, k) + 1) % E + (ids.reshape(-1, k) // E) * E
    res = simulate(stream, "forecast", L * E // 2, np.ones((L, E)), predictions=lists, record_victims=True,
                   prefetch_gate=False)  # (lists that lose: the gate and duel would close them)
    assert res.stats().prefetches > 0
    raw = TimeModel(2.0, 10**7, link_gb_s=50.0)
    for tm, per_selection in ((raw, 0.25), (with_compressed_tier(raw, (0.7, 100.0)), 1.25)):  # + the admitted flags
        simulate_time(stream, res, tm)  # compiled before measuring
        tracemalloc.start()
        simulate_time(stream, res, tm)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < per_selection * ids.size + 64 * L * E + (1 << 16), f"{peak / ids.size:.2f} bytes a selection"
