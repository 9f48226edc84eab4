"""How cold experts reach the kernels, as the report says it: the cold path of each cache-simulation
row and, where the cache stage timed the compressed host tier, which path the speed model picks.

The paths (:data:`coldset.analysis.speed.COLD_PATHS`): ``in place`` (the kernels read the raw host
tier over the link: the static placement's cold experts), ``raw fills`` (a dynamic cache copies
each admitted miss and prefetch into a slot from the raw host tier) and ``compressed fills`` (the
same copies from the lossless compressed host tier, decoded into the slot on the GPU). A dynamic
cache also reads in place the misses it does not admit; the row names how its slots are filled.

The pick (:func:`cold_path_pick`): :func:`coldset.analysis.speed.cold_path_choice` for one MoE
layer's misses of a step (the best raw-tier cache row's misses at the smallest simulated batch),
each read once, at this model's bytes per expert (the placement files' byte model), the link and
HBM rates measured by the bench (its ceilings) or else the speed model's configured ones
(``placement.bandwidths``), and the ratio and decoder rate of the config's ``cache.compressed_tier``
for the experts' format (:func:`coldset.analysis.time_model.compressed_tier`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coldset.analysis.speed import cold_path_choice, get_bandwidths
from coldset.analysis.streams import CacheError
from coldset.analysis.time_model import compressed_tier
from coldset.core.files import read_json
from coldset.core.placement import GIB
from coldset.reporting.answer import COLD_PATH_WORDS, human
from coldset.reporting.results import ReportInputError

def time_text(seconds: float) -> str:
    """A duration in µs below a millisecond, else in ms, three significant digits."""
    return f"{human(seconds * 1e6)} µs" if seconds < 1e-3 else f"{human(seconds * 1e3)} ms"


@dataclass(frozen=True)
class ColdPathPick:
    """The speed model's pick for one layer's misses (module doc) and what it was computed from."""

    choice: str  # a COLD_PATH_WORDS value
    seconds: dict[str, float]  # per COLD_PATH_WORDS value
    experts: int
    expert_bytes: float
    link_gb_s: float
    hbm_gb_s: float
    rates_source: str
    ratio: float
    decode_gb_s: float
    weight_format: str
    estimate: bool

    def short(self) -> str:
        """The pick in a few words, for the answer at the top."""
        return (f"the speed model picks {self.choice} for this model's experts"
                + (" (estimate)" if self.estimate else ""))

    def text(self) -> str:
        """One sentence in human units."""
        label = "speed model, estimate" if self.estimate else "speed model"
        times = ", ".join(f"{w} {time_text(s)}" for w, s in self.seconds.items())
        return (f"cold path ({label}): {self.choice} for a layer's {self.experts} missed "
                f"expert{'s' if self.experts != 1 else ''} of {human(self.expert_bytes / 1e6)} MB "
                f"({self.weight_format}) read once: {times}; link {human(self.link_gb_s)} GB/s and HBM "
                f"{human(self.hbm_gb_s)} GB/s {self.rates_source}, compressed/raw {human(self.ratio)}, decoder "
                f"{human(self.decode_gb_s)} GB/s (cache.compressed_tier)")


def experts_format(results_dir: Path, model: str) -> str | None:
    """The routed experts' format the run holds and moves, as the model stage recorded it in
    ``model/{model}/manifest.json`` (``experts_format``, or a shape-only model's ``shape``); None
    without a manifest."""
    path = results_dir / "model" / model / "manifest.json"
    if not path.is_file():
        return None
    doc = read_json(path)
    fmt = doc.get("experts_format") if isinstance(doc, dict) else None
    if fmt is None and isinstance(doc, dict) and isinstance(doc.get("shape"), dict):
        fmt = doc["shape"].get("expert_format")
    if not isinstance(fmt, str):
        raise ReportInputError(f"{path}: no experts_format (nor shape.expert_format) recorded")
    return fmt


def _bytes_per_expert(placements: list) -> float:
    """One routed expert's bytes under the placement stage's byte model (its HBM and host GiB over
    its experts)."""
    p = placements[0]
    return (p.hbm_expert_gib + p.host_expert_gib) * GIB / max(1, p.num_hot + p.num_cold)


def _rates(config: dict, bench: list) -> tuple[float, float, str]:
    """(link, HBM GB/s, where from): the bench's measured ceilings where it has them, else the speed
    model's preset (``placement.bandwidths``)."""
    measured = [b.ceilings for b in bench if b.ceilings and b.ceilings.get("link_read_gb_s")
                and b.ceilings.get("hbm_read_gb_s")]
    if measured:
        link = min(c["link_read_gb_s"] for c in measured)
        hbm = min(c["hbm_read_gb_s"] for c in measured)
        return float(link), float(hbm), "measured by the bench"
    spec = (config.get("placement") or {}).get("bandwidths") or "h200"
    bw = get_bandwidths(spec)
    return bw.link_gb_s, bw.hbm_gb_s, f"of the speed model's {bw.name} preset"


def cold_path_pick(table, config: dict, bench: list, placements: list, results_dir: Path, model: str,
                   layers: int, estimate: bool) -> ColdPathPick | str | None:
    """The speed model's cold path (module doc) where ``table`` (``simulation.csv``) has compressed
    rows; a sentence saying why there is none where an input is missing; None without compressed
    rows. ``layers``: the trace's MoE layers (a step's misses are spread over them)."""
    if table is None or "host_tier" not in table or not (table["host_tier"] == "compressed").any():
        return None
    spec = (config.get("cache") or {}).get("compressed_tier")
    if not spec:
        raise ReportInputError(f"cache/{model}/simulation.csv has host_tier=compressed rows but the config's "
                               "cache.compressed_tier is off: the ratio and decoder rate it was timed with are unknown")
    fmt = experts_format(results_dir, model)
    if fmt is None:
        return (f"cold path: no speed-model pick (the experts' format is not recorded: no "
                f"model/{model}/manifest.json)")
    if not placements or layers < 1:
        return "cold path: no speed-model pick (no placement files or MoE layers to size a layer's misses)"
    try:
        ratio, decode = compressed_tier(spec, fmt)
    except CacheError as exc:
        raise ReportInputError(str(exc)) from None
    cached = table[(table["policy"] != "static") & (table["policy"] != "belady") & (table["host_tier"] == "raw")]
    if not len(cached):
        return "cold path: no speed-model pick (no dynamic cache rows in the simulation)"
    if "batch" in cached:
        cached = cached[cached["batch"] == cached["batch"].min()]
    low = cached[cached["residency"] == cached["residency"].min()]
    timed = "step_ms" in low and low["step_ms"].notna().all()
    best = low.loc[low["step_ms"].idxmin() if timed else low["hit_rate"].idxmax()]
    batch = int(best["batch"]) if "batch" in best else 1
    experts = max(1, round(float(best["misses_per_token"]) * batch / layers))
    link, hbm, source = _rates(config, bench)
    size = _bytes_per_expert(placements)
    t = cold_path_choice([size] * experts, link, hbm, ratio, decode)
    seconds = {COLD_PATH_WORDS["in_place"]: t.in_place_s, COLD_PATH_WORDS["raw_fill"]: t.raw_fill_s,
               COLD_PATH_WORDS["compressed_fill"]: t.compressed_fill_s}
    return ColdPathPick(COLD_PATH_WORDS[t.choice], seconds, experts, size, link, hbm, source, ratio, decode, fmt,
                        estimate)
