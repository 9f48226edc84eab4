"""Atomic file writes (a stage's output is complete or absent, never half-written) and the JSON
readers that name the file, line and column of what they refuse."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def share_mode(path: str | os.PathLike) -> None:
    """Give a finished temporary file (or folder) the mode a plain ``open`` (``mkdir``) would have
    under the process's umask: ``mkstemp`` makes 0600 and ``mkdtemp`` 0700, but results are meant
    to be shared as the user's umask says (0644 / 0755 under umask 022)."""
    base = 0o777 if Path(path).is_dir() else 0o666
    os.chmod(path, base & ~_umask())


def remove_orphans(path: str | os.PathLike) -> list[Path]:
    """Remove the temporary siblings of ``path`` that a killed writer of ``path`` left behind.

    Writers here name their temporaries after the target (``.{name}.*.tmp``, ``{name}.*.tmp``,
    folders ``.{name}.tmp-*`` and ``.{name}.old-*``), so the next run of the stage that writes
    ``path`` cleans up after a previous one that died; other files are never touched.
    """
    path = Path(path)
    if not path.parent.is_dir():
        return []
    name = glob.escape(path.name)
    found = set()
    for pattern in (f".{name}.*.tmp", f"{name}.*.tmp", f".{name}.tmp-*", f".{name}.old-*"):
        found.update(path.parent.glob(pattern))
    for orphan in sorted(found):
        if orphan.is_dir() and not orphan.is_symlink():
            shutil.rmtree(orphan, ignore_errors=True)
        else:
            orphan.unlink(missing_ok=True)
    return sorted(found)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; on success it replaces ``path``, on error it is removed.

    Orphans of a previous, killed write of ``path`` are removed first (:func:`remove_orphans`);
    the result gets the umask's mode (:func:`share_mode`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        share_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON, atomically."""
    return write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """Read a JSON file; a missing or malformed file is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid JSON: {exc}") from exc


def jsonl_records(path: str | os.PathLike, error: type[Exception]) -> Iterator[tuple[str, Any]]:
    """Each non-blank line of the JSON Lines file ``path``, parsed: ``(f"{path}:{line}", value)``;
    a line that is not UTF-8 or not JSON raises ``error`` (the caller's own) naming the file, the
    line and the column. Lines end at ``\\n`` only (JSON may hold other line separators in strings)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            yield where, value
