"""coldset: serve a mixture-of-experts model whose routed experts do not all fit in GPU memory.

Packages by layer, each importing only from the ones before it: ``core`` (file formats: shapes,
the trace, the placement file and row map, FP8, atomic files), ``kernels`` (the fused MoE
computation, expert pools, autotune), ``engine`` (the embedded model, the slot cache, the
synthetic checkpoint), ``trace`` (fixtures, capture, importers), ``analysis`` (statistics,
forecasts, cache simulation), ``verify`` (the parity gate), ``bench``, ``reporting`` (results,
MLflow, the HTML report), ``serve`` (the vLLM plugin), ``workflow`` (config, stages, sweeps) and
``measure`` (GPU measurement commands). The package imports without snakemake, mlflow or triton.
"""

__version__ = "0.1.0"
