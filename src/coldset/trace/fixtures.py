"""Prompt fixtures per traffic domain: rendered from jinja2 templates, or read from a user JSONL.

Routing skew is a property of traffic, so the pipeline profiles on prompts grouped by *domain*
(agent tool-calling transcripts, prose, code, or whatever the user adds). Each fixture file
``fixtures/{domain}.jsonl`` holds one prompt per line::

    {"id": "agent-0003", "domain": "agent", "split": "profile", "prompt": "...", "max_new_tokens": 64}

``split`` is ``profile`` (which chooses the cold set) or ``heldout`` (which tests it).

Templates: ``{domain}.j2`` in ``template_dir`` (looked up first) or in the package's
``templates/`` folder (agent, prose, code). A template draws its variety from seeded helpers in
its context, so a prompt depends only on (seed, domain, index):

* ``choice(seq)``, ``sample(seq, n)``, ``shuffled(seq)``, ``randint(a, b)`` (inclusive),
  ``uniform(a, b)``, ``chance(p)`` (True with probability p), and the ``random`` filter;
* ``to_json(obj, indent=None)`` (and filter ``to_json``): plain ``json.dumps``, no HTML escaping;
* ``index`` (0-based prompt number), ``domain``, ``max_new_tokens``.

User prompts (config ``fixtures.prompts``): a JSONL, one object a line, with ``prompt`` and
``domain`` required and ``id``, ``split``, ``max_new_tokens`` optional; it replaces the
templates. Every line is validated and an error names the file and line.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import SandboxedEnvironment

from coldset.core.files import atomic_path, jsonl_records
from coldset.core.names import NAME_PATTERN, is_name

from coldset.core.trace import SPLITS, split_of

PACKAGE_TEMPLATES = Path(__file__).parent / "templates"
TEMPLATE_SUFFIX = ".j2"
_FIELDS = ("id", "domain", "split", "prompt", "max_new_tokens")


class FixtureError(ValueError):
    """Bad fixture input; the message names the file and line, or the template."""


@dataclass(frozen=True)
class Fixture:
    """One prompt of the traffic to profile."""

    id: str
    domain: str
    split: str  # "profile" | "heldout"
    prompt: str
    max_new_tokens: int


def _derived_seed(*parts: Any) -> int:
    """A seed from several values, stable across processes and Python versions."""
    text = ":".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def available_domains(template_dir: str | os.PathLike | None = None) -> list[str]:
    """Domains that have a template: the package's plus ``template_dir``'s, sorted."""
    names = {p.name[: -len(TEMPLATE_SUFFIX)] for p in PACKAGE_TEMPLATES.glob(f"*{TEMPLATE_SUFFIX}")}
    if template_dir is not None:
        names |= {p.name[: -len(TEMPLATE_SUFFIX)] for p in Path(template_dir).glob(f"*{TEMPLATE_SUFFIX}")}
    return sorted(names)


class _Dice:
    """The seeded random helpers a template sees; ``rng`` is swapped per prompt."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def choice(self, seq):
        seq = list(seq)
        if not seq:
            raise FixtureError("template called choice() on an empty sequence")
        return seq[self.rng.randrange(len(seq))]

    def sample(self, seq, n):
        seq = list(seq)
        return self.rng.sample(seq, min(int(n), len(seq)))

    def shuffled(self, seq):
        seq = list(seq)
        self.rng.shuffle(seq)
        return seq

    def randint(self, a, b):
        return self.rng.randint(int(a), int(b))

    def uniform(self, a, b):
        return self.rng.uniform(float(a), float(b))

    def chance(self, p):
        return self.rng.random() < float(p)


def _to_json(obj: Any, indent: int | None = None) -> str:
    return json.dumps(obj, ensure_ascii=False, indent=indent)


def _environment(template_dir: str | os.PathLike | None, dice: _Dice):
    search = ([str(template_dir)] if template_dir is not None else []) + [str(PACKAGE_TEMPLATES)]
    # Templates are user files, possibly from a shared folder: rendering one must not run code
    # (no attribute walks to os.system, no dunder access), so they render in jinja2's sandbox.
    env = SandboxedEnvironment(
        loader=jinja2.FileSystemLoader(search),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=False,
        autoescape=False,
    )
    # jinja's own ``random`` filter uses the global RNG: replace it so output follows the seed.
    env.filters["random"] = dice.choice
    env.filters["to_json"] = _to_json
    env.globals.update(
        choice=dice.choice, sample=dice.sample, shuffled=dice.shuffled, randint=dice.randint,
        uniform=dice.uniform, chance=dice.chance, to_json=_to_json,
    )
    return env


def _heldout_indices(n: int, heldout_fraction: float, seed: int, domain: str) -> set[int]:
    """Exactly round(n * fraction) held-out prompts, chosen by the seed; both splits non-empty
    whenever n >= 2 and 0 < fraction < 1."""
    if not 0.0 <= heldout_fraction <= 1.0:
        raise FixtureError(f"heldout_fraction must lie in [0, 1], got {heldout_fraction}")
    m = round(n * heldout_fraction)
    if n >= 2 and 0 < heldout_fraction < 1:
        m = min(max(m, 1), n - 1)
    return set(random.Random(_derived_seed(seed, domain, "split")).sample(range(n), m))


def render_domain(domain: str, per_domain: int, heldout_fraction: float, max_new_tokens: int, seed: int,
                  template_dir: str | os.PathLike | None = None) -> list[Fixture]:
    """Render ``per_domain`` prompts from ``{domain}.j2`` (user template dir first)."""
    if not is_name(domain):
        raise FixtureError(f"domain name {domain!r} must match {NAME_PATTERN} (it names a file and a label)")
    dice = _Dice()
    env = _environment(template_dir, dice)
    try:
        template = env.get_template(domain + TEMPLATE_SUFFIX)
    except jinja2.TemplateNotFound:
        where = ([str(template_dir)] if template_dir is not None else []) + [str(PACKAGE_TEMPLATES)]
        raise FixtureError(f"no template {domain}{TEMPLATE_SUFFIX} for domain {domain!r} in {where}; "
                           f"domains with templates: {available_domains(template_dir)}") from None
    except jinja2.TemplateSyntaxError as e:
        raise FixtureError(f"template {e.filename or domain + TEMPLATE_SUFFIX}:{e.lineno}: {e.message}") from None
    source, _, _ = env.loader.get_source(env, domain + TEMPLATE_SUFFIX)
    if not source.strip():
        raise FixtureError(f"template {template.filename} is empty: it would render empty prompts")
    heldout = _heldout_indices(per_domain, heldout_fraction, seed, domain)
    out = []
    for i in range(per_domain):
        dice.rng = random.Random(_derived_seed(seed, domain, i))
        try:
            text = template.render(index=i, domain=domain, max_new_tokens=max_new_tokens)
        except jinja2.exceptions.SecurityError as e:
            raise FixtureError(f"template {template.filename}: prompt {i} tried an operation the sandbox refuses "
                               f"({e}); templates render text, they cannot call into Python") from None
        except jinja2.TemplateError as e:
            raise FixtureError(f"template {template.filename}: rendering prompt {i} failed: {e}") from None
        text = re.sub(r"\n{3,}", "\n\n", text).strip()
        if not text.strip():
            raise FixtureError(f"template {template.filename} rendered an empty prompt (index {i})")
        out.append(Fixture(f"{domain}-{i:04d}", domain, "heldout" if i in heldout else "profile", text,
                           int(max_new_tokens)))
    return out


def source_files(domains: Sequence[str], template_dir: str | os.PathLike | None = None,
                 user_prompts: str | os.PathLike | None = None) -> list[Path]:
    """The files the fixtures are made from: the user's prompt file, or each domain's template
    as :func:`render_domain` finds it (``template_dir`` first). The workflow's fixtures and model
    rules list them as inputs, so an edited template or prompt file reruns what it feeds."""
    if user_prompts is not None:
        return [Path(user_prompts)]
    out = []
    for d in domains:
        found = [Path(folder) / f"{d}{TEMPLATE_SUFFIX}" for folder in (template_dir, PACKAGE_TEMPLATES) if folder]
        out += [p for p in found if p.is_file()][:1]
    return out


def template_texts(domains: Sequence[str], per_domain: int, seed: int,
                   template_dir: str | os.PathLike | None = None) -> dict[str, list[str]]:
    """Rendered template text per domain, for ``write_synthetic_checkpoint(domain_texts=...)``.

    The synthetic checkpoint learns which tokens belong to which domain from its training text;
    giving it text of the fixtures' own kind (render with a seed other than the fixtures') makes
    the default model route each fixture domain differently. Measured on the default
    SyntheticSpec, 8 prompts a domain, 16 new tokens: decode Spearman between domains 0.47-0.63
    without it, 0.22-0.28 with it (200 texts a domain).
    """
    return {d: [f.prompt for f in render_domain(d, per_domain, 0.0, 1, seed, template_dir)] for d in domains}


def _check_record(obj: Any, where: str, *, strict: bool, heldout_fraction: float, default_max_new: int | None,
                  n_in_domain: int) -> Fixture:
    """Validate one JSON line. ``strict``: every field required (fixture files we wrote)."""
    if not isinstance(obj, dict):
        raise FixtureError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_FIELDS))
    if unknown:
        raise FixtureError(f"{where}: unknown field(s) {unknown}; allowed: {list(_FIELDS)}")
    required = _FIELDS if strict else ("domain", "prompt")
    missing = [f for f in required if f not in obj]
    if missing:
        raise FixtureError(f"{where}: missing field(s) {missing}")
    prompt, domain = obj["prompt"], obj["domain"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise FixtureError(f"{where}: field 'prompt' must be a non-empty string")
    if not is_name(domain):
        raise FixtureError(f"{where}: field 'domain' must be a name matching {NAME_PATTERN} (it names a file "
                           f"and a label), got {domain!r}")
    rid = obj.get("id", f"{domain}-{n_in_domain:04d}")
    if not isinstance(rid, str) or not rid:
        raise FixtureError(f"{where}: field 'id' must be a non-empty string, got {rid!r}")
    split = obj.get("split")
    if split is None:
        split = split_of(rid, heldout_fraction)
    elif split not in SPLITS:
        raise FixtureError(f"{where}: field 'split' is {split!r}, expected one of {list(SPLITS)}")
    mnt = obj.get("max_new_tokens", default_max_new)
    if isinstance(mnt, bool) or not isinstance(mnt, int) or mnt < 1:
        raise FixtureError(f"{where}: field 'max_new_tokens' must be a positive integer, got {mnt!r}")
    return Fixture(rid, domain, split, prompt, mnt)


def _read_jsonl(path: Path, *, strict: bool, heldout_fraction: float = 0.25,
                default_max_new: int | None = None) -> list[Fixture]:
    if not path.is_file():
        raise FixtureError(f"{path}: file not found")
    out: list[Fixture] = []
    per_domain: dict[str, int] = {}
    for where, obj in jsonl_records(path, FixtureError):
        dom = obj.get("domain") if isinstance(obj, dict) else None
        n = per_domain.get(dom, 0) if isinstance(dom, str) else 0
        fx = _check_record(obj, where, strict=strict, heldout_fraction=heldout_fraction,
                           default_max_new=default_max_new, n_in_domain=n)
        per_domain[fx.domain] = n + 1
        out.append(fx)
    return out


def read_user_prompts(path: str | os.PathLike, heldout_fraction: float, max_new_tokens: int) -> list[Fixture]:
    """Validate a user's prompt JSONL: ``prompt``, ``domain`` required; ``id`` (default
    ``{domain}-{n:04d}``), ``split`` (default :func:`coldset.core.trace.split_of` on the id) and
    ``max_new_tokens`` (default ``max_new_tokens``) optional. Ids must be unique."""
    fixtures = _read_jsonl(Path(path), strict=False, heldout_fraction=heldout_fraction,
                           default_max_new=max_new_tokens)
    if not fixtures:
        raise FixtureError(f"{path}: no prompts")
    _check_unique(fixtures, str(path))
    return fixtures


def _check_unique(fixtures: Sequence[Fixture], where: str) -> None:
    seen: set[str] = set()
    for fx in fixtures:
        if fx.id in seen:
            raise FixtureError(f"{where}: duplicate id {fx.id!r}")
        seen.add(fx.id)


def write_fixtures(path: str | os.PathLike, fixtures: Sequence[Fixture]) -> Path:
    """Write fixtures as JSONL, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for fx in fixtures:
            f.write(json.dumps(asdict(fx), ensure_ascii=False) + "\n")
    return path


def make_fixtures(out_dir: str | os.PathLike, domains: Sequence[str] | None, per_domain: int,
                  heldout_fraction: float, max_new_tokens: int, seed: int,
                  template_dir: str | os.PathLike | None = None,
                  user_prompts: str | os.PathLike | None = None) -> list[Path]:
    """The ``fixtures`` stage: write ``out_dir/{domain}.jsonl`` per domain (the prompts of
    :func:`fixtures_by_domain`); return the paths."""
    by_domain = fixtures_by_domain(domains, per_domain, heldout_fraction, max_new_tokens, seed,
                                   template_dir=template_dir, user_prompts=user_prompts)
    out = Path(out_dir)
    return [write_fixtures(out / f"{d}.jsonl", fxs) for d, fxs in by_domain.items()]


def fixtures_by_domain(domains: Sequence[str] | None, per_domain: int, heldout_fraction: float,
                       max_new_tokens: int, seed: int, template_dir: str | os.PathLike | None = None,
                       user_prompts: str | os.PathLike | None = None) -> dict[str, list[Fixture]]:
    """The fixtures the ``fixtures`` stage writes, per domain, without writing them (the config
    check renders or reads them before any job starts: a bad prompt file or template is refused
    before Snakemake deletes a stage's previous outputs).

    From templates: ``per_domain`` prompts per domain, exactly ``round(per_domain *
    heldout_fraction)`` of them held out (both splits non-empty when ``per_domain >= 2``),
    deterministic from ``seed``. From ``user_prompts`` (replacing the templates): every prompt
    of the file, grouped by domain; ``domains`` (if given) selects domains and each must occur
    in the file; ``per_domain`` is not used.
    """
    if user_prompts is not None:
        fixtures = read_user_prompts(user_prompts, heldout_fraction, max_new_tokens)
        by_domain: dict[str, list[Fixture]] = {}
        for fx in fixtures:
            by_domain.setdefault(fx.domain, []).append(fx)
        if domains:
            absent = [d for d in domains if d not in by_domain]
            if absent:
                raise FixtureError(f"{user_prompts}: no prompts for domain(s) {absent}; the file has {list(by_domain)}")
            by_domain = {d: by_domain[d] for d in domains}
    else:
        if not domains:
            raise FixtureError("make_fixtures needs at least one domain (or user_prompts)")
        if per_domain < 1:
            raise FixtureError(f"per_domain must be >= 1, got {per_domain}")
        if max_new_tokens < 1:
            raise FixtureError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(set(domains)) != len(domains):
            raise FixtureError(f"domains {list(domains)} repeat a name")
        by_domain = {d: render_domain(d, per_domain, heldout_fraction, max_new_tokens, seed, template_dir)
                     for d in domains}
    return by_domain


def read_fixtures(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Fixture]:
    """Read fixture files (every field required, ids unique across files), in order."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Fixture] = []
    for p in paths:
        out.extend(_read_jsonl(Path(p), strict=True))
    _check_unique(out, ", ".join(str(p) for p in paths))
    return out
