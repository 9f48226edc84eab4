"""Snakemake script of the `parity` rule: thin, the work is coldset.workflow.stages.verify.parity."""

from coldset.workflow.entry import run_from_snakemake

run_from_snakemake(snakemake, "parity")  # noqa: F821 (snakemake is injected)
