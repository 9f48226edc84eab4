"""What produced a measurement: the code's commit, the software stack and the device, recorded
by the process that measured (the bench stage on the GPU host) in its own output.

Every bench JSON carries ``provenance`` (:func:`collect_provenance`); :mod:`coldset.reporting.track` turns it
into MLflow tags and the report shows it, so neither ever substitutes the state of the machine
that runs them (which may be a laptop with another checkout, long after the GPU run).

The commit is that of the code that ran: ``git`` on the checkout this package is imported from
(with a dirty flag for changed tracked files); for a copy made with ``git archive`` (how code is
shipped to a GPU host without ``.git``), ``_commit.txt``, which ``git archive`` fills with the
commit through the ``export-subst`` attribute (.gitattributes), dirty ``false`` by construction;
otherwise ``unknown``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # src/coldset
PROJECT_ROOT = PACKAGE_DIR.parents[1]  # src/coldset -> the checkout
COMMIT_FILE = PACKAGE_DIR / "_commit.txt"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_commit() -> dict:
    """``{"commit", "dirty", "commit_source"}`` of the code this process imported (see module doc)."""
    top = _git("rev-parse", "--show-toplevel")
    # Only the checkout this package lives in: a copy under another repository's folder (e.g. an
    # unpacked archive inside a checkout) must not report that repository's commit.
    if top is not None and Path(top).resolve() == PROJECT_ROOT:
        head = _git("rev-parse", "HEAD")
        status = _git("status", "--porcelain", "--untracked-files=no")
        if head:
            return {"commit": head, "dirty": None if status is None else bool(status), "commit_source": "git"}
    try:
        text = COMMIT_FILE.read_text().strip()
    except OSError:
        text = ""
    if len(text) == 40 and all(c in "0123456789abcdef" for c in text):
        return {"commit": text, "dirty": False, "commit_source": "git archive"}
    return {"commit": "unknown", "dirty": None, "commit_source": "none (no git checkout, no git archive)"}


def collect_provenance(device, tuned=None, ceilings: dict | None = None) -> dict:
    """Provenance of a measurement made now on ``device``: the code's commit and dirty flag, torch,
    triton, CUDA runtime and driver versions, device name and compute capability (those of
    :func:`coldset.kernels.tune.device_fingerprint`), the autotune key and whether it was a cache hit
    (``tuned``: a :class:`coldset.kernels.tune.TuneResult`), and the read ceilings measured in the run."""
    from coldset.kernels.tune import device_fingerprint  # torch-heavy: only where the bench records provenance

    fp = device_fingerprint(device)
    out = {**code_commit(), **{k: fp.get(k) for k in ("torch", "triton", "python")},
           "cuda": fp.get("cuda"), "driver": fp.get("driver"), "device": fp.get("name"),
           "capability": fp.get("capability"), "device_type": fp.get("type"),
           "autotune_key": None if tuned is None else tuned.key,
           "autotune_hit": None if tuned is None else bool(tuned.hit),
           "ceilings": dict(ceilings) if ceilings else None}
    return out


# Provenance fields that become MLflow tags (coldset.reporting.track) and the report's header, in order.
TAG_FIELDS = ("commit", "dirty", "commit_source", "torch", "triton", "cuda", "driver", "device", "capability",
              "autotune_key", "autotune_hit")
