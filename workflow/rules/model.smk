rule model:
    output:
        manifest=f"{RESULTS}/model/{MODEL}/manifest.json",
    log:
        f"logs/model/{MODEL}.log",
    params:
        model=config["model"],
    script:
        "../scripts/model.py"
