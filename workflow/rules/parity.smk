# One job decodes the fixtures once on the unmodified path, then once per placement (the model
# and the reference are loaded and computed once, which matters at real model sizes).
rule parity:
    input:
        manifest=model_inputs,
        fixtures=expand(f"{RESULTS}/fixtures/{{domain}}.jsonl", domain=DOMAINS),
        placements=rules.placement.output.placements,
        rowmaps=rules.placement.output.rowmaps,
        forecasters=rules.placement.output.forecasters,
        autotune=rules.autotune.output.entry,
    output:
        reports=update(
            report(
                expand(f"{RESULTS}/parity/{MODEL}/{{placement}}.json", placement=PLACEMENTS, allow_missing=True),
                caption="../../report/parity.rst",
                category="Parity",
            ),
        ),
    log:
        f"logs/parity/{MODEL}.log",
    conda:
        "../envs/coldset.yaml"
    threads: workflow.cores  # the engine uses every core; timings need them undisturbed
    resources:
        gpu=1,
    params:
        parity=config["parity"],
    script:
        "../scripts/parity.py"


# The gate: fails, naming every placement whose tokens differ; bench and report depend on it.
rule parity_gate:
    input:
        reports=rules.parity.output.reports,
        # the files each report's fingerprint digests (coldset.verify.fingerprint): the gate refuses a
        # report about other files than these
        rowmaps=rules.placement.output.rowmaps,
        forecasters=rules.placement.output.forecasters,
        manifest=model_inputs,
        autotune=rules.autotune.output.entry,
    output:
        gate=f"{RESULTS}/parity/{MODEL}/gate.json",
    log:
        f"logs/parity_gate/{MODEL}.log",
    conda:
        "../envs/coldset.yaml"
    script:
        "../scripts/parity_gate.py"
