"""Reload and start-up that fail: the attacks of issue 33, class 6, against the real daemon.

A config file that cannot be read (a byte that is not UTF-8, a folder where the file was, ...)
must never leave systemd without READY=1 after RELOADING=1, nor kill the reload for good; the
commands that read it exit 78 with what to fix, not a traceback. An inbox the daemon cannot
write at start-up exits with a status systemd can act on: 78 (EX_CONFIG: a layout that cannot
work, not restarted) or 75 (EX_TEMPFAIL: full, may clear, restarted within the start limit).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import DaemonProcess, drop, make_image, wait_until, write_config
from tests.fakes import NotifySocket

ROOT = os.geteuid() == 0


def inboxd(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inboxd", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def after(messages: list[str], kind: str) -> list[str]:
    """The notification kinds after the last ``kind`` one (STATUS and WATCHDOG left out)."""
    kinds = [m.split("=", 1)[0] for m in messages]
    last = len(kinds) - 1 - kinds[::-1].index(kind)
    return [k for k in kinds[last:] if k not in ("STATUS", "WATCHDOG")]


@pytest.mark.timeout(300)
@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_a_reload_of_an_undecodable_file_answers_ready_and_the_next_reload_works(
        tmp_path: Path) -> None:
    notify = NotifySocket(str(tmp_path / "notify.sock"))
    config = write_config(tmp_path)
    good = config.read_bytes()
    daemon = DaemonProcess(config, env={"NOTIFY_SOCKET": notify.address,
                                        "WATCHDOG_USEC": "4000000"})
    try:
        notify.wait_for("READY=1")
        config.write_bytes(good + b"# caf\xe9 in Latin-1\n")
        daemon.proc.send_signal(signal.SIGHUP)
        notify.wait_for("RELOADING=1")
        wait_until(lambda: after(notify.drain(), "RELOADING") == ["RELOADING", "READY"], 30,
                   "READY=1 after the RELOADING=1 of a reload that failed")
        refused = daemon.wait_for("reloaded", 30)[-1]
        assert "UTF-8" in refused and "line" in refused and "stays" in refused, refused
        assert "Traceback" not in daemon.output()
        status = wait_until(lambda: next((m for m in reversed(notify.drain())
                                          if m.startswith("STATUS=reload failed")), None), 10,
                            "a STATUS saying the reload failed")
        assert "old configuration kept" in status, status

        # Fixed: the next SIGHUP reloads, and the daemon serves with what it says.
        data = yaml.safe_load(good)
        data["capacity"] = {"queue": 3}
        config.write_text(yaml.safe_dump(data))
        daemon.proc.send_signal(signal.SIGHUP)
        reloaded = daemon.wait_for("reloaded", 30, count=2)[-1]
        assert "capacity.queue" in reloaded, reloaded
        wait_until(lambda: any(m.startswith("STATUS=queue 0/3,") for m in notify.drain()), 30,
                   "a STATUS with the new queue capacity and no reload failure")
        drop(make_image(tmp_path / "a.png"), tmp_path / "inbox")
        wait_until((tmp_path / "results" / "a.png.json").exists, 60, "a result after reloads")

        # A reload that raises something no one foresaw (the file replaced by a folder).
        config.unlink()
        config.mkdir()
        daemon.proc.send_signal(signal.SIGHUP)
        daemon.wait_for("reloaded", 30, count=3)
        wait_until(lambda: after(notify.drain(), "RELOADING") == ["RELOADING", "READY"], 30,
                   "READY=1 again")

        # A FIFO nobody writes to: reading it would block the daemon for ever.
        config.rmdir()
        os.mkfifo(config)
        daemon.proc.send_signal(signal.SIGHUP)
        assert "not a regular file" in daemon.wait_for("reloaded", 30, count=4)[-1]
        wait_until(lambda: after(notify.drain(), "RELOADING") == ["RELOADING", "READY"], 30,
                   "READY=1 after a FIFO")
        assert daemon.stop() == 0
    finally:
        daemon.kill()


# run reads the config as once does: its case (tens of seconds) only in the full suite.
@pytest.mark.parametrize("command", ["check-config", pytest.param("run", marks=pytest.mark.slow),
                                     "once"])
def test_an_undecodable_config_exits_78_with_the_line_to_fix(tmp_path: Path,
                                                             command: str) -> None:
    config = write_config(tmp_path)
    config.write_bytes(config.read_bytes() + b"note: \xff\xfe\n")
    result = inboxd(command, "-c", str(config), cwd=tmp_path)
    assert result.returncode == 78, result.stderr
    assert "Traceback" not in result.stderr
    line = config.read_bytes().count(b"\n")  # the last line holds the bad bytes
    assert "not UTF-8" in result.stderr and f"line {line}" in result.stderr, result.stderr


def test_every_config_read_error_exits_78(tmp_path: Path) -> None:
    folder = tmp_path / "conf.yaml"
    folder.mkdir()
    missing = tmp_path / "missing.yaml"
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # nobody writes to it: a read would wait for ever
    for path in (folder, missing, loop, fifo, Path("/dev/null")):
        result = inboxd("check-config", "-c", str(path), cwd=tmp_path)
        assert result.returncode == 78, (path, result.stderr)
        assert "Traceback" not in result.stderr and str(path) in result.stderr, result.stderr


@contextlib.contextmanager
def mounted(where: Path, options: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.skipif(not ROOT, reason="mounting a read-only or inode-starved tmpfs needs root")
@pytest.mark.parametrize("command", ["run", pytest.param("once", marks=pytest.mark.slow)])
def test_a_read_only_inbox_exits_78_saying_so(tmp_path: Path, command: str) -> None:
    config = write_config(tmp_path)
    with mounted(tmp_path / "inbox", "ro,size=1m"):
        result = inboxd(command, "-c", str(config), cwd=tmp_path)
    assert result.returncode == 78, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "read-only" in result.stderr.lower() and str(tmp_path / "inbox") in result.stderr


@pytest.mark.skipif(not ROOT, reason="mounting a read-only or inode-starved tmpfs needs root")
@pytest.mark.parametrize("command", ["run", pytest.param("once", marks=pytest.mark.slow)])
def test_an_inbox_out_of_inodes_exits_75_to_be_restarted(tmp_path: Path, command: str) -> None:
    config = write_config(tmp_path)
    with mounted(tmp_path / "inbox", "size=1m,nr_inodes=16") as inbox:
        with contextlib.suppress(OSError):
            for n in range(64):  # every inode taken
                (inbox / f"f{n}").touch()
        result = inboxd(command, "-c", str(config), cwd=tmp_path)
    assert result.returncode == 75, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "df -i" in result.stderr and str(inbox) in result.stderr, result.stderr
