"""Provenance: the commit of the code that ran, from git or from a ``git archive`` copy's stamp."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coldset.bench.provenance import PROJECT_ROOT, code_commit, collect_provenance

GIT = shutil.which("git")


def _git(*args):
    return subprocess.run(["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True).stdout.strip()


def _commit_in(src: Path) -> dict:
    code = "import json; from coldset.bench.provenance import code_commit; print(json.dumps(code_commit()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}, cwd=src)
    import json

    return json.loads(out.stdout)


@pytest.mark.skipif(GIT is None or not (PROJECT_ROOT / ".git").exists(), reason="needs a git checkout")
def test_commit_of_the_checkout_and_of_an_archive_copy(tmp_path):
    head = _git("rev-parse", "HEAD")
    here = code_commit()
    assert here["commit"] == head and here["commit_source"] == "git"
    assert here["dirty"] == bool(_git("status", "--porcelain", "--untracked-files=no"))
    # A copy made with git archive (how code travels to a GPU host without .git) carries the
    # commit through export-subst; a plain copy of the files says it does not know.
    archive = subprocess.run(["git", "-C", str(PROJECT_ROOT), "archive", "HEAD", "src/coldset"],
                             capture_output=True, check=True).stdout
    (tmp_path / "a").mkdir()
    subprocess.run(["tar", "-x", "-C", str(tmp_path / "a")], input=archive, check=True)
    assert _commit_in(tmp_path / "a" / "src") == {"commit": head, "dirty": False, "commit_source": "git archive"}
    shutil.copytree(PROJECT_ROOT / "src" / "coldset", tmp_path / "plain" / "coldset")
    assert _commit_in(tmp_path / "plain")["commit"] == "unknown"


def test_collect_provenance_names_the_stack():
    import torch

    class Tuned:
        key, hit = "k" * 64, True

    prov = collect_provenance(torch.device("cpu"), Tuned(), {"hbm_read_gb_s": 1.0})
    assert prov["torch"] == torch.__version__ and prov["device_type"] == "cpu"
    assert prov["autotune_key"] == "k" * 64 and prov["autotune_hit"] is True
    assert prov["ceilings"] == {"hbm_read_gb_s": 1.0} and prov["commit"]
