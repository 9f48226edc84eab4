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


def test_lookahead_recall_against_brute_force():
    """The lookahead's recall on missed selections, overall recall and precision against loops over
    every (step, layer, token): the router of layer l on the router input of layer l - depth."""
    import torch

    from coldset.forecast import lookahead_recall

    rng = np.random.default_rng(11)
    S, L, T, E, H, k = 3, 4, 2, 6, 5, 2
    hidden = torch.as_tensor(rng.standard_normal((S, L, T, H)), dtype=torch.float32)
    routers = [torch.as_tensor(rng.standard_normal((E, H)), dtype=torch.float32) for _ in range(L)]
    routing = np.stack([rng.choice(E, size=k, replace=False) for _ in range(S * L * T)]).reshape(S, L, T, k)
    missed = rng.random((S, L, T, k)) < 0.4
    for depth in (1, 2):
        for extra in (0, 1):
            got = lookahead_recall(hidden, routers, routing, missed, depth, extra)
            hit_m = tot_m = hit = tot = chosen = npred = 0
            for s in range(S):
                for layer in range(depth, L):
                    for t in range(T):
                        logits = (hidden[s, layer - depth, t] @ routers[layer].T).tolist()
                        pred = sorted(range(E), key=lambda e: (-logits[e], e))[:k + extra]
                        sel = routing[s, layer, t].tolist()
                        chosen += sum(e in sel for e in pred)
                        npred += len(pred)
                        for r, e in enumerate(sel):
                            tot += 1
                            hit += e in pred
                            if missed[s, layer, t, r]:
                                tot_m += 1
                                hit_m += e in pred
            assert got["recall_on_missed"] == pytest.approx(hit_m / tot_m)
            assert got["recall"] == pytest.approx(hit / tot)
            assert got["precision"] == pytest.approx(chosen / npred)
            assert got["missed_reachable"] == tot_m and got["missed"] == int(missed.sum())
    with pytest.raises(ForecastError, match="depth"):
        lookahead_recall(hidden, routers, routing, missed, L)


def test_lookahead_predictions_list_the_later_layers_top_experts():
    """Group (step s, layer l) lists layer l+depth's top-n experts on layer l's router inputs,
    token by token, first occurrence kept, as instances; the last depth layers list nothing."""
    import torch

    from coldset.forecast import lookahead_predictions

    rng = np.random.default_rng(5)
    S, L, T, E, H, n, depth = 2, 3, 2, 5, 4, 2, 1
    hidden = torch.as_tensor(rng.standard_normal((S, L, T, H)), dtype=torch.float32)
    routers = [torch.as_tensor(rng.standard_normal((E, H)), dtype=torch.float32) for _ in range(L)]
    got = lookahead_predictions(hidden, routers, depth, n)
    assert got.shape == (S * L, T * n)
    for s in range(S):
        for layer in range(L):
            want = []
            if layer + depth < L:
                for t in range(T):
                    logits = (hidden[s, layer, t] @ routers[layer + depth].T).tolist()
                    for e in sorted(range(E), key=lambda e: (-logits[e], e))[:n]:
                        if (layer + depth) * E + e not in want:
                            want.append((layer + depth) * E + e)
            row = got[s * L + layer]
            assert row[:len(want)].tolist() == want and (row[len(want):] == -1).all()
