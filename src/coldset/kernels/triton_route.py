"""The router's softmax and top-k in one Triton launch (CUDA).

Why: at decode batch sizes ``torch.topk`` costs two library kernels a layer (a radix select and
a sort of the k winners), mostly launch latency for 128 numbers, and the softmax is a third.
One program per token holds the token's E router logits in registers and does all of it: the k
largest logits by k rounds of max (ties to the lowest expert id), softmax probabilities of the
winners in float32, optional renormalisation over the k.

Ranking on the logits rather than on the probabilities orders the experts exactly as the
probabilities would (softmax is monotone) without the rounding of exp deciding near-ties.
Same contract as :func:`coldset.kernels.reference.torch_softmax_topk`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_topk_kernel(logits_ptr, ids_ptr, weights_ptr, stride_t,
                         E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                         RENORMALIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, EP)
    ok = offs < E
    x = tl.load(logits_ptr + t * stride_t + offs, mask=ok, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    denom = tl.sum(tl.where(ok, tl.exp(x - top), 0.0), axis=0)
    ranks = tl.arange(0, KP)
    ids = tl.zeros((KP,), dtype=tl.int64)
    probs = tl.zeros((KP,), dtype=tl.float32)
    left = tl.where(ok, x, float("-inf"))
    for r in tl.static_range(K):
        best = tl.max(left, axis=0)
        idx = tl.min(tl.where(left == best, offs, EP), axis=0)
        ids = tl.where(ranks == r, idx.to(tl.int64), ids)
        probs = tl.where(ranks == r, tl.exp(best - top) / denom, probs)
        left = tl.where(offs == idx, float("-inf"), left)
    if RENORMALIZE:
        probs = probs / tl.sum(probs, axis=0)
    keep = ranks < K
    tl.store(ids_ptr + t * K + ranks, ids, mask=keep)
    tl.store(weights_ptr + t * K + ranks, probs, mask=keep)


def triton_softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids [T, k] int64, topk_weights [T, k] float32)`` of router ``logits`` ``[T, E]``."""
    num_tokens, num_experts = logits.shape
    if not 0 < k <= num_experts:
        raise ValueError(f"triton_softmax_topk: k={k} must be in [1, {num_experts}]")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty((num_tokens, k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((num_tokens, k), dtype=torch.float32, device=logits.device)
    if num_tokens:
        _softmax_topk_kernel[(num_tokens,)](
            logits, ids, weights, logits.stride(0),
            E=num_experts, EP=triton.next_power_of_2(num_experts), K=k, KP=triton.next_power_of_2(k),
            RENORMALIZE=renormalize, num_warps=1 if num_experts <= 256 else 4)
    return ids, weights
