"""``nexttoken``: lru plus a prefetch of the next token's experts, victims by predicted next use.

After group (step ``t``, MoE layer ``l``) the forecast of layer ``l``'s experts at step ``t + 1``
(:class:`coldset.analysis.forecast.NextTokenForecaster`, the group's candidate list from
:func:`coldset.analysis.forecast.nexttoken_lists`) replaces layer ``l``'s *predicted* flags, and
its experts not resident are prefetched (up to ``prefetch_budget`` copies a group) into slots not
used by the group, not in flight and not predicted, of any layer, least recent first. Demand
victims: unpredicted least recent first, then predicted, never one used by the group or in
flight; a demand miss that finds no slot is read in place, not admitted. Layer ``l``'s prefetches
stay in flight until group (``t + 1``, ``l``). No victim (demand or prefetch) among the instances
the last ``L`` groups used or prefetched (``lru_guard``'s bar). The gate
(:func:`coldset.analysis.policies.base.prefetch_lead_unit`) judges layer ``l``'s previous list at
each group of layer ``l``; while it is closed the group neither prefetches nor flags its forecast as
predicted (its victims are then ``lru_guard``'s). The engine's slot cache follows the same rules.
"""

from __future__ import annotations

import numpy as np

from coldset.analysis.compiled import jit
from coldset.analysis.policies.base import DEFAULT_LEAD_UNIT, OWN_LAYER, CachePolicy, Replay, guard_groups, recording
from coldset.analysis.policies.pool import (admit_demand, classify_group, end_group, evict, gate_step, largest_group,
                                            link_tail)


@jit
def replay_nexttoken(ids, ptr, warm, n_inst, n_exp, n_layers, pred, budget, record, victims, guard, lead_unit):
    """``nexttoken`` (see the module doc): LRU list as :func:`coldset.analysis.policies.lru.replay_lru`,
    victims by (predicted, last use), the forecast's flags replaced per layer after each group, the prefetch of the
    group's list (up to ``budget`` copies, ``budget < 0``: no cut) into unpredicted, unused, not
    in-flight slots of any layer, in flight until the next group of the same layer; no victim
    (demand or prefetch) among the instances the last ``guard`` groups used or prefetched; the
    prefetch only while the gate (``lead_unit``,
    :func:`coldset.analysis.policies.base.prefetch_lead_unit`; < 0: none, always open) is open (and
    the predicted flags too: a closed gate leaves lru_guard's victims). Returns (hit [N], fills [G],
    prefetches [G], useful, issued [G, W], wasted)."""
    n = ids.size
    n_groups = ptr.size - 1
    width = pred.shape[1]
    hit = np.zeros(n, dtype=np.bool_)
    fills = np.zeros(n_groups, dtype=np.int64)
    prefetches = np.zeros(n_groups, dtype=np.int64)
    issued = np.full((n_groups, width), -1, dtype=pred.dtype)  # (the lists' own int type: int32 where they fit)
    wasted = 0
    useful = 0
    resident = np.zeros(n_inst, dtype=np.bool_)
    protected = np.zeros(n_inst + 1, dtype=np.bool_)
    in_group = np.zeros(n_inst, dtype=np.bool_)
    used = np.zeros(n_inst + 1, dtype=np.bool_)
    predicted = np.zeros(n_inst + 1, dtype=np.bool_)
    inflight = np.zeros(n_inst + 1, dtype=np.bool_)
    unused_prefetch = np.zeros(n_inst, dtype=np.bool_)
    last_group = np.full(n_layers, -1, dtype=np.int64)  # the previous group of each layer
    inst_group = np.full(n_inst + 1, -(2**62), dtype=np.int64)  # the guard: each instance's last group
    acc = np.zeros(3, dtype=np.int64)  # the gate's running sums
    want = np.zeros((n_layers, max(width, 1)), dtype=np.int64)
    want_n = np.zeros(n_layers, dtype=np.int64)
    want_group = np.full(n_layers, -1, dtype=np.int64)
    mark = np.zeros(n_inst, dtype=np.bool_)
    head = n_inst  # sentinel
    nxt = np.full(n_inst + 1, head, dtype=np.int64)
    prv = np.full(n_inst + 1, head, dtype=np.int64)
    for j in range(warm.size):
        x = warm[j]
        resident[x] = True
        link_tail(nxt, prv, head, x)
    max_group = max(largest_group(ptr), 1)
    missed = np.empty(max_group, dtype=np.int64)
    for g in range(n_groups):
        s = ptr[g]
        e = ptr[g + 1]
        layer = ids[s] // n_exp
        pg = last_group[layer]
        if pg >= 0:  # 1. commit the previous group of this layer's prefetches
            for q in range(width):
                x = issued[pg, q]
                if x >= 0:
                    inflight[x] = False
        n_miss = classify_group(ids, s, e, resident, protected, in_group, hit, missed)
        fills[g] = n_miss
        for i in range(s, e):
            if hit[i] and unused_prefetch[ids[i]]:
                unused_prefetch[ids[i]] = False
                useful += 1
        # 2. demand: unpredicted least recent first, then predicted; never used by the group or in flight
        v = nxt[head]
        second = False
        for m in range(n_miss):
            while True:
                while v != head and (protected[v] or inflight[v] or predicted[v] != second
                                     or inst_group[v] > g - guard):
                    v = nxt[v]
                if v != head or second:
                    break
                second = True
                v = nxt[head]
            if v == head:  # every slot is used by this group or in flight: read in place, not admitted
                break
            after, w = evict(nxt, prv, resident, unused_prefetch, v)
            wasted += w
            admit_demand(ids, missed[m], v, resident, protected, nxt, prv, head, record, victims)
            v = after
        end_group(ids, s, e, missed, n_miss, in_group, protected, used, resident, nxt, prv, head)
        for i in range(s, e):
            inst_group[ids[i]] = g
        # the gate: this layer's last list against this group's selections, then this group's list
        open_gate = True
        if lead_unit >= 0:
            open_gate = gate_step(acc, want, want_n, want_group, layer, layer, g, ids, s, e, mark, lead_unit, pred,
                                  resident)
        # 3. the forecast replaces this layer's predicted flags (none while the gate is closed)
        if pg >= 0:
            for q in range(width):
                if pred[pg, q] >= 0:
                    predicted[pred[pg, q]] = False
        for q in range(width):
            if pred[g, q] >= 0:
                predicted[pred[g, q]] = open_gate
        last_group[layer] = g
        # 4. prefetch: unpredicted, unused, not in-flight, not guarded victims of any layer, least recent first
        v = nxt[head]
        for q in range(width if open_gate else 0):
            x = pred[g, q]
            if x < 0 or resident[x]:
                continue
            if budget >= 0 and prefetches[g] >= budget:
                break
            while v != head and (used[v] or inflight[v] or predicted[v] or inst_group[v] > g - guard):
                v = nxt[v]
            if v == head:
                break
            after, w = evict(nxt, prv, resident, unused_prefetch, v)
            wasted += w
            resident[x] = True
            inflight[x] = True
            unused_prefetch[x] = True
            link_tail(nxt, prv, head, x)
            inst_group[x] = g
            issued[g, prefetches[g]] = x
            prefetches[g] += 1
            v = after
        for i in range(s, e):
            used[ids[i]] = False
    return hit, fills, prefetches, useful, issued, wasted

class NextToken(CachePolicy):
    """Prefetch of the next token's forecast experts; demand victims unpredicted first."""

    lists = OWN_LAYER
    budget = True
    gated = True

    def replay(self, stream, warm, counts, lists, budget, victims, lead_unit=DEFAULT_LEAD_UNIT):
        record, rec = recording(victims)
        hit, fills, prefetches, useful, issued, wasted = replay_nexttoken(
            stream.instances, stream.group_ptr, warm, stream.num_instances, stream.num_experts,
            stream.num_moe_layers, lists, -1 if budget is None else int(budget), record, rec,
            guard_groups(stream.num_moe_layers), int(lead_unit))
        return Replay(hit, fills, prefetches, int(useful), issued, int(wasted))
