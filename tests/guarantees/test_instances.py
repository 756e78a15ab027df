"""Several daemons on one inbox: each file is claimed by exactly one of them, and the files a
SIGKILLed instance had claimed come back (on its restart, or by ``inboxd recover``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import DaemonProcess, make_image, wait_until, write_config


def completed_names(daemon: DaemonProcess) -> list[str]:
    """Files this daemon ran through the model (not the ones it only finished as duplicates)."""
    return [line.split("PATH=")[1].split()[0] for line in daemon.records("completed")
            if "DUPLICATE=" not in line]


def test_two_instances_share_an_inbox_and_survive_a_kill(tmp_path: Path, daemon_factory) -> None:
    total = 300
    config = write_config(tmp_path, inbox={"settle_ms": 0, "rescan_interval_s": 1},
                          capacity={"event_buffer": 32})
    a = daemon_factory(config, "--instance", "a")
    b = daemon_factory(config, "--instance", "b")
    a.wait_for("ready")
    b.wait_for("ready")
    inbox = tmp_path / "inbox"
    for n in range(total):
        make_image(tmp_path / "src" / f"{n}.png", size=(16, 16), color=(n % 256, 3, 3))
        os.rename(tmp_path / "src" / f"{n}.png", inbox / f"{n}.png")

    # Kill a mid-flood, once it has really taken part, with files still claimed.
    a.wait_for("completed", 120, count=20)
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(30)
    claimed_by_a = list((inbox / ".processing" / "a").rglob("*.png"))

    # b cannot take a's files while a is merely dead: its claim is a's. An operator (or a's
    # restart) returns them; a running b then finishes them.
    done = subprocess.run([sys.executable, "-m", "inboxd", "recover", "-c", str(config),
                           "--instance", "a"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"returned {len(claimed_by_a)} file(s)" in done.stdout

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
    assert not list((inbox / ".processing").rglob("*.png"))


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
