"""``static``: no admission, no eviction; the hit rate is the warm set's coverage of the replay.

Each distinct missed instance of a group is one cold read over the link (``fills``).
"""

from __future__ import annotations

import numpy as np

from coldset.analysis.compiled import jit
from coldset.analysis.policies.base import DEFAULT_LEAD_UNIT, CachePolicy, Replay


@jit
def replay_static(ids, ptr, warm, n_inst):
    n_groups = ptr.size - 1
    resident = np.zeros(n_inst, dtype=np.bool_)
    for j in range(warm.size):
        resident[warm[j]] = True
    hit = np.empty(ids.size, dtype=np.bool_)
    fills = np.zeros(n_groups, dtype=np.int64)
    seen = np.zeros(n_inst, dtype=np.bool_)
    for g in range(n_groups):
        for i in range(ptr[g], ptr[g + 1]):
            x = ids[i]
            hit[i] = resident[x]
            if not hit[i] and not seen[x]:
                seen[x] = True
                fills[g] += 1
        for i in range(ptr[g], ptr[g + 1]):
            seen[ids[i]] = False
    return hit, fills


class Static(CachePolicy):
    """The warm pool, fixed."""

    holds_group = False

    def replay(self, stream, warm, counts, lists, budget, victims, lead_unit=DEFAULT_LEAD_UNIT):
        hit, fills = replay_static(stream.instances, stream.group_ptr, warm, stream.num_instances)
        return Replay(hit, fills)
