"""Several daemons on one inbox: each file is claimed by exactly one of them, and the files a
SIGKILLed instance had claimed come back by themselves: a surviving instance takes the dead
one's lock and returns them (``files/takeover.py``); its restart or ``inboxd recover`` do too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import (
    DaemonProcess,
    last_stats,
    line_fields,
    make_image,
    wait_until,
    write_config,
)


def completed_names(daemon: DaemonProcess) -> list[str]:
    """Files this daemon ran through the model (not the ones it only finished as duplicates)."""
    return [line.split("PATH=")[1].split()[0] for line in daemon.records("completed")
            if "DUPLICATE=" not in line]


@pytest.mark.daemon
@pytest.mark.slow
def test_a_survivor_returns_a_killed_instances_files_by_itself(tmp_path: Path,
                                                              daemon_factory) -> None:
    """Two daemons on one inbox; a is SIGKILLed mid-flood and not restarted. b finds a's lock
    free, returns a's claimed files and processes them: every file exactly one result, none
    inferred twice, nothing left claimed — and while a lived, b never touched a's files. A
    link planted in place of an instance's lock is never followed."""
    total = 300
    config = write_config(tmp_path, inbox={"settle_ms": 0, "rescan_interval_s": 1},
                          capacity={"event_buffer": 32})
    inbox = tmp_path / "inbox"
    processing = inbox / ".processing"
    outside = tmp_path / "outside.lock"
    outside.write_bytes(b"someone else's")
    (processing / "x").mkdir(parents=True)
    (processing / "x" / "kept.jpg").write_bytes(b"x's")
    (processing / "x.lock").symlink_to(outside)
    a = daemon_factory(config, "--instance", "a")
    b = daemon_factory(config, "--instance", "b")
    a.wait_for("ready")
    b.wait_for("ready")
    for n in range(total):
        make_image(tmp_path / "src" / f"{n}.png", size=(16, 16), color=(n % 256, 3, 3))
        os.rename(tmp_path / "src" / f"{n}.png", inbox / f"{n}.png")

    # Kill a mid-flood, once it has really taken part, with files still claimed. b has swept
    # for dead instances every second meanwhile: a was alive, so none of them took anything.
    a.wait_for("completed", 120, count=20)
    assert not b.records("instance_taken_over"), "a live instance's files were taken"
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(30)

    taken = b.wait_for("instance_taken_over", 30)
    print(taken[0])
    taken_over = line_fields(taken[0])
    assert len(taken) == 1 and taken_over["DEAD_INSTANCE"] == "a", taken
    assert int(taken_over["RETURNED"]) > 0, "a held nothing when it was killed"
    results = tmp_path / "results"
    wait_until(lambda: len(list(results.glob("*.json"))) == total, 300, "every result")
    assert b.stop() == 0

    by_instance = {"a": 0, "b": 0}
    for result in results.glob("*.json"):
        by_instance[json.loads(result.read_text())["instance"]] += 1
    assert by_instance["a"] > 0 and by_instance["b"] > 0, by_instance
    inferred = completed_names(a) + completed_names(b)
    assert len(inferred) == len(set(inferred)), "a file went through the model twice"
    assert len({p.name for p in (tmp_path / "done").iterdir()}) == total
    assert not list(processing.rglob("*.png"))
    assert not (tmp_path / "failed").exists() or not list((tmp_path / "failed").iterdir())
    assert "TAKEN_OVER=" in b.records("stats")[-1]
    assert int(last_stats(b.records("stats"))["TAKEN_OVER"]) == int(taken_over["RETURNED"])
    # The planted link: reported once, neither it nor what it points to touched.
    assert any("x.lock" in line for line in b.records("takeover_refused"))
    assert outside.read_bytes() == b"someone else's" and (processing / "x.lock").is_symlink()
    assert (processing / "x" / "kept.jpg").read_bytes() == b"x's"
    # a can start again under its name.
    again = daemon_factory(config, "--instance", "a")
    again.wait_for("ready")
    assert again.stop() == 0


@pytest.mark.daemon
def test_recover_returns_a_dead_instances_files(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    processing = tmp_path / "inbox" / ".processing"
    (processing / "a").mkdir(parents=True)
    (processing / "a" / "x.png").write_bytes(b"x")
    done = subprocess.run([sys.executable, "-m", "inboxd", "recover", "-c", str(config),
                           "--instance", "a"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "returned 1 file(s)" in done.stdout
    assert (tmp_path / "inbox" / "x.png").read_bytes() == b"x"


@pytest.mark.daemon
@pytest.mark.slow
def test_recover_refuses_a_running_instance(tmp_path: Path, daemon_factory) -> None:
    config = write_config(tmp_path)
    daemon = daemon_factory(config, "--instance", "x")
    daemon.wait_for("ready")
    done = subprocess.run([sys.executable, "-m", "inboxd", "recover", "-c", str(config),
                           "--instance", "x"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 75
    assert "already running" in done.stderr
    twin = subprocess.run([sys.executable, "-m", "inboxd", "run", "-c", str(config),
                           "--instance", "x"], capture_output=True, text=True, timeout=120)
    assert twin.returncode == 75, "a second daemon with the same instance name must refuse"
    assert daemon.stop() == 0
