"""The parity gate passes every real placement and catches a corrupted row map."""

import numpy as np
import pytest
import torch

from coldset import gate
from coldset.model import load_model
from coldset.placement import row_map_from_mask
from coldset.synthetic import SyntheticSpec, write_synthetic_checkpoint

SPEC = SyntheticSpec(layers=2, experts=8, top_k=2, hidden=64, moe_intermediate=32, heads=2, kv_heads=1,
                     head_dim=32, vocab_size=512, seed=3, expert_gain=2.0, lm_successor_gain=1.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_synthetic_checkpoint(SPEC, tmp_path_factory.mktemp("gate") / "ckpt")
    return load_model(path)


def _prompts(vocab, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(5, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_every_random_placement_is_token_exact(engine):
    prompts = _prompts(engine.config.vocab_size)
    ids = [f"p{i}" for i in range(len(prompts))]
    reference = gate.reference_decode(engine, prompts, 16, progress=False)
    rng = np.random.default_rng(0)
    for trial in range(3):
        mask = rng.random((engine.config.num_moe_layers, engine.config.num_experts)) < 0.5
        pools = engine.pools.placed(row_map_from_mask(mask))
        assert pools.num_cold > 0 and pools.num_hot > 0
        got = gate.placement_decode(engine, pools, prompts, 16, progress=False)
        result = gate.compare(f"random-{trial}", ids, reference, got, pools, engine)
        assert result.passed and result.tokens_matched == result.tokens_total == 4 * 16
        assert result.max_abs_logit_diff == 0.0


def test_gate_catches_two_swapped_experts(engine):
    prompts = _prompts(engine.config.vocab_size, seed=1)
    ids = [f"p{i}" for i in range(len(prompts))]
    reference = gate.reference_decode(engine, prompts, 16, progress=False)
    mask = np.ones((engine.config.num_moe_layers, engine.config.num_experts), dtype=bool)
    mask[:, ::2] = False
    row_map = row_map_from_mask(mask)
    pools = engine.pools.placed(row_map)
    # Corrupt: every layer's two most-used experts read each other's rows (a valid-looking map).
    from coldset.model import generate

    routing = generate(engine, prompts, 16, capture_routing=True, progress=False).routing
    counts = np.zeros(row_map.shape, dtype=np.int64)
    for r in routing:
        for layer in range(row_map.shape[0]):
            np.add.at(counts[layer], r.experts[:, layer].numpy().astype(np.int64).ravel(), 1)
    corrupted = row_map.copy()
    for layer in range(row_map.shape[0]):
        a, b = np.argsort(-counts[layer], kind="stable")[:2]
        corrupted[layer, [a, b]] = corrupted[layer, [b, a]]
    pools.set_row_map(corrupted)
    got = gate.placement_decode(engine, pools, prompts, 16, progress=False)
    result = gate.compare("swapped", ids, reference, got, pools, engine)
    assert not result.passed
    assert result.mismatches and result.tokens_matched < result.tokens_total
    first = result.mismatches[0]
    assert first.expected != first.got and first.logit_gap >= 0
    with pytest.raises(gate.ParityGateError, match="swapped"):
        gate.gate_verdict([result.to_dict()])


def test_placing_needs_the_unmodified_layout(engine):
    mask = np.zeros((engine.config.num_moe_layers, engine.config.num_experts), dtype=bool)
    mask[:, :3] = True
    pools = engine.pools.placed(row_map_from_mask(mask))
    assert pools.num_hot == 3 * engine.config.num_moe_layers
    with pytest.raises(ValueError, match="all-hot layout"):
        pools.placed(row_map_from_mask(mask))
