"""Which experts a placement keeps in host memory: per MoE layer, the expert ids of its cold rows.

A placement's row map (docs/design.md §3; ``coldset.core.placement``) numbers hot rows ``>= 0``
and cold rows ``< 0``; the cold experts of a layer are the columns of its negative entries. The
report shows them (:mod:`coldset.reporting.report`) and ``python -m coldset cold-experts`` prints
them (:func:`main`), both through :func:`read_cold_experts`. A dynamic placement's row map is its
slot cache's warm start: its cold set is where the cache starts, not where it stays.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coldset.core.placement import (
    DYNAMIC_POLICIES,
    PlacementError,
    load_placement,
    residency_label,
    row_map_path,
    validate_row_map,
)

ROW_MAP_SUFFIX = ".rowmap.npy"


@dataclass
class ColdExperts:
    """One placement's cold experts: ``cold[i]`` are the expert ids of MoE layer ``layers[i]``."""

    name: str  # {policy}-{residency}
    source: Path  # the row map read
    layers: list[int]
    num_experts: int
    cold: list[list[int]]
    dynamic: bool  # a slot cache's warm start

    @property
    def num_cold(self) -> int:
        return sum(len(c) for c in self.cold)


def cold_ids(row_map: np.ndarray) -> list[list[int]]:
    """Per row (MoE layer) of ``row_map``, the sorted column indices (expert ids) of negative entries."""
    return [np.flatnonzero(row < 0).astype(int).tolist() for row in np.asarray(row_map)]


def id_ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``; ``"none"`` for no ids."""
    if not ids:
        return "none"
    parts, start, prev = [], ids[0], ids[0]
    for i in [*ids[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)


def _load_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise PlacementError(f"{path}: not a readable .npy row map ({exc})") from None


def _from_json(path: Path) -> ColdExperts:
    """A placement JSON and its row map, read and checked by ``coldset.core.placement.load_placement``."""
    pl = load_placement(path)
    return ColdExperts(path.name[: -len(".json")], row_map_path(path), list(pl.moe_layers), pl.num_experts,
                       cold_ids(pl.row_map), pl.dynamic)


def _from_npy(path: Path) -> ColdExperts:
    """A bare row map: validated against its own counts; layers numbered by position (0..L-1)
    unless its JSON beside it is read instead (:func:`read_cold_experts`)."""
    row_map = _load_npy(path)
    if row_map.ndim != 2:
        raise PlacementError(f"{path}: a row map is [num_moe_layers, num_experts], got shape {list(row_map.shape)}")
    num_hot = int((row_map >= 0).sum()) if row_map.dtype == np.int32 else 0
    validate_row_map(row_map, num_hot, row_map.size - num_hot, row_map.shape[0], row_map.shape[1], str(path))
    name = path.name[: -len(ROW_MAP_SUFFIX)] if path.name.endswith(ROW_MAP_SUFFIX) else path.stem
    return ColdExperts(name, path, list(range(row_map.shape[0])), row_map.shape[1], cold_ids(row_map),
                       name.rsplit("-", 1)[0] in DYNAMIC_POLICIES)


def placement_jsons(folder: Path) -> list[Path]:
    """The placement JSONs (those naming a row map) in ``folder``, or in ``folder/placement/*/``
    for a results directory, sorted by name."""
    candidates = sorted(folder.glob("*-*.json")) or sorted(folder.glob("placement/*/*-*.json"))
    out = []
    for p in candidates:
        if p.with_name(p.name[: -len(".json")] + ROW_MAP_SUFFIX).is_file():
            out.append(p)
    return out


def _matches_budget(path: Path, budget: str | None) -> bool:
    if budget is None:
        return True
    residency = path.name[: -len(".json")].rsplit("-", 1)[-1]
    try:
        return residency_label(float(residency)) == residency_label(float(budget))
    except ValueError:
        return False


def read_cold_experts(target: str | os.PathLike, budget: str | None = None) -> list[ColdExperts]:
    """The cold experts of the placement(s) ``target`` names: a placement JSON, a ``.rowmap.npy``
    (its JSON beside it is read when present, for the layer ids), a placement folder or a results
    directory (every placement in it). ``budget``: only placements of this residency (``0.5``).
    Errors (:class:`PlacementError`) name the file."""
    path = Path(target)
    if budget is not None:
        try:
            float(budget)
        except ValueError:
            raise PlacementError(f"--budget {budget!r}: not a residency (a number such as 0.5)") from None
    if path.is_dir():
        jsons = placement_jsons(path)
        if not jsons:
            raise PlacementError(f"{path}: no placement (a {{policy}}-{{residency}}.json beside its {ROW_MAP_SUFFIX}) "
                                 "here or under placement/*/")
        chosen = [p for p in jsons if _matches_budget(p, budget)]
        if not chosen:
            have = sorted({p.name[: -len(".json")].rsplit("-", 1)[-1] for p in jsons})
            raise PlacementError(f"{path}: no placement at budget {budget} (residencies here: {', '.join(have)})")
        return [_from_json(p) for p in chosen]
    if not path.is_file():
        raise PlacementError(f"{path}: no such placement file or results directory")
    if path.name.endswith(ROW_MAP_SUFFIX):
        beside = path.with_name(path.name[: -len(ROW_MAP_SUFFIX)] + ".json")
        return [_from_json(beside) if beside.is_file() else _from_npy(path)]
    if path.suffix == ".json":
        return [_from_json(path)]
    raise PlacementError(f"{path}: not a placement JSON, a {ROW_MAP_SUFFIX} row map or a results directory")


def format_cold_experts(placements: list[ColdExperts]) -> str:
    """The command's text: per placement a header line, then ``layer L: ids`` per MoE layer."""
    lines = []
    for pl in placements:
        note = " (a slot cache's warm start: the cache moves experts at run time)" if pl.dynamic else ""
        lines.append(f"{pl.name}: {pl.num_cold} of {len(pl.layers) * pl.num_experts} experts in host memory "
                     f"({pl.source}){note}")
        width = len(str(max(pl.layers, default=0)))
        for layer, ids in zip(pl.layers, pl.cold):
            lines.append(f"  layer {layer:>{width}}: {' '.join(map(str, ids)) if ids else '-'}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``python -m coldset cold-experts TARGET [--budget R]``."""
    parser = argparse.ArgumentParser(
        prog="python -m coldset cold-experts",
        description="Print, per MoE layer, the ids of the experts a placement keeps in host memory.")
    parser.add_argument("target", help="a placement JSON or .rowmap.npy, a placement folder or a results directory")
    parser.add_argument("--budget", help="only placements of this residency (HBM share of routed experts, e.g. 0.5)")
    args = parser.parse_args(argv)
    try:
        placements = read_cold_experts(args.target, args.budget)
    except PlacementError as exc:
        print(f"coldset cold-experts: {exc}", file=sys.stderr)
        return 1
    print(format_cold_experts(placements))
    return 0
