"""``forecast``'s duel (coldset.analysis.policies.forecast): its prefetch is open only where a tag-only
replay of the gated prefetcher is faster than one of ``lru_guard`` on a clock that is the time
model's; checked against the time model, a brute-force replay, and streams built to make a
prefetcher lose (or win)."""

from __future__ import annotations

import numpy as np
import pytest

import test_cache
from coldset.analysis.policies.base import COPY_UNIT, guard_groups
from coldset.analysis.policies.forecast import DUEL_OPEN_SHIFT, DUEL_SHIFT, group_times
from coldset.analysis.policies.lru import no_lists, replay_with_lists
from coldset.analysis.simulate import simulate, warm_order
from coldset.analysis.streams import AccessStream
from coldset.analysis.time_model import TimeModel, simulate_time

# the time models the tests judge by: the cache stage's default (link shared, step joined) and the
# time model's own default (demand first, no join)
SHARE_STEP = dict(link="share", join="step")
PRIORITY_USE = dict(link="priority", join="use")
FIFO_STEP = dict(link="fifo", join="step")  # the duel's clock is share/step's: another link mode too


def whole_steps(rng, L, E, k, T):
    """T steps of L MoE layers, top-k drawn at random: (selections [T, L, k], stream)."""
    sel = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)]) for _ in range(T)])
    ids = (sel + (np.arange(L) * E)[None, :, None]).reshape(-1)
    return sel, AccessStream(ids, np.arange(0, ids.size + 1, k), T, L, E)


def forecast_lists(rng, sel, E, p, width=None):
    """Each group's list: its layer's experts at the next step, each replaced w.p. ``1 - p`` by a
    random one (an instance named once; -1 padded; the last step's lists empty)."""
    T, L, k = sel.shape
    width = width or k
    lists = np.full((T * L, width), -1, dtype=np.int64)
    for t in range(T - 1):
        for layer in range(L):
            row = [int(e) if rng.random() < p else int(rng.integers(E)) for e in sel[t + 1, layer]]
            row = list(dict.fromkeys(row))[:width]
            lists[t * L + layer, :len(row)] = layer * E + np.array(row)
    return lists


def step_times(stream, results, model):
    return [simulate_time(stream, r, model).step_ms for r in results]


def test_group_times_is_the_time_models_clock():
    """With the decisions at each group's start, no head and a compute a whole number of
    ``COPY_UNIT`` parts, the clock's total is simulate_time's under the link shared at 4/5 and the
    step joined, for lru_guard and for forecast with every list issued (no gate)."""
    rng = np.random.default_rng(0)
    checked = 0
    for trial in range(12):
        L, E, k, T = 4, 8, int(rng.integers(1, 4)), 25
        sel, stream = whole_steps(rng, L, E, k, T)
        lists = forecast_lists(rng, sel, E, 0.7, width=3)
        if trial % 2:
            lists[-L:] = lists[:L]  # the stream's end waits for the last step's prefetches too
        cap = int(rng.integers(k * L, L * E))
        compute = [0.25, 0.5, 1.0][trial % 3]  # a group's compute, in copies (copy: 1 ms)
        model = TimeModel(step_ms=compute * L, bytes_per_expert=10**6, link_gb_s=1.0, head_share=0.0,
                          router_share=0.0, demand_share=0.8, **SHARE_STEP)
        lead = model.lead_unit(L)
        assert lead == compute * COPY_UNIT
        layers = stream.instances[stream.group_ptr[:-1]] // E
        profile = rng.random((L, E))
        for res in (simulate(stream, "lru_guard", cap, profile),
                    simulate(stream, "forecast", cap, profile, predictions=lists, prefetch_gate=False)):
            pf = res.prefetches if res.prefetches is not None else np.zeros_like(res.fills)
            clock = group_times(layers, res.fills, pf, lead).sum() / COPY_UNIT
            ts = simulate_time(stream, res, model)
            assert clock == pytest.approx(ts.step_ms * ts.steps, rel=1e-12), trial
            checked += int(pf.sum() > 0)
    assert checked >= 6  # prefetches were timed


def duel_reference(time_f, time_g):
    """prefetch_duel read literally: decayed sums; open at first, closes where the prefetcher's is
    over lru_guard's, opens again where it is under by its 1/32."""
    sf = sg = 0
    is_open, out = True, []
    for a, b in zip(time_f.tolist(), time_g.tolist()):
        sf, sg = sf - (sf >> DUEL_SHIFT) + a, sg - (sg >> DUEL_SHIFT) + b
        is_open = sf <= sg if is_open else sf + (sf >> DUEL_OPEN_SHIFT) <= sg
        out.append(is_open)
    return np.array(out)


def fills_of(groups, hits):
    """Distinct missed instances per group."""
    out, a = [], 0
    for g in groups:
        out.append(len({x for x, h in zip(g, hits[a:a + len(g)]) if not h}))
        a += len(g)
    return np.array(out, dtype=np.int64)


def brute_force_dueled_forecast(groups, capacity, profile, n_experts, preds, guard, lead_unit):
    """The forecast policy read literally: tests/test_cache.py's ``brute_force_forecast`` (own-layer
    lists, ``guard``, the gate) whose gate also closes where the duel does: the shadows replayed by
    brute force (the gated forecast, ``lru_guard``), timed by the clock (:func:`group_times`) and
    compared by :func:`duel_reference`. Returns (hits, prefetches per group, useful)."""
    layer = np.array([g[0] // n_experts for g in groups])
    f_hit, f_pf, _ = test_cache.brute_force_forecast(groups, capacity, profile, n_experts, preds, own_layer=True,
                                                     guard=guard, lead_unit=lead_unit)
    g_hit, _ = test_cache.brute_force(groups, "lru_guard", capacity, profile, guard)
    none = np.zeros(len(groups), dtype=np.int64)
    allow = duel_reference(group_times(layer, fills_of(groups, f_hit), np.asarray(f_pf, dtype=np.int64), lead_unit),
                           group_times(layer, fills_of(groups, g_hit), none, lead_unit))
    gate = test_cache.BruteGate

    class DuelGate(gate):
        def judge(self, layer, g, group):
            return super().judge(layer, g, group) and bool(allow[g])

    test_cache.BruteGate = DuelGate  # brute_force_forecast builds its gate from the module's name
    try:
        return test_cache.brute_force_forecast(groups, capacity, profile, n_experts, preds, own_layer=True,
                                               guard=guard, lead_unit=lead_unit)
    finally:
        test_cache.BruteGate = gate


def partly_right_case(rng, trial):
    """A random stream (tests/test_cache.py's ``random_stream``, 3 layers of 6 experts) with lists
    partly right (so the duel both lets lists through and closes some the gate passes), a pool and
    a gate whose cap binds (units 0, 10, 1024) or not (10**6): (groups, stream, profile, lists,
    capacity, lead_unit)."""
    k = int(rng.integers(1, 4))
    groups, stream, profile, n_inst = test_cache.random_stream(
        rng, n_layers=3, n_experts=6, k=k, dup=trial % 3 == 0, n_groups=int(rng.integers(30, 120)))
    E = stream.num_experts
    width = int(rng.integers(1, 5))
    layer = np.array([g[0] // E for g in groups])
    pred = layer[:, None] * E + rng.integers(0, E, size=(len(groups), width))
    for g in range(len(groups) - 3):  # some entries right: the layer's next group (as random_stream's)
        right = groups[g + 3][:width]
        take = rng.random(len(right)) < (0.3 + 0.6 * (trial % 2))
        pred[g, :len(right)] = np.where(take, right, pred[g, :len(right)])
    pred = np.where(rng.random(pred.shape) < 0.25, -1, pred)
    test_cache.once_per_row(pred)
    cap = int(rng.integers(stream.max_group, n_inst + 1))
    return groups, stream, profile, pred, cap, int(rng.choice([0, 10, 1024, 10**6]))


def test_forecast_policy_matches_brute_force():
    """The forecast policy against the literal brute force with the duel, on random streams whose
    lists are partly right."""
    rng = np.random.default_rng(17)
    seen_prefetch = seen_useful = seen_closed = 0
    for trial in range(60):
        groups, stream, profile, pred, cap, lead_unit = partly_right_case(rng, trial)
        E = stream.num_experts
        _, gated_pf, _ = test_cache.brute_force_forecast(groups, cap, profile, E, pred.tolist(), own_layer=True,
                                                         guard=3, lead_unit=lead_unit)
        ref_hit, ref_pf, ref_useful = brute_force_dueled_forecast(groups, cap, profile, E, pred.tolist(), 3, lead_unit)
        res = simulate(stream, "forecast", cap, profile, predictions=pred, lead_unit=lead_unit)
        np.testing.assert_array_equal(res.hit, ref_hit, err_msg=f"trial {trial} cap {cap}")
        np.testing.assert_array_equal(res.prefetches, ref_pf, err_msg=f"trial {trial} cap {cap}")
        assert res.useful_prefetches == ref_useful
        st = res.stats()
        assert st.link_gb_per_token(10**9) == pytest.approx((res.fills.sum() + ref_pf.sum()) / stream.tokens)
        seen_prefetch += int(ref_pf.sum())
        seen_useful += ref_useful
        seen_closed += int(np.sum(gated_pf) > np.sum(ref_pf))
    assert seen_prefetch > 50 and seen_useful > 10  # the streams exercised prefetching
    assert seen_closed >= 5  # and the duel closed lists the gate alone let through


def test_forecast_is_its_replay_under_the_duel():
    """Everything the policy decides (hits, fills, prefetches, what they copied, useful and wasted
    ones, the recorded victims) is the replay under the duel's ``allow`` composed literally from
    its pieces (the two shadows, :func:`group_times`, :func:`duel_reference`), both where the duel
    stays open throughout (the policy's gated shadow is then its result) and where it closes."""
    rng = np.random.default_rng(23)
    seen_open = seen_closed = 0
    for trial in range(40):
        if trial % 2:  # lists mostly right, a group's compute one copy: the duel mostly stays open
            L, E, k = 3, 8, int(rng.integers(1, 3))
            sel, stream = whole_steps(rng, L, E, k, 30)
            pred, profile = forecast_lists(rng, sel, E, 0.9), rng.random((L, E))
            cap, lead_unit = int(rng.integers(k * L, L * E)), COPY_UNIT
        else:
            _, stream, profile, pred, cap, lead_unit = partly_right_case(rng, trial)
        res = simulate(stream, "forecast", cap, profile, predictions=pred, lead_unit=lead_unit, record_victims=True)
        warm, guard = warm_order(profile, cap), guard_groups(stream.num_moe_layers)
        gated = replay_with_lists(stream, warm, pred, None, guard, own_layer=True, lead_unit=lead_unit)
        plain = replay_with_lists(stream, warm, no_lists(stream), None, guard)
        layers = stream.instances[stream.group_ptr[:-1]] // stream.num_experts
        allow = duel_reference(group_times(layers, gated.fills, gated.prefetches, lead_unit),
                               group_times(layers, plain.fills, plain.prefetches, lead_unit))
        victims = np.full(stream.instances.size, -1, dtype=np.int64)
        ref = replay_with_lists(stream, warm, pred, victims, guard, own_layer=True, lead_unit=lead_unit, allow=allow)
        for name in ("hit", "fills", "prefetches", "issued"):
            np.testing.assert_array_equal(getattr(res, name), getattr(ref, name), err_msg=f"trial {trial} {name}")
        np.testing.assert_array_equal(res.victims, victims, err_msg=f"trial {trial} victims")
        assert (res.useful_prefetches, res.wasted_prefetches) == (ref.useful_prefetches, ref.wasted_prefetches)
        seen_open += int(allow.all() and ref.prefetches.sum() > 0 and (victims >= 0).any())
        seen_closed += int(not allow.all())
    assert seen_open >= 5 and seen_closed >= 5  # both ways, the open one with prefetches and victims


def adversarial_steps(rng, p, T, L=4, E=16):
    """Each layer alternates one expert (period 2) and takes a fresh one; the list names the next
    fresh one w.p. ``p`` (else another that does not come soon): (selections [T, L, 2], lists)."""
    F = E - 2
    sel = np.zeros((T, L, 2), dtype=np.int64)
    for t in range(T):
        for layer in range(L):
            sel[t, layer] = (t % 2, 2 + (t + 3 * layer) % F)
    lists = np.full((T * L, 1), -1, dtype=np.int64)
    for t in range(T - 1):
        for layer in range(L):
            good = rng.random() < p
            lists[t * L + layer, 0] = layer * E + (sel[t + 1, layer, 1] if good else 2 + (t + 3 * layer + 8) % F)
    return sel, lists


def adversarial(p, L=4, E=16, T=600):
    """:func:`adversarial_steps` as a stream with its profile counts and a pool of two steps'
    experts, so a wrong prefetch evicts the expert that comes back next step (lru_guard = lru
    here): (stream, lists, counts, capacity)."""
    sel, lists = adversarial_steps(np.random.default_rng(1), p, T, L, E)
    ids = (sel + (np.arange(L) * E)[None, :, None]).reshape(-1)
    stream = AccessStream(ids, np.arange(0, ids.size + 1, 2), T, L, E)
    counts = np.zeros((L, E))
    np.add.at(counts, (np.tile(np.repeat(np.arange(L), 2), T), sel.reshape(-1)), 1)
    return stream, lists, counts, 4 * L


@pytest.mark.parametrize("times", [PRIORITY_USE, SHARE_STEP, FIFO_STEP],
                         ids=["priority-use", "share-step", "fifo-step"])
def test_forecast_is_not_slower_than_lru_guard_where_its_prefetches_evict_the_next_steps_experts(times):
    """The adversarial stream at list precision 0.6..0.9: the gate alone keeps the lists open (their
    saving covers their waste) while each wrong one costs a demand miss; the duel closes them:
    forecast within 0.5% of lru_guard's simulated step."""
    model = TimeModel(step_ms=2.0, bytes_per_expert=10_200_000, link_gb_s=51.0, **times)
    for p in (0.6, 0.7, 0.8, 0.9):
        stream, lists, counts, cap = adversarial(p)
        lead = model.lead_unit(stream.num_moe_layers)
        guard, gated_only, forecast = (
            simulate(stream, "lru_guard", cap, counts),
            simulate(stream, "forecast", cap, counts, predictions=lists, prefetch_gate=False),
            simulate(stream, "forecast", cap, counts, predictions=lists, lead_unit=lead))
        t_guard, t_open, t_forecast = step_times(stream, (guard, gated_only, forecast), model)
        assert t_open > 1.02 * t_guard, p  # prefetching loses here
        assert t_forecast <= 1.005 * t_guard, (p, t_forecast / t_guard)


@pytest.mark.parametrize("times", [PRIORITY_USE, SHARE_STEP], ids=["priority-use", "share-step"])
def test_forecast_prefetches_and_beats_lru_where_its_lists_are_right(times):
    """Random routing (nothing for lru to keep), lists = the next step's experts: the duel opens,
    forecast hits far more than lru, and its step is under 0.85 of lru's."""
    rng = np.random.default_rng(3)
    L, E, k = 4, 16, 2
    model = TimeModel(step_ms=2.0, bytes_per_expert=10_200_000, link_gb_s=51.0, **times)
    for cap in (16, 24, 40):
        sel, stream = whole_steps(rng, L, E, k, 300)
        lists = forecast_lists(rng, sel, E, 1.0)
        counts = np.ones((L, E))
        lru = simulate(stream, "lru", cap, counts)
        forecast = simulate(stream, "forecast", cap, counts, predictions=lists, lead_unit=model.lead_unit(L))
        t_lru, t_forecast = step_times(stream, (lru, forecast), model)
        assert forecast.prefetches.sum() >= 0.2 * stream.tokens * L * k, cap
        assert forecast.hit.mean() > lru.hit.mean() + 0.25, cap
        assert t_forecast < 0.85 * t_lru, (cap, t_forecast / t_lru)


def test_the_duel_is_causal():
    """Changing the accesses (and lists) after group g changes none of forecast's decisions up to g
    (hits, prefetches, what they copied), though the duel opened, closed and opened again before g
    (right lists, then the adversarial stream's, then right ones) and the change changes the later
    decisions."""
    rng = np.random.default_rng(5)
    L, E, k = 4, 16, 2
    model = TimeModel(step_ms=2.0, bytes_per_expert=10_200_000, link_gb_s=51.0, **SHARE_STEP)
    lead = model.lead_unit(L)
    right_a, _ = whole_steps(rng, L, E, k, 150)
    wrong, wrong_lists = adversarial_steps(rng, 0.6, 200)
    right_b, _ = whole_steps(rng, L, E, k, 250)
    sel = np.concatenate([right_a, wrong, right_b])
    wrong_lists = np.concatenate([wrong_lists, np.full_like(wrong_lists, -1)], axis=1)
    lists = np.concatenate([forecast_lists(rng, right_a, E, 1.0), wrong_lists, forecast_lists(rng, right_b, E, 1.0)])
    T = sel.shape[0]
    counts = np.ones((L, E))
    cap = 16

    def run(s, lst):
        ids = (s + (np.arange(L) * E)[None, :, None]).reshape(-1)
        stream = AccessStream(ids, np.arange(0, ids.size + 1, k), T, L, E)
        return stream, simulate(stream, "forecast", cap, counts, predictions=lst, lead_unit=lead)

    stream, base = run(sel, lists)
    g = 450 * L - 1  # the last group of step 449
    on = base.prefetches.reshape(T, L).sum(axis=1) > 0  # steps that prefetched
    assert on[:150].mean() > 0.5 and on[250:350].mean() < 0.1 and on[380:450].mean() > 0.5
    later = sel.copy()
    later[450:] = whole_steps(rng, L, E, k, T - 450)[0]
    changed_lists = lists.copy()
    changed_lists[g + 1:] = forecast_lists(rng, later, E, 1.0)[g + 1:]
    _, other = run(later, changed_lists)
    n = int(stream.group_ptr[g + 1])
    np.testing.assert_array_equal(other.hit[:n], base.hit[:n])
    np.testing.assert_array_equal(other.prefetches[:g + 1], base.prefetches[:g + 1])
    np.testing.assert_array_equal(other.issued[:g + 1], base.issued[:g + 1])
    assert not np.array_equal(other.prefetches[g + 1:], base.prefetches[g + 1:])
