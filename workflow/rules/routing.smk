def routing_inputs(wildcards):
    """An imported trace needs only its file; a capture needs the model and the fixtures."""
    trace = model_cfg(wildcards)["routing"]["trace"]
    if trace:
        return {"trace": trace}  # checked against model.path when set
    return {
        "manifest": model_inputs(wildcards),
        "fixtures": expand(f"{RESULTS}/fixtures/{{domain}}.jsonl", domain=DOMAINS),
    }


rule routing:
    input:
        unpack(routing_inputs),
    output:
        trace=f"{RESULTS}/routing/{MODEL}/trace.parquet",
    log:
        f"logs/routing/{MODEL}.log",
    conda:
        "../envs/coldset.yaml"
    params:
        routing=config["routing"],
    threads: workflow.cores  # the engine uses every core; timings need them undisturbed
    resources:
        gpu=1,
    script:
        "../scripts/routing.py"
