"""The weights every family of the engine stores under the same Hugging Face names.

Each family's loader reads its own attention and MLP tensors; the embeddings, the final norm, the
LM head and each decoder layer's two norms are named alike in every family, so they are read here,
once, through the loader's own ``put(owner, attribute, key)`` (which applies that family's checks
and dtype rules).
"""

from __future__ import annotations

from collections.abc import Callable, Container

from torch import nn


def put_shared_weights(model: nn.Module, src: Container[str], put: Callable[[nn.Module, str, str], None]) -> None:
    """Read ``model``'s embeddings, final norm, LM head and every layer's input and post-attention
    norms from checkpoint keys in ``src``. The LM head is tied to the embeddings where the config
    ties them and the checkpoint holds no ``lm_head.weight``."""
    put(model.embed_tokens, "weight", "model.embed_tokens.weight")
    put(model.norm, "weight", "model.norm.weight")
    if model.config.tie_word_embeddings and "lm_head.weight" not in src:
        model.lm_head.weight = model.embed_tokens.weight
    else:
        put(model.lm_head, "weight", "lm_head.weight")
    for i, layer in enumerate(model.layers):
        put(layer.input_layernorm, "weight", f"model.layers.{i}.input_layernorm.weight")
        put(layer.post_attention_layernorm, "weight", f"model.layers.{i}.post_attention_layernorm.weight")
