"""Fixtures: deterministic template rendering, splits, user templates and user JSONL validation."""

from __future__ import annotations

import json
import re

import pytest

from coldset.trace.fixtures import (
    Fixture,
    FixtureError,
    available_domains,
    make_fixtures,
    read_user_prompts,
    render_domain,
    read_fixtures,
    template_texts,
    write_fixtures,
)
from coldset.core.trace import split_of

DOMAINS = ["agent", "prose", "code"]


def test_templates_are_deterministic_from_the_seed(tmp_path):
    a = make_fixtures(tmp_path / "a", DOMAINS, 12, 0.25, 48, seed=7)
    b = make_fixtures(tmp_path / "b", DOMAINS, 12, 0.25, 48, seed=7)
    c = make_fixtures(tmp_path / "c", DOMAINS, 12, 0.25, 48, seed=8)
    assert [p.name for p in a] == ["agent.jsonl", "prose.jsonl", "code.jsonl"]
    for pa_, pb, pc in zip(a, b, c):
        assert pa_.read_bytes() == pb.read_bytes()
        assert pa_.read_bytes() != pc.read_bytes()
    fx = read_fixtures(a)
    assert len(fx) == 36 and len({f.id for f in fx}) == 36
    for d in DOMAINS:
        mine = [f for f in fx if f.domain == d]
        assert sum(f.split == "heldout" for f in mine) == 3  # exactly round(12 * 0.25)
        assert all(f.max_new_tokens == 48 and f.id.startswith(d + "-") for f in mine)
        assert len({f.prompt for f in mine}) == 12  # every prompt differs
    # the synthetic model's training text is the same renderer
    assert template_texts(["prose"], 3, seed=7)["prose"] == [f.prompt for f in fx if f.domain == "prose"][:3]


def test_domains_render_their_kind_of_text(tmp_path):
    fx = read_fixtures(make_fixtures(tmp_path, DOMAINS, 6, 0.5, 16, seed=1))
    for f in (f for f in fx if f.domain == "agent"):
        calls = re.findall(r"<tool_call>(.*?)</tool_call>", f.prompt)
        assert calls, f.prompt
        for call in calls:
            obj = json.loads(call)  # JSON arguments, valid
            assert set(obj) == {"name", "arguments"} and isinstance(obj["arguments"], dict)
        assert "<|tool|>" in f.prompt and f.prompt.rstrip().endswith("<|assistant|>")
    for f in (f for f in fx if f.domain == "code"):
        assert "def " in f.prompt and "@dataclass" in f.prompt
        compile(f.prompt.rsplit("\ndef ", 1)[0], f.id, "exec")  # everything but the open function parses
    for f in (f for f in fx if f.domain == "prose"):
        assert len(re.findall(r"[.!?]", f.prompt)) >= 4 and "{" not in f.prompt


def test_split_fraction_keeps_both_splits():
    from coldset.trace.fixtures import render_domain

    fx = render_domain("prose", 3, 0.05, 8, seed=0)  # round(0.15) = 0 -> at least one held out
    assert sorted(f.split for f in fx) == ["heldout", "profile", "profile"]
    assert all(f.split == "profile" for f in render_domain("prose", 3, 0.0, 8, seed=0))


def test_user_template_adds_a_domain(tmp_path):
    tdir = tmp_path / "templates"
    tdir.mkdir()
    (tdir / "legal.j2").write_text(
        "Clause {{ index + 1 }}: the {{ choice(['tenant', 'landlord', 'agent']) }} shall pay "
        "{{ randint(100, 999) }} EUR {{ choice(['monthly', 'yearly']) }}.\n{{ to_json({'n': index}) }}\n"
    )
    assert "legal" in available_domains(tdir)
    paths = make_fixtures(tmp_path / "out", ["legal", "code"], 4, 0.25, 8, seed=3, template_dir=tdir)
    fx = read_fixtures(paths)
    legal = [f for f in fx if f.domain == "legal"]
    assert [f.prompt.splitlines()[1] for f in legal] == ['{"n": 0}', '{"n": 1}', '{"n": 2}', '{"n": 3}']
    assert all(re.match(r"Clause \d: the (tenant|landlord|agent) shall pay \d{3} EUR", f.prompt) for f in legal)
    with pytest.raises(FixtureError, match=r"no template nosuch.j2 for domain 'nosuch'"):
        make_fixtures(tmp_path / "x", ["nosuch"], 2, 0.5, 8, seed=0, template_dir=tdir)
    (tdir / "broken.j2").write_text("{% for x in %}")
    with pytest.raises(FixtureError, match=r"template .*broken.j2:1"):
        make_fixtures(tmp_path / "x", ["broken"], 2, 0.5, 8, seed=0, template_dir=tdir)
    assert not (tmp_path / "x").exists() or not list((tmp_path / "x").iterdir())


def test_user_prompts_jsonl(tmp_path):
    src = tmp_path / "mine.jsonl"
    src.write_text("\n".join(json.dumps(o) for o in [
        {"prompt": "Summarise the meeting.", "domain": "ops"},
        {"prompt": "Fix this bug.", "domain": "dev", "id": "bug-1", "split": "heldout", "max_new_tokens": 9},
        {"prompt": "Plan a trip.", "domain": "ops"},
    ]) + "\n\n")
    paths = make_fixtures(tmp_path / "out", None, 0, 0.5, 32, seed=0, user_prompts=src)
    assert [p.name for p in paths] == ["ops.jsonl", "dev.jsonl"]
    fx = read_fixtures(paths)
    assert fx[0] == Fixture("ops-0000", "ops", split_of("ops-0000", 0.5), "Summarise the meeting.", 32)
    assert fx[1].id == "ops-0001"
    assert fx[2] == Fixture("bug-1", "dev", "heldout", "Fix this bug.", 9)
    only = make_fixtures(tmp_path / "only", ["dev"], 0, 0.5, 32, seed=0, user_prompts=src)
    assert [p.name for p in only] == ["dev.jsonl"]
    with pytest.raises(FixtureError, match=r"mine.jsonl: no prompts for domain\(s\) \['agent'\]"):
        make_fixtures(tmp_path / "o2", ["agent"], 0, 0.5, 32, seed=0, user_prompts=src)


@pytest.mark.parametrize("line,msg", [
    ('{"prompt": "x", "domain": "a"', r"mine.jsonl:2: invalid JSON"),
    ('{"domain": "a"}', r"mine.jsonl:2: missing field\(s\) \['prompt'\]"),
    ('{"prompt": "  ", "domain": "a"}', r"mine.jsonl:2: field 'prompt' must be a non-empty string"),
    ('{"prompt": "x", "domain": "a b"}', r"mine.jsonl:2: field 'domain' must be a name"),
    ('{"prompt": "x", "domain": "a", "split": "train"}', r"mine.jsonl:2: field 'split' is 'train'"),
    ('{"prompt": "x", "domain": "a", "max_new_tokens": 0}', r"mine.jsonl:2: field 'max_new_tokens' must be a positive integer"),
    ('{"prompt": "x", "domain": "a", "max_new_token": 5}', r"mine.jsonl:2: unknown field\(s\) \['max_new_token'\]"),
    ('["x"]', r"mine.jsonl:2: expected a JSON object"),
    ('{"prompt": "y", "domain": "a", "id": "p1"}', r"mine.jsonl: duplicate id 'p1'"),
])
def test_user_prompts_errors_name_file_and_line(tmp_path, line, msg):
    src = tmp_path / "mine.jsonl"
    src.write_text('{"prompt": "ok", "domain": "a", "id": "p1"}\n' + line + "\n")
    with pytest.raises(FixtureError, match=msg):
        make_fixtures(tmp_path / "out", None, 0, 0.25, 8, seed=0, user_prompts=src)
    assert not (tmp_path / "out").exists()


def test_read_fixtures_requires_every_field(tmp_path):
    path = write_fixtures(tmp_path / "a.jsonl", [Fixture("a-0", "a", "profile", "hi", 4)])
    assert read_fixtures(path) == [Fixture("a-0", "a", "profile", "hi", 4)]
    path.write_text('{"id": "a-0", "domain": "a", "prompt": "hi", "max_new_tokens": 4}\n')
    with pytest.raises(FixtureError, match=r"a.jsonl:1: missing field\(s\) \['split'\]"):
        read_fixtures(path)
    write_fixtures(tmp_path / "b.jsonl", [Fixture("a-0", "b", "profile", "x", 4)])
    write_fixtures(tmp_path / "a.jsonl", [Fixture("a-0", "a", "profile", "x", 4)])
    with pytest.raises(FixtureError, match="duplicate id 'a-0'"):
        read_fixtures([tmp_path / "a.jsonl", tmp_path / "b.jsonl"])


def test_templates_render_in_the_sandbox(tmp_path):
    """A template from a shared folder cannot run commands (issue 16)."""
    marker = tmp_path / "ran"
    (tmp_path / "evil.j2").write_text(
        "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }} hello {{ index }}")
    with pytest.raises(FixtureError, match=r"evil.j2: prompt 0 tried an operation the sandbox refuses"):
        render_domain("evil", 2, 0.5, 4, 0, template_dir=tmp_path)
    assert not marker.exists()


def test_non_utf8_prompt_file_names_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"domain": "a", "prompt": "fine"}\n{"domain": "a", "prompt": "caf\xe9"}\n')
    with pytest.raises(FixtureError, match=rf"{path}:2: not UTF-8 \(byte 0xe9 at column 31\)"):
        read_user_prompts(path, 0.5, 8)
