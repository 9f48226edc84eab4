"""Routing skew statistics: how concentrated expert use is, and how well it transfers.

One streaming pass over a trace (:func:`scan_trace`, row group by row group, memory
proportional to the histogram plus the decode rows of the requests being read) produces

* the histogram: selections per (domain, split, phase, layer, expert), and
* the oracle per-token cache hits per (domain, layer), which need each request's order.

:func:`skew_stats` turns them into the statistics and :func:`run_stats` is the stage: it writes
``histogram.csv``, ``skew.json``, ``coverage.csv`` and the figures.

Definitions of the statistics: :mod:`coldset.analysis.skew`; the locality statistic:
:mod:`coldset.analysis.locality`; the figures: :mod:`coldset.analysis.stats_figures`.

Splits come from the trace's ``split`` column, or from :func:`coldset.core.trace.split_of` on the
request id when the trace has none.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
from tqdm import tqdm

from coldset.analysis.locality import locality_stats
from coldset.analysis.skew import (
    ALL,
    average_ranks,
    gini,
    json_number,
    layer_dict,
    nanmean,
    oracle_rows,
    spearman_rows,
    top_count,
    top_share,
)
from coldset.analysis.stats_figures import figure_heatmaps, figure_lorenz
from coldset.analysis.streams import trace_decode_rows
from coldset.core.files import atomic_path
from coldset.core.trace import (
    PHASES,
    SPLITS,
    TraceError,
    TraceMeta,
    iter_trace_batches,
    read_trace_meta,
    split_of,
    validate_trace,
)

DEFAULT_XS = (10, 25, 50, 73)
#: Decode rows gathered before the oracle cache simulation runs on finished requests.
_ORACLE_CHUNK_ROWS = 1_000_000
#: Rows per batch read by the streaming pass (bounds its working memory).
_SCAN_BATCH_ROWS = 1 << 18


@dataclass
class TraceScan:
    """What one pass over a trace yields."""

    meta: TraceMeta
    histogram: pd.DataFrame  # domain, split, phase, layer, expert, count
    oracle: pd.DataFrame | None  # domain, layer, hits, selections (decode)
    rows: int
    requests: int
    cached_prefix_rows_skipped: int
    split_source: str  # "column" or "hash"
    heldout_fraction: float
    counts: np.ndarray | None = None  # int64 [domain, split, phase, moe layer, expert]
    domains: list[str] | None = None  # names of counts' first axis


class _Codes:
    """String -> dense integer codes that stay stable across batches."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.names: list[str] = []

    def encode(self, column: pa.Array) -> np.ndarray:
        if not pa.types.is_dictionary(column.type):
            column = column.dictionary_encode()
        values = column.dictionary.cast(pa.string()).to_pylist()
        codes = np.empty(len(values), dtype=np.int64)
        for i, v in enumerate(values):
            c = self.index.get(v)
            if c is None:
                c = self.index[v] = len(self.names)
                self.names.append(v)
            codes[i] = c
        return codes[column.indices.to_numpy(zero_copy_only=False)]


def _decode_value_codes(column: pa.Array, allowed: Sequence[str]) -> np.ndarray:
    if not pa.types.is_dictionary(column.type):
        column = column.dictionary_encode()
    values = column.dictionary.cast(pa.string()).to_pylist()
    lut = np.array([allowed.index(v) if v in allowed else -1 for v in values], dtype=np.int64)
    return lut[column.indices.to_numpy(zero_copy_only=False)]


def _all_decode_rows(path: Path, requests: _Codes, lut: np.ndarray, batch_rows: int) -> list[tuple[np.ndarray, ...]]:
    """Every decode row of the trace as (request code, MoE layer index, position, rank, expert):
    the oracle's second pass when requests are not contiguous."""
    parts = []
    for batch in iter_trace_batches(path, ["request", "phase", "layer", "position", "rank", "expert"],
                                    validate=False, batch_rows=batch_rows):
        phase = _decode_value_codes(batch.column("phase"), PHASES)
        expert = batch.column("expert").to_numpy(zero_copy_only=False).astype(np.int64)
        dec = (phase == 1) & (expert >= 0)
        req = requests.encode(batch.column("request"))
        li = lut[batch.column("layer").to_numpy(zero_copy_only=False).astype(np.int64)]
        parts.append((req[dec], li[dec], batch.column("position").to_numpy(zero_copy_only=False)[dec].astype(np.int64),
                      batch.column("rank").to_numpy(zero_copy_only=False)[dec].astype(np.int64), expert[dec]))
    return parts


def _oracle_frame(oracle_parts: list[tuple[np.ndarray, ...]], req_domain: np.ndarray, domain_names: list[str],
                  meta: TraceMeta) -> pd.DataFrame:
    """The oracle cache's hits and decode selections per (domain, layer), from its per-request parts."""
    L = meta.num_moe_layers
    if oracle_parts:
        r, l, h, s = (np.concatenate([p[i] for p in oracle_parts]) for i in range(4))
    else:
        r = l = h = s = np.zeros(0, dtype=np.int64)
    d = req_domain[r]
    nd = len(domain_names)
    hits = np.bincount(d * L + l, weights=h, minlength=nd * L).reshape(nd, L)
    sels = np.bincount(d * L + l, weights=s, minlength=nd * L).reshape(nd, L)
    return pd.DataFrame({
        "domain": np.repeat(domain_names, L),
        "layer": np.tile(np.asarray(meta.moe_layers), nd),
        "hits": hits.ravel().astype(np.int64),
        "selections": sels.ravel().astype(np.int64),
    })


def scan_trace(trace_path: str | os.PathLike, heldout_fraction: float = 0.25, *, oracle: bool = True,
               cache_slots: int | None = None, expect: Any = None, progress: bool = True,
               batch_rows: int = _SCAN_BATCH_ROWS) -> TraceScan:
    """One streaming pass: the histogram and (if ``oracle``) the oracle cache hits.

    ``cache_slots`` defaults to 3 * top_k. The oracle needs each request's decode rows in
    order; they are gathered per request and simulated once the request's rows end (requests
    are contiguous in traces written by this package). If a request reappears after others,
    the oracle falls back, with a warning, to a second pass holding all decode rows at once
    (same result, more memory).
    """
    path = Path(trace_path)
    meta = validate_trace(path, expect)  # the one trace validator (rows and whole tokens)
    L, E, k = meta.num_moe_layers, meta.num_experts, meta.top_k
    slots = cache_slots if cache_slots is not None else 3 * k
    lut = np.full(max(meta.moe_layers) + 1, -1, dtype=np.int64)
    lut[meta.moe_layers] = np.arange(L)
    has_split = "split" in pq.read_schema(path).names
    columns = ["request", "domain", "position", "phase", "layer", "rank", "expert"] + (["split"] if has_split else [])
    domains, requests = _Codes(), _Codes()
    req_split: list[int] = []  # hash split per request code (no split column)
    req_domain = np.full(0, -1, dtype=np.int64)
    req_state = np.zeros(0, dtype=np.int8)  # 0 unseen, 1 open, 2 closed
    hist = np.zeros((0, 2, 2, L, E), dtype=np.int64)
    cached = 0
    rows = 0
    streaming = oracle
    buffer: list[tuple[np.ndarray, ...]] = []
    ready: list[tuple[np.ndarray, ...]] = []
    ready_rows = 0
    oracle_parts: list[tuple[np.ndarray, ...]] = []
    total_rows = pq.ParquetFile(path).metadata.num_rows
    bar = tqdm(total=total_rows, desc=f"stats {path.name}", file=sys.stderr, disable=not progress, unit="row",
               unit_scale=True)

    def run_oracle(parts: list[tuple[np.ndarray, ...]]) -> None:
        if not parts:
            return
        cols = [np.concatenate([p[i] for p in parts]) for i in range(5)]
        oracle_parts.append(oracle_rows(*cols, L, k, slots, requests.names, str(path)))

    for batch in iter_trace_batches(path, columns, validate=False, batch_rows=batch_rows):
        n = batch.num_rows
        rows += n
        dom = domains.encode(batch.column("domain"))
        req = requests.encode(batch.column("request"))
        n_req = len(requests.names)
        if req_domain.size < n_req:
            grow = n_req - req_domain.size
            req_domain = np.r_[req_domain, np.full(grow, -1, dtype=np.int64)]
            req_state = np.r_[req_state, np.zeros(grow, dtype=np.int8)]
        # a request belongs to one domain
        first = req_domain[req] < 0
        req_domain[req[first]] = dom[first]
        if (req_domain[req] != dom).any():
            i = int(np.flatnonzero(req_domain[req] != dom)[0])
            raise TraceError(f"{path}: request {requests.names[req[i]]!r} appears with domains "
                             f"{domains.names[req_domain[req[i]]]!r} and {domains.names[dom[i]]!r}")
        if has_split:
            split = _decode_value_codes(batch.column("split"), SPLITS)
        else:
            while len(req_split) < n_req:
                req_split.append(SPLITS.index(split_of(requests.names[len(req_split)], heldout_fraction)))
            split = np.asarray(req_split, dtype=np.int64)[req]
        phase = _decode_value_codes(batch.column("phase"), PHASES)
        li = lut[batch.column("layer").to_numpy(zero_copy_only=False).astype(np.int64)]
        expert = batch.column("expert").to_numpy(zero_copy_only=False).astype(np.int64)
        keep = expert >= 0
        cached += int(n - keep.sum())
        if len(domains.names) > hist.shape[0]:
            hist = np.concatenate([hist, np.zeros((len(domains.names) - hist.shape[0], 2, 2, L, E), np.int64)])
        key = (((dom * 2 + split) * 2 + phase) * L + li) * E + expert
        hist += np.bincount(key[keep], minlength=hist.size).reshape(hist.shape)
        if streaming:
            present = np.unique(req)
            if (req_state[present] == 2).any():
                again = requests.names[int(present[req_state[present] == 2][0])]
                warnings.warn(f"{path}: request {again!r} reappears after other requests; the oracle cache "
                              "falls back to a second pass that holds all decode rows in memory", stacklevel=2)
                streaming = False
                buffer.clear()
                ready.clear()
                ready_rows = 0
                oracle_parts.clear()
            else:
                dec = keep & (phase == 1)
                buffer.append((req[dec], li[dec],
                               batch.column("position").to_numpy(zero_copy_only=False)[dec].astype(np.int64),
                               batch.column("rank").to_numpy(zero_copy_only=False)[dec].astype(np.int64), expert[dec]))
                was_open = np.flatnonzero(req_state == 1)
                req_state[present] = 1
                closing = np.setdiff1d(was_open, present, assume_unique=True)
                if closing.size:
                    req_state[closing] = 2
                    allc = [np.concatenate([b[i] for b in buffer]) for i in range(5)]
                    m = np.isin(allc[0], closing)
                    ready.append(tuple(c[m] for c in allc))
                    ready_rows += int(m.sum())
                    buffer = [tuple(c[~m] for c in allc)]
                if ready_rows >= _ORACLE_CHUNK_ROWS:
                    run_oracle(ready)
                    ready, ready_rows = [], 0
        bar.update(n)
    bar.close()
    if oracle and streaming:
        run_oracle(ready + buffer)
    elif oracle:
        run_oracle(_all_decode_rows(path, requests, lut, batch_rows))

    histogram = _histogram_frame(hist, domains.names, meta)
    oracle_df = _oracle_frame(oracle_parts, req_domain, domains.names, meta) if oracle else None
    return TraceScan(meta, histogram, oracle_df, rows, len(requests.names), cached,
                     "column" if has_split else "hash", heldout_fraction, hist, list(domains.names))


def _histogram_frame(hist: np.ndarray, domain_names: list[str], meta: TraceMeta) -> pd.DataFrame:
    D, _, _, L, E = hist.shape
    idx = np.indices(hist.shape).reshape(5, -1)
    return pd.DataFrame({
        "domain": np.asarray(domain_names, dtype=object)[idx[0]] if D else np.zeros(0, dtype=object),
        "split": np.asarray(SPLITS, dtype=object)[idx[1]],
        "phase": np.asarray(PHASES, dtype=object)[idx[2]],
        "layer": np.asarray(meta.moe_layers, dtype=np.int64)[idx[3]],
        "expert": idx[4].astype(np.int64),
        "count": hist.ravel(),
    })


def histogram_from_trace(trace_path: str | os.PathLike, heldout_fraction: float = 0.25, *,
                         expect: Any = None, progress: bool = True) -> pd.DataFrame:
    """Selections per (domain, split, phase, layer, expert), zeros included, streaming the trace.

    Columns ``domain, split, phase, layer, expert, count``; ``layer`` is the model's layer index.
    """
    return scan_trace(trace_path, heldout_fraction, oracle=False, expect=expect, progress=progress).histogram


class _Hist:
    """Dense view of a histogram frame: counts[domain, split, phase, moe_layer_idx, expert]."""

    def __init__(self, counts: np.ndarray, domains: Sequence[str], meta: TraceMeta):
        self.meta = meta
        self.domains = list(domains)
        self.counts = counts
        self._all = counts.sum(axis=0)

    @classmethod
    def from_frame(cls, histogram: pd.DataFrame, meta: TraceMeta) -> "_Hist":
        missing = [c for c in ("domain", "split", "phase", "layer", "expert", "count") if c not in histogram.columns]
        if missing:
            raise ValueError(f"histogram lacks column(s) {missing}")
        L, E = meta.num_moe_layers, meta.num_experts
        domains = sorted(histogram["domain"].astype(str).unique().tolist())
        lut = np.full(max(meta.moe_layers) + 1, -1, dtype=np.int64)
        lut[meta.moe_layers] = np.arange(L)
        d = pd.Categorical(histogram["domain"].astype(str), categories=domains).codes.astype(np.int64)
        sp = pd.Categorical(histogram["split"], categories=list(SPLITS)).codes.astype(np.int64)
        ph = pd.Categorical(histogram["phase"], categories=list(PHASES)).codes.astype(np.int64)
        layer = histogram["layer"].to_numpy().astype(np.int64)
        e = histogram["expert"].to_numpy().astype(np.int64)
        for name, arr in (("split", sp), ("phase", ph)):
            if (arr < 0).any():
                raise ValueError(f"histogram column {name!r} holds a value outside "
                                 f"{SPLITS if name == 'split' else PHASES}")
        if ((layer < 0) | (layer >= lut.size)).any() or (lut[np.clip(layer, 0, lut.size - 1)] < 0).any():
            raise ValueError(f"histogram column 'layer' holds a layer outside the MoE layers {meta.moe_layers}")
        if ((e < 0) | (e >= E)).any():
            raise ValueError(f"histogram column 'expert' holds ids outside 0..{E - 1}")
        shape = (len(domains), 2, 2, L, E)
        flat = np.ravel_multi_index((d, sp, ph, lut[layer], e), shape)
        counts = np.bincount(flat, weights=histogram["count"].to_numpy().astype(np.float64),
                             minlength=int(np.prod(shape))).reshape(shape)
        return cls(np.rint(counts).astype(np.int64), domains, meta)

    def get(self, phase: str, domain: str = ALL, split: str | None = None) -> np.ndarray:
        c = self._all if domain == ALL else self.counts[self.domains.index(domain)]
        c = c.sum(axis=0) if split is None else c[SPLITS.index(split)]
        return c[PHASES.index(phase)]


def _rank_rows(counts: np.ndarray) -> np.ndarray:
    return np.stack([average_ranks(row) for row in counts])


def _spearman_layers(ranks_a: np.ndarray, ranks_b: np.ndarray, meta: TraceMeta) -> dict[str, Any]:
    per = spearman_rows(ranks_a, ranks_b)
    return {"mean": nanmean(per), "layers_defined": int(np.sum(~np.isnan(per))), "per_layer": layer_dict(meta, per)}


#: Pairwise tables (Spearman between domains, held-out coverage profile x held-out domain) grow
#: with the square of the domains (hundreds of domains: minutes and a skew.json of tens of MB), so
#: they keep the most selected domains only (stats.max_pairwise_domains in the config).
MAX_PAIRWISE_DOMAINS = 12


def pairwise_domains(h: "_Hist", max_domains: int = MAX_PAIRWISE_DOMAINS) -> list[str]:
    """The domains pairwise tables cover: the ``max_domains`` with the most selections (both
    phases; ties by name), in the histogram's order."""
    if len(h.domains) <= max_domains:
        return list(h.domains)
    totals = [(-int(h.counts[i].sum()), d) for i, d in enumerate(h.domains)]
    keep = {d for _, d in sorted(totals)[:max_domains]}
    return [d for d in h.domains if d in keep]


def coverage_table(histogram: pd.DataFrame, meta: TraceMeta, xs: Sequence[float] = DEFAULT_XS,
                   max_domains: int = MAX_PAIRWISE_DOMAINS) -> pd.DataFrame:
    """Held-out coverage for every (x, profile domain, heldout domain), ``(all)`` included, over
    the :func:`pairwise_domains` (the ``max_domains`` most selected).

    Columns: x, profile_domain, heldout_domain, coverage, cold_share (= 1 - coverage),
    profile_selections, heldout_selections (decode rows only).
    """
    h = histogram if isinstance(histogram, _Hist) else _Hist.from_frame(histogram, meta)
    names = pairwise_domains(h, max_domains) + [ALL]
    L, E = meta.num_moe_layers, meta.num_experts
    held = np.stack([h.get("decode", b, "heldout") for b in names]).astype(np.float64)  # [D+1, L, E]
    held_total = held.sum(axis=(1, 2))
    n_top = {x: top_count(x, E) for x in xs}
    rows = {x: [] for x in xs}
    for a in names:
        prof = h.get("decode", a, "profile")
        # hot set for x = the first top_count(x, E) experts of this order (ties to lower id)
        order = np.argsort(-prof, axis=1, kind="stable")
        cum = np.cumsum(held[:, np.arange(L)[:, None], order], axis=2).sum(axis=1)  # [D+1, E]
        for x in xs:
            if prof.sum() > 0:
                cov = np.divide(cum[:, n_top[x] - 1], held_total, out=np.full(len(names), np.nan),
                                where=held_total > 0)
            else:
                cov = np.full(len(names), np.nan)
            for b, value, total in zip(names, cov, held_total):
                rows[x].append({"x": x, "profile_domain": a, "heldout_domain": b, "coverage": float(value),
                                "cold_share": 1.0 - float(value), "profile_selections": int(prof.sum()),
                                "heldout_selections": int(total)})
    out = [r for x in xs for r in rows[x]]
    return pd.DataFrame(out, columns=["x", "profile_domain", "heldout_domain", "coverage", "cold_share",
                                      "profile_selections", "heldout_selections"])


DEFINITIONS = {
    "gini": "per layer over the num_experts selection counts (zeros included); mean = over layers with selections",
    "top_share": "share of selections taken by the ceil(x% * num_experts) most selected experts: mean_over_layers "
                 "= per layer then averaged; model_wide = top ceil(x% * layers * experts) (layer, expert) pairs",
    "spearman": "rank correlation (average ranks for ties) of per-layer expert counts, per layer then averaged "
                "over layers where both vectors vary",
    "oracle_cache": "per (request, MoE layer) cache of slots experts, empty at the first decode step; at each "
                    "decode step the token's top_k experts are needed, cached ones are hits, missing ones are "
                    "loaded evicting the cached expert not needed now whose next use is farthest (Belady); "
                    "hit_rate = hits / decode selections",
    "coverage": "per layer the top ceil(x% * num_experts) experts of the profile split's decode counts "
                "(ties to lower id) form the hot set; coverage = share of the heldout split's decode "
                "selections, all layers pooled, inside the hot sets",
    "splits": "skew statistics pool both splits; coverage uses profile vs heldout",
    "all": f"{ALL!r} = all domains pooled",
    "pairwise_domains": "spearman_between_domains and coverage cover these domains only: the most selected "
                        "ones, at most stats.max_pairwise_domains (pairwise tables grow with the square of "
                        "the domains); per-domain statistics cover every domain",
}


def skew_stats(histogram: pd.DataFrame, meta: TraceMeta, oracle: pd.DataFrame | None = None, *,
               xs: Sequence[float] = DEFAULT_XS, cache_slots: int | None = None,
               max_pairwise_domains: int = MAX_PAIRWISE_DOMAINS) -> dict[str, Any]:
    """Skew statistics per phase and per domain (plus ``(all)``), JSON-ready (NaN -> null).

    ``oracle`` is :attr:`TraceScan.oracle` (decode hits per domain and layer); without it the
    oracle cache entry is omitted. Definitions are in the module docstring and in the result's
    ``definitions``.
    """
    h = _Hist.from_frame(histogram, meta)
    return _skew_stats(h, meta, oracle, xs, cache_slots, coverage_table(h, meta, xs, max_pairwise_domains),
                       max_pairwise_domains)


def _skew_stats(h: "_Hist", meta: TraceMeta, oracle: pd.DataFrame | None, xs: Sequence[float],
                cache_slots: int | None, cov: pd.DataFrame,
                max_pairwise_domains: int = MAX_PAIRWISE_DOMAINS) -> dict[str, Any]:
    names = h.domains + [ALL]
    pairwise = pairwise_domains(h, max_pairwise_domains)
    result: dict[str, Any] = {"definitions": DEFINITIONS, "xs": list(xs), "phases": {},
                              "pairwise_domains": pairwise}
    for phase in PHASES:
        per_domain = {}
        for name in names:
            c = h.get(phase, name)
            g = [gini(row) for row in c]
            entry: dict[str, Any] = {
                "selections": int(c.sum()),
                "gini": {"mean": nanmean(g), "per_layer": layer_dict(meta, g)},
                "top_share": {},
            }
            for x in xs:
                per = [top_share(row, x) for row in c]
                entry["top_share"][str(x)] = {
                    "mean_over_layers": nanmean(per),
                    "model_wide": json_number(top_share(c, x)),
                    "per_layer": layer_dict(meta, per),
                }
            if phase == "decode" and oracle is not None:
                od = oracle if name == ALL else oracle[oracle["domain"] == name]
                by_layer = od.groupby("layer")[["hits", "selections"]].sum()
                hits, sels = int(by_layer["hits"].sum()), int(by_layer["selections"].sum())
                entry["oracle_cache"] = {
                    "slots_per_layer": int(cache_slots if cache_slots is not None else 3 * meta.top_k),
                    "hits": hits,
                    "selections": sels,
                    "hit_rate": hits / sels if sels else None,
                    "per_layer": {str(int(layer)): (json_number(r.hits / r.selections) if r.selections else None)
                                  for layer, r in by_layer.iterrows()},
                }
            per_domain[name] = entry
        ranks = {name: _rank_rows(h.get(phase, name)) for name in pairwise}
        pairs = []
        for i, a in enumerate(pairwise):
            for b in pairwise[i + 1:]:
                pairs.append({"a": a, "b": b, **_spearman_layers(ranks[a], ranks[b], meta)})
        result["phases"][phase] = {"domains": per_domain, "spearman_between_domains": pairs}
    result["spearman_prefill_vs_decode"] = {
        name: _spearman_layers(_rank_rows(h.get("prefill", name)), _rank_rows(h.get("decode", name)), meta)
        for name in names
    }
    result["coverage"] = {
        str(x): {a: {b: json_number(v) for b, v in zip(g["heldout_domain"], g["coverage"])}
                 for a, g in sub.groupby("profile_domain", sort=False)}
        for x, sub in cov.groupby("x", sort=False)
    }
    return result


def _write_csv(df: pd.DataFrame, path: str) -> None:
    """CSV through pyarrow (several times faster than pandas for million-row histograms)."""
    pcsv.write_csv(pa.Table.from_pandas(df, preserve_index=False), path,
                   write_options=pcsv.WriteOptions(quoting_style="needed"))


def _write_atomic(path: Path, write) -> None:
    with atomic_path(path) as tmp:
        write(tmp)


def run_stats(trace_path: str | os.PathLike, out_dir: str | os.PathLike, *, heldout_fraction: float = 0.25,
              xs: Sequence[float] = DEFAULT_XS, cache_slots_factor: int = 3, expect: Any = None,
              figures: bool = True, progress: bool = True, locality_seed: int = 0,
              max_pairwise_domains: int = MAX_PAIRWISE_DOMAINS) -> dict[str, Path]:
    """The ``stats`` stage: one pass over the trace, then every output into ``out_dir``.

    Writes ``histogram.csv`` (domain, split, phase, layer, expert, count; zeros included),
    ``skew.json`` (:func:`skew_stats` plus the trace summary), ``coverage.csv``
    (:func:`coverage_table`), ``locality.json`` (:func:`locality_stats` over every decode row, held
    in memory: about 60 bytes a row; shuffled baseline from ``locality_seed``) and, with
    ``figures``, ``heatmap_{phase}.png`` (raw expert ids, one panel per domain) and
    ``lorenz_{phase}.png``. ``expect`` (ModelConfig-like) makes a trace
    recorded for another model shape an error. Returns the paths by name.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = read_trace_meta(trace_path, expect)
    slots = cache_slots_factor * meta.top_k
    scan = scan_trace(trace_path, heldout_fraction, oracle=True, cache_slots=slots, progress=progress)
    order = np.argsort(scan.domains, kind="stable")  # domains sorted by name, as from a frame
    h = _Hist(scan.counts[order], [scan.domains[i] for i in order], meta)
    cov = coverage_table(h, meta, xs, max_pairwise_domains)
    stats = _skew_stats(h, meta, scan.oracle, xs, slots, cov, max_pairwise_domains)
    stats["trace"] = {
        "path": str(trace_path),
        "model": meta.model,
        "num_layers": meta.num_layers,
        "num_experts": meta.num_experts,
        "top_k": meta.top_k,
        "moe_layers": meta.moe_layers,
        "source": meta.source,
        "rows": scan.rows,
        "requests": scan.requests,
        "cached_prefix_rows_skipped": scan.cached_prefix_rows_skipped,
        "cached_prefix_tokens_skipped_at_import": int(meta.extra.get("cached_prefix_tokens_skipped", 0)),
        "split_source": scan.split_source,
        "heldout_fraction": heldout_fraction if scan.split_source == "hash" else None,
    }
    locality = locality_stats(trace_decode_rows(trace_path, heldout_fraction)[0], meta, locality_seed)
    paths = {"histogram": out / "histogram.csv", "skew": out / "skew.json", "coverage": out / "coverage.csv",
             "locality": out / "locality.json"}
    _write_atomic(paths["locality"], lambda p: Path(p).write_text(json.dumps(locality, indent=1, allow_nan=False)))
    _write_atomic(paths["histogram"], lambda p: _write_csv(scan.histogram, p))
    _write_atomic(paths["skew"], lambda p: Path(p).write_text(json.dumps(stats, indent=1, allow_nan=False)))
    _write_atomic(paths["coverage"], lambda p: cov.to_csv(p, index=False))
    if figures:
        for phase in PHASES:
            paths[f"heatmap_{phase}"] = out / f"heatmap_{phase}.png"
            figure_heatmaps(h, meta, phase, paths[f"heatmap_{phase}"])
            paths[f"lorenz_{phase}"] = out / f"lorenz_{phase}.png"
            figure_lorenz(h, meta, phase, paths[f"lorenz_{phase}"])
    return paths
