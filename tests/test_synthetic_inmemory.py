"""The in-memory synthetic model (real shapes on the GPU): same architecture as a real qwen3_moe,
checked against Hugging Face transformers; seeded; its skew knob moves routing skew; a padded
vocabulary is never decoded."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from coldset.model import encode_prompts, generate
from coldset.stats import gini
from coldset.synthetic import (SyntheticSpec, _config, build_synthetic_model, sample_prompts,
                               synthetic_model_config, write_synthetic_checkpoint)

SMALL = SyntheticSpec(layers=2, experts=8, top_k=2, hidden=64, moe_intermediate=32, heads=4, kv_heads=2,
                      head_dim=32, vocab_size=800, model_vocab_size=1000, seed=3, in_memory=True)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _export_hf(model, tokenizer, spec, folder):
    """Write the in-memory model as an HF qwen3_moe folder (per-expert keys) for transformers."""
    from safetensors.torch import save_file

    cfg = model.config
    t = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight,
         "lm_head.weight": model.lm_head.weight}
    I = cfg.moe_intermediate_size
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        a = layer.self_attn
        q, k, v = a.qkv_proj.weight.split([a.q_size, a.kv_size, a.kv_size])
        t.update({f"{p}.self_attn.q_proj.weight": q, f"{p}.self_attn.k_proj.weight": k,
                  f"{p}.self_attn.v_proj.weight": v, f"{p}.self_attn.o_proj.weight": a.o_proj.weight,
                  f"{p}.self_attn.q_norm.weight": a.q_norm.weight, f"{p}.self_attn.k_norm.weight": a.k_norm.weight,
                  f"{p}.input_layernorm.weight": layer.input_layernorm.weight,
                  f"{p}.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
                  f"{p}.mlp.gate.weight": layer.mlp.gate.weight})
        for e in range(cfg.num_experts):
            w13, w2 = model.pools.expert_weights(layer.mlp.moe_index, e)
            t[f"{p}.mlp.experts.{e}.gate_proj.weight"] = w13[:I]
            t[f"{p}.mlp.experts.{e}.up_proj.weight"] = w13[I:]
            t[f"{p}.mlp.experts.{e}.down_proj.weight"] = w2
    folder.mkdir()
    save_file({k: v.detach().contiguous().clone() for k, v in t.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    raw = _config(spec, cfg.vocab_size, tokenizer.token_to_id("<|endoftext|>"))
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_inmemory_model_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    model, tok = build_synthetic_model(SMALL, "cpu", torch.float32)
    assert model.config.vocab_size == 1000 and tok.get_vocab_size() <= 800
    assert synthetic_model_config(SMALL) == model.config
    assert model.pools.w13_hot.shape == (2 * 8, 64, 64) and model.pools.w2_hot.shape == (2 * 8, 64, 32)
    prompts = encode_prompts(tok, [sample_prompts("prose", 1)[0], sample_prompts("agent", 1)[0][:80]])
    gen = generate(model, prompts, 8, progress=False, return_all_logits=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(_export_hf(model, tok, SMALL, tmp_path / "hf"),
                                                           dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        seq = list(prompt)
        with torch.no_grad():
            for step in range(8):
                logits = hf(torch.tensor([seq])).logits[0, -1]
                assert (logits - gen.all_logits[i, step]).abs().max().item() < 1e-3
                seq.append(int(torch.argmax(logits)))
        assert seq[len(prompt):] == gen.tokens[i]


def test_inmemory_model_is_seeded():
    a, _ = build_synthetic_model(SMALL, "cpu", torch.float32)
    b, _ = build_synthetic_model(SMALL, "cpu", torch.float32)
    c, _ = build_synthetic_model(dataclasses.replace(SMALL, seed=4), "cpu", torch.float32)
    assert torch.equal(a.pools.w13_hot, b.pools.w13_hot) and torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert torch.equal(a.layers[1].mlp.gate.weight, b.layers[1].mlp.gate.weight)
    assert not torch.equal(a.pools.w2_hot, c.pools.w2_hot)
    assert not torch.equal(a.layers[0].mlp.gate.weight, c.layers[0].mlp.gate.weight)
    # bf16 build: the experts are drawn in the model dtype, not cast from another draw
    d, _ = build_synthetic_model(SMALL, "cpu", torch.bfloat16)
    assert d.pools.w13_hot.dtype == torch.bfloat16 and d.embed_tokens.weight.dtype == torch.bfloat16
    assert abs(float(d.pools.w13_hot.float().std()) - 64**-0.5) < 0.01


def _decode_gini(spec, prompts_text):
    model, tok = build_synthetic_model(spec, "cpu", torch.float32)
    prompts = encode_prompts(tok, prompts_text)
    gen = generate(model, prompts, 16, capture_routing=True, progress=False)
    counts = np.zeros((spec.layers, spec.experts))
    for r in gen.routing:
        dec = r.experts[r.num_prompt_tokens:].numpy().astype(int)
        for layer in range(spec.layers):
            np.add.at(counts[layer], dec[:, layer].ravel(), 1)
    tokens = [t for row in gen.tokens for t in row]
    return float(np.mean([gini(c) for c in counts])), tokens, tok.get_vocab_size()


def test_popularity_knob_raises_skew_and_padded_ids_are_never_decoded():
    spec = SyntheticSpec(layers=2, experts=32, top_k=4, hidden=128, moe_intermediate=32, heads=4, kv_heads=2,
                         head_dim=32, vocab_size=1200, model_vocab_size=5000, seed=1, in_memory=True)
    texts = [p for d in ("agent", "prose", "code") for p in sample_prompts(d, 2)]
    flat, tokens, tok_vocab = _decode_gini(dataclasses.replace(spec, popularity_scale=0.0), texts)
    skewed, _, _ = _decode_gini(dataclasses.replace(spec, popularity_scale=8.0), texts)
    assert skewed > flat + 0.1, (flat, skewed)
    assert max(tokens) < tok_vocab < 5000


def test_file_writer_refuses_in_memory_specs(tmp_path):
    with pytest.raises(ValueError, match="build_synthetic_model"):
        write_synthetic_checkpoint(SMALL, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        build_synthetic_model(dataclasses.replace(SMALL, model_vocab_size=10), "cpu")
