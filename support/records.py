"""A daemon's stderr records read back: the ``KEY=value`` fields of one line."""

from __future__ import annotations

import ast
import re

# A KEY=value field of a daemon's stderr record. A value holding whitespace, a quote or "=" is
# written as repr() writes it (inboxd.logs.format_value), spaces and all.
_FIELD = re.compile(
    r"""(?<!\S)([A-Z][A-Z0-9_]*)=(?:('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")(?!\S)|(\S+))""")


def line_fields(line: str) -> dict[str, str]:
    """The KEY=value fields of one stderr record line, quoted values unquoted."""
    return {key: ast.literal_eval(quoted) if quoted else bare
            for key, quoted, bare in _FIELD.findall(line)}


def numeric_fields(line: str) -> dict[str, float | str]:
    """``line_fields`` with every value that reads as a number as a float (for figures)."""
    fields: dict[str, float | str] = {}
    for key, value in line_fields(line).items():
        try:
            fields[key] = float(value)
        except ValueError:
            fields[key] = value
    return fields
