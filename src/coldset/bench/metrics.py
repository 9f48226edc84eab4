"""The bench's derived metrics of one row: the speed model's prediction, the timed loop's token
match, and the time bound against the run's all-HBM row (``TIME_BOUND_METRICS``, docs/design.md §6),
shared by the workflow's bench (:func:`coldset.bench.decode.derive_metrics`) and ``python -m
coldset bench cache``.
"""

from __future__ import annotations

import numpy as np

from coldset.analysis.time_model import TimeModel, manage_ms_per_group, simulate_time
from coldset.core.placement import STATIC_POLICIES

# Weight bytes read per token and what coldset.bench.decode.derive_metrics makes of them with the read
# ceilings measured in the same run (CUDA only; hbm_gb_per_token is also filled on CPU when the
# router is not replayed): the bytes floor of a step, the measured step's fraction of it, and the
# additive model (predicted_step_ms_calibrated: the policy's measured all-HBM step + the cold bytes'
# extra link time, all from the same run: a check that link time adds, not an independent prediction).
BYTES_METRICS: tuple[str, ...] = (
    "hbm_gb_per_token",
    "bytes_step_ms",
    "fraction_of_bytes_bound",
    "predicted_step_ms_calibrated",
)
# The time bound of every row (coldset.bench.decode.derive_metrics, docs/design.md §6 "for caches
# also"): the all-HBM step of the same run, the bound max(all-HBM step, link time), the fraction of
# it reached, overlap, stall per token (measured step - all-HBM step, per token), for a cache row the
# time simulator's step on the pass's own decisions (coldset.analysis.time_model.simulate_time with the engine's
# time model at this run's all-HBM step and link rate) and its ratio to the measured step, with the
# policy's residency-1.0 row of the run the cache's management per (step, layer) group and the
# simulated step with it (coldset.analysis.time_model.TimeModel.manage_ms) and its ratio, wasted prefetch
# bytes per token (the simulator's replay of the measured pass). None where undefined: the
# time-derived ones on the CPU or for a noisy timing, the management ones without a sound
# residency-1.0 row apart from the all-HBM one, wasted bytes for static placements, and all in
# bench files without them.
TIME_BOUND_METRICS: tuple[str, ...] = (
    "allhbm_step_ms",
    "bound_ms",
    "bound_fraction",
    "overlap",
    "stall_ms_per_token",
    "simulated_step_ms",
    "simulated_over_measured",
    "manage_ms_per_group",
    "simulated_managed_step_ms",
    "simulated_managed_over_measured",
)


def timed_token_match(expected: list[list[int]], got: list[list[int]]) -> float:
    """Share of ``expected``'s tokens (per sequence, per position) that ``got`` reproduces; a
    sequence or token missing from ``got`` counts as differing."""
    total = sum(len(x) for x in expected)
    if total == 0 or len(got) != len(expected):
        return 0.0
    same = sum(a == b for x, y in zip(expected, got) for a, b in zip(x, y))
    return same / total


def speed_model_prediction(placement, batch_size: int):
    """(preset, perfect-overlap ms, no-overlap ms) of the speed model at this batch size (h200 first)."""
    for preset in dict.fromkeys(["h200", *(p.preset for p in placement.predictions)]):
        try:
            pred = placement.prediction(preset, batch_size)
        except KeyError:
            continue
        return preset, pred.step_s_lower * 1e3, pred.step_s_sum * 1e3
    return None, None, None


def allhbm_reference(records: list[dict], batch_size: int, policy: str) -> dict | None:
    """The run's all-HBM row at ``batch_size``: a static placement at residency 1.0 (every expert
    in HBM, no cache management; ``usage_global`` first, then the other static policies in
    :data:`coldset.core.placement.STATIC_POLICIES` order), else ``policy``'s own residency 1.0; None
    when the run has neither."""
    full = {r["policy"]: r for r in records if r["batch_size"] == batch_size and abs(r["residency"] - 1.0) < 1e-9}
    for p in ("usage_global", *STATIC_POLICIES, policy):
        if p in full:
            return full[p]
    return None


def time_bound(record: dict, reference: dict | None, link_gb_s: float | None, full: dict | None = None) -> dict:
    """:data:`TIME_BOUND_METRICS` of one bench row (see :func:`derive_metrics`) against the
    all-HBM row ``reference``, with the measured link read rate ``link_gb_s`` (GB/s) and, for a
    cache row, its policy's residency-1.0 row ``full`` at the same batch size (the management
    columns); all None when the reference or the rate is missing (the caller passes None where a
    timing is not sound), the management ones also without ``full`` or when ``full`` is the
    reference itself (no all-HBM row apart from the policy's own: its management is inside the
    reference step, so it cannot be told apart)."""
    if reference is None or not link_gb_s:
        return dict.fromkeys(TIME_BOUND_METRICS)
    return time_columns(record["step_ms_mean"], record["batch_size"], record["link_gb_per_token"],
                        reference["step_ms_mean"], link_gb_s, record.get("replays"),
                        None if full is None or full is reference else full["step_ms_mean"])


def time_columns(step_ms: float, batch_size: int, link_gb_per_token: float, allhbm_step_ms: float,
                 link_gb_s: float, replays: list | None = None, full_step_ms: float | None = None) -> dict:
    """A measured row's time columns (:data:`TIME_BOUND_METRICS`, defined in :func:`derive_metrics`):
    the one implementation both the workflow's bench (:func:`time_bound`) and ``python -m coldset
    bench cache`` (:mod:`coldset.measure.cache`, under its JSON names) use.

    ``step_ms`` is the row's measured step at ``batch_size`` tokens, ``allhbm_step_ms`` the same
    run's all-HBM step, ``link_gb_s`` the measured link read rate: bound, its fraction, overlap
    (None without link bytes) and stall per token. ``replays`` ((stream, result, bytes per expert)
    of a cache row's measured passes): ``simulated_step_ms``, the mean over them of
    :func:`coldset.analysis.time_model.simulate_time` with the engine's model (:data:`ENGINE_TIME`), and its
    ratio to ``step_ms``. ``full_step_ms`` (the same policy's residency-1.0 step, same run and
    batch: every selection hits, so its excess over all-HBM is the cache's own work) adds
    ``manage_ms_per_group`` (:func:`coldset.analysis.time_model.manage_ms_per_group` over the stream's MoE
    layers) and ``simulated_managed_step_ms`` / ``simulated_managed_over_measured``, the simulator
    with :attr:`coldset.analysis.time_model.TimeModel.manage_ms` (without it lookahead is simulated
    fast). Columns without their inputs are None."""
    out = dict.fromkeys(TIME_BOUND_METRICS)
    link_ms = 1e3 * link_gb_per_token * batch_size / link_gb_s  # per step
    bound = max(allhbm_step_ms, link_ms)
    out.update(allhbm_step_ms=allhbm_step_ms, bound_ms=bound, bound_fraction=bound / step_ms,
               overlap=1.0 - (step_ms - allhbm_step_ms) / link_ms if link_ms > 0 else None,
               stall_ms_per_token=(step_ms - allhbm_step_ms) / batch_size)
    if not replays:  # a static row: no decisions to simulate
        return out
    def simulated(manage_ms: float) -> float:
        return float(np.mean([simulate_time(stream, result, TimeModel(allhbm_step_ms, per_expert, link_gb_s,
                                                                      manage_ms=manage_ms, **ENGINE_TIME)).step_ms
                              for stream, result, per_expert in replays]))

    sim = simulated(0.0)
    out.update(simulated_step_ms=sim, simulated_over_measured=sim / step_ms)
    if full_step_ms is not None:
        layers = {stream.num_moe_layers for stream, _, _ in replays}
        if len(layers) != 1:
            raise ValueError(f"time_columns: the replays have different MoE layer counts {sorted(layers)}")
        manage = manage_ms_per_group(full_step_ms, allhbm_step_ms, layers.pop())
        managed = simulated(manage) if manage > 0 else sim
        out.update(manage_ms_per_group=manage, simulated_managed_step_ms=managed,
                   simulated_managed_over_measured=managed / step_ms)
    return out


#: How the engine's copies meet the compute (coldset.analysis.time_model.TimeModel): demand fills and side-path
#: prefetches share the link, every copy of a step is joined at the step's end.
ENGINE_TIME = {"link": "share", "join": "step"}
