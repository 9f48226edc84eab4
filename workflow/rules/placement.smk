rule placement:
    input:
        manifest=model_inputs,
        histogram=rules.stats.output.histogram,
    output:
        placements=update(
            expand(f"{RESULTS}/placement/{MODEL}/{{placement}}.json", placement=PLACEMENTS, allow_missing=True)
        ),
        # the row maps are what parity and bench read: outputs here, inputs there, so an edited or
        # deleted one reruns what depends on it instead of leaving a verdict about other files
        rowmaps=update(
            expand(f"{RESULTS}/placement/{MODEL}/{{placement}}.rowmap.npy", placement=PLACEMENTS, allow_missing=True)
        ),
        forecasters=update(
            expand(
                f"{RESULTS}/placement/{MODEL}/{{placement}}.forecaster.npy", placement=FORECASTED, allow_missing=True
            )
        ),
        coverage=update(
            report(
                f"{RESULTS}/placement/{MODEL}/coverage.csv", caption="../../report/coverage.rst", category="Placement"
            )
        ),
    log:
        f"logs/placement/{MODEL}.log",
    conda:
        "../envs/coldset.yaml"
    params:
        placement=config["placement"],
    script:
        "../scripts/placement.py"
