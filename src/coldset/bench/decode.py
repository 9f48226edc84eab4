"""Decode benchmark of one placement: tok/s, step times, bytes over the host link, cold share.

The engine decodes the same greedy tokens as in the parity gate, through the row-map experts
path over pools built from the placement. On CUDA the decode step (every layer, the row-map
kernel included) is captured once in a CUDA graph and replayed, with no host synchronisation
inside the step; on CPU it runs eagerly. A pass decodes ``new_tokens`` from the prompts; tok/s is
1000 / its mean step (its time over its steps), the median over repeats after warm-up.

``cold_share`` and ``link_gb_per_token`` are measured from the routing of the benchmarked decode
tokens (an eager pass with routing capture over the same tokens), not predicted: per step and MoE
layer, each distinct cold expert the batch touched is read over the host link once. For a dynamic
placement (the slot cache, :mod:`coldset.engine.cache.pool`) they are what the engine's cache counted in that
pass: ``cold_share`` = missed selections / selections, ``link_gb_per_token`` = fills (distinct
missed instances copied into slots, plus ``lookahead``'s prefetch copies) x bytes per expert /
decoded tokens. ``hit_rate`` (1 -
cold_share) and ``misses_per_token`` (cold or missed selections per decoded token) are reported
for every placement, so static and dynamic ones compare under the same names.
Derived metrics that need several placements (``tok_s_per_gib``, ``fetch_tax``) are computed by
:func:`derive_metrics` over all of a model's results (docs/design.md §6).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch

from coldset.analysis.forecast import NextTokenForecaster, nexttoken_lists
from coldset.analysis.placement import nonexpert_bytes_breakdown
from coldset.analysis.simulate import simulate, warm_order
from coldset.analysis.streams import AccessStream, lanes_from_engine
from coldset.bench.metrics import allhbm_reference, speed_model_prediction, time_bound, timed_token_match
from coldset.core.timing import repeat_spread, speed_compares_placements, timing_noisy
from coldset.core.trace import split_of, validate_trace
from coldset.engine.generate import generate
from coldset.verify.gate import experts_functions

log = logging.getLogger(__name__)
GIB = 1024**3


@dataclass
class BenchResult:
    """One (placement, batch size) measurement; names as docs/design.md §6."""

    placement: str
    policy: str
    residency: float
    batch_size: int
    tok_s: float  # decode tokens per second per sequence: 1000 / step_ms_mean
    step_ms_mean: float  # a decode pass's mean step (its time / its steps), median over repeats
    step_ms_p50: float  # over every timed step (steps differ by their tokens' misses / cold reads)
    step_ms_p90: float
    prefill_ms: float
    hbm_expert_gib: float
    host_expert_gib: float
    cold_share: float
    link_gb_per_token: float
    hbm_gb_per_token: float | None  # weights read from HBM per token (non-expert + hot experts touched)
    predicted_step_ms: float | None  # the bytes-only speed model (max(HBM, link) time), for the preset named
    predicted_step_ms_sum: float | None
    predicted_preset: str | None
    prompt_tokens: int
    new_tokens: int
    repeats: int
    repeat_spread: float | None  # coldset.core.timing.repeat_spread: how much repeats of one pass disagree
    device: str
    dtype: str
    backend: str
    graphed: bool
    routing_source: str
    timed_token_match: float | None = None  # share of the timed loop's tokens equal to generate()'s
    prompt_split: str | None = None  # fixtures split the prompts (and replayed routing) came from
    tok_s_per_gib: float | None = None
    fetch_tax: float | None = None
    hit_rate: float | None = None  # 1 - cold_share: selections served from HBM (static) or slot hits (dynamic)
    misses_per_token: float | None = None  # selections served cold / missed, per decoded token
    # Dynamic placements: the simulator's hit rate on the same tokens (coldset.analysis.cache; equal to
    # hit_rate, or the bench refuses: CacheSimulatorMismatch).
    simulator_hit_rate: float | None = None
    # Dynamic placements: prefetched instances evicted before any use, bytes per decoded token, from
    # the simulator's replay of the measured pass (the engine does not count them; the replay
    # equals its decisions group by group or the bench refuses).
    wasted_gb_per_token: float | None = None
    # Filled by derive_metrics from the ceilings measured in the same run (CUDA):
    bytes_step_ms: float | None = None  # HBM bytes / HBM read rate + link bytes / link read rate
    fraction_of_bytes_bound: float | None = None  # bytes_step_ms / step_ms_mean
    # The additive model: this run's residency-1.0 step + this run's cold bytes' extra link time
    # (a check that link time adds, not a prediction made apart from the measurement).
    predicted_step_ms_calibrated: float | None = None
    # The timed passes' step times (ms, one list per repeat): what pool_results pools several
    # batches of distinct requests by; not written to the bench JSON.
    passes_ms: list[list[float]] | None = None
    # Dynamic placements: the simulator's replay of the measured pass, (stream, result, bytes per
    # expert), which derive_metrics times (simulated_step_ms) once the run's all-HBM step is known;
    # not written to the bench JSON.
    replays: list | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("passes_ms", "replays")}


class TimedLoopMismatch(RuntimeError):
    """The timed decode loop decoded other tokens than ``generate()``: its speed is not the
    engine's, so it is not published."""


class CacheSimulatorMismatch(TimedLoopMismatch):
    """The engine's slot cache decided otherwise than the simulator (:mod:`coldset.analysis.cache`) on the
    same tokens: one of the two is wrong, so neither the hit rate nor the speed is published."""


def placement_forecaster(placement):
    """The :class:`coldset.analysis.forecast.NextTokenForecaster` a ``nexttoken`` placement carries (its
    fields and tables, :mod:`coldset.core.placement`); None for any other policy. Its constructor
    re-checks the fields."""
    if placement.cache_forecaster is None:
        return None
    return NextTokenForecaster(tables=placement.cache_forecaster_tables, **placement.cache_forecaster)


def engine_stream(decode: np.ndarray, num_experts: int):
    """A pass's decode routing ``decode`` int ``[B, steps, L, k]`` as the engine groups it: one
    :class:`coldset.analysis.cache.AccessStream` group per (step, MoE layer), the batch's ``B * k``
    selections in row order."""
    B, steps, L, k = decode.shape
    E = int(num_experts)
    ids = (np.arange(L, dtype=np.int64)[None, None, :, None] * E + decode).transpose(1, 2, 0, 3).reshape(-1)
    ptr = np.arange(steps * L + 1, dtype=np.int64) * (B * k)
    return AccessStream(ids, ptr, B * steps, L, E)


def simulate_engine_pass(cache, decode: np.ndarray, forecaster=None):
    """The simulator (:func:`coldset.analysis.simulate.simulate`) on a pass's decode routing ``decode`` int
    ``[B, steps, L, k]``, grouped as the engine decides: per (step, MoE layer) one group of the
    batch's ``B * k`` selections in row order, from the same warm state as ``cache``.

    ``lookahead``: on the prefetch lists the engine recorded (the forecast is the engine's, from
    hidden states). ``nexttoken``: on the lists :func:`coldset.analysis.forecast.nexttoken_lists` makes
    from ``forecaster`` (the one the cache was built with) and the pass's routing, with the
    cache's prefetch budget; the engine's recorded lists must equal them group by group
    (:class:`CacheSimulatorMismatch` otherwise), so its forecast is checked too, not taken.

    The warm state as simulator input: profile counts equal to the warm instances' counts and 0
    elsewhere choose the same warm set (``usage_global`` at the cache's capacity: the warm
    instances were the top of the real counts, so any instance outside scored at most the lowest
    warm count, and ties at zero fall the same way), the same eviction order and LFU's initial
    counts (profile count for warm instances, 0 for others); checked, not assumed."""
    B, steps, L, k = decode.shape
    _, owner, _, count = (t.cpu().numpy() for t in cache.warm_state)
    E = cache.pools.row_map.shape[1]
    counts = np.zeros(L * E, dtype=np.float64)
    counts[owner] = count[owner]
    counts = counts.reshape(L, E)
    if set(warm_order(counts, cache.capacity).tolist()) != set(owner.tolist()):
        raise CacheSimulatorMismatch("bench: the cache's warm set is not the usage_global set of its own counts")
    stream = engine_stream(decode, E)
    if cache.policy == "nexttoken":
        if forecaster is None:
            raise ValueError("simulate_engine_pass: a nexttoken cache needs the forecaster it was built with")
        lanes = lanes_from_engine(decode, E)
        lists = nexttoken_lists(forecaster, lanes.sel, lanes.start)
        got = cache.prefetch_lists()
        if got.shape != lists.shape or not np.array_equal(got, lists):
            bad = (np.flatnonzero((got != lists).any(axis=1))[:1].tolist() if got.shape == lists.shape else [])
            raise CacheSimulatorMismatch(
                f"bench: the engine's nexttoken cache recorded forecast lists {got.shape} that differ from "
                f"coldset.analysis.forecast.nexttoken_lists {lists.shape} on the same tokens"
                + (f" (first at group {bad[0]}: {got[bad[0]].tolist()} against {lists[bad[0]].tolist()})"
                   if bad else "")
                + "; nothing is published")
        return simulate(stream, "nexttoken", cache.capacity, counts, predictions=lists,
                        prefetch_budget=cache.rules.prefetch_budget, lead_unit=gate_lead(cache),
                        prefetch_gate=gate_on(cache))
    # lookahead: the prefetch lists the engine recorded, one per group (the forecast is the engine's)
    lists = cache.prefetch_lists() if cache.policy == "lookahead" else None
    return simulate(stream, cache.policy, cache.capacity, counts, predictions=lists, lead_unit=gate_lead(cache),
                    prefetch_gate=gate_on(cache))


def gate_on(cache) -> bool:
    """Whether a slot cache's prefetch gate may close (its ``prefetch_gate``, the simulator's); True
    for the policies without a gate."""
    return bool(getattr(cache.rules, "gate_on", True))


def gate_lead(cache) -> int | None:
    """The prefetch gate unit a slot cache decides with (a gated policy's ``rules.lead_unit``, the
    simulator's ``lead_unit``); None for the policies without a gate."""
    return getattr(cache.rules, "lead_unit", None)


def bench_prompts(token_stream: list[int], batch_size: int, prompt_tokens: int) -> torch.Tensor:
    """``[batch_size, prompt_tokens]`` prompts cut from a token stream (fixtures concatenated)."""
    need = batch_size * prompt_tokens
    if not token_stream:
        raise ValueError("bench needs a non-empty token stream to cut prompts from")
    reps = -(-need // len(token_stream))
    return torch.tensor((token_stream * reps)[:need], dtype=torch.long).view(batch_size, prompt_tokens)


@dataclass(frozen=True)
class BenchRequest:
    """One held-out request the bench decodes: its fixture id and domain, and the first
    ``prompt_tokens`` tokens of its prompt (the prompt every batch row starts from)."""

    id: str
    domain: str
    tokens: tuple[int, ...]


def select_bench_requests(candidates: list[tuple[str, str, list[int]]], count: int,
                          prompt_tokens: int) -> list[BenchRequest]:
    """``count`` distinct requests from ``candidates`` (``(id, domain, token ids)`` in fixture
    order), taken round-robin across domains in order of first appearance, so every domain is
    timed and a batch mixes them; a request shorter than ``prompt_tokens`` is passed over (the
    bench's prompts are all ``prompt_tokens`` long). Raises ValueError, saying how many there were,
    when fewer than ``count`` qualify: a bench that repeated a request would time one document."""
    by_domain: dict[str, list[BenchRequest]] = {}
    short = 0
    for rid, domain, ids in candidates:
        if len(ids) < prompt_tokens:
            short += 1
            continue
        by_domain.setdefault(domain, []).append(BenchRequest(rid, domain, tuple(ids[:prompt_tokens])))
    picked: list[BenchRequest] = []
    queues = [list(q) for q in by_domain.values()]
    while len(picked) < count and any(queues):
        for q in queues:
            if q and len(picked) < count:
                picked.append(q.pop(0))
    if len(picked) < count:
        raise ValueError(f"the bench needs {count} distinct requests of at least {prompt_tokens} tokens; "
                         f"{len(picked)} of {len(candidates)} qualify ({short} shorter)")
    return picked


def request_batches(requests: list[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    """The requests in consecutive batches of ``batch_size`` (round-robin order: batches mix domains)."""
    if len(requests) % batch_size:
        raise ValueError(f"{len(requests)} requests do not fill batches of {batch_size}")
    return [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]


def batch_stream(batch: list[BenchRequest]) -> list[int]:
    """The token stream :func:`bench_prompts` cuts one batch's prompts from: row i = request i."""
    return [t for r in batch for t in r.tokens]


def ngram_overlap(bench: list[list[int]], profile: list[list[int]], n: int = 8) -> float | None:
    """Share of the bench prompts' ``n``-token sequences (counted with repeats) that also occur
    somewhere in the profile prompts: how much of what is timed the placement was fitted on (the
    agent system prompt every agent fixture starts with scores high). None when no bench prompt
    has ``n`` tokens."""
    seen = {tuple(p[i:i + n]) for p in profile for i in range(len(p) - n + 1)}
    grams = [tuple(p[i:i + n]) for p in bench for i in range(len(p) - n + 1)]
    return sum(g in seen for g in grams) / len(grams) if grams else None


def _mean_or_none(values: list) -> float | None:
    return None if any(v is None for v in values) else float(statistics.fmean(values))


def pool_results(results: list[BenchResult], batches: list[list[BenchRequest]]) -> dict:
    """One bench entry from the results of several batches of distinct requests (same placement,
    batch size and decode length), as if they were decoded one after the other: repeat r's pass is
    every batch's repeat r in turn, so ``step_ms_mean``, p50/p90 and ``repeat_spread`` come from
    :func:`pass_timing` / :func:`coldset.core.timing.repeat_spread` over those passes; shares and
    per-token bytes are means over batches (each decodes the same number of tokens); the prefill
    the median. ``requests`` lists the ids; ``domains`` counts requests per domain and, for
    batches of one request, holds each domain's own pooled tok/s, mean step and cold share."""
    if not results or len(results) != len(batches):
        raise ValueError("pool_results: one result per batch")
    first = results[0]
    if any((r.placement, r.batch_size, r.new_tokens, r.repeats) != (first.placement, first.batch_size,
                                                                      first.new_tokens, first.repeats)
           for r in results):
        raise ValueError("pool_results: results of other placements, batch sizes or decode lengths")
    passes = [[t for r in results for t in r.passes_ms[rep]] for rep in range(len(first.passes_ms))]
    mean_ms, p50, p90 = pass_timing(passes)
    out = first.to_dict()
    cold = statistics.fmean(r.cold_share for r in results)
    out.update(
        tok_s=1000.0 / mean_ms, step_ms_mean=mean_ms, step_ms_p50=p50, step_ms_p90=p90,
        prefill_ms=statistics.median(r.prefill_ms for r in results),
        repeat_spread=repeat_spread(passes), cold_share=cold, hit_rate=1.0 - cold,
        link_gb_per_token=statistics.fmean(r.link_gb_per_token for r in results),
        hbm_gb_per_token=_mean_or_none([r.hbm_gb_per_token for r in results]),
        misses_per_token=_mean_or_none([r.misses_per_token for r in results]),
        simulator_hit_rate=_mean_or_none([r.simulator_hit_rate for r in results]),
        wasted_gb_per_token=_mean_or_none([r.wasted_gb_per_token for r in results]),
        timed_token_match=_mean_or_none([r.timed_token_match for r in results]),
        requests=[q.id for b in batches for q in b],
        replays=None if any(r.replays is None for r in results) else [x for r in results for x in r.replays],
    )
    counts: dict[str, int] = {}
    for q in (q for b in batches for q in b):
        counts[q.domain] = counts.get(q.domain, 0) + 1
    domains: dict[str, dict] = {d: {"requests": c} for d, c in counts.items()}
    if first.batch_size == 1:  # one domain per batch: each domain's own timing
        for d in domains:
            mine = [r for r, b in zip(results, batches) if b[0].domain == d]
            d_mean, _, _ = pass_timing([[t for r in mine for t in r.passes_ms[rep]]
                                        for rep in range(len(first.passes_ms))])
            domains[d].update(tok_s=1000.0 / d_mean, step_ms_mean=d_mean,
                              cold_share=statistics.fmean(r.cold_share for r in mine))
    out["domains"] = domains
    return out


class Decoder:
    """Prefill then greedy decode of equal-length prompts, the step optionally CUDA-graphed.

    Every input of the step lives in a static buffer (token, position, cache slot, full-length
    attention mask), so one captured graph serves every step and every placement whose pools
    keep their addresses.
    """

    def __init__(self, model, batch_size: int, prompt_tokens: int, new_tokens: int, use_graph: bool):
        self.model = model
        self.bsz, self.plen, self.new = batch_size, prompt_tokens, new_tokens
        self.max_seq = prompt_tokens + new_tokens
        dev = model.device
        model.setup_cache(batch_size, self.max_seq)
        self.all_slots = torch.arange(self.max_seq, device=dev)
        self.tok = torch.zeros((batch_size, 1), dtype=torch.long, device=dev)
        self.pos = torch.zeros((batch_size, 1), dtype=torch.long, device=dev)
        self.slot = torch.zeros((1,), dtype=torch.long, device=dev)
        self.mask = torch.zeros((batch_size, 1, 1, self.max_seq), dtype=torch.bool, device=dev)
        self.logits = None
        self.graph = None
        self.use_graph = use_graph

    def _step(self):
        return self.model(self.tok, self.pos, self.slot, self.mask)[:, -1]

    def prefill(self, prompts: torch.Tensor) -> torch.Tensor:
        plen = self.plen
        slots = self.all_slots[:plen]
        mask = (slots[:, None] >= slots[None, :])[None, None].expand(self.bsz, 1, plen, plen)
        positions = slots[None, :].expand(self.bsz, plen)
        logits = self.model(prompts.to(self.model.device), positions, slots, mask, last_only=True)[:, -1]
        return torch.argmax(logits, dim=-1)

    def set_step(self, token: torch.Tensor, t: int) -> None:
        """Write step ``t``'s inputs (the token at sequence slot plen + t - 1) into the buffers."""
        slot = self.plen + t - 1
        self.tok.copy_(token[:, None])
        self.pos.fill_(slot)
        self.slot.fill_(slot)
        self.mask.copy_((self.all_slots <= slot)[None, None, None, :].expand_as(self.mask))

    def capture(self) -> None:
        """Capture the decode step in a CUDA graph (after a warm-up on a side stream)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()

    def step(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        return self._step()

    def timed_steps(self, token: torch.Tensor, steps: int, before_step=None):
        """Greedy decode of ``steps`` steps from ``token`` (step 1's input), each step timed alone
        (CUDA events on CUDA, the wall clock elsewhere): yields ``(ms, logits, next token)`` a step.
        ``logits`` is the step's output buffer (the graph's, rewritten by the next step: clone what
        is kept). ``before_step()``: called once a step's inputs are written, before its timing."""
        start, stop = _timer(self.model.device)
        for t in range(1, steps + 1):
            self.set_step(token, t)
            if before_step is not None:
                before_step()
            t0 = start()
            logits = self.step()
            ms = stop(t0)
            token = torch.argmax(logits, dim=-1)
            yield ms, logits, token


def _timer(device: torch.device):
    if device.type == "cuda":
        def start():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev

        def stop(ev):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return ev.elapsed_time(end)
    else:
        def start():
            return time.perf_counter()

        def stop(t0):
            return (time.perf_counter() - t0) * 1000.0
    return start, stop


def measure_routing(model, prompts: torch.Tensor, new_tokens: int, bytes_per_expert: int):
    """(cold_share, link bytes per decoded token, HBM expert bytes per decoded token, greedy
    tokens) from an eager pass with routing capture over the benchmarked decode tokens: per step
    and MoE layer each distinct expert the batch touched is read once, over the host link if cold,
    from HBM if hot."""
    gen = generate(model, prompts.tolist(), new_tokens, capture_routing=True, progress=False)
    row_map = model.pools.row_map.cpu().numpy()
    plen = prompts.shape[1]
    decode = np.stack([r.experts.cpu().numpy()[plen:] for r in gen.routing])  # [B, steps, L, k]
    if decode.shape[1] == 0:
        raise ValueError("bench needs at least 2 new tokens to observe decode routing")
    layers = np.arange(row_map.shape[0])[None, None, :, None]
    cold = row_map[layers, decode.astype(np.int64)] < 0
    cold_share = float(cold.mean())
    cold_reads = hot_reads = 0
    for step in range(decode.shape[1]):
        for layer in range(decode.shape[2]):
            ids = decode[:, step, layer, :]
            cold_reads += len(set(ids[cold[:, step, layer, :]].tolist()))
            hot_reads += len(set(ids[~cold[:, step, layer, :]].tolist()))
    tokens = decode.shape[0] * decode.shape[1]
    return (cold_share, cold_reads * bytes_per_expert / tokens, hot_reads * bytes_per_expert / tokens,
            gen.tokens)


def measure_cache(model, cache, prompts: torch.Tensor, new_tokens: int, bytes_per_expert: int, forecaster=None):
    """(cold_share, link bytes per decoded token, HBM expert bytes per decoded token, misses per
    decoded token, greedy tokens, counters, the simulator's hit rate, wasted prefetch bytes per
    decoded token, the replay as (stream, result)) of an eager pass with the
    slot cache ``cache`` (already wrapped into ``model.experts_fn``), from the cache's own counters
    over that pass's decode steps: a hit or a filled miss is read from its slot (each distinct
    instance once per step and layer), a fill crosses the link once. The simulator replays the same
    tokens (:func:`simulate_engine_pass`, ``forecaster``: a nexttoken cache's); a group decided
    otherwise raises :class:`CacheSimulatorMismatch`. Wasted prefetch bytes (instances prefetched
    and evicted before any hit) come from that replay: the engine does not count them, and the
    replay is its decisions group by group (checked here)."""
    cache.reset()  # from the placement's warm state, as every timed repeat starts (bench_decode)
    gen = generate(model, prompts.tolist(), new_tokens, capture_routing=True, progress=False)
    c = cache.counters()
    plen = prompts.shape[1]
    decode = np.stack([r.experts.cpu().numpy()[plen:] for r in gen.routing])  # [B, steps, L, k]
    steps, layers = decode.shape[1], decode.shape[2]
    if c["groups"] != steps * layers:
        raise ValueError(f"bench: the cache decided for {c['groups']} groups, the pass had {steps} decode steps x "
                         f"{layers} MoE layers (prompt_tokens {plen} must exceed the batch size's tokens)")
    # The engine's decisions against the simulator's on the same tokens, group by group.
    sim = simulate_engine_pass(cache, decode, forecaster)
    want = np.stack([sim.hits, sim.misses, sim.fills], axis=1)
    if "prefetches" in c:  # lookahead, nexttoken: the prefetch copies per group too (lists need the whole history)
        pf = sim.prefetches if sim.prefetches is not None else np.zeros(len(want), dtype=np.int64)
        want = np.concatenate([want, pf[:, None]], axis=1)
        got = np.concatenate([cache.group_history(), cache.prefetch_counts()[:, None]], axis=1)
    elif c["groups"] <= cache.history.shape[0]:
        got = cache.group_history()
    else:  # a pass longer than the cache's per-group history: the totals
        got, want = np.array([[c["hits"], c["misses"], c["fills"]]]), want.sum(0, keepdims=True)
    if not np.array_equal(got, want):
        g = int(np.flatnonzero((got != want).any(axis=1))[0])
        raise CacheSimulatorMismatch(
            f"bench: the engine's {cache.policy} cache decided group {g} as (hits, misses, fills[, prefetches]) "
            f"{got[g].tolist()}, "
            f"the simulator {want[g].tolist()} on the same tokens; nothing is published")
    tokens = decode.shape[0] * steps
    hot_reads = sum(len(set(decode[:, s, layer, :].ravel().tolist())) for s in range(steps) for layer in range(layers))
    accesses = c["hits"] + c["misses"]
    # a fill and a prefetch copy each cross the link once
    link = (c["fills"] + c.get("prefetches", 0)) * bytes_per_expert / tokens
    st = sim.stats()
    return (c["misses"] / accesses, link, hot_reads * bytes_per_expert / tokens,
            c["misses"] / tokens, gen.tokens, c, st.hit_rate, st.wasted_prefetches * bytes_per_expert / tokens,
            (engine_stream(decode, cache.pools.row_map.shape[1]), sim))


def measure_ceilings(pinned: torch.Tensor | None = None) -> dict[str, float]:
    """The read rates this run's ratios are taken against (CUDA), in GB/s: HBM (a streaming read
    of 4 GiB of random bf16) and, given a tensor in pinned host memory (the cold tier), its
    in-place read over the host link (up to 1 GiB of it), both by
    :func:`coldset.kernels.bandwidth.read_bandwidth`."""
    from coldset.kernels.bandwidth import (HBM_READ_SHAPES, best_read_bandwidth,  # GPU-only: imports triton
                                           read_bandwidth)

    buf = torch.randn(2 * GIB, device="cuda", dtype=torch.bfloat16)
    # A ceiling is the best rate seen: two rounds of two tilings (the same kernel gave 3974 and
    # 4511 GB/s in two runs on one H200 when measured once, right after a long host-side phase).
    out = {"hbm_read_gb_s": best_read_bandwidth(buf, HBM_READ_SHAPES, rounds=2) / 1e9}
    del buf
    torch.cuda.empty_cache()
    if pinned is not None:
        if not pinned.is_pinned():
            raise ValueError("measure_ceilings: the host tensor is not pinned; its read rate would not be the link's")
        out["link_read_gb_s"] = read_bandwidth(pinned.reshape(-1)[: GIB // pinned.element_size()], 4096, 4, 5) / 1e9
    return out


def pass_timing(passes: list[list[float]]) -> tuple[float, float, float]:
    """``(step_ms_mean, step_ms_p50, step_ms_p90)`` of timed decode passes (step times in ms, one
    list per repeat). The mean step is each pass's time over its steps, the median over repeats:
    a decode's throughput is its total time, and its steps differ by their tokens (a slot-cache
    miss, a cold read), so the median step would leave out the miss-heavy tail. p50 / p90 are over
    every step, a description of that spread."""
    if not passes or not all(passes):
        raise ValueError("pass_timing: no timed steps")
    steps = [t for p in passes for t in p]
    return (statistics.median(statistics.fmean(p) for p in passes), statistics.median(steps),
            float(np.percentile(steps, 90)))


DECODE_LENGTHS = (8, 16, 32, 64, 128, 256, 512, 1024)


def step_ms_by_length(passes: list[list[float]], lengths=DECODE_LENGTHS) -> dict[int, float]:
    """``{n: mean step of the first n decode steps}`` (the median over passes) for each ``n`` of
    ``lengths`` no pass is shorter than, and the whole pass's length. Why: a slot cache starts each
    pass from its warm state and spends its first steps loading what this request's decode uses,
    so its mean step depends on how long the decode is; a 16-step pass and a 256-step one answer
    different questions (a short reply's time against a long one's), and both come from one
    run's passes instead of two runs."""
    if not passes or not all(passes):
        raise ValueError("step_ms_by_length: no timed steps")
    shortest = min(len(p) for p in passes)
    chosen = sorted({n for n in lengths if n < shortest} | {shortest})
    return {n: statistics.median(statistics.fmean(p[:n]) for p in passes) for n in chosen}


def _timed_passes(dec: "Decoder", prompts: torch.Tensor, new_tokens: int, warmup: int, repeats: int, use_graph: bool,
                  replay, cache, measured, what: str) -> tuple[list[float], list[list[float]], list[torch.Tensor]]:
    """The warm-up and timed passes of :func:`bench_decode`: (prefill ms and step ms of each timed
    pass, the last pass's tokens). The graph is captured after the first prefill; with a cache,
    every pass starts from its warm state and must decide what the measured pass ``measured`` did
    (else :class:`TimedLoopMismatch`, naming ``what``)."""
    start, stop = _timer(dec.model.device)  # the prefill's; the steps are timed by Decoder.timed_steps
    prefill_ms, passes = [], []
    for rep in range(warmup + repeats):
        if replay is not None:
            replay.reset()
        t0 = start()
        token = dec.prefill(prompts)
        p_ms = stop(t0)
        if use_graph and dec.graph is None:
            dec.set_step(token, 1)
            dec.capture()
        if cache is not None:  # after the capture, whose warm-up ran the step (decisions included)
            cache.reset()
        steps, decoded = [], [token]
        for ms, _, token in dec.timed_steps(token, new_tokens - 1, replay.advance if replay is not None else None):
            steps.append(ms)
            decoded.append(token)
        if cache is not None and cache.counters() != measured:
            raise TimedLoopMismatch(
                f"bench {what}: repeat {rep} of the timed loop "
                f"decided {cache.counters()} in the cache, the measured pass {measured}; its speed would not "
                "be that of the reported misses, so nothing is published")
        if rep >= warmup:
            prefill_ms.append(p_ms)
            passes.append(steps)
    return prefill_ms, passes, decoded


def moved_bytes_per_expert(pools) -> int:
    """Bytes one expert's copy moves: its w13 and w2 rows and, for block-FP8 or MXFP4 experts, their
    scale rows (what a slot fill or a cold read carries); the biases stay resident (ExpertPools.bias_bytes)."""
    tier = "hot" if pools.num_hot else "cold"
    return sum(getattr(pools, f"{n}_{tier}")[0].numel() * getattr(pools, f"{n}_{tier}").element_size()
               for n in pools.expert_parts)


def bench_decode(model, placed_pools, placement, token_stream: list[int], batch_size: int,
                 prompt_tokens: int, new_tokens: int, warmup: int, repeats: int,
                 replay=None, tuned=None, prompt_split: str | None = None, cache=None) -> BenchResult:
    """Benchmark ``model`` decoding with ``placed_pools`` (the placement's row map) at one batch size.

    ``placement`` is a :class:`coldset.core.placement.Placement`; ``replay`` an optional
    :class:`RoutingReplay` that replaces the router's choices with a recorded trace's;
    ``prompt_split`` names the fixtures split ``token_stream`` was cut from (recorded, not used).
    ``cache`` (a :class:`coldset.engine.cache.pool.SlotCache` whose pools are ``placed_pools``) for a dynamic
    placement: its decisions and fills run inside every decode step (inside the CUDA graph on
    CUDA); the cache's state carries over from step to step, and every pass (the measured eager
    pass and each warm-up and timed repeat) starts from the placement's warm state
    (:meth:`coldset.engine.cache.pool.SlotCache.reset`): a cache left warm by a previous pass over the same
    tokens would already hold what they need, and its steps would be timed without the misses the
    bench reports. Each repeat's hits, misses and fills must equal the measured pass's.
    Raises :class:`TimedLoopMismatch` when the timed loop decodes other tokens than ``generate()``
    or, with a cache, decides otherwise than the measured pass.
    """
    device = model.device
    _, rowmap_fn, backend = experts_functions(device, tuned)
    if cache is not None:
        if placed_pools is not cache.pools:
            raise ValueError("bench_decode: with a cache, placed_pools must be cache.pools")
        if replay is not None:
            raise ValueError("bench_decode: a routing replay with a dynamic placement is not supported "
                             "(the cache decides on the router's choices)")
        rowmap_fn = cache.wrap(rowmap_fn)
    saved = model.pools, model.experts_fn
    model.pools, model.experts_fn = placed_pools, rowmap_fn
    if replay is not None:
        model.experts_fn = replay.wrap(rowmap_fn)
    try:
        prompts = bench_prompts(token_stream, batch_size, prompt_tokens)
        per_expert = moved_bytes_per_expert(placed_pools)
        eager_tokens = hot_per_token = simulator_hit_rate = wasted_per_token = replay_pass = measured = None
        per_token = model.config.top_k * model.config.num_moe_layers  # selections per decoded token
        if cache is not None:
            (cold_share, link_per_token, hot_per_token, misses_per_token, eager_tokens, measured,
             simulator_hit_rate, wasted_per_token, replay_pass) = measure_cache(
                model, cache, prompts, new_tokens, per_expert, placement_forecaster(placement))
        elif replay is None:
            cold_share, link_per_token, hot_per_token, eager_tokens = measure_routing(
                model, prompts, new_tokens, per_expert)
            misses_per_token = cold_share * per_token
        else:
            cold_share, link_per_token = replay.cold_stats(placed_pools.row_map.cpu().numpy(), batch_size,
                                                           new_tokens - 1, per_expert)
            misses_per_token = cold_share * per_token
        use_graph = device.type == "cuda" and backend == "triton"
        dec = Decoder(model, batch_size, prompt_tokens, new_tokens, use_graph)
        prefill_ms, passes, decoded = _timed_passes(dec, prompts, new_tokens, warmup, repeats, use_graph, replay,
                                                    cache, measured,
                                                    f"{placement.policy}-{placement.label} batch {batch_size}")
    finally:
        model.pools, model.experts_fn = saved
    # The timed loop (graphed on CUDA, full-length attention mask) must decode what the engine's
    # generate decodes: a loop that decodes other tokens times another computation, so the stage
    # fails rather than publish its speed (the share is reported in the bench JSON and MLflow).
    timed_tokens = torch.stack(decoded, dim=1).cpu().tolist()
    token_match = None
    if eager_tokens is not None:
        token_match = timed_token_match(eager_tokens, timed_tokens)
        if token_match < 1.0:
            raise TimedLoopMismatch(
                f"bench {placement.policy}-{placement.label} batch {batch_size}: the timed decode loop matches "
                f"generate() on {100 * token_match:.1f}% of {batch_size * new_tokens} tokens; its speed would "
                "not be the engine's, so nothing is published")
    mean_ms, p50, p90 = pass_timing(passes)
    preset, pred_lower, pred_sum = speed_model_prediction(placement, batch_size)
    return BenchResult(
        placement=f"{placement.policy}-{placement.label}",
        policy=placement.policy,
        residency=float(placement.residency if placement.residency is not None else placement.achieved_residency),
        batch_size=batch_size,
        tok_s=1000.0 / mean_ms,
        step_ms_mean=mean_ms,
        step_ms_p50=p50,
        step_ms_p90=p90,
        prefill_ms=statistics.median(prefill_ms),
        hbm_expert_gib=float(placement.hbm_expert_gib),
        host_expert_gib=float(placement.host_expert_gib),
        cold_share=cold_share,
        link_gb_per_token=link_per_token / 1e9,
        hbm_gb_per_token=None if hot_per_token is None else
        (hot_per_token + _nonexpert_read_bytes(model.config, batch_size, model.dtype) / batch_size) / 1e9,
        predicted_step_ms=pred_lower,
        predicted_step_ms_sum=pred_sum,
        predicted_preset=preset,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        repeats=repeats,
        repeat_spread=repeat_spread(passes),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        dtype=str(model.dtype).removeprefix("torch."),
        backend=backend,
        graphed=use_graph,
        routing_source="trace" if replay is not None else "router",
        timed_token_match=token_match,
        prompt_split=prompt_split,
        hit_rate=1.0 - cold_share,
        simulator_hit_rate=simulator_hit_rate,
        misses_per_token=misses_per_token,
        wasted_gb_per_token=None if wasted_per_token is None else wasted_per_token / 1e9,
        passes_ms=passes,
        replays=None if replay_pass is None else [(*replay_pass, per_expert)],
    )


def _nonexpert_read_bytes(cfg, batch_size: int, dtype: torch.dtype) -> int:
    """Non-expert weight bytes one decode step reads: every weight once (the LM head included),
    but of the embedding table only the batch's rows (unless it is tied to the LM head)."""
    fmt = str(dtype).removeprefix("torch.")
    parts = nonexpert_bytes_breakdown(cfg, fmt)
    total = sum(parts.values())
    if not cfg.tie_word_embeddings:
        total -= parts["embed_tokens"] - batch_size * cfg.hidden_size * torch.finfo(dtype).bits // 8
    return total


def derive_metrics(records: list[dict], ceilings: dict[str, float] | None = None) -> list[dict]:
    """Fill the metrics that need several placements or this run's ceilings (docs/design.md §6).

    ``tok_s_per_gib``: (tok/s - tok/s at the same policy's next smaller residency) / (GiB of
    experts in HBM added), at the same batch size; None for the smallest residency.
    ``fetch_tax``: 1 - tok/s / tok/s at residency 1.0 of the same policy and batch size.
    Both are None on the CPU (:func:`coldset.core.timing.speed_compares_placements`) and where either timing is
    ``timing_noisy`` (set on every record here): a ratio never divides noise by a GiB difference.
    With ``ceilings`` (:func:`measure_ceilings`): ``bytes_step_ms``, the step's bytes over the
    measured read rates (HBM bytes / HBM rate + link bytes / link rate: a floor), its
    ``fraction_of_bytes_bound`` (floor / measured step), and ``predicted_step_ms_calibrated``, an
    additive model: the same policy's measured residency-1.0 step plus the time the cold bytes take
    over the link instead of HBM. Its inputs come from the run it is compared with, so its agreement
    with measured steps checks additivity; it is not a prediction made apart from the measurement.
    Why this shape: layers run in sequence and each waits for its experts, so link time adds to
    the step rather than hiding under HBM time, and the all-HBM step's time
    beyond its bytes (launch latency of the small non-expert kernels) is a per-step constant
    that only a measurement gives.

    The time bound (docs/design.md §6, every row; ``wasted_gb_per_token`` is the bench's
    own, from the replay): with ``allhbm_step_ms`` the measured step of the run's all-HBM
    placement at the same batch size (:func:`allhbm_reference`, named in ``allhbm_placement``) and
    ``link_ms`` = link bytes per step / the measured link read rate,
    ``bound_ms = max(allhbm_step_ms, link_ms)``, ``bound_fraction = bound_ms / step_ms_mean``,
    ``overlap = 1 - (step_ms_mean - allhbm_step_ms) / link_ms`` (None without link bytes: nothing
    to hide) and ``stall_ms_per_token = (step_ms_mean - allhbm_step_ms) / batch_size``: the
    measured step beyond the all-HBM one, per token, whatever caused it (link waits and the
    cache's management alike; the engine does not time its stalls apart). For a cache row also
    ``simulated_step_ms``: :func:`coldset.analysis.time_model.simulate_time` of the measured pass's replay (its
    own decisions) with the engine's time model (:data:`ENGINE_TIME`) at this run's all-HBM step
    and link rate, the mean over the row's batches, and ``simulated_over_measured`` (the
    simulator's calibration, within 1 +- 0.1 when it holds); where the run also has the policy's
    residency-1.0 row at that batch size (``fetch_tax``'s reference; every selection hits, so its
    step beyond the all-HBM one is the cache's own work) ``manage_ms_per_group`` =
    (its step - ``allhbm_step_ms``) / the MoE layers (:func:`coldset.analysis.time_model.manage_ms_per_group`),
    and ``simulated_managed_step_ms`` / ``simulated_managed_over_measured``, the same simulation with
    that management per (step, layer) group (:attr:`coldset.analysis.time_model.TimeModel.manage_ms`). All by
    :func:`time_columns`, which ``bench cache`` shares. Published only where the timings involved
    (the row, the all-HBM row, the residency-1.0 row for the management columns) are sound (not on
    the CPU, not noisy) and the link rate was measured; None otherwise, as ``tok_s_per_gib``; the
    management columns also None when the all-HBM row is the policy's own residency 1.0.
    """
    out = [dict(r) for r in records]
    groups: dict[tuple, list[dict]] = {}
    for r in out:
        groups.setdefault((r["policy"], r["batch_size"]), []).append(r)
    hbm = (ceilings or {}).get("hbm_read_gb_s")
    link = (ceilings or {}).get("link_read_gb_s")

    def sound(r: dict | None) -> bool:  # a timing a ratio may use: a host tier, repeats that agree
        return r is not None and speed_compares_placements(r.get("device")) and not r["timing_noisy"]

    for r in out:
        r["timing_noisy"] = timing_noisy(r.get("step_ms_p50"), r.get("step_ms_p90"), r.get("repeat_spread"))
    fulls: dict[tuple, dict | None] = {}  # each (policy, batch size)'s residency-1.0 row
    for key, rows in groups.items():
        rows.sort(key=lambda r: r["residency"])
        full = fulls[key] = next((r for r in rows if abs(r["residency"] - 1.0) < 1e-9), None)
        prev = None
        for r in rows:
            # Both ends of a ratio must be sound: the residency-1.0 reference of fetch_tax as much as
            # the record itself (a noisy or CPU reference would divide by noise).
            r["fetch_tax"] = 1.0 - r["tok_s"] / full["tok_s"] if sound(r) and sound(full) else None
            gib = r["hbm_expert_gib"] - prev["hbm_expert_gib"] if prev else 0.0
            r["tok_s_per_gib"] = ((r["tok_s"] - prev["tok_s"]) / gib if gib > 0 and sound(r) and sound(prev)
                                  else None)
            prev = r
            b = r["batch_size"]
            link_gb = r.get("link_gb_per_token", 0.0) * b
            if hbm and r.get("hbm_gb_per_token") is not None and (link or link_gb == 0):
                r["bytes_step_ms"] = 1e3 * (r["hbm_gb_per_token"] * b / hbm + (link_gb / link if link_gb else 0.0))
                r["fraction_of_bytes_bound"] = r["bytes_step_ms"] / r["step_ms_mean"]
            if hbm and link and full is not None:
                r["predicted_step_ms_calibrated"] = full["step_ms_mean"] + 1e3 * link_gb * (1 / link - 1 / hbm)
    for r in out:
        ref = allhbm_reference(out, r["batch_size"], r["policy"])
        r["allhbm_placement"] = None if ref is None else ref.get("placement")
        full = fulls[(r["policy"], r["batch_size"])]
        r.update(time_bound(r, ref, link if sound(r) and sound(ref) else None, full if sound(full) else None))
    for r in out:  # the replays were for this; they are not bench JSON
        r.pop("replays", None)
    return out


class RoutingReplay:
    """Replays a recorded trace's decode routing instead of the model's router (speed only).

    The trace's decode selections, per MoE layer, are laid out as steps of ``batch_size`` tokens
    (requests side by side, in trace order: :meth:`from_trace`). Before every step, the next step's ids are written
    into one static buffer per layer, so the replay also works inside a CUDA graph.
    """

    def __init__(self, steps: np.ndarray, device):
        # steps: int64 [num_steps, num_moe_layers, batch, top_k]
        self.steps = torch.as_tensor(steps, dtype=torch.long)
        self.buffers = torch.zeros(self.steps.shape[1:], dtype=torch.long, device=device)
        self.index = 0

    @classmethod
    def from_trace(cls, trace_path, model_config, batch_size: int, num_steps: int, device,
                   split: str | None = None, heldout_fraction: float | None = None) -> "RoutingReplay":
        """Requests side by side: batch slot ``b`` of step ``s`` replays the ``s``-th decode token
        of the ``b``-th request (trace order of first appearance) that has at least ``num_steps``
        decode tokens, so a step's tokens are different requests at the same point of their
        decode, as in serving, not one request's consecutive tokens. ``split`` (``profile`` |
        ``heldout``) keeps that split's requests only: the trace's ``split`` column, or
        :func:`coldset.core.trace.split_of` with ``heldout_fraction`` where it has none."""
        meta = validate_trace(trace_path, model_config)  # the one trace validator: ids, ranks, layers
        has_split = "split" in pq.read_schema(trace_path).names
        cols = ["request", "position", "phase", "layer", "rank", "expert"] + (["split"] if has_split else [])
        df = pd.read_parquet(trace_path, columns=cols, filters=[("phase", "==", "decode")])
        order = pd.unique(df["request"])  # trace order, before sorting
        if split is not None:
            if has_split:
                keep = set(df.loc[df["split"] == split, "request"])
            else:
                if heldout_fraction is None:
                    raise ValueError(f"routing trace {trace_path} has no split column: give heldout_fraction "
                                     f"to assign the {split!r} split from request ids")
                keep = {r for r in order if split_of(str(r), heldout_fraction) == split}
            order = [r for r in order if r in keep]
        moe = {layer: i for i, layer in enumerate(meta.moe_layers)}
        k = meta.top_k
        df = df.sort_values(["request", "position", "layer", "rank"])
        per_request = {req: g["expert"].to_numpy().reshape(-1, len(moe), k)  # [tokens, L, k]
                       for req, g in df.groupby("request", sort=False)}
        chosen = [r for r in order if len(per_request[r]) >= num_steps][:batch_size]
        if len(chosen) < batch_size:
            where = f" in split {split!r}" if split is not None else ""
            raise ValueError(f"routing trace {trace_path}: {len(chosen)} request(s){where} have at least "
                             f"{num_steps} decode tokens; the benchmark replays {batch_size} side by side "
                             f"({num_steps} steps x batch {batch_size})")
        steps = np.stack([per_request[r][:num_steps] for r in chosen], axis=2)  # [S, L, B, k]
        return cls(np.ascontiguousarray(steps), device)

    def reset(self) -> None:
        self.index = 0

    def advance(self) -> None:
        self.buffers.copy_(self.steps[self.index % len(self.steps)].to(self.buffers.device))
        self.index += 1

    def wrap(self, experts_fn):
        buffers = self.buffers

        def replayed(pools, layer, x, topk_ids, topk_weights):
            if x.shape[0] == buffers.shape[1]:  # decode steps replay; prefill keeps the router
                topk_ids = buffers[layer]
            return experts_fn(pools, layer, x, topk_ids, topk_weights)

        return replayed

    def cold_stats(self, row_map: np.ndarray, batch_size: int, num_steps: int, bytes_per_expert: int):
        steps = self.steps[:num_steps].numpy()  # [S, L, B, k]
        layers = np.arange(row_map.shape[0])[None, :, None, None]
        cold = row_map[layers, steps] < 0
        link = sum(len(set(steps[s, l][cold[s, l]].tolist()))
                   for s in range(steps.shape[0]) for l in range(steps.shape[1]))
        return float(cold.mean()), link * bytes_per_expert / (steps.shape[0] * batch_size)
