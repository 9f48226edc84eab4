"""A model of a published config with random weights, every weight drawn on the device: the
decode step and the slot cache measured at a family's real shape without a checkpoint
(``python -m coldset bench step|cache --model-family``).

Why: the time of a decode step does not depend on the weights' values, only on their shapes and
formats, and a real-shape checkpoint is tens to hundreds of GB (a download, then a read); drawn on
the GPU it takes seconds. Every family the engine runs is built through its own model class
(:class:`~coldset.engine.model.MoEModel` for qwen3_moe and mixtral,
:class:`~coldset.engine.deepseek_v3.DeepseekV3Model`, :class:`~coldset.engine.glm4_moe.Glm4MoeModel`,
:class:`~coldset.engine.gpt_oss.GptOssModel`) and its routed experts into all-hot
:class:`~coldset.kernels.tiers.ExpertPools` in one of :data:`EXPERT_FORMATS`, so the step runs the
same modules and kernels as a loaded checkpoint of that family.

What is drawn (from ``seed``, on ``device``, in bfloat16): every linear weight and bias normal
with std ``1 / sqrt(fan_in)``, the embeddings with std 1, attention sinks with std 1, RMSNorm
weights 1 (float32 where the family keeps them so: gpt_oss), the grouped routers' weights in
float32 and their ``e_score_correction_bias`` 0. Experts: ``bf16`` drawn as the other weights;
``fp8`` drawn in bf16 a few experts at a time and quantized to block FP8 by
:func:`coldset.core.fp8.quantize_w13` / :func:`~coldset.core.fp8.quantize_weight` (scales
included); ``mxfp4`` random e2m1 bytes (every code equally likely) with one e8m0 scale per 32
values at the exponent that gives the weights the same std, jittered by one step
(:func:`mxfp4_scale_exponent`). gpt_oss's experts get biases (std ``1 / sqrt(fan_in)``) and its
clamped SwiGLU. The routing of such a model is not a trained model's (random routers route
near-uniformly, without the locality a trained model shows): step times are the real shape's,
cache hit rates are a random router's.

``moe_layers=N`` keeps the layers up to the N-th MoE layer at full width (the dense layers before
it, e.g. DeepSeek-V3's ``first_k_dense_replace``, stay): a model whose experts do not fit in HBM
measured on a subset of its MoE layers (:func:`subset_note` says which). The config's
``quantization_config`` is dropped: the expert format is the one asked for, every other weight is
bfloat16.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from coldset.core import fp8, mxfp4
from coldset.engine import deepseek_v3, glm4_moe, gpt_oss
from coldset.engine.model import Attention, ModelConfig, ModelLoadError, MoEModel, RMSNorm
from coldset.kernels.tiers import ExpertPools

#: The experts' formats a random model is built in: bfloat16, DeepSeek's block FP8 (128 x 128
#: scales), gpt-oss's MXFP4 (e2m1 values, an e8m0 scale per 32).
EXPERT_FORMATS = ("bf16", "fp8", "mxfp4")
#: The shapes' name (:mod:`coldset.core.shapes`) of each expert format.
SHAPE_FORMAT = {"bf16": "bfloat16", "fp8": fp8.FORMAT_NAME, "mxfp4": mxfp4.FORMAT_NAME}
#: model_type -> (config class, model class) of every family the engine runs.
FAMILIES = {
    "qwen3_moe": (ModelConfig, MoEModel),
    "mixtral": (ModelConfig, MoEModel),
    deepseek_v3.MODEL_TYPE: (deepseek_v3.DeepseekV3Config, deepseek_v3.DeepseekV3Model),
    glm4_moe.MODEL_TYPE: (glm4_moe.Glm4MoeConfig, glm4_moe.Glm4MoeModel),
    gpt_oss.MODEL_TYPE: (gpt_oss.GptOssConfig, gpt_oss.GptOssModel),
}
#: Experts quantized to block FP8 this many weights at a time (the quantizer's float32 temporaries).
_FP8_CHUNK_WEIGHTS = 1 << 28
#: Mean square of an e2m1 value when every 4-bit code is equally likely (8 magnitudes, two signs).
_E2M1_MEAN_SQUARE = sum(v * v for v in mxfp4.E2M1_VALUES[:8]) / 8


def _family(raw: dict, source: str):
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in FAMILIES:
        raise ModelLoadError(f"{source}: model_type {model_type!r} has no engine family (one of "
                             f"{', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def family_config(raw: dict, moe_layers: int | None = None, source: str = "config") -> ModelConfig:
    """The engine config of the published config dict ``raw`` without its ``quantization_config``
    (its family's ``from_hf_config``), cut after its ``moe_layers``-th MoE layer when given (the
    layers before it kept, ``layer_types`` and ``mlp_only_layers`` cut to them)."""
    config_class, _ = _family(raw, source)
    raw = {k: v for k, v in raw.items() if k != "quantization_config"}
    cfg = config_class.from_hf_config(raw, source)
    if moe_layers is None:
        return cfg
    if not 1 <= moe_layers <= cfg.num_moe_layers:
        raise ModelLoadError(f"{source}: moe_layers={moe_layers}, but the config has {cfg.num_moe_layers} MoE layers "
                             "(give 1 to that many)")
    n = cfg.moe_layers[moe_layers - 1] + 1
    raw["num_hidden_layers"] = n
    if isinstance(raw.get("layer_types"), list):
        raw["layer_types"] = raw["layer_types"][:n]
    if raw.get("mlp_only_layers"):
        raw["mlp_only_layers"] = [i for i in raw["mlp_only_layers"] if i < n]
    return config_class.from_hf_config(raw, source)


def subset_note(raw: dict, cfg: ModelConfig, expert_format: str, source: str = "config") -> dict:
    """What a random model of ``raw`` holds against the published model: its layers, MoE layers
    (of the published count), dense layers and expert format, for a result's JSON."""
    full = family_config(raw, None, source)
    kept = cfg.num_moe_layers
    return {"model_type": raw["model_type"], "layers": cfg.num_layers, "moe_layers": kept,
            "published_moe_layers": full.num_moe_layers, "dense_layers": cfg.num_layers - kept,
            "expert_format": expert_format, "subset": kept < full.num_moe_layers,
            "note": (f"{cfg.num_layers} of {full.num_layers} layers: the {cfg.num_layers - kept} dense layer(s) and "
                     f"the first {kept} of {full.num_moe_layers} MoE layers at full width"
                     if kept < full.num_moe_layers else "every layer")}


#: :func:`tiny_config`'s widths, for the keys a published config has.
_TINY = {"hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "n_routed_experts": 8, "num_local_experts": 8,
         "num_experts_per_tok": 2, "experts_per_token": 2, "q_lora_rank": 32, "kv_lora_rank": 32,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "sliding_window": 4}


def tiny_config(raw: dict, vocab_size: int = 4096) -> dict:
    """``raw`` at a few hundred thousand weights, its family and every other key as published: the
    widths of :data:`_TINY` where ``raw`` has those keys (multi-head latent attention: as many kv
    heads as heads), at most one dense layer before two MoE layers, ``n_group`` 2 where groups
    are used. Why: the CPU dry run of ``bench step`` / ``bench cache --model-family`` and the tests
    build each family as published, only narrow."""
    out = {**raw, "vocab_size": vocab_size}
    out.update({k: v for k, v in _TINY.items() if raw.get(k) is not None})
    if "kv_lora_rank" in raw:
        out["num_key_value_heads"] = out["num_attention_heads"]
    dense = min(int(raw.get("first_k_dense_replace") or 0), 1)
    if "first_k_dense_replace" in raw:
        out["first_k_dense_replace"] = dense
    out["num_hidden_layers"] = dense + 2
    if isinstance(raw.get("layer_types"), list):
        out["layer_types"] = raw["layer_types"][:dense + 2]
    if raw.get("mlp_only_layers"):
        out["mlp_only_layers"] = []
    if (raw.get("n_group") or 1) > 1:
        out["n_group"], out["topk_group"] = 2, 1
    return out


def mxfp4_scale_exponent(fan_in: int) -> int:
    """The middle e8m0 scale byte of :func:`_mxfp4_experts`' scales (that byte -1, 0 or +1, each
    equally likely): uniform random e2m1 codes under them have std ``1 / sqrt(fan_in)`` to within
    the factor sqrt(2) a power-of-two scale allows."""
    jitter = (0.25 + 1.0 + 4.0) / 3  # mean of 4 ** j over j in (-1, 0, 1): the variance factor of the jitter
    return mxfp4.SCALE_BIAS + round(math.log2(1.0 / math.sqrt(fan_in * _E2M1_MEAN_SQUARE * jitter)))


def build_random_model(raw: dict, device: str | torch.device = "cpu", expert_format: str = "bf16",
                       moe_layers: int | None = None, seed: int = 0, source: str = "config") -> MoEModel:
    """A bfloat16 model of the published config dict ``raw`` (e.g.
    :data:`coldset.engine.gpt_oss.GPT_OSS_20B_CONFIG`, a ``config/examples/shapes/*/config.json``)
    with random weights drawn on ``device`` from ``seed`` (the module doc says how), its routed
    experts all hot in ``expert_format`` (its config's ``expert_format`` says which), cut to
    ``moe_layers`` MoE layers when given; in eval mode."""
    if expert_format not in EXPERT_FORMATS:
        raise ModelLoadError(f"expert_format {expert_format!r}: one of {', '.join(EXPERT_FORMATS)}")
    cfg = family_config(raw, moe_layers, source)
    cfg = dataclasses.replace(cfg, expert_format=SHAPE_FORMAT[expert_format])
    _, model_class = _family(raw, source)
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    model = model_class(cfg)
    _draw_weights(model, device, gen)
    model.pools = _expert_pools(cfg, expert_format, device, gen)
    return model.eval()


def _normal(shape, std: float, device, gen, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)


def _draw_weights(model: MoEModel, device: torch.device, gen: torch.Generator) -> None:
    """Every parameter of ``model`` but the routed experts drawn (module doc); the grouped routers'
    correction biases 0; the qk-norm weights fused; the RoPE table moved to ``device``."""
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(module, RMSNorm):
                dtype = torch.float32 if isinstance(module, gpt_oss.GptOssRMSNorm) else torch.bfloat16
                value = torch.ones(param.shape, dtype=dtype, device=device)
            elif isinstance(module, nn.Linear):
                value = _normal(param.shape, module.in_features ** -0.5, device, gen)
            else:  # embeddings, attention sinks
                value = _normal(param.shape, 1.0, device, gen)
            setattr(module, name, nn.Parameter(value, requires_grad=False))
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for module in model.modules():
        if isinstance(module, deepseek_v3.DeepseekMoE):  # glm4_moe's too: float32 router, as the loaders read it
            module.gate.weight = nn.Parameter(module.gate.weight.float(), requires_grad=False)
            module.e_score_correction_bias = torch.zeros(model.config.num_experts, dtype=torch.float32, device=device)
        if isinstance(module, Attention):
            module.fuse_qk_norm()
    model.inv_freq = model.inv_freq.to(device)
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise ModelLoadError(f"build_random_model: parameters left undrawn: {left[:5]}")


def _expert_pools(cfg: ModelConfig, expert_format: str, device, gen) -> ExpertPools:
    """All-hot pools of ``cfg``'s routed experts in ``expert_format``, drawn layer by layer in
    place (no full-size temporaries), with gpt_oss's biases and activation."""
    L, E, I, H = cfg.num_moe_layers, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if expert_format == "bf16":
        w13 = torch.empty((L, E, 2 * I, H), dtype=torch.bfloat16, device=device)
        w2 = torch.empty((L, E, H, I), dtype=torch.bfloat16, device=device)
        for m in range(L):
            w13[m].normal_(0.0, H ** -0.5, generator=gen)
            w2[m].normal_(0.0, I ** -0.5, generator=gen)
        weights = (w13, w2)
    elif expert_format == "fp8":
        weights = _fp8_experts(L, E, I, H, device, gen)
    else:
        weights = _mxfp4_experts(L, E, I, H, device, gen)
    extra = {}
    if isinstance(cfg, gpt_oss.GptOssConfig):
        extra = {"w13_bias": _normal((L, E, 2 * I), H ** -0.5, device, gen),
                 "w2_bias": _normal((L, E, H), I ** -0.5, device, gen), "activation": cfg.activation}
    return ExpertPools.all_hot(*weights, **extra)


def _fp8_experts(L: int, E: int, I: int, H: int, device, gen) -> tuple[torch.Tensor, ...]:
    """Block-FP8 ``(w13, w2, w13 scales, w2 scales)``: bf16 experts drawn a chunk at a time and quantized."""
    w13 = torch.empty((L, E, 2 * I, H), dtype=fp8.FP8_DTYPE, device=device)
    w2 = torch.empty((L, E, H, I), dtype=fp8.FP8_DTYPE, device=device)
    s13 = torch.empty((L, E, fp8.w13_scale_rows(I), fp8.scale_grid(I, H)[1]), dtype=torch.float32, device=device)
    s2 = torch.empty((L, E, *fp8.scale_grid(H, I)), dtype=torch.float32, device=device)
    chunk = max(1, _FP8_CHUNK_WEIGHTS // (3 * I * H))
    for m in range(L):
        for e in range(0, E, chunk):
            n = min(chunk, E - e)
            q, s = fp8.quantize_w13(_normal((n, 2 * I, H), H ** -0.5, device, gen))
            w13[m, e:e + n].copy_(q)
            s13[m, e:e + n].copy_(s)
            q, s = fp8.quantize_weight(_normal((n, H, I), I ** -0.5, device, gen))
            w2[m, e:e + n].copy_(q)
            s2[m, e:e + n].copy_(s)
    return w13, w2, s13, s2


def _mxfp4_experts(L: int, E: int, I: int, H: int, device, gen) -> tuple[torch.Tensor, ...]:
    """MXFP4 ``(w13 uint8 [L, E, 2I, H/2], w2 [L, E, H, I/2], w13 scales [L, E, 2I, H/32], w2
    scales [L, E, H, I/32])`` as the MXFP4 pools hold them: random bytes, scales at
    :func:`mxfp4_scale_exponent` of each projection's fan-in plus -1, 0 or +1."""
    for name, n in (("hidden_size", H), ("moe_intermediate_size", I)):
        if n % mxfp4.BLOCK:
            raise ModelLoadError(f"{name} {n}: MXFP4 groups {mxfp4.BLOCK} values along a row")
    g = mxfp4.BLOCK
    w13 = torch.empty((L, E, 2 * I, H // 2), dtype=torch.uint8, device=device)
    w2 = torch.empty((L, E, H, I // 2), dtype=torch.uint8, device=device)
    s13 = torch.empty((L, E, 2 * I, H // g), dtype=torch.uint8, device=device)
    s2 = torch.empty((L, E, H, I // g), dtype=torch.uint8, device=device)
    for m in range(L):
        for blocks, scales, fan_in in ((w13[m], s13[m], H), (w2[m], s2[m], I)):
            blocks.random_(0, 256, generator=gen)
            base = mxfp4_scale_exponent(fan_in)
            scales.random_(base - 1, base + 2, generator=gen)
    return w13, w2, s13, s2
