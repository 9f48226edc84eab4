rule stats:
    input:
        trace=rules.routing.output.trace,
    output:
        histogram=update(f"{RESULTS}/stats/{MODEL}/histogram.csv"),
        skew=update(f"{RESULTS}/stats/{MODEL}/skew.json"),
        coverage=update(f"{RESULTS}/stats/{MODEL}/coverage.csv"),
        locality=update(f"{RESULTS}/stats/{MODEL}/locality.json"),
        heatmap=update(
            report(
                f"{RESULTS}/stats/{MODEL}/heatmap_decode.png", caption="../../report/heatmap.rst", category="Routing"
            )
        ),
        lorenz=update(
            report(f"{RESULTS}/stats/{MODEL}/lorenz_decode.png", caption="../../report/lorenz.rst", category="Routing")
        ),
    log:
        f"logs/stats/{MODEL}.log",
    conda:
        "../envs/coldset.yaml"
    params:
        stats=config["stats"],
    script:
        "../scripts/stats.py"
