"""Snakemake script of the `routing` rule: thin, the work is coldset.workflow.stages.prepare.routing."""

from coldset.workflow.entry import run_from_snakemake

run_from_snakemake(snakemake, "routing")  # noqa: F821 (snakemake is injected)
