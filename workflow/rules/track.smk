onstart:
    # Create the MLflow store and experiment once, before jobs could race to migrate it (NOTES.md).
    if config["tracking"]["uri"] is None:
        from coldset.track import ensure_store

        ensure_store(LAYOUT.tracking_uri(config), config["tracking"]["experiment"])


rule track:
    input:
        bench=expand(f"{RESULTS}/bench/{MODEL}/{{placement}}.json", placement=PLACEMENTS),
        parity=expand(f"{RESULTS}/parity/{MODEL}/{{placement}}.json", placement=PLACEMENTS),
        placement=expand(f"{RESULTS}/placement/{MODEL}/{{placement}}.json", placement=PLACEMENTS),
        skew=rules.stats.output.skew,
        locality=rules.stats.output.locality,
        cache=rules.cache.output.simulation,
        autotune=rules.autotune.output.entry,
    output:
        done=f"{RESULTS}/track/{MODEL}.done",
    log:
        f"logs/track/{MODEL}.log",
    params:
        tracking=config["tracking"],
    script:
        "../scripts/track.py"
