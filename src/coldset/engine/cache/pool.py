"""The dynamic expert cache in the engine: one pool of slots in HBM shared by every MoE layer.

A dynamic placement (``lru-0.5``, ``lfu-0.5``) keeps the data structures of a static one
(docs/design.md §3): the hot pool becomes ``C`` *slots*, the cold pool is the host tier that holds a
copy of every expert (row ``layer * E + expert``, :class:`coldset.kernels.tiers.HostTier`), and the row map
is the lookup table instance -> slot (``r >= 0``) or host row (``r < 0``). The experts kernel is
unchanged: it loads the row map once per block, so a dynamic run is bitwise the unmodified path
as long as every slot the row map names holds the expert it names.

After each MoE layer's router has run, :meth:`SlotCache.admit` makes the cache's decisions for
that (step, layer) group by the rules of :mod:`coldset.analysis.simulate`'s module doc (the simulator, which
implements the same rules on traces), through the cache's policy object
(:class:`coldset.engine.cache.policy.CachePolicy`, one class per family by name in
:data:`coldset.engine.cache.registry.POLICIES`):

- hits and misses per selection (an instance is resident iff its row-map entry is ``>= 0``);
- victims: the resident instances *not used by this group* (the hazard guard: a slot the same
  group still needs is never evicted; vLLM's expert-cache PR shipped without it and served wrong
  weights silently), ``lru`` by least recent use, ``lfu`` by (use count, last use); the k-th
  victim goes to the k-th missed instance in selection order; ``lru_guard`` and ``lfu`` take no
  victim among the instances the last ``L`` groups used (:mod:`coldset.engine.cache.lru`;
  ``nexttoken`` too, :mod:`coldset.engine.cache.nexttoken`);
- the row-map update: an evicted instance's entry goes back to its host row (the host tier holds
  every expert, so an eviction is a write of one int32, never a copy back), the admitted one's
  entry becomes its slot;
- the fill: the admitted instance's weights (block-FP8 experts: and their scales, in the same
  copy) are copied from the host tier into its slot (or, with a compressed host tier,
  :mod:`coldset.kernels.compressed_tier`, decoded from it: bitwise the same slot). On CUDA
  a small Triton kernel (:mod:`coldset.kernels.triton_slots`) reads the pinned host tier in place
  and copies only the rows of actual misses (its grid is fixed; blocks past the step's miss count
  return at once; from a compressed tier, a record copy and a decode launch listed the same way,
  :mod:`coldset.kernels.triton_codec_fill`); on the CPU a plain indexed copy.

On CUDA, in the fused decode step, a group costs one launch beside the router's
(:meth:`SlotCache.route`, :mod:`coldset.kernels.triton_slots`): the router's launch records the group
in its last program, which holds the selections in registers (hits, recency, counts, the missed
instances), and the fill, the router's programmatic dependent on sm90+, chooses the victims,
commits them to the row map and copies the admitted rows; the layer's :meth:`admit` then makes no
decision. Elsewhere on CUDA (a router that is not the fused launch) :meth:`admit` makes the same
decisions in one Triton launch of its own, which also casts the router weights (a launch every path
has), and the fill follows it. On the CPU they are torch ops (the same decisions, which CI tests
against the simulator). All have shapes fixed by the batch size and no host synchronisation, so the
whole decode step (every layer's decisions and fills included) is one CUDA graph, and a replay
re-runs the decisions on the data of that step. The prefetching policies add their own work beside
the step: :mod:`coldset.engine.cache.lookahead`, :mod:`coldset.engine.cache.nexttoken`.

Groups with more than ``max_tokens`` tokens (prefill) read through the current row map and change
nothing: the cache decides for decode steps, as the simulator replays decode tokens.

Warm start: the slots initially hold the static ``usage_global`` set of the same size (the
``usage_global`` placement's row map at that residency: slot ``r`` = its hot row ``r``), with the
recency order "profile count ascending, ties by instance id", so the least-used warm instance is
evicted first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from coldset.core.placement import lookahead_depth_for
from coldset.engine.cache.policy import CachePolicy, PoolShape
from coldset.engine.cache.registry import POLICIES
from coldset.kernels import KERNEL_MAX_SLOTS
from coldset.kernels.compressed_tier import CompressedHostTier, CompressedTierError, fill_slots
from coldset.kernels.tiers import ExpertPools, HostTier

_NEVER = -(2**62)  # last_use of an instance never seen (not resident, so never compared)


def _attach_listed_fill(pools: ExpertPools, compressed: CompressedHostTier, rules: CachePolicy,
                        demand_rows: int) -> None:
    """On CUDA: the cache's pools fill from ``compressed`` with the device's lists
    (:class:`coldset.kernels.triton_codec_fill.ListedFill`, which
    :func:`coldset.kernels.triton_slots.fill` dispatches to), staging the longest list a fill gets:
    the demand list (``demand_rows``) or the policy's prefetch span."""
    from coldset.kernels.triton_codec_fill import ListedFill  # GPU-only path (Triton)

    prefetch = getattr(rules, "pf_victims", None)  # the prefetching policies' lists
    rows = max(demand_rows, 0 if prefetch is None else int(prefetch.shape[1]))
    pools.compressed_fill = ListedFill(compressed, rows)


class CacheCapacityError(ValueError):
    """The pool has fewer slots than one step's selections can need."""


def _pdl_available(device: torch.device) -> bool:
    from coldset.kernels.triton_slots import pdl_available  # GPU-only path (Triton)

    return pdl_available(device)


def warm_order(warm_instances: np.ndarray, warm_counts: np.ndarray) -> np.ndarray:
    """The warm instances in eviction order: profile count ascending, ties by instance id ascending."""
    warm_instances = np.asarray(warm_instances, dtype=np.int64)
    order = np.lexsort((warm_instances, np.asarray(warm_counts, dtype=np.float64)))
    return warm_instances[order]


@dataclass
class SlotCache:
    """The slot pool, its device-side state and its policy (see the module doc).

    ``pools`` is what the experts kernel reads: ``w13_hot``/``w2_hot`` are the ``C`` slots on the
    compute device, ``w13_cold``/``w2_cold`` the host tier (every expert), ``row_map`` int32
    ``[L, E]``. State on the device: ``owner`` int64 ``[C]`` (the instance each slot holds),
    ``last_use`` int64 ``[L*E]`` (tick of each instance's last access), ``count`` float64
    ``[L*E]`` (profile count at warm start for warm instances + accesses since), ``tick`` int64
    ``[1]`` (selections seen). ``totals`` int64 ``[3]`` counts (hits, missed selections, fills =
    distinct missed instances copied over the link) since :meth:`reset_counters`; ``history``
    int64 ``[capacity, 3]`` holds the same per group (ring buffer, ``groups`` groups so far).
    ``policy`` is the policy's name, ``rules`` the policy object (its decisions and its own state).
    """

    pools: ExpertPools
    policy: str
    rules: CachePolicy
    max_tokens: int
    top_k: int
    owner: torch.Tensor
    last_use: torch.Tensor
    count: torch.Tensor
    tick: torch.Tensor
    totals: torch.Tensor
    history: torch.Tensor
    groups: torch.Tensor
    # (row_map, owner, last_use, count) of the warm state, for reset()
    warm_state: tuple[torch.Tensor, ...]
    # The demand fill's list (the Triton decisions write it on CUDA): victims, admitted instances, their number.
    victims: torch.Tensor
    admitted: torch.Tensor
    num_misses: torch.Tensor
    use_kernel: bool = False  # decisions by the Triton kernel (CUDA default) or torch ops
    pdl: bool = False  # the fill as the decisions' programmatic dependent launch (sm90+, kernel path)
    # the kernel path's fill ticket (int32 [1], zero between launches) and the layer whose group the
    # router's launch recorded (host side: route() then admit() of that layer)
    fill_ticket: torch.Tensor | None = None
    recorded_layer: int | None = None
    prefetch_blocks: int = 32  # blocks per weight of a prefetch copy beside the compute
    # the compressed host tier fills decode from (None: fills copy the raw host tier's rows)
    compressed: CompressedHostTier | None = None


    @classmethod
    def build(cls, all_hot: ExpertPools, host: HostTier, warm_row_map: np.ndarray, warm_counts,
              policy: str, max_tokens: int, top_k: int, history: int = 4096, routers=None,
              depth: int = 1, forecaster=None, prefetch_budget: int | None = None,
              lead_unit: int | None = None, prefetch_gate: bool = True,
              compressed: CompressedHostTier | None = None) -> "SlotCache":
        """A cache whose slots hold the warm set of ``warm_row_map`` (docs/design.md §3 placement
        encoding: the ``C`` hot rows are the slots), read from ``all_hot`` (the model's
        unmodified pools); its cold tier is ``host``. ``warm_counts`` are the profile counts of
        the warm instances, one per slot (hot row) in slot order. ``max_tokens``: the decode
        batch size (tokens per step) the cache decides for; ``C >= top_k * max_tokens`` is
        required, else one step could need more slots than exist. The policy's options:
        ``lookahead``: ``routers`` and ``depth``; ``nexttoken``: ``forecaster``
        (:func:`coldset.engine.cache.nexttoken.forecast_arrays`), ``prefetch_budget`` (copies
        issued per group at most; None = the whole list, ``max_tokens * n``) and ``lead_unit``
        (its prefetch gate's, :func:`coldset.analysis.policies.base.prefetch_lead_unit`; None: the
        default, as the simulator's) and ``prefetch_gate`` (False: prefetch without the gate).
        ``compressed``: the same experts' compressed host tier
        (:func:`coldset.kernels.compressed_tier.compressed_host_tier`): fills decode from it instead
        of copying ``host``'s rows (bitwise the same slots); ``host`` stays the cold pool that misses
        not admitted and prefill groups read in place. On CUDA the fills take the device's lists
        (:mod:`coldset.kernels.triton_codec_fill`, through :func:`coldset.kernels.triton_slots.fill`).
        """
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; known: {', '.join(POLICIES)}")
        pools = all_hot.placed(warm_row_map, host)  # validates the map; slots = compact hot pool
        if compressed is not None:
            compressed.check_fills(pools)
            if compressed.record_table.device != pools.w13_hot.device:
                raise CompressedTierError(
                    f"SlotCache.build(compressed=...): the compressed tier was built for experts on "
                    f"{compressed.record_table.device}, the slots are on {pools.w13_hot.device}")
        L, E = pools.num_moe_layers, pools.num_experts
        capacity = pools.num_hot
        dev = pools.row_map.device
        rules = POLICIES[policy].create(
            PoolShape(num_moe_layers=L, num_experts=E, capacity=capacity, max_tokens=int(max_tokens),
                      top_k=int(top_k), history=history, device=dev),
            routers=routers, depth=depth, forecaster=forecaster, prefetch_budget=prefetch_budget, lead_unit=lead_unit,
            prefetch_gate=prefetch_gate)
        need = int(top_k) * int(max_tokens)
        if capacity < need:
            raise CacheCapacityError(
                f"cache of {capacity} slots ({capacity / (L * E):.3f} of {L * E} experts) is smaller than one "
                f"step's {need} selections (top_k {top_k} x {max_tokens} tokens): raise the residency or "
                f"lower the batch size")
        if compressed is not None and dev.type == "cuda":
            _attach_listed_fill(pools, compressed, rules, min(need, E))
        warm_counts = np.asarray(warm_counts, dtype=np.float64)
        if warm_counts.shape != (capacity,):
            raise ValueError(f"warm_counts: one count per slot expected ({capacity}), got shape {warm_counts.shape}")
        rm = np.asarray(warm_row_map)
        flat = rm.reshape(-1)
        owner = np.empty(capacity, dtype=np.int64)
        hot = np.flatnonzero(flat >= 0)
        owner[flat[hot]] = hot  # slot r holds instance owner[r]
        last_use = np.full(L * E, _NEVER, dtype=np.int64)
        last_use[warm_order(owner, warm_counts)] = np.arange(-capacity, 0, dtype=np.int64)
        count = np.zeros(L * E, dtype=np.float64)
        count[owner] = warm_counts
        warm = (pools.row_map.clone(), torch.as_tensor(owner, device=dev), torch.as_tensor(last_use, device=dev),
                torch.as_tensor(count, device=dev))
        return cls(
            pools=pools, policy=policy, rules=rules, max_tokens=int(max_tokens), top_k=int(top_k),
            owner=warm[1].clone(), last_use=warm[2].clone(), count=warm[3].clone(),
            tick=torch.zeros(1, dtype=torch.int64, device=dev),
            totals=torch.zeros(3, dtype=torch.int64, device=dev),
            history=torch.zeros((history, 3), dtype=torch.int64, device=dev),
            groups=torch.zeros(1, dtype=torch.int64, device=dev),
            warm_state=warm,
            victims=torch.zeros(min(need, E), dtype=torch.int64, device=dev),
            admitted=torch.zeros(min(need, E), dtype=torch.int64, device=dev),
            num_misses=torch.zeros(1, dtype=torch.int64, device=dev),
            # lru's, lfu's and nexttoken's demand victims keep every slot's key in one program's
            # registers, lookahead's and the prefetch scans a slot in a key's 14 bits: up to 16384 slots.
            # Larger pools run the same decisions as torch ops (slower, same results).
            use_kernel=dev.type == "cuda" and capacity <= KERNEL_MAX_SLOTS,
            pdl=dev.type == "cuda" and _pdl_available(dev),
            fill_ticket=torch.zeros(1, dtype=torch.int32, device=dev) if dev.type == "cuda" else None,
            compressed=compressed,
        )

    def reset(self) -> None:
        """Back to the warm state (row map, owners, recency, counts, ticks, counters, the policy's
        state) with every slot refilled from the host tier, in place: a captured graph stays valid.
        For runs that must start warm after warm-up steps (a CUDA graph's capture runs the step)."""
        self.join()
        row_map, owner, last_use, count = self.warm_state
        pools = self.pools
        pools.row_map.copy_(row_map)
        pools.validated_version = pools.row_map._version  # the warm map, validated at build
        self.owner.copy_(owner)
        self.last_use.copy_(last_use)
        self.count.copy_(count)
        self.tick.zero_()
        self.recorded_layer = None
        if self.fill_ticket is not None:
            self.fill_ticket.zero_()
        self.rules.reset(self)
        self.reset_counters()
        if self.compressed is not None:  # every slot: host-listed (a device-listed fill stages one list)
            fill_slots(self.compressed, pools, owner.tolist(), range(self.capacity))
            return
        slots = torch.arange(self.capacity, device=owner.device)
        self.fill(slots, owner, torch.ones_like(slots, dtype=torch.bool),
                  torch.full((1,), self.capacity, dtype=torch.int64, device=owner.device))

    @classmethod
    def from_placement(cls, all_hot: ExpertPools, host: HostTier, placement, max_tokens: int,
                       top_k: int, routers=None, history: int = 4096, forecaster=None,
                       prefetch_budget: int | None = None, depth: int | None = None,
                       compressed: CompressedHostTier | None = None, lead_unit: int | None = None) -> "SlotCache":
        """The cache of a dynamic :class:`coldset.core.placement.Placement` (``lru-0.5``): its warm row
        map and warm counts, its policy; ``lookahead``: its depth for ``max_tokens`` sequences (or
        ``depth``, one of its per-batch depths: the parity stage decodes each), and ``routers``
        (the MoE layers' router weights ``[E, H]``, required there); ``compressed`` and ``lead_unit``
        (a gated policy's prefetch gate unit) as :meth:`build`'s."""
        if not placement.dynamic:
            raise ValueError(f"placement {placement.policy}-{placement.label} is static: it has no cache")
        ahead = placement.policy == "lookahead"
        if ahead and depth is None:
            depth = lookahead_depth_for(placement.cache_lookahead_depth, max_tokens)
        return cls.build(all_hot, host, placement.row_map, placement.cache_warm_counts, placement.policy,
                         max_tokens, top_k, history=history, routers=routers if ahead else None,
                         depth=depth if ahead else 1, forecaster=forecaster, prefetch_budget=prefetch_budget,
                         lead_unit=lead_unit, compressed=compressed)

    @property
    def capacity(self) -> int:
        return int(self.owner.shape[0])

    def guard_ticks(self, n: int) -> int:
        """The policy's victim bar in ticks for groups of ``n`` selections
        (:meth:`coldset.engine.cache.policy.CachePolicy.guard_ticks`), as the Triton decisions read it."""
        return self.rules.guard_ticks(self.pools.num_moe_layers, n)

    def reset_counters(self) -> None:
        """Zero the hit/miss/fill counters and the per-group history (the cache's contents stay)."""
        self.totals.zero_()
        self.history.zero_()
        self.groups.zero_()
        self.rules.reset_counters()

    def counters(self) -> dict[str, int]:
        """``{"hits", "misses", "fills", "groups"}`` since :meth:`reset_counters` (a host sync);
        ``lookahead`` and ``nexttoken`` add ``"prefetches"`` (copies issued, from the per-group
        history), ``nexttoken`` ``"stale"`` (commits refused because a copy's tag had not landed)."""
        hits, misses, fills = (int(v) for v in self.totals.tolist())
        out = {"hits": hits, "misses": misses, "fills": fills, "groups": int(self.groups)}
        out.update(self.rules.counters(self))
        return out

    def _recorded(self, history: torch.Tensor | None, what: str) -> np.ndarray:
        """The first ``groups`` rows of a per-group ring ``history`` (a host sync)."""
        if history is None:
            raise ValueError(f"cache policy {self.policy!r} records no {what}")
        n = int(self.groups)
        cap = history.shape[0]
        if n > cap:
            raise ValueError(f"the cache kept the last {cap} groups' {what}, {n} ran: build it with history >= {n}")
        return history[:n].cpu().numpy()

    def prefetch_counts(self) -> np.ndarray:
        """int64 ``[groups]``: the prefetch copies issued after each group, in order (a host sync)."""
        return self._recorded(self.rules.prefetch_history, "prefetches")

    def group_history(self) -> np.ndarray:
        """int64 ``[groups, 3]``: (hits, missed selections, fills) of each group, in order (a host sync)."""
        return self._recorded(self.history, "history")

    def prefetch_lists(self) -> np.ndarray:
        """int64 ``[groups, width]``: the prediction list the policy issued after each group
        (-1 padded; the simulator's ``predictions``), in order (a host sync)."""
        return self._recorded(self.rules.prediction_history, "lists")

    def wrap(self, experts_fn):
        """An experts function (model.experts_fn contract) that first runs :meth:`admit` for the
        layer's group, then ``experts_fn`` over this cache's pools (whatever pools it is given).

        It is marked ``casts_weights``: the model hands it the router's float32 weights and
        :meth:`admit` casts them to the activation dtype in the decisions' own launch on CUDA (the
        cast is a launch of its own on every path, so the cache adds one launch a layer, the fill,
        instead of two). Weights already in ``x``'s dtype are passed through."""
        cache = self

        last = self.pools.num_moe_layers - 1

        def cached(_pools, layer, x, topk_ids, topk_weights):
            w = cache.admit(layer, topk_ids, topk_weights, x.dtype, hidden=x)
            out = experts_fn(cache.pools, layer, x, topk_ids, w)
            cache.experts_done(layer)  # lookahead's prefetch fork, where route() deferred it
            if layer == last:
                cache.end_step()  # nexttoken: the step's copies joined and committed after its last experts
            return out

        cached.casts_weights = True
        cached.slot_cache = cache
        return cached

    def records_in_route(self, num_tokens: int) -> bool:
        """Whether the fused router launch records this cache's groups of ``num_tokens`` tokens
        (:meth:`route`): the kernel path, a decode group, a policy whose decisions run there
        (every built-in one: ``lru``/``lfu``/``nexttoken`` record the group there, ``lookahead``
        makes its whole decision there). With a compressed tier the fused launch chooses and commits
        only, and :func:`coldset.kernels.triton_slots.fill` decodes the admitted rows in the launch
        after it."""
        return self.use_kernel and self.rules.routes and num_tokens <= self.max_tokens

    def route(self, layer: int, x, norm_weight, eps, gate_weight, top_k, renormalize, counter, pdl: bool):
        """MoE layer ``layer``'s router (:func:`coldset.kernels.triton_decode.route`: the norm, the
        router GEMV, softmax and top-k) with the cache's decisions in the same launch: its last
        program records the group (hits, recency, counts, the missed instances); the next launch
        chooses the victims, commits them and fills their slots
        (:func:`coldset.kernels.triton_slots.choose_and_fill`, the router's programmatic dependent on
        sm90+). A cached layer then costs one launch more than an uncached one (the fill) where
        :meth:`admit`'s way costs two, and the decisions read the selections from registers.
        Returns ``(h, topk_ids, topk_weights)`` as ``route`` does, the weights in ``x``'s dtype;
        the layer's :meth:`admit` (from :meth:`wrap`'s experts function) then makes no decision.
        The policy's :meth:`~coldset.engine.cache.policy.CachePolicy.route` adds its own work
        (:meth:`coldset.engine.cache.lookahead.Lookahead.route`,
        :meth:`coldset.engine.cache.nexttoken.NextToken.route`)."""
        if not self.records_in_route(x.shape[0]):
            raise ValueError(f"SlotCache.route: policy {self.policy!r}, {x.shape[0]} tokens (max {self.max_tokens}), "
                             f"kernel path {self.use_kernel}: the router cannot record this group")
        return self.rules.route(self, layer, x, norm_weight, eps, gate_weight, top_k, renormalize, counter, pdl)

    def admit(self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None,
              dtype: torch.dtype | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """The cache's decisions for MoE layer ``layer``'s group ``topk_ids`` ``[T, k]`` (see the
        module doc), then the fill of the admitted instances' slots. The decisions are a no-op for
        ``T > max_tokens`` (prefill). Returns ``topk_weights`` cast to ``dtype`` (on the kernel
        path in the decisions' launch; ``None`` without weights). ``hidden``: the layer's router
        input ``[T, H]``, required by ``lookahead`` (its forecast of layer ``layer + depth``)."""
        cast = topk_weights is not None and dtype is not None and topk_weights.dtype != dtype
        if self.recorded_layer is not None:
            if self.recorded_layer != layer:
                raise RuntimeError(f"SlotCache.admit: layer {layer}'s group, but the router recorded layer "
                                   f"{self.recorded_layer}'s and its experts never ran")
            self.recorded_layer = None
            return topk_weights.to(dtype) if cast else topk_weights
        if topk_ids.shape[0] > self.max_tokens:
            return topk_weights.to(dtype) if cast else topk_weights
        return self.rules.admit(self, layer, topk_ids, topk_weights, dtype, hidden, cast)

    def experts_done(self, layer: int) -> None:
        """After MoE layer ``layer``'s experts are enqueued (:meth:`wrap`'s experts function): the
        policy's work left for that point (lookahead: the fork :meth:`route` deferred)."""
        self.rules.experts_done(self, layer)

    def end_step(self) -> None:
        """At a step's end (after its last MoE layer's experts): the policy's join and commit
        (nexttoken: the step's copies)."""
        self.rules.end_step(self)

    def join(self) -> None:
        """The compute stream waits for every side work of the policy still pending (host-side
        bookkeeping, no sync): before a state the next step or a check reads."""
        self.rules.join(self)

    # ---------------------------------------------------------------------------- the policies' tools
    def read_group(self, layer: int, ids: torch.Tensor) -> tuple:
        """A group's selections ``ids`` (flat int64 expert ids of MoE layer ``layer``) against the row
        map, as every torch-path policy reads them: ``(inst, hit, pos, used, m, slots_max, new_inst)``:
        the instances, which selections hit, their positions, which experts the group uses, how many
        distinct experts missed, the most it can admit, and the missed instances in first-selection
        order followed by the rest (never written: masked by ``j < m``)."""
        E = self.pools.num_experts
        n = ids.numel()
        base = layer * E
        rm = self.pools.row_map.view(-1)
        inst = ids + base
        hit = rm[inst] >= 0
        # First occurrence of each expert in selection order (n = not selected).
        pos = torch.arange(n, dtype=torch.int64, device=ids.device)
        first = torch.full((E,), n, dtype=torch.int64, device=ids.device).scatter_reduce_(0, ids, pos, "amin")
        used = first < n
        missed = used & (rm[base:base + E] < 0)
        slots_max = min(n, E)
        new_inst = torch.argsort(torch.where(missed, first, n), stable=True)[:slots_max] + base
        return inst, hit, pos, used, missed.sum(), slots_max, new_inst

    def admit_rows(self, victims: torch.Tensor, new_inst: torch.Tensor, valid: torch.Tensor) -> None:
        """The demand admissions of a group (torch path): the ``valid`` victims' slots go to ``new_inst``
        in the row map and the owners, then their rows are filled."""
        pools, rm, owner = self.pools, self.pools.row_map.view(-1), self.owner
        old_inst = owner[victims]
        # Evictions first (distinct instances, written as differences: a masked-out lane, or an empty victim,
        # owner -1, adds 0 wherever it points), then admissions read back after them (distinct experts), so a
        # masked-out write can never undo a real one.
        held = old_inst.clamp_min(0)
        rm.index_put_((held,), torch.where(valid & (old_inst >= 0), -old_inst - 1 - rm[held].to(torch.int64), 0)
                      .to(torch.int32), accumulate=True)
        rm.index_put_((new_inst,), torch.where(valid, victims, rm[new_inst].to(torch.int64)).to(torch.int32))
        owner.index_put_((victims,), torch.where(valid, new_inst, old_inst))
        # Written by the cache's own decisions, which keep the map a bijection onto C slots and
        # the host rows: a re-validation would be a host sync inside the step (see check()).
        pools.validated_version = pools.row_map._version
        self.fill(victims, new_inst, valid, valid.sum())  # the admitted (valid) rows are first

    def fill(self, victims, new_inst, valid, m, tags=None) -> None:
        """The admitted rows' copy (``valid`` lanes, ``m`` of them, first); with ``tags`` (``(tag
        list, done, ticket)``: nexttoken's prefetch) each copied slot's tag is written back into
        ``done`` once its rows have landed. With a compressed tier the rows are decoded from it (on
        CUDA through :func:`coldset.kernels.triton_slots.fill`'s dispatch to the cache's listed fill)."""
        pools = self.pools
        if pools.w13_hot.is_cuda:
            from coldset.kernels.triton_slots import fill  # GPU-only path (Triton)

            if tags is None:
                fill(pools, victims, new_inst, m)
            else:
                fill(pools, victims, new_inst, m, tags=tags)
            return
        slots, inst = victims[valid], new_inst[valid]
        if tags is not None:
            tag_list, done, _ = tags
            done[slots] = tag_list[valid]
        if self.compressed is not None:  # decoded from the compressed tier: weights and scales, bitwise the copy
            fill_slots(self.compressed, pools, inst.tolist(), slots.tolist())
            return
        for name in pools.expert_parts:  # a slot holds its expert's scales (FP8, MXFP4) beside its weights
            getattr(pools, f"{name}_hot")[slots] = getattr(pools, f"{name}_cold")[inst]

    # ---------------------------------------------------------------------------- checks
    def check(self, contents: bool = False) -> None:
        """Refuse (naming the first problem) a state in which the row map and the slot owners
        disagree: every slot's owner maps to that slot (an empty slot, owner -1, is named by none),
        every other instance to its host row; with ``contents``, also every slot's weights must equal
        its owner's host row. Outside the step (a host sync); tests and the parity stage call it after
        decoding."""
        self.join()
        pools = self.pools
        pools.validate()
        rm = pools.row_map.view(-1).cpu().numpy().astype(np.int64)
        owner = self.owner.cpu().numpy()
        n = rm.size
        expect = -np.arange(n, dtype=np.int64) - 1
        held = owner >= 0  # an empty slot (owner -1: a prefetch whose copy never landed) is named by no entry
        expect[owner[held]] = np.flatnonzero(held)
        bad = np.flatnonzero(rm != expect)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"slot cache: row map entry of instance {i} (layer {i // pools.num_experts}, expert "
                             f"{i % pools.num_experts}) is {rm[i]}, the slot owners say {expect[i]}")
        if contents:  # compared on the slots' device, one host row at a time
            dev = pools.w13_hot.device
            for s in range(self.capacity):
                o = int(owner[s])
                if o < 0:
                    continue  # empty: no weights
                scales_ok = not pools.has_scales or (
                    torch.equal(pools.w13_scale_hot[s], pools.w13_scale_cold[o].to(dev))
                    and torch.equal(pools.w2_scale_hot[s], pools.w2_scale_cold[o].to(dev)))
                if not (torch.equal(pools.w13_hot[s], pools.w13_cold[o].to(dev))
                        and torch.equal(pools.w2_hot[s], pools.w2_cold[o].to(dev)) and scales_ok):
                    raise ValueError(f"slot cache: slot {s} does not hold the weights of its owner, instance {o} "
                                     f"(layer {o // pools.num_experts}, expert {o % pools.num_experts})")
