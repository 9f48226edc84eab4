"""Where each stage's files live under results/: the one place that names them (docs/design.md §1).

The workflow's rules, the stages, the report and the vLLM plugin all find a stage's files through
:class:`Layout`, so a path is spelled once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coldset.core.placement import residency_label


@dataclass(frozen=True)
class Layout:
    """Where each stage's files live, from the validated config (docs/design.md §1)."""

    results: Path
    model: str

    @classmethod
    def from_config(cls, config: dict) -> "Layout":
        return cls(results=Path(config["results"]), model=config["model"]["name"])

    @property
    def model_dir(self) -> Path:
        return self.results / "model" / self.model

    @property
    def fixtures_dir(self) -> Path:
        return self.results / "fixtures"

    def fixtures(self, domain: str) -> Path:
        return self.fixtures_dir / f"{domain}.jsonl"

    @property
    def trace(self) -> Path:
        return self.results / "routing" / self.model / "trace.parquet"

    @property
    def stats_dir(self) -> Path:
        return self.results / "stats" / self.model

    @property
    def placement_dir(self) -> Path:
        return self.results / "placement" / self.model

    def placement(self, policy: str, residency: float | str) -> Path:
        label = residency if isinstance(residency, str) else residency_label(residency)
        return self.placement_dir / f"{policy}-{label}.json"

    @property
    def cache_dir(self) -> Path:
        return self.results / "cache" / self.model

    @property
    def autotune(self) -> Path:
        return self.results / "autotune" / f"{self.model}.json"

    def parity(self, policy: str, residency: float | str) -> Path:
        label = residency if isinstance(residency, str) else residency_label(residency)
        return self.results / "parity" / self.model / f"{policy}-{label}.json"

    @property
    def parity_gate(self) -> Path:
        return self.results / "parity" / self.model / "gate.json"

    def bench(self, policy: str, residency: float | str) -> Path:
        label = residency if isinstance(residency, str) else residency_label(residency)
        return self.results / "bench" / self.model / f"{policy}-{label}.json"

    @property
    def track_done(self) -> Path:
        return self.results / "track" / f"{self.model}.done"

    @property
    def report(self) -> Path:
        return self.results / "report" / "index.html"
