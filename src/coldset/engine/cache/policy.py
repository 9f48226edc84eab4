"""The interface a policy of the engine's slot cache implements (:class:`CachePolicy`).

The pool (:class:`coldset.engine.cache.pool.SlotCache`) owns what every policy shares: the slots,
the row map, the slot owners, recency, use counts, ticks, counters and the demand fill's lists. A
policy object owns its own state (lookahead's in-flight flags and side streams, nexttoken's
forecast tables and tags) and makes the decisions; the pool calls it, handing itself in:

- :meth:`CachePolicy.create` at :meth:`~coldset.engine.cache.pool.SlotCache.build`, with the pool's
  shape (:class:`PoolShape`) and the build's options (each policy reads the ones it knows);
- :meth:`CachePolicy.admit` for a decode group from the experts function (the torch decisions
  :meth:`CachePolicy.decide`, or the Triton launch a policy uses on CUDA);
- :meth:`CachePolicy.route` in the fused decode step when :attr:`CachePolicy.routes` (the router's
  launch records the group);
- :meth:`CachePolicy.experts_done`, :meth:`CachePolicy.end_step` and :meth:`CachePolicy.join`:
  the hooks where a policy's prefetch work forks and joins;
- :meth:`CachePolicy.reset`, :meth:`CachePolicy.reset_counters` and :meth:`CachePolicy.counters`.

:meth:`CachePolicy.decide` is the demand rule of the lru family on the torch path (the module doc
of :mod:`coldset.engine.cache.pool`): a policy that only changes which slots are barred or their
eviction order overrides :meth:`CachePolicy.demand_barred` or :meth:`CachePolicy.victim_order`. A
new policy is a module with its class and one line in :data:`coldset.engine.cache.registry.POLICIES`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coldset.analysis.policies.base import COPY_UNIT, DEFAULT_LEAD_UNIT, GATE_SHIFT, GATE_START_WANTED, guard_groups


#: The owner of an empty slot: nexttoken's prefetch whose copy never landed leaves its slot to no
#: instance (no row-map entry names it) until a later admission takes it.
EMPTY_SLOT = -1
#: An empty slot's last use in the victim orders: older than any resident's (warm ticks are ``-C..-1``), so
#: it is the first victim; within ``+-2**49``, the Triton victim scans' key range
#: (:data:`coldset.kernels.triton_slots._EMPTY_TICK` is the same number).
EMPTY_TICK = -(2**48)


def slot_values(table: torch.Tensor, owner: torch.Tensor, empty) -> torch.Tensor:
    """``table[owner]``, per slot, an instance-indexed table read through the slot owners; ``empty``
    for an empty slot (owner :data:`EMPTY_SLOT`)."""
    return torch.where(owner >= 0, table[owner.clamp_min(0)], empty)


@dataclass(frozen=True)
class PoolShape:
    """What a policy's state is sized by: the MoE layers ``L``, experts per layer ``E``, the slots
    ``C``, the decode batch (tokens per group at most), the router's top ``k``, the per-group
    history's length and the device."""

    num_moe_layers: int
    num_experts: int
    capacity: int
    max_tokens: int
    top_k: int
    history: int
    device: torch.device


class CachePolicy:
    """One policy of the engine's slot cache (subclass it and register the class by its name in
    :data:`coldset.engine.cache.registry.POLICIES`).

    ``name``: the placement's policy name. ``routes``: the fused router's launch can record this
    policy's groups (:meth:`route`; the Triton decisions of :mod:`coldset.kernels.triton_slots`
    know it). ``prediction_history`` / ``prefetch_history``: a policy that issues prefetch lists
    records them there (``[history, width]`` -1 padded, ``[history]`` copies), else None.
    """

    name = ""
    routes = False
    prediction_history: torch.Tensor | None = None
    prefetch_history: torch.Tensor | None = None

    @classmethod
    def create(cls, shape: PoolShape, **options) -> "CachePolicy":
        """The policy's state for a pool of ``shape``; ``options`` are the build's (``routers``,
        ``depth``, ``forecaster``, ``prefetch_budget``), each policy reading those it takes."""
        return cls()

    # ------------------------------------------------------------------------ the torch decisions
    def guard_ticks(self, num_moe_layers: int, n: int) -> int:
        """The window in ticks, for groups of ``n`` selections, in which a slot's last use bars it
        from the victims beyond the group's own residents (``lru_guard``); 0: only those."""
        return 0

    def demand_barred(self, cache, layer: int, in_group: torch.Tensor, n: int) -> torch.Tensor:
        """bool ``[C]``: the slots that are no demand victim of group ``layer`` (``n`` selections);
        ``in_group``: the slots whose instances the group uses (never a victim)."""
        return in_group

    def victim_order(self, cache, barred: torch.Tensor) -> torch.Tensor:
        """Slots in eviction order (first = first victim), the ``barred`` ones last: least recent use."""
        last = cache.last_use[cache.owner].masked_fill(barred, torch.iinfo(torch.int64).max)
        return torch.argsort(last, stable=True)  # ticks are unique, so no ties

    def after_demand(self, cache, layer: int, hidden: torch.Tensor | None, used: torch.Tensor, n: int) -> int:
        """After the group's demand admissions and accesses (torch path): the policy's own work
        (lookahead's prefetch); returns the ticks it took beyond the group's ``n``."""
        return 0

    def decide(self, cache, layer: int, topk_ids: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        """Group ``layer``'s decisions and fill as torch ops (the CPU path; the kernels' reference):
        the victims (the slots not barred, in eviction order; misses beyond them read in place),
        the admissions, recency and use counts of every selection, then the counters."""
        pools = cache.pools
        E = pools.num_experts
        dev = topk_ids.device
        ids = topk_ids.reshape(-1).to(torch.int64)
        n = ids.numel()
        inst, hit, pos, used, m, slots_max, new_inst = cache.read_group(layer, ids)
        owner = cache.owner
        in_group = (owner // E == layer) & used[owner % E]
        barred = self.demand_barred(cache, layer, in_group, n)
        # misses beyond the slots not barred are read in place (lru and lfu: never, a pool holds a group)
        victims = self.victim_order(cache, barred)[:slots_max]
        valid = torch.arange(slots_max, device=dev) < torch.minimum(m, (~barred).sum())
        cache.admit_rows(victims, new_inst, valid)
        # Recency and frequency of every selection, then the counters.
        cache.last_use.scatter_reduce_(0, inst, cache.tick + pos, "amax")
        cache.count.index_add_(0, inst, torch.ones(n, dtype=cache.count.dtype, device=dev))
        extra = self.after_demand(cache, layer, hidden, used, n)
        cache.tick.add_(n + extra)
        hits = hit.sum()
        row = torch.stack([hits, n - hits, m])
        cache.totals.add_(row)
        cache.history.index_copy_(0, cache.groups % cache.history.shape[0], row[None])
        cache.groups.add_(1)

    def admit(self, cache, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None,
              dtype: torch.dtype | None, hidden: torch.Tensor | None, cast: bool) -> torch.Tensor | None:
        """A decode group's decisions and fill off the fused router (:meth:`SlotCache.admit
        <coldset.engine.cache.pool.SlotCache.admit>`); returns ``topk_weights``, cast to ``dtype``
        where ``cast``."""
        self.decide(cache, layer, topk_ids, hidden)
        return topk_weights.to(dtype) if cast else topk_weights

    def route(self, cache, layer: int, x, norm_weight, eps, gate_weight, top_k, renormalize, counter, pdl: bool):
        """The router's launch with the group's decisions in it (:meth:`SlotCache.route
        <coldset.engine.cache.pool.SlotCache.route>`), for policies whose :attr:`routes` is set."""
        raise NotImplementedError(f"cache policy {self.name!r} has no decisions in the router's launch")

    # ------------------------------------------------------------------------ hooks and state
    def experts_done(self, cache, layer: int) -> None:
        """After MoE layer ``layer``'s experts are enqueued (the experts function of :meth:`SlotCache.wrap
        <coldset.engine.cache.pool.SlotCache.wrap>`)."""

    def end_step(self, cache) -> None:
        """At a decode step's end (after its last MoE layer's experts)."""

    def join(self, cache) -> None:
        """The compute stream waits for the policy's side work still pending (before a state the
        next step or a check reads)."""

    def reset(self, cache) -> None:
        """Back to the warm state (the pool resets its own first; the slots are refilled after)."""

    def reset_counters(self) -> None:
        """Zero the policy's per-group records."""

    def counters(self, cache) -> dict[str, int]:
        """The policy's counters beyond the pool's hits, misses, fills and groups (a host sync)."""
        return {}


class PrefetchingPolicy(CachePolicy):
    """A policy that issues a prefetch list after each group (lookahead, nexttoken): its in-flight
    flags, the lists and copies it recorded per group, and per layer the prefetch's victims,
    instances and count (``[L, span]``, ``[L, span]``, ``[L, 1]``) for the prefetch fill; and the
    rules every prefetching policy keeps (:mod:`coldset.analysis.policies`): ``lru_guard``'s bar
    (:meth:`guard_ticks`) and the gate (:meth:`gate`, :meth:`keep_wanted`), whose state (int64) is
    the running sums ``gate_acc`` ``[3]`` (wanted, useful, saving), per forecast layer the pending
    list's wanted instances ``want`` ``[L, min(width, E)]``, their number ``want_n`` ``[L]`` and the
    group that listed them ``want_group`` ``[L]`` (-1: none), the decode groups since the reset
    ``group_index`` ``[1]`` (views of one buffer, ``gate_state``), ``lead_unit`` and ``gate_on`` (host)."""

    def init_lists(self, shape: PoolShape, width: int, span: int, lead_unit: int | None = None,
                   prefetch_gate: bool = True) -> None:
        """The state every prefetching policy keeps, ``width`` entries a list, ``span`` copies a
        layer; ``lead_unit`` (the gate's, :func:`coldset.analysis.policies.base.prefetch_lead_unit`;
        None: the default) and ``prefetch_gate`` (False: the sums are kept but the gate never closes,
        the simulator's ``prefetch_gate``)."""
        L, E, dev = shape.num_moe_layers, shape.num_experts, shape.device
        lead = DEFAULT_LEAD_UNIT if lead_unit is None else int(lead_unit)
        if lead < 0:
            raise ValueError(f"lead_unit must be >= 0, got {lead_unit}")
        self.inflight = torch.zeros(L * E, dtype=torch.bool, device=dev)
        self.prediction_history = torch.full((shape.history, width), -1, dtype=torch.int64, device=dev)
        self.prefetch_history = torch.zeros(shape.history, dtype=torch.int64, device=dev)
        self.prev_layer = L  # the last group's layer (host side: the call order is the step's)
        self.pf_victims = torch.zeros((L, span), dtype=torch.int64, device=dev)
        self.pf_new = torch.zeros((L, span), dtype=torch.int64, device=dev)
        self.pf_count = torch.zeros((L, 1), dtype=torch.int64, device=dev)
        self.lead_unit = lead
        self.gate_on = bool(prefetch_gate)
        self.copy_unit, self.gate_shift = COPY_UNIT, GATE_SHIFT  # the gate's constants, as the kernels read them
        # one buffer (the Triton decisions take its pointer: coldset.kernels.triton_slots._gate_views), as views
        wm = min(width, E)
        self.gate_state = torch.zeros(4 + 2 * L + L * wm, dtype=torch.int64, device=dev)
        self.gate_acc = self.gate_state[0:3]
        self.group_index = self.gate_state[3:4]
        self.want_n = self.gate_state[4:4 + L]
        self.want_group = self.gate_state[4 + L:4 + 2 * L]
        self.want = self.gate_state[4 + 2 * L:].view(L, wm)
        self.reset_gate()

    def reset_gate(self) -> None:
        """The gate's state before the first group (the simulator's
        :func:`coldset.analysis.policies.pool.gate_state`): the wanted sum
        :data:`coldset.analysis.policies.base.GATE_START_WANTED`, the useful and saving sums 0, no
        pending list, no group counted."""
        self.gate_acc[0:1].fill_(GATE_START_WANTED)
        self.gate_acc[1:].zero_()
        self.want_n.zero_()
        self.want_group.fill_(-1)
        self.group_index.zero_()

    def guard_ticks(self, num_moe_layers: int, n: int) -> int:
        """``lru_guard``'s bar in ticks: a group of ``n`` selections takes ``n`` ticks and its list
        ``width`` more (the prefetches' recency), so the last ``L`` groups (this one included,
        :func:`coldset.analysis.policies.base.guard_groups`) began this many ticks before this one."""
        return (guard_groups(num_moe_layers) - 1) * (int(n) + self.prediction_history.shape[1])

    def guard_tick(self, cache, n: int) -> torch.Tensor:
        """The first tick of the groups whose instances are no victim (a group of ``n`` selections;
        at 0 or later: the warm ticks are no use)."""
        return (cache.tick - self.guard_ticks(cache.pools.num_moe_layers, n)).clamp_min(0)

    def gate(self, cache, layer: int, used: torch.Tensor) -> torch.Tensor:
        """The gate at a group of ``layer`` (torch path; the kernels' reference): the pending list
        for ``layer`` judged against the group's experts ``used`` (bool ``[E]``), the running sums
        decayed and updated (a pending list only), and whether it is open now (bool tensor; always
        with ``gate_on`` False)."""
        E = cache.pools.num_experts
        wl = self.want[layer]
        wn = self.want_n[layer]
        q = torch.arange(wl.numel(), device=wl.device)
        useful = ((q < wn) & used[(wl - layer * E).clamp(0, E - 1)]).sum()
        save = ((self.group_index[0] - self.want_group[layer]) * self.lead_unit).clamp(max=COPY_UNIT)
        adds = torch.stack([wn * COPY_UNIT, useful * COPY_UNIT, useful * save])
        acc = self.gate_acc
        acc.copy_(torch.where(self.want_group[layer] >= 0, acc - (acc >> GATE_SHIFT) + adds, acc))
        self.want_group[layer] = torch.where(self.want_group[layer] >= 0, -1, self.want_group[layer])
        saving = acc[2].clamp(max=self.lead_unit << GATE_SHIFT)
        return (saving > acc[0] - acc[1] + (acc[0] >> (GATE_SHIFT - 1))) | (not self.gate_on)

    def keep_wanted(self, target: int, wanted: torch.Tensor, n_wanted: torch.Tensor) -> None:
        """This group's list's wanted instances (``wanted``, the first ``n_wanted`` count) kept as
        the pending list for layer ``target`` (the layer it forecasts), judged at its next group."""
        row = self.want[target]  # (the entries past the count kept as they were, as the kernels leave them)
        row.copy_(torch.where(torch.arange(row.numel(), device=row.device) < n_wanted, wanted[:row.numel()], row))
        self.want_n[target] = n_wanted
        self.want_group[target] = self.group_index[0]

    def reset(self, cache) -> None:
        self.inflight.zero_()
        self.prev_layer = cache.pools.num_moe_layers
        self.reset_gate()

    def reset_counters(self) -> None:
        self.prediction_history.fill_(-1)
        self.prefetch_history.zero_()

    def counters(self, cache) -> dict[str, int]:
        """``"prefetches"``: copies issued, from the per-group history."""
        return {"prefetches": int(cache.prefetch_counts().sum())}
