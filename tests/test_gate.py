"""The parity gate passes every real placement and catches a corrupted row map."""

import numpy as np
import pytest
import torch

from coldset.verify import gate
from coldset.analysis.placement import row_map_from_mask
from coldset.engine.synthetic import SyntheticSpec
from synthetic_engines import random_prompts, synthetic_engine

SPEC = SyntheticSpec(layers=2, experts=8, top_k=2, hidden=64, moe_intermediate=32, heads=2, kv_heads=1,
                     head_dim=32, vocab_size=512, seed=3, expert_gain=2.0, lm_successor_gain=1.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return synthetic_engine(SPEC, tmp_path_factory.mktemp("gate"))



def test_every_random_placement_is_token_exact(engine):
    prompts = random_prompts(engine.config.vocab_size, 4)
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
    prompts = random_prompts(engine.config.vocab_size, 4, seed=1)
    ids = [f"p{i}" for i in range(len(prompts))]
    reference = gate.reference_decode(engine, prompts, 16, progress=False)
    mask = np.ones((engine.config.num_moe_layers, engine.config.num_experts), dtype=bool)
    mask[:, ::2] = False
    row_map = row_map_from_mask(mask)
    pools = engine.pools.placed(row_map)
    # Corrupt: every layer's two most-used experts read each other's rows (a valid-looking map).
    from coldset.engine.generate import generate

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


# --- Each clause of the verdict, on hand-made decodes (no model needed). Each test names the
# mutant of gate.compare / gate.gate_verdict it kills.

class _Pools:
    row_map = torch.tensor([[0, -1], [1, -2]], dtype=torch.int32)


class _Model:
    device = torch.device("cpu")
    dtype = torch.float32


def _decoded(tokens, vocab=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(len(t), vocab, generator=g) for t in tokens]
    return gate.Decoded([list(t) for t in tokens], logits)


def _clone(d: "gate.Decoded") -> "gate.Decoded":
    return gate.Decoded([list(t) for t in d.tokens], [x.clone() for x in d.logits])


def _compare(ref, got, ids=("a", "b")):
    return gate.compare("p-0.5", list(ids), ref, got, _Pools(), _Model(), backend="torch")


def test_identical_runs_pass():
    ref = _decoded([[1, 2, 3], [4, 5, 0]])
    r = _compare(ref, _clone(ref))
    assert r.passed and r.logits_bitwise_equal and r.tokens_matched == r.tokens_total == 6
    assert gate.gate_verdict([r.to_dict()])["passed"]


def test_a_placed_run_one_token_short_fails():
    """Mutant: compare zips each fixture's token lists, so a placed run one token short is
    compared only on its common prefix and passes."""
    ref = _decoded([[1, 2, 3], [4, 5, 0]])
    got = _clone(ref)
    got.tokens[1] = got.tokens[1][:-1]
    got.logits[1] = got.logits[1][:-1]
    r = _compare(ref, got)
    assert not r.passed and r.tokens_total == 6 and r.tokens_matched == 5
    assert r.mismatches and r.mismatches[0].fixture == "b" and r.mismatches[0].position == 2
    assert r.mismatches[0].got == -1
    with pytest.raises(gate.ParityGateError, match="1 of 6 tokens differ"):
        gate.gate_verdict([r.to_dict()])


def test_an_empty_placed_run_fails():
    """Mutant: compare zips the lists, so a placed run with no tokens at all (or no fixtures)
    compares nothing and passes."""
    ref = _decoded([[1, 2, 3], [4, 5, 0]])
    got = gate.Decoded([[], []], [torch.zeros(0, 6), torch.zeros(0, 6)])
    r = _compare(ref, got)
    assert not r.passed and r.tokens_matched == 0 and r.tokens_total == 6
    with pytest.raises(ValueError, match="0 placed tokens"):
        _compare(ref, gate.Decoded([], []))
    nothing = _compare(gate.Decoded([[], []], [torch.zeros(0, 6)] * 2), gate.Decoded([[], []], [torch.zeros(0, 6)] * 2))
    assert not nothing.passed and nothing.tokens_total == 0


def test_a_nan_logit_fails_even_with_equal_tokens():
    """Mutant: max(max_diff, nan) in Python drops the NaN difference, so a NaN logit in the placed
    run leaves max_abs_logit_diff 0 and passes with logits_bitwise_equal=True."""
    ref = _decoded([[1, 2, 3], [4, 5, 0]])
    got = _clone(ref)
    got.logits[0][1, 0] = float("nan")  # not the argmax's logit: tokens stay equal
    r = _compare(ref, got)
    assert r.tokens_matched == r.tokens_total
    assert not r.passed and not r.logits_bitwise_equal and r.nonfinite_logits == 1
    assert r.max_abs_logit_diff != r.max_abs_logit_diff  # NaN propagated, not dropped
    with pytest.raises(gate.ParityGateError, match="p-0.5"):
        gate.gate_verdict([r.to_dict()])


def test_inf_logits_fail_even_when_both_runs_agree():
    """Mutant: finiteness not required, so an Inf both runs share (a broken model) passes as
    bitwise equal."""
    ref = _decoded([[1, 2, 3], [4, 5, 0]])
    ref.logits[1][0, 3] = float("inf")
    ref.tokens[1][0] = 3
    got = _clone(ref)
    r = _compare(ref, got)
    assert r.tokens_matched == r.tokens_total and not r.passed and r.nonfinite_logits == 2


def test_passed_requires_bitwise_logits():
    """Mutant: ``passed`` without its bitwise-logit half (``not mismatches`` alone), so logits
    that differ in the last bit, with the same greedy tokens, pass."""
    ref = _decoded([[1, 2, 3], [4, 5, 0]])
    got = _clone(ref)
    got.logits[1][2, 1] = torch.nextafter(got.logits[1][2, 1], torch.tensor(float("inf")))
    r = _compare(ref, got)
    assert r.tokens_matched == r.tokens_total and not r.mismatches
    assert not r.logits_bitwise_equal and not r.passed and 0 < r.max_abs_logit_diff < 1e-5
    with pytest.raises(gate.ParityGateError, match="not bitwise equal"):
        gate.gate_verdict([r.to_dict()])


def test_bitwise_means_bits_not_equality():
    """Mutant: logits compared with == (or |diff| == 0), which equates -0.0 and 0.0."""
    ref = _decoded([[1, 2, 3], [4, 5, 0]])
    ref.logits[0][0, 5] = 0.0
    got = _clone(ref)
    got.logits[0][0, 5] = -0.0
    r = _compare(ref, got)
    assert r.max_abs_logit_diff == 0.0 and not r.logits_bitwise_equal and not r.passed


def test_verdict_requires_every_token_matched_whatever_the_flag_says():
    """Mutant: the verdict trusts ``passed`` (or ``not mismatches``) and never requires
    tokens_matched == tokens_total > 0, so a report with a token short passes."""
    ref = _decoded([[1, 2, 3], [4, 5, 0]])
    good = _compare(ref, _clone(ref)).to_dict()
    for tampered in ({"tokens_matched": 5}, {"tokens_matched": 0, "tokens_total": 0},
                     {"logits_bitwise_equal": False}, {"nonfinite_logits": 3}):
        with pytest.raises(gate.ParityGateError, match="p-0.5"):
            gate.gate_verdict([{**good, **tampered}])
    with pytest.raises(ValueError, match="missing field"):
        gate.gate_verdict([{k: v for k, v in good.items() if k != "tokens_total"}])
    with pytest.raises(gate.ParityGateError, match="no parity reports"):
        gate.gate_verdict([])


def test_logits_are_compared_at_every_position_up_to_the_first_divergence():
    """Brute force over every (fixture, position): a last-bit change of one logit there, with the
    same greedy tokens, fails the gate with exactly that difference; a divergence there (the
    placed run picks another token from logits that differ at that step) is reported at that
    position, with the logit difference of that step counted and the later steps' (different
    inputs, any values) not (issue 30: a gate comparing only the steps before the divergence
    survived)."""
    ref = _decoded([[1, 2, 3, 0], [4, 5, 0, 1]], seed=4)
    for f in range(2):
        for p in range(4):
            got = _clone(ref)
            v = got.logits[f][p, 0].clone()
            got.logits[f][p, 0] = torch.nextafter(v, torch.tensor(float("inf")))
            r = _compare(ref, got)
            assert not r.passed and not r.logits_bitwise_equal and not r.mismatches
            assert r.max_abs_logit_diff == float((got.logits[f][p, 0] - v).abs())
            # a divergence at p: the placed step's logits raise another token to the top
            got = _clone(ref)
            other = (ref.tokens[f][p] + 1) % 6
            got.logits[f][p, other] = ref.logits[f][p].max() + 3.0
            got.tokens[f][p] = other
            for q in range(p + 1, 4):  # after the divergence: other inputs, other logits
                got.logits[f][q] += 100.0
                got.tokens[f][q] = (ref.tokens[f][q] + 2) % 6
            r = _compare(ref, got)
            brute = max(float((got.logits[f][q] - ref.logits[f][q]).abs().max()) for q in range(p + 1))
            assert not r.passed and not r.logits_bitwise_equal
            assert (r.mismatches[0].fixture, r.mismatches[0].position) == ("ab"[f], p)
            assert r.max_abs_logit_diff == pytest.approx(brute) and brute < 100.0
            assert r.tokens_matched == 8 - (4 - p)


def test_the_compiled_decode_region_picks_its_reduction_configs_without_timing(tmp_path, monkeypatch):
    """Inductor times a reduction's block size and warps on the device and keeps the fastest; those
    set the order of its sums, so a region compiled twice (a graph a shape) could round apart from run
    to run. ``compile_decode`` compiles in Inductor's deterministic mode, and refuses a torch without
    that mode by name."""
    import torch._inductor.config as inductor_config

    model = synthetic_engine(SPEC, tmp_path)
    asked = {}
    compile_ = torch.compile

    def recording(fn, **kwargs):
        asked.update(kwargs)
        return compile_(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", recording)
    model.compile_decode(fused=False)
    assert asked["options"] == {"deterministic": True} and model.decode_is_dynamo_compiled
    from coldset.engine.generate import generate

    prompts = random_prompts(model.config.vocab_size, 2, seed=3)
    assert [len(t) for t in generate(model, prompts, 3, progress=False).tokens] == [3, 3]  # the mode compiles and runs
    monkeypatch.delattr(inductor_config, "deterministic")
    with pytest.raises(ValueError, match=r"needs Inductor's deterministic mode \(torch >= 2.10\), torch .* lacks it"):
        model.compile_decode(fused=False)


def test_warming_a_compiled_decode_region_makes_later_decodes_run_the_same_graphs(tmp_path):
    """Dynamo runs the newest compiled graph whose guards a step passes: the first decode of a
    workload compiles exact-size graphs its later steps supersede, so the reference and a placement
    decoded after it would run other graphs at the same steps (other kernels, other bits on some
    GPUs). ``warm_compiled_decode`` decodes each batch size once first: after it no decode of the
    same fixtures compiles a graph, and each runs the graphs its warm-up ran, step for step. Graphs
    are counted by a recording torch.compile backend standing in for Inductor (CPU)."""
    from coldset.engine.model import layer_before_experts

    model = synthetic_engine(SPEC, tmp_path)
    prompts = random_prompts(model.config.vocab_size, 3, seed=4)
    assert not model.decode_is_dynamo_compiled
    assert gate.warm_compiled_decode(model, prompts, 4, [1, 3], progress=False) == 0  # eager: nothing to warm
    model.compile_decode()  # on the CPU: the torch.compile region
    assert model.decode_is_dynamo_compiled
    compiled, ran = [], []

    def backend(gm, example_inputs):
        graph = len(compiled)
        compiled.append(graph)

        def run(*args):
            ran.append(graph)
            return gm.forward(*args)
        return run

    model._compiled_before_experts = torch.compile(layer_before_experts, fullgraph=True, backend=backend)
    assert gate.warm_compiled_decode(model, prompts, 4, [3, 1, 3], progress=False) == 2
    warmed = len(compiled)
    runs = {}
    for b in (3, 1, 3, 1):
        ran.clear()
        reference = gate.reference_decode(model, prompts, 4, b, progress=False)
        runs.setdefault(b, []).append(list(ran))
        pools = model.pools.placed(row_map_from_mask(np.arange(model.config.num_moe_layers * model.config.num_experts)
                                                     .reshape(model.config.num_moe_layers, -1) % 2 == 0))
        ran.clear()
        placed = gate.placement_decode(model, pools, prompts, 4, b, progress=False)
        runs[b].append(list(ran))
        assert gate.compare("halves", [f"p{i}" for i in range(3)], reference, placed, pools, model).passed
    assert len(compiled) == warmed  # nothing compiled after the warm-up
    for b, seqs in runs.items():
        assert seqs[0] and all(s == seqs[0] for s in seqs), (b, seqs)
