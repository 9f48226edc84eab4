"""coldset's vLLM plugin (coldset.serve.vllm_plugin) on real vLLM (the PyPI CPU build).

The workflow runs up to its parity gate on the default synthetic checkpoint (conftest's
``gated_workflow``). vLLM's OpenAI-compatible server is started once per configuration with
``python -m vllm.entrypoints.openai.api_server`` (the CPU build has no ``vllm serve``): without the
plugin (installed, not asked for) and with ``COLDSET_PLACEMENT`` naming usage_global-0.5,
positional-0.5 and the all-cold positional-0.0. A plain urllib client sends a two-prompt
completions request and a chat request at temperature 0; every configuration's tokens must equal
the stock server's and coldset's embedded engine decoding the same prompt tokens at that
placement. Offline ``LLM.generate`` the same, with the worker's memory report. Bad placements and
engine settings are refused at start-up by name.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import PLUGIN_PLACEMENTS, ServerProcess, coldset_env, embedded_tokens, plugin_lines

MAX_TOKENS = 6
CHAT = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PROMPT_TEXTS = ('{"name": "get_weather", "arguments": {"city": "Paris"}}',
                "def add(a, b):\n    return a + b")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def server_command(model_dir: Path, port: int, chat_template: Path, dtype: str = "float32") -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", "m", "--dtype", dtype, "--max-model-len", "512",
            "--kv-cache-memory-bytes", str(256 << 20), "--enforce-eager", "--host", "127.0.0.1",
            "--port", str(port), "--chat-template", str(chat_template)]


class Server(ServerProcess):
    """One api_server process on a free loopback port, with or without a placement."""

    def __init__(self, model_dir: Path, log: Path, chat_template: Path, placement: Path | None, dtype="float32"):
        self.port = _free_port()
        env = coldset_env()
        env.pop("COLDSET_PLACEMENT", None)
        if placement is not None:
            env["COLDSET_PLACEMENT"] = str(placement)
        super().__init__(server_command(model_dir, self.port, chat_template, dtype), log, env,
                         f"http://127.0.0.1:{self.port}")


def _requests(base: str, prompts: list[list[int]]) -> dict:
    common = {"model": "m", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    comp = _post(base, "/v1/completions", {**common, "prompt": prompts})
    chat = _post(base, "/v1/chat/completions", {**common, "messages": CHAT})
    choices = sorted(comp["choices"], key=lambda c: c["index"])
    return {"completion_prompts": [c["prompt_token_ids"] for c in choices],
            "completion": [c["token_ids"] for c in choices],
            "chat_prompt": chat["prompt_token_ids"], "chat": chat["choices"][0]["token_ids"],
            "completion_response": comp, "chat_response": chat}


@pytest.fixture(scope="module")
def prompts(gated_workflow) -> list[list[int]]:
    from coldset.engine.generate import encode_prompts
    from coldset.engine.loading import load_tokenizer

    return encode_prompts(load_tokenizer(gated_workflow["model_dir"]), list(PROMPT_TEXTS))


@pytest.fixture(scope="module")
def served(gated_workflow, prompts, tmp_path_factory):
    """Each configuration's server run: its responses and its log."""
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("served")
    template = root / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    runs = {}
    for name in (None, *PLUGIN_PLACEMENTS):
        placement = None if name is None else gated_workflow["placement_dir"] / f"{name}.json"
        server = Server(gated_workflow["model_dir"], root / f"{name or 'stock'}.log", template, placement)
        try:
            assert server.wait_ready(), f"server {name or 'stock'} exited at start:\n{server.text()[-6000:]}"
            runs[name or "stock"] = {**_requests(server.base, prompts), "log": None}
        finally:
            server.stop()
        runs[name or "stock"]["log"] = server.text()
    return runs


def _memory_line(log: str) -> tuple[int, int]:
    m = re.search(r"coldset: placement \S+ served: routed experts held on cpu: (\d+) bytes in the layers before, "
                  r"(\d+) bytes in the hot pool after", log)
    assert m, "the plugin's memory line is missing from the server log"
    return int(m.group(1)), int(m.group(2))


def test_plugin_installed_as_vllm_general_plugin():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("coldset") == "coldset.serve.vllm_plugin:register"


def test_installed_but_not_asked_for_changes_nothing(served, gated_workflow, prompts):
    stock = served["stock"]
    # the plugin said nothing: no line of its own, looked for outside the paths vLLM prints; those
    # hold the word here (gated_workflow runs in a folder named coldset, as a default clone does)
    assert "coldset" in stock["log"] and plugin_lines(stock["log"]) == []
    assert "COLDSET_PLACEMENT" not in stock["log"]
    ref = embedded_tokens(gated_workflow["model_dir"], gated_workflow["placement_dir"], None,
                          stock["completion_prompts"] + [stock["chat_prompt"]], MAX_TOKENS)
    assert stock["completion_prompts"] == prompts
    assert stock["completion"] + [stock["chat"]] == ref  # stock vLLM decodes what coldset's engine does


@pytest.mark.parametrize("name", PLUGIN_PLACEMENTS)
def test_server_tokens_equal_stock_and_embedded(served, gated_workflow, name):
    from coldset.core.placement import load_placement

    run, stock = served[name], served["stock"]
    assert f"coldset: serving placement {gated_workflow['placement_dir'] / name}.json" in run["log"]
    said = plugin_lines(run["log"])  # what the stock server's check looks for, found where the plugin speaks
    assert any("coldset: serving placement" in line for line in said), said
    assert any("coldset: placement" in line and "served: routed experts" in line for line in said), said
    assert run["completion_prompts"] == stock["completion_prompts"] and run["chat_prompt"] == stock["chat_prompt"]
    got = run["completion"] + [run["chat"]]
    assert all(len(t) == MAX_TOKENS for t in got)
    assert got == stock["completion"] + [stock["chat"]], f"{name}: plugin tokens differ from stock vLLM's"
    ref = embedded_tokens(gated_workflow["model_dir"], gated_workflow["placement_dir"], name,
                          run["completion_prompts"] + [run["chat_prompt"]], MAX_TOKENS)
    assert got == ref, f"{name}: plugin tokens differ from coldset's embedded engine at this placement"
    before, hot = _memory_line(run["log"])
    pl = load_placement(gated_workflow["placement_dir"] / f"{name}.json")
    assert before == (pl.num_hot + pl.num_cold) * pl.bytes_per_expert  # every routed expert, float32
    assert hot == pl.num_hot * pl.bytes_per_expert  # the hot pool: the placement's hot share only


#: vLLM 0.32's log line when it saves a compiled model (vllm/compilation/decorators.py), with the
#: cache root and the compile-cache key (VllmConfig.compute_hash() among its factors).
AOT_SAVED = re.compile(r"saved AOT compiled function to (\S+)/torch_compile_cache/torch_aot_compile/(\w+)/")


def test_vllm_parity_stage(gated_workflow, tmp_path, monkeypatch):
    """The rule's stage (coldset.workflow.vllm_parity, offline LLM.generate in a process per run) on the
    gated workflow, restricted to one placement: tokens equal to the embedded engine's and stock
    vLLM's, the plugin's classes in place, coldset's experts op called, the layers' expert tensors
    freed.

    The stage gives each run a vLLM cache of its own; here its runs, stock vLLM compiled and then
    the plugin compiled, share one VLLM_CACHE_ROOT (a user's warm cache): the plugin run compiles and
    saves its own graph under another key than stock's (vLLM's additional_config holds the placement:
    coldset.serve.vllm_plugin.key_compile_cache) and never tries stock's. With stock's key it would
    load stock's graph wherever vLLM can load one (vLLM checks only the sources that graph traced):
    vLLM's experts on the layers' freed tensors, or stock compared with stock."""
    pytest.importorskip("vllm")
    from coldset.workflow import vllm_parity as stage
    from coldset.workflow.config import load_config
    from coldset.workflow.pipeline import run_stage
    from coldset.core.placement import load_placement

    cache, runs, run_vllm = tmp_path / "vllm-cache", [], stage.run_vllm

    def run_in_one_cache(*args, cache_root=None, **kwargs):
        assert cache_root is None  # the stage's own runs: each in a cache of its own (run_vllm's default)
        runs.append(run_vllm(*args, cache_root=cache, **kwargs))
        return runs[-1]

    monkeypatch.setattr(stage, "run_vllm", run_in_one_cache)
    config = load_config(gated_workflow["config"])
    config["placement"]["policies"], config["placement"]["residency"] = ["usage_global"], [0.5]
    run_stage(stage.vllm_parity, config)
    report = json.loads((gated_workflow["results"] / "parity" / "synthetic-moe" / "vllm.json").read_text())
    assert report["passed"] and report["vllm_version"].startswith("0.32")
    stock, got = report["stock"], report["placements"]["usage_global-0.5"]
    assert stock["classes"] == ["RoutedExperts/UnquantizedFusedMoEMethod"]  # not asked for: vLLM's own
    assert stock["memory"] == {"active": False, "built": False}
    assert got["classes"] == ["ColdsetRoutedExperts/ColdsetMoEMethod"]
    assert got["tokens_matched"] == got["tokens_total"] == report["fixtures"] * report["max_new_tokens"] > 0
    assert got["equal_to_stock_vllm"] and stock["tokens_matched"] == stock["tokens_total"]
    assert stock["experts_calls"] == 0 and got["experts_calls"] > 0  # coldset's op ran in the plugin's run only
    mem = got["memory"]
    pl = load_placement(gated_workflow["placement_dir"] / "usage_global-0.5.json")
    assert mem["layer_expert_bytes_after"] == 0  # the layers' full expert tensors are freed
    assert mem["layer_expert_bytes_before"] == (pl.num_hot + pl.num_cold) * pl.bytes_per_expert
    assert mem["hot_pool_bytes"] == pl.num_hot * pl.bytes_per_expert == mem["layer_expert_bytes_before"] // 2
    # stock, then the plugin, in one cache: each compiled and saved its graph, under keys of their own
    saved = [AOT_SAVED.findall(run["log"]) for run in runs]
    assert [[root for root, _ in s] for s in saved] == [[str(cache)], [str(cache)]], saved
    stock_key, plugin_key = saved[0][0][1], saved[1][0][1]
    assert plugin_key != stock_key, "the plugin's compiled graph has stock vLLM's compile-cache key"
    assert sorted(p.name for p in (cache / "torch_compile_cache" / "torch_aot_compile").iterdir()) == sorted(
        [stock_key, plugin_key])
    assert "Directly load" not in runs[1]["log"] and "load failure" not in runs[1]["log"], runs[1]["log"][-4000:]


def test_compile_cache_key_names_the_placement(gated_workflow):
    """The entry the plugin puts in vLLM's additional_config differs between placements and is
    refused where additional_config cannot hold it."""
    from coldset.serve.vllm_plugin import (COMPILE_CACHE_KEY, PluginError, compile_cache_identity,
                                           key_compile_cache, load_served_placement)

    served = {n: load_served_placement(gated_workflow["placement_dir"] / f"{n}.json") for n in PLUGIN_PLACEMENTS}
    identities = {n: compile_cache_identity(s) for n, s in served.items()}
    assert len({json.dumps(i, sort_keys=True) for i in identities.values()}) == len(PLUGIN_PLACEMENTS)
    assert len({i["row_map_sha256"] for i in identities.values()}) == len(PLUGIN_PLACEMENTS)
    name = PLUGIN_PLACEMENTS[0]
    config = SimpleNamespace(additional_config={"other": 1})
    key_compile_cache(served[name], config)
    assert config.additional_config == {"other": 1, COMPILE_CACHE_KEY: identities[name]}
    key_compile_cache(served[name], config)  # the same placement again (another layer, another call)
    with pytest.raises(PluginError, match="already has an entry 'coldset'"):
        key_compile_cache(served[PLUGIN_PLACEMENTS[1]], config)
    with pytest.raises(PluginError, match="additional_config is a SimpleNamespace, not a dict"):
        key_compile_cache(served[name], SimpleNamespace(additional_config=SimpleNamespace()))


def test_compare_tokens_counts_divergence_and_length():
    from coldset.workflow.vllm_parity import compare_tokens

    want = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert compare_tokens(want, want, ["a", "b"])["passed"]
    r = compare_tokens([[1, 2, 3, 4], [5, 9, 7, 8]], want, ["a", "b"])
    assert not r["passed"] and r["tokens_matched"] == 5 and r["first_mismatch"]["fixture"] == "b"
    short = compare_tokens([[1, 2, 3], [5, 6, 7, 8]], want, ["a", "b"])  # one token short is not a match
    assert not short["passed"] and short["tokens_matched"] == 7 and short["first_mismatch"]["position"] == 3


# ------------------------------------------------------------------------------------ refusals


def _copy_results(gated_workflow, dst: Path) -> Path:
    """The placement, parity, manifest and autotune files of the workflow in a folder of their own
    (the manifest still names the model folder), to spoil one of them."""
    src = gated_workflow["results"]
    for sub in ("placement", "parity", "autotune"):
        shutil.copytree(src / sub, dst / sub)
    (dst / "model" / "synthetic-moe").mkdir(parents=True)
    shutil.copy2(src / "model" / "synthetic-moe" / "manifest.json", dst / "model" / "synthetic-moe" / "manifest.json")
    return dst / "placement" / "synthetic-moe"


def _edit_json(path: Path, **changes) -> None:
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


def test_bad_placements_refused_by_name(gated_workflow, tmp_path, monkeypatch):
    from coldset.serve.vllm_plugin import PluginError, load_served_placement

    pdir = _copy_results(gated_workflow, tmp_path / "results")
    name = "usage_global-0.5"
    assert load_served_placement(pdir / f"{name}.json").placement.policy == "usage_global"
    parity = tmp_path / "results" / "parity" / "synthetic-moe"
    cases = []
    # parity report missing
    (parity / "positional-0.5.json").unlink()
    cases.append(("positional-0.5", "no parity report"))
    # parity report failed (its flag, or its counts)
    _edit_json(parity / "usage_global-0.0.json", tokens_matched=0)
    cases.append(("usage_global-0.0", "did not pass"))
    # a stale report: the kernel entry it checked was rewritten
    auto = tmp_path / "results" / "autotune" / "synthetic-moe.json"
    doc = json.loads(auto.read_text())
    doc["configs"] = {"spoiled": 1}
    auto.write_text(json.dumps(doc))
    cases.append((name, "is stale"))
    for placement, message in cases:
        with pytest.raises(PluginError, match=message) as err:
            load_served_placement(pdir / f"{placement}.json")
        assert "COLDSET_PLACEMENT" in str(err.value)
    # a dynamic placement
    _edit_json(pdir / "positional-0.0.json", policy="lru", cache_warm_counts=[])
    with pytest.raises(PluginError, match="dynamic"):
        load_served_placement(pdir / "positional-0.0.json")
    # an edited row map (the pair's sha256 no longer matches)
    npy = pdir / "usage_global-0.5.rowmap.npy"
    npy.write_bytes(npy.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(PluginError, match="sha256"):
        load_served_placement(pdir / "usage_global-0.5.json")


def test_engine_settings_refused_by_name(gated_workflow, tmp_path):
    """The engine-side checks against vLLM's config (attribute names as in vLLM 0.32's
    ModelConfig/ParallelConfig, which the server runs above exercise on the real objects)."""
    from coldset.serve.vllm_plugin import PluginError, check_engine, check_vllm_version, load_served_placement

    served = load_served_placement(gated_workflow["placement_dir"] / "usage_global-0.5.json")
    cfg = served.manifest["config"]
    hf = SimpleNamespace(num_hidden_layers=cfg["num_layers"], num_experts=cfg["num_experts"],
                         hidden_size=cfg["hidden_size"], moe_intermediate_size=cfg["moe_intermediate_size"])

    def config(model=gated_workflow["model_dir"], dtype="torch.float32", quantization=None, hf_cfg=hf, **parallel):
        par = dict(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1,
                   enable_expert_parallel=False, enable_eplb=False)
        par.update(parallel)
        return SimpleNamespace(model_config=SimpleNamespace(model=str(model), dtype=dtype, quantization=quantization,
                                                            hf_text_config=hf_cfg),
                               parallel_config=SimpleNamespace(**par))

    check_engine(served, config())  # the model the placement was made for
    copy = tmp_path / "copy"
    shutil.copytree(gated_workflow["model_dir"], copy, copy_function=shutil.copy)  # same bytes, new mtimes
    other = SimpleNamespace(**{**vars(hf), "num_experts": 64})
    for cfg_, message in [
        (config(model=copy), "not the model the placement was made for"),
        (config(model="Qwen/Qwen3-30B-A3B"), "not a local folder"),
        (config(dtype="torch.bfloat16"), "dtype 'bfloat16'"),
        (config(hf_cfg=other), "num_experts 64"),
        (config(tensor_parallel_size=2), "tensor_parallel_size 2"),
        (config(pipeline_parallel_size=2), "pipeline_parallel_size 2 is not supported"),
        (config(enable_eplb=True), "enable_eplb is not supported"),
        (config(enable_expert_parallel=True), "enable_expert_parallel"),
        (config(data_parallel_size=2), "data_parallel_size 2"),
        (config(quantization="fp8"), "quantization 'fp8'"),
    ]:
        with pytest.raises(PluginError, match=message):
            check_engine(served, cfg_)
    check_vllm_version("0.32.0")
    with pytest.raises(PluginError, match="vLLM 0.33.1 is not a tested version"):
        check_vllm_version("0.33.1")


def test_engine_checks_read_vllms_own_parallel_config(gated_workflow):
    """The settings check_engine reads are vLLM 0.32's ParallelConfig fields (a misspelt one would
    read as its default and never refuse): real ParallelConfigs, beside the model config above,
    with pipeline parallelism and with EPLB (vLLM builds that one only on CUDA with expert
    parallelism over several ranks, so it is set on the object here) are refused by name."""
    pytest.importorskip("vllm")
    from dataclasses import fields

    from vllm.config import ParallelConfig

    from coldset.serve.vllm_plugin import PluginError, check_engine, load_served_placement

    read = {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "enable_expert_parallel",
            "enable_eplb"}
    assert read <= {f.name for f in fields(ParallelConfig)}
    served = load_served_placement(gated_workflow["placement_dir"] / "usage_global-0.5.json")
    cfg = served.manifest["config"]
    hf = SimpleNamespace(num_hidden_layers=cfg["num_layers"], num_experts=cfg["num_experts"],
                         hidden_size=cfg["hidden_size"], moe_intermediate_size=cfg["moe_intermediate_size"])
    model = SimpleNamespace(model=str(gated_workflow["model_dir"]), dtype="torch.float32", quantization=None,
                            hf_text_config=hf)
    check_engine(served, SimpleNamespace(model_config=model, parallel_config=ParallelConfig()))
    eplb = ParallelConfig()
    object.__setattr__(eplb, "enable_eplb", True)
    for parallel, message in [(ParallelConfig(pipeline_parallel_size=2), "pipeline_parallel_size 2 is not supported"),
                              (eplb, "enable_eplb is not supported")]:
        with pytest.raises(PluginError, match=message):
            check_engine(served, SimpleNamespace(model_config=model, parallel_config=parallel))


def test_bad_start_fails_the_server_with_the_message(gated_workflow, tmp_path):
    """Through the real server: a failed parity report (refused in the API server's own process,
    before any engine starts) and a good placement served at another dtype (refused where the
    model is built)."""
    pytest.importorskip("vllm")
    pdir = _copy_results(gated_workflow, tmp_path / "results")
    _edit_json(tmp_path / "results" / "parity" / "synthetic-moe" / "usage_global-0.5.json", passed=False)
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    for placement, dtype, message in [
        (pdir / "usage_global-0.5.json", "float32", "did not pass"),
        (gated_workflow["placement_dir"] / "positional-0.5.json", "bfloat16", "dtype 'bfloat16'"),
    ]:
        server = Server(gated_workflow["model_dir"], tmp_path / f"bad-{dtype}.log", template, placement, dtype)
        try:
            assert not server.wait_ready(), f"the server started with a bad placement ({message})"
        finally:
            server.stop()
        assert server.proc.returncode != 0
        log = server.text()
        assert "PluginError" in log and message in log, log[-4000:]


def test_importer_reads_real_vllm_responses_per_choice(served, gated_workflow, tmp_path):
    """The importer on real vLLM 0.32 responses (the stock server's, above): a two-prompt
    completions response's usage.prompt_tokens is the total over its prompts, so the importer takes
    each choice's prompt_token_ids; with routed_experts attached as vLLM writes them (every layer,
    prompt + completion - 1 rows; the CPU build cannot return them itself) the rows import with each
    choice's own prefill/decode split, and without token ids the response is refused."""
    import base64
    import io

    import numpy as np
    import pyarrow.parquet as pq

    from coldset.trace.importers import import_trace
    from coldset.engine.model import ModelConfig
    from coldset.core.trace import TraceError

    cfg = ModelConfig.from_pretrained(gated_workflow["model_dir"])
    comp = json.loads(json.dumps(served["stock"]["completion_response"]))
    lengths = [(len(c["prompt_token_ids"]), len(c["token_ids"])) for c in comp["choices"]]
    assert comp["usage"]["prompt_tokens"] == sum(p for p, _ in lengths)  # the total, not a choice's
    rng = np.random.default_rng(0)
    for choice, (p, c) in zip(comp["choices"], lengths):
        arr = np.stack([np.stack([rng.choice(cfg.num_experts, cfg.top_k, replace=False)
                                  for _ in range(cfg.num_layers)]) for _ in range(p + c - 1)]).astype(np.uint8)
        buf = io.BytesIO()
        np.save(buf, arr)
        choice["routed_experts"] = base64.b64encode(buf.getvalue()).decode()
    path = tmp_path / "resp.json"
    path.write_text(json.dumps(comp))
    rep = import_trace(path, tmp_path / "t.parquet", expect=cfg)
    df = pq.read_table(rep.path).to_pandas()
    for i, (p, c) in enumerate(lengths):
        req = df[df["request"] == f"{comp['id']}/{i}"]
        per_token = cfg.num_moe_layers * cfg.top_k
        assert (req["phase"] == "prefill").sum() == p * per_token
        assert (req["phase"] == "decode").sum() == (c - 1) * per_token
    for choice in comp["choices"]:
        del choice["prompt_token_ids"], choice["token_ids"]
    path.write_text(json.dumps(comp))
    with pytest.raises(TraceError, match="return_token_ids"):
        import_trace(path, tmp_path / "u.parquet", expect=cfg)
