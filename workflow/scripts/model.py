"""Snakemake script of the `model` rule: thin, the work is coldset.workflow.stages.prepare.model."""

from coldset.workflow.entry import run_from_snakemake

run_from_snakemake(snakemake, "model")  # noqa: F821 (snakemake is injected)
