"""``forecast``: ``lru`` plus a prefetch of each layer's next-step experts from a transition table.

After each group (MoE layer ``l`` of step ``t``) the group's prefetch list
(:func:`coldset.analysis.forecast.stream_predictions`: the forecast of layer ``l``'s experts at
step ``t + 1``) is walked in order; each listed instance not resident is admitted into the slot of
a victim chosen *in layers ``0..l`` only*, least recent first, among residents that this group did
not use, that are not in the list, not in flight and not guarded. The work of layers ``0..l`` in
step ``t`` is then done (layer ``l``'s experts still run beside the copy: hence "not used by this
group") and those layers come again only at the next step, so the copy can run beside the rest of
the step without any compute reading its slot. A prefetched instance is *in flight* until its
layer runs again (the next group of layer ``l``): the misses of layers ``0..l - 1`` at step
``t + 1`` never evict it. It enters the recency order as most recent, in list order, after the
group's own accesses. No eviction candidate left in those layers: the rest of the list is
skipped. No victim, demand or prefetch, among the instances the last ``L`` groups used or
prefetched (``lru_guard``'s bar, :func:`coldset.analysis.policies.base.guard_groups`): a demand
miss that finds no other slot is read in place and not admitted. The list is issued only while
the gate is open (:func:`coldset.analysis.policies.base.prefetch_lead_unit`) and the duel
(:func:`prefetch_duel`) finds prefetching faster than ``lru_guard``. Otherwise demand hits and
misses are ``lru``'s;
``prefetches`` counts the copies (they cross the link: ``link_gb_per_token`` counts them with the
fills) and ``useful_prefetches`` the prefetched instances hit before eviction.
"""

from __future__ import annotations

import numpy as np

from coldset.analysis.compiled import jit
from coldset.analysis.policies.base import COPY_UNIT, DEFAULT_LEAD_UNIT, OWN_LAYER, CachePolicy, guard_groups
from coldset.analysis.policies.lru import no_lists, replay_with_lists

#: The duel's running sums decay by ``x >> DUEL_SHIFT`` a group (about the last 256 groups).
DUEL_SHIFT = 8
#: A closed duel opens where the prefetcher's time is under ``lru_guard``'s by ``1 / 2**DUEL_OPEN_SHIFT``.
DUEL_OPEN_SHIFT = 5


@jit
def group_times(layers, fills, prefetches, lead_unit):
    """The time each group adds to a replay's clock (int64 ``[G]``, in :data:`COPY_UNIT` parts of a
    copy's link time), from its demand copies ``fills`` and prefetch copies ``prefetches`` per group
    and each group's MoE layer ``layers`` (a step starts where it does not rise).

    The time model's default (:data:`coldset.analysis.time_model.DEFAULT_TIME`: the link shared, the
    step's end joined; the engine's slot cache) with the decisions at a group's start and no head:
    at a group's decisions its prefetches join the link's backlog and its demand copies cross beside
    them at 4/5 of the rate while a backlog lasts (``min(5/4 D, D + backlog)``), the group waiting
    for them; then its compute (``lead_unit``) drains the backlog; a step's end waits for the whole
    backlog. So a prefetch costs nothing only where the rest of its step's compute hides it. Why
    not the time model itself: the replay knows only ``lead_unit`` (the gate's measure), and the
    clock must run beside the replay, group by group. A prefetch of the layer's next step (the
    replay's own_layer lists) lands by the step's end, so it is never late and the clock needs no
    instance: it is :func:`coldset.analysis.time_model.simulate_time`'s with those settings."""
    n = fills.size
    out = np.zeros(n, dtype=np.int64)
    backlog = 0
    for g in range(n):
        t = 0
        if g > 0 and layers[g] <= layers[g - 1]:  # the previous step's end waits for its copies
            t += backlog
            backlog = 0
        backlog += prefetches[g] * COPY_UNIT
        demand = fills[g] * COPY_UNIT
        if backlog >= demand >> 2:  # the demand copies cross at 4/5 of the rate throughout
            wait = demand + (demand >> 2)
            backlog -= demand >> 2
        else:  # the backlog ends first, then the demand copies take the whole rate
            wait = demand + backlog
            backlog = 0
        out[g] = t + wait + lead_unit
        backlog = max(0, backlog - lead_unit)
    if n > 0:  # the stream's end waits for its last step's copies
        out[n - 1] += backlog
    return out


@jit
def prefetch_duel(time_f, time_g, shift, open_shift):
    """Whether group g may prefetch (bool ``[G]``): the prefetching replay's clock (``time_f``, the
    time each group adds: :func:`group_times`) against ``lru_guard``'s (``time_g``) over the recent
    groups (sums decayed by ``x >> shift`` a group), both tag-only replays of the same stream on the
    same pool. Open at first (the gate it adds to decides alone); closes where the prefetcher is slower, and opens again
    only where it is faster by ``1 / 2**open_shift`` of its time.

    Why two shadows and not the policy's own replay: whether prefetching pays is a question about
    simulated time, and a replay whose prefetch is closed behaves as ``lru_guard``, so comparing
    its own clock with a shadow's tells nothing about prefetching and flips on noise. The two
    shadows never see the policy's decisions, so the comparison has no feedback. Why the margin:
    each switch costs (prefetches that are evicted before their layer runs again, the pool moving
    between two contents), so near a tie the duel keeps its state, and once closed it opens only
    for a clear gain, staying closed (``lru_guard``'s time) where the two are within the clock's
    error. A prefetch's cost enters the sums a step before its saving: the duel leans closed. Group
    g's decision takes the times up to g (its own demand copies and the shadow prefetcher's list
    at g): causal."""
    n = time_f.size
    allow = np.zeros(n, dtype=np.bool_)
    sum_f = 0
    sum_g = 0
    is_open = True
    for g in range(n):
        sum_f = sum_f - (sum_f >> shift) + time_f[g]
        sum_g = sum_g - (sum_g >> shift) + time_g[g]
        is_open = sum_f <= sum_g if is_open else sum_f + (sum_f >> open_shift) <= sum_g
        allow[g] = is_open
    return allow


class Forecast(CachePolicy):
    """lru + the transition forecast's prefetch of the group's layer at the next step."""

    lists = OWN_LAYER
    gated = True

    def replay(self, stream, warm, counts, lists, budget, victims, lead_unit=DEFAULT_LEAD_UNIT):
        """With the gate (``lead_unit >= 0``): the two shadows, the duel, then the replay under it;
        where the duel stays open throughout, the replay under it is the gated shadow (the same
        loop with every ``allow[g]`` true), so that shadow, recorded into a copy of ``victims``, is
        the result."""
        guard = guard_groups(stream.num_moe_layers)
        allow = None
        if lead_unit >= 0:
            shadow_victims = None if victims is None else victims.copy()
            gated = replay_with_lists(stream, warm, lists, shadow_victims, guard, own_layer=True, lead_unit=lead_unit)
            plain = replay_with_lists(stream, warm, no_lists(stream), None, guard)
            layers = stream.instances[stream.group_ptr[:-1]] // stream.num_experts
            allow = prefetch_duel(group_times(layers, gated.fills, gated.prefetches, lead_unit),
                                  group_times(layers, plain.fills, plain.prefetches, lead_unit), DUEL_SHIFT,
                                  DUEL_OPEN_SHIFT)
            if allow.all():
                if victims is not None:
                    victims[:] = shadow_victims
                return gated
        return replay_with_lists(stream, warm, lists, victims, guard, own_layer=True, lead_unit=lead_unit,
                                 allow=allow)
