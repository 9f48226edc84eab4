"""Runs coldset.serve.vllm_backend in its own process for tests_vllm (vLLM spawns processes and sets
global state, so it never runs inside pytest's process).

    python run_vllm_capture.py JOB.json RESULT.json

JOB.json: ``{"runs": [{"model_dir", "fixtures", "out", "tokens_out", "method"}...],
"refuse_routed_experts": model_dir or null, "expect_refused": {name: {"model_dir", "llm_kwargs"}} (optional)}``.
RESULT.json gets the seconds each run took; for ``refuse_routed_experts``, the error vLLM gave when
asked for its routed-experts output; for each ``expect_refused`` folder, the capture's error (None
if it ran) and its seconds, its trace asked for at ``<first run's folder>/<name>.refused.parquet``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(job_path: str, result_path: str) -> None:
    from coldset.serve.vllm_backend import VllmCaptureError, capture_routing_vllm

    job = json.loads(open(job_path).read())
    result = {"runs": []}
    for run in job["runs"]:
        t0 = time.perf_counter()
        capture_routing_vllm(run["model_dir"], [run["fixtures"]], run["out"], dtype="float32",
                             method=run["method"], tokens_out=run["tokens_out"], progress=False)
        result["runs"].append({"out": run["out"], "seconds": time.perf_counter() - t0})
    if job.get("refuse_routed_experts"):
        run = job["runs"][0]
        try:
            capture_routing_vllm(job["refuse_routed_experts"], [run["fixtures"]], run["out"] + ".refused",
                                 dtype="float32", method="routed_experts", progress=False)
            result["routed_experts_error"] = None
        except VllmCaptureError as err:
            result["routed_experts_error"] = str(err)
    result["refused"] = {}
    for name, ask in job.get("expect_refused", {}).items():
        run = job["runs"][0]
        t0 = time.perf_counter()
        try:
            capture_routing_vllm(ask["model_dir"], [run["fixtures"]],
                                 str(Path(run["out"]).parent / f"{name}.refused.parquet"), dtype="float32",
                                 llm_kwargs=ask.get("llm_kwargs"), progress=False)
            error = None
        except VllmCaptureError as err:
            error = str(err)
        result["refused"][name] = {"error": error, "seconds": time.perf_counter() - t0}
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
