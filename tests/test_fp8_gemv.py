"""The one-token GEMV with block-FP8 weights (``coldset.kernels.triton_decode.gemv(...,
weight_scale=...)``, weight-only) and its torch reference
(:func:`coldset.kernels.reference.torch_gemv`), against an independent float64
dequantize-then-matmul written here from the format's definition (not by :mod:`coldset.core.fp8`).

The weights are drawn with block magnitudes spread over two decades, so every 128 x 128 block has
its own scale and a scale read from the wrong block is a large error (the mutants below: a wrong
layout of the per-row table is caught, so the tolerances can fail).

Tolerances (relative Frobenius error of the output):
- float32 activations: the kernel and the torch reference against float64 < 1e-5 (the weights are
  the e4m3 bytes times float32 scales, exact in float32 for the product; what differs is float32
  summation order and the float32 rounding of the norm's input), and against each other < 1e-5;
- bf16 / fp16 activations (the model dtypes): < 1e-2 against float64 (the residual stream, the
  normed input and the output are rounded to the dtype, 2^-9 bf16 half steps, as the bf16 GEMV's
  own test allows), and the kernel against the torch reference (the same roundings) < 1e-2;
- the mutants (scale table shifted by one group, block rows of 64 instead of 128, the table read
  transposed): > 0.1 against float64 (they measure ~1).

Runs: :func:`check_kernel` on the CPU under Triton's interpreter (a child Python with
``TRITON_INTERPRET=1``, where triton is importable: the test extra installs it; float32 and
fp16, the interpreter's casts by torch as in tests/test_fp8_experts.py), and on CUDA (marked gpu:
float32, and bf16 as a programmatic dependent launch; repeated bitwise). The model's FP8 attention
(an FP8 checkpoint's bytes and scales kept, ``attach_fp8_attention``), the fused engine reading it
(gpu) and ``bench step``'s FP8 floor and row field close the file.
"""

from __future__ import annotations

import math

import pytest
import torch

from coldset.core import fp8
from coldset.kernels.reference import torch_gemv
from interpreter_helpers import run_interpreted
from test_fp8_experts import _PRELUDE

# (n, k, config fields or None): K not a multiple of 128 (a partial last group), N not a multiple of
# a program's rows, a row loop (iters) whose last blocks run past N, K below 128 (one partial group)
SHAPES = [(203, 300, None), (37, 256, (4, 3, 2)), (130, 96, None), (64, 1000, (8, 1, 4))]


def block_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A float32 ``[n, k]`` weight whose 128 x 128 blocks have magnitudes 10^U(-1, 1): each block's
    scale differs, so reading another block's scale is a large error."""
    g = torch.Generator().manual_seed(seed)
    gr, gc = math.ceil(n / 128), math.ceil(k / 128)
    mag = 10 ** (2 * torch.rand(gr, gc, generator=g) - 1)
    grid = mag.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return torch.randn(n, k, generator=g) / math.sqrt(k) * grid


def float64_gemv(x, q, grid, *, norm_weight=None, eps=0.0, add=None, residual=None):
    """Independent float64: ``q`` (e4m3) times its block grid ``grid`` ``[ceil(n/128), ceil(k/128)]``
    per 128 x 128 block, the input ``RMSNorm(x + add)`` with the residual stream rounded to x's
    dtype (the value the kernel writes and the next layer reads), ``residual`` added; nothing else
    rounded."""
    n, k = q.shape
    w = q.cpu().double() * grid.cpu().double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    s = (x.cpu().double() + add.cpu().double()).to(x.dtype).double() if add is not None else x.cpu().double()
    a = s
    if norm_weight is not None:
        a = norm_weight.cpu().double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    out = a @ w.T
    if residual is not None:
        out = out + residual.cpu().double()
    return out


def rel(a, b) -> float:
    a, b = a.cpu().double(), b.cpu().double()
    return float((a - b).norm() / b.norm())


def operands(n, k, dtype, device, seed=0):
    """``(q, grid, table, x, add, nw, res)`` of one case."""
    q, grid = fp8.quantize_weight(block_weight(n, k, seed))
    g = torch.Generator().manual_seed(seed + 1)
    x, add = (torch.randn(1, k, generator=g).to(device, dtype) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype)
    res = torch.randn(1, n, generator=g).to(device, dtype)
    return q.to(device), grid, fp8.row_scales(grid, n, k).to(device), x, add, nw, res


def tolerance(dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def mutant_tables(grid: torch.Tensor, n: int, k: int) -> dict:
    """Wrong per-row tables a layout bug would make, those that differ from the right one here
    (at least one does for every shape tested); each must fail the tolerance."""
    right = fp8.row_scales(grid, n, k)
    gr = grid.shape[0]
    bad = {
        "shifted one group": torch.roll(right, 1, dims=1),
        "shifted one block row": fp8.row_scales(torch.roll(grid, 1, dims=0), n, k),
        "block rows of 64": grid[torch.clamp(torch.arange(n) // 64, max=gr - 1)],
    }
    bad = {name: t.contiguous() for name, t in bad.items() if not torch.equal(t, right)}
    assert bad, (n, k)
    return bad


def check_kernel(device: str, runs=((torch.float32, False), (torch.float16, False))) -> None:
    """Every check of the FP8 GEMV on ``device`` (the interpreter's CPU or CUDA) for each
    ``(activation dtype, pdl)`` of ``runs``; raises AssertionError."""
    from coldset.kernels.triton_decode import GemvConfig, gemv, gemv_config

    for n, k, fields in SHAPES:
        cfg = GemvConfig(*fields) if fields else None
        for dtype, pdl in runs:
            tol = tolerance(dtype)
            q, grid, table, x, add, nw, res = operands(n, k, dtype, device, seed=n + k)
            case = (n, k, fields, dtype, pdl)
            out = gemv(x, q, weight_scale=table, config=cfg, pdl=pdl)
            assert out.dtype == dtype and out.shape == (1, n), case
            assert rel(out, float64_gemv(x, q, grid)) < tol, (case, rel(out, float64_gemv(x, q, grid)))
            assert rel(out, torch_gemv(x, q, weight_scale=table)) < tol, case
            summed, out = gemv(x, q, weight_scale=table, norm_weight=nw, eps=1e-6, add=add, config=cfg, pdl=pdl)
            want = float64_gemv(x, q, grid, norm_weight=nw, eps=1e-6, add=add)
            ref_sum, ref = torch_gemv(x, q, weight_scale=table, norm_weight=nw, eps=1e-6, add=add)
            assert torch.equal(summed, ref_sum), case  # the residual stream: one rounding of x + add
            assert rel(out, want) < tol and rel(out, ref) < tol, (case, rel(out, want), rel(out, ref))
            both = gemv(x, q, weight_scale=table, norm_weight=nw, eps=1e-6, add=add, residual=res, config=cfg,
                        pdl=pdl)
            assert rel(both[1], float64_gemv(x, q, grid, norm_weight=nw, eps=1e-6, add=add, residual=res)) < tol
            again = gemv(x, q, weight_scale=table, norm_weight=nw, eps=1e-6, add=add, config=cfg, pdl=pdl)
            assert torch.equal(again[1], out) and torch.equal(again[0], summed), case  # bitwise repeatable
            out = gemv(x, q, weight_scale=table, residual=res, config=cfg, pdl=pdl)
            assert rel(out, float64_gemv(x, q, grid, residual=res)) < tol, case
        # a wrong table layout is caught by these tolerances (the mutants measure ~1)
        q, grid, table, x, add, nw, res = operands(n, k, torch.float32, device, seed=n + k)
        want = float64_gemv(x, q, grid, norm_weight=nw, eps=1e-6, add=add)
        for name, bad in mutant_tables(grid, n, k).items():
            got = gemv(x, q, weight_scale=bad.to(device), norm_weight=nw, eps=1e-6, add=add, config=cfg)[1]
            assert rel(got, want) > 0.1, (n, k, name, rel(got, want))

    # a fused qkv: q, k and v each quantized on its own grid (row counts not multiples of 128), their
    # per-row tables concatenated, equals the three products concatenated
    parts = [(200, 7), (72, 8), (72, 9)]
    k = 256
    qs, grids = zip(*(fp8.quantize_weight(block_weight(r, k, seed)) for r, seed in parts))
    table = torch.cat([fp8.row_scales(gr, r, k) for gr, (r, _) in zip(grids, parts)]).to(device)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(device)
    out = gemv(x, torch.cat(qs).to(device), weight_scale=table)
    want = torch.cat([float64_gemv(x, qq, gr) for qq, gr in zip(qs, grids)], dim=1)
    assert rel(out, want) < 1e-5, rel(out, want)
    # the mistake of expanding the stacked grids as one grid over all rows (k's rows read q's last block row)
    wrong = torch.cat(grids).repeat_interleave(128, 0)[:table.shape[0]].contiguous().to(device)
    assert rel(gemv(x, torch.cat(qs).to(device), weight_scale=wrong), want) > 0.1

    # the config rule in bytes: FP8 gets twice the rows of a 2-byte weight of the same K (the same 8 KB)
    # (the LM head's shape: its 16 KB row blocks in a loop of 4)
    for n, k in ((5120, 2048), (2048, 4096), (300, 200), (151936, 2048)):
        c2, c1 = gemv_config(n, k), gemv_config(n, k, 1)
        assert c1.block_n == 2 * c2.block_n and (c1.iters, c1.num_warps) == (c2.iters, c2.num_warps), (n, k)
    assert gemv_config(5120, 2048, 1) == GemvConfig(4, 1, 4) and gemv_config(151936, 2048, 1) == GemvConfig(8, 4, 8)
    check_refusals(device)


def check_refusals(device: str) -> None:
    """Bad weight / scale pairs refused by name before any launch."""
    from coldset.kernels.triton_decode import gemv

    n, k = 40, 200
    q, grid, table, x, *_ = operands(n, k, torch.float32, device)
    cases = [
        (dict(weight=q, weight_scale=None), "give its block scales as weight_scale"),
        (dict(weight=q.float(), weight_scale=table), "scales go with a torch.float8_e4m3fn weight only"),
        (dict(weight=q, weight_scale=table.half()), "weight_scale must be float32"),
        (dict(weight=q, weight_scale=grid.to(device)), "weight_scale must be the per-row table [40, 2]"),
        (dict(weight=q, weight_scale=torch.ones(n, 3, device=device)), "weight_scale must be the per-row table"),
        (dict(weight=q, weight_scale=table.T.contiguous().T), "weight_scale must be row-major"),
        (dict(weight=q.float().to(torch.float8_e5m2), weight_scale=table), "float8_e5m2 is not supported"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match.replace("[", r"\[").replace("]", r"\]")):
            gemv(x, kwargs["weight"], weight_scale=kwargs["weight_scale"])
    with pytest.raises(fp8.Fp8FormatError, match="does not match a"):
        fp8.row_scales(grid[:, :1], n, k)


# ---------------------------------------------------------------------------------------------
# CPU: the reference against float64, the per-row table, and the kernel under the interpreter
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k,_", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_reference_against_float64(n, k, _, dtype):
    """The torch reference dequantizes as the format says and computes the kernel's quantities:
    against float64 within the stated tolerance, and a wrong table layout fails it."""
    q, grid, table, x, add, nw, res = operands(n, k, dtype, "cpu", seed=n + k)
    tol = tolerance(dtype)
    assert rel(torch_gemv(x, q, weight_scale=table), float64_gemv(x, q, grid)) < tol
    s, out = torch_gemv(x, q, weight_scale=table, norm_weight=nw, eps=1e-6, add=add, residual=res)
    assert torch.equal(s, (x.float() + add.float()).to(dtype))
    assert rel(out, float64_gemv(x, q, grid, norm_weight=nw, eps=1e-6, add=add, residual=res)) < tol
    # the dequantized weight equals coldset.core.fp8's own dequantization (float32)
    w = q.float() * table.repeat_interleave(128, 1)[:, :k]
    assert torch.equal(w, fp8.dequantize_weight(q, grid))
    want = float64_gemv(x, q, grid, norm_weight=nw, eps=1e-6, add=add)
    for name, bad in mutant_tables(grid, n, k).items():
        got = torch_gemv(x, q, weight_scale=bad, norm_weight=nw, eps=1e-6, add=add)[1]
        assert rel(got, want) > 0.1, (name, rel(got, want))


def test_row_scales_repeats_each_block_row_for_its_rows():
    grid = torch.arange(6, dtype=torch.float32).view(3, 2)  # rows 257..384 -> 3 block rows
    table = fp8.row_scales(grid, 300, 200)
    assert table.shape == (300, 2) and table.dtype == torch.float32 and table.is_contiguous()
    assert torch.equal(table[0], grid[0]) and torch.equal(table[127], grid[0])
    assert torch.equal(table[128], grid[1]) and torch.equal(table[299], grid[2])
    with pytest.raises(fp8.Fp8FormatError, match=r"grid \[3, 2\] does not match a \[300, 300\] weight"):
        fp8.row_scales(grid, 300, 300)


def test_fp8_gemv_under_the_interpreter():
    """:func:`check_kernel` on the CPU through Triton's interpreter (float32 and fp16; skipped where
    triton is not importable): every option against float64 and the torch reference, the mutants
    caught, a fused qkv of three grids, the config rule, the refusals."""
    run_interpreted(_PRELUDE + "\nimport test_fp8_gemv as T\nT.check_kernel('cpu')\nprint('INTERPRETED OK')\n")


# ---------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_fp8_gemv_on_cuda():
    """:func:`check_kernel` on CUDA: float32 activations, and bf16 (the engine's) as a programmatic
    dependent launch where the device has it (a lone launch waits on nothing); fp16 runs under the
    interpreter."""
    from coldset.kernels.triton_slots import pdl_available

    check_kernel("cuda", runs=((torch.float32, False), (torch.bfloat16, pdl_available(torch.device("cuda")))))


# ---------------------------------------------------------------------------------------------
# The model: an FP8 checkpoint's attention kept as stored for the fused one-token path
# ---------------------------------------------------------------------------------------------

# q 2 x 80 = 160 rows (a partial second block row), k and v 80 rows each, hidden 200 (a partial group)
PARTIAL = dict(layers=2, experts=8, top_k=2, hidden=200, moe_intermediate=136, heads=2, kv_heads=1, head_dim=80,
               vocab_size=512, seed=3)


def test_fp8_checkpoint_keeps_its_attention_bytes_and_scales_for_the_fused_path(tmp_path):
    """load_model keeps q/k/v/o_proj as stored (bytes, scales expanded per row, q/k/v each on its
    own grid) beside the dequantized weights every other path runs; the torch reference of the
    fused GEMV on those equals the dequantized product to float32 summation order."""
    from safetensors.torch import load_file

    from coldset.engine.loading import load_model
    from coldset.engine.model import fp8_attention_linears
    from coldset.engine.synthetic import SyntheticSpec, write_synthetic_checkpoint

    path = write_synthetic_checkpoint(SyntheticSpec(**PARTIAL, weight_format="fp8"), tmp_path / "hf")
    tensors = load_file(str(path / "model.safetensors"))
    model = load_model(path)
    hidden = PARTIAL["hidden"]
    for i, layer in enumerate(model.layers):
        attn, pre = layer.self_attn, f"model.layers.{i}.self_attn"
        names = ("q_proj", "k_proj", "v_proj")
        stored = [tensors[f"{pre}.{n}.weight"] for n in names]
        grids = [tensors[f"{pre}.{n}.weight_scale_inv"] for n in names]
        assert torch.equal(attn.qkv_fp8.view(torch.uint8), torch.cat(stored).view(torch.uint8))
        want = torch.cat([g.repeat_interleave(128, 0)[:q.shape[0]] for q, g in zip(stored, grids)])
        assert attn.qkv_scale.shape == (160 + 80 + 80, 2) and torch.equal(attn.qkv_scale, want)
        o, og = tensors[f"{pre}.o_proj.weight"], tensors[f"{pre}.o_proj.weight_scale_inv"]
        assert torch.equal(attn.o_fp8.view(torch.uint8), o.view(torch.uint8))
        assert torch.equal(attn.o_scale, og.repeat_interleave(128, 0)[:hidden])
        x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(i))
        assert rel(torch_gemv(x, attn.qkv_fp8, weight_scale=attn.qkv_scale), x @ attn.qkv_proj.weight.T) < 1e-5
        xo = torch.randn(1, 160, generator=torch.Generator().manual_seed(i))
        assert rel(torch_gemv(xo, attn.o_fp8, weight_scale=attn.o_scale), xo @ attn.o_proj.weight.T) < 1e-5
    assert fp8_attention_linears(model, 1) == []  # not compiled: the eager path runs the dequantized weights


def test_a_partly_converted_qkv_keeps_no_fp8_copy(tmp_path):
    """k_proj in modules_to_not_convert: qkv runs dequantized only (no FP8 copy), o_proj keeps its."""
    import json

    from safetensors.torch import load_file, save_file

    from coldset.engine.loading import load_model
    from coldset.engine.synthetic import SyntheticSpec, write_synthetic_checkpoint

    path = write_synthetic_checkpoint(SyntheticSpec(**PARTIAL, weight_format="fp8"), tmp_path / "hf")
    tensors = load_file(str(path / "model.safetensors"))
    for i in range(PARTIAL["layers"]):
        key = f"model.layers.{i}.self_attn.k_proj"
        tensors[f"{key}.weight"] = fp8.dequantize_weight(tensors[f"{key}.weight"], tensors.pop(f"{key}.weight_scale_inv"))
    save_file(tensors, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"].append("k_proj")
    (path / "config.json").write_text(json.dumps(cfg))
    model = load_model(path)
    attn = model.layers[0].self_attn
    assert attn.qkv_fp8 is None and attn.qkv_scale is None and attn.o_fp8 is not None


def test_attach_fp8_attention_quantizes_each_projection_and_restores():
    """The bench's in-memory FP8 attention: q, k, v and o_proj each quantized on its own grid, the
    float weights replaced by their dequantization (the FP8 model on every path), and put back."""
    from coldset.engine.loading import attach_fp8_attention
    from coldset.engine.synthetic import SyntheticSpec, build_synthetic_model

    model, _ = build_synthetic_model(SyntheticSpec(**PARTIAL, in_memory=True), "cpu", torch.float32)
    before = [(la.self_attn.qkv_proj.weight.clone(), la.self_attn.o_proj.weight.clone()) for la in model.layers]
    restore = attach_fp8_attention(model)
    for layer, (qkv_w, o_w) in zip(model.layers, before):
        attn = layer.self_attn
        parts = [fp8.quantize_weight(w) for w in qkv_w.split([160, 80, 80])]
        assert torch.equal(attn.qkv_fp8.view(torch.uint8), torch.cat([q for q, _ in parts]).view(torch.uint8))
        assert torch.equal(attn.qkv_scale, torch.cat([fp8.row_scales(s, q.shape[0], 200) for q, s in parts]))
        assert torch.equal(attn.qkv_proj.weight, torch.cat([fp8.dequantize_weight(q, s) for q, s in parts]))
        q, s = fp8.quantize_weight(o_w)
        assert torch.equal(attn.o_fp8.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(attn.o_proj.weight, fp8.dequantize_weight(q, s))
        assert rel(attn.qkv_proj.weight, qkv_w) < 0.05  # e4m3: a few percent
    with pytest.raises(ValueError, match="already has FP8 copies"):
        attach_fp8_attention(model)
    restore()
    for layer, (qkv_w, o_w) in zip(model.layers, before):
        attn = layer.self_attn
        assert torch.equal(attn.qkv_proj.weight, qkv_w) and torch.equal(attn.o_proj.weight, o_w)
        assert attn.qkv_fp8 is None and attn.qkv_scale is None and attn.o_fp8 is None and attn.o_scale is None


@pytest.mark.gpu
def test_fused_decode_with_fp8_attention_on_cuda():
    """The fused engine with FP8 attention (attach_fp8_attention, bf16): at batch 1 it reads the FP8
    copies (its logits differ from the same engine without them, by e4m3-vs-bf16 weight rounding
    only: < 1e-2), decodes the eager engine's greedy tokens (the eager one runs the dequantized
    weights) with logits within 1e-2, and repeats bitwise; batch 3 runs the dequantized weights."""
    from coldset.verify import gate
    from coldset.engine.generate import generate
    from coldset.engine.loading import attach_fp8_attention
    from coldset.engine.model import fp8_attention_linears
    from coldset.engine.synthetic import SyntheticSpec, build_synthetic_model

    spec = SyntheticSpec(layers=4, experts=16, top_k=4, hidden=256, moe_intermediate=128, heads=8, kv_heads=2,
                         head_dim=64, vocab_size=1024, seed=11, in_memory=True)
    eager, tok = build_synthetic_model(spec, "cuda", torch.bfloat16)
    fused, _ = build_synthetic_model(spec, "cuda", torch.bfloat16)
    for m in (eager, fused):
        m.experts_fn = gate.experts_functions(torch.device("cuda"), None)[0]
        attach_fp8_attention(m)
    fused.compile_decode()
    assert fp8_attention_linears(fused, 1) == ["qkv_proj", "o_proj"] and fp8_attention_linears(fused, 3) == []
    texts = ("def parse_args(items, limit):", "The quiet river", '{"tool": "get_weather", "city": "Oslo"}')
    one = [tok.encode(texts[0]).ids]
    a = generate(eager, one, 16, progress=False, return_all_logits=True)
    b = generate(fused, one, 16, progress=False, return_all_logits=True)
    c = generate(fused, one, 16, progress=False, return_all_logits=True)
    assert a.tokens == b.tokens and rel(b.all_logits, a.all_logits) < 1e-2
    assert torch.equal(b.all_logits, c.all_logits)
    # without the FP8 copies the same engine reads the dequantized bf16 weights: close, not equal
    copies = [(la.self_attn.qkv_fp8, la.self_attn.qkv_scale, la.self_attn.o_fp8, la.self_attn.o_scale)
              for la in fused.layers]
    for la in fused.layers:
        la.self_attn.qkv_fp8 = la.self_attn.qkv_scale = la.self_attn.o_fp8 = la.self_attn.o_scale = None
    d = generate(fused, one, 16, progress=False, return_all_logits=True)
    assert not torch.equal(d.all_logits[:, 1:], b.all_logits[:, 1:]) and rel(d.all_logits, b.all_logits) < 1e-2
    for la, (q, qs, o, os_) in zip(fused.layers, copies):
        la.self_attn.qkv_fp8, la.self_attn.qkv_scale, la.self_attn.o_fp8, la.self_attn.o_scale = q, qs, o, os_
    many = [tok.encode(t).ids for t in texts]
    a3 = generate(eager, many, 8, progress=False, return_all_logits=True)
    b3 = generate(fused, many, 8, progress=False, return_all_logits=True)
    assert a3.tokens == b3.tokens and rel(b3.all_logits, a3.all_logits) < 1e-2


# ---------------------------------------------------------------------------------------------
# bench step --weight-format fp8: the FP8 model's floor and what its rows say
# ---------------------------------------------------------------------------------------------


def test_fp8_step_floor_counts_attention_at_one_byte_at_batch_one():
    """At Qwen3-30B-A3B's shape the FP8 model's non-expert bytes at batch 1 are bf16's less the
    attention projections' bf16 bytes plus their e4m3 bytes and 128 x 128 block scales (computed
    here from the shapes: q [4096, 2048], k and v [512, 2048], o [2048, 4096], 48 layers); from 2
    tokens on they run dequantized, so bf16's."""
    from coldset.bench import decode as bn
    from coldset.workflow.config import load_config
    from coldset.measure.step import nonexpert_read_bytes_fp8
    from coldset.engine.synthetic import SyntheticSpec, synthetic_model_config

    cfg = synthetic_model_config(SyntheticSpec(**load_config("config/examples/qwen3-30b-a3b-h200.yaml")["model"]["synthetic"]))
    shapes = [(4096, 2048), (512, 2048), (512, 2048), (2048, 4096)]
    bf16 = 48 * sum(r * c * 2 for r, c in shapes)
    f8 = 48 * sum(r * c + math.ceil(r / 128) * math.ceil(c / 128) * 4 for r, c in shapes)
    assert bf16 == 1_811_939_328 and f8 == 906_190_848  # 0.50003 of bf16: the scales are 0.02%
    assert nonexpert_read_bytes_fp8(cfg, 1, torch.bfloat16) == bn._nonexpert_read_bytes(cfg, 1, torch.bfloat16) - bf16 + f8
    assert nonexpert_read_bytes_fp8(cfg, 8, torch.bfloat16) == bn._nonexpert_read_bytes(cfg, 8, torch.bfloat16)


def test_step_render_says_which_nonexpert_weights_were_fp8():
    from coldset.measure.render import render_step
    from test_measure_fp8 import STEP_FP8

    said = "q/k/v/o_proj block-FP8 (attach_fp8_attention): read as FP8 by the fused step at batch 1"
    assert "non-expert weights bf16 in both" in render_step(STEP_FP8)  # a result from before: as it was
    md = render_step({**STEP_FP8, "fp8_nonexpert": said})
    assert f"in the FP8 rows {said}" in md and "non-expert weights bf16 in both" not in md
