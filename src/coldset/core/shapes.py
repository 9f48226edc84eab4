"""Model shapes and weight-byte formats, read from a Hugging Face ``config.json`` alone.

What it is for: every stage that does not decode (stats, placement, the speed model, the cache
simulation, report, MLflow) needs only where the routed experts are (MoE layers, experts, top-k)
and how many bytes each weight takes; never the weights. This module reads that from the config
fields of the MoE families people serve (``SHAPE_FAMILIES``), including the expert weight format
from ``quantization_config``, so a folder holding only ``config.json`` is enough for those
stages. The embedded engine (``coldset.engine.model``) decodes only some of these families; whether a
folder can be decoded is the pipeline's question (:func:`coldset.workflow.config.decoding_support`).

Byte model: a weight matrix ``[rows, cols]`` (out, in) in a :class:`WeightFormat` takes its
elements plus its scales (and zero points, group indices). A routed expert is w13 ``[2I, H]``
(gate and up) plus w2 ``[H, I]`` in the expert format (plus biases in the model dtype where the
family has them: gpt_oss). Non-expert linear layers (attention projections, dense and shared
MLPs) are in ``linear_format`` (the quantized format where the checkpoint quantizes them, the
model dtype otherwise); embeddings, LM head, norms, routers and the small attention extras
(biases, sinks, convolution, decay parameters) are in the model dtype. Parameter counts exclude
multi-token-prediction layers (DeepSeek-V3's ``num_nextn_predict_layers``, Qwen3-Next's MTP) and
vision towers (Llama 4), which decoding text does not read.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

GIB = 2**30


class ShapeError(ValueError):
    """A config.json (or a weight format) could not be read; the message names the file and field."""


# ----------------------------------------------------------------------------------------------
# Weight formats


@dataclass(frozen=True)
class WeightFormat:
    """How one weight matrix ``[rows, cols]`` (out, in) is stored: element bytes plus scales.

    ``scale_block = (block_rows, block_cols)`` gives one scale of ``scale_bytes`` per block;
    ``None`` in a block dimension means the whole dimension (per-channel scales are
    ``(1, None)``). ``scale_block=None`` means no scales (bf16, fp16, fp32). ``scale_bytes`` may
    be fractional where a packed zero point rides with each scale (AWQ/GPTQ: a 2-byte fp16 scale
    plus a 4-bit zero). ``column_bytes`` is stored once per input column (GPTQ's int32 ``g_idx``).
    """

    name: str
    bytes_per_element: float
    scale_bytes: float = 0
    scale_block: tuple[int | None, int | None] | None = None
    column_bytes: float = 0

    def matrix_bytes(self, rows: int, cols: int) -> int:
        total = rows * cols * self.bytes_per_element + cols * self.column_bytes
        if self.scale_block is not None:
            block_rows, block_cols = self.scale_block
            block_rows = rows if block_rows is None else block_rows
            block_cols = cols if block_cols is None else block_cols
            total += math.ceil(rows / block_rows) * math.ceil(cols / block_cols) * self.scale_bytes
        return math.ceil(total)

    @property
    def has_scales(self) -> bool:
        return self.scale_block is not None


#: The names of the quantized expert formats the engine and kernels run (coldset.core.fp8, coldset.core.mxfp4).
FP8_BLOCK128 = "fp8_block128"
MXFP4 = "mxfp4"

WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "float32": WeightFormat("float32", 4),
    "bfloat16": WeightFormat("bfloat16", 2),
    "float16": WeightFormat("float16", 2),
    # DeepSeek-V3 style: float8_e4m3 with one float32 scale per 128 x 128 block.
    FP8_BLOCK128: WeightFormat(FP8_BLOCK128, 1, scale_bytes=4, scale_block=(128, 128)),
    # One float32 scale per output channel (row).
    "fp8_channel": WeightFormat("fp8_channel", 1, scale_bytes=4, scale_block=(1, None)),
    # One float32 scale per matrix.
    "fp8_tensor": WeightFormat("fp8_tensor", 1, scale_bytes=4, scale_block=(None, None)),
    # OCP MX: e2m1 elements (half a byte) and one e8m0 (1 byte) scale per 32 along the input dim.
    MXFP4: WeightFormat(MXFP4, 0.5, scale_bytes=1, scale_block=(1, 32)),
}
_FORMAT_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}
# Formats with parameters in their names: fp8_block{rows}x{cols}; awq/gptq_int{bits}_g{group|ch}.
_FP8_BLOCK = re.compile(r"fp8_block(\d+)(?:x(\d+))?")
_INT_GROUP = re.compile(r"(awq|gptq)_int(4|8)_g(\d+|ch)(_nozp)?")


def _int_format(method: str, bits: int, group: int | None, zero_point: bool = True) -> WeightFormat:
    """AWQ / GPTQ packed integers: ``bits/8`` bytes per element; per ``group`` input columns of each
    output row an fp16 scale (2 bytes) plus a packed ``bits``-bit zero point; GPTQ also stores an
    int32 group index per input column (``g_idx``). ``group=None``: one group per row."""
    name = f"{method}_int{bits}_g{'ch' if group is None else group}{'' if zero_point else '_nozp'}"
    return WeightFormat(name, bits / 8, scale_bytes=2 + (bits / 8 if zero_point else 0),
                        scale_block=(1, group), column_bytes=4 if method == "gptq" else 0)


def get_weight_format(fmt: str | WeightFormat) -> WeightFormat:
    """A ``WeightFormat`` by name: ``bfloat16`` (``bf16``), ``float16``, ``float32``,
    ``fp8_block128`` (or ``fp8_block{r}x{c}``), ``fp8_channel``, ``fp8_tensor``, ``mxfp4``,
    ``awq_int4_g128``, ``gptq_int4_g128`` (``_gch`` for one group per row)."""
    if isinstance(fmt, WeightFormat):
        return fmt
    name = _FORMAT_ALIASES.get(fmt, fmt)
    if name in WEIGHT_FORMATS:
        return WEIGHT_FORMATS[name]
    m = _FP8_BLOCK.fullmatch(str(name))
    if m:
        rows = int(m.group(1))
        cols = int(m.group(2) or rows)
        if rows > 0 and cols > 0:
            return WeightFormat(str(name), 1, scale_bytes=4, scale_block=(rows, cols))
    m = _INT_GROUP.fullmatch(str(name))
    if m and (m.group(3) == "ch" or int(m.group(3)) > 0):
        return _int_format(m.group(1), int(m.group(2)), None if m.group(3) == "ch" else int(m.group(3)),
                           zero_point=not m.group(4))
    raise ShapeError(
        f"unknown weight format {fmt!r}; known: {', '.join(sorted(WEIGHT_FORMATS))}, "
        "fp8_block{R}x{C}, awq_int{4|8}_g{G}, gptq_int{4|8}_g{G}"
    )


def _quant_method_format(qcfg: Mapping[str, Any], where: str, dtype: str) -> str:
    """The expert weight format a ``quantization_config`` names (no module lists)."""
    method = qcfg.get("quant_method")
    if method == "fp8":
        block = qcfg.get("weight_block_size")
        if block is None:  # one scale per tensor (vLLM's Fp8Config; the checkpoint stores one weight_scale)
            return "fp8_tensor"
        if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
            return f"fp8_block{block[0]}" if block[0] == block[1] else f"fp8_block{block[0]}x{block[1]}"
        raise ShapeError(f"{where}.weight_block_size must be two positive integers, got {block!r}")
    if method == "fbgemm_fp8":
        return "fp8_channel"
    if method == "mxfp4":
        return MXFP4
    if method in ("awq", "gptq"):
        bits = qcfg.get("bits", qcfg.get("w_bit"))
        group = qcfg.get("group_size", qcfg.get("q_group_size"))
        if bits not in (4, 8) or (method == "awq" and bits != 4):
            raise ShapeError(f"{where}.bits: {method} with {bits!r} bits is not modelled (4-bit AWQ, 4/8-bit GPTQ)")
        if not isinstance(group, int) or (group <= 0 and group != -1):
            raise ShapeError(f"{where}.group_size must be a positive integer or -1, got {group!r}")
        zero_point = qcfg.get("zero_point", True) if method == "awq" else True
        if not isinstance(zero_point, bool):
            raise ShapeError(f"{where}.zero_point must be true or false, got {zero_point!r}")
        return _int_format(method, bits, None if group == -1 else group, zero_point=zero_point).name
    raise ShapeError(
        f"{where}.quant_method {method!r} is not modelled; known: fp8 (block-scaled or per tensor), "
        "fbgemm_fp8, mxfp4, awq, gptq. Remove quantization_config to model the checkpoint in "
        f"{dtype}, or add the format to coldset.core.shapes")


def modules_not_converted(qcfg: Mapping[str, Any], where: str) -> list[str]:
    """The module-name patterns a ``quantization_config`` keeps unquantized: ``modules_to_not_convert``,
    or where that is absent ``ignored_layers`` (per-tensor FP8 checkpoints, MiniMax; transformers'
    FineGrainedFP8Config takes it as an alias) or ``ignore``."""
    for key in ("modules_to_not_convert", "ignored_layers", "ignore"):
        names = qcfg.get(key)
        if names is None:
            continue
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ShapeError(f"{where}.{key} must be a list of module names, got {names!r}")
        return names
    return []


def quantization_object(qcfg: Any, where: str, error: type[ValueError]) -> Mapping[str, Any]:
    """``qcfg`` (a ``quantization_config`` at ``where``) checked to be an object: the engine's
    quantized formats (:mod:`coldset.core.fp8`, :mod:`coldset.core.mxfp4`) raise their own ``error``."""
    if not isinstance(qcfg, Mapping):
        raise error(f"{where} must be an object, got {type(qcfg).__name__}")
    return qcfg


def format_skip_patterns(qcfg: Mapping[str, Any], where: str, error: type[ValueError]) -> tuple[str, ...]:
    """The ``modules_to_not_convert`` patterns of an engine format's ``quantization_config`` (absent
    or null: none), checked to be module names, else ``error``. Only that key: the engine loads
    the formats it reads, while :func:`modules_not_converted` also takes other producers' aliases
    for the byte count."""
    skip = qcfg.get("modules_to_not_convert") or ()
    if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
        raise error(f"{where}.modules_to_not_convert must be a list of module names, got {skip!r}")
    return tuple(skip)


_MODULE_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


def module_not_converted(name: str, patterns: list[str], where: str = "quantization_config") -> bool:
    """Whether module ``name`` is kept unquantized by ``patterns``, matched as transformers'
    quantizers match them (``quantizers_utils.should_convert_module``): a pattern matches from the
    start of the name up to a module boundary, as a regular expression (``model.layers.1`` covers
    ``model.layers.1.self_attn`` but not ``model.layers.11``; ``mlp.gate`` not ``mlp.gate_proj``),
    or as a plain suffix of the name. A substring test would take ``post_attention_layernorm``
    for the attention."""
    for key in patterns:
        try:
            hit = re.match(rf"(?:{key}){_MODULE_BOUNDARY}", name)
        except re.error as err:
            raise ShapeError(f"{where}: module pattern {key!r} is not a valid regular expression ({err})") from None
        if hit or name.endswith(key):
            return True
    return False


# Where each family's weights live, by the checkpoints' module names: layer prefix, attention
# module per layer kind, the MLP block (dense MLP and router), the shared expert(s) in it.
_MODULE_PATHS: dict[str, tuple[str, str, str]] = {
    "qwen3_moe": ("model.layers", "mlp", "shared_expert"),
    "qwen2_moe": ("model.layers", "mlp", "shared_expert"),
    "qwen3_next": ("model.layers", "mlp", "shared_expert"),
    "mixtral": ("model.layers", "block_sparse_moe", ""),
    "deepseek_v2": ("model.layers", "mlp", "shared_experts"),
    "deepseek_v3": ("model.layers", "mlp", "shared_experts"),
    "glm4_moe": ("model.layers", "mlp", "shared_experts"),
    "llama4": ("language_model.model.layers", "feed_forward", "shared_expert"),
    "gpt_oss": ("model.layers", "mlp", ""),
    "olmoe": ("model.layers", "mlp", ""),
    "granitemoe": ("model.layers", "block_sparse_moe", ""),
}
_LINEAR_ATTENTION = {"in_proj_qkvz", "in_proj_ba", "out_proj"}  # Qwen3-Next's Gated DeltaNet (linear_attn)


def linear_modules(fields_: Mapping[str, Any], layer_kinds: list[str] | None = None) -> dict[str, list[str]]:
    """The module names of each non-expert linear group of a parsed family (``attention_linears``'
    names, ``shared_experts``, ``dense_mlp``) and of the routed experts (``experts``), as the
    checkpoint names them: what ``modules_to_not_convert`` patterns are matched against.
    ``layer_kinds``: per layer, ``full_attention`` or ``linear_attention`` (Qwen3-Next)."""
    prefix, mlp, shared = _MODULE_PATHS[fields_["model_type"]]
    L, moe = fields_["num_layers"], set(fields_["moe_layers"])
    kinds = layer_kinds or ["full_attention"] * L
    groups: dict[str, list[str]] = {}
    for name, *_ in fields_["attention_linears"]:
        linear = name in _LINEAR_ATTENTION and fields_["model_type"] == "qwen3_next"
        block = "linear_attn" if linear else "self_attn"
        groups[name] = [f"{prefix}.{i}.{block}.{name}" for i in range(L)
                        if (kinds[i] == "linear_attention") == linear]
    mlp_linears = ("gate_proj", "up_proj", "down_proj")
    if fields_.get("shared_expert_intermediate_size"):
        groups["shared_experts"] = [f"{prefix}.{i}.{mlp}.{shared}.{p}" for i in sorted(moe) for p in mlp_linears]
    if fields_.get("intermediate_size") and len(moe) < L:
        groups["dense_mlp"] = [f"{prefix}.{i}.{mlp}.{p}" for i in range(L) if i not in moe for p in mlp_linears]
    groups["experts"] = [f"{prefix}.{i}.{mlp}.experts" for i in sorted(moe)]
    return groups


def weight_format_from_quantization(qcfg: Mapping[str, Any] | None, dtype: str, source: str,
                                    modules: Mapping[str, list[str]] | None = None
                                    ) -> tuple[str, str, tuple[str, ...]]:
    """``(expert_format, linear_format, unquantized_linears)`` from a config's ``quantization_config``.

    ``modules`` (:func:`linear_modules`) names the modules of each weight group; a group is kept in
    the model ``dtype`` when ``modules_to_not_convert`` (or ``ignored_layers``) names every one of its
    modules, matched as transformers does (:func:`module_not_converted`), and a group some of whose
    modules are named and others not is refused (one format per group is modelled).
    ``linear_format`` is the format of the converted non-expert linear layers (the model dtype when
    none is converted: gpt-oss keeps its attention in bf16, and mxfp4 converts only the experts);
    ``unquantized_linears`` the non-expert groups kept in the model dtype beside converted ones.
    Routers, embeddings, LM head and norms are always in the model dtype (every method here
    leaves them unquantized).
    """
    if not qcfg:
        return dtype, dtype, ()
    if not isinstance(qcfg, Mapping):
        raise ShapeError(f"{source}: field 'quantization_config' must be an object, got {type(qcfg).__name__}")
    where = f"{source}: quantization_config"
    fmt = _quant_method_format(qcfg, where, dtype)
    patterns = modules_not_converted(qcfg, where)
    kept = []
    for group, names in (modules or {}).items():
        skipped = [n for n in names if module_not_converted(n, patterns, where)]
        if skipped and len(skipped) < len(names):
            converted = next(n for n in names if n not in set(skipped))
            raise ShapeError(
                f"{where}.modules_to_not_convert keeps {skipped[0]} unquantized but not {converted}: weight "
                f"group {group!r} in two formats is not modelled")
        if skipped:
            kept.append(group)
    expert_fmt = dtype if "experts" in kept else fmt
    groups = [g for g in (modules or {}) if g != "experts"]
    kept_linears = tuple(g for g in groups if g in kept)
    if qcfg.get("quant_method") == "mxfp4" or len(kept_linears) == len(groups):
        return expert_fmt, dtype, ()  # mxfp4 (transformers' Mxfp4 quantizer) converts the experts only
    return expert_fmt, fmt, kept_linears


# ----------------------------------------------------------------------------------------------
# The shape


@dataclass(frozen=True)
class MoEShape:
    """The architecture of an MoE checkpoint as far as bytes and routing go.

    The engine's :class:`coldset.engine.model.ModelConfig` is this shape plus the forward pass's own
    fields, parsed by :func:`shape_from_hf_config` too. The first fields are those placement reads
    (``moe_layers`` are model layer indices; MoE-layer index ``i`` is ``moe_layers[i]``;
    ``intermediate_size`` is the dense MLP width of non-MoE layers, 0 when there are none).
    ``shared_expert_intermediate_size`` is the total width of the always-active shared expert
    MLP of each MoE layer (``num_shared_experts`` experts of ``moe_intermediate_size`` for
    DeepSeek). ``attention_linears`` lists the attention weight matrices of the whole model as
    ``(name, rows, cols, count)``; ``attention_params`` the attention's other parameters
    (biases, sinks, convolutions, decay terms); ``norm_params`` every RMSNorm weight (layers,
    q/k norms, MLA's latent norms, the final norm); ``router_params`` router weights and biases
    (and Qwen's shared-expert gates). ``expert_bias``: routed experts have biases (gpt_oss).
    ``linear_format`` is the format of the non-expert linear layers the checkpoint quantizes;
    ``unquantized_linears`` names the groups of them it keeps in ``dtype`` all the same (an
    ``attention_linears`` name, ``shared_experts`` or ``dense_mlp``: its
    ``modules_to_not_convert``).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int
    moe_layers: tuple[int, ...]
    tie_word_embeddings: bool
    qk_norm: bool
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    attention: str = "gqa"
    attention_linears: tuple[tuple[str, int, int, int], ...] = ()
    attention_params: int = 0
    norm_params: int = 0
    router_params: int = 0
    expert_bias: bool = False
    expert_format: str = "bfloat16"
    linear_format: str = "bfloat16"
    dtype: str = "bfloat16"
    unquantized_linears: tuple[str, ...] = ()
    source: str = field(default="", compare=False)  # where it was read: provenance, not shape

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "shape") -> "MoEShape":
        """Inverse of :meth:`to_dict` (a manifest's ``shape``)."""
        try:
            d = dict(raw)
            d["moe_layers"] = tuple(int(x) for x in d["moe_layers"])
            d["attention_linears"] = tuple(tuple(x) for x in d.get("attention_linears", ()))
            d["unquantized_linears"] = tuple(d.get("unquantized_linears", ()))
            return cls(**d)
        except (TypeError, KeyError, ValueError) as exc:
            raise ShapeError(f"{source}: not a model shape ({exc})") from None


def _gqa_linears(h: int, heads: int, kv_heads: int, head_dim: int, layers: int,
                 q_rows: int | None = None) -> tuple[tuple[str, int, int, int], ...]:
    q_out = heads * head_dim
    kv_out = kv_heads * head_dim
    if layers == 0:
        return ()
    return (("q_proj", q_rows or q_out, h, layers), ("k_proj", kv_out, h, layers),
            ("v_proj", kv_out, h, layers), ("o_proj", h, q_out, layers))


def as_shape(config: Any) -> MoEShape:
    """An :class:`MoEShape` for ``config``: itself, or a shape built from an object with
    ``coldset.engine.model.ModelConfig``'s attributes (grouped-query attention without biases, per-head
    q/k norms when ``qk_norm``, an optional ``shared_expert_intermediate_size``, bf16)."""
    if isinstance(config, MoEShape):
        return config
    h, layers = int(config.hidden_size), int(config.num_layers)
    moe_layers = tuple(int(x) for x in config.moe_layers)
    head_dim = int(config.head_dim)
    return MoEShape(
        model_type=str(getattr(config, "model_type", "unknown")),
        vocab_size=int(config.vocab_size), hidden_size=h, num_layers=layers,
        num_heads=int(config.num_heads), num_kv_heads=int(config.num_kv_heads), head_dim=head_dim,
        num_experts=int(config.num_experts), top_k=int(config.top_k),
        moe_intermediate_size=int(config.moe_intermediate_size),
        intermediate_size=int(config.intermediate_size), moe_layers=moe_layers,
        tie_word_embeddings=bool(config.tie_word_embeddings), qk_norm=bool(config.qk_norm),
        shared_expert_intermediate_size=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
        num_shared_experts=1 if getattr(config, "shared_expert_intermediate_size", 0) else 0,
        attention_linears=_gqa_linears(h, int(config.num_heads), int(config.num_kv_heads), head_dim, layers),
        norm_params=layers * (2 * h + (2 * head_dim if config.qk_norm else 0)) + h,
        router_params=len(moe_layers) * int(config.num_experts) * h,
    )


# ----------------------------------------------------------------------------------------------
# Bytes and parameter counts


def expert_bytes(config: Any, fmt: str | WeightFormat | None = None) -> int:
    """Bytes of one routed expert, what a placement moves: gate and up ``[I, H]`` (the kernel's fused
    w13) plus w2 ``[H, I]`` in ``fmt`` (default: the shape's ``expert_format``) with their scales.
    Expert biases (gpt_oss) are not part of it: the engine keeps every expert's biases resident
    (``nonexpert_bytes_breakdown``'s ``expert_biases``, design.md §4)."""
    shape = as_shape(config)
    f = get_weight_format(shape.expert_format if fmt is None else fmt)
    return _mlp_bytes(f, shape.hidden_size, shape.moe_intermediate_size)


def _mlp_bytes(f: WeightFormat, h: int, inter: int) -> int:
    """Gate ``[I, H]``, up ``[I, H]`` and down ``[H, I]``, each with its own scales (checkpoints
    store gate and up apart; where one fuses them, as gpt-oss does, per-row scales count the same)."""
    return 2 * f.matrix_bytes(inter, h) + f.matrix_bytes(h, inter) if inter else 0


def nonexpert_bytes_breakdown(config: Any, fmt: str | WeightFormat | None = None) -> dict[str, int]:
    """Bytes of everything that always stays in HBM, by part: ``embed_tokens``, ``lm_head`` (0
    when tied), ``attention`` (projections and extras), ``norms``, ``routers``,
    ``shared_experts`` (per MoE layer), ``dense_mlp`` (per dense layer), ``expert_biases`` (every
    routed expert's biases, gpt_oss: resident whatever the placement).

    ``fmt=None``: as the checkpoint stores them (linear layers in ``linear_format``, the rest in
    ``dtype``); a format name puts every non-expert weight in that format, which must be one
    without scales (non-expert weights in scaled formats are modelled only from the checkpoint's
    own ``quantization_config``).
    """
    shape = as_shape(config)
    if fmt is None:
        lin, other = get_weight_format(shape.linear_format), get_weight_format(shape.dtype)
    else:
        lin = other = get_weight_format(fmt)
        if lin.has_scales:
            raise ShapeError(
                f"non-expert weights in the scaled format {lin.name!r} are not modelled; "
                "use bfloat16, float16 or float32"
            )
    h = shape.hidden_size
    num_moe = len(shape.moe_layers)
    num_dense = shape.num_layers - num_moe
    b = other.bytes_per_element
    kept = set(getattr(shape, "unquantized_linears", ())) if fmt is None else set()

    def group(name: str) -> WeightFormat:
        return other if name in kept else lin

    parts = {
        "embed_tokens": shape.vocab_size * h * b,
        "lm_head": 0 if shape.tie_word_embeddings else shape.vocab_size * h * b,
        "attention": sum(n * group(name).matrix_bytes(r, c) for name, r, c, n in shape.attention_linears)
        + shape.attention_params * b,
        "norms": shape.norm_params * b,
        "routers": shape.router_params * b,
        "shared_experts": num_moe * _mlp_bytes(group("shared_experts"), h, shape.shared_expert_intermediate_size),
        "dense_mlp": num_dense * _mlp_bytes(group("dense_mlp"), h, shape.intermediate_size),
        "expert_biases": (num_moe * shape.num_experts * (2 * shape.moe_intermediate_size + h) * b
                          if shape.expert_bias else 0),
    }
    return {k: int(math.ceil(v)) for k, v in parts.items()}


def nonexpert_bytes(config: Any, fmt: str | WeightFormat | None = None) -> int:
    """Total of :func:`nonexpert_bytes_breakdown`."""
    return sum(nonexpert_bytes_breakdown(config, fmt).values())


def parameter_counts(config: Any) -> dict[str, int]:
    """Parameters (elements) by part, the keys of :func:`nonexpert_bytes_breakdown` plus
    ``routed_experts``; their sum is the model's parameter count (text decoder, no MTP layers)."""
    s = as_shape(config)
    h = s.hidden_size
    num_moe = len(s.moe_layers)
    expert = 3 * h * s.moe_intermediate_size + ((2 * s.moe_intermediate_size + h) if s.expert_bias else 0)
    return {
        "embed_tokens": s.vocab_size * h,
        "lm_head": 0 if s.tie_word_embeddings else s.vocab_size * h,
        "attention": sum(r * c * n for _, r, c, n in s.attention_linears) + s.attention_params,
        "norms": s.norm_params,
        "routers": s.router_params,
        "shared_experts": num_moe * 3 * h * s.shared_expert_intermediate_size,
        "dense_mlp": (s.num_layers - num_moe) * 3 * h * s.intermediate_size,
        "routed_experts": num_moe * s.num_experts * expert,
    }


def total_bytes(config: Any) -> int:
    """Every weight's bytes as the checkpoint stores them: non-expert plus all routed experts."""
    s = as_shape(config)
    return nonexpert_bytes(s) + len(s.moe_layers) * s.num_experts * expert_bytes(s)


# ----------------------------------------------------------------------------------------------
# Reading config.json


class _Fields:
    """Typed access to a config dict with errors that name the file and the field."""

    def __init__(self, raw: Mapping[str, Any], source: str):
        self.raw, self.source = raw, source

    def get(self, *names: str, default: Any = ...) -> Any:
        for n in names:
            if n in self.raw and self.raw[n] is not None:
                return self.raw[n]
        if default is ...:
            raise ShapeError(f"{self.source}: missing field {' or '.join(repr(n) for n in names)}")
        return default

    def int(self, *names: str, default: Any = ..., minimum: int = 1) -> int:
        v = self.get(*names, default=default)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            name = next((n for n in names if n in self.raw), names[0])
            raise ShapeError(f"{self.source}: field {name!r} must be an integer >= {minimum}, got {v!r}")
        return v

    def bool(self, name: str, default: bool) -> bool:
        v = self.get(name, default=default)
        if not isinstance(v, bool):
            raise ShapeError(f"{self.source}: field {name!r} must be true or false, got {v!r}")
        return v


def _moe_layers_sparse_step(f: _Fields, num_layers: int, num_experts: int) -> tuple[int, ...]:
    """Qwen's rule: layer ``i`` is MoE unless in ``mlp_only_layers``, when ``(i+1) % decoder_sparse_step == 0``."""
    step = f.int("decoder_sparse_step", default=1)
    mlp_only = f.get("mlp_only_layers", default=[])
    if not isinstance(mlp_only, list) or not all(isinstance(x, int) for x in mlp_only):
        raise ShapeError(f"{f.source}: field 'mlp_only_layers' must be a list of layer indices, got {mlp_only!r}")
    return tuple(i for i in range(num_layers) if i not in set(mlp_only) and num_experts > 0 and (i + 1) % step == 0)


def _dtype(f: _Fields) -> str:
    d = f.get("torch_dtype", "dtype", default="bfloat16")
    name = _FORMAT_ALIASES.get(d, d)
    if name not in ("bfloat16", "float16", "float32"):
        raise ShapeError(f"{f.source}: field 'torch_dtype' {d!r} is not bfloat16, float16 or float32")
    return name


def _base(f: _Fields, model_type: str) -> dict[str, Any]:
    """The fields every family has under the same names."""
    h = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    return dict(
        model_type=model_type, vocab_size=f.int("vocab_size"), hidden_size=h,
        num_layers=f.int("num_hidden_layers"), num_heads=heads,
        num_kv_heads=f.int("num_key_value_heads", default=heads),
        head_dim=f.int("head_dim", default=max(1, h // heads)),
        top_k=f.int("num_experts_per_tok", "experts_per_token"),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
    )


def _gqa(b: dict[str, Any], *, q_rows: int | None = None) -> tuple[tuple[str, int, int, int], ...]:
    return _gqa_linears(b["hidden_size"], b["num_heads"], b["num_kv_heads"], b["head_dim"], b["num_layers"], q_rows)


def _qwen_moe(f: _Fields, model_type: str) -> dict[str, Any]:
    b = _base(f, model_type)
    h, L = b["hidden_size"], b["num_layers"]
    e = f.int("num_experts", "num_local_experts")  # transformers 5 writes the latter
    moe = _moe_layers_sparse_step(f, L, e)
    q_out, kv_out = b["num_heads"] * b["head_dim"], b["num_kv_heads"] * b["head_dim"]
    qwen3 = model_type == "qwen3_moe"
    shared = f.int("shared_expert_intermediate_size", default=0, minimum=0) if not qwen3 else 0
    return dict(
        b, num_experts=e, moe_intermediate_size=f.int("moe_intermediate_size"),
        intermediate_size=f.int("intermediate_size", default=0, minimum=0) if len(moe) < L else 0,
        moe_layers=moe, qk_norm=qwen3,
        num_shared_experts=1 if shared else 0, shared_expert_intermediate_size=shared,
        attention_linears=_gqa(b),
        # qwen2_moe: q, k and v have biases; qwen3_moe: none (attention_bias false) but per-head q/k norms.
        attention_params=0 if qwen3 else L * (q_out + 2 * kv_out),
        norm_params=L * (2 * h + (2 * b["head_dim"] if qwen3 else 0)) + h,
        # qwen2_moe's shared expert has a sigmoid gate [1, H] per MoE layer.
        router_params=len(moe) * (e * h + (h if shared else 0)),
    )


def _qwen3_next(f: _Fields) -> dict[str, Any]:
    b = _base(f, "qwen3_next")
    h, L, hd = b["hidden_size"], b["num_layers"], b["head_dim"]
    e = f.int("num_experts")
    moe = _moe_layers_sparse_step(f, L, e)
    types = f.get("layer_types", default=None)
    if types is None:
        interval = f.int("full_attention_interval")
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(L)]
    if not isinstance(types, list) or len(types) != L or set(types) - {"full_attention", "linear_attention"}:
        raise ShapeError(f"{f.source}: field 'layer_types' must list 'full_attention'/'linear_attention' "
                         f"for each of the {L} layers")
    full = types.count("full_attention")
    lin = L - full
    nk, nv = f.int("linear_num_key_heads"), f.int("linear_num_value_heads")
    dk, dv = f.int("linear_key_head_dim"), f.int("linear_value_head_dim")
    kernel = f.int("linear_conv_kernel_dim")
    key_dim, value_dim = nk * dk, nv * dv
    gated = f.bool("attn_output_gate", True)
    q_out = b["num_heads"] * hd
    linears = _gqa_linears(h, b["num_heads"], b["num_kv_heads"], hd, full, q_rows=q_out * (2 if gated else 1))
    if lin:  # Gated DeltaNet: in_proj_qkvz, in_proj_ba, out_proj
        linears += (("in_proj_qkvz", 2 * key_dim + 2 * value_dim, h, lin), ("in_proj_ba", 2 * nv, h, lin),
                    ("out_proj", h, value_dim, lin))
    shared = f.int("shared_expert_intermediate_size", default=0, minimum=0)
    return dict(
        b, num_experts=e, moe_intermediate_size=f.int("moe_intermediate_size"),
        intermediate_size=f.int("intermediate_size", default=0, minimum=0) if len(moe) < L else 0,
        moe_layers=moe, qk_norm=True, attention="hybrid_linear",
        num_shared_experts=1 if shared else 0, shared_expert_intermediate_size=shared,
        attention_linears=linears,
        # per DeltaNet layer: depthwise conv over q, k, v channels, dt_bias and A_log per value head
        attention_params=lin * ((2 * key_dim + value_dim) * kernel + 2 * nv),
        # layer norms, per-head q/k norms of full attention, the DeltaNet output norm, final norm
        norm_params=L * 2 * h + full * 2 * hd + lin * dv + h,
        router_params=len(moe) * (e * h + (h if shared else 0)),
        _layer_kinds=types,
    )


def _mixtral(f: _Fields) -> dict[str, Any]:
    b = _base(f, "mixtral")
    h, L = b["hidden_size"], b["num_layers"]
    e = f.int("num_local_experts", "num_experts")
    return dict(b, num_experts=e, moe_intermediate_size=f.int("intermediate_size"), intermediate_size=0,
                moe_layers=tuple(range(L)), qk_norm=False, attention_linears=_gqa(b),
                norm_params=L * 2 * h + h, router_params=L * e * h)


# transformers' DeepseekV2Config / DeepseekV3Config defaults of the fields a config may leave out
# (transformers 5.24): a missing field is what transformers builds, not "none".
_DEEPSEEK_DEFAULTS = {
    "deepseek_v2": {"q_lora_rank": 1536, "n_shared_experts": 2, "first_k_dense_replace": 0},
    "deepseek_v3": {"q_lora_rank": 1536, "n_shared_experts": 1, "first_k_dense_replace": 3},
}


def _deepseek(f: _Fields, model_type: str) -> dict[str, Any]:
    b = _base(f, model_type)
    h, L, heads = b["hidden_size"], b["num_layers"], b["num_heads"]
    defaults = _DEEPSEEK_DEFAULTS[model_type]
    e = f.int("n_routed_experts")
    first_dense = f.int("first_k_dense_replace", default=defaults["first_k_dense_replace"], minimum=0)
    freq = f.int("moe_layer_freq", default=1)
    moe = tuple(i for i in range(L) if i >= first_dense and i % freq == 0)
    # q_lora_rank: null = no query compression (DeepSeek-V2-Lite); absent = transformers' default.
    if "q_lora_rank" not in f.raw:
        q_lora = defaults["q_lora_rank"]
    else:
        q_lora = None if f.raw["q_lora_rank"] is None else f.int("q_lora_rank")
    kv_lora = f.int("kv_lora_rank")
    nope, rope, v = f.int("qk_nope_head_dim"), f.int("qk_rope_head_dim"), f.int("v_head_dim")
    qk = nope + rope
    if q_lora is None:
        linears = (("q_proj", heads * qk, h, L),)
        lora_norms = 0
    else:
        linears = (("q_a_proj", q_lora, h, L), ("q_b_proj", heads * qk, q_lora, L))
        lora_norms = q_lora
    linears += (("kv_a_proj_with_mqa", kv_lora + rope, h, L), ("kv_b_proj", heads * (nope + v), kv_lora, L),
                ("o_proj", h, heads * v, L))
    n_shared = (f.int("n_shared_experts", default=defaults["n_shared_experts"], minimum=0)
                if f.raw.get("n_shared_experts", ...) is not None else 0)  # null: no shared expert
    moe_inter = f.int("moe_intermediate_size")
    # V3's noaux_tc routing adds a per-expert score correction bias to the router.
    corr = e if f.get("topk_method", default="") == "noaux_tc" else 0
    return dict(
        b, num_kv_heads=heads, head_dim=qk, num_experts=e, moe_intermediate_size=moe_inter,
        intermediate_size=f.int("intermediate_size") if len(moe) < L else 0, moe_layers=moe, qk_norm=False,
        attention="mla", num_shared_experts=n_shared, shared_expert_intermediate_size=n_shared * moe_inter,
        attention_linears=linears, norm_params=L * (2 * h + lora_norms + kv_lora) + h,
        router_params=len(moe) * (e * h + corr),
    )


def _glm4_moe(f: _Fields) -> dict[str, Any]:
    """GLM-4.5 (transformers' Glm4MoeConfig, whose defaults fill a missing field): grouped-query
    attention (q/k/v biases when ``attention_bias``, per-head q/k norms when ``use_qk_norm``), DeepSeek-V3's
    router (a correction bias per expert) and ``n_shared_experts`` shared experts, dense layers before
    ``first_k_dense_replace``."""
    b = _base(f, "glm4_moe")
    h, L = b["hidden_size"], b["num_layers"]
    e = f.int("n_routed_experts", "num_local_experts")
    moe = tuple(range(f.int("first_k_dense_replace", default=1, minimum=0), L))
    n_shared = f.int("n_shared_experts", default=1, minimum=0)
    moe_inter = f.int("moe_intermediate_size")
    q_out, kv_out = b["num_heads"] * b["head_dim"], b["num_kv_heads"] * b["head_dim"]
    qk_norm = f.bool("use_qk_norm", False)
    return dict(
        b, num_experts=e, moe_intermediate_size=moe_inter,
        intermediate_size=f.int("intermediate_size") if len(moe) < L else 0, moe_layers=moe, qk_norm=qk_norm,
        num_shared_experts=n_shared, shared_expert_intermediate_size=n_shared * moe_inter,
        attention_linears=_gqa(b), attention_params=L * (q_out + 2 * kv_out) if f.bool("attention_bias", False) else 0,
        norm_params=L * (2 * h + (2 * b["head_dim"] if qk_norm else 0)) + h,
        router_params=len(moe) * (e * h + e),
    )


def _llama4(f: _Fields) -> dict[str, Any]:
    b = _base(f, "llama4")
    h, L = b["hidden_size"], b["num_layers"]
    e = f.int("num_local_experts")
    layers = f.get("moe_layers", default=None)
    if layers is None:
        step = f.int("interleave_moe_layer_step", default=1)
        layers = list(range(step - 1, L, step))
    if not isinstance(layers, list) or not all(isinstance(x, int) and 0 <= x < L for x in layers):
        raise ShapeError(f"{f.source}: field 'moe_layers' must list layer indices in [0, {L}), got {layers!r}")
    moe = tuple(sorted(set(layers)))
    inter = f.int("intermediate_size")
    # Every Llama 4 MoE layer has one shared expert as wide as a routed one; qk norm is an
    # L2 norm without weights.
    return dict(b, num_experts=e, moe_intermediate_size=inter,
                intermediate_size=f.int("intermediate_size_mlp") if len(moe) < L else 0,
                moe_layers=moe, qk_norm=False, num_shared_experts=1, shared_expert_intermediate_size=inter,
                attention_linears=_gqa(b), norm_params=L * 2 * h + h, router_params=len(moe) * e * h)


def _gpt_oss(f: _Fields) -> dict[str, Any]:
    b = _base(f, "gpt_oss")
    h, L = b["hidden_size"], b["num_layers"]
    e = f.int("num_local_experts", "num_experts")
    q_out, kv_out = b["num_heads"] * b["head_dim"], b["num_kv_heads"] * b["head_dim"]
    bias = f.bool("attention_bias", True)
    return dict(b, num_experts=e, moe_intermediate_size=f.int("intermediate_size"), intermediate_size=0,
                moe_layers=tuple(range(L)), qk_norm=False, attention_linears=_gqa(b),
                # q, k, v, o biases and one attention sink per head
                attention_params=L * ((q_out + 2 * kv_out + h if bias else 0) + b["num_heads"]),
                norm_params=L * 2 * h + h, router_params=L * (e * h + e), expert_bias=True)


def _olmoe(f: _Fields) -> dict[str, Any]:
    b = _base(f, "olmoe")
    h, L = b["hidden_size"], b["num_layers"]
    e = f.int("num_experts")
    q_out, kv_out = b["num_heads"] * b["head_dim"], b["num_kv_heads"] * b["head_dim"]
    # OLMoE normalises q and k over the whole projection (not per head).
    return dict(b, num_experts=e, moe_intermediate_size=f.int("intermediate_size"), intermediate_size=0,
                moe_layers=tuple(range(L)), qk_norm=True, attention_linears=_gqa(b),
                norm_params=L * (2 * h + q_out + kv_out) + h, router_params=L * e * h)


def _granitemoe(f: _Fields) -> dict[str, Any]:
    b = _base(f, "granitemoe")
    h, L = b["hidden_size"], b["num_layers"]
    e = f.int("num_local_experts")
    return dict(b, num_experts=e, moe_intermediate_size=f.int("intermediate_size"), intermediate_size=0,
                moe_layers=tuple(range(L)), qk_norm=False, attention_linears=_gqa(b),
                norm_params=L * 2 * h + h, router_params=L * e * h)


# model_type -> parser of the (text) config's fields
SHAPE_FAMILIES = {
    "qwen3_moe": lambda f: _qwen_moe(f, "qwen3_moe"),
    "qwen2_moe": lambda f: _qwen_moe(f, "qwen2_moe"),
    "qwen3_next": _qwen3_next,
    "mixtral": _mixtral,
    "deepseek_v2": lambda f: _deepseek(f, "deepseek_v2"),
    "deepseek_v3": lambda f: _deepseek(f, "deepseek_v3"),
    "glm4_moe": _glm4_moe,
    "llama4": _llama4,
    "gpt_oss": _gpt_oss,
    "olmoe": _olmoe,
    "granitemoe": _granitemoe,
}
_TEXT_TYPES = {"llama4_text": "llama4"}


def shape_from_hf_config(raw: Mapping[str, Any], source: str = "config.json") -> MoEShape:
    """Parse an HF config dict (``source`` names the file in errors) into an :class:`MoEShape`.

    Multimodal configs (Llama 4) are read from their ``text_config``; ``quantization_config``
    (top level or in the text config) sets the weight formats.
    """
    if not isinstance(raw, Mapping):
        raise ShapeError(f"{source}: expected a JSON object")
    model_type = raw.get("model_type")
    text = raw.get("text_config")
    if model_type == "llama4" or (model_type is None and isinstance(text, Mapping)):
        if not isinstance(text, Mapping):
            raise ShapeError(f"{source}: field 'text_config' must be an object for model_type {model_type!r}")
        inner = dict(text)
        inner.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        for k in ("quantization_config", "torch_dtype"):
            if raw.get(k) is not None and inner.get(k) is None:
                inner[k] = raw[k]
        raw, model_type = inner, "llama4"
        source = f"{source} text_config"
    model_type = _TEXT_TYPES.get(model_type, model_type)
    if model_type not in SHAPE_FAMILIES:
        raise ShapeError(f"{source}: model_type {model_type!r} is not a known MoE family; coldset reads "
                         f"shapes of {', '.join(SHAPE_FAMILIES)}")
    f = _Fields(raw, source)
    fields_ = SHAPE_FAMILIES[model_type](f)
    kinds = fields_.pop("_layer_kinds", None)
    dtype = _dtype(f)
    expert_fmt, linear_fmt, kept = weight_format_from_quantization(
        raw.get("quantization_config"), dtype, source, linear_modules(fields_, kinds))
    shape = MoEShape(**fields_, expert_format=expert_fmt, linear_format=linear_fmt, unquantized_linears=kept,
                     dtype=dtype, source=source)
    if not shape.moe_layers:
        raise ShapeError(f"{source}: the model has no MoE layers")
    if shape.top_k > shape.num_experts:
        raise ShapeError(f"{source}: field 'num_experts_per_tok' ({shape.top_k}) exceeds the number of routed "
                         f"experts ({shape.num_experts})")
    return shape


def read_shape(path: str | os.PathLike) -> MoEShape:
    """The shape of a model folder (its ``config.json``) or of a ``config.json`` file itself."""
    p = Path(path)
    cfg = p / "config.json" if p.is_dir() else p
    if not cfg.is_file():
        raise ShapeError(f"{cfg}: missing (a model folder needs a config.json; weights are not needed "
                         "for statistics, placement, the speed model or the cache simulation)")
    try:
        raw = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ShapeError(f"{cfg}: not valid JSON ({err})") from None
    return shape_from_hf_config(raw, str(cfg))


def describe(shape: MoEShape) -> dict[str, Any]:
    """A one-line-per-field summary (report and logs): the totals people check a shape by."""
    counts = parameter_counts(shape)
    return {
        "model_type": shape.model_type,
        "layers": shape.num_layers,
        "moe_layers": shape.num_moe_layers,
        "routed_experts": shape.num_experts,
        "top_k": shape.top_k,
        "shared_experts": shape.num_shared_experts,
        "expert_format": shape.expert_format,
        "bytes_per_expert": expert_bytes(shape),
        "parameters": sum(counts.values()),
        "total_gib": total_bytes(shape) / GIB,
    }
