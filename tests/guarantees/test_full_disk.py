"""A full disk makes inboxd wait: no good photo fails, nothing is redone, the log stays quiet.

Real filesystems, the real daemon: a small ext4 on a loop device filled to the last block by a
filler file, then the filler removed; a bind mount made read-only, then read-write again. The
daemon must hold what is in flight, claim nothing more, say once which folder is full and what
to do, and carry on by itself when there is room (``pipeline/full_outputs.py``).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import DaemonProcess, drop, last_stats, make_image, wait_until, write_config
from tests.fakes import NotifySocket

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="loop devices and mounts need root")
pytestmark = [pytest.mark.daemon, pytest.mark.slow, needs_root]

# Quick probes, so that a test waits seconds for the resume, not the shipped 5 s at most.
QUICK_PROBES = {"backoff_initial_ms": 100, "output_probe_max_ms": 400}
# Records of a single photo: none may appear while the disk is full (no per-photo storm).
PER_PHOTO_EVENTS = ("[retry]", "[failed]", "[released]", "[completed]", "[skipped]")


@contextmanager
def small_ext4(mountpoint: Path, size_mb: int = 16) -> Iterator[Path]:
    """A fresh ext4 of ``size_mb`` on a loop device at ``mountpoint``; no blocks reserved for
    root (the daemon runs as root here, and would write into them)."""
    image = mountpoint.with_name(mountpoint.name + ".img")
    with open(image, "wb") as handle:
        handle.truncate(size_mb << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", str(image)], check=True)
    mountpoint.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)
        image.unlink()


def fill(folder: Path) -> Path:
    """Write filler in ``folder`` until its filesystem has not one block left.

    ext4 keeps a few blocks back for a file's own extent metadata, so one big file can stop
    with a block or two still free; small extra files take those, as a daemon's own small
    writes would.
    """
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in (1 << 20, 1 << 16, 1 << 12, 1 << 12):  # again after each flush
            while _wrote(fd, chunk):
                pass
            _synced(fd)
    finally:
        os.close(fd)
    for n in range(64):
        if os.statvfs(folder).f_bavail == 0:
            break
        try:
            fd = os.open(folder / f"filler.{n}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            break
        try:
            while _wrote(fd, 1 << 12):
                pass
            _synced(fd)
        finally:
            os.close(fd)
    free = os.statvfs(folder)
    assert free.f_bavail == 0, f"{free.f_bavail} blocks still free"
    return filler


def _wrote(fd: int, size: int) -> bool:
    try:
        os.write(fd, bytes(size))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
        return False
    return True


def _synced(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc


def flood(inbox: Path, count: int) -> set[str]:
    return {drop(make_image(inbox.parent / "src" / f"p{n:03}.png", size=(16, 16),
                            color=(n, 60, 120)), inbox).name for n in range(count)}


def names_in(folder: Path, suffix: str = "") -> set[str]:
    if not folder.is_dir():
        return set()
    return {p.name.removesuffix(suffix) for p in folder.iterdir()
            if p.is_file() and p.name.endswith(suffix) and not p.name.startswith("filler")}


def waited_a_while(daemon: DaemonProcess, seconds: float = 3.0) -> int:
    """Wait until the stats record shows the daemon waiting for room ``seconds`` long; returns
    how many lines it had printed by then."""
    def long_enough() -> bool:
        stats = daemon.records("stats")
        return bool(stats) and float(last_stats(stats).get("OUTPUT_FULL_S", 0)) >= seconds
    wait_until(long_enough, 60, f"OUTPUT_FULL_S >= {seconds} in the stats record")
    return len(daemon.lines)


def assert_quiet_while_full(daemon: DaemonProcess, freed_at: int) -> None:
    """One warning, and not one record about a single photo, from the warning to the moment
    space came back."""
    lines = daemon.lines[:freed_at]
    warned = [n for n, line in enumerate(lines) if "[output_full]" in line]
    assert len(warned) == 1, [lines[n] for n in warned]
    storm = [line for line in lines[warned[0] + 1:] if any(e in line for e in PER_PHOTO_EVENTS)]
    assert storm == [], storm[:5]
    other = [line for line in lines[warned[0] + 1:] if "[stats]" not in line]
    assert len(other) <= 3, other  # STATUS= lives in the unit; stderr gets the records only


def test_a_full_results_disk_holds_every_photo_and_resumes_by_itself(
        tmp_path: Path, daemon_factory) -> None:
    notify = NotifySocket(str(tmp_path / "notify.sock"))
    with small_ext4(tmp_path / "results") as results:
        config = write_config(tmp_path, retry=QUICK_PROBES)
        daemon = daemon_factory(config, env={"NOTIFY_SOCKET": notify.address,
                                             "WATCHDOG_USEC": "4000000"})  # a ping every 2 s
        daemon.wait_for("ready")
        filler = fill(results)
        names = flood(tmp_path / "inbox", 60)
        warning = daemon.wait_for("output_full", 60)[0]
        assert str(results) in warning and "No space left on device" in warning
        assert "free space there" in warning
        notify.drain()
        notify.messages.clear()
        freed_at = waited_a_while(daemon, 9.0)  # past the watchdog's 4 s and a stall's showing
        # STATUS= names the folder; the wait is no stall: the watchdog is still pinged.
        sent = notify.drain()
        statuses = [m for m in sent if m.startswith("STATUS=")]
        assert statuses and all(f"{results} cannot take more" in m for m in statuses)
        assert not any("stalled" in m for m in statuses), statuses
        assert "WATCHDOG=1" in sent, "the watchdog stopped while the disk was full"
        assert names_in(tmp_path / "failed") == set(), "a good photo failed for a full disk"
        stats = last_stats(daemon.records("stats"))
        assert int(stats["OUTPUT_FULL_WAITS"]) == 1 and int(stats["OUTPUT_PROBES"]) >= 2
        assert int(stats["FAILED"]) == 0 and int(stats["RETRIED"]) == 0
        filler.unlink()
        wait_until(lambda: names_in(results, ".json") == names, 120, "all 60 results")
        wait_until(lambda: names_in(tmp_path / "done") == names, 60, "all 60 sources done")
        resumed = daemon.wait_for("output_resumed", 30)
        assert len(resumed) == 1 and str(results) in resumed[0]
        assert daemon.stop() == 0
        assert_quiet_while_full(daemon, freed_at)
        assert names_in(tmp_path / "failed") == set()
        final = last_stats(daemon.records("stats"))
        assert (int(final["COMPLETED"]), int(final["FAILED"])) == (60, 0)
        assert int(final["DUPLICATES"]) == 0, "each photo was inferred once: no rerun"
        assert float(final["OUTPUT_FULL_S"]) == 0


def test_the_shipped_one_filesystem_layout_full_for_a_while_fails_nothing(
        tmp_path: Path, daemon_factory) -> None:
    """inbox, results, done and failed on one volume (/var/lib/inboxd), full for a while."""
    with small_ext4(tmp_path / "var") as var:
        config = write_config(var, retry=QUICK_PROBES, inbox={"settle_ms": 1500})
        daemon = daemon_factory(config)
        daemon.wait_for("ready")
        names = flood(var / "inbox", 40)  # not taken before they settle: the disk fills first
        # Bad ones too: their failure is decided, then held until failed/ can take it.
        bad = {f"bad{n}.png" for n in range(3)}
        for name in bad:
            (var / "inbox" / name).write_bytes(b"not an image " + name.encode())
        filler = fill(var)
        daemon.wait_for("output_full", 60)
        waited_a_while(daemon, 2.0)
        assert names_in(var / "failed") == set()
        # Restarted while the disk is full (SIGKILL: an admin, the OOM killer): it starts,
        # takes back what it had claimed, and waits, rather than exiting 75 until systemd's
        # start limit gives up.
        daemon.kill()
        daemon = daemon_factory(config)
        daemon.wait_for("ready")
        daemon.wait_for("output_full", 60)
        freed_at = waited_a_while(daemon)
        assert names_in(var / "failed") == set()
        filler.unlink()
        wait_until(lambda: names_in(var / "done") == names, 120, "all 40 sources done")
        wait_until(lambda: names_in(var / "failed") == bad | {f"{n}.error.json" for n in bad},
                   60, "the 3 bad ones in failed/")
        assert names_in(var / "results", ".json") == names
        daemon.wait_for("output_resumed", 30)
        assert daemon.stop() == 0
        assert_quiet_while_full(daemon, freed_at)
        assert int(last_stats(daemon.records("stats"))["FAILED"]) == len(bad)


def test_a_read_only_results_folder_holds_the_photos_until_it_is_writable(
        tmp_path: Path, daemon_factory) -> None:
    results = tmp_path / "results"
    results.mkdir()
    subprocess.run(["mount", "--bind", str(results), str(results)], check=True)
    try:
        daemon = daemon_factory(write_config(tmp_path, retry=QUICK_PROBES))
        daemon.wait_for("ready")
        subprocess.run(["mount", "-o", "remount,bind,ro", str(results)], check=True)
        names = flood(tmp_path / "inbox", 12)
        warning = daemon.wait_for("output_full", 60)[0]
        assert "Read-only file system" in warning and "remount it read-write" in warning
        freed_at = waited_a_while(daemon, 2.0)
        subprocess.run(["mount", "-o", "remount,bind,rw", str(results)], check=True)
        wait_until(lambda: names_in(tmp_path / "done") == names, 120, "all 12 sources done")
        assert names_in(results, ".json") == names
        daemon.wait_for("output_resumed", 30)
        assert daemon.stop() == 0
        assert_quiet_while_full(daemon, freed_at)
        assert names_in(tmp_path / "failed") == set()
    finally:
        subprocess.run(["umount", "-l", str(results)], check=False)


def test_once_waits_for_room_and_a_stop_while_it_waits_hands_every_photo_back(
        tmp_path: Path, daemon_factory) -> None:
    """``inboxd once`` (a cron job, a script) on a full results disk waits as the service does:
    it does not exit with the photos failed. Stopped while it waits (Ctrl-C, a job's time
    limit), it exits promptly with 128 + the signal and leaves every photo in the inbox, none
    in failed/; the next run, with room, finishes them all, each once."""
    with small_ext4(tmp_path / "results") as results:
        config = write_config(tmp_path, retry=QUICK_PROBES)
        filler = fill(results)
        names = flood(tmp_path / "inbox", 12)
        once = daemon_factory(config, command="once")
        once.wait_for("output_full", 120)
        with pytest.raises(subprocess.TimeoutExpired):  # it waits: a while, then on
            once.proc.wait(timeout=5)
        assert names_in(tmp_path / "failed") == set()
        assert once.stop(signal.SIGINT, timeout_s=60) == 128 + signal.SIGINT, once.tail()
        assert "wait in the inbox for the next run" in once.output()
        assert names_in(tmp_path / "inbox") == names, "a photo was not handed back"
        assert names_in(tmp_path / "failed") == set()

        waiting = daemon_factory(config, command="once")
        waiting.wait_for("output_full", 120)
        filler.unlink()
        wait_until(lambda: not waiting.alive(), 180, "once to finish when there is room")
        assert waiting.stop() == 0, waiting.tail()
        assert "12 completed, 0 failed" in waiting.output()
        assert names_in(results, ".json") == names
        assert names_in(tmp_path / "done") == names
        assert names_in(tmp_path / "inbox") == set()
        assert int(last_stats(waiting.records("stats"))["DUPLICATES"]) == 0
