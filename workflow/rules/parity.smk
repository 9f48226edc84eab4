rule parity:
    input:
        manifest=model_inputs,
        fixtures=expand(f"{RESULTS}/fixtures/{{domain}}.jsonl", domain=DOMAINS),
        placement=f"{RESULTS}/placement/{MODEL}/{{placement}}.json",
        autotune=rules.autotune.output.entry,
    output:
        report=f"{RESULTS}/parity/{MODEL}/{{placement}}.json",
    log:
        f"logs/parity/{MODEL}/{{placement}}.log",
    params:
        parity=config["parity"],
    resources:
        gpu=1,
    script:
        "../scripts/parity.py"


# The gate: fails, naming every placement whose tokens differ; bench and report depend on it.
rule parity_gate:
    input:
        expand(f"{RESULTS}/parity/{MODEL}/{{placement}}.json", placement=PLACEMENTS),
    output:
        gate=f"{RESULTS}/parity/{MODEL}/gate.json",
    log:
        f"logs/parity_gate/{MODEL}.log",
    script:
        "../scripts/parity_gate.py"
