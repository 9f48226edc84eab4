"""The embedded engine's model: a one-file MoE transformer for Hugging Face qwen3_moe and mixtral.

What it is for: profiling routing on a person's own prompts and serving as the unmodified path
the offload machinery is checked against. This file is only the model (its config, modules and
forward pass, and the faster decode regions :meth:`MoEModel.compile_decode` installs); a local HF
folder is read by :mod:`coldset.engine.loading` and decoded greedily by
:mod:`coldset.engine.generate`. Every routed expert lives in one
:class:`~coldset.kernels.tiers.ExpertPools` (so later stages move experts between tiers without
touching this file).

Layout of the decode state (why it looks like this): a batch of prompts of different lengths is
left-padded to a common length ``P``; cache *slot* ``s`` holds the token at column ``s`` of every
sequence, while each sequence has its own *position* ``s - pad[b]`` (so RoPE sees the same
positions as an unpadded run). Decode step ``t`` writes slot ``P + t`` for every sequence. The
attention mask is explicit (``key slot >= pad[b]``, causal, optional sliding window), the cache is
preallocated ``[B, max_seq, kv_heads, head_dim]`` per layer and written by index, so the decode
step has no data-dependent Python control flow or host sync outside ``experts_fn`` and can be
captured in a CUDA graph.

Numerics follow transformers: RMSNorm in float32 then cast, router logits in the model dtype,
softmax in float32, top-k, renormalisation (mixtral always, qwen3_moe when ``norm_topk_prob``),
router weights cast to the activation dtype before the weighted sum (transformers does this for
qwen3_moe; for mixtral it multiplies in float32, which only differs in bf16/fp16).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from coldset.core import fp8
from coldset.core.shapes import MoEShape, ShapeError, shape_from_hf_config
from coldset.kernels import softmax_topk, torch_experts
from coldset.kernels.tiers import ExpertPools

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "mixtral")
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class ModelLoadError(ValueError):
    """A local model folder could not be read; the message names the file, field or tensor."""


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def refuse_unsupported_quantization(raw: dict, shape: MoEShape, source: str) -> None:
    """Refuse, naming the field, a quantized checkpoint the engine does not decode: anything but the
    published block FP8 (:func:`coldset.core.fp8.parse_quantization_config`: quant_method fp8, e4m3,
    dynamic activations, 128 x 128 blocks) with its routed experts converted."""
    if shape.expert_format == shape.dtype and shape.linear_format == shape.dtype:
        return
    try:
        fp8.parse_quantization_config(raw.get("quantization_config"), source)
    except fp8.Fp8FormatError as exc:
        raise ModelLoadError(f"{exc}; placement, statistics and the cache simulation read this shape without "
                             "decoding") from None
    if shape.expert_format != fp8.FORMAT_NAME:
        raise ModelLoadError(f"{source}: quantization_config: routed experts in {shape.expert_format} beside block-FP8 "
                             f"linear layers are not decoded by the engine (its experts are {fp8.FORMAT_NAME} or "
                             "unquantized in every layer)")


@dataclass(frozen=True, kw_only=True)
class ModelConfig(MoEShape):
    """The architecture of a checkpoint, parsed from its HF config.json: its shape plus what the
    forward pass needs beyond bytes and routing.

    The shape fields (``hidden_size``, ``moe_layers``, ``top_k``, the weight formats, ...) are
    :class:`coldset.core.shapes.MoEShape`'s, read by the one config.json parser every stage uses
    (:func:`coldset.core.shapes.shape_from_hf_config`), so the engine and placement can never disagree
    about a model. ``moe_layers`` holds the *model* layer indices of the MoE layers, in order;
    MoE-layer index ``i`` (the row-map index) is ``moe_layers[i]``. ``intermediate_size`` is the
    dense MLP width of non-MoE layers (qwen3_moe ``mlp_only_layers`` / ``decoder_sparse_step``;
    0 when every layer is MoE). ``to_dict`` / ``from_dict`` (MoEShape's) round-trip a record of it
    (the model manifest); :meth:`from_hf_config` parses a config.json.
    """

    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int | None = None  # mixtral: implemented in the attention mask
    max_position_embeddings: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_hf_config(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        """Parse an HF config dict; ``source`` names the file in error messages. The shape comes
        from :func:`coldset.core.shapes.shape_from_hf_config`; this adds what only the engine refuses
        (families, activations, RoPE scalings and weight formats it does not implement)."""
        model_type = raw.get("model_type") if isinstance(raw, dict) else None
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"{source}: unsupported model_type {model_type!r}; coldset's engine supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{source}: unsupported hidden_act {act!r} (only 'silu')")
        if raw.get("attention_bias"):
            raise ModelLoadError(f"{source}: attention_bias=true is not supported")

        # RoPE: transformers 5 writes rope_parameters; older checkpoints rope_theta + rope_scaling.
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelLoadError(
                f"{source}: unsupported RoPE scaling {rope_type!r} (rope_parameters/rope_scaling); "
                "only plain RoPE is implemented"
            )
        if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ModelLoadError(f"{source}: partial_rotary_factor != 1 is not supported")
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))

        try:
            shape = shape_from_hf_config(raw, source)
        except ShapeError as exc:
            raise ModelLoadError(str(exc)) from None
        refuse_unsupported_quantization(raw, shape, source)
        if model_type == "qwen3_moe":
            norm_topk = bool(raw.get("norm_topk_prob", False))
            sliding = raw.get("sliding_window") if raw.get("use_sliding_window") else None
            if sliding is not None:
                raise ModelLoadError(f"{source}: use_sliding_window=true is not supported for qwen3_moe")
        else:  # mixtral renormalises the top-k probabilities, always
            norm_topk = True
            sliding = raw.get("sliding_window")
        eps = raw.get("rms_norm_eps")
        return cls(
            **{f.name: getattr(shape, f.name) for f in fields(MoEShape)},
            norm_topk_prob=norm_topk,
            rms_norm_eps=1e-6 if eps is None else float(eps),
            rope_theta=rope_theta,
            sliding_window=None if sliding is None else int(sliding),
            max_position_embeddings=raw.get("max_position_embeddings"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read ``path/config.json`` (``path`` a local HF folder)."""
        folder = Path(path)
        if not folder.is_dir():
            raise ModelLoadError(f"model folder {folder} does not exist")
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"{cfg_path}: missing (every HF model folder has a config.json)")
        try:
            raw = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ModelLoadError(f"{cfg_path}: not valid JSON ({err})") from err
        return cls.from_hf_config(raw, source=str(cfg_path))


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm as transformers computes it: normalise (in float32), cast back, then scale.

    ``F.rms_norm`` without a weight upcasts half-precision inputs internally, which is the same
    computation in one fused op.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.shape = (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x, self.shape, eps=self.eps)


def _linear(out_features: int, in_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False, device="meta")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """GQA self-attention with RoPE, optional per-head qk RMSNorm, writing a static KV cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v projections fused into one GEMM (rows: q, then k, then v).
        self.qkv_proj = _linear(self.q_size + 2 * self.kv_size, cfg.hidden_size)
        self.o_proj = _linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # [B, max_seq, kv_heads, head_dim], set by MoEModel.setup_cache. Buffers, so that a
        # compiled decode region treats them as inputs it writes, not as constants.
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)
        self.eps = cfg.rms_norm_eps
        self.qk_norm_weight: torch.Tensor | None = None  # [nh + nkv, D], set by fuse_qk_norm()
        # Block-FP8 copies of the projections for the fused one-token path (set_fp8; None: none).
        # Buffers (not persistent), so that moving the model moves them.
        for name in ("qkv_fp8", "qkv_scale", "o_fp8", "o_scale"):
            self.register_buffer(name, None, persistent=False)

    def set_fp8(self, qkv: list[tuple[torch.Tensor, torch.Tensor]] | None,
                o: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Give the fused one-token decode path (:func:`fused_layer_before_experts` at batch 1) the
        projections in block FP8: ``qkv`` the ``(weight float8_e4m3fn, weight_scale_inv)`` of q, k and
        v in that order (each its own 128 x 128 grid), ``o`` o_proj's; None leaves that projection
        without an FP8 copy. Kept as ``qkv_fp8`` ``[q + 2 kv, H]`` with ``qkv_scale``, the three
        per-row scale tables concatenated (:func:`coldset.core.fp8.row_scales`), and ``o_fp8`` /
        ``o_scale``, on the device of the layer's weights.

        Why beside the float ``qkv_proj`` / ``o_proj`` weights (which hold the same values
        dequantized to the model dtype): every other path (eager, prefill, the Inductor region, from
        two tokens on, the comparison with transformers) runs those; the GEMV at one token reads the
        FP8 bytes, half the bytes of bf16, and that is where the step streams them. The cost is the
        FP8 copy beside the float one: 1 byte a weight plus 4 bytes a row and 128-column group
        (Qwen3-30B-A3B: 0.93 GB beside 1.81 GB of bf16 projections). The fused path then rounds
        differently from the dequantized one (each group's float32 sum of e4m3 x input times its
        float32 scale; the weight never rounded to bf16), so its logits are not the dequantized
        path's bits; parity (placements against all hot) compares one engine on both sides, so it
        holds as it does for bf16."""
        dev = self.qkv_proj.weight.device
        hidden = self.qkv_proj.weight.shape[1]
        if qkv is not None:
            sizes = (self.q_size, self.kv_size, self.kv_size)
            for (q, s), rows, name in zip(qkv, sizes, ("q_proj", "k_proj", "v_proj")):
                if q.dtype != fp8.FP8_DTYPE or tuple(q.shape) != (rows, hidden):
                    raise ValueError(f"Attention.set_fp8: {name} must be {fp8.FP8_DTYPE} [{rows}, {hidden}], got "
                                     f"{q.dtype} {list(q.shape)}")
            self.qkv_fp8 = torch.cat([q for q, _ in qkv]).to(dev)
            self.qkv_scale = torch.cat([fp8.row_scales(s, rows, hidden) for (_, s), rows in zip(qkv, sizes)]).to(dev)
        else:
            self.qkv_fp8 = self.qkv_scale = None
        if o is not None:
            q, s = o
            want = (hidden, self.num_heads * self.head_dim)
            if q.dtype != fp8.FP8_DTYPE or tuple(q.shape) != want:
                raise ValueError(f"Attention.set_fp8: o_proj must be {fp8.FP8_DTYPE} {list(want)}, got {q.dtype} "
                                 f"{list(q.shape)}")
            self.o_fp8, self.o_scale = q.to(dev), fp8.row_scales(s, *want).to(dev)
        else:
            self.o_fp8 = self.o_scale = None

    def fuse_qk_norm(self) -> None:
        """Stack the q_norm and k_norm weights per head, for the one-op qk-norm in forward."""
        if self.q_norm is not None:
            self.qk_norm_weight = torch.cat([
                self.q_norm.weight.expand(self.num_heads, self.head_dim),
                self.k_norm.weight.expand(self.num_kv_heads, self.head_dim),
            ])

    def forward(self, x, cos, sin, slots, mask):
        """``x`` [B, T, H]; ``cos``/``sin`` [B, T, D]; ``slots`` [T] cache slots; ``mask`` [B, 1, T, S]."""
        bsz, seq, _ = x.shape
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads side by side [B, T, nh + nkv, D]: qk-norm and RoPE are per head and
        # elementwise, so one op on both is the same arithmetic as transformers' two.
        qk = qk.view(bsz, seq, nh + nkv, d)
        if self.q_norm is not None:
            qk = self.qk_norm_weight * F.rms_norm(qk, (d,), eps=self.eps)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        qk = qk * cos + _rotate_half(qk) * sin
        q, k = qk.split([nh, nkv], dim=2)
        v = v.view(bsz, seq, nkv, d)
        self.k_cache.index_copy_(1, slots, k)
        self.v_cache.index_copy_(1, slots, v)
        kv_len = mask.shape[-1]  # attend over the first kv_len slots (a shape, not data)
        keys = self.k_cache[:, :kv_len].transpose(1, 2)  # [B, KV, S, D]
        values = self.v_cache[:, :kv_len].transpose(1, 2)
        # GQA without repeating K/V: the `rep` query heads of one kv head become `rep * T` query
        # rows against that kv head (q head h uses kv head h // rep, as in transformers).
        rep = self.num_heads // self.num_kv_heads
        q = q.transpose(1, 2).reshape(bsz, self.num_kv_heads, rep * seq, self.head_dim)
        if rep > 1:
            mask = mask[:, :, None].expand(bsz, 1, rep, seq, kv_len).reshape(bsz, 1, rep * seq, kv_len)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        out = out.reshape(bsz, self.num_heads, seq, self.head_dim).transpose(1, 2)
        return self.o_proj(out.reshape(bsz, seq, self.num_heads * self.head_dim))


class DenseMLP(nn.Module):
    """The SwiGLU MLP of qwen3_moe's non-MoE layers."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = _linear(cfg.intermediate_size, cfg.hidden_size)
        self.up_proj = _linear(cfg.intermediate_size, cfg.hidden_size)
        self.down_proj = _linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEBlock(nn.Module):
    """Router + routed experts. The experts' weights live in the model's pools, not here."""

    def __init__(self, cfg: ModelConfig, moe_index: int, model: "MoEModel"):
        super().__init__()
        self.gate = _linear(cfg.num_experts, cfg.hidden_size)  # the router
        self.moe_index = moe_index
        self.top_k = cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self._model = [model]  # a list, so the parent is not registered as a submodule
        self._route_counter: torch.Tensor | None = None

    def route_counter_on(self, device: torch.device) -> torch.Tensor:
        """This block's int32 ``[1]`` ticket counter for the fused router launch
        (:func:`coldset.kernels.triton_decode.route`: zero between launches; one per layer, so
        launches of different layers never share one)."""
        if self._route_counter is None or self._route_counter.device != device:
            self._route_counter = torch.zeros(1, dtype=torch.int32, device=device)
        return self._route_counter

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_ids [N, k] int64, topk_weights [N, k] float32)`` for tokens ``flat`` [N, H]."""
        return softmax_topk(F.linear(flat, self.gate.weight), self.top_k, self.norm_topk_prob)

    def experts(self, flat: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum ``[N, H]`` through the model's ``experts_fn``."""
        model = self._model[0]
        if model.routing_sink is not None:
            model.routing_sink.append((topk_ids, topk_weights))
        fn = model.experts_fn
        # An experts function marked casts_weights (a slot cache's) casts them in a launch it makes anyway.
        w = topk_weights if getattr(fn, "casts_weights", False) else topk_weights.to(flat.dtype)
        return fn(model.pools, self.moe_index, flat, topk_ids, w)


def layer_before_experts(layer: "DecoderLayer", x, delta, cos, sin, slots, mask):
    """One layer up to its routed experts: ``(x, h, topk_ids, topk_weights)``.

    ``x + delta`` is the layer's input (``delta`` = the previous layer's MLP output), so the
    residual add that ends one layer runs in the same region as the next layer's attention. The
    layer's output is ``x + mlp(h)``; ``topk_*`` are ``None`` for a dense layer. Why a free
    function of the layer: everything between two experts calls is one region that
    :meth:`MoEModel.compile_decode` hands to ``torch.compile`` (one compiled graph serves every
    layer, since the layers differ only in their tensors), while the experts call, with its
    host-side dispatch and Triton launches, stays outside it.
    """
    x = x + delta
    bsz, seq, hidden = x.shape
    x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, slots, mask)
    h = layer.post_attention_layernorm(x)
    if isinstance(layer.mlp, MoEBlock):
        flat = h.reshape(bsz * seq, hidden)
        topk_ids, topk_weights = layer.mlp.route(flat)
        return x, flat, topk_ids, topk_weights
    return x, h, None, None


def fused_layer_before_experts(layer: "DecoderLayer", x, delta, cos, sin, slots, mask, pdl: bool | None = None):
    """:func:`layer_before_experts` for one decode token per sequence in Triton launches
    (:mod:`coldset.kernels.triton_decode`, CUDA): the residual add, input norm and qkv projection
    in one (at batch 1 :func:`~coldset.kernels.triton_decode.gemv`; from 2 tokens on, the add and
    norm in one and the projection by cuBLAS, which is faster there); qk-norm, RoPE, the KV write
    and attention in one; o_proj with the residual add; and for a MoE layer the post-attention
    norm, the router and its softmax + top-k in one (:func:`~coldset.kernels.triton_decode.route`),
    so a MoE layer is four launches before its experts at batch 1. Why: the step outside the
    experts is launch latency and weight streaming (BENCHMARKS.md). At batch 1 an
    attention with block-FP8 copies (:meth:`Attention.set_fp8`: an FP8 checkpoint's, or
    :func:`coldset.engine.loading.attach_fp8_attention`) runs its qkv and o_proj GEMVs on the FP8 bytes and their scales
    (weight-only: fp32 products, each 128-column group's sum times its scale), not on the
    dequantized weights: other roundings than the dequantized path's, the same in every placement.
    route's weights come in the model dtype (the cast the experts call would make, in the same
    launch) unless the experts function casts them itself or a routing sink records them (then
    float32, as :meth:`MoEBlock.route`). ``pdl``: launch the kernels as
    programmatic dependent launches (Hopper), each reading its weights while its predecessor
    finishes; None: :func:`~coldset.kernels.triton_decode.pdl_default` for the batch size. Same
    contract as :func:`layer_before_experts` (decode only)."""
    from coldset.kernels import triton_decode as td  # GPU-only: imports triton at its top

    bsz, seq, hidden = x.shape
    if seq != 1:
        raise ValueError(f"fused_layer_before_experts: one token per sequence (decode), got {seq}")
    attn, norm_in, norm_post = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
    if pdl is None:
        pdl = td.pdl_default(bsz, x.device)
    if bsz == 1:  # block-FP8 projections (Attention.set_fp8) read as FP8 bytes with their scales
        w, ws = (attn.qkv_fp8, attn.qkv_scale) if attn.qkv_fp8 is not None else (attn.qkv_proj.weight, None)
        x, qkv = td.gemv(x.view(1, hidden), w, norm_weight=norm_in.weight, eps=norm_in.eps,
                         add=delta.view(1, hidden), pdl=pdl, weight_scale=ws)
    else:
        x, normed = td.rms_norm(x.view(bsz, hidden), norm_in.weight, norm_in.eps, add=delta.view(bsz, hidden), pdl=pdl)
        qkv = F.linear(normed, attn.qkv_proj.weight)
    out = td.decode_attention(qkv, attn.qk_norm_weight, cos, sin, attn.k_cache, attn.v_cache, slots, mask,
                              attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.eps, pdl=pdl)
    if bsz == 1:
        w, ws = (attn.o_fp8, attn.o_scale) if attn.o_fp8 is not None else (attn.o_proj.weight, None)
        x = td.gemv(out, w, residual=x, pdl=pdl, weight_scale=ws)
    else:
        x = td.norm_linear(out, attn.o_proj.weight, residual=x, pdl=pdl)
    if isinstance(layer.mlp, MoEBlock):
        mlp = layer.mlp
        model = mlp._model[0]
        cache = getattr(model.experts_fn, "slot_cache", None)
        if cache is not None and model.routing_sink is None and cache.records_in_route(bsz):
            # a slot cache's decisions in the router's launch (SlotCache.route)
            h, topk_ids, topk_weights = cache.route(mlp.moe_index, x, norm_post.weight, norm_post.eps, mlp.gate.weight,
                                                    mlp.top_k, mlp.norm_topk_prob, mlp.route_counter_on(x.device),
                                                    pdl=pdl)
            return x.view(bsz, seq, hidden), h, topk_ids, topk_weights
        keep_f32 = model.routing_sink is not None or getattr(model.experts_fn, "casts_weights", False)
        h, topk_ids, topk_weights = td.route(x, norm_post.weight, norm_post.eps, mlp.gate.weight, mlp.top_k,
                                             mlp.norm_topk_prob, mlp.route_counter_on(x.device),
                                             weights_dtype=torch.float32 if keep_f32 else x.dtype, pdl=pdl)
        return x.view(bsz, seq, hidden), h, topk_ids, topk_weights
    h = td.rms_norm(x, norm_post.weight, norm_post.eps, pdl=pdl)
    return x.view(bsz, seq, hidden), h.view(bsz, seq, hidden), None, None


def fused_norm_lm_head(model: "MoEModel", x, delta, pdl: bool | None = None):
    """The decode step's end for the fused engine: logits ``[B, 1, V]`` of ``lm_head(norm(x + delta))``,
    at batch 1 one :func:`~coldset.kernels.triton_decode.gemv` (the add, the final norm and the
    LM head, the step's largest matrix), from 2 tokens on :func:`~coldset.kernels.triton_decode.rms_norm`
    with the add, then cuBLAS."""
    from coldset.kernels import triton_decode as td  # GPU-only: imports triton at its top

    bsz, seq, hidden = x.shape
    if pdl is None:
        pdl = td.pdl_default(bsz, x.device)
    if bsz == 1:
        _, logits = td.gemv(x.view(1, hidden), model.lm_head.weight, norm_weight=model.norm.weight,
                            eps=model.norm.eps, add=delta.view(1, hidden), pdl=pdl)
    else:
        _, normed = td.rms_norm(x.view(bsz, hidden), model.norm.weight, model.norm.eps, add=delta.view(bsz, hidden),
                                pdl=pdl)
        logits = F.linear(normed, model.lm_head.weight)
    return logits.view(bsz, seq, -1)


def fused_decode_supported(model: "MoEModel") -> str | None:
    """Why :func:`fused_layer_before_experts` cannot run ``model`` (None if it can): CUDA,
    triton, a half-precision dtype (the kernels' dots would run float32 as tf32), a power-of-two
    head_dim of at least 16 and, with qk-norm, the stacked qk-norm weights."""
    if model.device.type != "cuda":
        return f"the model is on {model.device}, the fused decode kernels are CUDA only"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if model.dtype not in (torch.bfloat16, torch.float16):
        return f"the model dtype is {model.dtype}; the fused decode kernels take bfloat16 or float16"
    d = model.config.head_dim
    if d < 16 or d & (d - 1):
        return f"head_dim {d} is not a power of two >= 16"
    if model.config.qk_norm and any(layer.self_attn.qk_norm_weight is None for layer in model.layers):
        return "qk-norm weights are not stacked (Attention.fuse_qk_norm)"
    return None


def fp8_attention_linears(model: "MoEModel", batch_size: int) -> list[str]:
    """The attention projections a decode step of ``batch_size`` tokens runs in FP8 as the model is
    compiled now: ``qkv_proj`` and/or ``o_proj`` where every layer has its copy
    (:meth:`Attention.set_fp8`), on the fused path (:meth:`MoEModel.compile_decode`) at one token
    only (eager, Inductor and batches of 2 tokens on run the dequantized weights); else ``[]``."""
    chosen = model._compiled_before_experts
    if batch_size != 1 or getattr(chosen, "func", chosen) is not fused_layer_before_experts:
        return []
    attns = [layer.self_attn for layer in model.layers]
    return [name for name, attr in (("qkv_proj", "qkv_fp8"), ("o_proj", "o_fp8"))
            if attns and all(getattr(a, attr) is not None for a in attns)]


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP (:class:`MoEBlock` on the MoE layers, :class:`DenseMLP` elsewhere).
    A family with other attention or routing gives its own classes as ``attention`` and ``moe_block``."""

    attention = None  # None: Attention
    moe_block = None  # None: MoEBlock

    def __init__(self, cfg: ModelConfig, layer_idx: int, model: "MoEModel"):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = (self.attention or Attention)(cfg)
        if layer_idx in cfg.moe_layers:
            self.mlp = (self.moe_block or MoEBlock)(cfg, cfg.moe_layers.index(layer_idx), model)
        else:
            self.mlp = DenseMLP(cfg)

    def mlp_out(self, h, topk_ids, topk_weights):
        """The MLP's output for :func:`layer_before_experts`'s ``h`` (shaped like the layer input's)."""
        if topk_ids is None:
            return self.mlp(h)
        return self.mlp.experts(h, topk_ids, topk_weights)


class MoEModel(nn.Module):
    """A decoder-only MoE transformer (qwen3_moe or mixtral) with a static KV cache.

    ``pools`` holds every routed expert (``ExpertPools``); ``experts_fn(pools, moe_index, x,
    topk_ids, topk_weights)`` is the one replaceable experts computation (default
    :func:`coldset.kernels.torch_experts`); its ``topk_weights`` are in ``x``'s dtype, unless the
    function has the attribute ``casts_weights = True`` (a slot cache's, :meth:`coldset.engine.cache.pool.SlotCache.wrap`):
    then it gets the router's float32 weights and casts them itself. Set ``routing_sink`` to a list to have every MoE
    block append ``(topk_ids, topk_weights)`` (float32, before the cast) in call order.
    Build it with :func:`coldset.engine.loading.load_model`.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device="meta")
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = _linear(cfg.vocab_size, cfg.hidden_size)
        self.pools: ExpertPools | None = None
        self.experts_fn: Callable = torch_experts
        self.routing_sink: list | None = None
        self.cache_shape: tuple[int, int] | None = None  # (batch, max_seq)
        self._compiled_before_experts: Callable | None = None  # set by compile_decode()
        self._fused_head: Callable | None = None  # the fused engine's final norm + LM head (compile_decode)
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def decode_is_dynamo_compiled(self) -> bool:
        """Whether decode steps run a ``torch.compile``d region (:meth:`compile_decode` with
        ``fused=False``). Dynamo runs the newest compiled graph whose guards a step passes, so which
        kernels a step runs depends on what ran before it: two runs that must compare bit for bit
        are warmed first (:func:`coldset.verify.gate.warm_compiled_decode`). The fused region always
        comes with its fused head; the ``torch.compile`` one never does."""
        return self._compiled_before_experts is not None and self._fused_head is None

    def compile_decode(self, fused: bool | None = None, pdl: bool | None = None) -> None:
        """Run decode steps (one token per sequence) through a faster region than the eager
        :func:`layer_before_experts`: the Triton kernels of :func:`fused_layer_before_experts`
        (``fused=True``; the default wherever :func:`fused_decode_supported` says they run: CUDA,
        triton, bf16/fp16) or a ``torch.compile``d :func:`layer_before_experts` (``fused=False``;
        the default elsewhere).

        Why: at batch 1 the step outside the experts is ~25 small kernels a layer in eager (norms,
        qk-norm, RoPE, KV write, SDPA, router, residual adds), launch latency rather than bytes;
        Inductor fuses the elementwise ones into a few (~12 kernels a layer), the fused kernels
        bring it to four launches plus the router's. The experts call stays between the regions,
        and the whole step can still be captured in one CUDA graph (:class:`coldset.bench.decode.Decoder`).
        Prefill is neither. Neither region is bitwise the eager step (other reduction orders, float32
        kept across fused ops), so every run that compares tokens (parity gate, bench) runs one
        engine on both sides. The Inductor region compiles in Inductor's deterministic mode: its
        reductions' block sizes and warps (the order of their sums) are not picked by timing, so a
        shape compiled again, in this run or the next, rounds the same. ``fused=True`` where the
        kernels cannot run raises, naming why.
        ``pdl`` (fused only): launch the kernels as programmatic dependent launches (Hopper, the
        same bits); None: where it measured faster (at batch 1 on Hopper or newer,
        :func:`coldset.kernels.triton_decode.pdl_default`).
        """
        reason = fused_decode_supported(self)
        if fused is None:
            fused = reason is None
        if fused:
            if reason is not None:
                raise ValueError(f"compile_decode(fused=True): {reason}")
            self._compiled_before_experts = functools.partial(fused_layer_before_experts, pdl=pdl)
            self._fused_head = functools.partial(fused_norm_lm_head, pdl=pdl)
            return
        self._fused_head = None
        if pdl:
            raise ValueError("compile_decode(pdl=True) needs the fused kernels (fused=True)")
        import torch._dynamo.config as dynamo_config  # torch-heavy, needed only when compiling

        # A region past the recompile limit would silently run eagerly (other numerics): fail.
        dynamo_config.fail_on_recompile_limit_hit = True
        # Routing, gate and bench batches differ in batch size, key length and mask strides: each
        # new kind of difference recompiles once (then that size is symbolic); 8 is too few.
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
        import torch._inductor.config as inductor_config  # deterministic mode: the docstring

        if not hasattr(inductor_config, "deterministic"):
            raise ValueError(f"compile_decode(fused=False) needs Inductor's deterministic mode (torch >= 2.10), "
                             f"torch {torch.__version__} lacks it: its timed reduction configs could change the "
                             f"compiled step's sums from run to run; decode eagerly (no compile_decode) instead")
        # dynamic=None: the first shape compiles static; a second (batch size, key length) makes
        # those sizes symbolic, so generate()'s growing mask costs one more compile, not one a step.
        self._compiled_before_experts = torch.compile(layer_before_experts, fullgraph=True,
                                                      options={"deterministic": True})

    def setup_cache(self, batch_size: int, max_seq: int) -> None:
        """Preallocate each layer's KV cache ``[batch_size, max_seq, kv_heads, head_dim]``."""
        cfg = self.config
        if self.cache_shape == (batch_size, max_seq):
            return
        shape = (batch_size, max_seq, cfg.num_kv_heads, cfg.head_dim)
        for layer in self.layers:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.cache_shape = (batch_size, max_seq)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits ``[B, T, V]`` (``[B, 1, V]`` if ``last_only``) in the model dtype.

        ``tokens``/``positions`` ``[B, T]``; ``slots`` ``[T]`` the cache slots these tokens are
        written to; ``mask`` bool ``[B, 1, T, S]``: which of the first ``S`` cache slots each
        query may attend to. Call :meth:`setup_cache` first.
        """
        x = self.embed_tokens(tokens)
        cos, sin = self.rope(positions)
        delta = torch.zeros_like(x)
        decode = tokens.shape[1] == 1 and self._compiled_before_experts is not None
        before_experts = self._compiled_before_experts if decode else layer_before_experts
        # Not cuDNN attention: it plans anew for every key length.
        with sdpa_kernel(_SDPA_BACKENDS):
            for layer in self.layers:
                x, h, topk_ids, topk_weights = before_experts(layer, x, delta, cos, sin, slots, mask)
                delta = layer.mlp_out(h, topk_ids, topk_weights).view(x.shape)
        if decode and self._fused_head is not None:
            return self._fused_head(self, x, delta)
        x = x + delta
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))
