"""Logging to the systemd journal through its native protocol, with structured fields.

When systemd connects our stderr to the journal (``$JOURNAL_STREAM`` names fd 2), every record
goes out via ``systemd.journal.send`` as ``MESSAGE``, ``PRIORITY``, ``SYSLOG_IDENTIFIER=inboxd``,
``INBOXD_EVENT`` and the record's uppercase fields, so ``journalctl INBOXD_EVENT=stats -o json``
sees each counter as its own field. Otherwise records go to stderr as text. Never both.

If journald goes away the handler switches to stderr for good and says so once: the daemon
must outlive its logger. Note that libsystemd drops messages *silently* when the socket file is
missing (ENOENT), so the handler looks for the socket itself before each send.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, TextIO

from inboxd import logs

JOURNAL_SOCKET = "/run/systemd/journal/socket"
SYSLOG_IDENTIFIER = "inboxd"

# journald drops *everything* a unit logs beyond RateLimitBurst=10000 messages per
# RateLimitIntervalSec=30s, stats records included (it counts each priority class separately
# and only ever scales the burst up with free disk space). So the frequent per-file records
# (completed, failed, retry, deferred, ...) pass a token bucket per priority class: 1000 at
# once, then 100 per second. Worst case per class in any 30 s window: 1000 + 30 * 100 = 4000,
# leaving 6000 for the records that are never dropped: stats (at most one per second),
# lifecycle events, errors and the summaries below (one per 5 s). 100 lines a second is more
# than anyone reads; the stats record carries the exact counts anyway.
BUCKET_BURST = 1000
BUCKET_RATE_PER_S = 100.0
SUMMARY_INTERVAL_S = 5.0
# Never dropped. Per-file "failed" warnings are *not* exempt: a flood of bad files must not use
# up the warning class and hide a warning that matters, such as a rejected reload.
EXEMPT_EVENTS = frozenset({"started", "ready", "stats", "reloaded", "stopping", "suppressed"})

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


def _rate_class(priority: int) -> int:
    """journald's rate-limit pools: emerg..crit | err | warning | notice, info | debug."""
    return {0: 0, 1: 0, 2: 0, 3: 1, 4: 2, 5: 3, 6: 3}.get(priority, 4)


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


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RecordLimiter:
    """Token buckets for the frequent records, and a count of what they held back."""

    def __init__(
        self,
        *,
        burst: int = BUCKET_BURST,
        rate_per_s: float = BUCKET_RATE_PER_S,
        summary_interval_s: float = SUMMARY_INTERVAL_S,
        exempt_events: Iterable[str] = EXEMPT_EVENTS,
    ) -> None:
        self._burst = burst
        self._rate_per_s = rate_per_s
        self._summary_interval_s = summary_interval_s
        self._exempt = frozenset(exempt_events)
        self._buckets: dict[int, _Bucket] = {}  # at most 5 keys: journald's priority classes
        self._pending: dict[str, int] = {}  # suppressed since the last summary, by event
        self._total = 0
        self._last_summary: float | None = None

    def admit(self, record: logging.LogRecord, now: float) -> bool:
        event = logs.record_event(record)
        if record.levelno >= logging.ERROR or event in self._exempt:
            return True
        key = _rate_class(syslog_priority(record.levelno))
        bucket = self._buckets.setdefault(key, _Bucket(float(self._burst), now))
        bucket.tokens = min(
            float(self._burst), bucket.tokens + (now - bucket.updated) * self._rate_per_s
        )
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return True
        name = event or "other"
        self._pending[name] = self._pending.get(name, 0) + 1
        self._total += 1
        if self._last_summary is None:
            self._last_summary = now  # the first summary comes one interval after the first drop
        return False

    def summary(self, now: float, *, force: bool = False) -> logging.LogRecord | None:
        """A ``suppressed`` record when records were held back and the interval has passed."""
        if not self._pending or self._last_summary is None:
            return None
        if not force and now - self._last_summary < self._summary_interval_s:
            return None
        count = sum(self._pending.values())
        by_event = " ".join(f"{k}={v}" for k, v in sorted(self._pending.items()))
        fields: dict[str, Any] = {"SUPPRESSED": count, "SUPPRESSED_TOTAL": self._total}
        for name, n in self._pending.items():
            key = "SUPPRESSED_" + name.upper()
            if _FIELD_NAME.match(key):
                fields[key] = n
        self._pending.clear()
        self._last_summary = now
        return _make_record(
            logging.INFO,
            "suppressed",
            f"log rate limit: suppressed {count} records ({by_event})",
            fields,
        )


class JournalHandler(logging.Handler):
    """Sends records to journald; falls back to stderr for good if journald is unreachable."""

    def __init__(
        self,
        level: int = logging.NOTSET,
        *,
        sender: Sender | None = None,
        socket_path: str = JOURNAL_SOCKET,
        limiter: RecordLimiter | None = None,
        fallback_stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        extra_fields: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(level)
        self._sender: Sender = sender if sender is not None else _journal_send()
        self._socket_path = socket_path
        self._limiter = limiter if limiter is not None else RecordLimiter()
        self._fallback_stream = fallback_stream
        self._fallback: logging.Handler | None = None
        self._clock = clock
        self._extra = dict(extra_fields or {})  # e.g. a test run id on every record

    @property
    def fell_back(self) -> bool:
        return self._fallback is not None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            now = self._clock()
            if not self._limiter.admit(record, now):
                return
            summary = self._limiter.summary(now)
            if summary is not None:
                self._deliver(summary)
            self._deliver(record)
        except Exception:  # logging must never raise into the daemon
            self.handleError(record)

    def close(self) -> None:
        try:
            with self.lock or contextlib.nullcontext():  # emit() runs under the same lock
                summary = self._limiter.summary(self._clock(), force=True)
                if summary is not None:
                    self._deliver(summary)
        finally:
            super().close()

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

    def _deliver(self, record: logging.LogRecord) -> None:
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
