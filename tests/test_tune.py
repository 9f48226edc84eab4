"""Autotune cache: miss then hit, a miss on any changed keyed input, damaged entries re-tuned with a
warning, atomic writes, and the default config (with a warning) for an untuned batch size."""

from __future__ import annotations

import json
import time
import warnings

import pytest

from coldset.kernels import tune
from coldset.kernels.tune import AutotuneCacheWarning, TuneShape, autotune, autotune_key, config_for

SHAPE = TuneShape(num_experts=4, hidden=16, intermediate=8, top_k=2, dtype="float32",
                  num_moe_layers=2, num_hot=6, num_cold=2)
SPACE = {"decode_max_tokens": 2, "decode": [{"token_chunk": None}],
         "prefill": [{"token_chunk": None}, {"token_chunk": 1}]}


def run(cache, **kw):
    args = dict(shape=SHAPE, batch_sizes=[1, 5], device="cpu", cache_dir=cache, search_space=SPACE, reps=1)
    args.update(kw)
    return autotune(**args)


def test_miss_then_hit_returns_the_same_configs_quickly(tmp_path):
    first = run(tmp_path)
    assert not first.hit and first.path.exists() and first.path.parent == tmp_path
    assert set(first.configs) == {1, 5}
    assert first.configs[1] == {"token_chunk": None}  # the only decode candidate
    assert first.configs[5] in SPACE["prefill"]
    assert set(first.timings_us[5]) == {json.dumps(c, sort_keys=True, separators=(",", ":")) for c in SPACE["prefill"]}
    t0 = time.perf_counter()
    second = run(tmp_path)
    assert second.hit and time.perf_counter() - t0 < 2.0
    assert second.key == first.key and second.configs == first.configs
    assert [p.name for p in tmp_path.iterdir()] == [f"{first.key}.json"]  # no temp files left


def test_key_changes_with_every_keyed_input(monkeypatch):
    base = autotune_key(SHAPE, [1, 5], "cpu", SPACE)
    assert autotune_key(SHAPE, [5, 1], "cpu", SPACE) == base  # order of batch sizes is not an input
    variants = [
        autotune_key(SHAPE, [1, 6], "cpu", SPACE),
        autotune_key(SHAPE, [1, 5], "cpu", {**SPACE, "prefill": [{"token_chunk": 2}]}),
        autotune_key(TuneShape(**{**SHAPE.__dict__, "intermediate": 12}), [1, 5], "cpu", SPACE),
        autotune_key(TuneShape(**{**SHAPE.__dict__, "dtype": "bfloat16"}), [1, 5], "cpu", SPACE),
        autotune_key(TuneShape(**{**SHAPE.__dict__, "num_hot": 5, "num_cold": 3}), [1, 5], "cpu", SPACE),
        autotune_key(TuneShape(**{**SHAPE.__dict__, "top_k": 3}), [1, 5], "cpu", SPACE),
    ]
    assert len({base, *variants}) == len(variants) + 1
    # kernel source text, an imported module's text, and the torch version are keyed too
    real = tune._module_source
    monkeypatch.setattr(tune, "_module_source", lambda m: real(m) + ("\n# edit" if m == "coldset.kernels.tiers" else ""))
    assert autotune_key(SHAPE, [1, 5], "cpu", SPACE) != base
    monkeypatch.setattr(tune, "_module_source", real)
    monkeypatch.setattr(tune.torch, "__version__", "0.0.0-other")
    assert autotune_key(SHAPE, [1, 5], "cpu", SPACE) != base


def test_changed_input_is_a_miss(tmp_path):
    run(tmp_path)
    other = run(tmp_path, batch_sizes=[1, 3])
    assert not other.hit
    assert len(list(tmp_path.glob("*.json"))) == 2


@pytest.mark.parametrize("damage", ["garbage", "truncated", "edited", "wrong_key"])
def test_damaged_entry_is_retuned_with_a_warning(tmp_path, damage):
    first = run(tmp_path)
    text = first.path.read_text()
    entry = json.loads(text)
    if damage == "garbage":
        first.path.write_bytes(b"\x00\xffnot json")
    elif damage == "truncated":
        first.path.write_text(text[: len(text) // 2])
    elif damage == "edited":  # a plausible but altered config: the checksum catches it
        entry["configs"]["5"] = {"token_chunk": 999}
        first.path.write_text(json.dumps(entry))
    else:  # another key's (valid) entry under this file name
        entry["key"] = "0" * 64
        entry["checksum"] = tune._checksum(entry)
        first.path.write_text(json.dumps(entry))
    with pytest.warns(AutotuneCacheWarning, match="damaged or mismatched"):
        again = run(tmp_path)
    assert not again.hit and again.configs[5] in SPACE["prefill"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run(tmp_path).hit  # the re-tuned entry is valid again


def test_config_for_default_with_warning(tmp_path):
    result = run(tmp_path)
    assert config_for(result, 5) == result.configs[5]
    with pytest.warns(AutotuneCacheWarning, match="no tuned config for batch size 7"):
        assert config_for(result, 7) == {"token_chunk": None}
    # once per result and batch size: every placement's experts function meets the same untuned sizes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config_for(result, 7) == {"token_chunk": None}
    with pytest.warns(AutotuneCacheWarning, match="no tuned config for batch size 9"):
        config_for(result, 9)


def test_tuned_experts_follows_the_contract(tmp_path):
    import torch

    from coldset.kernels import torch_experts
    from coldset.kernels.tiers import ExpertPools

    result = run(tmp_path)
    fn = tune.tuned_experts(result)
    g = torch.Generator().manual_seed(0)
    pools = ExpertPools.all_hot(torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 4, 16, 8, generator=g))
    x = torch.randn(5, 16, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1]])
    w = torch.full((5, 2), 0.5)
    torch.testing.assert_close(fn(pools, 1, x, ids, w), torch_experts(pools, 1, x, ids, w), rtol=1e-5, atol=1e-5)


def test_default_cache_dir_is_configurable_and_outside_results(monkeypatch, tmp_path):
    monkeypatch.setenv("COLDSET_AUTOTUNE_CACHE", str(tmp_path / "c"))
    assert tune.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("COLDSET_AUTOTUNE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert tune.default_cache_dir() == tmp_path / "x" / "coldset" / "autotune"
    assert "results" not in tune.default_cache_dir().parts


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        TuneShape(4, 16, 8, 2, "int8", 2, 8, 0)
    with pytest.raises(ValueError, match="cannot hold"):
        TuneShape(4, 16, 8, 2, "float32", 2, 4, 2)
    with pytest.raises(ValueError, match="batch_sizes"):
        autotune(SHAPE, [], "cpu")


@pytest.mark.gpu
def test_triton_autotune_on_gpu_hits_the_cache(tmp_path):
    shape = TuneShape(num_experts=16, hidden=256, intermediate=128, top_k=4, dtype="bfloat16",
                      num_moe_layers=2, num_hot=24, num_cold=8)
    space = {"decode_max_tokens": 4,
             "decode": [dict(block_m=16, block_n1=32, block_k1=64, block_n2=32, block_k2=64, num_warps=4, num_stages=3),
                        dict(block_m=16, block_n1=64, block_k1=128, block_n2=64, block_k2=128, num_warps=4, num_stages=3,
                             slot_max_pairs=1)],
             "prefill": [dict(block_m=64, block_n1=64, block_k1=64, block_n2=64, block_k2=64, num_warps=4, num_stages=3)]}
    first = autotune(shape, [1, 4, 100], "cuda", cache_dir=tmp_path, search_space=space, reps=3)
    assert not first.hit and first.backend == "triton" and set(first.configs) == {1, 4, 100}
    assert all(len(first.timings_us[b]) == (1 if b == 100 else 2) for b in first.configs)
    t0 = time.perf_counter()
    second = autotune(shape, [1, 4, 100], "cuda", cache_dir=tmp_path, search_space=space)
    assert second.hit and second.configs == first.configs and time.perf_counter() - t0 < 5


def test_kernel_configs_are_json_data_beside_the_kernels():
    """coldset.kernels.configs: one JSON file per Triton kernel module, its defaults (decode,
    prefill) and its search space; every entry names KernelConfig fields only (read from the
    kernel's source: no triton needed), with integer values, and the tuner's search spaces are
    those lists."""
    import ast

    from coldset.kernels.configs import HERE, load

    src = (HERE.parent / "triton_moe.py").read_text()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "KernelConfig")
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    assert {p.name for p in HERE.glob("*.json")} == {"triton_moe.json", "triton_fp8.json", "triton_mxfp4.json"}
    mx = load("triton_mxfp4")  # the MXFP4 kernel's (coldset.kernels.triton_mxfp4; not autotuned: its own search space)
    assert set(mx) == {"defaults", "search_space"}
    assert set(mx["defaults"]) == {"cuda_decode", "cuda_mma", "few_tokens", "decode", "prefill"}
    for entry in [*mx["defaults"].values(), *mx["search_space"]["decode"], *mx["search_space"]["prefill"]]:
        assert set(entry) <= fields and all(type(v) is int for v in entry.values()), ("triton_mxfp4", entry)
    for kernel, space in (("triton_moe", tune.TRITON_SEARCH_SPACE), ("triton_fp8", tune.TRITON_FP8_SEARCH_SPACE)):
        data = load(kernel)
        assert set(data) == {"defaults", "search_space"} and set(data["defaults"]) == {"decode", "prefill"}
        assert space == {"decode_max_tokens": tune.DECODE_MAX_TOKENS, **data["search_space"]}
        entries = [*data["defaults"].values(), *data["search_space"]["decode"], *data["search_space"]["prefill"]]
        for entry in entries:
            assert set(entry) <= fields and all(type(v) is int for v in entry.values()), (kernel, entry)
