"""The cache command (``python -m coldset.analysis.cache TRACE ...``, :func:`coldset.analysis.cache.main`) on
small traces written here: a trace it cannot replay is refused with the reason (exit 2, no traceback),
the printed recall lines say what they measured."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from coldset.analysis.cache import main
from coldset.core.trace import TraceMeta, write_trace

COLUMNS = ["request", "domain", "position", "phase", "layer", "rank", "expert", "split"]


def toy_trace(path, *, decode_steps: int = 5, requests: int = 6, seed: int = 0, experts: int = 6):
    """A trace of ``requests`` requests (every third held out, domains "a" / "b" alternating), each a
    prefill of 4 tokens then ``decode_steps`` decode tokens, 2 MoE layers (0 and 2) x top-2."""
    meta = TraceMeta("toy", num_layers=3, num_experts=experts, top_k=2, moe_layers=[0, 2], source="test")
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(requests):
        split = "heldout" if r % 3 == 0 else "profile"
        for pos in range(4 + decode_steps):
            phase = "prefill" if pos < 4 else "decode"
            for layer in (0, 2):
                ex = rng.choice(experts, 2, replace=False)
                rows += [(f"r{r}", "ab"[r % 2], pos, phase, layer, rank, int(ex[rank]), split) for rank in range(2)]
    return write_trace(path, meta, pa.Table.from_pandas(pd.DataFrame(rows, columns=COLUMNS), preserve_index=False))


@pytest.mark.parametrize("extra", [[], ["--policies", "static", "lru"], ["--profile-domains", "a"], ["--recall"],
                                   ["--replay-domains", "b", "--policies", "lfu"]])
def test_a_prefill_only_trace_is_refused_with_the_reason(tmp_path, capsys, extra):
    """No decode rows: exit 2 and one line naming the trace, the missing decode rows and what to do;
    never an empty table with exit 0, nor a traceback."""
    path = toy_trace(tmp_path / "prefill.parquet", decode_steps=0)
    assert main([str(path), *extra]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0]
    assert str(path) in lines[0] and "no decode rows" in lines[0] and "capture decode routing" in lines[0]


def test_an_empty_split_is_refused_and_a_decode_trace_prints_its_table(tmp_path, capsys):
    """A selection without decode rows (every request in the profile split) is refused naming the
    flag that chooses it; a trace with decode rows prints one row per policy and residency."""
    path = toy_trace(tmp_path / "t.parquet")
    assert main([str(path), "--policies", "static", "lru", "--residency", "0.5"]) == 0
    out, _ = capsys.readouterr()
    table = pd.read_csv(io.StringIO(out))
    assert table.policy.tolist() == ["static", "lru"] and (table.tokens == 2 * 5).all()
    assert main([str(path), "--replay-domains", "c"]) == 2
    assert "domain(s) ['c'] have no decode rows" in capsys.readouterr().err
    assert main([str(path), "--replay-domains", "a", "--profile-domains", "a", "--policies", "static"]) == 0
    capsys.readouterr()
    meta = TraceMeta("toy", num_layers=3, num_experts=6, top_k=2, moe_layers=[0, 2], source="test")
    one = pd.read_parquet(path)
    one["split"] = "profile"
    only_profile = write_trace(tmp_path / "p.parquet", meta, pa.Table.from_pandas(one, preserve_index=False))
    assert main([str(only_profile), "--policies", "static"]) == 2
    err = capsys.readouterr().err
    assert "replay selection has no decode rows" in err and "--replay-domains" in err
