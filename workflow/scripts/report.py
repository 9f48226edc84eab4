"""Snakemake script of the `report` rule: thin, the work is coldset.workflow.stages.publish.report."""

from coldset.workflow.entry import run_from_snakemake

run_from_snakemake(snakemake, "report")  # noqa: F821 (snakemake is injected)
