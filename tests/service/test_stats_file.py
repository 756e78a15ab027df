"""``inboxd stats -c`` and ``inboxd report -c`` for a daemon run without journald: they read
the stats file the daemon keeps (``files.stats_file``), say whose record it is, and never show
another daemon's as this one's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import REPO, make_image, write_config


def inboxd(*args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "JOURNAL_STREAM"}
    return subprocess.run([sys.executable, "-m", "inboxd", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=240,
                          env={**env, "PYTHONPATH": str(REPO / "daemon")})


@pytest.mark.daemon
@pytest.mark.timeout(400)
@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_stats_and_report_of_a_foreground_daemon_without_a_journal(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for root, count in ((ours, 3), (theirs, 1)):
        root.mkdir()
        config = write_config(root, inbox={"settle_ms": 0})
        for n in range(count):
            make_image(root / "inbox" / f"{n}.png", color=(n * 40, 10, 10))
        assert inboxd("once", "-c", str(config)).returncode == 0
    # Another daemon, its own config, in the same place a careless reader might look.
    shown = inboxd("stats", "--json", "-c", str(ours / "inboxd.yaml"))
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout.splitlines()[-1])
    assert (record["COMPLETED"], record["INSTANCE"]) == (3, "default")
    table = inboxd("stats", "-c", str(ours / "inboxd.yaml"))
    assert table.returncode == 0 and "completed 3" in table.stdout
    assert "instance default, pid " in table.stdout and "(not running)" in table.stdout
    report = inboxd("report", "-c", str(ours / "inboxd.yaml"), "-o", str(tmp_path / "r.png"))
    assert report.returncode == 0, report.stderr
    with Image.open(tmp_path / "r.png") as image:
        assert image.size[1] > image.size[0]  # the five panels, one above the other


def test_a_stats_file_of_two_daemons_is_not_drawn_as_one(tmp_path: Path) -> None:
    from inboxd.config import load_config
    from inboxd.files.stats_file import stats_path
    from inboxd.service.readback import write_report

    config = load_config(write_config(tmp_path))
    path = stats_path(config)
    path.parent.mkdir(parents=True)
    lines = [{"TIME": "2026-12-05T10:00:00+00:00", "INSTANCE": "default", "PID": 1,
              "CONFIG": "a.yaml", "COMPLETED": 1},
             {"TIME": "2026-12-05T10:00:10+00:00", "INSTANCE": "default", "PID": 2,
              "CONFIG": "b.yaml", "COMPLETED": 5}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert write_report(None, None, None, tmp_path / "r.png", config) == 1
    assert not (tmp_path / "r.png").exists()
