"""Snakemake script of the `report` rule: thin, the work is coldset.pipeline.report."""

from coldset.pipeline import run_from_snakemake

run_from_snakemake(snakemake, "report")  # noqa: F821 (snakemake is injected)
