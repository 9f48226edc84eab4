"""coldset: usage-aware MoE expert offload as one declarative experiment workflow.

A module per concept: ``model`` (the embedded engine), ``synthetic`` (the default checkpoint),
``fixtures``, ``routing`` (the trace contract and importers), ``stats``, ``placement``, ``tiers``
(hot and cold expert pools, the row map), ``kernels`` (the fused MoE computation), ``tune``,
``gate``, ``bench``, ``track`` and ``report``. The package imports without snakemake, mlflow or
triton; GPU code is imported lazily.
"""

__version__ = "0.1.0"
