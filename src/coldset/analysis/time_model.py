"""The time a cache replay's decisions take: the compute clock and the host link as one queue.

:func:`simulate_time` walks :func:`coldset.analysis.simulate.simulate`'s decisions on a stream:
per step, each MoE layer's share of the all-HBM step, the cache's own work per group
(``manage_ms``), and the link as one queue beside the compute, demand and prefetch copies sharing
it (:data:`LINK_MODES`), a late prefetch saving part of a copy. :class:`TimeModel` is what it
assumes about the step and the link; :func:`time_models` builds one per policy and batch from the
config's ``cache.time`` section (:data:`DEFAULT_TIME` without one);
:func:`manage_ms_per_group` measures a policy's own work from two measured steps. With the
compressed host tier (:attr:`TimeModel.compressed`, :func:`compressed_tier` from the config) a
slot fill crosses the link compressed and is usable after its decode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from coldset.analysis.compiled import jit
from coldset.analysis.policies import POLICIES
from coldset.analysis.policies.base import prefetch_lead_unit
from coldset.analysis.simulate import CacheResult
from coldset.analysis.streams import AccessStream, CacheError
from coldset.core.shapes import FP8_BLOCK128, MXFP4, ShapeError, get_weight_format


LINK_MODES = ("fifo", "priority", "share")  # serve_link's mode numbers: the index
#: |overlap| under this is the rounding of the step's summed float times (a series link's overlap
#: comes out as +-1e-11), reported as 0.
OVERLAP_RESOLUTION = 1e-9
#: Copies each of the link's two queues holds before :func:`grow_queues` doubles them.
QUEUE_SLOTS = 1024


@jit
def land(q, slot, new_t, qc, qx, qz, done, latest, decoder):
    """Copy ``qc[q, slot]`` (of instance ``qx[q, slot]``) has crossed the link at ``new_t``: a
    compressed one (``qz``) is decoded after it and after the previous decode (``decoder``:
    [decode ms, the decoder's free time]); the instance is usable then, if this is its latest copy."""
    ready = new_t
    if qz[q, slot]:
        ready = max(new_t, decoder[1]) + decoder[0]
        decoder[1] = ready
    x = qx[q, slot]
    if latest[x] == qc[q, slot]:
        done[x] = ready


@jit
def serve_head(q, slot, rate, t_left, dt, new_t, qc, qx, qr, qz, qh, done, latest, decoder):
    """Queue ``q``'s head copy (ring slot ``slot``, ``t_left`` from landing at ``rate`` of the link)
    served for ``dt`` up to ``new_t``: landed (:func:`land`) and off the queue where it finishes
    by then, else its link time left reduced; nothing where ``rate`` is 0."""
    if rate <= 0:
        return
    if t_left <= dt:
        qr[q, slot] = 0.0
        land(q, slot, new_t, qc, qx, qz, done, latest, decoder)
        qh[q, 0] += 1
    else:
        qr[q, slot] -= rate * dt


@jit
def serve_link(until, target, link_t, qc, qx, qr, qz, qh, done, latest, decoder, mode, share):
    """Advance the link from ``link_t``: up to time ``until`` (``target < 0``; the queues empty
    first: the link idles until then, or stays where it is when ``until`` is inf) or until instance
    ``target``'s latest copy has landed (``done[target]`` set). The two queues (row 0 demand, row
    1 prefetch) are rings: ``qc`` copy id, ``qx`` instance, ``qr`` the part of its link time left,
    ``qz`` decoded after landing, entry ``j`` of row ``q`` at ``j & (slots - 1)``, ``qh[q]`` =
    [head, tail]. Modes: 0 fifo (everything in the demand queue), 1 priority (the demand queue's
    head whenever it has one: a prefetch pauses), 2 share (both heads at once, demand at ``share``
    of the rate). Returns the new ``link_t``."""
    mask = qc.shape[1] - 1
    while True:
        if target >= 0:
            if done[target] != np.inf:
                return link_t
        elif link_t >= until:
            return link_t
        has_d = qh[0, 0] < qh[0, 1]
        has_p = qh[1, 0] < qh[1, 1]
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
        sd = qh[0, 0] & mask
        sp = qh[1, 0] & mask
        td = qr[0, sd] / rd if rd > 0 else np.inf
        tp = qr[1, sp] / rp if rp > 0 else np.inf
        dt = min(td, tp)
        if target < 0:
            dt = min(dt, until - link_t)
        new_t = link_t + dt
        serve_head(0, sd, rd, td, dt, new_t, qc, qx, qr, qz, qh, done, latest, decoder)
        serve_head(1, sp, rp, tp, dt, new_t, qc, qx, qr, qz, qh, done, latest, decoder)
        link_t = new_t


@jit
def grow_queues(qc, qx, qr, qz, qh, need):
    """The rings with room for ``need`` more entries in each queue: the same arrays where they have
    it, else new ones of a power-of-two size with each queue's entries from slot 0."""
    slots = qc.shape[1]
    used = max(qh[0, 1] - qh[0, 0], qh[1, 1] - qh[1, 0])
    if used + need <= slots:
        return qc, qx, qr, qz
    new = slots
    while used + need > new:
        new *= 2
    nc = np.empty((2, new), dtype=qc.dtype)
    nx = np.empty((2, new), dtype=qx.dtype)
    nr = np.empty((2, new), dtype=qr.dtype)
    nz = np.empty((2, new), dtype=qz.dtype)
    mask = slots - 1
    for q in range(2):
        n = qh[q, 1] - qh[q, 0]
        for j in range(n):
            old = (qh[q, 0] + j) & mask
            nc[q, j] = qc[q, old]
            nx[q, j] = qx[q, old]
            nr[q, j] = qr[q, old]
            nz[q, j] = qz[q, old]
        qh[q, 0] = 0
        qh[q, 1] = n
    return nc, nx, nr, nz


@jit
def push_copy(q, x, c, link_ms, decoded, qc, qx, qr, qz, qh, latest, done):
    """Copy ``c`` of instance ``x`` joins queue ``q``'s tail: ``link_ms`` of the link, decoded after
    landing where ``decoded``; the instance's latest copy, not usable until it lands."""
    j = qh[q, 1] & (qc.shape[1] - 1)
    qc[q, j] = c
    qx[q, j] = x
    qr[q, j] = link_ms
    qz[q, j] = decoded
    qh[q, 1] += 1
    latest[x] = c
    done[x] = np.inf


@jit
def end_step(t, stall, link_t, join_step, head_ms, qc, qx, qr, qz, qh, done, latest, decoder, mode, share):
    """A step's end at compute time ``t``: with ``join_step`` it waits for every copy issued so far
    and its decode (the wait is stall), then the head's ``head_ms``. Returns (t, stall, link_t)."""
    if join_step:
        link_t = serve_link(np.inf, -1, link_t, qc, qx, qr, qz, qh, done, latest, decoder, mode, share)
        end = max(link_t, decoder[1])
        if end > t:
            stall += end - t
            t = end
    return t + head_ms, stall, link_t


@jit
def replay_time(ids, ptr, hit, issued, n_exp, pre_ms, post_ms, head_ms, copy_ms, mode, share, join_step, n_inst,
                fill_ms, decode_ms, admitted, slots):
    """The compute clock and the link queue through a replay's decisions (see :func:`simulate_time`),
    in memory of the instances and the copies in flight (rings of ``slots`` entries at first, a power
    of two, doubled as needed). A demand copy takes ``copy_ms`` of the link, or where ``admitted``
    (bool ``[N]``, non-empty: the compressed tier) marks its selection ``fill_ms`` and then
    ``decode_ms`` on the decoder; a prefetch (always a fill) takes ``fill_ms``, then ``decode_ms``
    where ``admitted`` is non-empty. Returns (total ms, stall ms, steps, copies, decoded copies)."""
    n_groups = ptr.size - 1
    width = issued.shape[1]
    compressed = admitted.size > 0
    qc = np.empty((2, slots), dtype=np.int64)
    qx = np.empty((2, slots), dtype=np.int64)
    qr = np.empty((2, slots), dtype=np.float64)
    qz = np.zeros((2, slots), dtype=np.bool_)
    qh = np.zeros((2, 2), dtype=np.int64)  # row 0 demand copies (every copy in fifo mode), row 1 prefetches
    done = np.full(n_inst, np.inf)  # when each instance's latest copy is usable
    latest = np.full(n_inst, -1, dtype=np.int64)
    seen = np.zeros(n_inst, dtype=np.bool_)
    decoder = np.zeros(2, dtype=np.float64)
    decoder[0] = decode_ms
    nc = 0
    n_decoded = 0
    t = 0.0
    link_t = 0.0
    stall = 0.0
    steps = 0
    prev_layer = -1
    pq = 0 if mode == 0 else 1
    for g in range(n_groups):
        s = ptr[g]
        e = ptr[g + 1]
        layer = ids[s] // n_exp
        if g == 0 or layer <= prev_layer:  # a new step where the MoE layer index does not rise
            if g > 0:
                t, stall, link_t = end_step(t, stall, link_t, join_step, head_ms, qc, qx, qr, qz, qh, done, latest,
                                            decoder, mode, share)
            steps += 1
        prev_layer = layer
        t += pre_ms
        if qh[0, 0] < qh[0, 1] or qh[1, 0] < qh[1, 1]:
            link_t = serve_link(t, -1, link_t, qc, qx, qr, qz, qh, done, latest, decoder, mode, share)
        elif link_t < t:  # an idle link waits for the compute
            link_t = t
        if max(qh[0, 1] - qh[0, 0], qh[1, 1] - qh[1, 0]) + (e - s) + width > qc.shape[1]:
            qc, qx, qr, qz = grow_queues(qc, qx, qr, qz, qh, (e - s) + width)
        for i in range(s, e):  # demand copies: each distinct missed instance, first occurrence order
            x = ids[i]
            if not hit[i] and not seen[x]:
                seen[x] = True
                fill = compressed and admitted[i]
                push_copy(0, x, nc, fill_ms if fill else copy_ms, fill, qc, qx, qr, qz, qh, latest, done)
                n_decoded += fill
                nc += 1
        for q in range(width):  # the group's prefetches, issued with its decisions
            x = issued[g, q]
            if x < 0:
                continue
            push_copy(pq, x, nc, fill_ms, compressed, qc, qx, qr, qz, qh, latest, done)
            n_decoded += compressed
            nc += 1
        ready = t
        for i in range(s, e):  # the experts start when every selected instance's copy is usable
            x = ids[i]
            seen[x] = False
            if latest[x] < 0:
                continue
            if done[x] == np.inf:
                link_t = serve_link(np.inf, x, link_t, qc, qx, qr, qz, qh, done, latest, decoder, mode, share)
            if done[x] > ready:
                ready = done[x]
        stall += ready - t
        t = ready + post_ms
    if n_groups > 0:
        t, stall, link_t = end_step(t, stall, link_t, join_step, head_ms, qc, qx, qr, qz, qh, done, latest, decoder,
                                    mode, share)
    return t, stall, steps, nc, n_decoded


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
    BENCHMARKS.md section 4) is simulated fast.

    ``compressed_ratio`` and ``decode_gb_s`` (both or neither; default neither: the raw host
    tier): slot fills (admitted demand misses and prefetches) come from the compressed host tier,
    ``compressed_ratio`` x ``bytes_per_expert`` over the link, and the slot is usable only after
    its decode (``bytes_per_expert`` out at ``decode_gb_s``, beside the compute), one decode at a
    time in landing order, each after its copy and the previous decode
    (:func:`coldset.analysis.speed.compressed_fill_s`' model); reads in place (misses not
    admitted, and ``static``'s cold reads) stay raw: a kernel cannot read coded weights."""

    step_ms: float
    bytes_per_expert: int
    link_gb_s: float = 51.0
    head_share: float = 0.1
    router_share: float = 0.4
    link: str = "priority"
    join: str = "use"
    demand_share: float = 0.8
    manage_ms: float = 0.0
    compressed_ratio: float | None = None
    decode_gb_s: float | None = None

    def __post_init__(self) -> None:
        if (self.compressed_ratio is None) != (self.decode_gb_s is None):
            raise CacheError(f"TimeModel: compressed_ratio and decode_gb_s go together (the compressed host tier), "
                             f"got {self.compressed_ratio}, {self.decode_gb_s}")
        if self.compressed and not (self.compressed_ratio > 0 and self.decode_gb_s > 0):
            raise CacheError(f"TimeModel: compressed_ratio and decode_gb_s must be > 0, got {self.compressed_ratio}, "
                             f"{self.decode_gb_s}")
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
    def compressed(self) -> bool:
        """Slot fills come from the compressed host tier."""
        return self.compressed_ratio is not None

    @property
    def copy_ms(self) -> float:
        """One raw copy's link time."""
        return self.bytes_per_expert / (self.link_gb_s * 1e9) * 1e3

    @property
    def fill_ms(self) -> float:
        """One slot fill's link time: the compressed record's where the tier is compressed."""
        return self.copy_ms * self.compressed_ratio if self.compressed else self.copy_ms

    @property
    def decode_ms(self) -> float:
        """One slot fill's decode time (0 on the raw tier)."""
        return self.bytes_per_expert / (self.decode_gb_s * 1e9) * 1e3 if self.compressed else 0.0

    def lead_unit(self, num_moe_layers: int) -> int:
        """The prefetch gate's measure of a group's compute under this model
        (:func:`coldset.analysis.policies.base.prefetch_lead_unit`)."""
        return prefetch_lead_unit(self.step_ms, self.head_share, num_moe_layers, self.copy_ms)


@dataclass(frozen=True)
class TimeStats:
    """A replay's simulated time (per step of the stream's batch; per token = per step / batch).

    ``bound_ms = max(allhbm_ms, link ms per step, decode ms per step)`` (the link's time of the
    bytes it carried: compressed records where the tier is compressed; the decoder's work, 0 on the
    raw tier); ``bound_fraction = bound_ms / step_ms``;
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
    :func:`coldset.analysis.simulate.simulate`'s commit). With the compressed tier
    (:attr:`TimeModel.compressed`) a slot fill is usable after its decode, and ``result`` must
    carry ``victims`` (``simulate(..., record_victims=True)``): they tell the admitted misses
    (fills) from the reads in place. Memory: the stream, the result and a few arrays per instance
    and per copy in flight (the loop keeps no array per selection or per copy)."""
    if result.hit.size != stream.instances.size or result.fills.size != stream.num_groups:
        raise CacheError("simulate_time: the result is not a replay of this stream")
    admitted = np.zeros(0, dtype=bool)
    if model.compressed:
        if result.victims is None:
            raise CacheError("simulate_time: the compressed tier needs the replay's victims (simulate with "
                             "record_victims=True) to tell slot fills from reads in place")
        admitted = result.victims >= 0
    ids, ptr = stream.instances, stream.group_ptr
    issued = result.issued if result.issued is not None else np.zeros((stream.num_groups, 0), np.int64)
    if not np.issubdtype(issued.dtype, np.signedinteger):
        raise CacheError(f"simulate_time: the result's issued lists must be signed integers, got {issued.dtype}")
    per_layer = model.step_ms * (1 - model.head_share) / stream.num_moe_layers
    total, stall, steps, copies, decoded = replay_time(
        ids, ptr, result.hit, np.ascontiguousarray(issued), stream.num_experts,
        per_layer * model.router_share + model.manage_ms, per_layer * (1 - model.router_share),
        model.step_ms * model.head_share, model.copy_ms, LINK_MODES.index(model.link), float(model.demand_share),
        model.join == "step", stream.num_instances, model.fill_ms, model.decode_ms, admitted, QUEUE_SLOTS)
    total, stall, copies, decoded = float(total), float(stall), int(copies), int(decoded)
    st = result.stats()
    if copies != st.fills + st.prefetches:
        raise CacheError(f"simulate_time: {copies} copies timed, the replay counted {st.fills + st.prefetches}")
    tokens = max(stream.tokens, 1)
    steps = max(int(steps), 1)
    step = total / steps
    if model.compressed:
        ratio = model.compressed_ratio
        link_ms = ((copies - decoded) * model.copy_ms + decoded * model.fill_ms) / steps
        link_bytes = ((copies - decoded) + decoded * ratio) * model.bytes_per_expert
        wasted_bytes = st.wasted_prefetches * ratio * model.bytes_per_expert
        bound = max(model.step_ms, link_ms, decoded * model.decode_ms / steps)
    else:
        link_ms = copies * model.copy_ms / steps
        link_bytes = copies * model.bytes_per_expert
        wasted_bytes = st.wasted_prefetches * model.bytes_per_expert
        bound = max(model.step_ms, link_ms)
    overlap = float("nan")
    if copies:
        overlap = 1 - (step - model.step_ms) / link_ms
        if abs(overlap) < OVERLAP_RESOLUTION:  # the sums' rounding, not a measure: print 0, not -8e-11
            overlap = 0.0
    return TimeStats(step, model.step_ms, bound, bound / step, overlap, stall / tokens, link_bytes / tokens / 1e9,
                     wasted_bytes / tokens / 1e9, steps, stream.tokens)


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


#: Compressed over raw bytes of one expert per format, the codec on synthetic weights drawn as trained
#: ones are (Gaussian, std 1/sqrt(fan_in), Qwen3-30B-A3B's expert shape; scripts/codec_ratios.py).
DEFAULT_COMPRESSED_RATIOS = {"bfloat16": 0.6757, FP8_BLOCK128: 0.8463, MXFP4: 0.9574}


def compressed_tier(spec: Mapping[str, Any] | None, weight_format: str) -> tuple[float, float] | None:
    """``(compressed_ratio, decode_gb_s)`` of :class:`TimeModel` for experts in ``weight_format`` from
    the config's ``cache.compressed_tier`` (``{decode_gb_s, ratios: {format: ratio}}``, the ratios
    defaulting to :data:`DEFAULT_COMPRESSED_RATIOS`); None where ``spec`` is None (the raw tier)."""
    if spec is None:
        return None
    unknown = sorted(set(spec) - {"decode_gb_s", "ratios"})
    if unknown or "decode_gb_s" not in spec:
        raise CacheError(f"cache.compressed_tier: keys decode_gb_s (required) and ratios, got {sorted(spec)}")
    try:
        fmt = get_weight_format(weight_format).name
        given = spec.get("ratios") or DEFAULT_COMPRESSED_RATIOS
        ratios = {get_weight_format(k).name: float(v) for k, v in given.items()}
    except ShapeError as e:
        raise CacheError(f"cache.compressed_tier.ratios: {e}") from None
    if fmt not in ratios:
        raise CacheError(f"cache.compressed_tier.ratios: no ratio for the experts' format {fmt!r} (given: "
                         f"{', '.join(sorted(ratios))})")
    ratio, decode = ratios[fmt], float(spec["decode_gb_s"])
    if not (ratio > 0 and decode > 0):
        raise CacheError(f"cache.compressed_tier: the ratio of {fmt} and decode_gb_s must be > 0, got {ratio}, "
                         f"{decode}")
    return ratio, decode


def with_compressed_tier(model: TimeModel, tier: tuple[float, float]) -> TimeModel:
    """``model`` with slot fills from the compressed host tier ``(compressed_ratio, decode_gb_s)``."""
    return replace(model, compressed_ratio=float(tier[0]), decode_gb_s=float(tier[1]))
