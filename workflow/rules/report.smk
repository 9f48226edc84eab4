rule report:
    input:
        unpack(report_inputs),
    output:
        html=update(report(f"{RESULTS}/report/index.html", caption="../../report/report.rst", category="Report")),
        residency=update(
            report(
                expand(f"{RESULTS}/report/figures/residency-b{{bs}}.png", bs=BENCH_BATCHES),
                caption="../../report/residency.rst",
                category="Benchmark",
            )
        ),
        step_time=update(
            report(
                expand(f"{RESULTS}/report/figures/step-time-b{{bs}}.png", bs=BENCH_BATCHES),
                caption="../../report/step_time.rst",
                category="Benchmark",
            )
        ),
    log:
        f"logs/report/{MODEL}.log",
    conda:
        "../envs/coldset.yaml"
    script:
        "../scripts/report.py"
