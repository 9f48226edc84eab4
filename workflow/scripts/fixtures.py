"""Snakemake script of the `fixtures` rule: thin, the work is coldset.pipeline.fixtures."""

from coldset.pipeline import run_from_snakemake

run_from_snakemake(snakemake, "fixtures")  # noqa: F821 (snakemake is injected)
