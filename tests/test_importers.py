"""Importers on files laid out as vLLM and SGLang write them today (fixtures built from the
engines' source: vLLM's CompletionResponseChoice.routed_experts, SGLang's meta_info.routed_experts
and its expert distribution recorder's per_token dump), read back row by row."""

import base64
import io
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from coldset.trace.importers import import_trace
from coldset.core.trace import TraceError
from coldset.core.shapes import shape_from_hf_config

# 5 layers, layer 0 dense, 4 MoE layers (1..4), 8 experts, top-2
HF_CONFIG = {
    "model_type": "deepseek_v3", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_hidden_layers": 5, "num_attention_heads": 2, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": None,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16}
SHAPE = shape_from_hf_config(HF_CONFIG)
MOE = [1, 2, 3, 4]


def routing(rng, rows, layers=5, k=2):
    """Distinct top-k experts per (token, layer), as a router picks them."""
    return np.stack([np.stack([rng.choice(8, size=k, replace=False) for _ in range(layers)])
                     for _ in range(rows)])


def rows_of(arr, request, domain, prompt, first=0):
    """Expected trace rows of one request from its [tokens, MoE layers, k] array."""
    out = []
    for t in range(arr.shape[0]):
        for li, layer in enumerate(MOE):
            for r in range(arr.shape[2]):
                out.append((request, domain, first + t, "prefill" if t < prompt else "decode", layer, r,
                            int(arr[t, li, r])))
    return out


def read_rows(path):
    df = pq.read_table(path).to_pandas()
    return sorted(zip(df["request"].astype(str), df["domain"].astype(str), df["position"].astype(int),
                      df["phase"].astype(str), df["layer"].astype(int), df["rank"].astype(int),
                      df["expert"].astype(int)))


def vllm_response(rid, arr, prompt, completion):
    # vLLM: np.save of the uint8/uint16 array, base64 (CompletionResponseChoice.routed_experts)
    buf = io.BytesIO()
    np.save(buf, arr.astype(np.uint8))
    return {"id": rid, "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": "...", "finish_reason": "length",
                         "routed_experts": base64.b64encode(buf.getvalue()).decode()}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}}


def sglang_response(rid, arr, prompt, completion, start=0):
    # SGLang: base64 of the flattened int32 array, in meta_info (rows from routed_experts_start_len)
    meta = {"id": rid, "prompt_tokens": prompt, "completion_tokens": completion, "finish_reason": {"type": "length"},
            "routed_experts": base64.b64encode(arr.astype("<i4").tobytes()).decode()}
    if start:
        meta["routed_experts_start_len"] = start
    return {"text": "...", "meta_info": meta}


def test_vllm_openai_responses_in_a_folder_with_domains(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "exports"
    (folder / "code").mkdir(parents=True)
    expected = []
    for i, (prompt, completion) in enumerate([(5, 4), (3, 1), (7, 6)]):
        arr = routing(rng, prompt + completion - 1)  # every layer (vLLM's layer_num), last token not forwarded
        sub = "code" if i < 2 else ""
        path = folder / sub / f"resp{i}.json"
        path.write_text(json.dumps(vllm_response(f"cmpl-{i}", arr, prompt, completion)))
        domain = "coding" if i < 2 else "resp2"  # unmatched file: its stem
        expected += rows_of(arr[:, MOE, :], f"cmpl-{i}", domain, prompt)
    rep = import_trace(folder, tmp_path / "t.parquet", expect=SHAPE, domains={"code/*": "coding"})
    assert rep.requests == 3
    assert read_rows(tmp_path / "t.parquet") == sorted(expected)


def test_sglang_responses_with_fused_shared_experts_and_start_len(tmp_path):
    rng = np.random.default_rng(1)
    a = routing(rng, 6 + 3 - 1, k=3)  # top-2 + one fused shared expert column, every layer
    b = routing(rng, 9 + 2 - 1 - 4)  # rows from position 4 on
    lines = [sglang_response("r-a", a, 6, 3), sglang_response("r-b", b, 9, 2, start=4)]
    path = tmp_path / "sglang.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    import_trace(path, tmp_path / "t.parquet", expect=SHAPE)
    expected = rows_of(a[:, MOE, :2], "r-a", "sglang", 6) + rows_of(b[:, MOE, :], "r-b", "sglang", 5, first=4)
    assert read_rows(tmp_path / "t.parquet") == sorted(expected)


def test_sglang_recorder_per_token_dump(tmp_path):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    # physical -> logical: 10 physical slots (2 redundant copies), a different map per layer
    p2l = np.stack([np.concatenate([rng.permutation(8), [3, 5]]) for _ in range(5)])
    inv = [{int(l): p for p, l in enumerate(row[:8])} for row in p2l]

    def pass_ids(logical):  # [tokens, layers, 2] logical -> [layers, tokens, 8] physical, -1 padded
        phys = np.full((5, logical.shape[0], 8), -1, dtype=np.int32)
        for t in range(logical.shape[0]):
            for layer in range(5):
                phys[layer, t, :2] = [inv[layer][int(e)] for e in logical[t, layer]]
        return torch.from_numpy(phys)

    prefill = routing(rng, 7)  # two sequences of 4 and 3 tokens
    decode = routing(rng, 2)  # one decode step of both
    records = [
        {"forward_pass_id": 0, "rank": 0, "gatherer_key": "primary", "input_ids": list(range(7)),
         "positions": [0, 1, 2, 3, 0, 1, 2], "extend_seq_lens": [4, 3], "forward_mode": 1,
         "topk_ids_of_layer": pass_ids(prefill), "misc_objects": []},
        {"forward_pass_id": 1, "rank": 0, "gatherer_key": "primary", "input_ids": [50, 51],
         "positions": [4, 3], "extend_seq_lens": [1, 1], "forward_mode": 2,
         "topk_ids_of_layer": pass_ids(decode), "misc_objects": []},
    ]
    dump = {"records": records, "last_physical_to_logical_map": torch.from_numpy(p2l)}
    folder = tmp_path / "dumps"
    folder.mkdir()
    torch.save(dump, folder / "expert_distribution_recorder_1700000000.0_0.pt")
    torch.save({**dump, "records": [dict(r, rank=1) for r in records]},  # a second TP rank: same passes
               folder / "expert_distribution_recorder_1700000000.0_1.pt")
    import_trace(folder, tmp_path / "t.parquet", expect=SHAPE, domains={"*": "mmlu"})
    stem = "expert_distribution_recorder_1700000000"
    expected = (rows_of(prefill[:4, MOE], f"{stem}#0:0:0", "mmlu", 4)
                + rows_of(prefill[4:, MOE], f"{stem}#0:0:1", "mmlu", 3)
                + rows_of(decode[:1, MOE], f"{stem}#0:1:d0", "mmlu", 0, first=4)
                + rows_of(decode[1:, MOE], f"{stem}#0:1:d1", "mmlu", 0, first=3))
    assert read_rows(tmp_path / "t.parquet") == sorted(expected)


def test_engine_exports_refused_with_reasons(tmp_path):
    rng = np.random.default_rng(3)
    resp = vllm_response("x", routing(rng, 4), 3, 2)
    (tmp_path / "r.json").write_text(json.dumps(resp))
    with pytest.raises(TraceError, match="engine exports carry no model shape; set model.path"):
        import_trace(tmp_path / "r.json", tmp_path / "t.parquet")
    resp["choices"][0]["routed_experts"] = None
    (tmp_path / "r.json").write_text(json.dumps(resp))
    with pytest.raises(TraceError, match="enable-return-routed-experts"):
        import_trace(tmp_path / "r.json", tmp_path / "t.parquet", expect=SHAPE)
    bad = sglang_response("y", routing(rng, 5), 3, 2)  # 5 rows, but 3 + 2 - 1 = 4 expected
    (tmp_path / "r.json").write_text(json.dumps(bad))
    with pytest.raises(TraceError, match="do not make 4 rows"):
        import_trace(tmp_path / "r.json", tmp_path / "t.parquet", expect=SHAPE)
    assert not (tmp_path / "t.parquet").exists()


# ---------------------------------------------------------------------------------------------
# issue 30 item 2: vLLM imports that were silently wrong (checked against vLLM 0.32's serving code)


def npy_b64(arr):
    buf = io.BytesIO()
    np.save(buf, arr.astype(np.uint8))
    return base64.b64encode(buf.getvalue()).decode()


def completions_response(rid, prompts, arrs, completions, token_ids=True, echo=False):
    """A completions response to a list of prompts, as vLLM 0.32 builds it: one choice per prompt
    (index = its place), usage summed over prompts; with ``return_token_ids`` each choice carries
    its prompt_token_ids and token_ids (the prompt's too under ``echo``)."""
    choices = []
    for i, (p, arr, c) in enumerate(zip(prompts, arrs, completions)):
        choice = {"index": i, "text": "...", "finish_reason": "length", "routed_experts": npy_b64(arr)}
        if token_ids:
            prompt_ids, out_ids = list(range(100, 100 + p)), list(range(200, 200 + c))
            choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = prompt_ids + out_ids if echo else out_ids
        choices.append(choice)
    return {"id": rid, "object": "text_completion", "model": "m", "choices": choices,
            "usage": {"prompt_tokens": sum(prompts), "completion_tokens": sum(completions),
                      "total_tokens": sum(prompts) + sum(completions)}}


def test_vllm_multi_prompt_completions_take_each_choices_prompt(tmp_path):
    """usage.prompt_tokens of a multi-prompt request is the total: each choice's own prompt length
    (prompt_token_ids, sent with return_token_ids) splits its prefill from its decode rows."""
    rng = np.random.default_rng(4)
    prompts, completions = [2, 3], [8, 6]  # the total (5) fits either choice: once imported as each one's prompt
    arrs = [routing(rng, p + c - 1) for p, c in zip(prompts, completions)]
    for echo in (False, True):
        path = tmp_path / f"multi{echo}.json"
        path.write_text(json.dumps(completions_response("cmpl-m", prompts, arrs, completions, echo=echo)))
        import_trace(path, tmp_path / "t.parquet", expect=SHAPE)
        domain = path.stem
        expected = rows_of(arrs[0][:, MOE], "cmpl-m/0", domain, 2) + rows_of(arrs[1][:, MOE], "cmpl-m/1", domain, 3)
        assert read_rows(tmp_path / "t.parquet") == sorted(expected)
    # without per-choice token ids the split is not recoverable: refused, saying what to send
    path = tmp_path / "multi_no_ids.json"
    path.write_text(json.dumps(completions_response("cmpl-m", prompts, arrs, completions, token_ids=False)))
    with pytest.raises(TraceError, match=r"multi_no_ids.json choices\[0\]: .*usage.prompt_tokens \(5\) is the total "
                                         r"over the request's 2 prompts.*return_token_ids"):
        import_trace(path, tmp_path / "u.parquet", expect=SHAPE)
    assert not (tmp_path / "u.parquet").exists()


def test_vllm_row_count_checked_against_prompt_plus_completion(tmp_path):
    rng = np.random.default_rng(5)
    for rows, what in ((4 + 1, "one row too many"), (4 - 3, "three too few")):
        path = tmp_path / "r.json"
        path.write_text(json.dumps(vllm_response("cmpl-x", routing(rng, rows), 3, 2)))
        with pytest.raises(TraceError, match=rf"r.json choices\[0\].routed_experts: {rows} rows, expected prompt 3 \+ "
                                             r"completion 2 - 1 = 4"):
            import_trace(path, tmp_path / "t.parquet", expect=SHAPE)


def test_vllm_routed_experts_prompt_start(tmp_path):
    """vLLM drops the first N prompt rows for routed_experts_prompt_start=N and does not echo N: a
    response saved with the field imports at positions N.., one without it is refused (not shifted)."""
    rng = np.random.default_rng(6)
    prompt, completion, start = 7, 6, 4
    arr = routing(rng, prompt + completion - 1 - start)
    resp = vllm_response("cmpl-s", arr, prompt, completion)
    path = tmp_path / "s.json"
    path.write_text(json.dumps(resp))
    with pytest.raises(TraceError, match=r"8 rows, expected prompt 7 \+ completion 6 - 1 = 12.*routed_experts_prompt_start"
                                         r".*\"routed_experts_prompt_start\": 4"):
        import_trace(path, tmp_path / "t.parquet", expect=SHAPE)
    path.write_text(json.dumps({**resp, "routed_experts_prompt_start": start}))
    import_trace(path, tmp_path / "t.parquet", expect=SHAPE)
    assert read_rows(tmp_path / "t.parquet") == sorted(rows_of(arr[:, MOE], "cmpl-s", "s", prompt - start, first=start))
    path.write_text(json.dumps({**resp, "routed_experts_prompt_start": 8}))
    with pytest.raises(TraceError, match=r"routed_experts_prompt_start must be an integer in 0..7, got 8"):
        import_trace(path, tmp_path / "t.parquet", expect=SHAPE)


def offline_line(rid, arr, prompt):
    """One line of vLLM's offline outputs as the module doc says to write them."""
    return json.dumps({"id": rid, "num_prompt_tokens": prompt, "routed_experts": arr.tolist()})


def test_offline_jsonl_one_reader_file_or_folder_with_dense_layers(tmp_path):
    """vLLM 0.32 returns every layer (zero rows for the dense layer 0): a .jsonl of offline outputs
    named as a file and the same file inside a folder give the same trace."""
    rng = np.random.default_rng(7)
    arrs = [routing(rng, n) for n in (5, 3)]
    for a in arrs:
        a[:, 0, :] = 0  # the dense layer's rows, as vLLM writes them
    folder = tmp_path / "offline"
    folder.mkdir()
    path = folder / "agent.jsonl"
    path.write_text(offline_line("0", arrs[0], 3) + "\n" + offline_line("1", arrs[1], 2) + "\n")
    a = import_trace(path, tmp_path / "file.parquet", expect=SHAPE)
    b = import_trace(folder, tmp_path / "folder.parquet", expect=SHAPE)
    expected = rows_of(arrs[0][:, MOE], "0", "agent", 3) + rows_of(arrs[1][:, MOE], "1", "agent", 2)
    assert read_rows(a.path) == read_rows(b.path) == sorted(expected)


def test_offline_request_ids_repeated_across_files_refused_with_the_fix(tmp_path):
    rng = np.random.default_rng(8)
    folder = tmp_path / "offline"
    folder.mkdir()
    for name in ("run1.jsonl", "run2.jsonl"):  # two LLM instances: request ids restart at 0
        (folder / name).write_text(offline_line("0", routing(rng, 3), 2) + "\n")
    with pytest.raises(TraceError, match=r"run2.jsonl:1: request id '0' also in .*run1.jsonl:1.*restart at 0 for each "
                                         r"LLM instance"):
        import_trace(folder, tmp_path / "t.parquet", expect=SHAPE)


def test_truncated_base64_reported_as_truncated(tmp_path):
    rng = np.random.default_rng(9)
    resp = vllm_response("cmpl-t", routing(rng, 4), 3, 2)
    full = resp["choices"][0]["routed_experts"]
    for cut in (len(full) - 8, len(full) - 7):  # inside the data (whole base64 quanta), mid-quantum
        resp["choices"][0]["routed_experts"] = full[:cut]
        (tmp_path / "r.json").write_text(json.dumps(resp))
        with pytest.raises(TraceError, match=r"r.json choices\[0\].routed_experts: truncated"):
            import_trace(tmp_path / "r.json", tmp_path / "t.parquet", expect=SHAPE)
    resp["choices"][0]["routed_experts"] = base64.b64encode(b"not an npy file at all").decode()
    (tmp_path / "r.json").write_text(json.dumps(resp))
    with pytest.raises(TraceError, match=r"not an .npy payload"):
        import_trace(tmp_path / "r.json", tmp_path / "t.parquet", expect=SHAPE)


def test_import_error_is_one_message_on_the_console(tmp_path):
    """`python -m coldset routing` on a bad export: exit 1 and the reason, no traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    model = tmp_path / "model"
    model.mkdir()
    model.joinpath("config.json").write_text(json.dumps(HF_CONFIG))
    resp = vllm_response("cmpl-e", routing(np.random.default_rng(10), 6), 3, 2)  # 6 rows where 4 are due
    (tmp_path / "exports").mkdir()
    (tmp_path / "exports" / "r.json").write_text(json.dumps(resp))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"results": str(tmp_path / "results"), "model": {"name": "m", "path": str(model)},
                                   "routing": {"trace": str(tmp_path / "exports")}}))
    src = Path(__file__).resolve().parent.parent / "src"
    proc = subprocess.run([sys.executable, "-m", "coldset", "routing", "--config", str(cfg)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(src)})
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "r.json choices[0].routed_experts: 6 rows, expected prompt 3 + completion 2 - 1 = 4" in proc.stderr


def test_docs_and_configs_give_no_vllm_serve_command():
    """vLLM's PyPI CPU build has no `vllm serve` (its entry point looks up the distribution `vllm`):
    the docs, example configs and module docs give `python -m vllm.entrypoints.openai.api_server`."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    files = [repo / "README.md", *(repo / "docs").glob("*.md"), *(repo / "config").rglob("*.yaml"),
             *(repo / "config").rglob("*.md"), *(repo / "src" / "coldset").rglob("*.py")]
    command = re.compile(r"`+vllm serve [^`]")  # a command with arguments, not a mention of the name
    found = [f"{p.relative_to(repo)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
             if command.search(line)]
    assert not found, f"`vllm serve ...` as a command in {found}"
