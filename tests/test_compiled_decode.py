"""The compiled decode step (MoEModel.compile_decode) on CUDA: the eager engine's tokens, and
bitwise parity between the unmodified path and a placement when both run compiled.

GPU only (torch.compile of the decode region is what the CUDA pipeline runs; on CPU the engine
stays eager): skipped where no CUDA device or triton is present.
"""

import numpy as np
import pytest
import torch

# CUDA and triton only: skipped elsewhere by the gpu marker (tests/conftest.py).
pytestmark = pytest.mark.gpu

from coldset.bench import decode as bench  # noqa: E402
from coldset.verify import gate  # noqa: E402
from coldset.engine.generate import generate  # noqa: E402
from coldset.analysis.placement import row_map_from_mask  # noqa: E402
from coldset.engine.synthetic import SyntheticSpec, build_synthetic_model  # noqa: E402
from synthetic_engines import graphed_greedy_tokens  # noqa: E402

SPEC = SyntheticSpec(layers=4, experts=16, top_k=4, hidden=256, moe_intermediate=128, heads=4, kv_heads=2,
                     head_dim=64, vocab_size=1024, seed=5, in_memory=True)


@pytest.fixture(scope="module", params=[True, False], ids=["fused", "inductor"])
def models(request):
    """(eager, compiled, prompts): ``compile_decode(fused=True)`` runs the Triton decode kernels
    (the default on CUDA in bf16), ``fused=False`` the Inductor-compiled region."""
    eager, tok = build_synthetic_model(SPEC, "cuda", torch.bfloat16)
    compiled, _ = build_synthetic_model(SPEC, "cuda", torch.bfloat16)
    compiled.compile_decode(fused=request.param)
    for m in (eager, compiled):
        m.experts_fn = gate.experts_functions(torch.device("cuda"), None)[0]
    prompts = [tok.encode(t).ids for t in ("def parse_args(items, limit):", "The quiet river walked",
                                           '{"tool": "get_weather", "city": "Oslo"}')]
    return eager, compiled, prompts


def test_compiled_decode_matches_the_eager_engine(models):
    eager, compiled, prompts = models
    a = generate(eager, prompts, 16, progress=False, return_all_logits=True)
    b = generate(compiled, prompts, 16, progress=False, return_all_logits=True)
    assert a.tokens == b.tokens
    rel = (a.all_logits - b.all_logits).norm() / a.all_logits.norm()
    assert rel < 1e-2  # bf16: fused float32 normalisations round differently, not wrongly


def test_placement_is_bitwise_equal_to_the_unmodified_path_when_both_compiled(models):
    _, compiled, prompts = models
    ids = [f"p{i}" for i in range(len(prompts))]
    # the Inductor region: the same graphs in both decodes only after one of the workload (the fused one: none)
    gate.warm_compiled_decode(compiled, prompts, 12, [8], progress=False)
    reference = gate.reference_decode(compiled, prompts, 12, progress=False)
    mask = np.random.default_rng(0).random((compiled.config.num_moe_layers, compiled.config.num_experts)) < 0.5
    pools = compiled.pools.placed(row_map_from_mask(mask))
    got = gate.placement_decode(compiled, pools, prompts, 12, progress=False)
    result = gate.compare("random", ids, reference, got, pools, compiled)
    assert result.passed and result.max_abs_logit_diff == 0.0


def test_graphed_compiled_step_decodes_what_generate_decodes(models):
    _, compiled, prompts = models
    stream = [t for p in prompts for t in p]
    prompts_t = bench.bench_prompts(stream, 2, 8)
    want = generate(compiled, prompts_t.tolist(), 10, progress=False).tokens
    assert graphed_greedy_tokens(compiled, prompts_t, 10) == want
