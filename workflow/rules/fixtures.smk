rule fixtures:
    input:
        fixture_sources,
    output:
        update(expand(f"{RESULTS}/fixtures/{{domain}}.jsonl", domain=DOMAINS)),
    log:
        "logs/fixtures/fixtures.log",
    conda:
        "../envs/coldset.yaml"
    params:
        fixtures=config["fixtures"],
    script:
        "../scripts/fixtures.py"
