"""A daemon's stderr records read back: the ``KEY=value`` fields of one line; and this
process's own records captured as the daemon writes them to stderr."""

from __future__ import annotations

import ast
import io
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

from inboxd import logs

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


@contextmanager
def captured_stderr_records() -> Iterator[io.StringIO]:
    """The inboxd logger set up as the daemon sets it for stderr, into a string; as it was
    afterwards (its handlers, level and propagation are global: later code reads them)."""
    saved = list(logs.log.handlers), logs.log.level, logs.log.propagate
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.StderrFormatter())
    logs.install_handler(handler, "info")
    try:
        yield stream
    finally:
        handlers, level, propagate = saved
        logs.log.removeHandler(handler)
        for old in handlers:
            logs.log.addHandler(old)
        logs.log.setLevel(level)
        logs.log.propagate = propagate
