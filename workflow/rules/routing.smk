rule routing:
    input:
        unpack(routing_inputs),
    output:
        trace=update(f"{RESULTS}/routing/{MODEL}/trace.parquet"),
    log:
        f"logs/routing/{MODEL}.log",
    conda:
        "../envs/coldset.yaml"
    threads: workflow.cores  # the engine uses every core; timings need them undisturbed
    resources:
        gpu=1,
    params:
        routing=config["routing"],
    script:
        "../scripts/routing.py"
