"""The engine's ``lru``, ``lru_guard`` and ``lfu`` policies (the rules of :mod:`coldset.engine.cache.pool`'s
module doc): victims among the resident instances not used by the group, least recent use first
(``lfu``: by (use count, last use)); ``lru_guard`` also bars the instances the last ``L`` groups used
and reads the misses past the remaining slots in place; ``lfu`` keeps the same bar.

On CUDA a group is one Triton launch beside the router's: in the fused decode step the router's
launch records the group and the fill chooses and commits the victims (:meth:`LRU.route`,
:func:`coldset.kernels.triton_slots.choose_and_fill`); elsewhere one decisions launch of its own
(:func:`coldset.kernels.triton_slots.decide`, which also casts the router weights) before the fill.
"""

from __future__ import annotations

import torch

from coldset.analysis.policies.base import guard_groups
from coldset.engine.cache.policy import CachePolicy


def record_and_fill(cache, layer: int, x, norm_weight, eps, gate_weight, top_k, renormalize, counter, pdl: bool):
    """MoE layer ``layer``'s router launch recording the group (hits, recency, counts, the missed
    instances), then the launch that chooses the victims, commits them and fills their slots (the
    router's programmatic dependent on sm90+). Returns ``(h, topk_ids, topk_weights)``."""
    from coldset.kernels import triton_decode as td  # GPU-only path (Triton)
    from coldset.kernels import triton_slots as ts  # GPU-only path (Triton)

    h, ids, w = td.route(x, norm_weight, eps, gate_weight, top_k, renormalize, counter, weights_dtype=x.dtype,
                         pdl=pdl, record=ts.route_record_args(cache, layer), trigger=cache.pdl)
    ts.choose_and_fill(cache, ids.numel(), pdl=cache.pdl, layer=layer)
    cache.recorded_layer = layer
    return h, ids, w


class LRU(CachePolicy):
    """Least recently used (the victim order of :class:`CachePolicy`)."""

    name = "lru"
    routes = True

    def admit(self, cache, layer, topk_ids, topk_weights, dtype, hidden, cast):
        """The kernel path: the decisions in one Triton launch (which casts the weights too), then
        the fill; else the torch decisions."""
        if cache.use_kernel:
            from coldset.kernels.triton_slots import decide, fill  # GPU-only path (Triton)

            w_out = None
            if cast:
                w_out = torch.empty(topk_weights.shape, dtype=dtype, device=topk_weights.device)
                decide(cache, layer, topk_ids.reshape(-1).to(torch.int64).contiguous(),
                       topk_weights.contiguous().reshape(-1), w_out.view(-1))
            else:
                decide(cache, layer, topk_ids.reshape(-1).to(torch.int64).contiguous())
            fill(cache.pools, cache.victims, cache.admitted, cache.num_misses, pdl=cache.pdl)
            return w_out if cast else topk_weights
        return super().admit(cache, layer, topk_ids, topk_weights, dtype, hidden, cast)

    def route(self, cache, layer, x, norm_weight, eps, gate_weight, top_k, renormalize, counter, pdl):
        return record_and_fill(cache, layer, x, norm_weight, eps, gate_weight, top_k, renormalize, counter, pdl)


class LRUGuard(LRU):
    """``lru`` that takes no victim among the instances the last ``L`` groups used (one step's
    worth) and reads the misses past the remaining slots in place, not admitted: where a step's
    experts outnumber the slots, lru evicts what the next step needs again and thrashes; the guard
    keeps the pool and streams the surplus."""

    name = "lru_guard"

    def guard_ticks(self, num_moe_layers: int, n: int) -> int:
        """A slot whose instance was last used at the group's first tick minus this or later (and
        at tick 0 or later: the warm ticks are no use) is no victim, i.e. one used by any of the
        groups the simulator's rule bars (:func:`coldset.analysis.policies.base.guard_groups`: the last
        ``L``, this one included; every decode group has ``n`` ticks)."""
        return (guard_groups(num_moe_layers) - 1) * int(n)

    def demand_barred(self, cache, layer, in_group, n):
        guard = self.guard_ticks(cache.pools.num_moe_layers, n)
        return in_group | (cache.last_use[cache.owner] >= (cache.tick - guard).clamp_min(0))


class LFU(LRUGuard):
    """Least frequently used: victims by (use count, last use), with ``lru_guard``'s bar."""

    name = "lfu"

    def victim_order(self, cache, barred):
        order = super().victim_order(cache, barred)
        # lexicographic (count, last_use): stable sort on count of the lru order
        cnt = cache.count[cache.owner].masked_fill(barred, float("inf"))[order]
        return order[torch.argsort(cnt, stable=True)]
