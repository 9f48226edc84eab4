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
    current group included), one step's worth of groups (one per MoE layer)."""
    return int(num_moe_layers)


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
    ``budget``: takes ``prefetch_budget`` (copies per group); ``from_trace``: the cache stage can
    replay it from a trace alone (its lists, if any, come from a forecaster fitted on the trace).
    """

    holds_group: bool = True
    lists: str | None = None
    budget: bool = False
    from_trace: bool = True

    def replay(self, stream: AccessStream, warm: np.ndarray, counts: np.ndarray, lists: np.ndarray | None,
               budget: int | None, victims: np.ndarray | None) -> Replay:
        """Replay ``stream`` from the warm pool ``warm`` (instance ids, first victim first);
        ``counts`` float64 ``[L * E]`` the profile counts; ``lists`` int64 ``[G, W]`` the checked
        prefetch lists (policies with ``lists`` only); ``victims`` int64 ``[N]`` filled with -1, to
        record at each admitted selection the instance it evicted (None: not recorded)."""
        raise NotImplementedError


def recording(victims: np.ndarray | None) -> tuple[bool, np.ndarray]:
    """The replay loops' ``(record, victims)`` arguments: an empty array where nothing is recorded."""
    return victims is not None, victims if victims is not None else np.zeros(0, dtype=np.int64)


def check_lists(stream: AccessStream, lists: np.ndarray, kind: str) -> np.ndarray:
    """``lists`` as int64 ``[G, W]`` after checking it against ``stream`` and the policy's ``kind``
    (:data:`OWN_LAYER` or :data:`LATER_LAYER`)."""
    pred = np.ascontiguousarray(lists, dtype=np.int64)
    n_inst = stream.num_instances
    if pred.ndim != 2 or pred.shape[0] != stream.num_groups:
        raise CacheError(f"predictions: one row per group expected ({stream.num_groups}), got {pred.shape}")
    if pred.size and (pred.min() < -1 or pred.max() >= n_inst):
        raise CacheError(f"predictions: instance ids must lie in [0, {n_inst}) or be -1")
    if stream.instances.size:
        layer_of = stream.instances[stream.group_ptr[:-1]] // stream.num_experts
        if kind == OWN_LAYER:
            bad = (pred >= 0) & (pred // stream.num_experts != layer_of[:, None])
            what = "of another MoE layer (a group prefetches its own layer's next-step experts)"
        else:
            bad = (pred >= 0) & (pred // stream.num_experts <= layer_of[:, None])
            what = "of its own or an earlier MoE layer (a lookahead prefetches for later layers of its step)"
        if bad.any():
            raise CacheError(f"predictions: group {int(np.flatnonzero(bad.any(axis=1))[0])} lists an instance {what}")
    return pred
