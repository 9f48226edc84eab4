rule placement:
    input:
        manifest=model_inputs,
        histogram=rules.stats.output.histogram,
    output:
        placements=expand(f"{RESULTS}/placement/{MODEL}/{{placement}}.json", placement=PLACEMENTS),
        coverage=report(f"{RESULTS}/placement/{MODEL}/coverage.csv", caption="../../report/coverage.rst", category="Placement"),
    log:
        f"logs/placement/{MODEL}.log",
    params:
        placement=config["placement"],
    script:
        "../scripts/placement.py"
