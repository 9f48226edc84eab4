"""The one rule for names that become paths or labels.

Model names, traffic domains (config and trace) and MLflow experiment names end up as file
names (``results/fixtures/{domain}.jsonl``), as artifact folders, as row keys of the statistics
(where ``(all)`` is the pooled row) and as text in figures. A name that holds ``/`` or ``..``
writes or deletes outside results/; ``(all)`` would silently replace the pooled statistics; ``$``
is mathtext to matplotlib. So every such name matches :data:`NAME_PATTERN`: a letter or digit,
then letters, digits, ``_``, ``.`` and ``-``, at most 64 characters, and not only dots.
config/schema.yaml carries the same pattern (tests/test_config.py checks they agree).
"""

from __future__ import annotations

import re

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_NAME = re.compile(NAME_PATTERN)


class InvalidNameError(ValueError):
    """A name that would become a path or label but breaks :data:`NAME_PATTERN`."""


def is_name(value: object) -> bool:
    return isinstance(value, str) and _NAME.fullmatch(value) is not None


def check_name(value: object, what: str) -> str:
    """Return ``value`` if it is a valid name, else raise naming ``what`` (e.g. ``trace x.parquet: domain``)."""
    if not is_name(value):
        raise InvalidNameError(f"{what} {value!r} is not a valid name: names become file names and labels, so they "
                         f"must match {NAME_PATTERN} (letters, digits, '_', '.', '-'; no '/', spaces or brackets)")
    return value
