"""The token-exact parity gate: a placement must not change a single greedy token.

Per placement, every parity fixture is greedy-decoded twice with the same engine and the same
weights: once on the unmodified path (every routed expert in HBM, the experts computation with
the row-map indirection compiled out on CUDA, the all-hot identity map on CPU) and once with the
row-map path over pools built from the placement's row map (cold rows in pinned host memory on
CUDA). Any token that differs is a bug in the offload machinery (row map, pools, host reads), never
rounding: both runs use the same kernel, tiling and accumulation order (docs/design.md §4).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict, dataclass, field

import torch

from coldset.engine.generate import generate
from coldset.kernels import torch_experts, triton_experts
from coldset.kernels.tune import tuned_experts

log = logging.getLogger(__name__)


@dataclass
class Mismatch:
    """The first differing token of one fixture."""

    fixture: str
    position: int  # index among the new tokens
    expected: int  # the unmodified path's token
    got: int  # the placement's token
    logit_gap: float  # unmodified logits: expected token's logit minus got token's logit


@dataclass
class ParityResult:
    """One placement's gate verdict (written as results/parity/{model}/{placement}.json)."""

    placement: str
    passed: bool  # every token identical (none missing), logits finite and bitwise equal
    tokens_matched: int
    tokens_total: int
    fixtures: int
    max_new_tokens: int
    max_abs_logit_diff: float  # over every step's logits up to the first differing token
    logits_bitwise_equal: bool
    device: str
    dtype: str
    backend: str
    num_hot: int
    num_cold: int
    nonfinite_logits: int = 0  # NaN/Inf logit values in either run (compared range); any fails
    mismatches: list[Mismatch] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def experts_functions(device: torch.device, tuned=None):
    """(unmodified, row-map, backend) experts functions: Triton on CUDA, torch on CPU.

    ``tuned`` (a :class:`coldset.kernels.tune.TuneResult`) gives each batch size its tuned launch
    configuration, the same for both paths; without it the kernels' documented defaults apply.
    """
    if tuned is not None:
        return tuned_experts(tuned, use_row_map=False), tuned_experts(tuned), tuned.backend
    if device.type == "cuda":
        return functools.partial(triton_experts, use_row_map=False), triton_experts, "triton"
    return torch_experts, torch_experts, "torch"


@dataclass
class Decoded:
    """Greedy tokens and every step's logits (float32, on the CPU) of a list of prompts."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]  # per prompt [max_new_tokens, V]


def decode_fixtures(model, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 8,
                    progress: bool = True) -> Decoded:
    """Greedy-decode ``prompts`` in batches with the model's current pools and experts function."""
    tokens, logits = [], []
    for start in range(0, len(prompts), batch_size):
        gen = generate(model, prompts[start:start + batch_size], max_new_tokens,
                       progress=progress, return_all_logits=True)
        tokens.extend(gen.tokens)
        logits.extend(gen.all_logits.cpu())
    return Decoded(tokens, logits)


def reference_decode(model, prompts, max_new_tokens, batch_size=8, progress=True, tuned=None) -> Decoded:
    """The unmodified path: the model's all-hot pools, the experts function without indirection."""
    reference_fn, _, _ = experts_functions(model.device, tuned)
    saved = model.experts_fn
    model.experts_fn = reference_fn
    try:
        return decode_fixtures(model, prompts, max_new_tokens, batch_size, progress)
    finally:
        model.experts_fn = saved


def warm_compiled_decode(model, prompts, max_new_tokens, batch_sizes, progress=True, tuned=None) -> int:
    """Decode the fixtures once per batch size in ``batch_sizes`` and discard the result, where the
    decode region is ``torch.compile``d (:attr:`coldset.engine.model.MoEModel.decode_is_dynamo_compiled`);
    returns how many decodes ran (0 elsewhere).

    Why: Dynamo runs the newest compiled graph whose guards a step passes, and a workload's first
    decode compiles graphs for exact sizes that its later steps supersede with symbolic ones: a
    second decode of the same fixtures runs other graphs than the first at its first steps (other
    kernels, which may round otherwise: the unmodified path would not match itself). After one
    discarded decode of each batch size in use, later decodes of them compile nothing more and run
    the same graphs step for step: call it before the reference, then decode the placements with
    the same fixtures and batch sizes."""
    if not model.decode_is_dynamo_compiled:
        return 0
    runs = 0
    for b in sorted(set(batch_sizes)):
        log.info("warming the compiled decode region at batch %d (its graphs are picked by what ran before)", b)
        reference_decode(model, prompts, max_new_tokens, b, progress, tuned)
        runs += 1
    return runs


def placement_decode(model, placed_pools, prompts, max_new_tokens, batch_size=8, progress=True,
                     tuned=None, cache=None) -> Decoded:
    """The row-map path over ``placed_pools`` (the placement's hot and cold pools).

    With ``cache`` (a :class:`coldset.engine.cache.pool.SlotCache`, a dynamic placement) ``placed_pools`` are
    its pools and every decode step first runs the cache's decisions and fills: the row map
    changes from step to step while the kernel stays the same, so the gate applies unchanged.
    """
    _, rowmap_fn, _ = experts_functions(model.device, tuned)
    if cache is not None:
        if placed_pools is not cache.pools:
            raise ValueError("placement_decode: with a cache, placed_pools must be cache.pools")
        if batch_size > cache.max_tokens:
            raise ValueError(f"placement_decode: batch size {batch_size} is larger than the cache's "
                             f"max_tokens {cache.max_tokens}")
        rowmap_fn = cache.wrap(rowmap_fn)
    saved = model.pools, model.experts_fn
    model.pools, model.experts_fn = placed_pools, rowmap_fn
    try:
        return decode_fixtures(model, prompts, max_new_tokens, batch_size, progress)
    finally:
        model.pools, model.experts_fn = saved


def compare(placement_name: str, fixture_ids: list[str], reference: Decoded, placed: Decoded,
            placed_pools, model, backend: str | None = None) -> ParityResult:
    """Token-by-token verdict of one placement against the unmodified path.

    Nothing is zipped away: both runs must hold one token list and one logits tensor per fixture,
    and each fixture's placed run must have exactly the reference's tokens (a run one token
    short, or empty, fails at the first missing position). Logits are compared bit for bit up to
    the first differing token; a NaN or Inf anywhere in that range fails, even when both runs
    agree on it. ``passed`` requires every reference token matched, at least one token compared,
    finite logits and bitwise-equal logits.
    """
    n = len(fixture_ids)
    counts = {"reference tokens": len(reference.tokens), "reference logits": len(reference.logits),
              "placed tokens": len(placed.tokens), "placed logits": len(placed.logits)}
    if any(c != n for c in counts.values()):
        raise ValueError(f"parity {placement_name}: {n} fixture ids but "
                         + ", ".join(f"{c} {what}" for what, c in counts.items()))
    matched, total, mismatches, max_diff, nonfinite = 0, 0, [], 0.0, 0
    bitwise = True
    for fid, ref, got, ref_l, got_l in zip(fixture_ids, reference.tokens, placed.tokens,
                                           reference.logits, placed.logits):
        total += len(ref)
        if ref_l.shape[0] != len(ref) or got_l.shape[0] != len(got):
            raise ValueError(f"parity {placement_name}, fixture {fid}: logits for {ref_l.shape[0]} / "
                             f"{got_l.shape[0]} steps but {len(ref)} / {len(got)} tokens (reference / placed)")
        common = min(len(ref), len(got))
        same = [ref[i] == got[i] for i in range(common)]
        pos = same.index(False) if not all(same) else (common if len(ref) != len(got) else None)
        matched += sum(same)
        if pos is not None:
            if pos < common:
                gap = float(ref_l[pos, ref[pos]] - ref_l[pos, got[pos]])
                mismatches.append(Mismatch(fid, pos, ref[pos], got[pos], gap))
            else:  # one run stopped early: the missing token is -1 on its side
                mismatches.append(Mismatch(fid, pos, ref[pos] if pos < len(ref) else -1,
                                           got[pos] if pos < len(got) else -1, float("nan")))
            # After the first divergence the runs see different inputs: compare logits only up to
            # it, where both decoded the same prefix.
            upto = min(pos + 1, common)
            ref_l, got_l = ref_l[:upto], got_l[:upto]
        if ref_l.shape != got_l.shape:
            bitwise = False
            continue
        nonfinite += int((~torch.isfinite(ref_l)).sum() + (~torch.isfinite(got_l)).sum())
        if ref_l.numel():
            diff = (ref_l.float() - got_l.float()).abs()
            # torch.max propagates NaN (Python's max(x, nan) would drop it).
            max_diff = float(torch.max(torch.tensor(max_diff), diff.max()))
        # Bitwise: the same bits, not merely == (which equates -0.0 and 0.0).
        bitwise &= torch.equal(ref_l.contiguous().view(torch.uint8), got_l.contiguous().view(torch.uint8))
    bitwise = bitwise and nonfinite == 0
    return ParityResult(
        placement=placement_name,
        # Both runs use the same kernel, tiling and accumulation order, so anything short of
        # bitwise-equal logits is an offload bug even when no greedy token flips (docs/design.md §4).
        passed=not mismatches and total > 0 and matched == total and bitwise,
        tokens_matched=matched,
        tokens_total=total,
        fixtures=n,
        max_new_tokens=max((len(t) for t in reference.tokens), default=0),
        max_abs_logit_diff=max_diff,
        logits_bitwise_equal=bitwise,
        device=str(model.device),
        dtype=str(model.dtype).removeprefix("torch."),
        backend=backend or experts_functions(model.device)[2],
        # Experts per tier from the row map (a shared host tier holds more rows than are cold).
        num_hot=int((placed_pools.row_map >= 0).sum()),
        num_cold=int((placed_pools.row_map < 0).sum()),
        nonfinite_logits=nonfinite,
        mismatches=mismatches,
    )


class ParityGateError(RuntimeError):
    """At least one placement changed a token."""


def _failure(r: dict) -> str | None:
    """Why one parity report fails the gate (None if it passes), re-derived from its counts rather
    than trusting its ``passed`` flag alone: every token matched, at least one compared, logits
    bitwise equal and finite."""
    name = r.get("placement", "?")
    missing = [k for k in ("placement", "passed", "tokens_matched", "tokens_total", "logits_bitwise_equal")
               if k not in r]
    if missing:
        raise ValueError(f"parity report for {name}: missing field(s) {missing}")
    total, matched = r["tokens_total"], r["tokens_matched"]
    reasons = []
    if not r["passed"]:
        reasons.append("failed")
    if total <= 0:
        reasons.append("no tokens compared")
    elif matched != total:
        reasons.append(f"{total - matched} of {total} tokens differ")
    if not r["logits_bitwise_equal"]:
        reasons.append(f"logits not bitwise equal (max |logit diff| {r.get('max_abs_logit_diff', float('nan')):.3g})")
    if r.get("nonfinite_logits"):
        reasons.append(f"{r['nonfinite_logits']} NaN/Inf logits")
    if r.get("mismatches"):
        reasons.append(f"{len(r['mismatches'])} fixture(s) diverge")
    return ", ".join(reasons) or None


def gate_verdict(results: list[dict]) -> dict:
    """Summarise per-placement parity results; raise naming every placement that failed.

    A placement passes only if its report says so *and* its counts agree: every token matched
    (and more than none), logits bitwise equal, none NaN/Inf, no mismatch listed.
    """
    if not results:
        raise ParityGateError("parity gate: no parity reports to judge")
    reasons = {r.get("placement", "?"): _failure(r) for r in results}
    failed = [name for name, why in reasons.items() if why]
    summary = {
        "passed": not failed,
        "placements": {r["placement"]: {"passed": not reasons[r["placement"]], "tokens_matched": r["tokens_matched"],
                                         "tokens_total": r["tokens_total"]} for r in results},
        "failed": failed,
    }
    if failed:
        details = "; ".join(f"{name}: {reasons[name]}" for name in failed)
        raise ParityGateError(f"parity gate failed for {len(failed)} placement(s): {details}")
    return summary
