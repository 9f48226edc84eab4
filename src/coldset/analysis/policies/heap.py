"""The keyed replay of ``lfu`` and ``belady``: victims by the smallest key in a binary min-heap.

The heap is indexed: it holds each resident instance once, ordered by its current key
(key1, key2, instance id), and ``pos`` gives an instance's heap index (-1 off the heap), so an
access moves the instance's entry in place instead of pushing a new one. The order is strict
(ties by instance id ascending), so the smallest unprotected, unguarded resident is one instance.
"""

from __future__ import annotations

import numpy as np

from coldset.analysis.compiled import jit
from coldset.analysis.policies.pool import classify_group, largest_group

#: ``replay_keyed``'s ``policy`` argument.
LFU_KEYS = 0
BELADY_KEYS = 1


@jit
def key_less(key1, key2, x, y):
    """Whether instance ``x``'s key orders before instance ``y``'s (ties by instance id)."""
    if key1[x] != key1[y]:
        return key1[x] < key1[y]
    if key2[x] != key2[y]:
        return key2[x] < key2[y]
    return x < y


@jit
def heap_place(heap, pos, i, x):
    heap[i] = x
    pos[x] = i


@jit
def sift_up(heap, pos, key1, key2, i):
    x = heap[i]
    while i > 0:
        p = (i - 1) // 2
        if key_less(key1, key2, x, heap[p]):
            heap_place(heap, pos, i, heap[p])
            i = p
        else:
            break
    heap_place(heap, pos, i, x)


@jit
def sift_down(heap, pos, key1, key2, size, i):
    x = heap[i]
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and key_less(key1, key2, heap[c + 1], heap[c]):
            c += 1
        if key_less(key1, key2, heap[c], x):
            heap_place(heap, pos, i, heap[c])
            i = c
        else:
            break
    heap_place(heap, pos, i, x)


@jit
def heap_set(heap, pos, key1, key2, size, x):
    """Put instance ``x`` at its current key: moved in place when on the heap, else added.
    Returns the new size."""
    i = pos[x]
    if i < 0:
        heap_place(heap, pos, size, x)
        sift_up(heap, pos, key1, key2, size)
        return size + 1
    sift_up(heap, pos, key1, key2, i)
    sift_down(heap, pos, key1, key2, size, pos[x])
    return size


@jit
def heap_pop(heap, pos, key1, key2, size):
    """Remove the smallest instance from the heap; returns (it, the new size)."""
    x = heap[0]
    pos[x] = -1
    size -= 1
    if size > 0:
        heap_place(heap, pos, 0, heap[size])
        sift_down(heap, pos, key1, key2, size, 0)
    return x, size


@jit
def heap_remove(heap, pos, key1, key2, size, x):
    """Take instance ``x`` off the heap; returns the new size."""
    i = pos[x]
    pos[x] = -1
    size -= 1
    if i < size:
        last = heap[size]
        heap_place(heap, pos, i, last)
        sift_up(heap, pos, key1, key2, i)
        sift_down(heap, pos, key1, key2, size, pos[last])
    return size


@jit
def replay_keyed(ids, ptr, warm, warm_count, n_inst, policy, next_tick, record, victims, guard):
    """lfu (policy :data:`LFU_KEYS`) or belady (:data:`BELADY_KEYS`). Keys: lfu (count, last_use); belady (-next_use, 0)
    with ties by instance id. ``guard`` > 0: no victim among the instances the last ``guard`` groups
    used (this one included; a resident stays off the heap from its use until ``guard`` groups
    later); the misses past the other slots are read in place. Returns
    (hit [N], fills [G]); ``victims[i]`` (when ``record``) is the instance evicted to admit
    selection ``i`` (its first occurrence in the group)."""
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
    heap = np.empty(max(n_inst, 1), dtype=np.int64)
    pos = np.full(n_inst, -1, dtype=np.int64)
    cap = warm.size
    max_group = largest_group(ptr)
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
        size = heap_set(heap, pos, key1, key2, size, x)
    missed = np.empty(max(max_group, 1), dtype=np.int64)
    last_group = np.full(n_inst, -(2**62), dtype=np.int64)
    aside = np.empty(n_inst, dtype=np.int64)  # residents popped this group and not evicted
    for g in range(n_groups):
        s = ptr[g]
        e = ptr[g + 1]
        if guard > 1 and g >= guard:  # the residents last used ``guard`` groups ago are victims again
            for i in range(ptr[g - guard], ptr[g - guard + 1]):
                x = ids[i]
                if resident[x] and pos[x] < 0 and last_group[x] == g - guard:
                    size = heap_set(heap, pos, key1, key2, size, x)
        n_miss = classify_group(ids, s, e, resident, protected, in_group, hit, missed)
        fills[g] = n_miss
        n_aside = 0
        for m in range(n_miss):
            v = -1
            while size > 0:
                y, size = heap_pop(heap, pos, key1, key2, size)
                if protected[y] or last_group[y] > g - guard:
                    aside[n_aside] = y
                    n_aside += 1
                    continue
                v = y
                break
            if v < 0:  # every other slot is protected or guarded: the rest are read in place, not admitted
                break
            resident[v] = False
            i = missed[m]
            resident[ids[i]] = True
            protected[ids[i]] = True
            if record:
                victims[i] = v
        for m in range(n_miss):
            in_group[ids[missed[m]]] = False
        # key updates in rank order (the last occurrence in the group sets the final key); each
        # resident moves to its new key at once (admitted ones added) so the heap stays ordered
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
            last_group[x] = g
            if resident[x]:
                if guard <= 1:
                    size = heap_set(heap, pos, key1, key2, size, x)
                elif pos[x] >= 0:  # guarded for the next groups: off the heap until released
                    size = heap_remove(heap, pos, key1, key2, size, x)
        for j in range(n_aside):  # back on the heap unless guarded in the next group
            y = aside[j]
            if last_group[y] <= g + 1 - guard:
                size = heap_set(heap, pos, key1, key2, size, y)
    return hit, fills
