"""Snakemake script of the `stats` rule: thin, the work is coldset.workflow.stages.prepare.stats."""

from coldset.workflow.entry import run_from_snakemake

run_from_snakemake(snakemake, "stats")  # noqa: F821 (snakemake is injected)
