"""The stage context: what every stage reads, built once from the validated config (docs/design.md §1).

Every stage function takes a :class:`StageContext`. The facts several stages need (the files'
layout, the model's folder or that it lives in memory, the device, the configured placements,
the fixture files, the model's shape) are derived here once, not re-derived from the raw config
at each call; each section's settings are read-only mappings (``ctx.bench["batch_sizes"]``), as
config/schema.yaml defines them. The model's architecture and the device are read on first use
and kept: the model stage writes the manifest the architecture comes from, and resolving the
device asks torch for a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from pathlib import Path
from types import MappingProxyType

import torch

from coldset.core import shapes
from coldset.core.files import read_json
from coldset.core.placement import residency_label
from coldset.engine.loading import read_config
from coldset.engine.model import ModelConfig
from coldset.engine.synthetic import SyntheticSpec
from coldset.core.layout import Layout
from coldset.workflow.config import ConfigError, decoding_support, skipped_stages

IN_MEMORY_SOURCE = "synthetic-in-memory"

SECTIONS = ("model", "fixtures", "routing", "stats", "placement", "cache", "autotune", "parity", "bench", "tracking")


class StageError(RuntimeError):
    """A stage could not run with this configuration (the message says why)."""


def resolve_device(setting: str) -> str:
    """``auto`` is cuda when torch sees a GPU, else cpu; ``cuda`` without a GPU is an error."""
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config device: cuda, but torch sees no CUDA device")
    return setting


@dataclass(frozen=True)
class StageContext:
    """The validated config's facts for the stages (module doc); :meth:`from_config` builds it."""

    config: dict  # the validated config whole, for what takes it whole: its hash, the report, the tracking URI
    layout: Layout
    model_name: str
    model_path: Path | None  # model.path: a local Hugging Face folder (None: the synthetic model)
    in_memory: bool  # model.synthetic.in_memory without model.path: no folder, built by each process
    dtype: str
    device_setting: str  # auto | cpu | cuda (:attr:`device` resolves it)
    placements: tuple[str, ...]  # the configured placements, {policy}-{residency label}
    decoding: str | None  # None when the embedded engine decodes the model, else why not
    skipped: Mapping  # the stages left out for this model, each with its reason (config.skipped_stages)
    fixture_paths: tuple[Path, ...]  # one JSONL per fixtures.domains entry
    model: Mapping
    fixtures: Mapping
    routing: Mapping
    stats: Mapping
    placement: Mapping
    cache: Mapping
    autotune: Mapping
    parity: Mapping
    bench: Mapping
    tracking: Mapping

    @classmethod
    def from_config(cls, config: dict) -> StageContext:
        layout = Layout.from_config(config)
        model = config["model"]
        pc = config["placement"]
        sections = {name: MappingProxyType(config[name]) for name in SECTIONS}
        return cls(
            config=config, layout=layout, model_name=model["name"],
            model_path=Path(model["path"]) if model["path"] else None,
            in_memory=not model["path"] and bool((model["synthetic"] or {}).get("in_memory")),
            dtype=model["dtype"], device_setting=config.get("device", "auto"),
            placements=tuple(f"{p}-{residency_label(r)}" for p in pc["policies"] for r in pc["residency"]),
            decoding=decoding_support(config), skipped=MappingProxyType(skipped_stages(config)),
            fixture_paths=tuple(layout.fixtures(d) for d in config["fixtures"]["domains"]),
            **sections)

    @cached_property
    def device(self) -> str:
        """The device the engine runs on (:func:`resolve_device`)."""
        return resolve_device(self.device_setting)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def manifest_path(self) -> Path:
        return self.layout.model_dir / "manifest.json"

    @cached_property
    def synthetic_spec(self) -> SyntheticSpec:
        """``model.synthetic`` as a :class:`coldset.engine.synthetic.SyntheticSpec` (unknown keys refused)."""
        known = {f.name for f in fields(SyntheticSpec)}
        unknown = sorted(set(self.model["synthetic"]) - known)
        if unknown:
            raise StageError(f"config model.synthetic: unknown setting(s) {unknown}; known: {sorted(known)}")
        return SyntheticSpec(**self.model["synthetic"])

    @property
    def model_dir(self) -> Path:
        """The Hugging Face folder every model-reading stage loads (refused for an in-memory model)."""
        if self.in_memory:
            raise StageError(
                f"config model.synthetic.in_memory is true: model {self.model_name!r} is generated in "
                "memory by each process that uses it and has no folder (stages read its shape with "
                "StageContext.model_config and its weights through the engine); a stage that needs a "
                "folder (e.g. routing.backend: vllm) cannot run it: set in_memory: false to write a checkpoint")
        return self.model_path if self.model_path is not None else self.layout.model_dir / "hf"

    @cached_property
    def model_config(self) -> ModelConfig:
        """The model's architecture (:class:`coldset.engine.model.ModelConfig`) for stages that need only its shape.

        A folder's ``config.json``; for an in-memory model, the model stage's manifest (the config
        :func:`coldset.engine.synthetic.synthetic_model_config` gave), refused if its spec is not the config's.
        """
        if not self.in_memory:
            return read_config(self.model_dir)
        path = self.manifest_path
        try:
            manifest = read_json(path, "model manifest")
        except FileNotFoundError as exc:
            raise StageError(f"{exc}: run the model stage first") from None
        spec = asdict(self.synthetic_spec)
        if manifest.get("source") != IN_MEMORY_SOURCE or manifest.get("spec") != spec:
            raise StageError(f"model manifest {path} was not written for this config's in-memory model "
                             f"(source {manifest.get('source')!r}, spec {manifest.get('spec')}); run the model stage again")
        try:
            return ModelConfig.from_dict(manifest["config"], f"model manifest {path} field 'config'")
        except ValueError as exc:
            raise StageError(f"{exc}; run the model stage again") from None

    @cached_property
    def model_shape(self) -> shapes.MoEShape:
        """The model's shape and weight bytes (:class:`coldset.core.shapes.MoEShape`) for the stages that do
        not decode (placement, the speed model, the cache simulation): a folder's ``config.json`` of
        any family :mod:`coldset.core.shapes` reads (weights not needed), or an in-memory model's manifest."""
        if self.in_memory:  # its ModelConfig is a shape, in the dtype the model is built in
            return self.model_config
        try:
            return shapes.read_shape(self.model_dir)
        except shapes.ShapeError as exc:
            raise StageError(str(exc)) from None

    def placement_names(self, only: list[str] | None = None) -> list[str]:
        """The configured placements, or those of ``only`` (refused if one is not configured)."""
        names = list(self.placements)
        if only:
            unknown = sorted(set(only) - set(names))
            if unknown:
                raise StageError(f"unknown placement(s) {unknown}; configured: {names}")
            names = [n for n in names if n in only]
        return names

    def require_decoding(self, stage: str) -> None:
        """Refuse a decoding stage for a shape-only model, saying what does work."""
        if self.decoding is None:
            return
        raise StageError(
            f"stage {stage} cannot run for model {self.model_name!r}: {self.decoding}. Routing capture, "
            "autotune, parity and bench decode with the embedded engine, which needs a qwen3_moe or mixtral "
            "folder with its weights. What works with config.json alone: set routing.trace to a recorded "
            "trace (this project's parquet, vLLM's routed_experts export or an SGLang dump), then run "
            "stats, placement and report (`snakemake --cores all report` skips the decoding stages)")
