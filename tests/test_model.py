"""The embedded engine against Hugging Face transformers on tiny random checkpoints it wrote itself."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from coldset.engine.generate import encode_prompts, generate
from coldset.engine.loading import load_model, load_tokenizer
from coldset.engine.model import ModelConfig, ModelLoadError

transformers = pytest.importorskip("transformers")

TEXTS = [
    "The quick brown fox jumps",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "def add(a, b):\n    return",
    "x",
]
NEW_TOKENS = 32


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_greedy(hf, prompt, new_tokens):
    """Greedy decode one unpadded prompt by full recomputation: (tokens, logits [new, V], router logits)."""
    seq, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(new_tokens):
            step = hf(torch.tensor([seq])).logits[0, -1]
            logits.append(step)
            seq.append(int(torch.argmax(step)))
        out = hf(torch.tensor([seq[:-1]]), output_router_logits=True)
    router = torch.stack([r.float() for r in out.router_logits], dim=1)  # [n_tokens, L_moe, E]
    return seq[len(prompt):], torch.stack(logits), router


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_moe_nonorm", "mixtral", "mixtral_sliding"])
def test_batched_greedy_matches_transformers(tiny_hf_checkpoint, arch):
    path = tiny_hf_checkpoint(arch)
    model = load_model(path)
    prompts = encode_prompts(load_tokenizer(path), TEXTS)
    assert len({len(p) for p in prompts}) == len(prompts), "prompts must differ in length"
    gen = generate(model, prompts, NEW_TOKENS, capture_routing=True, progress=False,
                   return_all_logits=True)
    hf = _hf_model(path)
    k = model.config.top_k
    for b, prompt in enumerate(prompts):
        ref_tokens, ref_logits, router_logits = _hf_greedy(hf, prompt, NEW_TOKENS)
        assert gen.tokens[b] == ref_tokens
        assert (gen.all_logits[b] - ref_logits).abs().max().item() < 1e-4
        assert torch.equal(gen.final_logits[b], gen.all_logits[b, -1])
        routing = gen.routing[b]
        assert routing.num_prompt_tokens == len(prompt)
        assert routing.experts.dtype == torch.int16
        assert routing.experts.shape == (len(prompt) + NEW_TOKENS - 1, model.config.num_moe_layers, k)
        probs = torch.softmax(router_logits, dim=-1)
        ref_w, ref_ids = torch.topk(probs, k, dim=-1)
        if model.config.norm_topk_prob:
            ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        assert torch.equal(routing.experts, ref_ids.to(torch.int16))
        torch.testing.assert_close(routing.weights, ref_w, atol=1e-5, rtol=1e-4)


def test_sliding_window_changes_the_result(tiny_hf_checkpoint):
    """The mixtral_sliding parity above is not vacuous: ignoring the window changes logits."""
    path = tiny_hf_checkpoint("mixtral_sliding")
    model = load_model(path)
    assert model.config.sliding_window == 8
    prompts = encode_prompts(load_tokenizer(path), TEXTS[:2])
    with_window = generate(model, prompts, 8, progress=False, return_all_logits=True).all_logits
    model.config = dataclasses.replace(model.config, sliding_window=None)
    without = generate(model, prompts, 8, progress=False, return_all_logits=True).all_logits
    assert (with_window - without).abs().max().item() > 1e-3


def test_config_and_pools(tiny_hf_checkpoint):
    q = ModelConfig.from_pretrained(tiny_hf_checkpoint("qwen3_moe"))
    assert (q.model_type, q.moe_layers, q.num_experts, q.top_k, q.qk_norm, q.norm_topk_prob) == (
        "qwen3_moe", (0, 2), 8, 2, True, True)
    assert (q.intermediate_size, q.moe_intermediate_size, q.head_dim, q.num_kv_heads) == (96, 48, 32, 2)
    q2 = ModelConfig.from_pretrained(tiny_hf_checkpoint("qwen3_moe_nonorm"))
    assert q2.moe_layers == (1, 3) and q2.norm_topk_prob is False and q2.tie_word_embeddings
    tied = load_model(tiny_hf_checkpoint("qwen3_moe_nonorm"))
    assert tied.lm_head.weight is tied.embed_tokens.weight
    m = ModelConfig.from_pretrained(tiny_hf_checkpoint("mixtral"))
    assert (m.moe_layers, m.num_experts, m.qk_norm, m.norm_topk_prob, m.rope_theta) == (
        (0, 1), 6, False, True, 1e6)

    path = tiny_hf_checkpoint("qwen3_moe")
    model = load_model(path)
    pools = model.pools
    assert pools.w13_hot.shape == (2 * 8, 2 * 48, 64) and pools.w2_hot.shape == (2 * 8, 64, 48)
    assert pools.num_cold == 0 and pools.row_map.tolist() == [list(range(8)), list(range(8, 16))]
    sd = _hf_model(path).state_dict()
    hf_w = sd["model.layers.2.mlp.experts.gate_up_proj"][5]  # transformers' fused [2I, H] of expert 5
    assert torch.equal(pools.expert_weights(1, 5)[0], hf_w)
    assert torch.equal(pools.expert_weights(1, 5)[1], sd["model.layers.2.mlp.experts.down_proj"][5])
    # Routed experts live only in the pools.
    names = [n for n, _ in model.named_parameters()]
    assert not any("experts" in n for n in names)


def test_fused_expert_layout_is_accepted(tiny_hf_checkpoint, tmp_path):
    """A checkpoint storing experts as fused 3-D gate_up_proj/down_proj tensors loads identically."""
    from safetensors.torch import load_file, save_file

    src = tiny_hf_checkpoint("mixtral")
    dst = tmp_path / "fused"
    shutil.copytree(src, dst)
    sd = load_file(str(src / "model.safetensors"))
    fused = {k: v for k, v in sd.items() if ".experts." not in k}
    for layer in range(2):
        p = f"model.layers.{layer}.block_sparse_moe.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"{p}.{e}.w1.weight"], sd[f"{p}.{e}.w3.weight"]]) for e in range(6)])
        fused[f"{p}.down_proj"] = torch.stack([sd[f"{p}.{e}.w2.weight"] for e in range(6)])
    save_file(fused, str(dst / "model.safetensors"))
    a, b = load_model(src), load_model(dst)
    assert torch.equal(a.pools.w13_hot, b.pools.w13_hot) and torch.equal(a.pools.w2_hot, b.pools.w2_hot)


def test_experts_fn_is_the_one_replaceable_function(tiny_hf_checkpoint):
    path = tiny_hf_checkpoint("qwen3_moe")
    model = load_model(path)
    prompts = encode_prompts(load_tokenizer(path), TEXTS[:2])
    ref = generate(model, prompts, 4, progress=False, return_all_logits=True)
    calls = []
    default = model.experts_fn

    def recording(pools, layer, x, topk_ids, topk_weights):
        calls.append((layer, tuple(x.shape), topk_ids.dtype, topk_weights.dtype))
        return default(pools, layer, x, topk_ids, topk_weights)

    model.experts_fn = recording
    got = generate(model, prompts, 4, progress=False, return_all_logits=True)
    assert torch.equal(got.all_logits, ref.all_logits)
    assert [c[0] for c in calls[:2]] == [0, 1]  # MoE-layer indices, not model layer indices
    assert calls[0][1] == (2 * max(len(p) for p in prompts), 64)  # prefill
    assert calls[-1][1:] == ((2, 64), torch.int64, torch.float32)  # a decode step
    assert len(calls) == 2 * 4

    model.experts_fn = lambda pools, layer, x, ids, w: torch.zeros_like(x)
    changed = generate(model, prompts, 4, progress=False, return_all_logits=True)
    assert not torch.equal(changed.all_logits, ref.all_logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_decode_tracks_float32(tiny_hf_checkpoint, dtype):
    path = tiny_hf_checkpoint("qwen3_moe")
    prompts = encode_prompts(load_tokenizer(path), TEXTS)
    ref = generate(load_model(path), prompts, 4, progress=False, return_all_logits=True)
    model = load_model(path, dtype=dtype)
    assert model.pools.w13_hot.dtype == dtype
    got = generate(model, prompts, 4, capture_routing=True, progress=False, return_all_logits=True)
    assert got.final_logits.dtype == torch.float32
    scale = ref.all_logits[:, 0].abs().max().item()
    assert (got.all_logits[:, 0] - ref.all_logits[:, 0]).abs().max().item() < 0.05 * scale
    assert all(len(t) == 4 for t in got.tokens)


def test_generate_rejects_bad_requests(tiny_hf_checkpoint):
    model = load_model(tiny_hf_checkpoint("mixtral"))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [[1, 2]], 0, progress=False)
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[1], []], 2, progress=False)
    with pytest.raises(ValueError, match="outside"):
        generate(model, [[model.config.vocab_size]], 2, progress=False)
    limit = model.config.max_position_embeddings
    assert limit is not None
    generate(model, [[1] * (limit - 2), [1]], 2, progress=False)  # exactly at the limit: fine
    with pytest.raises(ValueError, match=rf"prompt 1 has {limit - 1} tokens.*max_position_embeddings \({limit}\)"):
        generate(model, [[1], [1] * (limit - 1)], 2, progress=False)


def test_tokenizer_bos_from_tokenizer_config(tiny_hf_checkpoint, tmp_path):
    src = tiny_hf_checkpoint("mixtral")
    plain = load_tokenizer(src)
    dst = tmp_path / "bos"
    shutil.copytree(src, dst)
    (dst / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": True, "bos_token": "<|endoftext|>"}))
    tok = load_tokenizer(dst)
    bos = tok.token_to_id("<|endoftext|>")
    assert encode_prompts(tok, ["def add"]) == [[bos] + plain.encode("def add").ids]


# ---------------------------------------------------------------------------------------------
# Errors name the file or tensor
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def qwen_copy(tiny_hf_checkpoint, tmp_path):
    dst = tmp_path / "qwen"
    shutil.copytree(tiny_hf_checkpoint("qwen3_moe"), dst)
    return dst


@pytest.fixture
def mixtral_copy(tiny_hf_checkpoint, tmp_path):
    dst = tmp_path / "mixtral"
    shutil.copytree(tiny_hf_checkpoint("mixtral"), dst)
    return dst


def _rewrite_tensor(path, key, fn):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path))
    fn(sd, key)
    save_file(sd, str(path))


def test_error_missing_folder_and_files(tmp_path, mixtral_copy):
    with pytest.raises(ModelLoadError, match="nowhere"):
        load_model(tmp_path / "nowhere")
    (mixtral_copy / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_tokenizer(mixtral_copy)
    (mixtral_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(mixtral_copy)
    (mixtral_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(mixtral_copy)


def test_error_unsupported_config(mixtral_copy):
    cfg_path = mixtral_copy / "config.json"
    raw = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**raw, "model_type": "dbrx"}))
    with pytest.raises(ModelLoadError, match=r"config.json.*model_type 'dbrx'"):
        load_model(mixtral_copy)
    cfg_path.write_text(json.dumps({**raw, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(ModelLoadError, match="config.json.*yarn"):
        load_model(mixtral_copy)
    missing = dict(raw)
    del missing["num_local_experts"]
    cfg_path.write_text(json.dumps(missing))
    with pytest.raises(ModelLoadError, match="num_local_experts"):
        load_model(mixtral_copy)


def test_error_wrong_shape_and_missing_tensor(mixtral_copy):
    st = mixtral_copy / "model.safetensors"
    key = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    _rewrite_tensor(st, key, lambda sd, k: sd.__setitem__(k, sd[k][:, :-1].contiguous()))
    with pytest.raises(ModelLoadError, match=rf"model.safetensors.*{key}.*shape \(64, 47\)"):
        load_model(mixtral_copy)
    _rewrite_tensor(st, key, lambda sd, k: sd.pop(k))
    with pytest.raises(ModelLoadError, match=f"missing tensor '{key}'"):
        load_model(mixtral_copy)


def test_error_corrupt_safetensors(mixtral_copy, qwen_copy):
    st = mixtral_copy / "model.safetensors"
    st.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ModelLoadError, match="model.safetensors.*corrupt"):
        load_model(mixtral_copy)
    shard = sorted(qwen_copy.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(qwen_copy)
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"{shard.name}: weight file missing"):
        load_model(qwen_copy)


def test_fixed_shape_decode_step_matches_generate(tiny_hf_checkpoint):
    """The decode step CUDA graphs would capture (full-length mask, tensors only) gives generate's logits."""
    path = tiny_hf_checkpoint("qwen3_moe")
    model = load_model(path)
    prompts = encode_prompts(load_tokenizer(path), TEXTS[:3])
    new = 6
    ref = generate(model, prompts, new, progress=False, return_all_logits=True)
    bsz, plen = len(prompts), max(len(p) for p in prompts)
    max_seq = plen + new
    model.setup_cache(bsz, max_seq)
    pad = torch.tensor([plen - len(p) for p in prompts])
    tokens = torch.tensor([[0] * (plen - len(p)) + p for p in prompts])
    slots = torch.arange(max_seq)
    valid = slots[None, :] >= pad[:, None]
    causal = slots[:plen, None] >= slots[None, :plen]
    mask = (causal[None] & valid[:, None, :plen]) | torch.eye(plen, dtype=torch.bool)
    logits = model(tokens, (slots[:plen] - pad[:, None]).clamp(min=0), slots[:plen], mask[:, None])
    nxt = logits[:, -1].argmax(-1)
    for t in range(1, new):
        slot = plen + t - 1
        full_mask = (valid & (slots[None, :] <= slot))[:, None, None, :]  # [B, 1, 1, max_seq]
        step = model(nxt[:, None], slot - pad[:, None], slots[slot:slot + 1], full_mask)[:, -1]
        assert (step.float() - ref.all_logits[:, t]).abs().max().item() < 1e-5
        nxt = step.argmax(-1)


# issue 16: errors name their culprit (the file and field, the fixture id)
@pytest.mark.parametrize("change, msg", [
    ({"hidden_size": "abc"}, r"config.json: field 'hidden_size' must be an integer >= 1, got 'abc'"),
    ({"num_attention_heads": 0}, r"config.json: field 'num_attention_heads' must be an integer >= 1, got 0"),
    ({"num_experts_per_tok": 99}, r"config.json: field 'num_experts_per_tok' \(99\) exceeds the number of routed "
                                  r"experts \(8\)"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},  # 128x128 FP8 is read (issue 29)
     r"config.json: quantization_config.weight_block_size \[64, 64\] is not supported"),
])
def test_bad_config_json_fields_name_file_and_field(tmp_path, change, msg):
    import json as _json

    from coldset.engine.model import ModelConfig, ModelLoadError

    raw = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2,
           "num_experts": 8, "moe_intermediate_size": 32, "vocab_size": 512, "num_experts_per_tok": 2,
           "num_key_value_heads": 1, "head_dim": 32}
    (tmp_path / "config.json").write_text(_json.dumps({**raw, **change}))
    with pytest.raises(ModelLoadError, match=msg):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(_json.dumps(raw))
    assert ModelConfig.from_pretrained(tmp_path).top_k == 2


def test_over_long_prompt_is_named_by_its_id():
    from coldset.engine.generate import check_prompts_fit
    from coldset.engine.model import ModelConfig

    cfg = ModelConfig.from_hf_config({"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 2,
                                 "num_hidden_layers": 2, "num_experts": 8, "moe_intermediate_size": 32,
                                 "vocab_size": 512, "num_experts_per_tok": 2, "max_position_embeddings": 16})
    check_prompts_fit(cfg, ["a", "b"], [[1] * 8, [1] * 12], 4)
    with pytest.raises(ValueError, match=r"prompt 'code-0007' has 13 tokens: with 4 new tokens it passes"):
        check_prompts_fit(cfg, ["a", "code-0007"], [[1] * 8, [1] * 13], 4)
