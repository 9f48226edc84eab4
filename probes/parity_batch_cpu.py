# Probe, not a tool: the issue 16 experiment that chose the parity batch size on the CPU.
"""Parity decode time on the default synthetic model and fixtures, CPU: batch 8 (the old default) vs every
fixture in one batch (issue 16). Usage: PYTHONPATH=src python probes/parity_batch_cpu.py [threads]"""

import sys
import time
from pathlib import Path

import torch

from coldset.verify import gate
from coldset.workflow import pipeline
from coldset.workflow.config import validate_config
from coldset.trace.fixtures import make_fixtures, read_fixtures
from coldset.engine.generate import encode_prompts
from coldset.engine.loading import load_model, load_tokenizer
from coldset.engine.synthetic import SyntheticSpec, write_synthetic_checkpoint

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
root = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/coldset-parity-batch")
cfg = validate_config({"results": str(root / "results")})
fx = cfg["fixtures"]
paths = make_fixtures(root / "results/fixtures", fx["domains"], fx["per_domain"], fx["heldout_fraction"], fx["max_new_tokens"], fx["seed"])
ck = root / "hf"
if not (ck / "config.json").exists():
    write_synthetic_checkpoint(SyntheticSpec(), ck, domain_texts=pipeline._domain_texts(cfg))
m, tok = load_model(ck, device="cpu", dtype=torch.float32), load_tokenizer(ck)
prompts = encode_prompts(tok, [f.prompt for f in read_fixtures(paths)])
n = cfg["parity"]["max_new_tokens"]
for bs in (8, len(prompts)):
    t0 = time.perf_counter()
    d = gate.reference_decode(m, prompts, n, bs, progress=False)
    print(f"batch {bs}: {len(prompts)} prompts x {n} new tokens: {time.perf_counter() - t0:.1f} s", flush=True)
