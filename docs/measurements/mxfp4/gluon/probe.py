"""Probe (the commit that added w8a16 4; PYTHONPATH=src python docs/measurements/mxfp4/gluon/probe.py): Gluon MXFP4 GEMV (explicit register layout, no layout conversion in the k loop) at gpt-oss-120b's
shape, one token, 4 experts' bytes a layer, 8 layers in one graph; against a plain read of the same bytes and the
current Triton kernel (triton_mxfp4_experts, default 1-token config) on the same 4 experts."""
import os, sys, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemv_x3
from coldset.core import mxfp4
from coldset.core.timing import graph_time_us
from coldset.kernels.bandwidth import best_read_bandwidth
from coldset.kernels.tiers import ExpertPools
from coldset.kernels.activation import swiglu_clamped
from coldset.kernels.triton_mxfp4 import triton_mxfp4_experts, default_config

torch.manual_seed(0)
L, E, H, I = 8, 4, 2880, 2880
dev = "cuda"
b13 = torch.randint(0, 256, (L, E, 2 * I, H // 2), dtype=torch.uint8, device=dev)
b2 = torch.randint(0, 256, (L, E, H, I // 2), dtype=torch.uint8, device=dev)
s13 = torch.randint(118, 131, (L, E, 2 * I, H // 32), dtype=torch.uint8, device=dev)
s2 = torch.randint(118, 131, (L, E, H, I // 32), dtype=torch.uint8, device=dev)
x = torch.randn(H, device=dev).bfloat16()
w13w = b13.view(L, E * 2 * I, H // 2).view(torch.int32)  # [L, N13, K/8]
w2w = b2.view(L, E * H, I // 2).view(torch.int32)
sc13 = s13.view(L, E * 2 * I, H // 32)
sc2 = s2.view(L, E * H, I // 32)
N13, N2 = w13w.shape[1], w2w.shape[1]

def ref(blocks, scales, layer):
    w = mxfp4.dequantize(blocks[layer].reshape(-1, H // 32, 16), scales[layer].reshape(-1, H // 32), torch.float32)
    return w.double() @ x.double()

rows = []
ref13 = ref(b13.view(L, -1, H // 2), sc13, 3)
ref2 = ref(b2.view(L, -1, I // 2), sc2, 5)
variants = [("x3", R, W, G, PF) for (R, W, G, PF) in
            [(4, 4, 32, 1), (4, 4, 32, 0), (2, 4, 32, 1), (8, 4, 32, 0), (8, 4, 32, 1), (4, 2, 32, 1), (8, 2, 32, 0),
             (4, 8, 32, 1), (4, 8, 16, 1), (8, 8, 16, 0), (4, 1, 32, 1), (16, 4, 32, 0)]]
ok = {}
for v in variants:
    mod = gemv_x3
    try:
        o13 = mod.mx_gemv(w13w[3], sc13[3], x, *v[1:])
        o2 = mod.mx_gemv(w2w[5], sc2[5], x, *v[1:])
        torch.cuda.synchronize()
        e13 = ((o13.double() - ref13).abs().max() / ref13.abs().max()).item()
        e2 = ((o2.double() - ref2).abs().max() / ref2.abs().max()).item()
        ok[v] = e13 < 1e-5 and e2 < 1e-5
        print("check", v, f"rel err w13 {e13:.2e} w2 {e2:.2e}", "OK" if ok[v] else "WRONG", flush=True)
    except Exception as ex:
        print("check", v, "FAILED", repr(ex)[:300], flush=True)
        ok[v] = False

bytes13 = w13w[0].numel() * 4 + sc13[0].numel()
bytes2 = w2w[0].numel() * 4 + sc2[0].numel()
outs = torch.empty(N13, device=dev)

def read_us(nbytes_buf):
    return nbytes_buf[0].numel() * nbytes_buf.element_size() / best_read_bandwidth(nbytes_buf, launches=L, rounds=2) * 1e6

# reads of the same bytes (codes only, scales are ~6%: added in proportion)
r13 = read_us(w13w.reshape(-1).view(torch.bfloat16).reshape(L, -1)) * bytes13 / (w13w[0].numel() * 4)
r2 = read_us(w2w.reshape(-1).view(torch.bfloat16).reshape(L, -1)) * bytes2 / (w2w[0].numel() * 4)
print(f"read of one layer's bytes: w13 {r13:.2f} us ({bytes13/1e6:.1f} MB), w2 {r2:.2f} us ({bytes2/1e6:.1f} MB)")

res = {}
for rnd in range(2):
    for v in variants:
        if not ok[v]:
            continue
        mod = gemv_x3
        o = torch.empty(N13, device=dev)
        def f13():
            for l in range(L):
                mod.mx_gemv(w13w[l], sc13[l], x, *v[1:])
        def f2():
            for l in range(L):
                mod.mx_gemv(w2w[l], sc2[l], x, *v[1:])
        t13 = graph_time_us(f13, 15) / L
        t2 = graph_time_us(f2, 15) / L
        res.setdefault(v, []).append((t13, t2))

# the current kernel: 4 experts, one token routed to all 4
act = swiglu_clamped(limit=7.0)
bias13 = torch.zeros(L, E, 2 * I, device=dev).bfloat16()
bias2 = torch.zeros(L, E, H, device=dev).bfloat16()
pools = ExpertPools.all_hot(b13, b2, s13, s2, w13_bias=bias13, w2_bias=bias2, activation=act)
xs = x[None].contiguous()
ids = torch.arange(4, device=dev)[None]
wts = torch.full((1, 4), 0.25, device=dev)
cur = []
for rnd in range(2):
    def fc():
        for l in range(L):
            triton_mxfp4_experts(pools, l, xs, ids, wts, default_config(1))
    cur.append(graph_time_us(fc, 15) / L)
print(f"current Triton kernel (default 1-token config {default_config(1)}), whole call w13+w2+sum: "
      f"{min(cur):.2f} us (rounds {['%.2f' % c for c in cur]}) = {100 * (r13 + r2) / min(cur):.1f}% of the read of its bytes")
print(f"{'variant':<28} {'w13 us':>8} {'%read':>6} {'w2 us':>8} {'%read':>6} {'sum us':>8} {'%read':>6}  rounds(w13+w2)")
for v, ts in res.items():
    t13 = min(t[0] for t in ts); t2 = min(t[1] for t in ts)
    print(f"{str(v):<28} {t13:8.2f} {100*r13/t13:6.1f} {t2:8.2f} {100*r2/t2:6.1f} {t13+t2:8.2f} {100*(r13+r2)/(t13+t2):6.1f}  "
          + " ".join('%.2f' % (a + b) for a, b in ts))
