"""The oracle every engine family's test runs: our left-padded batched greedy decode against
transformers' own ``generate`` of each unpadded prompt, in float32: the same tokens, logits within a
stated tolerance at every step, and the same routed experts and weights at every token and MoE layer
(read by forward hooks on transformers' router modules); and the parity gate's checks every family
passes on the CPU (a static placement and an LRU slot cache bitwise the all-hot path)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from coldset.bench import decode as bench
from coldset.analysis.placement import hot_mask_usage_global, row_map_from_mask
from coldset.engine.cache.pool import SlotCache
from coldset.engine.generate import generate
from coldset.engine.model import ModelLoadError
from coldset.kernels.tiers import host_tier
from coldset.verify import gate
from synthetic_engines import graphed_greedy_tokens


def checkpoints_by_variant(tmp_path_factory, build: Callable[[str, Path], Path]) -> Callable[[str], Path]:
    """A family test's ``checkpoint`` fixture: ``variant -> folder``, each variant's folder written
    once by ``build(variant, folder)`` in a fresh temporary folder and kept for the module."""
    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            built[variant] = build(variant, tmp_path_factory.mktemp(variant))
        return built[variant]

    return get


def assert_config_refused(config_cls, folder: Path, change: dict, field: str) -> None:
    """``folder``'s config.json with ``change`` applied: ``config_cls.from_hf_config`` raises a
    ModelLoadError naming ``field``."""
    raw = json.loads((folder / "config.json").read_text())
    raw.update(change)
    with pytest.raises(ModelLoadError, match=field):
        config_cls.from_hf_config(raw, "config.json")


def hf_greedy(hf, prompt: list[int], routers: dict, new_tokens: int):
    """transformers' greedy generate of one unpadded prompt: ``(tokens, logits [new, V], routing)``,
    ``routing[layer] = (ids, weights)``, each ``[prompt + new - 1, k]``, from hooks on ``routers``
    (HF layer index -> its router module, whose output is ``(logits, weights, ids)``)."""
    calls = {i: [] for i in routers}
    hooks = [router.register_forward_hook(lambda _m, _a, out, i=i: calls[i].append((out[2], out[1])))
             for i, router in routers.items()]
    try:
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    finally:
        for h in hooks:
            h.remove()
    routing = {i: (torch.cat([c[0] for c in calls[i]]), torch.cat([c[1] for c in calls[i]])) for i in routers}
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, dim=1)[0], routing


def assert_greedy_matches(model, hf, prompts, new_tokens: int, routers: dict, logit_atol: float,
                          ordered: bool = False):
    """Decode ``prompts`` with ``model`` and check them against ``hf`` (see the module doc); ``routers``
    maps each MoE layer's HF index, in the model's MoE-layer order, to its router module. ``ordered``:
    both routers emit the top-k in the same order (compared as is), else as sets with their weights.
    Returns our generation."""
    cfg = model.config
    gen = generate(model, prompts, new_tokens, capture_routing=True, progress=False, return_all_logits=True)
    worst = 0.0
    for b, prompt in enumerate(prompts):
        tokens, logits, hf_routing = hf_greedy(hf, prompt, routers, new_tokens)
        assert gen.tokens[b] == tokens, f"prompt {b}"
        worst = max(worst, (gen.all_logits[b] - logits).abs().max().item())
        routing = gen.routing[b]
        assert routing.experts.shape == (len(prompt) + new_tokens - 1, cfg.num_moe_layers, cfg.top_k)
        for m, layer in enumerate(routers):
            ref_ids, ref_w = hf_routing[layer]
            got_ids, got_w = routing.experts[:, m].long(), routing.weights[:, m]
            if not ordered:
                got_ids, order = got_ids.sort(dim=-1)
                ref_ids, ref_order = ref_ids.sort(dim=-1)
                got_w, ref_w = got_w.gather(1, order), ref_w.gather(1, ref_order)
            assert torch.equal(got_ids, ref_ids), f"prompt {b}, MoE layer {m}"
            torch.testing.assert_close(got_w, ref_w, atol=1e-6, rtol=1e-5)
    assert worst < logit_atol, f"max |logit diff| {worst:.3g}"
    return gen


def assert_stepwise_greedy_matches(hf, prompts, gen, steps: int, logit_atol: float) -> None:
    """transformers' ``hf`` on each unpadded prompt, the whole sequence again at every step (no cache),
    greedy: each step's last logits within ``logit_atol`` of ``gen.all_logits`` and its ``steps`` tokens
    ``gen.tokens`` (``gen``: our generate of ``prompts`` with ``return_all_logits``)."""
    for i, prompt in enumerate(prompts):
        seq = list(prompt)
        with torch.no_grad():
            for step in range(steps):
                logits = hf(torch.tensor([seq])).logits[0, -1]
                assert (logits - gen.all_logits[i, step]).abs().max().item() < logit_atol
                seq.append(int(torch.argmax(logits)))
        assert seq[len(prompt):] == gen.tokens[i]


def assert_random_half_placement_bitwise(model, prompts, new_tokens: int):
    """Half the experts, drawn at random, in the cold tier: the parity gate finds the logits and
    tokens bitwise the all-hot path's. Returns the placed pools."""
    cfg = model.config
    ids = [f"p{i}" for i in range(len(prompts))]
    reference = gate.reference_decode(model, prompts, new_tokens, progress=False)
    mask = np.random.default_rng(0).random((cfg.num_moe_layers, cfg.num_experts)) < 0.5
    pools = model.pools.placed(row_map_from_mask(mask))
    assert pools.num_cold > 0 and pools.num_hot > 0
    result = gate.compare("random-half", ids, reference,
                          gate.placement_decode(model, pools, prompts, new_tokens, progress=False), pools, model)
    assert result.passed and result.logits_bitwise_equal and result.max_abs_logit_diff == 0.0
    return pools


def assert_lru_cache_bitwise(model, prompts, new_tokens: int) -> None:
    """An LRU slot cache of two tokens' experts a layer, at batch 1, filling as it decodes: the parity
    gate finds it bitwise the all-hot path's."""
    cfg = model.config
    ids = [f"p{i}" for i in range(len(prompts))]
    counts = np.random.default_rng(1).integers(0, 20, size=(cfg.num_moe_layers, cfg.num_experts)).astype(np.float64)
    capacity = 2 * cfg.top_k * cfg.num_moe_layers
    row_map = row_map_from_mask(hot_mask_usage_global(counts, capacity))
    flat = row_map.reshape(-1)
    owner = np.empty(capacity, dtype=np.int64)
    owner[flat[flat >= 0]] = np.flatnonzero(flat >= 0)
    cache = SlotCache.build(model.pools, host_tier(model.pools), row_map, counts.reshape(-1)[owner], "lru",
                            max_tokens=1, top_k=cfg.top_k)
    one_by_one = gate.reference_decode(model, prompts, new_tokens, batch_size=1, progress=False)
    got = gate.placement_decode(model, cache.pools, prompts, new_tokens, batch_size=1, progress=False, cache=cache)
    result = gate.compare("lru", ids, one_by_one, got, cache.pools, model)
    assert result.passed and result.logits_bitwise_equal
    assert cache.counters()["fills"] > 0


def assert_cuda_placements_bitwise_eager_and_compiled(model, prompts, new_tokens: int, label: str = "") -> None:
    """On CUDA through the Triton experts kernel: half the experts, drawn at random, read from pinned
    host memory give bitwise the all-hot logits, eagerly and with the decode region that
    ``compile_decode`` installs; the compiled first step stays near the eager one."""
    cfg = model.config
    ids = [f"p{i}" for i in range(len(prompts))]
    mask = np.random.default_rng(0).random((cfg.num_moe_layers, cfg.num_experts)) < 0.5
    pools = model.pools.placed(row_map_from_mask(mask))
    assert pools.w13_cold.is_pinned() and pools.num_cold > 0
    eager = gate.reference_decode(model, prompts, new_tokens, progress=False)
    for name in ("eager", "compiled"):
        if name == "compiled":
            model.compile_decode()
            assert gate.warm_compiled_decode(model, prompts, new_tokens, [8], progress=False) == 1
        reference = gate.reference_decode(model, prompts, new_tokens, progress=False)
        placed = gate.placement_decode(model, pools, prompts, new_tokens, progress=False)
        result = gate.compare(name, ids, reference, placed, pools, model)
        assert result.backend == "triton" and result.passed and result.logits_bitwise_equal, (
            label, name, result.tokens_matched, result.tokens_total, result.max_abs_logit_diff,
            result.nonfinite_logits, result.mismatches[:2])
    for a, b in zip(reference.logits, eager.logits):  # the first decode step: compiled against eager
        assert (a[1] - b[1]).abs().max().item() < 0.5, label


def assert_graphed_step_decodes_generate(model, prompts, new_tokens: int, batch_size: int = 2) -> None:
    """The bench's decode loop (:class:`coldset.bench.decode.Decoder`: the compiled step captured in
    one CUDA graph, replayed) through the Triton experts kernel gives ``generate()``'s greedy tokens,
    ``batch_size`` sequences (tokens a kernel call) a step."""
    model.experts_fn = gate.experts_functions(model.device)[0]  # the Triton experts kernel, as the bench runs
    model.compile_decode()
    batch = bench.bench_prompts([t for p in prompts for t in p], batch_size, 8)
    want = generate(model, batch.tolist(), new_tokens, progress=False).tokens
    assert graphed_greedy_tokens(model, batch, new_tokens) == want
