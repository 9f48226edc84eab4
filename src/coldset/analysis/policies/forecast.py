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
the gate is open (:func:`coldset.analysis.policies.base.prefetch_lead_unit`). Otherwise demand
hits and misses are ``lru``'s;
``prefetches`` counts the copies (they cross the link: ``link_gb_per_token`` counts them with the
fills) and ``useful_prefetches`` the prefetched instances hit before eviction.
"""

from __future__ import annotations

from coldset.analysis.policies.base import DEFAULT_LEAD_UNIT, OWN_LAYER, CachePolicy, guard_groups
from coldset.analysis.policies.lru import replay_with_lists


class Forecast(CachePolicy):
    """lru + the transition forecast's prefetch of the group's layer at the next step."""

    lists = OWN_LAYER
    gated = True

    def replay(self, stream, warm, counts, lists, budget, victims, lead_unit=DEFAULT_LEAD_UNIT):
        return replay_with_lists(stream, warm, lists, victims, guard_groups(stream.num_moe_layers), own_layer=True,
                                 lead_unit=lead_unit)
