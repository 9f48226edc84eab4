"""Loading the embedded engine: a local Hugging Face folder into a :class:`~coldset.engine.model.MoEModel`.

The folder's config.json (:meth:`ModelConfig.from_pretrained`), its safetensors (one file, an index
of shards, or bare shards), read tensor by tensor with shapes checked before reading, and its
tokenizer.json. Block-FP8 checkpoints (:mod:`coldset.core.fp8`) keep their routed experts in FP8;
:func:`attach_fp8_attention` makes an in-memory model's attention FP8 the same way. Errors are
:class:`~coldset.engine.model.ModelLoadError`, naming the file, field or tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing
from torch import nn

from coldset.core import fp8, mxfp4
from coldset.engine import deepseek_v3, glm4_moe, gpt_oss
from coldset.engine.model import SUPPORTED_MODEL_TYPES, ModelConfig, ModelLoadError, MoEBlock, MoEModel
from coldset.engine.weights import put_shared_weights
from coldset.kernels.tiers import ExpertPools


class _TensorSource:
    """Lazy access to the tensors of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, folder: Path):
        self._safe_open = safe_open
        self._handles: dict[Path, object] = {}
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ModelLoadError(f"{index}: not a valid safetensors index ({err})") from err
            self.key_to_file = {k: folder / v for k, v in weight_map.items()}
        elif single.is_file():
            self.key_to_file = {k: single for k in self._open(single).keys()}
        else:
            shards = sorted(folder.glob("*.safetensors"))
            if not shards:
                raise ModelLoadError(
                    f"{folder}: no weights (model.safetensors or model.safetensors.index.json)"
                )
            self.key_to_file = {}
            for shard in shards:
                for key in self._open(shard).keys():
                    self.key_to_file[key] = shard

    def _open(self, path: Path):
        if path in self._handles:
            return self._handles[path]
        if not path.is_file():
            raise ModelLoadError(f"{path}: weight file missing (listed in the safetensors index)")
        try:
            handle = self._safe_open(str(path), framework="pt")
        except Exception as err:  # safetensors raises its own SafetensorError and OSError
            raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file ({err})") from err
        self._handles[path] = handle
        return handle

    def __contains__(self, key: str) -> bool:
        return key in self.key_to_file

    def get(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if key not in self.key_to_file:
            raise ModelLoadError(f"{self.folder}: missing tensor {key!r}")
        path = self.key_to_file[key]
        handle = self._open(path)
        try:
            stored = tuple(handle.get_slice(key).get_shape())  # header only: check before reading
            if stored != tuple(shape):
                raise ModelLoadError(
                    f"{path}: tensor {key!r} has shape {stored}, expected {tuple(shape)}"
                )
            return handle.get_tensor(key)
        except ModelLoadError:
            raise
        except Exception as err:
            raise ModelLoadError(f"{path}: cannot read tensor {key!r} ({err})") from err


def _expert_keys(cfg: ModelConfig, layer: int) -> tuple[str, tuple[str, str, str]]:
    if cfg.model_type == "mixtral":
        return f"model.layers.{layer}.block_sparse_moe", ("w1", "w3", "w2")
    return f"model.layers.{layer}.mlp", ("gate_proj", "up_proj", "down_proj")


def _read_linear(src: _TensorSource, module: str, shape: tuple[int, int], fmt) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, weight_scale_inv or None)`` of linear layer ``module`` as stored.

    ``fmt`` (a :class:`coldset.core.fp8.Fp8Format`, or None for an unquantized checkpoint) says whether
    the module is converted: then its weight must be float8_e4m3fn with a ``weight_scale_inv`` of
    the block grid; otherwise it must not be float8 (a float8 tensor with no scale to read it by
    would load as wrong numbers). Errors name the file and tensor.
    """
    weight = src.get(f"{module}.weight", shape)
    where = f"{src.key_to_file.get(f'{module}.weight', src.folder)}: tensor {module}.weight"
    if fmt is not None and fmt.converts(module):
        if weight.dtype != fp8.FP8_DTYPE:
            raise ModelLoadError(f"{where} is {weight.dtype}; quantization_config converts it, so it must be "
                                 f"{fp8.FP8_DTYPE} (or list the module in modules_to_not_convert)")
        key = f"{module}.weight_scale_inv"
        if key not in src:
            raise ModelLoadError(f"{src.folder}: missing tensor {key!r}: the float8 weight {module}.weight needs its "
                                 "per-block scales (weight_scale_inv)")
        # e4m3fn has one NaN per sign (bits S.1111.111) and no infinity. A NaN weight would
        # poison every token routed to its expert, and the weight-only kernel (w8a16=2) converts
        # by bit arithmetic that reads it as +-122880: refuse it here, where the tensor has a name.
        nan = (weight.view(torch.uint8) & 0x7F) == 0x7F
        if bool(nan.any()):
            r, c = (int(i) for i in nan.nonzero()[0])
            raise ModelLoadError(f"{where} holds {int(nan.sum())} NaN float8 value(s) (first at [{r}, {c}]): "
                                 "a published FP8 checkpoint has none; the file is corrupt or was written wrongly")
        scale = src.get(key, fp8.scale_grid(*shape)).float()
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise ModelLoadError(f"{src.key_to_file.get(key, src.folder)}: tensor {key} holds non-finite or negative "
                                 "scales; a block scale is a finite amax / 448 >= 0")
        return weight, scale
    if weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ModelLoadError(f"{where} is {weight.dtype} but the checkpoint's config does not convert it "
                             "(no quantization_config, or the module is in modules_to_not_convert)")
    return weight, None


def _read_dense(src: _TensorSource, module: str, shape: tuple[int, int], fmt) -> torch.Tensor:
    """A linear layer's weight as a float tensor: a converted (FP8) one dequantized in float32."""
    weight, scale = _read_linear(src, module, shape, fmt)
    return weight if scale is None else fp8.dequantize_weight(weight, scale)


def _load_experts(cfg, src: _TensorSource, device, dtype, fmt=None) -> tuple[torch.Tensor, ...]:
    """Stack routed experts into w13 ``[L, E, 2I, H]`` and w2 ``[L, E, H, I]``, one expert at a time.

    Accepts the per-expert layout real checkpoints use and the fused 3-D layout
    (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``). A block-FP8
    checkpoint (``fmt``) returns ``(w13, w2, w13_scale, w2_scale)``: the float8 bytes as stored and
    their scales (:mod:`coldset.core.fp8`: w13's grid gate's then up's), never dequantized.
    """
    L, E, I, H = cfg.num_moe_layers, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if fmt is not None:
        return _load_fp8_experts(cfg, src, device, fmt)
    w13 = torch.empty((L, E, 2 * I, H), dtype=dtype, device=device)
    w2 = torch.empty((L, E, H, I), dtype=dtype, device=device)
    for m, layer in enumerate(cfg.moe_layers):
        prefix, (gate, up, down) = _expert_keys(cfg, layer)
        fused = f"{prefix}.experts.gate_up_proj"
        if fused in src:
            w13[m].copy_(src.get(fused, (E, 2 * I, H)))
            w2[m].copy_(src.get(f"{prefix}.experts.down_proj", (E, H, I)))
            continue
        for e in range(E):
            base = f"{prefix}.experts.{e}"
            w13[m, e, :I].copy_(src.get(f"{base}.{gate}.weight", (I, H)))
            w13[m, e, I:].copy_(src.get(f"{base}.{up}.weight", (I, H)))
            w2[m, e].copy_(src.get(f"{base}.{down}.weight", (H, I)))
    return w13, w2


def _load_fp8_experts(cfg, src: _TensorSource, device, fmt) -> tuple[torch.Tensor, ...]:
    L, E, I, H = cfg.num_moe_layers, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    gi, gh = fp8.scale_grid(I, H)
    w13 = torch.empty((L, E, 2 * I, H), dtype=fp8.FP8_DTYPE, device=device)
    w2 = torch.empty((L, E, H, I), dtype=fp8.FP8_DTYPE, device=device)
    s13 = torch.empty((L, E, 2 * gi, gh), dtype=torch.float32, device=device)
    s2 = torch.empty((L, E, *fp8.scale_grid(H, I)), dtype=torch.float32, device=device)
    for m, layer in enumerate(cfg.moe_layers):
        prefix, (gate, up, down) = _expert_keys(cfg, layer)
        if f"{prefix}.experts.gate_up_proj" in src:
            raise ModelLoadError(f"{src.folder}: fused expert tensors ({prefix}.experts.gate_up_proj) in FP8 are not "
                                 "supported; the published FP8 checkpoints store one tensor per expert")
        for e in range(E):
            base = f"{prefix}.experts.{e}"
            for name, rows, scale_rows in ((gate, slice(0, I), slice(0, gi)), (up, slice(I, 2 * I), slice(gi, 2 * gi))):
                q, s = _read_linear(src, f"{base}.{name}", (I, H), fmt)
                if s is None:
                    raise ModelLoadError(f"{src.folder}: {base}.{name} is not converted (modules_to_not_convert); "
                                         "the engine needs every routed expert in FP8 or none")
                w13[m, e, rows].copy_(q)
                s13[m, e, scale_rows].copy_(s)
            q, s = _read_linear(src, f"{base}.{down}", (H, I), fmt)
            if s is None:
                raise ModelLoadError(f"{src.folder}: {base}.{down} is not converted (modules_to_not_convert); "
                                     "the engine needs every routed expert in FP8 or none")
            w2[m, e].copy_(q)
            s2[m, e].copy_(s)
    return w13, w2, s13, s2


ENGINE_MODEL_TYPES = (*SUPPORTED_MODEL_TYPES, deepseek_v3.MODEL_TYPE, gpt_oss.MODEL_TYPE, glm4_moe.MODEL_TYPE)


def read_config(path: str | os.PathLike) -> ModelConfig:
    """A model folder's config.json as its family's engine config: :class:`DeepseekV3Config
    <coldset.engine.deepseek_v3.DeepseekV3Config>` for deepseek_v3, else :class:`ModelConfig`
    (qwen3_moe, mixtral). Every stage reads a folder's config through this, so a family the
    engine runs is accepted, and any other refused by name, in one place."""
    folder = Path(path)
    if deepseek_v3.is_deepseek_v3(folder):
        return deepseek_v3.DeepseekV3Config.from_pretrained(folder)
    if glm4_moe.is_glm4_moe(folder):
        return glm4_moe.Glm4MoeConfig.from_pretrained(folder)
    if gpt_oss.is_gpt_oss(folder):
        return gpt_oss.GptOssConfig.from_pretrained(folder)
    return ModelConfig.from_pretrained(folder)


def load_model(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    keep_mxfp4: bool = False,
) -> MoEModel:
    """Load a local HF folder (config.json, model.safetensors or a sharded index) into MoEModel.

    Tensors are read lazily (safetensors ``safe_open``) and cast/moved one at a time, so peak
    memory is about one copy of the model. Routed experts end up only in ``model.pools``
    (``ExpertPools.all_hot``). Raises :class:`ModelLoadError` naming the file or tensor.

    A block-FP8 checkpoint (:mod:`coldset.core.fp8`: ``quantization_config`` quant_method fp8, 128 x 128
    blocks, dynamic activations, e4m3) keeps its routed experts in FP8 in the pools (weights and
    ``weight_scale_inv`` scale pools); its other converted linear layers (attention) are
    dequantized here to ``dtype`` once (``weight.float() * scale_inv`` per block), which is what
    transformers does on a CPU; every path runs those. The converted attention projections are also
    kept as stored (e4m3 bytes and their scales, :meth:`Attention.set_fp8`: 1 byte a weight beside
    the dequantized copy) for the fused decode step at batch 1, whose GEMV reads them weight-only
    (:func:`coldset.kernels.triton_decode.gemv` with ``weight_scale``): at one token the step
    streams its weights, and FP8 halves those bytes. That path rounds differently from the
    dequantized one (float32 weight times scale, no bf16 rounding of the weight); parity compares
    one engine with itself, so it holds. A serving engine would run every converted linear layer in
    FP8, larger batches as FP8 GEMMs with per-token-group activation quantization (vLLM's W8A8
    block path); here the batches from 2 tokens on, and the MLPs of dense layers, run dequantized.

    ``keep_mxfp4`` keeps an MXFP4 checkpoint's routed experts 4-bit in the pools (gpt_oss:
    :func:`coldset.engine.gpt_oss.load`; ``dtype`` must then be bfloat16, what the MXFP4 kernels
    take); without it they are dequantized to ``dtype`` at load. A folder whose experts are not
    MXFP4 is refused with it, by name.
    """
    folder = Path(path)
    if keep_mxfp4:
        stored = getattr(read_config(folder), "checkpoint_expert_format", None)
        if stored != mxfp4.FORMAT_NAME:
            raise ModelLoadError(f"{folder / 'config.json'}: keep_mxfp4 keeps MXFP4 experts 4-bit, but this "
                                 "checkpoint's routed experts are not MXFP4 (quantization_config quant_method "
                                 "mxfp4, *_blocks/*_scales tensors)")
    if gpt_oss.is_gpt_oss(folder):  # sink attention, biased router and experts: its own modules and weight names
        return gpt_oss.load(read_config(folder), _TensorSource(folder), torch.device(device), dtype,
                            keep_mxfp4=keep_mxfp4)
    if deepseek_v3.is_deepseek_v3(folder):  # MLA and the grouped router: its own modules and weight names
        return _load_family(folder, deepseek_v3.DeepseekV3Model, deepseek_v3.load_weights, device, dtype)
    if glm4_moe.is_glm4_moe(folder):  # biased, partially rotated GQA and DeepSeek-V3's MoE
        return _load_family(folder, glm4_moe.Glm4MoeModel, glm4_moe.load_weights, device, dtype)
    cfg = ModelConfig.from_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    fmt = fp8.parse_quantization_config(raw.get("quantization_config"), str(folder / "config.json"))
    src = _TensorSource(folder)
    device = torch.device(device)
    model = MoEModel(cfg)

    def put(param_owner: nn.Module, name: str, key: str):
        shape = tuple(getattr(param_owner, name).shape)
        module = key.removesuffix(".weight")
        if isinstance(param_owner, nn.Linear):
            tensor = _read_dense(src, module, shape, fmt)
        else:
            tensor = src.get(key, shape)
            if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise ModelLoadError(f"{src.key_to_file[key]}: tensor {key!r} is {tensor.dtype}; only linear layers "
                                     "are read in FP8")
        setattr(param_owner, name, nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))

    put_shared_weights(model, src, put)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        attn = layer.self_attn
        qkv = [
            _read_linear(src, f"{p}.self_attn.{name}", (size, cfg.hidden_size), fmt)
            for name, size in (("q_proj", attn.q_size), ("k_proj", attn.kv_size), ("v_proj", attn.kv_size))
        ]
        attn.qkv_proj.weight = nn.Parameter(
            torch.cat([w if s is None else fp8.dequantize_weight(w, s) for w, s in qkv]).to(device=device, dtype=dtype),
            requires_grad=False)
        o = _read_linear(src, f"{p}.self_attn.o_proj", tuple(attn.o_proj.weight.shape), fmt)
        attn.o_proj.weight = nn.Parameter(
            (o[0] if o[1] is None else fp8.dequantize_weight(*o)).to(device=device, dtype=dtype), requires_grad=False)
        # the checkpoint's own FP8 bytes and scales for the fused one-token path, where all of q, k, v
        # (and o_proj) are converted; a partly converted qkv runs dequantized only
        attn.set_fp8(qkv if all(s is not None for _, s in qkv) else None, o if o[1] is not None else None)
        if cfg.qk_norm:
            put(attn.q_norm, "weight", f"{p}.self_attn.q_norm.weight")
            put(attn.k_norm, "weight", f"{p}.self_attn.k_norm.weight")
            attn.fuse_qk_norm()
        if isinstance(layer.mlp, MoEBlock):
            prefix, _ = _expert_keys(cfg, i)
            put(layer.mlp.gate, "weight", f"{prefix}.gate.weight")
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                put(getattr(layer.mlp, proj), "weight", f"{p}.mlp.{proj}.weight")
    model.inv_freq = model.inv_freq.to(device)
    model.pools = ExpertPools.all_hot(*_load_experts(cfg, src, device, dtype, fmt))
    model.eval()
    return model


def _load_family(folder: Path, model_class, load_weights, device, dtype: torch.dtype) -> MoEModel:
    """A family with its own modules and weight names (deepseek_v3, glm4_moe): its config
    (:func:`read_config`, which refuses what it does not run), its model, its other weights by its
    ``load_weights`` (linear layers through :func:`_read_dense`: a block-FP8 one dequantized), the
    routed experts into the pools (block FP8 kept as stored, with their scales)."""
    cfg = read_config(folder)
    raw = json.loads((folder / "config.json").read_text())
    fmt = fp8.parse_quantization_config(raw.get("quantization_config"), str(folder / "config.json"))
    src, device = _TensorSource(folder), torch.device(device)
    model = model_class(cfg)
    load_weights(model, src, device, dtype, lambda module, shape: _read_dense(src, module, shape, fmt))
    model.pools = ExpertPools.all_hot(*_load_experts(cfg, src, device, dtype, fmt))
    return model.eval()


def load_tokenizer(path: str | os.PathLike):
    """The folder's ``tokenizer.json`` as a ``tokenizers.Tokenizer``, BOS handled as HF would.

    ``tokenizer.encode(text).ids`` gives the prompt ids. If ``tokenizer_config.json`` says
    ``add_bos_token: true`` and the tokenizer's own post-processor does not already add the BOS
    token, a post-processor that prepends it is installed (what HF's Llama-style fast tokenizers
    do). Otherwise the tokenizer.json's post-processor decides (Qwen adds nothing).
    """
    folder = Path(path)
    tok_path = folder / "tokenizer.json"
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    if not tok_path.is_file():
        raise ModelLoadError(f"{tok_path}: missing (coldset reads tokenizers through tokenizer.json)")
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as err:
        raise ModelLoadError(f"{tok_path}: cannot be read by the tokenizers library ({err})") from err
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            tcfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as err:
            raise ModelLoadError(f"{cfg_path}: not valid JSON ({err})") from err
        bos = tcfg.get("bos_token")
        if isinstance(bos, dict):
            bos = bos.get("content")
        if tcfg.get("add_bos_token") and bos is not None:
            bos_id = tokenizer.token_to_id(bos)
            if bos_id is None:
                raise ModelLoadError(f"{cfg_path}: bos_token {bos!r} is not in {tok_path}")
            probe = tokenizer.encode("a").ids
            if not probe or probe[0] != bos_id:
                tokenizer.post_processor = TemplateProcessing(
                    single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
                )
    return tokenizer


def attach_fp8_attention(model: MoEModel):
    """Make an in-memory model's attention projections block-FP8, as a published FP8 checkpoint
    stores them (q, k, v and o_proj converted; embeddings, norms, routers and the LM head not, as in
    Qwen3-30B-A3B-FP8's ``modules_to_not_convert``): each of q, k, v and o_proj quantized on its
    own 128 x 128 grid by :func:`coldset.core.fp8.quantize_weight`, the FP8 copies given to the fused
    one-token path (:meth:`Attention.set_fp8`) and the float weights replaced in place by their
    dequantization in the model dtype, what :func:`load_model` holds for such a checkpoint (so
    every path runs the FP8 model). Returns a function that puts the float weights back and drops
    the FP8 copies (the bench times both formats on one model). Why: the real-shape model is built
    in memory (``bench step --weight-format fp8``); a checkpoint would be written and read back."""
    saved = []
    for layer in model.layers:
        attn = layer.self_attn
        if attn.qkv_fp8 is not None or attn.o_fp8 is not None:
            raise ValueError("attach_fp8_attention: the model's attention already has FP8 copies")
        qkv_w, o_w = attn.qkv_proj.weight, attn.o_proj.weight
        qkv = [fp8.quantize_weight(w) for w in qkv_w.detach().split([attn.q_size, attn.kv_size, attn.kv_size])]
        o = fp8.quantize_weight(o_w.detach())
        saved.append((qkv_w.detach().clone(), o_w.detach().clone()))
        attn.set_fp8(qkv, o)
        with torch.no_grad():  # in place: a compiled region or captured graph keeps reading the same tensors
            qkv_w.copy_(torch.cat([fp8.dequantize_weight(q, sc) for q, sc in qkv]))
            o_w.copy_(fp8.dequantize_weight(*o))

    def restore() -> None:
        for layer, (qkv_w, o_w) in zip(model.layers, saved):
            attn = layer.self_attn
            with torch.no_grad():
                attn.qkv_proj.weight.copy_(qkv_w)
                attn.o_proj.weight.copy_(o_w)
            attn.set_fp8(None, None)
        saved.clear()

    return restore
