"""The review pass of issue 33: the attacks a helper tried against the fixes of its seven classes,
the ones that still worked, each as a test that failed before its fix (hostile config text,
hostile failed reports, ...)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DaemonProcess, make_image, write_config


def inboxd(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inboxd", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("text", [
    "x: " + "[" * 100_000 + "]" * 100_000 + "\n",  # nested past the parser's recursion limit
    'inbox: {paths: ["/srv/inbox\\x00/etc"]}\n',  # a NUL no path can hold (a YAML escape)
    'instance: "gpu0"\nmetrics: {textfile: "m\\0.prom"}\n',
], ids=["nested-100k-deep", "nul-in-inbox-path", "nul-in-textfile"])
def test_hostile_config_text_exits_78_not_a_traceback(tmp_path: Path, text: str) -> None:
    """Before: a RecursionError or 'ValueError: embedded null byte' traceback and exit 1 from
    check-config, and the same exceptions out of the loader for run, once and a reload."""
    config = write_config(tmp_path)
    config.write_text(text)
    result = inboxd("check-config", "-c", str(config), cwd=tmp_path)
    assert result.returncode == 78, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert str(config) in result.stderr


def test_submit_refuses_a_fifo_or_a_device_named_like_a_photo(tmp_path: Path) -> None:
    """Somebody submits every photo of a folder others can write: one of them planted
    ``planted.jpg`` as a FIFO (before: submit waited for a writer for ever) and ``zero.jpg`` as
    a link to /dev/zero (before: submit copied zeros until the inbox's disk was full)."""
    config = write_config(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.mkfifo(shared / "planted.jpg")
    (shared / "zero.jpg").symlink_to("/dev/zero")
    make_image(shared / "good.png")
    result = subprocess.run(
        [sys.executable, "-m", "inboxd", "submit", "-c", str(config),
         str(shared / "planted.jpg"), str(shared / "zero.jpg"), str(shared / "good.png")],
        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("not a regular file") == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in (tmp_path / "inbox").iterdir()) == ["good.png"]
    assert (tmp_path / "inbox" / "good.png").read_bytes() == (shared / "good.png").read_bytes()


# Each case runs inboxd once (tens of seconds): one in the fast tier, every one in the full suite.
@pytest.mark.parametrize("rel", [
    pytest.param("sub/..", id="dotdot-leaf"),
    pytest.param(".", id="dot", marks=pytest.mark.slow),
    pytest.param(".processing/default/x.png", id="into-processing", marks=pytest.mark.slow),
    pytest.param("a\0b.png", id="nul", marks=pytest.mark.slow),
    pytest.param(["x"], id="not-a-string", marks=pytest.mark.slow)])
def test_retry_refuses_a_report_whose_path_no_inbox_file_has(tmp_path: Path, rel: object) -> None:
    """A report in failed/ edited (or written by a bug) to say the file came from ``sub/..``:
    before, retry returned it to ``inbox/sub/..t<token>``, a hidden name the daemon never takes
    (lost to it for good), ``.`` likewise, ``.processing/default/x.png`` into the daemon's own
    claims, ``a\\0b.png`` to ``a``; a list became the name ``['x']``."""
    config = write_config(tmp_path, inbox={"settle_ms": 0})
    (tmp_path / "inbox" / "bad.png").write_bytes(b"not an image")
    inboxd("once", "-c", str(config), cwd=tmp_path)  # exits 1: a file failed
    report_path = tmp_path / "failed" / "bad.png.error.json"
    report = json.loads(report_path.read_text())
    report["rel"] = rel
    report_path.write_text(json.dumps(report))
    result = inboxd("retry", "-c", str(config), str(tmp_path / "failed" / "bad.png"),
                    cwd=tmp_path)
    assert result.returncode != 0, result.stdout
    assert "no file the daemon takes has" in result.stderr, result.stderr
    assert (tmp_path / "failed" / "bad.png").read_bytes() == b"not an image"
    assert json.loads(report_path.read_text())["rel"] == rel  # the report stays with it
    left = [p for p in (tmp_path / "inbox").rglob("*") if p.is_file() and p.suffix != ".lock"]
    assert left == [], left


@pytest.mark.timeout(180)
@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_a_stop_with_idle_metrics_connections_open_logs_no_traceback(tmp_path: Path) -> None:
    """Any local process can hold connections to metrics.listen open; at a SIGTERM each one's
    handler was cancelled, and Python 3.11's stream callback (task.exception() on a cancelled
    task) printed 'Exception in callback ... CancelledError' with a traceback for every one,
    into the journal."""
    port_probe = socket.socket()
    port_probe.bind(("127.0.0.1", 0))
    port = port_probe.getsockname()[1]
    port_probe.close()
    config = write_config(tmp_path, metrics={"listen": f"127.0.0.1:{port}"})
    daemon = DaemonProcess(config)
    idle: list[socket.socket] = []
    try:
        daemon.wait_for("ready")
        for _ in range(40):  # more than the cap: some evicted, 16 still waiting at the stop
            connection = socket.create_connection(("127.0.0.1", port), timeout=5)
            connection.send(b"GET /met")
            idle.append(connection)
        time.sleep(0.5)
        assert daemon.stop(timeout_s=60) == 0
        assert "Traceback" not in daemon.output(), daemon.output()[-3000:]
    finally:
        daemon.kill()
        for connection in idle:
            connection.close()


def test_the_metrics_socket_chmod_never_widens_what_a_swapped_in_link_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``unix:`` in a folder others can write: between the bind and the chmod the socket is
    swapped for a link to a 0600 file the daemon's user owns. Before, the chmod followed the
    link and made that file 0660 (readable by the group). The swap is injected right after the
    real bind, where a racing neighbour would win."""
    from inboxd.service import metrics_http

    secret = tmp_path / "secret.jpg"
    secret.write_bytes(b"private")
    secret.chmod(0o600)
    path = tmp_path / "metrics.sock"
    real_start = asyncio.start_unix_server

    async def start_then_swap(*args: Any, **kwargs: Any) -> asyncio.base_events.Server:
        server = await real_start(*args, **kwargs)
        path.unlink()
        path.symlink_to(secret)
        return server

    monkeypatch.setattr(metrics_http.asyncio, "start_unix_server", start_then_swap)

    async def start() -> None:
        server = metrics_http.MetricsServer(lambda: b"")
        try:
            with pytest.raises(OSError, match="replaced"):
                await server.start(f"unix:{path}")
        finally:
            server.close()

    asyncio.run(start())
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert secret.read_bytes() == b"private"


@pytest.mark.skipif(os.geteuid() != 0, reason="a folder of another uid needs root to make")
@pytest.mark.parametrize("planted", ["link", "foreign-folder"])
def test_crash_counts_are_never_read_from_a_processing_folder_not_ours(
        tmp_path: Path, planted: str) -> None:
    """A group member renames ``.processing`` away and plants their own (a link to a folder of
    theirs, or a folder they own) holding ``default.crashes.json`` that gives a victim's good
    photo two crashes. Before, the ledgers were listed and read by name through it: the next
    crash or start-up counted the forged crashes, failed the photo as a crasher and copied the
    forged count into the daemon's own ledger."""
    from inboxd.config import load_config
    from inboxd.files.lifecycle import Lifecycle

    lifecycle = Lifecycle(load_config(write_config(tmp_path)))
    lifecycle.lock_instance()
    inbox = tmp_path / "inbox"
    try:
        forged = {"victim.png": [2, "stage crashed", "0" * 64]}
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        (theirs / "default.crashes.json").write_text(json.dumps(forged))
        os.rename(inbox / ".processing", tmp_path / "ours")
        if planted == "link":
            (inbox / ".processing").symlink_to(theirs)
        else:
            os.rename(theirs, inbox / ".processing")
            os.chown(inbox / ".processing", 42_421, 42_420)
            os.chmod(inbox / ".processing", 0o2770)
        assert lifecycle.crash_ledger.counts(inbox) == []
    finally:
        lifecycle.unlock_instance()


@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_a_failed_file_with_a_long_name_can_be_retried(tmp_path: Path) -> None:
    """A 250-byte name fits, its report's name (+ ".error.json") does not and is shortened
    to name~hash.error.json. Before, retry took the report's name for the file's and said
    'only its report is left': such a file could never be retried."""
    config = write_config(tmp_path, inbox={"settle_ms": 0})
    name = "y" * 246 + ".png"
    (tmp_path / "inbox" / name).write_bytes(b"not an image")
    inboxd("once", "-c", str(config), cwd=tmp_path)  # exits 1: a file failed
    assert (tmp_path / "failed" / name).exists()
    result = inboxd("retry", "-c", str(config), "--all", cwd=tmp_path)
    assert "returned 1 failed file(s)" in result.stdout, result.stderr
    assert (tmp_path / "inbox" / name).read_bytes() == b"not an image"
    assert [p.name for p in (tmp_path / "failed").iterdir() if not p.name.startswith(".")] == []
