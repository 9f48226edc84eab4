rule model:
    output:
        manifest=f"{RESULTS}/model/{MODEL}/manifest.json",
    log:
        f"logs/model/{MODEL}.log",
    params:
        model=config["model"],
        fixtures=config["fixtures"],  # the synthetic model learns its domains from the fixtures' text
    conda:
        "../envs/coldset.yaml"
    script:
        "../scripts/model.py"
