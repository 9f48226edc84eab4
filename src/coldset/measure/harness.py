"""What every GPU measurement shares: the CUDA check, repeats summarised as median and spread,
and the result file with its provenance.

Why median and spread: a figure that is the best of several runs publishes the lucky one. Every
timed figure a command reports is the median over its repeats, with the slowest and fastest beside it
(:func:`spread`); the renderer prints all three.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from coldset.bench import decode as bn
from coldset.bench.provenance import collect_provenance
from coldset.core import fp8
from coldset.core.files import write_json
from coldset.core.fp8 import FORMAT_NAME
from coldset.core.timing import graph_time_us
from coldset.engine import gpt_oss, random_weights
from coldset.kernels.tiers import ExpertPools
from coldset.measure import model_memory

_T0 = time.perf_counter()


class MeasureError(RuntimeError):
    """A measurement that cannot run here (no CUDA) or was asked for wrongly; its message says why."""


def require_cuda():
    """The CUDA device a measurement runs on; :class:`MeasureError` naming what is missing
    when torch is absent or sees no CUDA device (a CPU timing of these kernels means nothing)."""
    try:
        import torch  # here, not at the top: a machine without torch gets a MeasureError
    except ImportError as exc:
        raise MeasureError(f"needs a CUDA GPU: torch is not importable here ({exc})") from exc
    if not torch.cuda.is_available():
        raise MeasureError(f"needs a CUDA GPU; torch {torch.__version__} sees none here "
                           "(torch.cuda.is_available() is False). Run it on the GPU host.")
    if importlib.util.find_spec("triton") is None:
        raise MeasureError("needs triton (the kernels it times), which is not installed here")
    return torch.device("cuda")


def log(*parts) -> None:
    """Progress to stderr with the seconds since start (the table goes to stdout, last)."""
    print(f"[{time.perf_counter() - _T0:7.1f}s]", *parts, file=sys.stderr, flush=True)


def spread(runs: list[float]) -> dict:
    """``{"median", "min", "max", "runs"}`` of repeated timings of one thing (see module doc)."""
    if not runs:
        raise ValueError("spread: no runs")
    runs = [float(r) for r in runs]
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}


def new_result(kind: str, argv: list[str] | None, args) -> dict:
    """The head of a result: its kind (which table renders it), the command line that reproduces
    it, the parsed arguments and the UTC date."""
    line = "python -m coldset bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    return {"kind": kind, "command": line, "args": {k: v for k, v in vars(args).items() if k != "func"},
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def write_result(path: Path, result: dict, ceilings: dict | None = None, tuned=None) -> Path:
    """Write ``result`` (atomically, complete or absent) with its provenance: the code's commit,
    the software stack, the device and the ceilings measured in this run
    (:func:`coldset.bench.provenance.collect_provenance`)."""
    import torch  # GPU-only path: loads when a measurement runs

    if "provenance" not in result or ceilings is not None:
        result["provenance"] = collect_provenance(torch.device("cuda"), tuned, ceilings)
    write_json(path, result)
    return path


#: ``--weight-format`` of the decode-step and cache measurements: the experts as the in-memory
#: model builds them (bf16), or those experts quantized to the published block-FP8 format.
WEIGHT_FORMATS = ("bf16", "fp8")


def expert_format(weight_format: str) -> str:
    """The :mod:`coldset.core.shapes` format name of ``--weight-format``: what
    :func:`coldset.core.shapes.expert_bytes` takes for the bytes of one expert (bf16 9,437,184 B at
    Qwen3-30B-A3B's shape; fp8 4,719,744 B, its block scales included)."""
    if weight_format not in WEIGHT_FORMATS:
        raise MeasureError(f"--weight-format {weight_format!r} not among {', '.join(WEIGHT_FORMATS)}")
    if weight_format == "bf16":
        return "bfloat16"

    return FORMAT_NAME


# What an FP8 run of bench step and bench cache holds beside its FP8 experts (the JSON's
# ``fp8_nonexpert``): the attention projections as a published FP8 checkpoint stores them
FP8_NONEXPERT = ("q/k/v/o_proj block-FP8 (attach_fp8_attention): read as FP8 by the fused step at batch 1, "
                 "dequantized to the model dtype elsewhere; lm_head, embeddings, norms and router gates in the "
                 "model dtype")


def fp8_expert_pools(pools):
    """All-hot block-FP8 pools (:class:`coldset.kernels.tiers.ExpertPools` with its scale pools) of the
    all-hot float ``pools`` of an in-memory model, quantized on the pools' device one MoE layer at a
    time by :func:`coldset.core.fp8.quantize_w13` and :func:`coldset.core.fp8.quantize_weight` (the
    quantizers of the synthetic FP8 checkpoint and of the FP8 autotune pools).

    Why here: the real-shape synthetic model is built in memory on the GPU (a checkpoint of it
    would be 61 GB written and read back), so ``bench step`` and ``bench cache`` make its FP8
    experts from the built ones. Layer by layer, the float32 temporaries of the quantizer stay one
    layer's (a few GB at Qwen3-30B-A3B), so the peak is the bf16 pools (58 GB) plus the FP8 ones
    (29 GB). The weights quantized are the model's bf16 experts (the FP8 checkpoint path quantizes
    the float32 weights before any cast), so the FP8 model is the bf16 model to e4m3 precision;
    its non-expert weights are not touched here (``bench step`` and ``bench cache`` make the
    attention projections FP8 beside these pools with :func:`coldset.engine.loading.attach_fp8_attention`,
    as a published FP8 checkpoint stores them)."""
    import torch  # GPU-only path: loads when a measurement runs

    if pools.is_fp8:
        raise MeasureError("fp8_expert_pools: the pools already hold block-FP8 experts")
    if not pools.w13_hot.dtype.is_floating_point or pools.w13_hot.dtype == fp8.FP8_DTYPE:
        raise MeasureError(f"fp8_expert_pools: expert weights of dtype {pools.w13_hot.dtype} are not float")
    pools._require_all_hot("fp8_expert_pools")
    L, E = pools.num_moe_layers, pools.num_experts
    two_i, H = pools.w13_hot.shape[1:]
    dev = pools.w13_hot.device
    w13 = torch.empty((L, E, two_i, H), dtype=fp8.FP8_DTYPE, device=dev)
    w2 = torch.empty((L, E, H, two_i // 2), dtype=fp8.FP8_DTYPE, device=dev)
    s13 = torch.empty((L, E, fp8.w13_scale_rows(two_i // 2), fp8.scale_grid(two_i // 2, H)[1]),
                      dtype=torch.float32, device=dev)
    s2 = torch.empty((L, E, *fp8.scale_grid(H, two_i // 2)), dtype=torch.float32, device=dev)
    for layer in range(L):
        rows = slice(layer * E, (layer + 1) * E)  # all-hot: row = layer * E + expert
        q, s = fp8.quantize_w13(pools.w13_hot[rows])
        w13[layer].copy_(q)
        s13[layer].copy_(s)
        q, s = fp8.quantize_weight(pools.w2_hot[rows])
        w2[layer].copy_(q)
        s2[layer].copy_(s)
        del q, s
    return ExpertPools.all_hot(w13, w2, s13, s2)


@dataclass(frozen=True)
class RandomFamily:
    """A published model ``bench step`` and ``bench cache`` draw with random weights
    (``--model-family``, :func:`coldset.engine.random_weights.build_random_model`): its config
    (a config.json path from the repository root, or the dict), the expert format it is published
    in, and how many of its MoE layers are built by default (None: all; a subset where its experts
    and a slot pool at residency 0.75 would not fit in one H200's 141 GB)."""

    config: str | dict
    expert_format: str
    moe_layers: int | None = None

    def raw(self) -> dict:
        if isinstance(self.config, dict):
            return self.config
        path = Path(self.config)
        if not path.is_file():
            raise MeasureError(f"--model-family: {path} not found (run from the repository root)")
        return json.loads(path.read_text())


_SHAPES = "config/examples/shapes"
#: ``--model-family``'s published configs. qwen3-30b-a3b: the published Qwen3-30B-A3B-FP8 config
#: without its quantization_config, which is Qwen3-30B-A3B's (same architecture), in bf16.
RANDOM_FAMILIES = {
    "gpt-oss-20b": RandomFamily(gpt_oss.GPT_OSS_20B_CONFIG, "bf16"),
    "gpt-oss-120b": RandomFamily(f"{_SHAPES}/gpt-oss-120b/config.json", "mxfp4"),
    "deepseek-v3": RandomFamily(f"{_SHAPES}/deepseek-v3/config.json", "fp8", 4),
    "glm-4.5-air": RandomFamily(f"{_SHAPES}/glm-4.5-air/config.json", "bf16", 12),
    "qwen3-30b-a3b": RandomFamily(f"{_SHAPES}/qwen3-30b-a3b-fp8/config.json", "bf16"),
}


_DEFAULT_SUBSETS = ", ".join(f"{k} {v.moe_layers}" for k, v in RANDOM_FAMILIES.items() if v.moe_layers)


def add_family_arguments(p) -> None:
    """``--model-family`` and ``--moe-layers`` of ``bench step`` and ``bench cache``."""
    p.add_argument("--model-family", choices=["synthetic", *RANDOM_FAMILIES], default="synthetic",
                   help="synthetic: the config's synthetic model; else that published config with random weights "
                        "drawn on the GPU in its published expert format (gpt-oss-120b MXFP4, deepseek-v3 block "
                        "FP8, the others bf16), prompted through the config's synthetic tokenizer")
    p.add_argument("--moe-layers", type=int, default=None,
                   help="with --model-family: build the dense layers and the first N MoE layers at full width "
                        f"(default: the family's, {_DEFAULT_SUBSETS}; others all)")


def check_family_arguments(args) -> None:
    """:class:`MeasureError` for ``--moe-layers`` without a family, or below 1."""
    if args.moe_layers is not None and args.model_family == "synthetic":
        raise MeasureError("--moe-layers cuts a --model-family model; the synthetic model takes its config's shape")
    if args.moe_layers is not None and args.moe_layers < 1:
        raise MeasureError(f"--moe-layers {args.moe_layers}: at least 1")


def random_family_model(name: str, device, moe_layers: int | None, R: dict):
    """The random model of family ``name`` (:data:`RANDOM_FAMILIES`) on ``device`` with
    ``moe_layers`` MoE layers (None: the family's default); ``R["model_family"]`` says what was
    built (layers, MoE layers of the published count, expert format, the bytes an expert's copy
    moves and those a step reads for it: :func:`expert_read_bytes`)."""
    fam = RANDOM_FAMILIES[name]
    raw, layers = fam.raw(), moe_layers if moe_layers is not None else fam.moe_layers
    t = time.perf_counter()
    try:
        if str(device).startswith("cuda"):  # checked before anything is drawn; the CPU has no HBM to check
            refusal = model_memory.preflight_model(name, raw, fam.expert_format, layers, device)
            if refusal:
                raise MeasureError(refusal)
        model = random_weights.build_random_model(raw, device, fam.expert_format, layers, source=name)
    except ValueError as exc:  # ModelLoadError: a bad --moe-layers, named
        raise MeasureError(str(exc)) from None
    R["model_family"] = {"name": name, **random_weights.subset_note(raw, model.config, fam.expert_format, name),
                         "expert_bytes": bn.moved_bytes_per_expert(model.pools),
                         "expert_read_bytes": expert_read_bytes(model.pools),
                         "build_s": round(time.perf_counter() - t, 1)}
    log("model built:", name, R["model_family"])
    return model


def expert_read_bytes(pools) -> int:
    """Bytes a decode step reads for one chosen expert of all-hot ``pools``: the rows and scale
    rows its copy moves (:func:`coldset.bench.decode.moved_bytes_per_expert`) and its biases, which
    stay resident but are read for the experts a token chose (:attr:`ExpertPools.bias_bytes` over
    the experts)."""
    return bn.moved_bytes_per_expert(pools) + pools.bias_bytes // (pools.num_moe_layers * pools.num_experts)


def idle_time(spans) -> float:
    """The time between the first start and the last end of ``spans`` ((start, end) pairs, any
    order, overlapping or not) covered by none of them: in a profile of back-to-back calls, the
    launch latency the kernels' chain leaves exposed."""
    spans = sorted(spans)
    idle, reach = 0.0, spans[0][1] if spans else 0.0
    for start, end in spans[1:]:
        idle += max(0.0, start - reach)
        reach = max(reach, end)
    return idle


def kernel_profile(step, n: int = 3, layers: int = 1) -> dict:
    """Kernels per step (and per layer: per step / ``layers``), their summed device time and the
    idle time between them (no kernel running), from the profiler over ``n`` back-to-back calls;
    the top kernels by time with their count per step. A kernel launched as a programmatic
    dependent counts from its launch, its wait on the one before included."""
    import torch  # GPU-only path: loads when a measurement runs
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total_us = sum(e.device_time for e in kernels) if kernels else 0.0
    idle_us = idle_time([(e.time_range.start, e.time_range.end) for e in kernels])
    by_name: dict[str, list] = {}
    for e in kernels:
        by_name.setdefault(e.name[:60], []).append(e.device_time)
    top = sorted(((k, len(v) / n, sum(v) / n) for k, v in by_name.items()), key=lambda r: -r[2])[:25]
    return {"kernels_per_step": len(kernels) / n, "kernels_per_layer": len(kernels) / n / layers,
            "kernel_us_per_step": total_us / n, "idle_us_per_step": idle_us / n,
            "top": [{"name": k, "per_step": c, "us_per_step": round(us, 1)} for k, c, us in top]}


def cumulative_stage_us(launches, stops, layers: int, reps: int) -> dict:
    """Cumulative µs a layer after each of ``stops``: ``launches(layer)`` (a kernel call's launch
    generator, :func:`coldset.kernels.triton_moe.experts_launches` or
    :func:`coldset.kernels.triton_fp8.fp8_experts_launches`) issued up to launch ``stop``
    (:func:`coldset.kernels.triton_moe.issue_through`) for every layer in one CUDA graph, median of
    ``reps`` replays, per stop."""
    from coldset.kernels.triton_moe import issue_through  # triton: GPU-only

    return {stop: graph_time_us(lambda: [issue_through(launches(layer), stop) for layer in range(layers)],
                                reps) / layers
            for stop in stops}


def load_module(path: str, name: str = "baseline_triton_moe"):
    """Another copy of a kernel module (``--baseline-module`` of bench kernel and bench step),
    loaded from its file."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise FileNotFoundError(f"bench kernel: --baseline-module {path} is not a Python file")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod
