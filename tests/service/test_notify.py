"""inboxd.service.notify against a real AF_UNIX datagram socket standing in for systemd's."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from inboxd.service.notify import Notifier

from tests.fakes import NotifySocket


@pytest.fixture(params=["path", "abstract"])
def systemd(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NotifySocket]:
    if request.param == "path":
        fake = NotifySocket(str(tmp_path / "notify.socket"))
    else:
        fake = NotifySocket(f"@inboxd-test-{uuid.uuid4().hex}")
    yield fake
    fake.close()


def test_lifecycle_sequence_is_sent_exactly(systemd: NotifySocket) -> None:
    notifier = Notifier(systemd.env)
    assert notifier.enabled
    notifier.extend_timeout(12.5)
    notifier.ready()
    notifier.status("queue 2/2, completed 10,\nfailed 0")
    notifier.watchdog()
    notifier.reloading()
    notifier.ready()
    notifier.stopping()
    got = systemd.from_this_process(7)
    assert got[:4] == [
        "EXTEND_TIMEOUT_USEC=12500000",
        "READY=1",
        "STATUS=queue 2/2, completed 10, failed 0",
        "WATCHDOG=1",
    ]
    reload_lines = got[4].split("\n")
    assert reload_lines[0] == "RELOADING=1"
    assert reload_lines[1].startswith("MONOTONIC_USEC=")
    assert len(reload_lines) == 2
    assert got[5:] == ["READY=1", "STOPPING=1"]
    systemd.assert_empty()
    notifier.close()


def test_monotonic_usec_is_clock_monotonic(systemd: NotifySocket) -> None:
    notifier = Notifier(systemd.env)
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    (message,) = systemd.from_this_process(1)
    usec = int(message.split("\n")[1].removeprefix("MONOTONIC_USEC="))
    assert before <= usec <= after


def test_without_notify_socket_everything_is_a_no_op() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    notifier.ready()
    notifier.status("x")
    notifier.watchdog()
    notifier.reloading()
    notifier.extend_timeout(1)
    notifier.stopping()
    assert notifier.send("READY=1") is False
    assert notifier.watchdog_interval_s() is None


def test_unsupported_address_disables_notify() -> None:
    assert not Notifier({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled
    assert not Notifier({"NOTIFY_SOCKET": "@"}).enabled


def test_survives_the_socket_disappearing(
    systemd: NotifySocket, caplog: pytest.LogCaptureFixture
) -> None:
    notifier = Notifier(systemd.env)
    assert notifier.send("READY=1")
    systemd.from_this_process(1)
    systemd.close()  # systemd gone: ENOENT for a path, ECONNREFUSED for an abstract name
    with caplog.at_level(logging.DEBUG, logger="inboxd.notify"):
        notifier.status("still running")
        notifier.watchdog()
        assert notifier.send("STOPPING=1") is False
    failures = [r for r in caplog.records if r.name == "inboxd.notify"]
    assert len(failures) == 1  # said once, then quiet
    assert "failed" in failures[0].getMessage()

    again = NotifySocket(systemd.address)  # systemd is back
    try:
        assert notifier.send("WATCHDOG=1")
        assert again.from_this_process(1) == ["WATCHDOG=1"]
    finally:
        again.close()


@pytest.mark.parametrize(
    ("env", "timeout_s"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": str(os.getpid())}, 0.5),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "x"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], timeout_s: float | None) -> None:
    notifier = Notifier(env)
    assert notifier.watchdog_timeout_s() == timeout_s
    # Ping at half the timeout, as sd_watchdog_enabled(3) advises.
    assert notifier.watchdog_interval_s() == (None if timeout_s is None else timeout_s / 2)
