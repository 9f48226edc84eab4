"""Offline ``vllm.LLM.generate`` with or without coldset's plugin (``COLDSET_PLACEMENT`` from the
environment), for tests_vllm/test_vllm_plugin.py: ``python run_plugin_offline.py job.json result.json``.

The job names the model folder, the prompts (token ids) and ``max_tokens``; the result holds each
prompt's greedy tokens, the class of every fused MoE layer's routed experts and of its method, and
the plugin's memory report. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so ``LLM.apply_model`` can return what the worker holds.
"""

from __future__ import annotations

import json
import os
import sys


def _layers(model) -> dict:
    from coldset import vllm_plugin

    classes = sorted({f"{type(m).__name__}/{type(m.quant_method).__name__}" for _, m in model.named_modules()
                      if type(m).__name__.endswith("RoutedExperts")})
    return {"classes": classes, "memory": vllm_plugin.memory_report()}


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    job = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model_dir"], dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=512,
              kv_cache_memory_bytes=256 << 20, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], **llm.apply_model(_layers)[0]}
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
