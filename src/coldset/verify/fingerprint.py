"""What a parity report checked, so that a verdict is never applied to other files.

A parity report says "this placement decodes token-exact" about one row map, one model and one
kernel configuration. If any of them changes on disk afterwards (the placement stage rewrites a
row map, the model folder's weights are replaced, the kernel is re-tuned), the old verdict says
nothing about the new files. Each report therefore carries a fingerprint:

- ``row_map_sha256``: sha256 of the ``.rowmap.npy`` bytes the decode used (the same digest the
  placement JSON records, so the pair is checked too);
- ``placement``: sha256 of what in the placement JSON the decode reads beside the row map
  (:data:`DECODE_FIELDS`: the policy and ``cache_warm_counts``, the warm pool's eviction order, and
  a lookahead's ``cache_lookahead_depth`` and ``cache_lookahead_fit``, a nexttoken's
  ``cache_forecaster`` (its fields and the sha256 of its tables file, re-digested from the file on
  disk) and ``cache_prefetch_budget``,
  each hashed only where set, so other placements keep their digest): a
  rewritten warm state with the same warm set (same row map) is another placement, while a
  placement rewritten with other statistics (coverage, predicted step times, whose last float
  digits differ between machines' summation orders) still decodes what the verdict checked;
- ``model``: sha256 of the model stage's manifest (the model's config.json contents, its source,
  and for a folder the name, size and mtime of every weight, config and tokenizer file, which the
  model stage records; for an in-memory synthetic model its generator spec) — file stats, not
  content, so checking it costs nothing at 61 GB, and the stats themselves are re-checked against
  the folder;
- ``kernel``: sha256 of the autotune entry's key (kernel source, shape, device, versions), its
  backend and the chosen launch configurations.

Both gate entry points (``snakemake parity_gate`` and ``python -m coldset parity_gate``) compare
each report's fingerprint with :func:`current_fingerprint` and refuse a stale one, naming the
report and what changed; the gate's summary keeps the fingerprints, and the bench refuses any
placement whose current fingerprint is not the one the gate passed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from coldset.core.files import read_json

FINGERPRINT_FIELDS = ("row_map_sha256", "placement", "model", "kernel")
#: The fields of a placement JSON that the decode reads beside its row map (coldset.workflow.pipeline's
#: slot cache: the policy's decisions from the warm counts' order).
DECODE_FIELDS = ("policy", "cache_warm_counts", "cache_lookahead_depth", "cache_lookahead_fit", "cache_forecaster",
                 "cache_prefetch_budget")
#: Of DECODE_FIELDS, those hashed only where set (not null), so that a placement without them has
#: the digest it has without the fields.
OPTIONAL_DECODE_FIELDS = ("cache_lookahead_depth", "cache_lookahead_fit", "cache_forecaster", "cache_prefetch_budget")
#: Files of a model folder whose stats the manifest records (what the engine reads).
MODEL_FILE_GLOBS = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                    "*.safetensors", "*.safetensors.index.json")


class StaleReportError(RuntimeError):
    """A parity report (or the gate's summary) refers to other files than those on disk now."""


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _json_sha256(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def model_files(folder: str | os.PathLike) -> list[dict]:
    """Name, size and mtime of the files the engine reads from a model folder (for the manifest)."""
    folder = Path(folder)
    seen = sorted({p for g in MODEL_FILE_GLOBS for p in folder.glob(g) if p.is_file()})
    return [{"file": p.name, "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in seen]


def model_fingerprint(manifest_path: str | os.PathLike) -> str:
    """sha256 of the model manifest, after checking that the folder it describes is unchanged."""
    manifest_path = Path(manifest_path)
    manifest = read_json(manifest_path, "model manifest")
    if manifest.get("path") and "files" in manifest:
        now = model_files(manifest["path"])
        if now != manifest["files"]:
            was = {f["file"]: f for f in manifest["files"]}
            changed = sorted({f["file"] for f in now if was.get(f["file"]) != f}
                             | (set(was) - {f["file"] for f in now}))
            raise StaleReportError(
                f"model folder {manifest['path']} changed since the model stage wrote {manifest_path} "
                f"(file(s) {changed}): rerun the model stage")
    return file_sha256(manifest_path)


def placement_fingerprint(placement_path: str | os.PathLike) -> str:
    """sha256 of the placement JSON's :data:`DECODE_FIELDS` (see the module doc)."""
    doc = read_json(placement_path, "placement")
    if "policy" not in doc:
        raise StaleReportError(f"placement {placement_path} lacks field 'policy'")
    # cache_warm_counts: null for static; the optional fields only where set (lookahead, nexttoken)
    fields = {f: doc.get(f) for f in DECODE_FIELDS if f not in OPTIONAL_DECODE_FIELDS or doc.get(f) is not None}
    fc = fields.get("cache_forecaster")
    if fc is not None:  # the tables the decode reads, as on disk now (not only the digest the JSON claims)
        tables = Path(placement_path).with_name(str(fc.get("tables_file")))
        if not tables.is_file():
            raise StaleReportError(f"forecaster tables {tables} (of placement {placement_path}) do not exist: "
                                   "rerun the placement stage")
        fields["cache_forecaster_tables"] = file_sha256(tables)
    return _json_sha256(fields)


def kernel_fingerprint(autotune_path: str | os.PathLike) -> str:
    """sha256 of what fixes the kernel: the autotune key, backend and chosen launch configurations."""
    entry = read_json(autotune_path, "autotune entry")
    try:
        return _json_sha256({"key": entry["key"], "backend": entry["backend"], "configs": entry["configs"]})
    except (KeyError, TypeError) as exc:
        raise StaleReportError(f"autotune entry {autotune_path} lacks field {exc}") from None


def current_fingerprint(row_map_path: str | os.PathLike, placement_path: str | os.PathLike,
                        manifest_path: str | os.PathLike, autotune_path: str | os.PathLike) -> dict[str, str]:
    """The fingerprint the files on disk have now."""
    for path, what in ((row_map_path, "row map"), (placement_path, "placement")):
        if not Path(path).is_file():
            raise StaleReportError(f"{what} {path} does not exist: rerun the placement stage")
    return {"row_map_sha256": file_sha256(row_map_path), "placement": placement_fingerprint(placement_path),
            "model": model_fingerprint(manifest_path), "kernel": kernel_fingerprint(autotune_path)}


def check_fingerprint(recorded: dict | None, current: dict[str, str], where: str,
                      files: dict[str, str | os.PathLike]) -> None:
    """Refuse ``recorded`` (a report's fingerprint) unless it equals ``current``; the error names
    ``where`` (the report) and each file that changed (``files``: field -> the file it digests)."""
    if not isinstance(recorded, dict):
        raise StaleReportError(f"{where} has no fingerprint of the files it checked (written by an older "
                               "coldset?): rerun the parity stage")
    changed = [f for f in FINGERPRINT_FIELDS if recorded.get(f) != current[f]]
    if changed:
        what = ", ".join(f"{f} ({files[f]})" for f in changed)
        raise StaleReportError(f"{where} is stale: it checked other files than those on disk now; changed: {what}. "
                               "Rerun the parity stage (then the gate)")
