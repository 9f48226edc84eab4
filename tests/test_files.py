"""Result files: the umask's modes, and orphans of killed writers cleaned by the next write (issue 16)."""

import os
import stat

import numpy as np
import pytest

from coldset.core.files import remove_orphans, write_json


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_results_respect_the_umask(tmp_path, umask_022):
    """Once 0600 files (mkstemp) and a 0700 model folder (mkdtemp) under umask 022."""
    from coldset.core.placement import load_placement, save_placement
    from coldset.trace.importers import import_trace
    from coldset.core.trace import RequestRows, TraceMeta, TraceWriter
    from coldset.engine.synthetic import SyntheticSpec, write_synthetic_checkpoint

    assert _mode(write_json(tmp_path / "a.json", {})) == 0o644
    meta = TraceMeta("toy", num_layers=2, num_experts=4, top_k=1, moe_layers=[0, 1], source="t")
    with TraceWriter(tmp_path / "t.parquet", meta, with_weight=False, with_split=False) as w:
        w.add(RequestRows("r", "d", np.zeros((2, 2, 1), np.int16), 1))
    assert _mode(tmp_path / "t.parquet") == 0o644
    import_trace(tmp_path / "t.parquet", tmp_path / "copy.parquet")
    assert _mode(tmp_path / "copy.parquet") == 0o644
    ckpt = write_synthetic_checkpoint(SyntheticSpec(layers=1, experts=4, top_k=1, hidden=32, moe_intermediate=16,
                                                    heads=2, kv_heads=1, head_dim=16, vocab_size=300),
                                      tmp_path / "hf")
    assert _mode(ckpt) == 0o755 and _mode(ckpt / "model.safetensors") == 0o644
    from coldset.engine.model import ModelConfig
    from coldset.analysis.placement import place
    import pandas as pd

    cfg = ModelConfig.from_pretrained(ckpt)
    hist = pd.DataFrame([{"domain": "d", "split": "profile", "phase": "decode", "layer": l, "expert": e, "count": e + 1}
                         for l in cfg.moe_layers for e in range(cfg.num_experts)])
    path = save_placement(place(hist, cfg, "usage_global", 0.5), tmp_path / "usage_global-0.5.json")
    assert _mode(path) == 0o644 and _mode(tmp_path / "usage_global-0.5.rowmap.npy") == 0o644
    assert load_placement(path).num_hot == 2


def test_next_write_removes_orphans_of_a_killed_one(tmp_path):
    target = tmp_path / "skew.json"
    orphans = [tmp_path / ".skew.json.abc123.tmp", tmp_path / "skew.json.x9.tmp"]
    for o in orphans:
        o.write_text("half")
    (tmp_path / ".hf.tmp-q1").mkdir()
    (tmp_path / ".hf.tmp-q1" / "model.safetensors").write_text("half")
    others = [tmp_path / "other.json.x.tmp", tmp_path / "skew.json.bak"]
    for o in others:
        o.write_text("not ours")
    write_json(target, {"a": 1})
    assert not any(o.exists() for o in orphans) and all(o.exists() for o in others)
    assert remove_orphans(tmp_path / "hf") == [tmp_path / ".hf.tmp-q1"] and not (tmp_path / ".hf.tmp-q1").exists()
