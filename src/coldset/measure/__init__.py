"""GPU measurements at real shape, as commands of the package: ``python -m coldset bench kernel``,
``bench step``, ``bench cache`` (and ``bench render`` for their tables, ``bench replay`` for
cache policies simulated on a saved run).

Each command measures on one CUDA GPU in one process, its ceilings in the same run
(:mod:`coldset.kernels.bandwidth`), times through :mod:`coldset.core.timing`'s graph and event
timers and :class:`coldset.bench.decode.Decoder`, writes one JSON with its provenance
(:mod:`coldset.measure.harness`) and prints the table :mod:`coldset.measure.render` makes of that
JSON, the same table BENCHMARKS.md shows. Each is cut the same way: build (shapes, weights,
placements), measure (the timed part, rows into the result), render (the JSON's table). Nothing
here is imported by the pipeline; torch and triton load when a measurement runs, so ``python -m
coldset`` runs (and these commands refuse cleanly) on a machine without them.

- :mod:`coldset.measure.kernel`: the experts kernel per MoE layer against the read bound (and a
  stored vLLM figure, labelled as such); :mod:`coldset.measure.kernel_fp8` its block-FP8 run;
- :mod:`coldset.measure.step`: the decode step per engine against its bytes floor;
- :mod:`coldset.measure.cache`: the slot cache and lookahead prefetch against static placement
  (:mod:`coldset.measure.cache_analysis` its ``--analysis``, :mod:`coldset.measure.cache_decisions`
  its ``--decisions-only``).
"""
