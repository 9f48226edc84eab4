"""The router's softmax + top-k Triton kernel against the torch reference (CUDA only)."""

import pytest
import torch

# CUDA and triton only: skipped elsewhere by the gpu marker (tests/conftest.py).
pytestmark = pytest.mark.gpu

from coldset.kernels import softmax_topk, torch_softmax_topk  # noqa: E402


@pytest.mark.parametrize("tokens,experts,k", [(1, 128, 8), (7, 128, 8), (64, 60, 4), (5, 8, 1), (3, 300, 6)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_reference(tokens, experts, k, renormalize, dtype):
    g = torch.Generator(device="cuda").manual_seed(tokens * 1000 + experts + k)
    # Distinct logits per token (ties are a separate test): a random permutation of a grid that
    # every dtype here represents exactly, scaled like real router logits.
    perm = torch.argsort(torch.rand(tokens, experts, generator=g, device="cuda"), dim=-1)
    logits = ((perm.float() - experts / 2) / 16).to(dtype)
    ids, weights = softmax_topk(logits, k, renormalize)
    want_ids, want_weights = torch_softmax_topk(logits, k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=1e-7)


def test_random_logits():
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(33, 128, generator=g, device="cuda")
    ids, weights = softmax_topk(logits, 8, True)
    want_ids, want_weights = torch_softmax_topk(logits, 8, True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=1e-7)
    assert torch.all(weights.sum(-1).sub(1).abs() < 1e-5)


def test_ties_go_to_the_lowest_expert_id():
    logits = torch.zeros(2, 16, device="cuda")
    logits[0, [3, 9, 12]] = 1.0
    logits[1, [15, 0]] = 2.0
    ids, weights = softmax_topk(logits, 3, False)
    assert ids.tolist() == [[3, 9, 12], [0, 15, 1]]
    assert torch.allclose(weights[0], weights[0, :1].expand(3))
