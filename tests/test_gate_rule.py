"""The prefetch gate's rule (coldset.analysis.policies.base.prefetch_lead_unit): open while
``min(S, lead_unit << GATE_SHIFT) > (W - U) + (W >> (GATE_SHIFT - 1))``, W starting at
``GATE_START_WANTED``. Its three implementations (the simulator's, the engine's torch path, the
Triton decisions' ``_gate_open``) against the rule written plainly, on its edges; and what the rule
is for, on streams built for it: the cap keeps a busy link's prefetching closed where the saving
alone would open it, the gate starts closed and opens after useful lists, and the margin keeps
lists that only break even closed."""

import numpy as np
import pytest
import torch

import test_cache
from coldset.analysis.policies.base import COPY_UNIT, GATE_SHIFT, GATE_START_WANTED
from coldset.analysis.policies.pool import gate_open
from coldset.analysis.simulate import simulate
from coldset.analysis.streams import AccessStream
from coldset.analysis.time_model import TimeModel, simulate_time
from coldset.engine.cache.pool import SlotCache
from coldset.kernels.tiers import host_tier
from test_lookahead_kernels import _interpret
from test_lookahead_rules import _engine_run
from test_slots import _random_pools, _warm


def rule(wanted, useful, saving, lead_unit):
    """The rule, plainly: the saving, at most 64 groups' compute (64 lead units), beats the waste
    by more than a 32nd of the wanted (rounded down)."""
    return min(saving, 64 * lead_unit) > (wanted - useful) + wanted // 32


def old_rule(wanted, useful, saving, lead_unit):
    """The rule before the cap and the margin (docs/history.md): the saving at least the waste."""
    return saving >= wanted - useful


# (wanted, useful, saving, lead_unit) on the rule's edges: the margin (saving = waste + margin:
# closed, one more: open, one less: closed), the cap (64 lead units = waste + margin: closed, a unit
# more: open; nothing wasted, a saving past a cap under the margin: closed, a unit more: open), the
# start (closed whatever the unit), empty sums, lead unit 0 (never open), a unit past int32
W0 = 64 * COPY_UNIT
EDGES = [(2 * W0, W0, W0 + 4096, 10**6), (2 * W0, W0, W0 + 4097, 10**6), (2 * W0, W0, W0 + 4095, 10**6),
         (2 * W0, W0, 10**9, (W0 + 4096) // 64), (2 * W0, W0, 10**9, (W0 + 4096) // 64 + 1),
         (3 * W0, 3 * W0, 10**9, 1), (3 * W0, 3 * W0, 6145, 96), (3 * W0, 3 * W0, 6145, 97),
         (GATE_START_WANTED, 0, 0, 10**6), (GATE_START_WANTED, 0, 0, 1), (0, 0, 0, 1), (0, 0, 1, 1), (0, 0, 1, 0),
         (W0, W0, 10**9, 0), (5 * W0, 0, 5 * W0 + 10240, 10**6), (W0, W0, 10**12, 2**31)]


def test_the_edges_of_the_rule_in_the_simulator_and_the_torch_path():
    """The simulator's ``gate_open`` and the engine's torch ``gate`` (no pending list: the sums as
    set) decide each edge case as the rule written plainly, both ways (the cases include opens and
    closes); the constants are the rule's."""
    assert GATE_SHIFT == 6 and GATE_START_WANTED == 4 * COPY_UNIT == 4096
    want = [rule(*c) for c in EDGES]
    assert want == [False, True, False, False, True, False, False, True, False, False, False, True, False, False,
                    False, True]
    assert [bool(gate_open(np.array(c[:3], dtype=np.int64), c[3])) for c in EDGES] == want
    for (w, u, s, lead), expect in zip(EDGES, want):
        cache = _engine_run(2, 4, 1, 3, [], np.ones((2, 4)), np.full((1, 1), -1), lead_unit=lead)
        cache.rules.gate_acc.copy_(torch.tensor([w, u, s]))
        assert bool(cache.rules.gate(cache, 1, torch.zeros(4, dtype=torch.bool))) == expect, (w, u, s, lead)
        assert cache.rules.gate_acc.tolist() == [w, u, s]  # nothing pending: the sums unchanged


_EDGES_TRITON = r"""
import sys
import torch
import triton
import triton.language as tl
sys.path.insert(0, sys.argv[1])
from coldset.kernels import triton_slots as ts
from test_gate_rule import EDGES, rule


@triton.jit
def gate_kernel(sums_ptr, lead_unit, out_ptr, SHIFT: tl.constexpr):
    a0 = tl.load(sums_ptr)
    a1 = tl.load(sums_ptr + 1)
    a2 = tl.load(sums_ptr + 2)
    tl.store(out_ptr, ts._gate_open(a0, a1, a2, lead_unit, SHIFT).to(tl.int32))


for w, u, s, lead in EDGES:
    out = torch.full((1,), -1, dtype=torch.int32)
    gate_kernel[(1,)](torch.tensor([w, u, s], dtype=torch.int64), lead, out, SHIFT=6)
    assert int(out) == int(rule(w, u, s, lead)), (w, u, s, lead, int(out))
print("INTERPRETED OK")
"""


def test_the_edges_of_the_rule_in_the_triton_decisions(tmp_path):
    """The Triton decisions' ``_gate_open`` (what ``_gate_judge`` and ``_ahead_prefetch`` decide by)
    under the interpreter on the same edge cases, the lead unit passed as 0, 1 (a value Triton
    specializes), an int32 and a value past int32: as the rule written plainly."""
    assert {c[3] for c in EDGES} >= {0, 1, 96, 10**6} and max(c[3] for c in EDGES) > 2**31 - 1
    _interpret(_EDGES_TRITON, folder=tmp_path)


def _steps_stream(L, E, sel):
    """``sel`` [T, L, k] expert ids as a stream of whole steps."""
    T, _, k = sel.shape
    ids = (sel + (np.arange(L) * E)[None, :, None]).reshape(-1)
    return AccessStream(ids, np.arange(0, ids.size + 1, k), T, L, E)


def _lookahead_lists(rng, sel, E, p, extra):
    """Depth-1 lookahead lists: after group (t, l), layer l + 1's experts at step t, each kept w.p.
    ``p`` (else a random one), then ``extra`` random ones; one entry per instance; none past the
    last layer."""
    T, L, k = sel.shape
    lists = np.full((T * L, k + extra), -1, dtype=np.int64)
    for t in range(T):
        for layer in range(L - 1):
            row = [int(e) if rng.random() < p else int(rng.integers(E)) for e in sel[t, layer + 1]]
            row = list(dict.fromkeys(row + [int(x) for x in rng.integers(E, size=extra)]))
            lists[t * L + layer, :len(row)] = (layer + 1) * E + np.array(row)
    return lists


def _gates_along(groups, lists, n_experts, lead_unit, decide):
    """The gate's decisions group by group on the lists alone, by ``decide(W, U, S, lead_unit)``,
    every list's entries counted as wanted (none resident: the stream's experts never repeat soon
    enough to stay): bool [G], and the sums starting as the rule's (W at 4 copies) or at 0."""
    acc = [GATE_START_WANTED if decide is rule else 0, 0, 0]
    pending, out = {}, []
    for g, group in enumerate(groups):
        layer = group[0] // n_experts
        if layer in pending:
            want, g0 = pending.pop(layer)
            useful = sum(x in group for x in want)
            adds = (len(want) * 1024, useful * 1024, useful * min(1024, (g - g0) * lead_unit))
            acc = [a - a // 64 + d for a, d in zip(acc, adds)]
        out.append(decide(*acc, lead_unit))
        listed = [int(x) for x in lists[g] if x >= 0]
        if listed:
            pending[listed[0] // n_experts] = (listed, g)
    return np.array(out)


def rule_without_cap(wanted, useful, saving, lead_unit):
    """The rule with its margin and without its cap."""
    return saving > (wanted - useful) + wanted // 32


def test_a_busy_link_keeps_lookahead_closed_where_the_saving_alone_would_open_it():
    """(a) The cap. Random routing (4 layers of 64 experts, top-4) through a pool of a quarter of
    the experts, so that nearly every selection misses and the link is busy with demand copies;
    depth-1 lists of 4 right w.p. 0.7 each; a group's compute hides half a copy (lead unit 512).
    Each useful prefetch counts half a copy of saving, more than its share of the waste: the old
    rule (the saving at least the waste) opens and stays open, the rule without its cap nearly so, and the
    ungated replay (what the old rule's gate let through) is over 5% slower than lru on the time
    model. The cap (64 groups' compute) keeps the rule's gate closed but for a few lists: the
    simulator's lookahead issues under a sixth of the ungated copies and is within 0.5% of lru."""
    rng = np.random.default_rng(0)
    L, E, k, T = 4, 64, 4, 150
    sel = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)]) for _ in range(T)])
    stream = _steps_stream(L, E, sel)
    lists = _lookahead_lists(rng, sel, E, 0.7, 0)
    counts = np.ones((L, E))
    cap = L * E // 4
    model = TimeModel(step_ms=2.0, bytes_per_expert=10**6, link_gb_s=1.0, head_share=0.0, router_share=0.0,
                      link="share", join="step")
    lead = model.lead_unit(L)
    assert lead == 512  # a group's compute: 0.5 ms, half a copy (1 ms)
    groups = [stream.instances[s:e].tolist() for s, e in zip(stream.group_ptr[:-1], stream.group_ptr[1:])]
    assert _gates_along(groups, lists, E, lead, old_rule)[L:].all()  # open after the first step's lists
    assert _gates_along(groups, lists, E, lead, rule_without_cap).mean() > 0.9
    assert _gates_along(groups, lists, E, lead, rule).mean() < 0.2
    lru, guard = (simulate(stream, p, cap, counts) for p in ("lru", "lru_guard"))
    ungated = simulate(stream, "lookahead", cap, counts, predictions=lists, prefetch_gate=False)
    gated = simulate(stream, "lookahead", cap, counts, predictions=lists, lead_unit=lead)
    assert ungated.prefetches.sum() > 2 * T * L and ungated.useful_prefetches > T * L  # most of them used
    assert gated.prefetches.sum() < ungated.prefetches.sum() / 6
    t_lru, t_ungated, t_gated = (simulate_time(stream, r, model).step_ms for r in (lru, ungated, gated))
    assert t_ungated > 1.05 * t_lru  # what the old rule's open gate cost
    assert t_gated <= 1.005 * t_lru


def _break_even_case(k, steps=120):
    """2 layers of 64 experts, top-``k``, one token; layer 0's experts cycle through 0..31 and
    layer 1's through 0..31 (``k - 1`` a step) beside expert 63 (always resident); layer 0's list
    (lookahead depth 1) names layer 1's cycling experts and one of 32..62, which no group selects:
    each list wants ``k`` copies (none resident: the cycles do not come back soon enough to stay
    in the pool), ``k - 1`` of them used a group later (a whole copy saved each at lead unit
    1024). Returns (stream, lists, counts, capacity, groups)."""
    E = 64
    groups, lists = [], []
    for t in range(steps):
        nxt = [E + ((k - 1) * t + j) % 32 for j in range(k - 1)]
        groups += [[(k * t + j) % 32 for j in range(k)], nxt + [E + 63]]
        lists += [nxt + [E + 32 + t % 31], [-1] * k]
    ids = np.array([x for g in groups for x in g])
    stream = AccessStream(ids, np.arange(0, ids.size + 1, k), steps, 2, E)
    counts = np.zeros((2, E))
    counts[1, 63] = 1.0
    return stream, np.array(lists), counts, 4 * k + 2, groups


def _engine_lookahead(groups, lists, counts, cap, k):
    """The engine's lookahead (torch decisions) on the case: ``_engine_run`` (identity routers:
    a group's router input names its list) at lead unit 1024."""
    return _engine_run(2, 64, k, cap, groups, counts, lists, lead_unit=1024)


def test_the_gate_starts_closed_and_opens_after_useful_lists():
    """(b) Lists two thirds right (top-3: each wants 3 copies, 2 used a group later): the
    simulator's lookahead issues nothing at first (the gate starts closed: W at 4 copies), then
    opens, at the group the rule written plainly opens, and keeps issuing; the brute-force replay
    (tests/test_cache.py) decides every group alike; the engine's torch path records the same lists
    and decides every group as the simulator. Its gate state starts, and resets to, 4 copies
    wanted, nothing useful or saved, nothing pending."""
    stream, lists, counts, cap, groups = _break_even_case(3)
    res = simulate(stream, "lookahead", cap, counts, predictions=lists, lead_unit=1024)
    first = int(np.flatnonzero(res.prefetches)[0])
    assert first >= 6 and res.prefetches[first::2].all()  # closed for the first lists, then open
    opens = np.flatnonzero(_gates_along(groups, lists, 64, 1024, rule))
    assert first == min(g for g in opens if lists[g, 0] >= 0)  # the first open group with a list (layer 0's)
    _, ref_pf, ref_useful = test_cache.brute_force_forecast(groups, cap, counts, 64, lists.tolist(), guard=2,
                                                            lead_unit=1024)
    np.testing.assert_array_equal(res.prefetches, ref_pf)
    assert res.useful_prefetches == ref_useful > 100
    fresh = _engine_lookahead([], lists, counts, cap, 3)
    assert fresh.rules.gate_acc.tolist() == [GATE_START_WANTED, 0, 0]
    assert fresh.rules.want_group.tolist() == [-1, -1] and int(fresh.rules.group_index) == 0
    cache = _engine_lookahead(groups, lists, counts, cap, 3)
    np.testing.assert_array_equal(cache.prefetch_lists(), lists)
    np.testing.assert_array_equal(cache.group_history(), np.stack([res.hits, res.misses, res.fills], axis=1))
    np.testing.assert_array_equal(cache.prefetch_counts(), res.prefetches)
    cache.check(contents=True)
    cache.reset()
    assert cache.rules.gate_acc.tolist() == [GATE_START_WANTED, 0, 0]
    assert cache.rules.want_group.tolist() == [-1, -1] and int(cache.rules.group_index) == 0


def test_the_margin_keeps_lists_that_only_break_even_closed():
    """(c) The margin. Lists half right (top-2: each wants 2 copies, 1 used a group later; the
    lead unit a whole copy, the cap far off): the saving equals the waste, so the old rule (at
    least the waste) opens and stays open, while the rule's margin (a 32nd of the wanted) keeps
    it closed: the simulator and the engine issue nothing. The ungated replay shows the lists'
    half right."""
    stream, lists, counts, cap, groups = _break_even_case(2)
    assert _gates_along(groups, lists, 64, 1024, old_rule).all()
    assert not _gates_along(groups, lists, 64, 1024, rule).any()
    res = simulate(stream, "lookahead", cap, counts, predictions=lists, lead_unit=1024)
    assert res.prefetches.sum() == 0
    cache = _engine_lookahead(groups, lists, counts, cap, 2)
    assert cache.counters()["prefetches"] == 0
    np.testing.assert_array_equal(cache.group_history(), np.stack([res.hits, res.misses, res.fills], axis=1))
    ungated = simulate(stream, "lookahead", cap, counts, predictions=lists, prefetch_gate=False)
    assert 2 * ungated.useful_prefetches == ungated.prefetches.sum() > 100  # half of what it fetched used


_OPENS_TRITON = r"""
import sys
import numpy as np
import torch
sys.path.insert(0, sys.argv[1])
from test_lookahead_kernels import _FILL_PRELUDE
exec(_FILL_PRELUDE)
from test_gate_rule import _break_even_case, _engine_lookahead

STATE = ("owner", "last_use", "count", "tick", "totals", "groups", "inflight", "gate_state", "prediction_history",
         "prefetch_history", "history")
stream, lists, counts, cap, groups = _break_even_case(3, steps=8)
ref, ker = (_engine_lookahead([], lists, counts, cap, 3) for _ in range(2))
ker.use_kernel, ker.fill_ticket = True, torch.zeros(1, dtype=torch.int32)  # the kernel path by hand
for g, ids in enumerate(groups):
    hidden = torch.zeros(1, 64)
    named = [x % 64 for x in lists[g] if x >= 0]
    hidden[0, named] = torch.arange(len(named), 0, -1, dtype=torch.float32)
    sel = torch.tensor([[x % 64 for x in ids]])
    ref.admit(g % 2, sel, hidden=hidden)
    ker.admit(g % 2, sel, hidden=hidden)
    for name in STATE:
        assert torch.equal(state(ref, name), state(ker, name)), (name, g)
    assert torch.equal(ref.pools.row_map, ker.pools.row_map), g
issued = ker.prefetch_counts()[:len(groups)]
assert issued[:6].sum() == 0 and issued.sum() > 0, issued  # closed at first, then open
ker.check(contents=True)
print("INTERPRETED OK")
"""


def test_the_triton_decisions_open_the_gate_as_the_torch_path():
    """``decide_ahead`` (the kernel path's decisions, under the interpreter) against the torch path
    on the first 8 steps of the two-thirds-right case: after every group the same state, the
    gate's sums included; nothing issued at first, then lists issued (the gate opened)."""
    _interpret(_OPENS_TRITON)
