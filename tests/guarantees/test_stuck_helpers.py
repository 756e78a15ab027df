"""Helpers that stop, and time that is not the file's: the attacks of issue 33, class 5, on the
real daemon and its real helper processes (SIGSTOP/SIGCONT, as a hung disk, a debugger, Ctrl-Z
or a cgroup freeze does), with a datagram socket standing in for systemd's $NOTIFY_SOCKET.

- A stopped commit process: STATUS says the commit stalls and WATCHDOG=1 stops (systemd would
  restart the service), and once it runs again every file completes and the pings come back.
- The whole process group stopped for longer than ``decode_timeout_s``, then continued: the
  file being decoded is not "took too long"; it completes.
- One decode worker stopped from outside: its file is not failed; the worker is replaced and
  the file tried again.
- A real time-out is a transient failure the first time, permanent only the second time.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DaemonProcess, drop, make_image, read_json, wait_until, write_config
from tests.fakes import NotifySocket

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test`, not `make test-fast`


def helper_pids(parent: int, module: str) -> list[int]:
    """The daemon's helper processes running ``python -m <module>``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and module.encode() in cmdline:
            found.append(int(entry))
    return found


SLOW_S = 2.5  # what the injected slow decode sleeps (the test-only fault ``slow``)


def in_slow_decode(inbox: Path, worker: int) -> bool:
    """slow.png claimed and its worker asleep in the injected sleep (where the kernel hides
    wchan, half a second after the claim instead)."""
    claimed = inbox / ".processing" / "default" / "slow.png"
    if not claimed.exists():
        return False
    wchan = Path(f"/proc/{worker}/wchan").read_text().strip()
    if wchan in ("", "0"):
        time.sleep(0.5)
        return True
    return "nanosleep" in wchan


@pytest.mark.timeout(300)
def test_a_stopped_commit_process_shows_in_status_and_stops_the_watchdog(
        tmp_path: Path) -> None:
    notify = NotifySocket(str(tmp_path / "notify.sock"))
    config = write_config(tmp_path, inbox={"settle_ms": 0, "rescan_interval_s": 1},
                          shutdown={"grace_s": 5})
    daemon = DaemonProcess(config, env={"NOTIFY_SOCKET": notify.address,
                                        "WATCHDOG_USEC": "4000000"})  # a ping every 2 s
    inbox = tmp_path / "inbox"
    try:
        notify.wait_for("READY=1")
        drop(make_image(tmp_path / "first.png"), inbox)
        wait_until((tmp_path / "results" / "first.png.json").exists, 60, "the first result")
        (commit_pid,) = helper_pids(daemon.proc.pid, "inboxd.files.commit_child")
        os.kill(commit_pid, signal.SIGSTOP)  # a hung disk holds it just as still
        try:
            for n in range(20):
                drop(make_image(tmp_path / f"{n}.png", color=(n, 2 * n, 90)), inbox)
            stalled = wait_until(lambda: next((m for m in reversed(notify.drain())
                                               if "commit stalled" in m), None), 60,
                                 "a STATUS saying the commit stalls")
            assert stalled.startswith("STATUS=") and "stopped" in stalled, stalled
            notify.messages.clear()
            wait_until(lambda: sum(m.startswith("STATUS=") for m in notify.drain()) >= 4, 30,
                       "four more STATUS lines (8 s: four watchdog intervals)")
            assert "WATCHDOG=1" not in notify.drain(), "pinged while the commit stood still"
            assert daemon.records("watchdog"), "the journal says why the pings stopped"
            assert len(list((tmp_path / "results").glob("*.json"))) == 1
        finally:
            os.kill(commit_pid, signal.SIGCONT)
        wait_until(lambda: len(list((tmp_path / "results").glob("*.json"))) == 21, 120,
                   "all 21 results once the commit process runs again")
        notify.messages.clear()
        notify.wait_for("WATCHDOG=1", 30)  # idle with nothing waiting: pinged again
        wait_until(lambda: any(m.startswith("STATUS=queue") for m in notify.drain()), 10)
        assert "stalled" not in [m for m in notify.drain() if m.startswith("STATUS=")][-1]
        assert daemon.stop() == 0
    finally:
        daemon.kill()


def _slow_daemon(tmp_path: Path, timeout_s: float, **sections: Any) -> tuple[Path, dict[str, str]]:
    config = write_config(tmp_path, inbox={"settle_ms": 0, "rescan_interval_s": 1},
                          preprocess={"decode_timeout_s": timeout_s, "workers": 1},
                          retry={"max_attempts": 5, "backoff_initial_ms": 100,
                                 "backoff_max_ms": 200},
                          shutdown={"grace_s": 5}, **sections)
    return config, {"INBOXD_TEST_DECODE_FAULTS": f"slow:{SLOW_S}=slow,hang=hang"}


@pytest.mark.timeout(300)
def test_a_process_group_stopped_longer_than_decode_timeout_s_fails_no_file(
        tmp_path: Path) -> None:
    config, env = _slow_daemon(tmp_path, timeout_s=4)
    # The daemon leads a process group of its own, as a shell job does (Ctrl-Z stops the whole
    # group) and as a systemd cgroup holds it with its helpers.
    daemon = DaemonProcess(config, env=env, new_session=True)
    try:
        daemon.wait_for("ready")
        drop(make_image(tmp_path / "warm.png"), tmp_path / "inbox")
        wait_until((tmp_path / "results" / "warm.png.json").exists, 60, "the first result")
        (worker,) = helper_pids(daemon.proc.pid, "inboxd.decode.worker_child")
        drop(make_image(tmp_path / "slow.png"), tmp_path / "inbox")
        # The worker is inside the slow decode: now Ctrl-Z (the whole group) for 3× the limit.
        wait_until(lambda: in_slow_decode(tmp_path / "inbox", worker), 30,
                   "the worker busy on slow.png")
        os.killpg(daemon.proc.pid, signal.SIGSTOP)
        time.sleep(12)
        os.killpg(daemon.proc.pid, signal.SIGCONT)
        wait_until(lambda: (tmp_path / "results" / "slow.png.json").exists()
                   or list((tmp_path / "failed").glob("slow.png*")), 60, "slow.png's outcome")
        failed = tmp_path / "failed" / "slow.png.error.json"
        assert not failed.exists(), read_json(failed)["reason"]
        assert read_json(tmp_path / "results" / "slow.png.json")["source"] == "slow.png"
        assert "took longer" not in daemon.output()
        assert daemon.stop() == 0
    finally:
        daemon.kill()


@pytest.mark.timeout(300)
def test_a_decode_worker_stopped_from_outside_costs_its_file_nothing(tmp_path: Path) -> None:
    config, env = _slow_daemon(tmp_path, timeout_s=3)
    daemon = DaemonProcess(config, env=env)
    try:
        daemon.wait_for("ready")
        drop(make_image(tmp_path / "warm.png"), tmp_path / "inbox")
        wait_until((tmp_path / "results" / "warm.png.json").exists, 60, "the first result")
        (worker,) = helper_pids(daemon.proc.pid, "inboxd.decode.worker_child")
        drop(make_image(tmp_path / "slow.png"), tmp_path / "inbox")
        wait_until(lambda: in_slow_decode(tmp_path / "inbox", worker), 30,
                   "the worker busy on slow.png")
        os.kill(worker, signal.SIGSTOP)  # and never continued: it is replaced
        wait_until(lambda: (tmp_path / "results" / "slow.png.json").exists()
                   or list((tmp_path / "failed").glob("slow.png*")), 120, "slow.png's outcome")
        failed = tmp_path / "failed" / "slow.png.error.json"
        assert not failed.exists(), read_json(failed)["reason"]
        replaced = daemon.records("decode_worker")
        assert any("stopped" in line and str(worker) in line for line in replaced), replaced
        assert daemon.stop() == 0
    finally:
        daemon.kill()


@pytest.mark.timeout(300)
def test_a_decode_time_out_is_transient_the_first_time_and_permanent_the_second(
        tmp_path: Path) -> None:
    config, env = _slow_daemon(tmp_path, timeout_s=1.5)
    daemon = DaemonProcess(config, env=env)
    try:
        daemon.wait_for("ready")
        drop(make_image(tmp_path / "hang.png"), tmp_path / "inbox")
        failed = tmp_path / "failed" / "hang.png.error.json"
        wait_until(failed.exists, 120, "hang.png failed")
        report = read_json(failed)
        assert report["permanent"] is True
        assert len(report["attempts"]) == 2, report["attempts"]  # not at the first time-out
        assert all("longer than preprocess.decode_timeout_s = 1.5 s" in reason
                   for reason in report["attempts"]), report["attempts"]
        assert daemon.stop() == 0
    finally:
        daemon.kill()
