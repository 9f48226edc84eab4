def report_inputs(wildcards):
    """The parity gate only when the model is decoded (a shape-only model skips it, DECODES)."""
    inputs = {
        "track": rules.track.output.done,
        "skew": rules.stats.output.skew,
        "coverage": rules.placement.output.coverage,
        "cache": rules.cache.output.simulation,
    }
    if DECODES:
        inputs["gate"] = rules.parity_gate.output.gate
    return inputs


# Bench figures exist only when the bench ran.
BENCH_BATCHES = config["bench"]["batch_sizes"] if DECODES else []


rule report:
    input:
        unpack(report_inputs),
    output:
        html=report(f"{RESULTS}/report/index.html", caption="../../report/report.rst", category="Report"),
        residency=report(
            expand(f"{RESULTS}/report/figures/residency-b{{bs}}.png", bs=BENCH_BATCHES),
            caption="../../report/residency.rst",
            category="Benchmark",
        ),
        step_time=report(
            expand(f"{RESULTS}/report/figures/step-time-b{{bs}}.png", bs=BENCH_BATCHES),
            caption="../../report/step_time.rst",
            category="Benchmark",
        ),
    log:
        f"logs/report/{MODEL}.log",
    conda:
        "../envs/coldset.yaml"
    script:
        "../scripts/report.py"
