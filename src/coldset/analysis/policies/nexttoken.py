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
from coldset.analysis.policies.pool import (admit_demand, admit_prefetch, classify_group, count_useful, end_group,
                                            gate_state, gate_step, land_layer, replay_outputs, recency_pool)


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
    n_groups = ptr.size - 1
    width = pred.shape[1]
    hit, fills, prefetches, issued = replay_outputs(ids, ptr, pred)
    wasted = 0
    useful = 0
    (resident, nxt, prv, protected, in_group, used, inflight, unused_prefetch, last_group,
     missed) = recency_pool(warm, n_inst, ptr)
    head = n_inst  # sentinel
    predicted = np.zeros(n_inst + 1, dtype=np.bool_)
    layer_group = np.full(n_layers, -1, dtype=np.int64)  # each layer's last group
    acc, want, want_n, want_group, mark = gate_state(n_layers, width, n_inst)
    for g in range(n_groups):
        s = ptr[g]
        e = ptr[g + 1]
        layer = ids[s] // n_exp
        pg = layer_group[layer]
        land_layer(issued, pg, inflight)  # 1. commit the previous group of this layer's prefetches
        n_miss = classify_group(ids, s, e, resident, protected, in_group, hit, missed)
        fills[g] = n_miss
        useful += count_useful(ids, s, e, hit, unused_prefetch)
        # 2. demand: unpredicted least recent first, then predicted; never used by the group or in flight
        v = nxt[head]
        second = False
        for m in range(n_miss):
            while True:
                while v != head and (protected[v] or inflight[v] or predicted[v] != second
                                     or last_group[v] > g - guard):
                    v = nxt[v]
                if v != head or second:
                    break
                second = True
                v = nxt[head]
            if v == head:  # every slot is used by this group or in flight: read in place, not admitted
                break
            v, w = admit_demand(ids, missed[m], v, resident, protected, unused_prefetch, nxt, prv, head, record,
                                victims)
            wasted += w
        end_group(ids, s, e, g, missed, n_miss, in_group, protected, used, resident, nxt, prv, head, last_group)
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
        layer_group[layer] = g
        # 4. prefetch: unpredicted, unused, not in-flight, not guarded victims of any layer, least recent first
        v = nxt[head]
        for q in range(width if open_gate else 0):
            x = pred[g, q]
            if x < 0 or resident[x]:
                continue
            if budget >= 0 and prefetches[g] >= budget:
                break
            while v != head and (used[v] or inflight[v] or predicted[v] or last_group[v] > g - guard):
                v = nxt[v]
            if v == head:
                break
            v, w = admit_prefetch(x, v, g, resident, inflight, unused_prefetch, nxt, prv, head, last_group, issued,
                                  prefetches)
            wasted += w
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
