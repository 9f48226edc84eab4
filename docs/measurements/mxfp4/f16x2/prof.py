"""What ncu profiles (docs/measurements/mxfp4/f16x2/README.md gives the command): the experts kernel at one token
on 128-expert pools, 4 layers, the Triton GEMV default and the fp16-pair Gluon tile (w8a16 4), 3 rounds each."""
import torch
from coldset.kernels.tiers import ExpertPools
from coldset.kernels.activation import swiglu_clamped
from coldset.kernels import triton_mxfp4 as tm
from coldset.kernels.triton_moe import KernelConfig

torch.manual_seed(0)
H = I = 2880
L, E = 4, 128
dev = "cuda"
pools = ExpertPools.all_hot(torch.randint(0, 256, (L, E, 2 * I, H // 2), dtype=torch.uint8, device=dev),
                            torch.randint(0, 256, (L, E, H, I // 2), dtype=torch.uint8, device=dev),
                            torch.randint(118, 131, (L, E, 2 * I, H // 32), dtype=torch.uint8, device=dev),
                            torch.randint(118, 131, (L, E, H, I // 32), dtype=torch.uint8, device=dev),
                            w13_bias=torch.zeros(L, E, 2 * I, device=dev).bfloat16(),
                            w2_bias=torch.zeros(L, E, H, device=dev).bfloat16(), activation=swiglu_clamped(limit=7.0))
x = torch.randn(1, H, device=dev).bfloat16()
ids = [torch.randperm(E, device=dev)[:4][None] for _ in range(L)]
w = torch.full((1, 4), 0.25, device=dev)
gluon = KernelConfig.from_dict(dict(block_m=1, block_n1=8, block_k1=1024, block_n2=16, block_k2=1024, num_warps=4,
                                    num_stages=1, slot_max_pairs=32, w8a16=4, pdl=2))
for c in (tm.default_config(1), gluon):
    for _ in range(3):
        for l in range(L):
            tm.triton_mxfp4_experts(pools, l, x, ids[l], w, c)
torch.cuda.synchronize()
