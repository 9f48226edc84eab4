"""bench step / bench cache --model-family refuse, before anything is drawn, a model that cannot fit
(coldset.measure.model_memory.model_fit_refusal, raised by coldset.measure.harness.random_family_model):
the byte estimate against the tensors of random models built on the CPU at odd tiny widths of each family,
the refusal's numbers and the --moe-layers that fits against the arithmetic done here over the estimate's
bytes at each MoE-layer count, and no build when refused."""

from __future__ import annotations

import dataclasses
import gc
import math

import pytest
import torch

from coldset.engine import random_weights
from coldset.engine.random_weights import build_random_model, family_config, tiny_config
from coldset.measure import harness
from coldset.measure.model_memory import (HBM_MARGIN_BYTES, HBM_MARGIN_FRACTION, model_fit_refusal,
                                          random_model_bytes)
from coldset.measure.harness import RANDOM_FAMILIES, MeasureError, RandomFamily

#: Odd widths: FP8's 128 x 128 scale blocks partial on both sides, MXFP4's groups of 32 whole.
ODD = {"hidden_size": 160, "moe_intermediate_size": 96, "intermediate_size": 224, "vocab_size": 301}


def odd_tiny(family: str) -> dict:
    raw = tiny_config(RANDOM_FAMILIES[family].raw(), vocab_size=ODD["vocab_size"])
    return raw | {k: v for k, v in ODD.items() if k in raw}


def device_bytes(model) -> int:
    """Bytes of every tensor the built model holds: parameters and buffers (a tied one once) and the
    expert pools' tensors."""
    tensors = [*model.parameters(), *model.buffers(),
               *(v for v in (getattr(model.pools, f.name) for f in dataclasses.fields(model.pools))
                 if isinstance(v, torch.Tensor))]
    unique = {t.data_ptr(): t for t in tensors if t.numel()}
    return sum(t.numel() * t.element_size() for t in unique.values())


@pytest.mark.parametrize("family, moe_layers, extra", [
    *((name, None, {}) for name in RANDOM_FAMILIES),
    ("deepseek-v3", 2, {"num_hidden_layers": 5, "first_k_dense_replace": 2}),  # 2 dense + the first 2 of 3 MoE
    ("qwen3-30b-a3b", 1, {}),
])
def test_the_estimate_is_the_built_models_bytes(family, moe_layers, extra):
    fam = RANDOM_FAMILIES[family]
    raw = odd_tiny(family) | extra
    model = build_random_model(raw, "cpu", fam.expert_format, moe_layers, source=family)
    cfg = model.config
    estimate = random_model_bytes(raw, fam.expert_format, moe_layers, family)
    actual = device_bytes(model)
    # Slack, left out of the estimate on purpose: the pools' row map (int32, one an expert) and the RoPE
    # frequencies (float32, at most head_dim / 2): tens of kB at the published shapes, and here smaller than
    # any part the estimate counts (a missing part, or one in the wrong dtype, is at least a norm's bytes).
    slack = 4 * cfg.num_moe_layers * cfg.num_experts + 2 * cfg.head_dim
    assert 0 <= actual - estimate.total <= slack, (actual, estimate)
    experts = sum(t.numel() * t.element_size() for t in (model.pools.w13_hot, model.pools.w2_hot,
                                                         model.pools.w13_scale_hot, model.pools.w2_scale_hot)
                  if t is not None)
    assert estimate.experts == experts
    assert model.pools.num_moe_layers == (moe_layers or family_config(raw).num_moe_layers)


def need(raw: dict, fmt: str, layers: int) -> float:
    """The check's arithmetic done apart: the estimate's bytes at ``layers`` MoE layers plus the margin."""
    b = random_model_bytes(raw, fmt, layers)
    return b.total + HBM_MARGIN_BYTES + HBM_MARGIN_FRACTION * b.total


@pytest.mark.parametrize("family, fit", [("deepseek-v3", 7), ("glm-4.5-air", 20), ("gpt-oss-120b", 11),
                                         ("qwen3-30b-a3b", 1)])
def test_refusal_names_the_numbers_and_the_largest_moe_layers_that_fit(family, fit):
    fam = RANDOM_FAMILIES[family]
    raw = fam.raw()
    published = family_config(raw).num_moe_layers
    needs = {n: need(raw, fam.expert_format, n) for n in range(1, published + 1)}
    assert all(needs[n] < needs[n + 1] for n in range(1, published))  # each MoE layer more costs bytes
    assert model_fit_refusal(family, raw, fam.expert_format, None, math.ceil(needs[published])) is None  # to the byte
    free = math.ceil(needs[fit])  # the largest that fits: fit, not fit + 1
    msg = model_fit_refusal(family, raw, fam.expert_format, None, free)
    b = random_model_bytes(raw, fam.expert_format, published)
    assert "\n" not in msg and msg.startswith(f"--model-family {family} --moe-layers {published} (of {published})")
    for gb in (needs[published], b.experts, b.rest, free):
        assert f"{gb / 1e9:.1f} GB" in msg
    assert f"{fam.expert_format} experts" in msg and msg.endswith(f"What fits: --moe-layers {fit}.")
    assert model_fit_refusal(family, raw, fam.expert_format, 1, math.ceil(needs[1]) - 1).endswith(
        "What fits: no --moe-layers count (not even 1).")


def test_a_subset_asked_is_checked_and_suggests_fewer_layers():
    fam = RANDOM_FAMILIES["deepseek-v3"]
    raw = fam.raw()
    free = math.ceil(need(raw, "fp8", 3))
    assert model_fit_refusal("deepseek-v3", raw, "fp8", 3, free) is None
    msg = model_fit_refusal("deepseek-v3", raw, "fp8", 4, free)
    assert "--moe-layers 4 (of 58)" in msg and msg.endswith("What fits: --moe-layers 3.")


@pytest.fixture
def no_build(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("build_random_model called for a model refused")
    monkeypatch.setattr(random_weights, "build_random_model", fail)


def fake_free(monkeypatch, free: int):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))


def test_nothing_is_built_when_refused(monkeypatch, no_build):
    fake_free(monkeypatch, 80 * 10**9)
    R = {}
    with pytest.raises(MeasureError, match=r"--model-family deepseek-v3 --moe-layers 58 \(of 58\).*80\.0 GB is free"):
        harness.random_family_model("deepseek-v3", torch.device("cuda"), 58, R)
    assert R == {}
    with pytest.raises(MeasureError, match="moe_layers=99"):  # a count the config lacks, named, still unbuilt
        harness.random_family_model("deepseek-v3", torch.device("cuda"), 99, R)


def test_a_model_that_fits_is_built_and_the_cpu_is_not_checked(monkeypatch):
    class Built(Exception):
        pass

    def built(*args, **kwargs):
        raise Built

    monkeypatch.setattr(random_weights, "build_random_model", built)
    fake_free(monkeypatch, 141 * 10**9)
    with pytest.raises(Built):  # the family's default subset (4 MoE layers) fits in 141 GB
        harness.random_family_model("deepseek-v3", "cuda:0", None, {})
    monkeypatch.undo()

    def no_cuda(device=None):
        raise AssertionError("the CPU path read CUDA memory")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_cuda)
    monkeypatch.setitem(RANDOM_FAMILIES, "qwen3-30b-a3b", RandomFamily(odd_tiny("qwen3-30b-a3b"), "bf16"))
    R = {}
    model = harness.random_family_model("qwen3-30b-a3b", "cpu", None, R)
    assert R["model_family"]["moe_layers"] == model.config.num_moe_layers == 2


@pytest.mark.gpu
@pytest.mark.parametrize("family, layers", [("deepseek-v3", 1), ("glm-4.5-air", 1), ("gpt-oss-120b", 2),
                                            ("qwen3-30b-a3b", 2)])
def test_on_the_gpu_the_build_allocates_the_estimate_and_peaks_within_the_margin(family, layers):
    """At the published widths: what the build leaves allocated is the estimate (plus the row map, the
    RoPE frequencies, the fused qk-norm weights and the allocator's 512-byte rounding: under 0.1%), and
    its peak (the FP8 quantizer's temporaries, deepseek-v3, gone before the first step) within what the
    check asks for."""
    fam = RANDOM_FAMILIES[family]
    gc.collect()  # an earlier test's cyclic garbage freed during the build would shrink what it seems to hold
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = build_random_model(fam.raw(), "cuda", fam.expert_format, layers, source=family)
    held, peak = torch.cuda.memory_allocated() - before, torch.cuda.max_memory_allocated() - before
    estimate = random_model_bytes(fam.raw(), fam.expert_format, layers, family)
    assert estimate.total <= held <= estimate.total * 1.001, (held, estimate)
    assert peak <= need(fam.raw(), fam.expert_format, layers), (peak, estimate)
    del model
    torch.cuda.empty_cache()
