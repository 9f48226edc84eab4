"""Snakemake script of the `placement` rule: thin, the work is coldset.pipeline.placement."""

from coldset.pipeline import run_from_snakemake

run_from_snakemake(snakemake, "placement")  # noqa: F821 (snakemake is injected)
