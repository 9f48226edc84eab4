"""Probe (PYTHONPATH=src python docs/measurements/mxfp4/f16x2/probe.py): the fp16-pair MXFP4 GEMV tile
(f16_gemv.py) at gpt-oss-120b's shape, one token, 4 experts' w13 and w2 rows a layer, 8 layers in one graph;
beside the float32 Gluon tile (../gluon/gemv_x3.py), the same loads without the arithmetic, plain reads of the
same bytes and the experts kernel's whole call on the same 4 experts. Checks first, then times; a table last."""
import json, os, sys, time, torch
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "gluon"))
import f16_gemv, gemv_x3
from coldset.core import mxfp4
from coldset.core.timing import graph_time_us
from coldset.kernels.bandwidth import best_read_bandwidth
from coldset.kernels.tiers import ExpertPools
from coldset.kernels.activation import swiglu_clamped
from coldset.kernels.triton_mxfp4 import triton_mxfp4_experts, default_config

REPS = 15
torch.manual_seed(0)
L, E, H, I = 8, 4, 2880, 2880
dev = "cuda"
b13 = torch.randint(0, 256, (L, E, 2 * I, H // 2), dtype=torch.uint8, device=dev)
b2 = torch.randint(0, 256, (L, E, H, I // 2), dtype=torch.uint8, device=dev)
s13 = torch.randint(118, 131, (L, E, 2 * I, H // 32), dtype=torch.uint8, device=dev)
s2 = torch.randint(118, 131, (L, E, H, I // 32), dtype=torch.uint8, device=dev)
w13w = b13.view(L, E * 2 * I, H // 2).view(torch.int32)
w2w = b2.view(L, E * H, I // 2).view(torch.int32)
sc13 = s13.view(L, E * 2 * I, H // 32)
sc2 = s2.view(L, E * H, I // 32)
N13, N2 = w13w.shape[1], w2w.shape[1]
x = torch.randn(H, device=dev).bfloat16()
x_wide = x.clone()
x_wide[::97] *= 300.0   # a few inputs 300x the rest, as in activations with outliers
x_wide[1::89] *= 1e-3

def deq(blocks, scales, layer, k):
    return mxfp4.dequantize(blocks[layer].reshape(-1, k // 32, 16), scales[layer].reshape(-1, k // 32),
                            torch.float32).double()

W13 = deq(b13.view(L, -1, H // 2), sc13, 3, H)
W2 = deq(b2.view(L, -1, I // 2), sc2, 5, I)

def errs(o, Wd, xv):
    ref = Wd @ xv.double()
    bound = Wd.abs() @ xv.double().abs()
    d = (o.double() - ref).abs()
    return (d.max() / ref.abs().max()).item(), (d / bound).max().item()

F16 = [("f16", R, W, G, PF) for (R, W, G, PF) in
       [(4, 4, 32, 1), (4, 4, 32, 0), (2, 4, 32, 1), (8, 4, 32, 1), (8, 4, 32, 0), (4, 8, 32, 1), (4, 2, 32, 1),
        (2, 8, 32, 1), (4, 4, 16, 1)]]
LOADS = [("loads", 4, 4, 32, 1), ("loads", 4, 4, 32, 0)]
F32 = [("f32", 4, 4, 32, 1), ("f32", 2, 4, 32, 1)]
ok, check = {}, {}
for xv, xname in ((x, "randn"), (x_wide, "outliers")):
    xp, xe = f16_gemv.xprep(xv)
    for v in F16 + F32:
        try:
            if v[0] == "f16":
                o13 = f16_gemv.f16_gemv(w13w[3], sc13[3], xp, xe, *v[1:])
                o2 = f16_gemv.f16_gemv(w2w[5], sc2[5], xp, xe, *v[1:])
            else:
                o13 = gemv_x3.mx_gemv(w13w[3], sc13[3], xv, *v[1:])
                o2 = gemv_x3.mx_gemv(w2w[5], sc2[5], xv, *v[1:])
            torch.cuda.synchronize()
            e = errs(o13, W13, xv) + errs(o2, W2, xv)
            good = max(e[1], e[3]) < 2 ** -9
            ok[v] = ok.get(v, True) and good
            check[f"{v} {xname}"] = e
            print("check", v, xname, "w13 rel %.2e of-bound %.2e | w2 rel %.2e of-bound %.2e" % e,
                  "OK" if good else "WRONG", flush=True)
        except Exception as ex:
            print("check", v, xname, "FAILED", repr(ex)[:400], flush=True)
            ok[v] = False
for v in LOADS:
    ok[v] = True

bytes13 = w13w[0].numel() * 4 + sc13[0].numel()
bytes2 = w2w[0].numel() * 4 + sc2[0].numel()

def read_us(buf):
    return buf[0].numel() * buf.element_size() / best_read_bandwidth(buf, launches=L, rounds=2) * 1e6

r13 = read_us(w13w.reshape(-1).view(torch.bfloat16).reshape(L, -1)) * bytes13 / (w13w[0].numel() * 4)
r2 = read_us(w2w.reshape(-1).view(torch.bfloat16).reshape(L, -1)) * bytes2 / (w2w[0].numel() * 4)
print(f"read of one layer's bytes: w13 {r13:.2f} us ({bytes13/1e6:.1f} MB), w2 {r2:.2f} us ({bytes2/1e6:.1f} MB)", flush=True)

xp, xe = f16_gemv.xprep(x)
o13 = torch.empty(N13, device=dev)
o2 = torch.empty(N2, device=dev)
res = {}
for rnd in range(2):
    for v in F16 + LOADS + F32:
        if not ok[v]:
            continue
        if v[0] == "f32":
            f13 = lambda: [gemv_x3.mx_gemv(w13w[l], sc13[l], x, *v[1:]) for l in range(L)]
            f2 = lambda: [gemv_x3.mx_gemv(w2w[l], sc2[l], x, *v[1:]) for l in range(L)]
        else:
            mode = 0 if v[0] == "f16" else 1
            f13 = lambda: [f16_gemv.f16_gemv(w13w[l], sc13[l], xp, xe, *v[1:], mode=mode, out=o13) for l in range(L)]
            f2 = lambda: [f16_gemv.f16_gemv(w2w[l], sc2[l], xp, xe, *v[1:], mode=mode, out=o2) for l in range(L)]
        res.setdefault(str(v), []).append((graph_time_us(f13, REPS) / L, graph_time_us(f2, REPS) / L))
prep = [graph_time_us(lambda: [f16_gemv.xprep(x, xp, xe) for _ in range(L)], REPS) / L for _ in range(2)]
# the launches an experts call on this tile would make at one token, in order (the inputs' pairs, w13, the
# intermediate's pairs, w2; no activation, routing or sum): against one read of both matrices' bytes
comb = torch.empty(L, (w13w[0].numel() + w2w[0].numel()) // 2, dtype=torch.int32, device=dev)
r_all = read_us(comb.view(torch.bfloat16)) * (bytes13 + bytes2) / (comb[0].numel() * 4)
x2 = torch.randn(I, device=dev).bfloat16()
ap, ae = f16_gemv.xprep(x2)
chain = {}
for v in [("f16", 4, 2, 32, 1), ("f16", 4, 4, 32, 0), ("f16", 2, 4, 32, 1)]:
    def fch():
        for l in range(L):
            f16_gemv.xprep(x, xp, xe)
            f16_gemv.f16_gemv(w13w[l], sc13[l], xp, xe, *v[1:], out=o13)
            f16_gemv.xprep(x2, ap, ae)
            f16_gemv.f16_gemv(w2w[l], sc2[l], ap, ae, *v[1:], out=o2)
    chain[str(v)] = [graph_time_us(fch, REPS) / L for _ in range(2)]

act = swiglu_clamped(limit=7.0)
pools = ExpertPools.all_hot(b13, b2, s13, s2, w13_bias=torch.zeros(L, E, 2 * I, device=dev).bfloat16(),
                            w2_bias=torch.zeros(L, E, H, device=dev).bfloat16(), activation=act)
xs, ids, wts = x[None].contiguous(), torch.arange(4, device=dev)[None], torch.full((1, 4), 0.25, device=dev)
cur = [graph_time_us(lambda: [triton_mxfp4_experts(pools, l, xs, ids, wts, default_config(1)) for l in range(L)], REPS) / L
       for _ in range(2)]

rows = []
for v, ts in res.items():
    t13 = min(t[0] for t in ts); t2 = min(t[1] for t in ts)
    rows.append(dict(variant=v, w13_us=t13, w13_pct=100 * r13 / t13, w2_us=t2, w2_pct=100 * r2 / t2,
                     rounds=[a + b for a, b in ts]))
out = dict(device=torch.cuda.get_device_name(), triton=__import__("triton").__version__, torch=torch.__version__,
           read_w13_us=r13, read_w2_us=r2, bytes_w13=bytes13, bytes_w2=bytes2, xprep_us=min(prep),
           experts_call_us=min(cur), experts_call_rounds=cur, read_both_one_launch_us=r_all, chain_us=chain, checks=check, rows=rows, reps=REPS,
           when=time.strftime("%Y-%m-%d %H:%M:%S"))
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "f16x2_probe.json"), "w"), indent=1)
print(f"\n{out['device']}; reads: w13 {r13:.2f} us, w2 {r2:.2f} us; x prep (one launch) {min(prep):.2f} us; "
      f"experts call (Triton, 1-token default, w13+w2+sum) {min(cur):.2f} us = {100*(r13+r2)/min(cur):.1f}% of w13+w2 reads")
print(f"one read of both matrices' bytes: {r_all:.2f} us; the experts call = {100 * r_all / min(cur):.1f}% of it")
for v, ts in chain.items():
    print(f"chain xprep+w13+xprep+w2 {v}: {min(ts):.2f} us ({' '.join('%.2f' % t for t in ts)}) = "
          f"{100 * r_all / min(ts):.1f}% of that read")
print(f"{'variant':<28} {'w13 us':>8} {'%read':>6} {'w2 us':>8} {'%read':>6}  rounds(w13+w2)")
for r in rows:
    print(f"{r['variant']:<28} {r['w13_us']:8.2f} {r['w13_pct']:6.1f} {r['w2_us']:8.2f} {r['w2_pct']:6.1f}  "
          + " ".join('%.2f' % s for s in r['rounds']))
