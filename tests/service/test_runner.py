"""The daemon as systemd runs it: a real datagram socket as NOTIFY_SOCKET, stderr connected to
a real journald (JOURNAL_STREAM), SIGHUP reloads, the watchdog, and the journal read back by
``inboxd stats`` and ``inboxd report``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from PIL import Image

from tests.conftest import DaemonProcess, drop, make_image, wait_until, write_config
from tests.fakes import NotifySocket
from tests.journald import journald, wait_for_entries  # noqa: F401 (fixture)


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NotifySocket]:
    address = (str(tmp_path / "notify.sock") if request.param == "path"
               else f"@inboxd-test-{uuid.uuid4().hex}")
    sock = NotifySocket(address)
    yield sock
    sock.close()


@pytest.mark.daemon
@pytest.mark.slow
def test_notify_sequence_ready_status_watchdog_reload_stopping(
    tmp_path: Path, notify_socket: NotifySocket
) -> None:
    config = write_config(tmp_path)
    daemon = DaemonProcess(config, env={"NOTIFY_SOCKET": notify_socket.address,
                                        "WATCHDOG_USEC": "1000000"})
    try:
        ready = notify_socket.wait_for("READY=1")
        assert ready == "READY=1"
        assert "[started]" in daemon.output(), "READY only after the model is warm"
        before_ready = notify_socket.messages[: notify_socket.messages.index("READY=1")]
        assert any(m.startswith("EXTEND_TIMEOUT_USEC=") for m in before_ready)
        status = notify_socket.wait_for("STATUS=")
        assert "queue 0/1" in status and "completed" in status and "files/s" in status
        notify_socket.wait_for("WATCHDOG=1")

        daemon.proc.send_signal(signal.SIGHUP)
        reloading = notify_socket.wait_for("RELOADING=1")
        usec = int(reloading.split("MONOTONIC_USEC=")[1])
        assert abs(usec / 1e6 - time.monotonic()) < 60, "CLOCK_MONOTONIC, in microseconds"
        daemon.wait_for("reloaded")
        assert daemon.stop() == 0
        kinds = notify_socket.kinds()
        assert kinds[kinds.index("READY"):][:1] == ["READY"]
        after_ready = [k for k in kinds[kinds.index("READY"):] if k not in ("STATUS", "WATCHDOG")]
        assert after_ready == ["READY", "RELOADING", "READY", "STOPPING"], kinds
        assert "EXTEND_TIMEOUT_USEC" not in kinds[kinds.index("READY"):]
    finally:
        daemon.kill()


@pytest.mark.daemon
@pytest.mark.slow
def test_a_hung_model_call_stops_the_watchdog(tmp_path: Path) -> None:
    notify = NotifySocket(str(tmp_path / "notify.sock"))
    config = write_config(tmp_path, shutdown={"grace_s": 1})
    daemon = DaemonProcess(config, env={"NOTIFY_SOCKET": notify.address,
                                        "WATCHDOG_USEC": "1000000",
                                        "INBOXD_TEST_MODEL_FAULTS": "hang_on_batch=1"})
    try:
        notify.wait_for("READY=1")
        notify.wait_for("WATCHDOG=1")
        drop(make_image(tmp_path / "a.png"), tmp_path / "inbox")
        daemon.wait_for("watchdog", 30)  # the model has been stuck longer than the timeout
        notify.drain()
        notify.messages.clear()
        wait_until(lambda: len(notify.drain()) >= 2, 10, "two more notifications (STATUS)")
        assert "WATCHDOG=1" not in notify.drain(), "no pings while the model call hangs"
        # systemd would now kill it; a plain SIGTERM must still end it despite the stuck thread.
        assert daemon.stop(timeout_s=30) == 0
    finally:
        daemon.kill()


@pytest.mark.daemon
@pytest.mark.slow
def test_the_watchdog_s_sigabrt_prints_every_stack_and_ends_the_daemon_by_sigabrt(
        tmp_path: Path) -> None:
    """What systemd's watchdog sends when the model call hangs: the hung call's stack must
    reach the journal (printed by the event loop with the GIL held: faulthandler's own dump,
    beside threads that ran on, crashed half-way with SIGSEGV in 2 nspawn runs of 6), and the
    exit status must say SIGABRT."""
    notify = NotifySocket(str(tmp_path / "notify.sock"))
    config = write_config(tmp_path)
    daemon = DaemonProcess(config, env={"NOTIFY_SOCKET": notify.address,
                                        "WATCHDOG_USEC": "1000000",
                                        "INBOXD_TEST_MODEL_FAULTS": "hang_on_batch=1"})
    try:
        notify.wait_for("READY=1")
        drop(make_image(tmp_path / "a.png"), tmp_path / "inbox")
        daemon.wait_for("watchdog", 30)  # the model has been stuck longer than the timeout
        daemon.proc.send_signal(signal.SIGABRT)
        assert daemon.proc.wait(30) == -signal.SIGABRT
        output = daemon.output()
        assert "Segmentation fault" not in output
        assert "models/faults.py" in output, output[-3000:]  # the hung call's own frames
    finally:
        daemon.kill()


@pytest.mark.daemon
@pytest.mark.slow
def test_reload_applies_capacities_live_and_refuses_a_bad_config(
    tmp_path: Path, daemon_factory
) -> None:
    config = write_config(tmp_path)
    daemon = daemon_factory(config)
    daemon.wait_for("stats")
    data = yaml.safe_load(config.read_text())
    data["capacity"] = {"queue": 5}
    data["results_dir"] = str(tmp_path / "elsewhere")
    config.write_text(yaml.safe_dump(data))
    daemon.proc.send_signal(signal.SIGHUP)
    reloaded = daemon.wait_for("reloaded")[-1]
    assert "capacity.queue" in reloaded and "needs restart to change: results_dir" in reloaded
    count = len(daemon.records("stats"))
    daemon.wait_for("stats", count=count + 1)
    assert "QUEUE_CAPACITY=5" in daemon.records("stats")[-1]

    config.write_text("capacity:\n  queue: zero\n")
    daemon.proc.send_signal(signal.SIGHUP)
    refused = daemon.wait_for("reloaded", count=2)[-1]
    assert "reload refused" in refused and "line 2: capacity.queue" in refused
    drop(make_image(tmp_path / "b.png"), tmp_path / "inbox")
    wait_until((tmp_path / "results" / "b.png.json").exists, 30, "still serving, old results_dir")
    assert daemon.stop() == 0


def _journal_stderr(tmp_path: Path) -> tuple[int, dict[str, str]]:
    """stderr connected to journald's stream socket, with JOURNAL_STREAM naming it — exactly
    what systemd gives a service with StandardError=journal."""
    stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stream.connect("/run/systemd/journal/stdout")
    stream.sendall(b"inboxd-test\n\n6\n0\n0\n0\n0\n")  # identifier, unit, priority, flags
    st = os.fstat(stream.fileno())
    fd = os.dup(stream.fileno())
    stream.close()
    return fd, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}


@pytest.mark.daemon
@pytest.mark.slow
@pytest.mark.usefixtures("journald")
def test_journal_records_stats_and_readback(tmp_path: Path) -> None:
    instance = f"t{uuid.uuid4().hex[:12]}"
    config = write_config(tmp_path, instance=instance, capacity={"queue": 2, "event_buffer": 8},
                          inbox={"settle_ms": 0, "rescan_interval_s": 1})
    for n in range(40):
        Image.new("RGB", (16, 16), (n, 9, 9)).save(tmp_path / "inbox" / f"{n}.png")
    stderr_fd, env = _journal_stderr(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "inboxd", "run", "-c", str(config)],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr_fd,
                            env={**os.environ, **env})
    os.close(stderr_fd)
    try:
        wait_until(lambda: len(list((tmp_path / "results").glob("*.json"))) == 40, 120)
        stats = wait_for_entries({"INBOXD_EVENT": "stats", "INSTANCE": instance}, 2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    entries = wait_for_entries({"_PID": str(proc.pid)}, 5)
    events = {e.get("INBOXD_EVENT") for e in entries}
    assert {"started", "ready", "completed", "stats", "stopping", "stopped"} <= events
    assert all(e["SYSLOG_IDENTIFIER"] == "inboxd" for e in entries)
    assert not any(e.get("_TRANSPORT") == "stdout" for e in entries), "never both"
    record = wait_for_entries({"INBOXD_EVENT": "stats", "INSTANCE": instance}, 3)[-1]
    for field in ("ACCEPTED", "ENQUEUED", "COMPLETED", "FAILED", "RETRIED", "DEFERRED",
                  "QUEUE_SIZE", "QUEUE_CAPACITY", "QUEUE_HIGH_WATER", "EVENT_BUFFER_HIGH_WATER",
                  "PREPROCESS_CACHE_CAPACITY", "RETRY_LIST_CAPACITY", "BATCH_HIGH_WATER",
                  "PUT_WAIT_MS_P50", "PUT_WAIT_MS_P99", "PUT_WAIT_MS_MAX", "LATENCY_MS_P50",
                  "LATENCY_MS_P99", "FILES_PER_S", "RSS_BYTES"):
        assert field in record, field
    assert record["COMPLETED"] == "40"
    assert int(stats[0]["QUEUE_CAPACITY"]) == 2

    shown = subprocess.run([sys.executable, "-m", "inboxd", "stats", "--instance", instance],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "completed 40" in shown.stdout
    assert any(line.split()[:3] == ["queue", "0", "2"] for line in shown.stdout.splitlines())
    as_json = subprocess.run([sys.executable, "-m", "inboxd", "stats", "--json", "--instance",
                              instance], capture_output=True, text=True, timeout=60)
    assert '"COMPLETED": 40' in as_json.stdout

    png = tmp_path / "report.png"
    report = subprocess.run([sys.executable, "-m", "inboxd", "report", "--instance", instance,
                             "--since", "10min", "-o", str(png)],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    with Image.open(png) as image:
        assert image.size[0] > 500 and image.size[1] > 500


@pytest.mark.daemon
@pytest.mark.slow
def test_reload_warms_a_larger_batch_first_and_refuses_one_past_a_programs_bound(
    tmp_path: Path, daemon_factory
) -> None:
    from tests.byo_models import export, resnet18

    program = export(resnet18(num_classes=1000), tmp_path / "small.pt2", size=32, max_batch=4)
    model = {"export": str(program), "device": "cpu", "input": {"resize": 32, "crop": 32}}
    config = write_config(tmp_path, model=model, batch={"max_size": 2})
    daemon = daemon_factory(config)
    daemon.wait_for("ready")
    data = yaml.safe_load(config.read_text())
    data["batch"] = {"max_size": 4}
    config.write_text(yaml.safe_dump(data))
    daemon.proc.send_signal(signal.SIGHUP)
    reloaded = daemon.wait_for("reloaded")[-1]
    assert "batch.max_size" in reloaded and "WARMED_BATCH_SIZES=4" in reloaded, reloaded

    data["batch"] = {"max_size": 8}
    config.write_text(yaml.safe_dump(data))
    daemon.proc.send_signal(signal.SIGHUP)
    refused = daemon.wait_for("reloaded", count=2)[-1]
    assert "reload refused" in refused and "at most 4 images" in refused, refused
    count = len(daemon.records("stats"))
    daemon.wait_for("stats", count=count + 1)
    assert "BATCH_CAPACITY=4" in daemon.records("stats")[-1], "the running batch size stays"
    assert daemon.stop() == 0
