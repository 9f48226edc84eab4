# One job benchmarks every placement (the model is loaded once); tok_s_per_gib and fetch_tax
# compare placements, so they are computed here over all of them.
rule bench:
    input:
        manifest=model_inputs,
        fixtures=expand(f"{RESULTS}/fixtures/{{domain}}.jsonl", domain=DOMAINS),
        placements=rules.placement.output.placements,
        rowmaps=rules.placement.output.rowmaps,
        forecasters=rules.placement.output.forecasters,
        autotune=rules.autotune.output.entry,
        gate=rules.parity_gate.output.gate,
    output:
        results=update(
            report(
                expand(f"{RESULTS}/bench/{MODEL}/{{placement}}.json", placement=PLACEMENTS, allow_missing=True),
                caption="../../report/bench.rst",
                category="Benchmark",
            ),
        ),
    log:
        f"logs/bench/{MODEL}.log",
    conda:
        "../envs/coldset.yaml"
    threads: workflow.cores  # the engine uses every core; timings need them undisturbed
    resources:
        gpu=1,
    params:
        bench=config["bench"],
    script:
        "../scripts/bench.py"
