rule cache:
    input:
        manifest=model_inputs,
        trace=rules.routing.output.trace,
        histogram=rules.stats.output.histogram,
        locality=rules.stats.output.locality,
    output:
        simulation=update(
            report(f"{RESULTS}/cache/{MODEL}/simulation.csv", caption="../../report/cache.rst", category="Cache")
        ),
        recommendation=update(
            report(f"{RESULTS}/cache/{MODEL}/recommendation.csv", caption="../../report/cache.rst", category="Cache")
        ),
        figure=update(
            report(f"{RESULTS}/cache/{MODEL}/locality.png", caption="../../report/cache.rst", category="Cache")
        ),
    log:
        f"logs/cache/{MODEL}.log",
    conda:
        "../envs/coldset.yaml"
    params:
        cache=config["cache"],
        placement=config["placement"],
    script:
        "../scripts/cache.py"
