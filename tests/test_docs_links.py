"""Every file, section and link the docs and the code cite exists.

Checked in README.md, every docs/*.md page, BENCHMARKS.md and config/README.md:
- relative markdown links ``[text](path)`` and images resolve to a file or folder, and
  ``path#anchor`` (or ``#anchor``) to a heading of that markdown file (GitHub's anchors);
- text citations of a repository path under ``docs/`` (``docs/<page>.md``, ``docs/img/...``) name a
  file that exists;
- citations ``DESIGN.md §N`` / ``design.md §N`` name a section N of docs/design.md (the code's
  "DESIGN.md §N" means that page).
Every .py file under src/ is checked for the two kinds of citation. The README's test command is
the command line CI runs (.ci/run)."""

from __future__ import annotations

import functools
import importlib
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
MARKDOWN = sorted({ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "config" / "README.md",
                   *(ROOT / "docs").glob("*.md")})
SOURCES = sorted((ROOT / "src").rglob("*.py"))

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+).+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
DOCS_PATH = re.compile(r"(?<![\w./-])docs/[\w./-]*?\.(?:md|json|png|npz|csv|svg|jpg|txt)\b")
DESIGN_CITE = re.compile(r"\b(?:DESIGN|design)\.md\s*§\s*(\d+)((?:\s*(?:,|and|or|-|–)\s*§?\s*\d+)*)")
SECTION_HEADING = re.compile(r"^#{1,6}\s+§(\d+)\.", re.M)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _blank(m: re.Match) -> str:
    return "\n" * m.group(0).count("\n")  # keeps line numbers


def strip_code(text: str) -> str:
    """The text without fenced blocks and inline code spans (where ``[x](y)`` is not a link)."""
    return INLINE_CODE.sub(_blank, FENCE.sub(_blank, text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its rendered text lowercased, punctuation dropped, spaces to
    hyphens (``§4. Kernel`` -> ``4-kernel``)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a markdown file's headings (outside code blocks), duplicates numbered."""
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", path.read_text())):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


@functools.lru_cache(maxsize=None)
def design_sections(path: Path = DESIGN) -> frozenset[int]:
    return frozenset(int(n) for n in SECTION_HEADING.findall(FENCE.sub("", path.read_text()))) if path.is_file() \
        else frozenset()


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def check_citations(text: str, where: str, root: Path = ROOT, design: Path = DESIGN) -> list[str]:
    """Text citations of a docs/ path and of a design section that do not exist."""
    problems = []
    for m in DOCS_PATH.finditer(text):
        if not (root / m.group(0)).exists():
            problems.append(f"{where}:{_line(text, m.start())}: cites {m.group(0)}, which does not exist")
    sections = design_sections(design)
    for m in DESIGN_CITE.finditer(text):
        numbers = [int(m.group(1)), *(int(n) for n in re.findall(r"\d+", m.group(2)))]
        for n in numbers:
            if n not in sections:
                problems.append(f"{where}:{_line(text, m.start())}: cites design section §{n}; "
                                f"{design.relative_to(root) if design.is_relative_to(root) else design} "
                                f"has §{sorted(sections)}")
    return problems


def check_links(text: str, source: Path, root: Path = ROOT) -> list[str]:
    """Relative markdown links of ``text`` (the file ``source``) that resolve to no file or heading."""
    problems = []
    where = source.relative_to(root) if source.is_relative_to(root) else source
    prose = strip_code(text)
    for m in LINK.finditer(prose):
        target = m.group(1)
        if SCHEME.match(target) or target.startswith("//"):
            continue  # a web address: not checked offline
        path_part, _, anchor = target.partition("#")
        dest = (source.parent / unquote(path_part)).resolve() if path_part else source
        line = _line(prose, m.start())
        if not dest.exists():
            problems.append(f"{where}:{line}: link to {target}: {path_part} does not exist")
            continue
        if anchor:
            if dest.suffix != ".md" or dest.is_dir():
                problems.append(f"{where}:{line}: link to {target}: an anchor into a non-markdown file")
            elif unquote(anchor).lower() not in anchors(dest):
                problems.append(f"{where}:{line}: link to {target}: {dest.name} has no heading #{anchor}")
    return problems


def check_markdown(path: Path, root: Path = ROOT, design: Path = DESIGN) -> list[str]:
    text = path.read_text()
    cited = re.sub(r"\]\([^)]*\)", "]()", text)  # link targets are checked as links, not again as citations
    return check_links(text, path, root) + check_citations(cited, str(path.relative_to(root)), root, design)


def test_design_page_has_the_sections_the_code_cites():
    assert design_sections() == frozenset(range(1, 10)), "docs/design.md numbers its sections §1..§9"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_citations_of_the_docs_resolve(path):
    if not path.exists():
        pytest.skip(f"{path.relative_to(ROOT)} is absent")
    problems = check_markdown(path)
    assert not problems, "\n".join(problems)


def test_citations_in_the_code_resolve():
    assert SOURCES, "no .py file under src/"
    problems = [p for f in SOURCES for p in check_citations(f.read_text(), str(f.relative_to(ROOT)))]
    assert not problems, "\n".join(problems)


def test_the_readme_test_command_is_what_ci_runs():
    """.ci/run's command line appears in the README as one line of a bash block, byte for byte."""
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith(("#", "set ", "cd "))]
    assert len(ci) == 1, ci
    blocks = re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    assert any(ci[0] in block.splitlines() for block in blocks), "README.md lacks .ci/run's command line"


# ---------------------------------------------------------------- the checker catches what it should

def test_planted_broken_links_and_citations_are_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    design = tmp_path / "docs" / "design.md"
    design.write_text("# design\n\n## §1. The pipeline\n\n## §2. The routing trace (the contract)\n")
    (tmp_path / "docs" / "good.md").write_text("# Good page\n\n## A section `with code`\n\nfine\n")
    page = tmp_path / "README.md"
    good = ("[ok](docs/good.md) [ok](docs/good.md#a-section-with-code) [ok](#top-heading) "
            "[web](https://example.org/x.md) see docs/good.md and DESIGN.md §2, design.md §1 and §2\n"
            "`[not a link](nowhere.md)`\n```\n[nor this](nowhere.md)\n```\n")
    page.write_text("# Top heading\n\n" + good)
    assert check_markdown(page, tmp_path, design) == []
    bad = ("# Top heading\n\n"
           "[a](docs/missing.md)\n"            # a missing file
           "[b](docs/good.md#no-such-part)\n"  # a missing heading
           "[c](#nowhere)\n"                   # a missing heading of the page itself
           "![d](docs/img/missing.png)\n"      # a missing image
           "as docs/gone.md says\n"            # a text citation of a missing page
           "DESIGN.md §7, and design.md §1 and §9\n")  # sections the design page lacks
    page.write_text(bad)
    problems = check_markdown(page, tmp_path, design)
    for needle in ("docs/missing.md does not exist", "has no heading #no-such-part", "has no heading #nowhere",
                   "docs/img/missing.png does not exist", "cites docs/gone.md", "§7", "§9"):
        assert any(needle in p for p in problems), (needle, problems)
    assert len(problems) == 7, problems
    # the code's citations: a missing page and a missing section, in a Python docstring
    code = '"""Reads the trace (DESIGN.md §2); its layout is in docs/nothing.md; see DESIGN.md §12."""\n'
    problems = check_citations(code, "src/x.py", tmp_path, design)
    assert [("docs/nothing.md" in p, "§12" in p) for p in problems] == [(True, False), (False, True)], problems


def test_github_anchors():
    assert slug("§4. Kernel") == "4-kernel"
    assert slug("§2. The routing trace (the contract every engine and importer writes)") == \
        "2-the-routing-trace-the-contract-every-engine-and-importer-writes"
    assert slug("Serve a placement with vLLM") == "serve-a-placement-with-vllm"
    assert slug("`lru_guard` and [links](x.md)") == "lru_guard-and-links"


# ---------------------------------------------------------------- names the text cites
DOTTED = re.compile(r"\bcoldset(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
NOT_CODE = {"coldset.run_key"}  # an MLflow tag's name, not a Python name


def _resolves(name: str) -> bool:
    """Whether ``name`` is a module of the package, or an attribute reachable from one."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def cited_names(text: str) -> set[str]:
    names = {m.group(0).rstrip(".") for m in DOTTED.finditer(text)}
    return {n for n in names if not n.endswith((".py", ".md", ".yaml", ".json", ".txt", ".html")) and n not in NOT_CODE}


def test_every_cited_python_name_exists():
    """A docstring, a docs page, the config schema or a rule that names ``coldset.x.y`` names a
    module or attribute that exists (BENCHMARKS.md and docs/history.md record what ran then)."""
    texts = [*ROOT.joinpath("src").rglob("*.py"), *ROOT.joinpath("workflow").rglob("*.py"),
             *ROOT.joinpath("workflow").rglob("*.smk"), ROOT / "README.md", ROOT / "config" / "schema.yaml",
             ROOT / "config" / "README.md", *(p for p in ROOT.joinpath("docs").glob("*.md") if p.name != "history.md")]
    missing = sorted((name, str(path.relative_to(ROOT))) for path in texts
                     for name in cited_names(path.read_text()) if not _resolves(name))
    assert missing == []


def test_a_stale_name_is_caught():
    assert cited_names("see coldset.cache.simulate and coldset.run_key") == {"coldset.cache.simulate"}
    assert not _resolves("coldset.cache.simulate") and _resolves("coldset.analysis.simulate.simulate")
