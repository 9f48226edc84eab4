"""bench cache's warm-up of a ``torch.compile``d decode region (coldset.measure.cache.warm_compiled_region):
one discarded decode of the unmodified path per batch size in use, on the prompts that batch size's all-HBM
reference decodes, and none where Dynamo compiles no decode region. The decode itself needs CUDA; here it is
replaced by a recorder, so the test checks what is asked of it, not the graphs (tests/test_gate.py checks
those on the CPU with a recording torch.compile backend)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from coldset.bench import decode as bn
from coldset.measure import cache as measure_cache


@pytest.mark.parametrize("compiled", [True, False], ids=["dynamo", "not-dynamo"])
def test_one_discarded_reference_decode_per_batch_size_where_dynamo_compiles(monkeypatch, compiled):
    calls = []

    def recording_decode(c, experts_fn, pools, bsz, prompts, passes, cache=None, record=False):
        calls.append(dict(experts_fn=experts_fn, pools=pools, bsz=bsz, prompts=prompts, passes=passes, cache=cache,
                          record=record))
        return [{}]

    monkeypatch.setattr(measure_cache, "decode", recording_decode)
    model = SimpleNamespace(decode_is_dynamo_compiled=compiled, pools=object())
    run = SimpleNamespace(model=model, ref_fn=object())
    heldout = list(range(3, 70))  # shorter than 8 prompts: bench_prompts repeats it

    runs = measure_cache.warm_compiled_region(run, heldout, [8, 1, 8])

    if not compiled:
        assert runs == 0 and calls == []
        return
    assert runs == 2
    assert [c["bsz"] for c in calls] == [1, 8]  # each batch size once
    for c in calls:
        assert c["experts_fn"] is run.ref_fn and c["pools"] is model.pools  # the unmodified path
        assert c["passes"] == 1 and c["cache"] is None and not c["record"]
        # the prompts the batch size's all-HBM reference decodes (all_hbm_batch cuts them the same way)
        assert torch.equal(c["prompts"], bn.bench_prompts(heldout, c["bsz"], measure_cache.PROMPT_TOKENS))
