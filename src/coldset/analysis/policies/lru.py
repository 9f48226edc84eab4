"""The recency and frequency policies: ``lru``, ``lru_guard`` and ``lfu``.

- ``lru``: victim = smallest ``last_use``.
- ``lru_guard``: ``lru`` without a victim among the instances any of the last ``L`` groups used
  (:func:`coldset.analysis.policies.base.guard_groups`: this one included, a step's worth, ``L``
  MoE layers); the misses past the remaining residents are read in place, not admitted (they
  cross the link all the same: ``fills`` counts them). Why: where one step's distinct experts
  outnumber the slots (batch 8 at residency 0.25), lru evicts what the next step selects again and
  its hit rate falls under the static set's; the guard keeps the pool and streams the surplus.
  Where fewer residents than the slots were used by the last step, lru's victims are older than
  that anyway and the two replays are the same.
- ``lfu``: victim = smallest ``(count, last_use)``; ``count`` = profile count for warm instances
  (0 for others) + accesses during replay, kept across evictions (an instance's frequency is a
  property of the traffic, not of its stay in the pool); with ``lru_guard``'s bar (no victim the
  last ``L`` groups used; the misses past the other slots read in place).

:func:`replay_lru` is also the replay of the prefetching policies ``forecast`` and ``lookahead``
(:mod:`coldset.analysis.policies.forecast`, :mod:`coldset.analysis.policies.lookahead`): the same
loop with a prefetch list after each group.
"""

from __future__ import annotations

import numpy as np

from coldset.analysis.compiled import jit
from coldset.analysis.policies.base import DEFAULT_LEAD_UNIT, CachePolicy, Replay, guard_groups, recording
from coldset.analysis.policies.heap import LFU_KEYS, replay_keyed
from coldset.analysis.policies.pool import (admit_demand, admit_prefetch, classify_group, count_useful, end_group,
                                            gate_state, gate_step, land_layer, list_layer,
                                            replay_outputs, recency_pool)


@jit
def replay_lru(ids, ptr, warm, n_inst, n_exp, n_layers, pred, record, victims, guard, own_layer, lead_unit, allow):
    """LRU through a doubly linked list in last_use order (head = least recent), plus the prefetch
    of ``pred[g]`` after each group g (``forecast``, ``lookahead``: see their module docs); plain
    ``lru`` is the same replay with empty lists (no prefetch, so nothing in flight, and a pool of at
    least one group always has a victim outside the group). ``guard`` > 0: no victim (demand or
    prefetch) among the instances the last ``guard`` groups used or prefetched (this one included);
    the misses past the other slots are read in place, not admitted. ``own_layer``: the lists name
    the group's own layer at the next step, and a prefetch is in flight until that layer's next
    group (else: until the step ends). ``lead_unit`` >= 0: the prefetch gate
    (:func:`coldset.analysis.policies.base.prefetch_lead_unit`, a list judged at the next group of
    the layer it forecasts); < 0: none. ``allow`` bool ``[G]`` (empty: no such condition): with the
    gate, a further condition on group g's list (``forecast``'s duel,
    :func:`coldset.analysis.policies.forecast.prefetch_duel`). Returns (hit [N], fills [G],
    prefetches [G], useful, issued [G, W] (copied after each group, in order, -1 padded), wasted
    (evicted before any hit))."""
    n_groups = ptr.size - 1
    width = pred.shape[1]
    hit, fills, prefetches, issued = replay_outputs(ids, ptr, pred)
    wasted = 0
    useful = 0
    (resident, nxt, prv, protected, in_group, used, inflight, unused_prefetch, last_group,
     missed) = recency_pool(warm, n_inst, ptr)
    head = n_inst  # sentinel
    listed = np.zeros(n_inst, dtype=np.bool_)
    flight = np.empty(n_inst, dtype=np.int64)
    n_flight = 0
    layer_group = np.full(n_layers, -1, dtype=np.int64)  # own_layer: each layer's last group
    acc, want, want_n, want_group, mark = gate_state(n_layers, width, n_inst)
    prev_layer = n_inst
    for g in range(n_groups):
        s = ptr[g]
        e = ptr[g + 1]
        layer = ids[s] // n_exp
        if own_layer:  # this layer's prefetches of the last step have reached their layer
            land_layer(issued, layer_group[layer], inflight)
            layer_group[layer] = g
        elif layer <= prev_layer:  # a new step: the previous step's prefetches are committed
            for j in range(n_flight):
                inflight[flight[j]] = False
            n_flight = 0
        prev_layer = layer
        n_miss = classify_group(ids, s, e, resident, protected, in_group, hit, missed)
        fills[g] = n_miss
        useful += count_useful(ids, s, e, hit, unused_prefetch)
        v = nxt[head]
        for m in range(n_miss):
            while v != head and (protected[v] or inflight[v] or last_group[v] > g - guard):
                v = nxt[v]
            if v == head:  # every slot is used by this group, in flight or guarded: read in place, not admitted
                break
            v, w = admit_demand(ids, missed[m], v, resident, protected, unused_prefetch, nxt, prv, head, record,
                                victims)
            wasted += w
        end_group(ids, s, e, g, missed, n_miss, in_group, protected, used, resident, nxt, prv, head, last_group)
        gate = True  # the prefetch gate: the last list for this layer against this group's selections
        if lead_unit >= 0:
            target = layer if own_layer else list_layer(pred, g, n_exp)  # (lookahead: a later layer)
            gate = gate_step(acc, want, want_n, want_group, layer, target, g, ids, s, e, mark, lead_unit, pred,
                             resident) and (allow.size == 0 or allow[g])
        # prefetch after the group: victims in layers 0..layer, not used, not listed, not in flight, not guarded
        for q in range(width):
            if pred[g, q] >= 0:
                listed[pred[g, q]] = True
        v = nxt[head]
        for q in range(width if gate else 0):
            x = pred[g, q]
            if x < 0 or resident[x]:
                continue
            while v != head and (v // n_exp > layer or used[v] or listed[v] or inflight[v]
                                 or last_group[v] > g - guard):
                v = nxt[v]
            if v == head:
                break
            v, w = admit_prefetch(x, v, g, resident, inflight, unused_prefetch, nxt, prv, head, last_group, issued,
                                  prefetches)
            wasted += w
            if not own_layer:  # (own_layer: released by the issued lists of its layer's last group)
                flight[n_flight] = x
                n_flight += 1
        for q in range(width):
            if pred[g, q] >= 0:
                listed[pred[g, q]] = False
        for i in range(s, e):
            used[ids[i]] = False
    return hit, fills, prefetches, useful, issued, wasted


def replay_with_lists(stream, warm, lists, victims, guard: int = 0, own_layer: bool = False,
                      lead_unit: int = -1, allow: np.ndarray | None = None) -> Replay:
    """:func:`replay_lru` on ``stream`` with the prefetch ``lists`` int64 ``[G, W]`` (``W = 0``: none) and
    the gate's further condition ``allow`` bool ``[G]`` (None: none)."""
    record, rec = recording(victims)
    hit, fills, prefetches, useful, issued, wasted = replay_lru(
        stream.instances, stream.group_ptr, warm, stream.num_instances, stream.num_experts, stream.num_moe_layers,
        lists, record, rec, guard, own_layer, lead_unit, np.zeros(0, dtype=np.bool_) if allow is None else allow)
    return Replay(hit, fills, prefetches, int(useful), issued, int(wasted))


def no_lists(stream) -> np.ndarray:
    """An empty prefetch list per group."""
    return np.zeros((stream.num_groups, 0), dtype=np.int64)


class LRU(CachePolicy):
    """Least recently used."""

    def replay(self, stream, warm, counts, lists, budget, victims, lead_unit=DEFAULT_LEAD_UNIT):
        r = replay_with_lists(stream, warm, no_lists(stream), victims)
        return Replay(r.hit, r.fills)


class LRUGuard(CachePolicy):
    """Least recently used, never a victim the last step used (a step's misses past that are read in place)."""

    def replay(self, stream, warm, counts, lists, budget, victims, lead_unit=DEFAULT_LEAD_UNIT):
        r = replay_with_lists(stream, warm, no_lists(stream), victims, guard_groups(stream.num_moe_layers))
        return Replay(r.hit, r.fills)


class LFU(CachePolicy):
    """Least frequently used (profile counts + replay accesses), ties by least recent; lru_guard's bar."""

    def replay(self, stream, warm, counts, lists, budget, victims, lead_unit=DEFAULT_LEAD_UNIT):
        record, rec = recording(victims)
        hit, fills = replay_keyed(stream.instances, stream.group_ptr, warm, counts[warm], stream.num_instances,
                                  LFU_KEYS, np.zeros(0), record, rec, guard_groups(stream.num_moe_layers))
        return Replay(hit, fills)
