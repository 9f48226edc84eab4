"""Snakemake script of the `report` rule: thin, the work is coldset.workflow.pipeline.report."""

from coldset.workflow.pipeline import run_from_snakemake

run_from_snakemake(snakemake, "report")  # noqa: F821 (snakemake is injected)
