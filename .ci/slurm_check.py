"""Checks of the SLURM CI step (.ci/slurm): the job table, and the SLURM run's results against the
local run's. Usage: slurm_check.py JOBS_TXT RESULTS_LOCAL RESULTS_SLURM, where JOBS_TXT is
`squeue --states=all -h -O JobID,Comment,State,TimeUsed,tres-per-job` (job id, comment
rule_{rule}..., state, elapsed, TRES per job: gres:gpu:1 or N/A), whitespace-separated. Prints the job table and the comparison; exits non-zero naming what differs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

GPU_RULES = {"routing", "autotune", "parity", "bench"}
CPU_RULES = {"model", "fixtures", "stats", "placement", "cache", "parity_gate", "track", "report"}


def _without_model_digest(doc):
    """A parity report or gate with the model manifest's digest taken out of its fingerprints:
    the manifest records the checkpoint's path and file mtimes, so it differs between any two
    result trees by construction; the checkpoint files themselves are compared byte for byte."""
    if isinstance(doc, dict):
        out = {}
        for k, v in doc.items():
            if k == "fingerprint" and isinstance(v, dict):
                v = {kk: vv for kk, vv in v.items() if kk != "model"}
            elif k == "fingerprints" and isinstance(v, dict):
                v = {name: {kk: vv for kk, vv in fp.items() if kk != "model"} for name, fp in v.items()}
            out[k] = _without_model_digest(v)
        return out
    if isinstance(doc, list):
        return [_without_model_digest(v) for v in doc]
    return doc


def _same(a: Path, b: Path) -> bool:
    if a.suffix == ".json" and a.parent.parent.name == "parity":
        return _without_model_digest(json.loads(a.read_text())) == _without_model_digest(json.loads(b.read_text()))
    return a.read_bytes() == b.read_bytes()


def main(jobs_txt: str, local: str, slurm: str) -> int:
    errors: list[str] = []
    rows = [line.split() for line in Path(jobs_txt).read_text().splitlines() if line.strip()]
    print(f"{'rule':<12} {'job id':>6} {'state':<10} {'elapsed':>8}  TRES per job")
    by_rule: dict[str, list[list[str]]] = {}
    for job_id, comment, state, elapsed, gres in sorted(rows, key=lambda r: int(r[0])):
        rule = comment.removeprefix("rule_").split("_wildcards_")[0]
        by_rule.setdefault(rule, []).append([job_id, state, elapsed, gres])
        print(f"{rule:<12} {job_id:>6} {state:<10} {elapsed:>8}  {gres}")
    for rule in sorted(GPU_RULES | CPU_RULES):
        jobs = by_rule.get(rule, [])
        if len(jobs) != 1:
            errors.append(f"rule {rule}: {len(jobs)} SLURM jobs, expected 1")
            continue
        _, state, _, gres = jobs[0]
        if state != "COMPLETED":
            errors.append(f"rule {rule}: SLURM state {state}")
        if (rule in GPU_RULES) != ("gpu" in gres):
            errors.append(f"rule {rule}: GRES {gres!r} ({'GPU' if rule in GPU_RULES else 'CPU'} rule)")
    extra = set(by_rule) - GPU_RULES - CPU_RULES
    if extra:
        errors.append(f"unexpected SLURM jobs for rules {sorted(extra)}")

    # the same files: the synthetic checkpoint and the placements (JSON and row maps) byte for byte,
    # the parity reports and the gate as JSON without the manifest digest (_without_model_digest)
    local_root, slurm_root = Path(local), Path(slurm)
    compared = 0
    for stage in ("model", "placement", "parity"):
        def files(root: Path) -> list[Path]:
            return sorted(p.relative_to(root) for p in (root / stage).rglob("*")
                          if p.is_file() and p.name != "manifest.json")

        local_files, slurm_files = files(local_root), files(slurm_root)
        if not local_files:
            errors.append(f"local run wrote no {stage} files")
        if local_files != slurm_files:
            errors.append(f"{stage}: different files: local only {sorted(set(local_files) - set(slurm_files))}, "
                          f"SLURM only {sorted(set(slurm_files) - set(local_files))}")
        for rel in sorted(set(local_files) & set(slurm_files)):
            compared += 1
            if not _same(local_root / rel, slurm_root / rel):
                errors.append(f"{rel}: differs between the local and the SLURM run")
    for rel in ("report/index.html",):
        if not (slurm_root / rel).is_file():
            errors.append(f"SLURM run has no {rel}")
    print(f"compared {compared} model/placement/parity files: "
          f"{'identical' if not any('differs' in e for e in errors) else 'DIFFERENT'}")
    for e in errors:
        print(f"FAIL: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
