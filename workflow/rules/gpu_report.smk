# On a CUDA machine, the GPU measurements at Qwen3-30B-A3B shape and one page of their tables:
#   snakemake --cores all gpu_report
# (not part of `all`). One job runs python -m coldset bench kernel, step and cache in turn (one
# GPU, never two measurements at once); gpu_report renders their JSON (bench render). Without
# CUDA the first command refuses with its reason, which the job prints to the console.
GPU_RESULTS = f"{RESULTS}/gpu"
GPU_SHAPE_CONFIG = "config/examples/qwen3-30b-a3b-h200.yaml"
GPU_TUNED = "config/examples/h200-tuned"


rule gpu_bench:
    input:
        shape=GPU_SHAPE_CONFIG,
        kernel_configs=f"{GPU_TUNED}/kernel_configs.json",
        step_configs=f"{GPU_TUNED}/decode_step_tuned.json",
    output:
        kernel=f"{GPU_RESULTS}/kernel_bench.json",
        step=f"{GPU_RESULTS}/decode_step.json",
        cache=f"{GPU_RESULTS}/cache_bench.json",
    log:
        "logs/gpu/bench.log",
    conda:
        "../envs/coldset.yaml"
    threads: workflow.cores  # timings need the machine undisturbed
    resources:
        gpu=1,
    params:
        out=lambda w, output: os.path.dirname(output.kernel),
    shell:
        "(python -m coldset bench kernel --out {params.out} --configs {input.kernel_configs}"
        " && python -m coldset bench step --config {input.shape} --out {params.out}"
        " --tuned {input.step_configs} --engines eager,fused"
        " && python -m coldset bench cache --config {input.shape} --out {params.out}) > {log} 2>&1"
        " || {{ grep '^coldset bench' {log} >&2; exit 1; }}"


rule gpu_report:
    input:
        rules.gpu_bench.output.kernel,
        rules.gpu_bench.output.step,
        rules.gpu_bench.output.cache,
    output:
        f"{RESULTS}/report/gpu.md",
    log:
        "logs/gpu/report.log",
    conda:
        "../envs/coldset.yaml"
    shell:
        "python -m coldset bench render {input} --out {output} 2> {log}"
