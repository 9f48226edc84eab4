"""The ``cache`` stage: the cache policies replayed on a trace's held-out decode routing.

:func:`run_cache` writes ``results/cache/{model}/simulation.csv`` (:data:`SIMULATION_COLUMNS` +
:data:`TIME_COLUMNS`, one row per policy, residency and batch size: :func:`simulation_table`) and
the figure ``locality.png`` (:mod:`coldset.analysis.locality_figure`); :func:`read_simulation`
reads the table back. The pieces: :mod:`coldset.analysis.streams` (what is replayed),
:mod:`coldset.analysis.simulate` (the replay and its rules), :mod:`coldset.analysis.policies`
(one file per policy, the registry), :mod:`coldset.analysis.time_model` (the simulated time).

The command ``python -m coldset.analysis.cache TRACE ...`` (:func:`main`) prints the same table for
any trace, with other profile and replay selections, batch sizes and time models, and with
``--recall`` the next-token forecast's quality per horizon (:func:`recall_table`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np
import pandas as pd

from coldset.analysis.forecast import (
    DEFAULT_TERMS,
    DEFAULT_WEIGHTS,
    ForecastError,
    LOWER_LAYER_TERMS,
    LOWER_LAYER_WEIGHTS,
    NextTokenForecaster,
    TransitionForecaster,
    conditional_ceiling,
    forecast_quality,
    forecast_recall,
    nexttoken_lists,
    stream_predictions,
    validation_split,
)
from coldset.analysis.locality_figure import figure_locality
from coldset.analysis.placement import expert_bytes
from coldset.analysis.policies import POLICIES, REGISTRY
from coldset.analysis.profile import profile_counts, read_histogram
from coldset.analysis.simulate import capacity_for_residency, simulate
from coldset.analysis.streams import AccessStream, CacheError, DecodeTokens, Lanes, read_decode_tokens
from coldset.analysis.time_model import (
    DEFAULT_TIME,
    LINK_MODES,
    TimeModel,
    compressed_tier,
    simulate_time,
    time_models,
    with_compressed_tier,
)
from coldset.core.files import atomic_path
from coldset.core.placement import ProfileSpec
from coldset.core.shapes import as_shape
from coldset.core.trace import TraceError

log = logging.getLogger(__name__)

SIMULATION_COLUMNS = ("policy", "residency", "capacity", "accesses", "tokens", "hit_rate",
                      "misses_per_token", "link_gb_per_token")
#: The batch the replay steps, the prefetches, and the simulated time
#: (:func:`coldset.analysis.time_model.simulate_time`).
TIME_COLUMNS = ("batch", "prefetches_per_token", "prefetch_precision", "step_ms", "bound_ms", "bound_fraction",
                "overlap", "stall_ms_per_token", "wasted_gb_per_token")


def simulation_rows(stream: AccessStream, policy: str, residency: float, capacity: int, profile_counts: np.ndarray,
                    lists: np.ndarray | None, bytes_per_expert: int,
                    time_model: TimeModel | Mapping[str, TimeModel] | None, batch: int,
                    prefetch_budget: int | None, compressed: tuple[float, float] | None = None) -> list[dict[str, Any]]:
    """:func:`simulation_table`'s rows of ``policy`` replayed on ``stream`` at ``capacity`` slots
    (``lists``: its prefetch lists, if it replays any), timed by its time model: one row, or with
    ``compressed`` the raw tier's and then the compressed tier's (the same replay re-timed)."""
    model = time_model if isinstance(time_model, TimeModel) or time_model is None else time_model[policy]
    rules = REGISTRY[policy]
    lead = model.lead_unit(stream.num_moe_layers) if model is not None and rules.gated else None
    res = simulate(stream, policy, capacity, profile_counts, predictions=lists,
                   prefetch_budget=prefetch_budget if rules.budget else None, lead_unit=lead,
                   record_victims=compressed is not None)
    st = res.stats()
    row = {"policy": policy, "residency": float(residency), "batch": int(batch), "capacity": capacity,
           "accesses": st.accesses, "tokens": st.tokens, "hit_rate": st.hit_rate,
           "misses_per_token": st.misses_per_token, "link_gb_per_token": st.link_gb_per_token(bytes_per_expert),
           "prefetches_per_token": st.prefetches / st.tokens if st.tokens else float("nan"),
           "prefetch_precision": st.useful_prefetches / st.prefetches if st.prefetches else float("nan")}
    rows = [row]
    if model is not None:
        models = [model] + ([with_compressed_tier(model, compressed)] if compressed is not None else [])
        rows = []
        for m in models:
            ts = simulate_time(stream, res, m)
            rows.append({**row, "step_ms": ts.step_ms, "bound_ms": ts.bound_ms, "bound_fraction": ts.bound_fraction,
                         "overlap": ts.overlap, "stall_ms_per_token": ts.stall_ms_per_token,
                         "wasted_gb_per_token": ts.wasted_gb_per_token,
                         **({"host_tier": "compressed" if m.compressed else "raw",
                             "link_gb_per_token": ts.link_gb_per_token} if compressed is not None else {})})
    return rows


def simulation_table(stream: AccessStream, profile_counts: np.ndarray, policies: Sequence[str],
                     residencies: Sequence[float], bytes_per_expert: int, forecaster: Any = None, *,
                     lanes: Lanes | None = None, nexttoken: Any = None,
                     time_model: TimeModel | Mapping[str, TimeModel] | None = None,
                     batch: int = 1, prefetch_budget: int | None = None,
                     compressed: tuple[float, float] | None = None) -> pd.DataFrame:
    """The ``simulation.csv`` frame of one batch size: one row per (policy, residency) in the given
    orders; with ``compressed`` (``(compressed_ratio, decode_gb_s)``,
    :func:`coldset.analysis.time_model.compressed_tier`; needs ``time_model``) two, column
    ``host_tier`` ``raw`` then ``compressed``: the same replay (hits, misses) timed with slot fills
    from the raw and from the compressed host tier (:class:`coldset.analysis.time_model.TimeModel`),
    ``link_gb_per_token`` the bytes each moves. ``forecaster`` (a
    :class:`coldset.analysis.forecast.TransitionForecaster`) is required by
    ``forecast``; ``nexttoken`` (a :class:`coldset.analysis.forecast.NextTokenForecaster`) and ``lanes``
    (the stream's tokens per lane, ``stream == lanes.stream()``) by ``nexttoken``. With
    ``time_model`` (its ``step_ms`` the all-HBM step at ``batch``; or one per policy,
    :func:`coldset.analysis.time_model.time_models`' form, each with the policy's own ``manage_ms``)
    the time columns are filled (:func:`coldset.analysis.time_model.simulate_time`), else NaN; its
    link and compute terms also set the gated policies' prefetch gate
    (:meth:`coldset.analysis.time_model.TimeModel.lead_unit`; without a model the default)."""
    if "forecast" in policies and forecaster is None:
        raise CacheError("policy 'forecast' needs a forecaster fitted on the profile selection")
    if compressed is not None and time_model is None:
        raise CacheError("the compressed host tier's rows are timed: give a time model (bytes per expert)")
    if "nexttoken" in policies and (nexttoken is None or lanes is None):
        raise CacheError("policy 'nexttoken' needs a NextTokenForecaster fitted on the profile selection and the "
                         "replay's lanes")
    caps = [capacity_for_residency(r, stream.num_moe_layers, stream.num_experts) for r in residencies]
    fits = [[p for p in policies if cap >= stream.max_group or not REGISTRY[p].holds_group] for cap in caps]
    for r, cap, fit in zip(residencies, caps, fits):
        if len(fit) < len(policies):
            msg = (f"residency {r}: a pool of {cap} slots cannot hold one step's {stream.max_group} selections at "
                   f"batch {batch} (top_k x batch)")
            if batch == 1:
                raise CacheError(f"{msg}; raise the residency")
            # A larger batch of cache.time.steps is an extra view of the same cache: a small model's pool
            # may not hold its step. Its cached rows are left out, said here and absent from the table.
            log.warning("%s: no %s rows at batch %d", msg, "/".join(p for p in policies if p not in fit), batch)
    rows = {}
    for p in policies:  # policy by policy: one policy's prefetch lists in memory at a time
        lists = None
        if p == "forecast":
            lists = stream_predictions(forecaster, stream)
        elif p == "nexttoken":
            lists = nexttoken_lists(nexttoken, lanes.sel, lanes.start)
        for i, r in enumerate(residencies):
            if p in fits[i]:
                rows[i, p] = simulation_rows(stream, p, r, caps[i], profile_counts, lists, bytes_per_expert,
                                             time_model, batch, prefetch_budget, compressed)
        del lists
    rows = [row for i in range(len(residencies)) for p in fits[i] for row in rows[i, p]]
    return pd.DataFrame(rows, columns=list(SIMULATION_COLUMNS + TIME_COLUMNS)
                        + (["host_tier"] if compressed is not None else []))


#: The policies a recommendation leaves out: belady knows the future.
NOT_RECOMMENDED = ("belady",)
RECOMMENDATION_COLUMNS = ("batch", "residency", "policy", "chosen", "chosen_on", "step_ms", "lru_step_ms",
                          "vs_lru", "verdict")


def recommendation(heldout: pd.DataFrame, choice: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per (batch, residency) of ``heldout`` (:func:`simulation_table` rows with the time columns) the
    policy to use, by simulated time (``step_ms``), not hit rate: chosen on ``choice`` (the same
    table on tokens the forecasters were fitted on: the profile's validation requests; None: on
    ``heldout`` itself, said in ``chosen_on``), then checked on ``heldout``: where the chosen
    policy's held-out step exceeds lru's at all, the verdict says so and the recommendation is lru,
    so a recommendation is never slower than lru on the held-out split. ``vs_lru`` = the
    recommended policy's held-out step / lru's. Empty without time columns or an lru row."""
    rows = []
    if "step_ms" not in heldout or heldout["step_ms"].isna().all():
        return pd.DataFrame(rows, columns=list(RECOMMENDATION_COLUMNS))
    for (batch, res), part in heldout.groupby(["batch", "residency"], sort=True):
        steps = part.dropna(subset=["step_ms"]).set_index("policy")["step_ms"]
        if "lru" not in steps:
            continue
        pick = choice[(choice.batch == batch) & (choice.residency == res)] if choice is not None else part
        cand = pick.dropna(subset=["step_ms"])
        cand = cand[~cand.policy.isin(NOT_RECOMMENDED) & cand.policy.isin(steps.index)]
        # the fastest; on a tie lru (the plainest) first
        chosen = str(min(zip(cand.step_ms, cand.policy != "lru", cand.policy))[2]) if len(cand) else "lru"
        lru = float(steps["lru"])
        step = float(steps[chosen])
        if step > lru:
            verdict, policy = f"{chosen} slower than lru on the held-out split ({step / lru:.4f}x): lru", "lru"
        else:
            verdict, policy = ("faster than lru" if step < lru else "as lru" if chosen == "lru"
                               else "as fast as lru"), chosen
        rows.append({"batch": int(batch), "residency": float(res), "policy": policy, "chosen": chosen,
                     "chosen_on": "validation" if choice is not None else "heldout",
                     "step_ms": float(steps[policy]), "lru_step_ms": lru, "vs_lru": float(steps[policy]) / lru,
                     "verdict": verdict})
    return pd.DataFrame(rows, columns=list(RECOMMENDATION_COLUMNS))


def validation_part(profile: DecodeTokens) -> DecodeTokens | None:
    """The profile's validation requests (every 5th, :func:`coldset.analysis.forecast.validation_split`,
    as the next-token forecaster is tuned), where a recommendation is chosen; None where that leaves
    no tokens or every token."""
    if profile.tokens == 0:
        return None
    val = validation_split(profile.request.astype(np.int64))
    return profile.take(val) if val.any() and not val.all() else None


def run_cache(trace_path: str | os.PathLike, histogram_csv: str | os.PathLike, model_config: Any,
              out_dir: str | os.PathLike, policies: Sequence[str] = POLICIES,
              residencies: Sequence[float] = (0.25, 0.5, 0.75, 1.0), profile_domains: Any = None, *,
              phase: str = "decode", domain_weights: Any = None, weight_format: str | None = None,
              heldout_fraction: float = 0.25, locality_json: str | os.PathLike | None = None,
              figures: bool = True, time: Mapping[str, Any] | None = None,
              prefetch_budget: int | None = None, nexttoken_extra: int = 3,
              compressed: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """The ``cache`` stage: ``simulation.csv`` (:data:`SIMULATION_COLUMNS` + :data:`TIME_COLUMNS`),
    ``recommendation.csv`` (:func:`recommendation`: chosen by simulated time on the profile's
    validation requests, checked against lru on the held-out split) and ``locality.png``.

    Warm pool = the ``usage_global`` hot set the placement stage chooses from the same histogram
    and profile (:func:`coldset.analysis.profile.profile_counts` with ``profile_domains``,
    ``phase``, ``domain_weights``); replay = the held-out split's decode rows of every domain, at
    each batch size of ``time["steps"]`` (requests laid out in lanes,
    :func:`coldset.analysis.streams.lanes_from_frame`), timed by
    :func:`coldset.analysis.time_model.simulate_time` with that batch's all-HBM step (``time``: the
    config's ``cache.time``).
    Link bytes use placement's byte model (:func:`coldset.analysis.placement.expert_bytes` in
    ``weight_format``, by default the model's own expert format, as the placement stage does).
    The forecasters (``forecast``, ``nexttoken``) are fitted on the profile selection's decode rows.
    The figure shows the locality statistic of ``locality_json`` (stats stage) beside the hit rates
    and the simulated time. ``compressed`` (the config's ``cache.compressed_tier``,
    :func:`coldset.analysis.time_model.compressed_tier`; None: off) adds the compressed host tier's
    rows (:func:`simulation_table`, column ``host_tier``); the recommendation and the figure read
    the raw tier's.
    """
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise CacheError(f"cache.policies: unknown {unknown}; known {list(POLICIES)}")
    rows, meta = read_decode_tokens(trace_path, heldout_fraction, expect=model_config)
    L, E = meta.num_moe_layers, meta.num_experts
    spec = ProfileSpec.make(profile_domains, phase, domain_weights)
    counts = profile_counts(read_histogram(histogram_csv), meta.moe_layers, E, spec)
    replay = rows.select("heldout")
    if replay.tokens == 0:
        raise CacheError(f"{trace_path}: the held-out split has no decode rows to replay")
    profile = rows.select("profile", spec.domains)
    per_expert = expert_bytes(model_config, weight_format)
    tier = compressed_tier(compressed, weight_format or as_shape(model_config).expert_format)
    forecaster = nexttoken = None
    if "forecast" in policies:
        forecaster = TransitionForecaster.fit(profile, L, E, meta.top_k)
    if "nexttoken" in policies:
        tokens, seq = profile.token_array()
        nexttoken = NextTokenForecaster.fit_tuned(tokens, seq, meta.top_k, E, extra=nexttoken_extra)
    val = validation_part(profile)
    tables, choices = [], []
    for batch, models in time_models(time, per_expert).items():
        for part, out_tables in ((replay, tables), (val, choices)):
            if part is None:
                continue
            lanes = part.lanes(batch)
            out_tables.append(simulation_table(lanes.stream(), counts, policies, residencies, per_expert, forecaster,
                                               lanes=lanes, nexttoken=nexttoken, time_model=models, batch=batch,
                                               prefetch_budget=prefetch_budget, compressed=tier))
    table = pd.concat(tables, ignore_index=True)
    raw, raw_choices = raw_tier(table), raw_tier(pd.concat(choices, ignore_index=True)) if choices else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"simulation": out / "simulation.csv", "recommendation": out / "recommendation.csv"}
    with atomic_path(paths["simulation"]) as tmp:
        table.to_csv(tmp, index=False)
    with atomic_path(paths["recommendation"]) as tmp:
        recommendation(raw, raw_choices).to_csv(tmp, index=False)
    if figures:
        locality = json.loads(Path(locality_json).read_text()) if locality_json else None
        paths["figure"] = out / "locality.png"
        figure_locality(raw, locality, meta, paths["figure"])
    return paths


def raw_tier(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``table`` timed with the raw host tier (all of them without a ``host_tier`` column)."""
    return table[table["host_tier"] == "raw"].reset_index(drop=True) if "host_tier" in table else table


def read_simulation(path: str | os.PathLike) -> pd.DataFrame:
    """Read and check ``simulation.csv`` (columns, policies, rates in [0, 1])."""
    path = Path(path)
    if not path.is_file():
        raise CacheError(f"{path}: cache simulation file not found")
    df = pd.read_csv(path)
    missing = [c for c in SIMULATION_COLUMNS if c not in df.columns]
    if missing:
        raise CacheError(f"{path}: missing column(s) {missing}; expected {list(SIMULATION_COLUMNS)}")
    bad = sorted(set(df["policy"]) - set(POLICIES))
    if bad:
        raise CacheError(f"{path}: unknown policy name(s) {bad}")
    rates = df["hit_rate"].to_numpy(dtype=float)
    if not np.all((rates >= 0) & (rates <= 1)):
        raise CacheError(f"{path}: hit_rate outside [0, 1]")
    # the time columns are optional: a file without them still reads
    for col in ("step_ms", "bound_ms", "stall_ms_per_token", "wasted_gb_per_token"):
        if col in df.columns:
            vals = df[col].to_numpy(dtype=float)
            if (vals[~np.isnan(vals)] < 0).any():
                raise CacheError(f"{path}: {col} must be >= 0")
    if "batch" in df.columns and (df["batch"].to_numpy() < 1).any():
        raise CacheError(f"{path}: batch must be >= 1")
    return df


#: The share of pairs whose context occurs more than once below which the recall table leaves the
#: in-sample bound out (NaN): mostly contexts seen once, it measures memorisation.
MIN_REPEATED_SHARE = 0.5


def in_sample_bound(ceiling: Mapping[str, Any]) -> float:
    """:func:`coldset.analysis.forecast.conditional_ceiling`'s in-sample recall, or NaN where fewer than
    :data:`MIN_REPEATED_SHARE` of its pairs have a context seen more than once."""
    return float(ceiling["ceiling_recall"]) if ceiling["repeated_share"] >= MIN_REPEATED_SHARE else float("nan")


def tuning_note(sequence: np.ndarray, validation: np.ndarray | None, tuned_on: str | None = None) -> str:
    """What chose :meth:`coldset.analysis.forecast.NextTokenForecaster.fit_tuned`'s parameters on
    profile tokens of ``sequence`` (their request numbers) with ``validation`` (None: every 5th
    request): ``tuned_on`` (default "every 5th profile request") with the requests counted, or
    "not tuned" and why."""
    val = validation_split(sequence, 5, validation)
    n_req = int(np.unique(sequence).size)
    n_val = int(np.unique(np.asarray(sequence)[val]).size)
    if not val.any() or val.all():
        return (f"not tuned: {n_val} of {n_req} profile request(s) set aside for validation, "
                "the default parameters")
    return f"{tuned_on or 'every 5th profile request'} ({n_val} of {n_req} profile requests)"


#: Tokens :func:`previous_token_recall` compares at once.
PREVIOUS_CHUNK = 1 << 16


def previous_token_recall(tokens: np.ndarray, sequence: np.ndarray, horizon: int) -> float:
    """The recall of the forecast "a token selects what the token ``horizon`` before it in its
    sequence did" on ``tokens`` ``[T, L, k]``: the share of the later token's selections among the
    earlier one's (NaN without such pairs), :data:`PREVIOUS_CHUNK` tokens at a time."""
    T = tokens.shape[0]
    inside = total = 0
    for c in range(0, max(T - horizon, 0), PREVIOUS_CHUNK):
        e = min(c + PREVIOUS_CHUNK, T - horizon)
        same = sequence[c + horizon:e + horizon] == sequence[c:e]
        later, earlier = tokens[c + horizon:e + horizon][same], tokens[c:e][same]
        inside += int((later[..., :, None] == earlier[..., None, :]).any(-1).sum())
        total += later.size
    return inside / total if total else float("nan")


def recall_table(profile: DecodeTokens, replay: DecodeTokens, num_moe_layers: int, num_experts: int, top_k: int,
                 horizons: Sequence[int] = (1, 2, 4, 8), extra: int = 3,
                 budget: int | None = None, term_sets=None, ceiling_lower_layers: int = 0) -> pd.DataFrame:
    """The next-token forecast's quality per horizon: the :class:`coldset.analysis.forecast.NextTokenForecaster`
    fitted (and tuned) on ``profile`` for each horizon, measured on ``replay``: recall and
    precision at ``top_k + extra`` candidates and at ``top_k`` (and at ``budget``), beside the
    transition table of the current token alone (the ``forecast`` policy's forecaster), the previous-token
    baseline and the in-sample bound of any function of the current token's experts
    (:func:`coldset.analysis.forecast.conditional_ceiling`, fitted and measured on the replay's own
    tokens), with the forecaster's cost. The bound is NaN unless at least :data:`MIN_REPEATED_SHARE`
    of the pairs have a context seen more than once (else it is memorisation: a context seen once is
    predicted perfectly); ``repeated_context_share`` says the share. ``tuned_on`` says which profile
    tokens chose the forecaster's parameters, or that none did (too few profile requests: defaults).
    ``term_sets``: as :meth:`~coldset.analysis.forecast.NextTokenForecaster.fit_tuned` (chosen on the
    profile's validation part); ``ceiling_lower_layers`` = m > 0 adds the in-sample bound of any
    function of the current token's experts in layers l..l-m (column
    ``in_sample_bound_current_and_lower_layers``, the same rule)."""
    L, E = num_moe_layers, num_experts
    tp, sp = profile.token_array()
    th, sh = replay.token_array()
    n = min(top_k + extra, E)
    # a replay of domains the profile lacks (a held-out subject): tune on a held-out profile domain too
    validation, tuned_on = None, None
    prof_domains = profile.domains
    if len(prof_domains) > 1 and not set(replay.domains) & set(prof_domains):
        validation = profile.domain_names[profile.domain] == prof_domains[-1]
        tuned_on = f"profile domain {prof_domains[-1]!r}"
    tuned_on = tuning_note(sp, validation, tuned_on)
    sizes = tuple(sorted({top_k} | ({int(budget)} if budget else set())))
    out = []
    for h in horizons:
        t0 = perf_counter()
        f = NextTokenForecaster.fit_tuned(tp, sp, top_k, E, horizon=h, extra=extra, validation=validation,
                                          term_sets=term_sets)
        fit_s = perf_counter() - t0
        t0 = perf_counter()
        q = forecast_quality(f, th, sh, sizes)
        per_token_us = (perf_counter() - t0) / max(th.shape[0], 1) * 1e6
        cur = NextTokenForecaster.fit(tp, sp, top_k, E, horizon=h, extra=extra, terms=((0, 0),), weights=(1.0,),
                                      hist_beta=0.0)
        qc = forecast_quality(cur, th, sh)
        prev_recall = previous_token_recall(th, sh, h)
        ceil = conditional_ceiling(th, sh, h, n)
        if ceiling_lower_layers > 0:
            wide = conditional_ceiling(th, sh, h, n, lower_layers=ceiling_lower_layers)
        ops = f.ops_per_step(1)
        row = {"horizon": h, "candidates": n, "recall": q["recall"], "precision": q["precision"]}
        for m in sizes:
            row[f"recall_at_{m}"] = q[f"recall_at_{m}"]
            row[f"precision_at_{m}"] = q[f"precision_at_{m}"]
        row.update({"recall_current_table_only": qc["recall"], "recall_previous_token": prev_recall,
                    "in_sample_bound_current_experts": in_sample_bound(ceil),
                    "repeated_context_share": ceil["repeated_share"], "popularity_recall": ceil["popularity_recall"],
                    **({"in_sample_bound_current_and_lower_layers": in_sample_bound(wide),
                        "repeated_context_share_lower": wide["repeated_share"],
                        "ceiling_lower_layers": ceiling_lower_layers, "contexts_current": ceil["contexts"],
                        "contexts_current_and_lower": wide["contexts"]} if ceiling_lower_layers > 0 else {}),
                    "hist_beta": f.hist_unit / 65536, "hist_shift": f.hist_shift,
                    "self_boost": f.self_boost, "tuned_on": tuned_on,
                    "terms": str(list(f.terms)),
                    "table_mb": f.nbytes / 1e6, "state_bytes_per_sequence": 4 * L * E,
                    "table_bytes_read_per_step_b1": ops["bytes_read"], "int_adds_per_step_b1": ops["int_adds"],
                    "cpu_us_per_token": per_token_us, "fit_s": fit_s, "pairs": q["pairs"]})
        out.append(row)
    return pd.DataFrame(out)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m coldset.analysis.cache TRACE ...``: the simulation table of any trace, printed as CSV."""
    ap = argparse.ArgumentParser(prog="python -m coldset.analysis.cache", description=(
        "Replay a trace's decode routing through the cache policies (warm from usage_global on the profile "
        "selection, replay the held-out selection) and print simulation.csv's rows."))
    ap.add_argument("trace")
    ap.add_argument("--profile-domains", nargs="+",
                    help="profile = these domains, every request (default: profile split)")
    ap.add_argument("--replay-domains", nargs="+",
                    help="replay = these domains, every request (default: heldout split)")
    ap.add_argument("--heldout-fraction", type=float, default=0.25, help="hash split for traces without a split column")
    ap.add_argument("--residency", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--bytes-per-expert", type=int, help="for link_gb_per_token and the time columns (NaN without it)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="replay batch sizes (requests in lanes)")
    ap.add_argument("--step-ms", type=float, nargs="+",
                    help="the all-HBM step (ms) at each --batch (default: the H200 figures, 2.56 at b1, 5.76 at b8)")
    ap.add_argument("--link-gb-s", type=float, default=DEFAULT_TIME["link_gb_s"])
    ap.add_argument("--head-share", type=float, default=DEFAULT_TIME["head_share"])
    ap.add_argument("--router-share", type=float, default=DEFAULT_TIME["router_share"])
    ap.add_argument("--link", choices=LINK_MODES, default=DEFAULT_TIME["link"],
                    help="demand vs prefetch copies on the link (TimeModel.link)")
    ap.add_argument("--demand-share", type=float, default=DEFAULT_TIME["demand_share"])
    ap.add_argument("--join", choices=("use", "step"), default=DEFAULT_TIME["join"])
    ap.add_argument("--compressed-ratio", type=float,
                    help="also time slot fills from a compressed host tier of this compressed / raw bytes ratio "
                         "(rows host_tier=compressed beside the raw ones; needs --decode-gb-s and --bytes-per-expert)")
    ap.add_argument("--decode-gb-s", type=float, help="the compressed tier's decode rate (raw GB/s out)")
    ap.add_argument("--prefetch-budget", type=int, help="nexttoken: copies per group (default: no cut)")
    ap.add_argument("--nexttoken-extra", type=int, default=3,
                    help="nexttoken: candidates per token beyond top_k (the predicted set and the prefetch list)")
    ap.add_argument("--recall", action="store_true",
                    help="print the next-token forecast's recall / precision table per horizon to stderr (CSV), "
                         "and the transition forecaster's one-token recall (JSON)")
    ap.add_argument("--horizons", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--lower-layer-terms", action="store_true",
                    help="nexttoken: also try the current token's two lower layers as forecast terms "
                         "(coldset.analysis.forecast.LOWER_LAYER_TERMS), chosen or not on the profile's "
                         "validation part")
    ap.add_argument("--ceiling-lower-layers", type=int, default=0,
                    help="--recall: also the in-sample bound of any function of the current token's experts in "
                         "layers l..l-N (printed where the contexts repeat, as the one of layer l)")
    args = ap.parse_args(argv)
    steps = args.step_ms or [next((s["all_hbm_step_ms"] for s in DEFAULT_TIME["steps"] if s["batch"] == b), None)
                             for b in args.batch]
    if len(steps) != len(args.batch) or any(s is None for s in steps):
        ap.error("--step-ms: one all-HBM step per --batch (defaults exist for batch 1 and 8 only)")
    if (args.compressed_ratio is None) != (args.decode_gb_s is None) or (
            args.compressed_ratio is not None and not args.bytes_per_expert):
        ap.error("--compressed-ratio and --decode-gb-s go together, with --bytes-per-expert")
    try:
        return print_tables(args, steps)
    except (CacheError, ForecastError, TraceError) as err:
        print(f"{ap.prog}: error: {err}", file=sys.stderr)
        return 2


def decode_selections(args: argparse.Namespace) -> tuple[DecodeTokens, DecodeTokens, Any]:
    """The command's profile and replay rows and the trace's meta; a :class:`CacheError` saying why
    and what to do when either selection has no decode rows (a prefill-only trace: the policies
    replay decode routing, one token after another)."""
    rows, meta = read_decode_tokens(args.trace, args.heldout_fraction)
    if rows.tokens == 0:
        raise CacheError(f"{args.trace}: the trace has no decode rows (prefill only?): the cache policies replay "
                         "decode routing token by token; capture decode routing (generate new tokens) and retry")
    profile = rows.select(None, args.profile_domains) if args.profile_domains else rows.select("profile")
    replay = rows.select(None, args.replay_domains) if args.replay_domains else rows.select("heldout")
    for name, part, flag in (("profile", profile, "--profile-domains"), ("replay", replay, "--replay-domains")):
        if part.tokens == 0:
            raise CacheError(f"{args.trace}: the {name} selection has no decode rows (its split is empty); "
                             f"choose it with {flag}")
    return profile, replay, meta


def print_tables(args: argparse.Namespace, steps: Sequence[float]) -> int:
    """The command's work after parsing: the forecasters fitted on the profile selection, the
    ``--recall`` tables to stderr, the simulation table to stdout."""
    term_sets = None
    if args.lower_layer_terms:
        term_sets = ((DEFAULT_TERMS, DEFAULT_WEIGHTS), (LOWER_LAYER_TERMS, LOWER_LAYER_WEIGHTS))
    profile, replay, meta = decode_selections(args)
    L, E = meta.num_moe_layers, meta.num_experts
    forecaster = nexttoken = None
    if "forecast" in args.policies or args.recall:
        t0 = perf_counter()
        forecaster = TransitionForecaster.fit(profile, L, E, meta.top_k)
        fit_s = perf_counter() - t0
        if args.recall:
            stream = replay.stream()
            t0 = perf_counter()
            stream_predictions(forecaster, stream)
            per_token = (perf_counter() - t0) / max(stream.tokens, 1)
            del stream
            print(json.dumps({**forecast_recall(forecaster, replay, L, E), "fit_s": round(fit_s, 3),
                              "forecast_us_per_token": round(per_token * 1e6, 1)}), file=sys.stderr)
            table = recall_table(profile, replay, L, E, meta.top_k, args.horizons, budget=args.prefetch_budget,
                                 term_sets=term_sets, ceiling_lower_layers=args.ceiling_lower_layers)
            print(table.to_csv(index=False, float_format="%.4g"), end="", file=sys.stderr)
    if "nexttoken" in args.policies:
        tokens, seq = profile.token_array()
        nexttoken = NextTokenForecaster.fit_tuned(tokens, seq, meta.top_k, E, extra=args.nexttoken_extra,
                                                  term_sets=term_sets)
        print(f"nexttoken forecaster: terms {list(nexttoken.terms)}, hist_unit {nexttoken.hist_unit}, hist_shift "
              f"{nexttoken.hist_shift}, self_boost {nexttoken.self_boost}, n {nexttoken.n}, tuned on "
              f"{tuning_note(seq, None)}", file=sys.stderr)
        del tokens, seq
    val = validation_part(profile) if args.bytes_per_expert else None
    counts = profile.counts()
    del profile  # the fits are done: the profile's tokens are not kept through the replays
    tables, choices = [], []
    tier = None if args.compressed_ratio is None else (args.compressed_ratio, args.decode_gb_s)
    for batch, step_ms in zip(args.batch, steps):
        model = None
        if args.bytes_per_expert:
            model = TimeModel(step_ms, args.bytes_per_expert, args.link_gb_s, args.head_share, args.router_share,
                              args.link, args.join, args.demand_share)
        for part, out_tables in ((replay, tables), (val, choices)):
            if part is None:
                continue
            lanes = part.lanes(batch)
            out_tables.append(simulation_table(lanes.stream(), counts, args.policies,
                                               args.residency, args.bytes_per_expert or 0, forecaster, lanes=lanes,
                                               nexttoken=nexttoken, time_model=model, batch=batch,
                                               prefetch_budget=args.prefetch_budget, compressed=tier))
    table = pd.concat(tables, ignore_index=True)
    if not args.bytes_per_expert:
        table["link_gb_per_token"] = float("nan")
    print(table.to_csv(index=False, float_format="%.6g"), end="")
    if args.bytes_per_expert:
        rec = recommendation(raw_tier(table), raw_tier(pd.concat(choices, ignore_index=True)) if choices else None)
        print("recommendation (by simulated time; chosen on the profile's validation requests, checked against "
              "lru on the replay):", file=sys.stderr)
        print(rec.to_csv(index=False, float_format="%.4g"), end="", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

