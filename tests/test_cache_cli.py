"""The cache command (``python -m coldset.analysis.cache TRACE ...``, :func:`coldset.analysis.cache.main`) on
small traces written here: a trace it cannot replay is refused with the reason (exit 2, no traceback),
the printed recall lines say what they measured."""

from __future__ import annotations

import io
import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from coldset.analysis.cache import main
from coldset.core.trace import TraceMeta, write_trace

COLUMNS = ["request", "domain", "position", "phase", "layer", "rank", "expert", "split"]


def toy_trace(path, *, decode_steps: int = 5, requests: int = 6, seed: int = 0, experts: int = 6):
    """A trace of ``requests`` requests (every third held out, domains "a" / "b" alternating), each a
    prefill of 4 tokens then ``decode_steps`` decode tokens, 2 MoE layers (0 and 2) x top-2."""
    meta = TraceMeta("toy", num_layers=3, num_experts=experts, top_k=2, moe_layers=[0, 2], source="test")
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(requests):
        split = "heldout" if r % 3 == 0 else "profile"
        for pos in range(4 + decode_steps):
            phase = "prefill" if pos < 4 else "decode"
            for layer in (0, 2):
                ex = rng.choice(experts, 2, replace=False)
                rows += [(f"r{r}", "ab"[r % 2], pos, phase, layer, rank, int(ex[rank]), split) for rank in range(2)]
    return write_trace(path, meta, pa.Table.from_pandas(pd.DataFrame(rows, columns=COLUMNS), preserve_index=False))


@pytest.mark.parametrize("extra", [[], ["--policies", "static", "lru"], ["--profile-domains", "a"], ["--recall"],
                                   ["--replay-domains", "b", "--policies", "lfu"]])
def test_a_prefill_only_trace_is_refused_with_the_reason(tmp_path, capsys, extra):
    """No decode rows: exit 2 and one line naming the trace, the missing decode rows and what to do;
    never an empty table with exit 0, nor a traceback."""
    path = toy_trace(tmp_path / "prefill.parquet", decode_steps=0)
    assert main([str(path), *extra]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0]
    assert str(path) in lines[0] and "no decode rows" in lines[0] and "capture decode routing" in lines[0]


def test_an_empty_split_is_refused_and_a_decode_trace_prints_its_table(tmp_path, capsys):
    """A selection without decode rows (every request in the profile split) is refused naming the
    flag that chooses it; a trace with decode rows prints one row per policy and residency."""
    path = toy_trace(tmp_path / "t.parquet")
    assert main([str(path), "--policies", "static", "lru", "--residency", "0.5"]) == 0
    out, _ = capsys.readouterr()
    table = pd.read_csv(io.StringIO(out))
    assert table.policy.tolist() == ["static", "lru"] and (table.tokens == 2 * 5).all()
    assert main([str(path), "--replay-domains", "c"]) == 2
    assert "domain(s) ['c'] have no decode rows" in capsys.readouterr().err
    assert main([str(path), "--replay-domains", "a", "--profile-domains", "a", "--policies", "static"]) == 0
    capsys.readouterr()
    meta = TraceMeta("toy", num_layers=3, num_experts=6, top_k=2, moe_layers=[0, 2], source="test")
    one = pd.read_parquet(path)
    one["split"] = "profile"
    only_profile = write_trace(tmp_path / "p.parquet", meta, pa.Table.from_pandas(one, preserve_index=False))
    assert main([str(only_profile), "--policies", "static"]) == 2
    err = capsys.readouterr().err
    assert "replay selection has no decode rows" in err and "--replay-domains" in err


def recall_lines(err: str) -> tuple[dict, pd.DataFrame]:
    """``--recall``'s stderr: the transition forecaster's JSON line, then the recall table (CSV)."""
    first, rest = err.split("\n", 1)
    return json.loads(first), pd.read_csv(io.StringIO(rest))


def test_recall_says_when_nothing_was_tuned_and_leaves_out_a_memorised_bound(tmp_path, capsys):
    """Two profile requests: no 5th request to tune on, so the table says "not tuned" (never "every
    5th profile request"); contexts (expert sets of 2 of 40) each seen once: the in-sample bound is
    memorisation and is left out (NaN) with the share of repeated contexts beside it."""
    path = toy_trace(tmp_path / "t.parquet", requests=3, decode_steps=6, experts=40)
    assert main([str(path), "--policies", "static", "--recall", "--horizons", "1", "2"]) == 0
    _, table = recall_lines(capsys.readouterr().err)
    assert table.tuned_on.str.startswith("not tuned: 0 of 2 profile request(s)").all()
    assert "ceiling_current_experts" not in table.columns
    assert table.in_sample_bound_current_experts.isna().all()
    assert (table.repeated_context_share < 0.5).all()


def test_recall_prints_the_in_sample_bound_where_contexts_repeat_and_says_what_tuned(tmp_path, capsys):
    """Contexts that repeat (2 of 3 experts: 3 sets): the in-sample bound is printed, equal to
    conditional_ceiling's on the replay; ten profile requests: two of them tuned the forecaster."""
    from coldset.analysis.forecast import conditional_ceiling
    from coldset.analysis.streams import select_rows, token_array, trace_decode_rows

    path = toy_trace(tmp_path / "t.parquet", requests=15, decode_steps=6, experts=3)
    assert main([str(path), "--policies", "static", "--recall", "--horizons", "1"]) == 0
    _, table = recall_lines(capsys.readouterr().err)
    assert table.tuned_on.tolist() == ["every 5th profile request (2 of 10 profile requests)"]
    rows, meta = trace_decode_rows(path)
    th, sh = token_array(select_rows(rows, "heldout"), 2, 3)
    c = conditional_ceiling(th, sh, 1, 5)
    assert c["repeated_share"] == 1.0
    assert table.in_sample_bound_current_experts.iloc[0] == pytest.approx(c["ceiling_recall"], abs=1e-4)
    assert table.repeated_context_share.iloc[0] == 1.0


def conditional_ceiling_by_frame(tokens, sequence, horizon, n, lower_layers=0):
    """The pandas groupby form of conditional_ceiling (the reference of the sort-based one)."""
    T, L, k = tokens.shape
    t = np.arange(max(T - horizon, 0))
    t = t[sequence[t + horizon] == sequence[t]]
    cur = np.sort(tokens[t], axis=2)
    tgt = tokens[t + horizon]
    E = int(tokens.max()) + 1
    key = np.zeros(cur.shape[:2], dtype=object)
    for m in range(lower_layers + 1):
        src = np.full(cur.shape, E, dtype=np.int64)
        src[:, m:] = cur[:, : L - m]
        for j in range(k):
            key = key * (E + 1) + src[:, :, j].astype(object)
    frame = pd.DataFrame({"layer": np.repeat(np.broadcast_to(np.arange(L), key.shape).reshape(-1), k),
                          "ctx": np.repeat(key.reshape(-1), k), "tgt": tgt.reshape(-1)})
    counts = frame.groupby(["layer", "ctx", "tgt"], sort=False).size()
    best = counts.groupby(level=[0, 1], sort=False).apply(lambda c: c.nlargest(n).sum()).sum()
    pop = frame.groupby(["layer", "tgt"], sort=False).size()
    pop_best = pop.groupby(level=0, sort=False).apply(lambda c: c.nlargest(n).sum()).sum()
    per_ctx = frame.groupby(["layer", "ctx"], sort=False).size() // k
    repeated = int(per_ctx[per_ctx > 1].sum())
    return {"ceiling_recall": best / len(frame), "popularity_recall": pop_best / len(frame),
            "contexts": len(per_ctx), "repeated_share": repeated / (t.size * L)}


@pytest.mark.parametrize("seed,experts,k,lower", [(0, 5, 2, 0), (1, 9, 3, 1), (2, 4, 1, 2), (3, 40, 8, 1)])
def test_conditional_ceiling_equals_the_groupby_reference(seed, experts, k, lower):
    from coldset.analysis.forecast import conditional_ceiling

    rng = np.random.default_rng(seed)
    T, L = 300, 4
    tokens = np.stack([np.stack([rng.choice(experts, k, replace=False) for _ in range(L)]) for _ in range(T)])
    seq = np.sort(rng.integers(0, 7, T))
    for h in (1, 3):
        got = conditional_ceiling(tokens, seq, h, min(k + 2, experts), lower_layers=lower)
        want = conditional_ceiling_by_frame(tokens, seq, h, min(k + 2, experts), lower_layers=lower)
        for key, value in want.items():
            assert got[key] == pytest.approx(value), key


def test_forecast_lanes_by_segments_equals_stepping_the_lanes():
    """forecast_lanes (each lane's segments side by side from their own step 0, in chunks) gives the
    forecast of stepping every lane together: starts anywhere, idle steps inside and after segments,
    activity before a lane's first start, lower-layer terms."""
    from coldset.analysis.forecast import LOWER_LAYER_TERMS, LOWER_LAYER_WEIGHTS, NextTokenForecaster

    rng = np.random.default_rng(7)
    S, L, B, E, k = 40, 3, 5, 7, 2
    tokens = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)]) for _ in range(200)])
    f = NextTokenForecaster.fit(tokens, np.repeat(np.arange(10), 20), k, E, terms=LOWER_LAYER_TERMS,
                                weights=LOWER_LAYER_WEIGHTS, hist_beta=0.2, hist_shift=3, self_boost=1.0)
    sel = np.stack([np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(B)]) for _ in range(L)])
                    for _ in range(S)])
    idle = rng.random((S, B)) < 0.2
    sel[np.broadcast_to(idle[:, None, :, None], sel.shape)] = -1
    start = rng.random((S, B)) < 0.15
    start[0, 0] = True
    got = f.forecast_lanes(sel, start)
    np.testing.assert_array_equal(got, f._forecast_steps(sel, start))
    assert (got[np.broadcast_to(idle[:, None, :, None], got.shape)] == -1).all()


def test_quality_of_a_history_grid_equals_one_forecaster_per_point_and_fit_tuned_chooses_the_same():
    """forecast_quality(hist=grid) (one forecast sharing the table lookups) gives each grid point's
    own quality, and fit_tuned picks what trying each point's forecaster in turn picks."""
    from dataclasses import replace

    from coldset.analysis.forecast import HIST_GRID, SCORE_UNIT, NextTokenForecaster, forecast_quality

    rng = np.random.default_rng(5)
    T, L, E, k = 400, 3, 8, 2
    tokens = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)]) for _ in range(T)])
    tokens[1::2, 0] = tokens[::2, 0]  # some stickiness, so the history matters
    seq = np.repeat(np.arange(20), 20)
    base = NextTokenForecaster.fit(tokens, seq, k, E, self_boost=2.0)
    hist = [(int(round(b * SCORE_UNIT)), h) for b, h in HIST_GRID]
    many = forecast_quality(base, tokens, seq, (2,), hist=hist)
    for (unit, shift), q in zip(hist, many):
        assert q == forecast_quality(replace(base, hist_unit=unit, hist_shift=shift), tokens, seq, (2,))
    val = np.arange(20)[seq] % 5 == 4
    best = None
    for boost in (0.0, float(k)):
        fit = NextTokenForecaster.fit(tokens[~val], seq[~val], k, E, self_boost=boost)
        for beta, shift in HIST_GRID:
            f = replace(fit, hist_unit=int(round(beta * SCORE_UNIT)), hist_shift=shift)
            r = forecast_quality(f, tokens[val], seq[val])["recall"]
            if best is None or r > best[0] + 1e-12:
                best = (r, beta, shift, boost)
    got = NextTokenForecaster.fit_tuned(tokens, seq, k, E)
    want = NextTokenForecaster.fit(tokens, seq, k, E, hist_beta=best[1], hist_shift=best[2], self_boost=best[3])
    assert (got.hist_unit, got.hist_shift, got.self_boost) == (want.hist_unit, want.hist_shift, want.self_boost)
    np.testing.assert_array_equal(got.tables, want.tables)


def test_compressed_tier_rows_sit_beside_the_raw_ones(tmp_path, capsys):
    """--compressed-ratio / --decode-gb-s: per (policy, residency) a raw row then a compressed one of
    the same replay (hits, capacity equal); lru admits every miss, so its compressed link bytes are
    the ratio of the raw ones and its bound reads them; static's cold reads stay raw (rows equal in
    time); without the flags no host_tier column, and the raw rows are the same."""
    path = toy_trace(tmp_path / "t.parquet", decode_steps=12, requests=9)
    base = [str(path), "--policies", "static", "lru", "nexttoken", "--residency", "0.5", "--bytes-per-expert",
            "100000000"]
    assert main(base) == 0
    plain = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert "host_tier" not in plain
    assert main([*base, "--compressed-ratio", "0.5", "--decode-gb-s", "40"]) == 0
    both = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert both.host_tier.tolist() == ["raw", "compressed"] * 3
    raw, comp = both[both.host_tier == "raw"].reset_index(drop=True), both[both.host_tier == "compressed"]
    comp = comp.reset_index(drop=True)
    # (the values; a column of zeros reads back as int64 without the compressed rows' floats beside it:
    # overlap, where the prefetch gate, closed at first, stays closed on this random routing)
    pd.testing.assert_frame_equal(raw.drop(columns="host_tier"), plain, check_dtype=False)
    for col in ("policy", "capacity", "hit_rate", "misses_per_token", "prefetches_per_token"):
        assert comp[col].equals(raw[col]), col
    lru_raw, lru_comp = raw.iloc[1], comp.iloc[1]
    # the table prints 6 significant digits
    assert lru_raw.link_gb_per_token > 0
    assert lru_comp.link_gb_per_token == pytest.approx(0.5 * lru_raw.link_gb_per_token, rel=1e-5)
    link_ms_step = lru_comp.link_gb_per_token / 51.0 * 1e3  # b1: a token a step; decodes of twice the bytes at 40
    assert lru_comp.bound_ms == pytest.approx(max(2.56, link_ms_step, 2 * link_ms_step * 51.0 / 40), rel=1e-5)
    for col in ("step_ms", "stall_ms_per_token", "link_gb_per_token", "bound_ms"):
        assert comp[col].iloc[0] == raw[col].iloc[0], col  # static: in place, raw
    with pytest.raises(SystemExit):
        main([*base, "--compressed-ratio", "0.5"])
    assert "go together" in capsys.readouterr().err


@pytest.mark.parametrize("horizon", [1, 3])
def test_previous_token_recall_in_chunks_equals_all_at_once(monkeypatch, horizon):
    """The previous-token baseline counted a few tokens at a time (chunks that cut sequences) equals
    the whole-array count."""
    from coldset.analysis import cache

    rng = np.random.default_rng(horizon)
    tokens = rng.integers(0, 6, size=(200, 3, 2))
    sequence = np.repeat(np.arange(20), rng.multinomial(200 - 20, [1 / 20] * 20) + 1)
    same = sequence[horizon:] == sequence[:-horizon]
    want = float((tokens[horizon:][same][..., :, None] == tokens[:-horizon][same][..., None, :]).any(-1).mean())
    assert cache.previous_token_recall(tokens, sequence, horizon) == pytest.approx(want, abs=1e-15)
    monkeypatch.setattr(cache, "PREVIOUS_CHUNK", 7)
    assert cache.previous_token_recall(tokens, sequence, horizon) == pytest.approx(want, abs=1e-15)
    assert np.isnan(cache.previous_token_recall(tokens[:1], sequence[:1], horizon))
