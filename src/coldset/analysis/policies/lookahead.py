"""``lookahead``: ``forecast``'s replay with lists for later layers of the same step.

After group (step ``t``, layer ``l``) the list names instances of a *later* layer of the same step
(pre-gated MoE's lookahead: the router of layer ``l + d`` applied to layer ``l``'s router input,
:func:`coldset.analysis.forecast.lookahead_predictions`); the victims are ``forecast``'s
(:mod:`coldset.analysis.policies.forecast`) without its guard and gate, and a prefetch is in flight
until the step ends (after its layer has run), so no slot that layers ``l + 1 ..`` of the step
can need is evicted for a prefetch, and a prefetched instance counts as a hit when its layer runs. Not a policy of the cache stage: its lists come from
the model's hidden states, which traces do not hold.
"""

from __future__ import annotations

from coldset.analysis.policies.base import DEFAULT_LEAD_UNIT, LATER_LAYER, CachePolicy
from coldset.analysis.policies.lru import replay_with_lists


class Lookahead(CachePolicy):
    """lru + a prefetch of later layers' experts forecast from hidden states (engine runs only)."""

    lists = LATER_LAYER
    from_trace = False
    holds_group = False  # not refused: a miss that finds no slot is read in place

    def replay(self, stream, warm, counts, lists, budget, victims, lead_unit=DEFAULT_LEAD_UNIT):
        return replay_with_lists(stream, warm, lists, victims)
