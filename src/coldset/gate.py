"""The token-exact parity gate: a placement must not change a single greedy token.

Per placement, every parity fixture is greedy-decoded twice with the same engine and the same
weights: once on the unmodified path (every routed expert in HBM, the experts computation with
the row-map indirection compiled out on CUDA, the all-hot identity map on CPU) and once with the
row-map path over pools built from the placement's row map (cold rows in pinned host memory on
CUDA). Any token that differs is a bug in the offload machinery (row map, pools, host reads), never
rounding: both runs use the same kernel, tiling and accumulation order (DESIGN.md §4).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict, dataclass, field

import torch

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
    passed: bool  # every token identical and the logits bitwise equal
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
    mismatches: list[Mismatch] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def experts_functions(device: torch.device, tuned=None):
    """(unmodified, row-map, backend) experts functions: Triton on CUDA, torch on CPU.

    ``tuned`` (a :class:`coldset.tune.TuneResult`) gives each batch size its tuned launch
    configuration, the same for both paths; without it the kernels' documented defaults apply.
    """
    from coldset.kernels import torch_experts, triton_experts

    if tuned is not None:
        from coldset.tune import tuned_experts

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
    from coldset.model import generate

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


def placement_decode(model, placed_pools, prompts, max_new_tokens, batch_size=8, progress=True,
                     tuned=None, cache=None) -> Decoded:
    """The row-map path over ``placed_pools`` (the placement's hot and cold pools).

    With ``cache`` (a :class:`coldset.slots.SlotCache`, a dynamic placement) ``placed_pools`` are
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
    """Token-by-token verdict of one placement against the unmodified path."""
    matched, mismatches, max_diff = 0, [], 0.0
    for fid, ref, got, ref_l, got_l in zip(fixture_ids, reference.tokens, placed.tokens,
                                           reference.logits, placed.logits):
        same = [a == b for a, b in zip(ref, got)]
        matched += sum(same)
        if not all(same):
            pos = same.index(False)
            gap = float(ref_l[pos, ref[pos]] - ref_l[pos, got[pos]])
            mismatches.append(Mismatch(fid, pos, ref[pos], got[pos], gap))
            # After the first divergence the runs see different inputs: compare logits only up to
            # it, where both decoded the same prefix.
            ref_l, got_l = ref_l[:pos + 1], got_l[:pos + 1]
        max_diff = max(max_diff, float((ref_l - got_l).abs().max()))
    max_new_tokens = len(reference.tokens[0]) if reference.tokens else 0
    return ParityResult(
        placement=placement_name,
        # Both runs use the same kernel, tiling and accumulation order, so anything short of
        # bitwise-equal logits is an offload bug even when no greedy token flips (DESIGN.md §4).
        passed=not mismatches and max_diff == 0.0,
        tokens_matched=matched,
        tokens_total=len(fixture_ids) * max_new_tokens,
        fixtures=len(fixture_ids),
        max_new_tokens=max_new_tokens,
        max_abs_logit_diff=max_diff,
        logits_bitwise_equal=max_diff == 0.0,
        device=str(model.device),
        dtype=str(model.dtype).removeprefix("torch."),
        backend=backend or experts_functions(model.device)[2],
        # Experts per tier from the row map (a shared host tier holds more rows than are cold).
        num_hot=int((placed_pools.row_map >= 0).sum()),
        num_cold=int((placed_pools.row_map < 0).sum()),
        mismatches=mismatches,
    )


class ParityGateError(RuntimeError):
    """At least one placement changed a token."""


def gate_verdict(results: list[dict]) -> dict:
    """Summarise per-placement parity results; raise naming every placement that failed."""
    failed = [r["placement"] for r in results if not r["passed"]]
    summary = {
        "passed": not failed,
        "placements": {r["placement"]: {"passed": r["passed"], "tokens_matched": r["tokens_matched"],
                                         "tokens_total": r["tokens_total"]} for r in results},
        "failed": failed,
    }
    if failed:
        details = "; ".join(
            f"{r['placement']}: {r['tokens_total'] - r['tokens_matched']} of {r['tokens_total']} tokens differ, "
            f"max |logit diff| {r['max_abs_logit_diff']:.3g}"
            for r in results if not r["passed"]
        )
        raise ParityGateError(f"parity gate failed for {len(failed)} placement(s): {details}")
    return summary
