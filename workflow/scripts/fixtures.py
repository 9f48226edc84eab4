"""Snakemake script of the `fixtures` rule: thin, the work is coldset.workflow.pipeline.fixtures."""

from coldset.workflow.pipeline import run_from_snakemake

run_from_snakemake(snakemake, "fixtures")  # noqa: F821 (snakemake is injected)
