"""The simulator's cache policies: one registry, one file per policy family.

:data:`REGISTRY` maps each policy name to its :class:`~coldset.analysis.policies.base.CachePolicy`;
:func:`coldset.analysis.simulate.simulate` dispatches through it. A new policy is a file beside
these (a ``CachePolicy`` subclass and its replay loop) and one line here. The rules shared with
the engine's slot cache (:func:`~coldset.analysis.policies.base.guard_groups`, the list kinds)
live in :mod:`coldset.analysis.policies.base`.
"""

from __future__ import annotations

from coldset.analysis.policies.base import CachePolicy
from coldset.analysis.policies.belady import Belady
from coldset.analysis.policies.forecast import Forecast
from coldset.analysis.policies.lookahead import Lookahead
from coldset.analysis.policies.lru import LFU, LRU, LRUGuard
from coldset.analysis.policies.nexttoken import NextToken
from coldset.analysis.policies.static import Static
from coldset.analysis.streams import CacheError

REGISTRY: dict[str, CachePolicy] = {
    "static": Static(),
    "lru": LRU(),
    "lru_guard": LRUGuard(),
    "lfu": LFU(),
    "belady": Belady(),
    "forecast": Forecast(),
    "nexttoken": NextToken(),
    "lookahead": Lookahead(),
}

#: The policies the cache stage replays from a trace, in ``simulation.csv``'s row order.
POLICIES = tuple(name for name, p in REGISTRY.items() if p.from_trace)


def policy_for(name: str) -> CachePolicy:
    """The registered policy ``name``; :class:`CacheError` naming the known ones otherwise."""
    if name not in REGISTRY:
        raise CacheError(f"unknown cache policy {name!r}; known: {list(REGISTRY)}")
    return REGISTRY[name]
