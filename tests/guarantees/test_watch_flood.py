"""The inotify reader (``files/inotify.py``) attacked by experiment: more events than the
kernel queues while the daemon is stopped (an overflow: the rescan catches up), the inbox's
bound on noticed paths held throughout, and watched folders replaced (the inbox itself, a
folder in it) while photos keep coming. Rescans are set far beyond the deadlines: only the
watcher can be in time."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from support.daemon import last_stats
from support.waiting import wait_until
from tests.conftest import DaemonProcess, make_image, write_config

RESCAN_S = 120
MODEL = {"runtime": "torch"}  # no background build of a fast path competing for the CPU


def drop(tmp_path: Path, folder: Path, names: list[str], tag: int) -> None:
    for n, name in enumerate(names):
        source = make_image(tmp_path / "src" / name, color=(n % 256, tag, 3))
        os.rename(source, folder / name)


def done_names(done: Path) -> set[str]:
    return {path.name for path in done.rglob("*.png")}


@pytest.mark.daemon
@pytest.mark.slow
@pytest.mark.parametrize("event_buffer", [16, 1024])
def test_more_events_than_the_kernel_queues_lose_no_photo(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess], event_buffer: int) -> None:
    """With the daemon stopped, 60 photos among ~21,000 events of a member's churn (more than
    fs.inotify.max_queued_events): the kernel drops events and queues an overflow. Every photo
    is done long before the timer's rescan and the event buffer never held more than its
    capacity. With room for them all the overflow is read and said (a rescan follows); with
    16 the buffer fills first, the watcher pauses and the scans take the backlog from disk."""
    queued = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    config = write_config(tmp_path, inbox={"settle_ms": 0, "rescan_interval_s": RESCAN_S},
                          capacity={"event_buffer": event_buffer}, model=MODEL,
                          stats={"interval_s": 1})
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    inbox, done = tmp_path / "inbox", tmp_path / "done"
    names = [f"p{n:03}.png" for n in range(60)]
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        drop(tmp_path, inbox, names[:30], 1)
        junk = inbox / "junk.txt"
        for _ in range(queued // 3 + 1000):  # IN_CREATE, IN_CLOSE_WRITE, IN_DELETE each
            os.close(os.open(junk, os.O_WRONLY | os.O_CREAT, 0o644))
            os.unlink(junk)
        drop(tmp_path, inbox, names[30:], 2)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: done_names(done) == set(names), RESCAN_S / 3, "60 photos done")
    if event_buffer > len(names):
        assert any("overflow" in line for line in daemon.records("watch_error")), \
            daemon.records("watch_error")
    else:
        assert daemon.records("deferred")
    wait_until(lambda: daemon.records("stats"), 30, "a stats record")
    stats = last_stats(daemon.records("stats"))
    assert int(stats["EVENT_BUFFER_HIGH_WATER"]) <= event_buffer
    assert int(stats["EVENT_BUFFER_CAPACITY"]) == event_buffer
    assert not [p for p in (tmp_path / "failed").rglob("*") if p.is_file()]
    assert daemon.stop() == 0


@pytest.mark.daemon
@pytest.mark.slow
def test_watched_folders_replaced_are_watched_again_at_once(
        tmp_path: Path, daemon_factory: Callable[..., DaemonProcess]) -> None:
    """A folder in the inbox moved away and another made in its place, twenty times over,
    then the inbox itself moved away and made again: photos dropped into the new folders are
    done within seconds. Before, the watch stayed on the old inbox and photos in the new one
    waited for the rescan timer (or for the next scan, for its identity check)."""
    config = write_config(tmp_path, inbox={"settle_ms": 0, "rescan_interval_s": RESCAN_S},
                          model=MODEL)
    inbox, done, away = tmp_path / "inbox", tmp_path / "done", tmp_path / "away"
    (inbox / "album").mkdir(parents=True)
    away.mkdir()
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    drop(tmp_path, inbox, ["warm.png"], 0)  # the first photo is slower
    wait_until(lambda: "warm.png" in done_names(done), 60, "the first photo done")
    for n in range(20):
        os.rename(inbox / "album", away / f"album{n}")
        (inbox / "album").mkdir()
    started = time.monotonic()
    drop(tmp_path, inbox / "album", ["a0.png", "a1.png", "a2.png"], 1)
    wait_until(lambda: {"a0.png", "a1.png", "a2.png"} <= done_names(done), RESCAN_S / 6,
               "the photos in the new album done")
    print(f"new album: done in {time.monotonic() - started:.1f} s")
    os.rename(inbox, tmp_path / "inbox.old")
    inbox.mkdir()
    started = time.monotonic()
    drop(tmp_path, inbox, ["b0.png", "b1.png", "b2.png"], 2)
    wait_until(lambda: {"b0.png", "b1.png", "b2.png"} <= done_names(done), RESCAN_S / 6,
               "the photos in the new inbox done")
    print(f"new inbox: done in {time.monotonic() - started:.1f} s")
    assert not [p for p in (tmp_path / "failed").rglob("*") if p.is_file()]
    assert daemon.stop() == 0
