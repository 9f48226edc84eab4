rule stats:
    input:
        trace=rules.routing.output.trace,
    output:
        histogram=f"{RESULTS}/stats/{MODEL}/histogram.csv",
        skew=f"{RESULTS}/stats/{MODEL}/skew.json",
    log:
        f"logs/stats/{MODEL}.log",
    params:
        stats=config["stats"],
    script:
        "../scripts/stats.py"
