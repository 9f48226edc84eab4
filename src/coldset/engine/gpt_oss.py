"""gpt-oss (``model_type`` ``gpt_oss``) for the embedded engine.

This file is only the model: its config, modules and weights-by-name. It builds on
:mod:`coldset.engine.model` (the decode loop, the cache slots and masks, the routed experts in
:class:`~coldset.kernels.tiers.ExpertPools` behind the one ``experts_fn``), so every placement,
the slot cache and the parity gate apply to it unchanged. What differs from qwen3_moe / mixtral:

- Attention: q, k, v and o projections with biases (``attention_bias``, true as published) and a
  learned *sink* per head, an extra logit in the softmax's denominator whose probability is
  dropped (so a head can attend to nothing); computed as transformers' eager attention does
  (scores, the sink appended, the row maximum subtracted, softmax, the sink's column dropped).
- Sliding windows per layer: the layers ``layer_types`` names ``sliding_attention`` attend to the
  last ``sliding_window`` tokens (themselves included), the ``full_attention`` layers to every
  token. The window is applied inside those layers' attention to the mask every layer gets, from
  the query's cache slot and the key slot (a slot and a position differ by the sequence's padding
  only), so prefill, decode and a CUDA-graph step with a fixed-width mask honour it alike. The
  KV cache stays one ``[B, max_seq, kv_heads, head_dim]`` per layer; a window layer masks the
  slots it does not read rather than keeping a ring of them. :class:`GptOssConfig` therefore has
  ``sliding_window`` None (the mask :func:`coldset.engine.generate.generate` builds for every
  layer) and the window in ``attention_window``.
- RoPE on the two halves of each head, plain or YaRN (``rope_parameters`` / ``rope_scaling``:
  the frequencies and the cos/sin factor of :func:`coldset.engine.deepseek_v3.rope_frequencies`,
  the same arithmetic as transformers' ``_compute_yarn_parameters``; published: factor 32,
  ``truncate`` false).
- The router has a bias: logits ``x W^T + b`` in the model dtype, top-k on the logits, softmax
  over the k (:func:`biased_topk_softmax`).
- The routed experts have biases on both projections and gpt-oss's clamped SwiGLU
  (:func:`coldset.kernels.activation.activation_from_config`: alpha 1.702, ``swiglu_limit``); they
  run in the kernels (``pools.w13_bias`` / ``w2_bias`` / ``activation``), not here. The
  checkpoint interleaves gate and up (``gate_up_proj[..., 0::2]`` gate, ``1::2`` up) and stores
  the fused tensors transposed (``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``):
  :func:`read_experts` de-interleaves into the engine's ``[gate; up]`` w13 rows.
- RMSNorm as transformers' ``GptOssRMSNorm``: the weight (kept float32, as transformers keeps
  these norms) times the float32 normalised input, then cast.

Checkpoints: bf16/float32 as written by transformers, and the published MXFP4 experts
(``*_blocks`` / ``*_scales``, ``quantization_config.quant_method`` mxfp4). :func:`load` with
``keep_mxfp4`` keeps those 4-bit (MXFP4 pools, :mod:`coldset.kernels.triton_mxfp4` on CUDA, bf16
activations; the config's ``expert_format`` mxfp4): what the workflow runs by default
(config ``model.experts_format: checkpoint``). Without it they are dequantized at load
to the model dtype by :mod:`coldset.core.mxfp4` (the load log says so); the config then says
``expert_format`` = the model dtype (what the pools hold) and ``checkpoint_expert_format`` mxfp4.

Refused by name (:class:`~coldset.engine.model.ModelLoadError`): RoPE types other than default
and yarn, ``partial_rotary_factor``, a ``layer_types`` entry other than the two kinds (or of
another length than the layers), sliding layers without ``sliding_window``, an odd
``head_dim``, other quantization methods (or attention/router weights quantized).

Numerics follow transformers' ``GptOssForCausalLM``; the experts' weighted sum runs through
``experts_fn`` (another summation order than transformers' per-expert loop), so logits agree to
float32 rounding, not bitwise. The fused Triton decode step is attention without sinks or
biases and a softmax-then-top-k router without bias: :meth:`GptOssModel.compile_decode` refuses
it and compiles the eager layer with ``torch.compile`` instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import types
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from coldset.core import mxfp4
from coldset.core.shapes import MoEShape, ShapeError, shape_from_hf_config
from coldset.engine.deepseek_v3 import YarnScaling, rope_frequencies
from coldset.engine.model import DecoderLayer, ModelConfig, ModelLoadError, MoEBlock, MoEModel, RMSNorm
from coldset.engine.weights import put_shared_weights
from coldset.kernels.activation import Activation, activation_from_config
from coldset.kernels.tiers import ExpertPools

log = logging.getLogger(__name__)

MODEL_TYPE = "gpt_oss"
LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' GptOssConfig.default_theta: the RoPE base of a config that names none
_DEFAULT_ROPE_THETA = 150000.0
# transformers' GptOssConfig.swiglu_limit default: a config that leaves it out is clamped at 7
_DEFAULT_SWIGLU_LIMIT = 7.0


class TensorSource(Protocol):
    """What the loaders read from: :class:`coldset.engine.loading`'s safetensors reader."""

    def __contains__(self, key: str) -> bool: ...

    def get(self, key: str, shape: tuple[int, ...]) -> torch.Tensor: ...


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GptOssConfig(ModelConfig):
    """:class:`~coldset.engine.model.ModelConfig` plus the per-layer attention kinds and window,
    the attention biases, the experts' activation and the RoPE scaling. ``sliding_window`` (the
    window :func:`coldset.engine.generate.generate` applies to every layer) is None: the window
    is ``attention_window``, on the layers ``layer_types`` marks ``sliding_attention``.
    ``checkpoint_expert_format`` is how the folder stores the experts (``mxfp4`` or the dtype);
    ``expert_format`` what the engine's pools hold. :meth:`from_hf_config` parses a config.json."""

    layer_types: tuple[str, ...]
    attention_window: int | None
    attention_bias: bool = True
    activation: Activation
    yarn: YarnScaling | None = None
    checkpoint_expert_format: str

    @property
    def softmax_scale(self) -> float:
        """``head_dim ** -0.5`` (YaRN scales cos and sin instead, by its attention factor)."""
        return self.head_dim ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The attention window of model layer ``layer`` (None: every earlier token)."""
        return self.attention_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_hf_config(cls, raw: dict, source: str = "config.json") -> "GptOssConfig":
        """Parse a gpt_oss config dict; ``source`` names the file in error messages. The shape
        comes from :func:`coldset.core.shapes.shape_from_hf_config`; this adds the forward pass's
        fields and refuses, by field name, what the engine does not implement."""
        model_type = raw.get("model_type") if isinstance(raw, dict) else None
        if model_type != MODEL_TYPE:
            raise ModelLoadError(f"{source}: model_type {model_type!r} is not {MODEL_TYPE!r}")
        try:
            shape = shape_from_hf_config(raw, source)
        except ShapeError as exc:
            raise ModelLoadError(str(exc)) from None
        checkpoint_format = _expert_format(raw, shape, source)
        if shape.head_dim % 2:
            raise ModelLoadError(f"{source}: field 'head_dim' is {shape.head_dim}; RoPE rotates two halves of a head")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        layer_types = _layer_types(raw, shape.num_layers, source)
        window = raw.get("sliding_window")
        if "sliding_attention" in layer_types and (window is None or int(window) < 1):
            raise ModelLoadError(f"{source}: field 'sliding_window' is {window!r}; layer_types names "
                                 "sliding_attention layers, which need a window of at least 1 token")
        limit = raw.get("swiglu_limit", _DEFAULT_SWIGLU_LIMIT)
        if limit is None:
            raise ModelLoadError(f"{source}: field 'swiglu_limit' is null; gpt_oss's experts clamp gate and up by it")
        try:
            activation = activation_from_config({**raw, "swiglu_limit": limit})
        except ValueError as exc:
            raise ModelLoadError(f"{source}: fields 'swiglu_limit'/'swiglu_alpha': {exc}") from None
        eps = raw.get("rms_norm_eps")
        return cls(
            **{**{f.name: getattr(shape, f.name) for f in fields(MoEShape)}, "expert_format": shape.dtype},
            norm_topk_prob=True,  # softmax over the k chosen logits: the weights sum to 1
            rms_norm_eps=1e-5 if eps is None else float(eps),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA))),
            sliding_window=None,
            max_position_embeddings=raw.get("max_position_embeddings"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            layer_types=layer_types,
            attention_window=None if window is None else int(window),
            attention_bias=bool(raw.get("attention_bias", True)),
            activation=activation,
            yarn=_yarn(rope, source),
            checkpoint_expert_format=checkpoint_format,
        )


def is_gpt_oss(path: str | os.PathLike) -> bool:
    """Whether ``path/config.json`` names ``model_type`` gpt_oss (False when it cannot be read:
    then :meth:`ModelConfig.from_pretrained <coldset.engine.model.ModelConfig.from_pretrained>`
    names what is wrong with it)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") == MODEL_TYPE


def _expert_format(raw: dict, shape: MoEShape, source: str) -> str:
    """How the checkpoint stores the routed experts: the dtype, or mxfp4 (experts only)."""
    if shape.expert_format == shape.dtype and shape.linear_format == shape.dtype:
        return shape.dtype
    qcfg = raw.get("quantization_config") or {}
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
    if shape.expert_format != mxfp4.FORMAT_NAME or shape.linear_format != shape.dtype:
        raise ModelLoadError(f"{source}: quantization_config: quant_method {method!r} ({shape.expert_format} "
                             f"experts, {shape.linear_format} linear layers) is not decoded by the engine for gpt_oss; "
                             "it reads bf16/float32 checkpoints and MXFP4 experts (attention and router unquantized)")
    try:
        mxfp4.parse_quantization_config(qcfg, source)
    except mxfp4.Mxfp4FormatError as exc:
        raise ModelLoadError(str(exc)) from None
    return mxfp4.FORMAT_NAME


def _layer_types(raw: dict, num_layers: int, source: str) -> tuple[str, ...]:
    """``layer_types`` as given, or transformers' default (sliding on even layers, full on odd)."""
    given = raw.get("layer_types")
    if given is None:
        return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers))
    if not isinstance(given, list) or len(given) != num_layers:
        raise ModelLoadError(f"{source}: field 'layer_types' must list one kind per layer ({num_layers}), "
                             f"got {given!r}")
    for i, kind in enumerate(given):
        if kind not in LAYER_TYPES:
            raise ModelLoadError(f"{source}: field 'layer_types'[{i}] is {kind!r}; the engine implements "
                                 f"{', '.join(LAYER_TYPES)} for gpt_oss")
    return tuple(given)


def _yarn(rope: dict, source: str) -> YarnScaling | None:
    """The YaRN parameters of ``rope`` (None for plain RoPE), refused by name when the engine
    does not implement them."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ModelLoadError(f"{source}: RoPE scaling {rope_type!r} (rope_parameters/rope_scaling) is not "
                             "implemented for gpt_oss; only plain RoPE and yarn")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{source}: field 'partial_rotary_factor' != 1 is not supported")
    if rope_type == "default":
        return None
    for name in ("factor", "original_max_position_embeddings"):
        if rope.get(name) is None:
            raise ModelLoadError(f"{source}: field {name!r} of the yarn RoPE scaling is missing")
    return YarnScaling(
        factor=float(rope["factor"]), original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
        mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
        attention_factor=rope.get("attention_factor"), truncate=bool(rope.get("truncate", True)),
    )


# openai/gpt-oss-20b's published config.json, its quantization_config left out (the experts of a
# model built from it are bf16): the real shape bench step measures without a download
# (:func:`coldset.engine.random_weights.build_random_model`).
GPT_OSS_20B_CONFIG = {
    "model_type": MODEL_TYPE, "architectures": ["GptOssForCausalLM"], "torch_dtype": "bfloat16",
    "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
    "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "attention_bias": True, "hidden_act": "silu",
    "swiglu_limit": 7.0, "rms_norm_eps": 1e-05, "max_position_embeddings": 131072, "initial_context_length": 4096,
    "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False, "original_max_position_embeddings": 4096},
    "tie_word_embeddings": False, "eos_token_id": 200002, "pad_token_id": 199999,
}


# --------------------------------------------------------------------------------------------
# Router
# --------------------------------------------------------------------------------------------


def biased_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's router on ``logits`` ``[T, E]`` (the bias already added): ``(topk_ids [T, k]
    int64, topk_weights [T, k] float32)``, the top ``k`` logits (sorted, as ``torch.topk``) and the
    softmax over those ``k`` in the logits' dtype (transformers' ``GptOssTopKRouter``)."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    return ids, torch.softmax(top, dim=-1, dtype=top.dtype).float()


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class GptOssRMSNorm(RMSNorm):
    """transformers' ``GptOssRMSNorm``: ``(weight * normalised(x in float32)).to(x.dtype)``, the
    weight kept float32 by :func:`load_weights`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * F.rms_norm(x.float(), self.shape, eps=self.eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' gpt-oss ``_apply_rotary_emb``: ``x``'s halves rotated by half-width cos/sin."""
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class SinkAttention(nn.Module):
    """Grouped-query attention with q/k/v/o biases, a learned sink per head and an optional
    sliding window (``window``, set per layer by :class:`GptOssDecoderLayer`), writing a static KV
    cache ``[B, max_seq, kv_heads, head_dim]`` (:meth:`MoEModel.setup_cache`)."""

    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.softmax_scale
        self.window: int | None = None
        # q, k and v fused into one GEMM (rows: q, then k, then v), biases likewise
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias,
                                  device="meta")
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias, device="meta")
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads, device="meta"), requires_grad=False)
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def forward(self, x, cos, sin, slots, mask):
        """``x`` [B, T, H]; ``cos``/``sin`` [B, T, head_dim / 2]; ``slots`` [T]; ``mask`` [B, 1, T, S]."""
        bsz, seq, _ = x.shape
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        q = _rotate(q.view(bsz, seq, nh, d), cos, sin)
        k = _rotate(k.view(bsz, seq, nkv, d), cos, sin)
        self.k_cache.index_copy_(1, slots, k)
        self.v_cache.index_copy_(1, slots, v.view(bsz, seq, nkv, d))
        kv_len = mask.shape[-1]  # attend over the first kv_len slots (a shape, not data)
        if self.window is not None:  # key slot within the last `window` slots up to the query's
            key_slots = torch.arange(kv_len, device=mask.device)
            mask = mask & (key_slots[None, :] > slots[:, None] - self.window)
        keys = self.k_cache[:, :kv_len].transpose(1, 2)  # [B, KV, S, D]
        values = self.v_cache[:, :kv_len].transpose(1, 2)
        # GQA without repeating K/V: the `rep` query heads of kv head j (heads j*rep .. j*rep+rep-1,
        # as transformers' repeat_kv) become rep * T rows against it.
        rep = nh // nkv
        q = q.transpose(1, 2).reshape(bsz, nkv, rep * seq, d)
        scores = (torch.matmul(q, keys.transpose(2, 3)) * self.scale).view(bsz, nkv, rep, seq, kv_len)
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
        sinks = self.sinks.view(1, nkv, rep, 1, 1).expand(bsz, nkv, rep, seq, 1).to(scores.dtype)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # the sink's column dropped
        out = torch.matmul(probs.reshape(bsz, nkv, rep * seq, kv_len).to(values.dtype), values)
        out = out.view(bsz, nh, seq, d).transpose(1, 2).reshape(bsz, seq, nh * d)
        return self.o_proj(out)


class GptOssMoE(MoEBlock):
    """The biased router (:func:`biased_topk_softmax`) and the routed experts, whose biases and
    clamped SwiGLU live in the pools (:class:`~coldset.engine.model.MoEBlock`'s ``experts``).
    The captured routing weights (``routing_sink``) are the softmax over the k, in float32."""

    def __init__(self, cfg: GptOssConfig, moe_index: int, model: "GptOssModel"):
        super().__init__(cfg, moe_index, model)
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True, device="meta")

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_ids [N, k] int64, topk_weights [N, k] float32)`` for tokens ``flat`` [N, H]."""
        return biased_topk_softmax(F.linear(flat, self.gate.weight, self.gate.bias), self.top_k)


class GptOssDecoderLayer(DecoderLayer):
    """Pre-norm sink attention (windowed on ``sliding_attention`` layers) and the MoE block:
    :class:`coldset.engine.model.DecoderLayer` with this family's modules, so
    :func:`coldset.engine.model.layer_before_experts` runs it."""

    attention = SinkAttention
    moe_block = GptOssMoE

    def __init__(self, cfg: GptOssConfig, layer_idx: int, model: "GptOssModel"):
        super().__init__(cfg, layer_idx, model)
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn.window = cfg.layer_window(layer_idx)


class GptOssModel(MoEModel):
    """A gpt_oss model in :class:`~coldset.engine.model.MoEModel`'s interface: the same forward
    pass, ``pools``, ``experts_fn``, ``routing_sink`` and decode state (slots, masks, KV cache),
    with sink attention, per-layer windows, the biased router and (YaRN-)scaled half-split RoPE."""

    def __init__(self, cfg: GptOssConfig):
        super().__init__(cfg)
        self.layers = nn.ModuleList(GptOssDecoderLayer(cfg, i, self) for i in range(cfg.num_layers))
        self.norm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # rope_frequencies reads these three fields; gpt-oss rotates every dim of a head
        rope_fields = types.SimpleNamespace(qk_rope_head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, yarn=cfg.yarn)
        self.inv_freq, self.attention_factor = rope_frequencies(rope_fields)

    def compile_decode(self, fused: bool | None = None, pdl: bool | None = None) -> None:
        """``torch.compile`` the eager decode layer (:meth:`MoEModel.compile_decode` with
        ``fused=False``); the fused Triton step has neither attention sinks, biases and windows
        per layer nor the biased router, so ``fused=True`` is refused."""
        if fused:
            raise ValueError("compile_decode(fused=True): the fused decode kernels run attention without sinks or "
                             "biases and a softmax-then-top-k router without bias; gpt_oss's sink attention and "
                             "biased top-k router run eagerly or under torch.compile (fused=False)")
        super().compile_decode(fused=False, pdl=pdl)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-width ``(cos, sin)`` ``[B, T, head_dim / 2]``, times YaRN's attention factor."""
        freqs = positions[..., None].float() * self.inv_freq
        factor = self.attention_factor
        return (freqs.cos() * factor).to(self.dtype), (freqs.sin() * factor).to(self.dtype)


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def load_weights(model: GptOssModel, src: TensorSource, device: torch.device, dtype: torch.dtype) -> None:
    """Read every weight but the routed experts from ``src`` by the checkpoint's names, into
    ``model`` (built on the meta device) on ``device`` in ``dtype``; the RMSNorm weights in float32
    (as transformers keeps them). q, k and v (weights and biases) are stacked into ``qkv_proj``."""
    cfg = model.config

    def read(key: str, shape: tuple[int, ...], as_dtype: torch.dtype = dtype) -> nn.Parameter:
        tensor = src.get(key, shape)
        if not tensor.is_floating_point() or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ModelLoadError(f"tensor {key!r} is {tensor.dtype}; gpt_oss reads attention, router, norms and "
                                 "embeddings unquantized")
        return nn.Parameter(tensor.to(device=device, dtype=as_dtype), requires_grad=False)

    def put(owner: nn.Module, name: str, key: str) -> None:
        as_dtype = torch.float32 if isinstance(owner, GptOssRMSNorm) else dtype
        setattr(owner, name, read(key, tuple(getattr(owner, name).shape), as_dtype))

    put_shared_weights(model, src, put)
    h = cfg.hidden_size
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        attn = layer.self_attn
        sizes = (("q_proj", attn.q_size), ("k_proj", attn.kv_size), ("v_proj", attn.kv_size))
        weights = [read(f"{p}.self_attn.{n}.weight", (rows, h)) for n, rows in sizes]
        attn.qkv_proj.weight = nn.Parameter(torch.cat(weights), requires_grad=False)
        put(attn.o_proj, "weight", f"{p}.self_attn.o_proj.weight")
        if cfg.attention_bias:
            biases = [read(f"{p}.self_attn.{n}.bias", (rows,)) for n, rows in sizes]
            attn.qkv_proj.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
            put(attn.o_proj, "bias", f"{p}.self_attn.o_proj.bias")
        put(attn, "sinks", f"{p}.self_attn.sinks")
        put(layer.mlp.gate, "weight", f"{p}.mlp.router.weight")
        put(layer.mlp.gate, "bias", f"{p}.mlp.router.bias")
    model.inv_freq = model.inv_freq.to(device)


def read_experts(cfg: GptOssConfig, src: TensorSource, device, dtype) -> tuple[torch.Tensor, ...]:
    """The routed experts as the pools hold them: ``(w13 [L, E, 2I, H], w2 [L, E, H, I],
    w13_bias [L, E, 2I], w2_bias [L, E, H])`` in ``dtype`` on ``device``, gate rows then up rows.

    From the fused tensors transformers writes (``experts.gate_up_proj`` ``[E, H, 2I]``,
    interleaved; ``experts.down_proj`` ``[E, I, H]``; ``*_bias``), transposed and de-interleaved;
    or, for an MXFP4 checkpoint, from ``gate_up_proj_blocks`` ``[E, 2I, H/32, 16]`` /
    ``_scales`` ``[E, 2I, H/32]`` and ``down_proj_blocks`` / ``_scales``, dequantized to ``dtype``
    by :func:`coldset.core.mxfp4.dequantize` (rows already out-major) on ``device``, then
    de-interleaved (:func:`coldset.core.mxfp4.deinterleave_rows`)."""
    L, E, I, H = cfg.num_moe_layers, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    packed = cfg.checkpoint_expert_format == mxfp4.FORMAT_NAME
    if packed:
        log.info("gpt_oss: MXFP4 experts dequantized to %s at load (%d layers x %d experts; keep_mxfp4 keeps them "
                 "4-bit)", str(dtype).removeprefix("torch."), L, E)
    w13 = torch.empty((L, E, 2 * I, H), dtype=dtype, device=device)
    w2 = torch.empty((L, E, H, I), dtype=dtype, device=device)
    b13 = torch.empty((L, E, 2 * I), dtype=dtype, device=device)
    b2 = torch.empty((L, E, H), dtype=dtype, device=device)
    for m, layer in enumerate(cfg.moe_layers):
        p = f"model.layers.{layer}.mlp.experts"
        if packed:
            _read_mxfp4(src, f"{p}.gate_up_proj", w13[m], interleaved=True)
            _read_mxfp4(src, f"{p}.down_proj", w2[m], interleaved=False)
        else:
            gate_up = src.get(f"{p}.gate_up_proj", (E, H, 2 * I)).transpose(1, 2)
            w13[m].copy_(mxfp4.deinterleave_rows(gate_up, 1, f"{p}.gate_up_proj"))
            w2[m].copy_(src.get(f"{p}.down_proj", (E, I, H)).transpose(1, 2))
        bias = src.get(f"{p}.gate_up_proj_bias", (E, 2 * I))
        b13[m].copy_(mxfp4.deinterleave_rows(bias, 1, f"{p}.gate_up_proj_bias"))
        b2[m].copy_(src.get(f"{p}.down_proj_bias", (E, H)))
    return w13, w2, b13, b2


def _read_mxfp4(src: TensorSource, name: str, out: torch.Tensor, interleaved: bool) -> None:
    """Dequantize the MXFP4 matrices ``{name}_blocks`` / ``{name}_scales`` (groups of 32 along a
    row) into ``out`` ``[experts, rows, cols]`` (its dtype and device; gate/up rows de-interleaved
    when ``interleaved``). The packed bytes go to ``out``'s device first (a quarter of the bytes of
    bf16) and are dequantized one expert at a time, so the temporaries stay one expert's."""
    experts, rows, cols = out.shape
    if cols % mxfp4.BLOCK:
        raise ModelLoadError(f"tensor {name}_blocks: MXFP4 groups {mxfp4.BLOCK} values along a row, and {cols} is "
                             "not a multiple")
    blocks = src.get(f"{name}_blocks", (experts, rows, cols // mxfp4.BLOCK, mxfp4.BLOCK_BYTES)).to(out.device)
    scales = src.get(f"{name}_scales", (experts, rows, cols // mxfp4.BLOCK)).to(out.device)
    for e in range(experts):
        try:
            w = mxfp4.dequantize(blocks[e], scales[e], out.dtype, name)
        except mxfp4.Mxfp4FormatError as exc:
            raise ModelLoadError(f"tensors {name}_blocks/{name}_scales: {exc}") from None
        out[e].copy_(mxfp4.deinterleave_rows(w, 0, name) if interleaved else w)


def read_mxfp4_experts(cfg: GptOssConfig, src: TensorSource, device, bias_dtype) -> tuple[torch.Tensor, ...]:
    """An MXFP4 folder's routed experts kept 4-bit, as MXFP4 pools hold them
    (:class:`~coldset.kernels.tiers.ExpertPools`): ``(w13 uint8 [L, E, 2I, H/2], w2 uint8 [L, E, H,
    I/2], w13_scale uint8 [L, E, 2I, H/32], w2_scale uint8 [L, E, H, I/32], w13_bias [L, E, 2I],
    w2_bias [L, E, H])`` on ``device``, gate rows then up rows
    (:func:`coldset.core.mxfp4.w13_from_checkpoint`: whole rows moved, nothing unpacked), the biases
    in ``bias_dtype``."""
    if cfg.checkpoint_expert_format != mxfp4.FORMAT_NAME:
        raise ModelLoadError(f"the experts are stored as {cfg.checkpoint_expert_format}, not MXFP4: there are no "
                             "4-bit experts to keep")
    L, E, I, H = cfg.num_moe_layers, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    g, nb = mxfp4.BLOCK, mxfp4.BLOCK_BYTES
    w13 = torch.empty((L, E, 2 * I, H // 2), dtype=torch.uint8, device=device)
    w2 = torch.empty((L, E, H, I // 2), dtype=torch.uint8, device=device)
    s13 = torch.empty((L, E, 2 * I, H // g), dtype=torch.uint8, device=device)
    s2 = torch.empty((L, E, H, I // g), dtype=torch.uint8, device=device)
    b13 = torch.empty((L, E, 2 * I), dtype=bias_dtype, device=device)
    b2 = torch.empty((L, E, H), dtype=bias_dtype, device=device)
    for m, layer in enumerate(cfg.moe_layers):
        p = f"model.layers.{layer}.mlp.experts"
        blocks = src.get(f"{p}.gate_up_proj_blocks", (E, 2 * I, H // g, nb))
        scales = src.get(f"{p}.gate_up_proj_scales", (E, 2 * I, H // g))
        down_blocks = src.get(f"{p}.down_proj_blocks", (E, H, I // g, nb))
        down_scales = src.get(f"{p}.down_proj_scales", (E, H, I // g))
        try:
            blocks, scales, bias = mxfp4.w13_from_checkpoint(blocks, scales, src.get(f"{p}.gate_up_proj_bias",
                                                                                     (E, 2 * I)), f"{p}.gate_up_proj")
            mxfp4.check_tensors(down_blocks, down_scales, f"{p}.down_proj")
        except mxfp4.Mxfp4FormatError as exc:
            raise ModelLoadError(str(exc)) from None
        w13[m].copy_(blocks.flatten(-2))
        s13[m].copy_(scales)
        b13[m].copy_(bias)
        w2[m].copy_(down_blocks.flatten(-2))
        s2[m].copy_(down_scales)
        b2[m].copy_(src.get(f"{p}.down_proj_bias", (E, H)))
    return w13, w2, s13, s2, b13, b2


def load(cfg: GptOssConfig, src: TensorSource, device: torch.device, dtype: torch.dtype,
         keep_mxfp4: bool = False) -> GptOssModel:
    """A gpt_oss model from ``src`` (:func:`coldset.engine.loading.load_model` calls this): its
    weights (:func:`load_weights`) and every routed expert in the pools with its biases and the
    config's activation, in eval mode. The experts are in ``dtype`` (:func:`read_experts`, an
    MXFP4 folder's dequantized), or, with ``keep_mxfp4``, an MXFP4 folder's kept 4-bit
    (:func:`read_mxfp4_experts`; the MXFP4 kernels take bf16 activations, so ``dtype`` must be
    bfloat16, and the config's ``expert_format`` is then mxfp4)."""
    if keep_mxfp4:
        if dtype != torch.bfloat16:
            raise ModelLoadError(f"keep_mxfp4: the MXFP4 experts kernels take bfloat16 activations, not {dtype}")
        experts = read_mxfp4_experts(cfg, src, device, dtype)  # refuses a folder without MXFP4 experts
        cfg = dataclasses.replace(cfg, expert_format=mxfp4.FORMAT_NAME)
        log.info("gpt_oss: MXFP4 experts kept 4-bit in the pools (%d layers x %d experts)", cfg.num_moe_layers,
                 cfg.num_experts)
    model = GptOssModel(cfg)
    load_weights(model, src, device, dtype)
    if keep_mxfp4:
        w13, w2, s13, s2, b13, b2 = experts
        model.pools = ExpertPools.all_hot(w13, w2, s13, s2, w13_bias=b13, w2_bias=b2, activation=cfg.activation)
    else:
        w13, w2, b13, b2 = read_experts(cfg, src, device, dtype)
        model.pools = ExpertPools.all_hot(w13, w2, w13_bias=b13, w2_bias=b2, activation=cfg.activation)
    return model.eval()
