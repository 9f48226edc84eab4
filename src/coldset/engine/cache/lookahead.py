"""The engine's ``lookahead`` policy (the placement ``lookahead-0.5``, depth from ``cache.lookahead_depth``).

``lru`` plus, after each group of layer ``l``, the prefetch of layer ``l + depth``'s forecast, the
top-``k`` experts of that layer's router applied to layer ``l``'s router input (pre-gated MoE), with
the rules of the simulator's ``lookahead`` policy (:mod:`coldset.analysis.policies.lookahead`): a prefetched
instance takes the least recent slot of layers ``<= l`` not used by the group, not in flight and not
guarded, is in flight until the step ends (no demand miss evicts it; a demand miss that finds no other
slot is read in place, not admitted), and enters the recency order after the group's accesses; no
victim, demand or prefetch, among the instances the last ``L`` groups used or prefetched
(``lru_guard``'s bar, :meth:`coldset.engine.cache.policy.PrefetchingPolicy.guard_ticks`); the list is
judged at layer ``l + depth``'s group and issued only while the gate is open
(:meth:`coldset.engine.cache.policy.PrefetchingPolicy.gate`). The engine
records each group's list (:meth:`coldset.engine.cache.pool.SlotCache.prefetch_lists`), which the
simulator replays for the step-by-step equality. On the CPU the decisions are torch ops and the
copies plain indexed copies.

On CUDA in the fused decode step (:meth:`Lookahead.route`) the router's launch makes the group's
record and demand decisions: each of its programs computes the forecast of layer ``l + depth``'s
router rows beside its own (on the same normed input) and its last program, holding the selections
in registers, runs the demand decisions (:func:`coldset.kernels.triton_slots.ahead_group`); then the
demand fill, and on the decisions stream the forecast's list and the prefetch decisions
(:func:`coldset.kernels.triton_slots.ahead_list`) followed by the prefetch copy: a group is the
router's launch, the demand fill and the side work, two launches fewer on the critical path than
the way below (BENCHMARKS.md section 4). Elsewhere on CUDA (a router that is not the fused launch) a
group is the forecast's GEMV (:func:`coldset.kernels.triton_slots.forecast_logits`), one Triton
launch for all the decisions (:func:`coldset.kernels.triton_slots.decide_ahead`; on sm90+ the GEMV's
programmatic dependent), the demand fill on the compute stream, and the prefetch copy (the same fill
kernel, ``prefetch_blocks`` blocks per weight) forked onto a side stream: an event recorded on the
compute stream after the decisions and the demand fill, waited on by the side stream; the copy's own
event is waited on by the compute stream at the end of the admit of layer ``l + depth``, right before
that layer's experts kernel reads the row map (the commit: no kernel reads a prefetched slot before
its copy is complete). Why the victims are safe while the copy runs: their last reader was an
experts kernel of a layer before ``l`` (ordered before the fork) or none (not used by the group),
and no later group of the step may evict or read them. Fork and join are recorded in the step's
CUDA graph; the last MoE layer joins whatever is left, so every branch ends inside the step. A copy
engine (``cudaMemcpyAsync``) cannot do this copy inside the graph: its addresses are fixed at
capture, and the rows to copy are decided on the device during the step.
"""

from __future__ import annotations

import contextlib

import torch

from coldset.engine.cache.policy import PoolShape, PrefetchingPolicy


class Lookahead(PrefetchingPolicy):
    """``lookahead``'s state: each MoE layer's router as the forecast's operand (``[E, H]``
    contiguous in the model's dtype, read as it is by the GEMV launch or the router's launch, cast
    by ``torch.mm`` on the torch path), the kernel path's float32 logits ``[max_tokens, E]`` (one
    buffer: each group's are read by its decisions before the next group's launch writes it), the
    depth, the side stream with its fork event and per target layer the join event and whether a
    copy for it is pending, the decisions stream (:meth:`route`'s lists) with an event per layer,
    and the fork :meth:`route` left for :meth:`experts_done`.

    ``list_after_experts``: on :meth:`route`'s path, fork the forecast's list and the prefetch copy
    after the layer's experts (:meth:`experts_done`) instead of after its demand fill, so that they
    run beside the next layer's attention rather than beside this layer's experts; the same
    decisions in the same order either way. :meth:`create` sets it where ``depth >= 2``: at depth 1
    the copy would start after the experts of the one layer it has to cross (BENCHMARKS.md section 4;
    ``bench cache --other-fork`` times the other choice by setting it on the policy)."""

    name = "lookahead"
    routes = True

    @classmethod
    def create(cls, shape: PoolShape, *, routers=None, depth: int = 1, lead_unit: int | None = None,
               prefetch_gate: bool = True, **_) -> "Lookahead":
        """Needs the ``L`` MoE layers' routers ``[E, hidden]`` and a ``depth`` in ``[1, L - 1]``;
        ``lead_unit`` and ``prefetch_gate``: the gate's
        (:meth:`coldset.engine.cache.policy.PrefetchingPolicy.init_lists`)."""
        L, E, dev = shape.num_moe_layers, shape.num_experts, shape.device
        if routers is None or len(routers) != L or any(tuple(r.shape)[0] != E for r in routers):
            raise ValueError(f"policy 'lookahead' needs the {L} MoE layers' routers [{E}, hidden]")
        if not 1 <= int(depth) < L:
            raise ValueError(f"lookahead depth must be in [1, {L - 1}], got {depth}")
        need = shape.top_k * shape.max_tokens
        cuda = dev.type == "cuda"
        self = cls()
        self.init_lists(shape, width=need, span=min(need, E), lead_unit=lead_unit, prefetch_gate=prefetch_gate)
        self.depth = int(depth)
        self.forecast_routers = [r.detach().to(dev).contiguous() for r in routers]
        self.forecast_out = torch.empty((shape.max_tokens, E), dtype=torch.float32, device=dev)
        self.side_stream = torch.cuda.Stream(dev) if cuda else None
        self.fork_event = torch.cuda.Event() if cuda else None
        self.join_events = [torch.cuda.Event() for _ in range(L)] if cuda else None
        self.pending = [False] * L
        self.decide_stream = torch.cuda.Stream(dev) if cuda else None
        self.decided_events = [torch.cuda.Event() for _ in range(L)] if cuda else None
        self.list_after_experts = self.depth >= 2
        self.deferred_fork = None  # (layer, target, listed) route() left for experts_done
        self.forked = None  # the last layer whose list decisions were forked and not yet waited on
        return self

    # ------------------------------------------------------------------------ torch path
    def demand_barred(self, cache, layer, in_group, n):
        """Slots in flight or guarded (``lru_guard``'s bar) are no demand victim; a new step commits
        the last step's prefetches."""
        if layer <= self.prev_layer:  # a new step: the last step's prefetches are committed
            self.inflight.zero_()
        self.prev_layer = layer
        owner = cache.owner
        return in_group | self.inflight[owner] | (cache.last_use[owner] >= self.guard_tick(cache, n))

    def after_demand(self, cache, layer, hidden, used, n):
        """The prefetch (:meth:`_prefetch`); the prefetches take the ticks after the group's (the
        width of a list at most)."""
        self._prefetch(cache, layer, hidden, used, n)
        return self.prediction_history.shape[1]

    def admit(self, cache, layer, topk_ids, topk_weights, dtype, hidden, cast):
        if hidden is None:
            raise ValueError("SlotCache.admit: policy 'lookahead' needs the layer's router input (hidden)")
        if cache.use_kernel:
            return self._admit_kernel(cache, layer, topk_ids, topk_weights, dtype, hidden, cast)
        return super().admit(cache, layer, topk_ids, topk_weights, dtype, hidden, cast)

    def forecast_logits(self, cache, hidden: torch.Tensor, target: int, pdl: bool = False) -> torch.Tensor:
        """float32 ``[T, E]``: layer ``target``'s router on ``hidden`` (this layer's router input),
        the forecast both paths rank (the lists are recorded, so the rounding is not a contract).
        Kernel path: one Triton launch reading the router in the model's dtype
        (:func:`coldset.kernels.triton_slots.forecast_logits`; ``pdl``: the decisions launch that
        follows may start beside it), into ``forecast_out`` (the view returned is overwritten by
        the next call); torch path: ``torch.mm`` of the float32 casts."""
        h = hidden.reshape(hidden.shape[0], -1)
        w = self.forecast_routers[target]
        if cache.use_kernel:
            from coldset.kernels.triton_slots import forecast_logits  # GPU-only path (Triton)

            if h.stride(-1) != 1:
                h = h.contiguous()
            return forecast_logits(h, w, self.forecast_out[:h.shape[0]], pdl=pdl)
        return torch.mm(h.float(), w.float().T)

    def _prefetch(self, cache, layer: int, hidden: torch.Tensor, used: torch.Tensor, n: int) -> None:
        """The prefetch after group (step, ``layer``), the simulator's ``lookahead`` rules
        (:mod:`coldset.analysis.policies.lookahead`): the list = the top ``k`` experts of layer ``layer + depth``'s
        router on this layer's router inputs, token by token, first occurrence kept; the gate
        judges the list that forecast this layer, keeps this list's wanted instances for layer
        ``layer + depth``'s group and, while open, each listed instance not resident, in list order,
        takes the least recent slot of layers ``<= layer`` not used by this group, not listed, not in
        flight and not guarded (none left: the rest is skipped); it is in flight until the step ends
        and enters the recency order after the group's accesses, in list order. The list is
        recorded per group (the simulator replays it), so its logits' rounding (float32 here) is
        the engine's choice, not a contract."""
        pools = cache.pools
        L, E = pools.num_moe_layers, pools.num_experts
        dev = cache.owner.device
        width = self.prediction_history.shape[1]
        row = cache.groups % self.prediction_history.shape[0]
        target = layer + self.depth
        is_open = self.gate(cache, layer, used)  # the list that forecast this layer judged
        if target >= L:
            self.prediction_history.index_fill_(0, row, -1)
            self.prefetch_history.index_fill_(0, row, 0)
            self.group_index.add_(1)
            return
        logits = self.forecast_logits(cache, hidden, target)
        top = torch.sort(-logits, dim=1, stable=True).indices[:, :cache.top_k].reshape(-1)
        # The target layer's experts by first position in the list, then the unlisted ones by id:
        # E distinct instances (so masked-out writes below never share an index with real ones).
        pos_top = torch.arange(top.numel(), device=dev)
        first = (top.numel() + torch.arange(E, device=dev)).scatter_reduce_(0, top, pos_top, "amin")
        seq = torch.argsort(first) + target * E
        nk = (first < top.numel()).sum()  # listed experts
        ranks = torch.arange(E, device=dev)
        listed = ranks < nk
        lst = torch.where(listed, seq, -1)
        rec = lst[:width] if E >= width else torch.nn.functional.pad(lst, (0, width - E), value=-1)
        rm = pools.row_map.view(-1)
        want = listed & (rm[seq] < 0)
        span = min(E, cache.capacity)
        wanted = seq[torch.argsort((~want).to(torch.int64), stable=True)]  # non-resident listed first
        new = wanted[:span]
        self.keep_wanted(target, wanted, want.sum())  # judged at layer target's group
        self.group_index.add_(1)
        owner = cache.owner
        # Candidates: slots of layers already done this step, not used by this group, not in flight,
        # not guarded (a listed instance belongs to a later layer, so it is never one).
        barred = ((owner // E > layer) | ((owner // E == layer) & used[owner % E]) | self.inflight[owner]
                  | (cache.last_use[owner] >= self.guard_tick(cache, n)))
        key = cache.last_use[owner].masked_fill(barred, torch.iinfo(torch.int64).max)
        victims = torch.argsort(key, stable=True)[:span]
        got = torch.minimum(want.sum(), (~barred).sum()) * is_open
        j = torch.arange(span, device=dev)
        valid = j < got
        old = owner[victims]
        # Evictions first (distinct instances of layers <= layer), then admissions (distinct instances
        # of the target layer), so a masked-out write can never undo a real one.
        rm.index_put_((old,), torch.where(valid, -old - 1, rm[old].to(torch.int64)).to(torch.int32))
        rm.index_put_((new,), torch.where(valid, victims, rm[new].to(torch.int64)).to(torch.int32))
        owner.index_put_((victims,), torch.where(valid, new, old))
        pools.validated_version = pools.row_map._version
        self.inflight.index_put_((new,), valid | self.inflight[new])
        cache.last_use.index_put_((new,), torch.where(valid, cache.tick + n + j, cache.last_use[new]))
        cache.fill(victims, new, valid, got)
        self.prediction_history.index_copy_(0, row, rec[None])
        self.prefetch_history.index_copy_(0, row, got[None])

    # ------------------------------------------------------------------------ kernel path
    def route(self, cache, layer, x, norm_weight, eps, gate_weight, top_k, renormalize, counter, pdl):
        """The router's launch also computes the forecast (layer ``layer + depth``'s router on the
        same normed input, every program beside its own rows) and its last program makes the
        group's record and demand decisions (:func:`coldset.kernels.triton_slots.ahead_group`
        without its list: the demand victims with the in-flight rule); then the demand fill (a plain
        copy, the router's programmatic dependent); then, forked onto the decisions stream after it
        (or, with :attr:`list_after_experts`, after the layer's experts: :meth:`experts_done`), the
        forecast's list and the prefetch decisions (:func:`coldset.kernels.triton_slots.ahead_list`,
        one program) and after them on the side stream the prefetch copy, joined as the admit's
        path does (:meth:`_ahead_fork_join`). The next group's router waits for the list decisions
        (:meth:`_wait_list`: they write the state it reads, and read the forecast buffer it writes),
        so every group decides on the state the last one left, as the simulator does; the experts
        run beside them (a prefetch victim is never a slot the group uses)."""
        from coldset.kernels import triton_decode as td  # GPU-only path (Triton)
        from coldset.kernels import triton_slots as ts  # GPU-only path (Triton)

        new_step = self._ahead_open(cache, layer)
        target = layer + self.depth
        self._wait_list(cache)  # the last group's list decisions are complete before this group reads the state
        h, ids, w = td.route(x, norm_weight, eps, gate_weight, top_k, renormalize, counter, weights_dtype=x.dtype,
                             pdl=pdl, ahead=ts.route_ahead_args(cache, layer, target, new_step, x.shape[0] * top_k),
                             trigger=cache.pdl)
        ts.fill(cache.pools, cache.victims, cache.admitted, cache.num_misses, pdl=cache.pdl)
        self._ahead_fork_join(cache, layer, target, listed=ids.numel())
        cache.recorded_layer = layer
        return h, ids, w

    def _admit_kernel(self, cache, layer, topk_ids, topk_weights, dtype, hidden, cast):
        """The decisions in one Triton launch (demand and prefetch, the torch path's rules), the
        demand fill on the compute stream (the decisions' dependent launch), and the prefetch's copy
        forked onto the side stream: it starts once this layer's decisions are done, runs beside the
        compute of the layers after, and the compute stream joins it at the end of the admit of
        layer ``layer + depth``, right before that layer's experts kernel reads the row map. Its
        victims are slots of layers ``<= layer`` not used by this group, whose last reader (an
        experts kernel of an earlier layer) ran before the fork; every branch is joined within the
        step (the last MoE layer joins whatever is left), so a captured step forks and joins inside
        its graph. (In the fused decode step the router's launch makes these decisions: :meth:`route`.)"""
        from coldset.kernels.triton_slots import decide_ahead, fill  # GPU-only path (Triton)

        L = cache.pools.num_moe_layers
        new_step = self._ahead_open(cache, layer)
        target = layer + self.depth
        self._wait_list(cache)  # (a list route() forked reads forecast_out, which the GEMV below writes)
        # Every input of the decisions launch first (a torch op between the GEMV and the decisions
        # would end their overlap): the decisions are the GEMV's programmatic dependent with pdl.
        ids = topk_ids.reshape(-1).to(torch.int64).contiguous()
        w_in = topk_weights.contiguous().reshape(-1) if cast else None
        w_out = torch.empty(topk_weights.shape, dtype=dtype, device=topk_weights.device) if cast else None
        logits = self.forecast_logits(cache, hidden, target, pdl=cache.pdl) if target < L else None
        decide_ahead(cache, layer, ids, new_step, logits, target, w_in, w_out.view(-1) if cast else None,
                     after_forecast=logits is not None)
        fill(cache.pools, cache.victims, cache.admitted, cache.num_misses, pdl=cache.pdl)
        self._ahead_fork_join(cache, layer, target)
        return w_out if cast else topk_weights

    def _ahead_open(self, cache, layer: int) -> bool:
        """Host-side step bookkeeping (kernel path): whether group ``layer`` starts a new step (a
        layer not above the last one), after joining every copy still pending."""
        new_step = layer <= self.prev_layer
        if new_step:
            self.join(cache)  # nothing of the last step may still be in flight (a no-op after a full step)
        self.prev_layer = layer
        return new_step

    def _ahead_fork_join(self, cache, layer: int, target: int, listed: int | None = None) -> None:
        """After group ``layer``'s decisions and demand fill on the compute stream (either path):
        the prefetch for layer ``target`` forked (:meth:`_ahead_fork`; on :meth:`route`'s path with
        :attr:`list_after_experts`, left for :meth:`experts_done`), then the compute stream joins
        the copy forked for ``layer`` (before this layer's experts), and the last MoE layer joins
        whatever is left."""
        L = cache.pools.num_moe_layers
        if self.deferred_fork is not None:  # never silently: that fork's list decisions and copy would be lost
            raise RuntimeError(f"SlotCache: layer {self.deferred_fork[0]}'s prefetch fork is still pending at layer "
                               f"{layer}'s decisions: its experts did not run through wrap()'s experts function "
                               "(which calls experts_done)")
        if listed is not None and self.list_after_experts and target < L:
            self.deferred_fork = (layer, target, listed)
        else:
            self._ahead_fork(cache, layer, target, listed)
        self._join_layer(cache, layer)
        if layer == L - 1:
            self.join(cache)

    def experts_done(self, cache, layer: int) -> None:
        """The fork :meth:`route` deferred for ``layer`` (:attr:`list_after_experts`), if any. The
        list decisions then read the state after the same group's record and before the next
        group's, as without the deferral: the same decisions."""
        if self.deferred_fork is None:
            return
        fl, target, listed = self.deferred_fork
        if fl != layer:
            raise RuntimeError(f"SlotCache.experts_done: layer {layer}'s experts, but layer {fl}'s prefetch fork is "
                               "pending: its experts never ran")
        self.deferred_fork = None
        self._ahead_fork(cache, fl, target, listed)

    def _ahead_fork(self, cache, layer: int, target: int, listed: int | None) -> None:
        """The prefetch copy for layer ``target`` (if it is a layer) forked onto the side stream (an
        event on the compute stream, waited on by the side stream; ``prefetch_blocks`` blocks per
        weight). ``listed`` (:meth:`route`'s path: the group's selections): the list and its
        prefetch decisions first, on the decisions stream after the same event
        (:func:`coldset.kernels.triton_slots.ahead_list`), the copy after them; the next group's
        router waits for them (:meth:`_wait_list`)."""
        from coldset.kernels.triton_slots import ahead_list, fill  # GPU-only path (Triton)

        if target >= cache.pools.num_moe_layers:
            return
        side = self.side_stream  # (none: Triton's interpreter on the CPU, where launches run in order)
        if side is not None:
            self.fork_event.record(torch.cuda.current_stream(cache.owner.device))
        if listed is not None:
            dec = self.decide_stream if side is not None else None
            if dec is not None:
                dec.wait_event(self.fork_event)
            with torch.cuda.stream(dec) if dec is not None else contextlib.nullcontext():
                ahead_list(cache, layer, target, listed)
            if dec is not None:
                self.decided_events[layer].record(dec)
                self.forked = layer
                side.wait_event(self.decided_events[layer])
        elif side is not None:
            side.wait_event(self.fork_event)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            fill(cache.pools, self.pf_victims[target], self.pf_new[target], self.pf_count[target],
                 blocks=cache.prefetch_blocks)
            if side is not None:
                self.join_events[target].record(side)
        self.pending[target] = side is not None

    def _wait_list(self, cache) -> None:
        """(:meth:`route`'s path) The compute stream waits for the list decisions forked last (if
        any is pending): the next group's record reads the state they write."""
        if self.forked is not None:
            torch.cuda.current_stream(cache.owner.device).wait_event(self.decided_events[self.forked])
            self.forked = None

    def _join_layer(self, cache, layer: int) -> None:
        """The compute stream waits for the prefetch copy forked for ``layer`` (if one is pending)."""
        if self.pending[layer]:
            torch.cuda.current_stream(cache.owner.device).wait_event(self.join_events[layer])
            self.pending[layer] = False

    def join(self, cache) -> None:
        """The compute stream waits for the list decisions and every prefetch copy still pending
        (host-side bookkeeping, no sync)."""
        self._wait_list(cache)
        if self.side_stream is None:
            return
        for layer in range(len(self.pending)):
            self._join_layer(cache, layer)
