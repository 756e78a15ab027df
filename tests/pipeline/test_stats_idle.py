"""The stats record while nothing happens: one when work starts, each interval while it goes
on, one when it stops, then only a heartbeat every ``stats.heartbeat_s``; and a record's line
on a terminal stays short (the journal keeps every field)."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

import pytest
from inboxd import logs
from inboxd.config import load_config
from inboxd.pipeline.wiring import Pipeline

from support.terminal import run_on_a_terminal
from tests.conftest import write_config
from tests.fakes import FakeModel


def test_an_idle_daemon_logs_a_heartbeat_not_a_record_each_interval(
        tmp_path: Path, stderr_records: io.StringIO) -> None:
    now = [1000.0]
    config = load_config(write_config(tmp_path, stats={"interval_s": 10, "heartbeat_s": 300}))
    pipeline = Pipeline(config, FakeModel(), clock=lambda: now[0])  # type: ignore[arg-type]

    def interval() -> int:
        """One stats interval; how many records it logged."""
        before = stderr_records.getvalue().count("[stats]")
        now[0] += 10
        pipeline.report.log_stats(quiet_when_idle=True)
        return stderr_records.getvalue().count("[stats]") - before

    assert interval() == 1  # the first
    assert [interval() for _ in range(20)] == [0] * 20  # idle: quiet
    pipeline.stats.counters.completed += 1  # work goes on
    assert [interval(), interval(), interval()] == [1, 1, 0]  # ... and the one after it stops
    now[0] += 300
    assert interval() == 1  # the heartbeat
    assert interval() == 0
    assert pipeline.report.log_stats()["COMPLETED"] == 1  # asked for (at a stop): always logged
    assert stderr_records.getvalue().count("[stats]") == 5


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
@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_the_foreground_daemon_on_a_terminal_writes_short_lines(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    status, out = run_on_a_terminal([sys.executable, "-m", "inboxd", "once", "-c", str(config)],
                                    stdout_too=False)
    assert status == 0, out[-2000:]
    lines = [line for line in out.splitlines() if "[" in line]
    assert any("[stats]" in line for line in lines), lines
    too_long = [line for line in lines if len(line) > logs.TERMINAL_LINE_CHARS]
    assert too_long == [], too_long
