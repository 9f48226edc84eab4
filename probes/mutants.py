# Probe, not a tool: the mutation experiment of issue 18 (rewrites source files while it runs; use on a clean checkout).
"""Apply each mutant of a spec file to the source, run the tests that should kill it, revert.

    PYTHONPATH=src python probes/mutants.py probes/mutants_issue18.json [name-substring]

A spec is a JSON list of ``{"name", "file", "old", "new", "tests"}``: ``old`` must occur exactly
once in ``file``; it is replaced by ``new``, ``pytest -x`` runs ``tests``, and the file is restored
whatever happens. Prints KILLED (the tests failed) or SURVIVED per mutant; exits 1 if any survived.
Run it on a clean checkout: it rewrites source files while it runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    only = argv[1] if len(argv) > 1 else ""
    survived = 0
    for m in spec:
        if only not in m["name"]:
            continue
        path = Path(m["file"])
        src = path.read_text()
        if src.count(m["old"]) != 1:
            print(f"STALE    {m['name']}: the text to mutate occurs {src.count(m['old'])} times in {path}")
            survived += 1
            continue
        path.write_text(src.replace(m["old"], m["new"]))
        try:
            rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m["tests"]],
                                capture_output=True, text=True).returncode
        finally:
            path.write_text(src)
        survived += rc == 0
        print(f"{'KILLED  ' if rc else 'SURVIVED'} {m['name']}  ({' '.join(m['tests'])})", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
