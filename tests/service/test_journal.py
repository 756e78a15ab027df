"""inboxd.service.journal against a real journald: fields, stream detection, fallback, and the
record budget (inboxd.log_budget) under journald's own rate limit."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from inboxd import log_budget
from inboxd.service import journal as dj

from tests.journald import (  # noqa: F401
    journald,
    read_journal,
    send_marker,
    wait_for_entries,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_id() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def logger() -> Iterator[logging.Logger]:
    log = logging.getLogger(f"inboxd.test.{uuid.uuid4().hex}")
    log.propagate = False
    log.setLevel(logging.DEBUG)
    yield log
    for handler in list(log.handlers):
        handler.close()
        log.removeHandler(handler)


def _sentinel(run_id: str) -> None:
    """Datagrams on the journal socket are handled in order: once this one is readable, every
    record sent before it has been processed (stored or dropped)."""
    send_marker("INBOXD_SENTINEL", run_id, "sentinel")
    assert wait_for_entries({"INBOXD_SENTINEL": run_id}, 1), "sentinel never reached the journal"


# --- values and priorities (no journald needed) ----------------------------------------------


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.1 + 0.2, "0.3"),
        (3.0, "3"),
        (12.3456789, "12.3457"),
        (1.5e7, "15000000"),
        (1.5e-7, "0.00000015"),
        (float("nan"), "nan"),
        (42, "42"),
        (True, "True"),
        ("a b", "a b"),
        (b"\x00raw", b"\x00raw"),
    ],
)
def test_journal_value(value: object, text: str | bytes) -> None:
    assert dj.journal_value(value) == text


def test_syslog_priority() -> None:
    levels = [logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL]
    assert [dj.syslog_priority(lv) for lv in levels] == [7, 6, 4, 3, 2]


# --- fallback to stderr ---------------------------------------------------------------------


class _RecordingSender:
    def __init__(self, error: OSError | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.error = error

    def __call__(self, **fields: Any) -> None:
        self.calls.append(fields)
        if self.error is not None:
            raise self.error


def test_missing_socket_falls_back_to_stderr_once(tmp_path: Path, logger: logging.Logger) -> None:
    stream = io.StringIO()
    sender = _RecordingSender()
    handler = dj.JournalHandler(
        sender=sender, socket_path=str(tmp_path / "gone.socket"), fallback_stream=stream
    )
    logger.addHandler(handler)
    logger.info("first", extra={"inboxd_event": "completed", "inboxd_fields": {"PATH": "a.jpg"}})
    logger.info("second", extra={"inboxd_event": "completed", "inboxd_fields": {"PATH": "b.jpg"}})
    lines = stream.getvalue().splitlines()
    assert sender.calls == []  # libsystemd would have swallowed them silently
    assert handler.fell_back
    assert len(lines) == 3
    assert "[log_fallback] journal unreachable" in lines[0]
    assert "gone.socket" in lines[0]
    assert "[completed] first PATH=a.jpg" in lines[1]
    assert "[completed] second PATH=b.jpg" in lines[2]


def test_send_error_falls_back_for_good(tmp_path: Path, logger: logging.Logger) -> None:
    sock_path = tmp_path / "journal.socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(sock_path))  # a socket file nobody listens on once closed
    stream = io.StringIO()
    sender = _RecordingSender(ConnectionRefusedError(111, "Connection refused"))
    handler = dj.JournalHandler(sender=sender, socket_path=str(sock_path), fallback_stream=stream)
    logger.addHandler(handler)
    logger.warning("one")
    logger.warning("two")
    assert len(sender.calls) == 1  # permanent: journald is not tried again
    assert stream.getvalue().count("journal unreachable") == 1
    assert "one" in stream.getvalue() and "two" in stream.getvalue()


_REAL_LIBSYSTEMD_FALLBACK = """
import io, logging, socket
from inboxd.service import journal as dj

def attempt(label):
    stream = io.StringIO()
    handler = dj.JournalHandler(fallback_stream=stream)
    handler.handle(logging.makeLogRecord({"msg": label, "levelno": 20, "levelname": "INFO"}))
    print(label, handler.fell_back, stream.getvalue().replace(chr(10), " | "))

attempt("missing")
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind("/run/systemd/journal/socket")
s.close()  # the file stays, nobody listens: ECONNREFUSED, like a dead journald
attempt("refused")
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root")
def test_real_libsystemd_failures_fall_back() -> None:
    """The default sender (libsystemd) with journald gone, in a private mount namespace whose
    /run/systemd/journal is an empty tmpfs: a missing socket (libsystemd is silent about it)
    and a refused one (libsystemd raises)."""
    script = (
        "mkdir -p /run/systemd/journal && mount -t tmpfs tmpfs /run/systemd/journal && "
        f'exec "{sys.executable}" -c "$INBOXD_SCRIPT"'
    )
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "INBOXD_SCRIPT": _REAL_LIBSYSTEMD_FALLBACK},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    missing, refused = proc.stdout.splitlines()
    assert missing.startswith("missing True ") and "No such file" in missing, missing
    assert refused.startswith("refused True ") and "Connection refused" in refused, refused
    assert "INFO    missing" in missing and "INFO    refused" in refused


# --- stderr_is_journal ----------------------------------------------------------------------


def test_stderr_is_journal_false(tmp_path: Path) -> None:
    with open(tmp_path / "f", "w") as f:
        st = os.fstat(f.fileno())
        here = f"{st.st_dev}:{st.st_ino}"
        assert dj.stderr_is_journal({"JOURNAL_STREAM": here}, fd=f.fileno())
        assert not dj.stderr_is_journal({}, fd=f.fileno())
        assert not dj.stderr_is_journal({"JOURNAL_STREAM": f"{st.st_dev}:1"}, fd=f.fileno())
        assert not dj.stderr_is_journal({"JOURNAL_STREAM": "garbage"}, fd=f.fileno())
        assert not dj.stderr_is_journal({"JOURNAL_STREAM": here}, fd=12345)  # not open


_STREAM_CHILD = """
import logging, sys
from inboxd import logs
from inboxd.service import journal
print(journal.stderr_is_journal(), flush=True)
journal.setup_logging("info")


def announce():
    logs.emit(logging.INFO, "started", "hello through the native protocol",
              inboxd_test_run=sys.argv[1])


announce()
"""
# The line of _STREAM_CHILD where announce() calls logs.emit.
ANNOUNCE_LINE = 1 + [line.strip() for line in _STREAM_CHILD.splitlines()].index(
    'logs.emit(logging.INFO, "started", "hello through the native protocol",')


def test_journal_stream_is_detected_and_native_protocol_used(
    journald: None,  # noqa: F811
    run_id: str,
) -> None:
    """Do what systemd does for a service: connect stderr to journald's stream socket and set
    JOURNAL_STREAM. The daemon must log natively (structured) and write nothing to the stream."""
    ident = f"inboxd-stream-{run_id}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stream:
        stream.connect("/run/systemd/journal/stdout")
        # identifier, unit, priority, level_prefix, forward to syslog, kmsg, console
        stream.sendall(f"{ident}\n\n6\n0\n0\n0\n0\n".encode())
        st = os.fstat(stream.fileno())
        env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        child = subprocess.run(
            [sys.executable, "-c", _STREAM_CHILD, run_id],
            stderr=stream.fileno(),
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
            timeout=60,
            check=False,
        )
        stream.sendall(b"stream sentinel\n")
    assert child.returncode == 0
    assert child.stdout.strip() == "True"

    native = wait_for_entries({"INBOXD_TEST_RUN": run_id}, 1)
    assert len(native) == 1
    assert native[0]["_TRANSPORT"] == "journal"
    assert native[0]["SYSLOG_IDENTIFIER"] == "inboxd"
    assert native[0]["INBOXD_EVENT"] == "started"
    # The code that logged, not logs.emit, which every record passes through.
    assert (native[0]["CODE_FILE"], native[0]["CODE_FUNC"], native[0]["CODE_LINE"]) == (
        "<string>", "announce", str(ANNOUNCE_LINE))
    # Once our sentinel line arrived, anything the child wrote to stderr would have too.
    streamed = wait_for_entries({"SYSLOG_IDENTIFIER": ident}, 1)
    assert [e["MESSAGE"] for e in streamed] == ["stream sentinel"]


def test_stderr_not_journal_uses_plain_stderr(run_id: str) -> None:
    child = subprocess.run(
        [sys.executable, "-c", _STREAM_CHILD, run_id],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"},
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "False"
    assert f"[started] hello through the native protocol INBOXD_TEST_RUN={run_id}" in child.stderr


# --- records in the real journal -------------------------------------------------------------


def test_records_and_fields_reach_the_journal(
    journald: None,  # noqa: F811
    run_id: str,
    logger: logging.Logger,
) -> None:
    logger.addHandler(dj.JournalHandler(extra_fields={"INBOXD_TEST_RUN": run_id}))
    fields = {
        "PATH": "in box/a.jpg",
        "LATENCY_MS": 12.3456789,
        "THROUGHPUT": 1.5e7,
        "BATCH": 8,
        "NOTE": "two\nlines",
        "lowercase": "dropped: journald would ignore it",
        "MESSAGE": "must not override the message",
    }
    logger.info("done a.jpg", extra={"inboxd_event": "completed", "inboxd_fields": fields})
    logger.warning("bad b.jpg", extra={"inboxd_event": "failed", "inboxd_fields": {"PATH": "b"}})
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("crashed")

    entries = wait_for_entries({"INBOXD_TEST_RUN": run_id}, 3)
    assert len(entries) == 3
    done, bad, crashed = entries
    for entry in entries:
        assert entry["SYSLOG_IDENTIFIER"] == "inboxd"
        assert entry["_TRANSPORT"] == "journal"
        assert entry["CODE_FILE"] == __file__
        assert entry["CODE_FUNC"] == "test_records_and_fields_reach_the_journal"
        assert int(entry["CODE_LINE"]) > 0
    assert done["MESSAGE"] == "done a.jpg"
    assert done["PRIORITY"] == "6"
    assert done["INBOXD_EVENT"] == "completed"
    assert done["PATH"] == "in box/a.jpg"
    assert done["LATENCY_MS"] == "12.3457"
    assert done["THROUGHPUT"] == "15000000"
    assert done["BATCH"] == "8"
    assert done["NOTE"] == "two\nlines"
    assert "lowercase" not in done and "LOWERCASE" not in done
    assert (bad["PRIORITY"], bad["INBOXD_EVENT"]) == ("4", "failed")
    assert crashed["PRIORITY"] == "3"
    assert "INBOXD_EVENT" not in crashed
    assert "ValueError: boom" in crashed["MESSAGE"]


# --- a burst of per-file records under journald's real rate limit ----------------------------

_BURST = """
import json, logging, sys, time
from inboxd import log_budget, logs
from inboxd.service import journal as dj

run, total, exempt_completed = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
if exempt_completed:
    logs.budget = log_budget.RecordBudget(exempt_events={*log_budget.EXEMPT_EVENTS, "completed"})
handler = dj.JournalHandler(extra_fields={"INBOXD_TEST_RUN": run})
logs.install_handler(handler, "info")
chunk, stats = 1000, 0
start = time.monotonic()
for done in range(1, total + 1):
    logs.emit(logging.INFO, "completed", f"completed f{done}.jpg", path=f"f{done}.jpg")
    if done % chunk == 0:
        stats += 1
        logs.emit(logging.INFO, "stats", "stats", completed=done, seq=stats)
        if not exempt_completed:
            time.sleep(0.1)  # 30,000 records over about 3 s
elapsed = time.monotonic() - start
print(json.dumps({"stats": stats, "elapsed_s": elapsed, "fell_back": handler.fell_back}))
# The last "suppressed" summary is logged on the way out (logs.flush_suppressed, at exit).
"""


def _unit_cgroup(name: str) -> Path | None:
    """A cgroup named like a service, so journald applies its per-unit rate limit to what we
    send from it (it does not rate-limit processes outside any unit)."""
    if os.geteuid() != 0:
        return None
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (root / "cgroup.controllers").exists():
            try:
                (root / name).mkdir()
            except OSError:
                return None
            return root / name
    return None


def _burst(run_id: str, total: int, *, exempt_completed: bool) -> tuple[dict[str, Any], bool]:
    unit = f"inboxd-burst-{run_id[:12]}.service"
    cgroup = _unit_cgroup(unit)
    python = [sys.executable, "-c", _BURST, run_id, str(total), "1" if exempt_completed else "0"]
    if cgroup is not None:
        cmd = ["sh", "-c", f'echo $$ > "{cgroup}/cgroup.procs" && exec "$@"', "sh", *python]
    else:
        cmd = python
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=240)
    finally:
        if cgroup is not None:
            cgroup.rmdir()
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    _sentinel(run_id)
    in_unit = False
    if cgroup is not None:
        sample = read_journal({"INBOXD_TEST_RUN": run_id, "INBOXD_EVENT": "stats"})
        in_unit = bool(sample) and sample[0].get("_SYSTEMD_UNIT") == unit
    return result, in_unit


def test_burst_of_per_file_records_keeps_every_stats_record(
    journald: None,  # noqa: F811
    run_id: str,
) -> None:
    result, in_unit = _burst(run_id, 30_000, exempt_completed=False)
    assert not result["fell_back"]

    stats = read_journal({"INBOXD_TEST_RUN": run_id, "INBOXD_EVENT": "stats"})
    assert sorted(int(e["SEQ"]) for e in stats) == list(range(1, 31))
    completed = read_journal({"INBOXD_TEST_RUN": run_id, "INBOXD_EVENT": "completed"})
    summaries = read_journal({"INBOXD_TEST_RUN": run_id, "INBOXD_EVENT": "suppressed"})
    suppressed = sum(int(e["SUPPRESSED"]) for e in summaries)
    assert summaries and int(summaries[-1]["SUPPRESSED_TOTAL"]) == suppressed
    # Every record is accounted for: in the journal, or counted in a summary.
    assert len(completed) + suppressed == 30_000
    # ... and the journal got no more than the bucket allows, far below journald's 10,000/30 s.
    allowed = log_budget.BUCKET_BURST + log_budget.BUCKET_RATE_PER_S * (result["elapsed_s"] + 1)
    assert len(completed) <= allowed
    if os.geteuid() == 0:
        assert in_unit, "burst did not run as a unit: journald's rate limit was not in play"


def test_burst_without_the_budget_loses_stats(
    journald: None,  # noqa: F811
    run_id: str,
) -> None:
    """The control: the same kind of flood with per-file records exempt from the bucket trips
    journald's limit (10,000 per 30 s, scaled up to at most 40,000 by free space) and the
    stats records after that point are lost. This is what the budget is for."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the flood inside a unit-like cgroup")
    result, in_unit = _burst(run_id, 60_000, exempt_completed=True)
    assert in_unit
    stats = read_journal({"INBOXD_TEST_RUN": run_id, "INBOXD_EVENT": "stats"})
    if len(stats) == result["stats"]:
        pytest.skip("this journald does not rate-limit (RateLimitBurst=0 or a huge burst)")
    assert len(stats) < result["stats"]
