"""``policies.heap.replay_keyed`` (lfu and belady) against a brute-force replay that scans every
resident for the smallest key at each miss."""

import numpy as np
import pytest

from coldset.analysis.policies.belady import next_use_ticks
from coldset.analysis.policies.heap import BELADY_KEYS, LFU_KEYS, replay_keyed


def brute_keyed(ids, ptr, warm, warm_count, n_inst, policy, next_tick, guard):
    """Victim = the smallest (key1, key2, id) among residents neither used in this group nor in the
    last ``guard`` groups; misses past that are read in place."""
    resident, key, count, last_group = set(), {}, {}, {}
    first = {}
    for i in range(len(ids) - 1, -1, -1):
        first[int(ids[i])] = i
    for j, x in enumerate(warm.tolist()):
        resident.add(x)
        count[x] = float(warm_count[j])
        key[x] = (count[x], float(j - len(warm))) if policy == LFU_KEYS else (-first.get(x, np.inf), 0.0)
    hit = np.zeros(len(ids), dtype=bool)
    fills = np.zeros(len(ptr) - 1, dtype=np.int64)
    victims = np.full(len(ids), -1, dtype=np.int64)
    for g in range(len(ptr) - 1):
        group = [int(x) for x in ids[ptr[g]:ptr[g + 1]]]
        used = set(group)
        missed = []
        for i, x in enumerate(group, start=int(ptr[g])):
            if x in resident:
                hit[i] = True
            elif x not in [ids[k] for k in missed]:
                missed.append(i)
        fills[g] = len(missed)
        for i in missed:
            free = [y for y in resident if y not in used and last_group.get(y, -(2**62)) <= g - guard]
            if not free:
                break
            v = min(free, key=lambda y: (key[y], y))
            resident.remove(v)
            resident.add(int(ids[i]))
            victims[i] = v
        for i, x in enumerate(group, start=int(ptr[g])):
            count[x] = count.get(x, 0.0) + 1.0
            key[x] = (count[x], float(i)) if policy == LFU_KEYS else (-next_tick[i], 0.0)
            last_group[x] = g
    return hit, fills, victims


@pytest.mark.parametrize("seed", range(4))
def test_replay_keyed_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    for _ in range(60):
        n_inst = int(rng.integers(2, 30))
        groups = [rng.choice(n_inst, size=int(rng.integers(1, min(n_inst, 8) + 1)), replace=False)
                  for _ in range(int(rng.integers(1, 40)))]
        ids = np.concatenate(groups).astype(np.int64)
        ptr = np.concatenate([[0], np.cumsum([len(x) for x in groups])]).astype(np.int64)
        warm = rng.choice(n_inst, size=int(rng.integers(1, n_inst)), replace=False).astype(np.int64)
        warm_count = rng.integers(0, 4, size=warm.size).astype(np.float64)
        for policy, guard in ((LFU_KEYS, 0), (LFU_KEYS, 1), (LFU_KEYS, 2), (LFU_KEYS, 5), (BELADY_KEYS, 0)):
            next_tick = next_use_ticks(ids, n_inst) if policy == BELADY_KEYS else np.zeros(0)
            victims = np.full(ids.size, -1, dtype=np.int64)
            hit, fills = replay_keyed(ids, ptr, warm, warm_count, n_inst, policy, next_tick, True, victims, guard)
            want_hit, want_fills, want_victims = brute_keyed(ids, ptr, warm, warm_count, n_inst, policy,
                                                             next_tick, guard)
            np.testing.assert_array_equal(hit, want_hit)
            np.testing.assert_array_equal(fills, want_fills)
            np.testing.assert_array_equal(victims, want_victims)
