"""Shared fixtures. ``tiny_hf_checkpoint(arch)`` builds (once per session) a tiny random HF
checkpoint with transformers itself; see tests/hf_fixtures.py for the variants."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from hf_fixtures import TINY_ARCHS, build_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """A function ``arch -> Path`` of a tiny HF checkpoint folder (built once per session, read-only)."""
    pytest.importorskip("transformers")
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in TINY_ARCHS:
            raise ValueError(f"unknown tiny arch {arch!r}; one of {TINY_ARCHS}")
        if arch not in built:
            built[arch] = build_tiny_checkpoint(arch, tmp_path_factory.mktemp(f"hf_{arch}"))
        return built[arch]

    return get


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny tensors: one intra-op thread is faster on 2 cores and avoids spin-wait stalls when the
    other core is busy (subprocesses, such as the workflow test's Snakemake, set their own)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
