"""The embedded engine's greedy decode loop: prompts in, tokens, logits and routing out.

:func:`generate` left-pads a batch of prompts (the decode-state layout of
:mod:`coldset.engine.model`), prefills them, then decodes one token per sequence per step with a
static KV cache, optionally recording every token's routed experts (:class:`RequestRouting`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from coldset.analysis.forecast import ForecastError
from coldset.engine.model import ModelConfig, MoEModel


def encode_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text (special tokens as :func:`load_tokenizer` configured them)."""
    return [enc.ids for enc in tokenizer.encode_batch(list(texts))]


@dataclass
class RequestRouting:
    """Routed experts of one request: rows ``[:num_prompt_tokens]`` prefill, the rest decode."""

    experts: torch.Tensor  # int16 [n_tokens, num_moe_layers, top_k]
    weights: torch.Tensor  # float32 [n_tokens, num_moe_layers, top_k]
    num_prompt_tokens: int


@dataclass
class Generation:
    """Result of :func:`generate` (docs/architecture.md, engine -> routing)."""

    tokens: list[list[int]]
    final_logits: torch.Tensor  # float32 [B, V]: the logits that chose each last new token
    routing: list[RequestRouting] | None = None
    all_logits: torch.Tensor | None = field(default=None, repr=False)  # [B, new, V] if asked


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    return tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, leave=False)


@torch.inference_mode()
def check_prompts_fit(cfg: ModelConfig, ids: Sequence[str], prompts: Sequence[Sequence[int]],
                      max_new_tokens: int) -> None:
    """Refuse, naming the fixture id, a prompt that with ``max_new_tokens`` new tokens would pass
    the model's ``max_position_embeddings`` (checked by the stages before any decode, where the
    ids are known; :func:`generate` knows only positions in its batch)."""
    limit = cfg.max_position_embeddings
    if limit is None:
        return
    for fid, p in zip(ids, prompts):
        if len(p) + max_new_tokens > limit:
            raise ValueError(f"prompt {fid!r} has {len(p)} tokens: with {max_new_tokens} new tokens it passes the "
                             f"model's max_position_embeddings ({limit}); shorten it or lower max_new_tokens")


def generate(
    model: MoEModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    capture_routing: bool = False,
    progress: bool = True,
    return_all_logits: bool = False,
) -> Generation:
    """Greedy-decode exactly ``max_new_tokens`` tokens for each prompt, batched.

    Prompts are left-padded to a common length (see the module docstring); padded positions are
    masked out of attention and excluded from the captured routing. No EOS stopping: every
    prompt gets ``max_new_tokens`` tokens, which keeps the trace shapes simple. Ties go to the
    lowest token id (``torch.argmax``). ``return_all_logits`` also returns ``all_logits``
    float32 ``[B, max_new_tokens, V]``, the logits behind every new token (for tests).

    Each decode step attends over the first ``slot + 1`` cache slots (the mask's last dimension),
    which is cheapest eagerly; a CUDA-graph capture would instead call ``model.forward`` with a
    fixed ``[B, 1, 1, max_seq]`` mask (slots beyond the current one masked out), same result.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt and no empty prompt")
    cfg = model.config
    vocab = cfg.vocab_size
    for i, p in enumerate(prompts):
        if min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"prompt {i} has a token id outside [0, {vocab})")
    device = model.device
    bsz = len(prompts)
    lengths = [len(p) for p in prompts]
    plen = max(lengths)
    max_seq = plen + max_new_tokens
    limit = cfg.max_position_embeddings
    if limit is not None and max(lengths) + max_new_tokens > limit:
        worst = lengths.index(plen)
        raise ValueError(f"prompt {worst} has {plen} tokens: with {max_new_tokens} new tokens it passes the "
                         f"model's max_position_embeddings ({limit}); shorten it or lower max_new_tokens")
    model.setup_cache(bsz, max_seq)

    pad = torch.tensor([plen - n for n in lengths], device=device)  # [B]
    tokens = torch.zeros((bsz, plen), dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, plen - len(p):] = torch.tensor(p, dtype=torch.long)
    tokens = tokens.to(device)
    all_slots = torch.arange(max_seq, device=device)
    key_valid = all_slots[None, :] >= pad[:, None]  # [B, max_seq]
    if cfg.sliding_window is not None:
        window_ok = all_slots[None, :] > all_slots[:, None] - cfg.sliding_window  # [q, k]
    else:
        window_ok = None

    # Prefill: every padded query may at least see itself (keeps softmax finite; its output is unused).
    slots = all_slots[:plen]
    causal = all_slots[:plen, None] >= all_slots[None, :plen]
    if window_ok is not None:
        causal = causal & window_ok[:plen, :plen]
    mask = (causal[None] & key_valid[:, None, :plen]) | torch.eye(plen, dtype=torch.bool, device=device)
    positions = (slots[None, :] - pad[:, None]).clamp(min=0)
    sink: list | None = [] if capture_routing else None
    model.routing_sink = sink
    bar = _progress(bsz * max_new_tokens, progress, "decode")
    step_logits: list[torch.Tensor] = []
    out_tokens = torch.empty((bsz, max_new_tokens), dtype=torch.long, device=device)
    try:
        logits = model(tokens, positions, slots, mask[:, None], last_only=True)[:, -1]
        prefill_routing = sink[:] if sink is not None else None
        if sink is not None:
            sink.clear()
        nxt = torch.argmax(logits, dim=-1)
        out_tokens[:, 0] = nxt
        if return_all_logits:
            step_logits.append(logits.float())
        if bar is not None:
            bar.update(bsz)
        for t in range(1, max_new_tokens):
            slot = plen + t - 1
            step_slots = all_slots[slot:slot + 1]
            step_mask = key_valid[:, None, None, :slot + 1]
            if window_ok is not None:
                step_mask = step_mask & window_ok[slot, :slot + 1]
            step_pos = step_slots[None, :] - pad[:, None]
            logits = model(nxt[:, None], step_pos, step_slots, step_mask)[:, -1]
            nxt = torch.argmax(logits, dim=-1)
            out_tokens[:, t] = nxt
            if return_all_logits:
                step_logits.append(logits.float())
            if bar is not None:
                bar.update(bsz)
    finally:
        model.routing_sink = None
        if bar is not None:
            bar.close()

    routing = None
    if capture_routing:
        routing = _assemble_routing(cfg, prefill_routing, sink, bsz, plen, lengths)
    return Generation(
        tokens=out_tokens.cpu().tolist(),
        final_logits=logits.float(),
        routing=routing,
        all_logits=torch.stack(step_logits, dim=1) if return_all_logits else None,
    )


# the profile tokens router_inputs keeps at most: 2x the real shape's hidden size, 0.8 GB of bf16
# router inputs at 48 x 2048
LOOKAHEAD_FIT_TOKENS = 4096


def router_inputs(engine, prompts: list[list[int]], max_tokens: int = LOOKAHEAD_FIT_TOKENS):
    """``[N, L, H]`` (the engine's dtype and device): every MoE layer's router input for each of the
    ``N`` tokens of ``prompts``, one prefill a prompt through the engine's current experts path
    (:func:`generate`, one new token, so only the prefill runs), in prompt order, the
    first ``max_tokens`` tokens (the last prompt cut): the profile data of
    :func:`coldset.analysis.forecast.fit_lookahead_routers`, bounded whatever the size of a user's fixture set."""
    L = engine.config.num_moe_layers
    saved = engine.experts_fn
    rec: list = []
    out = []
    length = 0

    def recording(p, layer, x, ids, w):
        if x.shape[0] == length:
            rec.append(x.detach().clone())
        return saved(p, layer, x, ids, w)

    engine.experts_fn = recording
    total = 0
    try:
        for p in prompts:
            p = list(p)[:max(0, int(max_tokens) - total)]
            if not p:
                break
            rec.clear()
            length = len(p)
            total += length
            generate(engine, [p], 1, progress=False)
            if len(rec) != L:
                raise ForecastError(f"router_inputs: {len(rec)} router inputs recorded for a prompt of {length} "
                                    f"tokens, {L} MoE layers expected")
            out.append(torch.stack(rec, dim=1))
    finally:
        engine.experts_fn = saved
    if not out:
        raise ForecastError("router_inputs: no prompts")
    return torch.cat(out)


def _assemble_routing(cfg, prefill, decode, bsz, plen, lengths) -> list[RequestRouting]:
    """Per-request routing tensors from the MoE blocks' appends (layer-major within each call)."""
    n_moe, k = cfg.num_moe_layers, cfg.top_k

    def stack(entries, seq):  # entries: n_calls * n_moe tuples of [bsz*seq, k]
        ids = torch.stack([e[0] for e in entries]).view(-1, n_moe, bsz, seq, k)
        wts = torch.stack([e[1] for e in entries]).view(-1, n_moe, bsz, seq, k)
        # -> [bsz, calls*seq, n_moe, k]
        ids = ids.permute(2, 0, 3, 1, 4).reshape(bsz, -1, n_moe, k)
        wts = wts.permute(2, 0, 3, 1, 4).reshape(bsz, -1, n_moe, k)
        return ids.to(torch.int16).cpu(), wts.float().cpu()

    pre_ids, pre_w = stack(prefill, plen)
    if decode:
        dec_ids, dec_w = stack(decode, 1)
    else:
        dec_ids = torch.empty((bsz, 0, n_moe, k), dtype=torch.int16)
        dec_w = torch.empty((bsz, 0, n_moe, k), dtype=torch.float32)
    out = []
    for b, n in enumerate(lengths):
        out.append(
            RequestRouting(
                experts=torch.cat([pre_ids[b, plen - n:], dec_ids[b]]).contiguous(),
                weights=torch.cat([pre_w[b, plen - n:], dec_w[b]]).contiguous(),
                num_prompt_tokens=n,
            )
        )
    return out
