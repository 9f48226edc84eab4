"""Shared fixtures. ``tiny_hf_checkpoint(arch)`` builds (once per session) a tiny random HF
checkpoint with transformers itself; see tests/hf_fixtures.py for the variants."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from hf_fixtures import TINY_ARCHS, build_tiny_checkpoint  # noqa: E402


def _gpu_skip_reason() -> str | None:
    """Why tests marked ``gpu`` cannot run here (None if they can): CUDA and triton both needed."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA device (marked gpu)"
    if importlib.util.find_spec("triton") is None:
        return "needs triton (marked gpu)"
    return None


def pytest_collection_modifyitems(config, items):
    """The one place CUDA-only tests are skipped: every test marked ``gpu`` and only those, so
    ``pytest -m gpu`` runs every CUDA-only test and a CPU run's skips for CUDA are exactly them."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    reason = _gpu_skip_reason() if gpu_items else None
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))


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
