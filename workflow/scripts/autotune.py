"""Snakemake script of the `autotune` rule: thin, the work is coldset.workflow.stages.prepare.autotune."""

from coldset.workflow.entry import run_from_snakemake

run_from_snakemake(snakemake, "autotune")  # noqa: F821 (snakemake is injected)
