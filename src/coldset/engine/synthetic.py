"""The default synthetic checkpoint: a small qwen3_moe HF folder whose routing behaves like a real MoE.

Why synthetic: the pipeline must run end to end on a laptop CPU without downloading weights, and
what this tool measures (skewed expert popularity that differs between traffic domains) must be
present. Random weights route almost uniformly, so the weights here are built with structure:

- An orthonormal basis of the hidden space splits into a shared *popularity* direction ``u``, one
  *domain* direction ``c_k`` per domain of the built-in corpus (agent tool-call JSON, prose, code,
  plus any ``domain_texts``), and a *noise* subspace.
- Token embeddings are ``a*u + b*sum_k p_k(t) c_k + noise_t``: ``p_k(t)`` is how much more often
  token ``t`` occurs in domain ``k``'s text than in the others (measured on the tokenised corpus),
  so tokens cluster by the kind of text they come from.
- Each MoE layer's router row ``e`` is ``s_pop*z_e*u + s_dom*A[e]·c + s_rand*g_e``: ``z_e`` are
  Zipf magnitudes over a per-layer permutation of the experts (global popularity, knob
  ``zipf_exponent``), ``A`` a per-layer random expert-by-domain affinity (knob
  ``domain_affinity``) and ``g_e`` random (token-level spread, knob ``router_noise``).
- Attention values read the domain directions and the outputs write them back, so each token's
  residual carries the domain mix of its context: decode tokens route like their prompt's domain.
- Temporal structure (knobs ``temporal_gain``, ``temporal_continuity``, ``topic_context``,
  ``temporal_dims``): real routers reuse experts from token to token because their input, the
  hidden state, varies slowly within a request. Here ``temporal_dims`` *topic* directions carry a
  latent ``z_t`` per token that is sticky along each domain's successor cycle, the order greedy
  decode walks (below): a token keeps its predecessor's ``z`` with probability
  ``temporal_continuity``, so decode runs through stretches of tokens that share a topic; the next
  stretch's topic is another of the ``topic_palette`` topics of its part of the cycle (knobs
  ``topic_palette``, ``topic_span``), so a request's decode keeps returning to a bounded set of
  topics, and of experts, as a real request does over hundreds of tokens; attention carries the context's mean ``z`` (gain
  ``topic_context``), a per-request topic that persists and drifts as tokens are generated; each
  router reads the topic directions through a random per-layer expert-by-topic matrix (gain
  ``temporal_gain``). ``temporal_gain = 0`` and ``topic_context = 0`` build the model without
  topic directions (routing by domain and popularity alone).
- The LM head prefers tokens of the context's domain plus a random token-to-token term, so greedy
  decode wanders within a domain instead of repeating one token.

One construction, :func:`build_synthetic_model`, makes the model in memory on any device (real
shapes on the GPU, ``SyntheticSpec.in_memory``). :func:`write_synthetic_checkpoint`, the default
workflow's checkpoint, is that model built on the CPU in float32 and written exactly like a real
checkpoint (per-expert HF keys, config.json with ``rope_theta``, a byte-level BPE tokenizer.json
trained deterministically on the built-in corpus), so :func:`coldset.engine.loading.load_model` and
transformers read it, and the loaded model gives the in-memory model's logits exactly.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from dataclasses import replace as dataclasses_replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from tqdm import tqdm

from coldset.core import fp8
from coldset.core.files import remove_orphans, share_mode
from coldset.engine.model import ModelConfig, MoEBlock, MoEModel
from coldset.kernels.tiers import ExpertPools

EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape and routing-skew knobs of a synthetic qwen3_moe checkpoint.

    ``vocab_size`` is the BPE trainer's target; the written config holds the trained
    tokenizer's actual size (at most this). ``zipf_exponent`` sets how unequal the experts'
    global popularity is, ``domain_affinity`` how strongly a domain pulls its own experts,
    ``router_noise`` the token-level spread; ``attention_context`` how much of the context's
    domain mix each token carries, ``qk_gain`` how peaked attention is, ``expert_gain`` the
    scale of expert outputs. Temporal structure (module docstring): ``temporal_gain`` how much
    the routers read the topic directions, ``temporal_continuity`` the probability that a
    token shares its predecessor's topic latent along the decode walk (token-to-token
    continuity), ``topic_context`` how much of the context's mean topic each token carries (the
    per-request topic), ``temporal_dims`` the number of topic directions; ``topic_palette`` the
    topics each stretch of ``topic_span`` tokens of the decode walk draws from (0: a fresh topic
    for every run, so a long decode keeps reaching new experts and drifts away from any cache;
    real requests reuse a bounded set: :func:`_palette_walk`). Defaults are calibrated
    against the shared Llama-4-Maverick trace at the default shape (BENCHMARKS.md; the
    lift against the real trace's over the same request length, 31 decode tokens, since the lift
    grows with it; ``topic_palette``, ``topic_span`` and ``router_noise`` by decode position over
    256 decode steps, lru's copies a token against config/calibration/decode-position.json,
    scripts/trace_by_position.py --synthetic); the same router knobs route far more skewed at 128 experts, top-8 (decode
    Gini 0.76 where 0.66 here), so other shapes carry their own (config/examples/qwen3-30b-a3b-h200.yaml: calibrated
    on the H200 with scripts/locality_calibrate.py --grid, which remakes only the routers,
    :func:`set_router_knobs`).
    """

    layers: int = 6
    experts: int = 32
    top_k: int = 4
    hidden: int = 256
    moe_intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 4096
    seed: int = 0
    zipf_exponent: float = 1.2
    popularity_scale: float = 11.0
    domain_affinity: float = 1.0
    router_noise: float = 1.0
    attention_context: float = 1.0
    qk_gain: float = 1.0
    expert_gain: float = 0.25
    lm_domain_gain: float = 2.0
    lm_successor_gain: float = 6.0
    temporal_gain: float = 12.0
    temporal_continuity: float = 0.75
    topic_context: float = 3.0
    temporal_dims: int = 8
    topic_palette: int = 32
    topic_span: int = 1024
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    # The model's vocabulary (embedding and LM-head rows) when it must be larger than the trained
    # tokenizer's, e.g. a real model's 151,936 rows for real-shape byte counts; None = the
    # tokenizer's size. Ids past the tokenizer never occur in prompts and are never anyone's
    # successor, so greedy decode stays inside the tokenizer's vocabulary.
    model_vocab_size: int | None = None
    # The weights live only in memory, built on the compute device from the seed
    # (build_synthetic_model), never written: for real shapes (61 GB at Qwen3-30B-A3B's) that are
    # not worth writing to disk. write_synthetic_checkpoint refuses such a spec (the same
    # construction without this flag is what it writes).
    in_memory: bool = False
    # How write_synthetic_checkpoint stores the weights: "float32" (as built), or "fp8": the
    # published block-FP8 format (coldset.core.fp8; Qwen3-30B-A3B-FP8's keys and layout: linear layers
    # float8_e4m3fn + weight_scale_inv per 128 x 128 block, quantization_config in config.json,
    # norms, router (mlp.gate) and lm_head in modules_to_not_convert and kept in float32).
    weight_format: str = "float32"


# --------------------------------------------------------------------------------------------
# Built-in corpus (deterministic): the tokenizer's training text and the token-domain statistics
# --------------------------------------------------------------------------------------------

_NOUNS = (
    "river city garden teacher window market forest engine letter mountain village doctor story "
    "morning winter harbor station painter kitchen library island bridge farmer ocean lantern "
    "machine student journey festival meadow orchard museum valley sailor castle desert voice "
    "evening summer mirror feather candle blanket storm season friend neighbor child traveler"
).split()
_VERBS = (
    "walked opened carried found watched followed remembered painted crossed reached noticed "
    "gathered built repaired wrote described explored visited answered promised discovered "
    "climbed shared lifted counted finished wandered borrowed listened learned"
).split()
_ADJS = (
    "quiet old bright small golden narrow heavy gentle distant broken warm silver patient "
    "curious tired careful sudden empty crowded ancient green simple strange"
).split()
_ADVS = "slowly quietly finally suddenly carefully together again always often rarely".split()
_PREPS = "across beside under over near behind through toward along past".split()

_TOOLS = (
    "search_flights get_weather send_email create_event lookup_order query_database "
    "translate_text book_hotel get_stock_price list_files read_file run_tests fetch_url "
    "convert_currency schedule_meeting cancel_booking"
).split()
_ARG_KEYS = (
    "city origin destination date unit query limit order_id email subject body currency amount "
    "path url timeout language start end attendees user_id status format"
).split()
_ARG_VALUES = (
    "Paris Tokyo Berlin Lima Oslo celsius fahrenheit USD EUR JPY pending shipped open json csv "
    "en de fr ja ascending descending"
).split()

_IDENTS = (
    "items values result total count index buffer config request response data node parent "
    "child queue stack cache key value path size offset limit token batch model state"
).split()
_FUNCS = (
    "parse_args load_config compute_total merge_sorted read_lines flatten apply_patch "
    "normalize tokenize build_index find_max update_cache retry fetch_page validate"
).split()


def _prose_line(rng: random.Random) -> str:
    def phrase():
        return f"the {rng.choice(_ADJS)} {rng.choice(_NOUNS)}"

    sentences = []
    for _ in range(rng.randint(2, 4)):
        s = (
            f"{phrase()} {rng.choice(_VERBS)} {phrase()} {rng.choice(_PREPS)} {phrase()}"
            + (f" {rng.choice(_ADVS)}" if rng.random() < 0.5 else "")
        )
        sentences.append(s[0].upper() + s[1:] + rng.choice([".", ".", ".", "!", "?"]))
    return " ".join(sentences)


def _agent_line(rng: random.Random) -> str:
    args = {}
    for key in rng.sample(_ARG_KEYS, rng.randint(1, 4)):
        r = rng.random()
        if r < 0.4:
            args[key] = rng.choice(_ARG_VALUES)
        elif r < 0.7:
            args[key] = rng.randint(0, 5000)
        elif r < 0.85:
            args[key] = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        else:
            args[key] = [rng.choice(_ARG_VALUES) for _ in range(rng.randint(1, 3))]
    call = {"name": rng.choice(_TOOLS), "arguments": args}
    if rng.random() < 0.5:
        call = {"role": "assistant", "tool_calls": [{"id": f"call_{rng.randint(0, 99999)}",
                                                      "type": "function", "function": call}]}
    return json.dumps(call)


def _code_line(rng: random.Random) -> str:
    f, a, b, c = rng.choice(_FUNCS), *rng.sample(_IDENTS, 3)
    body = rng.choice(
        [
            f"    for {a} in {b}:\n        {c}.append({a} * 2)\n    return {c}",
            f"    if not {a}:\n        return None\n    {b} = {a}[0]\n    return {b} + {c}",
            f"    {c} = {{}}\n    for i, {a} in enumerate({b}):\n        {c}[i] = {a}\n    return {c}",
            f"    while {a} < len({b}):\n        {a} += 1\n    return {b}[{a} - 1]",
            f"    try:\n        {c} = int({a})\n    except ValueError:\n        {c} = 0\n    return {c}",
            f"    {c} = [{a} for {a} in {b} if {a} is not None]\n    return sorted({c})",
        ]
    )
    return f"def {f}({a}, {b}):\n{body}\n"


_GENERATORS = {"agent": _agent_line, "prose": _prose_line, "code": _code_line}


def builtin_corpus(lines_per_domain: int = 400, seed: int = 1234) -> dict[str, list[str]]:
    """The built-in training text per domain (deterministic for a given seed)."""
    rng = random.Random(seed)
    return {d: [gen(rng) for _ in range(lines_per_domain)] for d, gen in _GENERATORS.items()}


def sample_prompts(domain: str, n: int, seed: int = 99) -> list[str]:
    """``n`` prompts of a built-in domain (``agent``, ``prose``, ``code``), for tests and demos."""
    rng = random.Random(f"{seed}-{domain}")
    return [_GENERATORS[domain](rng) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` (deterministic, exact round trip)."""

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS_TOKEN],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _domain_affinity(tokenizer, corpus: dict[str, list[str]], vocab: int) -> torch.Tensor:
    """``p [V, K]``: per token, its relative frequency in each domain, rows summing to 1.

    Tokens never seen in the corpus get a uniform row.
    """
    freqs = []
    for texts in corpus.values():
        counts = torch.zeros(vocab, dtype=torch.float64)
        for enc in tokenizer.encode_batch(texts):
            counts += torch.bincount(torch.tensor(enc.ids, dtype=torch.long), minlength=vocab).double()
        freqs.append(counts / counts.sum().clamp(min=1))
    f = torch.stack(freqs, dim=1)  # [V, K]
    total = f.sum(dim=1, keepdim=True)
    uniform = torch.full_like(f, 1.0 / f.shape[1])
    return torch.where(total > 0, f / total.clamp(min=1e-30), uniform).float()


# --------------------------------------------------------------------------------------------
# The model: one construction (build_synthetic_model); the checkpoint is its serialization
# --------------------------------------------------------------------------------------------


def _config(spec: SyntheticSpec, vocab: int, eos_id: int, dtype: str = "float32") -> dict:
    """The config.json of the model; ``torch_dtype`` the dtype its weights are built in."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": 2 * spec.hidden,
        "moe_intermediate_size": spec.moe_intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "num_experts": spec.experts,
        "num_experts_per_tok": spec.top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": spec.max_position_embeddings,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "use_cache": True,
        "coldset_synthetic": asdict(spec),
    }


def synthetic_tokenizer(spec: SyntheticSpec, domain_texts: dict[str, list[str]] | None = None):
    """(tokenizer, affinity ``p [V_tok, K]``, domain names): the BPE tokenizer trained on the
    built-in corpus plus ``domain_texts`` (domain -> texts; new names add domains), and how much
    more often each token occurs in each domain's text than in the others."""
    corpus = builtin_corpus()
    for domain, texts in (domain_texts or {}).items():
        corpus[domain] = corpus.get(domain, []) + [str(x) for x in texts]
    tokenizer = train_tokenizer([x for texts in corpus.values() for x in texts], spec.vocab_size)
    vocab = tokenizer.get_vocab_size()
    return tokenizer, _domain_affinity(tokenizer, corpus, vocab), list(corpus)


def _check_spec(spec: SyntheticSpec) -> None:
    if spec.heads % spec.kv_heads:
        raise ValueError(f"SyntheticSpec.heads={spec.heads} is not a multiple of kv_heads={spec.kv_heads}")
    if spec.top_k > spec.experts:
        raise ValueError(f"SyntheticSpec.top_k={spec.top_k} exceeds experts={spec.experts}")
    if not 0.0 <= spec.temporal_continuity < 1.0:
        raise ValueError(f"SyntheticSpec.temporal_continuity={spec.temporal_continuity} must be in [0, 1)")
    if spec.topic_palette < 0 or spec.topic_span < 1:
        raise ValueError(f"SyntheticSpec.topic_palette={spec.topic_palette} must be >= 0 (0 = a fresh topic for "
                         f"every run) and topic_span={spec.topic_span} >= 1")
    if spec.temporal_gain < 0 or spec.topic_context < 0 or spec.temporal_dims < 1:
        raise ValueError("SyntheticSpec.temporal_gain and topic_context must be >= 0, temporal_dims >= 1")
    if spec.weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"SyntheticSpec.weight_format={spec.weight_format!r}; known: {', '.join(WEIGHT_FORMATS)}")
    if spec.weight_format != "float32" and spec.in_memory:
        raise ValueError(f"SyntheticSpec.weight_format={spec.weight_format!r} is a checkpoint format: it needs "
                         "in_memory=False (the in-memory model is never quantized)")


def synthetic_model_config(spec: SyntheticSpec, domain_texts: dict[str, list[str]] | None = None,
                           dtype: str = "float32"):
    """The :class:`coldset.engine.model.ModelConfig` that :func:`build_synthetic_model` gives ``spec`` in
    ``dtype`` (trains the tokenizer, seconds; no weights), for stages that need only the shape."""

    _check_spec(spec)
    tokenizer, p_tok, _ = synthetic_tokenizer(spec, domain_texts)
    vocab = p_tok.shape[0] if spec.model_vocab_size is None else int(spec.model_vocab_size)
    return ModelConfig.from_hf_config(_config(spec, vocab, tokenizer.token_to_id(EOS_TOKEN), dtype), source="synthetic spec")


def _topic_dims(spec: SyntheticSpec) -> int:
    """Topic directions in the hidden space: none when the temporal knobs are off."""
    return int(spec.temporal_dims) if (spec.temporal_gain > 0 or spec.topic_context > 0) else 0


def _topic_latents(spec: SyntheticSpec, vocab: int, dims: int, cycles: list[torch.Tensor]) -> torch.Tensor:
    """``z [V, dims]`` float32 on the CPU (same numbers for every device), unit norm on average.

    Along each successor cycle (``cycles``: token ids in walk order) the latent is sticky: a
    token keeps its predecessor's ``z`` with probability ``temporal_continuity`` and draws a
    fresh one otherwise, so greedy decode, which walks the cycle, sees runs of tokens (mean
    length ``1 / (1 - temporal_continuity)``) that share a topic. Tokens off the cycles (padded
    ids) draw their own. (An AR(1) latent with the same autocorrelation gives a lower lift: the
    top-k of two similar router inputs overlaps less than that of two equal ones.)
    """
    gen = torch.Generator().manual_seed(spec.seed + 7919)
    z = torch.randn(vocab, dims, generator=gen, dtype=torch.float64) / dims**0.5
    for order in cycles:
        fresh = torch.rand(len(order), generator=gen, dtype=torch.float64) >= spec.temporal_continuity
        fresh[0] = True
        start = order[torch.nonzero(fresh).flatten()]
        z[order] = z[start[torch.cumsum(fresh.long(), 0) - 1]]
    if spec.topic_palette:
        for order in cycles:
            z[order] = _palette_walk(spec, len(order), dims, gen)
    return z.float()


def _palette_walk(spec: SyntheticSpec, n: int, dims: int, gen: torch.Generator) -> torch.Tensor:
    """``z [n, dims]`` float64 along one successor cycle of ``n`` tokens when topics come from
    palettes: the cycle is cut into spans of ``topic_span`` tokens, each with its own
    ``topic_palette`` latents; a token keeps its predecessor's latent with probability
    ``temporal_continuity`` and otherwise takes another latent of its span's palette (a new span
    starts on its palette's first). A decode that walks a span therefore revisits a few topics:
    its experts form a bounded working set, as a real request's do, instead of a new topic every
    few tokens."""
    m, span = int(spec.topic_palette), int(spec.topic_span)
    spans = -(-n // span)
    palettes = torch.randn(spans, m, dims, generator=gen, dtype=torch.float64) / dims**0.5
    stay = torch.rand(n, generator=gen, dtype=torch.float64) < spec.temporal_continuity
    step = torch.randint(1, max(m, 2), (n,), generator=gen)  # another entry than the current one
    pick = torch.zeros(n, dtype=torch.long)
    for i in range(1, n):
        if i % span == 0:
            pick[i] = 0
        elif stay[i] or m == 1:
            pick[i] = pick[i - 1]
        else:
            pick[i] = (pick[i - 1] + step[i]) % m
    return palettes[torch.arange(n) // span, pick]


def _successor_cycles(p_tok: torch.Tensor, V: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A random cyclic order of each domain's tokens (a CPU generator seeded with ``seed``): each
    token id's predecessor (itself outside a cycle) and the cycles."""
    K = p_tok.shape[1]
    cluster = p_tok.argmax(dim=1)
    predecessor = torch.arange(V)
    cpu_gen = torch.Generator().manual_seed(seed)
    cycles = []
    for k in range(K):
        members = torch.nonzero(cluster == k).flatten()
        if len(members) > 1:
            order = members[torch.randperm(len(members), generator=cpu_gen)]
            predecessor[order] = torch.roll(order, 1)
            cycles.append(order)
    return predecessor, cycles


def _set_attention(block, spec: SyntheticSpec, randn, param, dom: torch.Tensor, topic: torch.Tensor) -> None:
    """One layer's norms and attention weights (``randn`` draws from the build's generator, in
    this order: q, k, v, o): the values read the domain and topic directions, the outputs write
    them back."""
    H, D, nh, nkv = spec.hidden, spec.head_dim, spec.heads, spec.kv_heads
    K, n_t = dom.shape[1], topic.shape[1]
    f32 = dict(device=dom.device, dtype=torch.float32)
    block.input_layernorm.weight = param(torch.ones(H, **f32))
    block.post_attention_layernorm.weight = param(torch.ones(H, **f32))
    attn = block.self_attn
    attn.q_norm.weight = param(torch.full((D,), spec.qk_gain, **f32))
    attn.k_norm.weight = param(torch.full((D,), spec.qk_gain, **f32))
    attn.fuse_qk_norm()
    q = randn(nh * D, H) / H**0.5
    k = randn(nkv * D, H) / H**0.5
    # Values: the first K dims of every kv head read the domain directions; the rest random.
    # Outputs write them back, so the residual carries the context's domain mix.
    v = 0.3 * randn(nkv * D, H) / H**0.5
    o = 0.3 * randn(H, nh * D) / (nh * D) ** 0.5
    for g in range(nkv):
        v[g * D:g * D + K] = dom.T
        v[g * D + K:g * D + K + n_t] = topic.T
    for h in range(nh):
        o[:, h * D:h * D + K] = spec.attention_context * dom / (nh * spec.layers)
        o[:, h * D + K:h * D + K + n_t] = spec.topic_context * topic / (nh * spec.layers)
    attn.qkv_proj.weight = param(torch.cat([q, k, v]))
    attn.o_proj.weight = param(o)


@torch.no_grad()  # not inference_mode: the row map must keep a version counter
def build_synthetic_model(
    spec: SyntheticSpec,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    domain_texts: dict[str, list[str]] | None = None,
    progress: bool = False,
):
    """``(MoEModel, tokenizer)`` for ``spec``, every weight generated on ``device`` from ``spec.seed``.

    The one construction of the synthetic model (module docstring): the default workflow's
    checkpoint is this model built on the CPU in float32 and serialized by
    :func:`write_synthetic_checkpoint`; at real shapes (Qwen3-30B-A3B: 48 layers x 128 experts,
    61 GB in bf16) it is built straight on the GPU, since writing and reloading a checkpoint costs
    minutes and disk the GPU host does not have, while a device generator fills 61 GB in seconds.
    Weights are drawn in whole-layer batches from one generator on ``device`` (experts straight
    in ``dtype``), so they are deterministic for a (seed, device type, dtype); a CUDA build draws
    other numbers than the CPU build the checkpoint holds. The tokenizer is trained on the CPU;
    ``spec.model_vocab_size`` pads the model's vocabulary past it (see SyntheticSpec). The model is
    assembled like :func:`coldset.engine.loading.load_model` does it (fused qkv, fused qk-norm, routed
    experts only in ``model.pools`` as ``ExpertPools.all_hot``).
    """

    _check_spec(spec)
    device = torch.device(device)
    tokenizer, p_tok, _ = synthetic_tokenizer(spec, domain_texts)
    v_tok, K = p_tok.shape
    V = v_tok if spec.model_vocab_size is None else int(spec.model_vocab_size)
    if V < v_tok:
        raise ValueError(f"SyntheticSpec.model_vocab_size={V} is smaller than the tokenizer's {v_tok} tokens")
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    cfg = ModelConfig.from_hf_config(_config(spec, V, eos_id, str(dtype).removeprefix("torch.")),
                                     source="synthetic spec")
    H, E, I, D = spec.hidden, spec.experts, spec.moe_intermediate, spec.head_dim
    n_t = _topic_dims(spec)
    if H < K + n_t + 8:
        raise ValueError(f"SyntheticSpec.hidden={H} is too small for {K} domains and {n_t} topic directions")
    if D < K + n_t:
        raise ValueError(f"SyntheticSpec.head_dim={D} is too small for {K} domains and {n_t} topic directions")
    f32 = dict(device=device, dtype=torch.float32)
    gen = torch.Generator(device=device).manual_seed(spec.seed)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    basis, _ = torch.linalg.qr(randn(H, H))
    u, dom = basis[:, 0], basis[:, 1:1 + K]
    topic, noise_basis = basis[:, 1 + K:1 + K + n_t], basis[:, 1 + K + n_t:]
    n_noise = noise_basis.shape[1]

    def noise_vectors(n):  # unit-norm-ish random vectors in the noise subspace
        return randn(n, n_noise) @ noise_basis.T / n_noise**0.5

    # Padded ids (past the tokenizer) belong to no domain. Sharpen the affinity so a token's
    # cluster is clear; centred so a uniform token has none.
    p = torch.full((V, K), 1.0 / K, **f32)
    p[:v_tok] = p_tok.to(device)
    p_sharp = p**2 / (p**2).sum(dim=1, keepdim=True)
    p_centred = p_sharp - 1.0 / K
    model = MoEModel(cfg)

    def param(t):
        return nn.Parameter(t.to(dtype).contiguous(), requires_grad=False)

    token_noise = noise_vectors(V)
    predecessor, cycles = _successor_cycles(p_tok, V, spec.seed)
    embed = u[None, :] + 1.5 * p_centred @ dom.T + token_noise
    if n_t:
        embed += _topic_latents(spec, V, n_t, cycles).to(device) @ topic.T
    # Scaled to RMS about 1 (norm about sqrt(H)), the scale every layer's output is on.
    model.embed_tokens.weight = param(embed * H**0.5 / 1.6)
    del embed
    model.norm.weight = param(torch.ones(H, **f32))
    # LM head: prefer tokens of the hidden state's domain, and within it the current token's
    # successor under a random cyclic order of each domain's tokens (row t' reads the noise of
    # its predecessor), so greedy decode walks through a domain's tokens instead of looping.
    # Cycles over tokenizer ids only (drawn above); padded ids get their own random rows, which
    # no token's state points at.
    succ_noise = token_noise[predecessor.to(device)]
    if V > v_tok:
        succ_noise[v_tok:] = noise_vectors(V - v_tok)
    model.lm_head.weight = param(spec.lm_domain_gain * p_centred @ dom.T + spec.lm_successor_gain * succ_noise)
    del token_noise, succ_noise

    L = cfg.num_moe_layers
    router_parts = []
    w13 = torch.empty((L, E, 2 * I, H), device=device, dtype=dtype)
    w2 = torch.empty((L, E, H, I), device=device, dtype=dtype)
    layers = range(spec.layers)
    if progress:
        layers = tqdm(layers, desc="synthetic layers", file=sys.stderr, leave=False)
    for layer in layers:
        block = model.layers[layer]
        _set_attention(block, spec, randn, param, dom, topic)
        # Router (router_weight): popularity along u, domain affinity along dom, token-level
        # spread in the noise subspace, topic affinity. Drawn whatever the router knobs are, so
        # set_router_knobs can remake it from these parts alone.
        parts = RouterParts(
            popularity_rank=torch.randperm(E, generator=gen, device=device),
            popular=u,
            domain=randn(E, K) @ dom.T,
            spread=randn(E, n_noise) @ noise_basis.T,
            topic=randn(E, n_t) @ topic.T if n_t else None,
        )
        router_parts.append(parts)
        block.mlp.gate.weight = param(router_weight(parts, spec))
        # Experts straight in the model dtype: w13 rows [:I] gate, [I:] up (as the loader stacks them).
        m = cfg.moe_layers.index(layer)
        w13[m].normal_(0.0, 1.0 / H**0.5, generator=gen)
        w2[m].normal_(0.0, spec.expert_gain / I**0.5, generator=gen)
    model.inv_freq = model.inv_freq.to(device)
    model.pools = ExpertPools.all_hot(w13, w2)
    model.synthetic_spec = spec
    model.synthetic_router_parts = router_parts
    model.eval()
    return model, tokenizer


# The knobs that enter only the routers (router_weight): set_router_knobs changes them on a built
# model without drawing anything again.
ROUTER_KNOBS = ("zipf_exponent", "popularity_scale", "domain_affinity", "router_noise", "temporal_gain")


@dataclass(frozen=True)
class RouterParts:
    """The random draws behind one MoE layer's router, independent of the router knobs.

    ``popularity_rank [E]``: each expert's popularity rank in this layer (0 = the most popular);
    ``popular [H]``: the popularity direction u; ``domain``, ``spread``, ``topic`` ``[E, H]``: each
    expert's random affinity to the domain directions, to the noise subspace (the token-specific
    part of the state) and to the topic directions (None without topic directions).
    """

    popularity_rank: torch.Tensor
    popular: torch.Tensor
    domain: torch.Tensor
    spread: torch.Tensor
    topic: torch.Tensor | None


def popularity_offsets(experts: int, zipf_exponent: float) -> torch.Tensor:
    """Per popularity rank (0 = the most popular), the expert's popularity along u, float32
    ``[experts]``: ``r^-zipf_exponent`` for ranks ``r = 1..experts``, standardized over the experts."""
    zipf = torch.arange(1, experts + 1, dtype=torch.float32) ** (-float(zipf_exponent))
    return (zipf - zipf.mean()) / zipf.std()


def router_weight(parts: RouterParts, spec: SyntheticSpec) -> torch.Tensor:
    """One MoE layer's router ``[E, H]`` (float32) from its random parts and the router knobs.

    ``popularity_scale * popularity_offsets(...)[rank] * u + domain_affinity * domain +
    router_noise * spread + temporal_gain * topic``, divided by ``sqrt(H)``: the router sees an
    RMS-normalised state (norm ``sqrt(H)``), so the knobs are in units of the unit-norm state's
    components. The spread reads only the noise subspace (the token-specific part of the state),
    so it varies the choice per token without adding a fixed per-expert offset.
    """
    E, H = parts.spread.shape
    offsets = popularity_offsets(E, spec.zipf_exponent).to(parts.spread.device)
    router = (spec.popularity_scale * offsets[parts.popularity_rank][:, None] * parts.popular[None, :]
              + spec.domain_affinity * parts.domain + spec.router_noise * parts.spread)
    if parts.topic is not None:
        router = router + spec.temporal_gain * parts.topic
    return router / H**0.5


@torch.no_grad()
def set_router_knobs(model, spec: SyntheticSpec) -> None:
    """Remake the routers of a model built by :func:`build_synthetic_model` for ``spec``'s router
    knobs (ROUTER_KNOBS), in place, from the parts its build drew: the model is then the one
    ``build_synthetic_model(spec)`` gives, without generating 61 GB again (the calibration sweeps
    of scripts/locality_calibrate.py). Every other field of ``spec`` must equal the build's.
    """
    built = getattr(model, "synthetic_spec", None)
    parts = getattr(model, "synthetic_router_parts", None)
    if built is None or parts is None:
        raise ValueError("set_router_knobs needs a model made by build_synthetic_model (it has no router parts)")
    _check_spec(spec)
    same = dataclasses_replace(spec, **{k: getattr(built, k) for k in ROUTER_KNOBS})
    if same != built:
        differ = sorted(k for k, v in asdict(same).items() if v != getattr(built, k))
        raise ValueError(f"set_router_knobs changes only {ROUTER_KNOBS}; {differ} differ from the built model's")
    if _topic_dims(spec) != _topic_dims(built):
        raise ValueError("set_router_knobs cannot add or remove the topic directions (temporal_gain and "
                         "topic_context both 0 build none): build the model again")

    for block, p in zip((b for b in model.layers if isinstance(b.mlp, MoEBlock)), parts, strict=True):
        block.mlp.gate.weight.copy_(router_weight(p, spec).to(block.mlp.gate.weight.dtype))
    model.synthetic_spec = spec


WEIGHT_FORMATS = ("float32", "fp8")
# The HF modules that are linear layers (the only ones a block-FP8 checkpoint may convert).
_LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "mlp.gate", "lm_head")


def fp8_modules_to_not_convert(num_layers: int) -> list[str]:
    """What a Qwen3 MoE FP8 checkpoint lists in ``modules_to_not_convert``: the LM head,
    embeddings and final norm, and per layer its norms and its router (``mlp.gate``)."""
    names = ["lm_head", "model.embed_tokens", "model.norm"]
    for i in range(num_layers):
        pre = f"model.layers.{i}"
        names += [f"{pre}.input_layernorm", f"{pre}.post_attention_layernorm", f"{pre}.self_attn.q_norm",
                  f"{pre}.self_attn.k_norm", f"{pre}.mlp.gate"]
    return names


def fp8_tensors(tensors: dict[str, torch.Tensor], fmt) -> dict[str, torch.Tensor]:
    """``tensors`` (HF keys) with every linear layer that ``fmt`` (a :class:`coldset.core.fp8.Fp8Format`)
    converts stored as ``*.weight`` float8_e4m3fn + ``*.weight_scale_inv`` float32 (coldset.core.fp8)."""

    out = {}
    for key, t in tensors.items():
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and module.endswith(_LINEAR_SUFFIXES) and fmt.converts(module):
            out[key], out[f"{module}.weight_scale_inv"] = fp8.quantize_weight(t)
        else:
            out[key] = t
    return out


def _hf_tensors(model) -> dict[str, torch.Tensor]:
    """The synthetic model's weights under Hugging Face qwen3_moe keys (per-expert, q/k/v split),
    as views of the model's own tensors: serializing them needs no second copy of the model."""
    cfg = model.config
    I = cfg.moe_intermediate_size
    t = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight,
         "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(model.layers):
        pre = f"model.layers.{i}"
        attn = block.self_attn
        q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
        t.update({
            f"{pre}.input_layernorm.weight": block.input_layernorm.weight,
            f"{pre}.post_attention_layernorm.weight": block.post_attention_layernorm.weight,
            f"{pre}.self_attn.q_proj.weight": q,
            f"{pre}.self_attn.k_proj.weight": k,
            f"{pre}.self_attn.v_proj.weight": v,
            f"{pre}.self_attn.o_proj.weight": attn.o_proj.weight,
            f"{pre}.self_attn.q_norm.weight": attn.q_norm.weight,
            f"{pre}.self_attn.k_norm.weight": attn.k_norm.weight,
            f"{pre}.mlp.gate.weight": block.mlp.gate.weight,
        })
        for e in range(cfg.num_experts):
            w13, w2 = model.pools.expert_weights(block.mlp.moe_index, e)
            base = f"{pre}.mlp.experts.{e}"
            t[f"{base}.gate_proj.weight"] = w13[:I]
            t[f"{base}.up_proj.weight"] = w13[I:]
            t[f"{base}.down_proj.weight"] = w2
    return {key: value.detach() for key, value in t.items()}


def write_synthetic_checkpoint(
    spec: SyntheticSpec,
    out_dir: str | os.PathLike,
    domain_texts: dict[str, list[str]] | None = None,
) -> Path:
    """Write :func:`build_synthetic_model`'s CPU float32 model for ``spec`` as a qwen3_moe HF
    folder at ``out_dir``, atomically; return its path.

    The folder holds config.json, model.safetensors (per-expert keys, float32), tokenizer.json
    (byte-level BPE trained on the built-in corpus plus ``domain_texts``), tokenizer_config.json
    and generation_config.json; :func:`coldset.engine.loading.load_model` on it gives exactly the logits
    of ``build_synthetic_model(spec, "cpu", torch.float32, domain_texts)`` (with
    ``spec.weight_format == "fp8"``: that model's weights quantized to block FP8, the published
    layout, so the logits are those of the quantized model). ``domain_texts``
    (domain -> texts) add training text and, for new domain names, new domain clusters.
    ``spec.model_vocab_size`` is written as the config's vocab_size (larger than the tokenizer's,
    as real checkpoints do). A spec with ``in_memory=True`` is refused: it says the weights are
    made on the device and never written (61 GB at real shapes). Everything is written to a
    temporary sibling folder that replaces ``out_dir`` only when complete; a failure leaves
    ``out_dir`` as it was.
    """

    if spec.in_memory:
        raise ValueError(
            "SyntheticSpec.in_memory=True: the weights are made on the device by build_synthetic_model "
            "and never written; write_synthetic_checkpoint needs in_memory=False"
        )
    model, tokenizer = build_synthetic_model(spec, "cpu", torch.float32, domain_texts)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    config = _config(spec, model.config.vocab_size, eos_id)
    tensors = _hf_tensors(model)
    if spec.weight_format == "fp8":

        config["quantization_config"] = fp8.quantization_config(fp8_modules_to_not_convert(spec.layers))
        tensors = fp8_tensors(tensors, fp8.parse_quantization_config(config["quantization_config"]))
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(out)  # a killed previous write's .{name}.tmp-* / .{name}.old-* folders
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del model, tensors
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save(str(tmp / "tokenizer.json"))
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": False,
            "bos_token": None,
            "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
            "model_max_length": spec.max_position_embeddings,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(
            json.dumps({"do_sample": False, "eos_token_id": eos_id}, indent=2) + "\n"
        )
        for path in (tmp, *tmp.iterdir()):
            share_mode(path)  # mkdtemp makes 0700 and safetensors 0600: the umask decides instead
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / out.name)
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
