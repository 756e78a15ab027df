"""A shared machine: the inbox belongs to a group (2770, group ``inboxd``), and other local
users are around. What a neighbour can see or do must stay what the README's threat model says:
a private photo stays private on its way to done/ and in its result, an idle connection flood
on ``metrics.listen`` cannot stop the pipeline, a file held open does not make the daemon spin,
and records a neighbour writes to the journal or names they choose never pass for the daemon's.
Real mounts, real processes, other uids (as root; each test skips with its reason otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib
import json
import os
import resource
import socket
import stat
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from inboxd.config import load_config
from inboxd.pipeline.wiring import Pipeline
from inboxd.service.metrics_http import LISTEN_BACKLOG, MAX_CONNECTIONS

from support.harness import free_port
from tests.conftest import (
    DaemonProcess,
    line_fields,
    make_image,
    read_json,
    wait_until,
    write_config,
)
from tests.fakes import FakeModel
from tests.journald import journald, wait_for_entries  # noqa: F401

needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="mounts, other owners and other uids need root")
NEIGHBOUR_UID = NEIGHBOUR_GID = 65534  # nobody/nogroup: a local user who is not the daemon
OWNER_UID, OWNER_GID = 4242, 4343  # the photo's owner (no passwd entry needed)


@contextmanager
def tmpfs(target: Path) -> Iterator[Path]:
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,mode=0755", "tmpfs", str(target)],
                   check=True)
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def set_xattr(path: Path) -> str | None:
    """A user xattr where the filesystem takes one (tmpfs does since Linux 6.6), else a
    trusted one (root on tmpfs); the name set, or None."""
    for name in ("user.inboxd_test", "trusted.inboxd_test"):
        try:
            os.setxattr(path, name, b"kept")
        except OSError:
            continue
        return name
    return None


def reads_as(uid: int, gid: int, files: dict[str, tuple[Path, str]]) -> dict[str, bool]:
    """Which of ``files`` (folder, name) a forked child running as ``uid``/``gid`` can open
    for reading. The folders are opened first (pytest's temp root is 0700): only the files'
    own modes and their folders' are tried."""
    folders = {key: os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
               for key, (folder, _) in files.items()}
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            answer = ""
            for key, (_, name) in files.items():
                try:
                    os.close(os.open(name, os.O_RDONLY, dir_fd=folders[key]))
                    answer += "1"
                except PermissionError:
                    answer += "0"
            os.write(write_end, answer.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    answer = os.read(read_end, 64).decode()
    os.waitpid(pid, 0)
    os.close(read_end)
    for fd in folders.values():
        os.close(fd)
    assert len(answer) == len(files), "the child did not answer"
    return {key: flag == "1" for key, flag in zip(files, answer, strict=True)}


# -- class 3: permissions lost on the way -----------------------------------------------------


@needs_root
def test_a_move_to_another_filesystem_keeps_mode_owner_times_and_xattrs(tmp_path: Path) -> None:
    """done/ and failed/ on a tmpfs of their own: the cross-filesystem copy. A 0600 photo of
    another user stays 0600 and theirs, with its mtime and xattrs, in done/ and in failed/;
    its result and error report are no more readable than it (never 0640 for the group)."""
    with tmpfs(tmp_path / "other") as other:
        config = load_config(write_config(
            tmp_path, inbox={"settle_ms": 0}, done_dir=str(other / "done"),
            failed_dir=str(other / "failed")))
        inbox = config.inbox.paths[0]
        good = make_image(inbox / "private.png", size=(8, 8))
        bad = inbox / "broken.png"
        bad.write_bytes(b"not an image")
        shared = make_image(inbox / "shared.png", size=(8, 8), color=(1, 2, 3))
        mtime_ns = 1_600_000_000_123_456_789
        xattrs = {}
        for path, mode in ((good, 0o600), (bad, 0o600), (shared, 0o644)):
            os.chown(path, OWNER_UID, OWNER_GID)
            os.chmod(path, mode)
            os.utime(path, ns=(mtime_ns, mtime_ns))
            xattrs[path.name] = set_xattr(path)
        pipeline = Pipeline(config, FakeModel())  # type: ignore[arg-type]
        asyncio.run(pipeline.process_backlog())

        for moved, mode in ((other / "done" / "private.png", 0o600),
                            (other / "failed" / "broken.png", 0o600),
                            (other / "done" / "shared.png", 0o644)):
            st = moved.lstat()
            assert stat.S_IMODE(st.st_mode) == mode, (moved, oct(st.st_mode))
            assert (st.st_uid, st.st_gid) == (OWNER_UID, OWNER_GID), moved
            assert st.st_mtime_ns == mtime_ns, moved
            name = xattrs[moved.name]
            if name is not None:
                assert os.getxattr(moved, name) == b"kept", moved
        # What the daemon writes about a private photo is private too; a shared one's is not.
        for written in (tmp_path / "results" / "private.png.json",
                        other / "failed" / "broken.png.error.json"):
            assert stat.S_IMODE(written.stat().st_mode) & 0o077 == 0, (
                written, oct(written.stat().st_mode))
        assert stat.S_IMODE((tmp_path / "results" / "shared.png.json").stat().st_mode) & 0o044
        assert read_json(tmp_path / "results" / "private.png.json")["source"] == "private.png"
        # A neighbour in the photos' group, as another uid: the private photo and its result
        # are closed to them, the shared one's result is not.
        neighbour_reads = reads_as(NEIGHBOUR_UID, OWNER_GID, {
            "done": (other / "done", "private.png"),
            "result": (tmp_path / "results", "private.png.json"),
            "shared": (tmp_path / "results", "shared.png.json")})
        assert neighbour_reads == {"done": False, "result": False, "shared": True}
        # Nothing readable by others was left on the way.
        assert not [p for p in other.rglob("*.tmp") if p.is_file()]


# -- class 4: a resource any local process can exhaust ----------------------------------------


def null_model_config(tmp_path: Path, **sections: Any) -> Path:
    """A config with the overhead bench's tiny exported model: loads in a second."""
    import torch

    from support.models import NullModel
    from tests.byo_models import export

    torch.manual_seed(0)
    program = export(NullModel().eval(), tmp_path / "null.pt2", size=32)
    labels = tmp_path / "labels.txt"
    labels.write_text("".join(f"c{i}\n" for i in range(10)))
    sections["inbox"] = {"settle_ms": 0, "rescan_interval_s": 1, **sections.get("inbox", {})}
    return write_config(
        tmp_path, model={"export": str(program), "labels": str(labels), "device": "cpu",
                         "input": {"resize": 32, "crop": 32}}, **sections)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def drop_photos(inbox: Path, prefix: str, count: int) -> set[str]:
    names = set()
    for n in range(count):
        path = make_image(inbox.parent / "staging" / f"{prefix}{n}.png", size=(8, 8),
                          color=(n, 9, 99))
        os.rename(path, inbox / path.name)
        names.add(path.name)
    return names


def done_names(tmp_path: Path) -> set[str]:
    return {p.name for p in (tmp_path / "done").glob("*.png")}


@pytest.mark.slow
@needs_root
def test_an_idle_connection_flood_on_metrics_listen_stops_nothing(tmp_path: Path) -> None:
    """300 idle connections to ``metrics.listen``, the daemon allowed 48 descriptors more than
    it holds at ready: files still complete, a scrape still answers, the daemon's descriptors
    stay within the cap; and with no descriptor left at all, files wait (not failed) and
    complete once descriptors are back."""
    port = free_port()
    config = null_model_config(tmp_path, metrics={"listen": f"127.0.0.1:{port}"})
    daemon = DaemonProcess(config)
    idle: list[socket.socket] = []
    try:
        daemon.wait_for("ready", 120)
        pid = daemon.proc.pid
        url = f"http://127.0.0.1:{port}/metrics"
        assert "inboxd_completed_total" in scrape(url)
        baseline = open_fds(pid)
        # The soft limit only: raising a hard limit again needs CAP_SYS_RESOURCE.
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (baseline + 48, hard))
        for _ in range(300):
            client = socket.socket()
            client.settimeout(0.05)  # a full accept queue drops the SYN: go on to the next
            with contextlib.suppress(OSError):
                client.connect(("127.0.0.1", port))
            idle.append(client)
        peak = open_fds(pid)
        time.sleep(1)  # the daemon takes (or refuses) what the kernel queued
        peak = max(peak, open_fds(pid))
        names = drop_photos(tmp_path / "inbox", "a", 5)
        wait_until(lambda: done_names(tmp_path) >= names, 60,
                   "the files to complete beside 300 idle connections")
        assert "inboxd_completed_total" in scrape(url), "a scrape must still answer"
        # The cap, and one accept batch whose evicted connections close on the next loop turn:
        # a bound of the server's own, whatever the clients do (the old server: the limit).
        bound = baseline + MAX_CONNECTIONS + LISTEN_BACKLOG + 4
        assert max(peak, open_fds(pid)) <= bound, (peak, baseline)

        # No descriptor to spare at all: claims, reads and commits fail for now; files wait.
        for client in idle:
            client.close()
        idle.clear()
        wait_until(lambda: open_fds(pid) <= baseline + 2, 20, "the idle connections to end")
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (open_fds(pid), hard))
        squeezed = drop_photos(tmp_path / "inbox", "b", 5)
        time.sleep(4)
        assert daemon.proc.poll() is None, daemon.output()[-3000:]
        assert not list((tmp_path / "failed").glob("b*.png")), "EMFILE is nobody's fault"
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        wait_until(lambda: done_names(tmp_path) >= names | squeezed, 90,
                   "the squeezed files once descriptors are back")
        assert "inboxd_completed_total" in scrape(url)
        assert not list((tmp_path / "failed").iterdir()) or not list(
            (tmp_path / "failed").glob("*.png")), daemon.output()[-3000:]
    finally:
        for client in idle:
            client.close()
        code = daemon.stop()
    assert code == 0, daemon.output()[-3000:]
    # An accept that fails for want of descriptors is one warning, not a traceback a second.
    assert "out of system resource" not in daemon.output(), daemon.output()[-3000:]


# -- class 7: smaller ones --------------------------------------------------------------------


def stats_field(daemon: DaemonProcess, field: str, after: int) -> int:
    """``field`` of the first stats record printed after line ``after``."""
    def found() -> str | None:
        stats = [line for line in daemon.lines_since(after) if "[stats]" in line]
        return stats[0] if stats else None

    return int(line_fields(wait_until(found, 20, "a stats record"))[field])


@pytest.mark.slow
@needs_root  # the lease that tells a file is held open needs its owner or CAP_LEASE
def test_a_photo_held_open_for_writing_is_not_claimed_again_and_again(tmp_path: Path) -> None:
    """A finished photo whose writer keeps its handle open, writing nothing: given back each
    time it is claimed (it may still grow), but with a growing wait, not ~13 times a second;
    taken as soon as possible once the handle is closed."""
    config = null_model_config(tmp_path, retry={"backoff_initial_ms": 200,
                                                "backoff_max_ms": 1600},
                               inbox={"settle_ms": 0, "rescan_interval_s": 5})
    daemon = DaemonProcess(config)
    try:
        daemon.wait_for("ready", 120)
        staged = make_image(tmp_path / "staging" / "held.png", size=(8, 8))
        handle = os.open(staged, os.O_WRONLY)  # the writer's handle, kept open across the move
        try:
            old = time.time() - 60
            os.utime(staged, (old, old))
            os.rename(staged, tmp_path / "inbox" / "held.png")
            wait_until(lambda: daemon.records("released"), 30, "the first give-back")
            time.sleep(4)
            mark = len(daemon.lines)
            released = stats_field(daemon, "RELEASED", mark)
        finally:
            os.close(handle)
        wait_until(lambda: (tmp_path / "done" / "held.png").exists(), 30,
                   "the photo once its handle is closed")
    finally:
        code = daemon.stop()
    assert code == 0, daemon.output()[-3000:]
    print(f"give-backs in 4 s while held open: {released}")
    # 0.2 + 0.4 + 0.8 + 1.6 + 1.6 s: about five give-backs in four seconds (it was ~50).
    assert 1 <= released <= 8, (released, daemon.output()[-3000:])


def send_as(uid: int, gid: int, **fields: str) -> None:
    """One journal record sent by a forked child running as ``uid``/``gid`` (the module is
    imported before the fork: the child needs no access to the venv)."""
    journal: Any = importlib.import_module("systemd.journal")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            journal.send("inboxd stats", **fields)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@needs_root
def test_inboxd_stats_ignores_records_a_neighbour_forges(
        tmp_path: Path, journald: None) -> None:  # noqa: F811
    """Any local user can send ``SYSLOG_IDENTIFIER=inboxd INBOXD_EVENT=stats`` to the journal;
    ``inboxd stats`` (without ``-u``) must show the daemon's record, not a later forged one."""
    instance = f"forge-{uuid.uuid4().hex[:12]}"
    record = {"SYSLOG_IDENTIFIER": "inboxd", "INBOXD_EVENT": "stats", "INSTANCE": instance}
    send_as(0, 0, **record, COMPLETED="7")  # as the daemon (root here) sends its own
    wait_for_entries({"INSTANCE": instance}, 1)
    send_as(NEIGHBOUR_UID, NEIGHBOUR_GID, **record, COMPLETED="999999")
    forged = wait_for_entries({"INSTANCE": instance}, 2)
    assert {entry["_UID"] for entry in forged} == {"0", str(NEIGHBOUR_UID)}
    shown = subprocess.run([sys.executable, "-m", "inboxd", "stats", "--json", "--instance",
                            instance], capture_output=True, text=True, timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout.splitlines()[0])["COMPLETED"] == 7, shown.stdout


FORGED_LINE = "2026-01-01T00:00:00.000Z INFO    [completed] completed forged.png"


@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_control_characters_in_names_never_reach_stderr_or_check_config_raw(
        tmp_path: Path) -> None:
    """A name with ESC and a newline: the daemon's stderr lines and ``check-config`` show it
    escaped, so it can neither forge a log line nor drive the reader's terminal."""
    hostile = f"a\x1b[2Jb\n{FORGED_LINE}\x9b.png"
    config = null_model_config(tmp_path, results_dir=str(tmp_path / f"res\x1b[31m\n{FORGED_LINE}"))
    checked = subprocess.run([sys.executable, "-m", "inboxd", "check-config", "-c", str(config)],
                             capture_output=True, text=True, timeout=120, check=False)
    assert checked.returncode == 0, checked.stderr
    daemon = DaemonProcess(config)
    try:
        daemon.wait_for("ready", 120)
        make_image(tmp_path / "staging" / "x.png", size=(8, 8)).rename(
            tmp_path / "inbox" / hostile)
        (tmp_path / "inbox" / f"bad\x1b]0;owned\x07\n{FORGED_LINE}.png").write_bytes(b"junk")
        daemon.wait_for("completed", 60)
        daemon.wait_for("failed", 60)
    finally:
        code = daemon.stop()
    assert code == 0, daemon.output()[-3000:]
    for output in (checked.stdout + checked.stderr, daemon.output()):
        assert not any(ch in output for ch in "\x1b\x07\x9b"), output[-3000:]
        assert not any(line.startswith(FORGED_LINE) for line in output.splitlines()), (
            output[-3000:])
    assert "\\x1b" in daemon.output()  # shown, escaped: not dropped


@contextmanager
def no_spare_descriptors() -> Iterator[None]:
    """This process at its descriptor limit (the soft one: it is raised again after). The limit
    is on descriptor *numbers*: the gaps other code left below the highest one open are filled
    first, or a new descriptor would still get one of them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))  # listdir's own, closed now
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
    fillers: list[int] = []
    try:
        while True:
            try:
                fillers.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
            except OSError as exc:
                assert exc.errno == errno.EMFILE, exc
                break
        yield
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_giving_a_file_back_with_no_descriptor_to_spare_is_not_a_crash(tmp_path: Path) -> None:
    """Out of descriptors (a neighbour's flood, a leak elsewhere), handing a claimed file back
    must not raise into the stage (a crash that counts against every file in flight): the
    file stays claimed for now, and goes back once descriptors are there again."""
    from inboxd.files.lifecycle import Lifecycle

    config = load_config(write_config(tmp_path))
    lifecycle = Lifecycle(config)
    lifecycle.prepare()
    inbox = config.inbox.paths[0]
    make_image(inbox / "a.png", size=(8, 8))
    claimed = lifecycle.claim(inbox, "a.png")
    assert claimed is not None
    with no_spare_descriptors():
        outcome = lifecycle.release(claimed, inbox / "a.png")
    assert outcome is None and os.path.exists(claimed)  # still ours, nothing lost
    assert lifecycle.release(claimed, inbox / "a.png") == str(inbox / "a.png")
    assert (inbox / "a.png").exists()


def test_status_sent_to_systemd_escapes_control_characters(tmp_path: Path) -> None:
    """``STATUS=`` is shown by ``systemctl status`` on a terminal: a name in it (a stalled
    file, say) must arrive as one escaped line, on a real datagram socket."""
    from inboxd.service.notify import Notifier

    address = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(str(address))
        receiver.settimeout(5)
        Notifier({"NOTIFY_SOCKET": str(address)}).status("stalled on a\x1b[2Jb\nREADY=1\x9b")
        message = receiver.recv(4096).decode()
    assert message == "STATUS=stalled on a\\x1b[2Jb READY=1\\x9b", message
