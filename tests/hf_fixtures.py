"""Tiny random Hugging Face MoE checkpoints written by transformers itself (the independent reference).

``build_tiny_checkpoint(arch, out_dir)`` saves a randomly initialised qwen3_moe or mixtral model
with ``save_pretrained`` (safetensors, float32) plus a small byte-level BPE ``tokenizer.json``.
head_dim is 32 so that vLLM's CPU backend can load the same folders in a later test.
Variants: ``qwen3_moe`` (sharded, layer 1 dense via ``mlp_only_layers``, ``norm_topk_prob``),
``qwen3_moe_nonorm`` (``decoder_sparse_step=2``: odd layers MoE, no renormalisation, tied
embeddings),
``mixtral`` (single file), ``mixtral_sliding`` (``sliding_window=8``).
"""

from __future__ import annotations

from pathlib import Path

TINY_ARCHS = ("qwen3_moe", "qwen3_moe_nonorm", "mixtral", "mixtral_sliding")

TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "def add(a, b):\n    return a + b\n",
    "Mixture of experts models route every token to a few experts.",
    "for i in range(10):\n    print(i * i)\n",
]


def build_tokenizer(vocab_size: int = 300):
    """A deterministic byte-level BPE tokenizer trained on a few lines (exact round trip)."""
    from coldset.engine.synthetic import train_tokenizer

    return train_tokenizer(TOKENIZER_TEXT * 4, vocab_size)


def build_tiny_checkpoint(arch: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny random ``arch`` checkpoint (see module docstring) into ``out_dir``."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; one of {TINY_ARCHS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    vocab = tok.get_vocab_size()
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    shard = None
    if arch.startswith("qwen3_moe"):
        extra = (
            dict(mlp_only_layers=[1], norm_topk_prob=True, num_hidden_layers=3)
            if arch == "qwen3_moe"
            else dict(decoder_sparse_step=2, norm_topk_prob=False, num_hidden_layers=4)
        )
        settings = {**common, **extra}
        if arch == "qwen3_moe_nonorm":
            settings["tie_word_embeddings"] = True  # lm_head.weight absent from the file
        cfg = Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=48, num_experts=8, rope_theta=10000.0,
            **settings,
        )
        model = Qwen3MoeForCausalLM(cfg)
        shard = "200KB" if arch == "qwen3_moe" else None
    else:
        cfg = MixtralConfig(
            intermediate_size=48, num_local_experts=6, num_hidden_layers=2, rope_theta=1e6,
            sliding_window=8 if arch == "mixtral_sliding" else None, **common,
        )
        model = MixtralForCausalLM(cfg)
    model = model.float().eval()
    if shard:
        model.save_pretrained(out, max_shard_size=shard)
    else:
        model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    return out
