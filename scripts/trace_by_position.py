"""A cache's copies a token by decode position, on a routing trace or on the synthetic model's own
decode: do they fall or grow along a request's decode?

    python scripts/trace_by_position.py [TRACE] [--residencies 0.25,0.5] [--policies static,lru]
        [--windows 16,32,128] [--positions 0,8,32,64,127]
    python scripts/trace_by_position.py [TRACE] --buckets 0,8,16,32,64,128,256 --json OUT.json
    python scripts/trace_by_position.py --synthetic [--set KNOB=VALUE] [--new-tokens 257] --json OUT.json

Why: a cache warmed from the profile split copies most at a request's first tokens and less as the
request's own experts become resident, so its ratio to the all-HBM step depends on the decode's
length (``python -m coldset bench cache --steps N`` measures it on the engine; BENCHMARKS.md names
this script beside its decode-length table). Each held-out request of the trace (default: the
shared Llama-4-Maverick MMLU trace) is replayed alone by :func:`coldset.analysis.simulate.simulate`
from the profile split's warm set (every request starts warm, as every pass of ``bench cache``
does). The table gives, per residency and policy, the copies (fills: link transfers) a token
averaged over the requests that reach each decode step, over the first N steps of each window
and at a few steps ("-": no request reaches it). A few seconds on the shared trace.

``--buckets`` gives the same per decode-position bucket (steps [a, b)) as JSON: the copies a token
per (policy, residency), their ratio to the first 16 steps' (the curve's shape, comparable across
model shapes), and the reuse distances of the held-out selections (coldset.analysis.locality:
shares reused from the previous token, within 8 tokens, and first uses in the request).
``--synthetic`` measures the synthetic model (coldset.engine.synthetic, the config's spec with
``--set`` overrides) instead of a trace: the fixtures' prompts (profile and held-out split) decoded
greedily on the CPU, ``--new-tokens`` each. The committed real targets,
config/calibration/decode-position.json, are this script's JSON on the shared trace (its
``command`` field says how it was made); tests/test_synthetic_positions.py checks the synthetic
router's curve against them.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

import numpy as np

from coldset.analysis.locality import decode_tokens, reuse_distances
from coldset.analysis.simulate import capacity_for_residency, simulate
from coldset.analysis.streams import (AccessStream, counts_from_rows, select_rows, stream_from_frame,
                                      trace_decode_rows)

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "../shared/data/traces/llama4-maverick-mmlu.parquet"
BUCKETS = (0, 8, 16, 32, 64, 128, 256)
EARLY = 16  # the curve's reference: the first 16 decode steps (the GPU bench's old length)
BAND_DRAWS = 400


def copies_by_position(rows, meta, residency: float, policy: str) -> tuple[np.ndarray, np.ndarray]:
    """Per decode step s of a request (0 = its first decode token): the copies a token at step s
    averaged over the held-out requests that reach s, and how many requests reach s (``rows``,
    ``meta``: :func:`coldset.analysis.streams.trace_decode_rows`)."""
    num_layers, num_experts = meta.num_moe_layers, meta.num_experts
    counts = counts_from_rows(select_rows(rows, "profile"), num_layers, num_experts)
    capacity = capacity_for_residency(residency, num_layers, num_experts)
    per_request = []
    for _, group in select_rows(rows, "heldout").groupby("request", observed=True):
        result = simulate(stream_from_frame(group, num_layers, num_experts), policy, capacity, counts)
        per_request.append(result.fills.reshape(-1, num_layers).sum(axis=1))
    return _mean_by_step(per_request)


def _mean_by_step(per_request: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    steps = max((f.size for f in per_request), default=0)
    total, seen = np.zeros(steps), np.zeros(steps, dtype=np.int64)
    for values in per_request:
        total[:values.size] += values
        seen[:values.size] += 1
    return total / np.maximum(seen, 1), seen


def table_lines(trace: str | Path, residencies: list[float], policies: list[str], windows: list[int],
                positions: list[int]) -> list[str]:
    """The markdown table: one row per (residency, policy)."""
    head = ["residency", "policy", *(f"first {n}" for n in windows), *(f"at {s}" for s in positions)]
    rows, meta = trace_decode_rows(trace)
    lines = ["| " + " | ".join(head) + " |", "|--:|---|" + "--:|" * (len(windows) + len(positions))]
    for residency in residencies:
        for policy in policies:
            mean, seen = copies_by_position(rows, meta, residency, policy)
            cells = [f"{mean[:n][seen[:n] > 0].mean():.2f}" if seen[:n].any() else "-" for n in windows]
            cells += [f"{mean[s]:.2f}" if s < seen.size and seen[s] else "-" for s in positions]
            lines.append(f"| {residency} | {policy} | " + " | ".join(cells) + " |")
    return lines


def trace_requests(rows, meta, split: str) -> list[np.ndarray]:
    """The decode selections ``[T, L, k]`` of each request of ``split``, tokens in position order."""
    sel, req, _ = decode_tokens(select_rows(rows, split), meta.num_moe_layers, meta.top_k)
    return [sel[req == r] for r in np.unique(req)]


def _stream(sel: np.ndarray, num_experts: int) -> AccessStream:
    T, L, k = sel.shape
    inst = (np.arange(L)[None, :, None] * num_experts + sel).reshape(-1)
    return AccessStream(inst, np.arange(0, inst.size + 1, k), T, L, num_experts)


def _window_means(per_step: list[np.ndarray], edges: list[tuple[int, int]]) -> list[float | None]:
    """Mean over every (request, step) with a <= step < b, per (a, b) (None: no request reaches a)."""
    out = []
    for a, b in edges:
        v = np.concatenate([x[a:b] for x in per_step])
        out.append(round(float(v.mean()), 4) if v.size else None)
    return out


def _ratio_band(per_step: list[np.ndarray], edges: list[tuple[int, int]], draws: int = BAND_DRAWS,
                seed: int = 0) -> list[list[float] | None]:
    """Per bucket, the 5th and 95th percentiles of its ratio to the first ``EARLY`` steps over
    ``draws`` bootstrap resamples of the requests (numpy default_rng(seed)): how far the ratio
    moves with the requests sampled."""
    windows = [*edges, (0, EARLY)]
    sums = np.array([[x[a:b].sum() for a, b in windows] for x in per_step])
    counts = np.array([[x[a:b].size for a, b in windows] for x in per_step])
    pick = np.random.default_rng(seed).integers(0, len(per_step), (draws, len(per_step)))
    s, c = sums[pick].sum(axis=1), counts[pick].sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = (s[:, :-1] / c[:, :-1]) / (s[:, -1:] / c[:, -1:])
    out = []
    for i in range(len(edges)):
        r = ratio[:, i][np.isfinite(ratio[:, i])]
        out.append([round(float(q), 4) for q in np.percentile(r, [5, 95])] if r.size else None)
    return out


def by_bucket(profile: list[np.ndarray], heldout: list[np.ndarray], num_experts: int,
              residencies: list[float], policies: list[str], buckets: tuple[int, ...] = BUCKETS) -> dict:
    """Per decode-position bucket [a, b): the copies a token of each (policy, residency) over the
    held-out requests, each replayed alone from the profile requests' warm set, their ratio to
    the first ``EARLY`` steps' with its bootstrap band over the requests (``_ratio_band``), and the reuse distances of the held-out selections (``profile``,
    ``heldout``: per request its decode selections ``[T, L, k]``, -1 for none)."""
    L = heldout[0].shape[1]
    counts = np.zeros((L, num_experts))
    for sel in profile:
        for layer in range(L):
            s = sel[:, layer].ravel()
            counts[layer] += np.bincount(s[s >= 0], minlength=num_experts)
    edges = list(zip(buckets[:-1], buckets[1:]))
    out: dict = {"buckets": [list(e) for e in edges],
                 "requests": [int(sum(h.shape[0] > a for h in heldout)) for a, _ in edges],
                 "profile_requests": len(profile), "copies": {}, "ratio_to_first16": {}}
    for residency in residencies:
        capacity = capacity_for_residency(residency, L, num_experts)
        for policy in policies:
            per = [simulate(_stream(h, num_experts), policy, capacity, counts).fills.reshape(-1, L).sum(axis=1)
                   for h in heldout]
            key = f"{policy}@{residency}"
            values = _window_means(per, edges)
            early = _window_means(per, [(0, EARLY)])[0]
            out["copies"][key] = values
            out["ratio_to_first16"][key] = [None if v is None or not early else round(v / early, 4) for v in values]
            out.setdefault("ratio_band", {})[key] = _ratio_band(per, edges)
    sel = np.concatenate(heldout)
    req = np.concatenate([np.full(h.shape[0], i) for i, h in enumerate(heldout)])
    pos = np.concatenate([np.arange(h.shape[0]) for h in heldout])
    d = reuse_distances(sel, req, pos)
    tok = np.nonzero(sel >= 0)[0]
    step = pos[tok]
    reuse = {"previous_token": d == 1, "within_8": (d >= 1) & (d <= 8), "first_use": d == 0}
    out["reuse"] = {name: [round(float(hit[(step >= a) & (step < b)].mean()), 4) if ((step >= a) & (step < b)).any()
                           else None for a, b in edges] for name, hit in reuse.items()}
    return out


def synthetic_requests(spec, per_domain: int, new_tokens: int, domains=("agent", "prose", "code"), seed: int = 0,
                       device: str = "cpu", batch_size: int = 0,
                       prompt_tokens: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(profile, held-out) decode selections per request of the synthetic model built from
    ``spec`` on ``device`` (float32 on the CPU, bfloat16 on a GPU): the fixtures' prompts
    (coldset.trace.fixtures, half held out; each cut to its first ``prompt_tokens`` tokens where
    > 0) decoded greedily, ``new_tokens`` each (``new_tokens - 1`` decode steps: the first comes
    from the prefill), ``batch_size`` prompts at a time (0: all)."""
    import torch

    from coldset.engine.generate import encode_prompts, generate
    from coldset.engine.synthetic import build_synthetic_model
    from coldset.trace.fixtures import fixtures_by_domain

    model, tokenizer = build_synthetic_model(spec, device, torch.float32 if device == "cpu" else torch.bfloat16)
    fixtures = [f for fs in fixtures_by_domain(list(domains), per_domain, 0.5, new_tokens, seed).values() for f in fs]
    prompts = encode_prompts(tokenizer, [f.prompt for f in fixtures])
    if prompt_tokens > 0:
        prompts = [p[:prompt_tokens] for p in prompts]
    step = batch_size or len(prompts)
    decoded = []
    for i in range(0, len(prompts), step):
        gen = generate(model, prompts[i:i + step], new_tokens, capture_routing=True, progress=False)
        decoded += [r.experts[r.num_prompt_tokens:].cpu().numpy().astype(np.int64) for r in gen.routing]
    return ([d for d, f in zip(decoded, fixtures) if f.split == "profile"],
            [d for d, f in zip(decoded, fixtures) if f.split == "heldout"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE), help="a routing trace (docs/design.md §2)")
    p.add_argument("--residencies", default="0.25,0.5")
    p.add_argument("--policies", default="static,lru", help="simulator policies without prefetch lists")
    p.add_argument("--windows", default="16,32,128", help="the first N decode steps averaged, per N")
    p.add_argument("--positions", default="0,8,32,64,127", help="decode steps shown alone")
    p.add_argument("--buckets", help="decode-step bucket edges, e.g. 0,8,16,32,64,128,256: JSON per bucket")
    p.add_argument("--json", type=Path, help="write the --buckets JSON here (else print it)")
    p.add_argument("--synthetic", action="store_true", help="measure the synthetic model's decode, not a trace")
    p.add_argument("--config", type=Path, help="--synthetic: take the spec from this workflow config's model.synthetic")
    p.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                   help="--synthetic: a SyntheticSpec field (JSON value), repeatable")
    p.add_argument("--per-domain", type=int, default=12, help="--synthetic: fixtures per domain (half held out)")
    p.add_argument("--new-tokens", type=int, default=257, help="--synthetic: tokens decoded per prompt")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="--synthetic: where the model is built and decoded")
    p.add_argument("--batch-size", type=int, default=0, help="--synthetic: prompts decoded together (0: all)")
    p.add_argument("--prompt-tokens", type=int, default=0, help="--synthetic: cut each prompt to its first N tokens")
    args = p.parse_args()
    residencies = [float(r) for r in args.residencies.split(",")]
    policies = args.policies.split(",")
    if not args.synthetic and not args.buckets:
        for line in table_lines(args.trace, residencies, policies, [int(n) for n in args.windows.split(",")],
                                [int(s) for s in args.positions.split(",")]):
            print(line)
        return
    buckets = tuple(int(b) for b in (args.buckets or ",".join(map(str, BUCKETS))).split(","))
    if args.synthetic:
        import dataclasses

        import torch

        from coldset.engine.synthetic import SyntheticSpec

        torch.set_num_threads(args.threads)
        knobs = {}
        if args.config:
            import yaml

            knobs.update((yaml.safe_load(args.config.read_text()).get("model") or {}).get("synthetic") or {})
        for item in args.set:
            key, sep, value = item.partition("=")
            if not sep:
                raise SystemExit(f"--set expects KNOB=VALUE, got {item!r}")
            knobs[key] = json.loads(value)
        spec = SyntheticSpec(**knobs)
        profile, heldout = synthetic_requests(spec, args.per_domain, args.new_tokens, device=args.device,
                                              batch_size=args.batch_size, prompt_tokens=args.prompt_tokens)
        source, num_experts = {"synthetic": dataclasses.asdict(spec)}, spec.experts
    else:
        rows, meta = trace_decode_rows(args.trace)
        profile, heldout = trace_requests(rows, meta, "profile"), trace_requests(rows, meta, "heldout")
        source, num_experts = {"trace": Path(args.trace).name}, meta.num_experts
    result = {"command": "python scripts/trace_by_position.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
              **source, **by_bucket(profile, heldout, num_experts, residencies, policies, buckets)}
    text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]",
                  json.dumps(result, indent=1)) + "\n"  # lists of numbers on one line
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
