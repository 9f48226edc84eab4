"""Snakemake script of the `report_models` rule: thin, the work is coldset.workflow.sweep.report_models."""

from coldset.workflow.entry import run_from_snakemake

run_from_snakemake(snakemake, "report_models")  # noqa: F821 (snakemake is injected)
