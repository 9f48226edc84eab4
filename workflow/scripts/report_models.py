"""Snakemake script of the `report_models` rule: thin, the work is coldset.workflow.sweep.report_models."""

from coldset.workflow.pipeline import run_from_snakemake
from coldset.workflow.sweep import report_models

run_from_snakemake(snakemake, report_models)  # noqa: F821 (snakemake is injected)
