"""Routing traces others have published, in their own formats: read request by request into the
trace's rows (docs/design.md §2) by :func:`coldset.trace.importers.import_exports`.

The traces released with Yu et al., "Patterns behind Chaos: Forecasting Data Movement for Efficient
Large-Scale MoE LLM Inference" (arXiv:2510.05497; Hugging Face dataset
``core12345/MoE_expert_selection_trace``, ``profiling_result/{org}/{model}/{benchmark}/{subject}/
{n}.json``) hold one request per file: a list whose element 0 is the prompt's forward pass and every
later element one decoded token's, each an object ``{layer: [[expert, ...] per token] | null}``
keyed by the model's layer number (null for dense layers). Checked against the subset mirrored in
andronius-yang/cse223b-proj at c5a3d17 (traffic-gen/llama4-mmlu-*/, 387 Llama-4-Maverick MMLU
requests): every request's experts, positions, layers and phases equal the team's converted trace
(../shared/data/traces/llama4-maverick-mmlu.parquet).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from coldset.core.trace import TraceError, TraceMeta

RELEASE_KIND = "per-request layer steps (arXiv:2510.05497)"


def is_layer_step(obj: Any) -> bool:
    """An object keyed by layer number (``{"0": null, "1": [[expert, ...], ...], ...}``)."""
    return isinstance(obj, Mapping) and bool(obj) and all(isinstance(k, str) and k.isdigit() for k in obj)


def release_steps(path: Path) -> list | None:
    """The steps of one request file of the arXiv:2510.05497 release (module doc), or None when
    ``path`` holds something else (an engine's export)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, list) and doc and is_layer_step(doc[0]) else None


def release_request(steps: list, meta: TraceMeta, where: str) -> tuple[np.ndarray, int]:
    """``[tokens, num_moe_layers, top_k]`` experts and the prompt's token count from
    :func:`release_steps`' list: element 0's tokens are the prompt (prefill), each later element
    one decode token. Every element must route exactly the model's MoE layers, each token to
    ``top_k`` experts; errors name the file, the element and what differs."""
    moe = list(meta.moe_layers)
    parts = []
    for i, step in enumerate(steps):
        at = f"{where}[{i}]"
        if not is_layer_step(step):
            raise TraceError(f"{at}: expected an object of layer -> experts per token, got {type(step).__name__}")
        routed = sorted(int(k) for k, v in step.items() if v is not None)
        if routed != moe:
            raise TraceError(f"{at}: routed layers {routed} are not the model's MoE layers {moe}")
        try:
            arr = np.asarray([step[str(layer)] for layer in moe], dtype=np.int64)  # [layers, tokens, k]
        except (ValueError, TypeError) as e:
            raise TraceError(f"{at}: layers disagree on the number of tokens or experts per token ({e})") from None
        if arr.ndim != 3 or arr.shape[2] != meta.top_k:
            raise TraceError(f"{at}: {arr.shape[-1] if arr.ndim == 3 else 'no list of'} experts per token; "
                             f"the model's top_k is {meta.top_k}")
        if i > 0 and arr.shape[1] != 1:
            raise TraceError(f"{at}: a decode step holds {arr.shape[1]} tokens, expected 1")
        parts.append(arr.transpose(1, 0, 2))
    return np.concatenate(parts), int(parts[0].shape[0])
