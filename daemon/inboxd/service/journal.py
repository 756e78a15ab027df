"""Logging to the systemd journal through its native protocol, with structured fields.

When systemd connects our stderr to the journal (``$JOURNAL_STREAM`` names fd 2), every record
goes out via ``systemd.journal.send`` as ``MESSAGE``, ``PRIORITY``, ``SYSLOG_IDENTIFIER=inboxd``,
``INBOXD_EVENT`` and the record's uppercase fields, so ``journalctl INBOXD_EVENT=stats -o json``
sees each counter as its own field. Otherwise records go to stderr as text. Never both. The
frequent records are budgeted before they get here, whichever the sink (``inboxd.log_budget``).

If journald goes away the handler switches to stderr for good and says so once: the daemon
must outlive its logger. Note that libsystemd drops messages *silently* when the socket file is
missing (ENOENT), so the handler looks for the socket itself before each send.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
import stat
import sys
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any, TextIO

from inboxd import logs

JOURNAL_SOCKET = "/run/systemd/journal/socket"
SYSLOG_IDENTIFIER = "inboxd"

Sender = Callable[..., object]  # like systemd.journal.send(MESSAGE=..., **fields)


def _journal_send() -> Sender:
    """systemd-python's ``send``, imported only when the journal is in use: the daemon runs
    without systemd-python elsewhere (a bare GPU machine, a terminal). Imported by name because
    the repo's systemd/ folder (unit files) looks like a namespace package to mypy and ruff; at
    run time the installed package wins."""
    try:
        module: Any = importlib.import_module("systemd.journal")
    except ImportError as exc:
        raise RuntimeError("stderr is connected to the journal but systemd-python is not "
                           "installed: pip install systemd-python (it needs libsystemd-dev "
                           "and pkg-config to build)") from exc
    send: Sender = module.send
    return send


# journald silently drops fields whose names are not this (and "_" names are its own).
_FIELD_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


def syslog_priority(levelno: int) -> int:
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


def journal_value(value: object) -> str | bytes:
    """Field values as text; floats compact (6 significant digits, never an exponent)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, float) and math.isfinite(value):
        text = f"{value:.6g}"
        return format(Decimal(text), "f") if "e" in text else text
    return str(value)


def stderr_is_journal(environ: Mapping[str, str] | None = None, fd: int = 2) -> bool:
    """True when ``$JOURNAL_STREAM`` ("device:inode") is the file open on ``fd``."""
    raw = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    dev, sep, ino = raw.partition(":")
    if not (sep and dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return st.st_dev == int(dev) and st.st_ino == int(ino)


def _make_record(level: int, event: str, message: str, fields: dict[str, Any]) -> logging.LogRecord:
    record = logging.LogRecord(logs.LOGGER_NAME, level, __file__, 0, message, None, None)
    record.inboxd_event = event
    record.inboxd_fields = fields
    return record


class JournalHandler(logging.Handler):
    """Sends records to journald; falls back to stderr for good if journald is unreachable."""

    def __init__(
        self,
        level: int = logging.NOTSET,
        *,
        sender: Sender | None = None,
        socket_path: str = JOURNAL_SOCKET,
        fallback_stream: TextIO | None = None,
        extra_fields: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(level)
        self._sender: Sender = sender if sender is not None else _journal_send()
        self._socket_path = socket_path
        self._fallback_stream = fallback_stream
        self._fallback: logging.Handler | None = None
        self._extra = dict(extra_fields or {})  # e.g. a test run id on every record

    @property
    def fell_back(self) -> bool:
        return self._fallback is not None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self._fallback is None:
                try:
                    st = os.stat(self._socket_path)  # libsystemd says nothing when it is missing
                    if not stat.S_ISSOCK(st.st_mode):
                        raise ConnectionRefusedError(f"{self._socket_path} is not a socket")
                    self._sender(**self.journal_fields(record))
                    return
                except OSError as exc:
                    self._switch_to_stderr(exc)
            assert self._fallback is not None
            self._fallback.emit(record)
        except Exception:  # logging must never raise into the daemon
            self.handleError(record)

    def journal_fields(self, record: logging.LogRecord) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "MESSAGE": self.format(record),
            "PRIORITY": str(syslog_priority(record.levelno)),
            "SYSLOG_IDENTIFIER": SYSLOG_IDENTIFIER,
            "CODE_FILE": record.pathname,
            "CODE_LINE": record.lineno,
            "CODE_FUNC": record.funcName or "",
        }
        event = logs.record_event(record)
        if event:
            fields["INBOXD_EVENT"] = event
        for source in (self._extra, logs.record_fields(record)):
            for key, value in source.items():
                # The fields above win; journald would silently drop an invalid name.
                if key not in fields and _FIELD_NAME.match(key):
                    fields[key] = journal_value(value)
        return fields

    def _switch_to_stderr(self, exc: OSError) -> None:
        fallback = logging.StreamHandler(self._fallback_stream or sys.stderr)
        fallback.setFormatter(logs.StderrFormatter())
        self._fallback = fallback
        notice = _make_record(
            logging.WARNING,
            "log_fallback",
            "journal unreachable, logging to stderr from now on",
            {"JOURNAL_ERROR": str(exc)},
        )
        fallback.emit(notice)


def setup_logging(level: str) -> None:
    """Journal when systemd connected stderr to it, plain stderr otherwise — never both."""
    if stderr_is_journal():
        logs.install_handler(JournalHandler(), level)
    else:
        logs.setup_stderr_logging(level)
