"""The synthetic block-FP8 checkpoint (the published layout and keys) and the engine's FP8 loader:
the bytes and scales it keeps for the experts, the weights it dequantizes for the rest, against
transformers' own FP8 dequantization (``Fp8Dequantize``, which ``from_pretrained`` runs on a
CPU; the full ``from_pretrained`` needs accelerate, not installed here) and against e4m3 values
decoded from their bits; refusals naming the field or tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from coldset.core import fp8
from coldset.engine.generate import generate
from coldset.engine.loading import load_model
from coldset.engine.model import ModelLoadError
from coldset.engine.synthetic import SyntheticSpec, build_synthetic_model, write_synthetic_checkpoint

from test_fp8 import TABLE

TINY = dict(layers=2, experts=8, top_k=2, hidden=64, moe_intermediate=32, heads=2, kv_heads=1, head_dim=32,
            vocab_size=512, seed=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_synthetic_checkpoint(SyntheticSpec(**TINY, weight_format="fp8"), tmp_path_factory.mktemp("fp8") / "hf")


def _hf_dequant(q, s):
    mod = pytest.importorskip("transformers.integrations.finegrained_fp8")
    return mod.Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)


def test_checkpoint_has_the_published_layout(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    q = cfg["quantization_config"]
    assert {k: q[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == \
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert {"lm_head", "model.layers.0.mlp.gate", "model.layers.1.post_attention_layernorm"} <= set(q["modules_to_not_convert"])
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    for key, dt in dtypes.items():
        linear = key.endswith(("_proj.weight",))
        if key.endswith(".weight_scale_inv"):
            assert dt == "F32" and dtypes[key.replace("_scale_inv", "")] == "F8_E4M3"
        elif linear:
            assert dt == "F8_E4M3" and key + "_scale_inv" in dtypes, key
        else:
            assert dt == "F32", key  # norms, embeddings, router, lm_head
    assert dtypes["model.layers.0.mlp.gate.weight"] == "F32" and dtypes["lm_head.weight"] == "F32"


def test_loader_keeps_expert_bytes_and_dequantizes_the_rest_as_transformers(ckpt):
    model = load_model(ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    cfg, pools = model.config, model.pools
    assert pools.is_fp8 and pools.w13_hot.dtype == torch.float8_e4m3fn
    inter = cfg.moe_intermediate_size
    for layer in range(cfg.num_layers):
        pre = f"model.layers.{layer}"
        attn = model.layers[layer].self_attn
        want_qkv = torch.cat([_hf_dequant(tensors[f"{pre}.self_attn.{n}.weight"], tensors[f"{pre}.self_attn.{n}.weight_scale_inv"])
                              for n in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(attn.qkv_proj.weight, want_qkv)
        o = tensors[f"{pre}.self_attn.o_proj.weight"]
        assert torch.equal(attn.o_proj.weight, _hf_dequant(o, tensors[f"{pre}.self_attn.o_proj.weight_scale_inv"]))
        # independent: the e4m3 value of each byte times its block's scale (one partial block here),
        # exact in float64, rounded once to float32 (which is what float32's product gives)
        assert torch.equal(attn.o_proj.weight,
                           (TABLE[o.view(torch.uint8).long()] * float(tensors[f"{pre}.self_attn.o_proj.weight_scale_inv"])).float())
        assert torch.equal(model.layers[layer].mlp.gate.weight, tensors[f"{pre}.mlp.gate.weight"])
        for e in range(cfg.num_experts):
            base = f"{pre}.mlp.experts.{e}"
            w13, w2 = pools.expert_weights(layer, e)
            s13, s2 = pools.expert_scales(layer, e)
            gate, up = tensors[f"{base}.gate_proj.weight"], tensors[f"{base}.up_proj.weight"]
            assert torch.equal(w13.view(torch.uint8), torch.cat([gate, up]).view(torch.uint8))  # the bytes as stored
            assert torch.equal(w2.view(torch.uint8), tensors[f"{base}.down_proj.weight"].view(torch.uint8))
            deq = fp8.dequantize_w13(w13, s13)
            assert torch.equal(deq[:inter], _hf_dequant(gate, tensors[f"{base}.gate_proj.weight_scale_inv"]))
            assert torch.equal(deq[inter:], _hf_dequant(up, tensors[f"{base}.up_proj.weight_scale_inv"]))
            assert torch.equal(fp8.dequantize_weight(w2, s2),
                               _hf_dequant(tensors[f"{base}.down_proj.weight"], tensors[f"{base}.down_proj.weight_scale_inv"]))


def test_fp8_model_decodes_close_to_the_float_model(ckpt):
    spec = SyntheticSpec(**TINY)
    ref, tok = build_synthetic_model(spec, "cpu", torch.float32)
    model = load_model(ckpt)
    prompts = [tok.encode("def parse(x):").ids, tok.encode("The river").ids]
    got = generate(model, prompts, 4, progress=False, return_all_logits=True)
    want = generate(ref, prompts, 4, progress=False, return_all_logits=True)
    first = got.all_logits[:, 0].double()  # same prompt, before any token could differ
    err = float((first - want.all_logits[:, 0].double()).norm() / want.all_logits[:, 0].double().norm())
    assert torch.isfinite(got.all_logits).all() and 0 < err < 0.1, err


def test_partial_blocks_load_with_ceil_div_scale_grids(tmp_path):
    spec = SyntheticSpec(**{**TINY, "hidden": 200, "moe_intermediate": 136, "head_dim": 80}, weight_format="fp8")
    path = write_synthetic_checkpoint(spec, tmp_path / "hf")
    tensors = load_file(str(path / "model.safetensors"))
    s = tensors["model.layers.0.mlp.experts.0.down_proj.weight_scale_inv"]
    assert tuple(s.shape) == (2, 2)  # [200, 136] in 128 x 128 blocks, partial last ones
    model = load_model(path)
    w13, w2 = model.pools.expert_weights(1, 3)
    s13, s2 = model.pools.expert_scales(1, 3)
    assert tuple(s13.shape) == (4, 2) and tuple(s2.shape) == (2, 2)
    up = tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    us = tensors["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"]
    want = TABLE[up.view(torch.uint8).long()] * us.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:136, :200]
    assert torch.equal(fp8.dequantize_w13(w13, s13)[136:], want.float())


def _edited(ckpt, tmp_path, config_change=None, drop=None, edit=None):
    out = tmp_path / "edited"
    shutil.copytree(ckpt, out)
    if config_change:
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"].update(config_change)
        (out / "config.json").write_text(json.dumps(cfg))
    if drop or edit:
        tensors = load_file(str(out / "model.safetensors"))
        if drop:
            del tensors[drop]
        if edit:
            edit(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("change,match", [
    ({"weight_block_size": [64, 64]}, "weight_block_size"),
    ({"activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"fmt": "e5m2"}, "fmt 'e5m2'"),
])
def test_loader_refuses_unsupported_formats_by_name(ckpt, tmp_path, change, match):
    with pytest.raises(ModelLoadError, match=match):
        load_model(_edited(ckpt, tmp_path, config_change=change))


def test_loader_refuses_a_missing_scale_and_a_mislisted_module(ckpt, tmp_path):
    key = "model.layers.1.mlp.experts.5.down_proj.weight_scale_inv"
    with pytest.raises(ModelLoadError, match=f"missing tensor '{key}'"):
        load_model(_edited(ckpt, tmp_path, drop=key))
    shutil.rmtree(tmp_path / "edited")
    listed = json.loads((ckpt / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    edited = _edited(ckpt, tmp_path, config_change={"modules_to_not_convert": [m for m in listed if m != "model.layers.0.mlp.gate"]})
    with pytest.raises(ModelLoadError, match=r"model.layers.0.mlp.gate.weight is torch.float32; quantization_config converts it"):
        load_model(edited)


def test_loader_refuses_nan_weights_and_bad_scales_by_tensor(ckpt, tmp_path):
    """A NaN e4m3 byte (S.1111.111, either sign) in an expert, or a non-finite scale, is refused with
    the tensor's name: the weight-only kernel's bit conversion would read a NaN as a finite value."""
    key = "model.layers.1.mlp.experts.3.up_proj.weight"

    def nan_byte(tensors, sign):
        raw = tensors[key].view(torch.uint8).clone()
        raw[2, 5] = 0x7F | sign
        tensors[key] = raw.view(torch.float8_e4m3fn)

    for sign in (0x00, 0x80):
        with pytest.raises(ModelLoadError, match=rf"{key} holds 1 NaN float8 value\(s\) \(first at \[2, 5\]\)"):
            load_model(_edited(ckpt, tmp_path, edit=lambda t: nan_byte(t, sign)))
        shutil.rmtree(tmp_path / "edited")
    skey = "model.layers.0.mlp.experts.1.down_proj.weight_scale_inv"

    def inf_scale(tensors):
        tensors[skey] = tensors[skey].clone()
        tensors[skey].view(-1)[0] = float("inf")

    with pytest.raises(ModelLoadError, match=rf"{skey} holds non-finite or negative scales"):
        load_model(_edited(ckpt, tmp_path, edit=inf_scale))
    shutil.rmtree(tmp_path / "edited")
    # the largest finite e4m3 byte (0x7E, 448) is a value, not a NaN: it loads
    def max_byte(tensors):
        raw = tensors[key].view(torch.uint8).clone()
        raw[2, 5] = 0x7E
        tensors[key] = raw.view(torch.float8_e4m3fn)

    model = load_model(_edited(ckpt, tmp_path, edit=max_byte))
    assert model is not None
