"""The routed experts' gated activation: what joins the gate and up halves of w13's product.

Two kinds, one per published family of expert MLPs:

- ``"silu"`` (the default): ``SiLU(gate) * up``, as Qwen3-MoE, Mixtral and DeepSeek-V3 compute it
  (``hidden_act: silu``);
- ``"swiglu_clamped"``: gpt-oss's clamped SwiGLU (transformers' ``GptOssExperts._apply_gate``):
  ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
  ``(up + 1) * gate * sigmoid(alpha * gate)``, with ``alpha`` (1.702) and ``limit``
  (``swiglu_limit``, 7.0) from the model's config.

An :class:`Activation` is a frozen value the pools carry (:class:`coldset.kernels.tiers.ExpertPools`):
the torch path calls :func:`torch_activation`, the Triton kernels compile the kind in as a
constexpr (:data:`KIND_CODES`), so the SiLU kernels are the same code whether or not this module
exists. :func:`activation_from_config` reads it from a Hugging Face config, so every family's
loader gets it one way, and a config naming an activation the kernels do not compute is refused by
name instead of being run as SiLU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

KINDS = ("silu", "swiglu_clamped")

#: The kernels' constexpr code of each kind (0 compiles the SiLU epilogue alone).
KIND_CODES = {"silu": 0, "swiglu_clamped": 1}

#: gpt-oss's sigmoid scale (transformers' ``GptOssConfig.swiglu_alpha`` default; published configs omit it).
GPT_OSS_ALPHA = 1.702


@dataclass(frozen=True)
class Activation:
    """The experts' gated activation (module doc). ``alpha`` and ``limit`` belong to
    ``swiglu_clamped`` only (positive, finite); ``silu`` takes neither."""

    kind: str = "silu"
    alpha: float | None = None
    limit: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Activation.kind: {self.kind!r} is not one of {KINDS}")
        if self.kind == "silu":
            if self.alpha is not None or self.limit is not None:
                raise ValueError(f"Activation: kind 'silu' takes no alpha/limit, got alpha={self.alpha}, "
                                 f"limit={self.limit}")
            return
        for name in ("alpha", "limit"):
            v = getattr(self, name)
            if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"Activation.{name}: kind 'swiglu_clamped' needs a positive finite number, got {v!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "limit", float(self.limit))

    @property
    def code(self) -> int:
        """The Triton kernels' constexpr for this kind (:data:`KIND_CODES`)."""
        return KIND_CODES[self.kind]

    def key(self) -> dict:
        """The fields that change the computed function: the autotune key's ``activation``."""
        return {"kind": self.kind, "alpha": self.alpha, "limit": self.limit}


SILU = Activation()


def swiglu_clamped(limit: float, alpha: float = GPT_OSS_ALPHA) -> Activation:
    """gpt-oss's clamped SwiGLU with ``limit`` (its config's ``swiglu_limit``) and ``alpha``."""
    return Activation("swiglu_clamped", alpha=alpha, limit=limit)


def activation_from_config(config: Any) -> Activation:
    """The experts' activation a Hugging Face config (a mapping or an object with attributes)
    describes: ``swiglu_clamped`` when it has ``swiglu_limit`` (gpt-oss: ``swiglu_alpha`` when
    present, else :data:`GPT_OSS_ALPHA`, the value transformers hard-codes or defaults to), else
    ``silu`` when ``hidden_act`` is ``silu`` or absent. Any other ``hidden_act`` is refused
    naming it: the kernels compute these two only."""
    def get(name):
        return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)

    limit = get("swiglu_limit")
    if limit is not None:
        alpha = get("swiglu_alpha")
        return swiglu_clamped(limit=limit, alpha=GPT_OSS_ALPHA if alpha is None else alpha)
    act = get("hidden_act")
    if act is None or act == "silu":
        return SILU
    raise ValueError(f"config hidden_act {act!r}: the experts kernels compute SiLU(gate) * up ('silu') or "
                     f"gpt-oss's clamped SwiGLU ('swiglu_limit'), not this activation")


def torch_activation(activation: Activation, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``activation`` of ``gate`` and ``up`` in their dtype, op by op as transformers computes it
    (every intermediate rounded to that dtype): the reference of the kernels' epilogues."""
    if activation.kind == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(min=None, max=activation.limit)
    up = up.clamp(min=-activation.limit, max=activation.limit)
    glu = gate * torch.sigmoid(gate * activation.alpha)
    return (up + 1) * glu
