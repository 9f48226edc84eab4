"""``lookahead``: ``forecast``'s replay with lists for later layers of the same step.

After group (step ``t``, layer ``l``) the list names instances of a *later* layer of the same step
(pre-gated MoE's lookahead: the router of layer ``l + d`` applied to layer ``l``'s router input,
:func:`coldset.analysis.forecast.lookahead_predictions`); the victims are ``forecast``'s
(:mod:`coldset.analysis.policies.forecast`): layers ``0..l`` only, least recent first, not used by
the group, not in flight and never among the instances the last ``L`` groups used or prefetched
(``lru_guard``'s bar, :func:`coldset.analysis.policies.base.guard_groups`: a demand miss that finds
no other slot is read in place, not admitted). A prefetch is in flight until the step ends (after its
layer has run), so no slot that layers ``l + 1 ..`` of the step can need is evicted for a prefetch,
and a prefetched instance counts as a hit when its layer runs. The gate
(:func:`coldset.analysis.policies.base.prefetch_lead_unit`) judges a list at the group of the layer
it forecasts (``d`` groups later, the lead) and the list is issued only while it is open. Not a
policy of the cache stage: its lists come from the model's hidden states, which traces do not hold.
"""

from __future__ import annotations

from coldset.analysis.policies.base import DEFAULT_LEAD_UNIT, LATER_LAYER, CachePolicy, guard_groups
from coldset.analysis.policies.lru import replay_with_lists


class Lookahead(CachePolicy):
    """lru_guard + a gated prefetch of later layers' experts forecast from hidden states (engine runs only)."""

    lists = LATER_LAYER
    gated = True
    from_trace = False
    holds_group = False  # not refused: a miss that finds no slot is read in place

    def replay(self, stream, warm, counts, lists, budget, victims, lead_unit=DEFAULT_LEAD_UNIT):
        return replay_with_lists(stream, warm, lists, victims, guard_groups(stream.num_moe_layers),
                                 lead_unit=lead_unit)
