"""``bench step`` and ``bench cache``'s memory check of a ``--model-family`` model: a model whose
random weights (:func:`coldset.engine.random_weights.build_random_model`) cannot be drawn in the
GPU's free memory is refused before anything is drawn, naming the largest ``--moe-layers`` that
fits (:func:`model_fit_refusal`; ``bench cache`` checks its placement after the build,
:func:`coldset.measure.cache_memory.check_placement_fits`). Why: drawing a real-shape model takes
minutes, and a CUDA out-of-memory error after them says neither what fits nor why.

The refusal is returned, not raised: :mod:`coldset.measure.harness` (whose ``MeasureError`` a
refusal becomes) calls it, and a module it imports cannot import it back."""

from __future__ import annotations

from dataclasses import dataclass, replace

from coldset.core import shapes
from coldset.engine import random_weights

#: HBM a run needs beside what it sizes (the model's weights; a placement's hot pool or the slot pool of
#: the same rows): decode activations, KV cache, CUDA graph pools, the compressed tier's staging and
#: allocator slack; a fixed part and a share of what was sized.
HBM_MARGIN_BYTES = 2 << 30
HBM_MARGIN_FRACTION = 0.05


#: The parts of a random model drawn in float32 though its dtype is bfloat16
#: (:mod:`coldset.engine.random_weights`' module doc), by model_type: gpt_oss's RMSNorm weights; the
#: grouped routers' weights and score correction biases.
FLOAT32_PARTS = {"gpt_oss": ("norms",), "deepseek_v3": ("routers",), "glm4_moe": ("routers",)}


@dataclass(frozen=True)
class ModelBytes:
    """Bytes a random model holds on its device: ``experts``, the routed experts in their format
    with their scales; ``rest``, everything else (:func:`coldset.core.shapes.nonexpert_bytes_breakdown`'s
    parts: embeddings, LM head, attention, norms, routers, shared experts, dense MLPs, expert biases)."""

    experts: int
    rest: int

    @property
    def total(self) -> int:
        return self.experts + self.rest


def random_model_bytes(raw: dict, expert_format: str, moe_layers: int | None, source: str = "config") -> ModelBytes:
    """What :func:`coldset.engine.random_weights.build_random_model` of ``raw`` in ``expert_format``
    cut to ``moe_layers`` MoE layers (None: all) holds, from the shape of the config it builds
    (:func:`coldset.core.shapes.shape_from_hf_config` of ``raw`` without its ``quantization_config``,
    cut to the layers :func:`coldset.engine.random_weights.family_config` keeps) with every
    non-expert weight in bfloat16 but :data:`FLOAT32_PARTS`. Left out: the RoPE frequencies, the
    pools' row map (4 bytes an expert) and the fused qk-norm weights, a few hundred kB at the
    published shapes. A ``moe_layers`` the config does not have raises
    :class:`coldset.engine.model.ModelLoadError` (a ValueError) naming it."""
    cfg = random_weights.family_config(raw, moe_layers, source)
    cut = {k: v for k, v in raw.items() if k != "quantization_config"} | {"num_hidden_layers": cfg.num_layers}
    shape = replace(shapes.shape_from_hf_config(cut, source), expert_format=random_weights.SHAPE_FORMAT[expert_format],
                    linear_format="bfloat16", dtype="bfloat16", unquantized_linears=())
    parts = shapes.nonexpert_bytes_breakdown(shape)
    f32, bf16 = shapes.get_weight_format("float32"), shapes.get_weight_format("bfloat16")
    for part in FLOAT32_PARTS.get(shape.model_type, ()):
        parts[part] = int(parts[part] * f32.bytes_per_element / bf16.bytes_per_element)
    return ModelBytes(shape.num_moe_layers * shape.num_experts * shapes.expert_bytes(shape), sum(parts.values()))


def model_need_bytes(model: ModelBytes, held_bytes: int = 0) -> float:
    """HBM a run of ``model`` needs: its bytes, :data:`HBM_MARGIN_BYTES`, :data:`HBM_MARGIN_FRACTION`
    of its bytes and ``held_bytes`` (what the run keeps on the GPU besides).

    What the margin covers for ``bench step`` (:mod:`coldset.measure.step`): one engine at a time
    (each engine's compiled region is reset and each decoder dropped before the next), its KV cache
    at batch 8 and 48 positions (tens of MB at the families' shapes; DeepSeek-V3 caches its latent),
    its CUDA graph pool, activations and 16 steps of logits, and allocator slack; before them, the
    FP8 build's quantizer temporaries (one chunk of experts in float32, about 2 GB at deepseek-v3,
    freed when the build ends). Not covered unless a caller passes them as ``held_bytes``
    (:func:`coldset.measure.harness.random_family_model` passes none): ``--weight-format fp8``'s FP8
    pools beside the model's and its FP8 attention copies, ``--float32-check``'s float32 copy of the
    non-expert weights. ``bench cache`` checks its placement after the build
    (:func:`coldset.measure.cache_memory.check_placement_fits`)."""
    return model.total + HBM_MARGIN_BYTES + HBM_MARGIN_FRACTION * model.total + held_bytes


def model_fit_refusal(family: str, raw: dict, expert_format: str, moe_layers: int | None, free_bytes: int,
                      held_bytes: int = 0) -> str | None:
    """Why the random model of ``--model-family`` ``family`` (config ``raw``, experts in
    ``expert_format``) at ``moe_layers`` MoE layers (None: all) cannot be built in ``free_bytes``
    (:func:`model_need_bytes` of :func:`random_model_bytes` above them), in one line naming the
    family, the MoE layers asked, the GB needed (experts and the rest), the GB free and the largest
    ``--moe-layers`` that fits, or that none does; None when it fits."""
    published = random_weights.family_config(raw, None, family).num_moe_layers
    asked = published if moe_layers is None else moe_layers
    model = random_model_bytes(raw, expert_format, asked, family)
    need = model_need_bytes(model, held_bytes)
    if need <= free_bytes:
        return None
    fit = next((n for n in range(asked - 1, 0, -1)
                if model_need_bytes(random_model_bytes(raw, expert_format, n, family), held_bytes) <= free_bytes), None)
    return (
        f"--model-family {family} --moe-layers {asked} (of {published}) needs {need / 1e9:.1f} GB of HBM: "
        f"{model.experts / 1e9:.1f} GB of {expert_format} experts + {model.rest / 1e9:.1f} GB of the rest + "
        f"{(need - model.total) / 1e9:.1f} GB for activations, KV cache, graphs and what the run holds besides, "
        f"and {free_bytes / 1e9:.1f} GB is free. What fits: "
        + (f"--moe-layers {fit}." if fit else "no --moe-layers count (not even 1)."))


def preflight_model(family: str, raw: dict, expert_format: str, moe_layers: int | None, device,
                    held_bytes: int = 0) -> str | None:
    """:func:`model_fit_refusal` on the free bytes of CUDA ``device`` now, before anything is drawn
    (the allocator's cached blocks given back first, so that free bytes count them)."""
    import torch  # GPU-only path: torch loads when a measurement runs

    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return model_fit_refusal(family, raw, expert_format, moe_layers, free, held_bytes)
