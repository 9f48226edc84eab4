"""The dynamic expert cache in the engine: one pool of slots in HBM shared by every MoE layer.

A dynamic placement (``lru-0.5``, ``lfu-0.5``) keeps the data structures of a static one
(DESIGN.md §3): the hot pool becomes ``C`` *slots*, the cold pool is the host tier that holds a
copy of every expert (row ``layer * E + expert``, :class:`coldset.kernels.tiers.HostTier`), and the row map
is the lookup table instance -> slot (``r >= 0``) or host row (``r < 0``). The experts kernel is
unchanged: it loads the row map once per block, so a dynamic run is bitwise the unmodified path
as long as every slot the row map names holds the expert it names.

After each MoE layer's router has run, :meth:`SlotCache.admit` makes the cache's decisions for
that (step, layer) group by the rules of :mod:`coldset.analysis.cache`'s module doc (the simulator, which
implements the same rules on traces):

- hits and misses per selection (an instance is resident iff its row-map entry is ``>= 0``);
- victims: the resident instances *not used by this group* (the hazard guard: a slot the same
  group still needs is never evicted; vLLM's expert-cache PR shipped without it and served wrong
  weights silently), ``lru`` by least recent use, ``lfu`` by (use count, last use); the k-th
  victim goes to the k-th missed instance in selection order; ``lru_guard`` takes no victim
  among the instances the last ``L`` groups used (one step's worth) and reads the misses past
  the remaining slots in place, not admitted: where a step's experts outnumber the slots, lru
  evicts what the next step needs again and thrashes; the guard keeps the pool and streams the
  surplus (the batch-8, residency-0.25 rows of BENCHMARKS.md);
- the row-map update: an evicted instance's entry goes back to its host row (the host tier holds
  every expert, so an eviction is a write of one int32, never a copy back), the admitted one's
  entry becomes its slot;
- the fill: the admitted instance's weights (block-FP8 experts: and their scales, in the same
  copy) are copied from the host tier into its slot. On CUDA
  a small Triton kernel (:mod:`coldset.kernels.triton_slots`) reads the pinned host tier in place
  and copies only the rows of actual misses (its grid is fixed; blocks past the step's miss count
  return at once); on the CPU a plain indexed copy.

On CUDA, in the fused decode step, an ``lru``/``lfu`` group costs one launch beside the
router's (:meth:`SlotCache.route`, :mod:`coldset.kernels.triton_slots`): the router's launch
records the group in its last program, which holds the selections in registers (hits, recency,
counts, the missed instances), and the fill, the router's programmatic dependent on sm90+,
chooses the victims, commits them to the row map and copies the admitted rows; the layer's
:meth:`admit` then makes no decision. Elsewhere on CUDA (a router that is not the fused launch)
:meth:`admit` makes the same decisions in one Triton launch of its own, which also casts the
router weights (a launch every path has), and the fill follows it. On the CPU they are torch ops
(the same decisions, which CI tests against the simulator). All have shapes fixed by the batch
size and no host synchronisation, so the whole decode step (every layer's decisions and fills
included) is one CUDA graph, and a replay re-runs the decisions on the data of that step.

``lookahead`` (the placement ``lookahead-0.5``, depth from ``cache.lookahead_depth``): ``lru`` plus, after each
group of layer ``l``, the prefetch of layer ``l + depth``'s forecast, the top-``k`` experts of that
layer's router applied to layer ``l``'s router input (pre-gated MoE), with the rules of the
simulator's ``lookahead`` policy (:mod:`coldset.analysis.cache`): a prefetched instance takes the least
recent slot of layers ``<= l`` not used by the group and not in flight, is in flight until the
step ends (no demand miss evicts it; a demand miss that finds no other slot is read in place, not
admitted), and enters the recency order after the group's accesses. The engine records each
group's list (:meth:`SlotCache.prefetch_lists`), which the simulator replays for the step-by-step
equality. On the CPU the decisions are torch ops and the copies plain indexed copies. On CUDA in
the fused decode step (:meth:`SlotCache.route`) the router's launch makes the whole decision: each
of its programs computes the forecast of layer ``l + depth``'s router rows beside its own (on the
same normed input) and its last program, holding the selections in registers, runs the decisions
(:func:`coldset.kernels.triton_slots.ahead_group`, the body :func:`~coldset.kernels.triton_slots.decide_ahead`'s
launch runs too); a group is then that launch, the demand fill (its programmatic dependent) and
the prefetch copy, two launches fewer than the way below (why: 107.5 + 198.9 us a step of 48
layers at b1 on the H200 for the GEMV and the decisions launch; the fused way's router launch
costs 151 us a step beyond the plain router's against lru's 54, the step at residency 1.0 0.954
of all-HBM: BENCHMARKS.md section 4). Elsewhere on CUDA (a router that is not the fused launch) a
group is the forecast's GEMV (one Triton launch over the router in the model's dtype, float32
sums: :func:`coldset.kernels.triton_slots.forecast_logits`), one Triton launch for all the
decisions (demand with the in-flight rule, the forecast's top ``k`` by one partial sort, the
prefetch: :func:`coldset.kernels.triton_slots.decide_ahead`; on sm90+ the GEMV's programmatic
dependent, its demand part beside the GEMV), the demand fill on the
compute stream, and the prefetch copy (the same fill kernel, ``prefetch_blocks`` blocks per
weight) forked onto a side stream: an event recorded on the compute stream after the decisions
and the demand fill, waited on by the side stream; the copy's own event is waited on by the compute stream at the end of
:meth:`admit` of layer ``l + depth``, right before that layer's experts kernel reads the row map
(the commit: no kernel reads a prefetched slot before its copy is complete). Why the victims are
safe while the copy runs: their last reader was an experts kernel of a layer before ``l`` (ordered
before the fork) or none (not used by the group), and no later group of the step may evict or
read them. Fork and join are recorded in the step's CUDA graph; the last MoE layer joins whatever
is left, so every branch ends inside the step. A copy engine (``cudaMemcpyAsync``) cannot do this
copy inside the graph: its addresses are fixed at capture, and the rows to copy are decided on
the device during the step.

``nexttoken`` (issue 28; the rules of :mod:`coldset.analysis.cache`'s ``nexttoken``, its forecaster
:class:`coldset.analysis.forecast.NextTokenForecaster` handed to :meth:`SlotCache.build`): after group
(step ``t``, layer ``l``) the forecast of layer ``l``'s experts at step ``t + 1`` (integer table
sums over the forecaster's (token, layer) terms plus each lane's decayed history, top ``n`` per
lane, round robin), and its missing experts prefetched into slots not used by the group, not in
flight and not predicted, least recent first; demand victims by (predicted, recency) past the
in-flight slots; layer ``l``'s prefetches stay in flight until group (``t + 1``, ``l``). On CUDA
in the fused step: the router's launch records the group, the fill's blocks choose the demand
victims, commit and copy (compute stream); the forecast and prefetch decisions are one launch on a
decisions stream (:func:`coldset.kernels.triton_slots.decide_next`; the next group's router waits
for it, so every group decides on the state the last one left) and the copies one tagged launch a
layer on one copy stream (the link's queue), which the compute stream joins only after the
step's last MoE layer's experts (:meth:`SlotCache.end_step`, from :meth:`SlotCache.wrap`): the
copies run beside the rest of the step. A prefetched instance's row map points at its slot only
after that join, and only if the slot's done tag (written by the copy's last block once every row
landed) equals the tag its prefetch was issued with (monotonic per slot); otherwise it stays on
its host row and counts as ``stale`` (bitwise parity holds either way: no kernel reads a slot its
row map does not name). Why the join is at the step's end and not at the next step's layer
``l``: a side branch forked inside a captured step must rejoin inside that graph. On the CPU (and
off the fused router) the same decisions are torch ops and the copies plain copies.

Groups with more than ``max_tokens`` tokens (prefill) read through the current row map and change
nothing: the cache decides for decode steps, as the simulator replays decode tokens.

Warm start: the slots initially hold the static ``usage_global`` set of the same size (the
``usage_global`` placement's row map at that residency: slot ``r`` = its hot row ``r``), with the
recency order "profile count ascending, ties by instance id", so the least-used warm instance is
evicted first.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from coldset.kernels import KERNEL_MAX_SLOTS
from coldset.core.placement import DYNAMIC_POLICIES, lookahead_depth_for
from coldset.kernels.tiers import ExpertPools, HostTier

_NEVER = -(2**62)  # last_use of an instance never seen (not resident, so never compared)


# The engine's policies: the placements' dynamic ones (lookahead: lru + a prefetch of the next
# layers' router forecasts) and nexttoken (a forecast of each layer's experts for the next token,
# coldset.analysis.cache's rules; its forecaster is handed to build()).
ENGINE_POLICIES = tuple(dict.fromkeys((*DYNAMIC_POLICIES, "nexttoken")))


def forecast_arrays(forecaster, num_moe_layers: int, num_experts: int) -> dict:
    """The arrays of a next-token forecaster (:class:`coldset.analysis.forecast.NextTokenForecaster`: its
    ``terms`` (``(a, d)``: token offset ``a >= 0``, layer offset ``d``), int32 ``tables`` ``[J, L, E,
    E]``, ``num_predictions`` per token, the per-sequence history's ``hist_unit`` and ``hist_shift``,
    ``horizon`` 1), checked against the model: ``{terms int64 [J, 2], tables, n, hist_unit,
    hist_shift}``."""
    if forecaster is None:
        raise ValueError("policy 'nexttoken' needs a next-token forecaster (coldset.analysis.forecast.NextTokenForecaster)")
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


class CacheCapacityError(ValueError):
    """The pool has fewer slots than one step's selections can need."""


def _pdl_available(device: torch.device) -> bool:
    from coldset.kernels.triton_slots import pdl_available

    return pdl_available(device)


def warm_order(warm_instances: np.ndarray, warm_counts: np.ndarray) -> np.ndarray:
    """The warm instances in eviction order: profile count ascending, ties by instance id ascending."""
    warm_instances = np.asarray(warm_instances, dtype=np.int64)
    order = np.lexsort((warm_instances, np.asarray(warm_counts, dtype=np.float64)))
    return warm_instances[order]


@dataclass
class SlotCache:
    """The slot pool, its device-side state and the decisions of one policy (see the module doc).

    ``pools`` is what the experts kernel reads: ``w13_hot``/``w2_hot`` are the ``C`` slots on the
    compute device, ``w13_cold``/``w2_cold`` the host tier (every expert), ``row_map`` int32
    ``[L, E]``. State on the device: ``owner`` int64 ``[C]`` (the instance each slot holds),
    ``last_use`` int64 ``[L*E]`` (tick of each instance's last access), ``count`` float64
    ``[L*E]`` (profile count at warm start for warm instances + accesses since), ``tick`` int64
    ``[1]`` (selections seen). ``totals`` int64 ``[3]`` counts (hits, missed selections, fills =
    distinct missed instances copied over the link) since :meth:`reset_counters`; ``history``
    int64 ``[capacity, 3]`` holds the same per group (ring buffer, ``groups`` groups so far).
    """

    pools: ExpertPools
    policy: str
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
    warm_state: tuple[torch.Tensor, ...] | None = None
    # The Triton path's outputs for the fill (CUDA): victims, admitted instances, their number.
    victims: torch.Tensor | None = None
    admitted: torch.Tensor | None = None
    num_misses: torch.Tensor | None = None
    use_kernel: bool = False  # decisions by the Triton kernel (CUDA default) or torch ops
    pdl: bool = False  # the fill as the decisions' programmatic dependent launch (sm90+, kernel path)
    # lookahead: the routers [E, H] of every MoE layer, the depth d, the state (in flight until the
    # step ends), per group the prediction list issued ([history, width], -1 padded) and the prefetches
    routers: list | None = None
    depth: int = 1
    inflight: torch.Tensor | None = None
    prediction_history: torch.Tensor | None = None
    prefetch_history: torch.Tensor | None = None
    prev_layer: int = 0  # the last group's layer (host side: the call order is the step's)
    # lookahead on the kernel path (CUDA): per target layer the prefetch's victims, instances and
    # count ([L, span], [L, span], [L, 1]: one row per target, so a copy still in flight on the side
    # stream never has its list overwritten within the step), the side stream, the fork event and
    # per target the join event and whether a copy for it was forked in this step (host side).
    # the forecast's operands: each MoE layer's router [E, H] contiguous in its own (the model's)
    # dtype, read as it is by the GEMV launch or the router's launch (kernel path) or cast by torch.mm
    # (torch path), and the kernel path's float32 logits [max_tokens, E] (one buffer: each group's are
    # read by its decisions launch, or the router launch's last program, on the same stream, before
    # the next group's launch writes it)
    forecast_routers: list | None = None
    forecast_out: torch.Tensor | None = None
    pf_victims: torch.Tensor | None = None
    pf_new: torch.Tensor | None = None
    pf_count: torch.Tensor | None = None
    side_stream: object = None
    fork_event: object = None
    join_events: list | None = None
    pending: list | None = None
    prefetch_blocks: int = 32  # blocks per weight of the prefetch copy beside the compute
    # lookahead on route()'s path: fork the forecast's list and the prefetch copy after the layer's
    # experts (experts_done) instead of after its demand fill, so that they run beside the next
    # layer's attention GEMVs rather than beside this layer's w13 launch. The same decisions in the
    # same order either way. build() sets it where depth >= 2 (measured on the H200, issue 28 eighth
    # session, bench cache --other-fork: with it w13 takes 778 instead of 886 µs a step at b1 and
    # residency 0.5 runs at 0.560 instead of 0.543 of all-HBM at depth 4, the same at b8 (0.167 and
    # 0.166); at depth 1 the copy would start after the experts of the one layer it has to cross,
    # and b8 residency 0.5 fell from 0.183 to 0.159).
    list_after_experts: bool = False
    deferred_fork: tuple | None = None  # (layer, target, listed) route() left for experts_done
    # lru/lfu on the kernel path: the fill's ticket (int32 [1], zero between launches) and the layer
    # whose group the router's launch recorded (host side: route() then admit() of that layer)
    fill_ticket: torch.Tensor | None = None
    recorded_layer: int | None = None
    # nexttoken (see the module doc): per instance whether the latest forecast of its layer names it
    # (uint8 as bool [L*E]); per slot the tag of its latest prefetch and the tag its copy wrote
    # back (int64 [C]); commits refused for a tag that had not landed (int64 [1]); the ring of the
    # last R steps' selections (int64 [R, L, max_tokens * k], -1 = none) and the step counter; the
    # forecaster's terms (device int64 [J, 2] and host list) and tables (int32 [J, L, E, E]); the
    # prefetch's tags per layer; the decisions and copy streams, per layer the fork and decided
    # events, the copy's end event and ticket; whether a step is open (host side). lookahead on
    # route()'s path uses the decisions stream, the decided events and ``forked`` too (its lists).
    predicted: torch.Tensor | None = None
    tags: torch.Tensor | None = None
    done: torch.Tensor | None = None
    stale: torch.Tensor | None = None
    selections: torch.Tensor | None = None
    step: torch.Tensor | None = None
    terms: torch.Tensor | None = None
    terms_host: list | None = None
    tables: torch.Tensor | None = None
    num_predictions: int = 0
    prefetch_budget: int = 0
    # the forecast's per-sequence history H (int32 [L, max_tokens, E]: a decayed count of each
    # lane's selections per layer, zero at a reset) and its increment and decay shift
    seq_history: torch.Tensor | None = None
    hist_unit: int = 0
    hist_shift: int = 1
    pf_tags: torch.Tensor | None = None
    decide_stream: object = None
    copy_stream: object = None
    fork_events: list | None = None
    decided_events: list | None = None
    copy_event: object = None
    copy_ticket: torch.Tensor | None = None
    step_open: bool = False
    forked: int | None = None  # the last layer whose side work was forked and not yet waited on (kernel path)
    ids_alive: list | None = None  # each layer's router ids the side launch reads (kept allocated)

    @classmethod
    def build(cls, all_hot: ExpertPools, host: HostTier, warm_row_map: np.ndarray, warm_counts,
              policy: str, max_tokens: int, top_k: int, history: int = 4096, routers=None,
              depth: int = 1, forecaster=None, prefetch_budget: int | None = None) -> "SlotCache":
        """A cache whose slots hold the warm set of ``warm_row_map`` (DESIGN.md §3 placement
        encoding: the ``C`` hot rows are the slots), read from ``all_hot`` (the model's
        unmodified pools); its cold tier is ``host``. ``warm_counts`` are the profile counts of
        the warm instances, one per slot (hot row) in slot order. ``max_tokens``: the decode
        batch size (tokens per step) the cache decides for; ``C >= top_k * max_tokens`` is
        required, else one step could need more slots than exist. ``nexttoken``: ``forecaster``
        (:func:`forecast_arrays`) and ``prefetch_budget`` (copies issued per group at most; None =
        the whole list, ``max_tokens * n``).
        """
        if policy not in ENGINE_POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; known: {', '.join(ENGINE_POLICIES)}")
        pools = all_hot.placed(warm_row_map, host)  # validates the map; slots = compact hot pool
        L, E = pools.num_moe_layers, pools.num_experts
        if policy == "lookahead":
            if routers is None or len(routers) != L or any(tuple(r.shape)[0] != E for r in routers):
                raise ValueError(f"policy 'lookahead' needs the {L} MoE layers' routers [{E}, hidden]")
            if not 1 <= int(depth) < L:
                raise ValueError(f"lookahead depth must be in [1, {L - 1}], got {depth}")
        nxt = policy == "nexttoken"
        if nxt:
            fc = forecast_arrays(forecaster, L, E)
            width = int(max_tokens) * fc["n"]
            budget = width if prefetch_budget is None else int(prefetch_budget)
            if budget < 0:
                raise ValueError(f"prefetch_budget must be >= 0, got {prefetch_budget}")
        capacity = pools.num_hot
        need = int(top_k) * int(max_tokens)
        if capacity < need:
            raise CacheCapacityError(
                f"cache of {capacity} slots ({capacity / (L * E):.3f} of {L * E} experts) is smaller than one "
                f"step's {need} selections (top_k {top_k} x {max_tokens} tokens): raise the residency or "
                f"lower the batch size")
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
        dev = pools.row_map.device
        ahead = policy == "lookahead"
        span = min(need, E) if not nxt else min(width, E, capacity)
        listing = ahead or nxt  # per group a prediction list and its prefetch count
        width = need if ahead else (width if nxt else 0)
        warm = (pools.row_map.clone(), torch.as_tensor(owner, device=dev), torch.as_tensor(last_use, device=dev),
                torch.as_tensor(count, device=dev))
        return cls(
            pools=pools, policy=policy, max_tokens=int(max_tokens), top_k=int(top_k),
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
            routers=list(routers) if policy == "lookahead" else None, depth=int(depth),
            list_after_experts=policy == "lookahead" and int(depth) >= 2,
            inflight=torch.zeros(L * E, dtype=torch.bool, device=dev) if listing else None,
            prediction_history=torch.full((history, width), -1, dtype=torch.int64, device=dev) if listing else None,
            prefetch_history=torch.zeros(history, dtype=torch.int64, device=dev) if listing else None,
            prev_layer=L,
            forecast_routers=[r.detach().to(dev).contiguous() for r in routers] if ahead else None,
            forecast_out=torch.empty((int(max_tokens), E), dtype=torch.float32, device=dev) if ahead else None,
            pf_victims=torch.zeros((L, span), dtype=torch.int64, device=dev) if listing else None,
            pf_new=torch.zeros((L, span), dtype=torch.int64, device=dev) if listing else None,
            pf_count=torch.zeros((L, 1), dtype=torch.int64, device=dev) if listing else None,
            side_stream=torch.cuda.Stream(dev) if ahead and dev.type == "cuda" else None,
            fork_event=torch.cuda.Event() if ahead and dev.type == "cuda" else None,
            join_events=[torch.cuda.Event() for _ in range(L)] if ahead and dev.type == "cuda" else None,
            pending=[False] * L if ahead else None,
            # lookahead's list decisions (route's path) on a stream of their own, an event each layer
            **(dict(decide_stream=torch.cuda.Stream(dev), decided_events=[torch.cuda.Event() for _ in range(L)])
               if ahead and dev.type == "cuda" else {}),
            fill_ticket=torch.zeros(1, dtype=torch.int32, device=dev) if dev.type == "cuda" else None,
            **(cls._next_state(dev, L, E, capacity, int(max_tokens), int(top_k), fc, budget, span) if nxt else {}),
        )

    @staticmethod
    def _next_state(dev, L, E, capacity, max_tokens, top_k, fc, budget, span) -> dict:
        """nexttoken's state at build (see the fields)."""
        cuda = dev.type == "cuda"
        terms, tables, n_pred = fc["terms"], fc["tables"], fc["n"]
        ring = int(terms[:, 0].max()) + 1
        return dict(
            predicted=torch.zeros(L * E, dtype=torch.bool, device=dev),
            tags=torch.zeros(capacity, dtype=torch.int64, device=dev),
            done=torch.zeros(capacity, dtype=torch.int64, device=dev),
            stale=torch.zeros(1, dtype=torch.int64, device=dev),
            selections=torch.full((ring, L, max_tokens * top_k), -1, dtype=torch.int64, device=dev),
            step=torch.full((1,), -1, dtype=torch.int64, device=dev),
            terms=torch.as_tensor(terms, device=dev).contiguous(),
            terms_host=[(int(a), int(d)) for a, d in terms],
            tables=torch.as_tensor(tables, device=dev).contiguous(),
            num_predictions=n_pred, prefetch_budget=budget,
            seq_history=torch.zeros((L, max_tokens, E), dtype=torch.int32, device=dev),
            hist_unit=fc["hist_unit"], hist_shift=fc["hist_shift"],
            pf_tags=torch.zeros((L, span), dtype=torch.int64, device=dev),
            decide_stream=torch.cuda.Stream(dev) if cuda else None,
            copy_stream=torch.cuda.Stream(dev) if cuda else None,
            fork_events=[torch.cuda.Event() for _ in range(L)] if cuda else None,
            decided_events=[torch.cuda.Event() for _ in range(L)] if cuda else None,
            copy_event=torch.cuda.Event() if cuda else None,
            copy_ticket=torch.zeros(1, dtype=torch.int32, device=dev) if cuda else None,
            ids_alive=[None] * L,
        )

    def reset(self) -> None:
        """Back to the warm state (row map, owners, recency, counts, ticks, counters) with every
        slot refilled from the host tier, in place: a captured graph stays valid. For runs that
        must start warm after warm-up steps (a CUDA graph's capture runs the step)."""
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
        if self.inflight is not None:
            self.inflight.zero_()
        if self.predicted is not None:  # nexttoken: no forecast yet, nothing in flight or pending
            self.predicted.zero_()
            self.done.copy_(self.tags)  # tags stay monotonic across resets
            self.selections.fill_(-1)
            self.seq_history.zero_()
            self.step.fill_(-1)
            self.pf_count.zero_()
            self.step_open, self.forked = False, None
        self.prev_layer = pools.num_moe_layers
        self.reset_counters()
        slots = torch.arange(self.capacity, device=owner.device)
        self._fill(slots, owner, torch.ones_like(slots, dtype=torch.bool),
                   torch.full((1,), self.capacity, dtype=torch.int64, device=owner.device))

    @classmethod
    def from_placement(cls, all_hot: ExpertPools, host: HostTier, placement, max_tokens: int,
                       top_k: int, routers=None, history: int = 4096, forecaster=None,
                       prefetch_budget: int | None = None, depth: int | None = None) -> "SlotCache":
        """The cache of a dynamic :class:`coldset.core.placement.Placement` (``lru-0.5``): its warm row
        map and warm counts, its policy; ``lookahead``: its depth for ``max_tokens`` sequences (or
        ``depth``, one of its per-batch depths: the parity stage decodes each), and ``routers``
        (the MoE layers' router weights ``[E, H]``, required there)."""
        if not placement.dynamic:
            raise ValueError(f"placement {placement.policy}-{placement.label} is static: it has no cache")
        ahead = placement.policy == "lookahead"
        if ahead and depth is None:
            depth = lookahead_depth_for(placement.cache_lookahead_depth, max_tokens)
        return cls.build(all_hot, host, placement.row_map, placement.cache_warm_counts, placement.policy,
                         max_tokens, top_k, history=history, routers=routers if ahead else None,
                         depth=depth if ahead else 1, forecaster=forecaster, prefetch_budget=prefetch_budget)

    @property
    def capacity(self) -> int:
        return int(self.owner.shape[0])

    def reset_counters(self) -> None:
        """Zero the hit/miss/fill counters and the per-group history (the cache's contents stay)."""
        self.totals.zero_()
        self.history.zero_()
        self.groups.zero_()
        if self.prediction_history is not None:
            self.prediction_history.fill_(-1)
            self.prefetch_history.zero_()
        if self.stale is not None:
            self.stale.zero_()

    def counters(self) -> dict[str, int]:
        """``{"hits", "misses", "fills", "groups"}`` since :meth:`reset_counters` (a host sync);
        ``lookahead`` adds ``"prefetches"`` (copies issued, from the per-group history)."""
        hits, misses, fills = (int(v) for v in self.totals.tolist())
        out = {"hits": hits, "misses": misses, "fills": fills, "groups": int(self.groups)}
        if self.prefetch_history is not None:
            out["prefetches"] = int(self.prefetch_counts().sum())
        if self.stale is not None:  # nexttoken: commits refused because a copy's tag had not landed
            out["stale"] = int(self.stale)
        return out

    def prefetch_counts(self) -> np.ndarray:
        """int64 ``[groups]``: ``lookahead``'s prefetch copies issued after each group, in order (a host sync)."""
        n = int(self.groups)
        cap = self.prefetch_history.shape[0]
        if n > cap:
            raise ValueError(f"the cache kept the last {cap} groups' prefetches, {n} ran: build it with history >= {n}")
        return self.prefetch_history[:n].cpu().numpy()

    def group_history(self) -> np.ndarray:
        """int64 ``[groups, 3]``: (hits, missed selections, fills) of each group, in order (a host sync)."""
        n = int(self.groups)
        cap = self.history.shape[0]
        if n > cap:
            raise ValueError(f"the cache kept the last {cap} groups' history, {n} ran: build it with history >= {n}")
        return self.history[:n].cpu().numpy()

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
            if layer == last and cache.step_open:
                cache.end_step()  # nexttoken: the step's copies joined and committed after its last experts
            return out

        cached.casts_weights = True
        cached.slot_cache = cache
        return cached

    def records_in_route(self, num_tokens: int) -> bool:
        """Whether the fused router launch records this cache's groups of ``num_tokens`` tokens
        (:meth:`route`): the kernel path, a decode group (every engine policy: ``lru``/``lfu``/``nexttoken``
        record the group there, ``lookahead`` makes its whole decision there)."""
        return self.use_kernel and self.policy in ENGINE_POLICIES and num_tokens <= self.max_tokens

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

        ``lookahead``: the router's launch also computes the forecast (layer ``layer + depth``'s
        router on the same normed input, every program beside its own rows) and its last program
        makes the group's record and demand decisions (:func:`coldset.kernels.triton_slots.ahead_group`
        without its list: the demand victims with the in-flight rule); then the demand fill (a plain
        copy, the router's programmatic dependent); then, forked onto the decisions stream after it
        (or, with :attr:`list_after_experts`, depth >= 2, after the layer's experts:
        :meth:`experts_done`), the forecast's list and the prefetch decisions
        (:func:`coldset.kernels.triton_slots.ahead_list`, one program) and after them on the side
        stream the prefetch copy, joined as :meth:`admit`'s path does (:meth:`_ahead_fork_join`).
        The next group's router waits for the list decisions (:meth:`_wait_list`: they write the
        state it reads, and read the forecast buffer it writes), so every group decides on the state
        the last one left, as the simulator does; the experts run beside them (a prefetch victim is
        never a slot the group uses). Why: a cached
        lookahead layer then costs the router's launch and the demand fill on the critical path,
        where :meth:`admit`'s path costs a forecast GEMV launch and a decisions launch more (107.5 +
        198.9 us a step of 48 layers at b1 on the H200, ``bench cache --decisions-only``) and the
        list in the router's last program cost 151 us a step beyond the plain router's at b1 (lru's
        54), 440 at b8 (lru's 118; ``bench cache --profile``, residency 1.0)."""
        from coldset.kernels import triton_decode as td
        from coldset.kernels import triton_slots as ts

        if not self.records_in_route(x.shape[0]):
            raise ValueError(f"SlotCache.route: policy {self.policy!r}, {x.shape[0]} tokens (max {self.max_tokens}), "
                             f"kernel path {self.use_kernel}: the router cannot record this group")
        if self.policy == "lookahead":
            new_step = self._ahead_open(layer)
            target = layer + self.depth
            self._wait_list()  # the last group's list decisions are complete before this group reads the state
            h, ids, w = td.route(x, norm_weight, eps, gate_weight, top_k, renormalize, counter, weights_dtype=x.dtype,
                                 pdl=pdl, ahead=ts.route_ahead_args(self, layer, target, new_step), trigger=self.pdl)
            ts.fill(self.pools, self.victims, self.admitted, self.num_misses, pdl=self.pdl)
            self._ahead_fork_join(layer, target, listed=ids.numel())
            self.recorded_layer = layer
            return h, ids, w
        nxt = self.policy == "nexttoken"
        if nxt:
            new_step = self._open_group(layer)
            if self.forked is not None and self.decide_stream is not None:
                # the last side decisions are complete before this group reads the state
                torch.cuda.current_stream(x.device).wait_event(self.decided_events[self.forked])
        h, ids, w = td.route(x, norm_weight, eps, gate_weight, top_k, renormalize, counter, weights_dtype=x.dtype,
                             pdl=pdl, record=ts.route_record_args(self, layer), trigger=self.pdl)
        ts.choose_and_fill(self, ids.numel(), pdl=self.pdl, layer=layer)
        self.recorded_layer = layer
        if nxt:
            self._fork_next(layer, ids, new_step)
        return h, ids, w

    # ---------------------------------------------------------------------------- nexttoken
    def _open_group(self, layer: int) -> bool:
        """Host-side step bookkeeping of a nexttoken group: whether it starts a new step (a layer
        not above the last one); a step still open is ended first (its copies joined, committed)."""
        new_step = layer <= self.prev_layer
        if new_step:
            if self.step_open:
                self.end_step()
            self.step_open = True
        self.prev_layer = layer
        return new_step

    def _fork_next(self, layer: int, ids: torch.Tensor, new_step: bool) -> None:
        """nexttoken on CUDA after group (step, ``layer``)'s demand launch: the forecast and prefetch
        decisions forked onto the decisions stream (:func:`coldset.kernels.triton_slots.decide_next`;
        the next group's router waits for them, so every group decides on the state the last one
        left), then the tagged copy onto the copy stream (one queue: the link's order), which the
        compute stream waits for only at the step's end (:meth:`end_step`). Why the copy's slots are
        safe: a victim is not used by this group (whose experts kernel runs beside the copy), its
        instance's row map went back to the host tier in the decisions (no later kernel reads the
        slot), and the prefetched instance's row map points at the slot only after the join."""
        from coldset.kernels.triton_slots import decide_next, fill

        side = self.decide_stream is not None  # (no streams: Triton's interpreter on the CPU, in order)
        self.ids_alive[layer] = ids  # read on the side stream: never freed (nor reused) under it
        if side:
            self.fork_events[layer].record(torch.cuda.current_stream(ids.device))
            self.decide_stream.wait_event(self.fork_events[layer])
        with torch.cuda.stream(self.decide_stream) if side else contextlib.nullcontext():
            decide_next(self, layer, ids.reshape(-1), new_step)
            if side:
                self.decided_events[layer].record(self.decide_stream)
        if side:
            self.copy_stream.wait_event(self.decided_events[layer])
        with torch.cuda.stream(self.copy_stream) if side else contextlib.nullcontext():
            fill(self.pools, self.pf_victims[layer], self.pf_new[layer], self.pf_count[layer], blocks=self.prefetch_blocks,
                 tags=(self.pf_tags[layer], self.done, self.copy_ticket))
        self.forked = layer

    def end_step(self) -> None:
        """nexttoken at a step's end (after its last MoE layer's experts): the compute stream joins
        the decisions and the copy queue (CUDA; a no-op wait elsewhere), then the commit: each of
        the step's prefetches whose slot holds the tag it was issued with gets its row map entry
        (the others stay on their host rows and count as stale). In a captured step both are
        inside the graph."""
        if self.predicted is None or not self.step_open:
            return
        if self.forked is not None:
            from coldset.kernels.triton_slots import commit_prefetches

            if self.decide_stream is not None:
                main = torch.cuda.current_stream(self.owner.device)
                main.wait_event(self.decided_events[self.forked])
                self.copy_event.record(self.copy_stream)
                main.wait_event(self.copy_event)
            commit_prefetches(self)
            self.forked = None
        else:
            self._commit_torch()
        self.step_open = False

    def _commit_torch(self) -> None:
        """:meth:`end_step`'s commit as torch ops (the CPU path; the commit kernel's reference)."""
        span = self.pf_victims.shape[1]
        ok = torch.arange(span, device=self.owner.device)[None, :] < self.pf_count
        good = ok & (self.done[self.pf_victims] == self.pf_tags)
        rm = self.pools.row_map.view(-1)
        new = self.pf_new.reshape(-1)
        rm.index_put_((new,), torch.where(good.reshape(-1), self.pf_victims.reshape(-1), rm[new].to(torch.int64))
                      .to(torch.int32))
        self.pools.validated_version = self.pools.row_map._version
        self.stale.add_((ok & ~good).sum())
        self.pf_count.zero_()

    # ---------------------------------------------------------------------------- decisions
    def guard_ticks(self, n: int) -> int:
        """``lru_guard``'s window in ticks for groups of ``n`` selections: a slot whose instance was
        last used at the group's first tick minus this or later (and at tick 0 or later: the warm
        ticks are no use) is no victim, i.e. one used by any of the last ``L`` groups (this one
        included: every decode group has ``n`` ticks). 0 for every other policy (only the group's
        own residents are barred)."""
        return (self.pools.num_moe_layers - 1) * int(n) if self.policy == "lru_guard" else 0

    def _victim_order(self, in_group: torch.Tensor) -> torch.Tensor:
        """Slots in eviction order (first = first victim); slots used by the group come last."""
        last = self.last_use[self.owner].masked_fill(in_group, torch.iinfo(torch.int64).max)
        order = torch.argsort(last, stable=True)  # lru; ticks are unique, so no ties
        if self.policy == "lfu":  # lexicographic (count, last_use): stable sort on count of the lru order
            cnt = self.count[self.owner].masked_fill(in_group, float("inf"))[order]
            order = order[torch.argsort(cnt, stable=True)]
        return order

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
        if self.policy == "nexttoken":  # off the fused router: the torch decisions (copies on this stream)
            self._decide_next_torch(layer, topk_ids, self._open_group(layer))
            return topk_weights.to(dtype) if cast else topk_weights
        if self.policy == "lookahead" and hidden is None:
            raise ValueError("SlotCache.admit: policy 'lookahead' needs the layer's router input (hidden)")
        if self.use_kernel and self.policy == "lookahead":
            return self._admit_ahead(layer, topk_ids, topk_weights, dtype, hidden, cast)
        if self.use_kernel:
            from coldset.kernels.triton_slots import decide, fill

            w_out = None
            if cast:
                w_out = torch.empty(topk_weights.shape, dtype=dtype, device=topk_weights.device)
                decide(self, layer, topk_ids.reshape(-1).to(torch.int64).contiguous(),
                       topk_weights.contiguous().reshape(-1), w_out.view(-1))
            else:
                decide(self, layer, topk_ids.reshape(-1).to(torch.int64).contiguous())
            fill(self.pools, self.victims, self.admitted, self.num_misses, pdl=self.pdl)
            return w_out if cast else topk_weights
        self._decide_torch(layer, topk_ids, hidden)
        return topk_weights.to(dtype) if cast else topk_weights

    def _forecast_logits(self, hidden: torch.Tensor, target: int, pdl: bool = False) -> torch.Tensor:
        """float32 ``[T, E]``: layer ``target``'s router on ``hidden`` (this layer's router input),
        the forecast both paths rank (the lists are recorded, so the rounding is not a contract).
        Kernel path: one Triton launch reading the router in the model's dtype
        (:func:`coldset.kernels.triton_slots.forecast_logits`; ``pdl``: the decisions launch that
        follows may start beside it), into ``forecast_out`` (the view returned is overwritten by
        the next call); torch path: ``torch.mm`` of the float32 casts."""
        h = hidden.reshape(hidden.shape[0], -1)
        w = self.forecast_routers[target]
        if self.use_kernel:
            from coldset.kernels.triton_slots import forecast_logits

            if h.stride(-1) != 1:
                h = h.contiguous()
            return forecast_logits(h, w, self.forecast_out[:h.shape[0]], pdl=pdl)
        return torch.mm(h.float(), w.float().T)

    def _admit_ahead(self, layer, topk_ids, topk_weights, dtype, hidden, cast):
        """``lookahead`` on CUDA: the decisions in one Triton launch (demand and prefetch, the torch
        path's rules), the demand fill on the compute stream (the decisions' dependent launch), and
        the prefetch's copy forked onto the side stream: it starts once this layer's decisions are
        done, runs beside the compute of the layers after, and the compute stream joins it at the end
        of :meth:`admit` of layer ``layer + depth``, right before that layer's experts kernel reads the
        row map (the commit: no kernel reads a prefetched slot before its copy is complete). Its
        victims are slots of layers ``<= layer`` not used by this group, whose last reader (an
        experts kernel of an earlier layer) ran before the fork; every branch is joined within the
        step (the last MoE layer joins whatever is left), so a captured step forks and joins inside
        its graph."""
        from coldset.kernels.triton_slots import decide_ahead, fill

        # (In the fused decode step the router's launch makes these decisions instead: route().)
        L = self.pools.num_moe_layers
        new_step = self._ahead_open(layer)
        target = layer + self.depth
        self._wait_list()  # (a list route() forked reads forecast_out, which the GEMV below writes)
        # Every input of the decisions launch first (a torch op between the GEMV and the decisions
        # would end their overlap): the decisions are the GEMV's programmatic dependent with pdl.
        ids = topk_ids.reshape(-1).to(torch.int64).contiguous()
        w_in = topk_weights.contiguous().reshape(-1) if cast else None
        w_out = torch.empty(topk_weights.shape, dtype=dtype, device=topk_weights.device) if cast else None
        logits = self._forecast_logits(hidden, target, pdl=self.pdl) if target < L else None
        decide_ahead(self, layer, ids, new_step, logits, target, w_in, w_out.view(-1) if cast else None,
                     after_forecast=logits is not None)
        fill(self.pools, self.victims, self.admitted, self.num_misses, pdl=self.pdl)
        self._ahead_fork_join(layer, target)
        return w_out if cast else topk_weights

    def _ahead_open(self, layer: int) -> bool:
        """lookahead's host-side step bookkeeping (kernel path): whether group ``layer`` starts a new
        step (a layer not above the last one), after joining every copy still pending."""
        new_step = layer <= self.prev_layer
        if new_step:
            self.join()  # nothing of the last step may still be in flight (a no-op after a full step)
        self.prev_layer = layer
        return new_step

    def _ahead_fork_join(self, layer: int, target: int, listed: int | None = None) -> None:
        """lookahead after group ``layer``'s decisions and demand fill on the compute stream (either
        path): the prefetch for layer ``target`` forked (:meth:`_ahead_fork`; on :meth:`route`'s
        path with :attr:`list_after_experts`, left for :meth:`experts_done`), then the compute
        stream joins the copy forked for ``layer`` (before this layer's experts), and the last MoE
        layer joins whatever is left."""
        L = self.pools.num_moe_layers
        if self.deferred_fork is not None:  # never silently: that fork's list decisions and copy would be lost
            raise RuntimeError(f"SlotCache: layer {self.deferred_fork[0]}'s prefetch fork is still pending at layer "
                               f"{layer}'s decisions: its experts did not run through wrap()'s experts function "
                               "(which calls experts_done)")
        if listed is not None and self.list_after_experts and target < L:
            self.deferred_fork = (layer, target, listed)
        else:
            self._ahead_fork(layer, target, listed)
        self._join_layer(layer)
        if layer == L - 1:
            self.join()

    def experts_done(self, layer: int) -> None:
        """After MoE layer ``layer``'s experts are enqueued (:meth:`wrap`'s experts function): the
        fork :meth:`route` deferred for that layer (:attr:`list_after_experts`), if any. The list
        decisions then read the state after the same group's record and before the next group's,
        as without the deferral: the same decisions."""
        if self.deferred_fork is None:
            return
        fl, target, listed = self.deferred_fork
        if fl != layer:
            raise RuntimeError(f"SlotCache.experts_done: layer {layer}'s experts, but layer {fl}'s prefetch fork is "
                               "pending: its experts never ran")
        self.deferred_fork = None
        self._ahead_fork(fl, target, listed)

    def _ahead_fork(self, layer: int, target: int, listed: int | None) -> None:
        """The prefetch copy for layer ``target`` (if it is a layer) forked onto the side stream (an
        event on the compute stream, waited on by the side stream; ``prefetch_blocks`` blocks per
        weight). ``listed`` (:meth:`route`'s path: the group's selections): the list and its
        prefetch decisions first, on the decisions stream after the same event
        (:func:`coldset.kernels.triton_slots.ahead_list`), the copy after them; the next group's
        router waits for them (:meth:`_wait_list`)."""
        from coldset.kernels.triton_slots import ahead_list, fill

        if target >= self.pools.num_moe_layers:
            return
        side = self.side_stream  # (none: Triton's interpreter on the CPU, where launches run in order)
        if side is not None:
            self.fork_event.record(torch.cuda.current_stream(self.owner.device))
        if listed is not None:
            dec = self.decide_stream if side is not None else None
            if dec is not None:
                dec.wait_event(self.fork_event)
            with torch.cuda.stream(dec) if dec is not None else contextlib.nullcontext():
                ahead_list(self, layer, target, listed)
            if dec is not None:
                self.decided_events[layer].record(dec)
                self.forked = layer
                side.wait_event(self.decided_events[layer])
        elif side is not None:
            side.wait_event(self.fork_event)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            fill(self.pools, self.pf_victims[target], self.pf_new[target], self.pf_count[target],
                 blocks=self.prefetch_blocks)
            if side is not None:
                self.join_events[target].record(side)
        self.pending[target] = side is not None

    def _wait_list(self) -> None:
        """lookahead (:meth:`route`'s path): the compute stream waits for the list decisions forked
        last (if any is pending): the next group's record reads the state they write."""
        if self.policy == "lookahead" and self.forked is not None:
            torch.cuda.current_stream(self.owner.device).wait_event(self.decided_events[self.forked])
            self.forked = None

    def _join_layer(self, layer: int) -> None:
        """The compute stream waits for the prefetch copy forked for ``layer`` (if one is pending)."""
        if self.pending is not None and self.pending[layer]:
            torch.cuda.current_stream(self.owner.device).wait_event(self.join_events[layer])
            self.pending[layer] = False

    def join(self) -> None:
        """The compute stream waits for every prefetch copy still pending (host-side bookkeeping, no
        sync): before a state the next step or a check reads. nexttoken: the open step ends
        (:meth:`end_step`)."""
        if self.step_open:
            self.end_step()
        self._wait_list()
        if self.pending is None or self.side_stream is None:
            return
        for layer in range(len(self.pending)):
            self._join_layer(layer)

    def _group(self, layer: int, ids: torch.Tensor) -> tuple:
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

    def _admit_rows(self, victims: torch.Tensor, new_inst: torch.Tensor, valid: torch.Tensor) -> None:
        """The demand admissions of a group (torch path): the ``valid`` victims' slots go to ``new_inst``
        in the row map and the owners, then their rows are filled."""
        pools, rm, owner = self.pools, self.pools.row_map.view(-1), self.owner
        old_inst = owner[victims]
        # Evictions first (distinct instances), then admissions read back after them (distinct
        # experts), so a masked-out write can never undo a real one.
        rm.index_put_((old_inst,), torch.where(valid, -old_inst - 1, rm[old_inst].to(torch.int64)).to(torch.int32))
        rm.index_put_((new_inst,), torch.where(valid, victims, rm[new_inst].to(torch.int64)).to(torch.int32))
        owner.index_put_((victims,), torch.where(valid, new_inst, old_inst))
        # Written by the cache's own decisions, which keep the map a bijection onto C slots and
        # the host rows: a re-validation would be a host sync inside the step (see check()).
        pools.validated_version = pools.row_map._version
        self._fill(victims, new_inst, valid, valid.sum())  # the admitted (valid) rows are first

    def _decide_next_torch(self, layer: int, topk_ids: torch.Tensor, new_step: bool) -> None:
        """nexttoken's group (step, ``layer``) as torch ops, in the rules' order (coldset.analysis.cache's
        ``nexttoken``; the kernels' reference): the commit of layer ``layer``'s previous prefetches
        (in-flight flags), the demand (victims not used by the group and not in flight, unpredicted
        least recent first; misses past them read in place), the forecast and the predicted flags,
        the prefetch (victims not used, not in flight, not predicted, least recent first; the row map
        of a prefetched instance waits for :meth:`end_step`), the counters and the group's list."""
        pools = self.pools
        L, E = pools.num_moe_layers, pools.num_experts
        dev = topk_ids.device
        ids = topk_ids.reshape(-1).to(torch.int64)
        n = ids.numel()
        k = self.top_k
        T = n // k
        base = layer * E
        rm = pools.row_map.view(-1)
        big = torch.iinfo(torch.int64).max
        inst, hit, pos, used, m, slots_max, new_inst = self._group(layer, ids)
        owner = self.owner
        # 1. commit: layer `layer`'s prefetches of the last step are no longer in flight
        self.inflight[base:base + E] = False
        # 2. demand
        in_group = (owner // E == layer) & used[owner % E]
        barred = in_group | self.inflight[owner]
        order = torch.argsort(self.last_use[owner].masked_fill(barred, big), stable=True)
        pr = self.predicted[owner].to(torch.float64).masked_fill(barred, float("inf"))[order]
        victims = order[torch.argsort(pr, stable=True)][:slots_max]
        valid = torch.arange(slots_max, device=dev) < torch.minimum(m, (~barred).sum())
        self._admit_rows(victims, new_inst, valid)
        self.last_use.scatter_reduce_(0, inst, self.tick + pos, "amax")
        self.count.index_add_(0, inst, torch.ones(n, dtype=self.count.dtype, device=dev))
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
        self.predicted[base:base + E] = False
        self.predicted.index_put_((seq,), listed)
        # 4. prefetch
        want = listed & (rm[seq] < 0)
        span = self.pf_victims.shape[1]
        new = seq[torch.argsort((~want).to(torch.int64), stable=True)][:span]  # the wanted first, in list order
        in_group = (owner // E == layer) & used[owner % E]
        barred = in_group | self.inflight[owner] | self.predicted[owner]
        pv = torch.argsort(self.last_use[owner].masked_fill(barred, big), stable=True)[:span]
        got = torch.minimum(torch.minimum(want.sum(), torch.tensor(self.prefetch_budget, device=dev)), (~barred).sum())
        j = torch.arange(span, device=dev)
        ok = j < got
        old = owner[pv]
        rm.index_put_((old,), torch.where(ok, -old - 1, rm[old].to(torch.int64)).to(torch.int32))
        owner.index_put_((pv,), torch.where(ok, new, old))
        pools.validated_version = pools.row_map._version
        self.inflight.index_put_((new,), ok | self.inflight[new])
        self.last_use.index_put_((new,), torch.where(ok, self.tick + n + j, self.last_use[new]))
        tags = self.tags[pv] + ok.to(torch.int64)
        self.tags.index_put_((pv,), tags)
        self.pf_victims[layer], self.pf_new[layer], self.pf_tags[layer] = pv, new, tags
        self.pf_count[layer] = got
        self._fill(pv, new, ok, got, tags=self.pf_tags[layer])
        hrow = self.groups % self.history.shape[0]
        self.prediction_history.index_copy_(0, hrow, rec[None])
        self.prefetch_history.index_copy_(0, hrow, got[None])
        self.tick.add_(n + width)
        hits = hit.sum()
        stats = torch.stack([hits, n - hits, m])
        self.totals.add_(stats)
        self.history.index_copy_(0, hrow, stats[None])
        self.groups.add_(1)

    def _decide_torch(self, layer: int, topk_ids: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        """:meth:`admit`'s decisions and fill as torch ops (the CPU path; the kernel's reference)."""
        pools = self.pools
        E = pools.num_experts
        dev = topk_ids.device
        ids = topk_ids.reshape(-1).to(torch.int64)
        n = ids.numel()
        inst, hit, pos, used, m, slots_max, new_inst = self._group(layer, ids)
        owner = self.owner
        in_group = (owner // E == layer) & used[owner % E]
        ahead = self.policy == "lookahead"
        barred = in_group
        if ahead:
            if layer <= self.prev_layer:  # a new step: the last step's prefetches are committed
                self.inflight.zero_()
            self.prev_layer = layer
            barred = in_group | self.inflight[owner]  # slots in flight are no demand victim
        elif self.policy == "lru_guard":  # nor an instance the last L groups used
            barred = in_group | (self.last_use[owner] >= (self.tick - self.guard_ticks(n)).clamp_min(0))
        # misses beyond the slots not barred are read in place (lru and lfu: never, a pool holds a group)
        victims = self._victim_order(barred)[:slots_max]
        valid = torch.arange(slots_max, device=dev) < torch.minimum(m, (~barred).sum())
        self._admit_rows(victims, new_inst, valid)
        # Recency and frequency of every selection, then the counters.
        self.last_use.scatter_reduce_(0, inst, self.tick + pos, "amax")
        self.count.index_add_(0, inst, torch.ones(n, dtype=self.count.dtype, device=dev))
        if ahead:
            self._prefetch(layer, hidden, used, n)
        # lookahead: the prefetches take the ticks after the group's (width of a list at most)
        self.tick.add_(n + (self.prediction_history.shape[1] if ahead else 0))
        hits = hit.sum()
        row = torch.stack([hits, n - hits, m])
        self.totals.add_(row)
        self.history.index_copy_(0, self.groups % self.history.shape[0], row[None])
        self.groups.add_(1)

    def _prefetch(self, layer: int, hidden: torch.Tensor, used: torch.Tensor, n: int) -> None:
        """``lookahead``'s prefetch after group (step, ``layer``), the simulator's ``lookahead``
        rules (:mod:`coldset.analysis.cache`): the list = the top ``k`` experts of layer ``layer + depth``'s
        router on this layer's router inputs, token by token, first occurrence kept; each listed
        instance not resident, in list order, takes the least recent slot of layers ``<= layer``
        not used by this group, not listed and not in flight (none left: the rest is skipped); it
        is in flight until the step ends and enters the recency order after the group's accesses,
        in list order. The list is recorded per group (the simulator replays it), so its logits'
        rounding (float32 here) is the engine's choice, not a contract."""
        pools = self.pools
        L, E = pools.num_moe_layers, pools.num_experts
        dev = self.owner.device
        width = self.prediction_history.shape[1]
        row = self.groups % self.prediction_history.shape[0]
        target = layer + self.depth
        if target >= L:
            self.prediction_history.index_fill_(0, row, -1)
            self.prefetch_history.index_fill_(0, row, 0)
            return
        logits = self._forecast_logits(hidden, target)
        top = torch.sort(-logits, dim=1, stable=True).indices[:, :self.top_k].reshape(-1)
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
        span = min(E, self.capacity)
        new = seq[torch.argsort((~want).to(torch.int64), stable=True)][:span]  # non-resident listed first
        owner = self.owner
        # Candidates: slots of layers already done this step, not used by this group, not in flight
        # (a listed instance belongs to a later layer, so it is never one).
        barred = (owner // E > layer) | ((owner // E == layer) & used[owner % E]) | self.inflight[owner]
        key = self.last_use[owner].masked_fill(barred, torch.iinfo(torch.int64).max)
        victims = torch.argsort(key, stable=True)[:span]
        got = torch.minimum(want.sum(), (~barred).sum())
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
        self.last_use.index_put_((new,), torch.where(valid, self.tick + n + j, self.last_use[new]))
        self._fill(victims, new, valid, got)
        self.prediction_history.index_copy_(0, row, rec[None])
        self.prefetch_history.index_copy_(0, row, got[None])

    def prefetch_lists(self) -> np.ndarray:
        """int64 ``[groups, width]``: the prediction list ``lookahead`` issued after each group
        (-1 padded; the simulator's ``predictions``), in order (a host sync)."""
        n = int(self.groups)
        cap = self.prediction_history.shape[0]
        if n > cap:
            raise ValueError(f"the cache kept the last {cap} groups' lists, {n} ran: build it with history >= {n}")
        return self.prediction_history[:n].cpu().numpy()

    def _fill(self, victims, new_inst, valid, m, tags=None) -> None:
        """The admitted rows' copy (``valid`` lanes, ``m`` of them, first); with ``tags`` (nexttoken's
        prefetch) each copied slot's tag is written back into ``done`` once its rows have landed."""
        pools = self.pools
        if pools.w13_hot.is_cuda:
            from coldset.kernels.triton_slots import fill

            if tags is None:
                fill(pools, victims, new_inst, m)
            else:
                fill(pools, victims, new_inst, m, tags=(tags, self.done, self.copy_ticket))
            return
        slots, inst = victims[valid], new_inst[valid]
        pools.w13_hot[slots] = pools.w13_cold[inst]
        pools.w2_hot[slots] = pools.w2_cold[inst]
        if tags is not None:
            self.done[slots] = tags[valid]
        if pools.is_fp8:  # a slot holds its expert's FP8 scales beside its weights (issue 29)
            pools.w13_scale_hot[slots] = pools.w13_scale_cold[inst]
            pools.w2_scale_hot[slots] = pools.w2_scale_cold[inst]

    # ---------------------------------------------------------------------------- checks
    def check(self, contents: bool = False) -> None:
        """Refuse (naming the first problem) a state in which the row map and the slot owners
        disagree: every slot's owner maps to that slot, every other instance to its host row; with
        ``contents``, also every slot's weights must equal its owner's host row. Outside the step
        (a host sync); tests and the parity stage call it after decoding."""
        self.join()
        pools = self.pools
        pools.validate()
        rm = pools.row_map.view(-1).cpu().numpy().astype(np.int64)
        owner = self.owner.cpu().numpy()
        n = rm.size
        expect = -np.arange(n, dtype=np.int64) - 1
        expect[owner] = np.arange(self.capacity)
        bad = np.flatnonzero(rm != expect)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"slot cache: row map entry of instance {i} (layer {i // pools.num_experts}, expert "
                             f"{i % pools.num_experts}) is {rm[i]}, the slot owners say {expect[i]}")
        if contents:  # compared on the slots' device, one host row at a time
            dev = pools.w13_hot.device
            for s in range(self.capacity):
                o = int(owner[s])
                if not (torch.equal(pools.w13_hot[s], pools.w13_cold[o].to(dev))
                        and torch.equal(pools.w2_hot[s], pools.w2_cold[o].to(dev))
                        and (not pools.is_fp8 or (torch.equal(pools.w13_scale_hot[s], pools.w13_scale_cold[o].to(dev))
                                                  and torch.equal(pools.w2_scale_hot[s], pools.w2_scale_cold[o].to(dev))))):
                    raise ValueError(f"slot cache: slot {s} does not hold the weights of its owner, instance {o} "
                                     f"(layer {o // pools.num_experts}, expert {o % pools.num_experts})")
