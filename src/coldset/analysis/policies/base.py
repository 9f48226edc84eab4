"""The interface every cache policy of the simulator implements, and the rules policies share.

A policy is a :class:`CachePolicy`: what it needs (``holds_group``: the pool must hold the
largest group; ``lists``: which prefetch lists it replays; ``budget``: whether it
takes a prefetch budget; ``from_trace``: whether a trace alone can drive it) and one method,
:meth:`CachePolicy.replay`, that runs its replay loop and returns a :class:`Replay`.
:func:`coldset.analysis.simulate.simulate` checks the inputs against those fields, chooses the
warm pool, calls ``replay`` and counts the result; the registry in
:mod:`coldset.analysis.policies` maps names to policies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coldset.analysis.streams import AccessStream, CacheError

#: ``CachePolicy.lists``: each group's list names instances of the group's own MoE layer (the next
#: step's forecast) or of later MoE layers of the same step (the lookahead).
OWN_LAYER = "own_layer"
LATER_LAYER = "later_layer"


def guard_groups(num_moe_layers: int) -> int:
    """``lru_guard``'s bar: no victim among the instances the last this-many groups used (the
    current group included), one step's worth of groups (one per MoE layer). The prefetching
    policies keep the same bar for their demand and prefetch victims, a prefetched instance
    counting as used by the group that issued it (the engine's tick of a prefetch)."""
    return int(num_moe_layers)


#: The prefetch gate's unit: one copy's link time (:func:`prefetch_lead_unit`).
COPY_UNIT = 1024
#: The gate's running sums decay by ``x >> GATE_SHIFT`` at each evaluation (about the last 64 lists).
GATE_SHIFT = 6
#: The gate's running wanted sum before the first list (the useful and saving sums start at 0): a
#: few copies of waste that measured savings must outweigh first, so the gate starts closed.
GATE_START_WANTED = 4 * COPY_UNIT
#: ``lead_unit`` where no time model says better: one group's compute hides one copy.
DEFAULT_LEAD_UNIT = COPY_UNIT


def prefetch_lead_unit(step_ms: float, head_share: float, num_moe_layers: int, copy_ms: float) -> int:
    """The prefetch gate's measure of time: one (step, MoE layer) group's compute,
    ``step_ms * (1 - head_share) / L`` (the time model's per-layer share,
    :class:`coldset.analysis.time_model.TimeModel`), in :data:`COPY_UNIT` parts of one copy's link
    time ``copy_ms``; an integer, so the simulator and the engine take the same decisions.

    The gate (the prefetching policies' adaptive budget): a prefetch list's *wanted* entries are its
    instances not resident when it is issued; when their layer next runs, the *useful* ones are those
    it selects, and the *lead* is the groups between the two. A useful prefetch saves at most one copy
    on the critical path, ``min(COPY_UNIT, lead * lead_unit)`` (a copy issued fewer groups ahead than
    it takes to cross saves only the part that had crossed); a wasted one costs a whole copy of link
    time that the demand copies queue behind. Running sums of the three, W (wanted), U (useful) and
    S (saving), in :data:`COPY_UNIT` parts, decayed by ``x >> GATE_SHIFT`` at each list judged
    (:data:`GATE_SHIFT`), measured on the lists whether they were issued or not (so a closed gate
    reopens when the forecast improves); W starts at :data:`GATE_START_WANTED`, U and S at 0. The
    policy issues its list (up to its budget) while::

        min(S, lead_unit << GATE_SHIFT) > (W - U) + (W >> (GATE_SHIFT - 1))

    and none otherwise. The cap: the sums hold about ``2**GATE_SHIFT`` lists, over as many groups,
    whose compute hides at most ``lead_unit << GATE_SHIFT`` of copy time; a saving beyond it is
    none on a link the demand copies already keep busy, where a useful prefetch only replaces a
    demand copy by a prefetch copy while every wasted one still queues ahead of the demand. The
    margin ``W >> (GATE_SHIFT - 1)`` (a 32nd of the wanted copies, twice a decay's share): the
    saving must beat the waste by more than the estimates' noise, so a list whose saving only
    breaks even stays unissued; the inequality is strict and :data:`GATE_START_WANTED` makes the
    gate start closed (it opens once the judged lists show savings)."""
    if not (step_ms > 0 and copy_ms > 0 and num_moe_layers >= 1 and 0 <= head_share < 1):
        raise CacheError(f"prefetch_lead_unit: step_ms {step_ms}, copy_ms {copy_ms}, layers {num_moe_layers}, "
                         f"head_share {head_share}: each must be > 0 (head_share in [0, 1))")
    return max(0, int(round(COPY_UNIT * step_ms * (1 - head_share) / num_moe_layers / copy_ms)))


@dataclass(frozen=True)
class Replay:
    """What a policy's replay loop decided.

    ``hit`` bool ``[N]`` per selection; ``fills`` int64 ``[G]``: distinct missed instances per group
    (link transfers); ``prefetches`` int64 ``[G]``, ``useful_prefetches``, ``issued`` int64
    ``[G, W]`` (instances copied after each group, -1 padded) and ``wasted_prefetches`` for
    prefetching policies (None / 0 otherwise).
    """

    hit: np.ndarray
    fills: np.ndarray
    prefetches: np.ndarray | None = None
    useful_prefetches: int = 0
    issued: np.ndarray | None = None
    wasted_prefetches: int = 0


class CachePolicy:
    """One cache policy of the simulator (subclass it; register an instance in
    :data:`coldset.analysis.policies.REGISTRY`).

    ``holds_group``: the pool must hold the largest group, else :class:`CacheError` (the policies
    that admit every miss of a group); ``lists``: None, or
    :data:`OWN_LAYER` / :data:`LATER_LAYER` (the prefetch lists
    :func:`coldset.analysis.simulate.simulate` requires and checks);
    ``budget``: takes ``prefetch_budget`` (copies per group); ``gated``: its prefetch budget is the
    gate's (:func:`prefetch_lead_unit`), which takes ``lead_unit``; ``from_trace``: the cache stage can
    replay it from a trace alone (its lists, if any, come from a forecaster fitted on the trace).
    """

    holds_group: bool = True
    lists: str | None = None
    budget: bool = False
    gated: bool = False
    from_trace: bool = True

    def replay(self, stream: AccessStream, warm: np.ndarray, counts: np.ndarray, lists: np.ndarray | None,
               budget: int | None, victims: np.ndarray | None, lead_unit: int = DEFAULT_LEAD_UNIT) -> Replay:
        """Replay ``stream`` from the warm pool ``warm`` (instance ids, first victim first);
        ``counts`` float64 ``[L * E]`` the profile counts; ``lists`` int32 or int64 ``[G, W]`` the checked
        prefetch lists (policies with ``lists`` only); ``victims`` int64 ``[N]`` filled with -1, to
        record at each admitted selection the instance it evicted (None: not recorded);
        ``lead_unit``: the prefetch gate's (:func:`prefetch_lead_unit`; ``gated`` policies only)."""
        raise NotImplementedError


def recording(victims: np.ndarray | None) -> tuple[bool, np.ndarray]:
    """The replay loops' ``(record, victims)`` arguments: an empty array where nothing is recorded."""
    return victims is not None, victims if victims is not None else np.zeros(0, dtype=np.int64)


def check_lists(stream: AccessStream, lists: np.ndarray, kind: str) -> np.ndarray:
    """``lists`` as a C-contiguous int32 or int64 ``[G, W]`` (other integer types as int64) after
    checking it against ``stream`` and the policy's ``kind`` (:data:`OWN_LAYER` or
    :data:`LATER_LAYER`)."""
    pred = np.asarray(lists)
    pred = np.ascontiguousarray(pred, dtype=pred.dtype if pred.dtype in (np.int32, np.int64) else np.int64)
    n_inst = stream.num_instances
    if pred.ndim != 2 or pred.shape[0] != stream.num_groups:
        raise CacheError(f"predictions: one row per group expected ({stream.num_groups}), got {pred.shape}")
    if pred.size and (pred.min() < -1 or pred.max() >= n_inst):
        raise CacheError(f"predictions: instance ids must lie in [0, {n_inst}) or be -1")
    if stream.instances.size:
        # each group's layer as the instance bounds [start, end) (no division of the whole lists)
        start = (stream.instances[stream.group_ptr[:-1]] // stream.num_experts * stream.num_experts)[:, None]
        end = start + stream.num_experts
        if kind == OWN_LAYER:
            bad = (pred >= 0) & ((pred < start) | (pred >= end))
            what = "of another MoE layer (a group prefetches its own layer's next-step experts)"
        else:
            bad = (pred >= 0) & (pred < end)
            what = "of its own or an earlier MoE layer (a lookahead prefetches for later layers of its step)"
        if bad.any():
            raise CacheError(f"predictions: group {int(np.flatnonzero(bad.any(axis=1))[0])} lists an instance {what}")
    return pred
