"""The trace contract: writer, streaming reader, validation errors, importers, capture."""

from __future__ import annotations

import base64
import hashlib
import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from coldset.trace.importers import import_sglang, import_trace, import_vllm
from coldset.core.trace import (
    RequestRows,
    TraceError,
    TraceMeta,
    TraceWriter,
    iter_trace_batches,
    read_trace_meta,
    split_of,
    validate_trace,
    write_trace,
)

META = TraceMeta("toy", num_layers=4, num_experts=8, top_k=2, moe_layers=[1, 3], source="test")


def _long_rows(rid, domain, experts, num_prompt, split=None):
    """The §2 long form built with plain loops (the reference for the vectorised writer)."""
    rows = []
    for t in range(experts.shape[0]):
        if (experts[t] == -1).all():
            continue
        for li, layer in enumerate(META.moe_layers):
            for r in range(experts.shape[2]):
                row = {"request": rid, "domain": domain, "position": t,
                       "phase": "prefill" if t < num_prompt else "decode", "layer": layer, "rank": r,
                       "expert": int(experts[t, li, r])}
                if split is not None:
                    row["split"] = split
                rows.append(row)
    return rows


def _frame(path):
    df = pd.read_parquet(path)
    for c in df.columns:
        if isinstance(df[c].dtype, pd.CategoricalDtype):
            df[c] = df[c].astype(str)
    return df


def _table(n=16, **over):
    rng = np.random.default_rng(0)
    d = {
        "request": ["r0"] * n, "domain": ["d"] * n, "position": np.repeat(np.arange(n // 4), 4).astype(np.int32),
        "phase": ["prefill"] * (n // 2) + ["decode"] * (n - n // 2),
        "layer": np.tile([1, 1, 3, 3], n // 4).astype(np.int16), "rank": np.tile([0, 1], n // 2).astype(np.int8),
        # two distinct experts per token (a valid top-2 routing)
        "expert": np.concatenate([rng.permutation(8)[:2] for _ in range(n // 2)]).astype(np.int16),
    }
    d.update(over)
    return pa.table(d)


# ---------------------------------------------------------------------------------------------
# writer and reader


def _topk(rng, tokens, layers=2, k=2, experts=8):
    """Routed experts [tokens, layers, k]: k distinct experts per (token, layer), as a router picks them."""
    return np.stack([rng.permutation(experts)[:k] for _ in range(tokens * layers)]).reshape(tokens, layers, k)


def test_writer_round_trip_and_row_groups(tmp_path):
    rng = np.random.default_rng(1)
    reqs = [RequestRows(f"q{i}", ["a", "b"][i % 2], _topk(rng, 5 + i), 3,
                        rng.random((5 + i, 2, 2)).astype(np.float32), ["profile", "heldout"][i % 2])
            for i in range(6)]
    path = tmp_path / "t.parquet"
    with TraceWriter(path, META, with_weight=True, with_split=True, row_group_rows=60) as w:
        for r in reqs:
            w.add(r)
    assert pq.ParquetFile(path).num_row_groups >= 3
    meta = read_trace_meta(path)
    assert (meta.model, meta.num_experts, meta.top_k, meta.moe_layers) == ("toy", 8, 2, [1, 3])
    schema = pq.read_schema(path)
    assert schema.field("position").type == pa.int32() and schema.field("layer").type == pa.int16()
    assert schema.field("rank").type == pa.int8() and schema.field("expert").type == pa.int16()
    assert schema.field("weight").type == pa.float32()
    got = _frame(path)
    exp = pd.DataFrame([row for r in reqs for row in _long_rows(r.request, r.domain, r.experts, 3, r.split)])
    pd.testing.assert_frame_equal(got.drop(columns="weight")[exp.columns], exp, check_dtype=False)
    np.testing.assert_array_equal(got["weight"].to_numpy(),
                                  np.concatenate([r.weights.reshape(-1) for r in reqs]))
    batches = list(iter_trace_batches(path, ["request", "expert"], batch_rows=50))
    assert len(batches) >= 3 and all(b.num_rows <= 50 for b in batches)
    assert sum(b.num_rows for b in batches) == len(exp)


def test_writer_skips_and_counts_cached_prefix(tmp_path):
    ex = np.arange(6 * 2 * 2).reshape(6, 2, 2) % 8
    ex[:2] = -1  # two cached prompt tokens
    path = tmp_path / "t.parquet"
    with TraceWriter(path, META, with_weight=False, with_split=False) as w:
        assert w.add(RequestRows("q", "d", ex, 4)) == 2
    df = _frame(path)
    assert sorted(df.position.unique()) == [2, 3, 4, 5]
    assert (df[df.position < 4].phase == "prefill").all() and (df[df.position >= 4].phase == "decode").all()
    assert read_trace_meta(path).extra["cached_prefix_tokens_skipped"] == "2"


@pytest.mark.parametrize("experts,npt,msg", [
    (np.zeros((3, 2, 3), int), 1, r"shape \(3, 2, 3\), expected \[tokens, 2, 2\]"),
    (np.array([[[0, 1], [2, 8]]]), 1, r"expert id 8 at token 0, MoE layer 1, rank 1 is outside 0..7"),
    (np.array([[[0, -1], [2, 3]]]), 1, r"expert id -1 at token 0, MoE layer 0, rank 1"),
    (np.array([[[1, 2], [2, 3]], [[-1, -1], [-1, -1]]]), 1, r"generated token 1 is marked -1"),
])
def test_writer_refuses_bad_requests_and_leaves_nothing(tmp_path, experts, npt, msg):
    path = tmp_path / "t.parquet"
    with pytest.raises(TraceError, match=msg):
        with TraceWriter(path, META, with_weight=False, with_split=False) as w:
            w.add(RequestRows("q", "d", experts, npt))
    assert list(tmp_path.iterdir()) == []  # no trace, no temp file


def test_write_trace_from_table(tmp_path):
    path = write_trace(tmp_path / "t.parquet", META, _table())
    assert validate_trace(path, {"num_experts": 8, "top_k": 2, "moe_layers": (1, 3)}).model == "toy"


# ---------------------------------------------------------------------------------------------
# validation errors: each names the file and the place


def _with(row, expert):
    """_table()'s expert column with one row changed."""
    ex = _table().column("expert").to_numpy().copy()
    ex[row] = expert
    return ex


@pytest.mark.parametrize("over,msg", [
    ({"expert": _with(9, 8)}, r"row 9: column 'expert' holds expert id 8 outside 0..7"),
    ({"expert": _with(3, -2)}, r"row 3: column 'expert' holds expert id -2"),
    ({"expert": _with(12, -1)}, r"row 12: column 'expert' holds -1 \(cached prefix\) in a decode row"),
    ({"layer": np.r_[np.ones(5), 2, np.ones(10)].astype(np.int16)}, r"row 5: column 'layer' holds layer 2, not one of the MoE layers \[1, 3\]"),
    ({"rank": np.r_[np.zeros(7), 2, np.zeros(8)].astype(np.int8)}, r"row 7: column 'rank' holds rank 2 outside 0..1"),
    ({"phase": ["prefill"] * 15 + ["generate"]}, r"row 15: column 'phase' holds 'generate'"),
])
def test_validation_errors_name_file_row_group_row_and_column(tmp_path, over, msg):
    path = tmp_path / "bad.parquet"
    # written with pyarrow directly (write_trace would refuse it), two row groups of 8 rows
    t = _table(**over).replace_schema_metadata(META.to_metadata())
    pq.write_table(t, path, row_group_size=8)
    with pytest.raises(TraceError, match=msg) as err:
        validate_trace(path)
    row = int(msg.split("row ")[1].split(":")[0])
    assert str(path) in str(err.value) and f"row group {row // 8}" in str(err.value)
    with pytest.raises(TraceError, match=msg):
        write_trace(tmp_path / "w.parquet", META, _table(**over))
    assert not (tmp_path / "w.parquet").exists()


def test_missing_column_and_metadata_errors(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(_table().drop(["rank"]).replace_schema_metadata(META.to_metadata()), path)
    with pytest.raises(TraceError, match=r"t.parquet: missing column\(s\) \['rank'\]"):
        read_trace_meta(path)
    md = {k: v for k, v in META.to_metadata().items() if k != b"top_k"}
    pq.write_table(_table().replace_schema_metadata(md), path)
    with pytest.raises(TraceError, match=r"t.parquet: schema metadata lacks key\(s\) \['top_k'\]"):
        read_trace_meta(path)
    pq.write_table(_table().replace_schema_metadata(META.to_metadata()), path)
    ok = {"num_experts": 8, "top_k": 2, "moe_layers": [1, 3]}
    for key, value, shown in (("num_experts", 16, "num_experts=8 disagrees with the model \\(num_experts=16\\)"),
                              ("top_k", 4, "top_k=2 disagrees with the model \\(top_k=4\\)"),
                              ("moe_layers", [0, 1, 2, 3], r"moe_layers=\[1, 3\] disagrees")):
        with pytest.raises(TraceError, match=f"t.parquet: trace metadata {shown}"):
            read_trace_meta(path, {**ok, key: value})
    with pytest.raises(TraceError, match="expected an integer"):
        pq.write_table(_table(position=pa.array(["x"] * 16)).replace_schema_metadata(META.to_metadata()), path)
        read_trace_meta(path)


def test_split_of_is_a_stable_hash():
    ids = [f"req-{i}" for i in range(2000)]
    splits = [split_of(i, 0.25) for i in ids]
    assert 0.22 < splits.count("heldout") / len(ids) < 0.28
    h = int.from_bytes(hashlib.sha256(b"req-7").digest()[:8], "big") / 2**64
    assert split_of("req-7", 0.25) == ("heldout" if h < 0.25 else "profile")
    assert all(split_of(i, 0.0) == "profile" for i in ids[:50])
    assert all(split_of(i, 1.0) == "heldout" for i in ids[:50])


# ---------------------------------------------------------------------------------------------
# importers on arrays of the documented shapes


def _vllm_requests():
    rng = np.random.default_rng(7)
    def topk(tokens):  # distinct experts per (token, layer), as a router selects them
        return np.stack([rng.permutation(8)[:2] for _ in range(tokens * 2)]).reshape(tokens, 2, 2)

    a = topk(9).astype(np.int16)  # int16 [tokens, moe_layers, k]
    a[:3] = -1  # three prompt tokens served from the prefix cache
    b = topk(5).astype(np.uint8)  # uint8 when <= 256 experts
    return [("agent-1", "agent", 6, a), ("prose-2", "prose", 2, b)]


def test_import_vllm(tmp_path):
    export = tmp_path / "vllm.jsonl"
    header = {"trace_meta": {"model": "toy", "num_layers": 4, "num_experts": 8, "top_k": 2, "moe_layers": [1, 3]}}
    lines = [json.dumps(header)] + [json.dumps({"id": i, "domain": d, "num_prompt_tokens": n, "routed_experts": a.tolist(),
                                                "split": "profile"}) for i, d, n, a in _vllm_requests()]
    export.write_text("\n".join(lines) + "\n")
    rep = import_vllm(export, tmp_path / "t.parquet")
    assert rep.cached_prefix_tokens_skipped == 3 and rep.requests == 2
    exp = pd.DataFrame([row for i, d, n, a in _vllm_requests() for row in _long_rows(i, d, a.astype(int), n, "profile")])
    got = _frame(tmp_path / "t.parquet")
    assert rep.rows == len(exp)
    pd.testing.assert_frame_equal(got[exp.columns], exp, check_dtype=False)
    meta = read_trace_meta(tmp_path / "t.parquet", META)
    assert meta.extra["cached_prefix_tokens_skipped"] == "3" and meta.source.startswith("vllm")


def test_import_vllm_errors(tmp_path):
    export = tmp_path / "vllm.jsonl"
    export.write_text(json.dumps({"id": "x", "num_prompt_tokens": 1, "routed_experts": [[[1, 2, 3], [1, 2, 3]]]}) + "\n")
    with pytest.raises(TraceError, match=r"vllm.jsonl:1: field 'routed_experts' has shape \[1, 2, 3\], expected \[tokens, 2, 2\]"):
        import_vllm(export, tmp_path / "t.parquet", META)
    export.write_text('{"id": "x", "num_prompt_tokens": 1, "routed_experts": [[[1, 2], [1, 9]]]}\n{"id": 1\n')
    with pytest.raises(TraceError, match=r"vllm.jsonl:1: expert id 9 at token 0, MoE layer 1, rank 1"):
        import_vllm(export, tmp_path / "t.parquet", META)
    export.write_text('{"id": "x", "num_prompt_tokens": 1, "routed_experts": [[[1, 2], [1, 3]]]}\n{"id": 1\n')
    with pytest.raises(TraceError, match=r"vllm.jsonl:2: invalid JSON"):
        import_vllm(export, tmp_path / "t.parquet", META)
    export.write_text('{"id": "x", "routed_experts": []}\n')
    with pytest.raises(TraceError, match=r"vllm.jsonl:1: missing field 'num_prompt_tokens'"):
        import_vllm(export, tmp_path / "t.parquet", META)
    with pytest.raises(TraceError, match="no trace_meta header line and no model metadata"):
        import_vllm(export, tmp_path / "t.parquet")
    export.write_text('{"id": "x", "num_prompt_tokens": 1, "routed_experts": [[[1, 2], [1, 3]]], "split": "heldout"}\n'
                      '{"id": "y", "num_prompt_tokens": 1, "routed_experts": [[[1, 2], [1, 3]]]}\n')
    with pytest.raises(TraceError, match=r"vllm.jsonl:2: field 'split' must be on every request line or on none"):
        import_vllm(export, tmp_path / "t.parquet", META)
    export.write_text(json.dumps({"trace_meta": {"model": "toy", "num_layers": 4, "num_experts": 8, "top_k": 2,
                                                 "moe_layers": [1, 3]}}) + "\n")
    with pytest.raises(TraceError, match=r"vllm.jsonl: no request lines"):
        import_vllm(export, tmp_path / "t.parquet")
    assert not (tmp_path / "t.parquet").exists()


def test_import_sglang_matches_vllm(tmp_path):
    reqs = _vllm_requests()
    full = tmp_path / "sgl_full.jsonl"  # every layer of the model, dense layers included
    moe = tmp_path / "sgl_moe.jsonl"  # only the MoE layers, no shape given
    with open(full, "w") as f_full, open(moe, "w") as f_moe:
        for i, d, n, a in reqs:
            a32 = a.astype(np.int32)
            a32[a == 255] = -1  # (uint8 rows never hold -1 here)
            all_layers = np.full((a.shape[0], 4, 2), 0, dtype="<i4")
            all_layers[:, [1, 3]] = a32
            all_layers[(a32 == -1).all(axis=(1, 2))] = -1
            f_full.write(json.dumps({"id": i, "domain": d, "num_prompt_tokens": n, "split": "profile",
                                     "shape": list(all_layers.shape),
                                     "routed_experts": base64.b64encode(all_layers.tobytes()).decode()}) + "\n")
            f_moe.write(json.dumps({"id": i, "domain": d, "num_prompt_tokens": n, "split": "profile",
                                    "routed_experts": base64.b64encode(a32.astype("<i4").tobytes()).decode()}) + "\n")
    exp = pd.DataFrame([row for i, d, n, a in reqs for row in _long_rows(i, d, a.astype(int), n, "profile")])
    for src in (full, moe):
        rep = import_sglang(src, tmp_path / f"{src.stem}.parquet", META)
        assert rep.cached_prefix_tokens_skipped == 3
        got = _frame(tmp_path / f"{src.stem}.parquet")
        pd.testing.assert_frame_equal(got[exp.columns], exp, check_dtype=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "num_prompt_tokens": 1,
                               "routed_experts": base64.b64encode(np.zeros(6, "<i4").tobytes()).decode()}) + "\n")
    with pytest.raises(TraceError, match=r"bad.jsonl:1: 6 int32 values do not divide into \[tokens, 2, 2\]"):
        import_sglang(bad, tmp_path / "b.parquet", META)
    bad.write_text(json.dumps({"id": "x", "num_prompt_tokens": 1, "routed_experts": "@@@"}) + "\n")
    with pytest.raises(TraceError, match=r"bad.jsonl:1: field 'routed_experts' is not valid base64"):
        import_sglang(bad, tmp_path / "b.parquet", META)


def test_import_trace_dispatches_by_kind(tmp_path):
    reqs = _vllm_requests()
    vllm = tmp_path / "export.jsonl"
    vllm.write_text("".join(json.dumps({"id": i, "domain": d, "num_prompt_tokens": n, "routed_experts": a.tolist()}) + "\n"
                            for i, d, n, a in reqs))
    sgl = tmp_path / "export_sgl.jsonl"
    sgl.write_text("".join(json.dumps({"id": i, "domain": d, "num_prompt_tokens": n, "routed_experts":
                                       base64.b64encode(a.astype("<i4").tobytes()).decode()}) + "\n"
                           for i, d, n, a in reqs if a.dtype == np.uint8))
    model = {"num_experts": 8, "top_k": 2, "moe_layers": [1, 3], "num_layers": 4}
    rep = import_trace(vllm, tmp_path / "a.parquet", expect=model, model_name="toy")
    assert read_trace_meta(rep.path).source.startswith("vllm") and rep.cached_prefix_tokens_skipped == 3
    assert "split" not in pq.read_schema(rep.path).names  # no split in the export: readers assign it
    rep = import_trace(vllm, tmp_path / "h.parquet", expect=model, heldout_fraction=0.5)
    splits = dict(_frame(rep.path)[["request", "split"]].drop_duplicates().itertuples(index=False))
    assert splits == {i: split_of(i, 0.5) for i, *_ in reqs}
    rep = import_trace(sgl, tmp_path / "b.parquet", expect=model)
    assert read_trace_meta(rep.path).source.startswith("sglang") and rep.requests == 1
    rep = import_trace(tmp_path / "a.parquet", tmp_path / "c.parquet", expect=model)
    assert rep.requests == 2 and rep.rows == pq.ParquetFile(tmp_path / "a.parquet").metadata.num_rows
    assert (tmp_path / "c.parquet").read_bytes() == (tmp_path / "a.parquet").read_bytes()
    with pytest.raises(TraceError, match=r"a.parquet: trace metadata num_experts=8 disagrees with the model"):
        import_trace(tmp_path / "a.parquet", tmp_path / "d.parquet", expect={**model, "num_experts": 16})
    assert not (tmp_path / "d.parquet").exists()


# ---------------------------------------------------------------------------------------------
# capture with the embedded engine, checked against Hugging Face transformers' router


def test_capture_routing_matches_transformers_router(tmp_path, tiny_hf_checkpoint):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from coldset.trace.fixtures import Fixture, write_fixtures
    from coldset.engine.generate import encode_prompts
    from coldset.engine.loading import load_tokenizer
    from coldset.trace.capture import capture_routing

    ckpt = tiny_hf_checkpoint("qwen3_moe")  # layers 0 and 2 are MoE, layer 1 dense
    fixtures = [Fixture("a-0", "a", "profile", "The quick brown fox", 4),
                Fixture("a-1", "a", "heldout", "def add(a, b):\n    return", 4),
                Fixture("b-0", "b", "profile", '{"name": "get_weather"}', 3)]
    fx_path = write_fixtures(tmp_path / "fx.jsonl", fixtures)
    out = capture_routing(ckpt, [fx_path], tmp_path / "trace.parquet", batch_size=2, progress=False)
    meta = read_trace_meta(out)
    assert meta.moe_layers == [0, 2] and meta.top_k == 2 and meta.num_experts == 8
    df = _frame(out)
    assert set(df.split) == {"profile", "heldout"}
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tok = load_tokenizer(ckpt)
    for fx in fixtures:
        rows = df[df.request == fx.id]
        prompt = encode_prompts(tok, [fx.prompt])[0]
        n_prompt = len(prompt)
        # HF greedy continuation, then the router on prompt + generated[:-1] in one forward
        with torch.no_grad():
            ids = torch.tensor([prompt])
            for _ in range(fx.max_new_tokens):
                nxt = hf(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            seq = ids[:, : n_prompt + fx.max_new_tokens - 1]
            router = hf(seq, output_router_logits=True).router_logits
        assert rows.position.max() == n_prompt + fx.max_new_tokens - 2
        assert (rows[rows.position < n_prompt].phase == "prefill").all()
        assert (rows[rows.position >= n_prompt].phase == "decode").all()
        for li, layer in enumerate(meta.moe_layers):
            want = torch.topk(router[li].float(), 2, dim=-1).indices.numpy()  # [tokens, k], rank order
            got = rows[rows.layer == layer].sort_values(["position", "rank"]).expert.to_numpy().reshape(-1, 2)
            np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# issue 16 item 3: every reader goes through the one validator, which also checks whole tokens


def _raw_trace(path, table, meta=META):
    """Written with pyarrow directly: what an external tool may hand us (write_trace would refuse)."""
    pq.write_table(table.replace_schema_metadata(meta.to_metadata()), path, row_group_size=8)
    return path


@pytest.mark.parametrize("over,msg", [
    # every row relabelled to one MoE layer: each token then repeats its ranks
    ({"layer": np.ones(16, np.int16)}, r"request 'r0', position 0, layer 1 \(rows \[0, 1, 2, 3\]\) repeats a rank"),
    # one token selects expert 5 at both ranks
    ({"expert": np.r_[[1, 2, 3, 4, 5, 5], np.arange(10) % 8].astype(np.int16)},
     r"position 1, layer 1 \(rows \[4, 5\]\) selects the same expert twice \(\[5, 5\]\)"),
    # a top-2 trace whose row 6 says rank 0 again: the token at rows 6-7 misses rank 1
    ({"rank": np.r_[np.tile([0, 1], 3), [0, 0], np.tile([0, 1], 4)].astype(np.int8),
      "expert": np.r_[np.tile([0, 1], 3), [2, 3], np.tile([0, 1], 4)].astype(np.int16)},
     r"position 1, layer 3 \(rows \[6, 7\]\) repeats a rank"),
    ({"weight": np.full(16, np.nan, np.float32)}, r"row 0: column 'weight' holds router weight nan"),
    ({"domain": ["(all)"] * 16}, r"row 0: column 'domain' holds domain '\(all\)', not a valid name"),
    ({"domain": ["d"] * 8 + ["$\\frac{a$"] * 8}, r"row 8: column 'domain' holds domain"),
])
def test_validator_refuses_tokens_no_single_row_shows(tmp_path, over, msg):
    base = {"expert": np.tile([0, 1], 8).astype(np.int16)}
    path = _raw_trace(tmp_path / "bad.parquet", _table(**{**base, **over}))
    with pytest.raises(TraceError, match=msg):
        validate_trace(path)


def test_validator_refuses_a_token_missing_a_rank_at_the_end(tmp_path):
    # the last token of the file has rank 0 only (its rank-1 row was dropped)
    t = _table(expert=np.tile([0, 1], 8).astype(np.int16)).slice(0, 15)
    path = _raw_trace(tmp_path / "bad.parquet", t)
    with pytest.raises(TraceError, match=r"position 3, layer 3 \(rows \[14\]\) has ranks \[0\], missing some of 0..1"):
        validate_trace(path)


def test_validator_joins_a_token_split_across_row_groups(tmp_path):
    # 8-row groups starting at row 1: every row group boundary cuts a token in two; still valid
    t = _table(n=24, expert=np.tile([0, 1], 12).astype(np.int16))
    t = pa.concat_tables([t.slice(0, 1), t.slice(1)])
    path = tmp_path / "t.parquet"
    pq.write_table(t.replace_schema_metadata(META.to_metadata()).combine_chunks(), path, row_group_size=7)
    assert pq.ParquetFile(path).num_row_groups == 4
    assert validate_trace(path).top_k == 2


def test_writer_refuses_a_domain_that_is_not_a_name(tmp_path):
    ex = np.zeros((3, 2, 2), np.int16)
    ex[..., 1] = 1
    with pytest.raises(TraceError, match=r"domain '\.\./\.\./victim' is not a valid name"):
        with TraceWriter(tmp_path / "t.parquet", META, with_weight=False, with_split=False) as w:
            w.add(RequestRows("r0", "../../victim", ex, 2))
    assert not (tmp_path / "t.parquet").exists()
