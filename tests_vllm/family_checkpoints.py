"""Tiny random checkpoints of the engine's newer families written by transformers itself, in
shapes vLLM's CPU build loads: glm4_moe and gpt_oss (attention heads of 32, the CPU attention's
smallest), deepseek_v3 (a latent of kv_lora_rank 512 + qk_rope_head_dim 64, the only width vLLM's
CPU MLA backend takes). float32 safetensors plus tests/hf_fixtures.py's small tokenizer.

Random biases (glm4_moe's q/k/v and every router's ``e_score_correction_bias``; gpt_oss's sinks,
router and expert biases) so that each one moves the result. gpt_oss uses the published clamped
SwiGLU (``swiglu_limit`` 7) and YaRN; deepseek_v3 writes the published router fields
(``topk_method: noaux_tc``, ``scoring_func: sigmoid``) that transformers leaves out.
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_fixtures import build_tokenizer

FAMILIES = ("glm4_moe", "gpt_oss", "deepseek_v3")


def build_family_checkpoint(family: str, out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a tiny random ``family`` checkpoint into ``out_dir`` (config fields ``overrides``)."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    common = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, max_position_embeddings=512, initializer_range=0.2,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    grouped = dict(moe_intermediate_size=32, intermediate_size=96, num_hidden_layers=3, first_k_dense_replace=1,
                   n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
                   routed_scaling_factor=1.5, norm_topk_prob=True)
    torch.manual_seed(seed)
    if family == "glm4_moe":
        cfg = transformers.Glm4MoeConfig(**{
            **common, **grouped, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "attention_bias": True, "use_qk_norm": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            **overrides})
        model = transformers.Glm4MoeForCausalLM(cfg)
    elif family == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(**{
            **common, **grouped, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
            "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **overrides})
        model = transformers.DeepseekV3ForCausalLM(cfg)
    else:
        cfg = transformers.GptOssConfig(**{
            **common, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
            "sliding_window": 6, "swiglu_limit": 7.0,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128},
            **overrides})
        model = transformers.GptOssForCausalLM(cfg)
    model = model.float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            mlp = layer.mlp
            if family == "gpt_oss":
                for t in (layer.self_attn.sinks, mlp.router.bias, mlp.experts.gate_up_proj_bias,
                          mlp.experts.down_proj_bias):
                    t.normal_(0.0, 0.5)
            elif hasattr(mlp, "gate"):
                mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
            if family == "glm4_moe":
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.2)
    model.save_pretrained(out)
    if family == "deepseek_v3":
        raw = json.loads((out / "config.json").read_text())
        raw.update(topk_method="noaux_tc", scoring_func="sigmoid")
        (out / "config.json").write_text(json.dumps(raw, indent=2))
    tok.save(str(out / "tokenizer.json"))
    return out
