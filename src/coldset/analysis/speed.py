"""The decode speed model: a bandwidth estimate of one decode step under a placement.

Bytes per step from the placement's byte model (non-expert weights from HBM; each expert's bytes
times the chance the batch touches it, from HBM if hot and over the host link if cold), times
from read bandwidths (``Bandwidths``: a preset of ``BANDWIDTH_PRESETS`` or the user's); see
``predict_step``. A prediction is recorded in the placement's JSON as a
:class:`coldset.core.placement.StepPrediction`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from coldset.analysis.profile import as_histogram, profile_counts
from coldset.core.placement import GIB, Placement, PlacementError, StepPrediction
from coldset.core.shapes import MoEShape


@dataclass(frozen=True)
class Bandwidths:
    """Read bandwidths in GB/s (1e9 bytes/s) of HBM and of the host link, and where they are from."""

    name: str
    hbm_gb_s: float
    link_gb_s: float
    source: str = "user"


BANDWIDTH_PRESETS: dict[str, Bandwidths] = {
    "h200": Bandwidths(
        "h200",
        3400.0,
        51.0,
        "lent H200, PCIe Gen5 x16: link 51 GB/s measured (Triton kernel reading pinned host memory in "
        "place); HBM 3.4 TB/s from a torch copy probe, a conservative figure: the Triton read kernel "
        "measured 3,974-4,615 GB/s on the same card (BENCHMARKS.md, NOTES.md), and the bench measures "
        "its own ceilings in each run",
    ),
    "gb300": Bandwidths(
        "gb300",
        8000.0,
        340.0,
        "not measured: host link about 340 GB/s over NVLink-C2C (docs/design.md §6); HBM 8 TB/s is "
        "the GB300 datasheet figure (a lead, peak not sustained)",
    ),
}


def get_bandwidths(spec: str | Bandwidths | Mapping[str, Any]) -> Bandwidths:
    """A preset by name, a ``Bandwidths``, or a mapping ``{hbm_gb_s, link_gb_s[, name]}``."""
    if isinstance(spec, Bandwidths):
        bw = spec
    elif isinstance(spec, str):
        if spec not in BANDWIDTH_PRESETS:
            raise PlacementError(
                f"unknown bandwidth preset {spec!r}; known: {', '.join(BANDWIDTH_PRESETS)} "
                "(or give {'hbm_gb_s': ..., 'link_gb_s': ...})"
            )
        bw = BANDWIDTH_PRESETS[spec]
    else:
        try:
            bw = Bandwidths(
                str(spec.get("name", "user")),
                float(spec["hbm_gb_s"]),
                float(spec["link_gb_s"]),
                str(spec.get("source", "user")),
            )
        except KeyError as e:
            raise PlacementError(f"bandwidths need hbm_gb_s and link_gb_s, missing {e}") from None
    if not (bw.hbm_gb_s > 0 and bw.link_gb_s > 0):
        raise PlacementError(f"bandwidths must be > 0, got {bw}")
    return bw



def expected_touched(counts: np.ndarray, top_k: int, batch_size: int) -> np.ndarray:
    """Probability that each (layer, expert) is used by at least one of ``batch_size`` tokens.

    Per layer, ``p_e = count_e / tokens`` with ``tokens = sum(count) / top_k`` (one token selects
    ``top_k`` distinct experts), and tokens are independent: ``1 - (1 - p_e) ** batch_size``.
    """
    if batch_size < 1:
        raise PlacementError(f"batch_size must be >= 1, got {batch_size}")
    selections = counts.sum(axis=1)
    empty = np.flatnonzero(selections <= 0)
    if empty.size:
        raise PlacementError(
            f"the profile has no selections in MoE layer position {int(empty[0])}; the speed "
            "model cannot estimate its experts' use"
        )
    tokens = selections / top_k
    p = np.clip(counts / tokens[:, None], 0.0, 1.0)
    return 1.0 - (1.0 - p) ** batch_size


def predict_step(
    placement: Placement,
    histogram: pd.DataFrame | np.ndarray | str | os.PathLike,
    config: MoEShape,
    bandwidths: str | Bandwidths | Mapping[str, Any],
    batch_size: int,
) -> StepPrediction:
    """Bandwidth bound of one decode step under ``placement``.

    Bytes per step: the non-expert weights once, from HBM; per MoE layer, each expert's bytes
    times the probability that the batch touches it (``expected_touched``), from HBM if hot and
    over the host link if cold (a cold expert is read once per step in place, whatever the
    number of its tokens). Times: ``bytes / bandwidth``; ``step_s_lower = max(hbm_s, link_s)``
    (perfect overlap) and ``step_s_sum = hbm_s + link_s`` (none). KV cache, activations and launch
    overheads are not modelled. These are estimates, not bounds: the touched-expert probability
    treats a batch's tokens as picking experts independently, while real tokens of a batch share
    experts, so fewer bytes are read and measured batch-8 steps on the H200 fall below ``step_s_lower``
    (BENCHMARKS.md); at batch 1 they are bytes-only floors for the preset's rates.

    ``histogram`` is the histogram (then the placement's profile spec selects the counts) or
    the profile counts ``[num_moe_layers, num_experts]`` themselves.
    """
    bw = get_bandwidths(bandwidths)
    if isinstance(histogram, np.ndarray):
        counts = np.asarray(histogram, dtype=np.float64)
    else:
        counts = profile_counts(
            as_histogram(histogram), placement.moe_layers, placement.num_experts, placement.profile
        )
    if counts.shape != placement.row_map.shape:
        raise PlacementError(
            f"profile counts have shape {list(counts.shape)}, the placement's row map "
            f"{list(placement.row_map.shape)}"
        )
    touched = expected_touched(counts, config.top_k, int(batch_size))
    hot = placement.row_map >= 0
    hot_experts = float(touched[hot].sum())
    cold_experts = float(touched[~hot].sum())
    per_expert = placement.bytes_per_expert
    hbm_bytes = placement.nonexpert_gib * GIB + hot_experts * per_expert  # exact: GIB is a power of 2
    link_bytes = cold_experts * per_expert
    hbm_s = hbm_bytes / (bw.hbm_gb_s * 1e9)
    link_s = link_bytes / (bw.link_gb_s * 1e9)
    lower, total = max(hbm_s, link_s), hbm_s + link_s
    return StepPrediction(
        preset=bw.name,
        batch_size=int(batch_size),
        hbm_gb_s=bw.hbm_gb_s,
        link_gb_s=bw.link_gb_s,
        hbm_bytes=hbm_bytes,
        link_bytes=link_bytes,
        expected_hot_experts=hot_experts,
        expected_cold_experts=cold_experts,
        hbm_s=hbm_s,
        link_s=link_s,
        step_s_lower=lower,
        step_s_sum=total,
        tok_s_lower=batch_size / lower,
        tok_s_sum=batch_size / total,
    )


#: The ways a cold expert's weights reach a kernel, simplest first (the order ties are broken in).
COLD_PATHS = ("in_place", "raw_fill", "compressed_fill")


@dataclass(frozen=True)
class ColdPathTimes:
    """Seconds to serve one group of cold experts (a layer's misses) by each path, and the fastest."""

    in_place_s: float
    raw_fill_s: float
    compressed_fill_s: float
    choice: str


def compressed_fill_s(expert_bytes, ratios, link_gb_s: float, decode_gb_s: float) -> float:
    """When the last of a group of experts is decoded into its slot, filled from the compressed host
    tier expert by expert: expert ``j``'s record (``ratios[j] * expert_bytes[j]`` bytes) crosses the
    link after expert ``j - 1``'s; its decode (``expert_bytes[j]`` bytes out at ``decode_gb_s``, the
    decoder's rate beside the step's compute) starts once its record has landed and the decoder has
    finished expert ``j - 1``, so the copy of the next expert overlaps the decode of the one before."""
    if link_gb_s <= 0 or decode_gb_s <= 0:
        raise PlacementError(f"compressed_fill_s: rates must be > 0, got link {link_gb_s}, decode {decode_gb_s} GB/s")
    copied = decoded = 0.0
    for nbytes, ratio in zip(expert_bytes, ratios, strict=True):
        copied += ratio * nbytes / (link_gb_s * 1e9)
        decoded = max(copied, decoded) + nbytes / (decode_gb_s * 1e9)
    return decoded


def cold_path_choice(expert_bytes, link_gb_s: float, hbm_gb_s: float, ratio: float, decode_gb_s: float,
                     reads: int = 1) -> ColdPathTimes:
    """Which way to serve a group of cold experts (``expert_bytes``, one entry per expert, each read
    ``reads`` times by the kernels before it leaves HBM), from the link's and HBM's read rates, the
    codec's ``ratio`` (compressed over raw bytes) and the decoder's rate beside the compute.

    - ``in_place``: every read crosses the link (zero-copy over the raw host tier): ``reads * B / link``;
    - ``raw_fill``: one copy, then reads from HBM: ``B / link + reads * B / hbm``;
    - ``compressed_fill``: :func:`compressed_fill_s`, then reads from HBM.

    The choice is the fastest, ties going to the simpler path (:data:`COLD_PATHS` order). A coded
    expert cannot be read in place (:mod:`coldset.kernels.compressed_tier`), so ``in_place`` always
    reads the raw tier."""
    sizes = [float(b) for b in expert_bytes]
    if not sizes or min(sizes) < 0:
        raise PlacementError(f"cold_path_choice: expert_bytes must be non-negative and non-empty, got {sizes}")
    if not (link_gb_s > 0 and hbm_gb_s > 0 and decode_gb_s > 0 and 0 < ratio):
        raise PlacementError(f"cold_path_choice: rates and ratio must be > 0, got link {link_gb_s}, hbm {hbm_gb_s}, "
                             f"decode {decode_gb_s} GB/s, ratio {ratio}")
    if reads < 1:
        raise PlacementError(f"cold_path_choice: reads must be >= 1, got {reads}")
    total = sum(sizes)
    from_hbm = reads * total / (hbm_gb_s * 1e9)
    times = {"in_place": reads * total / (link_gb_s * 1e9),
             "raw_fill": total / (link_gb_s * 1e9) + from_hbm,
             "compressed_fill": compressed_fill_s(sizes, [ratio] * len(sizes), link_gb_s, decode_gb_s) + from_hbm}
    choice = min(COLD_PATHS, key=lambda p: (times[p], COLD_PATHS.index(p)))
    return ColdPathTimes(times["in_place"], times["raw_fill"], times["compressed_fill"], choice)
