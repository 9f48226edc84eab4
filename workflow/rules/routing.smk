rule routing:
    input:
        manifest=model_inputs,
        fixtures=expand(f"{RESULTS}/fixtures/{{domain}}.jsonl", domain=DOMAINS),
    output:
        trace=f"{RESULTS}/routing/{MODEL}/trace.parquet",
    log:
        f"logs/routing/{MODEL}.log",
    params:
        routing=config["routing"],
    resources:
        gpu=1,
    script:
        "../scripts/routing.py"
