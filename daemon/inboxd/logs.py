"""Structured log records: one event name plus uppercase fields on every record.

Every record that matters to an operator is emitted through :func:`emit`, which attaches
``INBOXD_EVENT`` and a dict of uppercase fields. The stderr formatter prints them as
``KEY=value`` pairs; the journal handler (``inboxd.service.journal``) sends them as native
journal fields, so ``journalctl INBOXD_EVENT=stats -o json`` sees exactly what stderr shows.
The frequent records pass :data:`budget` first (``inboxd.log_budget`` says why), whichever
the sink.
"""

from __future__ import annotations

import atexit
import functools
import logging
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from inboxd.log_budget import RecordBudget, Summary

LOGGER_NAME = "inboxd"
log = logging.getLogger(LOGGER_NAME)
budget = RecordBudget()  # process-wide, like the logger

# journald silently drops fields whose names are not [A-Z0-9_], starting with a letter.
_FIELD_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


@functools.lru_cache(maxsize=256)  # the keys are the code's own few dozen; checked once each
def field_name(key: str) -> str:
    name = key.upper()
    if not _FIELD_NAME.match(name):
        raise ValueError(f"journal field name {key!r} is not [A-Z0-9_]")
    return name


def emit(level: int, event: str, message: str, **fields: Any) -> None:
    """Log one record carrying ``INBOXD_EVENT=event`` and ``fields`` (names upper-cased),
    unless the budget holds it back."""
    if log.isEnabledFor(level) and budget.admit(level, event):
        _record(level, event, message, fields)


def emit_made(level: int, event: str, make: Callable[[], tuple[str, dict[str, Any]]]) -> None:
    """``emit`` of the (message, fields) that ``make`` returns, called only when the record
    is logged: for the per-file records, whose message and fields cost more to make than
    the level and the budget cost to ask, and which either holds back for most files."""
    if log.isEnabledFor(level) and budget.admit(level, event):
        message, fields = make()
        _record(level, event, message, fields)


def _record(level: int, event: str, message: str, fields: dict[str, Any]) -> None:
    summary = budget.summary()
    if summary is not None:
        _log_summary(summary)
    record_fields = {
        field_name(k): printable(v) if isinstance(v, str) else v
        for k, v in fields.items()
        if v is not None
    }
    # stacklevel 3: the record's file, line and function (the journal's CODE_FILE, CODE_LINE,
    # CODE_FUNC) are those of the code that called emit, not these lines.
    log.log(level, printable(message), stacklevel=3,
            extra={"inboxd_event": event, "inboxd_fields": record_fields})


def _log_summary(summary: Summary) -> None:
    # handle, not info: held-back warnings are summarised even where the level hides info.
    log.handle(log.makeRecord(LOGGER_NAME, logging.INFO, __file__, 0, summary.message, (), None,
                              extra={"inboxd_event": "suppressed",
                                     "inboxd_fields": summary.fields}))


@atexit.register  # runs before logging's own exit hook (registered earlier), so handlers are open
def flush_suppressed() -> None:
    """Log what the budget held back since its last summary, whatever the interval."""
    summary = budget.summary(force=True)
    if summary is not None:
        _log_summary(summary)


def printable(text: str) -> str:
    """File names may hold bytes that are not UTF-8 (kept by Python as lone surrogates); the
    journal and terminals need UTF-8, so show those bytes as ``\\xNN`` escapes."""
    if text.isascii():  # nearly every name: nothing to escape
        return text
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def escape_controls(text: str) -> str:
    """Every character a terminal or a line-based reader would act on — C0/C1 controls (a
    newline forges a log line, ESC drives the terminal), DEL, line separators, bidi overrides
    — as ``\\xNN``/``\\uNNNN``. For every line-oriented sink (stderr, ``STATUS=``, command
    output); the journal's fields keep the bytes, and a JSON file escapes them itself."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escaped(ch) for ch in text)


def _escaped(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def shown(value: object) -> str:
    """``value`` as one printable line: bytes that are not UTF-8 and controls escaped."""
    return escape_controls(printable(str(value)))


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    fields: dict[str, Any] = getattr(record, "inboxd_fields", {})
    return fields


def record_event(record: logging.LogRecord) -> str | None:
    return getattr(record, "inboxd_event", None)


# \s is str.isspace()'s whitespace: a value with any of these is quoted.
_NEEDS_QUOTES = re.compile(r"[\s\"'=]")


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    if not text or _NEEDS_QUOTES.search(text) or not text.isprintable():
        return repr(text)  # repr escapes every character str.isprintable() refuses
    return text


# A record's line on a terminal (a daemon run in the foreground, watched by a person): the
# message and what fields fit. Redirected, every field is kept (scripts and tests read them);
# the journal always keeps every field.
TERMINAL_LINE_CHARS = 200


class StderrFormatter(logging.Formatter):
    """``2026-11-30T07:40:01.123Z INFO completed a/b.jpg KEY=value ...`` — one line per record;
    at most ``max_chars`` long when given (a cut line ends in ``…``)."""

    _second = -1
    _stamp = ""

    def __init__(self, max_chars: int | None = None) -> None:
        super().__init__()
        self.max_chars = max_chars

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:  # one strftime per second, not one per record
            self._second, self._stamp = second, time.strftime("%Y-%m-%dT%H:%M:%S",
                                                              time.gmtime(second))
        stamp = self._stamp
        millis = int(record.msecs)
        parts = [f"{stamp}.{millis:03d}Z", f"{record.levelname:<7}"]
        event = record_event(record)
        if event:
            parts.append(f"[{event}]")
        parts.append(escape_controls(record.getMessage()))
        fields = record_fields(record)
        if self.max_chars is not None:
            line = _fitted(" ".join(parts), fields, self.max_chars)
        else:
            if fields:
                parts.append(" ".join(f"{k}={format_value(v)}" for k, v in fields.items()))
            line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _fitted(head: str, fields: dict[str, Any], max_chars: int) -> str:
    """``head`` and as many fields as fit in ``max_chars``, cut with ``…``."""
    if len(head) > max_chars:
        return head[:max_chars - 1] + "…"
    line = head
    for key, value in fields.items():
        more = f" {key}={format_value(value)}"
        if len(line) + len(more) > max_chars - 2:
            return line + " …"
        line += more
    return line


def setup_stderr_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(StderrFormatter(TERMINAL_LINE_CHARS if sys.stderr.isatty() else None))
    install_handler(handler, level)


def install_handler(handler: logging.Handler, level: str) -> None:
    """Replace whatever handler the inboxd logger had: stderr *or* journal, never both."""
    for old in list(log.handlers):
        log.removeHandler(old)
    log.addHandler(handler)
    log.setLevel(level.upper())
    log.propagate = False
