"""Snakemake script of the `parity_gate` rule: thin, the work is coldset.workflow.pipeline.parity_gate."""

from coldset.workflow.pipeline import run_from_snakemake

run_from_snakemake(snakemake, "parity_gate")  # noqa: F821 (snakemake is injected)
