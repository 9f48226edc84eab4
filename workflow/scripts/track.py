"""Snakemake script of the `track` rule: thin, the work is coldset.workflow.stages.publish.track."""

from coldset.workflow.entry import run_from_snakemake

run_from_snakemake(snakemake, "track")  # noqa: F821 (snakemake is injected)
