"""``belady``: victim = the resident whose next use after this group is furthest away (never used
again = infinitely far; ties by instance id ascending). The offline optimum for the miss count:
the bound the online policies are measured against.
"""

from __future__ import annotations

import numpy as np

from coldset.analysis.policies.base import DEFAULT_LEAD_UNIT, CachePolicy, Replay, recording
from coldset.analysis.policies.heap import BELADY_KEYS, replay_keyed


def next_use_ticks(ids: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """float64 ``[N]``: for each selection, the tick of the next selection of the same instance
    (``inf`` when none). Used by Belady at the last occurrence of an instance in its group, where
    this is its next use after the group."""
    ids = np.asarray(ids, dtype=np.int64)
    order = np.argsort(ids, kind="stable")
    out = np.full(ids.size, np.inf)
    same = ids[order[1:]] == ids[order[:-1]]
    out[order[:-1][same]] = order[1:][same]
    return out


class Belady(CachePolicy):
    """Furthest next use first (knows the future: simulation only)."""

    def replay(self, stream, warm, counts, lists, budget, victims, lead_unit=DEFAULT_LEAD_UNIT):
        record, rec = recording(victims)
        ids, ptr = stream.instances, stream.group_ptr
        hit, fills = replay_keyed(ids, ptr, warm, counts[warm], stream.num_instances, BELADY_KEYS,
                                  next_use_ticks(ids, ptr), record, rec)
        return Replay(hit, fills)
