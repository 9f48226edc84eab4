"""The cross-engine token check: every static placement served by vLLM with coldset's plugin
(:mod:`coldset.serve.vllm_plugin`) decodes the parity fixtures to the same greedy tokens as coldset's
embedded engine and as stock vLLM.

The rule ``vllm_parity`` (workflow/rules/vllm.smk, ``snakemake vllm_parity``; not part of the
default target, since it needs vLLM in the workflow's environment) runs :func:`vllm_parity`
after the parity gate. The embedded engine decodes the parity fixtures once on its unmodified
path, in the parity stage's batches (the gate proved every placement bitwise equal to that path);
vLLM then runs once without the plugin and once per static placement with
``COLDSET_PLACEMENT`` set, each in its own process (the plugin's state is per process):
``python -m coldset.workflow.vllm_parity --worker job.json result.json``, offline ``LLM.generate`` at
temperature 0 on the same prompt token ids. The report, ``results/parity/<model>/vllm.json``,
counts per placement the tokens equal to the embedded engine's and to stock vLLM's, with the
worker's memory report (routed-expert bytes in the layers before, in the hot pool after) and how
many times coldset's experts op ran; the stage fails after writing it, naming each placement that
differs or whose run never called coldset's experts op. Each run has a vLLM cache of its own
(``VLLM_CACHE_ROOT``), so no run loads a graph another one compiled. Dynamic placements (the slot
cache) are listed as not served: the plugin refuses them. A family coldset does not run through
vLLM (:func:`coldset.serve.vllm_families.vllm_refusal`, e.g. a deepseek_v3 config without its
published router fields) fails the stage before any vLLM run, naming why; deepseek_v3 on vLLM's
CPU build runs eager with vLLM's rotary op off (``CPU_DEEPSEEK_ENGINE``; coldset.serve.vllm_families
says why).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from coldset.core.files import read_json, write_json
from coldset.core.placement import DYNAMIC_POLICIES
from coldset.engine.generate import encode_prompts
from coldset.serve import vllm_plugin
from coldset.serve.vllm_families import CPU_DEEPSEEK_ENGINE, vllm_refusal
from coldset.verify import gate
from coldset.workflow.context import StageContext
from coldset.workflow.process_engine import load_engine, parity_fixtures

log = logging.getLogger(__name__)

#: vLLM's KV cache on the CPU for the check (fixtures are short); vLLM otherwise reserves most RAM.
KV_CACHE_BYTES = 256 << 20


class VllmParityError(RuntimeError):
    """A placement served by vLLM decodes other tokens than coldset's engine (the message names it)."""


def run_worker(job_path: str, result_path: str) -> None:
    """One vLLM engine in this process (the plugin active iff ``COLDSET_PLACEMENT`` is set): the
    job's prompts decoded greedily; writes tokens, the routed-experts classes and the plugin's
    memory report."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # apply_model returns the worker's objects
    job = json.loads(Path(job_path).read_text())
    import vllm  # optional dependency: the worker runs only where vLLM is installed
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # vLLM's default execution (compiled with torch.compile), as a server runs without --enforce-eager,
    # unless the job's engine_args say otherwise
    llm = LLM(model=job["model_dir"], dtype=job["dtype"], seed=0, skip_tokenizer_init=True,
              max_model_len=job["max_model_len"], kv_cache_memory_bytes=KV_CACHE_BYTES, **job.get("engine_args", {}))
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    result = {"vllm_version": vllm.__version__, "tokens": [list(o.outputs[0].token_ids) for o in outs],
              **llm.apply_model(_worker_state)[0]}
    Path(result_path).write_text(json.dumps(result))


def _worker_state(model) -> dict:
    classes = sorted({f"{type(m).__name__}/{type(m.quant_method).__name__}" for _, m in model.named_modules()
                      if type(m).__name__.endswith("RoutedExperts")})
    return {"classes": classes, "memory": vllm_plugin.memory_report(), "experts_calls": vllm_plugin.experts_calls()}


def run_vllm(model_dir: Path, prompts: list[list[int]], max_tokens: int, dtype: str,
             placement: Path | None, workdir: Path, engine_args: dict | None = None,
             cache_root: Path | None = None) -> dict:
    """:func:`run_worker` in a fresh process, with the plugin serving ``placement`` (None: not asked
    for); ``engine_args`` go to ``vllm.LLM`` besides the worker's own. vLLM's cache (its compiled
    graphs) is ``cache_root`` (``VLLM_CACHE_ROOT``), by default a new folder in ``workdir``: no
    compiled graph of another run (stock vLLM's, another placement's, a user's earlier server) is
    reused. The result holds the worker's output (vLLM's log) under ``log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    job, result = workdir / "job.json", workdir / "result.json"
    max_len = max(len(p) for p in prompts) + max_tokens
    job.write_text(json.dumps({"model_dir": str(model_dir), "prompts": prompts, "max_tokens": max_tokens,
                               "dtype": dtype, "max_model_len": max_len, "engine_args": engine_args or {}}))
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    env.pop("COLDSET_PLACEMENT", None)
    env["VLLM_CACHE_ROOT"] = str(cache_root if cache_root is not None else workdir / "vllm-cache")
    if placement is not None:
        env["COLDSET_PLACEMENT"] = str(placement)
    proc = subprocess.run([sys.executable, "-m", "coldset.workflow.vllm_parity", "--worker", str(job), str(result)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if proc.returncode != 0:
        what = "stock vLLM" if placement is None else f"vLLM with placement {placement}"
        raise VllmParityError(f"{what} failed (exit {proc.returncode}); its output ends:\n{proc.stdout[-4000:]}")
    return {**json.loads(result.read_text()), "log": proc.stdout}


def compare_tokens(got: list[list[int]], want: list[list[int]], ids: list[str]) -> dict:
    """Tokens matched over the fixtures (position by position, up to the first divergence of each)
    and the first fixture that diverges."""
    matched = total = 0
    first = None
    for rid, g, w in zip(ids, got, want, strict=True):
        total += len(w)
        n = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        matched += n
        if (n < len(w) or len(g) != len(w)) and first is None:
            first = {"fixture": rid, "position": n, "vllm": g[n:n + 4], "embedded": w[n:n + 4]}
    return {"tokens_matched": matched, "tokens_total": total, "passed": first is None and total > 0,
            "first_mismatch": first}


def _family_engine(model_dir: Path) -> tuple[str | None, dict]:
    """Why coldset does not run this model through vLLM (coldset.serve.vllm_families), or None;
    and the engine arguments its runs take (deepseek_v3 on the CPU build: CPU_DEEPSEEK_ENGINE)."""
    from vllm.platforms import current_platform  # optional dependency: the stage runs where vLLM is installed

    config = model_dir / "config.json"
    raw = read_json(config, "model config")
    cpu_deepseek = raw.get("model_type") == "deepseek_v3" and current_platform.is_cpu()
    return vllm_refusal(raw, str(config)), dict(CPU_DEEPSEEK_ENGINE) if cpu_deepseek else {}


def vllm_parity(ctx: StageContext, **_) -> None:
    """The stage: every static placement of the config through vLLM with the plugin (module doc)."""
    layout = ctx.layout
    refusal, engine_args = _family_engine(ctx.model_dir)
    if refusal is not None:
        raise VllmParityError(f"vLLM parity refused: {refusal}")
    pc = ctx.parity
    names = ctx.placement_names()
    fxs = parity_fixtures(ctx)
    engine, tokenizer = load_engine(ctx)
    prompts = encode_prompts(tokenizer, [f.prompt for f in fxs])
    ids = [f.id for f in fxs]
    n_new = pc["max_new_tokens"]
    reference = gate.reference_decode(engine, prompts, n_new, pc["batch_size"] or len(prompts)).tokens
    folder, dtype = ctx.model_dir, ctx.dtype
    report: dict = {"fixtures": len(prompts), "max_new_tokens": n_new, "dtype": dtype, "placements": {}}
    with tempfile.TemporaryDirectory(prefix="coldset-vllm-parity-") as tmp:
        stock = run_vllm(folder, prompts, n_new, dtype, None, Path(tmp) / "stock", engine_args)
        report["vllm_version"] = stock["vllm_version"]
        report["stock"] = {**compare_tokens(stock["tokens"], reference, ids), "classes": stock["classes"],
                           "memory": stock["memory"], "experts_calls": stock["experts_calls"]}
        for name in names:
            if name.split("-")[0] in DYNAMIC_POLICIES:
                report["placements"][name] = {"served": False, "reason": "dynamic placement: the plugin serves "
                                              "static placements only"}
                continue
            got = run_vllm(folder, prompts, n_new, dtype, layout.placement_dir / f"{name}.json", Path(tmp) / name,
                           engine_args)
            entry = {"served": True, **compare_tokens(got["tokens"], reference, ids),
                     "equal_to_stock_vllm": got["tokens"] == stock["tokens"], "classes": got["classes"],
                     "memory": got["memory"], "experts_calls": got["experts_calls"]}
            report["placements"][name] = entry
            log.info("vllm parity %s: %d/%d tokens equal to the embedded engine's; hot pool %s of %s bytes", name,
                     entry["tokens_matched"], entry["tokens_total"], got["memory"].get("hot_pool_bytes"),
                     got["memory"].get("layer_expert_bytes_before"))
    # a run whose tokens are right but in which coldset's experts op never ran decoded another graph
    # than the plugin's (stock vLLM's): it proves nothing about the placement
    failed = [n for n, e in report["placements"].items()
              if e["served"] and not (e["passed"] and e["equal_to_stock_vllm"] and e["experts_calls"] > 0)]
    if not report["stock"]["passed"]:
        failed.insert(0, "stock vLLM (no plugin)")
    report["passed"] = not failed
    write_json(layout.results / "parity" / layout.model / "vllm.json", report)
    if failed:
        raise VllmParityError(f"vLLM's tokens differ from coldset's engine (or, with the plugin, from stock vLLM's, or "
                              f"coldset's experts op never ran) for: {', '.join(failed)} "
                              f"(report {layout.results / 'parity' / layout.model / 'vllm.json'})")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--worker":
        sys.exit("usage: python -m coldset.workflow.vllm_parity --worker JOB.json RESULT.json")
    run_worker(sys.argv[2], sys.argv[3])
