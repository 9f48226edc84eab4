"""BENCHMARKS.md's measured tables are renderings of the committed JSON, never hand copies."""

from pathlib import Path

import pytest

from coldset.measure.render import BLOCK, refresh_page

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
    from coldset.measure.harness import MeasureError

    with pytest.raises(MeasureError, match="nowhere.json"):
        refresh_page("<!-- rendered: nowhere.json -->\nold\n<!-- end rendered -->\n", tmp_path)


def test_the_shapes_table_is_what_its_command_prints():
    """Section 6's rows are the command's output (coldset.core.shapes.describe of each example)."""
    from coldset.core.shapes import describe, read_shape

    lines = set((ROOT / "BENCHMARKS.md").read_text().splitlines())
    examples = sorted(p for p in (ROOT / "config" / "examples" / "shapes").iterdir() if p.is_dir())
    assert examples
    for p in examples:
        d = describe(read_shape(p))
        want = (f"| {p.name} | {d['model_type']} | {d['layers']} / {d['moe_layers']} | {d['routed_experts']} + "
                f"{d['shared_experts']} | {d['top_k']} | {d['expert_format']} | {d['bytes_per_expert']:,} | "
                f"{d['parameters'] / 1e9:.2f}B | {d['total_gib']:.1f} |")
        assert want in lines, want
