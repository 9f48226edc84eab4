"""coldset.serve.vllm_plugin's engine-side refusals, without vLLM: ``check_engine`` on objects with
the attributes of vLLM 0.32's ``VllmConfig`` (``model_config``, ``parallel_config``; the field
names are checked against vLLM's own classes in tests_vllm/test_vllm_plugin.py). The plugin
serves one device's hot pool: pipeline parallelism and EPLB (which moves experts between devices
itself) must stop the engine by name, whatever else is set."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from coldset.serve.vllm_plugin import PluginError, ServedPlacement, check_engine
from coldset.verify.fingerprint import model_files

CONFIG = {"num_layers": 3, "moe_layers": [1, 2], "num_experts": 8, "hidden_size": 64,
          "moe_intermediate_size": 32, "dtype": "float32"}


@pytest.fixture
def served(tmp_path):
    """A placement served for a model folder (config.json only) whose manifest matches it."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    manifest = {"path": str(folder), "files": model_files(folder), "config": CONFIG}
    assert manifest["files"], "the manifest must list the folder's files for the check to mean anything"
    placement = SimpleNamespace(num_experts=8, moe_layers=(1, 2), policy="usage_global", num_hot=8, num_cold=8)
    return ServedPlacement(tmp_path / "placement" / "m" / "usage_global-0.5.json", placement,
                           tmp_path / "model" / "m" / "manifest.json", manifest,
                           tmp_path / "parity" / "m" / "usage_global-0.5.json")


def vllm_config(folder: Path, **parallel):
    hf = SimpleNamespace(num_hidden_layers=3, num_experts=8, hidden_size=64, moe_intermediate_size=32)
    par = dict(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1,
               enable_expert_parallel=False, enable_eplb=False)
    par.update(parallel)
    return SimpleNamespace(model_config=SimpleNamespace(model=str(folder), dtype="torch.float32", quantization=None,
                                                        hf_text_config=hf),
                           parallel_config=SimpleNamespace(**par))


def test_one_device_engine_accepted(served):
    check_engine(served, vllm_config(Path(served.manifest["path"])))


@pytest.mark.parametrize("size", [2, 4])
def test_pipeline_parallelism_refused_by_name(served, size):
    with pytest.raises(PluginError, match=rf": pipeline_parallel_size {size} is not supported yet .*run with 1"):
        check_engine(served, vllm_config(Path(served.manifest["path"]), pipeline_parallel_size=size))


def test_eplb_refused_by_name(served):
    with pytest.raises(PluginError, match=r": enable_eplb is not supported \(EPLB moves experts itself\)"):
        check_engine(served, vllm_config(Path(served.manifest["path"]), enable_eplb=True))


@pytest.mark.parametrize("parallel", [
    # what vLLM 0.32 itself requires before it enables EPLB: expert parallelism over TP or DP > 1
    dict(enable_eplb=True, enable_expert_parallel=True, tensor_parallel_size=2),
    dict(enable_eplb=True, enable_expert_parallel=True, data_parallel_size=2),
    dict(enable_eplb=True, enable_expert_parallel=True, tensor_parallel_size=2, pipeline_parallel_size=2),
    dict(pipeline_parallel_size=2, enable_expert_parallel=True),
], ids=["eplb-tp2", "eplb-dp2", "eplb-tp2-pp2", "pp2-ep"])
def test_eplb_and_pipeline_in_vllms_own_combinations_refused(served, parallel):
    """As vLLM accepts them (EPLB only with expert parallelism over several ranks), each combination
    stops the engine with one of the plugin's one-device refusals."""
    with pytest.raises(PluginError, match=r"(tensor_parallel_size|data_parallel_size|pipeline_parallel_size) \d+ "
                                          r"is not supported yet|enable_expert_parallel is not supported|"
                                          r"enable_eplb is not supported"):
        check_engine(served, vllm_config(Path(served.manifest["path"]), **parallel))
