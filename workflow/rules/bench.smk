rule bench:
    input:
        manifest=model_inputs,
        placement=f"{RESULTS}/placement/{MODEL}/{{placement}}.json",
        autotune=rules.autotune.output.entry,
        gate=rules.parity_gate.output.gate,
    output:
        bench=f"{RESULTS}/bench/{MODEL}/{{placement}}.json",
    log:
        f"logs/bench/{MODEL}/{{placement}}.log",
    params:
        bench=config["bench"],
    resources:
        gpu=1,
    script:
        "../scripts/bench.py"
