"""Snakemake script of the `vllm_parity` rule: thin, the work is coldset.workflow.vllm_parity.vllm_parity."""

from coldset.workflow.entry import run_from_snakemake

run_from_snakemake(snakemake, "vllm_parity")  # noqa: F821 (snakemake is injected)
