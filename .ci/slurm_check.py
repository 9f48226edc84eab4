"""Checks of the SLURM CI step (.ci/slurm): the job table, and the SLURM run's results against the
local run's. Usage: slurm_check.py JOBS_TXT RESULTS_LOCAL RESULTS_SLURM, where JOBS_TXT is
`squeue --states=all -h -O JobID,Comment,State,TimeUsed,tres-per-job` (job id, comment
rule_{rule}..., state, elapsed, TRES per job: gres:gpu:1 or N/A), whitespace-separated. Prints the job table and the comparison; exits non-zero naming what differs."""

from __future__ import annotations

import sys
from pathlib import Path

GPU_RULES = {"routing", "autotune", "parity", "bench"}
CPU_RULES = {"model", "fixtures", "stats", "placement", "parity_gate", "track", "report"}


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

    # the same files, byte for byte: placements (JSON and row maps), parity reports, the gate
    local_root, slurm_root = Path(local), Path(slurm)
    compared = 0
    for stage in ("placement", "parity"):
        local_files = sorted(p.relative_to(local_root) for p in (local_root / stage).rglob("*") if p.is_file())
        slurm_files = sorted(p.relative_to(slurm_root) for p in (slurm_root / stage).rglob("*") if p.is_file())
        if not local_files:
            errors.append(f"local run wrote no {stage} files")
        if local_files != slurm_files:
            errors.append(f"{stage}: different files: local only {sorted(set(local_files) - set(slurm_files))}, "
                          f"SLURM only {sorted(set(slurm_files) - set(local_files))}")
        for rel in sorted(set(local_files) & set(slurm_files)):
            compared += 1
            if (local_root / rel).read_bytes() != (slurm_root / rel).read_bytes():
                errors.append(f"{rel}: differs between the local and the SLURM run")
    for rel in ("report/index.html",):
        if not (slurm_root / rel).is_file():
            errors.append(f"SLURM run has no {rel}")
    print(f"compared {compared} placement/parity files: "
          f"{'identical' if not any('differs' in e for e in errors) else 'DIFFERENT'}")
    for e in errors:
        print(f"FAIL: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
