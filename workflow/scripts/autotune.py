"""Snakemake script of the `autotune` rule: thin, the work is coldset.workflow.pipeline.autotune."""

from coldset.workflow.pipeline import run_from_snakemake

run_from_snakemake(snakemake, "autotune")  # noqa: F821 (snakemake is injected)
