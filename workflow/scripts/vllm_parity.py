"""Snakemake script of the `vllm_parity` rule: thin, the work is coldset.workflow.vllm_parity.vllm_parity."""

from coldset.workflow.pipeline import run_from_snakemake
from coldset.workflow.vllm_parity import vllm_parity

run_from_snakemake(snakemake, vllm_parity)  # noqa: F821 (snakemake is injected)
