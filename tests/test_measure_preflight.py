"""bench cache's preflight (coldset.measure.cache_memory.check_placement_fits): a run whose largest placement
cannot be built beside the all-HBM reference is refused with the numbers and what fits, against the
bytes and hot rows computed here from the pools' shapes (brute force over layer counts and residencies)."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest
import torch

from coldset.kernels.tiers import ExpertPools
from coldset.measure.cache_memory import check_placement_fits
from coldset.measure.harness import MeasureError
from coldset.measure.model_memory import HBM_MARGIN_BYTES, HBM_MARGIN_FRACTION


def bf16_pools(L: int, E: int, I: int, H: int, device: str = "cpu") -> ExpertPools:
    return ExpertPools.all_hot(torch.zeros((L, E, 2 * I, H), dtype=torch.bfloat16, device=device),
                               torch.zeros((L, E, H, I), dtype=torch.bfloat16, device=device))


def mxfp4_pools(L: int, E: int, I: int, H: int) -> ExpertPools:
    """MXFP4 experts with biases (gpt-oss's layout): packed weights, e8m0 scales, bf16 biases."""
    u8 = torch.uint8
    return ExpertPools.all_hot(torch.zeros((L, E, 2 * I, H // 2), dtype=u8), torch.zeros((L, E, H, I // 2), dtype=u8),
                               torch.full((L, E, 2 * I, H // 32), 127, dtype=u8),
                               torch.full((L, E, H, I // 32), 127, dtype=u8),
                               w13_bias=torch.zeros((L, E, 2 * I), dtype=torch.bfloat16),
                               w2_bias=torch.zeros((L, E, H), dtype=torch.bfloat16))


class Arithmetic:
    """The check's arithmetic done apart: bytes from the shapes, hot rows as floor(residency * rows)."""

    def __init__(self, L, E, per_expert, bias_per_layer, free, held):
        self.L, self.E, self.per_expert, self.free, self.held = L, E, per_expert, free, held
        self.layer_bytes = E * per_expert + bias_per_layer

    def pool(self, res, layers):
        return math.floor(Fraction(str(res)) * layers * self.E) * self.per_expert

    def need(self, res, layers):
        pool = self.pool(res, layers)
        return pool + HBM_MARGIN_BYTES + HBM_MARGIN_FRACTION * pool + self.held

    def fits(self, res, layers):
        return self.need(res, layers) <= self.free + (self.L - layers) * self.layer_bytes


def refusal(pools, residencies, free, held=0, family=None) -> str:
    with pytest.raises(MeasureError) as exc:
        check_placement_fits(pools, residencies, free, held, family)
    return str(exc.value)


def test_passes_when_the_placement_fits_and_refuses_a_byte_short():
    L, E, I, H = 4, 8, 16, 32
    pools = bf16_pools(L, E, I, H)
    per_expert = (2 * I * H + H * I) * 2
    a = Arithmetic(L, E, per_expert, 0, 0, held=1000)
    need = a.need(0.5, L)  # the largest residency decides: 16 hot rows
    assert need == pytest.approx(16 * per_expert * (1 + HBM_MARGIN_FRACTION) + HBM_MARGIN_BYTES + 1000)
    check_placement_fits(pools, [0.25, 0.5], math.ceil(need), 1000)
    check_placement_fits(pools, [0.5, 0.25], math.ceil(need), 1000, "qwen3-30b-a3b")
    msg = refusal(pools, [0.25, 0.5], math.ceil(need) - 1, 1000)
    assert msg.startswith("residency 0.5's placement") and f"16 of {L * E} experts" in msg
    assert "--moe-layers" not in msg  # a synthetic run has no layer count to cut


@pytest.mark.parametrize("make, L, E, I, H, bias_per_layer, scale_bytes", [
    (bf16_pools, 8, 16, 16, 32, 0, 0),
    (mxfp4_pools, 8, 16, 32, 64, 16 * (2 * 32 + 64) * 2, 2 * 32 * 2 + 64 * 1),
])
@pytest.mark.parametrize("fit_layers", [1, 3, 7])
def test_suggests_the_largest_layer_count_and_residency_that_fit(make, L, E, I, H, bias_per_layer, scale_bytes,
                                                                 fit_layers):
    pools = make(L, E, I, H)
    weight_bytes = (2 * I * H + H * I) * 2 if make is bf16_pools else (2 * I * H + H * I) // 2
    per_expert = weight_bytes + scale_bytes
    held, res = 5000, 0.75
    # free bytes at which fit_layers layers just fit: their need less what the dropped layers free
    a = Arithmetic(L, E, per_expert, bias_per_layer, 0, held)
    a.free = math.ceil(a.need(res, fit_layers) - (L - fit_layers) * a.layer_bytes)
    assert a.fits(res, fit_layers) and not a.fits(res, fit_layers + 1) and not a.fits(res, L)
    msg = refusal(pools, [0.25, res], a.free, held, "gpt-oss-120b")
    assert f"--model-family gpt-oss-120b --moe-layers {fit_layers} at residency {res}" in msg
    want_res = max((c / 100 for c in range(1, 76) if a.fits(c / 100, L)), default=None)
    if want_res is None:
        assert f"no residency at {L} MoE layers" in msg
    else:
        assert a.fits(want_res, L) and not a.fits(round(want_res + 0.01, 2), L)
        assert f"--residencies up to {want_res} at {L} MoE layers" in msg
    assert f"({math.floor(res * L * E)} of {L * E} experts at {per_expert / 1e6:.2f} MB)" in msg


def test_says_nothing_fits_when_even_one_layer_does_not():
    L, E, I, H = 4, 8, 16, 32
    pools = bf16_pools(L, E, I, H)
    a = Arithmetic(L, E, (2 * I * H + H * I) * 2, 0, 0, 0)
    a.free = math.ceil(a.need(0.5, 1) - (L - 1) * a.layer_bytes) - 1  # a byte short at one layer
    assert not any(a.fits(0.5, n) for n in range(1, L + 1)) and not a.fits(0.01, L)
    msg = refusal(pools, [0.5], a.free, 0, "qwen3-30b-a3b")
    assert "What fits: no --moe-layers count at residency 0.5; no residency at 4 MoE layers." in msg


def test_qwen3_at_its_published_shape_on_an_80_gb_gpu():
    """Qwen3-30B-A3B's 48 layers of 128 bf16 experts (9437184 bytes each, 58 GB all-HBM) with 21 GB
    free: residency 0.5's 29 GB pool is refused with the numbers; the pools on the meta device."""
    L, E = 48, 128
    pools = bf16_pools(L, E, 768, 2048, device="meta")
    per_expert = 9437184
    free, held = 21_000_000_000, 0
    msg = refusal(pools, [0.5], free, held, "qwen3-30b-a3b")
    a = Arithmetic(L, E, per_expert, 0, free, held)
    margin = a.need(0.5, L) - 3072 * per_expert
    assert (f"residency 0.5's placement needs {3072 * per_expert / 1e9:.1f} GB of HBM (3072 of 6144 experts at "
            f"9.44 MB) + {margin / 1e9:.1f} GB") in msg
    assert f"all-HBM reference's {L * E * per_expert / 1e9:.1f} GB already resident" in msg
    assert "58.0 GB already resident" in msg and "21.0 GB is free" in msg and "29.0 GB of HBM" in msg
    layers = int(re.search(r"--moe-layers (\d+)", msg).group(1))
    assert a.fits(0.5, layers) and not a.fits(0.5, layers + 1)
    res = float(re.search(r"--residencies up to ([0-9.]+)", msg).group(1))
    assert a.fits(res, L) and not a.fits(round(res + 0.01, 2), L)
