"""The developer scripts under scripts/ run as commands on small synthetic data, and what they print
equals an independent computation: a cache replay written out here from the rules of
:mod:`coldset.analysis.simulate` (warm set, ticks, victims outside the group) with plain Python sets
and dicts, and the traces' sizes counted from what the test wrote."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from coldset.core.trace import TraceMeta, read_trace_meta, write_trace

ROOT = Path(__file__).resolve().parents[1]
LAYERS, EXPERTS, TOP_K = 3, 8, 2


def run_script(name: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "scripts").glob("*.py")))
def test_every_script_answers_help(name):
    assert "usage:" in run_script(name, "--help")


def small_trace(path: Path, requests: dict[str, tuple[str, str, int]], seed: int = 0) -> dict[str, np.ndarray]:
    """A trace of decode rows only: per request id (domain, split, decode tokens), each token's
    ``TOP_K`` distinct experts per MoE layer, skewed towards low expert ids. Returns the
    selections per request ``[tokens, LAYERS, TOP_K]``."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, EXPERTS + 1)
    cols: dict[str, list] = {c: [] for c in ("request", "domain", "position", "phase", "layer", "rank", "expert",
                                             "split")}
    sel = {}
    for rid, (domain, split, tokens) in sorted(requests.items()):
        s = np.stack([np.stack([rng.choice(EXPERTS, TOP_K, replace=False, p=p / p.sum()) for _ in range(LAYERS)])
                      for _ in range(tokens)])
        sel[rid] = s
        for t in range(tokens):
            for layer in range(LAYERS):
                for rank in range(TOP_K):
                    for c, v in zip(cols, (rid, domain, 4 + t, "decode", layer, rank, s[t, layer, rank], split)):
                        cols[c].append(v)
    table = pa.table({
        "request": cols["request"], "domain": cols["domain"], "position": np.array(cols["position"], np.int32),
        "phase": cols["phase"], "layer": np.array(cols["layer"], np.int16), "rank": np.array(cols["rank"], np.int8),
        "expert": np.array(cols["expert"], np.int16), "split": cols["split"]})
    write_trace(path, TraceMeta("scripts-test", LAYERS, EXPERTS, TOP_K, list(range(LAYERS)), "tests"), table)
    return sel


def profile_counts(sel: dict[str, np.ndarray], ids) -> np.ndarray:
    counts = np.zeros(LAYERS * EXPERTS)
    for rid in ids:
        for t, layer, rank in np.ndindex(sel[rid].shape):
            counts[layer * EXPERTS + sel[rid][t, layer, rank]] += 1
    return counts


def replay(tokens: list[np.ndarray], counts: np.ndarray, capacity: int, policy: str) -> list[tuple[int, int]]:
    """(hits, copies) per (token, layer) group, ``static`` or ``lru``, from the simulator's stated
    rules: the warm pool is the ``capacity`` most counted instances (ties: lower id), ticked
    ``-capacity..-1`` by count ascending then id; a selection resident at its group's start hits;
    each distinct missed instance is one copy and (lru) evicts the least recently used resident
    that its group does not use; every selection sets its instance's last use to its tick."""
    warm = sorted(range(counts.size), key=lambda i: (-counts[i], i))[:capacity]
    last_use = {i: -capacity + n for n, i in enumerate(sorted(warm, key=lambda i: (counts[i], i)))}
    hot, tick, out = set(warm), 0, []
    for token in tokens:
        for layer in range(LAYERS):
            group = [layer * EXPERTS + int(e) for e in token[layer]]
            resident = hot if policy == "static" else set(last_use)
            hits = sum(i in resident for i in group)
            missed = {i for i in group if i not in resident}
            if policy == "lru":
                for victim in sorted((u, i) for i, u in last_use.items() if i not in group)[:len(missed)]:
                    del last_use[victim[1]]
                for i in group:
                    last_use[i] = tick
                    tick += 1
            out.append((hits, len(missed)))
    return out


REQUESTS = {"p0": ("a", "profile", 9), "p1": ("b", "profile", 7), "p2": ("a", "profile", 12),
            "h0": ("a", "heldout", 5), "h1": ("b", "heldout", 12), "h2": ("a", "heldout", 9)}


@pytest.mark.parametrize("residency", [0.25, 0.5])
def test_trace_by_position_equals_a_replay_of_each_request_alone(tmp_path, residency):
    sel = small_trace(tmp_path / "t.parquet", REQUESTS)
    out = run_script("trace_by_position.py", str(tmp_path / "t.parquet"), "--residencies", str(residency),
                     "--windows", "4,100", "--positions", "0,6,11,12")
    counts = profile_counts(sel, ["p0", "p1", "p2"])
    capacity = round(residency * LAYERS * EXPERTS)
    held = [sel[r] for r in ("h0", "h1", "h2")]
    for policy in ("static", "lru"):
        copies = [np.array([c for _, c in replay(list(s), counts, capacity, policy)]).reshape(-1, LAYERS).sum(1)
                  for s in held]
        by_step = [np.mean([c[s] for c in copies if s < c.size]) for s in range(12)]
        want = [np.mean(by_step[:4]), np.mean(by_step), by_step[0], by_step[6], by_step[11]]
        row = next(line for line in out.splitlines() if line.startswith(f"| {residency} | {policy} |"))
        cells = [c.strip() for c in row.strip("|").split("|")][2:]
        assert cells[-1] == "-"  # no request reaches step 12
        assert np.allclose([float(c) for c in cells[:-1]], want, atol=0.005 + 1e-9), (policy, cells, want)


def hit_rate_lines(out: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"residency 0\.5 (\w+) .*hit rate ([0-9.]+)", out)}


def test_cache_bench_on_a_given_trace_prints_the_replays_hit_rates(tmp_path):
    sel = small_trace(tmp_path / "t.parquet", REQUESTS, seed=1)
    out = run_script("cache_bench.py", "--trace", str(tmp_path / "t.parquet"), "--residency", "0.5")
    rates = hit_rate_lines(out)
    counts = profile_counts(sel, ["p0", "p1", "p2"])
    tokens = [t for rid in sorted(sel) for t in sel[rid]]  # both splits, requests in id order
    selections = len(tokens) * LAYERS * TOP_K
    assert f"rows {selections:,}" in out and f"tokens {len(tokens):,}" in out
    for policy in ("static", "lru"):
        hits = sum(h for h, _ in replay(tokens, counts, round(0.5 * LAYERS * EXPERTS), policy))
        assert rates[policy] == pytest.approx(hits / selections, abs=5e-5), policy


def test_cache_bench_writes_a_trace_of_the_asked_shape():
    out = run_script("cache_bench.py", "--rows", "2000", "--layers", "4", "--experts", "16", "--top-k", "2",
                     "--residency", "0.5")
    assert "wrote 2,000 rows" in out and "rows 2,000 " in out
    assert f"tokens {2000 // (4 * 2):,}" in out
    assert all(0 <= r <= 1 for r in hit_rate_lines(out).values()) and "lru" in hit_rate_lines(out)


def test_bench_stats_times_the_stats_stage_on_the_trace_it_wrote(tmp_path):
    out = run_script("bench_stats.py", "--rows", "1", "--dir", str(tmp_path / "bench"), "--keep")
    result = json.loads(out)
    per_request = (128 + 133) * 16 * 4  # one request: prompt + decode tokens x 16 MoE layers x top-4
    assert result["rows"] == per_request
    assert pq.ParquetFile(tmp_path / "bench" / "trace-1.parquet").metadata.num_rows == per_request
    assert result["run_stats_s"] > 0 and result["peak_rss_mib"] > 0
    assert any((tmp_path / "bench" / "stats").iterdir())


def test_locality_calibrate_real_line_equals_the_replays_of_its_splits(tmp_path):
    requests = {"a0": ("abstract_algebra", "profile", 8), "a1": ("anatomy", "heldout", 6),
                "a2": ("anatomy", "profile", 10), "s0": ("astronomy", "profile", 7),
                "s1": ("astronomy", "heldout", 9), "a3": ("abstract_algebra", "heldout", 5)}
    sel = small_trace(tmp_path / "t.parquet", requests, seed=2)
    out = run_script("locality_calibrate.py", "--no-synthetic", "--real", "--real-trace", str(tmp_path / "t.parquet"),
                     "--lift-window", "3")
    line = json.loads(out.splitlines()[-1])
    assert line["routing"] == "real: t"
    assert line["tokens"] == sum(s.shape[0] for s in sel.values())
    assert line["tokens_per_request"] == pytest.approx(line["tokens"] / len(sel))
    def ids(keep) -> list[str]:
        return [r for r in sel if keep(*requests[r][:2])]

    splits = {"heldout": (ids(lambda d, s: s == "profile"), ids(lambda d, s: s == "heldout")),
              "cross": (ids(lambda d, s: d != "astronomy"), ids(lambda d, s: d == "astronomy"))}
    for name, (profile, replayed) in splits.items():
        counts = profile_counts(sel, profile)
        tokens = [t for rid in sorted(replayed) for t in sel[rid]]
        for residency in (0.25, 0.5, 0.75):
            capacity = round(residency * LAYERS * EXPERTS)
            for policy in ("static", "lru"):
                hits = sum(h for h, _ in replay(tokens, counts, capacity, policy))
                assert line[f"{name}:{policy}@{residency}"] == pytest.approx(
                    hits / (len(tokens) * LAYERS * TOP_K), abs=5e-5), (name, policy, residency)


def test_synthetic_routing_trace_writes_the_asked_routing_shape(tmp_path):
    from coldset.analysis.streams import trace_decode_rows

    run_script("synthetic_routing_trace.py", str(tmp_path / "s.parquet"), "--per-domain", "2", "--new-tokens", "3",
               "--layers", "2", "--experts", "8", "--top-k", "2", "--hidden", "32")
    rows, meta = trace_decode_rows(tmp_path / "s.parquet")
    assert (meta.num_moe_layers, meta.num_experts, meta.top_k) == (2, 8, 2)
    assert set(rows["domain"]) == {"agent", "prose", "code"}
    assert rows["request"].nunique() == 3 * 2
    per_group = rows.groupby(["request", "position", "layer_index"], observed=True)["expert"]
    assert (per_group.nunique() == 2).all() and (per_group.size() == 2).all()
    assert rows["expert"].between(0, 7).all()


def test_trace_by_position_buckets_equal_a_replay_of_each_request_alone(tmp_path):
    sel = small_trace(tmp_path / "t.parquet", REQUESTS)
    run_script("trace_by_position.py", str(tmp_path / "t.parquet"), "--buckets", "0,4,8,16", "--residencies", "0.5",
               "--json", str(tmp_path / "out.json"))
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["command"].startswith("python scripts/trace_by_position.py ") and "--buckets 0,4,8,16" in got["command"]
    counts = profile_counts(sel, ["p0", "p1", "p2"])
    held = [sel[r] for r in ("h0", "h1", "h2")]  # 5, 12 and 9 decode tokens
    assert got["buckets"] == [[0, 4], [4, 8], [8, 16]] and got["requests"] == [3, 3, 2]
    for policy in ("static", "lru"):
        copies = [np.array([c for _, c in replay(list(s), counts, round(0.5 * LAYERS * EXPERTS), policy)])
                  .reshape(-1, LAYERS).sum(1) for s in held]
        want = [np.mean(np.concatenate([c[a:b] for c in copies])) for a, b in ((0, 4), (4, 8), (8, 16))]
        early = np.mean(np.concatenate([c[:16] for c in copies]))
        assert np.allclose(got["copies"][f"{policy}@0.5"], want, atol=1e-4), policy
        assert np.allclose(got["ratio_to_first16"][f"{policy}@0.5"], np.array(want) / early, atol=1e-3), policy
    # reuse distances by brute force: per held-out selection, tokens since its (layer, expert) was last
    # selected in the same request (0: first use)
    dist, step = [], []
    for s in held:
        last: dict[tuple[int, int], int] = {}
        for t in range(s.shape[0]):
            for layer in range(LAYERS):
                for e in s[t, layer]:
                    dist.append(t - last[(layer, e)] if (layer, e) in last else 0)
                    step.append(t)
                for e in s[t, layer]:
                    last[(layer, e)] = t
    dist, step = np.array(dist), np.array(step)
    for i, (a, b) in enumerate(((0, 4), (4, 8), (8, 16))):
        d = dist[(step >= a) & (step < b)]
        assert got["reuse"]["previous_token"][i] == pytest.approx((d == 1).mean(), abs=1e-4)
        assert got["reuse"]["within_8"][i] == pytest.approx(((d >= 1) & (d <= 8)).mean(), abs=1e-4)
        assert got["reuse"]["first_use"][i] == pytest.approx((d == 0).mean(), abs=1e-4)


def test_trace_by_position_measures_the_synthetic_models_own_decode(tmp_path):
    import dataclasses

    from coldset.engine.synthetic import SyntheticSpec

    knobs = dict(layers=2, hidden=64, moe_intermediate=16, heads=2, kv_heads=1, head_dim=32, topic_palette=4)
    run_script("trace_by_position.py", "--synthetic", "--per-domain", "2", "--new-tokens", "13", "--buckets", "0,4,12",
               "--residencies", "0.5", *(a for k, v in knobs.items() for a in ("--set", f"{k}={v}")),
               "--json", str(tmp_path / "s.json"))
    got = json.loads((tmp_path / "s.json").read_text())
    assert got["synthetic"] == dataclasses.asdict(SyntheticSpec(**knobs))
    assert got["profile_requests"] == 3 and got["requests"] == [3, 3]  # one held-out prompt a domain, 12 steps
    assert set(got["copies"]) == {"static@0.5", "lru@0.5"} and all(len(v) == 2 for v in got["copies"].values())


def _moe_beyond_csv(path: Path, experts: np.ndarray) -> None:
    """A MoE-Beyond activation CSV of ``experts`` ``[tokens, 26, 6]``: rows layer by layer (1..26)."""
    lines = ["Layer ID,Batch Number,Token,Activated Expert IDs"]
    for li in range(experts.shape[1]):
        lines += [f'{li + 1},0,tok{t},"{experts[t, li].tolist()}"' for t in range(experts.shape[0])]
    path.write_text("\n".join(lines) + "\n")


def test_moe_beyond_trace_writes_each_selection_and_refuses_a_ragged_file(tmp_path):
    rng = np.random.default_rng(0)
    src = tmp_path / "eamc"
    src.mkdir()
    prompts = {n: np.stack([np.stack([rng.choice(64, 6, replace=False) for _ in range(26)]) for _ in range(t)])
               for n, t in ((1002, 3), (1001, 5))}
    for n, experts in prompts.items():
        _moe_beyond_csv(src / f"prompt_{n}_data.csv", experts)
    out = tmp_path / "t.parquet"
    assert "2 requests, 8 tokens" in run_script("moe_beyond_trace.py", str(src), str(out), "--as-streams")
    table = pq.read_table(out).to_pandas()
    meta = read_trace_meta(out)
    assert set(table["phase"]) == {"decode"} and (meta.num_experts, meta.top_k, meta.moe_layers) == (64, 6, list(range(1, 27)))
    for n, experts in prompts.items():
        rows = table[table["request"] == f"prompt-{n}"]
        for t in range(len(experts)):
            for li in range(26):
                got = rows[(rows["position"] == t) & (rows["layer"] == li + 1)].sort_values("rank")["expert"]
                assert got.tolist() == experts[t, li].tolist(), (n, t, li)
    bad = prompts[1001].copy()
    _moe_beyond_csv(src / "prompt_1003_data.csv", bad)
    text = (src / "prompt_1003_data.csv").read_text().splitlines()
    (src / "prompt_1003_data.csv").write_text("\n".join(text[:-1]) + "\n")  # layer 26 one token short
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "moe_beyond_trace.py"), str(src), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "prompt_1003_data.csv: token counts differ" in done.stderr
