"""The importers' edge where the engine returns no prompt rows at all: vLLM's
``routed_experts_prompt_start`` (SGLang's ``routed_experts_start_len``) equal to the prompt length.

vLLM then drops every prompt row: ``routed_experts`` holds ``prompt + completion - 1 - prompt =
completion - 1`` rows, the decode steps at positions ``prompt .. prompt + completion - 2``, every
one of them a decode row. The expectations are spelled out by hand below (positions, phases and
experts row by row), not computed by the importer's own arithmetic.
"""

import base64
import io
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from coldset.core.shapes import shape_from_hf_config
from coldset.core.trace import TraceError
from coldset.trace.importers import import_trace
from test_importers import HF_CONFIG

# test_importers' model with 3 layers: layer 0 dense, MoE layers 1 and 2, 8 experts, top-2
SHAPE = shape_from_hf_config({**HF_CONFIG, "num_hidden_layers": 3})

# vLLM 0.32 returns every layer of the model (the dense layer's rows are zeros); rows are tokens,
# columns per layer the top-2. Three decode tokens (completion 4: the last sampled token is never
# forwarded), distinct experts in each (token, layer).
ROWS = np.array([
    [[0, 0], [1, 2], [3, 4]],
    [[0, 0], [5, 6], [7, 0]],
    [[0, 0], [2, 1], [6, 3]],
], dtype=np.uint8)
PROMPT, COMPLETION = 5, 4
# (position, phase, layer, rank, expert) of every trace row, by hand from ROWS: token t is at
# position PROMPT + t, every row a decode row, layer 0 (dense) dropped
EXPECTED = sorted([
    (5, "decode", 1, 0, 1), (5, "decode", 1, 1, 2), (5, "decode", 2, 0, 3), (5, "decode", 2, 1, 4),
    (6, "decode", 1, 0, 5), (6, "decode", 1, 1, 6), (6, "decode", 2, 0, 7), (6, "decode", 2, 1, 0),
    (7, "decode", 1, 0, 2), (7, "decode", 1, 1, 1), (7, "decode", 2, 0, 6), (7, "decode", 2, 1, 3),
])


def _npy_b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode()


def _response(arr, prompt=PROMPT, completion=COMPLETION, start=None, token_ids=False, echo=False):
    """A vLLM completions response with one choice, as the server writes it (the saved
    ``routed_experts_prompt_start`` added by the user, as the importer's doc says)."""
    choice = {"index": 0, "text": "...", "finish_reason": "length", "routed_experts": _npy_b64(arr)}
    if token_ids:
        prompt_ids, out_ids = list(range(100, 100 + prompt)), list(range(200, 200 + completion))
        choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = prompt_ids + out_ids if echo else out_ids
    resp = {"id": "cmpl-edge", "object": "text_completion", "model": "m", "choices": [choice],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}}
    if start is not None:
        resp["routed_experts_prompt_start"] = start
    return resp


def _rows(path, request="cmpl-edge"):
    df = pq.read_table(path).to_pandas()
    assert set(df["request"].astype(str)) == {request}
    return sorted(zip(df["position"].astype(int), df["phase"].astype(str), df["layer"].astype(int),
                      df["rank"].astype(int), df["expert"].astype(int)))


@pytest.mark.parametrize("token_ids,echo", [(False, False), (True, False), (True, True)],
                         ids=["usage", "token_ids", "echo"])
def test_vllm_prompt_start_equal_to_prompt_imports_decode_rows_only(tmp_path, token_ids, echo):
    """Lengths from usage, from the choice's token ids, or from an echo request's token ids (which
    hold the prompt too): the same three decode tokens at positions 5, 6, 7, no prefill row."""
    path = tmp_path / "resp.json"
    path.write_text(json.dumps(_response(ROWS, start=PROMPT, token_ids=token_ids, echo=echo)))
    rep = import_trace(path, tmp_path / "t.parquet", expect=SHAPE)
    assert (rep.requests, rep.rows) == (1, 12)  # 3 tokens x 2 MoE layers x top-2
    assert _rows(tmp_path / "t.parquet") == EXPECTED


def test_vllm_prompt_start_equal_to_prompt_row_count_still_checked(tmp_path):
    """With every prompt row dropped the count is completion - 1 (3): one row more or less is refused."""
    path = tmp_path / "resp.json"
    for arr in (np.concatenate([ROWS, ROWS[:1]]), ROWS[:2]):
        path.write_text(json.dumps(_response(arr, start=PROMPT)))
        with pytest.raises(TraceError, match=rf"resp.json choices\[0\].routed_experts: {len(arr)} rows, expected "
                                             r"prompt 5 \+ completion 4 - 1 = 8 - routed_experts_prompt_start 5 = 3$"):
            import_trace(path, tmp_path / "t.parquet", expect=SHAPE)
        assert not (tmp_path / "t.parquet").exists()


def test_vllm_rows_of_decode_only_without_the_field_refused_naming_the_prompt_length(tmp_path):
    """The same three rows saved without the field: not imported as prompt rows at positions 0..2,
    refused, and the fix names the whole prompt (5) as the start."""
    path = tmp_path / "resp.json"
    path.write_text(json.dumps(_response(ROWS)))
    with pytest.raises(TraceError, match=r"3 rows, expected prompt 5 \+ completion 4 - 1 = 8; if the request set "
                                         r"routed_experts_prompt_start .*\"routed_experts_prompt_start\": 5 "):
        import_trace(path, tmp_path / "t.parquet", expect=SHAPE)
    # one past the prompt is outside 0..prompt
    path.write_text(json.dumps(_response(ROWS[:2], start=PROMPT + 1)))
    with pytest.raises(TraceError, match=r"routed_experts_prompt_start must be an integer in 0..5, got 6"):
        import_trace(path, tmp_path / "t.parquet", expect=SHAPE)


def test_vllm_prompt_start_equal_to_one_choices_prompt_of_two(tmp_path):
    """The field is the request's, one value for every prompt of a multi-prompt request: equal to
    the first prompt's length (3) it leaves that choice decode rows only, and the second prompt (5
    tokens) its last 2 prompt rows, as prefill, at positions 3 and 4."""
    a = np.array([[[0, 0], [1, 2], [3, 4]],  # choice 0: prompt 3, completion 2 -> 1 row, position 3
                  ], dtype=np.uint8)
    b = np.array([[[0, 0], [5, 6], [7, 0]],  # choice 1: prompt 5, completion 3 -> 5 + 3 - 1 - 3 = 4 rows
                  [[0, 0], [2, 1], [6, 3]],
                  [[0, 0], [4, 7], [1, 5]],
                  [[0, 0], [0, 3], [2, 4]]], dtype=np.uint8)
    choices = []
    for i, (arr, p, c) in enumerate([(a, 3, 2), (b, 5, 3)]):
        choices.append({"index": i, "text": "...", "finish_reason": "length", "routed_experts": _npy_b64(arr),
                        "prompt_token_ids": list(range(100, 100 + p)), "token_ids": list(range(200, 200 + c))})
    resp = {"id": "cmpl-two", "object": "text_completion", "model": "m", "choices": choices,
            "usage": {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13},
            "routed_experts_prompt_start": 3}
    path = tmp_path / "two.json"
    path.write_text(json.dumps(resp))
    import_trace(path, tmp_path / "t.parquet", expect=SHAPE)
    df = pq.read_table(tmp_path / "t.parquet").to_pandas()
    got = sorted(zip(df["request"].astype(str), df["position"].astype(int), df["phase"].astype(str),
                     df["layer"].astype(int), df["rank"].astype(int), df["expert"].astype(int)))
    assert got == sorted([
        ("cmpl-two/0", 3, "decode", 1, 0, 1), ("cmpl-two/0", 3, "decode", 1, 1, 2),
        ("cmpl-two/0", 3, "decode", 2, 0, 3), ("cmpl-two/0", 3, "decode", 2, 1, 4),
        ("cmpl-two/1", 3, "prefill", 1, 0, 5), ("cmpl-two/1", 3, "prefill", 1, 1, 6),
        ("cmpl-two/1", 3, "prefill", 2, 0, 7), ("cmpl-two/1", 3, "prefill", 2, 1, 0),
        ("cmpl-two/1", 4, "prefill", 1, 0, 2), ("cmpl-two/1", 4, "prefill", 1, 1, 1),
        ("cmpl-two/1", 4, "prefill", 2, 0, 6), ("cmpl-two/1", 4, "prefill", 2, 1, 3),
        ("cmpl-two/1", 5, "decode", 1, 0, 4), ("cmpl-two/1", 5, "decode", 1, 1, 7),
        ("cmpl-two/1", 5, "decode", 2, 0, 1), ("cmpl-two/1", 5, "decode", 2, 1, 5),
        ("cmpl-two/1", 6, "decode", 1, 0, 0), ("cmpl-two/1", 6, "decode", 1, 1, 3),
        ("cmpl-two/1", 6, "decode", 2, 0, 2), ("cmpl-two/1", 6, "decode", 2, 1, 4),
    ])


def test_sglang_start_len_equal_to_prompt_imports_decode_rows_only(tmp_path):
    """SGLang's counterpart: ``routed_experts_start_len`` equal to ``prompt_tokens``."""
    meta = {"id": "sg-edge", "prompt_tokens": PROMPT, "completion_tokens": COMPLETION,
            "routed_experts_start_len": PROMPT, "finish_reason": {"type": "length"},
            "routed_experts": base64.b64encode(ROWS.astype("<i4").tobytes()).decode()}
    path = tmp_path / "sglang.json"
    path.write_text(json.dumps({"text": "...", "meta_info": meta}))
    import_trace(path, tmp_path / "t.parquet", expect=SHAPE)
    assert _rows(tmp_path / "t.parquet", "sg-edge") == EXPECTED
