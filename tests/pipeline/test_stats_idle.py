"""The stats record while nothing happens: one when work starts, each interval while it goes
on, one when it stops, then only a heartbeat every ``stats.heartbeat_s``; and a record's line
on a terminal stays short (the journal keeps every field)."""

from __future__ import annotations

import io
import logging
import os
import pty
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from inboxd import logs
from inboxd.config import load_config
from inboxd.pipeline.wiring import Pipeline

from tests.conftest import REPO, write_config
from tests.fakes import FakeModel


@pytest.fixture
def stats_lines() -> Iterator[io.StringIO]:
    saved = list(logs.log.handlers), logs.log.level, logs.log.propagate
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.StderrFormatter())
    logs.install_handler(handler, "info")
    yield stream
    handlers, level, propagate = saved
    logs.log.removeHandler(handler)
    for old in handlers:
        logs.log.addHandler(old)
    logs.log.setLevel(level)
    logs.log.propagate = propagate


def test_an_idle_daemon_logs_a_heartbeat_not_a_record_each_interval(
        tmp_path: Path, stats_lines: io.StringIO) -> None:
    now = [1000.0]
    config = load_config(write_config(tmp_path, stats={"interval_s": 10, "heartbeat_s": 300}))
    pipeline = Pipeline(config, FakeModel(), clock=lambda: now[0])  # type: ignore[arg-type]

    def interval() -> int:
        """One stats interval; how many records it logged."""
        before = stats_lines.getvalue().count("[stats]")
        now[0] += 10
        pipeline.report.log_stats(quiet_when_idle=True)
        return stats_lines.getvalue().count("[stats]") - before

    assert interval() == 1  # the first
    assert [interval() for _ in range(20)] == [0] * 20  # idle: quiet
    pipeline.stats.counters.completed += 1  # work goes on
    assert [interval(), interval(), interval()] == [1, 1, 0]  # ... and the one after it stops
    now[0] += 300
    assert interval() == 1  # the heartbeat
    assert interval() == 0
    assert pipeline.report.log_stats()["COMPLETED"] == 1  # asked for (at a stop): always logged
    assert stats_lines.getvalue().count("[stats]") == 5


def test_a_records_line_on_a_terminal_stays_short() -> None:
    formatter = logs.StderrFormatter(logs.TERMINAL_LINE_CHARS)
    record = logging.LogRecord("inboxd", logging.INFO, __file__, 1, "completed x.jpg: cat 0.9",
                               None, None)
    record.inboxd_event = "completed"
    record.inboxd_fields = {f"FIELD_{n}": "v" * 20 for n in range(40)}
    line = formatter.format(record)
    assert len(line) <= logs.TERMINAL_LINE_CHARS and line.endswith(" …"), line
    assert "completed x.jpg: cat 0.9 FIELD_0=" in line
    # Redirected (scripts and tests read the fields), every field stays.
    assert "FIELD_39=" in logs.StderrFormatter().format(record)


@pytest.mark.daemon
@pytest.mark.timeout(120)
def test_the_foreground_daemon_on_a_terminal_writes_short_lines(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    controller, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "inboxd", "once", "-c", str(config)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=terminal,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "daemon")})
    os.close(terminal)
    out = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the daemon has gone, and with it the terminal's other side
            break
        if not chunk:
            break
        out += chunk
    os.close(controller)
    assert proc.wait(60) == 0
    lines = [line for line in out.decode(errors="replace").splitlines() if "[" in line]
    assert any("[stats]" in line for line in lines), lines
    too_long = [line for line in lines if len(line) > logs.TERMINAL_LINE_CHARS]
    assert too_long == [], too_long
