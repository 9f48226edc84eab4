"""The HTML report: rendered from a small synthetic results tree, then opened in headless Chromium.

The tree follows the stage file contracts (DESIGN.md §1, §6, docs/architecture.md). Chromium is
the independent reference for "every figure renders": the page's own inline script records how
many images decoded (naturalWidth > 0) and which sections are empty, and ``--dump-dom`` returns
the DOM after the load event. A second page with a corrupted image and an emptied section proves
the check can fail.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from coldset.analysis.placement import row_map_from_mask

from coldset.core.layout import Layout
from coldset.reporting.report import render_report
from coldset.reporting.results import (
    BENCH_METRICS,
    ReportInputError,
    load_bench,
    load_skew,
    placement_key_from_path,
)
from coldset.core.trace import TraceMeta
from coldset.analysis.stats import skew_stats

MODEL = "tiny-moe"
POLICIES = ["positional", "usage_global"]
RESIDENCIES = [0.5, 1.0]
BATCH_SIZES = [1, 4]
LAYERS, EXPERTS = 3, 8
GIB_PER_EXPERT = 0.125

CONFIG = {
    "model": {"name": MODEL, "dtype": "bfloat16"},
    "device": "cpu",
    "routing": {"batch_size": 8},
    "placement": {"policies": POLICIES, "residency": RESIDENCIES},
    "bench": {"batch_sizes": BATCH_SIZES},
}
MACHINE = {"device": "cpu", "torch": "2.13.0", "cpu": "Test CPU", "gpu": "none"}


NONEXPERT_GIB = 0.75


def _row_map(policy: str, num_hot: int) -> np.ndarray:
    """The tree's row map: positional keeps the first layers whole; usage_global the most used
    experts (the histogram's expert e of a layer is selected (e+1)^2 times for code, so the
    highest ids), spread over the layers."""
    if policy == "positional":
        hot = np.arange(LAYERS * EXPERTS).reshape(LAYERS, EXPERTS) < num_hot
    else:
        rank = np.argsort(np.argsort(-np.tile(np.arange(EXPERTS), (LAYERS, 1)).T.reshape(-1), kind="stable"))
        hot = (rank < num_hot).reshape(EXPERTS, LAYERS).T
    return row_map_from_mask(hot)


def _tok_s(policy: str, residency: float, batch: int) -> float:
    base = 100.0 if policy == "usage_global" else 60.0
    return base * residency + 20.0 / batch


# Read ceilings of the GPU-like tree (GB/s), as coldset.bench.decode.measure_ceilings reports them.
HBM_GB_S, LINK_GB_S = 4000.0, 50.0


def _hbm_gb_per_token(residency: float) -> float:
    return 0.05 + 0.01 * residency


def bytes_fields(policy: str, residency: float, batch: int) -> dict[str, float]:
    """The GPU-like tree's bytes metrics, by their definitions (coldset.bench.decode.derive_metrics'
    docstring) written out here: floor = HBM bytes / HBM rate + link bytes / link rate; calibrated
    = the policy's residency-1.0 step + the cold bytes' time over the link instead of HBM."""
    step = 1000.0 / _tok_s(policy, residency, batch)
    hbm_gb, link_gb = _hbm_gb_per_token(residency) * batch, 0.01 * (1.0 - residency) * batch
    floor = 1e3 * (hbm_gb / HBM_GB_S + link_gb / LINK_GB_S)
    return {
        "hbm_gb_per_token": _hbm_gb_per_token(residency),
        "bytes_step_ms": floor,
        "fraction_of_bytes_bound": floor / step,
        "predicted_step_ms_calibrated": 1000.0 / _tok_s(policy, 1.0, batch) + 1e3 * link_gb * (1 / LINK_GB_S - 1 / HBM_GB_S),
    }


def time_fields(policy: str, residency: float, batch: int) -> dict:
    """The GPU-like tree's time bound (issue 28), by its definitions written out here: the all-HBM
    step is usage_global-1.0's at the batch size, link time = link bytes a step / the link rate."""
    step = 1000.0 / _tok_s(policy, residency, batch)
    allhbm = 1000.0 / _tok_s("usage_global", 1.0, batch)
    link_ms = 1e3 * 0.01 * (1.0 - residency) * batch / LINK_GB_S
    bound = max(allhbm, link_ms)
    return {"allhbm_step_ms": allhbm, "bound_ms": bound, "bound_fraction": bound / step,
            "overlap": 1 - (step - allhbm) / link_ms if link_ms else None, "stall_ms_per_token": (step - allhbm) / batch,
            "wasted_gb_per_token": None, "allhbm_placement": "usage_global-1.0"}


# The provenance the bench stage records (coldset.bench.provenance.collect_provenance) on the machine
# that measured: track and the report must show these, not their own machine's state.
PROVENANCE = {"commit": "4b825dc642cb6eb9a060e54bf8d69288fbee4904", "dirty": False, "commit_source": "git archive",
              "torch": "2.11.0+cu130", "triton": "3.6.0", "python": "3.12.3", "cuda": "13.0", "driver": "580.95.05",
              "device": "NVIDIA H200", "capability": "9.0", "device_type": "cuda", "autotune_key": "abc123",
              "autotune_hit": False, "ceilings": {"hbm_read_gb_s": 4500.0, "link_read_gb_s": 51.0}}


def build_results_tree(root: Path, *, with_autotune: bool = True, with_prediction: bool = True,
                       bytes_run: str = "absent", provenance: bool = True) -> Path:
    """A complete, small results tree as the producing stages write it.

    ``bytes_run``: ``"absent"``, bench files from before the bench wrote the bytes metrics and
    ceilings; ``"cpu"``, a CPU bench (hbm_gb_per_token filled, the ceiling-derived metrics and
    ``ceilings`` null); ``"gpu"``, a CUDA bench (all filled, ceilings measured, device H200).
    """
    assert bytes_run in ("absent", "cpu", "gpu")
    res = root / "results"
    layout = Layout(results=res, model=MODEL)
    stats = layout.stats_dir
    stats.mkdir(parents=True)
    rows = []
    for domain in ("code", "prose"):
        for split in ("profile", "heldout"):
            for phase in ("prefill", "decode"):
                for layer in range(LAYERS):
                    for expert in range(EXPERTS):
                        # skewed: expert e gets (e+1)^2 selections, shifted per domain
                        e = (expert + (3 if domain == "prose" else 0)) % EXPERTS
                        rows.append((domain, split, phase, layer, expert, (e + 1) ** 2))
    hist = pd.DataFrame(rows, columns=["domain", "split", "phase", "layer", "expert", "count"])
    hist.to_csv(stats / "histogram.csv", index=False)
    # skew.json exactly as the stats stage writes it (no oracle: that needs a trace)
    meta = TraceMeta(model=MODEL, num_layers=LAYERS, num_experts=EXPERTS, top_k=2, moe_layers=list(range(LAYERS)))
    (stats / "skew.json").write_text(json.dumps(skew_stats(hist, meta), allow_nan=False))
    for stage in ("placement", "parity", "bench"):
        (res / stage / MODEL).mkdir(parents=True)
    total = LAYERS * EXPERTS
    for policy in POLICIES:
        for r in RESIDENCIES:
            num_hot = int(round(total * r))
            name = layout.placement(policy, r).name
            row_map = _row_map(policy, num_hot)
            npy = layout.placement(policy, r).with_name(name[: -len(".json")] + ".rowmap.npy")
            np.save(npy, row_map)
            layout.placement(policy, r).write_text(
                json.dumps(
                    {
                        "format_version": 1,
                        "model": MODEL,
                        "policy": policy,
                        "residency": r,
                        "achieved_residency": num_hot / total,
                        "num_hot": num_hot,
                        "num_cold": total - num_hot,
                        "moe_layers": list(range(LAYERS)),
                        "num_experts": EXPERTS,
                        "row_map_file": npy.name,
                        "row_map_sha256": hashlib.sha256(npy.read_bytes()).hexdigest(),
                        "bytes_per_expert": int(GIB_PER_EXPERT * 2**30),
                        "profile": {"split": "profile", "domains": None, "phase": "decode", "weighting": "none"},
                        "nonexpert_gib": NONEXPERT_GIB,
                        "hbm_expert_gib": num_hot * GIB_PER_EXPERT,
                        "host_expert_gib": (total - num_hot) * GIB_PER_EXPERT,
                        "coverage_profile": min(1.0, r * (1.5 if policy == "usage_global" else 1.0)),
                        "coverage_heldout": min(1.0, r * (1.4 if policy == "usage_global" else 1.0)),
                        "predictions": [
                            {"preset": "h200", "batch_size": b, "hbm_gb_s": 3400.0, "link_gb_s": 51.0, "hbm_bytes": 3.4e6,
                             "link_bytes": 5.1e4, "expected_hot_experts": 1.0, "expected_cold_experts": 1.0,
                             "hbm_s": 0.001, "link_s": 0.001, "step_s_lower": 0.001, "step_s_sum": 0.002,
                             "tok_s_lower": 1000.0 * b, "tok_s_sum": 500.0 * b}
                            for b in BATCH_SIZES
                        ],
                    }
                )
            )
            layout.parity(policy, r).write_text(
                json.dumps(
                    {
                        "placement": name,
                        "passed": True,
                        "tokens_matched": 96,
                        "tokens_total": 96,
                        "mismatches": [],
                        "max_abs_logit_diff": 0.0,
                        "device": "cpu",
                        "dtype": "bfloat16",
                    }
                )
            )
            batches = []
            for b in BATCH_SIZES:
                tok_s = _tok_s(policy, r, b)
                batches.append(
                    {
                        "batch_size": b,
                        "tok_s": tok_s,
                        "step_ms_mean": 1000.0 / tok_s,
                        "step_ms_p50": 950.0 / tok_s,
                        "step_ms_p90": 1100.0 / tok_s,
                        "repeat_spread": 1.02,
                        "prefill_ms": 12.5,
                        "hbm_expert_gib": num_hot * GIB_PER_EXPERT,
                        "host_expert_gib": (total - num_hot) * GIB_PER_EXPERT,
                        "cold_share": 1.0 - r,
                        "link_gb_per_token": 0.01 * (1.0 - r),
                        "tok_s_per_gib": None if r == RESIDENCIES[0] else (tok_s - _tok_s(policy, RESIDENCIES[0], b))
                        / ((r - RESIDENCIES[0]) * total * GIB_PER_EXPERT),
                        "fetch_tax": 1.0 - tok_s / _tok_s(policy, 1.0, b),
                        "predicted_step_ms": (900.0 / tok_s) if with_prediction else None,
                        "predicted_step_ms_sum": (1000.0 / tok_s) if with_prediction else None,
                        "predicted_preset": "h200" if with_prediction else None,
                        "device": "cpu",
                        "dtype": "bfloat16",
                        # the rest of coldset.bench.decode.BenchResult
                        "placement": name[: -len(".json")],
                        "policy": policy,
                        "residency": r,
                        "prompt_tokens": 64,
                        "new_tokens": 32,
                        "repeats": 3,
                        "backend": "torch",
                        "graphed": False,
                        "routing_source": "router",
                        "timed_token_match": 1.0,
                        "prompt_split": "heldout",
                    }
                )
                if bytes_run == "cpu":
                    batches[-1].update(hbm_gb_per_token=_hbm_gb_per_token(r), bytes_step_ms=None,
                                       fraction_of_bytes_bound=None, predicted_step_ms_calibrated=None)
                elif bytes_run == "gpu":
                    batches[-1].update(bytes_fields(policy, r, b), **time_fields(policy, r, b), device="NVIDIA H200")
            doc = {"placement": name[: -len(".json")], "batches": batches}
            if provenance:
                doc["provenance"] = PROVENANCE
            if bytes_run != "absent":
                doc["ceilings"] = (
                    {"hbm_read_gb_s": HBM_GB_S, "link_read_gb_s": LINK_GB_S} if bytes_run == "gpu" else None
                )
            layout.bench(policy, r).write_text(json.dumps(doc))
    if with_autotune:
        (res / "autotune").mkdir()
        # a coldset.kernels.tune cache entry as the autotune rule copies it, plus the hit flag
        (res / "autotune" / f"{MODEL}.json").write_text(
            json.dumps({
                "key": "abc123", "hit": False, "backend": "triton", "created_utc": "2026-11-30T04:00:00Z",
                "shape": {"num_experts": EXPERTS}, "batch_sizes": BATCH_SIZES, "search_space": {},
                "device": {"type": "cuda", "name": "NVIDIA H200", "capability": "9.0", "driver": "580.1",
                           "torch": "2.11.0", "triton": "3.6.0"},
                "configs": {"1": {"BLOCK_M": 16, "num_warps": 4}, "4": {"BLOCK_M": 16, "num_warps": 8}},
                "timings_us": {}, "checksum": "0" * 64,
            })
        )
    return res


# ---------------------------------------------------------------- Chromium


def _chromium() -> str | None:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed but CI is set: install it (apt-get install -y chromium)")
        pytest.skip("headless Chromium not installed (apt-get install -y chromium); not in CI, so skipped")
    return path


def _dump_dom(chromium: str, html: Path, profile: Path) -> dict[str, str]:
    """Load ``html`` in headless Chromium and return the self-check attributes of <body>."""
    cmd = [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=5000",
        "--dump-dom", html.resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}): {proc.stderr[-2000:]}"
    body = re.search(r"<body([^>]*)>", proc.stdout)
    assert body, f"no <body> in the dumped DOM: {proc.stdout[:500]}"
    return dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body.group(1)))


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


def test_report_renders_every_figure_in_headless_chromium(tmp_path):
    chromium = _chromium()
    res = build_results_tree(tmp_path)
    out = render_report(res, res / "report" / "index.html", CONFIG, MACHINE, figures_dir=res / "report" / "figures")
    assert out == res / "report" / "index.html"
    html = out.read_text()

    # heatmap + lorenz + coverage + (residency + step time) per batch size
    expected_figures = 3 + 2 * len(BATCH_SIZES)
    assert _count(r'<img src="data:image/png;base64,', html) == expected_figures
    assert "http://" not in html and "https://" not in html, "the page must need no network"
    assert sorted(p.name for p in (res / "report" / "figures").glob("*.png")) == sorted(
        ["heatmap.png", "lorenz.png", "coverage.png"]
        + [f"residency-b{b}.png" for b in BATCH_SIZES]
        + [f"step-time-b{b}.png" for b in BATCH_SIZES]
    )
    # every figure states device, batch size and dtype
    assert _count(r'class="conditions">device: [^<]+ · batch size: [^<]+ · dtype: bfloat16<', html) == expected_figures
    for b in BATCH_SIZES:
        assert f"device: cpu · batch size: {b} · dtype: bfloat16" in html
    # a CPU bench plots no measured speed (its timings differ by noise) and so no tok/s-per-GiB
    # slope: the residency curve is the speed model's estimate (the GPU case, by hand, is
    # test_residency_slopes_only_where_measured_speed_compares_placements)
    assert "measured speeds would rank placements by timing noise and are not plotted" in html
    assert "+20 tok/s per GiB" not in html and "+33.3 tok/s per GiB" not in html
    # tables carry the data: every placement's parity row, the autotune entry, the machine
    for policy in POLICIES:
        for r in RESIDENCIES:
            assert f"<td>{Layout(res, MODEL).parity(policy, r).stem}</td>" in html
    assert "abc123" in html and "miss (tuned in this run)" in html and "NVIDIA H200 · 9.0" in html
    assert 'batch 4: {&#34;BLOCK_M&#34;: 16, &#34;num_warps&#34;: 8}' in html
    # the speed model's preset is named, and no CPU timing is compared with an H200 prediction
    assert "speed model on h200" in html and "are not compared with it" in html
    assert "Test CPU" in html and "2.13.0" in html

    check = _dump_dom(chromium, out, tmp_path / "profile")
    assert check.get("check") == "done", f"the page's self-check did not run: {check}"
    assert int(check["images-total"]) == expected_figures
    assert check["images-ok"] == check["images-total"], f"figures that did not decode: {check}"
    assert int(check["sections-total"]) == 11
    assert check["sections-empty"] == "", f"empty sections: {check['sections-empty']}"
    # without the locality statistic and the cache simulation the section says so
    assert "No locality statistic or cache simulation" in html
    assert "the model&#39;s own router" in html and "lift not measured" in html


def test_chromium_check_catches_a_broken_figure_and_an_empty_section(tmp_path):
    """The self-check is not vacuous: a corrupted image and an emptied section are reported."""
    chromium = _chromium()
    res = build_results_tree(tmp_path)
    html = render_report(res, tmp_path / "good.html", CONFIG, MACHINE).read_text()
    first = re.search(r'src="data:image/png;base64,([^"]+)"', html)
    corrupt = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"not a png at all" * 8).decode()
    html = html.replace(first.group(1), corrupt, 1)
    # empty the autotune section's body, keeping its heading
    html = re.sub(
        r'(<section id="autotune" data-section="autotune">\s*<h2>[^<]*</h2>).*?(</section>)',
        r"\1\2", html, count=1, flags=re.S,
    )
    bad = tmp_path / "bad.html"
    bad.write_text(html)
    check = _dump_dom(chromium, bad, tmp_path / "profile")
    assert int(check["images-ok"]) == int(check["images-total"]) - 1
    assert check["sections-empty"] == "autotune"


def test_optional_stages_say_so_instead_of_rendering_empty(tmp_path):
    res = build_results_tree(tmp_path, with_autotune=False, with_prediction=False)
    for path in Layout(res, MODEL).placement_dir.glob("*-*.json"):  # no speed-model preset at all
        path.write_text(json.dumps({**json.loads(path.read_text()), "predictions": []}))
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    assert "Autotune did not run" in html
    assert "No prediction to compare with" in html
    assert _count(r'<img src="data:image/png;base64,', html) == 3 + len(BATCH_SIZES)


def test_missing_required_input_is_an_error_naming_the_file(tmp_path):
    res = build_results_tree(tmp_path)
    missing = Layout(res, MODEL).parity("usage_global", 1.0)
    missing.unlink()
    out = res / "report" / "index.html"
    with pytest.raises(ReportInputError, match=re.escape(str(missing))):
        render_report(res, out, CONFIG, MACHINE)
    assert not out.exists(), "nothing half-written"

    res2 = build_results_tree(tmp_path / "b")
    bench = Layout(res2, MODEL).bench("positional", 0.5)
    doc = json.loads(bench.read_text())
    del doc["batches"][1]["cold_share"]
    bench.write_text(json.dumps(doc))
    with pytest.raises(ReportInputError, match=re.escape(f"{bench} (batch_size=4): missing field(s) cold_share")):
        render_report(res2, res2 / "report" / "index.html", CONFIG, MACHINE)

    res3 = build_results_tree(tmp_path / "c")
    (res3 / "stats" / MODEL / "histogram.csv").unlink()
    with pytest.raises(ReportInputError, match="histogram.csv"):
        render_report(res3, res3 / "report" / "index.html", CONFIG, MACHINE)


def test_failed_parity_is_shown_as_a_failure(tmp_path):
    res = build_results_tree(tmp_path)
    p = Layout(res, MODEL).parity("usage_global", 0.5)
    doc = json.loads(p.read_text())
    doc.update(passed=False, tokens_matched=95, mismatches=[{"fixture": "code-3", "position": 17, "expected": 11, "got": 42, "logit_gap": 0.03}])
    p.write_text(json.dumps(doc))
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    assert f"parity gate FAILED for {p.stem}" in html
    assert "code-3@17: expected 11, got 42" in html
    assert "95 / 96" in html


def test_loaders_read_the_bench_container_and_keep_the_join_key(tmp_path):
    assert placement_key_from_path("results/bench/m/usage_global-0.25.json") == ("m", "usage_global", "0.25")
    entry = {m: 1.0 for m in BENCH_METRICS} | {"device": "cpu", "dtype": "float32"}
    d = tmp_path / "m"
    d.mkdir()
    two = d / "permute-0.5.json"
    two.write_text(json.dumps({"policy": "permute", "batches": [entry | {"batch_size": 2}, entry | {"batch_size": 1}]}))
    assert [r.batch_size for r in load_bench(two)] == [1, 2]
    one = d / "permute-0.75.json"
    one.write_text(json.dumps({"batches": [entry | {"batch_size": 8, "tok_s_per_gib": None}]}))
    (r,) = load_bench(one)
    assert r.batch_size == 8 and r.metrics["tok_s_per_gib"] is None and r.metrics["tok_s"] == 1.0
    bare = d / "permute-1.0.json"
    bare.write_text(json.dumps([entry | {"batch_size": 8}]))
    with pytest.raises(ReportInputError, match="'batches' list"):
        load_bench(bare)
    wrong = d / "positional-0.5.json"
    wrong.write_text(json.dumps({"policy": "permute", "batches": [entry | {"batch_size": 1}]}))
    with pytest.raises(ReportInputError, match="disagrees with the file name"):
        load_bench(wrong)
    skew = load_skew(build_results_tree(tmp_path / "t") / "stats" / MODEL / "skew.json")
    assert {(r.phase, r.domain) for r in skew.rows} == {
        (ph, d) for ph in ("prefill", "decode") for d in ("code", "prose", "(all)")
    }
    # hand-computed: every layer has counts (e+1)^2, e = 0..7 -> sum 204, top 10% = ceil(0.8) = 1
    # expert = 64/204; Gini of 1,4,...,64 over 8 experts = sum|xi-xj| / (2 n^2 mean)
    counts = [(e + 1) ** 2 for e in range(EXPERTS)]
    gini = sum(abs(a - b) for a in counts for b in counts) / (2 * EXPERTS**2 * (sum(counts) / EXPERTS))
    row = skew.row("decode", "code")
    assert row.top_share["10"] == pytest.approx(64 / 204)
    assert row.mean_gini == pytest.approx(gini)
    assert skew.xs == ["10", "25", "50", "73"]
    assert [(d["phase"], d["a"], d["b"]) for d in skew.spearman_between_domains] == [
        ("prefill", "code", "prose"), ("decode", "code", "prose")
    ]
    assert skew.heldout_coverage["10"]["code"]["code"] == pytest.approx(64 / 204)


def test_autotune_entry_without_hit_flag_says_so(tmp_path):
    res = build_results_tree(tmp_path)
    entry = res / "autotune" / f"{MODEL}.json"
    doc = json.loads(entry.read_text())
    del doc["hit"]
    entry.write_text(json.dumps(doc))
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    assert "<td>not recorded</td>" in html and "miss (tuned" not in html
    del doc["configs"]
    entry.write_text(json.dumps(doc))
    with pytest.raises(ReportInputError, match=re.escape(f"{entry}: missing field configs")):
        render_report(res, res / "report" / "index.html", CONFIG, MACHINE)


# ---------------------------------------------------------------- bytes metrics and ceilings


def _bench_table(html: str) -> dict[tuple[str, str, int], dict[str, str]]:
    """The bench table as {(policy, residency, batch): {column header: cell text}}."""
    table = re.search(r'<table id="bench-table">(.*?)</table>', html, re.S).group(1)
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)
    header = re.findall(r"<th>(.*?)</th>", rows[0])
    out = {}
    for row in rows[1:]:
        cells = dict(zip(header, re.findall(r"<td[^>]*>(.*?)</td>", row)))
        out[(cells["policy"], cells["residency"], int(cells["batch size"]))] = cells
    return out


def _render_capturing_figures(res: Path, monkeypatch) -> tuple[str, dict[str, object]]:
    """Render the report, keeping each matplotlib figure (by title) to read back what it plots."""
    import coldset.reporting.figures as figure_module

    figures = {}
    original = figure_module._png

    def keep(fig, conditions):
        figures[fig.axes[0].get_title()] = fig
        return original(fig, conditions)

    monkeypatch.setattr(figure_module, "_png", keep)
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    return html, figures


def _step_points(figures: dict, batch: int) -> tuple[str, list[tuple[float, float]], list[tuple[float, float]]]:
    """(x label, filled points, hollow points) of the step-time figure at ``batch``."""
    import numpy as np

    (fig,) = [f for t, f in figures.items() if "measured vs" in t and f"batch size {batch}" in t]
    ax = fig.axes[0]
    filled, hollow = [], []
    for coll in ax.collections:
        pts = [tuple(map(float, xy)) for xy in np.asarray(coll.get_offsets())]
        (hollow if len(coll.get_facecolors()) == 0 else filled).extend(pts)
    return ax.get_xlabel(), sorted(filled), sorted(hollow)


def _flat(points) -> list[float]:
    return [v for xy in points for v in xy]


def test_gpu_run_shows_ceilings_and_plots_the_calibrated_prediction(tmp_path, monkeypatch):
    res = build_results_tree(tmp_path, bytes_run="gpu")
    html, figures = _render_capturing_figures(res, monkeypatch)
    assert "HBM read <b>4000 GB/s</b>, host link read (pinned host memory) <b>50 GB/s</b>" in html
    table = _bench_table(html)
    assert len(table) == len(POLICIES) * len(RESIDENCIES) * len(BATCH_SIZES)
    # usage_global 0.5 at batch 4: step 1000/55 ms; residency 1.0 step 1000/105 ms; 0.02 GB over
    # the link at 50 vs 4000 GB/s adds 0.395 ms -> 9.918 ms; floor 0.055*4/4000 + 0.02/50 s = 0.455 ms
    row = table[("usage_global", "0.5", 4)]
    assert row["predicted_step_ms_calibrated"] == "9.919"
    assert row["bytes_step_ms"] == "0.455"
    assert float(row["fraction_of_bytes_bound"]) == pytest.approx(0.455 * 55 / 1000, rel=1e-3)  # 4 digits shown
    assert row["hbm_gb_per_token"] == "0.055"
    assert row["predicted_step_ms"] == "16.36"  # the speed model's column stays: 900 / 55
    # issue 28's time bound, against usage_global-1.0's step at b4 (1000/105 ms): 0.02 GB a step at
    # 50 GB/s is 0.4 ms of link, below it -> bound 9.524 ms; overlap 1 - (18.18 - 9.524) / 0.4
    assert row["allhbm_placement"] == "usage_global-1.0" and row["allhbm_step_ms"] == "9.524"
    assert row["bound_ms"] == "9.524" and float(row["bound_fraction"]) == pytest.approx(55 / 105, rel=1e-3)
    assert float(row["overlap"]) == pytest.approx(1 - (1000 / 55 - 1000 / 105) / 0.4, rel=1e-3)
    assert float(row["stall_ms_per_token"]) == pytest.approx((1000 / 55 - 1000 / 105) / 4, rel=1e-3)
    assert row["wasted_gb_per_token"] == "—"  # a static placement prefetches nothing
    assert table[("usage_global", "1.0", 4)]["overlap"] == "—"  # no link bytes: nothing to hide
    for b in BATCH_SIZES:
        label, filled, hollow = _step_points(figures, b)
        assert "additive model, same run (filled)" in label and "bytes-only speed model, preset h200 (hollow)" in label
        expect = [(bytes_fields(p, r, b)["predicted_step_ms_calibrated"], 1000.0 / _tok_s(p, r, b))
                  for p in POLICIES for r in RESIDENCIES]
        assert _flat(filled) == pytest.approx(_flat(sorted(expect)))
        assert _flat(hollow) == pytest.approx(_flat(sorted((900.0 / _tok_s(p, r, b), 1000.0 / _tok_s(p, r, b))
                                                           for p in POLICIES for r in RESIDENCIES)))
        ratios = [m / c for c, m in expect]
        assert f"Measured / additive: {min(ratios):.2f}–{max(ratios):.2f}× over 4 placements" in html
    # speed model at 900/tok_s: measured / predicted is 1/0.9 everywhere
    assert "measured / speed model: 1.11–1.11×" in html
    assert "No additive model" not in html


def test_management_columns_pass_from_bench_json_to_the_bench_table(tmp_path, monkeypatch):
    """A cache row's management columns (bench.time_columns: manage_ms_per_group and the simulated
    step with it) are bench metrics: the bench table shows them as the bench JSON carries them,
    undefined (—) where the bench left them None (here the static rows)."""
    res = build_results_tree(tmp_path, bytes_run="gpu", with_autotune=False)
    path = Layout(res, MODEL).bench("usage_global", 0.5)
    doc = json.loads(path.read_text())
    for entry in doc["batches"]:
        if entry["batch_size"] == 4:
            entry.update(simulated_step_ms=12.5, simulated_over_measured=0.6875, manage_ms_per_group=0.0625,
                         simulated_managed_step_ms=15.5, simulated_managed_over_measured=0.8525)
    path.write_text(json.dumps(doc))
    html, _ = _render_capturing_figures(res, monkeypatch)
    table = _bench_table(html)
    row = table[("usage_global", "0.5", 4)]
    assert (row["manage_ms_per_group"], row["simulated_managed_step_ms"]) == ("0.0625", "15.5")
    assert (row["simulated_step_ms"], row["simulated_managed_over_measured"]) == ("12.5", "0.8525")
    assert all(table[("positional", "0.5", 4)][m] == "—" for m in ("manage_ms_per_group", "simulated_managed_step_ms",
                                                                   "simulated_managed_over_measured"))


def test_cpu_run_without_ceilings_plots_the_speed_model(tmp_path, monkeypatch):
    for kind in ("cpu", "absent"):
        res = build_results_tree(tmp_path / kind, bytes_run=kind, with_autotune=False)
        html, figures = _render_capturing_figures(res, monkeypatch)
        assert "carry no measured read ceilings" in html and 'id="ceilings"' not in html
        row = _bench_table(html)[("positional", "0.5", 1)]
        assert row["predicted_step_ms_calibrated"] == row["bytes_step_ms"] == row["fraction_of_bytes_bound"] == "—"
        assert all(row[m] == "—" for m in ("allhbm_step_ms", "bound_ms", "bound_fraction", "overlap",
                                            "stall_ms_per_token", "wasted_gb_per_token", "allhbm_placement"))
        assert row["hbm_gb_per_token"] == ("0.055" if kind == "cpu" else "—")
        # on the CPU the figure is the speed model's step per placement (the tree's 1 ms at
        # perfect overlap to 2 ms with none), never the CPU's timings
        (fig,) = [f for t, f in figures.items() if t.endswith("estimated step time, batch size 1")]
        ax = fig.axes[0]
        assert "speed model preset h200" in ax.get_xlabel()
        assert sorted(t.get_text() for t in ax.get_yticklabels()) == sorted(
            f"{p}-{r}" for p in POLICIES for r in RESIDENCIES)
        assert [(bar.get_x(), bar.get_width()) for bar in ax.patches] == [(1.0, 1.0)] * len(POLICIES) * 2
        assert not ax.collections and "are not compared with it" in html


def test_bench_validation_of_bytes_metrics_and_ceilings(tmp_path):
    res = build_results_tree(tmp_path, bytes_run="gpu", with_autotune=False)
    bench = Layout(res, MODEL).bench("positional", 0.5)
    (r1, r4) = load_bench(bench)
    assert r1.ceilings == {"hbm_read_gb_s": HBM_GB_S, "link_read_gb_s": LINK_GB_S}
    assert r4.metrics["predicted_step_ms_calibrated"] == pytest.approx(
        bytes_fields("positional", 0.5, 4)["predicted_step_ms_calibrated"])
    good = json.loads(bench.read_text())

    def write(doc):
        bench.write_text(json.dumps(doc))

    write({**good, "batches": [dict(e, bytes_step_ms=None) for e in good["batches"]], "ceilings": None})
    assert [r.metrics["bytes_step_ms"] for r in load_bench(bench)] == [None, None]
    assert load_bench(bench)[0].ceilings is None
    for bad, match in [
        ({**good, "ceilings": 4000.0}, "field ceilings must be an object"),
        ({**good, "ceilings": {"hbm_read_gb_s": "fast", "link_read_gb_s": 50.0}}, "ceilings/hbm_read_gb_s"),
        ({**good, "ceilings": {"hbm_read_gb_s": 4000.0, "link_read_gb_s": True}}, "ceilings/link_read_gb_s"),
        ({**good, "batches": [dict(good["batches"][0], fraction_of_bytes_bound="0.9x")]}, "fraction_of_bytes_bound"),
        ({**good, "batches": [dict(good["batches"][0], predicted_step_ms_calibrated=[1.0])]}, "predicted_step_ms_calibrated"),
    ]:
        write(bad)
        with pytest.raises(ReportInputError, match=re.escape(str(bench)) + ".*" + re.escape(match)):
            load_bench(bench)


def _summary_table(html: str) -> list[dict[str, str]]:
    table = re.search(r'<table id="summary-table">(.*?)</table>', html, re.S).group(1)
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)
    header = re.findall(r"<th>(.*?)</th>", rows[0])
    return [dict(zip(header, re.findall(r"<td[^>]*>(.*?)</td>", row))) for row in rows[1:]]


def test_cpu_summary_leads_with_coverage_and_predictions_not_speed(tmp_path):
    """Issue 16 item 4: on the CPU the summary says measured speed compares nothing and shows
    coverage, held-out coverage and the speed model's predictions instead of tok/s ratios."""
    res = build_results_tree(tmp_path, bytes_run="cpu", with_autotune=False)
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    assert "measured speed compares nothing" in html
    rows = _summary_table(html)
    assert list(rows[0]) == ["policy", "residency", "GiB in HBM", "coverage (profile)", "coverage (held-out)",
                             "predicted step time (speed model)"]
    ug = next(r for r in rows if (r["policy"], r["residency"]) == ("usage_global", "0.5"))
    assert ug["coverage (held-out)"] == "70.0%"  # min(1, 0.5 * 1.4), as the tree's placement JSON says
    assert "h200 b1:" in ug["predicted step time (speed model)"]
    gpu = build_results_tree(tmp_path / "gpu", bytes_run="gpu")
    html = render_report(gpu, gpu / "report" / "index.html", CONFIG, MACHINE).read_text()
    assert "measured speed compares nothing" not in html and "tok_s_per_gib" in list(_summary_table(html)[0])


def test_timing_whose_repeats_disagree_is_flagged_not_published(tmp_path):
    res = build_results_tree(tmp_path, bytes_run="gpu")
    path = res / "bench" / MODEL / "usage_global-0.5.json"
    doc = json.loads(path.read_text())
    doc["batches"][0]["step_ms_p90"] = 2.0 * doc["batches"][0]["step_ms_p50"]  # steps differ: not noise
    doc["batches"][1]["repeat_spread"] = 1.6  # repeats disagree: noise
    doc["batches"][1]["step_ms_p90"] = doc["batches"][1]["step_ms_p50"]
    path.write_text(json.dumps(doc))
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    table = _bench_table(html)
    assert table[("usage_global", "0.5", doc["batches"][0]["batch_size"])]["timing"] == "ok"
    assert table[("usage_global", "0.5", doc["batches"][1]["batch_size"])]["timing"] == \
        "noisy: repeats disagree by 1.60x, not a result"
    # a noisy row's time bound is not shown, even from a bench file that carries one (issue 28)
    noisy = table[("usage_global", "0.5", doc["batches"][1]["batch_size"])]
    assert all(noisy[m] == "—" for m in ("bound_ms", "bound_fraction", "overlap", "stall_ms_per_token"))
    assert table[("usage_global", "0.5", doc["batches"][0]["batch_size"])]["overlap"] != "—"
    doc["batches"][0]["repeat_spread"] = None  # one repeat: the steps' p90 / p50 is all there is
    path.write_text(json.dumps(doc))
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    assert _bench_table(html)[("usage_global", "0.5", doc["batches"][0]["batch_size"])]["timing"] == \
        "noisy: p90/p50 = 2.00, not a result"
    assert table[("positional", "0.5", 1)]["timing"] == "ok"
    assert 'id="noisy-note"' in html


def test_locality_section_shows_the_simulation_and_the_lift(tmp_path):
    """With stats/locality.json and cache/simulation.csv the report plots them, tables every
    simulated row and names the routing the bench ran on with its lift."""
    res = build_results_tree(tmp_path)
    loc = {"consecutive_overlap": {"mean": 0.6, "per_layer": {"0": 0.5, "2": 0.7}},
           "shuffled_overlap": {"mean": 0.4, "per_layer": {"0": 0.4, "2": 0.4}}, "lift": 1.5,
           "reuse_distance": {"1": 0.5, "first": 0.5}, "tokens": 10, "seed": 0}
    (res / "stats" / MODEL / "locality.json").write_text(json.dumps(loc))
    sim = pd.DataFrame({"policy": ["static", "lru", "static", "lru"], "residency": [0.25, 0.25, 0.5, 0.5],
                        "capacity": [3, 3, 6, 6], "accesses": 40, "tokens": 10,
                        "hit_rate": [0.5, 0.625, 0.75, 0.875], "misses_per_token": [2.0, 1.5, 1.0, 0.5],
                        "link_gb_per_token": [0.02, 0.015, 0.01, 0.005]})
    (res / "cache" / MODEL).mkdir(parents=True)
    sim.to_csv(res / "cache" / MODEL / "simulation.csv", index=False)
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    assert _count(r'<img src="data:image/png;base64,', html) == 4 + 2 * len(BATCH_SIZES)
    assert 'id="fig-locality"' in html and "lift <b>1.50x</b>" in html
    for r in sim.itertuples():
        assert f"<td>{r.policy}</td><td class=\"num\">{r.residency}</td><td class=\"num\">{r.capacity}</td>" \
               f"<td class=\"num\">{r.hit_rate}</td>" in html
    assert "its captured trace: lift 1.50x" in html
    # the answer at budget 0.5 quotes the simulation's best policy there (hit rate: no time columns)
    answer = re.search(r'<tr data-budget="0.5".*?</tr>', html, re.S).group(0)
    assert "the cache simulation: lru (raw fills) best (0.875 hit rate; the static set, read in place, 0.75)" in answer
    sim.loc[0, "hit_rate"] = 1.5
    sim.to_csv(res / "cache" / MODEL / "simulation.csv", index=False)
    with pytest.raises(ReportInputError, match="hit_rate outside"):
        render_report(res, res / "report" / "index.html", CONFIG, MACHINE)


def test_report_header_shows_the_bench_provenance_and_the_held_out_split(tmp_path):
    """The header carries the measuring machine's provenance from the bench JSONs (commit,
    versions, device, autotune key/hit), not the rendering machine's; the held-out vs profile
    table appears when the bench measured both, read back value by value."""
    res = build_results_tree(tmp_path)
    layout = Layout(results=res, model=MODEL)
    doc = json.loads(layout.bench("usage_global", 0.5).read_text())
    doc["prompt_split"] = "heldout"
    profile = [dict(b, tok_s=b["tok_s"] * 2, cold_share=0.125, prompt_split="profile") for b in doc["batches"]]
    doc["profile_batches"] = profile
    layout.bench("usage_global", 0.5).write_text(json.dumps(doc))
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    line = re.search(r'<p class="conditions" id="provenance">(.*?)</p>', html).group(1)
    for value in (PROVENANCE["commit"], "torch 2.11.0+cu130", "triton 3.6.0", "cuda 13.0", "driver 580.95.05",
                  "device NVIDIA H200", "autotune_key abc123", "autotune_hit False"):
        assert value in line, value
    assert len(load_bench(layout.bench("usage_global", 0.5), "profile_batches")) == len(BATCH_SIZES)
    assert load_bench(layout.bench("positional", 0.5), "profile_batches") == []
    table = re.search(r'<table id="split-table">(.*?)</table>', html, re.S).group(1)
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", table) if "<td" in r]
    assert [(r[0], r[1], int(r[2])) for r in rows] == [("usage_global", "0.5", b) for b in BATCH_SIZES]
    for r, b in zip(rows, sorted(BATCH_SIZES)):
        held = _tok_s("usage_global", 0.5, b)
        assert float(r[3]) == pytest.approx(held, rel=1e-3) and float(r[4]) == pytest.approx(2 * held, rel=1e-3)
        assert float(r[5]) == 0.5 and float(r[6]) == 0.125
    old = build_results_tree(tmp_path / "old", provenance=False)
    html = render_report(old, old / "report" / "index.html", CONFIG, MACHINE).read_text()
    assert "not recorded (bench files without provenance)" in html and 'id="split-table"' not in html


def test_locality_loader_names_the_file_and_the_field(tmp_path):
    """The report and MLflow read locality.json through one loader (coldset.reporting.results)."""
    from coldset.reporting.results import load_locality

    path = tmp_path / "locality.json"
    good = {"consecutive_overlap": {"mean": 0.6}, "shuffled_overlap": {"mean": 0.4}, "lift": 1.5,
            "reuse_distance": {"1": 0.5}}
    path.write_text(json.dumps(good))
    assert load_locality(path)["lift"] == 1.5
    path.write_text(json.dumps({k: v for k, v in good.items() if k != "lift"}))
    with pytest.raises(ReportInputError, match=r"locality.json: missing field\(s\) lift"):
        load_locality(path)
    path.write_text(json.dumps({**good, "shuffled_overlap": {}}))
    with pytest.raises(ReportInputError, match=r"locality.json: field 'shuffled_overlap' has no 'mean'"):
        load_locality(path)
    path.write_text(json.dumps({**good, "lift": "high"}))
    with pytest.raises(ReportInputError, match=r"field 'lift': 'high' is not a number"):
        load_locality(path)


# ---------------------------------------------------------------- issue 30: what is published


def _residency_annotations(figures: dict, batch: int) -> list[str]:
    (fig,) = [f for t, f in figures.items() if t.endswith(f"residency curve, batch size {batch}")]
    return sorted(t.get_text() for t in fig.axes[0].texts)


def _caption(html: str, fig_id: str) -> str:
    return re.search(rf'<figure id="fig-{fig_id}">.*?<figcaption>(.*?)</figcaption>', html, re.S).group(1)


def test_residency_slopes_only_where_measured_speed_compares_placements(tmp_path, monkeypatch):
    """Issue 30 item 5: a CPU bench (no host tier) or a noisy timing labels no residency segment
    with a tok/s-per-GiB slope, also from bench files that still carry one; a GPU bench's
    segments carry the slope by its definition, computed here from the tree's tok/s and GiB."""
    cpu = build_results_tree(tmp_path / "cpu")  # device cpu, tok_s_per_gib filled as old bench files did
    html, figures = _render_capturing_figures(cpu, monkeypatch)
    for b in BATCH_SIZES:
        assert _residency_annotations(figures, b) == []
        caption = _caption(html, f"residency-b{b}")
        assert "are not plotted" in caption and "/GiB" not in caption
        # what is plotted is the speed model's estimate: the tree's 1 ms step at perfect overlap,
        # b / 1 ms tok/s, at each placement's GiB of experts in HBM; never a measured tok/s
        (fig,) = [f for t, f in figures.items() if t.endswith(f"residency curve, batch size {b}")]
        ys = sorted(float(y) for line in fig.axes[0].lines for y in line.get_ydata())
        assert ys == [1000.0 * b] * len(POLICIES) * len(RESIDENCIES)
        assert "estimated tok/s" in fig.axes[0].get_ylabel()
    table = _bench_table(html)
    assert {row["tok_s_per_gib"] for row in table.values()} == {"—"}
    assert {row["fetch_tax"] for row in table.values()} == {"—"}

    gpu = build_results_tree(tmp_path / "gpu", bytes_run="gpu")
    path = Layout(gpu, MODEL).bench("positional", 1.0)
    doc = json.loads(path.read_text())
    doc["batches"][1]["repeat_spread"] = 1.6  # positional 1.0 at batch 4: repeats disagree
    path.write_text(json.dumps(doc))
    html, figures = _render_capturing_figures(gpu, monkeypatch)
    gib = (RESIDENCIES[1] - RESIDENCIES[0]) * LAYERS * EXPERTS * GIB_PER_EXPERT
    for b in BATCH_SIZES:
        expect = sorted(f"{(_tok_s(p, 1.0, b) - _tok_s(p, 0.5, b)) / gib:+.3g}/GiB"
                        for p in POLICIES if (p, b) != ("positional", 4))
        assert _residency_annotations(figures, b) == expect
    caption = _caption(html, "residency-b4")
    assert "No slope is shown for segments with a noisy timing" in caption and "positional 1.5→3 GiB" in caption
    assert _bench_table(html)[("positional", "1.0", 4)]["tok_s_per_gib"] == "—"


def test_speed_model_tok_s_is_labelled_an_upper_estimate(tmp_path):
    """Issue 30 item 5: the speed model's tok/s comes from its perfect-overlap (fastest) step,
    so the report calls it an upper estimate and never a lower bound."""
    res = build_results_tree(tmp_path, bytes_run="cpu")
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    note = re.search(r'<p id="speed-model-note">(.*?)</p>', html, re.S).group(1)
    assert "<b>upper</b> estimate" in note and "lower bound" not in html
    # the tree's prediction: 1 ms at perfect overlap, 2 ms with none -> up to 1000 * b tok/s
    assert "h200 b4: 1–2 ms (up to 4,000 tok/s)" in html


def _shape_only_tree(root: Path) -> Path:
    """The tree of a model that is not decoded: no parity, bench or autotune files; its manifest
    holds the shape read from config.json (Llama-4-Maverick's, a bf16 model)."""
    from coldset.core.shapes import read_shape

    res = build_results_tree(root, with_autotune=False)
    for stage in ("parity", "bench"):
        shutil.rmtree(res / stage)
    (res / "model" / MODEL).mkdir(parents=True)
    shape = read_shape(Path(__file__).resolve().parents[1] / "config" / "examples" / "shapes" / "llama4-maverick")
    (res / "model" / MODEL / "manifest.json").write_text(json.dumps(
        {"source": "shape-only", "decodes": False, "reason": "shape only", "shape": shape.to_dict()}))
    return res


def test_trace_only_report_keeps_locality_and_claims_no_measurement(tmp_path):
    """Issue 30 item 6: without a bench the locality and cache-simulation section is still there
    (it needs only the trace), and the header says nothing was measured and gives the model's own
    dtype (bf16, from its config.json), not the engine's float32 on this machine's CPU."""
    res = _shape_only_tree(tmp_path)
    loc = {"consecutive_overlap": {"mean": 0.6, "per_layer": {"0": 0.5}}, "shuffled_overlap": {"mean": 0.4,
           "per_layer": {"0": 0.4}}, "lift": 1.5, "reuse_distance": {"1": 0.5, "first": 0.5}, "tokens": 10, "seed": 0}
    (res / "stats" / MODEL / "locality.json").write_text(json.dumps(loc))
    sim = pd.DataFrame({"policy": ["static", "lru"], "residency": [0.5, 0.5], "capacity": [6, 6], "accesses": 40,
                        "tokens": 10, "hit_rate": [0.75, 0.875], "misses_per_token": [1.0, 0.5],
                        "link_gb_per_token": [0.01, 0.005]})
    (res / "cache" / MODEL).mkdir(parents=True)
    sim.to_csv(res / "cache" / MODEL / "simulation.csv", index=False)
    config = {**CONFIG, "model": {"name": MODEL, "dtype": "float32"}}
    skipped = {s: "model_type 'llama4' is not one the embedded engine runs" for s in ("autotune", "parity", "bench")}
    html = render_report(res, res / "report" / "index.html", config, MACHINE, skipped=skipped).read_text()
    assert 'id="fig-locality"' in html and 'id="cache-table"' in html and "lift <b>1.50x</b>" in html
    assert "<td>lru</td><td class=\"num\">0.5</td><td class=\"num\">6</td><td class=\"num\">0.875</td>" in html
    header = re.search(r'<p class="conditions" id="conditions">(.*?)</p>', html, re.S).group(1)
    assert header.startswith("nothing measured") and "measured on" not in header
    assert "model dtype bfloat16" in header and "float32" not in header and "cpu" not in header
    assert 'id="provenance"' not in html and 'id="bench-table"' not in html
    assert "Measurements ran on" not in html and "Nothing was measured (no bench)" in html


# ---------------------------------------------------------------- the answer (issue 49 item 3)


def _answers(html: str) -> dict[str, str]:
    """The answer table as {budget (residency): chosen placement}."""
    return dict(re.findall(r'<tr data-budget="([^"]+)" data-choice="([^"]+)">', html))


def _heldout_coverage(hist: pd.DataFrame, row_map: np.ndarray) -> float:
    """Share of the held-out decode selections whose (layer, expert) the row map keeps in HBM."""
    held = hist[(hist["split"] == "heldout") & (hist["phase"] == "decode")]
    hot = row_map[held["layer"].to_numpy(), held["expert"].to_numpy()] >= 0
    return float(held["count"].to_numpy()[hot].sum() / held["count"].sum())


def test_answer_leads_and_names_the_best_held_out_placement_per_budget(tmp_path):
    """On the CPU the answer (the page's first section) names, per budget, the placement whose
    HBM experts serve the most held-out traffic: recomputed here from the stats stage's
    histogram and each row map, for placements the placement stage's own ``place`` made."""
    from coldset.analysis.placement import place
    from coldset.core.placement import save_placement
    from coldset.core.shapes import MoEShape

    res = build_results_tree(tmp_path, bytes_run="cpu", with_autotune=False)
    layout = Layout(res, MODEL)
    hist = pd.read_csv(layout.stats_dir / "histogram.csv")
    shape = MoEShape(model_type="qwen3_moe", num_layers=LAYERS, moe_layers=tuple(range(LAYERS)), num_experts=EXPERTS,
                     top_k=2, hidden_size=8, moe_intermediate_size=4, intermediate_size=0, vocab_size=16,
                     num_heads=2, num_kv_heads=1, head_dim=4, tie_word_embeddings=False, qk_norm=False)
    for policy in POLICIES:
        for r in RESIDENCIES:
            save_placement(place(hist, shape, policy, r, batch_sizes=BATCH_SIZES, model=MODEL),
                           layout.placement(policy, r))
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    assert re.search(r"<section id=\"(\w+)\"", html).group(1) == "answer"
    assert 'id="answer-estimate"' in html and "estimate" in html
    answers = _answers(html)
    assert sorted(answers, key=float) == [str(r) for r in RESIDENCIES]
    for r in RESIDENCIES:
        coverage = {f"{p}-{r}": _heldout_coverage(hist, np.load(layout.placement_dir / f"{p}-{r}.rowmap.npy"))
                    for p in POLICIES}
        assert coverage[answers[str(r)]] == pytest.approx(max(coverage.values())), (r, coverage)
    assert answers["0.5"] == "usage_global-0.5"  # the skewed histogram: the used experts beat whole layers


def test_answer_follows_the_files_not_a_fixed_policy(tmp_path):
    """A placement file saying positional serves more held-out traffic makes positional the
    CPU's choice; the GiB it needs and the speeds are in human units."""
    res = build_results_tree(tmp_path, bytes_run="cpu", with_autotune=False)
    layout = Layout(res, MODEL)
    path = layout.placement("positional", 0.5)
    doc = json.loads(path.read_text())
    doc["coverage_heldout"] = 0.95
    path.write_text(json.dumps(doc))
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    docs = {p.name[: -len(".json")]: json.loads(p.read_text()) for p in layout.placement_dir.glob("*-*.json")}
    for budget, choice in _answers(html).items():
        best = max(d["coverage_heldout"] for n, d in docs.items() if n.endswith(f"-{budget}"))
        assert docs[choice]["coverage_heldout"] == best
    assert _answers(html)["0.5"] == "positional-0.5"
    row = re.search(r'<tr data-budget="0.5".*?</tr>', html, re.S).group(0)
    # 12 experts of 0.125 GiB in HBM + 0.75 GiB of the other weights; 1 ms a step at batch 1
    assert "2.25 GiB of weights (1.5 GiB of routed experts + 768 MiB of the other weights)" in row
    assert "batch 1: 1,000 tok/s" in row and "95.0%" in row


def test_gpu_answer_is_the_fastest_measured_placement(tmp_path):
    """On a GPU the choice is the highest measured tok/s at the budget (read here from the bench
    files), a noisy timing left out."""
    res = build_results_tree(tmp_path, bytes_run="gpu", with_autotune=False)
    layout = Layout(res, MODEL)
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    assert 'id="answer-measured"' in html and 'id="answer-estimate"' not in html
    for budget, choice in _answers(html).items():
        tok = {p: [e["tok_s"] for e in json.loads(layout.bench(p, float(budget)).read_text())["batches"]]
               for p in POLICIES}
        assert choice == f"{max(tok, key=lambda p: tok[p][0])}-{budget}"
    path = layout.bench("usage_global", 0.5)
    doc = json.loads(path.read_text())
    for e in doc["batches"]:
        e["repeat_spread"] = 1.6
    path.write_text(json.dumps(doc))
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    assert _answers(html)["0.5"] == "positional-0.5"
    row = re.search(r'<tr data-budget="1.0".*?</tr>', html, re.S).group(0)
    # usage_global-1.0 at batch 1: 100 + 20 tok/s; positional-1.0: 60 + 20
    assert "usage_global-1.0: 120 tok/s" in row and "80 tok/s (the choice: 1.5× faster)" in row


def test_no_scientific_notation_or_nan_anywhere_on_the_page(tmp_path):
    res = build_results_tree(tmp_path, bytes_run="cpu")
    path = Layout(res, MODEL).placement("usage_global", 0.5)
    doc = json.loads(path.read_text())
    for q in doc["predictions"]:
        q["step_s_lower"], q["step_s_sum"] = 2.758e-6, 4.803e-6  # 362,581 tok/s at batch 1
    path.write_text(json.dumps(doc))
    loc = {"consecutive_overlap": {"mean": 0.6, "per_layer": {"0": 0.5}}, "shuffled_overlap": {"mean": 0.4,
           "per_layer": {"0": 0.4}}, "lift": 1.5, "reuse_distance": {"1": 0.5, "first": 0.5}, "tokens": 10, "seed": 0}
    (res / "stats" / MODEL / "locality.json").write_text(json.dumps(loc))
    sim = pd.DataFrame({"policy": ["static", "static"], "residency": [0.5, 1.0], "capacity": [12, 24], "accesses": 40,
                        "tokens": 10, "hit_rate": [0.75, 1.0], "misses_per_token": [1.0, 0.0],
                        "link_gb_per_token": [2.008e-05, 0.0], "batch": [1, 1], "step_ms": [2.57, 2.56],
                        "bound_ms": [2.56, 2.56], "bound_fraction": [0.99, 1.0], "overlap": [1.354e-12, float("nan")],
                        "stall_ms_per_token": [0.01, 0.0], "wasted_gb_per_token": [0.0, 0.0]})
    (res / "cache" / MODEL).mkdir(parents=True)
    sim.to_csv(res / "cache" / MODEL / "simulation.csv", index=False)
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", html)
    text = re.sub(r"<pre>.*?</pre>", "", text, flags=re.S)  # the config as the user wrote it
    assert not re.findall(r"\d[eE][+-]\d", text)  # Python writes 7.206e+04, 2.008e-05
    assert not re.findall(r"\bnan\b", text, re.I)
    assert "363,000 tok/s" in text and "0.00002008" in text


def _expand(cell: str) -> list[int]:
    if cell == "none":
        return []
    out = []
    for part in cell.split(", "):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def test_cold_experts_of_each_choice_are_shown_per_layer(tmp_path):
    """The cold-experts table lists, per layer, the negative entries of each chosen placement's
    row map (read here with numpy), with the command that prints them."""
    res = build_results_tree(tmp_path, bytes_run="cpu", with_autotune=False)
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    table = re.search(r'<table id="cold-table">(.*?)</table>', html, re.S).group(1)
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)
    names = re.findall(r"<th>(.*?)</th>", rows[0])[1:]
    assert names == [_answers(html)[str(r)] for r in RESIDENCIES]
    layout = Layout(res, MODEL)
    maps = {n: np.load(layout.placement_dir / f"{n}.rowmap.npy") for n in names}
    for row in rows[1:]:
        layer, *cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
        for name, cell in zip(names, cells):
            assert _expand(cell) == np.nonzero(maps[name][int(layer)] < 0)[0].tolist()
    assert f"python -m coldset cold-experts {layout.placement('usage_global', 0.5).as_posix()}" in html


def test_cold_experts_of_a_large_model_are_counted_with_the_file_and_command(tmp_path, monkeypatch):
    """Above COLD_IDS_INLINE ids the table gives each layer's count of cold experts (from the
    row map, read here with numpy), with a link to the row map and the command for the ids."""
    import coldset.reporting.report as report_module

    monkeypatch.setattr(report_module, "COLD_IDS_INLINE", 0)
    res = build_results_tree(tmp_path, bytes_run="cpu", with_autotune=False)
    html = render_report(res, res / "report" / "index.html", CONFIG, MACHINE).read_text()
    table = re.search(r'<table id="cold-table">(.*?)</table>', html, re.S).group(1)
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)
    names = re.findall(r"<th>(.*?)</th>", rows[0])[1:]
    maps = {n: np.load(Layout(res, MODEL).placement_dir / f"{n}.rowmap.npy") for n in names}
    for row in rows[1:]:
        layer, *cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
        assert cells == [f"{int((maps[n][int(layer)] < 0).sum())} of {EXPERTS}" for n in names]
    assert f'<a href="../placement/{MODEL}/{names[0]}.rowmap.npy">' in html
    assert "python -m coldset cold-experts" in html
