"""Faults around the daemon: a full or read-only results disk, the inbox deleted under it,
inotify overflowing, CUDA running out of memory. The real daemon, real mounts (as root)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import DaemonProcess, drop, make_image, read_json, wait_until, write_config

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting and sysctls need root")


@contextmanager
def mounted(args: list[str], target: Path) -> Iterator[None]:
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", *args, str(target)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def flood(inbox: Path, count: int, prefix: str = "f") -> set[str]:
    names = set()
    for n in range(count):
        names.add(drop(make_image(inbox.parent / "src" / f"{prefix}{n}.png", size=(16, 16),
                                  color=(n, 50, 90)), inbox).name)
    return names


def result_names(results: Path) -> set[str]:
    return {p.name.removesuffix(".json") for p in results.glob("*.json")}


PATIENT_RETRY = {"max_attempts": 200, "backoff_initial_ms": 50, "backoff_max_ms": 300}


@pytest.mark.daemon
@pytest.mark.slow
@needs_root
def test_results_disk_full_keeps_data_safe_and_resumes(tmp_path: Path, daemon_factory) -> None:
    results = tmp_path / "results"
    with mounted(["-t", "tmpfs", "-o", "size=48k,nr_inodes=64", "tmpfs"], results):
        config = write_config(tmp_path, retry=PATIENT_RETRY, capacity={"retry_list": 64})
        daemon = daemon_factory(config)
        daemon.wait_for("ready")
        names = flood(tmp_path / "inbox", 40)
        daemon.wait_for("output_full", 60)  # the disk filled up: one warning, no retries
        assert len(result_names(results)) < 40
        subprocess.run(["mount", "-o", "remount,size=16m,nr_inodes=4096", str(results)],
                       check=True)
        wait_until(lambda: result_names(results) == names, 120, "every result after space returned")
        for name in names:
            assert read_json(results / f"{name}.json")["source"] == name  # complete JSON
        assert daemon.stop() == 0  # the last batch's sources move after its results appear
        assert not list((tmp_path / "failed").glob("*.png"))
        assert {p.name for p in (tmp_path / "done").iterdir()} == names
        assert not list((results / ".tmp").rglob("*.tmp")), "failed writes left no temps"


@pytest.mark.daemon
@pytest.mark.slow
@needs_root
def test_read_only_results_folder_then_writable_again(tmp_path: Path, daemon_factory) -> None:
    results = tmp_path / "results"
    results.mkdir()
    with mounted(["--bind", str(results)], results):
        subprocess.run(["mount", "-o", "remount,bind,ro", str(results)], check=True)
        config = write_config(tmp_path, retry=PATIENT_RETRY)
        daemon = daemon_factory(config)
        # Start-up itself must cope: it cannot create results/.tmp/ yet.
        names = flood(tmp_path / "inbox", 5)
        wait_until(lambda: "Read-only file system" in daemon.output(), 120, "the EROFS error")
        assert result_names(results) == set()
        assert {p.name for p in (tmp_path / "inbox").glob("*.png")} | {
            p.name for p in (tmp_path / "inbox" / ".processing").rglob("*.png")} == names
        subprocess.run(["mount", "-o", "remount,bind,rw", str(results)], check=True)
        wait_until(lambda: result_names(results) == names, 120, "results once writable")
        assert daemon.stop() == 0


@pytest.mark.daemon
@pytest.mark.slow
def test_inbox_deleted_and_recreated_while_running(tmp_path: Path, daemon_factory) -> None:
    config = write_config(tmp_path, inbox={"rescan_interval_s": 1})
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    inbox = tmp_path / "inbox"
    drop(make_image(tmp_path / "before.png"), inbox)
    wait_until((tmp_path / "results" / "before.png.json").exists, 30, "the first result")
    subprocess.run(["rm", "-rf", str(inbox)], check=True)
    inbox.mkdir()
    drop(make_image(tmp_path / "after.png"), inbox)
    wait_until((tmp_path / "results" / "after.png.json").exists, 30, "a result in the new inbox")
    assert daemon.proc.poll() is None
    assert daemon.stop() == 0


@pytest.mark.daemon
@pytest.mark.slow
@needs_root
def test_inotify_overflow_is_caught_by_the_rescan(tmp_path: Path, daemon_factory) -> None:
    knob = Path("/proc/sys/fs/inotify/max_queued_events")
    saved = knob.read_text()
    knob.write_text("16\n")  # applies to inotify instances created from now on
    try:
        config = write_config(tmp_path, inbox={"rescan_interval_s": 2})
        daemon = daemon_factory(config)
        daemon.wait_for("ready")
    finally:
        knob.write_text(saved)
    names = flood(tmp_path / "inbox", 150)
    wait_until(lambda: result_names(tmp_path / "results") == names, 180, "every result")
    assert daemon.stop() == 0


@pytest.mark.daemon
@pytest.mark.slow
def test_cuda_oom_halves_the_batch_in_the_real_daemon(tmp_path: Path) -> None:
    config = write_config(tmp_path, batch={"max_size": 8, "max_delay_ms": 500},
                          inbox={"settle_ms": 0})
    names = flood(tmp_path / "inbox", 16)
    once = DaemonProcess(config, command="once",
                         env={"INBOXD_TEST_MODEL_FAULTS": "oom_above_batch=2"})
    assert once.proc.wait(300) == 0, once.output()
    assert "FAULT INJECTION ACTIVE" in once.output()
    assert "retrying as" in once.output(), "the OOM split was logged"
    assert result_names(tmp_path / "results") == names


@pytest.mark.daemon
@pytest.mark.slow
def test_a_poisoned_cuda_context_returns_the_files_and_exits_for_a_restart(
        tmp_path: Path, daemon_factory) -> None:
    """After an illegal address every CUDA call fails; no file may be blamed for that."""
    config = write_config(tmp_path, batch={"max_size": 4, "max_delay_ms": 200},
                          inbox={"settle_ms": 0})
    daemon = daemon_factory(config, env={"INBOXD_TEST_MODEL_FAULTS": "device_error_from_batch=2"})
    daemon.wait_for("ready")
    names = flood(tmp_path / "inbox", 12)
    assert daemon.proc.wait(60) == 76, daemon.output()  # Restart=on-failure restarts 76
    assert "device_fault" in daemon.output() and "illegal memory access" in daemon.output()
    assert not list((tmp_path / "failed").glob("*.png")), "no file was blamed for the device"
    results = result_names(tmp_path / "results")
    back = {p.name for p in (tmp_path / "inbox").glob("*.png")}
    assert results | back == names and not results & back
    assert not list((tmp_path / "inbox" / ".processing").rglob("*.png"))
