"""GLM-4.5 (``model_type`` ``glm4_moe``, transformers' ``Glm4MoeForCausalLM``) for the embedded engine.

This file is only the model: its config, attention and weights-by-name. GLM-4.5 is DeepSeek-V3's
mixture of experts with standard grouped-query attention, so it is built from what exists:
:mod:`coldset.engine.model`'s :class:`~coldset.engine.model.Attention` (the fused qkv projection,
per-head qk RMSNorm, the static KV cache, GQA through SDPA) and decode state, and
:mod:`coldset.engine.deepseek_v3`'s :class:`~coldset.engine.deepseek_v3.DeepseekMoE` (the grouped
sigmoid router :func:`~coldset.engine.deepseek_v3.grouped_sigmoid_topk` in float32 with
``e_score_correction_bias`` for the choice only, ``n_group`` / ``topk_group``, ``norm_topk_prob``,
``routed_scaling_factor``, and ``n_shared_experts`` shared experts added to the routed sum); the
routed experts live in the model's :class:`~coldset.kernels.tiers.ExpertPools` behind the one
``experts_fn``, so every placement, the slot cache and the parity gate apply unchanged. What differs
from qwen3_moe's attention:

- ``attention_bias``: q, k and v projections with biases (o_proj without), fused into the one qkv GEMM.
- Partial RoPE: ``partial_rotary_factor`` (transformers' default for this family 0.5, in
  ``rope_parameters`` or at the top level) rotates the first ``head_dim * partial_rotary_factor``
  dims of each q and k head (``rotate_half`` over those dims) and passes the rest through.
- ``use_qk_norm`` (per-head RMSNorm of q and k before RoPE) is optional; ``head_dim`` is read from
  the config (GLM-4.5's 128 is not ``hidden_size / heads``).
- ``first_k_dense_replace`` dense layers (SwiGLU of ``intermediate_size``), MoE layers after.

Refused by name (:class:`~coldset.engine.model.ModelLoadError`): another ``hidden_act``, RoPE
scalings other than plain, a rotary width that is not a positive even number of dims, a group
layout the router cannot take, ``use_sliding_window``, and quantized checkpoints (their shape is
read by placement and statistics all the same). Multi-token-prediction layers
(``num_nextn_predict_layers``) are not read: the engine decodes one token a step, and
:func:`load_weights` logs that it skips them.

Numerics follow transformers' ``Glm4MoeForCausalLM``; the routed experts' weighted sum runs
through ``experts_fn`` (another summation order than transformers' per-expert loop), so logits
agree to float32 rounding, not bitwise. The fused Triton decode step implements neither attention
biases, partial RoPE nor the grouped sigmoid router: :meth:`Glm4MoeModel.compile_decode` refuses
it and compiles the eager layer with ``torch.compile`` instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from coldset.core.shapes import MoEShape, ShapeError, shape_from_hf_config
from coldset.engine.deepseek_v3 import DeepseekMoE, TensorSource, names_model_type, router_groups, weight_putter
from coldset.engine.model import Attention, DecoderLayer, ModelConfig, ModelLoadError, MoEModel
from coldset.engine.weights import put_shared_weights

log = logging.getLogger(__name__)

MODEL_TYPE = "glm4_moe"
# transformers' Glm4MoeConfig defaults of the fields the forward pass reads (what a config.json
# that leaves one out builds there); the shape's own defaults are coldset.core.shapes'.
_DEFAULTS = {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
             "partial_rotary_factor": 0.5, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 131072, "num_nextn_predict_layers": 1}


@dataclass(frozen=True, kw_only=True)
class Glm4MoeConfig(ModelConfig):
    """:class:`~coldset.engine.model.ModelConfig` plus the grouped router's fields, the attention
    biases and the rotary width. ``shared_expert_intermediate_size`` (the shape's) is
    ``n_shared_experts * moe_intermediate_size``. :meth:`from_hf_config` parses a config.json."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float
    attention_bias: bool
    rotary_dim: int
    num_mtp_layers: int = 0

    @classmethod
    def from_hf_config(cls, raw: dict, source: str = "config.json") -> "Glm4MoeConfig":
        """Parse a glm4_moe config dict; ``source`` names the file in error messages. The shape
        comes from :func:`coldset.core.shapes.shape_from_hf_config`; this adds the forward pass's
        fields and refuses, by field name, what the engine does not implement."""
        model_type = raw.get("model_type") if isinstance(raw, dict) else None
        if model_type != MODEL_TYPE:
            raise ModelLoadError(f"{source}: model_type {model_type!r} is not {MODEL_TYPE!r}")
        rope = _refuse_unsupported(raw, source)
        try:
            shape = shape_from_hf_config(raw, source)
        except ShapeError as exc:
            raise ModelLoadError(str(exc)) from None
        if shape.expert_format != shape.dtype or shape.linear_format != shape.dtype:
            raise ModelLoadError(f"{source}: quantization_config: quantized glm4_moe checkpoints "
                                 f"({shape.expert_format} experts) are not decoded by the engine; placement, "
                                 "statistics and the cache simulation read this shape without decoding")
        n_group, topk_group = router_groups(raw, shape, source, _DEFAULTS)
        factor = float(_get(rope, "partial_rotary_factor", _get(raw, "partial_rotary_factor")))
        rotary_dim = int(shape.head_dim * factor)
        if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > shape.head_dim:
            raise ModelLoadError(f"{source}: field 'partial_rotary_factor' ({factor}) of head_dim {shape.head_dim} "
                                 f"gives a rotary width of {rotary_dim} dims; it must be a positive even number "
                                 "of dims at most head_dim")
        return cls(
            **{f.name: getattr(shape, f.name) for f in fields(MoEShape)},
            norm_topk_prob=bool(_get(raw, "norm_topk_prob")),
            rms_norm_eps=float(_get(raw, "rms_norm_eps")),
            rope_theta=float(_get(rope, "rope_theta", _get(raw, "rope_theta"))),
            max_position_embeddings=int(_get(raw, "max_position_embeddings")),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(_get(raw, "routed_scaling_factor")),
            attention_bias=bool(raw.get("attention_bias", False)),
            rotary_dim=rotary_dim,
            num_mtp_layers=int(raw.get("num_nextn_predict_layers", raw.get(
                "num_mtp_layers", _DEFAULTS["num_nextn_predict_layers"])) or 0),
        )


def is_glm4_moe(path: str | os.PathLike) -> bool:
    """Whether ``path/config.json`` names ``model_type`` glm4_moe."""
    return names_model_type(path, MODEL_TYPE)


def _get(raw: dict, name: str, default=None):
    """``raw[name]``, else ``default``, else transformers' default (a missing field or a null)."""
    value = raw.get(name)
    if value is not None:
        return value
    return _DEFAULTS[name] if default is None else default


def _refuse_unsupported(raw: dict, source: str) -> dict:
    """Refuse, naming the field, a glm4_moe config whose forward pass the engine does not run;
    returns its RoPE parameters (``rope_parameters`` or ``rope_scaling``, ``{}`` for none)."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: field 'hidden_act' is {raw['hidden_act']!r}; the engine implements "
                             "glm4_moe with hidden_act 'silu' only")
    if raw.get("use_sliding_window"):
        raise ModelLoadError(f"{source}: field 'use_sliding_window' is true; glm4_moe attends over every token")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ModelLoadError(f"{source}: RoPE scaling {rope_type!r} (rope_parameters/rope_scaling) is not "
                             "implemented for glm4_moe; only plain RoPE")
    return rope


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GlmAttention(Attention):
    """:class:`~coldset.engine.model.Attention` with q/k/v biases (``attention_bias``) in the fused
    qkv projection and RoPE on the first ``rotary_dim`` dims of each head (the rest passed through)."""

    def __init__(self, cfg: Glm4MoeConfig):
        super().__init__(cfg)
        if cfg.attention_bias:  # q, k and v biases, concatenated as the rows are
            self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=True, device="meta")
        self.rotary_dim = cfg.rotary_dim

    def forward(self, x, cos, sin, slots, mask):
        """``x`` [B, T, H]; ``cos``/``sin`` [B, T, rotary_dim]; ``slots`` [T]; ``mask`` [B, 1, T, S]."""
        bsz, seq, _ = x.shape
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(bsz, seq, nh + nkv, d)  # q and k heads side by side: norm and RoPE are per head
        if self.q_norm is not None:
            qk = self.qk_norm_weight * F.rms_norm(qk, (d,), eps=self.eps)
        rot, rest = qk.split([self.rotary_dim, d - self.rotary_dim], dim=-1)
        rot = rot * cos.unsqueeze(2) + _rotate_half(rot) * sin.unsqueeze(2)
        q, k = torch.cat((rot, rest), dim=-1).split([nh, nkv], dim=2)
        self.k_cache.index_copy_(1, slots, k)
        self.v_cache.index_copy_(1, slots, v.view(bsz, seq, nkv, d))
        kv_len = mask.shape[-1]  # attend over the first kv_len slots (a shape, not data)
        keys = self.k_cache[:, :kv_len].transpose(1, 2)  # [B, KV, S, D]
        values = self.v_cache[:, :kv_len].transpose(1, 2)
        # GQA without repeating K/V, as model.Attention: a kv head's `rep` query heads as `rep * T` rows
        rep = nh // nkv
        q = q.transpose(1, 2).reshape(bsz, nkv, rep * seq, d)
        if rep > 1:
            mask = mask[:, :, None].expand(bsz, 1, rep, seq, kv_len).reshape(bsz, 1, rep * seq, kv_len)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        out = out.reshape(bsz, nh, seq, d).transpose(1, 2)
        return self.o_proj(out.reshape(bsz, seq, nh * d))


class Glm4MoeDecoderLayer(DecoderLayer):
    """Pre-norm attention and MLP (dense before ``first_k_dense_replace``, DeepSeek-V3's MoE after)."""

    attention = GlmAttention
    moe_block = DeepseekMoE


class Glm4MoeModel(MoEModel):
    """A glm4_moe model in :class:`~coldset.engine.model.MoEModel`'s interface (the same forward
    pass, pools, ``experts_fn``, ``routing_sink``, KV cache and decode state), with RoPE over
    ``rotary_dim`` dims."""

    def __init__(self, cfg: Glm4MoeConfig):
        super().__init__(cfg)
        self.layers = nn.ModuleList(Glm4MoeDecoderLayer(cfg, i, self) for i in range(cfg.num_layers))
        r = cfg.rotary_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))

    def compile_decode(self, fused: bool | None = None, pdl: bool | None = None) -> None:
        """``torch.compile`` the eager decode layer (:meth:`MoEModel.compile_decode` with
        ``fused=False``); the fused Triton step implements neither q/k/v biases, partial RoPE nor
        the grouped sigmoid router, so ``fused=True`` is refused."""
        if fused:
            raise ValueError("compile_decode(fused=True): the fused decode kernels run attention without q/k/v biases, "
                             "RoPE over the whole head and a softmax router; glm4_moe's biased, partially rotated "
                             "attention and grouped sigmoid router run eagerly or under torch.compile (fused=False)")
        super().compile_decode(fused=False, pdl=pdl)


def load_weights(model: Glm4MoeModel, src: TensorSource, device: torch.device, dtype: torch.dtype,
                 read_linear: Callable[[str, tuple[int, ...]], torch.Tensor]) -> None:
    """Read every weight but the routed experts from ``src`` by the checkpoint's names into
    ``model`` (built on the meta device) on ``device`` in ``dtype``; the router's weight and
    ``e_score_correction_bias`` in float32. ``read_linear(module, shape)`` reads a linear layer's
    weight (:mod:`coldset.engine.loading`'s reader, which refuses a float8 weight this config does
    not convert). The routed experts go into ``model.pools`` through
    :func:`coldset.engine.loading.load_model`'s expert reader. Tensors of layers past
    ``num_hidden_layers`` (multi-token prediction) are not read; a log line says so."""
    cfg = model.config
    put = weight_putter(src, device, dtype, read_linear)

    def tensor(value: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=False)

    if cfg.num_mtp_layers:
        log.info("glm4_moe: skipping %d multi-token-prediction layer(s) (model.layers.%d and on): the engine "
                 "decodes one token a step", cfg.num_mtp_layers, cfg.num_layers)
    put_shared_weights(model, src, put)
    h = cfg.hidden_size
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}.self_attn"
        attn = layer.self_attn
        parts = (("q_proj", attn.q_size), ("k_proj", attn.kv_size), ("v_proj", attn.kv_size))
        attn.qkv_proj.weight = tensor(torch.cat([read_linear(f"{p}.{name}", (rows, h)) for name, rows in parts]))
        if cfg.attention_bias:
            attn.qkv_proj.bias = tensor(torch.cat([src.get(f"{p}.{name}.bias", (rows,)) for name, rows in parts]))
        put(attn.o_proj, "weight", f"{p}.o_proj.weight")
        if cfg.qk_norm:
            put(attn.q_norm, "weight", f"{p}.q_norm.weight")
            put(attn.k_norm, "weight", f"{p}.k_norm.weight")
            attn.fuse_qk_norm()
        mlp, prefix = layer.mlp, f"model.layers.{i}.mlp"
        if isinstance(mlp, DeepseekMoE):
            put(mlp.gate, "weight", f"{prefix}.gate.weight", torch.float32)  # the router: never float8
            mlp.e_score_correction_bias = src.get(f"{prefix}.gate.e_score_correction_bias", (cfg.num_experts,)).to(
                device=device, dtype=torch.float32)
            mlp, prefix = mlp.shared_experts, f"{prefix}.shared_experts"
        if mlp is not None:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                put(getattr(mlp, proj), "weight", f"{prefix}.{proj}.weight")
    model.inv_freq = model.inv_freq.to(device)
