"""The name coldset gives a block-FP8 checkpoint's format, for square and non-square blocks, and
what that name means in bytes.

``quantization_config.weight_block_size`` is ``[block_n, block_k]`` (vLLM's and DeepSeek's order:
output rows, then input columns, of a ``[out, in]`` weight); the checkpoint stores one float32
``weight_scale_inv`` per block, ``[ceil(out / block_n), ceil(in / block_k)]``. A square block is
named ``fp8_block{B}`` (the published 128 one is coldset.core.fp8's format); a non-square one
``fp8_block{block_n}x{block_k}``, rows first. The byte counts below are worked by hand from those
scale grids, at a hidden size (320) and expert width (96) that no block divides, so that rows and
columns swapped give a different count.
"""

import json

import pytest

from coldset.core import fp8
from coldset.core.shapes import expert_bytes, get_weight_format, shape_from_hf_config

H, I = 320, 96  # hidden size, moe_intermediate_size


def _config(block):
    """A small qwen3_moe config.json with block-FP8 weights of ``weight_block_size`` ``block``."""
    return {"model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": H, "intermediate_size": 512,
            "moe_intermediate_size": I, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
            "torch_dtype": "bfloat16", "max_position_embeddings": 4096, "rope_theta": 10000.0,
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": block, "modules_to_not_convert": ["lm_head"]}}


# One expert: gate [I, H] and up [I, H] (stored apart), down [H, I]; 1 byte a weight.
WEIGHTS = 3 * I * H  # 92160
# float32 scales per expert, by hand:
#   [64, 128]:  gate/up ceil(96/64)=2 x ceil(320/128)=3 = 6 each; down ceil(320/64)=5 x ceil(96/128)=1 = 5
#   [128, 64]:  gate/up ceil(96/128)=1 x ceil(320/64)=5 = 5 each; down ceil(320/128)=3 x ceil(96/64)=2 = 6
#   [128, 128]: gate/up 1 x 3 = 3 each; down 3 x 1 = 3
CASES = [
    ([64, 128], "fp8_block64x128", (64, 128), WEIGHTS + 4 * (6 + 6 + 5)),
    ([128, 64], "fp8_block128x64", (128, 64), WEIGHTS + 4 * (5 + 5 + 6)),
    ([128, 128], "fp8_block128", (128, 128), WEIGHTS + 4 * (3 + 3 + 3)),
]


@pytest.mark.parametrize("block,name,scale_block,nbytes", CASES, ids=[c[1] for c in CASES])
def test_block_fp8_format_named_rows_first_with_its_bytes(block, name, scale_block, nbytes):
    shape = shape_from_hf_config(json.loads(json.dumps(_config(block))))
    assert shape.expert_format == name and shape.linear_format == name
    fmt = get_weight_format(name)
    assert fmt.name == name and fmt.scale_block == scale_block
    assert (fmt.bytes_per_element, fmt.scale_bytes) == (1, 4)
    assert expert_bytes(shape) == nbytes


def test_non_square_names_differ_by_orientation_and_from_the_published_format():
    assert CASES[0][3] != CASES[1][3]  # the hand counts tell the orientations apart at this shape
    names = {shape_from_hf_config(_config(b)).expert_format for b, *_ in CASES}
    assert len(names) == 3
    assert shape_from_hf_config(_config([128, 128])).expert_format == fp8.FORMAT_NAME
    # one matrix whose rows and columns are both not multiples of either block edge
    assert get_weight_format("fp8_block64x128").matrix_bytes(100, 300) == 100 * 300 + 4 * (2 * 3)
    assert get_weight_format("fp8_block128x64").matrix_bytes(100, 300) == 100 * 300 + 4 * (1 * 5)


@pytest.mark.parametrize("block", [[64, 128], [128, 64]])
def test_non_square_block_refused_by_the_fp8_reader_naming_it(block):
    """Only the published [128, 128] block is decoded (coldset.core.fp8); shapes and bytes above
    need no decoding, the engine's reader refuses the checkpoint, naming the block."""
    with pytest.raises(fp8.Fp8FormatError, match=rf"weight_block_size \[{block[0]}, {block[1]}\] is not supported"):
        fp8.parse_quantization_config(_config(block)["quantization_config"])
