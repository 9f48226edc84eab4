"""Snakemake script of the `bench` rule: thin, the work is coldset.workflow.stages.bench.bench."""

from coldset.workflow.entry import run_from_snakemake

run_from_snakemake(snakemake, "bench")  # noqa: F821 (snakemake is injected)
