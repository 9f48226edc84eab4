"""Autotune the experts kernel for a model's shapes, with a cache keyed by content (docs/design.md §5).

The key is a sha256 over everything that can change the best configuration or its validity: the
source text of the kernel module and of every ``coldset`` module it imports (transitively), the
search space, the problem shape (E, hot/cold row counts, H, I, top_k, dtype, layers), the batch
sizes, the device (name, compute capability, driver; on CPU the processor and thread count) and
the torch and triton versions. Entries live outside results/ (default: ``$COLDSET_AUTOTUNE_CACHE``,
else ``$XDG_CACHE_HOME/coldset/autotune``, else ``~/.cache/coldset/autotune``), one JSON file
per key, written atomically (temp file + ``os.replace``) and verified on read: the stored key must
equal the file's key and a sha256 of the content must match the stored checksum. A damaged or
mismatched entry is re-tuned with a warning, never used. A hit reads one small file.

On CUDA the Triton kernel's launch parameters are tuned (:class:`KernelConfig`: tile sizes, the
split of the weight rows over blocks, warps, stages), timed by CUDA-graph replay, median of
repeats, rotating over several layers' experts so L2 does not serve repeats; every candidate's
output is checked against the torch path first (a wrong configuration is excluded with a warning).
On CPU the torch path's one knob, ``token_chunk``, is tuned by the same machinery.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from coldset.core import fp8, mxfp4
from coldset.core.files import write_json
from coldset.kernels import torch_experts, triton_experts
from coldset.kernels.activation import SILU, Activation
from coldset.kernels.configs import load as load_kernel_configs
from coldset.kernels.tiers import build_pools
from coldset.core.timing import graph_time_us

# Tokens per call up to which the "decode" candidates are searched; above, the "prefill" ones.
DECODE_MAX_TOKENS = 64

# The Triton kernels' candidates per regime, kept as data beside the kernels
# (coldset.kernels.configs: triton_moe.json, triton_fp8.json). bf16: at decode small tiles spread
# over many blocks, where the weights' bytes bound the time, with dependent launch (pdl 2: the w2
# and sum launches start early), the in-kernel and the sorted grouping and both block orders; at
# prefill large tiles (wgmma), vLLM's H200 fused_moe tiles for E=128, N=768, the per-pair buffer in
# the activation dtype (half_buf), half tiles for an expert's last chunk (half_tail) and pdl 3
# (the first launch chained too). Split-K and pdl 1 (a w2 prefetch) are not searched: both were
# slower at every batch size. FP8: the decode tiles with each pdl mode, the quantization options
# (quant_x, quant_act), swap_ab (FP8 warpgroup MMAs at decode) and the weight-only mode (w8a16 1
# and 2); at prefill 64- and 128-row tiles. Their timings are BENCHMARKS.md sections 1 and 2, the
# candidates tried and dropped docs/history.md. On CPU, autotune() times TORCH_SEARCH_SPACE and
# neither times nor hashes these lists: their size never costs CPU CI time.
TRITON_SEARCH_SPACE: dict = {"decode_max_tokens": DECODE_MAX_TOKENS, **load_kernel_configs("triton_moe")["search_space"]}
TRITON_FP8_SEARCH_SPACE: dict = {"decode_max_tokens": DECODE_MAX_TOKENS, **load_kernel_configs("triton_fp8")["search_space"]}
TRITON_MXFP4_SEARCH_SPACE: dict = {"decode_max_tokens": DECODE_MAX_TOKENS,
                                   **load_kernel_configs("triton_mxfp4")["search_space"]}

TORCH_SEARCH_SPACE: dict = {
    "decode_max_tokens": DECODE_MAX_TOKENS,
    "decode": [{"token_chunk": None}],
    "prefill": [{"token_chunk": None}, {"token_chunk": 64}, {"token_chunk": 256}, {"token_chunk": 1024}],
}

TORCH_DEFAULT_CONFIG = {"token_chunk": None}


class AutotuneCacheWarning(UserWarning):
    """A cache entry was damaged or mismatched (re-tuned), or a batch size had no tuned entry."""


@dataclass(frozen=True)
class TuneShape:
    """The problem the kernel is tuned for: one model's routed experts and their placement sizes."""

    num_experts: int
    hidden: int
    intermediate: int
    top_k: int
    dtype: str  # "bfloat16" | "float16" | "float32"
    num_moe_layers: int
    num_hot: int
    num_cold: int
    # The experts' weight format when it is not ``dtype``: "fp8_block128" (coldset.core.fp8) or "mxfp4"
    # (coldset.core.mxfp4, bfloat16 activations). None (the default) is left out of the key, so entries
    # tuned before the field existed stay valid.
    weight_format: str | None = None
    # Experts with biases (gpt-oss) and their activation (None: SiLU): both compile other kernel
    # code (constexpr branches), so both enter the key when set; unset they are left out, so
    # entries tuned before the fields existed stay valid.
    expert_bias: bool = False
    activation: Activation | None = None

    def __post_init__(self):
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"TuneShape.dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.weight_format not in (None, fp8.FORMAT_NAME, mxfp4.FORMAT_NAME):
            raise ValueError(f"TuneShape.weight_format must be None, {fp8.FORMAT_NAME!r} or {mxfp4.FORMAT_NAME!r}, "
                             f"got {self.weight_format!r}")
        if self.weight_format == mxfp4.FORMAT_NAME and self.dtype != "bfloat16":
            raise ValueError(f"TuneShape.dtype must be bfloat16 with MXFP4 experts (the kernels' activations), "
                             f"got {self.dtype!r}")
        if isinstance(self.activation, dict):  # as a cache entry's JSON stores it (asdict)
            object.__setattr__(self, "activation", Activation(**self.activation))
        if self.activation == SILU:  # the kernels' default code: left out of the key, as None is
            object.__setattr__(self, "activation", None)
        if self.activation is not None and not isinstance(self.activation, Activation):
            raise ValueError(f"TuneShape.activation must be an Activation or None, got {self.activation!r}")
        if self.num_hot + self.num_cold < self.num_moe_layers * self.num_experts:
            raise ValueError(
                f"TuneShape: num_hot {self.num_hot} + num_cold {self.num_cold} rows cannot hold "
                f"{self.num_moe_layers} x {self.num_experts} experts"
            )


@dataclass
class TuneResult:
    """The outcome of :func:`autotune`: the best config per batch size and how each candidate timed."""

    key: str
    hit: bool
    backend: str  # "triton" | "torch"
    shape: TuneShape
    batch_sizes: list[int]
    configs: dict[int, dict]  # batch size -> best config
    timings_us: dict[int, dict[str, float]] = field(default_factory=dict)  # batch -> config json -> µs
    path: Path | None = None  # the cache entry
    # batch sizes config_for has already warned about (once each: the bench builds an experts
    # function per placement, and every one met the same untuned prefill sizes)
    defaulted: set[int] = field(default_factory=set, compare=False, repr=False)


def default_cache_dir() -> Path:
    """``$COLDSET_AUTOTUNE_CACHE``, else ``$XDG_CACHE_HOME/coldset/autotune``, else ``~/.cache/...``."""
    env = os.environ.get("COLDSET_AUTOTUNE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "coldset" / "autotune"


def _backend(device) -> str:
    return "triton" if torch.device(device).type == "cuda" else "torch"


def kernel_module(backend: str) -> str:
    return "coldset.kernels.triton_moe" if backend == "triton" else "coldset.kernels.reference"


def _module_source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"autotune key: cannot find the source of {module}")
    return Path(spec.origin).read_text()


def _module_level_nodes(tree: ast.AST):
    """AST nodes outside function bodies: the imports a module makes when it is imported.

    Imports inside functions (lazy ones, such as tiers' call into the placement validator) are
    not the kernel's code path and would make every edit of an unrelated module a cache miss.
    """
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                stack.append(child)


def _coldset_imports(module: str, source: str) -> set[str]:
    """The ``coldset`` modules a module imports at module level (absolute or relative), from its AST."""
    found: set[str] = set()
    package = module.rsplit(".", 1)[0]
    for node in _module_level_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "coldset")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            if name.split(".")[0] != "coldset":
                continue
            found.add(name)
            for a in node.names:  # `from coldset.kernels import reference` imports a module
                sub = f"{name}.{a.name}"
                if importlib.util.find_spec(sub.rsplit(".", 1)[0]) and _is_module(sub):
                    found.add(sub)
    return found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def source_digests(backend: str, weight_format: str | None = None) -> dict[str, str]:
    """sha256 of the kernel module's source and of every coldset module it imports, transitively;
    for FP8 or MXFP4 experts also that format's kernel and format modules (called lazily, so not
    found by imports)."""
    todo = [kernel_module(backend)]
    if weight_format == mxfp4.FORMAT_NAME:
        todo += ["coldset.core.mxfp4"] + (["coldset.kernels.triton_mxfp4"] if backend == "triton" else [])
    elif weight_format is not None:
        todo += ["coldset.core.fp8"] + (["coldset.kernels.triton_fp8"] if backend == "triton" else [])
    digests: dict[str, str] = {}
    while todo:
        mod = todo.pop()
        if mod in digests:
            continue
        text = _module_source(mod)
        digests[mod] = hashlib.sha256(text.encode()).hexdigest()
        todo.extend(sorted(_coldset_imports(mod, text) - set(digests)))
    return dict(sorted(digests.items()))


def _driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            line = f.readline()
        for tok in line.split():
            if tok.count(".") >= 1 and tok.replace(".", "").isdigit():
                return tok
    except OSError:
        pass
    try:
        import pynvml  # nvidia-ml-py, where installed

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        return "unknown"


def device_fingerprint(device) -> dict:
    """What identifies the hardware and software stack a tuning result is valid for."""
    device = torch.device(device)
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    info = {"type": device.type, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version()}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        cap = torch.cuda.get_device_capability(index)
        info.update(name=torch.cuda.get_device_name(index), capability=f"{cap[0]}.{cap[1]}",
                    driver=_driver_version(), cuda=torch.version.cuda)
    else:
        info.update(name=platform.processor() or platform.machine(), machine=platform.machine(),
                    cpus=os.cpu_count(), threads=torch.get_num_threads())
    return info


def default_search_space(device, weight_format: str | None = None) -> dict:
    if _backend(device) != "triton":
        return TORCH_SEARCH_SPACE
    if weight_format == mxfp4.FORMAT_NAME:
        return TRITON_MXFP4_SEARCH_SPACE
    return TRITON_SEARCH_SPACE if weight_format is None else TRITON_FP8_SEARCH_SPACE


def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def autotune_key(shape: TuneShape, batch_sizes, device, search_space: dict | None = None) -> str:
    """sha256 (hex) over kernel sources, search space, shape, batch sizes, device and versions."""
    backend = _backend(device)
    shape_fields = asdict(shape)
    if shape.weight_format is None:  # keys of the weights-in-dtype shapes as before the field existed
        del shape_fields["weight_format"]
    if not shape.expert_bias:  # likewise for the bias and activation variants (set: in the key)
        del shape_fields["expert_bias"]
    if shape.activation is None:
        del shape_fields["activation"]
    else:
        shape_fields["activation"] = shape.activation.key()
    material = {
        "backend": backend,
        "sources": source_digests(backend, shape.weight_format),
        "search_space": default_search_space(device, shape.weight_format) if search_space is None else search_space,
        "shape": shape_fields,
        "batch_sizes": sorted(int(b) for b in batch_sizes),
        "device": device_fingerprint(device),
    }
    return hashlib.sha256(_canonical(material).encode()).hexdigest()


def _checksum(entry: dict) -> str:
    return hashlib.sha256(_canonical({k: v for k, v in entry.items() if k != "checksum"}).encode()).hexdigest()


def _read_entry(path: Path, key: str) -> dict | None:
    """The verified entry, or None (with a warning) if it is absent, damaged or mismatched."""
    if not path.exists():
        return None
    try:
        entry = json.loads(path.read_text())
        if not isinstance(entry, dict):
            raise ValueError("not a JSON object")
        if entry.get("key") != key:
            raise ValueError(f"stored key {str(entry.get('key'))[:16]}... differs from {key[:16]}...")
        if entry.get("checksum") != _checksum(entry):
            raise ValueError("checksum mismatch (content altered or truncated)")
        if not isinstance(entry.get("configs"), dict):
            raise ValueError("no configs")
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        warnings.warn(f"autotune cache entry {path} is damaged or mismatched ({exc}); re-tuning",
                      AutotuneCacheWarning, stacklevel=3)
        return None
    return entry


def _cpu_time_us(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _tuning_pools(shape: TuneShape, device, layers: int, seed: int = 0):
    """Random experts for ``layers`` layers, with the shape's cold fraction in pinned/host memory."""
    dtype = getattr(torch, shape.dtype)
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where the pools live: fast on a GPU
    E, H, I = shape.num_experts, shape.hidden, shape.intermediate
    w13 = (torch.randn(layers, E, 2 * I, H, generator=g, device=device) / H**0.5).to(dtype)
    w2 = (torch.randn(layers, E, H, I, generator=g, device=device) / I**0.5).to(dtype)
    scales = {}
    if shape.weight_format == mxfp4.FORMAT_NAME:  # MXFP4 experts: packed rows and e8m0 scales, as the pools hold them
        (b13, s13), (b2, s2) = mxfp4.quantize(w13), mxfp4.quantize(w2)
        w13, w2, scales = b13.flatten(-2), b2.flatten(-2), dict(w13_scale=s13, w2_scale=s2)
    elif shape.weight_format is not None:  # FP8 experts: quantized as a checkpoint stores them
        (w13, s13), (w2, s2) = fp8.quantize_w13(w13), fp8.quantize_weight(w2)
        scales = dict(w13_scale=s13, w2_scale=s2)
    variant = dict(activation=shape.activation or SILU)
    if shape.expert_bias:  # the model dtype's biases (FP8 experts: the activations' bf16)
        bias_dtype = torch.bfloat16 if shape.weight_format is not None else dtype
        variant.update(w13_bias=torch.randn(layers, E, 2 * I, generator=g, device=device).to(bias_dtype),
                       w2_bias=torch.randn(layers, E, H, generator=g, device=device).to(bias_dtype))
    cold_fraction = shape.num_cold / max(1, shape.num_hot + shape.num_cold)
    n = layers * E
    n_cold = int(round(cold_fraction * n))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    is_cold = torch.zeros(n, dtype=torch.bool)
    is_cold[perm[:n_cold]] = True
    rows = torch.empty(n, dtype=torch.int32)
    rows[~is_cold] = torch.arange(n - n_cold, dtype=torch.int32)
    rows[is_cold] = -torch.arange(n_cold, dtype=torch.int32) - 1
    return build_pools(w13, w2, rows.reshape(layers, E), device, **scales, **variant)


def _routing(num_tokens, shape: TuneShape, device, g):
    dtype = getattr(torch, shape.dtype)
    x = torch.randn(num_tokens, shape.hidden, generator=g).to(dtype).to(device)
    w, ids = torch.softmax(torch.randn(num_tokens, shape.num_experts, generator=g), -1).topk(shape.top_k, -1)
    return x, ids.to(device), (w / w.sum(-1, keepdim=True)).to(dtype).to(device)


def _candidates(space: dict, batch_size: int) -> list[dict]:
    regime = "decode" if batch_size <= int(space.get("decode_max_tokens", DECODE_MAX_TOKENS)) else "prefill"
    cands = space.get(regime) or []
    if not cands:
        raise ValueError(f"autotune search space has no {regime!r} candidates for batch size {batch_size}")
    return cands


def _weight_only_reference(pools, cand: dict) -> bool:
    """Whether candidate ``cand`` is checked against the torch path's weight-only numerics: block-FP8
    pools with ``w8a16`` set leave the activations unquantized. MXFP4 pools are always weight-only
    (their ``w8a16`` picks how codes are unpacked, not what is computed), bf16 pools have one numerics."""
    return bool(cand.get("w8a16", 0)) and pools.is_fp8


def _tune(shape: TuneShape, batch_sizes, device, space: dict, layers: int, reps: int):
    backend = _backend(device)
    pools = _tuning_pools(shape, device, layers)
    g = torch.Generator().manual_seed(1)
    configs: dict[int, dict] = {}
    timings: dict[int, dict[str, float]] = {}
    total = sum(len(_candidates(space, b)) for b in batch_sizes)
    bar = tqdm(total=total, desc=f"autotune ({backend})", file=sys.stderr, disable=None)
    for bs in batch_sizes:
        cases = [_routing(bs, shape, device, g) for _ in range(layers)]
        refs_by_mode: dict[bool, list] = {}  # the torch path of the candidate's numerics (FP8: w8a16 or not)
        timings[bs] = {}
        for cand in _candidates(space, bs):
            label = _canonical(cand)
            w8a16 = _weight_only_reference(pools, cand)
            if w8a16 not in refs_by_mode:
                refs_by_mode[w8a16] = [torch_experts(pools, l, *cases[l], w8a16=w8a16).float() for l in range(layers)]
            refs = refs_by_mode[w8a16]
            if backend == "triton":
                def fn(cand=cand):
                    return [triton_experts(pools, l, *cases[l], config=cand) for l in range(layers)]
            else:
                chunk = cand.get("token_chunk")

                def fn(chunk=chunk):
                    return [torch_experts(pools, l, *cases[l], token_chunk=chunk) for l in range(layers)]
            try:
                outs = fn()
                errs = [float((o.float() - r).norm() / r.norm().clamp_min(1e-30)) for o, r in zip(outs, refs)]
                if not all(e < 2e-2 for e in errs):  # a config computing the wrong function is never used
                    raise ValueError(f"output differs from the torch path (rel err {max(errs):.2e})")
                t = graph_time_us(fn, reps) if backend == "triton" else _cpu_time_us(fn, reps)
                timings[bs][label] = t / layers
            except Exception as exc:  # out of resources, wrong output: excluded, not fatal
                warnings.warn(f"autotune: config {label} at batch {bs} excluded: {exc!r}"[:400],
                              AutotuneCacheWarning, stacklevel=2)
            bar.update(1)
        if not timings[bs]:
            raise RuntimeError(f"autotune: no candidate config worked for batch size {bs}")
        configs[bs] = json.loads(min(timings[bs], key=timings[bs].get))
    bar.close()
    return configs, timings


def autotune(
    shape: TuneShape,
    batch_sizes,
    device,
    cache_dir: str | os.PathLike | None = None,
    search_space: dict | None = None,
    layers: int | None = None,
    reps: int | None = None,
) -> TuneResult:
    """The best config per batch size for ``shape`` on ``device``, from the cache or by timing.

    ``layers`` (default: min(num_moe_layers, 4) on CUDA, 1 on CPU) layers' worth of random
    experts are rotated while timing. A verified cache entry for the key is returned at once
    (``hit=True``); a damaged or mismatched one is re-tuned with a warning.
    """
    batch_sizes = sorted({int(b) for b in batch_sizes})
    if not batch_sizes or batch_sizes[0] <= 0:
        raise ValueError(f"autotune: batch_sizes must be positive integers, got {batch_sizes}")
    backend = _backend(device)
    space = default_search_space(device, shape.weight_format) if search_space is None else search_space
    key = autotune_key(shape, batch_sizes, device, space)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = folder / f"{key}.json"
    entry = _read_entry(path, key)
    if entry is not None:
        return TuneResult(key=key, hit=True, backend=backend, shape=shape, batch_sizes=batch_sizes,
                          configs={int(b): c for b, c in entry["configs"].items()},
                          timings_us={int(b): t for b, t in entry.get("timings_us", {}).items()}, path=path)
    if layers is None:
        layers = min(shape.num_moe_layers, 4) if backend == "triton" else 1
    if reps is None:
        reps = 20 if backend == "triton" else 3
    configs, timings = _tune(shape, batch_sizes, device, space, layers, reps)
    entry = {
        "key": key,
        "backend": backend,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "shape": asdict(shape),
        "batch_sizes": batch_sizes,
        "search_space": space,
        "device": device_fingerprint(device),
        "configs": {str(b): c for b, c in configs.items()},
        "timings_us": {str(b): t for b, t in timings.items()},
    }
    entry["checksum"] = _checksum(entry)
    write_json(path, entry)
    return TuneResult(key=key, hit=False, backend=backend, shape=shape, batch_sizes=batch_sizes,
                      configs=configs, timings_us=timings, path=path)


def untimed_candidates(result: TuneResult, search_space: dict) -> dict[int, list[dict]]:
    """Per tuned batch size, the candidates of ``search_space`` for its regime that have no time in
    ``result`` (excluded by :func:`autotune`: an error, out of resources, or an output that differs
    from the torch path of its numerics), so that a caller can refuse a tune that silently lost
    candidates it meant to time."""
    out = {}
    for bs in result.batch_sizes:
        timed = result.timings_us.get(bs, {})
        missing = [c for c in _candidates(search_space, bs) if _canonical(c) not in timed]
        if missing:
            out[bs] = missing
    return out


def config_for(result: TuneResult, batch_size: int, cuda: bool = False) -> dict:
    """The tuned config for ``batch_size``; if none was tuned for it, the documented default, with a
    warning (the first time for this result and batch size).

    Defaults: for the Triton backend the format's ``default_config`` (decode tiles up to 64 tokens,
    prefill tiles above; ``cuda``: the call's tensors are on CUDA, where MXFP4's decode default is a
    Gluon tile the interpreter cannot run); for the torch backend ``{"token_chunk": None}`` (one chunk).
    """
    cfg = result.configs.get(int(batch_size))
    if cfg is not None:
        return dict(cfg)
    if int(batch_size) not in result.defaulted:  # once per result and batch size
        result.defaulted.add(int(batch_size))
        warnings.warn(
            f"autotune: no tuned config for batch size {batch_size} (tuned: {sorted(result.configs)}); "
            f"using the default", AutotuneCacheWarning, stacklevel=2)
    if result.backend == "triton":
        if result.shape.weight_format == mxfp4.FORMAT_NAME:  # triton: the kernels' modules load on use
            from coldset.kernels.triton_mxfp4 import default_config

            return default_config(int(batch_size), result.shape.top_k, cuda=cuda).to_dict()
        elif result.shape.weight_format is not None:  # triton: the kernels' modules load on use
            from coldset.kernels.triton_fp8 import default_config
        else:
            from coldset.kernels.triton_moe import default_config

        return default_config(int(batch_size), result.shape.top_k).to_dict()
    return dict(TORCH_DEFAULT_CONFIG)


def result_from_entry(entry: dict) -> TuneResult:
    """The :class:`TuneResult` a workflow's copy of a cache entry (results/autotune/{model}.json) holds."""
    return TuneResult(key=entry["key"], hit=bool(entry.get("hit", True)), backend=entry["backend"],
                      shape=TuneShape(**entry["shape"]), batch_sizes=[int(b) for b in entry["batch_sizes"]],
                      configs={int(b): c for b, c in entry["configs"].items()},
                      timings_us={int(b): t for b, t in entry.get("timings_us", {}).items()})


def tuned_experts(result: TuneResult, use_row_map: bool = True) -> Callable:
    """An experts function (the engine's contract) that runs each call with its batch size's config.

    ``use_row_map=False`` is the unmodified path (Triton: the indirection compiled out); with the
    same result both paths use the same tiles, which is what makes them bitwise comparable.
    """
    chosen: dict[int, dict] = {}

    def experts(pools, layer, x, topk_ids, topk_weights):
        bs = int(x.shape[0])
        if bs not in chosen:
            chosen[bs] = config_for(result, bs, cuda=x.is_cuda)  # warns once per result and missing batch size
        if result.backend == "triton":
            return triton_experts(pools, layer, x, topk_ids, topk_weights, config=chosen[bs],
                                  use_row_map=use_row_map)
        return torch_experts(pools, layer, x, topk_ids, topk_weights, token_chunk=chosen[bs].get("token_chunk"))

    return experts


def write_entry(result: TuneResult, path: str | os.PathLike) -> None:
    """Copy the verified cache entry of ``result`` to ``path`` atomically (the workflow rule's output),
    with ``hit``: whether this run was served from the cache."""
    entry = _read_entry(Path(result.path), result.key) if result.path else None
    if entry is None:
        raise FileNotFoundError(f"autotune: cache entry for key {result.key} is missing or damaged at {result.path}")
    write_json(path, {**entry, "hit": result.hit})
