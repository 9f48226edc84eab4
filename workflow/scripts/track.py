"""Snakemake script of the `track` rule: thin, the work is coldset.workflow.pipeline.track."""

from coldset.workflow.pipeline import run_from_snakemake

run_from_snakemake(snakemake, "track")  # noqa: F821 (snakemake is injected)
