"""What the workflow tunes and charges for MXFP4 experts (a gpt-oss checkpoint run as published):
the autotune key and source digests carry the format, the tuning pools hold packed rows and e8m0
scales, the tuned configs compute the torch path's function, a float32 MXFP4 shape is refused by
field, and the bench counts an expert's copy as its blocks plus scales. The workflow itself on an
MXFP4 folder: tests/test_gpt_oss_workflow.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coldset.bench.decode import moved_bytes_per_expert
from coldset.core import mxfp4
from coldset.kernels.activation import activation_from_config
from coldset.kernels.tune import TuneShape, _tuning_pools, autotune, autotune_key, source_digests

SHAPE = dict(num_experts=4, hidden=64, intermediate=32, top_k=2, num_moe_layers=2, num_hot=8, num_cold=0,
             expert_bias=True, activation=activation_from_config({"model_type": "gpt_oss", "swiglu_limit": 7.0}))


def test_the_mxfp4_format_enters_the_key_and_the_digests():
    bf16 = TuneShape(dtype="bfloat16", **SHAPE)
    packed = TuneShape(dtype="bfloat16", weight_format="mxfp4", **SHAPE)
    assert autotune_key(packed, [1], "cpu") != autotune_key(bf16, [1], "cpu")
    assert "coldset.core.mxfp4" in source_digests("triton", "mxfp4")
    assert "coldset.kernels.triton_mxfp4" in source_digests("triton", "mxfp4")
    assert "coldset.kernels.triton_fp8" not in source_digests("triton", "mxfp4")
    pools = _tuning_pools(packed, "cpu", layers=1)
    assert pools.is_mxfp4 and pools.w13_hot.shape == (4, 64, 32) and pools.w13_scale_hot.shape == (4, 64, 2)


def test_a_float32_mxfp4_shape_is_refused_by_field():
    with pytest.raises(ValueError, match="dtype must be bfloat16 with MXFP4"):
        TuneShape(dtype="float32", weight_format="mxfp4", **SHAPE)
    with pytest.raises(ValueError, match="weight_format"):
        TuneShape(dtype="bfloat16", weight_format="mxfp4_e5m2", **SHAPE)


def _tune(device, tmp_path):
    shape = TuneShape(dtype="bfloat16", weight_format="mxfp4", **SHAPE)
    result = autotune(shape, [1, 3], device, tmp_path, layers=1, reps=1)
    again = autotune(shape, [1, 3], device, tmp_path)
    assert not result.hit and again.hit and again.configs == result.configs
    assert sorted(result.configs) == [1, 3] and all(result.timings_us[b] for b in (1, 3))
    return result


def test_cpu_autotune_times_mxfp4_pools(tmp_path):
    """Every candidate passes the tuner's own check against the torch path on MXFP4 pools
    (a candidate computing another function would be excluded with a warning, leaving a gap)."""
    result = _tune("cpu", tmp_path)
    assert result.backend == "torch"


def test_each_format_checks_candidates_against_its_own_torch_path_numerics():
    """MXFP4's ``w8a16`` (2: codes unpacked by words) picks an unpack, not a numerics: its candidates
    are checked against the one weight-only torch path, which the tuner can compute for them; only
    block-FP8 candidates with ``w8a16`` are checked against FP8's weight-only path (unquantized
    activations); bf16 has one."""
    from coldset.kernels import torch_experts
    from coldset.kernels.tune import _weight_only_reference

    cases = [("mxfp4", {"w8a16": 2}, False), ("mxfp4", {}, False), ("fp8_block128", {"w8a16": 1}, True),
             ("fp8_block128", {}, False), (None, {"w8a16": 2}, False)]
    for fmt, cand, want in cases:
        shape = TuneShape(dtype="bfloat16", weight_format=fmt, **{**SHAPE, "hidden": 128, "intermediate": 128})
        pools = _tuning_pools(shape, "cpu", layers=1)
        assert _weight_only_reference(pools, cand) is want, (fmt, cand)
        x = torch.randn(3, 128, dtype=torch.bfloat16)
        ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
        out = torch_experts(pools, 0, x, ids, torch.full((3, 2), 0.5), w8a16=_weight_only_reference(pools, cand))
        assert out.shape == x.shape and torch.isfinite(out.float()).all(), (fmt, cand)


def test_a_tune_of_mxfp4_candidates_with_w8a16_checks_and_times_each(tmp_path):
    """The tuner's reference step end to end on the CPU: candidates carrying MXFP4's ``w8a16`` 2 (as
    every GEMV entry of triton_mxfp4's search space does) are checked and timed, none dropped."""
    shape = TuneShape(dtype="bfloat16", weight_format="mxfp4", **SHAPE)
    space = {"decode_max_tokens": 2, "decode": [{"token_chunk": None, "w8a16": 2}, {"token_chunk": 1, "w8a16": 2}],
             "prefill": [{"token_chunk": None}]}
    result = autotune(shape, [1, 3], "cpu", tmp_path, search_space=space, layers=1, reps=1)
    assert len(result.timings_us[1]) == 2 and len(result.timings_us[3]) == 1


@pytest.mark.gpu
def test_cuda_autotune_times_the_mxfp4_kernel(tmp_path):
    """On CUDA the candidates are triton_mxfp4's search space, each checked against the torch path."""
    result = _tune("cuda", tmp_path)
    assert result.backend == "triton"


def test_the_bench_counts_an_mxfp4_expert_as_blocks_plus_scales():
    """What the bench charges a cold read or a fill: the packed rows and their e8m0 scales
    (coldset.core.mxfp4's byte model), for hot and cold experts alike; bf16 pools their rows."""
    shape = TuneShape(dtype="bfloat16", weight_format="mxfp4", **SHAPE)
    pools = _tuning_pools(shape, "cpu", layers=1)
    want = mxfp4.expert_bytes(SHAPE["hidden"], SHAPE["intermediate"])
    assert moved_bytes_per_expert(pools) == want
    assert moved_bytes_per_expert(pools.placed(np.array([[0, -1, -2, 1]], dtype=np.int32))) == want
    cold = pools.placed(np.array([[-1, -2, -3, -4]], dtype=np.int32))
    assert cold.num_hot == 0 and moved_bytes_per_expert(cold) == want
    plain = _tuning_pools(TuneShape(dtype="bfloat16", **SHAPE), "cpu", layers=1)
    assert moved_bytes_per_expert(plain) == 3 * SHAPE["hidden"] * SHAPE["intermediate"] * 2
