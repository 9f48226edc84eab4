rule report:
    input:
        track=rules.track.output.done,
        gate=rules.parity_gate.output.gate,
        skew=rules.stats.output.skew,
        coverage=rules.placement.output.coverage,
        cache=rules.cache.output.simulation,
    output:
        html=report(f"{RESULTS}/report/index.html", caption="../../report/report.rst", category="Report"),
        residency=report(
            expand(f"{RESULTS}/report/figures/residency-b{{bs}}.png", bs=config["bench"]["batch_sizes"]),
            caption="../../report/residency.rst",
            category="Benchmark",
        ),
        step_time=report(
            expand(f"{RESULTS}/report/figures/step-time-b{{bs}}.png", bs=config["bench"]["batch_sizes"]),
            caption="../../report/step_time.rst",
            category="Benchmark",
        ),
    log:
        f"logs/report/{MODEL}.log",
    script:
        "../scripts/report.py"
