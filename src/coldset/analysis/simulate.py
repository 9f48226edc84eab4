"""Expert cache simulation: replay an access stream through one pool of slots under a policy.

Why: a static cold set serves a fixed share of selections; a cache that follows the traffic serves
more where consecutive tokens reuse experts. :func:`simulate` replays a trace's decode selections
(:class:`coldset.analysis.streams.AccessStream`) through one pool of ``C`` slots shared by every
MoE layer and counts hits, misses and link bytes, so a user can compare static and dynamic
placement at the same HBM budget on their own traffic before touching a GPU, and so the engine's
slot cache (:mod:`coldset.engine.cache`) can be checked step by step against an independent
implementation of the same rules.

Semantics (this package is their reference implementation; the engine's slot cache follows the
same rules):

- Instance = (MoE-layer index, expert), id ``moe_layer_index * E + expert`` (the row-map row,
  not the model's layer index).
- Pool of ``C`` slots, ``C = capacity_for_residency(residency, L, E)`` (placement's rounding,
  :func:`coldset.analysis.placement.hot_count_for_residency`). The policies that admit need ``C``
  at least the largest group (``top_k`` x tokens per step), else :class:`CacheError`
  (:attr:`coldset.analysis.policies.base.CachePolicy.holds_group`).
- Warm start: the pool holds the ``usage_global`` hot set of size ``C`` chosen on the profile
  counts (:func:`coldset.analysis.placement.hot_mask_usage_global`). Initial order: profile count
  ascending, ties by instance id ascending (:func:`warm_order`); warm instances get ticks
  ``-C..-1`` in that order, so the least-used warm instance is the first victim.
- The stream is a sequence of *groups*: a (token, MoE layer) group of ``top_k`` selections, or
  any grouping a caller builds (an engine step at batch ``B`` processes (step, layer) groups of
  ``B * k``). Ticks count selections in stream order from 0; every access sets ``last_use`` to
  its tick.
- Per group: every selection whose instance is resident at the group's start is a hit
  (duplicates of one instance count once per selection). Then the distinct missed instances are
  admitted (online policies always admit), each evicting one victim among residents *not used by
  this group* (the hazard guard). Victims are taken in the policy's order and assigned to the
  missed instances in rank order (first occurrence).
- The policies and their victim orders: :mod:`coldset.analysis.policies` (``static``, ``lru``,
  ``lru_guard``, ``lfu``, ``belady``, ``forecast``, ``nexttoken``, and ``lookahead``, whose lists
  come from an engine run's hidden states), one file per family, each module's doc its rules.
  ``lfu``, ``forecast`` and ``nexttoken`` keep ``lru_guard``'s bar
  (:func:`coldset.analysis.policies.base.guard_groups`); the last two also keep a prefetch in
  flight until its layer has run, and prefetch only while their gate says it pays
  (:func:`coldset.analysis.policies.base.prefetch_lead_unit`).

Link traffic: each distinct missed instance of a group crosses the link once (``fills``); for
``static`` these are the cold reads, for the online policies the slot fills, plus the prefetching
policies' copies. ``link_gb_per_token = (fills + prefetches) * bytes_per_expert / tokens / 1e9``.

The replay loops are compiled with numba when it is importable (:mod:`coldset.analysis.compiled`:
the same Python source runs uncompiled otherwise, same results, slower); everything around them is
vectorised numpy. The time a replay's decisions take: :mod:`coldset.analysis.time_model`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coldset.analysis.placement import hot_count_for_residency, hot_mask_usage_global
from coldset.analysis.policies import REGISTRY, policy_for
from coldset.analysis.policies.base import DEFAULT_LEAD_UNIT, check_lists
from coldset.analysis.streams import AccessStream, CacheError


def capacity_for_residency(residency: float, num_moe_layers: int, num_experts: int) -> int:
    """Slots of the pool at ``residency``: the static placements' hot count for the same residency."""
    return hot_count_for_residency(residency, num_moe_layers * num_experts)


def warm_order(profile_counts: np.ndarray, capacity: int) -> np.ndarray:
    """The warm pool's instance ids, first victim first: the ``usage_global`` hot set of size
    ``capacity`` ordered by profile count ascending, ties by instance id ascending."""
    counts = np.asarray(profile_counts, dtype=np.float64)
    hot = np.flatnonzero(hot_mask_usage_global(counts, capacity).reshape(-1))
    flat = counts.reshape(-1)
    return hot[np.lexsort((hot, flat[hot]))]

@dataclass(frozen=True)
class CacheStats:
    """One (policy, capacity) replay: the ``simulation.csv`` row (without residency/bytes)."""

    policy: str
    capacity: int
    accesses: int
    hits: int
    misses: int
    fills: int
    tokens: int
    groups: int
    prefetches: int = 0
    useful_prefetches: int = 0
    wasted_prefetches: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else float("nan")

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.tokens if self.tokens else float("nan")

    def link_gb_per_token(self, bytes_per_expert: int) -> float:
        return (self.fills + self.prefetches) * bytes_per_expert / self.tokens / 1e9 if self.tokens else float("nan")


@dataclass(frozen=True)
class CacheResult:
    """Per-selection and per-group outcome of one replay.

    ``hit`` bool ``[N]``; ``hits``, ``misses``, ``fills`` int64 ``[G]`` per group (``fills`` =
    distinct missed instances = link transfers); ``victims`` int64 ``[N]`` when recorded: at the
    first occurrence of each missed instance of a group, the instance evicted for it (-1
    elsewhere, and always -1 for ``static``). ``prefetches`` int64 ``[G]``: copies issued after
    each group and ``useful_prefetches`` (prefetched instances hit before eviction), prefetching
    policies only (None / 0 otherwise); ``issued`` int64 ``[G, W]`` the instances copied after each
    group in issue order (-1 padded; the engine's prefetch lists compare against it) and
    ``wasted_prefetches`` (prefetched instances evicted before any hit).
    """

    policy: str
    capacity: int
    hit: np.ndarray
    hits: np.ndarray
    misses: np.ndarray
    fills: np.ndarray
    tokens: int
    victims: np.ndarray | None = None
    prefetches: np.ndarray | None = None
    useful_prefetches: int = 0
    issued: np.ndarray | None = None
    wasted_prefetches: int = 0

    def stats(self) -> CacheStats:
        pf = int(self.prefetches.sum()) if self.prefetches is not None else 0
        return CacheStats(self.policy, self.capacity, int(self.hit.size), int(self.hits.sum()),
                          int(self.misses.sum()), int(self.fills.sum()), self.tokens, int(self.hits.size),
                          pf, int(self.useful_prefetches), int(self.wasted_prefetches))


#: Groups :func:`group_sums` counts at once (its int64 copy of the flags is of these groups only).
SUM_GROUPS = 1 << 20


def group_sums(flags: np.ndarray, group_ptr: np.ndarray) -> np.ndarray:
    """int64 ``[G]``: the True ``flags`` (bool ``[N]``) of each group ``flags[group_ptr[g]:group_ptr[g + 1]]``
    (every group non-empty), :data:`SUM_GROUPS` groups at a time."""
    n_groups = group_ptr.size - 1
    out = np.zeros(n_groups, dtype=np.int64)
    for g0 in range(0, n_groups, SUM_GROUPS):
        g1 = min(g0 + SUM_GROUPS, n_groups)
        lo = group_ptr[g0]
        out[g0:g1] = np.add.reduceat(flags[lo:group_ptr[g1]], group_ptr[g0:g1] - lo, dtype=np.int64)
    return out


def simulate(stream: AccessStream, policy: str, capacity: int, profile_counts: np.ndarray, *,
             record_victims: bool = False, predictions: np.ndarray | None = None,
             prefetch_budget: int | None = None, lead_unit: int | None = None,
             prefetch_gate: bool = True) -> CacheResult:
    """Replay ``stream`` through a pool of ``capacity`` slots under ``policy`` (a name of
    :data:`coldset.analysis.policies.REGISTRY`).

    ``profile_counts`` float ``[L, E]`` (profile split's selections) choose the warm pool
    (:func:`warm_order`) and LFU's initial counts. ``predictions`` int32 or int64 ``[G, P]`` (required by the
    policies that replay prefetch lists, and only by them): the instances to prefetch after each
    group, -1 padded (``forecast``: :func:`coldset.analysis.forecast.stream_predictions`;
    ``lookahead``: :func:`coldset.analysis.forecast.lookahead_predictions`; ``nexttoken``: the
    forecast's candidate list of each group, :func:`coldset.analysis.forecast.nexttoken_lists`,
    which also sets the predicted flags); ``prefetch_budget``: copies per group, for the policies
    that take one (``nexttoken``; None: no cut); ``lead_unit``: the prefetch gate's measure of a
    group's compute, for the gated policies (``forecast``, ``nexttoken``;
    :func:`coldset.analysis.policies.base.prefetch_lead_unit` from the time model; None:
    :data:`~coldset.analysis.policies.base.DEFAULT_LEAD_UNIT`); ``prefetch_gate`` False: those policies
    prefetch without the gate (tests of the prefetch itself, and what the gate saves). See the
    module docstring for the rules.
    """
    rules = policy_for(policy)
    counts = np.asarray(profile_counts, dtype=np.float64)
    if counts.shape != (stream.num_moe_layers, stream.num_experts):
        raise CacheError(f"profile_counts has shape {counts.shape}, expected "
                         f"({stream.num_moe_layers}, {stream.num_experts})")
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise CacheError("profile_counts must be finite and >= 0")
    capacity = int(capacity)
    if capacity < 0 or capacity > stream.num_instances:
        raise CacheError(f"capacity {capacity} outside [0, {stream.num_instances}] instances")
    if rules.holds_group and capacity < stream.max_group:
        raise CacheError(f"a pool of {capacity} slots cannot hold one group's {stream.max_group} selections "
                         f"(top_k x tokens per step); policy {policy!r} needs capacity >= {stream.max_group}")
    if (rules.lists is not None) != (predictions is not None):
        listed = " or ".join(repr(n) for n, p in REGISTRY.items() if p.lists is not None)
        raise CacheError(f"predictions (the prefetch lists) are required by policy {listed} and only by them")
    if prefetch_budget is not None and (not rules.budget or int(prefetch_budget) < 0):
        takes = ", ".join(repr(n) for n, p in REGISTRY.items() if p.budget)
        raise CacheError(f"prefetch_budget (>= 0 copies per group) is a parameter of {takes} only, got "
                         f"{prefetch_budget} for {policy!r}")
    if lead_unit is not None and (not rules.gated or int(lead_unit) < 0):
        gated = ", ".join(repr(n) for n, p in REGISTRY.items() if p.gated)
        raise CacheError(f"lead_unit (>= 0) is a parameter of the gated policies {gated} only, got {lead_unit} "
                         f"for {policy!r}")
    lists = None if rules.lists is None else check_lists(stream, predictions, rules.lists)
    warm = warm_order(counts, capacity)
    victims = np.full(stream.instances.size, -1, dtype=np.int64) if record_victims else None
    out = rules.replay(stream, warm, counts.reshape(-1), lists,
                       None if prefetch_budget is None else int(prefetch_budget), victims,
                       -1 if not prefetch_gate else DEFAULT_LEAD_UNIT if lead_unit is None else int(lead_unit))
    hits = group_sums(out.hit, stream.group_ptr)
    return CacheResult(policy, capacity, out.hit, hits, np.diff(stream.group_ptr) - hits, out.fills, stream.tokens,
                       victims, out.prefetches, int(out.useful_prefetches), out.issued, int(out.wasted_prefetches))
