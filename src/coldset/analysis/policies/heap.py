"""The keyed replay of ``lfu`` and ``belady``: victims by the smallest key in a binary min-heap.

The heap holds (key1, key2, instance) entries with lazy deletion: every access pushes the
instance's new key, so an entry is live only while it equals the current key of a resident,
unprotected instance (a protected instance is accessed in this group, so its old entry is stale
anyway). Ties by instance id ascending.
"""

from __future__ import annotations

import numpy as np

from coldset.analysis.compiled import jit
from coldset.analysis.policies.pool import classify_group, largest_group

#: ``replay_keyed``'s ``policy`` argument.
LFU_KEYS = 0
BELADY_KEYS = 1


@jit
def heap_less(k1, k2, ins, i, j):
    if k1[i] != k1[j]:
        return k1[i] < k1[j]
    if k2[i] != k2[j]:
        return k2[i] < k2[j]
    return ins[i] < ins[j]


@jit
def heap_swap(k1, k2, ins, i, j):
    t1 = k1[i]
    k1[i] = k1[j]
    k1[j] = t1
    t2 = k2[i]
    k2[i] = k2[j]
    k2[j] = t2
    t3 = ins[i]
    ins[i] = ins[j]
    ins[j] = t3


@jit
def heap_push(k1, k2, ins, size, a, b, x):
    k1[size] = a
    k2[size] = b
    ins[size] = x
    i = size
    while i > 0:
        p = (i - 1) // 2
        if heap_less(k1, k2, ins, i, p):
            heap_swap(k1, k2, ins, i, p)
            i = p
        else:
            break
    return size + 1


@jit
def heap_pop(k1, k2, ins, size):
    """Remove the minimum (moved to index ``size - 1``); return the new size."""
    size -= 1
    heap_swap(k1, k2, ins, 0, size)
    i = 0
    while True:
        l = 2 * i + 1
        if l >= size:
            break
        c = l
        if l + 1 < size and heap_less(k1, k2, ins, l + 1, l):
            c = l + 1
        if heap_less(k1, k2, ins, c, i):
            heap_swap(k1, k2, ins, c, i)
            i = c
        else:
            break
    return size


@jit
def replay_keyed(ids, ptr, warm, warm_count, n_inst, policy, next_tick, record, victims, guard):
    """lfu (policy :data:`LFU_KEYS`) or belady (:data:`BELADY_KEYS`). Keys: lfu (count, last_use); belady (-next_use, 0)
    with ties by instance id. ``guard`` > 0: no victim among the instances the last ``guard`` groups
    used (this one included; their entries are set aside and pushed back after the group); the
    misses past the other slots are read in place. Returns (hit [N], fills [G]); ``victims[i]``
    (when ``record``) is the instance evicted to admit selection ``i`` (its first occurrence in the
    group)."""
    n = ids.size
    n_groups = ptr.size - 1
    hit = np.zeros(n, dtype=np.bool_)
    fills = np.zeros(n_groups, dtype=np.int64)
    resident = np.zeros(n_inst, dtype=np.bool_)
    protected = np.zeros(n_inst, dtype=np.bool_)
    in_group = np.zeros(n_inst, dtype=np.bool_)
    key1 = np.zeros(n_inst, dtype=np.float64)
    key2 = np.zeros(n_inst, dtype=np.float64)
    count = np.zeros(n_inst, dtype=np.float64)
    cap = warm.size
    max_group = largest_group(ptr)
    heap_cap = 4 * n_inst + max_group + 64
    h1 = np.empty(heap_cap, dtype=np.float64)
    h2 = np.empty(heap_cap, dtype=np.float64)
    hi = np.empty(heap_cap, dtype=np.int64)
    size = 0
    # first use of every instance (belady's key for the warm pool)
    first = np.full(n_inst, np.inf)
    for i in range(n - 1, -1, -1):
        first[ids[i]] = i
    for j in range(cap):
        x = warm[j]
        resident[x] = True
        count[x] = warm_count[j]
        if policy == 0:
            key1[x] = count[x]
            key2[x] = j - cap
        else:
            key1[x] = -first[x]
            key2[x] = 0.0
        size = heap_push(h1, h2, hi, size, key1[x], key2[x], x)
    missed = np.empty(max(max_group, 1), dtype=np.int64)
    last_group = np.full(n_inst, -(2**62), dtype=np.int64)
    aside = np.empty(n_inst, dtype=np.int64)  # guarded live entries popped this group
    for g in range(n_groups):
        s = ptr[g]
        e = ptr[g + 1]
        n_miss = classify_group(ids, s, e, resident, protected, in_group, hit, missed)
        fills[g] = n_miss
        n_aside = 0
        for m in range(n_miss):
            v = -1
            while size > 0:
                size = heap_pop(h1, h2, hi, size)
                y = hi[size]
                if resident[y] and not protected[y] and h1[size] == key1[y] and h2[size] == key2[y]:
                    if last_group[y] > g - guard:
                        aside[n_aside] = y
                        n_aside += 1
                        resident[y] = False  # (marked off while aside: a second entry of it is skipped)
                        continue
                    v = y
                    break
            if v < 0:  # every other slot is guarded: the rest are read in place, not admitted
                break
            resident[v] = False
            i = missed[m]
            resident[ids[i]] = True
            protected[ids[i]] = True  # its stale entries must not make it a victim in this group
            if record:
                victims[i] = v
        for m in range(n_miss):
            in_group[ids[missed[m]]] = False
        for j in range(n_aside):
            resident[aside[j]] = True
        # key updates in rank order (the last occurrence in the group sets the final key)
        for i in range(s, e):
            x = ids[i]
            protected[x] = False
            count[x] += 1.0
            if policy == 0:
                key1[x] = count[x]
                key2[x] = i
            else:
                key1[x] = -next_tick[i]
                key2[x] = 0.0
        if size + (e - s) + n_aside > heap_cap:
            # rebuild from the residents' current keys (drops every stale entry)
            size = 0
            for y in range(n_inst):
                if resident[y]:
                    size = heap_push(h1, h2, hi, size, key1[y], key2[y], y)
        else:
            for i in range(s, e):  # one push per distinct instance of the group
                x = ids[i]
                if not in_group[x]:
                    in_group[x] = True
                    size = heap_push(h1, h2, hi, size, key1[x], key2[x], x)
            for i in range(s, e):
                in_group[ids[i]] = False
            for j in range(n_aside):  # the guarded entries back (their keys unchanged unless used here)
                y = aside[j]
                size = heap_push(h1, h2, hi, size, key1[y], key2[y], y)
        for i in range(s, e):
            last_group[ids[i]] = g
    return hit, fills
