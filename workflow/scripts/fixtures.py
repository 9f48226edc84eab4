"""Snakemake script of the `fixtures` rule: thin, the work is coldset.workflow.stages.prepare.fixtures."""

from coldset.workflow.entry import run_from_snakemake

run_from_snakemake(snakemake, "fixtures")  # noqa: F821 (snakemake is injected)
