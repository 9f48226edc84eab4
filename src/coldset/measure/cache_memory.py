"""``bench cache``'s memory check: a run whose largest placement cannot be built beside its all-HBM
reference in the GPU's free memory is refused before the host tier is pinned or anything is
written, naming the ``--moe-layers`` and ``--residencies`` that fit. Why: pinning and compiling
take a minute, and a CUDA out-of-memory error after them says neither what fits nor why."""

from __future__ import annotations

from coldset.analysis.placement import hot_count_for_residency
from coldset.bench import decode as bn
from coldset.measure.harness import MeasureError
from coldset.measure.model_memory import HBM_MARGIN_BYTES, HBM_MARGIN_FRACTION


def check_placement_fits(pools, residencies: list[float], free_bytes: int, held_bytes: int = 0,
                         family: str | None = None) -> None:
    """:class:`MeasureError` when the largest of ``residencies``' placements cannot be built beside the
    all-HBM ``pools`` already resident: its hot rows (:func:`hot_count_for_residency`) times the bytes
    an expert moves (:func:`coldset.bench.decode.moved_bytes_per_expert`), plus :data:`HBM_MARGIN_BYTES`,
    :data:`HBM_MARGIN_FRACTION` of that pool and ``held_bytes`` (what the run keeps on the GPU besides),
    above ``free_bytes``. The message says what fits: the largest ``--residencies`` at this layer
    count and, for a ``--model-family`` run (``family``), the largest ``--moe-layers`` at the asked
    residency (each MoE layer fewer frees its experts and biases from the reference)."""
    L, E = pools.num_moe_layers, pools.num_experts
    per_expert = bn.moved_bytes_per_expert(pools)
    reference = L * E * per_expert + pools.bias_bytes
    residency = max(residencies)

    def need(res: float, layers: int) -> tuple[int, float]:  # (hot pool bytes, with margin and held bytes)
        pool = hot_count_for_residency(res, layers * E) * per_expert
        return pool, pool + HBM_MARGIN_BYTES + HBM_MARGIN_FRACTION * pool + held_bytes

    def fits(res: float, layers: int) -> bool:
        return need(res, layers)[1] <= free_bytes + (L - layers) * (reference // L)

    if fits(residency, L):
        return
    pool, total = need(residency, L)
    res_fit = next((c / 100 for c in range(round(residency * 100), 0, -1) if fits(c / 100, L)), None)
    what = [f"--residencies up to {res_fit} at {L} MoE layers" if res_fit else f"no residency at {L} MoE layers"]
    if family is not None:
        layers_fit = next((n for n in range(L - 1, 0, -1) if fits(residency, n)), None)
        what.insert(0, f"--model-family {family} --moe-layers {layers_fit} at residency {residency}" if layers_fit
                    else f"no --moe-layers count at residency {residency}")
    raise MeasureError(
        f"residency {residency}'s placement needs {pool / 1e9:.1f} GB of HBM ({pool // per_expert} of {L * E} "
        f"experts at {per_expert / 1e6:.2f} MB) + {(total - pool) / 1e9:.1f} GB for activations, logits and graphs "
        f"beside the all-HBM reference's {reference / 1e9:.1f} GB already resident, and {free_bytes / 1e9:.1f} GB "
        f"is free after the build. What fits: {'; '.join(what)}.")


def preflight_placement(args, model) -> None:
    """:func:`check_placement_fits` of the built ``model`` on the GPU's free bytes now, before the host
    tier is pinned and anything is written; its held bytes are the all-HBM passes' and one row's
    logits and the all-HBM router inputs at the largest ``--batches``. Pools off CUDA (the CPU dry
    run of the tests) have no HBM to check."""
    import torch  # GPU-only path: torch loads when a measurement runs

    if model.pools.w13_hot.device.type != "cuda":
        return
    torch.cuda.empty_cache()  # the build's freed temporaries back to the device, so free bytes count them
    free, _ = torch.cuda.mem_get_info(model.pools.w13_hot.device)
    cfg, bsz, steps = model.config, max(int(b) for b in args.batches.split(",")), args.steps
    held = (2 * (1 + args.repeats) * steps * bsz * cfg.vocab_size + steps * cfg.num_moe_layers * bsz
            * cfg.hidden_size) * torch.empty((), dtype=model.dtype).element_size()
    check_placement_fits(model.pools, [float(r) for r in args.residencies.split(",")], free, held,
                         args.model_family if args.model_family != "synthetic" else None)
