"""A tiny synthetic engine and random prompts, for the tests that decode through the engine
(gate, slot cache): one way to build both."""

from __future__ import annotations

import torch

from coldset.model import load_model
from coldset.synthetic import SyntheticSpec, write_synthetic_checkpoint


def synthetic_engine(spec: SyntheticSpec, folder):
    """The embedded engine over ``spec``'s checkpoint written into ``folder``."""
    return load_model(write_synthetic_checkpoint(spec, folder / "ckpt"))


def random_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of 5-11 random token ids, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(5, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]
