"""Per-launch (PYTHONPATH=src python docs/measurements/mxfp4/gluon/diag.py at the commit that added w8a16 4): times of the MXFP4 kernel at 1 token (Triton GEMV vs the Gluon GEMV tile, w8a16 4) on
128-expert pools (random experts) and on 4-expert pools (all selected), beside the standalone probe kernel and reads."""
import torch
from coldset.core.timing import graph_time_us
from coldset.kernels.bandwidth import best_read_bandwidth
from coldset.kernels.tiers import ExpertPools
from coldset.kernels.activation import swiglu_clamped
from coldset.kernels import triton_mxfp4 as tm, gluon_mxfp4 as gm
from coldset.kernels.triton_moe import KernelConfig

torch.manual_seed(0)
H = I = 2880
L = 4
dev = "cuda"
def pools_of(E):
    b13 = torch.randint(0, 256, (L, E, 2 * I, H // 2), dtype=torch.uint8, device=dev)
    b2 = torch.randint(0, 256, (L, E, H, I // 2), dtype=torch.uint8, device=dev)
    s13 = torch.randint(118, 131, (L, E, 2 * I, H // 32), dtype=torch.uint8, device=dev)
    s2 = torch.randint(118, 131, (L, E, H, I // 32), dtype=torch.uint8, device=dev)
    z13 = torch.zeros(L, E, 2 * I, device=dev).bfloat16(); z2 = torch.zeros(L, E, H, device=dev).bfloat16()
    return ExpertPools.all_hot(b13, b2, s13, s2, w13_bias=z13, w2_bias=z2, activation=swiglu_clamped(limit=7.0))
def cfg(n1, k1, n2, k2, ns, pdl, w8):
    return KernelConfig.from_dict(dict(block_m=1, block_n1=n1, block_k1=k1, block_n2=n2, block_k2=k2, num_warps=4,
                                       num_stages=ns, slot_max_pairs=32, w8a16=w8, pdl=pdl))
CFGS = {"triton ns2 pdl2": cfg(16, 512, 32, 512, 2, 2, 2), "triton ns1": cfg(16, 512, 32, 512, 1, 0, 2),
        "gluon 8/1024 ns1 pdl2": cfg(8, 1024, 16, 1024, 1, 2, 4), "gluon 8/1024 ns2 pdl2": cfg(8, 1024, 16, 1024, 2, 2, 4),
        "gluon 8/1024 ns2 pdl0": cfg(8, 1024, 16, 1024, 2, 0, 4), "gluon 4/1024 ns2 pdl0": cfg(4, 1024, 8, 1024, 2, 0, 4)}
x = torch.randn(1, H, device=dev).bfloat16()
for E in (4, 128):
    pools = pools_of(E)
    ids = [torch.randperm(E, device=dev)[:4][None] for _ in range(L)]
    w = torch.full((1, 4), 0.25, device=dev)
    sel = ids[0][0].tolist()
    w13b = torch.cat([pools.w13_hot[e].reshape(-1) for e in sel]).view(torch.bfloat16)  # layer 0's selected rows
    w2b = torch.cat([pools.w2_hot[e].reshape(-1) for e in sel]).view(torch.bfloat16)
    r13 = w13b.numel() * 2 / best_read_bandwidth(w13b, rounds=2) * 1e6 * 1.0625  # + scales (1/16 of the codes)
    r2 = w2b.numel() * 2 / best_read_bandwidth(w2b, rounds=2) * 1e6 * 1.0625
    print(f"E={E}: reads of 4 experts' bytes (codes + scales): w13 {r13:.2f} us, w2 {r2:.2f} us, sum {r13 + r2:.2f}")
    ref = None
    for name, c in CFGS.items():
        outs = [tm.triton_mxfp4_experts(pools, l, x, ids[l], w, c) for l in range(L)]
        torch.cuda.synchronize()
        if ref is None:
            ref = outs
        err = max(((o.float() - r.float()).abs().max() / r.float().abs().max()).item() for o, r in zip(outs, ref))
        def upto(n):
            def f():
                for l in range(L):
                    g = tm.mxfp4_experts_launches(pools, l, x, ids[l], w, c)
                    for _ in range(n):
                        next(g)
            return f
        t = [graph_time_us(upto(n), 20) / L for n in (1, 2, 3)]
        print(f"  {name:<24} w13 {t[0]:6.2f}  +w2 {t[1] - t[0]:6.2f}  +sum {t[2] - t[1]:5.2f}  call {t[2]:6.2f} us"
              f" = {100 * (r13 + r2) / t[2]:5.1f}% of read; w13 {100 * r13 / t[0]:5.1f}%; rel diff to first {err:.1e}")
for fn in (gm._w13_gemv_kernel, gm._w2_gemv_kernel, tm._w13_mx_kernel, tm._w2_mx_kernel):
    try:
        for k in fn.device_caches[0][0].values():
            print(fn.__name__ if hasattr(fn, "__name__") else fn, "regs", k.n_regs, "spills", k.n_spills)
    except Exception as ex:
        print("regs: n/a", repr(ex)[:120])
