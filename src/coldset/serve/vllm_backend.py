"""Routing capture from a real vLLM engine (``routing.backend: vllm``).

Most users serve with vLLM, so the routing they profile should come from the engine they serve
with. This module starts ``vllm.LLM`` on a local HF checkpoint, decodes the fixtures greedily and
writes the docs/design.md §2 trace through :class:`coldset.core.trace.TraceWriter`, exactly as the
embedded capture does (same rows, same split and weight columns). Two capture methods:

``routed_experts``
    vLLM's own record (``enable_return_routed_experts``; vLLM 0.32/0.33): each finished
    ``CompletionOutput.routed_experts`` is ``[seq_len, layers, top_k]`` (uint8 when there are at
    most 256 experts), prompt rows first, then the generated tokens that were fed back (the last
    generated token never is, so ``seq_len = prompt + new - 1``, as in the embedded engine).
    ``layers`` is every layer of the model in vLLM 0.32 (rows of the MoE layers are taken) or
    the MoE layers only. Prompt tokens that an older vLLM reports as -1 (served from the prefix
    cache, never routed) are skipped and counted by the writer. vLLM needs Model Runner V2 and
    prefix caching for this output: GPU hosts have it, vLLM on CPU does not.

``router_hooks``
    Where the engine cannot return routing (vLLM on CPU), every fused MoE layer's router is
    wrapped in the worker through ``LLM.apply_model``: vLLM 0.32's ``MoERunner``
    (``model.layers.N.<block>.experts``) picks each token's experts with its ``router``'s
    ``select_experts`` (softmax top-k for qwen3_moe, mixtral and gpt_oss; grouped sigmoid top-k
    with the correction bias for glm4_moe), and the wrapper records the ids and weights it returns
    to the experts computation. A weight is the factor vLLM applies to that expert's output: the
    router's weight times the runner's ``routed_scaling_factor`` where the runner applies it
    (glm4_moe), as coldset's engine records it. The engine runs one request at a time (eager mode,
    prefix caching off so every prompt token is routed). The rows are vLLM's own choice, not a
    recomputation from the router logits.

The method used is written into the trace's ``source`` metadata and its ``capture_method`` key.
Before vLLM starts, :func:`coldset.serve.vllm_families.vllm_refusal` refuses a family coldset does
not run through vLLM, naming the reason; deepseek_v3 on vLLM's CPU build runs with vLLM's
``rotary_embedding`` custom op off (:data:`coldset.serve.vllm_families.CPU_DEEPSEEK_COMPILATION`:
that op rotates DeepSeek's RoPE half otherwise than transformers), and is refused if the caller's
``llm_kwargs`` turn it back on.
Prompts are tokenized with the checkpoint's ``tokenizer.json`` by :func:`coldset.engine.loading.load_tokenizer`
and handed to vLLM as token ids, so both engines see the same tokens. vLLM is imported lazily:
the package imports without it. vLLM starts worker processes; a script that calls this must
guard its entry point with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from coldset.core.files import atomic_path, read_json
from coldset.core.trace import RequestRows, TraceError, TraceMeta, TraceWriter
from coldset.engine.generate import encode_prompts
from coldset.engine.loading import load_tokenizer, read_config
from coldset.serve.vllm_families import CPU_DEEPSEEK_COMPILATION, rotary_op_refusal, vllm_refusal
from coldset.trace.fixtures import read_fixtures

METHODS = ("auto", "routed_experts", "router_hooks")
#: KV cache reserved by vLLM on CPU unless llm_kwargs say otherwise (fixtures are short).
CPU_KV_CACHE_BYTES = 512 << 20
#: vLLM 0.32's fused MoE layers (``MoERunner``) in its module tree: ``model.layers.N.mlp.experts``
#: (qwen3_moe, glm4_moe, gpt_oss), ``model.layers.N.block_sparse_moe.experts`` (mixtral).
MOE_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.[A-Za-z_]+\.experts$")


class VllmCaptureError(RuntimeError):
    """vLLM could not produce routing that fits the trace contract; the message says why."""


@dataclass
class VllmRequestResult:
    """One request as vLLM ran it: the tokens and the routing, before it becomes trace rows."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    experts: np.ndarray  # int32 [prompt + new - 1 - skipped, num_moe_layers, top_k]
    weights: np.ndarray | None  # float32, same shape (router_hooks only)
    first_position: int = 0


# --------------------------------------------------------------------------------------------
# worker side (runs inside vLLM's worker through LLM.apply_model; must be picklable)

_RECORDS: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
_WRAPPED: list[Any] = []  # the routers whose select_experts is wrapped


def _recording_select(layer: int, scale: float, select, *args, **kwargs):
    """The router's ``select_experts``, recording the ids and the weights (times ``scale``)."""
    topk_weights, topk_ids = select(*args, **kwargs)
    _RECORDS.setdefault(layer, []).append((topk_ids.detach().int().cpu().numpy(),
                                           (topk_weights.detach().float() * scale).cpu().numpy()))
    return topk_weights, topk_ids


def _install_router_hooks(model, *, num_experts: int, top_k: int) -> list[int]:
    """Wrap every fused MoE layer's router in ``model``; returns the model layer indices wrapped."""
    from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter  # optional dependency

    _remove_router_hooks(model)
    hooked = []
    for name, module in model.named_modules():
        m = MOE_LAYER_RE.search(name)
        router = getattr(module, "router", None)
        if m is None or not isinstance(router, FusedMoERouter):
            continue
        layer = int(m.group(1))
        if getattr(router, "global_num_experts", num_experts) != num_experts or getattr(router, "top_k", top_k) != top_k:
            raise RuntimeError(f"{name}: vLLM's router picks {router.top_k} of {router.global_num_experts} experts; "
                               f"the checkpoint's config says {top_k} of {num_experts}")
        scale = float(getattr(module, "routed_scaling_factor", 1.0))  # applied by the runner to the output
        router.select_experts = partial(_recording_select, layer, scale, router.select_experts)
        _WRAPPED.append(router)
        hooked.append(layer)
    return sorted(hooked)


def _remove_router_hooks(model=None) -> None:
    for router in _WRAPPED:
        vars(router).pop("select_experts", None)  # the class's method again
    _WRAPPED.clear()
    _RECORDS.clear()


def _take_records(model=None) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Each hooked layer's rows since the last take, concatenated over forward calls."""
    out = {}
    for layer, calls in _RECORDS.items():
        out[layer] = (np.concatenate([c[0] for c in calls]), np.concatenate([c[1] for c in calls]))
    _RECORDS.clear()
    return out


# --------------------------------------------------------------------------------------------
# driver side


def _engine_kwargs(model_dir: Path, dtype: str, max_model_len: int, method: str,
                   llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of vllm.LLM for ``method`` (the caller's ``llm_kwargs`` win)."""
    from vllm.platforms import current_platform  # optional dependency

    kwargs: dict[str, Any] = dict(model=str(model_dir), dtype=dtype, seed=0, skip_tokenizer_init=True,
                                  max_model_len=max_model_len)
    if method == "routed_experts":
        kwargs.update(enable_return_routed_experts=True, enable_prefix_caching=True)
    else:
        # eager: hooks fire on every call; no prefix cache: every prompt token is routed and seen
        kwargs.update(enforce_eager=True, enable_prefix_caching=False)
    if current_platform.is_cpu() and "kv_cache_memory_bytes" not in llm_kwargs and "gpu_memory_utilization" not in llm_kwargs:
        # vLLM on CPU otherwise reserves 92% of free RAM and refuses to start when page cache holds more
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    kwargs.update(llm_kwargs)
    return kwargs


def routed_experts_refusal(kwargs: dict[str, Any]) -> str | None:
    """Why this vLLM refuses ``enable_return_routed_experts`` with these LLM arguments, or None.

    Only builds the engine configuration (where vLLM checks Model Runner V2, prefix caching and
    the rest), so no model is loaded and a refusal costs a second, not an engine start.
    """
    from vllm.engine.arg_utils import EngineArgs  # optional dependency

    try:
        EngineArgs(**kwargs).create_engine_config()
    except ValueError as err:  # pydantic's ValidationError is a ValueError
        return str(err)
    return None


def _set_env_for_hooks() -> None:
    """apply_model sends a Python function to the worker: run the engine in this process
    (nothing to pickle) unless the user chose multiprocessing, which then needs vLLM's opt-in
    to pickled functions."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def _routed_rows(arr: np.ndarray, meta: TraceMeta, where: str) -> np.ndarray:
    """vLLM's routed_experts as int32 ``[tokens, num_moe_layers, top_k]``."""
    arr = np.asarray(arr)
    L, k = meta.num_moe_layers, meta.top_k
    if arr.ndim != 3 or arr.shape[2] != k:
        raise VllmCaptureError(f"{where}: routed_experts has shape {list(arr.shape)}, expected [tokens, layers, {k}]")
    if arr.dtype.kind not in "iu":
        raise VllmCaptureError(f"{where}: routed_experts has dtype {arr.dtype}, expected integers")
    arr = arr.astype(np.int32)
    if arr.shape[1] == meta.num_layers and meta.num_layers != L:
        arr = arr[:, meta.moe_layers, :]
    elif arr.shape[1] != L:
        raise VllmCaptureError(f"{where}: routed_experts has {arr.shape[1]} layers; expected {L} (MoE layers) "
                               f"or {meta.num_layers} (all layers)")
    return np.ascontiguousarray(arr)


def _run_routed_experts(llm, prompts: list[list[int]], new_tokens: list[int], meta: TraceMeta,
                        ids: list[str], progress: bool) -> list[VllmRequestResult]:
    from vllm import SamplingParams  # optional dependency
    from vllm.inputs import TokensPrompt  # optional dependency

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False,
                             routed_experts_prompt_start=0) for n in new_tokens]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=progress)
    results = []
    for rid, prompt, out in zip(ids, prompts, outs):
        comp = out.outputs[0]
        where = f"fixture {rid!r} (vLLM routed_experts)"
        if comp.routed_experts is None:
            raise VllmCaptureError(f"{where}: the engine returned no routed_experts although it accepted "
                                   "enable_return_routed_experts")
        experts = _routed_rows(comp.routed_experts, meta, where)
        expect = len(prompt) + len(comp.token_ids) - 1
        if experts.shape[0] != expect:
            raise VllmCaptureError(f"{where}: {experts.shape[0]} routed rows, expected prompt {len(prompt)} + "
                                   f"generated {len(comp.token_ids)} - 1 = {expect}")
        results.append(VllmRequestResult(list(prompt), list(comp.token_ids), experts, None))
    return results


def _run_router_hooks(llm, prompts: list[list[int]], new_tokens: list[int], meta: TraceMeta,
                      ids: list[str], progress: bool) -> list[VllmRequestResult]:
    from vllm import SamplingParams  # optional dependency
    from vllm.inputs import TokensPrompt  # optional dependency

    hooked = llm.apply_model(partial(_install_router_hooks, num_experts=meta.num_experts, top_k=meta.top_k))
    if len(hooked) != 1:
        raise VllmCaptureError(f"router hooks need exactly one model worker (tensor/pipeline parallel size 1); "
                               f"vLLM runs {len(hooked)}")
    if hooked[0] != list(meta.moe_layers):
        raise VllmCaptureError(f"router hooks found fused MoE routers on layers {hooked[0]}, but the checkpoint's MoE "
                               f"layers are {list(meta.moe_layers)} (module names matched by {MOE_LAYER_RE.pattern})")
    results = []
    try:
        llm.apply_model(_take_records)  # nothing from before this point
        for rid, prompt, n_new in tqdm(list(zip(ids, prompts, new_tokens)), desc="vLLM capture routing",
                                       unit="req", file=sys.stderr, disable=not progress):
            where = f"fixture {rid!r} (vLLM router hooks)"
            sp = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True, detokenize=False)
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
            token_ids = list(out.outputs[0].token_ids)
            rec = llm.apply_model(_take_records)[0]
            expect = len(prompt) + len(token_ids) - 1
            experts = np.empty((expect, meta.num_moe_layers, meta.top_k), dtype=np.int32)
            weights = np.empty(experts.shape, dtype=np.float32)
            for i, layer in enumerate(meta.moe_layers):
                if layer not in rec or rec[layer][0].shape[0] != expect:
                    got = rec[layer][0].shape[0] if layer in rec else 0
                    raise VllmCaptureError(f"{where}: the router of layer {layer} saw {got} tokens, expected prompt "
                                           f"{len(prompt)} + generated {len(token_ids)} - 1 = {expect}")
                experts[:, i], weights[:, i] = rec[layer]
            results.append(VllmRequestResult(list(prompt), token_ids, experts, weights))
    finally:
        llm.apply_model(_remove_router_hooks)
    return results


def capture_routing_vllm(model_dir: str | os.PathLike, fixtures_paths: Sequence[str | os.PathLike],
                         out_path: str | os.PathLike, *, dtype: str = "float32",
                         max_new_tokens: int | None = None, model_name: str | None = None,
                         method: str = "auto", tokens_out: str | os.PathLike | None = None,
                         llm_kwargs: dict[str, Any] | None = None, progress: bool = True) -> Path:
    """Run vLLM over the fixtures and write the routing trace (docs/design.md §2) to ``out_path``.

    ``dtype`` is vLLM's (``float32``, ``bfloat16``, ``float16``). Each fixture decodes
    greedily (temperature 0, EOS ignored) for its own ``max_new_tokens`` or, if given, for
    ``max_new_tokens``. ``method``: ``routed_experts``, ``router_hooks`` or ``auto`` (the
    engine's routed-experts output where it accepts ``enable_return_routed_experts``, else
    router hooks, said on stderr and in the trace's ``source``). ``tokens_out`` (optional) gets a
    JSONL of ``{"id", "prompt_token_ids", "token_ids"}`` per fixture, for cross-engine checks.
    ``llm_kwargs`` go to ``vllm.LLM`` (e.g. ``gpu_memory_utilization``, ``tensor_parallel_size``
    for ``routed_experts``). Rows carry the fixture's split and, with router hooks, the router
    weights; the routed-experts output has no weights, so that trace has no weight column.
    """
    if method not in METHODS:
        raise ValueError(f"method {method!r}: one of {METHODS}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {dtype!r}: one of float32, bfloat16, float16")
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    fixtures = read_fixtures(fixtures_paths)
    if not fixtures:
        raise TraceError(f"no fixtures in {[str(p) for p in fixtures_paths]}")
    tok = load_tokenizer(model_dir)
    prompts = encode_prompts(tok, [fx.prompt for fx in fixtures])
    for fx, ids in zip(fixtures, prompts):
        if not ids:
            raise TraceError(f"fixture {fx.id!r}: the prompt tokenizes to nothing")
    new_tokens = [int(max_new_tokens or fx.max_new_tokens) for fx in fixtures]
    if min(new_tokens) < 1:
        raise ValueError("max_new_tokens must be >= 1")
    max_len = max(len(p) + n for p, n in zip(prompts, new_tokens))
    if cfg.max_position_embeddings and max_len > cfg.max_position_embeddings:
        raise TraceError(f"a fixture needs {max_len} positions; {model_dir / 'config.json'} allows "
                         f"max_position_embeddings={cfg.max_position_embeddings}")
    meta = TraceMeta.from_model_config(cfg, model_name or model_dir.name, "")
    llm_kwargs = dict(llm_kwargs or {})
    fixture_ids = [fx.id for fx in fixtures]

    if method == "router_hooks":
        _set_env_for_hooks()
    import vllm  # optional dependency
    from vllm.platforms import current_platform  # optional dependency

    config_path = model_dir / "config.json"
    raw = read_json(config_path, "model config")
    refusal = vllm_refusal(raw, str(config_path))
    if refusal is not None:
        raise VllmCaptureError(f"vLLM {vllm.__version__} capture refused: {refusal}")
    if raw.get("model_type") == "deepseek_v3" and current_platform.is_cpu():
        llm_kwargs.setdefault("compilation_config", CPU_DEEPSEEK_COMPILATION)  # module doc
    chosen = method
    if method in ("auto", "routed_experts"):
        reason = routed_experts_refusal(_engine_kwargs(model_dir, dtype, max_len, "routed_experts", llm_kwargs))
        if reason is None:
            chosen = "routed_experts"
        elif method == "routed_experts":
            raise VllmCaptureError(f"vLLM {vllm.__version__} refuses enable_return_routed_experts: {reason}")
        else:
            print(f"vLLM {vllm.__version__} cannot return routed experts here ({reason}); capturing with router "
                  "hooks (the fused MoE routers' select_experts) instead", file=sys.stderr)
            chosen = "router_hooks"
            _set_env_for_hooks()
    from vllm import LLM  # optional dependency

    kwargs = _engine_kwargs(model_dir, dtype, max_len, chosen, llm_kwargs)
    eager = kwargs.get("enforce_eager", False)
    custom_ops = (kwargs.get("compilation_config") or {}).get("custom_ops") or (["all"] if eager else ["none"])
    refusal = rotary_op_refusal(raw.get("model_type"), custom_ops, current_platform.is_cpu())
    if refusal is not None:
        raise VllmCaptureError(f"vLLM {vllm.__version__} capture refused: {config_path}: {refusal}")
    llm = LLM(**kwargs)
    if chosen == "router_hooks":
        results = _run_router_hooks(llm, prompts, new_tokens, meta, fixture_ids, progress)
        how = "the fused MoE routers' select_experts via LLM.apply_model, one request at a time"
    else:
        results = _run_routed_experts(llm, prompts, new_tokens, meta, fixture_ids, progress)
        how = "CompletionOutput.routed_experts"
    del llm

    meta.source = f"vllm {vllm.__version__} ({chosen}: {how}; dtype {dtype})"
    meta.extra["capture_method"] = chosen
    with_weight = chosen == "router_hooks"
    with TraceWriter(out_path, meta, with_weight=with_weight, with_split=True) as w:
        for fx, res in zip(fixtures, results):
            w.add(RequestRows(fx.id, fx.domain, res.experts, len(res.prompt_token_ids),
                              res.weights if with_weight else None, fx.split, res.first_position),
                  f"fixture {fx.id!r}")
    if w.cached_tokens_skipped:
        print(f"{out_path}: skipped {w.cached_tokens_skipped} cached-prefix prompt tokens (rows of -1)", file=sys.stderr)
    if tokens_out is not None:
        _write_tokens(Path(tokens_out), fixture_ids, results)
    return Path(out_path)


def _write_tokens(path: Path, ids: list[str], results: list[VllmRequestResult]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for rid, res in zip(ids, results):
            f.write(json.dumps({"id": rid, "prompt_token_ids": res.prompt_token_ids,
                                "token_ids": res.token_ids}) + "\n")
