"""Snakemake script of the `cache` rule: thin, the work is coldset.workflow.pipeline.cache."""

from coldset.workflow.entry import run_from_snakemake

run_from_snakemake(snakemake, "cache")  # noqa: F821 (snakemake is injected)
