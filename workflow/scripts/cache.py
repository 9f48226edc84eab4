"""Snakemake script of the `cache` rule: thin, the work is coldset.pipeline.cache."""

from coldset.pipeline import run_from_snakemake

run_from_snakemake(snakemake, "cache")  # noqa: F821 (snakemake is injected)
