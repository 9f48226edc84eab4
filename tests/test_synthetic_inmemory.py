"""The synthetic model's one construction, build_synthetic_model (in memory; real shapes on the GPU):
same architecture as a real qwen3_moe, checked against Hugging Face transformers; the checkpoint
write_synthetic_checkpoint writes loads to exactly it; seeded; its skew knob moves routing skew; a
padded vocabulary is never decoded."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from coldset.engine.generate import encode_prompts, generate
from coldset.engine.loading import load_model, load_tokenizer
from coldset.analysis.skew import gini
from coldset.engine.synthetic import (SyntheticSpec, build_synthetic_model, sample_prompts, synthetic_model_config,
                               write_synthetic_checkpoint)
from family_oracle import assert_stepwise_greedy_matches

SMALL = SyntheticSpec(layers=2, experts=8, top_k=2, hidden=64, moe_intermediate=32, heads=4, kv_heads=2,
                      head_dim=32, vocab_size=800, model_vocab_size=1000, seed=3, in_memory=True)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def small_model():
    """SMALL built in memory (CPU, float32) and its prompts."""
    model, tok = build_synthetic_model(SMALL, "cpu", torch.float32)
    prompts = encode_prompts(tok, [sample_prompts("prose", 1)[0], sample_prompts("agent", 1)[0][:80]])
    return model, tok, prompts


@pytest.fixture(scope="module")
def small_written(tmp_path_factory):
    """SMALL without in_memory written by write_synthetic_checkpoint (padded vocabulary included)."""
    return write_synthetic_checkpoint(dataclasses.replace(SMALL, in_memory=False),
                                      tmp_path_factory.mktemp("small") / "hf")


def test_inmemory_model_matches_transformers(small_model, small_written):
    transformers = pytest.importorskip("transformers")
    model, tok, prompts = small_model
    assert model.config.vocab_size == 1000 and tok.get_vocab_size() <= 800
    assert synthetic_model_config(SMALL) == model.config
    assert model.pools.w13_hot.shape == (2 * 8, 64, 64) and model.pools.w2_hot.shape == (2 * 8, 64, 32)
    gen = generate(model, prompts, 8, progress=False, return_all_logits=True)
    # transformers reads the written folder: its own qwen3_moe code against the in-memory model
    hf = transformers.AutoModelForCausalLM.from_pretrained(small_written, dtype=torch.float32).eval()
    assert hf.config.vocab_size == 1000
    assert_stepwise_greedy_matches(hf, prompts, gen, 8, 1e-3)


def test_written_checkpoint_loads_to_exactly_the_inmemory_model(small_model, small_written):
    """One construction: load_model on the file gives bitwise the logits of build_synthetic_model."""
    model, tok, prompts = small_model
    loaded = load_model(small_written, "cpu", torch.float32)
    assert loaded.config == model.config
    assert load_tokenizer(small_written).get_vocab() == tok.get_vocab()
    assert torch.equal(loaded.pools.w13_hot, model.pools.w13_hot) and torch.equal(loaded.pools.w2_hot, model.pools.w2_hot)
    a = generate(model, prompts, 8, progress=False, return_all_logits=True, capture_routing=True)
    b = generate(loaded, prompts, 8, progress=False, return_all_logits=True, capture_routing=True)
    assert torch.equal(a.all_logits, b.all_logits) and a.tokens == b.tokens
    for ra, rb in zip(a.routing, b.routing):
        assert torch.equal(ra.experts, rb.experts) and torch.equal(ra.weights, rb.weights)
    # domain_texts reach the written model exactly as the in-memory one (tokenizer and clusters)
    spec = dataclasses.replace(SMALL, in_memory=False, model_vocab_size=None, layers=1, seed=5)
    texts = {"sql": ["SELECT quuxfrobnicate FROM zorbletable WHERE quuxfrobnicate > 3;"] * 50}
    built, built_tok = build_synthetic_model(spec, "cpu", torch.float32, domain_texts=texts)
    path = write_synthetic_checkpoint(spec, small_written.parent / "sql", domain_texts=texts)
    ids = encode_prompts(built_tok, ["SELECT quuxfrobnicate FROM zorbletable;", sample_prompts("code", 1)[0][:60]])
    assert encode_prompts(load_tokenizer(path), ["SELECT quuxfrobnicate FROM zorbletable;"])[0] == ids[0]
    a = generate(built, ids, 4, progress=False, return_all_logits=True)
    b = generate(load_model(path, "cpu", torch.float32), ids, 4, progress=False, return_all_logits=True)
    assert torch.equal(a.all_logits, b.all_logits)


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
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        write_synthetic_checkpoint(dataclasses.replace(SMALL, model_vocab_size=10, in_memory=False), tmp_path / "y")
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def _state(model) -> dict[str, torch.Tensor]:
    return {**{k: v.clone() for k, v in model.state_dict().items()},
            "w13": model.pools.w13_hot.clone(), "w2": model.pools.w2_hot.clone()}


def test_set_router_knobs_gives_the_fresh_build_of_the_new_knobs():
    """Remaking the routers in place (the calibration sweeps' path) is exactly a fresh build of
    the new router knobs: every weight, hence every routing decision, equal; other fields refused."""
    from coldset.engine.synthetic import set_router_knobs

    new = dataclasses.replace(SMALL, popularity_scale=3.0, zipf_exponent=0.7, domain_affinity=2.5,
                              router_noise=1.1, temporal_gain=5.0)
    swept, _ = build_synthetic_model(SMALL, "cpu", torch.float32)
    before = _state(swept)
    set_router_knobs(swept, new)
    fresh, tok = build_synthetic_model(new, "cpu", torch.float32)
    after, expected = _state(swept), _state(fresh)
    assert after.keys() == expected.keys()
    for key in expected:
        assert torch.equal(after[key], expected[key]), key
    gates = [k for k in expected if k.endswith("mlp.gate.weight")]
    assert gates and all(not torch.equal(before[k], after[k]) for k in gates)  # the knobs did move the routers
    ids = encode_prompts(tok, [sample_prompts("code", 1)[0][:60]])
    a = generate(swept, ids, 6, capture_routing=True, progress=False)
    b = generate(fresh, ids, 6, capture_routing=True, progress=False)
    assert torch.equal(a.routing[0].experts, b.routing[0].experts) and a.tokens == b.tokens
    set_router_knobs(swept, SMALL)  # and back
    assert all(torch.equal(v, before[k]) for k, v in _state(swept).items())
    with pytest.raises(ValueError, match=r"\['seed'\] differ"):
        set_router_knobs(swept, dataclasses.replace(SMALL, seed=4))
    no_context = dataclasses.replace(SMALL, topic_context=0.0)  # topic directions only for the router
    model, _ = build_synthetic_model(no_context, "cpu", torch.float32)
    with pytest.raises(ValueError, match="topic directions"):
        set_router_knobs(model, dataclasses.replace(no_context, temporal_gain=0.0))


def test_inmemory_config_states_the_dtype_the_model_is_built_in():
    """Placement sizes an in-memory model's experts from its ModelConfig: a bf16 build must say
    bf16 (half the float32 bytes), and the manifest's config must equal the built model's."""
    from coldset.core.shapes import expert_bytes

    bf16 = synthetic_model_config(SMALL, dtype="bfloat16")
    model, _ = build_synthetic_model(SMALL, "cpu", torch.bfloat16)
    assert model.config == bf16 and bf16.expert_format == bf16.dtype == "bfloat16"
    assert synthetic_model_config(SMALL) != bf16
    assert 2 * expert_bytes(bf16) == expert_bytes(synthetic_model_config(SMALL))
