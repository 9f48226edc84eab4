"""Routing from the serving engines, as they write it today, into the trace (docs/design.md §2).

``routing.trace`` may name one file or a folder of them (every ``.json``, ``.jsonl`` and ``.pt``
below it, in name order); each file is read in the format its content shows:

- **vLLM OpenAI response** (``python -m vllm.entrypoints.openai.api_server
  --enable-return-routed-experts``, a GPU build: the PyPI CPU build has no ``vllm serve`` and
  refuses the flag; a completions or chat response saved as JSON, one per file or one per line):
  ``choices[i].routed_experts`` is the base64 of an ``.npy`` file, ``[prompt + completion - 1 -
  routed_experts_prompt_start, layers, top_k]`` uint8 or uint16 (the last sampled token is never
  forwarded), checked row for row against that count. A choice's prompt and completion lengths
  come from its ``prompt_token_ids`` / ``token_ids`` (the request's ``return_token_ids: true``;
  a chat response's ``prompt_token_ids`` is top-level; ``token_ids`` of an ``echo`` request hold
  the prompt too, told apart by the row count), else from ``usage`` when the response has one
  choice (or is a chat response, whose choices share one prompt). A completions response with
  several choices and no token ids is refused: its ``usage.prompt_tokens`` is the total over its
  prompts. vLLM does not echo ``routed_experts_prompt_start`` (it drops that many prompt rows):
  save it in the response object as ``"routed_experts_prompt_start": N`` and the rows import at
  positions ``N..``; a response whose rows fall short without it is refused, saying so. ``id``
  (and the choice index when there are several) names the request.
- **vLLM offline** (``LLM.generate``): ``RequestOutput.outputs[i].routed_experts`` is the same
  array (every layer of the model in vLLM 0.32, zero rows for dense layers); write one JSON line
  per request, ``{"id": f"{run}-{out.request_id}", "num_prompt_tokens": len(out.prompt_token_ids),
  "routed_experts": out.outputs[0].routed_experts.tolist()}``. vLLM numbers offline requests from 0
  in each ``LLM`` instance: prefix the ids with something unique to the run (``run``), else two
  runs' files repeat ids and the import is refused. The same reader takes such a ``.jsonl`` named
  as ``routing.trace`` or inside a folder (:func:`import_exports`; :func:`import_vllm` and
  :func:`import_sglang` are that reader for one file with an optional ``trace_meta`` header).
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

- **The traces released with arXiv:2510.05497** (Hugging Face dataset
  ``core12345/MoE_expert_selection_trace``; :mod:`coldset.trace.published`): one request per
  ``.json`` file, named by its path inside the folder without the suffix (``anatomy/17``), its
  domain by default the file's folder (the subject).

``layers`` may be the MoE layers or every layer of the model (then the MoE layers' rows are
taken). What the exports lack is filled so: ``domain`` from ``routing.trace_domains`` (a glob
over the file's path inside the folder, or its name, to a domain; first match wins), else a
``domain`` field of the line, else the file's name without suffix; ``split`` by
:func:`coldset.core.trace.split_of` over the request id; ``phase`` from the prompt length (rows
before it are prefill).
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import io
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from coldset.core.files import jsonl_records, remove_orphans, share_mode
from coldset.trace.published import RELEASE_KIND, is_layer_step, release_request, release_steps
from coldset.core.trace import (SPLITS, ImportReport, RequestRows, TraceError, TraceMeta, TraceWriter,
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
            return isinstance(obj, Mapping) and ("choices" in obj or "meta_info" in obj or is_layer_step(obj))
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


_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def _b64(value: Any, where: str, what: str = "") -> bytes:
    """Decode base64, telling a cut-off string (a partial 4-character group) from a damaged one.
    Messages read ``{where}: {what}...`` (``what`` e.g. ``"field 'routed_experts' is "``)."""
    if not isinstance(value, str):
        raise TraceError(f"{where}: {what}expected a base64 string, got {type(value).__name__}")
    if _BASE64.fullmatch(value) and len(value) % 4:
        raise TraceError(f"{where}: {what}truncated base64: {len(value)} characters end inside a 4-character group "
                         "(the saved response was cut off)")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise TraceError(f"{where}: {what}not valid base64 ({e})") from None


def _npy(raw: bytes, where: str) -> np.ndarray:
    """An ``.npy`` payload; a cut-off one is reported as truncated, with the bytes it lacks."""
    buf = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(buf)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, _, dtype = read_header(buf)
    except (ValueError, EOFError) as e:
        if raw[:6] == b"\x93NUMPY" or b"\x93NUMPY".startswith(raw):
            raise TraceError(f"{where}: truncated .npy payload: {len(raw)} bytes end inside its header") from None
        raise TraceError(f"{where}: not an .npy payload ({e})") from None
    need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    have = len(raw) - buf.tell()
    if have < need:
        raise TraceError(f"{where}: truncated .npy payload: its header says {dtype} {list(shape)} ({need} bytes of "
                         f"data), the payload holds {have} (the saved response was cut off)")
    try:
        return np.load(io.BytesIO(raw), allow_pickle=False)
    except ValueError as e:
        raise TraceError(f"{where}: not an .npy payload ({e})") from None


def _int_field(obj: Mapping, key: str, where: str) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TraceError(f"{where}: field {key!r} must be a non-negative integer, got {v!r}")
    return v


def _token_ids(value: Any, where: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise TraceError(f"{where}: expected a list of token ids")
    return value


def _vllm_choice_lengths(obj: Mapping, choice: Mapping, n_choices: int, rows: int, start: int,
                         where: str) -> tuple[int, int]:
    """``(prompt, completion)`` tokens of one choice of a vLLM response (see the module doc)."""
    usage = obj.get("usage")
    chat = str(obj.get("object", "")).startswith("chat.completion")
    prompt_ids = _token_ids(choice.get("prompt_token_ids"), f"{where}.prompt_token_ids")
    if prompt_ids is None:
        prompt_ids = _token_ids(obj.get("prompt_token_ids"), f"{where} (response) prompt_token_ids")
    out_ids = _token_ids(choice.get("token_ids"), f"{where}.token_ids")
    if (prompt_ids is None or out_ids is None) and n_choices > 1 and not (chat and out_ids is not None):
        total = usage.get("prompt_tokens") if isinstance(usage, Mapping) else None
        raise TraceError(f"{where}: a {'chat' if chat else 'completions'} response with {n_choices} choices and no "
                         f"per-choice token ids: usage.prompt_tokens ({total}) is the total over the request's "
                         f"{n_choices} prompts (or one prompt, counted once), usage.completion_tokens the total "
                         "over its choices, so a choice's own lengths are unknown; send return_token_ids: true "
                         "(each choice then carries prompt_token_ids and token_ids) or one prompt per request")
    if prompt_ids is not None:
        prompt = len(prompt_ids)
    else:
        if not isinstance(usage, Mapping):
            raise TraceError(f"{where}: a vLLM response needs 'usage' (prompt_tokens) or the choice's prompt_token_ids")
        prompt = _int_field(usage, "prompt_tokens", f"{where} usage")
    if out_ids is None:
        if not isinstance(usage, Mapping):
            raise TraceError(f"{where}: a vLLM response needs 'usage' (completion_tokens) or the choice's token_ids")
        return prompt, _int_field(usage, "completion_tokens", f"{where} usage")
    completion = len(out_ids)
    # echo: token_ids hold the prompt, then the completion; the row count tells which reading holds
    if (prompt_ids is not None and completion >= prompt and out_ids[:prompt] == prompt_ids
            and rows == completion - 1 - start):
        completion -= prompt
    return prompt, completion


def vllm_response_requests(obj: Mapping, meta: TraceMeta, where: str) -> Iterator[tuple[str, np.ndarray, int, int]]:
    """``(request id, experts [rows, moe_layers, k], prompt rows, first position)`` per choice of a
    vLLM response, rows checked against prompt + completion - 1 - routed_experts_prompt_start."""
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        raise TraceError(f"{where}: a vLLM response needs a non-empty 'choices' list")
    start = obj.get("routed_experts_prompt_start", 0)
    for i, choice in enumerate(choices):
        chw = f"{where} choices[{i}]"
        cw = f"{chw}.routed_experts"
        if not isinstance(choice, Mapping) or choice.get("routed_experts") is None:
            raise TraceError(f"{cw}: missing (start vLLM with --enable-return-routed-experts)")
        arr = _npy(_b64(choice["routed_experts"], cw), cw)
        if arr.dtype.kind not in "iu":
            raise TraceError(f"{cw}: dtype {arr.dtype}, expected integers")
        if arr.ndim < 1:
            raise TraceError(f"{cw}: a scalar, expected [tokens, layers, top_k]")
        prompt, completion = _vllm_choice_lengths(obj, choice, len(choices), arr.shape[0],
                                                  start if isinstance(start, int) else 0, chw)
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= prompt:
            raise TraceError(f"{where}: routed_experts_prompt_start must be an integer in 0..{prompt}, got {start!r}")
        expect = prompt + completion - 1 - start
        if arr.shape[0] != expect:
            shown = f"prompt {prompt} + completion {completion} - 1 = {prompt + completion - 1}"
            if start:
                shown += f" - routed_experts_prompt_start {start} = {expect}"
            hint = ""
            if not start and 0 < arr.shape[0] < expect:
                hint = (f"; if the request set routed_experts_prompt_start (vLLM then drops that many prompt rows "
                        f"and does not echo the field), add \"routed_experts_prompt_start\": {expect - arr.shape[0]} "
                        f"to the saved response")
            raise TraceError(f"{cw}: {arr.shape[0]} rows, expected {shown}{hint}")
        rid = str(obj.get("id", "response")) + (f"/{choice.get('index', i)}" if len(choices) > 1 else "")
        yield rid, _moe_rows(arr, meta, cw, extra_k_ok=False), prompt - start, start


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
    """A JSON file's objects: the whole file (an object or a list of them), or one per line (always
    for ``.jsonl``, so every request is named by its line)."""
    if path.suffix != ".jsonl":
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            items = doc if isinstance(doc, list) else [doc]
            for i, item in enumerate(items):
                yield (f"{path}[{i}]" if isinstance(doc, list) else str(path)), item
            return
        except json.JSONDecodeError:
            pass
    yield from jsonl_records(path, TraceError)


def _container_line(obj: Mapping, meta: TraceMeta, where: str) -> tuple[str, np.ndarray, int]:
    """One request line ``{"id", "num_prompt_tokens", "routed_experts"}``: nested lists (vLLM's
    offline output) or the base64 of little-endian int32 with an optional ``shape`` (SGLang);
    ``[tokens, MoE layers or every layer, top_k]``."""
    for key in ("id", "num_prompt_tokens", "routed_experts"):
        if key not in obj:
            raise TraceError(f"{where}: missing field {key!r}")
    npt = obj["num_prompt_tokens"]
    if isinstance(npt, bool) or not isinstance(npt, int) or npt < 0:
        raise TraceError(f"{where}: num_prompt_tokens must be a non-negative integer, got {npt!r}")
    value = obj["routed_experts"]
    L, k = meta.num_moe_layers, meta.top_k
    if isinstance(value, list):
        try:
            arr = np.asarray(value, dtype=np.int64)
        except (ValueError, TypeError) as e:
            raise TraceError(f"{where}: field 'routed_experts' is not a rectangular integer array ({e})") from None
        if arr.ndim == 1 and arr.size == 0:
            arr = arr.reshape(0, L, k)
        if arr.ndim != 3 or arr.shape[2] != k or arr.shape[1] not in (L, meta.num_layers):
            every = f" or [tokens, {meta.num_layers}, {k}] (every layer)" if meta.num_layers != L else ""
            raise TraceError(f"{where}: field 'routed_experts' has shape {list(arr.shape)}, expected "
                             f"[tokens, {L}, {k}]{every}")
    elif isinstance(value, str):
        raw = _b64(value, where, "field 'routed_experts' is ")
        if len(raw) % 4:
            raise TraceError(f"{where}: field 'routed_experts' decodes to {len(raw)} bytes, not a multiple of 4 "
                             "(int32)")
        flat = np.frombuffer(raw, dtype="<i4")
        shape = obj.get("shape")
        if shape is None:
            if flat.size % (L * k):
                raise TraceError(f"{where}: {flat.size} int32 values do not divide into [tokens, {L}, {k}]")
            shape = [-1, L, k]
        try:
            arr = flat.reshape(shape)
        except (ValueError, TypeError) as e:
            raise TraceError(f"{where}: field 'shape' {shape} does not fit {flat.size} int32 values ({e})") from None
    else:
        raise TraceError(f"{where}: field 'routed_experts' must be nested lists (vLLM) or a base64 string (SGLang), "
                         f"got {type(value).__name__}")
    return str(obj["id"]), _moe_rows(arr, meta, f"{where} routed_experts", extra_k_ok=False), npt


def sglang_recorder_requests(path: Path, meta: TraceMeta, seen: set) -> Iterator[tuple[str, np.ndarray, int, int]]:
    """``(request id, experts, prompt tokens, first position)`` from a per_token recorder dump."""
    import torch  # torch-heavy: only for SGLang's .pt recorder dumps

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
            raise TraceError(f"{where}: missing or malformed field ({e}); expected a per_token recorder "
                             "record") from None
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


def _first_request(files: list[Path]) -> tuple[Mapping | None, str]:
    """The first request object of the first JSON export (its ``split`` decides whether splits come
    from the lines), and where it is."""
    for path in files:
        if path.suffix == ".pt":
            return None, str(path)
        for where, obj in _json_objects(path):
            if isinstance(obj, Mapping) and "trace_meta" in obj:
                continue
            return (obj if isinstance(obj, Mapping) else None), where
    return None, str(files[0])


def import_exports(source: str | os.PathLike, out_path: str | os.PathLike, meta: TraceMeta, *,
                   heldout_fraction: float | None = None, domains: Mapping[str, str] | None = None,
                   source_label: str | None = None) -> ImportReport:
    """Write the trace from every engine export ``source`` names (a file or a folder); see the
    module docstring for the formats and how domain, split and phase are filled.

    The one reader of engine exports, whether named alone or inside a folder. Request lines carry
    ``split`` on every line or on none (then ``split_of`` with ``heldout_fraction`` when given,
    else no split column); a request id appears once over all files; a ``trace_meta`` header line
    must agree with ``meta``; an export without requests is refused."""
    root = Path(source)
    files = export_files(root)
    kinds = set()
    meta = TraceMeta(meta.model, meta.num_layers, meta.num_experts, meta.top_k, list(meta.moe_layers),
                     source_label or f"engine exports {root.name}")
    seen_passes: set = set()
    first, first_where = _first_request(files)
    line_splits = first is not None and "split" in first
    with_split = line_splits or heldout_fraction is not None
    ids: dict[str, str] = {}
    with TraceWriter(out_path, meta, with_weight=False, with_split=with_split) as w:
        def add(rid, domain, experts, npt, where, first_position=0, line=None):
            if rid in ids:
                hint = ("; vLLM's offline request ids restart at 0 for each LLM instance: write ids unique across "
                        "runs, e.g. f\"{run}-{out.request_id}\"" if line is not None else "")
                raise TraceError(f"{where}: request id {rid!r} also in {ids[rid]}{hint}")
            ids[rid] = where
            has = line is not None and "split" in line
            if has != line_splits:
                raise TraceError(f"{where}: field 'split' must be on every request line or on none "
                                 f"({first_where} {'has' if line_splits else 'lacks'} it)")
            split = line.get("split") if has else None
            if has and split not in SPLITS:
                raise TraceError(f"{where}: field 'split' is {split!r}, expected one of {list(SPLITS)}")
            if split is None and heldout_fraction is not None:
                split = split_of(rid, heldout_fraction)
            w.add(RequestRows(rid, domain, experts, npt, None, split, first_position), where)

        for path in files:
            if path.suffix == ".pt":
                kinds.add("sglang recorder")
                domain = domain_for(path, root, domains)
                for rid, ex, npt, first_pos in sglang_recorder_requests(path, meta, seen_passes):
                    add(rid, domain, ex, npt, f"{path} {rid}", first_pos)
                continue
            steps = release_steps(path) if path.suffix == ".json" else None
            if steps is not None:  # the arXiv:2510.05497 release: one request per file (coldset.trace.published)
                kinds.add(RELEASE_KIND)
                rid = path.relative_to(root).with_suffix("").as_posix() if root in path.parents else path.stem
                experts, npt = release_request(steps, meta, str(path))
                add(rid, domain_for(path, root, domains, path.parent.name), experts, npt, str(path))
                continue
            for where, obj in _json_objects(path):
                if not isinstance(obj, Mapping):
                    raise TraceError(f"{where}: expected a JSON object")
                if "trace_meta" in obj:  # a container's header: the shape it names must be the model's
                    check_meta_against_model(_meta_from_header(obj, where, ""), meta,
                                             f"{where} (trace_meta header vs the model)")
                    continue
                domain = domain_for(path, root, domains, obj.get("domain"))
                if "choices" in obj:
                    kinds.add("vllm response")
                    for rid, ex, npt, first_pos in vllm_response_requests(obj, meta, where):
                        add(rid, domain, ex, npt, where, first_pos)
                elif "meta_info" in obj:
                    kinds.add("sglang response")
                    rid, ex, npt, first_pos = sglang_response_request(obj, meta, where)
                    add(rid, domain, ex, npt, where, first_pos)
                elif "routed_experts" in obj and "id" in obj:
                    kinds.add("request lines")
                    rid, ex, npt = _container_line(obj, meta, where)
                    add(rid, domain, ex, npt, where, 0, obj)
                else:
                    raise TraceError(f"{where}: not a vLLM response (choices), an SGLang response (meta_info) or "
                                     "a routed-experts line (id, num_prompt_tokens, routed_experts)")
        if not ids:
            raise TraceError(f"{root}: no request lines to import")
        report = ImportReport(Path(out_path), w.requests_written, w.rows_written, w.cached_tokens_skipped)
    print(f"{root}: imported {len(files)} file(s) ({', '.join(sorted(kinds))}): {report.requests} requests, "
          f"{report.rows} rows" + (f", {report.cached_prefix_tokens_skipped} cached-prefix tokens (rows of -1) "
                                   "skipped" if report.cached_prefix_tokens_skipped else ""), file=sys.stderr)
    return report


# --------------------------------------------------------------------------------------------
# the JSONL containers (vLLM / SGLang, one request a line) and import_trace, the routing stage's import


def _read_export_lines(export_path: Path) -> Iterator[tuple[str, dict]]:
    """An engine export's lines (:func:`coldset.core.files.jsonl_records`), each a JSON object:
    ``(f"{path}:{line}", object)``."""
    for where, obj in jsonl_records(export_path, TraceError):
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object per line")
        yield where, obj


def _meta_from_header(obj: dict, where: str, source: str) -> TraceMeta:
    h = obj["trace_meta"]
    try:
        meta = TraceMeta(str(h["model"]), int(h["num_layers"]), int(h["num_experts"]), int(h["top_k"]),
                         [int(x) for x in h["moe_layers"]], source)
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{where}: trace_meta header needs model, num_layers, num_experts, top_k, moe_layers "
                         f"({e})") from None
    meta.check(where)
    return meta


def _import_file(export_path: str | os.PathLike, out_path: str | os.PathLike, meta: TraceMeta | None,
                 heldout_fraction: float | None, kind: str) -> ImportReport:
    """One export file through :func:`import_exports`, its model shape from a ``trace_meta`` first
    line or ``meta`` (both given: they must agree)."""
    export_path = Path(export_path)
    if not export_path.is_file():
        raise TraceError(f"{export_path}: {kind} export not found")
    header = None
    for where, obj in _json_objects(export_path):
        if isinstance(obj, Mapping) and "trace_meta" in obj:
            header = _meta_from_header(obj, where, "")
            if meta is not None:
                check_meta_against_model(header, meta, f"{where} (trace_meta header vs the given model)")
        break
    meta = header or meta
    if meta is None:
        raise TraceError(f"{export_path}: no trace_meta header line and no model metadata given")
    return import_exports(export_path, out_path, meta, heldout_fraction=heldout_fraction,
                          source_label=f"{kind} export {export_path.name}")


def import_vllm(export_path: str | os.PathLike, out_path: str | os.PathLike,
                meta: TraceMeta | None = None, heldout_fraction: float | None = None) -> ImportReport:
    """Convert a file of vLLM routed-experts request lines (JSONL) into a trace.

    One JSON object per line, optionally after a header line ``{"trace_meta": {"model",
    "num_layers", "num_experts", "top_k", "moe_layers"}}`` (the model shape when ``meta`` is not
    given; both given, they must agree)::

        {"id": "run1-0", "domain": "agent", "num_prompt_tokens": 57,
         "routed_experts": [[[e, ...] * top_k] * layers] * tokens,
         "split": "profile"}                              # split optional

    ``routed_experts`` is vLLM's per-request output (``--enable-return-routed-experts``; uint8 for
    <= 256 experts), as nested lists, prompt rows first; ``layers`` every layer of the model (vLLM
    0.32: zero rows for dense layers, dropped here) or the MoE layers. Prompt tokens served from
    vLLM's prefix cache are rows of -1: skipped, counted, and the count is returned and stored in
    the trace metadata (``cached_prefix_tokens_skipped``). ``split`` is on every line or on none;
    with none, the trace holds ``split_of(id, heldout_fraction)`` if ``heldout_fraction`` is given,
    else no split column (readers then split requests by :func:`split_of` with their own fraction).
    The reader is :func:`import_exports`, the same as for such a file inside a folder.
    """
    return _import_file(export_path, out_path, meta, heldout_fraction, "vllm")


def import_sglang(export_path: str | os.PathLike, out_path: str | os.PathLike,
                  meta: TraceMeta | None = None, heldout_fraction: float | None = None) -> ImportReport:
    """Convert a file of SGLang routed-experts request lines (JSONL) into a trace.

    As :func:`import_vllm`, with ``routed_experts`` the base64 of little-endian int32 ``[tokens,
    layers, k]`` and an optional ``"shape": [tokens, layers, k]`` (without it the array is read as
    ``[-1, num_moe_layers, top_k]``)::

        {"id": "...", "domain": "...", "num_prompt_tokens": 57,
         "routed_experts": "<base64>", "shape": [tokens, layers, k], "split": "heldout"}
    """
    return _import_file(export_path, out_path, meta, heldout_fraction, "sglang")


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
    source, out_path = Path(source), Path(out_path)
    if kind != "parquet" and is_engine_export(source):
        # A folder, or what vLLM / SGLang write today (coldset.trace.importers); domains per file.
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
            for where, obj in _read_export_lines(source):
                if "trace_meta" in obj:
                    continue
                value = obj.get("routed_experts")
                kind = "vllm" if isinstance(value, list) else "sglang" if isinstance(value, str) else ""
                if not kind:
                    raise TraceError(f"{where}: field 'routed_experts' is neither nested lists (vLLM) "
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
