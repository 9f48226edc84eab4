"""``belady``: victim = the resident whose next use after this group is furthest away (never used
again = infinitely far; ties by instance id ascending). The offline optimum for the miss count:
the bound the online policies are measured against.
"""

from __future__ import annotations

import numpy as np

from coldset.analysis.compiled import jit
from coldset.analysis.policies.base import DEFAULT_LEAD_UNIT, CachePolicy, Replay, recording
from coldset.analysis.policies.heap import BELADY_KEYS, replay_keyed


@jit
def next_use_ticks(ids, n_inst):
    """float64 ``[N]``: for each selection, the tick of the next selection of the same instance
    (``inf`` when none), by one backward pass. Used by Belady at the last occurrence of an instance
    in its group, where this is its next use after the group."""
    out = np.empty(ids.size)
    nxt = np.full(n_inst, np.inf)
    for i in range(ids.size - 1, -1, -1):
        out[i] = nxt[ids[i]]
        nxt[ids[i]] = i
    return out


class Belady(CachePolicy):
    """Furthest next use first (knows the future: simulation only)."""

    def replay(self, stream, warm, counts, lists, budget, victims, lead_unit=DEFAULT_LEAD_UNIT):
        record, rec = recording(victims)
        ids, ptr = stream.instances, stream.group_ptr
        hit, fills = replay_keyed(ids, ptr, warm, counts[warm], stream.num_instances, BELADY_KEYS,
                                  next_use_ticks(ids, stream.num_instances), record, rec, 0)
        return Replay(hit, fills)
