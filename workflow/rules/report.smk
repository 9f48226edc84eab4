rule report:
    input:
        track=rules.track.output.done,
        gate=rules.parity_gate.output.gate,
        skew=rules.stats.output.skew,
        coverage=rules.placement.output.coverage,
    output:
        html=f"{RESULTS}/report/index.html",
    log:
        f"logs/report/{MODEL}.log",
    script:
        "../scripts/report.py"
