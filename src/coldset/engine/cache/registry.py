"""The engine's cache policies by name: one line per policy (a new policy is a module with its
class and a line here). The names are the placements' dynamic policies
(:data:`coldset.core.placement.DYNAMIC_POLICIES`)."""

from __future__ import annotations

from coldset.engine.cache.lookahead import Lookahead
from coldset.engine.cache.lru import LFU, LRU, LRUGuard
from coldset.engine.cache.nexttoken import NextToken
from coldset.engine.cache.policy import CachePolicy

POLICIES: dict[str, type[CachePolicy]] = {
    "lru": LRU,
    "lru_guard": LRUGuard,
    "lfu": LFU,
    "lookahead": Lookahead,
    "nexttoken": NextToken,
}
