rule model:
    input:
        model_sources,
    output:
        manifest=update(f"{RESULTS}/model/{MODEL}/manifest.json"),
    log:
        f"logs/model/{MODEL}.log",
    conda:
        "../envs/coldset.yaml"
    params:
        model=config["model"],
        fixtures=config["fixtures"],  # the synthetic model learns its domains from the fixtures' text
    script:
        "../scripts/model.py"
