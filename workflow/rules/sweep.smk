# models: one report comparing every model (coldset.workflow.sweep.render_comparison); each model's own
# stages are the per-model rules with the model as a wildcard.
rule report_models:
    input:
        track=expand(f"{RESULTS}/track/{{model}}.done", model=MODELS),
        coverage=expand(f"{RESULTS}/placement/{{model}}/coverage.csv", model=MODELS),
    output:
        html=update(report(str(comparison_path(config)), caption="../../report/report.rst", category="Report")),
    log:
        "logs/report_models/models.log",
    conda:
        "../envs/coldset.yaml"
    script:
        "../scripts/report_models.py"
