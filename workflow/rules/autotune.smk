# The tune itself is cached outside results/ by a content key (docs/design.md §5): a rerun after a
# script change or on a fresh clone is a cache hit in seconds, never a new tune.
rule autotune:
    input:
        manifest=model_inputs,
    output:
        entry=update(
            report(f"{RESULTS}/autotune/{MODEL}.json", caption="../../report/autotune.rst", category="Autotune")
        ),
    log:
        f"logs/autotune/{MODEL}.log",
    conda:
        "../envs/coldset.yaml"
    resources:
        gpu=1,
    params:
        autotune=config["autotune"],
    script:
        "../scripts/autotune.py"
