"""The slot pool's shared pieces, compiled with the replay loops that use them.

Every replay loop follows one per-group protocol:

- pass 1 (:func:`classify_group`): hit = resident at the group's start; the group's resident
  instances are protected (never a victim in this group);
- pass 2: one victim per distinct missed instance from the policy's order, skipping protected
  residents;
- pass 3: in rank order, the missed instances take the victims' slots, and keys are updated.

The recency policies keep residents on a doubly linked list in last-use order (head = least
recent): :func:`recency_pool`, :func:`link_tail`, :func:`unlink`, :func:`evict`, :func:`admit_demand`,
:func:`end_group`, :func:`admit_prefetch`. The keyed policies (lfu, belady) use the binary min-heap of
:mod:`coldset.analysis.policies.heap`.

The prefetching policies' gate (:func:`coldset.analysis.policies.base.prefetch_lead_unit`):
:func:`gate_state` before the first group, :func:`gate_evaluate` at a group of the layer a pending
list was for, :func:`gate_open` before a group's prefetch.
"""

from __future__ import annotations

import numpy as np

from coldset.analysis.compiled import jit
from coldset.analysis.policies.base import COPY_UNIT, GATE_SHIFT, GATE_START_WANTED


@jit
def largest_group(ptr):
    """The largest group's selection count."""
    out = 0
    for g in range(ptr.size - 1):
        out = max(out, ptr[g + 1] - ptr[g])
    return out


@jit
def replay_outputs(ids, ptr, pred):
    """A prefetching replay's outputs before its first group: hit bool ``[N]``, fills ``[G]``,
    prefetches ``[G]`` and issued ``[G, W]`` (-1 padded, in the lists' own int type: int32 where
    they fit)."""
    n_groups = ptr.size - 1
    hit = np.zeros(ids.size, dtype=np.bool_)
    fills = np.zeros(n_groups, dtype=np.int64)
    prefetches = np.zeros(n_groups, dtype=np.int64)
    issued = np.full((n_groups, pred.shape[1]), -1, dtype=pred.dtype)
    return hit, fills, prefetches, issued


@jit
def classify_group(ids, s, e, resident, protected, in_group, hit, missed):
    """Pass 1 of a group (selections ``s..e-1``): mark hits and protect their instances; list each
    missed instance's first selection in ``missed``. Returns the number of missed instances."""
    n_miss = 0
    for i in range(s, e):
        x = ids[i]
        if resident[x]:
            hit[i] = True
            protected[x] = True
        elif not in_group[x]:
            in_group[x] = True
            missed[n_miss] = i
            n_miss += 1
    return n_miss


@jit
def link_tail(nxt, prv, head, x):
    """Link instance ``x`` at the tail (most recent end) of the LRU list."""
    last = prv[head]
    nxt[last] = x
    prv[x] = last
    nxt[x] = head
    prv[head] = x


@jit
def recency_pool(warm, n_inst, ptr):
    """The recency pool at a replay's start: ``warm`` resident, on the LRU list in its order (the
    sentinel ``head`` is ``n_inst``), nothing protected, in the group, used by the step, in flight
    or an unused prefetch, no instance's last group (the guard's) recent. Returns (resident, nxt,
    prv, protected, in_group, used, inflight, unused_prefetch, last_group, missed:
    :func:`classify_group`'s room for one group's misses)."""
    resident = np.zeros(n_inst, dtype=np.bool_)
    head = n_inst
    nxt = np.full(n_inst + 1, head, dtype=np.int64)
    prv = np.full(n_inst + 1, head, dtype=np.int64)
    for j in range(warm.size):
        resident[warm[j]] = True
        link_tail(nxt, prv, head, warm[j])
    protected = np.zeros(n_inst + 1, dtype=np.bool_)
    in_group = np.zeros(n_inst, dtype=np.bool_)
    used = np.zeros(n_inst + 1, dtype=np.bool_)
    inflight = np.zeros(n_inst + 1, dtype=np.bool_)
    unused_prefetch = np.zeros(n_inst, dtype=np.bool_)
    last_group = np.full(n_inst + 1, -(2**62), dtype=np.int64)
    missed = np.empty(max(largest_group(ptr), 1), dtype=np.int64)
    return resident, nxt, prv, protected, in_group, used, inflight, unused_prefetch, last_group, missed


@jit
def unlink(nxt, prv, v):
    after = nxt[v]
    nxt[prv[v]] = after
    prv[after] = prv[v]
    return after


@jit
def evict(nxt, prv, resident, unused_prefetch, v):
    """Evict instance ``v`` from its slot (off the LRU list, not resident); returns (the instance
    after it in the list, 1 if ``v`` was a prefetch never used: wasted bytes, else 0)."""
    after = unlink(nxt, prv, v)
    resident[v] = False
    wasted = 1 if unused_prefetch[v] else 0
    unused_prefetch[v] = False
    return after, wasted


@jit
def admit_demand(ids, i, v, resident, protected, unused_prefetch, nxt, prv, head, record, victims):
    """Selection ``i``'s instance takes victim ``v``'s slot: resident, protected for the rest of its
    group, most recent in the LRU list; ``victims[i] = v`` when recording. Returns :func:`evict`'s
    (the instance after ``v`` in the list, wasted)."""
    after, wasted = evict(nxt, prv, resident, unused_prefetch, v)
    x = ids[i]
    resident[x] = True
    protected[x] = True
    link_tail(nxt, prv, head, x)
    if record:
        victims[i] = v
    return after, wasted


@jit
def end_group(ids, s, e, g, missed, n_miss, in_group, protected, used, resident, nxt, prv, head, last_group):
    """After group ``g``'s demand admissions: its instances are no longer protected, count as used
    by this step, have ``g`` as their last group (the guard's), and the resident ones move to the
    most recent end of the LRU list in selection order."""
    for m in range(n_miss):
        in_group[ids[missed[m]]] = False
    for i in range(s, e):
        x = ids[i]
        protected[x] = False
        used[x] = True
        if resident[x]:
            unlink(nxt, prv, x)
            link_tail(nxt, prv, head, x)
    for i in range(s, e):
        last_group[ids[i]] = g


@jit
def admit_prefetch(x, v, g, resident, inflight, unused_prefetch, nxt, prv, head, last_group, issued, prefetches):
    """Group ``g``'s prefetch of instance ``x`` takes victim ``v``'s slot: resident, in flight, an
    unused prefetch, most recent on the LRU list, ``g`` its last group (the guard's), the next entry
    of ``issued[g]``. Returns :func:`evict`'s (the instance after ``v`` in the list, wasted)."""
    after, wasted = evict(nxt, prv, resident, unused_prefetch, v)
    resident[x] = True
    inflight[x] = True
    unused_prefetch[x] = True
    link_tail(nxt, prv, head, x)
    last_group[x] = g
    issued[g, prefetches[g]] = x
    prefetches[g] += 1
    return after, wasted


@jit
def land_layer(issued, pg, inflight):
    """The prefetches issued after group ``pg`` (``issued[pg]``, -1 padded; ``pg`` < 0: none) have
    reached their layer: no longer in flight."""
    if pg < 0:
        return
    for q in range(issued.shape[1]):
        if issued[pg, q] >= 0:
            inflight[issued[pg, q]] = False


@jit
def count_useful(ids, s, e, hit, unused_prefetch):
    """The prefetched instances selections ``s..e-1`` hit for the first time (each then no longer
    an unused prefetch)."""
    n = 0
    for i in range(s, e):
        if hit[i] and unused_prefetch[ids[i]]:
            unused_prefetch[ids[i]] = False
            n += 1
    return n


@jit
def gate_state(n_layers, width, n_inst):
    """The gate's state before the first group: running sums ``acc`` int64 ``[3]`` (wanted
    :data:`coldset.analysis.policies.base.GATE_START_WANTED`, useful and saving 0), the pending
    list of each layer (``want [n_layers, W]``, its length ``want_n``, its group ``want_group``, -1:
    none) and the scratch ``mark`` bool ``[n_inst]`` (see :func:`gate_step`)."""
    acc = np.zeros(3, dtype=np.int64)
    acc[0] = GATE_START_WANTED
    want = np.zeros((n_layers, max(width, 1)), dtype=np.int64)
    want_n = np.zeros(n_layers, dtype=np.int64)
    want_group = np.full(n_layers, -1, dtype=np.int64)
    mark = np.zeros(n_inst, dtype=np.bool_)
    return acc, want, want_n, want_group, mark


@jit
def gate_evaluate(acc, want, want_n, want_group, layer, g, ids, s, e, mark, lead_unit):
    """The pending list of ``layer`` (``want[layer, :want_n[layer]]``, the instances it wanted,
    issued at group ``want_group[layer]``; -1: none) against group ``g``'s selections ``s..e-1``: the
    gate's running sums ``acc`` int64 ``[3]`` (wanted, useful, saving, in :data:`COPY_UNIT` parts)
    decay and take it in; the list is no longer pending."""
    if want_group[layer] < 0:
        return
    for i in range(s, e):
        mark[ids[i]] = True
    useful = 0
    for q in range(want_n[layer]):
        if mark[want[layer, q]]:
            useful += 1
    for i in range(s, e):
        mark[ids[i]] = False
    save = min(COPY_UNIT, (g - want_group[layer]) * lead_unit)
    acc[0] = acc[0] - (acc[0] >> GATE_SHIFT) + want_n[layer] * COPY_UNIT
    acc[1] = acc[1] - (acc[1] >> GATE_SHIFT) + useful * COPY_UNIT
    acc[2] = acc[2] - (acc[2] >> GATE_SHIFT) + useful * save
    want_group[layer] = -1


@jit
def gate_open(acc, lead_unit):
    """Whether the running saving, capped at what ``2**GATE_SHIFT`` groups' compute hides
    (``lead_unit << GATE_SHIFT``), beats the running waste (wanted - useful copies) by more than
    the margin ``wanted >> (GATE_SHIFT - 1)`` (:func:`coldset.analysis.policies.base.prefetch_lead_unit`)."""
    return min(acc[2], lead_unit << GATE_SHIFT) > (acc[0] - acc[1]) + (acc[0] >> (GATE_SHIFT - 1))


@jit
def list_layer(pred, g, n_exp):
    """The MoE layer group ``g``'s list ``pred[g]`` forecasts: its first entry's (-1: an empty list)."""
    for q in range(pred.shape[1]):
        if pred[g, q] >= 0:
            return pred[g, q] // n_exp
    return -1


@jit
def gate_step(acc, want, want_n, want_group, layer, target, g, ids, s, e, mark, lead_unit, pred, resident):
    """The gate at group ``g`` (layer ``layer``, selections ``s..e-1``): the pending list for
    ``layer`` judged (:func:`gate_evaluate`), then the group's list ``pred[g]``'s wanted instances
    (listed, not resident) kept as the pending list for layer ``target``, the layer it forecasts
    (``forecast``, ``nexttoken``: ``layer`` itself at the next step; ``lookahead``: a later layer of
    this step; < 0: an empty list, nothing kept). Returns whether the gate is open."""
    gate_evaluate(acc, want, want_n, want_group, layer, g, ids, s, e, mark, lead_unit)
    if target < 0:
        return gate_open(acc, lead_unit)
    nw = 0
    for q in range(pred.shape[1]):
        x = pred[g, q]
        if x >= 0 and not resident[x]:
            want[target, nw] = x
            nw += 1
    want_n[target] = nw
    want_group[target] = g
    return gate_open(acc, lead_unit)
