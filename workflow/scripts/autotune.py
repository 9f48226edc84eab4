"""Snakemake script of the `autotune` rule: thin, the work is coldset.pipeline.autotune."""

from coldset.pipeline import run_from_snakemake

run_from_snakemake(snakemake, "autotune")  # noqa: F821 (snakemake is injected)
