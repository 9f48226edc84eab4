"""Per-launch times (PYTHONPATH=src python docs/measurements/mxfp4/f16x2/diag.py) of the MXFP4 experts kernel at
one token on 128-expert pools (4 random experts a layer, 4 layers a graph): the Triton GEMV tile (the defaults)
against the fp16-pair Gluon tile (w8a16 4), cumulative over the call's launches (the input pairs go with w13,
the intermediate's pairs with w2), beside a read of the 4 experts' bytes."""
import torch
from coldset.core.timing import graph_time_us
from coldset.kernels.bandwidth import best_read_bandwidth
from coldset.kernels.tiers import ExpertPools
from coldset.kernels.activation import swiglu_clamped
from coldset.kernels import triton_mxfp4 as tm
from coldset.kernels.triton_moe import KernelConfig

torch.manual_seed(0)
H = I = 2880
L, E = 4, 128
dev = "cuda"
b13 = torch.randint(0, 256, (L, E, 2 * I, H // 2), dtype=torch.uint8, device=dev)
b2 = torch.randint(0, 256, (L, E, H, I // 2), dtype=torch.uint8, device=dev)
s13 = torch.randint(118, 131, (L, E, 2 * I, H // 32), dtype=torch.uint8, device=dev)
s2 = torch.randint(118, 131, (L, E, H, I // 32), dtype=torch.uint8, device=dev)
pools = ExpertPools.all_hot(b13, b2, s13, s2, w13_bias=torch.randn(L, E, 2 * I, device=dev).bfloat16() * 0.1,
                            w2_bias=torch.randn(L, E, H, device=dev).bfloat16() * 0.1,
                            activation=swiglu_clamped(limit=7.0))


def cfg(n1, k1, n2, k2, ns, pdl, w8, warps=4):
    return KernelConfig.from_dict(dict(block_m=1, block_n1=n1, block_k1=k1, block_n2=n2, block_k2=k2, num_warps=warps,
                                       num_stages=ns, slot_max_pairs=32, w8a16=w8, pdl=pdl))


CFGS = {"triton 16/512 ns2 pdl2 (default 1-2)": cfg(16, 512, 32, 512, 2, 2, 2),
        "triton 16/512 ns1 pdl0 (default 3-64)": cfg(16, 512, 32, 512, 1, 0, 2),
        "gluon 8/1024 8/1024 ns1 pdl2 w2": cfg(8, 1024, 8, 1024, 1, 2, 4, 2),
        "gluon 8/1024 8/1024 ns1 pdl0 w2": cfg(8, 1024, 8, 1024, 1, 0, 4, 2),
        "gluon 8/1024 16/1024 ns1 pdl2": cfg(8, 1024, 16, 1024, 1, 2, 4),
        "gluon 8/1024 16/1024 ns2 pdl2": cfg(8, 1024, 16, 1024, 2, 2, 4),
        "gluon 4/1024 8/1024 ns1 pdl2 w2": cfg(4, 1024, 8, 1024, 1, 2, 4, 2)}
x = torch.randn(1, H, device=dev).bfloat16()
ids = [torch.randperm(E, device=dev)[:4][None] for _ in range(L)]
w = torch.softmax(torch.randn(1, 4, device=dev), -1)
sel = ids[0][0].tolist()
w13b = torch.cat([pools.w13_hot[0, e].reshape(-1) for e in sel]).view(torch.bfloat16)
w2b = torch.cat([pools.w2_hot[0, e].reshape(-1) for e in sel]).view(torch.bfloat16)
both = torch.cat([w13b, w2b])
r13 = w13b.numel() * 2 / best_read_bandwidth(w13b, rounds=2) * 1e6 * 1.0625  # + scales (1/16 of the codes)
r2 = w2b.numel() * 2 / best_read_bandwidth(w2b, rounds=2) * 1e6 * 1.0625
rb = both.numel() * 2 / best_read_bandwidth(both, rounds=2) * 1e6 * 1.0625
print(f"reads of layer 0's 4 experts (codes + scales): w13 {r13:.2f} us, w2 {r2:.2f} us, both in one launch {rb:.2f}")
ref = [tm.triton_mxfp4_experts(pools, l, x, ids[l], w, cfg(16, 512, 32, 512, 1, 0, 2)).float() for l in range(L)]
for name, c in CFGS.items():
    outs = [tm.triton_mxfp4_experts(pools, l, x, ids[l], w, c) for l in range(L)]
    torch.cuda.synchronize()
    err = max(((o.float() - r).abs().max() / r.abs().max()).item() for o, r in zip(outs, ref))

    def upto(n):
        def f():
            for l in range(L):
                g = tm.mxfp4_experts_launches(pools, l, x, ids[l], w, c)
                for _ in range(n):
                    next(g)
        return f
    t = [min(graph_time_us(upto(n), 20) for _ in range(2)) / L for n in (1, 2, 3)]
    print(f"{name:<38} w13 {t[0]:6.2f}  +w2 {t[1] - t[0]:6.2f}  +sum {t[2] - t[1]:5.2f}  call {t[2]:6.2f} us = "
          f"{100 * rb / t[2]:5.1f}% of one read; max diff to the Triton tile {err:.1e} of its largest")
