"""The routing trace: its contract (docs/design.md §2), writer, streaming reader, validation, splits.

The bottom of the package's trace layer: capture (:mod:`coldset.trace.capture`), the importers
(:mod:`coldset.trace.importers`), the fixtures, the statistics, the cache simulation and the forecast
all depend on this module, and it depends on none of them.

Every producer of routing data meets in one Parquet format, long, one row per
(request, position, layer, rank):

=========  ===========  ==========================================================
column     type         meaning
=========  ===========  ==========================================================
request    str          the fixture id of the request
domain     str          traffic domain (agent, prose, code, an MMLU subject, ...)
position   int32        token index in the request's sequence (prompt tokens first)
phase      str          ``prefill`` (prompt tokens) or ``decode`` (generated tokens)
layer      int16        the model's layer index (``moe_layers[i]`` for MoE index i)
rank       int8         0..top_k-1, the slot in the router's top-k
expert     int16        the routed expert id, 0..num_experts-1
weight     float32      router weight (optional column)
split      str          ``profile`` or ``heldout`` (optional column)
=========  ===========  ==========================================================

Schema metadata (utf-8): ``model``, ``num_layers``, ``num_experts``, ``top_k``,
``moe_layers`` (a JSON list) and ``source``. Traces are written in row groups so that readers
(:func:`iter_trace_batches`, the statistics) hold one row group at a time, never the trace.

An expert id of -1 is allowed in one place only: a ``prefill`` row of a prompt token that the
serving engine took from its prefix cache and so never routed (vLLM marks those rows -1). The
importers drop such tokens and count them; a trace that still carries them is read with those
rows skipped and counted by the statistics. Any other negative or out-of-range id is an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from coldset.core.files import remove_orphans, share_mode
from coldset.core.names import NAME_PATTERN, is_name

PHASES = ("prefill", "decode")
SPLITS = ("profile", "heldout")
REQUIRED_COLUMNS = ("request", "domain", "position", "phase", "layer", "rank", "expert")
OPTIONAL_COLUMNS = ("weight", "split")
META_KEYS = ("model", "num_layers", "num_experts", "top_k", "moe_layers", "source")
#: Rows per Parquet row group written by :class:`TraceWriter` (about 10 MB of decoded columns).
ROW_GROUP_ROWS = 1 << 20
#: The expert id vLLM uses for a prompt token served from its prefix cache (never routed).
CACHED_EXPERT = -1

_INT_COLUMNS = {"position": pa.int32(), "layer": pa.int16(), "rank": pa.int8(), "expert": pa.int16()}
_STR_COLUMNS = ("request", "domain", "phase", "split")


class TraceError(ValueError):
    """A trace or an engine export that breaks the contract; the message says file and where."""


@dataclass
class TraceMeta:
    """The schema metadata every trace carries: the model shape the routing belongs to."""

    model: str
    num_layers: int
    num_experts: int
    top_k: int
    moe_layers: list[int]
    source: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def to_metadata(self) -> dict[bytes, bytes]:
        md = {
            "model": self.model,
            "num_layers": str(int(self.num_layers)),
            "num_experts": str(int(self.num_experts)),
            "top_k": str(int(self.top_k)),
            "moe_layers": json.dumps([int(x) for x in self.moe_layers]),
            "source": self.source,
        }
        md.update({k: str(v) for k, v in self.extra.items()})
        return {k.encode(): v.encode() for k, v in md.items()}

    @classmethod
    def from_metadata(cls, md: dict[bytes, bytes] | None, where: str) -> "TraceMeta":
        md = {k.decode(): v.decode() for k, v in (md or {}).items()}
        missing = [k for k in META_KEYS if k not in md]
        if missing:
            raise TraceError(f"{where}: schema metadata lacks key(s) {missing} (docs/design.md §2)")
        try:
            num_layers, num_experts, top_k = (int(md[k]) for k in ("num_layers", "num_experts", "top_k"))
        except ValueError as e:
            raise TraceError(f"{where}: schema metadata num_layers/num_experts/top_k must be integers: {e}") from None
        try:
            moe_layers = json.loads(md["moe_layers"])
            if not isinstance(moe_layers, list) or not all(isinstance(x, int) for x in moe_layers):
                raise ValueError("not a list of integers")
        except ValueError as e:
            raise TraceError(f"{where}: schema metadata moe_layers={md['moe_layers']!r} is not a JSON list of ints "
                             f"({e})") from None
        extra = {k: v for k, v in md.items()
                 if k not in META_KEYS and k != "ARROW:schema" and not k.startswith("pandas")}
        meta = cls(md["model"], num_layers, num_experts, top_k, moe_layers, md["source"], extra)
        meta.check(where)
        return meta

    def check(self, where: str) -> None:
        """Internal consistency: positive sizes, sorted distinct MoE layers inside the model."""
        if self.num_experts <= 0 or self.top_k <= 0 or self.top_k > self.num_experts:
            raise TraceError(f"{where}: metadata num_experts={self.num_experts}, top_k={self.top_k} are not a "
                             "valid pair")
        if self.num_experts > 32767:
            raise TraceError(f"{where}: metadata num_experts={self.num_experts} does not fit the int16 expert column")
        ml = list(self.moe_layers)
        if not ml or ml != sorted(set(ml)) or ml[0] < 0 or ml[-1] >= self.num_layers:
            raise TraceError(
                f"{where}: metadata moe_layers={ml} must be a non-empty increasing list of layer indices "
                f"below num_layers={self.num_layers}"
            )

    @classmethod
    def from_model_config(cls, config: Any, model: str, source: str) -> "TraceMeta":
        """Metadata for a model described by a ModelConfig-like object (or a mapping)."""
        exp = _expectation(config, "model config")
        num_layers = _get(config, "num_layers", None) or _get(config, "num_hidden_layers", None)
        if num_layers is None:
            num_layers = exp["moe_layers"][-1] + 1
        return cls(model, int(num_layers), exp["num_experts"], exp["top_k"], exp["moe_layers"], source)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _expectation(config: Any, where: str) -> dict[str, Any]:
    """num_experts, top_k, moe_layers from a ModelConfig-like object or a dict."""
    num_experts = _get(config, "num_experts") or _get(config, "num_local_experts")
    top_k = _get(config, "top_k") or _get(config, "num_experts_per_tok")
    moe_layers = _get(config, "moe_layers")
    if num_experts is None or top_k is None or moe_layers is None:
        raise TraceError(f"{where}: expected num_experts, top_k and moe_layers on {type(config).__name__}")
    return {"num_experts": int(num_experts), "top_k": int(top_k), "moe_layers": [int(x) for x in moe_layers]}


def check_meta_against_model(meta: TraceMeta, expect: Any, where: str) -> None:
    """Refuse a trace recorded for another model shape than the one the pipeline uses."""
    exp = _expectation(expect, where)
    for key in ("num_experts", "top_k", "moe_layers"):
        got = getattr(meta, key)
        if got != exp[key]:
            raise TraceError(f"{where}: trace metadata {key}={got} disagrees with the model ({key}={exp[key]})")


# --------------------------------------------------------------------------------------------
# split assignment


def split_of(request_id: str, heldout_fraction: float) -> str:
    """Deterministic split of a request by a hash of its id, for traces without a split column.

    sha256 of the utf-8 id, first 8 bytes as an integer, divided by 2**64: ``heldout`` below
    ``heldout_fraction``, else ``profile``. The same id always lands in the same split, on any
    machine and Python version (unlike ``hash()``).
    """
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must lie in [0, 1], got {heldout_fraction}")
    h = int.from_bytes(hashlib.sha256(request_id.encode("utf-8")).digest()[:8], "big")
    return "heldout" if h / 2.0**64 < heldout_fraction else "profile"


# --------------------------------------------------------------------------------------------
# writing


def _schema(meta: TraceMeta, with_weight: bool, with_split: bool) -> pa.Schema:
    d = pa.dictionary(pa.int32(), pa.string())
    fields = [
        pa.field("request", d),
        pa.field("domain", d),
        pa.field("position", pa.int32()),
        pa.field("phase", d),
        pa.field("layer", pa.int16()),
        pa.field("rank", pa.int8()),
        pa.field("expert", pa.int16()),
    ]
    if with_weight:
        fields.append(pa.field("weight", pa.float32()))
    if with_split:
        fields.append(pa.field("split", d))
    return pa.schema(fields, metadata=meta.to_metadata())


@dataclass
class RequestRows:
    """One request's routing before it becomes trace rows (what capture and importers build)."""

    request: str
    domain: str
    experts: np.ndarray  # int [n_tokens, num_moe_layers, top_k]; -1 rows = cached prefix
    num_prompt_tokens: int
    weights: np.ndarray | None = None  # float32, same shape
    split: str | None = None
    first_position: int = 0


class TraceWriter:
    """Writes a trace request by request, in row groups, atomically (temp file, then rename).

    Use as a context manager; on an exception nothing is left at ``path``.
    """

    def __init__(self, path: str | os.PathLike, meta: TraceMeta, *, with_weight: bool, with_split: bool,
                 row_group_rows: int = ROW_GROUP_ROWS):
        meta.check(str(path))
        self.path = Path(path)
        self.meta = meta
        self.with_weight = with_weight
        self.with_split = with_split
        self.row_group_rows = row_group_rows
        self.cached_tokens_skipped = 0
        self.rows_written = 0
        self.requests_written = 0
        self._pending: list[dict[str, np.ndarray | list]] = []
        self._pending_rows = 0
        self._layers = np.asarray(meta.moe_layers, dtype=np.int16)
        self._seen: set[str] = set()
        self._writer: pq.ParquetWriter | None = None
        self._tmp: str | None = None

    def __enter__(self) -> "TraceWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_orphans(self.path)
        fd, self._tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        os.close(fd)
        self._schema = _schema(self.meta, self.with_weight, self.with_split)
        self._writer = pq.ParquetWriter(self._tmp, self._schema, compression="zstd")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._flush()
                # The skipped-token count travels with the trace so the statistics can report it;
                # it is known only now, so it goes into the footer's key-value metadata.
                if self.cached_tokens_skipped:
                    self.meta.extra["cached_prefix_tokens_skipped"] = str(self.cached_tokens_skipped)
                    self._writer.add_key_value_metadata(
                        {"cached_prefix_tokens_skipped": str(self.cached_tokens_skipped)})
            self._writer.close()
            if exc_type is None:
                share_mode(self._tmp)
                os.replace(self._tmp, self.path)
                self._tmp = None
        finally:
            if self._tmp is not None and os.path.exists(self._tmp):
                os.unlink(self._tmp)

    def add(self, req: RequestRows, where: str = "") -> int:
        """Append one request's rows; returns the number of cached-prefix tokens it skipped."""
        where = where or f"request {req.request!r}"
        meta = self.meta
        ex = np.asarray(req.experts)
        L, k = meta.num_moe_layers, meta.top_k
        if ex.ndim != 3 or ex.shape[1:] != (L, k):
            raise TraceError(f"{where}: routed experts have shape {tuple(ex.shape)}, expected [tokens, {L}, {k}] "
                             f"(tokens, MoE layers, top_k)")
        if not is_name(req.domain):
            raise TraceError(f"{where}: domain {req.domain!r} is not a valid name (domains become file names and "
                             f"labels; they must match {NAME_PATTERN})")
        if req.request in self._seen:
            raise TraceError(f"{where}: request id {req.request!r} appears twice")
        self._seen.add(req.request)
        if not 0 <= req.num_prompt_tokens <= ex.shape[0] + 1:
            raise TraceError(f"{where}: num_prompt_tokens={req.num_prompt_tokens} outside 0..{ex.shape[0] + 1}")
        if self.with_split and req.split not in SPLITS:
            raise TraceError(f"{where}: split {req.split!r} is not one of {SPLITS}")
        if ex.dtype.kind not in "iu":
            raise TraceError(f"{where}: routed experts must be integers, got dtype {ex.dtype}")
        ex = ex.astype(np.int32, copy=False)
        cached_tok = (ex == CACHED_EXPERT).all(axis=(1, 2))
        bad = (ex < 0) | (ex >= meta.num_experts)
        bad[cached_tok] = False
        if bad.any():
            t, l, r = (int(v) for v in np.argwhere(bad)[0])
            raise TraceError(
                f"{where}: expert id {int(ex[t, l, r])} at token {t}, MoE layer {l}, rank {r} is outside "
                f"0..{meta.num_experts - 1} (only whole tokens of -1 are accepted, as cached prefix)"
            )
        srt = np.sort(ex, axis=2)
        dup = (srt[..., 1:] == srt[..., :-1]).any(axis=2) & ~cached_tok[:, None]
        if dup.any():
            t, l = (int(v) for v in np.argwhere(dup)[0])
            raise TraceError(f"{where}: token {t}, MoE layer {l} selects the same expert twice ({ex[t, l].tolist()})")
        positions = np.arange(ex.shape[0], dtype=np.int64) + req.first_position
        if (cached_tok & (positions >= req.num_prompt_tokens + req.first_position)).any():
            t = int(np.flatnonzero(cached_tok & (positions >= req.num_prompt_tokens + req.first_position))[0])
            raise TraceError(f"{where}: generated token {t} is marked -1 (cached); only prompt tokens can be cached")
        keep = ~cached_tok
        n_skipped = int(cached_tok.sum())
        self.cached_tokens_skipped += n_skipped
        ex = ex[keep]
        positions = positions[keep]
        n = ex.shape[0]
        rows = n * L * k
        w = None
        if self.with_weight:
            if req.weights is None:
                raise TraceError(f"{where}: the trace has a weight column but this request has no weights")
            w = np.asarray(req.weights, dtype=np.float32)
            if w.shape != np.asarray(req.experts).shape:
                raise TraceError(f"{where}: weights shape {w.shape} differs from experts shape "
                                 f"{np.asarray(req.experts).shape}")
            w = w[keep].reshape(-1)
        pos = np.repeat(positions, L * k).astype(np.int32)
        chunk = {
            "request": (req.request, rows),
            "domain": (req.domain, rows),
            "position": pos,
            "phase": (pos >= req.first_position + req.num_prompt_tokens).astype(np.int32),
            "layer": np.tile(np.repeat(self._layers, k), n),
            "rank": np.tile(np.arange(k, dtype=np.int8), n * L),
            "expert": ex.reshape(-1).astype(np.int16),
        }
        if self.with_weight:
            chunk["weight"] = w
        if self.with_split:
            chunk["split"] = (req.split, rows)
        self._pending.append(chunk)
        self._pending_rows += rows
        self.rows_written += rows
        self.requests_written += 1
        if self._pending_rows >= self.row_group_rows:
            self._flush()
        return n_skipped

    def _flush(self) -> None:
        if not self._pending:
            return
        cols = {}
        for name in ("request", "domain", "split"):
            if name not in self._pending[0]:
                continue
            values, index = [], []
            lookup: dict[str, int] = {}
            for ch in self._pending:
                v, n = ch[name]
                code = lookup.setdefault(v, len(lookup))
                if code == len(values):
                    values.append(v)
                index.append(np.full(n, code, dtype=np.int32))
            cols[name] = pa.DictionaryArray.from_arrays(pa.array(np.concatenate(index)), pa.array(values, pa.string()))
        phase = np.concatenate([ch["phase"] for ch in self._pending])
        cols["phase"] = pa.DictionaryArray.from_arrays(pa.array(phase), pa.array(list(PHASES), pa.string()))
        for name in ("position", "layer", "rank", "expert", "weight"):
            if name in self._pending[0]:
                cols[name] = pa.array(np.concatenate([ch[name] for ch in self._pending]))
        table = pa.table([cols[f.name] for f in self._schema], schema=self._schema)
        self._writer.write_table(table, row_group_size=max(self.row_group_rows, table.num_rows))
        self._pending.clear()
        self._pending_rows = 0


def write_trace(path: str | os.PathLike, meta: TraceMeta, tables: pa.Table | Iterable[pa.Table],
                row_group_rows: int = ROW_GROUP_ROWS) -> Path:
    """Write rows already in long form (tables with the §2 columns) as a trace, atomically.

    Each table is validated against ``meta`` before it is written; row groups are at most
    ``row_group_rows`` rows.
    """
    path = Path(path)
    meta.check(str(path))
    if isinstance(tables, pa.Table):
        tables = [tables]
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    writer = None
    try:
        for i, t in enumerate(tables):
            t = _normalise_table(t, f"{path} (table {i})")
            offset = 0
            for batch in t.to_batches():
                _validate_batch(batch, meta, f"{path} (table {i})", offset)
                offset += batch.num_rows
            if writer is None:
                schema = _schema(meta, "weight" in t.column_names, "split" in t.column_names)
                writer = pq.ParquetWriter(tmp, schema, compression="zstd")
            t = t.select(schema.names).cast(schema)
            writer.write_table(t, row_group_size=row_group_rows)
        if writer is None:
            raise TraceError(f"{path}: no rows to write")
        writer.close()
        writer = None
        share_mode(tmp)
        os.replace(tmp, path)
    finally:
        if writer is not None:
            writer.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _normalise_table(t: pa.Table, where: str) -> pa.Table:
    missing = [c for c in REQUIRED_COLUMNS if c not in t.column_names]
    if missing:
        raise TraceError(f"{where}: missing column(s) {missing}; a trace needs {list(REQUIRED_COLUMNS)}")
    return t


# --------------------------------------------------------------------------------------------
# reading and validation


def read_trace_meta(path: str | os.PathLike, expect: Any = None) -> TraceMeta:
    """The trace's metadata, checked for consistency and, if ``expect`` (a ModelConfig-like
    object or dict with num_experts, top_k, moe_layers) is given, against the model."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: trace file not found")
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise TraceError(f"{path}: not a readable Parquet file ({e})") from None
    schema = pf.schema_arrow
    # Schema metadata plus footer key-value metadata (written after the rows, e.g. skip counts).
    md = dict(pf.metadata.metadata or {})
    md.update(schema.metadata or {})
    meta = TraceMeta.from_metadata(md, str(path))
    _check_columns(schema, str(path))
    if expect is not None:
        check_meta_against_model(meta, expect, str(path))
    return meta


def _check_columns(schema: pa.Schema, where: str) -> None:
    missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
    if missing:
        raise TraceError(f"{where}: missing column(s) {missing}; a trace needs {list(REQUIRED_COLUMNS)} "
                         "(docs/design.md §2)")
    for name in schema.names:
        typ = schema.field(name).type
        if pa.types.is_dictionary(typ):
            typ = typ.value_type
        if name in _INT_COLUMNS and not pa.types.is_integer(typ):
            raise TraceError(f"{where}: column {name!r} has type {typ}, expected an integer ({_INT_COLUMNS[name]})")
        if name in _STR_COLUMNS and not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
            raise TraceError(f"{where}: column {name!r} has type {typ}, expected a string")
        if name == "weight" and not pa.types.is_floating(typ):
            raise TraceError(f"{where}: column 'weight' has type {typ}, expected float32")


def _first_bad(mask: pa.Array | np.ndarray) -> int:
    m = mask.to_numpy(zero_copy_only=False) if isinstance(mask, (pa.Array, pa.ChunkedArray)) else mask
    return int(np.flatnonzero(m)[0])


def _validate_batch(batch: pa.RecordBatch, meta: TraceMeta, where: str, row_offset: int) -> None:
    """Vectorised checks of one batch; ``row_offset`` makes row numbers file-global."""
    names = batch.schema.names

    def fail(column: str, i: int, msg: str) -> None:
        raise TraceError(f"{where}, row {row_offset + i}: column {column!r} {msg}")

    if "expert" in names:
        ex = batch.column("expert")
        if ex.null_count:
            fail("expert", _first_bad(ex.is_null()), "is null")
        bad = pc.or_(pc.less(ex, CACHED_EXPERT), pc.greater_equal(ex, meta.num_experts))
        if pc.any(bad).as_py():
            i = _first_bad(bad)
            fail("expert", i, f"holds expert id {ex[i].as_py()} outside 0..{meta.num_experts - 1}")
        neg = pc.equal(ex, CACHED_EXPERT)
        if pc.any(neg).as_py():
            if "phase" not in names:
                fail("expert", _first_bad(neg), "holds -1 and the phase column was not read to check it is prefill")
            bad = pc.and_(neg, pc.not_equal(batch.column("phase").cast(pa.string()), "prefill"))
            if pc.any(bad).as_py():
                fail("expert", _first_bad(bad),
                     "holds -1 (cached prefix) in a decode row; only prefill rows may be cached")
    if "layer" in names:
        layer = batch.column("layer")
        ok = pc.is_in(layer, value_set=pa.array(meta.moe_layers, layer.type))
        if not pc.all(ok).as_py() or layer.null_count:
            i = _first_bad(pc.invert(pc.fill_null(ok, False)))
            fail("layer", i, f"holds layer {layer[i].as_py()}, not one of the MoE layers {meta.moe_layers}")
    if "rank" in names:
        rank = batch.column("rank")
        bad = pc.fill_null(pc.or_(pc.less(rank, 0), pc.greater_equal(rank, meta.top_k)), True)
        if pc.any(bad).as_py():
            i = _first_bad(bad)
            fail("rank", i, f"holds rank {rank[i].as_py()} outside 0..{meta.top_k - 1}")
    if "position" in names:
        pos = batch.column("position")
        bad = pc.fill_null(pc.less(pos, 0), True)
        if pc.any(bad).as_py():
            i = _first_bad(bad)
            fail("position", i, f"holds position {pos[i].as_py()}; positions are >= 0")
    for name, allowed in (("phase", PHASES), ("split", SPLITS)):
        if name in names:
            col = batch.column(name)
            if pa.types.is_dictionary(col.type):  # check the few dictionary values, not every row
                ok = pc.take(pc.is_in(col.dictionary.cast(pa.string()), value_set=pa.array(allowed)), col.indices)
            else:
                ok = pc.is_in(col.cast(pa.string()), value_set=pa.array(allowed))
            ok = pc.fill_null(ok, False)
            if not pc.all(ok).as_py():
                i = _first_bad(pc.invert(ok))
                fail(name, i, f"holds {col[i].as_py()!r}, expected one of {list(allowed)}")
    for name in ("request", "domain"):
        if name in names and batch.column(name).null_count:
            fail(name, _first_bad(batch.column(name).is_null()), "is null")
    if "domain" in names:  # domains become file names and figure labels: one rule (coldset.core.names)
        col = batch.column("domain")
        values = col.dictionary if pa.types.is_dictionary(col.type) else pc.unique(col)
        for value in values.cast(pa.string()).to_pylist():
            if value is not None and not is_name(value):
                i = _first_bad(pc.equal(col.cast(pa.string()), value))
                fail("domain", i, f"holds domain {value!r}, not a valid name (domains become file names and "
                                  f"labels; they must match {NAME_PATTERN})")
    if "weight" in names:
        w = batch.column("weight")
        bad = pc.invert(pc.fill_null(pc.is_finite(w), True))
        if pc.any(bad).as_py():
            i = _first_bad(bad)
            fail("weight", i, f"holds router weight {w[i].as_py()}; router weights are finite numbers")


def iter_trace_batches(path: str | os.PathLike, columns: Sequence[str] | None = None, *,
                       validate: bool = True, expect: Any = None,
                       batch_rows: int = ROW_GROUP_ROWS) -> Iterator[pa.RecordBatch]:
    """Stream a trace in batches of at most ``batch_rows`` rows (row group by row group).

    Each batch is validated (expert range, MoE layer, rank, position, phase and split values)
    unless ``validate=False``; errors name the file, row group and file-global row. Memory is
    one batch, never the whole trace. Dictionary-encoded string columns stay dictionaries.
    """
    path = Path(path)
    meta = read_trace_meta(path, expect)
    pf = pq.ParquetFile(path)
    if columns is not None:
        unknown = [c for c in columns if c not in pf.schema_arrow.names]
        if unknown:
            raise TraceError(f"{path}: missing column(s) {unknown} (the file has {pf.schema_arrow.names})")
        columns = list(columns)
    offset = 0
    for rg in range(pf.num_row_groups):
        for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[rg], columns=columns):
            if validate:
                _validate_batch(batch, meta, f"{path}, row group {rg}", offset)
            offset += batch.num_rows
            yield batch


_TOKEN_COLUMNS = ["request", "position", "layer", "rank", "expert"]


def _check_tokens(t: pa.Table, meta: TraceMeta, where: str, final: bool) -> pa.Table:
    """Every routed (request, position, MoE layer) of ``t`` has ranks 0..top_k-1 once each and
    ``top_k`` distinct experts. ``t`` carries a file-global ``_row`` column. Returns the rows of
    tokens that may still be completed by later rows (fewer than top_k rows, distinct so far);
    with ``final`` those are errors too. Cached-prefix rows (-1) were routed by nobody: skipped."""
    t = t.filter(pc.not_equal(t.column("expert"), CACHED_EXPERT))
    if not t.num_rows:
        return t
    key = ["request", "position", "layer"]
    keyed = t.select(key + ["rank", "expert", "_row"])
    if pa.types.is_dictionary(keyed.schema.field("request").type):
        keyed = keyed.set_column(0, "request", keyed.column("request").cast(pa.string()))
    g = keyed.group_by(key).aggregate([("rank", "count"), ("rank", "count_distinct"), ("expert", "count_distinct"),
                                       ("_row", "min")])
    k = meta.top_k
    n, ranks, experts = (g.column(c).to_numpy() for c in ("rank_count", "rank_count_distinct",
                                                          "expert_count_distinct"))
    bad = (ranks < n) | (experts < n) | (n > k)
    if final:
        bad |= n < k
    if bad.any():
        order = np.argsort(g.column("_row_min").to_numpy()[bad], kind="stable")
        i = int(np.flatnonzero(bad)[order[0]])
        req, pos, layer = (g.column(c)[i].as_py() for c in key)
        rows = keyed.filter(pc.and_(pc.and_(pc.equal(keyed.column("request"), req),
                                            pc.equal(keyed.column("position"), pos)),
                                    pc.equal(keyed.column("layer"), layer)))
        row_ids = rows.column("_row").to_pylist()
        what = (f"request {req!r}, position {pos}, layer {layer} (rows {row_ids[:2 * k]})")
        if ranks[i] < n[i] or n[i] > k:
            msg = f"repeats a rank ({rows.column('rank').to_pylist()}; top_k={k})"
        elif experts[i] < n[i]:
            msg = f"selects the same expert twice ({rows.column('expert').to_pylist()})"
        else:
            msg = f"has ranks {sorted(rows.column('rank').to_pylist())}, missing some of 0..{k - 1}"
        raise TraceError(f"{where}: {what} {msg}")
    open_keys = g.filter(pc.less(g.column("rank_count"), k)).select(key)
    if not open_keys.num_rows:
        return keyed.slice(0, 0)
    return keyed.join(open_keys, key, join_type="inner")


def validate_trace(path: str | os.PathLike, expect: Any = None) -> TraceMeta:
    """Read a whole trace once, streaming, and raise :class:`TraceError` on the first defect.

    The one validator every reader of a trace calls (import, statistics, the bench's routing
    replay): the row checks of :func:`iter_trace_batches` (expert range, MoE layer, rank, phase,
    split, domain names, finite weights) and the token checks no single row shows: every routed
    (request, position, MoE layer) has each rank 0..top_k-1 once and top_k distinct experts
    (rows relabelled to one layer repeat ranks; negative ids never wrap around). Memory is a row
    group plus the rows of tokens left open across row groups (none for coldset's writers).
    """
    meta = read_trace_meta(path, expect)
    open_rows: pa.Table | None = None
    offset = 0
    for batch in iter_trace_batches(path, expect=None):
        t = pa.Table.from_batches([batch]).select(_TOKEN_COLUMNS)
        t = t.append_column("_row", pa.array(np.arange(offset, offset + batch.num_rows, dtype=np.int64)))
        offset += batch.num_rows
        if pa.types.is_dictionary(t.schema.field("request").type):
            t = t.set_column(0, "request", t.column("request").cast(pa.string()))
        if open_rows is not None and open_rows.num_rows:
            t = pa.concat_tables([open_rows.select(t.column_names).cast(t.schema), t])
        open_rows = _check_tokens(t, meta, str(path), final=False)
    if open_rows is not None and open_rows.num_rows:
        _check_tokens(open_rows, meta, str(path), final=True)
    return meta


@dataclass
class ImportReport:
    """What an importer wrote: the trace path and counts, including skipped cached tokens."""

    path: Path
    requests: int
    rows: int
    cached_prefix_tokens_skipped: int


def request_codes(column: Any) -> tuple[np.ndarray, np.ndarray]:
    """(codes, names) of a request-id column, codes ascending with the names' string order.

    The one numbering of requests that the cache replay and the forecast share, so that their
    groups line up row for row."""
    cat = column if isinstance(column, pd.Categorical) else pd.Categorical(np.asarray(column).astype(str))
    names = np.asarray(cat.categories).astype(str)
    order = np.argsort(names, kind="stable")
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = np.arange(order.size)
    codes = np.asarray(cat.codes, dtype=np.int64)
    if (codes < 0).any():
        raise TraceError("request column holds missing values")
    return rank[codes], names[order]
