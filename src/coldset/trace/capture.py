"""Routing capture from the embedded engine: decode the fixtures and write the trace (docs/design.md §2).

The trace's format, writer, reader and validation live in :mod:`coldset.core.trace`; the importers of
vLLM / SGLang exports and of existing traces in :mod:`coldset.trace.importers`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from coldset.core.trace import RequestRows, TraceError, TraceMeta, TraceWriter
from coldset.engine.generate import check_prompts_fit, encode_prompts, generate
from coldset.engine.loading import load_model, load_tokenizer
from coldset.trace.fixtures import read_fixtures

def capture_routing_engine(model, tokenizer, fixtures_paths: Sequence[str | os.PathLike],
                           out_path: str | os.PathLike, batch_size: int = 8, *, model_name: str,
                           max_new_tokens: int | None = None, source_detail: str | None = None,
                           progress: bool = True) -> Path:
    """Run a loaded embedded engine (``model``, ``tokenizer``) over the fixtures and write the routing trace.

    The one capture: the pipeline passes the engine it holds (loaded from a folder or built in
    memory), so a 61 GB model is made once per process. Routing comes from the model as it
    stands (its current pools and ``experts_fn``). Prompts are tokenized with ``tokenizer`` and
    decoded greedily in batches of ``batch_size`` (fixtures grouped by their ``max_new_tokens``,
    or all with ``max_new_tokens`` if given, and batched in order of prompt length). Prefill rows
    are the prompt tokens; decode rows are the generated tokens that were fed back (the last
    generated token never is). Each row keeps the fixture's split and the router's weight. Layer
    numbers are the model's layer indices. ``source_detail`` is added to the trace's ``source``.
    """
    fixtures = read_fixtures(fixtures_paths)
    if not fixtures:
        raise TraceError(f"no fixtures in {[str(p) for p in fixtures_paths]}")
    dtype_name = str(model.dtype).removeprefix("torch.")
    detail = f", {source_detail}" if source_detail else ""
    meta = TraceMeta.from_model_config(model.config, model_name,
                                       f"coldset embedded engine ({model.device.type}, {dtype_name}{detail})")
    all_ids = encode_prompts(tokenizer, [fx.prompt for fx in fixtures])
    groups: dict[int, list] = {}
    for fx, ids in zip(fixtures, all_ids):
        if not ids:
            raise TraceError(f"fixture {fx.id!r}: the prompt tokenizes to nothing")
        groups.setdefault(max_new_tokens or fx.max_new_tokens, []).append((fx, ids))
    for n_new, items in groups.items():  # before any decode: an over-long prompt is named by its id
        check_prompts_fit(model.config, [fx.id for fx, _ in items], [ids for _, ids in items], n_new)
    with TraceWriter(out_path, meta, with_weight=True, with_split=True) as w:
        bar = _progress(len(fixtures), "capture routing", progress)
        for n_new, items in groups.items():
            # similar lengths share a batch: less left padding to compute and mask
            items.sort(key=lambda item: len(item[1]))
            for start in range(0, len(items), batch_size):
                chunk = items[start:start + batch_size]
                gen = generate(model, [ids for _, ids in chunk], n_new, capture_routing=True, progress=False)
                for (fx, _), rr in zip(chunk, gen.routing):
                    w.add(RequestRows(fx.id, fx.domain, np.asarray(rr.experts), int(rr.num_prompt_tokens),
                                      np.asarray(rr.weights, dtype=np.float32), fx.split), f"fixture {fx.id!r}")
                bar.update(len(chunk))
        bar.close()
    return Path(out_path)


def capture_routing(model_dir: str | os.PathLike, fixtures_paths: Sequence[str | os.PathLike],
                    out_path: str | os.PathLike, device: str = "cpu", dtype: Any = "float32",
                    batch_size: int = 8, *, model_name: str | None = None,
                    max_new_tokens: int | None = None, progress: bool = True) -> Path:
    """Load the HF folder ``model_dir`` and :func:`capture_routing_engine` with it (tests, scripts).

    ``device`` is ``cpu``, ``cuda`` or ``auto``; ``dtype`` a torch dtype or its name.
    """
    model_dir = Path(model_dir)
    if not read_fixtures(fixtures_paths):  # before loading the model: fail fast
        raise TraceError(f"no fixtures in {[str(p) for p in fixtures_paths]}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype name (float32, bfloat16, float16)")
    mdl = load_model(model_dir, device=device, dtype=torch_dtype)
    return capture_routing_engine(mdl, load_tokenizer(model_dir), fixtures_paths, out_path, batch_size,
                                  model_name=model_name or model_dir.name, max_new_tokens=max_new_tokens,
                                  progress=progress)


def _progress(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, unit="req")

