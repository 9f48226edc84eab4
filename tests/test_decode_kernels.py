"""The decode step's Triton kernels (coldset.kernels.triton_decode) against torch references in
float32, their determinism, and the fused decode step against the eager engine.

GPU only: skipped by the gpu marker where no CUDA device or triton is present (tests/conftest.py).
``DEVICE`` is read from the environment so that the kernels' tests can also be run through
Triton's interpreter on the CPU (``TRITON_INTERPRET=1 COLDSET_TEST_DEVICE=cpu``, by hand).
"""

import math
import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

DEVICE = os.environ.get("COLDSET_TEST_DEVICE", "cuda")
DT = getattr(torch, os.environ.get("COLDSET_TEST_DTYPE", "bfloat16"))
# Programmatic dependent launch: on CUDA both ways (a lone launch waits on nothing, so the values
# are the same; the engine test below runs it between kernels, in and out of a CUDA graph).
PDLS = [False, True] if DEVICE == "cuda" else [False]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def ref_norm(x, w, eps):
    """The engine's RMSNorm (float32 normalisation, cast, scale) in float32 throughout."""
    return w.float() * F.rms_norm(x.float(), (x.shape[-1],), eps=eps)


@pytest.mark.parametrize("pdl", PDLS)
@pytest.mark.parametrize("m,n,k", [(1, 640, 512), (1, 96, 4096), (3, 200, 384), (8, 512, 1024), (20, 96, 256)])
def test_norm_linear_against_torch(m, n, k, pdl):
    from coldset.kernels.triton_decode import norm_linear

    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(DEVICE, DT)
    add = torch.randn(m, k, generator=g).to(DEVICE, DT)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(DEVICE, DT)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, DT)
    res = torch.randn(m, n, generator=g).to(DEVICE, DT)

    plain = norm_linear(x, w, pdl=pdl)
    assert rel(plain, x.float() @ w.float().T) < 1e-2

    summed, out = norm_linear(x, w, norm_weight=nw, eps=1e-6, add=add, pdl=pdl)
    if DEVICE == "cuda":  # (Triton's interpreter truncates to bf16 where CUDA rounds to nearest)
        assert torch.equal(summed, x + add)  # the residual stream: one bf16 add, exactly torch's
    assert rel(summed, x.float() + add.float()) < 1e-2
    assert rel(out, ref_norm(x.float() + add.float(), nw, 1e-6) @ w.float().T) < 1e-2

    with_res = norm_linear(x, w, residual=res, pdl=pdl)
    assert rel(with_res, res.float() + x.float() @ w.float().T) < 1e-2

    again = norm_linear(x, w, norm_weight=nw, eps=1e-6, add=add, pdl=pdl)
    assert torch.equal(again[1], out)  # a fixed reduction order: the same bits every run


def test_norm_linear_refuses_a_transposed_weight():
    from coldset.kernels.triton_decode import norm_linear

    w = torch.randn(64, 32, device=DEVICE, dtype=DT).T  # [32, 64] view, column-major
    with pytest.raises(ValueError, match="row-major"):
        norm_linear(torch.randn(1, 64, device=DEVICE, dtype=DT), w)


@pytest.mark.parametrize("pdl", PDLS)
def test_rms_norm_against_torch(pdl):
    from coldset.kernels.triton_decode import rms_norm

    x = torch.randn(5, 2048, device=DEVICE, dtype=DT) * 3
    add = torch.randn(5, 2048, device=DEVICE, dtype=DT)
    w = (1 + 0.1 * torch.randn(2048)).to(DEVICE, DT)
    got = rms_norm(x, w, 1e-6, pdl=pdl)
    want = w * F.rms_norm(x, (2048,), eps=1e-6)  # the engine's RMSNorm.forward
    assert rel(got, want) < 1e-2
    # Each element is either the engine's or one bf16 step from it (float32 sums in other orders).
    assert ((got.float() - want.float()).abs() <= 2 ** -7 * want.float().abs() + 1e-6).all()
    summed, normed = rms_norm(x, w, 1e-6, add=add, pdl=pdl)
    assert rel(summed, x.float() + add.float()) < 1e-2
    if DEVICE == "cuda":
        assert torch.equal(summed, x + add)
    assert rel(normed, ref_norm(x.float() + add.float(), w, 1e-6)) < 1e-2


@pytest.mark.parametrize("pdl", PDLS)
@pytest.mark.parametrize("n,k,config", [
    (640, 2048, None),                 # the default config of a qkv-like shape
    (96, 4096, None),                  # o_proj-like K
    (203, 300, (4, 3, 4)),             # K not a power of two, N not a multiple of a block, a row loop
    (37, 256, (2, 4, 2)),              # the loop's last blocks past N
])
def test_gemv_against_torch(n, k, config, pdl):
    from coldset.kernels.triton_decode import GemvConfig, gemv

    cfg = GemvConfig(*config) if config else None
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(DEVICE, DT)
    add = torch.randn(1, k, generator=g).to(DEVICE, DT)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(DEVICE, DT)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, DT)
    res = torch.randn(1, n, generator=g).to(DEVICE, DT)

    assert rel(gemv(x, w, config=cfg, pdl=pdl), x.float() @ w.float().T) < 1e-2
    summed, out = gemv(x, w, norm_weight=nw, eps=1e-6, add=add, config=cfg, pdl=pdl)
    if DEVICE == "cuda":
        assert torch.equal(summed, x + add)
    assert rel(out, ref_norm(x.float() + add.float(), nw, 1e-6) @ w.float().T) < 1e-2
    assert rel(gemv(x, w, residual=res, config=cfg, pdl=pdl), res.float() + x.float() @ w.float().T) < 1e-2
    again = gemv(x, w, norm_weight=nw, eps=1e-6, add=add, config=cfg, pdl=pdl)
    assert torch.equal(again[1], out) and torch.equal(again[0], summed)


def test_gemv_takes_one_token_only():
    from coldset.kernels.triton_decode import gemv

    with pytest.raises(ValueError, match="one token"):
        gemv(torch.randn(2, 64, device=DEVICE, dtype=DT), torch.randn(8, 64, device=DEVICE, dtype=DT))


@pytest.mark.parametrize("pdl", PDLS)
@pytest.mark.parametrize("m,e,h,k,renorm,block_e", [
    (1, 128, 2048, 8, True, 2),    # Qwen3-30B-A3B's router, one token
    (8, 128, 2048, 8, False, 1),   # batch 8, one router row a program
    (3, 60, 200, 6, True, 4),      # E and H not powers of two, the last program part-empty
])
def test_route_against_torch(m, e, h, k, renorm, block_e, pdl):
    """The fused norm + router + softmax/top-k: the norm and logits against float32 torch, and the
    selection bitwise the one today's router kernel (and torch, on tie-free logits) makes from the
    same logits, ties to the lowest expert id; the counter is left at zero for the next launch."""
    from coldset.kernels import torch_softmax_topk
    from coldset.kernels.triton_decode import route
    from coldset.kernels.triton_route import triton_softmax_topk

    g = torch.Generator().manual_seed(m * 100 + e)
    x = (torch.randn(m, h, generator=g) * 3).to(DEVICE, DT)
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(DEVICE, DT)
    gw = (torch.randn(e, h, generator=g) / math.sqrt(h)).to(DEVICE, DT)
    gw[7] = gw[2]  # expert 7's logits equal expert 2's, exactly (the same arithmetic on the same row)
    gw[9] = gw[2]
    gw[2] += 0.05 * nw.float().sign().to(DT) * (x[0].float().sign().to(DT))  # make them win for token 0
    gw[7], gw[9] = gw[2], gw[2]
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    hh, ids, wts, logits = route(x, nw, 1e-6, gw, k, renorm, counter, block_e=block_e, pdl=pdl, return_logits=True)
    assert counter.item() == 0
    assert rel(hh, ref_norm(x.float(), nw, 1e-6)) < 1e-2
    assert rel(logits, hh.float() @ gw.float().T) < 1e-2
    assert torch.equal(logits[:, 7], logits[:, 2]) and torch.equal(logits[:, 9], logits[:, 2])
    want_ids, want_w = triton_softmax_topk(logits, k, renorm)  # today's router kernel
    assert ids.dtype == torch.int64 and wts.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(wts, want_w, rtol=2e-6, atol=1e-7)
    assert {2, 7, 9} <= set(ids[0].tolist())
    first = ids[0].tolist()
    assert first.index(2) < first.index(7) < first.index(9)  # a tie goes to the lowest expert id
    # torch on tie-free rows (its topk breaks ties its own way): the same experts, in the same order.
    free = [t for t in range(m) if logits[t].unique().numel() == e]
    if free:
        ref_ids, _ = torch_softmax_topk(logits[free], k, renorm)
        assert torch.equal(ids[free], ref_ids)
    # In the model dtype: the same values, cast once; and a second launch repeats every bit.
    hh2, ids2, wts2 = route(x, nw, 1e-6, gw, k, renorm, counter, weights_dtype=DT, block_e=block_e, pdl=pdl)
    assert counter.item() == 0
    assert torch.equal(hh2, hh) and torch.equal(ids2, ids) and wts2.dtype == DT
    if DEVICE == "cuda":  # (Triton's interpreter truncates to bf16 where CUDA rounds to nearest)
        assert torch.equal(wts2, wts.to(DT))
    assert rel(wts2, wts) < 1e-2


def ref_attention(qkv, nw, cos, sin, k_cache, v_cache, slot, mask, nh, nkv, d, eps):
    """float32 torch: qk-norm, RoPE, the KV write (into the given caches), masked GQA softmax attention."""
    bsz = qkv.shape[0]
    q, k, v = qkv.float().split([nh * d, nkv * d, nkv * d], dim=-1)
    q, k, v = q.view(bsz, nh, d), k.view(bsz, nkv, d), v.view(bsz, nkv, d)
    if nw is not None:
        q = ref_norm(q, nw[:nh], eps)
        k = ref_norm(k, nw[nh:], eps)

    def rot(t):
        return torch.cat((-t[..., d // 2:], t[..., : d // 2]), dim=-1)

    c, s = cos.float(), sin.float()  # [B, 1, D]: broadcast over heads
    q, k = q * c + rot(q) * s, k * c + rot(k) * s
    k_cache[:, slot] = k.to(k_cache.dtype)
    v_cache[:, slot] = v.to(v_cache.dtype)
    seq = mask.shape[-1]
    rep = nh // nkv
    keys = k_cache[:, :seq].float().repeat_interleave(rep, dim=2)  # [B, S, nh, D]
    values = v_cache[:, :seq].float().repeat_interleave(rep, dim=2)
    scores = torch.einsum("bhd,bshd->bhs", q, keys) / math.sqrt(d)
    scores = scores.masked_fill(~mask[:, 0, 0][:, None, :], float("-inf"))
    return torch.einsum("bhs,bshd->bhd", scores.softmax(-1), values).reshape(bsz, nh * d)


@pytest.mark.parametrize("pdl", PDLS)
@pytest.mark.parametrize("bsz,nh,nkv,d,qk_norm,max_seq,seq,slot,pad", [
    (1, 32, 4, 128, True, 48, 48, 40, 0),     # Qwen3-30B-A3B heads, the bench's full-length mask
    (3, 8, 2, 64, False, 200, 150, 149, 70),  # mixtral-like (no qk-norm), keys over three blocks, and
                                              # a sequence whose first block of keys is all padding
    (8, 16, 16, 32, True, 70, 33, 32, 3),     # no GQA, generate()'s growing mask
])
def test_decode_attention_against_torch(bsz, nh, nkv, d, qk_norm, max_seq, seq, slot, pad, pdl):
    from coldset.kernels.triton_decode import decode_attention

    g = torch.Generator().manual_seed(bsz * 1000 + d)
    qkv = (torch.randn(bsz, (nh + 2 * nkv) * d, generator=g) * 2).to(DEVICE, DT)
    nw = (1 + 0.2 * torch.randn(nh + nkv, d, generator=g)).to(DEVICE, DT) if qk_norm else None
    pos = torch.randint(0, 4000, (bsz, 1), generator=g).float()
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)  # [B, 1, D]
    cos, sin = emb.cos().to(DEVICE, DT), emb.sin().to(DEVICE, DT)
    kc = torch.randn(bsz, max_seq, nkv, d, generator=g).to(DEVICE, DT)
    vc = torch.randn(bsz, max_seq, nkv, d, generator=g).to(DEVICE, DT)
    slots = torch.tensor([slot], device=DEVICE)
    # Left padding: sequence b sees slots >= pad * b, up to the slot.
    s = torch.arange(seq)
    mask = ((s[None, :] >= pad * torch.arange(bsz)[:, None]) & (s[None, :] <= slot))[:, None, None].to(DEVICE)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = ref_attention(qkv, nw, cos, sin, kc_ref, vc_ref, slot, mask, nh, nkv, d, 1e-6)
    got = decode_attention(qkv, nw, cos, sin, kc, vc, slots, mask, nh, nkv, d, 1e-6, pdl=pdl)
    assert got.shape == (bsz, nh * d) and not got.isnan().any()
    assert rel(got, want) < 1e-2
    others = torch.ones(max_seq, dtype=torch.bool)
    others[slot] = False
    assert torch.equal(kc[:, others], kc_ref[:, others]) and torch.equal(vc[:, others], vc_ref[:, others])
    assert torch.equal(vc[:, slot], qkv[:, (nh + nkv) * d:].view(bsz, nkv, d))  # v is written as projected
    assert rel(kc[:, slot], kc_ref[:, slot]) < 1e-2
    again = decode_attention(qkv, nw, cos, sin, kc, vc, slots, mask, nh, nkv, d, 1e-6, pdl=pdl)
    assert torch.equal(again, got)


@pytest.mark.skipif(DEVICE != "cuda", reason="the engine's fused step runs on CUDA")
@pytest.mark.parametrize("pdl", [False, True])
def test_fused_decode_step_matches_the_eager_engine_and_repeats_bitwise(pdl):
    from coldset.bench import decode as bench
    from coldset.verify import gate
    from coldset.engine.generate import generate
    from coldset.engine.model import fused_layer_before_experts
    from coldset.engine.synthetic import SyntheticSpec, build_synthetic_model
    from synthetic_engines import graphed_greedy_tokens

    spec = SyntheticSpec(layers=4, experts=16, top_k=4, hidden=256, moe_intermediate=128, heads=8, kv_heads=2,
                         head_dim=64, vocab_size=1024, seed=11, in_memory=True)
    eager, tok = build_synthetic_model(spec, "cuda", DT)
    fused, _ = build_synthetic_model(spec, "cuda", DT)
    fused.compile_decode(pdl=pdl)
    chosen = fused._compiled_before_experts
    assert getattr(chosen, "func", chosen) is fused_layer_before_experts  # the default on CUDA in bf16
    for m in (eager, fused):
        m.experts_fn = gate.experts_functions(torch.device("cuda"), None)[0]
    texts = ("def parse_args(items, limit):", "The quiet river", '{"tool": "get_weather", "city": "Oslo"}')
    for prompts in ([tok.encode(texts[0]).ids], [tok.encode(t).ids for t in texts]):  # batch 1 and 3: both paths
        a = generate(eager, prompts, 16, progress=False, return_all_logits=True)
        b = generate(fused, prompts, 16, progress=False, return_all_logits=True)
        c = generate(fused, prompts, 16, progress=False, return_all_logits=True)
        assert a.tokens == b.tokens
        assert rel(b.all_logits, a.all_logits) < 1e-2
        assert torch.equal(b.all_logits, c.all_logits)
    # Captured in one CUDA graph (as the bench runs it), the step decodes what generate() decodes.
    stream = [t for text in texts for t in tok.encode(text).ids]
    prompts_t = bench.bench_prompts(stream, 2, 8)
    want = generate(fused, prompts_t.tolist(), 10, progress=False).tokens
    assert graphed_greedy_tokens(fused, prompts_t, 10) == want
