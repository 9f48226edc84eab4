rule routing:
    input:
        unpack(routing_inputs),
    output:
        trace=f"{RESULTS}/routing/{MODEL}/trace.parquet",
    log:
        f"logs/routing/{MODEL}.log",
    params:
        routing=config["routing"],
    threads: workflow.cores  # the engine uses every core; timings need them undisturbed
    resources:
        gpu=1,
    conda:
        "../envs/coldset.yaml"
    script:
        "../scripts/routing.py"
