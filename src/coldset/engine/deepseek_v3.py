"""DeepSeek-V3 (``model_type`` ``deepseek_v3``, and configs that use its architecture) for the embedded engine.

This file is only the model: its config, modules and weights-by-name. It builds on
:mod:`coldset.engine.model` (the decode loop, the cache slots and masks, the routed experts in
:class:`~coldset.kernels.tiers.ExpertPools` behind the one ``experts_fn``), so every placement,
the slot cache and the parity gate apply to it unchanged. What differs from qwen3_moe / mixtral:

- Multi-head latent attention (MLA): the query optionally through a low-rank ``q_a_proj`` /
  ``q_a_layernorm`` / ``q_b_proj``; keys and values from one compressed latent
  (``kv_a_proj_with_mqa`` -> ``kv_lora_rank`` latent + one shared RoPE key of ``qk_rope_head_dim``),
  expanded per head by ``kv_b_proj`` into ``qk_nope_head_dim`` key and ``v_head_dim`` value dims.
- The KV cache holds the compressed latent (after ``kv_a_layernorm``) and the rotated RoPE key,
  ``kv_lora_rank + qk_rope_head_dim`` values a token and layer, as serving engines keep it
  (DeepSeek-V3: 576 values, where the expanded keys and values would be
  ``heads * (qk_nope + qk_rope + v_head_dim)`` = 40960). A step expands the cached latents of the
  keys it attends over through ``kv_b_proj`` (expand on read, the transformers order of
  operations); serving engines instead absorb ``kv_b_proj`` into the query and output
  projections, which saves that GEMM over the cached tokens but rounds differently.
- RoPE, plain or YaRN (``rope_parameters`` / ``rope_scaling`` type ``yarn``: interpolated
  frequencies, cos/sin scaled by the attention factor, and ``mscale_all_dim`` folded into the
  softmax scale as ``mscale**2``), on interleaved pairs when ``rope_interleave`` (the default).
- ``first_k_dense_replace`` dense layers, ``n_shared_experts`` shared experts (one SwiGLU of
  ``n_shared_experts * moe_intermediate_size``) added to the routed experts' sum.
- The router as published (``topk_method`` ``noaux_tc``, ``scoring_func`` ``sigmoid``):
  :func:`grouped_sigmoid_topk`, in float32 (the router weight and ``e_score_correction_bias`` are
  kept in float32 whatever the model dtype, as transformers keeps them).

Block-FP8 checkpoints as published (``quantization_config`` quant_method fp8, fmt e4m3, dynamic
activations, ``weight_block_size`` [128, 128]; ``*.weight`` float8_e4m3fn beside
``*.weight_scale_inv``, :mod:`coldset.core.fp8`): the routed experts go into the expert pools as
stored, FP8 bytes and their scales, through the same loader and kernels as qwen3_moe's FP8 experts
(a scale travels with its expert between tiers). Every other converted linear layer (the MLA
projections, the shared experts, the dense layers' MLPs) is dequantized to the model dtype at load
(``weight.float() * scale_inv`` per block, transformers' CPU dequantization), because the FP8 path
outside the experts is the fused GQA decode step's, which MLA does not run. What that costs in HBM
for DeepSeek-V3 in bf16: 15.16 G such weights hold 30.31 GB (28.23 GiB) where their FP8 bytes and
scales are 15.16 GB (14.12 GiB), 14.11 GiB more; :func:`load_weights` logs the figure of the
checkpoint it reads. The LM head and the router are never converted (transformers' rule).

Refused by name (:class:`~coldset.engine.model.ModelLoadError`): DeepSeek-V3.2's sparse attention
(``index_topk`` and its indexer fields), another ``topk_method`` or ``scoring_func``,
``moe_layer_freq`` != 1, ``num_key_value_heads`` != ``num_attention_heads``, ``attention_bias``,
RoPE types other than default and yarn, ``partial_rotary_factor``, a group layout the router cannot
take, and quantized checkpoints in any other format (another ``weight_block_size``, per-tensor FP8,
static activation scales, e5m2, MXFP4, AWQ/GPTQ, experts left unconverted beside FP8 linear
layers): their shape is read by placement and statistics all the same.
Multi-token-prediction layers (``num_nextn_predict_layers``) are not read: the engine decodes one
token a step, and :func:`load_weights` logs that it skips them.

Numerics follow transformers' ``DeepseekV3ForCausalLM``; the routed experts' weighted sum runs
through ``experts_fn`` (another summation order than transformers' per-expert loop), so logits
agree to float32 rounding, not bitwise. Block-FP8 experts quantize their activations per
128-column group, the FP8 kernel's scheme (:mod:`coldset.kernels.reference`), where transformers'
CPU run of the same checkpoint multiplies float activations by the dequantized weights: the two
agree to that quantization (weight-only experts, ``w8a16``, agree to float32 rounding). The fused
Triton decode step is grouped-query attention and a softmax router;
:meth:`DeepseekV3Model.compile_decode` refuses it and compiles the eager layer with
``torch.compile`` instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from coldset.core import fp8
from coldset.core.shapes import MoEShape, ShapeError, shape_from_hf_config
from coldset.engine.model import (DecoderLayer, DenseMLP, ModelConfig, ModelLoadError, MoEBlock, MoEModel, RMSNorm,
                                  refuse_unsupported_quantization)
from coldset.engine.weights import put_shared_weights

log = logging.getLogger(__name__)

MODEL_TYPE = "deepseek_v3"
# transformers' DeepseekV3Config defaults of the fields the forward pass reads (what a config.json
# that leaves one out builds there); the shape's own defaults are coldset.core.shapes'.
_DEFAULTS = {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
             "rope_interleave": True, "max_position_embeddings": 4096, "num_nextn_predict_layers": 1}
# DeepSeek-V3.2's indexer (DSA, sparse attention): a config naming any of these needs it.
_SPARSE_ATTENTION_FIELDS = ("index_topk", "index_n_heads", "index_head_dim")
# The norms inside MLA use RMSNorm's default epsilon, not rms_norm_eps (as the reference code does).
_LATENT_NORM_EPS = 1e-6


class TensorSource(Protocol):
    """What :func:`load_weights` reads from: :class:`coldset.engine.loading`'s safetensors reader."""

    def __contains__(self, key: str) -> bool: ...

    def get(self, key: str, shape: tuple[int, ...]) -> torch.Tensor: ...


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's parameters as transformers reads them (``_compute_yarn_parameters``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True, kw_only=True)
class DeepseekV3Config(ModelConfig):
    """:class:`~coldset.engine.model.ModelConfig` plus MLA's ranks and head dims, the grouped
    router's fields and the RoPE scaling. ``head_dim`` (the shape's) is ``qk_nope_head_dim +
    qk_rope_head_dim``, ``num_kv_heads`` is ``num_heads``; ``shared_expert_intermediate_size`` is
    ``n_shared_experts * moe_intermediate_size``. :meth:`from_hf_config` parses a config.json."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    rope_interleave: bool = True
    yarn: YarnScaling | None = None
    num_mtp_layers: int = 0

    @property
    def softmax_scale(self) -> float:
        """``(qk_nope + qk_rope) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            m = yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim)
            scale = scale * m * m
        return scale

    @classmethod
    def from_hf_config(cls, raw: dict, source: str = "config.json") -> "DeepseekV3Config":
        """Parse a deepseek_v3 config dict; ``source`` names the file in error messages. The shape
        comes from :func:`coldset.core.shapes.shape_from_hf_config`; this adds the forward pass's
        fields and refuses, by field name, what the engine does not implement."""
        model_type = raw.get("model_type") if isinstance(raw, dict) else None
        if model_type != MODEL_TYPE:
            raise ModelLoadError(f"{source}: model_type {model_type!r} is not {MODEL_TYPE!r}")
        _refuse_unsupported(raw, source)
        try:
            shape = shape_from_hf_config(raw, source)
        except ShapeError as exc:
            raise ModelLoadError(str(exc)) from None
        refuse_unsupported_quantization(raw, shape, source)
        n_group, topk_group = router_groups(raw, shape, source, _DEFAULTS)
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        eps = raw.get("rms_norm_eps")
        return cls(
            **{f.name: getattr(shape, f.name) for f in fields(MoEShape)},
            norm_topk_prob=bool(_get(raw, "norm_topk_prob")),
            rms_norm_eps=1e-6 if eps is None else float(eps),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            max_position_embeddings=_get(raw, "max_position_embeddings"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            q_lora_rank=_q_lora_rank(shape),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(_get(raw, "routed_scaling_factor")),
            rope_interleave=bool(_get(raw, "rope_interleave")),
            yarn=_yarn(raw, rope, source),
            num_mtp_layers=int(raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers",
                                                                             _DEFAULTS["num_nextn_predict_layers"]))),
        )


def is_deepseek_v3(path: str | os.PathLike) -> bool:
    """Whether ``path/config.json`` names ``model_type`` deepseek_v3 (:func:`names_model_type`)."""
    return names_model_type(path, MODEL_TYPE)


def names_model_type(path: str | os.PathLike, model_type: str) -> bool:
    """Whether ``path/config.json`` names ``model_type`` (False when it cannot be read: then
    :meth:`ModelConfig.from_pretrained <coldset.engine.model.ModelConfig.from_pretrained>` names
    what is wrong with it)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") == model_type


def _get(raw: dict, name: str):
    """``raw[name]``, or transformers' default when the config leaves it out (or writes null)."""
    value = raw.get(name)
    return _DEFAULTS[name] if value is None else value


def _q_lora_rank(shape: MoEShape) -> int | None:
    """The query's low rank as the shape read it (``q_a_proj``'s rows), None without compression."""
    ranks = [rows for name, rows, _, _ in shape.attention_linears if name == "q_a_proj"]
    return ranks[0] if ranks else None


def _refuse_unsupported(raw: dict, source: str) -> None:
    """Refuse, naming the field, a deepseek_v3 config whose forward pass the engine does not run."""
    for name in _SPARSE_ATTENTION_FIELDS:
        if name in raw:
            raise ModelLoadError(f"{source}: field {name!r}: DeepSeek-V3.2's sparse attention (the lightning "
                                 "indexer, DSA) is not implemented; the engine runs dense multi-head latent attention")
    checks = (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"), ("hidden_act", "silu"))
    for name, want in checks:
        if raw.get(name, want) != want:
            raise ModelLoadError(f"{source}: field {name!r} is {raw[name]!r}; the engine implements "
                                 f"deepseek_v3 with {name} {want!r} only")
    if raw.get("attention_bias"):
        raise ModelLoadError(f"{source}: field 'attention_bias' is true; MLA projections with biases are not "
                             "implemented")
    if raw.get("moe_layer_freq", 1) != 1:
        raise ModelLoadError(f"{source}: field 'moe_layer_freq' is {raw['moe_layer_freq']!r}; deepseek_v3 makes "
                             "every layer from first_k_dense_replace on a MoE layer (moe_layer_freq 1)")
    heads = raw.get("num_attention_heads")
    if raw.get("num_key_value_heads", heads) not in (None, heads):
        raise ModelLoadError(f"{source}: field 'num_key_value_heads' ({raw['num_key_value_heads']!r}) differs from "
                             f"num_attention_heads ({heads!r}); MLA expands one latent into every head")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ModelLoadError(f"{source}: RoPE scaling {rope_type!r} (rope_parameters/rope_scaling) is not "
                             "implemented for deepseek_v3; only plain RoPE and yarn")
    if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError(f"{source}: field 'partial_rotary_factor' != 1 is not supported")


def router_groups(raw: dict, shape: MoEShape, source: str, defaults: dict) -> tuple[int, int]:
    """``(n_group, topk_group)`` of a grouped sigmoid router's config (``defaults``: the family's
    transformers defaults of the two), refused by name when :func:`grouped_sigmoid_topk` cannot run
    on them."""
    for name in ("n_group", "topk_group"):
        if name in raw and raw[name] is None:
            raise ModelLoadError(f"{source}: field {name!r} is null; the grouped router needs a group count")
    n_group, topk_group = (int(defaults[n] if raw.get(n) is None else raw[n]) for n in ("n_group", "topk_group"))
    e, k = shape.num_experts, shape.top_k
    if n_group < 1 or e % n_group or e // n_group < 2:
        raise ModelLoadError(f"{source}: field 'n_group' ({n_group}) must divide n_routed_experts ({e}) into groups "
                             "of at least 2 experts (a group's score is its two best experts')")
    if not 1 <= topk_group <= n_group or k > topk_group * (e // n_group):
        raise ModelLoadError(f"{source}: field 'topk_group' ({topk_group}) must be in [1, n_group] and its groups "
                             f"must hold num_experts_per_tok ({k}) experts")
    return n_group, topk_group


def _yarn(raw: dict, rope: dict, source: str) -> YarnScaling | None:
    """The YaRN parameters of ``rope`` (None for plain RoPE), with transformers' defaults."""
    if rope.get("rope_type", rope.get("type", "default")) != "yarn":
        return None
    if rope.get("factor") is None:
        raise ModelLoadError(f"{source}: field 'factor' of the yarn RoPE scaling is missing")
    original = rope.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if original is None:
        original = _get(raw, "max_position_embeddings")
    return YarnScaling(
        factor=float(rope["factor"]), original_max_position_embeddings=int(original),
        beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
        mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
        attention_factor=rope.get("attention_factor"), truncate=bool(rope.get("truncate", True)),
    )


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: DeepseekV3Config) -> tuple[torch.Tensor, float]:
    """``(inv_freq [qk_rope_head_dim / 2] float32, attention_factor)``: plain RoPE's frequencies
    and 1, or YaRN's interpolated frequencies and the factor cos and sin are scaled by (the same
    float32 arithmetic as transformers' ``_compute_yarn_parameters``)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    if cfg.yarn is None:
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    y = cfg.yarn
    attention_factor = y.attention_factor
    if attention_factor is None:
        if y.mscale and y.mscale_all_dim:
            attention_factor = float(yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim))
        else:
            attention_factor = yarn_mscale(y.factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (y.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate ``x`` ``[..., D]`` by ``cos``/``sin`` (broadcast to it, ``cat(freqs, freqs)``):
    halves (``rotate_half``), or interleaved pairs ``(x0, x1), (x2, x3), ...`` written back
    de-interleaved (evens' results, then odds'), as transformers does for DeepSeek's weights."""
    if not interleave:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# --------------------------------------------------------------------------------------------
# Router
# --------------------------------------------------------------------------------------------


def grouped_sigmoid_topk(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int,
                         topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router (``noaux_tc``) on float32 ``logits`` ``[T, E]``: ``(topk_ids [T, k]
    int64, topk_weights [T, k] float32)``.

    Scores are ``sigmoid(logits)``; the choice adds ``correction_bias`` to them, keeps the
    ``topk_group`` groups (of ``n_group`` equal groups of experts) whose two best biased scores sum
    highest, and takes the ``top_k`` best biased scores inside them; the weights are the unbiased
    scores of those experts, renormalised to sum 1 when ``norm_topk_prob``, times
    ``routed_scaling_factor``. The same ops in the same order as transformers'
    ``DeepseekV3TopkRouter``, so the choice is the same at every token.
    """
    tokens, num_experts = logits.shape
    scores = logits.sigmoid()
    for_choice = scores + correction_bias
    group_scores = for_choice.view(tokens, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(tokens, n_group, num_experts // n_group).reshape(tokens, num_experts)
    for_choice = for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_ids = torch.topk(for_choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_ids, topk_weights * routed_scaling_factor


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


def _linear(out_features: int, in_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False, device="meta")


class LatentAttention(nn.Module):
    """Multi-head latent attention writing a compressed-latent KV cache (the module docstring)."""

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.interleave = cfg.rope_interleave
        self.scale = cfg.softmax_scale
        q_out = cfg.num_heads * (self.nope + self.rope_dim)
        if cfg.q_lora_rank is None:
            self.q_proj = _linear(q_out, cfg.hidden_size)
        else:
            self.q_a_proj = _linear(cfg.q_lora_rank, cfg.hidden_size)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = _linear(q_out, cfg.q_lora_rank)
        self.kv_a_proj_with_mqa = _linear(cfg.kv_lora_rank + self.rope_dim, cfg.hidden_size)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = _linear(cfg.num_heads * (self.nope + self.v_dim), cfg.kv_lora_rank)
        self.o_proj = _linear(cfg.hidden_size, cfg.num_heads * self.v_dim)
        # [B, max_seq, kv_lora_rank] and [B, max_seq, qk_rope_head_dim], set by setup_cache
        self.register_buffer("latent_cache", None, persistent=False)
        self.register_buffer("rope_key_cache", None, persistent=False)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x, cos, sin, slots, mask):
        """``x`` [B, T, H]; ``cos``/``sin`` [B, T, qk_rope_head_dim]; ``slots`` [T]; ``mask`` [B, 1, T, S]."""
        bsz, seq, _ = x.shape
        nh = self.num_heads
        q = self.query(x).view(bsz, seq, nh, self.nope + self.rope_dim)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rot = apply_rope(q_rot, cos.unsqueeze(2), sin.unsqueeze(2), self.interleave)
        k_rot = apply_rope(k_rot, cos, sin, self.interleave)
        self.latent_cache.index_copy_(1, slots, latent)
        self.rope_key_cache.index_copy_(1, slots, k_rot)
        kv_len = mask.shape[-1]  # attend over the first kv_len slots (a shape, not data)
        kv = self.kv_b_proj(self.latent_cache[:, :kv_len]).view(bsz, kv_len, nh, self.nope + self.v_dim)
        k_nope, values = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = self.rope_key_cache[:, :kv_len, None].expand(bsz, kv_len, nh, self.rope_dim)
        keys = torch.cat((k_nope, k_rope), dim=-1).transpose(1, 2)  # [B, nh, S, qk]
        queries = torch.cat((q_nope, q_rot), dim=-1).transpose(1, 2)  # [B, nh, T, qk]
        out = F.scaled_dot_product_attention(queries, keys, values.transpose(1, 2), attn_mask=mask, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, nh * self.v_dim))


class DeepseekMoE(MoEBlock):
    """The grouped sigmoid router, the routed experts (through the model's ``experts_fn`` and
    pools, :class:`~coldset.engine.model.MoEBlock`) and the shared experts added to their sum.

    The router's weight and ``e_score_correction_bias`` are float32 and its logits are computed
    in float32 from the hidden state, whatever the model dtype. The captured routing weights
    (``routing_sink``) are those the experts are weighted by: renormalised, times
    ``routed_scaling_factor``.
    """

    def __init__(self, cfg: DeepseekV3Config, moe_index: int, model: "DeepseekV3Model"):
        super().__init__(cfg, moe_index, model)
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.register_buffer("e_score_correction_bias", None)
        self.shared_experts = None
        if cfg.shared_expert_intermediate_size:
            width = cfg.shared_expert_intermediate_size  # n_shared_experts experts as one SwiGLU
            self.shared_experts = DenseMLP(dataclasses.replace(cfg, intermediate_size=width))

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_ids [N, k] int64, topk_weights [N, k] float32)`` for tokens ``flat`` [N, H]."""
        logits = F.linear(flat.float(), self.gate.weight.float())
        return grouped_sigmoid_topk(logits, self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
                                    self.norm_topk_prob, self.routed_scaling_factor)

    def experts(self, flat: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        routed = super().experts(flat, topk_ids, topk_weights)
        if self.shared_experts is None:
            return routed
        return routed + self.shared_experts(flat)


class DeepseekDecoderLayer(DecoderLayer):
    """Pre-norm MLA and MLP (dense before ``first_k_dense_replace``, :class:`DeepseekMoE` after):
    :class:`coldset.engine.model.DecoderLayer` with this family's attention and routing, so
    :func:`coldset.engine.model.layer_before_experts` runs it."""

    attention = LatentAttention
    moe_block = DeepseekMoE


class DeepseekV3Model(MoEModel):
    """A deepseek_v3 model in :class:`~coldset.engine.model.MoEModel`'s interface: the same
    forward pass, ``pools``, ``experts_fn``, ``routing_sink`` and decode state (slots, masks),
    with MLA's compressed-latent cache and the (YaRN-)scaled RoPE."""

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__(cfg)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, self) for i in range(cfg.num_layers))
        self.inv_freq, self.attention_factor = rope_frequencies(cfg)

    def compile_decode(self, fused: bool | None = None, pdl: bool | None = None) -> None:
        """``torch.compile`` the eager decode layer (:meth:`MoEModel.compile_decode` with
        ``fused=False``); the fused Triton step implements grouped-query attention and the softmax
        router, not MLA and the grouped sigmoid router, so ``fused=True`` is refused."""
        if fused:
            raise ValueError("compile_decode(fused=True): the fused decode kernels run grouped-query attention and a "
                             "softmax router; deepseek_v3's multi-head latent attention and grouped sigmoid router "
                             "run eagerly or under torch.compile (fused=False)")
        super().compile_decode(fused=False, pdl=pdl)

    def setup_cache(self, batch_size: int, max_seq: int) -> None:
        """Preallocate each layer's latent cache ``[batch_size, max_seq, kv_lora_rank]`` and RoPE
        key cache ``[batch_size, max_seq, qk_rope_head_dim]``."""
        cfg = self.config
        if self.cache_shape == (batch_size, max_seq):
            return
        for layer in self.layers:
            attn = layer.self_attn
            attn.latent_cache = torch.zeros((batch_size, max_seq, cfg.kv_lora_rank), dtype=self.dtype,
                                            device=self.device)
            attn.rope_key_cache = torch.zeros((batch_size, max_seq, cfg.qk_rope_head_dim), dtype=self.dtype,
                                              device=self.device)
        self.cache_shape = (batch_size, max_seq)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_factor).to(self.dtype), (emb.sin() * self.attention_factor).to(self.dtype)


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


# Weights every loader reads as stored, never through a float8 reader: the LM head (transformers'
# quantizers keep the output embedding unconverted) and the router (not a linear layer there).
_NEVER_CONVERTED = ("lm_head.weight", ".mlp.gate.weight")


def weight_putter(src: TensorSource, device: torch.device, dtype: torch.dtype,
                  read_linear: Callable[[str, tuple[int, ...]], torch.Tensor],
                  dequantized: list[tuple[int, int]] | None = None) -> Callable[..., None]:
    """``put(owner, name, key, as_dtype=dtype)``: read tensor ``key`` of ``owner.name``'s shape into
    it as a frozen parameter on ``device`` in ``as_dtype``. A linear layer's weight goes through
    ``read_linear(module, shape)`` (:mod:`coldset.engine.loading`'s reader: a weight the checkpoint
    converts to block FP8 comes back dequantized, a float8 weight it does not convert is refused);
    the LM head, the router and every other tensor are read as stored and must not be float8.
    ``dequantized`` collects ``(weights, scales)``, the element counts of each block-FP8 weight
    read dequantized (:func:`log_dequantized`)."""

    def put(owner: nn.Module, name: str, key: str, as_dtype: torch.dtype = dtype) -> None:
        shape = tuple(getattr(owner, name).shape)
        if isinstance(owner, nn.Linear) and name == "weight" and not key.endswith(_NEVER_CONVERTED):
            module = key.removesuffix(".weight")
            tensor = read_linear(module, shape)
            if dequantized is not None and f"{module}.weight_scale_inv" in src:
                dequantized.append((math.prod(shape), math.prod(fp8.scale_grid(*shape))))
        else:
            tensor = src.get(key, shape)
            if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise ModelLoadError(f"tensor {key!r} is {tensor.dtype}; the engine reads it unquantized (only "
                                     "linear layers other than the LM head and the router are read in float8)")
        setattr(owner, name, nn.Parameter(tensor.to(device=device, dtype=as_dtype), requires_grad=False))

    return put


def log_dequantized(family: str, dequantized: list[tuple[int, int]], dtype: torch.dtype) -> None:
    """Log what the block-FP8 linear layers outside the routed experts cost in ``dtype`` against
    their FP8 bytes and scales (``dequantized``: :func:`weight_putter`'s counts; nothing when empty)."""
    if not dequantized:
        return
    weights, scales = sum(w for w, _ in dequantized), sum(s for _, s in dequantized)
    held, stored = weights * dtype.itemsize, weights + 4 * scales
    log.info("%s: %d block-FP8 linear layers outside the routed experts (attention projections, shared experts, "
             "dense MLPs) dequantized to %s at load: %.3f GiB on the model's device where their FP8 bytes and "
             "scales are %.3f GiB (+%.3f GiB); the routed experts stay block FP8 in the expert pools", family,
             len(dequantized), str(dtype).removeprefix("torch."), held / 2**30, stored / 2**30,
             (held - stored) / 2**30)


def load_weights(model: DeepseekV3Model, src: TensorSource, device: torch.device, dtype: torch.dtype,
                 read_linear: Callable[[str, tuple[int, ...]], torch.Tensor]) -> None:
    """Read every weight but the routed experts from ``src`` by the checkpoint's names, into
    ``model`` (built on the meta device) on ``device`` in ``dtype``; the router's weight and
    ``e_score_correction_bias`` in float32. Linear layers through ``read_linear`` (:func:`weight_putter`:
    a block-FP8 checkpoint's are dequantized here to ``dtype``, the module docstring says why). The
    routed experts go into ``model.pools`` through :func:`coldset.engine.loading.load_model`'s expert
    reader (``model.layers.{i}.mlp.experts``, per-expert or fused; block FP8 kept as stored).
    Tensors of layers past ``num_hidden_layers`` (multi-token prediction) are not read; a log line
    says so."""
    cfg = model.config
    dequantized: list[tuple[int, int]] = []
    put = weight_putter(src, device, dtype, read_linear, dequantized)
    if cfg.num_mtp_layers:
        log.info("deepseek_v3: skipping %d multi-token-prediction layer(s) (model.layers.%d and on): the engine "
                 "decodes one token a step", cfg.num_mtp_layers, cfg.num_layers)
    put_shared_weights(model, src, put)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        attn = layer.self_attn
        names = ["q_proj"] if cfg.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
        for name in names + ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]:
            put(getattr(attn, name), "weight", f"{p}.self_attn.{name}.weight")
        mlp = layer.mlp
        if isinstance(mlp, DeepseekMoE):
            put(mlp.gate, "weight", f"{p}.mlp.gate.weight", torch.float32)
            mlp.e_score_correction_bias = src.get(f"{p}.mlp.gate.e_score_correction_bias", (cfg.num_experts,)).to(
                device=device, dtype=torch.float32)
            dense, prefix = mlp.shared_experts, f"{p}.mlp.shared_experts"
        else:
            dense, prefix = mlp, f"{p}.mlp"
        if dense is not None:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                put(getattr(dense, proj), "weight", f"{prefix}.{proj}.weight")
    model.inv_freq = model.inv_freq.to(device)
    log_dequantized(MODEL_TYPE, dequantized, dtype)
