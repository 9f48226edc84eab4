"""The next-token forecaster (coldset.analysis.forecast) against plain-Python references."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from coldset.analysis.streams import AccessStream, CacheError, tokens_from_frame
from coldset.analysis.forecast import ForecastError, TransitionForecaster, forecast_recall, stream_predictions


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
    with pytest.raises(CacheError, match="two rows for position 0"):
        TransitionForecaster.fit(rows, 1, 4, 2)
    one = pd.DataFrame({"request": ["a"], "position": [0], "layer_index": [0], "rank": [0], "expert": [1]})
    with pytest.raises(ForecastError, match="no two consecutive"):
        TransitionForecaster.fit(one, 1, 4, 1)


def test_lookahead_recall_against_brute_force():
    """The lookahead's recall on missed selections, overall recall and precision against loops over
    every (step, layer, token): the router of layer l on the router input of layer l - depth."""
    import torch

    from coldset.analysis.forecast import lookahead_recall

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

    from coldset.analysis.forecast import lookahead_predictions

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


def test_fit_lookahead_routers_solves_the_ridge_towards_the_router():
    """Each fitted matrix is the ridge solution of the docstring (numpy's float64 normal equations,
    an independent solve); an exactly linear residual stream is recovered as ``R A`` when the
    prior is light, the router itself when it is heavy; the first ``depth`` entries are the routers;
    bad arguments are refused by name."""
    import torch

    from coldset.analysis.forecast import fit_lookahead_routers

    rng = np.random.default_rng(3)
    N, L, H, E, depth = 40, 4, 6, 5, 2
    hidden = torch.as_tensor(rng.standard_normal((N, L, H)), dtype=torch.float32)
    routers = [torch.as_tensor(rng.standard_normal((E, H)), dtype=torch.float32) for _ in range(L)]
    got = fit_lookahead_routers(hidden, routers, depth, shrink=0.3)
    assert len(got) == L and all(g.shape == (E, H) and g.dtype == torch.float32 for g in got)
    for t in range(depth):
        assert torch.equal(got[t], routers[t])
    for t in range(depth, L):
        x = hidden[:, t - depth].double().numpy()
        r = routers[t].double().numpy()
        z = hidden[:, t].double().numpy() @ r.T
        g = x.T @ x
        lam = 0.3 * np.mean(np.diag(g))
        want = np.linalg.solve(g + lam * np.eye(H), x.T @ z + lam * r.T).T
        np.testing.assert_allclose(got[t].double().numpy(), want, rtol=1e-5, atol=1e-5)
    # layer t's input an exact linear map of layer t - depth's: the fit finds R A
    a = [torch.as_tensor(rng.standard_normal((H, H)), dtype=torch.float64) for _ in range(L)]
    base = torch.as_tensor(rng.standard_normal((400, H)), dtype=torch.float64)
    lin = torch.stack([base @ a[t].T if t >= depth else base for t in range(L)], dim=1)
    routers64 = [r.double() for r in routers]
    light = fit_lookahead_routers(lin, routers64, depth, shrink=1e-9)
    heavy = fit_lookahead_routers(lin, routers64, depth, shrink=1e9)
    for t in range(depth, L):
        np.testing.assert_allclose(light[t].numpy(), (routers64[t] @ a[t]).numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(heavy[t].numpy(), routers64[t].numpy(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ForecastError, match="depth 4"):
        fit_lookahead_routers(hidden, routers, 4)
    with pytest.raises(ForecastError, match="shrink 0"):
        fit_lookahead_routers(hidden, routers, 1, shrink=0)


def test_router_inputs_are_what_each_router_ranked(tmp_path):
    """engine.generate.router_inputs on a synthetic engine: one [T, L, H] block a prompt, in prompt order;
    each layer's router applied to its rows ranks, token by token, the experts the engine's own
    routing capture recorded for those prompt tokens (an independent path: the capture records the
    selections, not the inputs); the engine's experts function is restored after."""
    import torch

    from coldset.engine.generate import generate, router_inputs
    from coldset.engine.synthetic import SyntheticSpec
    from synthetic_engines import random_prompts, synthetic_engine

    spec = SyntheticSpec(layers=3, experts=8, top_k=2, hidden=32, moe_intermediate=16, heads=2, kv_heads=1,
                         head_dim=16, vocab_size=256, seed=4)
    engine = synthetic_engine(spec, tmp_path)
    prompts = random_prompts(engine.config.vocab_size, 3, seed=2)
    saved = engine.experts_fn
    hidden = router_inputs(engine, prompts)
    assert engine.experts_fn is saved
    L, H = engine.config.num_moe_layers, engine.config.hidden_size
    assert hidden.shape == (sum(len(p) for p in prompts), L, H)
    start = 0
    for p in prompts:
        routing = generate(engine, [p], 1, capture_routing=True, progress=False).routing[0]
        for j, layer in enumerate(engine.config.moe_layers):
            gate = engine.layers[layer].mlp.gate.weight.detach()
            logits = hidden[start:start + len(p), j].float() @ gate.float().T
            top = torch.topk(logits, engine.config.top_k, dim=-1).indices.sort(dim=-1).values
            want = torch.as_tensor(routing.experts[:len(p), j]).long().sort(dim=-1).values
            assert torch.equal(top, want), (layer, p)
        start += len(p)
    # capped: the first max_tokens tokens, the last prompt cut (its own prefill: the same rows, causal)
    n = len(prompts[0]) + 2
    capped = router_inputs(engine, prompts, max_tokens=n)
    assert capped.shape[0] == n
    torch.testing.assert_close(capped, hidden[:n], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The next-token forecast of every layer (issue 28)


def random_tokens(rng, n_seq=5, L=3, E=7, k=2, sticky=0.6):
    """Decode tokens [T, L, k] of a few sequences (distinct experts per token) and their ids."""
    toks, seq = [], []
    for s in range(n_seq):
        prev = [rng.choice(E, size=k, replace=False) for _ in range(L)]
        for t in range(int(rng.integers(3, 14))):
            row = []
            for layer in range(L):
                keep = [e for e in prev[layer] if rng.random() < sticky]
                ex = (keep + [e for e in rng.permutation(E) if e not in keep])[:k]
                prev[layer] = ex
                row.append(ex)
            toks.append(row)
            seq.append(10 + 3 * s)
    return np.array(toks, dtype=np.int64), np.array(seq, dtype=np.int64)


def reference_tables(tokens, seq, E, terms, weights, horizon, alpha):
    """The integer tables by loops over every (token, layer) pair of a sequence."""
    from coldset.analysis.forecast import SCORE_UNIT

    T, L, k = tokens.shape
    out = np.zeros((len(terms), L, E, E), dtype=np.int64)
    for j, ((a, d), w) in enumerate(zip(terms, weights)):
        pairs = np.zeros((L, E, E))
        occ = np.zeros((L, E))
        pop = np.zeros((L, E))
        n = 0
        for t in range(a, T - horizon):
            if not (seq[t - a] == seq[t] == seq[t + horizon]):
                continue
            n += 1
            for layer in range(L):
                src = layer - d
                if not 0 <= src < L:
                    continue
                for e in tokens[t - a, src]:
                    occ[layer, e] += 1
                    for f in tokens[t + horizon, layer]:
                        pairs[layer, e, f] += 1
                for f in tokens[t + horizon, layer]:
                    pop[layer, f] += 1
        if n == 0:
            continue
        pop /= n
        prob = (pairs + alpha * pop[:, None, :]) / (occ[:, :, None] + alpha)
        out[j] = np.rint(prob * w * SCORE_UNIT)
    return out


def reference_forecast(f, sel, start):
    """The forecast of every (step, layer, lane) read literally from the formula."""
    S, L, B, k = sel.shape
    E, n = f.num_experts, f.num_predictions
    H = {}
    out = np.full((S, L, B, n), -1, dtype=np.int64)
    first = {}
    for b in range(B):
        for s in range(S):
            if sel[s, 0, b, 0] < 0:
                continue
            if start[s, b]:
                first[b] = s
                for layer in range(L):
                    H[b, layer] = [0] * E
            for layer in range(L):
                h = H[b, layer]
                cur = set(sel[s, layer, b].tolist())
                H[b, layer] = h = [v - (v >> f.hist_shift) + (f.hist_unit if e in cur else 0) for e, v in enumerate(h)]
                score = list(h)
                for j, (a, d) in enumerate(f.terms):
                    src = layer - d
                    if s - a < first[b] or not 0 <= src < L:
                        continue
                    for e in sel[s - a, src, b]:
                        for e2 in range(E):
                            score[e2] += int(f.tables[j, layer, e, e2])
                out[s, layer, b] = sorted(range(E), key=lambda e: (-score[e], e))[:n]
    return out


def test_nexttoken_tables_match_loops():
    from coldset.analysis.forecast import NextTokenForecaster

    rng = np.random.default_rng(8)
    tokens, seq = random_tokens(rng)
    terms, weights = ((0, 0), (1, 0), (0, 1), (1, -1)), (1.0, 0.5, 0.25, 0.5)
    for horizon in (1, 2):
        f = NextTokenForecaster.fit(tokens, seq, 2, 7, horizon=horizon, terms=terms, weights=weights, alpha=0.7)
        want = reference_tables(tokens, seq, 7, terms, weights, horizon, 0.7)
        assert np.abs(f.tables.astype(np.int64) - want).max() <= 1  # float rounding at .5 only
        assert f.nbytes == 4 * 3 * 7 * 7 * 4 and f.horizon == horizon


def test_nexttoken_forecast_matches_the_formula_on_lanes():
    """Two lanes, sequences starting mid-pass, an idle lane at the end, ties (integer scores) to
    the lower expert id."""
    from coldset.analysis.streams import Lanes
    from coldset.analysis.forecast import NextTokenForecaster, nexttoken_lists

    rng = np.random.default_rng(9)
    tokens, seq = random_tokens(rng)
    f = NextTokenForecaster.fit(tokens, seq, 2, 7, terms=((0, 0), (2, 0), (0, 1), (1, -2)),
                                weights=(1, 0.5, 0.5, 0.25), hist_beta=0.3, hist_shift=2, extra=2)
    S, L, B, k = 9, 3, 2, 2
    sel = np.full((S, L, B, k), -1, dtype=np.int64)
    start = np.zeros((S, B), dtype=bool)
    sel[:, :, 0] = tokens[:S]
    start[0, 0] = start[4, 0] = True  # lane 0: a new sequence at step 4
    sel[:6, :, 1] = tokens[S:S + 6]
    start[0, 1] = True  # lane 1 idle after step 5
    lanes = Lanes(sel, start, 7)
    got = f.forecast_lanes(sel, start)
    np.testing.assert_array_equal(got, reference_forecast(f, sel, start))
    # the group lists: round robin over rank then lane, first occurrence, as instances
    lists = nexttoken_lists(f, sel, start)
    stream = lanes.stream()
    assert lists.shape == (stream.num_groups, B * f.num_predictions)
    for s in range(S):
        for layer in range(L):
            want = []
            for r in range(f.num_predictions):
                for b in range(B):
                    e = got[s, layer, b, r]
                    if e >= 0 and layer * 7 + e not in want:
                        want.append(layer * 7 + int(e))
            row = lists[s * L + layer]
            assert row.tolist() == want + [-1] * (row.size - len(want))
    # ties: a forecaster with zero tables and no history ranks by expert id
    zero = NextTokenForecaster(((0, 0),), np.zeros((1, L, 7, 7), np.int32), 0, 3, 2, 1)
    assert (zero.forecast_lanes(sel, start)[:, :, 0] == np.arange(3)).all()


def test_nexttoken_quality_and_ceiling_against_counts():
    from coldset.analysis.forecast import NextTokenForecaster, conditional_ceiling, forecast_quality

    rng = np.random.default_rng(10)
    tokens, seq = random_tokens(rng, n_seq=6, k=2)
    f = NextTokenForecaster.fit(tokens, seq, 2, 7, horizon=2, hist_beta=0.2, hist_shift=3)
    q = forecast_quality(f, tokens, seq, sizes=(2,))
    sel = tokens[:, :, None, :]
    start = np.r_[True, seq[1:] != seq[:-1]][:, None]
    lists = reference_forecast(f, sel, start)[:, :, 0]
    hit = tot = hit2 = npred = 0
    for t in range(len(tokens) - 2):
        if seq[t + 2] != seq[t]:
            continue
        for layer in range(3):
            nxt = set(tokens[t + 2, layer].tolist())
            hit += len(nxt & set(lists[t, layer].tolist()))
            hit2 += len(nxt & set(lists[t, layer, :2].tolist()))
            tot += 2
            npred += lists.shape[2]
    assert q["recall"] == pytest.approx(hit / tot) and q["precision"] == pytest.approx(hit / npred)
    assert q["recall_at_2"] == pytest.approx(hit2 / tot) and q["precision_at_2"] == pytest.approx(hit2 / tot)
    # the ceiling: per (layer, current set) the best n experts of the empirical next-token counts
    from collections import Counter, defaultdict

    ctx = defaultdict(Counter)
    for t in range(len(tokens) - 1):
        if seq[t + 1] == seq[t]:
            for layer in range(3):
                ctx[layer, frozenset(tokens[t, layer].tolist())].update(tokens[t + 1, layer].tolist())
    best = sum(sum(sorted(c.values(), reverse=True)[:3]) for c in ctx.values())
    total = sum(sum(c.values()) for c in ctx.values())
    c = conditional_ceiling(tokens, seq, 1, 3)
    assert c["ceiling_recall"] == pytest.approx(best / total) and c["contexts"] == len(ctx)
    assert c["popularity_recall"] <= c["ceiling_recall"]


def test_nexttoken_refuses_unknown_terms_and_overflow():
    from coldset.analysis.forecast import NextTokenForecaster

    with pytest.raises(ForecastError, match="not known after layer"):
        NextTokenForecaster(((0, -1),), np.zeros((1, 2, 3, 3), np.int32), 0, 3, 1)
    with pytest.raises(ForecastError, match="beyond int32"):
        NextTokenForecaster(((0, 0),), np.full((1, 2, 3, 3), 2**30, np.int32), 0, 3, 2)


def _profile_and_replay(seed: int, L: int):
    """Three domains of 3 requests x 10 decode tokens (E 6, top-2): the profile split (domains x and
    y) and the replay (domain z)."""
    rng = np.random.default_rng(seed)
    frames = []
    for dom in ("x", "y", "z"):
        f = decode_rows(rng, requests=3, tokens=10, L=L, E=6, k=2)
        frames.append(f.assign(request=dom + "-" + f.request.astype(str), domain=dom))
    rows = pd.concat(frames, ignore_index=True)
    return rows[rows.domain != "z"], rows[rows.domain == "z"]


def test_recall_table_tunes_on_a_held_out_profile_domain():
    """A replay of a domain the profile lacks: H's parameters are chosen on the last profile
    domain (never on the replay), and each horizon's row is that forecaster's quality."""
    from coldset.analysis.cache import recall_table
    from coldset.analysis.forecast import NextTokenForecaster, forecast_quality
    from coldset.analysis.streams import token_array

    prof, rep = _profile_and_replay(seed=12, L=2)
    table = recall_table(tokens_from_frame(prof, 2, 6), tokens_from_frame(rep, 2, 6), 2, 6, 2, horizons=(1, 2))
    assert table.horizon.tolist() == [1, 2] and (table.tuned_on == "profile domain 'y' (3 of 6 profile requests)").all()
    tp, sp = token_array(prof, 2, 6)
    th, sh = token_array(rep, 2, 6)
    for row in table.itertuples():
        f = NextTokenForecaster.fit(tp, sp, 2, 6, horizon=row.horizon, hist_beta=row.hist_beta,
                                    hist_shift=row.hist_shift, self_boost=row.self_boost)
        q = forecast_quality(f, th, sh, (2,))
        assert row.recall == pytest.approx(q["recall"]) and row.recall_at_2 == pytest.approx(q["recall_at_2"])
        bound = row.in_sample_bound_current_experts  # NaN where the contexts rarely repeat
        assert 0 <= row.popularity_recall <= 1 and (np.isnan(bound) or row.popularity_recall <= bound <= 1)


def test_self_boost_puts_the_current_experts_first():
    from coldset.analysis.forecast import SCORE_UNIT, NextTokenForecaster

    rng = np.random.default_rng(13)
    tokens, seq = random_tokens(rng, k=2)
    plain = NextTokenForecaster.fit(tokens, seq, 2, 7, hist_beta=0.0)
    f = NextTokenForecaster.fit(tokens, seq, 2, 7, hist_beta=0.0, self_boost=2.0)
    diff = f.tables.astype(np.int64) - plain.tables
    assert (diff[0] == np.eye(7, dtype=np.int64)[None] * 2 * SCORE_UNIT).all() and (diff[1:] == 0).all()
    lists = f.forecast_lanes(tokens[:, :, None, :], np.r_[True, seq[1:] != seq[:-1]][:, None])[:, :, 0]
    assert (np.sort(lists[..., :2], axis=-1) == np.sort(tokens, axis=-1)).all()


def test_forecast_loop_equals_the_vectorised_steps_with_idle_steps_and_variants():
    """forecast_lanes (one loop per lane segment) equals _forecast_steps (every lane stepped
    together, numpy) on lanes with idle steps inside a segment, a mid-pass start and several
    history variants at once, in int16 and int64 selections."""
    from coldset.analysis.forecast import NextTokenForecaster

    rng = np.random.default_rng(14)
    tokens, seq = random_tokens(rng, n_seq=5, k=2)
    f = NextTokenForecaster.fit(tokens, seq, 2, 7, terms=((0, 0), (2, 0), (0, 1), (1, -1)),
                                weights=(1, 0.5, 0.5, 0.25), hist_beta=0.3, hist_shift=2, extra=2)
    S, B = 12, 3
    sel = np.full((S, 3, B, 2), -1, dtype=np.int64)
    for b in range(B):
        sel[:, :, b] = tokens[b * S:(b + 1) * S]
    sel[3:5, :, 1] = -1  # idle inside lane 1's segment
    sel[9:, :, 2] = -1  # lane 2 idle at the end
    start = np.zeros((S, B), dtype=bool)
    start[0] = True
    start[6, 0] = True
    hist = [(0, 3), (int(0.3 * 65536), 2), (int(0.8 * 65536), 5)]
    want = f._forecast_steps(sel, start, hist)
    for dtype in (np.int64, np.int16):
        got = f.forecast_lanes(sel.astype(dtype), start, hist=hist)
        np.testing.assert_array_equal(got, want)


def test_ceiling_with_lower_layers_against_counts():
    """The in-sample ceiling of any function of (layer, the current token's sets in layers l and
    l - 1): per context the best n next-token experts' counts, by dictionaries."""
    from collections import Counter, defaultdict

    from coldset.analysis.forecast import conditional_ceiling

    rng = np.random.default_rng(15)
    tokens, seq = random_tokens(rng, n_seq=6, L=3, k=2)
    for m, h in ((1, 1), (2, 2)):
        ctx = defaultdict(Counter)
        for t in range(len(tokens) - h):
            if seq[t + h] != seq[t]:
                continue
            for layer in range(3):
                key = (layer,) + tuple(frozenset(tokens[t, layer - i].tolist()) if layer - i >= 0 else None
                                       for i in range(m + 1))
                ctx[key].update(tokens[t + h, layer].tolist())
        best = sum(sum(sorted(c.values(), reverse=True)[:3]) for c in ctx.values())
        total = sum(sum(c.values()) for c in ctx.values())
        c = conditional_ceiling(tokens, seq, h, 3, lower_layers=m)
        assert c["ceiling_recall"] == pytest.approx(best / total) and c["contexts"] == len(ctx)
        assert c["ceiling_recall"] >= conditional_ceiling(tokens, seq, h, 3)["ceiling_recall"] - 1e-12
    with pytest.raises(ForecastError, match="lower_layers"):
        conditional_ceiling(tokens, seq, 1, 3, lower_layers=-1)


def test_fit_tuned_chooses_term_sets_on_validation_only():
    """term_sets: every (terms, weights, self_boost, H) candidate fitted on the non-validation
    sequences, the best recall on the validation ones (first wins ties), refitted on all tokens."""
    from coldset.analysis.forecast import (DEFAULT_TERMS, DEFAULT_WEIGHTS, LOWER_LAYER_TERMS, LOWER_LAYER_WEIGHTS,
                                  NextTokenForecaster, forecast_quality)

    rng = np.random.default_rng(16)
    tokens, seq = random_tokens(rng, n_seq=8, L=3, k=2)
    sets = ((DEFAULT_TERMS, DEFAULT_WEIGHTS), (LOWER_LAYER_TERMS, LOWER_LAYER_WEIGHTS))
    grid = ((0.0, 5), (0.3, 2))
    val = np.isin(seq, np.unique(seq)[1::3])
    got = NextTokenForecaster.fit_tuned(tokens, seq, 2, 7, grid=grid, validation=val, term_sets=sets)
    best = None
    for terms, weights in sets:
        for boost in (0.0, 2.0):
            for beta, shift in grid:
                f = NextTokenForecaster.fit(tokens[~val], seq[~val], 2, 7, terms=terms, weights=weights,
                                            self_boost=boost, hist_beta=beta, hist_shift=shift)
                r = forecast_quality(f, tokens[val], seq[val])["recall"]
                if best is None or r > best[0] + 1e-12:
                    best = (r, terms, weights, boost, beta, shift)
    want = NextTokenForecaster.fit(tokens, seq, 2, 7, terms=best[1], weights=best[2], self_boost=best[3],
                                   hist_beta=best[4], hist_shift=best[5])
    assert got.terms == want.terms and got.hist_unit == want.hist_unit and got.hist_shift == want.hist_shift
    np.testing.assert_array_equal(got.tables, want.tables)
    with pytest.raises(ForecastError, match="not both"):
        NextTokenForecaster.fit_tuned(tokens, seq, 2, 7, term_sets=sets, terms=DEFAULT_TERMS)


def test_recall_table_term_sets_and_lower_layer_ceiling():
    """recall_table(term_sets=..., ceiling_lower_layers=1): each row's forecaster is fit_tuned's
    choice among the sets (on the last profile domain) and the wider ceiling is conditional_ceiling's."""
    from coldset.analysis.cache import recall_table
    from coldset.analysis.forecast import (DEFAULT_TERMS, DEFAULT_WEIGHTS, LOWER_LAYER_TERMS, LOWER_LAYER_WEIGHTS,
                                  NextTokenForecaster, conditional_ceiling, forecast_quality)
    from coldset.analysis.streams import token_array

    prof, rep = _profile_and_replay(seed=17, L=3)
    sets = ((DEFAULT_TERMS, DEFAULT_WEIGHTS), (LOWER_LAYER_TERMS, LOWER_LAYER_WEIGHTS))
    table = recall_table(tokens_from_frame(prof, 3, 6), tokens_from_frame(rep, 3, 6), 3, 6, 2, horizons=(1,),
                         term_sets=sets, ceiling_lower_layers=1)
    tp, sp = token_array(prof, 3, 6)
    th, sh = token_array(rep, 3, 6)
    from coldset.core.trace import request_codes

    _, names = request_codes(prof["request"])
    val = np.array([str(names[s]).startswith("y-") for s in sp])  # the last profile domain's tokens
    assert val.any() and (~val).any()
    want = NextTokenForecaster.fit_tuned(tp, sp, 2, 6, validation=val, term_sets=sets)
    row = table.iloc[0]
    assert row.terms == str(list(want.terms))
    assert row.recall == pytest.approx(forecast_quality(want, th, sh)["recall"])
    c = conditional_ceiling(th, sh, 1, 5, lower_layers=1)
    want_bound = c["ceiling_recall"] if c["repeated_share"] >= 0.5 else float("nan")
    assert row.in_sample_bound_current_and_lower_layers == pytest.approx(want_bound, nan_ok=True)
    assert row.contexts_current_and_lower == c["contexts"]
