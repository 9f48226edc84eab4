"""Snakemake script of the `placement` rule: thin, the work is coldset.workflow.stages.prepare.placement."""

from coldset.workflow.entry import run_from_snakemake

run_from_snakemake(snakemake, "placement")  # noqa: F821 (snakemake is injected)
