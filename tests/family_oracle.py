"""The oracle every engine family's test runs: our left-padded batched greedy decode against
transformers' own ``generate`` of each unpadded prompt, in float32: the same tokens, logits within a
stated tolerance at every step, and the same routed experts and weights at every token and MoE layer
(read by forward hooks on transformers' router modules)."""

from __future__ import annotations

import torch

from coldset.engine.generate import generate


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
