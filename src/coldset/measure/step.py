"""``python -m coldset bench step``: the decode step at real shape on one GPU, per engine, at
batch 1 and 8, against its bytes floor measured in the same run.

Builds the config's in-memory synthetic model (every expert in HBM), measures the HBM read
ceiling (:func:`coldset.bench.decode.measure_ceilings`: best of several rounds), then for each engine
(``eager``; ``compiled``: ``compile_decode(fused=False)``, the Inductor-compiled region; ``fused``:
``compile_decode()``, the fused Triton kernels of :mod:`coldset.kernels.triton_decode` with their
default launch mode, ``fused-pdl`` / ``fused-nopdl`` with dependent launch forced on / off;
``NAME@base``: engine NAME with the experts kernel of ``--baseline-module``, a before/after in
one process), each captured in one CUDA graph by :class:`coldset.bench.decode.Decoder`, times the full
step at batch 1 and 8 (prompts cut from fixture-like text, as the bench cuts them) and the step
with the routed experts replaced by zeros at batch 1, with a kernel profile of each full step.
A step's time is the median of ``--reps`` event-timed calls (:func:`coldset.core.timing.eager_time_us`),
repeated ``--rounds`` times: the median round is reported with the slowest and fastest.

The bytes floor of a step is what it must read from HBM (non-expert weights with the LM head, the
batch's embedding rows, and per MoE layer each distinct expert the batch's tokens chose, from an
eager pass with routing capture over the same tokens: :func:`coldset.bench.decode.measure_routing`) over
the measured read rate; ``of floor`` = floor / measured step. Checks: every engine decodes the
first engine's greedy tokens (16 steps, both batch sizes); the largest logit difference.
``--tune`` runs the experts autotune (:mod:`coldset.kernels.tune`) for batch 1 and 8 first; ``--tuned``
reads the configs of an autotune entry instead (e.g. config/examples/h200-tuned/). Writes
``decode_step.json`` under ``--out``.

``--weight-format fp8`` times every engine twice in the same process, on the same
model and the same tokens: with the built bf16 experts and with those experts quantized to the
published block-FP8 format (:func:`coldset.measure.harness.fp8_expert_pools`: weights e4m3 with
their 128 x 128 scales, all in HBM, run by :mod:`coldset.kernels.triton_fp8`; the non-expert
weights bf16 except the attention projections). The FP8 model is the one a published FP8
checkpoint holds (Qwen3-30B-A3B-FP8: routed experts and q/k/v/o_proj in block FP8; LM head,
embeddings, norms and router gates in ``modules_to_not_convert``): its rows run with
:func:`coldset.engine.loading.attach_fp8_attention` (each projection quantized on its own grid; the fused
step at batch 1 reads the FP8 bytes, every other path their dequantization, as
:func:`coldset.engine.loading.load_model` runs an FP8 checkpoint), undone for the bf16 rows. Each row with
``--weight-format fp8`` says which non-expert linears it ran in FP8 (``nonexpert_fp8``:
``["qkv_proj", "o_proj"]`` for a fused engine at batch 1, else ``[]``,
:func:`coldset.engine.model.fp8_attention_linears`). Each format has its bytes floor (FP8 experts at
:func:`coldset.core.shapes.expert_bytes` of ``fp8_block128``, scales included, over the distinct
experts of its own routing; at batch 1 the attention projections at that format's bytes too,
:func:`nonexpert_read_bytes_fp8`, the floor of the FP8 model whichever engine runs it) and its rows;
``fp8_speedup`` is bf16 step / FP8 step per engine and batch beside the ratio of the two
floors (the speed the bytes alone allow). FP8 rows are checked against the first engine's FP8 tokens;
FP8 against bf16 (other weights) is reported as a token match rate, not checked. The FP8 kernel
runs its documented defaults (:func:`coldset.kernels.triton_fp8.default_config`), the configs of
``--tuned-fp8`` (an autotune entry of the FP8 shape), or its own autotune in this run (``--tune``,
which tunes both kernels, or ``--tune-fp8``, the FP8 kernel alone, e.g. beside ``--tuned``).

``--model-family NAME`` measures a published model instead of the synthetic one: its config with
random weights drawn on the GPU in its published expert format
(:data:`coldset.measure.harness.RANDOM_FAMILIES`: gpt-oss-20b bf16, gpt-oss-120b MXFP4, deepseek-v3
block FP8 on ``--moe-layers`` of its MoE layers, glm-4.5-air bf16 on a subset, qwen3-30b-a3b bf16,
the reference), through its family's own modules (:mod:`coldset.engine.random_weights`;
``R["model_family"]`` says what was built). The floor counts that format's bytes per chosen expert
(its rows, scale rows and biases: :func:`coldset.measure.harness.expert_read_bytes`) and the
family's non-expert weights in bf16 (:func:`nonexpert_read_bytes`: the unchosen experts' resident
biases are not read); an engine the family refuses (the fused step: every family but qwen3_moe and
mixtral) is an error row. ``R["step_shares"]``: the step without the routed experts over the full
step at batch 1, beside the non-expert bytes' share of the floor (:func:`step_shares`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from coldset.measure.harness import (FP8_NONEXPERT, RANDOM_FAMILIES, WEIGHT_FORMATS, MeasureError,
                                     add_family_arguments, check_family_arguments, expert_format, expert_read_bytes,
                                     fp8_expert_pools,
                                     kernel_profile, load_module, log, new_result, random_family_model,
                                     require_cuda, spread, write_result)
from coldset.analysis.placement import expert_bytes, nonexpert_bytes_breakdown
from coldset.bench import decode as bn
from coldset.core import mxfp4
from coldset.core.fp8 import FORMAT_NAME
from coldset.core.shapes import get_weight_format
from coldset.core.timing import eager_time_us
from coldset.engine.loading import attach_fp8_attention
from coldset.engine.model import fp8_attention_linears
from coldset.engine.synthetic import SyntheticSpec, build_synthetic_model, synthetic_tokenizer
from coldset.kernels.reference import torch_experts
from coldset.kernels.tiers import ExpertPools
from coldset.kernels.tune import (
    TuneResult,
    TuneShape,
    autotune,
    config_for,
    default_search_space,
    tuned_experts,
    untimed_candidates,
)
from coldset.trace.fixtures import template_texts
from coldset.verify.gate import experts_functions
from coldset.workflow.config import load_config

#: The fused engines: compile_decode's default (dependent launch where it measured faster: batch 1
#: on Hopper), and each way forced.
FUSED_PDL = {"fused": None, "fused-pdl": True, "fused-nopdl": False}
ENGINES = ("eager", "compiled", *FUSED_PDL)
PROMPT_TOKENS, NEW_TOKENS, BATCHES = 32, 16, (1, 8)


def add_arguments(p) -> None:
    p.add_argument("--config", default="config/examples/qwen3-30b-a3b-h200.yaml",
                   help="workflow config whose model.synthetic shape and fixtures are measured")
    p.add_argument("--out", required=True, help="folder for decode_step.json")
    add_family_arguments(p)
    tuning = p.add_mutually_exclusive_group()
    tuning.add_argument("--tune", action="store_true", help="autotune the experts kernel for batch 1 and 8 first")
    tuning.add_argument("--tuned", help="an autotune cache entry (JSON) whose experts configs to use")
    p.add_argument("--engines", default="eager,compiled,fused",
                   help=f"comma-separated: {', '.join(ENGINES)}; NAME@base with --baseline-module")
    p.add_argument("--reps", type=int, default=50, help="timed calls of the step per round (their median)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of --reps calls: median and spread of the rounds")
    p.add_argument("--baseline-module",
                   help="another triton_moe.py (e.g. `git show main:src/coldset/kernels/triton_moe.py`): an engine "
                        "named NAME@base runs engine NAME with that module's triton_experts on the same tuned "
                        "configs (needs --tuned or --tune), for a before/after of the experts kernel in one process")
    p.add_argument("--float32-check", action="store_true",
                   help="also each engine's first decode step against the same weights in float32 (eager, torch "
                        "experts), fed the engine's own first token: tells rounding from an engine that computes "
                        "something else (float32_check in the JSON)")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="bf16",
                   help="fp8: also every engine with the experts quantized to block FP8 (all in HBM), beside bf16 in "
                        "the same run (same model, same tokens): FP8 step against bf16 step")
    fp8_tuning = p.add_mutually_exclusive_group()
    fp8_tuning.add_argument("--tuned-fp8",
                            help="with --weight-format fp8: an autotune cache entry (JSON) of the FP8 shape whose "
                                 "configs the FP8 kernel runs (default: its documented defaults; --tune tunes both)")
    fp8_tuning.add_argument("--tune-fp8", action="store_true",
                            help="with --weight-format fp8: autotune the FP8 kernel alone for batch 1 and 8 first "
                                 "(e.g. beside --tuned for the bf16 kernel)")


def check_arguments(args) -> None:
    """:class:`MeasureError` naming a bad count, engine or combination before anything is built."""
    if args.reps < 1 or args.rounds < 1:
        raise MeasureError(f"--reps {args.reps} and --rounds {args.rounds}: each must be at least 1")
    check_engines(args.engines.split(","), bool(args.baseline_module))
    check_family_arguments(args)
    if args.model_family != "synthetic" and (args.weight_format != "bf16" or args.baseline_module):
        raise MeasureError(f"--model-family {args.model_family} runs its published expert format "
                           f"({RANDOM_FAMILIES[args.model_family].expert_format}); --weight-format fp8 and "
                           "--baseline-module are the synthetic model's")
    if args.baseline_module and not (args.tune or args.tuned):
        raise MeasureError("--baseline-module needs --tune or --tuned (the configs both kernels run)")
    fp8 = args.weight_format == "fp8"
    if fp8 and args.baseline_module:
        raise MeasureError("--baseline-module is a bf16 triton_moe.py: it does not run with --weight-format fp8")
    if args.tuned_fp8 and not fp8:
        raise MeasureError(f"--tuned-fp8 {args.tuned_fp8} needs --weight-format fp8")
    if args.tune_fp8 and not fp8:
        raise MeasureError("--tune-fp8 needs --weight-format fp8")
    if (args.tuned_fp8 or args.tune_fp8) and args.tune:
        raise MeasureError(f"{'--tuned-fp8' if args.tuned_fp8 else '--tune-fp8'} with --tune: --tune tunes the FP8 "
                           "kernel too; give one of them")
    for flag, path in (("--tuned", args.tuned), ("--tuned-fp8", args.tuned_fp8)):
        if path and not Path(path).is_file():
            raise MeasureError(f"{flag} {path}: no such file")


def check_engines(names: list[str], baseline: bool) -> None:
    """:class:`MeasureError` for an unknown engine or an ``@base`` engine without a baseline."""
    for mode in names:
        engine, at, which = mode.partition("@")
        if engine not in ENGINES or (at and which != "base"):
            raise MeasureError(f"unknown engine {mode!r} (one of {', '.join(ENGINES)}; NAME@base)")
        if at and not baseline:
            raise MeasureError(f"engine {mode!r} needs --baseline-module")


def baseline_experts(path: str, result):
    """The engine's experts function with the triton_experts of another copy of triton_moe.py
    (the unmodified path, as ``tuned_experts(result, use_row_map=False)``), each batch size on its
    tuned config restricted to the fields that copy knows."""

    mod = load_module(path)
    known = set(mod.KernelConfig.__dataclass_fields__)
    variants = hasattr(mod, "epilogue_args")  # a copy without it computes neither biases nor the clamped SwiGLU
    chosen: dict[int, dict] = {}

    def experts(pools, layer, x, topk_ids, topk_weights):
        if not variants and (pools.has_bias or pools.activation.kind != "silu"):
            raise MeasureError(f"--baseline-module {path}: that triton_moe.py computes no expert biases or "
                               "activation variants, and these pools have them")
        bs = int(x.shape[0])
        if bs not in chosen:
            chosen[bs] = {k: v for k, v in config_for(result, bs).items() if k in known}
        return mod.triton_experts(pools, layer, x, topk_ids, topk_weights, config=chosen[bs], use_row_map=False)

    return experts


def _tuned_from_file(path: str, shape):
    """The :class:`coldset.kernels.tune.TuneResult` of an autotune entry's configs, for ``shape``."""

    entry = json.loads(Path(path).read_text())
    return TuneResult(key=entry["key"], hit=True, backend=entry["backend"], shape=shape,
                      batch_sizes=[int(b) for b in entry["configs"]],
                      configs={int(b): c for b, c in entry["configs"].items()})


def fp8_speedup(rows: list[dict], floor: dict, floor_fp8: dict) -> dict:
    """Per ``engine/bBATCH`` timed in both formats: ``bf16_over_fp8`` = bf16 step / FP8 step (the
    medians), its ``range`` over the rounds (slowest bf16 over fastest FP8 and the reverse) and
    ``floor_ratio`` = bf16 floor / FP8 floor, the speedup the bytes alone allow."""
    def full(fmt):
        return {(r["mode"], r["batch"]): r for r in rows if r["experts"] == "full" and r.get("weight_format") == fmt}

    bf, f8 = full("bf16"), full("fp8")
    out = {}
    for (mode, b), r in bf.items():
        if (mode, b) not in f8:
            continue
        s, s8 = r["step_ms_spread"], f8[mode, b]["step_ms_spread"]
        fl = floor[b] if b in floor else floor[str(b)]
        fl8 = floor_fp8[b] if b in floor_fp8 else floor_fp8[str(b)]
        out[f"{mode}/b{b}"] = {"bf16_over_fp8": s["median"] / s8["median"],
                               "range": [s["min"] / s8["max"], s["max"] / s8["min"]],
                               "floor_ratio": fl["floor_ms"] / fl8["floor_ms"]}
    return out


def nonexpert_read_bytes(cfg, batch_size: int, dtype) -> int:
    """Non-expert weight bytes a decode step must read (:func:`coldset.bench.decode._nonexpert_read_bytes`)
    without the routed experts' biases: resident for every expert, but a step reads those of the
    experts it chose, which the floor counts with each chosen expert
    (:func:`coldset.measure.harness.expert_read_bytes`)."""
    biases = nonexpert_bytes_breakdown(cfg, str(dtype).removeprefix("torch.")).get("expert_biases", 0)
    return bn._nonexpert_read_bytes(cfg, batch_size, dtype) - biases


def nonexpert_read_bytes_fp8(cfg, batch_size: int, dtype) -> int:
    """Non-expert weight bytes a decode step of the FP8 model must read: those of the model dtype
    (:func:`coldset.bench.decode._nonexpert_read_bytes`: every weight once, the batch's embedding rows) with,
    at one token, the attention projections (``cfg.attention_linears``: q, k, v and o_proj, the
    fused step's FP8 GEMVs) at the published format's bytes (``fp8_block128``: 1 byte a weight and
    a float32 scale per 128 x 128 block) instead of the dtype's. A floor: the GEMV reads its scales
    expanded per row (:func:`coldset.core.fp8.row_scales`, 4 bytes a row and 128-column group, ~3% of the
    FP8 bytes), which is not counted. From 2 tokens on the projections run dequantized (cuBLAS on the
    model-dtype weights), so they count in the dtype."""

    total = nonexpert_read_bytes(cfg, batch_size, dtype)
    if batch_size != 1:
        return total
    dt, f8 = get_weight_format(str(dtype).removeprefix("torch.")), get_weight_format(FORMAT_NAME)
    for _, rows, cols, count in cfg.attention_linears:
        total -= count * (dt.matrix_bytes(rows, cols) - f8.matrix_bytes(rows, cols))
    return total


@dataclass
class StepRun:
    """What the engines' timings share: the arguments, the result being written, the model and
    its prompts per batch, the formats timed (name, all-hot pools, experts functions by engine
    suffix, bytes of one expert), the bf16 tune (for the provenance) and each engine's tokens and
    logits (the checks). The first format is the model's own (:attr:`primary`: bf16 for the
    synthetic model, a ``--model-family``'s published one): its floor is ``R["floor"]`` and only it
    times the step without experts; a second one (``--weight-format fp8``) is ``floor_fp8``."""

    args: object
    R: dict
    out_path: Path
    ceilings: dict
    model: object
    experts: object  # the bf16 experts function the model runs between engines
    tuned: object
    formats: list = field(default_factory=list)
    prompts_by_b: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)
    tokens_by_mode: dict = field(default_factory=dict)
    logits_by_mode: dict = field(default_factory=dict)

    def save(self) -> None:
        write_result(self.out_path, self.R, self.ceilings, self.tuned)

    @property
    def primary(self) -> str:
        return self.formats[0][0]

    def floor_key(self, fmt: str) -> str:
        return "floor" if fmt == self.primary else f"floor_{fmt}"


def build_model(config: dict, dev, family: str = "synthetic", moe_layers: int | None = None, R: dict | None = None):
    """The config's in-memory synthetic model (every expert in HBM), its tokenizer and the
    fixture-like texts its prompts are cut from. ``family`` other than ``synthetic``: a model of
    that published config with random weights drawn on the GPU
    (:func:`coldset.measure.harness.random_family_model`, ``moe_layers`` of its MoE layers, what was
    built in ``R["model_family"]``; the step's time does not depend on the values), prompted
    through the config's synthetic tokenizer (its ids lie within every family's vocabulary)."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    spec = SyntheticSpec(**config["model"]["synthetic"])
    fx = config["fixtures"]
    texts = template_texts(fx["domains"], 200, seed=fx["seed"] + 1, template_dir=fx["template_dir"])
    if family != "synthetic":
        tokenizer = synthetic_tokenizer(spec, texts)[0]
        model = random_family_model(family, dev, moe_layers, R if R is not None else {})
        return model, tokenizer, texts
    model, tokenizer = build_synthetic_model(spec, dev, getattr(torch, config["model"]["dtype"]), domain_texts=texts)
    log("model built")
    return model, tokenizer, texts


def tune_shape(config: dict, cfg, pools):
    """The experts' autotune shape of the model (all hot), with its experts' biases and activation."""

    L = cfg.num_moe_layers
    return TuneShape(num_experts=cfg.num_experts, hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size,
                     top_k=cfg.top_k, dtype=config["model"]["dtype"], num_moe_layers=L,
                     num_hot=L * cfg.num_experts, num_cold=0, expert_bias=pools.has_bias,
                     weight_format=FORMAT_NAME if pools.is_fp8 else mxfp4.FORMAT_NAME if pools.is_mxfp4 else None,
                     activation=pools.activation)


def bf16_experts(args, dev, shape, R: dict):
    """The bf16 experts function (``--tune``: autotuned now; ``--tuned``: an entry's configs; else
    the parity gate's default) and its tune result (None without)."""

    experts, result = experts_functions(dev, None)[0], None
    if args.tune:
        t = time.perf_counter()
        result = autotune(shape, list(BATCHES), "cuda", "/tmp/coldset-autotune")
        R["autotune_s"] = time.perf_counter() - t
        experts = tuned_experts(result, use_row_map=False)
        R["tuned_configs"] = result.configs
        log("autotune", R["autotune_s"], "s")
    elif args.tuned:
        result = _tuned_from_file(args.tuned, shape)
        experts = tuned_experts(result, use_row_map=False)
        R["tuned_configs"] = result.configs
        R["tuned_from"] = args.tuned
    return experts, result


def fp8_format(args, dev, model, shape, R: dict) -> tuple:
    """``--weight-format fp8``'s format: the model's experts quantized to block FP8 and the FP8
    kernel's experts function (its defaults, ``--tuned-fp8``'s configs, or autotuned now with
    ``--tune`` / ``--tune-fp8``: a candidate the tune excluded fails the run)."""
    from dataclasses import replace  # GPU-only path: loads when a measurement runs

    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    t = time.perf_counter()
    pools8 = fp8_expert_pools(model.pools)
    torch.cuda.synchronize()
    R["fp8_quantize_s"] = time.perf_counter() - t
    shape8 = replace(shape, weight_format=expert_format("fp8"))
    experts8 = experts_functions(dev, None)[0]  # triton_experts dispatches FP8 pools to triton_fp8, defaults
    R["fp8_configs_from"] = "triton_fp8.default_config"
    if args.tune or args.tune_fp8:
        t = time.perf_counter()
        tuned8 = autotune(shape8, list(BATCHES), "cuda", "/tmp/coldset-autotune")
        R["fp8_autotune_s"] = time.perf_counter() - t
        experts8, R["fp8_tuned_configs"] = tuned_experts(tuned8, False), tuned8.configs
        # every candidate's µs per layer, so a config that lost is seen losing (not only the winner)
        R["fp8_tune_timings_us"] = {str(b): t for b, t in tuned8.timings_us.items()}
        # a candidate the tune excluded (an error, or an output unlike its torch path) fails the run
        lost = untimed_candidates(tuned8, default_search_space(dev, shape8.weight_format))
        if lost:
            R.setdefault("fails", []).append(f"FP8 autotune excluded candidates (see the warnings): {lost}")
        R["fp8_configs_from"] = "autotuned in this run"
        log("FP8 autotune", R["fp8_autotune_s"], "s", tuned8.configs)
    elif args.tuned_fp8:
        tuned8 = _tuned_from_file(args.tuned_fp8, shape8)
        experts8, R["fp8_tuned_configs"], R["fp8_configs_from"] = tuned_experts(tuned8, False), tuned8.configs, \
            args.tuned_fp8
    return "fp8", pools8, {"": experts8}, expert_bytes(model.config, expert_format("fp8"))


def measure_floors(s: StepRun) -> None:
    """The bytes floor per step and format: every non-expert weight once (the batch's embedding
    rows), and each distinct expert the batch chose per layer (eager routing capture over the
    same tokens), per format (FP8: its own routing, its bytes per expert): ``R["floor"]`` bf16's,
    ``R["floor_fp8"]`` FP8's."""

    model, R, cfg = s.model, s.R, s.model.config
    for fmt, pools, fns, ebytes in s.formats:
        floor = R[s.floor_key(fmt)] = {}
        model.pools, model.experts_fn = pools, fns[""]
        second = fmt != s.primary  # --weight-format fp8's: attention projections FP8 too
        restore = attach_fp8_attention(model) if second else None  # the FP8 model's own routing
        try:
            for b, prompts in s.prompts_by_b.items():
                _, _, hot_per_token, _ = bn.measure_routing(model, prompts, NEW_TOKENS, ebytes)
                nonexpert = nonexpert_read_bytes_fp8(cfg, b, model.dtype) if second else \
                    nonexpert_read_bytes(cfg, b, model.dtype)
                step_bytes = nonexpert + hot_per_token * b
                floor[b] = {"bytes_per_step": step_bytes, "expert_bytes_per_step": hot_per_token * b,
                            "nonexpert_bytes_per_step": nonexpert,
                            "floor_ms": step_bytes / (R["hbm_read_GBps"] * 1e6)}
        finally:
            if restore is not None:
                restore()
        log("floor", fmt, floor)
    model.pools, model.experts_fn = s.formats[0][1], s.experts


def no_experts(pools, layer, x, topk_ids, topk_weights):
    """The step with the routed experts replaced by zeros (it reads none)."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    return torch.zeros_like(x)


def decode_tokens(s: StepRun, dec, tok):
    """16 greedy steps of a captured decoder from its first token: the tokens and each step's logits."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    toks, logs = [tok], []
    for step in range(1, NEW_TOKENS):
        dec.set_step(tok, step)
        lg = dec.step()
        logs.append(lg.float().clone())
        tok = torch.argmax(lg, dim=-1)
        toks.append(tok)
    return torch.stack(toks, 1), torch.stack(logs, 1)


def step_row(s: StepRun, dec, mode: str, bsz: int, name: str, fmt: str) -> dict:
    """The timed row of a captured step: ``--rounds`` medians of ``--reps`` calls (median round
    with the slowest and fastest), tok/s; a full step also its floor and a kernel profile."""

    args, R = s.args, s.R
    ms = spread([eager_time_us(dec.step, args.reps) / 1e3 for _ in range(args.rounds)])
    row = {"mode": mode, "batch": bsz, "experts": name, "step_ms": ms["median"], "step_ms_spread": ms,
           "tok_s": bsz * 1e3 / ms["median"]}
    if args.weight_format != "bf16":
        row["weight_format"] = fmt
        row["nonexpert_fp8"] = fp8_attention_linears(s.model, bsz)  # [] unless fused at batch 1
    if name == "full":
        row["floor_ms"] = R[s.floor_key(fmt)][bsz]["floor_ms"]
        row["fraction_of_floor"] = row["floor_ms"] / ms["median"]
        row["fraction_of_floor_range"] = [row["floor_ms"] / ms["max"], row["floor_ms"] / ms["min"]]
        try:
            row["profile"] = kernel_profile(dec.step, layers=len(s.model.layers))
        except Exception as exc:  # the profiler is a diagnosis, not the measurement
            row["profile"] = {"error": repr(exc)}
    return row


def run_engine(s: StepRun, mode: str, t: float, experts_fn, fmt: str = "bf16") -> None:
    """One engine on the model's current pools (``fmt``: their weight format; rows and check
    keys of a second format carry it); the step without experts only once (the primary format),
    it reads none."""

    model, key = s.model, "" if fmt == s.primary else f" {fmt}"
    for bsz in BATCHES:
        for name in (("full", "no_experts") if bsz == 1 and fmt == s.primary else ("full",)):
            model.experts_fn = experts_fn if name == "full" else no_experts
            dec = bn.Decoder(model, bsz, PROMPT_TOKENS, NEW_TOKENS, True)
            tok = dec.prefill(s.prompts_by_b[bsz])
            dec.set_step(tok, 1)
            dec.capture()
            if bsz == 1 and name == "full" and fmt == s.primary:  # the first capture pays the compile
                s.R.setdefault("compile_s", {})[mode] = time.perf_counter() - t
            toks, logits = decode_tokens(s, dec, tok)
            if name == "full":
                s.tokens_by_mode[f"{mode}{key}/b{bsz}"] = toks.tolist()
                s.logits_by_mode[f"{mode}{key}/b{bsz}"] = logits
            row = step_row(s, dec, mode, bsz, name, fmt)
            s.rows.append(row)
            log({k: v for k, v in row.items() if k != "profile"},
                {k: v for k, v in row.get("profile", {}).items() if k != "top"})
            del dec
            s.save()


def run_engines(s: StepRun, engines: list[str]) -> None:
    """Every engine (its decode region compiled once) in every format; an engine that fails
    (e.g. a launch mode the driver refuses, a fused step the family refuses) is a result
    (``R["errors"]``)."""
    import torch._dynamo as dynamo  # GPU-only path: torch and the kernels load when a measurement runs

    model = s.model
    for mode in engines:
        dynamo.reset()
        model._compiled_before_experts = model._fused_head = None
        t = time.perf_counter()
        engine, _, which = mode.partition("@")
        try:
            if engine == "compiled":
                model.compile_decode(fused=False)
            elif engine in FUSED_PDL:
                model.compile_decode(fused=True, pdl=FUSED_PDL[engine])
        except ValueError as exc:  # a family whose modules the fused kernels do not implement
            s.R.setdefault("errors", {})[mode] = repr(exc)[:500]
            log("engine", mode, "refused:", repr(exc)[:500])
            continue
        for fmt, pools, fns, _ in s.formats:  # the compiled region is the same for every format
            model.pools = pools
            restore = attach_fp8_attention(model) if fmt != s.primary else None  # FP8 attention for FP8 rows only
            try:
                run_engine(s, mode, t, fns[which], fmt)
            except Exception as exc:  # one engine failing (e.g. a launch mode the driver refuses) is a result
                label = mode if fmt == s.primary else f"{mode} {fmt}"
                s.R.setdefault("errors", {})[label] = repr(exc)[:500]
                log("engine", label, "failed:", repr(exc)[:500])
            finally:
                if restore is not None:
                    restore()
    model.pools, model.experts_fn = s.formats[0][1], s.experts


def compare(s: StepRun, a: str, b: str, bsz: int) -> dict | None:
    """Token match rate and largest logit difference of two engines' runs (None if one is missing),
    and their first decode step alone: its largest logit difference and the reference's smallest
    gap between its two best logits. Why: once one greedy token differs the sequences part, so the
    whole run's figures cannot tell a near tie that flipped (first-step difference below the gap)
    from an engine that computes something else."""
    if a not in s.tokens_by_mode or b not in s.tokens_by_mode:
        return None
    e, c = s.tokens_by_mode[a], s.tokens_by_mode[b]
    same = sum(x_ == y_ for x, y in zip(e, c) for x_, y_ in zip(x, y)) / (bsz * NEW_TOKENS)
    la, lb = s.logits_by_mode[a], s.logits_by_mode[b]
    top2 = la[:, 0].topk(2, dim=-1).values
    return {"token_match": same, "max_abs_logit_diff": (la - lb).abs().max().item(),
            "first_step_max_abs_logit_diff": (la[:, 0] - lb[:, 0]).abs().max().item(),
            "first_step_top2_gap_min": (top2[:, 0] - top2[:, 1]).min().item()}


def record_checks(s: StepRun, engines: list[str]) -> None:
    """Every engine against the first one's tokens per format; with FP8 the speedup per engine and
    batch and FP8 against bf16 (a token match rate, not checked)."""
    R = s.R
    R["checks"] = {}
    ref = engines[0]
    for fmt, *_ in s.formats:
        key = "" if fmt == s.primary else f" {fmt}"
        for mode in engines:
            for bsz in BATCHES:
                got = compare(s, f"{ref}{key}/b{bsz}", f"{mode}{key}/b{bsz}", bsz)
                if got is not None:
                    R["checks"][f"{mode}{key}/b{bsz}"] = got
    R["checks_against"] = ref
    if len(s.formats) > 1:
        R["fp8_speedup"] = fp8_speedup(s.rows, R["floor"], R["floor_fp8"])
        R["fp8_vs_bf16"] = {f"{mode}/b{bsz}": got for mode in engines for bsz in BATCHES
                            if (got := compare(s, f"{mode}/b{bsz}", f"{mode} fp8/b{bsz}", bsz)) is not None}
        log("bf16 step / FP8 step", {k: round(v["bf16_over_fp8"], 3) for k, v in R["fp8_speedup"].items()})


def float32_experts(pools, layer, x, topk_ids, topk_weights):
    """The routed experts of ``layer`` in float32 for the float32 reference: bf16 pools' chosen
    experts upcast (exactly) one layer at a time, so the reference never holds a float32 copy of
    every expert; scaled pools (FP8, MXFP4) as they are, whose torch path already computes in
    float32 from their exact dequantization (:func:`coldset.kernels.reference.torch_experts`)."""
    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    if pools.has_scales:
        return torch_experts(pools, layer, x, topk_ids, topk_weights)
    chosen, local = torch.unique(topk_ids, return_inverse=True)  # sorted: torch_experts' loop order kept
    with torch.inference_mode(False):  # the decode runs in inference mode; pools track their row map's version
        chosen = chosen.clone()
        rows = pools.row_map[layer, chosen].long()
        bias = {}
        if pools.has_bias:
            bias = dict(w13_bias=pools.w13_bias[layer, chosen].float()[None],
                        w2_bias=pools.w2_bias[layer, chosen].float()[None])
        one = ExpertPools.all_hot(pools.w13_hot[rows].float()[None], pools.w2_hot[rows].float()[None],
                                  activation=pools.activation, **bias)
    return torch_experts(one, 0, x, local, topk_weights)


def float32_check(s: StepRun, engines: list[str]) -> dict:
    """Each engine's first decode step (every batch) against the same weights in float32: the
    non-expert weights upcast in a copy of the model, the experts through :func:`float32_experts`,
    eager, fed the engine's own prefill token. Why: two engines whose greedy tokens part after a
    few steps either round differently (each near float32, at alike distances) or one computes
    something else (it alone far off). Per engine and batch: the largest logit difference, the
    float32 logits' smallest top-2 gap and whether the first decoded token agrees with float32's."""
    import copy

    import torch  # GPU-only path: torch and the kernels load when a measurement runs

    model = s.model
    kept = model.pools, model._compiled_before_experts, model._fused_head
    model.pools = model._compiled_before_experts = model._fused_head = None  # not copied: the engines are done
    try:
        ref = copy.deepcopy(model).float()
    finally:
        model.pools, model._compiled_before_experts, model._fused_head = kept
    ref.pools, ref.experts_fn, ref.cache_shape = model.pools, float32_experts, None
    out = {}
    for bsz in BATCHES:
        keys = [k for k in (f"{mode}/b{bsz}" for mode in engines) if k in s.tokens_by_mode]
        if not keys:
            continue
        dec = bn.Decoder(ref, bsz, PROMPT_TOKENS, NEW_TOKENS, False)
        dec.prefill(s.prompts_by_b[bsz])  # once: each engine's first step rewrites the same cache slot
        for key in keys:
            dec.set_step(torch.tensor([row[0] for row in s.tokens_by_mode[key]], device=ref.device), 1)
            want = dec.step().float()
            got = s.logits_by_mode[key][:, 0].to(want.device)
            top2 = want.topk(2, dim=-1).values
            out[key] = {"first_step_max_abs_logit_diff": (got - want).abs().max().item(),
                        "float32_top2_gap_min": (top2[:, 0] - top2[:, 1]).min().item(),
                        "logit_abs_max": want.abs().max().item(),
                        "first_token_agrees": bool((got.argmax(-1) == want.argmax(-1)).all())}
        del dec
    del ref
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def step_shares(rows: list[dict], floor: dict, primary: str = "bf16") -> dict:
    """Per engine at batch 1 (the primary format): the step without its routed experts (attention,
    routers, norms, shared experts, dense layers, LM head: :func:`no_experts`) over the full step
    (``without_routed_experts``, medians), and the non-expert bytes' share of the bytes floor
    (``nonexpert_bytes_of_floor``): how much of the step is not the experts, measured and by bytes."""
    steps = {(r["mode"], r["experts"]): r["step_ms"] for r in rows
             if r["batch"] == 1 and r.get("weight_format", primary) == primary}
    fl = floor[1] if 1 in floor else floor["1"]
    return {mode: {"without_routed_experts": steps[mode, "no_experts"] / full,
                   "nonexpert_bytes_of_floor": fl["nonexpert_bytes_per_step"] / fl["bytes_per_step"]}
            for (mode, name), full in steps.items() if name == "full" and (mode, "no_experts") in steps}


def run(args, argv=None) -> dict:
    """Measure (see module doc); returns the result written to ``--out``/decode_step.json."""
    check_arguments(args)
    engines = args.engines.split(",")
    dev = require_cuda()
    from torch._dynamo.utils import counters  # GPU-only path: torch and the kernels load when a measurement runs

    out_path = Path(args.out) / "decode_step.json"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    config = load_config(args.config)
    R = new_result("step", argv, args)
    R["config"] = args.config
    ceilings = bn.measure_ceilings()
    R["hbm_read_GBps"] = ceilings["hbm_read_gb_s"]
    log("HBM read GB/s", R["hbm_read_GBps"])
    model, tokenizer, texts = build_model(config, dev, args.model_family, args.moe_layers, R)
    R.setdefault("model_family", args.model_family)  # a family's: what was built (harness.random_family_model)
    primary = "bf16" if args.model_family == "synthetic" else RANDOM_FAMILIES[args.model_family].expert_format
    tuning = args.tune or args.tuned or args.weight_format == "fp8"
    shape = tune_shape(config, model.config, model.pools) if tuning else None  # what the autotunes key on
    experts, result = bf16_experts(args, dev, shape, R)
    s = StepRun(args, R, out_path, ceilings, model, experts, result)
    experts_by_name = {"": experts}
    if args.baseline_module:
        experts_by_name["base"] = baseline_experts(args.baseline_module, result)
        R["baseline_module"] = args.baseline_module
    s.formats.append((primary, model.pools, experts_by_name, expert_read_bytes(model.pools)))
    if args.weight_format == "fp8":
        s.formats.append(fp8_format(args, dev, model, shape, R))
        R["expert_bytes"] = {name: b for name, _, _, b in s.formats}
        R["fp8_nonexpert"] = FP8_NONEXPERT
        log("FP8 experts quantized in", R["fp8_quantize_s"], "s; bytes per expert", R["expert_bytes"])
    fx = config["fixtures"]
    stream = [t for d in fx["domains"] for text in texts[d][:4] for t in tokenizer.encode(text).ids]
    s.prompts_by_b = {b: bn.bench_prompts(stream, b, PROMPT_TOKENS) for b in BATCHES}
    measure_floors(s)
    R["rows"] = s.rows
    run_engines(s, engines)
    R["dynamo"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break", "recompiles")}
    record_checks(s, engines)
    R["step_shares"] = step_shares(s.rows, R["floor"], primary)
    if args.float32_check:
        R["float32_check"] = float32_check(s, engines)
        log("first decode step against float32", R["float32_check"])
    s.save()
    for r in s.rows:
        if "top" in r.get("profile", {}):
            log(r["mode"], f"b{r['batch']}", "top kernels (name, per step, us per step):",
                [(t["name"][:48], t["per_step"], t["us_per_step"]) for t in r["profile"]["top"][:12]])
    return R
