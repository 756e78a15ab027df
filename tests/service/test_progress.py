"""``inboxd once`` on a terminal: a progress bar (total, rate, time left) on its own line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from inboxd.service.progress import bar_line

from support.terminal import run_on_a_terminal
from tests.conftest import make_image, write_config


def test_the_bar_says_how_far_how_fast_and_how_long() -> None:
    assert bar_line(50, 0, 200, 10.0) == (
        "[#######.....................] 50/200  25%  5.0 files/s  ETA 00:30")
    assert bar_line(190, 10, 200, 100.0).endswith("100%  2.0 files/s  ETA 00:00  10 failed")
    assert "ETA --:--" in bar_line(0, 0, 10, 1.0)


@pytest.mark.daemon
@pytest.mark.timeout(180)
@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_once_on_a_terminal_draws_a_progress_bar(tmp_path: Path) -> None:
    config = write_config(tmp_path, inbox={"settle_ms": 0})
    for n in range(6):
        make_image(tmp_path / "inbox" / f"{n}.png", color=(n * 30, 0, 0))
    status, out = run_on_a_terminal([sys.executable, "-m", "inboxd", "once", "-c",
                                     str(config)])
    assert status == 0, out[-2000:]
    assert "] 6/6 100%" in out and "files/s  ETA" in out, out[-2000:]
    # Each record clears the bar's line first: no record is written after the bar on its line.
    for line in out.replace("\r\n", "\n").split("\n"):
        shown = line.rsplit("\r", 1)[-1].replace("\x1b[K", "")
        assert not ("] " in shown and "files/s" in shown and "[completed]" in shown), line
