"""``python -m coldset cold-experts``: per layer, the experts a placement keeps in host memory.

The reference is the row map itself, read with numpy: a layer's cold experts are the columns of
its negative entries (docs/design.md §3). The placements are made by the placement stage's own
``place`` and written by ``save_placement``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from coldset.analysis.placement import place
from coldset.cli import main
from coldset.core.placement import save_placement
from coldset.core.shapes import MoEShape

LAYERS, EXPERTS = (1, 3, 4), 6


def _placements(results: Path) -> Path:
    """usage_global and positional at 0.5 and 1.0 of a 3-MoE-layer, 6-expert model, under
    ``results/placement/toy/`` as the workflow lays them out."""
    shape = MoEShape(model_type="qwen3_moe", num_layers=5, moe_layers=LAYERS, num_experts=EXPERTS, top_k=2,
                     hidden_size=8, moe_intermediate_size=4, intermediate_size=0, vocab_size=16, num_heads=2,
                     num_kv_heads=1, head_dim=4, tie_word_embeddings=False, qk_norm=False)
    rng = np.random.default_rng(0)
    rows = [(d, split, "decode", layer, e, int(rng.integers(1, 50)))
            for d in ("a", "b") for split in ("profile", "heldout") for layer in LAYERS for e in range(EXPERTS)]
    hist = pd.DataFrame(rows, columns=["domain", "split", "phase", "layer", "expert", "count"])
    folder = results / "placement" / "toy"
    for policy in ("usage_global", "positional"):
        for r in (0.5, 1.0):
            save_placement(place(hist, shape, policy, r, batch_sizes=(), model="toy"), folder / f"{policy}-{r}.json")
    return folder


def _printed(capsys, *argv: str) -> dict[str, dict[int, list[int]]]:
    """The command's output as {placement: {layer: cold ids}}."""
    assert main(["cold-experts", *argv]) == 0
    out: dict[str, dict[int, list[int]]] = {}
    name = None
    for line in capsys.readouterr().out.splitlines():
        if not line.startswith(" "):
            name = line.split(":", 1)[0]
            out[name] = {}
            continue
        layer, ids = re.fullmatch(r"\s+layer\s+(\d+): (.*)", line).groups()
        out[name][int(layer)] = [] if ids == "-" else [int(i) for i in ids.split()]
    return out


def _negative_rows(npy: Path) -> dict[int, list[int]]:
    row_map = np.load(npy)
    return {layer: np.nonzero(row_map[i] < 0)[0].tolist() for i, layer in enumerate(LAYERS)}


def test_cold_experts_are_the_row_maps_negative_entries(tmp_path, capsys):
    folder = _placements(tmp_path / "results")
    every = _printed(capsys, str(tmp_path / "results"))
    assert sorted(every) == sorted(f"{p}-{r}" for p in ("positional", "usage_global") for r in (0.5, 1.0))
    for name, layers in every.items():
        assert layers == _negative_rows(folder / f"{name}.rowmap.npy"), name
    assert sum(map(len, every["usage_global-0.5"].values())) == len(LAYERS) * EXPERTS // 2
    assert all(ids == [] for ids in every["usage_global-1.0"].values())
    # --budget keeps that residency's placements; a JSON or a row map names one placement
    assert sorted(_printed(capsys, str(tmp_path / "results"), "--budget", "0.5")) == ["positional-0.5",
                                                                                      "usage_global-0.5"]
    one = _printed(capsys, str(folder / "usage_global-0.5.json"))
    assert one == {"usage_global-0.5": _negative_rows(folder / "usage_global-0.5.rowmap.npy")}
    assert _printed(capsys, str(folder / "usage_global-0.5.rowmap.npy")) == one
    assert _printed(capsys, str(folder), "--budget", "0.50") == _printed(capsys, str(tmp_path / "results"),
                                                                         "--budget", "0.5")


@pytest.mark.parametrize("case", ["missing", "sha", "not_placement", "budget", "empty_dir", "bad_budget", "yaml"])
def test_bad_input_is_refused_naming_the_file(tmp_path, capsys, case):
    folder = _placements(tmp_path / "results")
    target, extra = folder / "usage_global-0.5.json", []
    if case == "missing":
        target = folder / "lru-0.5.json"
        expect = str(target)
    elif case == "sha":
        npy = folder / "usage_global-0.5.rowmap.npy"
        np.save(npy, np.load(npy)[:, ::-1].copy())  # a valid map, not the one the JSON recorded
        expect = f"{npy}: sha256 differs"
    elif case == "not_placement":
        target = folder / "other-0.5.json"
        target.write_text('{"hello": 1}')
        expect = f"{target}: missing field"
    elif case == "budget":
        target, extra, expect = tmp_path / "results", ["--budget", "0.25"], "no placement at budget 0.25"
    elif case == "empty_dir":
        target = tmp_path / "nothing"
        target.mkdir()
        expect = f"{target}: no placement"
    elif case == "bad_budget":
        extra, expect = ["--budget", "half"], "--budget 'half': not a residency"
    else:
        target = tmp_path / "config.yaml"
        target.write_text("model: {}\n")
        expect = f"{target}: not a placement JSON"
    assert main(["cold-experts", str(target), *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith("coldset cold-experts: ") and expect in err, err
    assert "Traceback" not in err
