"""The next-token forecaster (coldset.forecast) against plain-Python references."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from coldset.cache import AccessStream
from coldset.forecast import ForecastError, TransitionForecaster, forecast_recall, stream_predictions, token_groups


def decode_rows(rng, requests=4, tokens=12, L=2, E=6, k=2, sticky=0.6):
    """Decode rows of a few requests; consecutive tokens keep an expert with probability ``sticky``."""
    rows = []
    for r in range(requests):
        prev = [rng.choice(E, size=k, replace=False) for _ in range(L)]
        for t in range(tokens):
            for layer in range(L):
                keep = [e for e in prev[layer] if rng.random() < sticky]
                rest = [e for e in rng.permutation(E) if e not in keep]
                ex = (keep + rest)[:k]
                prev[layer] = ex
                rows += [{"request": f"q{r}", "position": 10 + t, "layer_index": layer, "rank": j, "expert": int(e)}
                         for j, e in enumerate(ex)]
    frame = pd.DataFrame(rows)
    return frame.sample(frac=1.0, random_state=1).reset_index(drop=True)  # order must not matter


def reference_table(rows, L, E, alpha):
    """The transition table by loops over consecutive tokens of each request."""
    sets = {}
    for r in rows.itertuples():
        sets.setdefault((r.request, r.position, r.layer_index), set()).add(r.expert)
    pairs = np.zeros((L, E, E))
    occ = np.zeros((L, E))
    pop = np.zeros((L, E))
    n = np.zeros(L)
    for (req, pos, layer), cur in sets.items():
        nxt = sets.get((req, pos + 1, layer))
        if nxt is None:
            continue
        n[layer] += 1
        for e in cur:
            occ[layer, e] += 1
            for f in nxt:
                pairs[layer, e, f] += 1
        for f in nxt:
            pop[layer, f] += 1
    pop /= np.maximum(n, 1)[:, None]
    return (pairs + alpha * pop[:, None, :]) / (occ[:, :, None] + alpha), sets


def test_table_predictions_and_recall_match_loops():
    rng = np.random.default_rng(3)
    L, E, k = 2, 6, 2
    rows = decode_rows(rng, L=L, E=E, k=k)
    f = TransitionForecaster.fit(rows, L, E, k, extra=2, alpha=0.5)
    want, sets = reference_table(rows, L, E, 0.5)
    np.testing.assert_allclose(f.table, want, rtol=1e-6)
    assert f.nbytes == L * E * E * 4 and f.num_predictions == 4
    # predictions: the current experts first (by score), then the rest by score, ties by id
    hits = total = same = 0
    for (req, pos, layer), cur in sets.items():
        cur_sorted = sorted(cur)
        score = want[layer, cur_sorted].sum(axis=0)
        ranked = sorted(range(E), key=lambda e: (e not in cur, -score[e], e))[:4]
        got = f.predict(np.array([layer]), np.array([cur_sorted]))[0]
        assert set(got[:k].tolist()) == cur  # the current experts first
        # then the best scores (float32 vs float64: compare scores, not the order of near-ties)
        np.testing.assert_allclose(score[list(got)], score[ranked], rtol=1e-5)
        nxt = sets.get((req, pos + 1, layer))
        if nxt is not None:
            hits += len(nxt & set(got.tolist()))
            same += len(nxt & cur)
            total += len(nxt)
    rec = forecast_recall(f, rows, L, E)
    assert rec["recall"] == pytest.approx(hits / total) and rec["previous_token_recall"] == pytest.approx(same / total)
    assert rec["recall"] >= rec["previous_token_recall"]  # the current experts are part of the forecast
    assert rec["pairs"] == total // k


def test_stream_predictions_are_each_tokens_forecast_united_per_group():
    rng = np.random.default_rng(5)
    L, E, k = 2, 6, 2
    f = TransitionForecaster.fit(decode_rows(rng, L=L, E=E, k=k), L, E, k, extra=1)
    # an engine stream at batch 2: (step, layer) groups of 2 tokens x k
    groups = []
    for step in range(5):
        for layer in range(L):
            groups.append([layer * E + int(e) for _ in range(2) for e in rng.choice(E, size=k, replace=False)])
    ids = np.array([x for g in groups for x in g])
    stream = AccessStream(ids, np.arange(0, ids.size + 1, 2 * k), 10, L, E)
    pred = stream_predictions(f, stream)
    assert pred.shape == (len(groups), 2 * f.num_predictions)
    for g, row in zip(groups, pred):
        layer = g[0] // E
        want = []
        for tok in (g[:k], g[k:]):
            for e in f.predict(np.array([layer]), np.array([[x % E for x in tok]]))[0]:
                if layer * E + e not in want:
                    want.append(layer * E + int(e))
        assert row.tolist() == want + [-1] * (row.size - len(want))


def test_bad_rows_are_refused():
    rows = pd.DataFrame({"request": ["a", "a"], "position": [0, 0], "layer_index": [0, 0], "rank": [0, 0],
                         "expert": [1, 2]})
    with pytest.raises(ForecastError, match="ranks 0..k-1 once"):
        token_groups(rows, 1, 4)
    one = pd.DataFrame({"request": ["a"], "position": [0], "layer_index": [0], "rank": [0], "expert": [1]})
    with pytest.raises(ForecastError, match="no two consecutive"):
        TransitionForecaster.fit(one, 1, 4, 1)
