"""The experts kernels' shipped launch configs, as JSON data beside the kernels (as vLLM keeps
``fused_moe/configs/``): one file per kernel module, ``triton_moe.json`` (bf16/fp16) and
``triton_fp8.json`` (block FP8), each with

- ``defaults``: the config a call runs when it is given none and no tuned entry exists
  (``decode`` up to 64 tokens, ``prefill`` above), tiles the autotuner chose on the H200 at
  Qwen3-30B-A3B's shape with dependent launch off (``pdl`` 0), so that a default runs on any CUDA
  GPU the kernel runs on;
- ``search_space``: the autotuner's candidates per regime (:mod:`coldset.kernels.tune`).

Each entry is a dict of :class:`coldset.kernels.triton_moe.KernelConfig` fields (the others at
their defaults). The timings behind them are BENCHMARKS.md's kernel tables (sections 1 and 2).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(kernel: str) -> dict:
    """The configs of kernel module ``kernel`` (``"triton_moe"`` or ``"triton_fp8"``):
    ``{"defaults": {"decode", "prefill"}, "search_space": {"decode", "prefill"}}``."""
    return json.loads((HERE / f"{kernel}.json").read_text())
