"""Snakemake script of the `placement` rule: thin, the work is coldset.workflow.pipeline.placement."""

from coldset.workflow.pipeline import run_from_snakemake

run_from_snakemake(snakemake, "placement")  # noqa: F821 (snakemake is injected)
