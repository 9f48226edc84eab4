"""The report's cold path: each cache-simulation row's (in place, raw fills, compressed fills) and, where
the cache stage timed the compressed host tier (config cache.compressed_tier), the speed model's pick for
this model's experts with the rates, ratio and decoder it used, on the cache stage's real output."""

import html as htmllib
import json
import re

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from coldset.analysis.cache import run_cache
from coldset.analysis.stats import run_stats
from coldset.analysis.time_model import DEFAULT_COMPRESSED_RATIOS
from coldset.core.trace import TraceMeta, write_trace
from coldset.reporting.report import render_report
from coldset.reporting.results import ReportInputError
from test_cache import TINY_SHAPE
from test_report import CONFIG, GIB_PER_EXPERT, MACHINE, MODEL, build_results_tree


DECODE_GB_S = 200.0


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """The cache stage's simulation.csv (:func:`cache_stage`), once for the module."""
    return cache_stage(tmp_path_factory.mktemp("cache"))


def cache_stage(tmp_path):
    """The cache stage (policies static, lru) on a tiny trace, with the compressed tier timed."""
    meta = TraceMeta("toy", num_layers=3, num_experts=8, top_k=2, moe_layers=[0, 2], source="test")
    rng = np.random.default_rng(5)
    rows = []
    for i in range(8):
        for pos in range(int(rng.integers(3, 9))):
            for layer in (0, 2):
                ex = rng.choice(8, size=2, replace=False, p=np.r_[0.4, 0.2, 0.1, [0.3 / 5] * 5])
                rows += [(f"q{i}", "x" if i < 4 else "y", pos, "decode", layer, r, int(ex[r]),
                          "heldout" if i % 2 else "profile") for r in range(2)]
    df = pd.DataFrame(rows, columns=["request", "domain", "position", "phase", "layer", "rank", "expert", "split"])
    trace = write_trace(tmp_path / "t.parquet", meta, pa.Table.from_pandas(df, preserve_index=False))
    stats = run_stats(trace, tmp_path / "stats", figures=False, progress=False)
    paths = run_cache(trace, stats["histogram"], TINY_SHAPE, tmp_path / "cache", ["static", "lru"], [0.5],
                      ["x", "y"], figures=False, time={"steps": [{"batch": 1, "all_hbm_step_ms": 2.0}]},
                      compressed={"decode_gb_s": DECODE_GB_S})
    return pd.read_csv(paths["simulation"])


def pipeline_s(n, size, ratio, link, decode):
    """n experts filled compressed one after another: copy j + 1 beside decode j (brute force clock)."""
    copy_end, decode_end = [], []
    for j in range(n):
        copy_end.append((j + 1) * ratio * size / (link * 1e9))
        decode_end.append(max(copy_end[j], decode_end[-1] if decode_end else 0.0) + size / (decode * 1e9))
    return decode_end[-1]


def rendered(tmp_path, table, config, manifest=True):
    """The report over a CPU run's results tree with ``table`` as the cache stage's output (the skew
    file naming its trace, as the stats stage writes it; the model manifest with the experts' format)."""
    res = build_results_tree(tmp_path / "tree", bytes_run="cpu")
    skew_path = res / "stats" / MODEL / "skew.json"
    skew = json.loads(skew_path.read_text())
    skew["trace"] = {"model": MODEL, "num_layers": 3, "num_experts": 8, "top_k": 2, "moe_layers": [0, 2]}
    skew_path.write_text(json.dumps(skew))
    (res / "cache" / MODEL).mkdir(parents=True)
    table.to_csv(res / "cache" / MODEL / "simulation.csv", index=False)
    if manifest:
        (res / "model" / MODEL).mkdir(parents=True)
        (res / "model" / MODEL / "manifest.json").write_text(json.dumps({"name": MODEL,
                                                                         "experts_format": "bfloat16"}))
    return res, render_report(res, res / "report" / "index.html", config, MACHINE).read_text()


def test_report_names_each_rows_cold_path_and_the_speed_models_pick(tmp_path, table):
    assert sorted(set(zip(table.policy, table.host_tier))) == [("lru", "compressed"), ("lru", "raw"),
                                                             ("static", "compressed"), ("static", "raw")]
    config = {**CONFIG, "cache": {"compressed_tier": {"decode_gb_s": DECODE_GB_S}}}
    res, html = rendered(tmp_path, table, config)
    cells = re.findall(r'<tr><td>(\w+)</td><td class="num">[^<]*</td>.*?<td>([a-z ]+)</td></tr>',
                       html.split('id="cache-table"')[1].split("</table>")[0])
    want = {("static", "in place"), ("lru", "raw fills"), ("lru", "compressed fills")}
    assert len(cells) == len(table) and set(cells) == want

    # the pick, by hand: a layer's misses of the best raw lru row, each read once, on the CPU
    skew = json.loads((res / "stats" / MODEL / "skew.json").read_text())
    layers = len(skew["trace"]["moe_layers"])
    lru = table[(table.policy == "lru") & (table.host_tier == "raw")].iloc[0]
    n = max(1, round(lru.misses_per_token * lru.batch / layers))
    size, link, hbm, ratio = GIB_PER_EXPERT * 2**30, 51.0, 3400.0, DEFAULT_COMPRESSED_RATIOS["bfloat16"]
    times = {"in place": n * size / (link * 1e9), "raw fills": n * size / (link * 1e9) + n * size / (hbm * 1e9),
             "compressed fills": pipeline_s(n, size, ratio, link, DECODE_GB_S) + n * size / (hbm * 1e9)}
    choice = min(times, key=times.get)
    assert choice == "compressed fills"  # 200 GB/s decode is about 4x the link at 0.676
    para = htmllib.unescape(re.search(r'<p id="cold-path">(.*?)</p>', html, re.S).group(1))
    assert para.startswith(f"Cold path (speed model, estimate): {choice} for a layer's {n} missed expert")
    assert "link 51 GB/s and HBM 3400 GB/s of the speed model's h200 preset" in para
    assert f"compressed/raw {ratio}, decoder 200 GB/s" in para
    for words, s in times.items():
        shown = re.search(rf"{words} ([\d.]+) (ms|µs)", para)
        assert float(shown.group(1)) * (1e-3 if shown.group(2) == "ms" else 1e-6) == pytest.approx(s, rel=2e-3)
    # the answer at the top: the best simulated row and its cold path (here the static set, read in
    # place; then, with the static rows slowed, lru's fastest tier), the pick labelled an estimate
    def answer_of(page):
        return htmllib.unescape(re.search(r'<tr data-budget="0.5".*?</tr>', page, re.S).group(0))

    assert table.loc[table.step_ms.idxmin()].policy == "static"
    answer = answer_of(html)
    assert "the cache simulation at batch 1: static (in place) best" in answer
    assert "the speed model picks compressed fills for this model's experts (estimate)" in answer
    slow = table.assign(step_ms=np.where(table.policy == "static", 3.0, table.step_ms))
    best = slow.loc[slow.step_ms.idxmin()]
    path = {"raw": "raw fills", "compressed": "compressed fills"}[best.host_tier]
    answer = answer_of(rendered(tmp_path / "slow", slow, config)[1])
    assert f"the cache simulation at batch 1: lru ({path}) best" in answer
    assert "; the static set, read in place, 3)" in answer


def test_the_pick_needs_the_tiers_config_and_says_why_without_the_experts_format(tmp_path, table):
    _, html = rendered(tmp_path / "a", table, {**CONFIG, "cache": {"compressed_tier": {"decode_gb_s": 1.0}}},
                       manifest=False)
    assert "Cold path: no speed-model pick (the experts&#39; format is not recorded" in html
    with pytest.raises(ReportInputError, match="cache.compressed_tier is off"):
        rendered(tmp_path / "b", table, CONFIG)
    # a slow decoder: in place wins, and the raw tier's rows alone carry no pick
    _, html = rendered(tmp_path / "c", table, {**CONFIG, "cache": {"compressed_tier": {"decode_gb_s": 1.0}}})
    assert re.search(r'<p id="cold-path">Cold path \(speed model, estimate\): in place ', html)
    _, html = rendered(tmp_path / "d", table[table.host_tier == "raw"].drop(columns="host_tier"), CONFIG)
    assert 'id="cold-path"' not in html and "<td>raw fills</td>" in html
