"""Which model families coldset runs through vLLM, and why the others are refused.

Routing capture (:mod:`coldset.serve.vllm_backend`), the placement plugin
(:mod:`coldset.serve.vllm_plugin`) and the cross-engine stage (:mod:`coldset.workflow.vllm_parity`)
call :func:`vllm_refusal` on the checkpoint's ``config.json`` before vLLM starts. A family is
accepted where vLLM 0.32 (its CPU build, the one coldset's tests run) decodes the tokens coldset's
engine and transformers decode and routes to the same experts at every token and MoE layer:

- ``qwen3_moe``, ``mixtral``, ``glm4_moe``;
- ``gpt_oss`` with gpt-oss's published clamped SwiGLU (``swiglu_limit`` 7, ``swiglu_alpha``
  1.702): vLLM's gpt-oss model never reads those fields and its ``swigluoai`` activation
  computes with 7 and 1.702 whatever the config says, so another value would run other experts
  than the checkpoint's.

Refused, with the reason in the message:

- ``deepseek_v3`` on vLLM's CPU build: its multi-head latent attention (the ``CPU_MLA`` backend
  with the ``CPU_SDPA_MLA`` prefill) returns other outputs than transformers' and coldset's from
  the second position of a prompt on, in float32 and bfloat16, so the tokens diverge at the first
  generated token; that backend also takes only ``kv_lora_rank + qk_rope_head_dim = 576``;
- ``deepseek_v3`` anywhere without ``topk_method: noaux_tc`` and ``scoring_func: sigmoid`` in its
  config: vLLM reads its router from those two fields (absent, a softmax router without the
  correction bias) where coldset's engine takes DeepSeek-V3's published router;
- a family coldset's engine does not run (:data:`VLLM_FAMILIES` lists those it compares against).
"""

from __future__ import annotations

#: model_type of the families whose vLLM runs coldset compares with its own engine.
VLLM_FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "gpt_oss")
#: gpt-oss's clamped SwiGLU as vLLM 0.32 computes it (``swigluoai``: limit 7, alpha 1.702).
VLLM_GPT_OSS_SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}
#: The DeepSeek-V3 router fields vLLM reads, with the values coldset's engine implements.
DEEPSEEK_ROUTER_FIELDS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}

_DEEPSEEK_CPU = ("vLLM's CPU build computes DeepSeek-V3's multi-head latent attention (CPU_MLA backend, "
                 "CPU_SDPA_MLA prefill) differently from transformers and coldset's engine from the second "
                 "position of a prompt on (float32 and bfloat16 alike), so its tokens and routing are not the "
                 "model's; coldset does not run deepseek_v3 through vLLM on the CPU (use routing.backend: "
                 "embedded)")


def vllm_refusal(raw: dict, source: str, on_cpu: bool) -> str | None:
    """Why coldset will not run the model of config ``raw`` (read from ``source``) through vLLM,
    or None. ``on_cpu``: vLLM runs on its CPU platform."""
    model_type = raw.get("model_type")
    if model_type == "deepseek_v3":
        if on_cpu:
            return f"{source}: model_type 'deepseek_v3': {_DEEPSEEK_CPU}"
        for name, want in DEEPSEEK_ROUTER_FIELDS.items():
            if raw.get(name) != want:
                return (f"{source}: field {name!r} is {raw.get(name)!r}: vLLM builds DeepSeek-V3's router from "
                        f"{name} (absent: a softmax router without the correction bias) and coldset's engine runs "
                        f"{name} {want!r}; write the published value into the config")
        return None
    if model_type not in VLLM_FAMILIES:
        return (f"{source}: model_type {model_type!r} is not a family coldset runs through vLLM "
                f"(those: {', '.join(VLLM_FAMILIES)}, and deepseek_v3 off the CPU)")
    if model_type == "gpt_oss":
        for name, want in VLLM_GPT_OSS_SWIGLU.items():
            value = raw.get(name, want)  # absent: transformers' GptOssConfig default, the same value
            if value is None or float(value) != want:
                return (f"{source}: field {name!r} is {value!r}: vLLM 0.32's gpt-oss experts clamp their SwiGLU "
                        f"with {name} {want} whatever the config says, so vLLM would compute other experts than "
                        "this checkpoint's")
    return None
