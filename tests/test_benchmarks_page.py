"""BENCHMARKS.md's measured tables are renderings of the committed JSON, never hand copies."""

import json
from pathlib import Path

import pytest

from coldset.measure.harness import MeasureError
from coldset.measure.render import BLOCK, check_one_block_per_measurement, refresh_page

ROOT = Path(__file__).resolve().parents[1]


def test_every_rendered_block_of_benchmarks_md_equals_its_json():
    page = (ROOT / "BENCHMARKS.md").read_text()
    blocks = BLOCK.findall(page)
    assert blocks, "BENCHMARKS.md has no rendered block"
    assert refresh_page(page, ROOT) == page, (
        "a table of BENCHMARKS.md differs from its JSON: run `python -m coldset bench render --into BENCHMARKS.md`")


def test_a_hand_edited_number_in_a_block_is_caught(tmp_path):
    page = (ROOT / "BENCHMARKS.md").read_text()
    m = BLOCK.search(page)
    body = m.group("body")
    digit = next(i for i, ch in enumerate(body) if ch.isdigit())
    edited = page[:m.start("body") + digit] + str((int(body[digit]) + 1) % 10) + page[m.start("body") + digit + 1:]
    assert refresh_page(edited, ROOT) == page != edited


def test_a_block_naming_a_missing_file_names_it(tmp_path):
    with pytest.raises(MeasureError, match="nowhere.json"):
        refresh_page("<!-- rendered: nowhere.json -->\nold\n<!-- end rendered -->\n", tmp_path)


def test_the_shapes_table_is_what_its_command_prints():
    """docs/models.md's shapes rows are the command's output (coldset.core.shapes.describe of each example)."""
    from coldset.core.shapes import describe, read_shape

    lines = set((ROOT / "docs" / "models.md").read_text().splitlines())
    examples = sorted(p for p in (ROOT / "config" / "examples" / "shapes").iterdir() if p.is_dir())
    assert examples
    for p in examples:
        d = describe(read_shape(p))
        want = (f"| {p.name} | {d['model_type']} | {d['layers']} / {d['moe_layers']} | {d['routed_experts']} + "
                f"{d['shared_experts']} | {d['top_k']} | {d['expert_format']} | {d['bytes_per_expert']:,} | "
                f"{d['parameters'] / 1e9:.2f}B | {d['total_gib']:.1f} |")
        assert want in lines, want


def test_the_page_stays_within_40_kb():
    """BENCHMARKS.md holds the current tables only; earlier ones are in git history (issue 45)."""
    assert len((ROOT / "BENCHMARKS.md").read_bytes()) <= 40_000


def test_the_real_page_holds_one_block_per_measurement():
    check_one_block_per_measurement((ROOT / "BENCHMARKS.md").read_text(), ROOT)


def _page(*paths: str) -> str:
    return "".join(f"<!-- rendered: {p} -->\nold\n<!-- end rendered -->\n\n" for p in paths)


def _planted(tmp_path, name: str, base: str, **args) -> str:
    """A copy of a committed result with ``args`` changed (a re-run), written as ``name``."""
    res = json.loads((ROOT / "docs" / "measurements" / base).read_text())
    res = {**res, "date": "2027-01-01 00:00 UTC", "args": {**res["args"], **args}}
    (tmp_path / name).write_text(json.dumps(res))
    return name


@pytest.mark.parametrize("base, rerun", [
    # a cache re-run with other --out, repeats and depths, at one of the same residencies
    ("cache_bench_fit_b1.json", dict(out="/elsewhere", repeats=5, depths="1", residencies="0.5")),
    ("kernel_bench_fp8_swap.json", dict(out="/elsewhere", reps=50)),  # the same batch sizes
])
def test_a_second_block_of_the_same_measurement_is_refused_naming_both(tmp_path, base, rerun):
    from coldset.measure.cli import main

    old = _planted(tmp_path, "old.json", base)
    new = _planted(tmp_path, "new.json", base, **rerun)
    with pytest.raises(MeasureError, match=r"old\.json \(.*\) and new\.json \(.*\) are blocks of the same measurement"):
        refresh_page(_page(old, new), tmp_path)
    page = tmp_path / "PAGE.md"
    page.write_text(_page(old, new))
    assert main(["render", "--into", str(page)]) == 1  # --into refuses and leaves the page alone
    assert page.read_text() == _page(old, new)


@pytest.mark.parametrize("other", [dict(residencies="0.75"), dict(policies="lru,lru_guard"), dict(steps=256),
                                   dict(batches="8")])
def test_other_residencies_policies_steps_or_batches_are_another_measurement(tmp_path, other):
    a = _planted(tmp_path, "a.json", "cache_bench_fit_b1.json")
    b = _planted(tmp_path, "b.json", "cache_bench_fit_b1.json", **other)
    check_one_block_per_measurement(_page(a, b), tmp_path)


def test_another_model_family_is_another_measurement(tmp_path):
    """bench step / cache --model-family: two families' tables at the same cells are two measurements."""
    for base in ("cache_bench_fit_b1.json", "decode_step_fp8.json"):
        a = _planted(tmp_path, "a.json", base)
        res = json.loads((tmp_path / "a.json").read_text())
        (tmp_path / "b.json").write_text(json.dumps({**res, "model_family": {"name": "gpt-oss-20b"}}))
        check_one_block_per_measurement(_page(a, "b.json"), tmp_path)
        with pytest.raises(MeasureError, match="same measurement"):
            check_one_block_per_measurement(_page(a, _planted(tmp_path, "c.json", base)), tmp_path)


def test_a_step_run_meets_the_bf16_rows_of_an_fp8_step_run(tmp_path):
    """bench step --weight-format fp8 times bf16 beside FP8: a bf16 step run at the same engine
    and batch is the same measurement as those rows."""
    res = json.loads((ROOT / "docs" / "measurements" / "decode_step_fp8.json").read_text())
    bf16 = {**res, "rows": [r for r in res["rows"] if r.get("weight_format", "bf16") == "bf16"]}
    fp8 = {**res, "rows": [r for r in res["rows"] if r.get("weight_format") == "fp8"]}
    for name, r in (("all.json", res), ("bf16.json", bf16), ("fp8.json", fp8)):
        (tmp_path / name).write_text(json.dumps(r))
    with pytest.raises(MeasureError, match=r"all\.json \(.*\) and bf16\.json"):
        check_one_block_per_measurement(_page("all.json", "bf16.json"), tmp_path)
    check_one_block_per_measurement(_page("bf16.json", "fp8.json"), tmp_path)
