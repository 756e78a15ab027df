"""A real journald for the tests that read the journal back.

``journald`` is a session fixture: it makes sure ``/run/systemd/journal/socket`` accepts
datagrams and that ``journalctl`` sees a record sent through it. When no journald is listening
and we are root, it starts ``/lib/systemd/systemd-journald`` (it runs fine without systemd as
PID 1) and leaves it running, like ``.ci/journald.sh``. If none can be had, the tests skip — or
fail when ``$CI`` is set, so CI can never pass by skipping them.

Import it into conftest.py or a test module: ``from tests.journald import journald``.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

JOURNAL_SOCKET = Path("/run/systemd/journal/socket")
JOURNALD = Path("/lib/systemd/systemd-journald")
START_TIMEOUT_S = 15.0


def socket_accepting(path: Path = JOURNAL_SOCKET) -> bool:
    """True when something receives datagrams on ``path`` (ENOENT/ECONNREFUSED otherwise)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def read_journal(
    matches: Mapping[str, str], *, extra_args: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """All entries matching ``FIELD=value`` pairs (ANDed), as journalctl's JSON objects."""
    args = ["journalctl", "--no-pager", "-a", "-o", "json", *extra_args]
    args += [f"{k}={v}" for k, v in matches.items()]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode not in (0, 1):  # 1: nothing matched on some versions
        raise RuntimeError(f"journalctl failed ({proc.returncode}): {proc.stderr.strip()}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def wait_for_entries(
    matches: Mapping[str, str], count: int, *, timeout_s: float = 20.0
) -> list[dict[str, Any]]:
    """Poll until at least ``count`` entries match (journald writes asynchronously)."""
    deadline = time.monotonic() + timeout_s
    entries = read_journal(matches)
    while len(entries) < count and time.monotonic() < deadline:
        time.sleep(0.1)
        entries = read_journal(matches)
    return entries


def send_marker(field: str, value: str, message: str = "inboxd test marker") -> None:
    """One record straight through libsystemd (the repo's systemd/ folder of unit files would
    shadow the package for mypy, hence import_module)."""
    journal: Any = importlib.import_module("systemd.journal")
    journal.send(message, SYSLOG_IDENTIFIER="inboxd-test", **{field: value})


def _journal_sees_a_probe(timeout_s: float) -> bool:
    run = uuid.uuid4().hex
    send_marker("INBOXD_PROBE", run, "inboxd test probe")
    return bool(wait_for_entries({"INBOXD_PROBE": run}, 1, timeout_s=timeout_s))


def ensure_journald(timeout_s: float = START_TIMEOUT_S) -> str | None:
    """Make a journald available; None when it is, else why not."""
    if shutil.which("journalctl") is None:
        return "journalctl is not installed"
    if not socket_accepting():
        if os.geteuid() != 0:
            return f"no journald listening on {JOURNAL_SOCKET} and not root to start one"
        if not JOURNALD.exists():
            return f"no journald listening and {JOURNALD} is missing"
        JOURNAL_SOCKET.parent.mkdir(parents=True, exist_ok=True)
        # A fixed system binary, left running after the session like .ci/journald.sh leaves it.
        subprocess.Popen(
            [str(JOURNALD)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while not socket_accepting() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not socket_accepting():
            return f"started {JOURNALD}, but {JOURNAL_SOCKET} never accepted"
    try:
        if not _journal_sees_a_probe(timeout_s):
            return "journald accepts records but journalctl does not show them"
    except ImportError:
        return "systemd-python is not installed"
    return None


@pytest.fixture(scope="session")
def journald() -> Iterator[None]:
    reason = ensure_journald()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"journal tests required in CI: {reason}")
        pytest.skip(reason)
    yield
