"""Probe (not a tool of the package): how many variants of the router launch a lookahead cache
compiles over its layers and steps, without a GPU.

    PYTHONPATH=<triton 3.6>:src python probes/route_variants_cpu.py [--layers 20]

Triton compiles one kernel per specialization key (the constexprs, the argument types, an int's
``== 1`` and multiple-of-16 flags, a pointer's 16-byte alignment). This probe replaces the router
launch's ``run`` by the key computation alone (Triton's own binder with the sm90 backend), drives
the plain router and a ``lookahead`` :class:`coldset.engine.cache.pool.SlotCache` through ``--layers`` layers
for three steps on the CPU (nothing is launched: the decisions are not made, only the arguments
are bound), and prints the distinct keys and the arguments in which they differ. With
``PER_LAYER_ARGS`` and ``PER_LAYER_VIEWS`` it should print three: the plain launch, lookahead's
with a forecast and without (the last layers).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from test_slots import _random_pools, _warm  # noqa: E402

from coldset.kernels import triton_decode as td  # noqa: E402
from coldset.kernels import triton_slots as ts  # noqa: E402
from coldset.engine.cache.pool import SlotCache  # noqa: E402
from coldset.kernels.tiers import host_tier  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=20)
    L = p.parse_args(argv).layers
    kernel = td._route_kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    keys = []

    def bind_only(*args, grid, warmup, **kw):
        keys.append(tuple(binder(*args, **kw)[1]))

    kernel.run = bind_only
    ts.fill = lambda *a, **k: None  # nothing launched: only the router's arguments are bound
    # lookahead's list launch (ahead_list, after the router's): its keys bound alike, counted apart
    lister = ts._ahead_list_kernel
    list_binder = create_function_from_signature(lister.signature, lister.params,
                                                 make_backend(GPUTarget("cuda", 90, 32)))
    list_keys = []
    lister.run = lambda *args, grid, warmup, **kw: list_keys.append(tuple(list_binder(*args, **kw)[1]))
    E, k, T, H = 8, 2, 3, 24
    g = torch.Generator().manual_seed(0)
    gates = [torch.randn(E, H, generator=g) for _ in range(L)]
    counts = np.random.default_rng(0).integers(0, 9, size=(L, E)).astype(np.float64)
    row_map, _, wc = _warm(counts, 2 * E)
    pools = _random_pools(L, E, seed=0, dtype=torch.float32)
    pools = type(pools).all_hot(pools.w13_hot.view(L, E, 8, 4), pools.w2_hot.view(L, E, 4, 4))
    cache = SlotCache.build(pools, host_tier(pools), row_map, wc, "lookahead", T, k, routers=gates, depth=1)
    cache.use_kernel, cache.fill_ticket = True, torch.zeros(1, dtype=torch.int32)
    counter, norm_w = torch.zeros(1, dtype=torch.int32), torch.ones(H)
    for _ in range(3):
        for layer in range(L):
            x = torch.randn((T, H), generator=g)
            td.route(x, norm_w, 1e-6, gates[layer], k, True, counter)
            cache.route(layer, x, norm_w, 1e-6, gates[layer], k, True, counter, pdl=cache.pdl)
    distinct = list(dict.fromkeys(keys))
    print(f"{len(keys)} launches over {L} layers x 3 steps: {len(distinct)} compiled variants")
    names = [q.name for q in kernel.params]
    for key in distinct[1:]:
        print("  differs from the first in:", [(names[i], v) for i, v in enumerate(key) if v != distinct[0][i]][:6])
    print(f"{len(list_keys)} list launches (ahead_list): {len(set(list_keys))} compiled variants")
    return 0


if __name__ == "__main__":
    sys.exit(main())
