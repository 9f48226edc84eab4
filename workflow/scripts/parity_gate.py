"""Snakemake script of the `parity_gate` rule: thin, the work is coldset.workflow.stages.verify.parity_gate."""

from coldset.workflow.entry import run_from_snakemake

run_from_snakemake(snakemake, "parity_gate")  # noqa: F821 (snakemake is injected)
