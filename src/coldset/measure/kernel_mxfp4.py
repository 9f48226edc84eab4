"""The MXFP4 experts kernel's paths at gpt-oss-120b's shape on one CUDA GPU, beside the bf16 kernel,
against plain reads of the same bytes measured in the same run.

``PYTHONPATH=src python -m coldset.measure.kernel_mxfp4`` (no snakemake, no mlflow): hidden 2880,
intermediate 2880, 128 experts, top-4, gpt-oss's expert biases and clamped SwiGLU (limit 7), bf16
tokens, at 1 / 4 / 16 / 64 / 256 / 2048 tokens (``--batches``). Random weights: MXFP4 experts as
random e2m1 bytes with e8m0 scales around 2^-7 (the magnitude of 1/sqrt(2880) weights), bf16
experts ``randn / sqrt(K)``; ``--layers`` layers of each, every layer's call captured in one CUDA
graph and replayed (:func:`coldset.core.timing.graph_time_us`, the median of ``--reps``), so no
layer's weights are served from L2 by the one before.

The configs are the kernel's search space (``coldset/kernels/configs/triton_mxfp4.json``: the
decode list up to 64 tokens, prefill above), or those of a file of the same shape (``--configs``, to
try configs outside the search space); ``--variants`` keeps some paths only. Each config is one
of the paths :func:`variant_of` names: ``dot-values`` (bf16 dots on tiles unpacked value by value),
``dot-words`` (the same dots and bits, tiles unpacked by 32-bit words), ``dot-f16`` (fp16 dots, one
per scale group), ``gemv`` (no dot: one or two pairs a block, products summed in registers; in
Gluon, ``gemv-gluon``) and ``mma-gluon`` (a chunk of pairs a block, the MMA's operands from
registers).
Per batch, first the correctness of every config, on
fresh random tokens and routing, with the memory each output lands in poisoned (NaN) first: against
the torch path on the same pools (:func:`coldset.kernels.torch_experts`: exact dequantization,
float32 GEMMs), each output within 2^-7 of |ref| + RMS(ref) (the bf16 outputs' rounding plus a
flip of the intermediate's); the bf16 kernel against its torch path (relative norm error below
1e-2). A config that is wrong or does not compile is not timed and is listed; the others still
are, and the command exits 1 at the end when any was wrong. A bf16 failure leaves the bf16 columns
empty, with the reason printed. Then the times of each config and of the bf16 kernel at its
default config; each as a percentage of the time a plain streaming read
(:func:`coldset.kernels.bandwidth.best_read_bandwidth`) takes for the same bytes (the selected
experts' blocks, scales and biases; bf16: their weights and biases), read one layer's worth a
launch as the kernels do. ``--budget-s`` bounds the checks and times: a batch may run until the
budget's end less :data:`ROW_RESERVE_S` for each batch after it, and configs past that are skipped
(and listed as such). Last on stdout: every config's µs per
batch, then the table of each path's best; ``--out FILE`` also writes the rows as JSON.

``--tiny`` runs the same steps at a tiny shape (hidden 64, intermediate 64, 8 experts, top-2) and,
without CUDA, under Triton's interpreter (``TRITON_INTERPRET=1``): the correctness checks only, no
times (a CPU time of these kernels means nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import torch

from coldset.core import mxfp4
from coldset.core.timing import graph_time_us
from coldset.kernels import torch_experts, torch_softmax_topk
from coldset.kernels.activation import swiglu_clamped
from coldset.kernels.configs import load as load_kernel_configs
from coldset.kernels.tiers import ExpertPools
from coldset.measure.harness import MeasureError, log

GPT_OSS_120B = dict(hidden=2880, inter=2880, experts=128, top_k=4)
TINY = dict(hidden=64, inter=64, experts=8, top_k=2)
SWIGLU_LIMIT = 7.0  # gpt-oss's swiglu_limit
#: The kernel paths (:func:`variant_of`), as the table's columns.
VARIANTS = ("dot-values", "dot-words", "dot-f16", "gemv", "gemv-gluon", "mma-gluon")
ROW_RESERVE_S = 12.0  # of --budget-s, kept for each batch still to run
SCALE_BYTES = (119, 120, 121, 122)  # e8m0 scales drawn from these: weights of magnitude about 2^-7 x e2m1


@dataclass
class Setup:
    args: argparse.Namespace
    device: torch.device
    hidden: int
    inter: int
    experts: int
    top_k: int
    layers: int
    mx: ExpertPools
    bf16: ExpertPools
    gen: torch.Generator
    bf16_failure: str | None = None  # why the bf16 kernel is not timed (its check failed), None while it holds

    @property
    def timed(self) -> bool:
        return self.device.type == "cuda"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m coldset.measure.kernel_mxfp4", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,4,16,64,256,2048", help="tokens per call, comma-separated")
    p.add_argument("--layers", type=int, default=4, help="layers of experts, each one call in the timed graph")
    p.add_argument("--reps", type=int, default=20, help="graph replays per timing (their median)")
    p.add_argument("--tiny", action="store_true", help="a tiny shape; on the CPU under TRITON_INTERPRET=1, no times")
    p.add_argument("--out", default=None, help="write the rows as JSON to this file")
    p.add_argument("--variants", default="all",
                   help=f"kernel paths to run, comma-separated: {', '.join(VARIANTS)} (default all)")
    p.add_argument("--configs", default=None,
                   help="a JSON file of configs to run instead of the search space: {\"decode\": [...], \"prefill\": "
                        "[...]} as in coldset/kernels/configs/triton_mxfp4.json's search_space (a missing list: none)")
    p.add_argument("--budget-s", type=float, default=180.0,
                   help="seconds after which configs not yet timed are skipped (and listed as such)")
    args = p.parse_args(argv)
    try:
        args.batch_list = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        p.error(f"--batches {args.batches!r}: comma-separated token counts expected")
    args.variant_list = None if args.variants == "all" else tuple(v.strip() for v in args.variants.split(","))
    if args.variant_list and not set(args.variant_list) <= set(VARIANTS):
        p.error(f"--variants {args.variants!r}: 'all' or some of {', '.join(VARIANTS)}")
    if not args.batch_list or min(args.batch_list) < 1 or args.layers < 1 or args.reps < 1:
        p.error("--batches, --layers and --reps must be positive")
    args.space = None
    if args.configs:
        try:
            with open(args.configs) as f:
                args.space = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            p.error(f"--configs {args.configs}: {exc}")
        if not isinstance(args.space, dict) or not set(args.space) <= {"decode", "prefill"} or not all(
                isinstance(v, list) and all(isinstance(c, dict) for c in v) for v in args.space.values()):
            p.error(f"--configs {args.configs}: an object with lists of config objects under 'decode' and/or "
                    "'prefill' expected")
    return args


def build(args) -> Setup:
    """MXFP4 and bf16 pools of ``--layers`` layers, all hot, with the same biases and activation."""
    shape = TINY if args.tiny else GPT_OSS_120B
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.tiny:
        device = torch.device("cpu")
    else:
        raise MeasureError("needs a CUDA GPU (or --tiny under TRITON_INTERPRET=1 on the CPU)")
    h, i, e, L = shape["hidden"], shape["inter"], shape["experts"], args.layers
    gen = torch.Generator(device=device).manual_seed(0)
    t0 = time.time()
    blocks13 = torch.randint(0, 256, (L, e, 2 * i, h // 2), dtype=torch.uint8, device=device, generator=gen)
    blocks2 = torch.randint(0, 256, (L, e, h, i // 2), dtype=torch.uint8, device=device, generator=gen)
    choices = torch.tensor(SCALE_BYTES, dtype=torch.uint8, device=device)
    s13 = choices[torch.randint(0, len(SCALE_BYTES), (L, e, 2 * i, h // 32), device=device, generator=gen)]
    s2 = choices[torch.randint(0, len(SCALE_BYTES), (L, e, h, i // 32), device=device, generator=gen)]
    b13 = (torch.randn(L, e, 2 * i, device=device, generator=gen) * 0.1).bfloat16()
    b2 = (torch.randn(L, e, h, device=device, generator=gen) * 0.1).bfloat16()
    act = swiglu_clamped(limit=SWIGLU_LIMIT)
    mx = ExpertPools.all_hot(blocks13, blocks2, s13, s2, w13_bias=b13, w2_bias=b2, activation=act)
    w13 = (torch.randn(L, e, 2 * i, h, device=device, generator=gen) / h**0.5).bfloat16()
    w2 = (torch.randn(L, e, h, i, device=device, generator=gen) / i**0.5).bfloat16()
    bf16 = ExpertPools.all_hot(w13, w2, w13_bias=b13, w2_bias=b2, activation=act)
    if device.type == "cuda":
        torch.cuda.synchronize()
    log(f"pools on {device}: {L} layers x {e} experts, H={h} I={i}; MXFP4 "
        f"{L * e * mxfp4.expert_bytes(h, i) / 2**30:.2f} GiB, bf16 {L * e * 3 * h * i * 2 / 2**30:.2f} GiB, "
        f"{time.time() - t0:.1f}s")
    return Setup(args, device, h, i, e, shape["top_k"], L, mx, bf16, gen)


def make_case(s: Setup, num_tokens: int):
    """Fresh tokens and routing per layer: gpt-oss's router takes the top-k logits and a softmax
    over them, which is the renormalized softmax top-k."""
    xs = [torch.randn(num_tokens, s.hidden, device=s.device, generator=s.gen).bfloat16() for _ in range(s.layers)]
    rs = []
    for _ in range(s.layers):
        ids, w = torch_softmax_topk(torch.randn(num_tokens, s.experts, device=s.device, generator=s.gen), s.top_k,
                                    renormalize=True)
        rs.append((ids, w))
    return xs, rs


def _poison(s: Setup, nbytes: int) -> None:
    """Fill and free a block of the allocator's memory with NaN, so that an output the kernel leaves
    unwritten reads NaN rather than a stale right answer."""
    block = torch.full((max(1, nbytes // 4),), float("nan"), dtype=torch.float32, device=s.device)
    del block


def variant_of(cfg) -> str:
    """The kernel path a config runs (:mod:`coldset.kernels.triton_mxfp4`): ``gemv`` (block_m 1 or 2:
    sums in registers, no dot; ``gemv-gluon`` with w8a16 4, :mod:`coldset.kernels.gluon_mxfp4`),
    ``dot-words`` (bf16 dots on tiles unpacked by 32-bit words, w8a16 2), ``dot-f16`` (fp16 dots,
    one per scale group, w8a16 3), ``dot-values`` (bf16 dots on tiles unpacked value by value) or
    ``mma-gluon`` (w8a16 5, :mod:`coldset.kernels.gluon_mxfp4_mma`)."""
    from coldset.kernels.triton_mxfp4 import GEMV_MAX_ROWS  # triton: imported when a measurement runs

    if cfg.w8a16 == 5:
        return "mma-gluon"
    if cfg.block_m <= GEMV_MAX_ROWS:
        return "gemv-gluon" if cfg.w8a16 == 4 else "gemv"
    return {2: "dot-words", 3: "dot-f16"}.get(cfg.w8a16, "dot-values")


def check_correct(s: Setup, num_tokens: int, configs: list, deadline: float) -> tuple[float, dict[int, str]]:
    """Each MXFP4 config's output, and the bf16 kernel's, against the torch path on fresh inputs
    (first and last layer). Returns the largest |err| / (|ref| + RMS(ref)) of the MXFP4 outputs that
    held, in units of the 2^-7 tolerance, and ``{config index: why}`` for each config that failed:
    ``wrong: ...`` (outside the tolerance or not finite) or ``raised: ...`` (it did not compile or
    launch), or ``skipped: ...`` (not checked: ``deadline``, a ``time.time()``, had passed). A config
    that failed or was skipped is not timed; the other configs still are."""
    from coldset.kernels import triton_experts  # triton: imported when a measurement runs
    from coldset.kernels.triton_mxfp4 import triton_mxfp4_experts

    xs, rs = make_case(s, num_tokens)
    worst, failed = 0.0, {}
    for layer in sorted({0, s.layers - 1}):
        x, (ids, w) = xs[layer], rs[layer]
        ref = torch_experts(s.mx, layer, x, ids, w).double()
        tol = 2.0**-7 * (ref.abs() + ref.pow(2).mean().sqrt())
        for i, cfg in enumerate(configs):
            if i in failed:
                continue
            if time.time() > deadline:
                failed[i] = "skipped: past the time budget (--budget-s)"
                continue
            _poison(s, 8 * num_tokens * s.top_k * max(s.hidden, s.inter) * 4)
            try:
                out = triton_mxfp4_experts(s.mx, layer, x, ids, w, cfg)
                if s.timed:
                    torch.cuda.synchronize()
            except Exception as exc:  # a config that does not compile or launch here: reported, not timed
                failed[i] = f"raised: {type(exc).__name__}: {str(exc)[:300]}"
                log(f"{num_tokens} tokens, config {i} ({variant_of(cfg)}) {failed[i]}")
                continue
            ratio = float(((out.double() - ref).abs() / tol).max())
            finite = bool(torch.isfinite(out).all())
            if not finite or ratio > 1:
                failed[i] = f"wrong: layer {layer}, max |err| = {ratio:.3g} x tolerance (finite: {finite})"
                log(f"{num_tokens} tokens, config {i} ({variant_of(cfg)}) {failed[i]}: {cfg}")
                continue
            worst = max(worst, ratio)
        if s.timed and s.bf16_failure is None:  # the bf16 kernel: CUDA only; wrong or failing, it is not timed
            _poison(s, 8 * num_tokens * s.top_k * max(s.hidden, s.inter) * 4)
            try:
                out = triton_experts(s.bf16, layer, x, ids, w).double()
            except Exception as exc:  # reported in the table; the MXFP4 rows still run
                s.bf16_failure = f"bf16 kernel raised at {num_tokens} tokens: {type(exc).__name__}: {exc}"
                continue
            ref16 = torch_experts(s.bf16, layer, x, ids, w).double()
            err = float((out - ref16).norm() / ref16.norm())
            if not bool(torch.isfinite(out).all()) or err > 1e-2:
                s.bf16_failure = f"bf16 kernel wrong at {num_tokens} tokens, layer {layer}: rel. error {err:.3g}"
    return worst, failed


def read_us(s: Setup, pools: ExpertPools, nbytes: float) -> float:
    """µs a plain streaming read of ``nbytes`` takes, one launch per layer of the hot pool's bytes
    (the layers' launches in one graph, as the kernels run), best of three read shapes."""
    from coldset.kernels.bandwidth import best_read_bandwidth  # triton: imported when a measurement runs

    flat = pools.w13_hot.view(-1).view(torch.uint8)
    part = max(16, int(nbytes) // 16 * 16)
    rate = best_read_bandwidth(flat[: s.layers * part], ((4096, 1), (4096, 4), (4096, 16)), s.args.reps,
                               launches=s.layers)
    return nbytes / rate * 1e6


def selected_bytes(s: Setup, rs, per_expert: float) -> float:
    """Mean bytes a layer's call must read: its distinct selected experts times ``per_expert``."""
    return sum(int(torch.unique(ids).numel()) for ids, _ in rs) * per_expert / s.layers


def time_batch(s: Setup, num_tokens: int, configs: list, skip: dict[int, str], deadline: float) -> dict:
    """µs per layer of each MXFP4 config not in ``skip`` (in list order; once ``deadline``, a
    ``time.time()``, has passed, the rest are skipped and said so), the best per variant and
    overall, and the bf16 kernel's at its default config; the reads' µs of the same bytes."""
    from coldset.kernels import triton_experts  # triton: imported when a measurement runs
    from coldset.kernels.triton_mxfp4 import triton_mxfp4_experts

    xs, rs = make_case(s, num_tokens)
    bias_bytes = (2 * s.inter + s.hidden) * 2
    mx_bytes = selected_bytes(s, rs, mxfp4.expert_bytes(s.hidden, s.inter) + bias_bytes)
    mx_read = read_us(s, s.mx, mx_bytes)
    per_config, skipped = [], dict(skip)
    for i, cfg in enumerate(configs):
        entry = {"variant": variant_of(cfg), "config": cfg.to_dict()}
        if i not in skipped and time.time() > deadline:
            skipped[i] = "skipped: past the time budget (--budget-s)"
        if i in skipped:
            per_config.append({**entry, "us": None, "why": skipped[i]})
            continue
        try:
            us = graph_time_us(lambda cfg=cfg: [triton_mxfp4_experts(s.mx, l, xs[l], *rs[l], cfg)
                                                for l in range(s.layers)], s.args.reps) / s.layers
        except Exception as exc:  # e.g. a capture this config's launches do not survive: listed, the rest still run
            skipped[i] = f"raised while timed: {type(exc).__name__}: {str(exc)[:300]}"
            log(f"{num_tokens} tokens, config {i} ({entry['variant']}) {skipped[i]}")
            per_config.append({**entry, "us": None, "why": skipped[i]})
            continue
        per_config.append({**entry, "us": us, "pct_of_read": 100 * mx_read / us})
    timed = [c for c in per_config if c["us"] is not None]
    row = {"mxfp4_bytes": mx_bytes, "mxfp4_read_us": mx_read, "configs": per_config, "variants": {},
           "failed": {str(i): why for i, why in skipped.items()}}
    for c in timed:
        best = row["variants"].get(c["variant"])
        if best is None or c["us"] < best["us"]:
            row["variants"][c["variant"]] = {"us": c["us"], "pct_of_read": c["pct_of_read"], "config": c["config"]}
    if timed:
        top = min(timed, key=lambda c: c["us"])
        row.update(mxfp4_us=top["us"], mxfp4_variant=top["variant"], mxfp4_config=top["config"],
                   mxfp4_pct_of_read=top["pct_of_read"])
    if s.bf16_failure is None:
        bf_us = graph_time_us(lambda: [triton_experts(s.bf16, l, xs[l], *rs[l]) for l in range(s.layers)],
                              s.args.reps) / s.layers
        bf_bytes = selected_bytes(s, rs, 3 * s.hidden * s.inter * 2 + bias_bytes)
        bf_read = read_us(s, s.bf16, bf_bytes)
        row.update(bf16_us=bf_us, bf16_bytes=bf_bytes, bf16_read_us=bf_read, bf16_pct_of_read=100 * bf_read / bf_us)
        if "mxfp4_us" in row:
            row["mxfp4_speedup_vs_bf16"] = bf_us / row["mxfp4_us"]
    return row


#: Variants that run on CUDA only (Gluon): left out of a run on the CPU, which says so.
CUDA_ONLY_VARIANTS = ("gemv-gluon", "mma-gluon")


def configs_for(num_tokens: int, variants: tuple[str, ...] | None = None, space: dict | None = None,
                cuda: bool = True) -> list:
    """The configs for ``num_tokens`` (decode up to 64 tokens, prefill above) of ``space`` (default:
    the search space), those of ``variants`` only when given, without :data:`CUDA_ONLY_VARIANTS`
    unless ``cuda``."""
    from coldset.kernels.triton_moe import KernelConfig  # triton: imported when a measurement runs

    if space is None:
        space = load_kernel_configs("triton_mxfp4")["search_space"]
    configs = [KernelConfig.from_dict(d) for d in space.get("decode" if num_tokens <= 64 else "prefill", [])]
    return [c for c in configs if (variants is None or variant_of(c) in variants)
            and (cuda or variant_of(c) not in CUDA_ONLY_VARIANTS)]


def table(rows: list[dict]) -> str:
    """Per token count: the read of the selected experts' bytes, each variant's best µs (and % of
    the read), the best config overall, the bf16 kernel."""
    head = (f"{'tokens':>6} {'MB read':>8} {'read us':>8} "
            + " ".join(f"{v + ' us (% rd)':>20}" for v in VARIANTS)
            + f" {'bf16 us (% rd)':>16} {'x bf16':>7} {'err/tol':>7}  best config")
    lines = [head]
    for r in rows:
        if "mxfp4_read_us" not in r:
            lines.append(f"{r['tokens']:>6} {'-':>8} {'-':>8} " + " ".join(f"{'-':>20}" for _ in VARIANTS)
                         + f" {'-':>16} {'-':>7} {r['err_over_tol']:>7.3f}")
            continue
        cells = []
        for v in VARIANTS:
            b = r["variants"].get(v)
            cells.append(f"{b['us']:>11.1f} ({b['pct_of_read']:>5.1f}%)" if b else f"{'-':>20}")
        bf = (f"{r['bf16_us']:>8.1f} ({r['bf16_pct_of_read']:>4.0f}%)" if "bf16_us" in r else f"{'-':>16}")
        speed = f"{r['mxfp4_speedup_vs_bf16']:>7.2f}" if "mxfp4_speedup_vs_bf16" in r else f"{'-':>7}"
        best = json.dumps(_short(r["mxfp4_config"])) if "mxfp4_config" in r else "-"
        lines.append(f"{r['tokens']:>6} {r['mxfp4_bytes'] / 1e6:>8.1f} {r['mxfp4_read_us']:>8.1f} " + " ".join(cells)
                     + f" {bf} {speed} {r['err_over_tol']:>7.3f}  {best}")
    return "\n".join(lines)


def config_table(rows: list[dict]) -> str:
    """µs per layer of every config at every token count it ran at (``-``: failed or skipped)."""
    seen: dict[str, dict[int, str]] = {}
    for r in rows:
        for c in r.get("configs", []):
            cell = f"{c['us']:.1f}" if c["us"] is not None else "-"
            seen.setdefault(f"{c['variant']:<10} {json.dumps(_short(c['config']))}", {})[r["tokens"]] = cell
    tokens = [r["tokens"] for r in rows]
    lines = [" ".join(f"{t:>8}" for t in tokens) + "  variant / config (us per layer)"]
    for name, cells in seen.items():
        lines.append(" ".join(f"{cells.get(t, ''):>8}" for t in tokens) + "  " + name)
    return "\n".join(lines)


def _short(cfg: dict) -> dict:
    """A config's fields that differ from KernelConfig's defaults (as the JSON configs list them)."""
    from coldset.kernels.triton_moe import KernelConfig  # triton: imported when a measurement runs

    base = KernelConfig().to_dict()
    return {k: v for k, v in cfg.items() if v != base[k] or k.startswith("block_")}


def run(argv: list[str] | None = None) -> tuple[list[dict], bool]:
    """The measurement; returns its rows and whether every MXFP4 config that ran was right."""
    args = parse_args(argv)
    t_start = time.time()
    s = build(args)
    rows, wrong = [], []
    for n, num_tokens in enumerate(args.batch_list):
        configs = configs_for(num_tokens, args.variant_list, args.space, cuda=s.timed)
        # the budget's end, less a reserve for each batch after this one (their compiles and times); the
        # first batches compile the most (each grouping's kernels), so they are not held to an equal share
        deadline = t_start + args.budget_s - ROW_RESERVE_S * (len(args.batch_list) - 1 - n)
        if not s.timed:  # a time budget of GPU runs only
            deadline = float("inf")
        worst, failed = check_correct(s, num_tokens, configs, deadline)
        wrong += [(num_tokens, i, why) for i, why in failed.items() if why.startswith("wrong")]
        row = {"tokens": num_tokens, "configs_checked": len(configs), "err_over_tol": worst,
               "failed": {str(i): why for i, why in failed.items()}}
        log(f"{num_tokens} tokens: {len(configs) - len(failed)} of {len(configs)} configs correct (max err "
            f"{worst:.3f} of the tolerance), {time.time() - t_start:.0f}s")
        if s.timed:
            row.update(time_batch(s, num_tokens, configs, failed, deadline))
            if "mxfp4_us" in row:
                log(f"{num_tokens} tokens: best MXFP4 {row['mxfp4_variant']} {row['mxfp4_us']:.1f} us "
                    f"({row['mxfp4_pct_of_read']:.1f}% of a read of its bytes), {time.time() - t_start:.0f}s")
        rows.append(row)
    device = torch.cuda.get_device_name() if s.timed else "cpu (Triton interpreter: no times)"
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "shape": TINY if args.tiny else GPT_OSS_120B, "layers": args.layers,
                       "reps": args.reps, "rows": rows, "bf16_failure": s.bf16_failure,
                       "seconds": time.time() - t_start}, f, indent=1)
    for num_tokens, i, why in wrong:
        cfg = configs_for(num_tokens, args.variant_list, args.space, cuda=s.timed)[i]
        print(f"WRONG: {num_tokens} tokens, config {i} ({variant_of(cfg)}): {why}")
    if s.bf16_failure:
        print(f"bf16 column empty: {s.bf16_failure}")
    if not s.timed:
        print(f"not run on the CPU (CUDA only): {', '.join(CUDA_ONLY_VARIANTS)}")
    print(f"MXFP4 experts kernel variants vs bf16, {device}, H={s.hidden} I={s.inter} E={s.experts} top-{s.top_k}, "
          f"{args.layers} layers a graph, median of {args.reps} replays, us per layer; % of a plain read of the "
          f"same bytes; {time.time() - t_start:.0f}s")
    if s.timed:
        print(config_table(rows))
    print(table(rows))
    return rows, not wrong


if __name__ == "__main__":
    try:
        _, all_right = run(sys.argv[1:])
    except MeasureError as e:
        print(f"kernel_mxfp4: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if all_right else 1)
