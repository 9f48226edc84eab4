rule fixtures:
    output:
        expand(f"{RESULTS}/fixtures/{{domain}}.jsonl", domain=DOMAINS),
    log:
        "logs/fixtures/fixtures.log",
    params:
        fixtures=config["fixtures"],
    conda:
        "../envs/coldset.yaml"
    script:
        "../scripts/fixtures.py"
