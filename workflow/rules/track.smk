onstart:
    # Create the MLflow store and experiment once, before jobs could race to migrate it (NOTES.md).
    if config["tracking"]["uri"] is None:
        from coldset.track import ensure_store

        ensure_store(LAYOUT.tracking_uri(config), config["tracking"]["experiment"])


def track_inputs(wildcards):
    """Bench, parity and autotune results when the model is decoded; placements and stats always."""
    inputs = {
        "placement": expand(f"{RESULTS}/placement/{MODEL}/{{placement}}.json", placement=PLACEMENTS),
        "skew": rules.stats.output.skew,
    }
    if DECODES:
        inputs["bench"] = expand(f"{RESULTS}/bench/{MODEL}/{{placement}}.json", placement=PLACEMENTS)
        inputs["parity"] = expand(f"{RESULTS}/parity/{MODEL}/{{placement}}.json", placement=PLACEMENTS)
        inputs["autotune"] = rules.autotune.output.entry
    return inputs


rule track:
    input:
        unpack(track_inputs),
    output:
        done=f"{RESULTS}/track/{MODEL}.done",
    log:
        f"logs/track/{MODEL}.log",
    params:
        tracking=config["tracking"],
    script:
        "../scripts/track.py"
