"""The synthetic default checkpoint: routing behaves like a real MoE; it is a real HF folder."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from coldset.engine.generate import encode_prompts, generate
from coldset.engine.loading import load_model, load_tokenizer
from coldset.engine.model import ModelConfig
from coldset.engine.synthetic import SyntheticSpec, synthetic_model_config, write_synthetic_checkpoint
from family_oracle import assert_stepwise_greedy_matches

# Hand-written prompts (not from the generator that trained the tokenizer).
PROMPTS = {
    "agent": [
        '{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Madrid", "unit": "celsius"}}}]}',
        '{"name": "book_hotel", "arguments": {"city": "Kyoto", "start": "2026-03-02", "end": "2026-03-05", "guests": 2}}',
        '{"name": "query_database", "arguments": {"query": "orders", "limit": 25, "status": "open", "format": "csv"}}',
        '{"name": "send_email", "arguments": {"email": "ana@example.com", "subject": "Invoice 4411", "body": "See attached"}}',
        '{"role": "assistant", "tool_calls": [{"id": "call_7", "type": "function", "function": {"name": "fetch_url", "arguments": {"url": "https://example.org", "timeout": 30}}}]}',
        '{"name": "convert_currency", "arguments": {"amount": 120, "currency": "GBP", "to": ["EUR", "USD"]}}',
    ],
    "prose": [
        "The old lighthouse keeper walked along the narrow path every evening, counting the boats that came home.",
        "When the winter finally ended, the children of the village ran across the meadow to the river.",
        "She opened the letter slowly, and for a long moment the quiet kitchen seemed to hold its breath.",
        "A traveler reached the ancient bridge at dawn and noticed that the stones were warm.",
        "Her grandmother remembered the festival in the harbor, the lanterns and the music over the water.",
        "The painter carried his brushes up the mountain, hoping the morning light would be gentle.",
    ],
    "code": [
        "def merge(left, right):\n    result = []\n    while left and right:\n        result.append(left.pop(0))\n",
        "def count_words(path):\n    counts = {}\n    for line in open(path):\n        for word in line.split():\n",
        "class Cache:\n    def __init__(self, size):\n        self.size = size\n        self.data = {}\n\n    def get(self, key):\n",
        "for i, item in enumerate(items):\n    if item is None:\n        continue\n    total += item * weights[i]\n",
        "def parse(tokens):\n    stack = []\n    for token in tokens:\n        if token == '(':\n            stack.append(token)\n",
        "import os\n\ndef list_files(root):\n    return sorted(os.path.join(root, name) for name in os.listdir(root))\n",
    ],
}
NEW_TOKENS = 48


def gini(counts) -> float:
    """Gini coefficient of non-negative counts (0 = all equal, 1 - 1/n = all in one)."""
    c = np.sort(np.asarray(counts, dtype=float))
    n = len(c)
    return float(2 * np.sum(np.arange(1, n + 1) * c) / (n * c.sum()) - (n + 1) / n)


def spearman(a, b) -> float:
    """Spearman rank correlation with average ranks for ties."""
    def ranks(x):
        x = np.asarray(x, dtype=float)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):  # average ties
            r[x == v] = r[x == v].mean()
        return r

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def test_gini_and_spearman_helpers_on_hand_computed_cases():
    assert gini([5, 5, 5, 5]) == pytest.approx(0.0)
    assert gini([0, 0, 0, 8]) == pytest.approx(0.75)
    assert gini([1, 3]) == pytest.approx(0.25)  # mean |xi-xj| / (2 mean) = (2*2/4) / (2*2)
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


@pytest.fixture(scope="module")
def default_checkpoint(tmp_path_factory):
    return write_synthetic_checkpoint(SyntheticSpec(), tmp_path_factory.mktemp("syn") / "default")


@pytest.fixture(scope="module")
def decode_counts(default_checkpoint):
    """Per domain: decode-phase selection counts [num_moe_layers, experts], and generated tokens."""
    model = load_model(default_checkpoint)
    tok = load_tokenizer(default_checkpoint)
    out = {}
    for domain, texts in PROMPTS.items():
        gen = generate(model, encode_prompts(tok, texts), NEW_TOKENS, capture_routing=True,
                       progress=False)
        counts = np.zeros((model.config.num_moe_layers, model.config.num_experts))
        for r in gen.routing:
            decode = r.experts[r.num_prompt_tokens:].numpy()
            assert decode.shape[0] == NEW_TOKENS - 1
            for layer in range(counts.shape[0]):
                counts[layer] += np.bincount(decode[:, layer].ravel(), minlength=counts.shape[1])
        out[domain] = (counts, gen.tokens)
    return out


def test_default_decode_routing_is_skewed(decode_counts):
    pooled = sum(c for c, _ in decode_counts.values())
    mean_gini = np.mean([gini(layer) for layer in pooled])
    assert 0.4 <= mean_gini <= 0.8, mean_gini
    for domain, (counts, _) in decode_counts.items():
        g = np.mean([gini(layer) for layer in counts])
        assert 0.4 <= g <= 0.85, (domain, g)


def test_default_domains_reach_different_experts(decode_counts):
    domains = list(decode_counts)
    for i, a in enumerate(domains):
        for b in domains[i + 1:]:
            ca, cb = decode_counts[a][0], decode_counts[b][0]
            rho = np.mean([spearman(x, y) for x, y in zip(ca, cb)])
            assert rho < 0.75, (a, b, rho)
            same_top = sum(
                set(np.argsort(-x, kind="stable")[:4]) == set(np.argsort(-y, kind="stable")[:4])
                for x, y in zip(ca, cb)
            )
            assert same_top <= len(ca) // 2, (a, b, same_top)


def test_default_greedy_decode_has_variety(decode_counts):
    for domain, (_, tokens) in decode_counts.items():
        for seq in tokens:
            assert len(set(seq)) >= NEW_TOKENS // 3, (domain, seq)


def test_tokenizer_round_trip(default_checkpoint):
    tok = load_tokenizer(default_checkpoint)
    for text in [*PROMPTS["code"][:2], PROMPTS["agent"][0], "naïve café — 東京 ✓\n\ttab", ""]:
        assert tok.decode(tok.encode(text).ids) == text
    assert tok.get_vocab_size() == ModelConfig.from_pretrained(default_checkpoint).vocab_size


def test_default_checkpoint_is_a_real_qwen3_moe_folder(default_checkpoint):
    names = set(os.listdir(default_checkpoint))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    spec = SyntheticSpec()
    cfg = ModelConfig.from_pretrained(default_checkpoint)
    assert (cfg.model_type, cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.hidden_size) == (
        "qwen3_moe", spec.layers, spec.experts, spec.top_k, spec.hidden)
    assert cfg.moe_layers == tuple(range(spec.layers)) and 1000 < cfg.vocab_size <= spec.vocab_size
    from safetensors import safe_open

    with safe_open(str(default_checkpoint / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.5.mlp.experts.31.down_proj.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)


def test_small_spec_matches_transformers_and_is_deterministic(tmp_path):
    transformers = pytest.importorskip("transformers")
    spec = SyntheticSpec(layers=2, experts=8, top_k=2, hidden=64, moe_intermediate=32,
                         heads=4, kv_heads=2, head_dim=32, vocab_size=800, seed=3)
    a = write_synthetic_checkpoint(spec, tmp_path / "a")
    b = write_synthetic_checkpoint(spec, tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    other = write_synthetic_checkpoint(dataclass_replace(spec, seed=4), tmp_path / "c")
    assert (a / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()

    tok = load_tokenizer(a)
    prompts = encode_prompts(tok, [PROMPTS["prose"][0], PROMPTS["agent"][1]])
    gen = generate(load_model(a), prompts, 12, capture_routing=True, progress=False,
                   return_all_logits=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).eval()
    assert_stepwise_greedy_matches(hf, prompts, gen, 12, 1e-3)


def dataclass_replace(spec, **changes):
    import dataclasses

    return dataclasses.replace(spec, **changes)


def test_domain_texts_join_the_tokenizer_and_add_a_domain(tmp_path):
    spec = SyntheticSpec(layers=1, experts=8, top_k=2, hidden=64, moe_intermediate=32,
                         heads=2, kv_heads=1, head_dim=32, vocab_size=1500)
    sql = ["SELECT quuxfrobnicate FROM zorbletable WHERE quuxfrobnicate > 3;"] * 50
    path = write_synthetic_checkpoint(spec, tmp_path / "sql", domain_texts={"sql": sql})
    tok = load_tokenizer(path)
    assert len(tok.encode(" quuxfrobnicate").ids) == 1
    plain = write_synthetic_checkpoint(spec, tmp_path / "plain")
    assert len(load_tokenizer(plain).encode(" quuxfrobnicate").ids) > 1


def test_write_is_atomic(tmp_path, monkeypatch):
    spec = SyntheticSpec(layers=1, experts=4, top_k=2, hidden=64, moe_intermediate=32,
                         heads=2, kv_heads=1, head_dim=32, vocab_size=600)
    out = write_synthetic_checkpoint(spec, tmp_path / "m")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    import coldset.engine.synthetic

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(coldset.engine.synthetic, "save_file", fail)  # the writer's safetensors call
    with pytest.raises(OSError, match="disk full"):
        write_synthetic_checkpoint(dataclass_replace(spec, seed=9), out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp folders left
    with pytest.raises(OSError):
        write_synthetic_checkpoint(spec, tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert json.loads((out / "config.json").read_text())["coldset_synthetic"]["seed"] == 0


# ---------------------------------------------------------------------------------------------
# temporal structure (issue 17): the lift of consecutive-token expert overlap over its shuffled
# baseline comes from the knobs, not from a constant

_SMALL = dict(layers=2, experts=16, top_k=2, hidden=96, moe_intermediate=16, heads=2, kv_heads=1, head_dim=32,
              vocab_size=512)


def _decode_lift(**knobs) -> float:
    from coldset.engine.generate import encode_prompts as enc
    from coldset.analysis.locality import consecutive_overlap, shuffled_overlap
    from coldset.engine.synthetic import build_synthetic_model

    model, tok = build_synthetic_model(SyntheticSpec(**_SMALL, **knobs))
    prompts = [p for ps in PROMPTS.values() for p in ps]
    gen = generate(model, enc(tok, prompts), 24, capture_routing=True, progress=False)
    decode = [r.experts[r.num_prompt_tokens:].numpy().astype(np.int64) for r in gen.routing]
    sel = np.concatenate(decode)
    req = np.concatenate([np.full(len(d), i) for i, d in enumerate(decode)])
    pos = np.concatenate([np.arange(len(d)) for d in decode])
    return float(np.nanmean(consecutive_overlap(sel, req, pos)) / np.nanmean(shuffled_overlap(sel, req, seed=0)))


def test_temporal_knobs_set_the_lift():
    on = dict(temporal_gain=12.0, temporal_continuity=0.8, router_noise=0.3, popularity_scale=9.0)
    # the chosen knobs give about 1.46 at this size (1.65 at the default shape, BENCHMARKS.md)
    assert _decode_lift(**on) == pytest.approx(1.46, abs=0.15)
    # no continuity (a fresh topic every token) or no topic in the router: no temporal structure
    assert _decode_lift(**{**on, "temporal_continuity": 0.0}) == pytest.approx(1.0, abs=0.08)
    assert _decode_lift(temporal_gain=0.0, topic_context=0.0) == pytest.approx(1.0, abs=0.08)


def test_temporal_latents_are_deterministic_and_sticky():
    from coldset.engine.synthetic import _topic_latents

    spec = SyntheticSpec(temporal_gain=1.0, temporal_continuity=0.75, seed=3)
    cycles = [torch.randperm(400, generator=torch.Generator().manual_seed(1)), torch.arange(400, 900)]
    z = _topic_latents(spec, 1000, 8, cycles)
    assert torch.equal(z, _topic_latents(spec, 1000, 8, cycles))
    assert not torch.equal(z, _topic_latents(SyntheticSpec(temporal_gain=1.0, temporal_continuity=0.75, seed=4),
                                             1000, 8, cycles))
    for order in cycles:  # neighbours on a cycle share z with probability temporal_continuity
        same = (z[order[1:]] == z[order[:-1]]).all(dim=1).float().mean().item()
        assert same == pytest.approx(0.75, abs=0.06)
    assert z.norm(dim=1).mean().item() == pytest.approx(1.0, abs=0.15)


def test_topic_palettes_bound_the_topics_of_each_span():
    from coldset.engine.synthetic import _topic_latents

    cycles = [torch.randperm(900, generator=torch.Generator().manual_seed(2))]
    spec = SyntheticSpec(temporal_gain=1.0, temporal_continuity=0.75, topic_palette=5, topic_span=300, seed=3)
    z = _topic_latents(spec, 900, 8, cycles)[cycles[0]]
    spans = [z[i:i + 300] for i in range(0, 900, 300)]
    topics = [torch.unique(s, dim=0) for s in spans]
    assert [t.shape[0] for t in topics] == [5, 5, 5]  # each span walks its own palette, every entry reached
    for a in range(3):
        for b in range(a + 1, 3):
            assert not (topics[a][:, None] == topics[b][None]).all(-1).any()  # no topic shared between spans
    for s in spans:  # neighbours keep their topic with probability temporal_continuity, else change it
        same = (s[1:] == s[:-1]).all(dim=1).float().mean().item()
        assert same == pytest.approx(0.75, abs=0.07)
    # without palettes each run draws a fresh topic: as many topics as runs
    free = _topic_latents(dataclass_replace(spec, topic_palette=0), 900, 8, cycles)[cycles[0]]
    runs = 1 + int((free[1:] != free[:-1]).any(dim=1).sum())
    assert torch.unique(free, dim=0).shape[0] == runs > 100
    with pytest.raises(ValueError, match="topic_palette"):
        synthetic_model_config(SyntheticSpec(topic_palette=-1))
