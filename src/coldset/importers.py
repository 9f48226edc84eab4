"""Routing from the serving engines, as they write it today, into the trace (DESIGN.md §2).

``routing.trace`` may name one file or a folder of them (every ``.json``, ``.jsonl`` and ``.pt``
below it, in name order); each file is read in the format its content shows:

- **vLLM OpenAI response** (``vllm serve --enable-return-routed-experts``; a completions or chat
  response saved as JSON, one per file or one per line): ``choices[i].routed_experts`` is the
  base64 of an ``.npy`` file, ``[prompt_tokens + completion_tokens - 1, layers, top_k]`` uint8 or
  uint16 (the last sampled token is never forwarded), ``usage.prompt_tokens`` splits prefill
  from decode, ``id`` (and the choice index when there are several) names the request.
- **vLLM offline** (``LLM.generate``): ``RequestOutput.outputs[i].routed_experts`` is the same
  array; write one JSON line per request, ``{"id": out.request_id, "num_prompt_tokens":
  len(out.prompt_token_ids), "routed_experts": out.outputs[0].routed_experts.tolist()}`` (the
  container :func:`coldset.importers.import_vllm` reads).
- **SGLang ``return_routed_experts``** (``/generate`` response saved as JSON, one object, a list
  or one per line): ``meta_info.routed_experts`` is the base64 of little-endian int32
  ``[rows, layers, top_k (+ fused shared experts)]`` covering token positions
  ``[routed_experts_start_len, prompt_tokens + completion_tokens - 1)``; ``meta_info.id`` names
  the request. Any fused shared-expert columns (after the top-k) are dropped.
- **SGLang expert distribution recorder, ``per_token`` mode** (``.pt`` from
  ``/dump_expert_distribution_record``): ``records`` of forward passes, each with
  ``topk_ids_of_layer`` int32 ``[layers, tokens, 8]`` (physical expert ids, -1 padded),
  ``positions``, ``extend_seq_lens`` and ``forward_mode``; ``last_physical_to_logical_map``
  maps physical ids to experts. The recorder keeps no request ids: each prefill sequence of a
  pass becomes one request ``{file}#{rank}:{pass}:{seq}`` and each decode token its own request
  ``{file}#{rank}:{pass}:d{i}``, so per-request statistics (the oracle cache, locality) are not
  meaningful for such traces; expert counts are. Passes recorded identically by several
  tensor-parallel ranks are counted once.

``layers`` may be the MoE layers or every layer of the model (then the MoE layers' rows are
taken). What the exports lack is filled so: ``domain`` from ``routing.trace_domains`` (a glob
over the file's path inside the folder, or its name, to a domain; first match wins), else a
``domain`` field of the line, else the file's name without suffix; ``split`` by
:func:`coldset.trace.split_of` over the request id; ``phase`` from the prompt length (rows
before it are prefill).
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import io
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from coldset.files import remove_orphans, share_mode
from coldset.trace import (SPLITS, ImportReport, RequestRows, TraceError, TraceMeta, TraceWriter,
                           check_meta_against_model, iter_trace_batches, split_of, validate_trace)

EXPORT_SUFFIXES = (".json", ".jsonl", ".pt")
#: SGLang's ForwardMode values in the recorder's ``forward_mode`` (IntEnum from 1).
SGLANG_EXTEND, SGLANG_DECODE, SGLANG_MIXED = 1, 2, 3


def export_files(source: str | os.PathLike) -> list[Path]:
    """The files ``routing.trace`` names: itself, or every export file below a folder."""
    source = Path(source)
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise TraceError(f"{source}: routing trace not found (a file or a folder of engine exports)")
    files = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix in EXPORT_SUFFIXES)
    if not files:
        raise TraceError(f"{source}: folder holds no engine exports ({', '.join(EXPORT_SUFFIXES)})")
    return files


def is_engine_export(source: str | os.PathLike) -> bool:
    """Whether ``source`` is read here: a folder, a recorder ``.pt``, or JSON whose first object
    is a vLLM (``choices``) or SGLang (``meta_info``) response."""
    source = Path(source)
    if source.is_dir() or source.suffix == ".pt":
        return True
    if source.suffix not in (".json", ".jsonl") or not source.is_file():
        return False
    try:
        for _, obj in _json_objects(source):
            return isinstance(obj, Mapping) and ("choices" in obj or "meta_info" in obj)
    except (TraceError, UnicodeDecodeError):
        return False
    return False


def domain_for(path: Path, root: Path, domains: Mapping[str, str] | None, line_domain: Any = None) -> str:
    """The domain of a file's requests: the first matching ``domains`` glob (over the path inside
    ``root`` and over the name), else the line's own ``domain``, else the file's stem."""
    rel = path.relative_to(root).as_posix() if root != path and root in path.parents else path.name
    for pattern, domain in (domains or {}).items():
        if fnmatch.fnmatch(rel, pattern) or fnmatch.fnmatch(path.name, pattern):
            return str(domain)
    if line_domain is not None:
        return str(line_domain)
    return path.name.split(".")[0]


def _moe_rows(arr: np.ndarray, meta: TraceMeta, where: str, *, extra_k_ok: bool) -> np.ndarray:
    """``[tokens, layers, k']`` -> ``[tokens, num_moe_layers, top_k]``: every layer's rows are cut
    to the MoE layers; columns after the top-k are dropped only where the engine appends fused
    shared experts there (``extra_k_ok``)."""
    if arr.ndim != 3:
        raise TraceError(f"{where}: routed experts have {arr.ndim} dimensions, expected [tokens, layers, top_k]")
    L, k = meta.num_moe_layers, meta.top_k
    if arr.shape[1] == meta.num_layers and meta.num_layers != L:
        arr = arr[:, meta.moe_layers, :]
    elif arr.shape[1] != L:
        raise TraceError(f"{where}: routed experts have {arr.shape[1]} layers; the model has {L} MoE layers "
                         f"of {meta.num_layers}")
    if arr.shape[2] != k and not (extra_k_ok and arr.shape[2] > k):
        raise TraceError(f"{where}: routed experts have {arr.shape[2]} per token and layer; the model's top_k is {k}")
    return arr[:, :, :k]


def _b64(value: Any, where: str) -> bytes:
    if not isinstance(value, str):
        raise TraceError(f"{where}: expected a base64 string, got {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise TraceError(f"{where}: not valid base64 ({e})") from None


def _int_field(obj: Mapping, key: str, where: str) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TraceError(f"{where}: field {key!r} must be a non-negative integer, got {v!r}")
    return v


def vllm_response_requests(obj: Mapping, meta: TraceMeta, where: str) -> Iterator[tuple[str, np.ndarray, int]]:
    """``(request id, experts [rows, moe_layers, k], prompt tokens)`` per choice of a vLLM response."""
    usage = obj.get("usage")
    if not isinstance(usage, Mapping):
        raise TraceError(f"{where}: a vLLM response needs 'usage' (prompt_tokens)")
    prompt = _int_field(usage, "prompt_tokens", f"{where} usage")
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        raise TraceError(f"{where}: a vLLM response needs a non-empty 'choices' list")
    for i, choice in enumerate(choices):
        cw = f"{where} choices[{i}].routed_experts"
        if not isinstance(choice, Mapping) or choice.get("routed_experts") is None:
            raise TraceError(f"{cw}: missing (start vLLM with --enable-return-routed-experts)")
        try:
            arr = np.load(io.BytesIO(_b64(choice["routed_experts"], cw)), allow_pickle=False)
        except ValueError as e:
            raise TraceError(f"{cw}: not an .npy payload ({e})") from None
        if arr.dtype.kind not in "iu":
            raise TraceError(f"{cw}: dtype {arr.dtype}, expected integers")
        rid = str(obj.get("id", "response")) + (f"/{choice.get('index', i)}" if len(choices) > 1 else "")
        yield rid, _moe_rows(arr, meta, cw, extra_k_ok=False), prompt


def sglang_response_request(obj: Mapping, meta: TraceMeta, where: str) -> tuple[str, np.ndarray, int, int]:
    """``(request id, experts, prompt tokens, first position)`` of one SGLang /generate response."""
    mi = obj["meta_info"]
    mw = f"{where} meta_info"
    if not isinstance(mi, Mapping) or mi.get("routed_experts") is None:
        raise TraceError(f"{mw}.routed_experts: missing (start SGLang with --enable-return-routed-experts and "
                         "send return_routed_experts: true)")
    raw = _b64(mi["routed_experts"], f"{mw}.routed_experts")
    if len(raw) % 4:
        raise TraceError(f"{mw}.routed_experts: {len(raw)} bytes is not a whole number of int32 values")
    flat = np.frombuffer(raw, dtype="<i4")
    prompt = _int_field(mi, "prompt_tokens", mw)
    completion = _int_field(mi, "completion_tokens", mw)
    start = mi.get("routed_experts_start_len", 0) or 0
    if not isinstance(start, int) or not 0 <= start <= prompt:
        raise TraceError(f"{mw}.routed_experts_start_len must be in 0..{prompt}, got {start!r}")
    rows = prompt + completion - 1 - start
    per_row = flat.size // rows if rows > 0 else 0
    if rows <= 0 or flat.size != rows * per_row:
        raise TraceError(f"{mw}.routed_experts: {flat.size} int32 values do not make {rows} rows "
                         f"(prompt_tokens + completion_tokens - 1 - routed_experts_start_len)")
    for layers in (meta.num_layers, meta.num_moe_layers):
        if per_row % layers == 0 and per_row // layers >= meta.top_k:
            arr = flat.reshape(rows, layers, per_row // layers)
            break
    else:
        raise TraceError(f"{mw}.routed_experts: {per_row} values per token fit neither {meta.num_layers} nor "
                         f"{meta.num_moe_layers} layers of top-{meta.top_k}")
    rid = str(mi.get("id") or obj.get("rid") or "request")
    return rid, _moe_rows(arr, meta, f"{mw}.routed_experts", extra_k_ok=True), max(prompt - start, 0), start


def _json_objects(path: Path) -> Iterator[tuple[str, Any]]:
    """A JSON file's objects: the whole file (an object or a list of them), or one per line."""
    text = path.read_text(encoding="utf-8")
    try:
        doc = json.loads(text)
        items = doc if isinstance(doc, list) else [doc]
        for i, item in enumerate(items):
            yield (f"{path}[{i}]" if isinstance(doc, list) else str(path)), item
        return
    except json.JSONDecodeError:
        pass
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None


def _legacy_line(obj: Mapping, meta: TraceMeta, where: str) -> tuple[str, np.ndarray, int]:
    """The JSONL container of :func:`coldset.importers.import_vllm` / ``import_sglang`` (one request a line)."""
    value = obj["routed_experts"]
    npt = _int_field(obj, "num_prompt_tokens", where)
    if isinstance(value, list):
        arr = np.asarray(value, dtype=np.int64)
        if arr.size == 0:
            arr = arr.reshape(0, meta.num_moe_layers, meta.top_k)
    else:
        flat = np.frombuffer(_b64(value, f"{where} routed_experts"), dtype="<i4")
        shape = obj.get("shape") or [-1, meta.num_moe_layers, meta.top_k]
        try:
            arr = flat.reshape(shape)
        except (ValueError, TypeError) as e:
            raise TraceError(f"{where}: field 'shape' {shape} does not fit {flat.size} int32 values ({e})") from None
    return str(obj["id"]), _moe_rows(arr, meta, f"{where} routed_experts", extra_k_ok=False), npt


def sglang_recorder_requests(path: Path, meta: TraceMeta, seen: set) -> Iterator[tuple[str, np.ndarray, int, int]]:
    """``(request id, experts, prompt tokens, first position)`` from a per_token recorder dump."""
    import torch

    try:
        dump = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (torch raises many types for a bad file)
        raise TraceError(f"{path}: not a readable torch dump ({type(e).__name__}: {e})") from None
    if not isinstance(dump, Mapping) or "records" not in dump:
        raise TraceError(f"{path}: not an SGLang expert distribution dump in per_token/per_pass mode "
                         "(no 'records'; stat mode keeps only counts, which a trace cannot hold)")
    p2l = dump.get("last_physical_to_logical_map")
    p2l = None if p2l is None else np.asarray(p2l)
    stem = path.name.split(".")[0]
    for i, rec in enumerate(dump["records"]):
        where = f"{path} records[{i}]"
        try:
            ids = np.asarray(rec["topk_ids_of_layer"])
            positions = [int(x) for x in rec["positions"]]
            input_ids = [int(x) for x in rec["input_ids"]]
            mode = int(rec["forward_mode"])
            fp, rank = int(rec["forward_pass_id"]), int(rec.get("rank", 0))
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"{where}: missing or malformed field ({e}); expected a per_token recorder record") from None
        key = (fp, tuple(positions), tuple(input_ids))
        if key in seen:  # the same pass recorded by another tensor-parallel rank
            continue
        seen.add(key)
        if ids.ndim != 3 or ids.shape[1] != len(positions):
            raise TraceError(f"{where}: topk_ids_of_layer has shape {list(ids.shape)}, expected "
                             f"[layers, {len(positions)} tokens, top-k slots]")
        if ids.shape[2] < meta.top_k:
            raise TraceError(f"{where}: the recorder kept {ids.shape[2]} experts per token, the model routes to "
                             f"top-{meta.top_k}")
        ids = ids[:, :, :meta.top_k].astype(np.int64)
        if p2l is not None:
            if p2l.ndim != 2 or p2l.shape[0] != ids.shape[0]:
                raise TraceError(f"{path}: last_physical_to_logical_map has shape {list(p2l.shape)}, records "
                                 f"{ids.shape[0]} layers")
            valid = ids >= 0
            mapped = np.take_along_axis(p2l, np.where(valid, ids, 0).reshape(ids.shape[0], -1), axis=1)
            ids = np.where(valid, mapped.reshape(ids.shape), ids)
        tokens = np.transpose(ids, (1, 0, 2))  # [tokens, layers, k]
        tokens = _moe_rows(tokens, meta, f"{where} topk_ids_of_layer", extra_k_ok=False)
        if mode == SGLANG_EXTEND:
            lens = [int(x) for x in rec.get("extend_seq_lens") or []]
            if sum(lens) != len(positions):
                raise TraceError(f"{where}: extend_seq_lens {lens} do not add up to {len(positions)} tokens")
            start = 0
            for s, n in enumerate(lens):
                pos = positions[start:start + n]
                if n and pos != list(range(pos[0], pos[0] + n)):
                    raise TraceError(f"{where}: positions of sequence {s} are not consecutive")
                if n:
                    yield f"{stem}#{rank}:{fp}:{s}", tokens[start:start + n], n, pos[0]
                start += n
        elif mode == SGLANG_DECODE:
            for t in range(len(positions)):
                yield f"{stem}#{rank}:{fp}:d{t}", tokens[t:t + 1], 0, positions[t]
        else:
            raise TraceError(f"{where}: forward_mode {mode} (mixed or idle) cannot be split into prefill and "
                             "decode rows; record without mixed chunked prefill")


def import_exports(source: str | os.PathLike, out_path: str | os.PathLike, meta: TraceMeta, *,
                   heldout_fraction: float | None = None, domains: Mapping[str, str] | None = None) -> ImportReport:
    """Write the trace from every engine export ``source`` names (a file or a folder); see the
    module docstring for the formats and how domain, split and phase are filled."""
    root = Path(source)
    files = export_files(root)
    kinds = set()
    meta = TraceMeta(meta.model, meta.num_layers, meta.num_experts, meta.top_k, list(meta.moe_layers),
                     f"engine exports {root.name}")
    seen_passes: set = set()
    with_split = heldout_fraction is not None
    with TraceWriter(out_path, meta, with_weight=False, with_split=with_split) as w:
        def add(rid, domain, experts, npt, where, first_position=0):
            split = split_of(rid, heldout_fraction) if with_split else None
            w.add(RequestRows(rid, domain, experts, npt, None, split, first_position), where)

        for path in files:
            if path.suffix == ".pt":
                kinds.add("sglang recorder")
                domain = domain_for(path, root, domains)
                for rid, ex, npt, first in sglang_recorder_requests(path, meta, seen_passes):
                    add(rid, domain, ex, npt, f"{path} {rid}", first)
                continue
            for where, obj in _json_objects(path):
                if not isinstance(obj, Mapping):
                    raise TraceError(f"{where}: expected a JSON object")
                if "trace_meta" in obj:
                    continue  # the container's header; the model's shape comes from its config.json
                domain = domain_for(path, root, domains, obj.get("domain"))
                if "choices" in obj:
                    kinds.add("vllm response")
                    for rid, ex, npt in vllm_response_requests(obj, meta, where):
                        add(rid, domain, ex, npt, where)
                elif "meta_info" in obj:
                    kinds.add("sglang response")
                    rid, ex, npt, first = sglang_response_request(obj, meta, where)
                    add(rid, domain, ex, npt, where, first)
                elif "routed_experts" in obj and "id" in obj:
                    kinds.add("container")
                    rid, ex, npt = _legacy_line(obj, meta, where)
                    add(rid, domain, ex, npt, where)
                else:
                    raise TraceError(f"{where}: not a vLLM response (choices), an SGLang response (meta_info) or "
                                     "a routed-experts line (id, num_prompt_tokens, routed_experts)")
        report = ImportReport(Path(out_path), w.requests_written, w.rows_written, w.cached_tokens_skipped)
    print(f"{root}: imported {len(files)} file(s) ({', '.join(sorted(kinds))}): {report.requests} requests, "
          f"{report.rows} rows", file=sys.stderr)
    return report


# --------------------------------------------------------------------------------------------
# the JSONL containers (vLLM / SGLang, one request a line) and import_trace, the routing stage's import


def _read_export_lines(export_path: Path) -> Iterator[tuple[int, dict]]:
    with open(export_path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{export_path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{export_path}:{lineno}: expected a JSON object per line")
            yield lineno, obj


def _meta_from_header(obj: dict, where: str, source: str) -> TraceMeta:
    h = obj["trace_meta"]
    try:
        meta = TraceMeta(str(h["model"]), int(h["num_layers"]), int(h["num_experts"]), int(h["top_k"]),
                         [int(x) for x in h["moe_layers"]], source)
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{where}: trace_meta header needs model, num_layers, num_experts, top_k, moe_layers ({e})") from None
    meta.check(where)
    return meta


def _import(export_path: str | os.PathLike, out_path: str | os.PathLike, meta: TraceMeta | None,
            heldout_fraction: float | None, kind: str, decode_line) -> ImportReport:
    export_path = Path(export_path)
    if not export_path.exists():
        raise TraceError(f"{export_path}: {kind} export not found")
    lines = _read_export_lines(export_path)
    first = next(lines, None)
    if first is None:
        raise TraceError(f"{export_path}: empty {kind} export")
    source = f"{kind} export {export_path.name}"
    if "trace_meta" in first[1]:
        header = _meta_from_header(first[1], f"{export_path}:{first[0]}", source)
        if meta is not None:
            check_meta_against_model(header, meta, f"{export_path}:{first[0]} (trace_meta header vs the given model)")
        meta = header
        first = next(lines, None)
    if first is None:
        raise TraceError(f"{export_path}: no request lines in the {kind} export")
    # Splits come from the export on every line or on none. With none, the trace gets no split
    # column (the statistics assign splits by split_of with their heldout_fraction), unless
    # heldout_fraction is given here: then the column holds split_of(id, heldout_fraction).
    export_splits = "split" in first[1]
    with_split = export_splits or heldout_fraction is not None
    if meta is None:
        raise TraceError(f"{export_path}: no trace_meta header line and no model metadata given")
    meta = TraceMeta(meta.model, meta.num_layers, meta.num_experts, meta.top_k, list(meta.moe_layers), source)

    def requests():
        yield first
        yield from lines

    with TraceWriter(out_path, meta, with_weight=False, with_split=with_split) as w:
        for lineno, obj in requests():
            where = f"{export_path}:{lineno}"
            for key in ("id", "num_prompt_tokens", "routed_experts"):
                if key not in obj:
                    raise TraceError(f"{where}: missing field {key!r}")
            rid = str(obj["id"])
            domain = str(obj.get("domain", "default"))
            npt = obj["num_prompt_tokens"]
            if not isinstance(npt, int) or npt < 0:
                raise TraceError(f"{where}: num_prompt_tokens must be a non-negative integer, got {npt!r}")
            if ("split" in obj) != export_splits:
                raise TraceError(f"{where}: field 'split' must be on every request line or on none "
                                 f"(line {first[0]} {'has' if export_splits else 'lacks'} it)")
            split = obj.get("split")
            if split is None and heldout_fraction is not None:
                split = split_of(rid, heldout_fraction)
            elif export_splits and split not in SPLITS:
                raise TraceError(f"{where}: field 'split' is {split!r}, expected one of {list(SPLITS)}")
            experts = decode_line(obj, meta, where)
            w.add(RequestRows(rid, domain, experts, npt, None, split), where)
        report = ImportReport(Path(out_path), w.requests_written, w.rows_written, w.cached_tokens_skipped)
    if report.cached_prefix_tokens_skipped:
        print(f"{export_path}: skipped {report.cached_prefix_tokens_skipped} cached-prefix tokens (rows of -1)",
              file=sys.stderr)
    return report


def import_vllm(export_path: str | os.PathLike, out_path: str | os.PathLike,
                meta: TraceMeta | None = None, heldout_fraction: float | None = None) -> ImportReport:
    """Convert a vLLM routed-experts export (JSONL) into a trace.

    Container, one JSON object per line::

        {"id": "agent-0001", "domain": "agent", "num_prompt_tokens": 57,
         "routed_experts": [[[e, ...] * top_k] * num_moe_layers] * tokens,
         "split": "profile"}                              # split optional

    ``routed_experts`` is what vLLM returns per request with ``--enable-return-routed-experts``
    (int16 ``[tokens, moe_layers, k]``, or uint8 for <= 256 experts), as nested lists: prompt
    rows first, then generated rows. Prompt tokens served from vLLM's prefix cache are rows of
    -1: they are skipped, counted, and the count is returned and stored in the trace metadata
    (``cached_prefix_tokens_skipped``). The model shape comes from ``meta`` or an optional
    first line ``{"trace_meta": {"model", "num_layers", "num_experts", "top_k", "moe_layers"}}``
    (both given: they must agree). ``split`` is on every line or on none; with none, the trace
    holds ``split_of(id, heldout_fraction)`` if ``heldout_fraction`` is given, else no split
    column (readers then split requests by :func:`split_of` with their own fraction).
    """

    def decode(obj: dict, meta: TraceMeta, where: str) -> np.ndarray:
        try:
            arr = np.asarray(obj["routed_experts"], dtype=np.int64)
        except (ValueError, TypeError) as e:
            raise TraceError(f"{where}: field 'routed_experts' is not a rectangular integer array ({e})") from None
        if arr.ndim == 1 and arr.size == 0:
            arr = arr.reshape(0, meta.num_moe_layers, meta.top_k)
        if arr.ndim != 3 or arr.shape[1:] != (meta.num_moe_layers, meta.top_k):
            raise TraceError(f"{where}: field 'routed_experts' has shape {list(arr.shape)}, expected "
                             f"[tokens, {meta.num_moe_layers}, {meta.top_k}]")
        return arr

    return _import(export_path, out_path, meta, heldout_fraction, "vllm", decode)


def import_sglang(export_path: str | os.PathLike, out_path: str | os.PathLike,
                  meta: TraceMeta | None = None, heldout_fraction: float | None = None) -> ImportReport:
    """Convert an SGLang routed-experts export (JSONL) into a trace.

    Container, one JSON object per line::

        {"id": "...", "domain": "...", "num_prompt_tokens": 57,
         "routed_experts": "<base64 of little-endian int32 [tokens, layers, k]>",
         "shape": [tokens, layers, k], "split": "heldout"}   # shape and split optional

    ``layers`` is either the number of MoE layers or every layer of the model (then the rows of
    the MoE layers, ``moe_layers``, are taken). Without ``shape`` the array is read as
    ``[-1, num_moe_layers, top_k]``. Whole tokens of -1 (cached prefix) are skipped and counted as
    in :func:`import_vllm`.
    """

    def decode(obj: dict, meta: TraceMeta, where: str) -> np.ndarray:
        b64 = obj["routed_experts"]
        if not isinstance(b64, str):
            raise TraceError(f"{where}: field 'routed_experts' must be a base64 string")
        try:
            raw = base64.b64decode(b64, validate=True)
        except ValueError as e:
            raise TraceError(f"{where}: field 'routed_experts' is not valid base64 ({e})") from None
        if len(raw) % 4:
            raise TraceError(f"{where}: field 'routed_experts' decodes to {len(raw)} bytes, not a multiple of 4 (int32)")
        flat = np.frombuffer(raw, dtype="<i4")
        shape = obj.get("shape")
        L, k = meta.num_moe_layers, meta.top_k
        if shape is None:
            shape = [-1, L, k]
            if flat.size % (L * k):
                raise TraceError(f"{where}: {flat.size} int32 values do not divide into [tokens, {L}, {k}]")
        try:
            arr = flat.reshape(shape)
        except (ValueError, TypeError) as e:
            raise TraceError(f"{where}: field 'shape' {shape} does not fit {flat.size} int32 values ({e})") from None
        if arr.ndim != 3 or arr.shape[2] != k:
            raise TraceError(f"{where}: array shape {list(arr.shape)}, expected [tokens, layers, {k}]")
        if arr.shape[1] == meta.num_layers and meta.num_layers != L:
            arr = arr[:, meta.moe_layers, :]
        elif arr.shape[1] != L:
            raise TraceError(f"{where}: array has {arr.shape[1]} layers; expected {L} (MoE layers) or "
                             f"{meta.num_layers} (all layers)")
        return arr

    return _import(export_path, out_path, meta, heldout_fraction, "sglang", decode)


def import_trace(source: str | os.PathLike, out_path: str | os.PathLike, *, kind: str = "auto",
                 expect: Any = None, model_name: str | None = None,
                 heldout_fraction: float | None = None, domains: dict[str, str] | None = None) -> ImportReport:
    """The ``routing`` stage when config names an existing trace (``routing.trace``).

    ``kind``: ``parquet`` or ``coldset`` (a trace in this format: validated in full, then copied), ``vllm`` or
    ``sglang`` (a JSONL export, see :func:`import_vllm` / :func:`import_sglang`), or ``auto``
    (by suffix ``.parquet``; for JSONL by the first request's ``routed_experts``: nested lists
    = vLLM, a string = SGLang). ``expect`` (the pipeline's ModelConfig) is checked against the
    trace's model shape and, for exports without a ``trace_meta`` header, supplies it
    (``model_name`` names the model then).
    """
    import shutil

    source, out_path = Path(source), Path(out_path)
    if kind != "parquet" and is_engine_export(source):
        # A folder, or what vLLM / SGLang write today (coldset.importers); domains per file.
        if expect is None:
            raise TraceError(f"{source}: engine exports carry no model shape; set model.path to the model's "
                             "folder (its config.json is enough)")
        return import_exports(source, out_path, TraceMeta.from_model_config(expect, model_name or "model", ""),
                                        heldout_fraction=heldout_fraction, domains=domains)
    if not source.is_file():
        raise TraceError(f"{source}: routing trace not found")
    kind = "parquet" if kind == "coldset" else kind  # config's name for this package's format
    if kind == "auto":
        if source.suffix == ".parquet":
            kind = "parquet"
        else:
            kind = ""
            for lineno, obj in _read_export_lines(source):
                if "trace_meta" in obj:
                    continue
                value = obj.get("routed_experts")
                kind = "vllm" if isinstance(value, list) else "sglang" if isinstance(value, str) else ""
                if not kind:
                    raise TraceError(f"{source}:{lineno}: field 'routed_experts' is neither nested lists (vLLM) "
                                     "nor a base64 string (SGLang)")
                break
            if not kind:
                raise TraceError(f"{source}: no request lines to import")
    if kind == "parquet":
        meta = validate_trace(source, expect)
        rows = pq.ParquetFile(source).metadata.num_rows
        requests = set()
        for batch in iter_trace_batches(source, ["request"], validate=False):
            col = batch.column("request")
            used = col.dictionary.take(pc.unique(col.indices)) if pa.types.is_dictionary(col.type) else pc.unique(col)
            requests.update(used.to_pylist())
        out_path.parent.mkdir(parents=True, exist_ok=True)
        remove_orphans(out_path)
        fd, tmp = tempfile.mkstemp(prefix=out_path.name + ".", suffix=".tmp", dir=out_path.parent)
        os.close(fd)
        try:
            shutil.copyfile(source, tmp)
            share_mode(tmp)
            os.replace(tmp, out_path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return ImportReport(out_path, len(requests), rows, int(meta.extra.get("cached_prefix_tokens_skipped", 0)))
    if kind not in ("vllm", "sglang"):
        raise TraceError(f"unknown trace kind {kind!r}; one of auto, parquet, vllm, sglang")
    meta = None
    if expect is not None:
        meta = TraceMeta.from_model_config(expect, model_name or "model", "")
    importer = import_vllm if kind == "vllm" else import_sglang
    return importer(source, out_path, meta, heldout_fraction)
