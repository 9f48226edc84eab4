"""A tiny synthetic engine, random prompts and the bench's graphed decode loop, for the tests that
decode through the engine (gate, slot cache, compiled and fused decode): one way to build each."""

from __future__ import annotations

import torch

from coldset.engine.loading import load_model
from coldset.engine.synthetic import SyntheticSpec, write_synthetic_checkpoint


def synthetic_engine(spec: SyntheticSpec, folder):
    """The embedded engine over ``spec``'s checkpoint written into ``folder``."""
    return load_model(write_synthetic_checkpoint(spec, folder / "ckpt"))


def random_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of 5-11 random token ids, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(5, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def graphed_greedy_tokens(model, prompts: torch.Tensor, new_tokens: int, use_graph: bool = True) -> list[list[int]]:
    """Greedy tokens ``[B, new_tokens]`` of the bench's decode loop (:class:`coldset.bench.decode.Decoder`:
    prefill, then the step captured in one CUDA graph and replayed), to compare with ``generate()``."""
    from coldset.bench import decode as bench

    dec = bench.Decoder(model, prompts.shape[0], prompts.shape[1], new_tokens, use_graph=use_graph)
    token = dec.prefill(prompts)
    got = [token]
    dec.set_step(token, 1)
    if use_graph:
        dec.capture()
    for t in range(1, new_tokens):
        dec.set_step(token, t)
        token = torch.argmax(dec.step(), dim=-1)
        got.append(token)
    return torch.stack(got, 1).tolist()
