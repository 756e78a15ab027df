"""Watches that fail after start-up (issue 36, class 6): inotify's watch limit reached for
folders made while the daemon runs. The notify crate under watchfiles drops that failure
without a word, and photos in those folders waited for the rescan timer. The limit is set
inside a user namespace of the daemon's own (``/proc/sys/user/max_inotify_watches`` is per
user namespace; the machine's own limit is never touched)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from support.waiting import wait_until
from tests.conftest import DaemonProcess, make_image, write_config

RESCAN_S = 120  # far beyond the deadlines below: only the watcher (or polling) can be in time
# The plain model: no background build of a fast path competing for the CPU meanwhile.
MODEL = {"runtime": "torch"}
WATCHES = 12  # the inbox and the daemon's own folders at start-up, and a few more


def user_namespace_with_watches(watches: int) -> list[str]:
    """A command prefix: run in a new user namespace whose inotify watch limit is ``watches``."""
    return ["unshare", "--user", "--map-root-user", "sh", "-c",
            f'echo {watches} > /proc/sys/user/max_inotify_watches && exec "$@"', "sh"]


def namespaces_work() -> bool:
    try:
        return subprocess.run([*user_namespace_with_watches(8), "true"], timeout=30,
                              capture_output=True).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.daemon
@pytest.mark.slow
@pytest.mark.skipif(not namespaces_work(), reason="needs unshare --user with its own limits")
def test_folders_past_the_watch_limit_are_polled_and_said_once(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    config = write_config(tmp_path, inbox={"settle_ms": 0, "rescan_interval_s": RESCAN_S},
                          model=MODEL)
    daemon = daemon_factory(config, prefix=user_namespace_with_watches(WATCHES))
    daemon.wait_for("ready")
    inbox, done = tmp_path / "inbox", tmp_path / "done"
    assert not daemon.records("watch_error"), "the limit was reached at start-up already"
    for n in range(20):  # 20 new folders: most of them past the limit
        (inbox / f"camera{n}").mkdir()
    # The folders' events are handled in order: once a photo dropped after them is done, the
    # watcher has seen (and tried to watch) every folder.
    make_image(tmp_path / "src" / "marker.png", color=(1, 2, 3))
    os.rename(tmp_path / "src" / "marker.png", inbox / "marker.png")
    wait_until(lambda: (done / "marker.png").exists(), 30, "the marker done")
    started = time.monotonic()
    for n in range(20):  # 4 photos into each: in an unwatched folder they raise no event
        for m in range(4):
            make_image(tmp_path / "src" / f"{n}-{m}.png", color=(n * 10, m * 50, 7))
            os.rename(tmp_path / "src" / f"{n}-{m}.png", inbox / f"camera{n}" / f"{m}.png")
    try:
        wait_until(lambda: len(list(done.rglob("*.png"))) == 81, RESCAN_S / 3, "80 photos done")
    except AssertionError:
        print("\n".join(line for line in daemon.lines if "watch" in line))
        raise
    took_s = time.monotonic() - started
    print(f"80 photos in folders made after start-up done in {took_s:.1f} s")
    assert took_s < RESCAN_S / 3
    warnings = daemon.records("watch_error")
    assert len(warnings) == 1, warnings
    assert "fs.inotify.max_user_watches" in warnings[0]
    assert daemon.stop() == 0


@pytest.mark.daemon
@pytest.mark.slow
def test_a_name_that_is_not_utf8_renamed_back_and_forth_leaves_the_watcher_up(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    """watchfiles' notify crate could not make such a path a str and its watcher failed for
    good: the daemon started a new one at each rename (20 restarts in 21 s)."""
    config = write_config(tmp_path, inbox={"settle_ms": 0, "rescan_interval_s": RESCAN_S},
                          model=MODEL)
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    inbox, done = tmp_path / "inbox", tmp_path / "done"
    warm = make_image(tmp_path / "src" / "warm.png", color=(5, 5, 5))  # the first is slower
    os.rename(warm, inbox / "warm.png")
    wait_until(lambda: (done / "warm.png").exists(), 60, "the first photo done")
    odd, other = (os.fsencode(inbox) + b"/\xff\xfe-odd-" + end for end in (b"a.bin", b"b.bin"))
    with open(odd, "wb"):
        pass
    stop = threading.Event()

    def storm() -> None:
        while not stop.is_set():
            os.rename(odd, other)
            os.rename(other, odd)
            stop.wait(0.01)

    renaming = threading.Thread(target=storm)
    renaming.start()
    latencies_s = []
    try:
        for n in range(10):
            source = make_image(tmp_path / "src" / f"p{n}.png", color=(n * 20, 9, 9))
            dropped = time.monotonic()
            os.rename(source, inbox / source.name)
            wait_until(lambda n=n: (done / f"p{n}.png").exists(), 20, f"p{n}.png done")
            latencies_s.append(time.monotonic() - dropped)
    finally:
        stop.set()
        renaming.join()
    print("latencies during the rename storm (s):", [round(x, 2) for x in latencies_s])
    assert daemon.records("watch_error") == []
    assert max(latencies_s) < RESCAN_S / 10
    assert daemon.stop() == 0
