"""The time a cache replay's decisions take: the compute clock and the host link as one queue.

:func:`simulate_time` walks :func:`coldset.analysis.simulate.simulate`'s decisions on a stream:
per step, each MoE layer's share of the all-HBM step, the cache's own work per group
(``manage_ms``), and the link as one queue beside the compute, demand and prefetch copies sharing
it (:data:`LINK_MODES`), a late prefetch saving part of a copy. :class:`TimeModel` is what it
assumes about the step and the link; :func:`time_models` builds one per policy and batch from the
config's ``cache.time`` section (:data:`DEFAULT_TIME` without one);
:func:`manage_ms_per_group` measures a policy's own work from two measured steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from coldset.analysis.compiled import jit
from coldset.analysis.policies import POLICIES
from coldset.analysis.policies.base import prefetch_lead_unit
from coldset.analysis.simulate import CacheResult
from coldset.analysis.streams import AccessStream, CacheError


LINK_MODES = ("fifo", "priority", "share")  # serve_link's mode numbers: the index


@jit
def serve_link(until, target, link_t, remaining, done, dq, dhead, pq, phead, mode, share):
    """Advance the link from ``link_t``: up to time ``until`` (``target < 0``; the queues empty
    first: the link idles until then, or stays where it is when ``until`` is inf) or until copy
    ``target`` has landed. ``dhead`` / ``phead``: [head, tail] of the demand / prefetch queues.
    Modes: 0 fifo (everything in the demand queue), 1 priority (the demand queue's head whenever
    it has one: a prefetch pauses), 2 share (both heads at once, demand at ``share`` of the rate).
    Returns the new ``link_t``."""
    while True:
        if target >= 0:
            if done[target] != np.inf:
                return link_t
        elif link_t >= until:
            return link_t
        has_d = dhead[0] < dhead[1]
        has_p = phead[0] < phead[1]
        if not has_d and not has_p:
            return link_t if until == np.inf or target >= 0 else until
        rd = 0.0
        rp = 0.0
        if has_d and has_p and mode == 2:
            rd = share
            rp = 1.0 - share
        elif has_d:
            rd = 1.0
        else:
            rp = 1.0
        cd = dq[dhead[0]] if has_d else -1
        cp = pq[phead[0]] if has_p else -1
        td = remaining[cd] / rd if rd > 0 else np.inf
        tp = remaining[cp] / rp if rp > 0 else np.inf
        dt = min(td, tp)
        if target < 0:
            dt = min(dt, until - link_t)
        new_t = link_t + dt
        if rd > 0:
            if td <= dt:
                remaining[cd] = 0.0
                done[cd] = new_t
                dhead[0] += 1
            else:
                remaining[cd] -= rd * dt
        if rp > 0:
            if tp <= dt:
                remaining[cp] = 0.0
                done[cp] = new_t
                phead[0] += 1
            else:
                remaining[cp] -= rp * dt
        link_t = new_t


@jit
def replay_time(ids, ptr, hit, issued, new_step, pre_ms, post_ms, head_ms, copy_ms, mode, share, join_step,
                 n_inst):
    """The compute clock and the link queue through a replay's decisions (see :func:`simulate_time`).
    Returns (total ms, stall ms, steps, copies)."""
    n_groups = ptr.size - 1
    width = issued.shape[1]
    n_copies = 0
    for g in range(n_groups):
        n_copies += (ptr[g + 1] - ptr[g]) + width
    remaining = np.zeros(n_copies + 1, dtype=np.float64)
    done = np.full(n_copies + 1, np.inf)
    dq = np.empty(n_copies + 1, dtype=np.int64)  # demand copies (every copy in fifo mode)
    pq = np.empty(n_copies + 1, dtype=np.int64)  # prefetch copies
    dhead = np.zeros(2, dtype=np.int64)
    phead = np.zeros(2, dtype=np.int64)
    latest = np.full(n_inst, -1, dtype=np.int64)
    seen = np.zeros(n_inst, dtype=np.bool_)
    nc = 0
    t = 0.0
    link_t = 0.0
    stall = 0.0
    steps = 0
    for g in range(n_groups):
        if new_step[g]:
            if g > 0:
                if join_step:  # the previous step's end waits for every copy issued so far
                    link_t = serve_link(np.inf, -1, link_t, remaining, done, dq, dhead, pq, phead, mode, share)
                    if link_t > t:
                        stall += link_t - t
                        t = link_t
                t += head_ms
            steps += 1
        t += pre_ms
        link_t = serve_link(t, -1, link_t, remaining, done, dq, dhead, pq, phead, mode, share)
        s = ptr[g]
        e = ptr[g + 1]
        for i in range(s, e):  # demand copies: each distinct missed instance, first occurrence order
            x = ids[i]
            if not hit[i] and not seen[x]:
                seen[x] = True
                remaining[nc] = copy_ms
                latest[x] = nc
                dq[dhead[1]] = nc
                dhead[1] += 1
                nc += 1
        for i in range(s, e):
            seen[ids[i]] = False
        for q in range(width):  # the group's prefetches, issued with its decisions
            x = issued[g, q]
            if x < 0:
                continue
            remaining[nc] = copy_ms
            latest[x] = nc
            if mode == 0:
                dq[dhead[1]] = nc
                dhead[1] += 1
            else:
                pq[phead[1]] = nc
                phead[1] += 1
            nc += 1
        ready = t
        for i in range(s, e):  # the experts start when every selected instance's copy has landed
            c = latest[ids[i]]
            if c < 0:
                continue
            if done[c] == np.inf:
                link_t = serve_link(np.inf, c, link_t, remaining, done, dq, dhead, pq, phead, mode, share)
            if done[c] > ready:
                ready = done[c]
        stall += ready - t
        t = ready + post_ms
    if n_groups > 0:
        if join_step:
            link_t = serve_link(np.inf, -1, link_t, remaining, done, dq, dhead, pq, phead, mode, share)
            if link_t > t:
                stall += link_t - t
                t = link_t
        t += head_ms
    return t, stall, steps, nc


@dataclass(frozen=True)
class TimeModel:
    """What :func:`simulate_time` assumes about the step and the host link.

    ``step_ms``: the all-HBM decode step at the stream's batch size (measured).
    ``link_gb_s``: the host link's read rate (the measured pinned read rate).
    ``bytes_per_expert``: one copy
    (:func:`coldset.analysis.placement.expert_bytes`). ``head_share``: the share of the step outside the
    MoE layers' loop (embedding, final norm, LM head; 0.1 is the LM head's share of Qwen3-30B-A3B's
    bytes per step at b1); the rest is split equally over the MoE layers. ``router_share``: the share
    of a layer before its cache decisions (attention and router; the experts follow). Copies are
    issued at the decisions, the group's demand copies first. ``link``: ``"priority"`` (demand
    copies go before every queued prefetch and pause a running one, resumed after), ``"fifo"`` (one
    queue in issue order) or ``"share"`` (a demand and a prefetch copy cross at once, the demand
    at ``demand_share`` of the rate: the engine's demand fill and side-stream copy running
    together, 128 and 32 blocks a weight; a class alone gets the whole rate); FIFO within a class.
    ``join``: ``"use"`` (a copy is waited on only by a group that selects its instance) or
    ``"step"`` (in addition, each step's end, after its last MoE layer, waits for every copy issued
    until then: a side path joined inside the step's CUDA graph, as the engine's slot cache does).
    ``manage_ms``: the cache's own work per (step, layer) group on the compute stream (its
    decision and fill launches, cross-stream waits), paid at the group's decisions whether or not
    anything is copied: :func:`manage_ms_per_group` measures it from the policy's residency-1.0
    step, where every selection hits. Without it a policy whose decisions cost time (``lookahead``,
    BENCHMARKS.md section 4) is simulated fast."""

    step_ms: float
    bytes_per_expert: int
    link_gb_s: float = 51.0
    head_share: float = 0.1
    router_share: float = 0.4
    link: str = "priority"
    join: str = "use"
    demand_share: float = 0.8
    manage_ms: float = 0.0

    def __post_init__(self) -> None:
        if not (self.step_ms > 0 and self.link_gb_s > 0 and self.bytes_per_expert > 0):
            raise CacheError(f"TimeModel: step_ms, link_gb_s and bytes_per_expert must be > 0, got {self.step_ms}, "
                             f"{self.link_gb_s}, {self.bytes_per_expert}")
        if not self.manage_ms >= 0:
            raise CacheError(f"TimeModel: manage_ms must be >= 0, got {self.manage_ms}")
        if not (0 <= self.head_share < 1 and 0 <= self.router_share <= 1):
            raise CacheError(f"TimeModel: head_share must lie in [0, 1) and router_share in [0, 1], got "
                             f"{self.head_share}, {self.router_share}")
        if self.join not in ("use", "step"):
            raise CacheError(f"TimeModel: join must be 'use' or 'step', got {self.join!r}")
        if self.link not in LINK_MODES or not 0 < self.demand_share < 1:
            raise CacheError(f"TimeModel: link must be one of {LINK_MODES} and demand_share in (0, 1), got "
                             f"{self.link!r}, {self.demand_share}")

    @property
    def copy_ms(self) -> float:
        return self.bytes_per_expert / (self.link_gb_s * 1e9) * 1e3

    def lead_unit(self, num_moe_layers: int) -> int:
        """The prefetch gate's measure of a group's compute under this model
        (:func:`coldset.analysis.policies.base.prefetch_lead_unit`)."""
        return prefetch_lead_unit(self.step_ms, self.head_share, num_moe_layers, self.copy_ms)


@dataclass(frozen=True)
class TimeStats:
    """A replay's simulated time (per step of the stream's batch; per token = per step / batch).

    ``bound_ms = max(allhbm_ms, link ms per step)``; ``bound_fraction = bound_ms / step_ms``;
    ``overlap = 1 - (step_ms - allhbm_ms) / link ms per step`` (NaN without link traffic): 1 when
    every copy hides under the compute, 0 when the link time adds to it in series."""

    step_ms: float
    allhbm_ms: float
    bound_ms: float
    bound_fraction: float
    overlap: float
    stall_ms_per_token: float
    link_gb_per_token: float
    wasted_gb_per_token: float
    steps: int
    tokens: int


def simulate_time(stream: AccessStream, result: CacheResult, model: TimeModel) -> TimeStats:
    """The time a replay's decisions (:func:`coldset.analysis.simulate.simulate`'s ``result`` on
    ``stream``) take.

    Compute: per step, each MoE layer ``(step_ms * (1 - head_share)) / L`` (``router_share`` of it
    before its decisions) plus ``manage_ms`` (the decisions), then ``head_share`` of the step.
    Link: one queue at ``link_gb_s``; a copy lands when its bytes have crossed. At a group's
    decisions its demand copies (each distinct missed instance: a slot fill, a read in place or a
    static cold read) and then its prefetches (``result.issued``) are queued; the group's experts
    start when every copy of an instance it selects has landed, the last of its own demand copies
    and any earlier copy still crossing (a late prefetch is a hit that saves only part of a copy);
    the wait is the stall. A new step starts where the stream's MoE layer index does not rise (as
    :func:`coldset.analysis.simulate.simulate`'s commit)."""
    if result.hit.size != stream.instances.size or result.fills.size != stream.num_groups:
        raise CacheError("simulate_time: the result is not a replay of this stream")
    ids, ptr = stream.instances, stream.group_ptr
    L = stream.num_moe_layers
    issued = result.issued if result.issued is not None else np.zeros((stream.num_groups, 0), np.int64)
    layer = ids[ptr[:-1]] // stream.num_experts if ids.size else np.zeros(0, np.int64)
    new_step = np.r_[True, layer[1:] <= layer[:-1]] if layer.size else np.zeros(0, bool)
    per_layer = model.step_ms * (1 - model.head_share) / L
    total, stall, steps, copies = replay_time(
        ids, ptr, result.hit, np.ascontiguousarray(issued, dtype=np.int64), new_step,
        per_layer * model.router_share + model.manage_ms, per_layer * (1 - model.router_share),
        model.step_ms * model.head_share,
        model.copy_ms, LINK_MODES.index(model.link), float(model.demand_share),
        model.join == "step", stream.num_instances)
    total, stall, copies = float(total), float(stall), int(copies)
    st = result.stats()
    if copies != st.fills + st.prefetches:
        raise CacheError(f"simulate_time: {copies} copies timed, the replay counted {st.fills + st.prefetches}")
    tokens = max(stream.tokens, 1)
    steps = max(int(steps), 1)
    step = total / steps
    link_ms = copies * model.copy_ms / steps
    bound = max(model.step_ms, link_ms)
    return TimeStats(step, model.step_ms, bound, bound / step, 1 - (step - model.step_ms) / link_ms if copies else
                     float("nan"), stall / tokens, copies * model.bytes_per_expert / tokens / 1e9,
                     st.wasted_prefetches * model.bytes_per_expert / tokens / 1e9, steps, stream.tokens)


def manage_ms_per_group(full_step_ms: float, allhbm_step_ms: float, num_moe_layers: int) -> float:
    """:attr:`TimeModel.manage_ms` from two measured steps of one run and batch size: the policy at
    residency 1.0 (every selection hits, so its step exceeds the all-HBM one only by the cache's
    decisions) and the all-HBM step, spread over the step's ``num_moe_layers`` groups; 0 when the
    policy's step is not slower (noise)."""
    if num_moe_layers < 1 or not (full_step_ms > 0 and allhbm_step_ms > 0):
        raise CacheError(f"manage_ms_per_group: steps {full_step_ms}, {allhbm_step_ms} ms over {num_moe_layers} "
                         "layers: each must be > 0")
    return max(0.0, (full_step_ms - allhbm_step_ms) / num_moe_layers)


# The H200 at Qwen3-30B-A3B's shape (BENCHMARKS.md section 4) and the engine's slot cache: copies
# on a side stream joined at the step's end, sharing the link with the demand fills.
DEFAULT_TIME = {"steps": [{"batch": 1, "all_hbm_step_ms": 2.56}, {"batch": 8, "all_hbm_step_ms": 5.76}],
                "link_gb_s": 51.0, "head_share": 0.1, "router_share": 0.4, "link": "share", "demand_share": 0.8,
                "join": "step"}


def time_models(time: Mapping[str, Any] | None, bytes_per_expert: int) -> dict[int, dict[str, TimeModel]]:
    """The config's ``cache.time`` section (None: :data:`DEFAULT_TIME`, the H200 figures at
    Qwen3-30B-A3B's shape) as, per simulated batch size, one :class:`TimeModel` per policy of
    :data:`coldset.analysis.policies.POLICIES`: the same step and link, each with the policy's own
    work per group from the step entry's ``manage_us`` (``TimeModel.manage_ms``; a policy not
    listed: none)."""
    t = {**DEFAULT_TIME, **(time or {})}
    out: dict[int, dict[str, TimeModel]] = {}
    for entry in t["steps"]:
        b = int(entry["batch"])
        if b < 1 or b in out:
            raise CacheError(f"cache.time.steps: batch {b} is < 1 or listed twice")
        manage = dict(entry.get("manage_us") or {})
        unknown = sorted(set(manage) - set(POLICIES))
        if unknown:
            raise CacheError(f"cache.time.steps: batch {b}'s manage_us names {unknown}, "
                             f"not among {', '.join(POLICIES)}")
        out[b] = {p: TimeModel(float(entry["all_hbm_step_ms"]), int(bytes_per_expert), float(t["link_gb_s"]),
                               float(t["head_share"]), float(t["router_share"]), str(t["link"]), str(t["join"]),
                               float(t["demand_share"]), float(manage.get(p, 0.0)) / 1e3) for p in POLICIES}
    if not out:
        raise CacheError("cache.time.steps: at least one (batch, all_hbm_step_ms) entry")
    return out
