"""The engine's ``nexttoken`` policy: the rules of :mod:`coldset.analysis.policies.nexttoken`, its
forecaster (:class:`coldset.analysis.forecast.NextTokenForecaster`) handed to
:meth:`coldset.engine.cache.pool.SlotCache.build`.

After group (step ``t``, layer ``l``) the forecast of layer ``l``'s experts at step ``t + 1`` (integer
table sums over the forecaster's (token, layer) terms plus each lane's decayed history, top ``n``
per lane, round robin), and its missing experts prefetched into slots not used by the group, not in
flight and not predicted, least recent first; demand victims by (predicted, recency) past the
in-flight slots; layer ``l``'s prefetches stay in flight until group (``t + 1``, ``l``). No victim
(demand or prefetch) among the instances the last ``L`` groups used or prefetched (``lru_guard``'s
bar, in ticks: :meth:`coldset.engine.cache.policy.PrefetchingPolicy.guard_ticks`), and the prefetch
only while the gate is open (the running precision and lead of the lists,
:func:`coldset.analysis.policies.base.prefetch_lead_unit`; closed, the forecast flags nothing as
predicted either).

On CUDA in the fused step: the router's launch records the group, the fill's blocks choose the
demand victims, commit and copy (compute stream); the forecast and prefetch decisions are one launch
on a decisions stream (:func:`coldset.kernels.triton_slots.decide_next`; the next group's router
waits for it, so every group decides on the state the last one left) and the copies one tagged
launch a layer on one copy stream (the link's queue), which the compute stream joins only after the
step's last MoE layer's experts (:meth:`NextToken.end_step`, from the experts function of
:meth:`~coldset.engine.cache.pool.SlotCache.wrap`): the copies run beside the rest of the step. A
prefetched instance's row map points at its slot only after that join, and only if the slot's done
tag (written by the copy's last block once every row landed) equals the tag its prefetch was issued
with (monotonic per slot); otherwise it stays on its host row, counts as ``stale``, and its slot is
left empty (owner :data:`coldset.engine.cache.policy.EMPTY_SLOT`, named by no row-map entry, the first
victim of a later admission): bitwise parity holds either way (no kernel reads a slot its row map
does not name) and the row map and the owners agree. Why the join is at the
step's end and not at the next step's layer ``l``: a side branch forked inside a captured step must
rejoin inside that graph. On the CPU (and off the fused router) the same decisions are torch ops and
the copies plain copies.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from coldset.engine.cache.lru import record_and_fill
from coldset.engine.cache.policy import EMPTY_SLOT, EMPTY_TICK, PoolShape, PrefetchingPolicy, slot_values


def forecast_arrays(forecaster, num_moe_layers: int, num_experts: int) -> dict:
    """The arrays of a next-token forecaster (:class:`coldset.analysis.forecast.NextTokenForecaster`: its
    ``terms`` (``(a, d)``: token offset ``a >= 0``, layer offset ``d``), int32 ``tables`` ``[J, L, E,
    E]``, ``num_predictions`` per token, the per-sequence history's ``hist_unit`` and ``hist_shift``,
    ``horizon`` 1), checked against the model: ``{terms int64 [J, 2], tables, n, hist_unit,
    hist_shift}``."""
    if forecaster is None:
        raise ValueError("policy 'nexttoken' needs a next-token forecaster "
                         "(coldset.analysis.forecast.NextTokenForecaster)")
    terms = np.asarray(forecaster.terms, dtype=np.int64).reshape(-1, 2)
    tables = np.asarray(forecaster.tables)
    n = int(forecaster.num_predictions)
    unit, shift = int(forecaster.hist_unit), int(forecaster.hist_shift)
    L, E = num_moe_layers, num_experts
    if int(getattr(forecaster, "horizon", 1)) != 1:
        raise ValueError(f"forecaster.horizon: the engine prefetches for the next token (1), got {forecaster.horizon}")
    if terms.shape[0] == 0 or (terms[:, 0] < 0).any() or ((terms[:, 0] == 0) & (terms[:, 1] < 0)).any():
        raise ValueError(f"forecaster.terms: (a, d) pairs with a >= 0 (and d >= 0 where a = 0), got {terms.tolist()}")
    if tables.shape != (terms.shape[0], L, E, E) or tables.dtype != np.int32:
        raise ValueError(f"forecaster.tables: int32 [{terms.shape[0]}, {L}, {E}, {E}] expected, got "
                         f"{tables.dtype} {tables.shape}")
    if tables.size >= 2**31:
        raise ValueError(f"forecaster.tables: {tables.size} entries; the kernel's offsets need fewer than 2**31")
    if not 1 <= n <= E or unit < 0 or not 0 < shift < 31:
        raise ValueError(f"forecaster: num_predictions in [1, {E}], hist_unit >= 0 and hist_shift in [1, 30] "
                         f"expected, got {n}, {unit}, {shift}")
    return {"terms": terms, "tables": tables, "n": n, "hist_unit": unit, "hist_shift": shift}


class NextToken(PrefetchingPolicy):
    """``nexttoken``'s state: per instance whether the latest forecast of its layer names it (uint8
    as bool ``[L*E]``); per slot the tag of its latest prefetch and the tag its copy wrote back
    (int64 ``[C]``); commits refused for a tag that had not landed (int64 ``[1]``); the ring of the
    last ``R`` steps' selections (int64 ``[R, L, max_tokens * k]``, -1 = none) and the step counter;
    the forecaster's terms (device int64 ``[J, 2]`` and host list) and tables (int32 ``[J, L, E,
    E]``); the forecast's per-sequence history (int32 ``[L, max_tokens, E]``: a decayed count of each
    lane's selections per layer, zero at a reset) with its increment and decay shift; the
    prefetch's tags per layer; the decisions and copy streams, per layer the fork and decided
    events, the copy's end event and ticket; whether a step is open, the last layer whose side work
    was forked and not yet waited on, and each layer's router ids the side launch reads (kept
    allocated) (host side). The gate's state: :class:`coldset.engine.cache.policy.PrefetchingPolicy`'s."""

    name = "nexttoken"
    routes = True

    @classmethod
    def create(cls, shape: PoolShape, *, forecaster=None, prefetch_budget: int | None = None,
               lead_unit: int | None = None, prefetch_gate: bool = True, **_) -> "NextToken":
        """``forecaster`` (:func:`forecast_arrays`), ``prefetch_budget`` (copies issued per group at
        most; None = the whole list, ``max_tokens * n``) and ``lead_unit`` (the gate's,
        :func:`coldset.analysis.policies.base.prefetch_lead_unit`; None: the default); ``prefetch_gate``
        False: the gate's sums are kept but it never closes (the simulator's ``prefetch_gate``)."""
        L, E, dev = shape.num_moe_layers, shape.num_experts, shape.device
        fc = forecast_arrays(forecaster, L, E)
        width = shape.max_tokens * fc["n"]
        budget = width if prefetch_budget is None else int(prefetch_budget)
        if budget < 0:
            raise ValueError(f"prefetch_budget must be >= 0, got {prefetch_budget}")
        span = min(width, E, shape.capacity)
        cuda = dev.type == "cuda"
        terms, tables = fc["terms"], fc["tables"]
        ring = int(terms[:, 0].max()) + 1
        self = cls()
        self.init_lists(shape, width=width, span=span, lead_unit=lead_unit, prefetch_gate=prefetch_gate)
        self.predicted = torch.zeros(L * E, dtype=torch.bool, device=dev)
        self.tags = torch.zeros(shape.capacity, dtype=torch.int64, device=dev)
        self.done = torch.zeros(shape.capacity, dtype=torch.int64, device=dev)
        self.stale = torch.zeros(1, dtype=torch.int64, device=dev)
        self.selections = torch.full((ring, L, shape.max_tokens * shape.top_k), -1, dtype=torch.int64, device=dev)
        self.step = torch.full((1,), -1, dtype=torch.int64, device=dev)
        self.terms = torch.as_tensor(terms, device=dev).contiguous()
        self.terms_host = [(int(a), int(d)) for a, d in terms]
        self.tables = torch.as_tensor(tables, device=dev).contiguous()
        self.num_predictions, self.prefetch_budget = fc["n"], budget
        self.seq_history = torch.zeros((L, shape.max_tokens, E), dtype=torch.int32, device=dev)
        self.hist_unit, self.hist_shift = fc["hist_unit"], fc["hist_shift"]
        self.pf_tags = torch.zeros((L, span), dtype=torch.int64, device=dev)
        self.decide_stream = torch.cuda.Stream(dev) if cuda else None
        self.copy_stream = torch.cuda.Stream(dev) if cuda else None
        self.fork_events = [torch.cuda.Event() for _ in range(L)] if cuda else None
        self.decided_events = [torch.cuda.Event() for _ in range(L)] if cuda else None
        self.copy_event = torch.cuda.Event() if cuda else None
        self.copy_ticket = torch.zeros(1, dtype=torch.int32, device=dev) if cuda else None
        self.step_open = False
        self.forked = None
        self.ids_alive = [None] * L
        return self

    def admit(self, cache, layer, topk_ids, topk_weights, dtype, hidden, cast):
        """Off the fused router: the torch decisions (copies on this stream)."""
        self.decide(cache, layer, topk_ids, hidden)
        return topk_weights.to(dtype) if cast else topk_weights

    def route(self, cache, layer, x, norm_weight, eps, gate_weight, top_k, renormalize, counter, pdl):
        """The router's launch records the group and the fill chooses the demand victims
        (:func:`coldset.engine.cache.lru.record_and_fill`), after the last group's side decisions;
        then the side work (:meth:`_fork_next`)."""
        new_step = self._open_group(cache, layer)
        if self.forked is not None and self.decide_stream is not None:
            # the last side decisions are complete before this group reads the state
            torch.cuda.current_stream(x.device).wait_event(self.decided_events[self.forked])
        h, ids, w = record_and_fill(cache, layer, x, norm_weight, eps, gate_weight, top_k, renormalize, counter, pdl)
        self._fork_next(cache, layer, ids, new_step)
        return h, ids, w

    def _open_group(self, cache, layer: int) -> bool:
        """Host-side step bookkeeping of a group: whether it starts a new step (a layer not above
        the last one); a step still open is ended first (its copies joined, committed)."""
        new_step = layer <= self.prev_layer
        if new_step:
            if self.step_open:
                self.end_step(cache)
            self.step_open = True
        self.prev_layer = layer
        return new_step

    def _fork_next(self, cache, layer: int, ids: torch.Tensor, new_step: bool) -> None:
        """On CUDA after group (step, ``layer``)'s demand launch: the forecast and prefetch
        decisions forked onto the decisions stream (:func:`coldset.kernels.triton_slots.decide_next`;
        the next group's router waits for them, so every group decides on the state the last one
        left), then the tagged copy onto the copy stream (one queue: the link's order), which the
        compute stream waits for only at the step's end (:meth:`end_step`). Why the copy's slots are
        safe: a victim is not used by this group (whose experts kernel runs beside the copy), its
        instance's row map went back to the host tier in the decisions (no later kernel reads the
        slot), and the prefetched instance's row map points at the slot only after the join."""
        from coldset.kernels.triton_slots import decide_next, fill  # GPU-only path (Triton)

        side = self.decide_stream is not None  # (no streams: Triton's interpreter on the CPU, in order)
        self.ids_alive[layer] = ids  # read on the side stream: never freed (nor reused) under it
        if side:
            self.fork_events[layer].record(torch.cuda.current_stream(ids.device))
            self.decide_stream.wait_event(self.fork_events[layer])
        with torch.cuda.stream(self.decide_stream) if side else contextlib.nullcontext():
            decide_next(cache, layer, ids.reshape(-1), new_step)
            if side:
                self.decided_events[layer].record(self.decide_stream)
        if side:
            self.copy_stream.wait_event(self.decided_events[layer])
        with torch.cuda.stream(self.copy_stream) if side else contextlib.nullcontext():
            fill(cache.pools, self.pf_victims[layer], self.pf_new[layer], self.pf_count[layer],
                 blocks=cache.prefetch_blocks, tags=(self.pf_tags[layer], self.done, self.copy_ticket))
        self.forked = layer

    def end_step(self, cache) -> None:
        """At a step's end (after its last MoE layer's experts): the compute stream joins the
        decisions and the copy queue (CUDA; a no-op wait elsewhere), then the commit: each of the
        step's prefetches whose slot holds the tag it was issued with gets its row map entry (the
        others stay on their host rows, count as stale and leave their slots empty). In a captured
        step both are inside the graph."""
        if not self.step_open:
            return
        if self.forked is not None:
            from coldset.kernels.triton_slots import commit_prefetches  # GPU-only path (Triton)

            if self.decide_stream is not None:
                main = torch.cuda.current_stream(cache.owner.device)
                main.wait_event(self.decided_events[self.forked])
                self.copy_event.record(self.copy_stream)
                main.wait_event(self.copy_event)
            commit_prefetches(cache)
            self.forked = None
        else:
            self._commit_torch(cache)
        self.step_open = False

    def _commit_torch(self, cache) -> None:
        """:meth:`end_step`'s commit as torch ops (the CPU path; the commit kernel's reference)."""
        span = self.pf_victims.shape[1]
        ok = torch.arange(span, device=cache.owner.device)[None, :] < self.pf_count
        good = ok & (self.done[self.pf_victims] == self.pf_tags)
        rm = cache.pools.row_map.view(-1)
        new = self.pf_new.reshape(-1)
        rm.index_put_((new,), torch.where(good.reshape(-1), self.pf_victims.reshape(-1), rm[new].to(torch.int64))
                      .to(torch.int32))
        cache.pools.validated_version = cache.pools.row_map._version
        # a slot whose copy did not land holds no expert: empty (no row-map entry names it)
        bad = ok & ~good
        lost = torch.zeros_like(cache.owner).index_add_(0, self.pf_victims.reshape(-1), bad.reshape(-1).to(torch.int64))
        cache.owner.copy_(torch.where(lost > 0, EMPTY_SLOT, cache.owner))
        self.stale.add_(bad.sum())
        self.pf_count.zero_()

    def decide(self, cache, layer: int, topk_ids: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        """Group (step, ``layer``) as torch ops, in the rules' order
        (:mod:`coldset.analysis.policies.nexttoken`; the kernels' reference): the commit of layer
        ``layer``'s previous prefetches (in-flight flags), the demand (victims not used by the group
        and not in flight, unpredicted least recent first; misses past them read in place), the
        forecast and the predicted flags, the prefetch (victims not used, not in flight, not
        predicted, least recent first; the row map of a prefetched instance waits for
        :meth:`end_step`), the counters and the group's list."""
        new_step = self._open_group(cache, layer)
        pools = cache.pools
        L, E = pools.num_moe_layers, pools.num_experts
        dev = topk_ids.device
        ids = topk_ids.reshape(-1).to(torch.int64)
        n = ids.numel()
        k = cache.top_k
        T = n // k
        base = layer * E
        rm = pools.row_map.view(-1)
        big = torch.iinfo(torch.int64).max
        inst, hit, pos, used, m, slots_max, new_inst = cache.read_group(layer, ids)
        owner = cache.owner
        # 1. commit: layer `layer`'s prefetches of the last step are no longer in flight
        self.inflight[base:base + E] = False
        # 2. demand (never an instance the last L groups used or prefetched)
        guard = self.guard_tick(cache, n)
        in_group = (owner // E == layer) & used[owner % E]  # (an empty slot's owner -1 is of no layer)
        lu = slot_values(cache.last_use, owner, EMPTY_TICK)  # an empty slot: the first victim
        barred = in_group | slot_values(self.inflight, owner, False) | (lu >= guard)
        order = torch.argsort(lu.masked_fill(barred, big), stable=True)
        pr = slot_values(self.predicted, owner, False).to(torch.float64).masked_fill(barred, float("inf"))[order]
        victims = order[torch.argsort(pr, stable=True)][:slots_max]
        valid = torch.arange(slots_max, device=dev) < torch.minimum(m, (~barred).sum())
        cache.admit_rows(victims, new_inst, valid)
        cache.last_use.scatter_reduce_(0, inst, cache.tick + pos, "amax")
        cache.count.index_add_(0, inst, torch.ones(n, dtype=cache.count.dtype, device=dev))
        # 3. forecast: the group's selections into the ring, then the terms' integer table sums
        if new_step:
            self.step.add_(1)
        R, _, nsel = self.selections.shape
        ring = self.selections.view(-1)
        row = self.step % R
        ring.index_put_(((row * L + layer) * nsel + pos,), ids)
        # the lanes' history of this layer: decayed, plus the experts each lane selected now
        h = self.seq_history[layer, :T]
        onehot = torch.zeros((T, E), dtype=torch.int32, device=dev).scatter_(1, ids.view(T, k), 1)
        h.copy_(h - (h >> self.hist_shift) + self.hist_unit * onehot)
        score = h.to(torch.int64)
        for j, (a, d) in enumerate(self.terms_host):
            src = layer - d
            if not 0 <= src < L:
                continue
            e = ring[(((self.step - a) % R) * L + src) * nsel + pos].view(T, k)
            e_ok = (e >= 0) & (self.step - a >= 0)
            score += (self.tables[j, layer][e.clamp(min=0)].to(torch.int64) * e_ok[..., None]).sum(1)
        top = torch.sort(-score, dim=1, stable=True).indices[:, :self.num_predictions]  # ties: the lower id
        lst = top.T.reshape(-1)  # round robin: rank, then token
        W = lst.numel()
        firsts = (W + torch.arange(E, device=dev)).scatter_reduce_(0, lst, torch.arange(W, device=dev), "amin")
        seq = torch.argsort(firsts) + base  # listed experts in first-occurrence order, then the others
        listed = torch.arange(E, device=dev) < (firsts < W).sum()
        width = self.prediction_history.shape[1]
        rec = torch.where(listed, seq, -1)
        rec = rec[:width] if E >= width else torch.nn.functional.pad(rec, (0, width - E), value=-1)
        # the gate judges this layer's last list; closed, the forecast flags nothing and fetches nothing
        is_open = self.gate(cache, layer, used)
        self.predicted[base:base + E] = False
        self.predicted.index_put_((seq,), listed & is_open)
        # 4. the prefetch (this list's wanted instances kept for the gate)
        want = listed & (rm[seq] < 0)
        wanted = seq[torch.argsort((~want).to(torch.int64), stable=True)]  # the wanted first, in list order
        self.keep_wanted(layer, wanted, want.sum())
        self.group_index.add_(1)
        span = self.pf_victims.shape[1]
        new = wanted[:span]
        in_group = (owner // E == layer) & used[owner % E]
        lu = slot_values(cache.last_use, owner, EMPTY_TICK)
        barred = (in_group | slot_values(self.inflight, owner, False) | slot_values(self.predicted, owner, False)
                  | (lu >= guard))
        pv = torch.argsort(lu.masked_fill(barred, big), stable=True)[:span]
        got = torch.minimum(torch.minimum(want.sum(), torch.tensor(self.prefetch_budget, device=dev)), (~barred).sum())
        got = got * is_open
        j = torch.arange(span, device=dev)
        ok = j < got
        old = owner[pv]
        # the evicted back to their host rows, as differences (a masked lane or an empty victim adds 0)
        held = old.clamp_min(0)
        rm.index_put_((held,), torch.where(ok & (old >= 0), -old - 1 - rm[held].to(torch.int64), 0).to(torch.int32),
                      accumulate=True)
        owner.index_put_((pv,), torch.where(ok, new, old))
        pools.validated_version = pools.row_map._version
        self.inflight.index_put_((new,), ok | self.inflight[new])
        cache.last_use.index_put_((new,), torch.where(ok, cache.tick + n + j, cache.last_use[new]))
        tags = self.tags[pv] + ok.to(torch.int64)
        self.tags.index_put_((pv,), tags)
        self.pf_victims[layer], self.pf_new[layer], self.pf_tags[layer] = pv, new, tags
        self.pf_count[layer] = got
        cache.fill(pv, new, ok, got, tags=(self.pf_tags[layer], self.done, self.copy_ticket))
        hrow = cache.groups % cache.history.shape[0]
        self.prediction_history.index_copy_(0, hrow, rec[None])
        self.prefetch_history.index_copy_(0, hrow, got[None])
        cache.tick.add_(n + width)
        hits = hit.sum()
        stats = torch.stack([hits, n - hits, m])
        cache.totals.add_(stats)
        cache.history.index_copy_(0, hrow, stats[None])
        cache.groups.add_(1)

    def join(self, cache) -> None:
        """The open step ends (:meth:`end_step`)."""
        if self.step_open:
            self.end_step(cache)

    def reset(self, cache) -> None:
        """No forecast yet, nothing in flight or pending; the tags stay monotonic across resets."""
        super().reset(cache)
        self.predicted.zero_()
        self.done.copy_(self.tags)
        self.selections.fill_(-1)
        self.seq_history.zero_()
        self.step.fill_(-1)
        self.pf_count.zero_()
        self.step_open, self.forked = False, None

    def reset_counters(self) -> None:
        super().reset_counters()
        self.stale.zero_()

    def counters(self, cache) -> dict[str, int]:
        """``"prefetches"`` and ``"stale"``: commits refused because a copy's tag had not landed."""
        return {**super().counters(cache), "stale": int(self.stale)}
