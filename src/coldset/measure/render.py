"""Markdown tables of the GPU measurements' JSON (``python -m coldset bench render FILE...``).

The one way a measurement becomes a table: each command prints this rendering of the JSON it
wrote, and BENCHMARKS.md's tables are made by this command from the committed JSON, so a number
is never copied by hand. Each table carries its command, commit, device, date and the ceilings of
its own run; every timed figure is the median of its repeats with their range (min-max). A page
shows one table per measurement, the latest: ``--into`` refuses a page with two blocks of the same
measurement (:func:`measurement_key` says what that means).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from coldset.measure.harness import MeasureError


def _f(x, fmt: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _spread(s: dict | None, fmt: str = ".1f") -> str:
    """``median (min-max)`` of a :func:`coldset.measure.harness.spread`; the median alone for one run."""
    if not s:
        return "-"
    if len(s["runs"]) < 2:
        return format(s["median"], fmt)
    return f"{format(s['median'], fmt)} ({format(s['min'], fmt)}-{format(s['max'], fmt)})"


def table(headers: list[str], rows: list[list]) -> str:
    """A markdown table (cells already text)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def header(res: dict, title: str) -> str:
    """Title line, provenance (device, commit, date) and the command that reproduces it."""
    p = res.get("provenance") or {}
    commit = (p.get("commit") or "unknown")[:10] + (" (dirty)" if p.get("dirty") else "")
    return (f"**{title}** · {p.get('device', '?')} · torch {p.get('torch', '?')}, triton {p.get('triton', '?')} · "
            f"commit {commit} · {res.get('date', '?')}\n\n`{res.get('command', '?')}`")


def render_kernel(res: dict) -> str:
    c = res["ceilings"]
    hbm = c["hbm_read_GBps"]
    out = [header(res, "Experts kernel per MoE layer"),
           f"Ceilings in this run: HBM read {hbm:.0f} GB/s, pinned zero-copy read {c['pinned_read_GBps']:.1f} GB/s, "
           f"bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s. µs per layer, median of the rounds (min-max)."]
    at = res.get("autotune", {})
    if at.get("skipped"):
        out.append(f"Configs from {at['configs_from']} (not tuned in this run).")
    rows = []
    for r in res["batches"]:
        cold = f"{r['cold_us']:.0f} ({r['cold_pct_pinned']:.0f}%)" if "cold_us" in r else "-"
        rows.append([r["batch"], f"{r['distinct_expert_MB']:.1f}", f"{r['bound_us']:.1f}",
                     _spread(r.get("hot_us_spread")), f"{100 * r['bound_us'] / r['hot_us']:.0f}%",
                     f"{r['hot_GBps']:.0f} ({100 * r['hot_GBps'] / hbm:.0f}%)", f"{r['rowmap_cost_pct']:+.1f}%", cold,
                     f"{r['torch_us']:.0f}", f"{r['bitwise_rowmap_vs_off']}/{r['bitwise_cold_vs_hot']}",
                     f"{r['max_rel_err_vs_torch']:.1e}", _f(r.get("vllm_stored_us")),
                     _f(r.get("speed_vs_stored_vllm"), ".2f") + ("x" if "speed_vs_stored_vllm" in r else "")])
    out.append(table(["tokens", "distinct expert MB", "bound µs", "hot µs", "% of bound", "hot GB/s (% HBM)",
                      "row-map cost", "all-cold µs (% pinned)", "torch µs", "bitwise off/cold", "rel err vs torch",
                      "stored vLLM µs", "speed vs stored vLLM"], rows))
    if any("vllm_stored_us" in r for r in res["batches"]):
        out.append(f"vLLM column: {res.get('vllm_stored', {}).get('source', 'stored vLLM figure')}; "
                   "not timed in this run, so its ratio carries the spread between two processes.")
    notes = []
    for r in res["batches"]:
        if "sized_read_GBps" in r:
            notes.append(f"batch {r['batch']}: a read of {r['distinct_expert_MB']:.1f} MB a launch streams at "
                         f"{r['sized_read_GBps']:.0f} GB/s; the kernel reaches {r['pct_of_sized_read']:.0f}% of it")
    st = res.get("batch1_stages_us")
    if st:
        notes.append(f"batch 1 stages (µs/layer, cumulative): w13 + act {st['w13_act']:.1f}, + w2 "
                     f"{st['w13_act+w2']:.1f}, + top-k sum {st['all_three']:.1f}")
    m = res.get("mixed")
    if m:
        notes.append(f"mixed 4 hot + 4 cold: {m['mixed_us']:.0f} µs vs parts {m['hot4_us']:.1f} + {m['cold4_us']:.0f} "
                     f"(ratio {m['mixed_over_sum']:.3f}); bitwise vs all-hot {m['bitwise_mixed_vs_hot']}")
    big = res.get("largest_batch_stages_us")
    if big:
        notes.append(f"batch {big['batch']} stages (µs/layer, cumulative): grouping + w13 + act "
                     f"{big['grouping+w13_act']:.1f}, + w2 {big['+w2']:.1f}, + top-k sum {big['+sum']:.1f}")
    if notes:
        out.append("\n".join(f"- {n}" for n in notes))
    return "\n\n".join(out)


def render_kernel_fp8(res: dict) -> str:
    """``bench kernel --weight-format fp8``: the FP8 kernel beside bf16, each in % of a plain read of
    its own bytes measured in the same run, and of the bytes and FLOP bounds."""
    c = res["ceilings"]
    out = [header(res, "Block-FP8 experts kernel per MoE layer, beside bf16"),
           f"Ceilings in this run: HBM read {c['hbm_read_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} "
           f"TFLOP/s, FP8 matmul {c['fp8_matmul_TFLOPs']:.0f} TFLOP/s"
           + (f", pinned zero-copy read {c['pinned_read_GBps']:.1f} GB/s" if "pinned_read_GBps" in c else "")
           + ". µs per layer (median of the graph replays); FP8: the fastest "
           + (f"of the configs in {res['fp8_configs_from']}" if res.get("fp8_configs_from")
              else "config of the FP8 search space")
           + f"; bf16: {'configs of ' + res['bf16_configs_from'] if res.get('bf16_configs_from') else 'its defaults'}."]
    rows = []
    for r in res["batches"]:
        fp8_us, bf_us = r["fp8_us"], r["bf16_us"]
        cold = (f"{r['fp8_cold_us']:.1f} ({100 * r['fp8_cold_link_bound_us'] / r['fp8_cold_us']:.0f}%)"
                if "fp8_cold_us" in r else "-")
        cfg = r["fp8_config"]
        rows.append([r["batch"], f"{r['fp8_MB']:.1f}", f"{fp8_us:.1f}", f"{100 * r['fp8_plain_read_us'] / fp8_us:.0f}%",
                     f"{100 * r['fp8_bytes_bound_us'] / fp8_us:.0f}%", f"{100 * r['fp8_flop_bound_us'] / fp8_us:.0f}%",
                     f"{bf_us:.1f}", f"{100 * r['bf16_plain_read_us'] / bf_us:.0f}%",
                     f"{100 * max(r['bf16_bytes_bound_us'], r['bf16_flop_bound_us']) / bf_us:.0f}%",
                     f"{bf_us / fp8_us:.2f}x", f"{r['fp8_rel_err_vs_torch']:.1e}",
                     f"{r['fp8_bitwise_rowmap_vs_off']}/{r.get('fp8_cold_bitwise_vs_hot', '-')}", cold,
                     f"{cfg['block_m']}/{cfg['block_n1']}/{cfg['block_n2']} w{cfg['num_warps']}s{cfg['num_stages']}"
                     + (" w8a16" if cfg.get("w8a16") else "") + (" swap" if cfg.get("swap_ab") else "")
                     + (" fused" if cfg.get("fuse_w2") else "")])
    out.append(table(["tokens", "FP8 MB", "FP8 µs", "% plain read", "% bytes bound", "% FLOP bound", "bf16 µs",
                      "bf16 % plain read", "bf16 % bound", "bf16/FP8", "FP8 rel err vs torch", "bitwise off/cold",
                      "FP8 all-cold µs (% link)", "FP8 config m/n1/n2"], rows))
    if res.get("fp8_configs_from"):  # the given candidates, each timed at every batch
        out.append(_tune_table({r["batch"]: r["fp8_candidates_us"] for r in res["batches"]},
                               f"FP8 configs of {res['fp8_configs_from']}, µs per layer of each:"))
    if any("fp8_stages_us" in r for r in res["batches"]):  # runs before the stages were timed have none
        out.append(_fp8_stage_table(res["batches"]))
    fails = res.get("fails", [])
    out.append("Checks: " + ("all passed" if not fails else "FAILED: " + "; ".join(fails)) + ".")
    return "\n\n".join(out)


def _fp8_stage_table(rows: list[dict]) -> str:
    """The FP8 call's launches timed cumulatively (µs a layer after each; "-": a launch the config
    does not make; with ``fuse_w2``, the tiles of ``84e9666`` removed in ``083c6a7``, "+w13" is
    the launch that ran w13 and w2), beside a plain read of w13's and w2's bytes: the fastest
    config per batch (the JSON keeps every config's of ``--fp8-configs``; the page only the one
    that ran)."""
    stages = ("quant_x", "w13", "quant_act", "w2", "sum")
    lines = []
    for r in rows:
        if "fp8_stages_us" not in r:
            continue
        st, reads = r["fp8_stages_us"], r.get("fp8_stage_read_us", {})
        lines.append([r["batch"], _config_label(r["fp8_config"]), *[_f(st.get(s), ".1f") for s in stages],
                      _f(reads.get("w13"), ".1f"), _f(reads.get("w2"), ".1f")])
    return ("FP8 launches timed cumulatively (one CUDA graph of every layer's call stopped after that launch; "
            "the grouping, where launched, in the first), µs per layer:\n\n"
            + table(["tokens", "config", "quant x", "+w13", "+quant act", "+w2", "+sum", "w13 plain read",
                     "w2 plain read"], lines))


def _floors(fl: dict) -> str:
    return ", ".join(f"b{b} {f['floor_ms']:.3f} ms ({f['bytes_per_step'] / 1e9:.2f} GB)" for b, f in fl.items())


_FP8_CONFIG_NAMES = {"block_n1": "n1", "block_n2": "n2", "num_warps": "w", "num_stages": "s", "pdl": "pdl",
                     "quant_x": "qx", "quant_act": "qa", "tile_order": "to", "w8a16": "w8a16",
                     "swap_ab": "sw", "fuse_w2": "fw"}


def _config_label(d: dict) -> str:
    """An FP8 config's fields that its candidates differ in, short (``n1=32 n2=64 w=4 s=4 pdl=2 ...``)."""
    return " ".join(f"{v}={d[k]}" for k, v in _FP8_CONFIG_NAMES.items() if k in d)


def _tune_table(timings: dict, title: str = "FP8 autotune in this run, µs per layer of each candidate:") -> str:
    """FP8 candidates, µs per layer per batch (fastest first at the first batch): every config
    measured, so the ones that lost show by how much."""
    batches = list(timings)
    configs = sorted(timings[batches[0]], key=timings[batches[0]].get)
    rows = [[_config_label(json.loads(c)), *[_f(timings[b].get(c), ".1f") for b in batches]] for c in configs]
    return title + "\n\n" + table(["config", *[f"b{b}" for b in batches]], rows)


def _engine_check(key: str, check: dict) -> str:
    """One engine comparison of ``bench step`` (:func:`coldset.measure.step.compare`) in words: the
    run's token match and largest logit difference, and its first step's where recorded."""
    text = f"{key} tokens {check['token_match']:.3f}, max logit diff {check['max_abs_logit_diff']:.3g}"
    if "first_step_top2_gap_min" in check:
        text += (f" (first step {check['first_step_max_abs_logit_diff']:.3g}, its top-2 gap "
                 f"{check['first_step_top2_gap_min']:.3g})")
    return text


def render_step(res: dict) -> str:
    """``bench step``; with ``--weight-format fp8`` (rows carrying ``weight_format``) a format column,
    each format's floor and the bf16 / FP8 step ratio per engine and batch."""
    fp8 = "floor_fp8" in res
    if fp8:
        eb = res.get("expert_bytes", {})
        floors = (f"bf16 experts ({_f(eb.get('bf16', 0) / 1e6, '.2f')} MB an expert) {_floors(res['floor'])}; "
                  f"block-FP8 experts ({_f(eb.get('fp8', 0) / 1e6, '.2f')} MB an expert with its scales) "
                  f"{_floors(res['floor_fp8'])}")
    else:
        floors = _floors(res["floor"])
    out = [header(res, "Decode step" + (", block-FP8 experts beside bf16 (all in HBM, one process)" if fp8 else "")),
           f"HBM read ceiling in this run {res['hbm_read_GBps']:.0f} GB/s; bytes floor per step: {floors}. "
           f"Step ms: median of {res['args']['rounds']} rounds of {res['args']['reps']} calls (min-max)."]
    if fp8:
        nonexpert = (f"in the FP8 rows {res['fp8_nonexpert']}" if res.get("fp8_nonexpert")
                     else "non-expert weights bf16 in both")  # results before FP8 attention: the latter
        out.append("The FP8 experts are the same model's bf16 experts quantized to 128 x 128 blocks "
                   f"(coldset.measure.harness.fp8_expert_pools); {nonexpert}; FP8 kernel configs: "
                   f"{res.get('fp8_configs_from', '?')}.")
    rows = []
    for r in res["rows"]:
        p = r.get("profile", {})
        rng = r.get("fraction_of_floor_range")
        of = f"{100 * r['fraction_of_floor']:.1f}%" if "fraction_of_floor" in r else "-"
        if rng and len(r["step_ms_spread"]["runs"]) > 1:
            of += f" ({100 * rng[0]:.1f}-{100 * rng[1]:.1f}%)"
        rows.append([r["mode"], *([r["weight_format"]] if fp8 else []), r["batch"], r["experts"],
                     _spread(r["step_ms_spread"], ".3f"), f"{r['tok_s']:.1f}",
                     _f(r.get("floor_ms"), ".3f"), of, _f(p.get("kernels_per_step"), ".0f")])
    out.append(table(["engine", *(["experts format"] if fp8 else []), "batch", "experts", "step ms", "tok/s",
                      "floor ms", "of floor", "kernels/step"], rows))
    if fp8 and res.get("fp8_speedup"):
        out.append(table(["engine / batch", "bf16 step / FP8 step (range over rounds)", "bf16 floor / FP8 floor"],
                         [[k, f"{v['bf16_over_fp8']:.3f}x ({v['range'][0]:.3f}-{v['range'][1]:.3f})",
                           f"{v['floor_ratio']:.3f}x"] for k, v in res["fp8_speedup"].items()]))
    checks = res.get("checks", {})
    if checks:
        out.append(f"Against {res.get('checks_against', 'the first engine')}" + (" of the same format" if fp8 else "")
                   + ": " + "; ".join(_engine_check(k, v) for k, v in checks.items()))
    if res.get("fp8_tune_timings_us"):
        out.append(_tune_table(res["fp8_tune_timings_us"]))
    if res.get("fp8_vs_bf16"):
        out.append("FP8 against bf16, the same engine (other weights: reported, not checked): "
                   + "; ".join(_engine_check(k, v) for k, v in res["fp8_vs_bf16"].items()))
    if res.get("float32_check"):
        out.append("First decode step against the same weights in float32, fed each engine's own first token: "
                   + "; ".join(_float32_check(k, v) for k, v in res["float32_check"].items()))
    if res.get("errors"):
        out.append("Engines that failed: " + "; ".join(f"{k}: {v}" for k, v in res["errors"].items()))
    if res.get("fails"):
        out.append("Checks FAILED: " + "; ".join(res["fails"]))
    return "\n\n".join(out)


def _float32_check(key: str, check: dict) -> str:
    """One engine's first step against float32 (:func:`coldset.measure.step.float32_check`) in words."""
    return (f"{key} max logit diff {check['first_step_max_abs_logit_diff']:.3g} of logits up to "
            f"{check['logit_abs_max']:.3g} (float32 top-2 gap {check['float32_top2_gap_min']:.3g}, first token "
            f"{'agrees' if check['first_token_agrees'] else 'differs'})")


def render_cache(res: dict) -> str:
    c = res.get("ceilings", {})
    a = res["args"]
    fails = res.get("fails", [])
    fp8 = res.get("weight_format") == "fp8"
    out = [header(res, "Slot cache and lookahead prefetch" + (", block-FP8 experts" if fp8 else "")),
           f"{res.get('model', '?')}, {a['steps']} decode steps x {a['repeats']} timed passes (+1 checked), held-out "
           f"fixture prompts, {res.get('router', 'synthetic router')}. Ceilings in this run: HBM read "
           f"{_f(c.get('hbm_read_gb_s'), '.0f')} GB/s, link read {_f(c.get('link_read_gb_s'), '.1f')} GB/s. "
           "Checks: " + ("all passed" if not fails else "FAILED: " + "; ".join(fails)) + "."]
    if "weight_format" in res:  # results since --weight-format: the experts' format and bytes, every tier alike
        fmt = res.get("weight_format")
        label = EXPERT_FORMAT_LABELS.get(fmt, "bf16")
        out.append(f"Experts: {label} in every tier, {res['expert_bytes'] / 1e6:.2f} MB an expert"
                   + (" with its scales; all-HBM (the bitwise reference) runs the same kernel all hot."
                      if fmt in ("fp8", "mxfp4") else "."))
    family = res.get("model_family")
    if isinstance(family, dict) and family.get("note"):
        out.append(f"Model: {family.get('name')}, {family['note']}.")
    if res.get("lead_unit"):  # a result without it ran the policies' default unit
        out.append("Prefetch gate unit (a layer's compute in 1024ths of one copy, from this run's all-HBM step and "
                   "link): " + ", ".join(f"b{b} {u}" for b, u in res["lead_unit"].items()) + ".")
    ct = res.get("compressed_tier")
    if ct:  # bench cache --host-tier with compressed
        out.append(f"Compressed host tier (rows '... compressed'; fills decode its lossless records inside the step): "
                   f"{ct['ratio']:.4f} of the raw bytes ({ct['host_gb']:.2f} GB pinned beside the raw "
                   f"{ct['raw_gb']:.2f} GB), coded parts {', '.join(ct['coded_parts']) or 'none'}; its rows' link "
                   "GB/token are the records copied (misses read in place at raw bytes).")
    # Results with the time columns (bench cache since the nexttoken policy) get four more columns;
    # older results render as they always did.
    timed = any("sim_over_measured" in r for r in res["rows"])
    managed = any("sim_managed_over_measured" in r for r in res["rows"])  # since the management term
    fc = res.get("forecaster")
    if fc:
        a_ = res["args"]
        budget = a_.get("prefetch_budget")
        out.append(f"nexttoken forecaster (fitted on the profile routing): terms {fc['terms']}, history unit "
                   f"{fc['hist_unit']} shift {fc['hist_shift']}, {fc['n']} candidates a token, tables "
                   f"{fc['table_mb']:.2f} MB; prefetch budget {'none' if budget is None else budget} copies a group.")
    rows = []
    for r in res["rows"]:
        full = next(x for x in res["rows"] if x["batch"] == r["batch"] and x["placement"] == "all-HBM")
        ug = None if r["placement"] == "all-HBM" else next(
            (x for x in res["rows"] if x["batch"] == r["batch"] and x["placement"] == f"usage_global-{r['residency']}"),
            None)
        rows.append([r["batch"], r["placement"], f"{r['tok_s']:.1f}", _f(r["tok_s"] / ug["tok_s"] if ug else None, ".2f"),
                     f"{r['tok_s'] / full['tok_s']:.3f}", f"{r['hit_rate']:.4f}", _f(r.get("sim_hit_rate"), ".4f"),
                     f"{r['misses_per_token']:.2f}", _f(r.get("prefetches_per_token"), ".2f"),
                     f"{r['link_gb_per_token']:.4f}", _spread(r.get("step_ms_mean_spread"), ".3f")])
        if timed:
            rows[-1] += [_f(r.get("wasted_prefetches_per_token"), ".2f"), _f(r.get("overlap"), ".2f"),
                         _f(r.get("fraction_of_bound"), ".2f"), _f(r.get("sim_over_measured"), ".3f")]
        if managed:
            rows[-1] += [_f(r.get("sim_managed_over_measured"), ".3f")]
    headers = ["batch", "placement", "tok/s", "x usage_global", "x all-HBM", "hit rate", "sim hit",
               "misses/token", "prefetches/token", "link GB/token", "mean step ms (min-max of passes)"]
    if timed:
        headers += ["wasted prefetches/token", "overlap", "of bound", "simulated / measured step"]
    if managed:
        headers += ["with management / measured"]
    out.append(table(headers, rows))
    if timed:
        out.append("overlap = 1 - (step - all-HBM step) / link time; bound = max(all-HBM step, link time); "
                   "simulated: time_model.simulate_time" + (" (with management: + manage_ms)." if managed else "."))
    by_length = [r for r in res["rows"] if "step_ms_by_length" in r]
    if by_length:  # since the decode-length columns: each pass's first n steps, x all-HBM's first n
        lengths = sorted({int(n) for r in by_length for n in r["step_ms_by_length"]})
        lrows = []
        for r in by_length:
            full = next(x for x in by_length if x["batch"] == r["batch"] and x["placement"] == "all-HBM")
            mine, ref = ({int(n): v for n, v in x["step_ms_by_length"].items()} for x in (r, full))  # JSON: str keys
            lrows.append([r["batch"], r["placement"],
                          *(_f(ref[n] / mine[n] if n in mine and n in ref else None, ".3f") for n in lengths)])
        out.append("x all-HBM by decode length (each pass's mean step over its first n steps against all-HBM's first "
                   "n, the median over passes; every pass starts from the placement's warm state):")
        out.append(table(["batch", "placement", *(f"first {n}" for n in lengths)], lrows))
    profiled = [r for r in res["rows"] if "top" in r.get("profile", {})]
    if profiled:  # --profile: where each row's step goes, kernel by kernel
        names = list(dict.fromkeys(t["name"] for r in profiled for t in r["profile"]["top"][:5]))
        per = [{t["name"]: t for t in r["profile"]["top"]} for r in profiled]
        out.append("Kernel profile of each row's captured step (--profile, 3 steps after the timed passes; a "
                   "kernel launched as a programmatic dependent counts from its launch, its wait included; idle: "
                   "no kernel running), µs a step (launches a step):")
        out.append(table(["batch", "placement", "kernels/step", "kernel µs/step", "idle µs/step", *names],
                         [[r["batch"], r["placement"], _f(r["profile"]["kernels_per_step"], ".0f"),
                           _f(r["profile"]["kernel_us_per_step"], ".0f"), _f(r["profile"].get("idle_us_per_step"), ".0f"),
                           *(f"{t['us_per_step']:.0f} ({t['per_step']:.0f})" if (t := d.get(n)) else "-" for n in names)]
                          for r, d in zip(profiled, per)]))
    return "\n\n".join(out)


def render_decisions(res: dict) -> str:
    parts = sorted({n for v in res["us_per_step"].values() for n in v})
    rows = [[b, *(f"{v[n]:.1f}" for n in parts)] for b, v in res["us_per_step"].items()]
    return "\n\n".join([header(res, "Slot cache work per step (µs, all layers)"), table(["batch", *parts], rows)])


RENDERERS = {"kernel": render_kernel, "step": render_step, "cache": render_cache, "cache-decisions": render_decisions,
             "kernel-fp8": render_kernel_fp8}


def render(res: dict) -> str:
    """The markdown of one measurement's JSON, chosen by its ``kind``."""
    kind = res.get("kind")
    if kind not in RENDERERS:
        raise MeasureError(f"kind {kind!r} is not one of {', '.join(RENDERERS)} "
                           "(a JSON written by python -m coldset bench kernel/step/cache)")
    return RENDERERS[kind](res)


def _load(path) -> dict:
    """A result file's JSON; a missing or unreadable file raises, naming it."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MeasureError(f"{path}: {exc}") from exc


def render_files(paths: list[str]) -> str:
    """The tables of several result files, in order, each under its file name."""
    parts = []
    for path in paths:
        res = _load(path)
        try:
            parts.append(render(res))
        except MeasureError as exc:
            raise MeasureError(f"{path}: {exc}") from exc
        except (KeyError, TypeError, AttributeError) as exc:
            raise MeasureError(f"{path}: field {exc} missing or malformed") from exc
    return "\n\n".join(parts) + "\n"


#: A rendered block in a markdown page: ``<!-- rendered: PATH -->`` ... ``<!-- end rendered -->``,
#: PATH relative to the page's folder. :func:`refresh_page` rewrites every block from its JSON, so
#: a page's tables are never copied by hand (BENCHMARKS.md; its test checks the blocks are current).
BLOCK = re.compile(r"(<!-- rendered: (?P<path>[^ ]+) -->\n)(?P<body>.*?)(<!-- end rendered -->)", re.S)


def refresh_page(text: str, folder: Path) -> str:
    """``text`` with every rendered block replaced by the rendering of its JSON (paths relative to
    ``folder``); a block naming a file that is missing or not a measurement raises, naming it, and
    so do two blocks of the same measurement (:func:`check_one_block_per_measurement`)."""
    check_one_block_per_measurement(text, folder)

    def fill(m: re.Match) -> str:
        path = folder / m.group("path")
        return m.group(1) + render_files([str(path)]).rstrip("\n") + "\n" + m.group(4)

    return BLOCK.sub(fill, text)


def _numbers(value, kind=int) -> set:
    """``"1,8"`` / ``[1, 8]`` / ``1`` as a set of numbers (a result's ``--batches``, ``--residencies``)."""
    if value is None:
        return set()
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
    return {kind(x) for x in items if str(x).strip()}


def family_summary(results: list[dict]) -> str:
    """A short markdown summary of ``bench step`` and ``bench cache`` results of ``--model-family``
    runs (the JSON of each, any order): per family the step at batch 1 and 8 of each engine against
    its floor, with the step without routed experts as a share of the step; per cache row tok/s
    x all-HBM of the same run and batch, hit rate, link GB a token, fraction of bound and overlap.
    Why: one GPU call's tables, printed last by scripts/h200_family_tables.sh."""
    def name(res: dict) -> str:
        fam = res.get("model_family")
        if not isinstance(fam, dict):
            return "synthetic"
        return f"{fam['name']} ({fam['expert_format']}, {fam['moe_layers']}/{fam['published_moe_layers']} MoE layers)"

    step_rows, cache_rows, f32_rows = [], [], []
    for res in results:
        if res.get("kind") == "step":
            shares = res.get("step_shares", {})
            for r in res.get("rows", []):
                if r.get("experts") != "full":
                    continue
                sh = shares.get(r["mode"], {}) if r["batch"] == 1 else {}
                step_rows.append(f"| {name(res)} | {r['mode']} | {r['batch']} | {r['step_ms']:.3f} | "
                                 f"{_f(r.get('floor_ms'), '.3f')} | {_f(r.get('fraction_of_floor'), '.1%')} | "
                                 f"{_f(sh.get('without_routed_experts'), '.1%')} | "
                                 f"{_f(sh.get('nonexpert_bytes_of_floor'), '.1%')} |")
            for mode, err in res.get("errors", {}).items():
                step_rows.append(f"| {name(res)} | {mode} | - | failed: {err[:80]} | | | | |")
            for key, c in res.get("float32_check", {}).items():
                match = res.get("checks", {}).get(key, {}).get("token_match")
                f32_rows.append(f"| {name(res)} | {key} | {_f(match, '.3f')} | {c['first_step_max_abs_logit_diff']:.3g} | "
                                f"{c['logit_abs_max']:.3g} | {c['float32_top2_gap_min']:.3g} | "
                                f"{'yes' if c['first_token_agrees'] else 'no'} |")
        elif res.get("kind") == "cache":
            full = {r["batch"]: r for r in res.get("rows", []) if r["placement"] == "all-HBM"}
            for r in res.get("rows", []):
                ref = full.get(r["batch"])
                cache_rows.append(f"| {name(res)} | {r['batch']} | {r['placement']} | {r['tok_s']:.1f} | "
                                  f"{_f(r['tok_s'] / ref['tok_s'] if ref else None, '.3f')} | {_f(r.get('hit_rate'), '.3f')} | "
                                  f"{_f(r.get('link_gb_per_token'), '.4f')} | {_f(r.get('fraction_of_bound'), '.2f')} | "
                                  f"{_f(r.get('overlap'), '.2f')} |")
            if res.get("fails"):
                cache_rows.append(f"| {name(res)} | - | checks FAILED: {'; '.join(res['fails'])[:120]} | | | | | | |")
    out = []
    if step_rows:
        out += ["| model | engine | batch | step ms | floor ms | of floor | step without routed experts | "
                "non-expert bytes of floor |", "|---|---|---|---|---|---|---|---|", *step_rows, ""]
    if f32_rows:
        out += ["| model | engine/batch | token match, the run's first engine | first step: "
                "max logit diff to float32 | largest float32 logit | float32 top-2 gap | first token agrees |",
                "|---|---|---|---|---|---|---|", *f32_rows, ""]
    if cache_rows:
        out += ["| model | batch | placement | tok/s | x all-HBM | hit rate | link GB/token | of bound | overlap |",
                "|---|---|---|---|---|---|---|---|---|", *cache_rows]
    return "\n".join(out) if out else "no bench step or bench cache results"


#: The experts' formats a cache result names (``weight_format``), in words.
EXPERT_FORMAT_LABELS = {"fp8": "block-FP8 (e4m3, 128 x 128 scales)", "mxfp4": "MXFP4 (e2m1 values, an e8m0 scale per 32)"}


def _family_name(res: dict) -> str:
    """The model a result measured: a ``--model-family`` name, else the config's synthetic model."""
    family = res.get("model_family")
    return family.get("name", "synthetic") if isinstance(family, dict) else (family or "synthetic")


def measurement_key(res: dict) -> tuple[tuple, frozenset]:
    """What a result measures: ``(identity, cells)``. Two rendered blocks are the same measurement
    when their identities are equal and their cells overlap; a page keeps one block of each
    (:func:`check_one_block_per_measurement`).

    - identity: the kind (``kernel``, ``kernel-fp8``, ``step``, ``cache``, ``cache-decisions``);
      for the step and the cache the model (a ``--model-family`` name, else the synthetic model);
      for the cache also the experts' weight format, the set of ``--policies`` and ``--steps``
      (a cache's ratio to all-HBM depends on the decode's length); for ``cache-decisions`` the
      weight format.
    - cells: what it times. kernel and cache-decisions: the batch sizes; step: each row's (engine,
      experts format, batch, experts), so an FP8 run's bf16 rows meet a bf16 run's; cache: every
      (batch, residency) of ``--batches`` x ``--residencies``.

    Everything else says how a measurement ran, not what it measured: ``--out``, repeats, reps,
    rounds, layers, depths, ``--lookahead-fit``, ``--profile``, ``--save-replays``, the config and
    candidate files, the commit and the date. A re-run that differs only there is the same
    measurement: its table replaces the old one.
    """
    kind = res.get("kind")
    args = res.get("args") or {}
    if kind == "cache":
        fmt = res.get("weight_format") or args.get("weight_format") or "bf16"
        policies = frozenset(p.strip() for p in str(args.get("policies", "")).split(",") if p.strip())
        cells = {(b, r) for b in _numbers(args.get("batches")) for r in _numbers(args.get("residencies"), float)}
        return (kind, _family_name(res), fmt, policies, args.get("steps")), frozenset(cells)
    if kind == "cache-decisions":
        return (kind, args.get("weight_format") or "bf16"), frozenset(int(b) for b in res.get("us_per_step", {}))
    if kind == "step":
        return (kind, _family_name(res)), frozenset((r.get("mode"), r.get("weight_format", "bf16"), r.get("batch"), r.get("experts"))
                                  for r in res.get("rows", []))
    if kind in ("kernel", "kernel-fp8"):
        return (kind,), frozenset(r["batch"] for r in res.get("batches", []))
    return (kind,), frozenset()  # not a measurement: rendering it raises, naming the file


def check_one_block_per_measurement(text: str, folder: Path) -> None:
    """Raise, naming both blocks, when ``text`` holds two rendered blocks of the same measurement
    (:func:`measurement_key`): a page shows the latest table of each measurement, and what an
    earlier one taught goes to docs/history.md."""
    seen: dict[tuple, list[tuple[str, frozenset]]] = {}
    for m in BLOCK.finditer(text):
        res = _load(folder / m.group("path"))
        try:
            path = f"{m.group('path')} ({res.get('date', 'undated')})"
            identity, cells = measurement_key(res)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MeasureError(f"{m.group('path')}: field {exc} missing or malformed") from exc
        for other, other_cells in seen.get(identity, []):
            shared = cells & other_cells
            if shared:
                raise MeasureError(
                    f"{other} and {path} are blocks of the same measurement ({_describe(identity)}; both time "
                    f"{', '.join(_cell(identity[0], c) for c in _sorted(shared))}): keep the latest one's block and "
                    "move what the other taught to docs/history.md")
        seen.setdefault(identity, []).append((path, cells))


def _describe(identity: tuple) -> str:
    kind, *rest = identity
    if kind == "cache":
        model, fmt, policies, steps = rest
        return f"bench cache, {model}, {fmt}, policies {','.join(sorted(policies))}, {steps} steps"
    return " ".join(["bench", str(kind), *map(str, rest)])


def _sorted(cells) -> list:
    try:
        return sorted(cells)
    except TypeError:  # a step row with a missing field: None beside text
        return sorted(cells, key=str)


def _cell(kind: str, cell) -> str:
    if kind == "cache":
        return f"b{cell[0]} at residency {cell[1]:g}"
    if kind == "step":
        return "{} {} b{} {}".format(*cell)
    return f"b{cell}"
