"""The commit process on a real filesystem: a batch crosses the pipe whole (odd names, vectors,
errors), is filed and moved exactly as in the daemon's own process, holds the instance while it
lives, and dies with the daemon; one that dies mid-batch is reported, never taken for an
outcome (tests/pipeline/test_commit_crash.py: what the daemon then does)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from inboxd.config import load_config
from inboxd.files import commit_process as commit_process_module
from inboxd.files import lifecycle as lifecycle_module
from inboxd.files.commit_process import CommitProcess, CommitProcessFailed, CommitRaised
from inboxd.files.commits import (
    CommitEntry,
    Committed,
    commit,
    committed_from,
    entries_from,
    filed_document,
    reply_header,
    request_frame,
)
from inboxd.files.layout import processing_dir
from inboxd.files.lifecycle import InstanceBusy, Lifecycle
from inboxd.testing import COMMIT_PAUSE_MS

from tests.conftest import wait_until, write_config
from tests.fakes import InProcess

ODD_NAME = os.fsdecode(b"caf\xe9 \xff.jpg")  # not UTF-8: kept as surrogate escapes


def lifecycle_for(tmp_path: Path) -> Lifecycle:
    lifecycle = Lifecycle(load_config(write_config(tmp_path)))
    lifecycle.prepare()
    lifecycle.lock_instance()
    return lifecycle


def claimed(lifecycle: Lifecycle, name: str, data: bytes) -> CommitEntry:
    """``name`` dropped and claimed, with a result document for it."""
    inbox = lifecycle.config.inbox.paths[0]
    (inbox / name).write_bytes(data)
    path = lifecycle.claim(inbox, name)
    assert path is not None
    sha = hashlib.sha256(data).hexdigest()
    return CommitEntry(name, sha, {"source": name, "sha256": sha, "top_k": []}, path,
                       os.path.join(inbox, name))


@pytest.fixture
def process(tmp_path: Path) -> Iterator[CommitProcess]:
    lifecycle = lifecycle_for(tmp_path)
    commits = CommitProcess(lifecycle.config, lifecycle)
    commits.start()
    yield commits
    commits.close()
    lifecycle.unlock_instance()


def test_a_batch_crosses_the_pipe_whole() -> None:
    vector = np.arange(5, dtype=np.float32)
    entries = [CommitEntry(ODD_NAME, "a" * 64, {"source": ODD_NAME, "n": [1, 2.5]},
                           f"/p/{ODD_NAME}", f"/in/{ODD_NAME}", vector),
               CommitEntry("b.jpg", "b" * 64, {"source": "b.jpg"}, "/p/b.jpg", "/in/b.jpg")]
    rows, payload = request_frame(entries)
    back = entries_from(json.loads(json.dumps(rows)), bytearray(payload))
    assert [(e.key, e.sha256, e.document, e.claimed, e.inbox_path) for e in back] == [
        (e.key, e.sha256, e.document, e.claimed, e.inbox_path) for e in entries]
    assert back[0].vector is not None and back[0].vector.tolist() == vector.tolist()
    assert back[1].vector is None
    committed = Committed([(ODD_NAME, False), ("b.jpg", True)],
                          [None, OSError(errno.ENOSPC, "No space left on device")])
    again = committed_from(json.loads(json.dumps(reply_header(committed))))
    assert again.filed == committed.filed and again.moves[0] is None and again.error is None
    assert isinstance(again.moves[1], OSError) and again.moves[1].errno == errno.ENOSPC
    assert again.moves[1].strerror == "No space left on device"
    # A full disk's error names its file (the index's, say): the wait names and probes its
    # folder, so the path crosses too, not UTF-8 or not.
    full = Committed(error=OSError(errno.EROFS, "Read-only file system", f"/idx/{ODD_NAME}"))
    back_full = committed_from(json.loads(json.dumps(reply_header(full))))
    assert back_full.error is not None and back_full.error.filename == f"/idx/{ODD_NAME}"


def test_a_result_filed_under_another_name_says_so(tmp_path: Path) -> None:
    results = lifecycle_for(tmp_path).results
    document = {"source": "a.jpg", "sha256": "x", "embedding": {"file": "a.jpg.npy", "dim": 2}}
    assert filed_document(results, "a.jpg", document, "a.jpg") is document
    other = filed_document(results, "a.jpg", document, "a.0123456789ab.jpg")
    assert list(other)[:3] == ["source", "filed_as", "sha256"]
    assert other["filed_as"] == "a.0123456789ab.jpg"
    assert other["embedding"] == {"file": "a.0123456789ab.jpg.npy", "dim": 2}
    assert document["embedding"]["file"] == "a.jpg.npy"  # the caller's is left alone


def test_the_commit_process_files_and_moves_as_the_daemon_would(
        tmp_path: Path, process: CommitProcess) -> None:
    lifecycle = process.lifecycle
    entries = [claimed(lifecycle, ODD_NAME, b"one"), claimed(lifecycle, "b.jpg", b"two")]
    here = InProcess(lifecycle).send([claimed(lifecycle, "b.jpg", b"three")]).result()
    assert here.filed == [("b.jpg", False)] and here.moves == [None]
    committed = process.send(entries).result()
    assert committed.error is None and committed.moves == [None, None]
    token = hashlib.sha256(b"two").hexdigest()[:12]
    assert committed.filed == [(ODD_NAME, False), (f"b.{token}.jpg", False)]
    results, done = tmp_path / "results", tmp_path / "done"
    assert json.loads((results / f"b.{token}.jpg.json").read_text())["filed_as"] == (
        f"b.{token}.jpg")
    assert (done / f"b.{token}.jpg").read_bytes() == b"two"
    assert (done / ODD_NAME).read_bytes() == b"one"
    assert not list(Path(processing_dir(lifecycle.config, tmp_path / "inbox")).iterdir())
    # The same bytes under the same name again: found filed, not filed twice.
    again = process.send([claimed(lifecycle, "b.jpg", b"two")]).result()
    assert again.filed == [(f"b.{token}.jpg", True)] and again.moves == [None]


def test_a_group_commit_walks_to_its_claimed_folder_once_and_keeps_what_it_checked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit process holds no area: it walks to the claimed folder by name, once per batch
    (not for each file's mode and again for its move), and keeps the folder that walk checked
    when a member of the group swaps ``.processing`` for a folder of their own meanwhile."""
    daemon = lifecycle_for(tmp_path)
    entries = [claimed(daemon, f"{n}.jpg", f"photo {n}".encode()) for n in range(4)]
    config = daemon.config
    walker = Lifecycle(config)  # as the commit process makes it: no area held
    inbox = config.inbox.paths[0]
    area = Path(processing_dir(config, inbox))
    walks: list[str] = []
    real_open_inside = lifecycle_module.open_inside

    @contextlib.contextmanager
    def counting(root: str | Path | int, parts: list[str], **kwargs: bool) -> Iterator[int]:
        with real_open_inside(root, parts, **kwargs) as folder:
            yield folder
        if root == inbox and parts == [area.parent.name, area.name]:
            walks.append(area.name)
            if len(walks) == 1:  # walked and checked: now the name leads to another folder
                os.rename(area.parent, inbox / "moved-away")
                area.mkdir(parents=True)

    monkeypatch.setattr(lifecycle_module, "open_inside", counting)
    committed = commit(walker, entries)
    assert committed.error is None and committed.moves == [None] * 4
    assert walks == [area.name]
    assert sorted(p.name for p in (tmp_path / "done").iterdir()) == [
        f"{n}.jpg" for n in range(4)]
    assert not list((inbox / "moved-away" / area.name).iterdir())
    daemon.unlock_instance()


def test_batches_sent_before_the_first_is_answered_are_each_answered(
        tmp_path: Path, process: CommitProcess) -> None:
    lifecycle = process.lifecycle
    sent = [process.send([claimed(lifecycle, f"{n}-{i}.jpg", f"{n}-{i}".encode())
                          for i in range(20)]) for n in range(3)]
    # A writer cancelled at shutdown cannot cancel a batch already sent: its reply is still
    # taken off the pipe, and the next batch's is its own.
    assert not sent[0].cancel()
    for n, future in enumerate(sent):
        assert future.result().filed == [(f"{n}-{i}.jpg", False) for i in range(20)]
    assert len(list((tmp_path / "done").glob("*.jpg"))) == 60


def test_a_vector_is_filed_beside_its_result(tmp_path: Path, process: CommitProcess) -> None:
    entry = claimed(process.lifecycle, "e.jpg", b"embed")
    entry = CommitEntry(entry.key, entry.sha256, {"source": "e.jpg", "embedding": {
        "file": "e.jpg.npy"}}, entry.claimed, entry.inbox_path, np.array([3, 4], np.float32))
    assert process.send([entry]).result().filed == [("e.jpg", False)]
    assert np.load(tmp_path / "results" / "e.jpg.npy").tolist() == [3.0, 4.0]


def test_a_full_results_disk_is_the_batch_s_error_and_nothing_moves(
        tmp_path: Path, process: CommitProcess) -> None:
    entry = claimed(process.lifecycle, "a.jpg", b"data")
    tmp = process.lifecycle.results.tmp_dir
    tmp.mkdir(parents=True, exist_ok=True)
    tmp.rmdir()
    tmp.write_bytes(b"")  # where the temp files go is a file now: ENOTDIR, like a broken disk
    committed = process.send([entry]).result()
    assert committed.error is not None and committed.filed == []
    assert os.path.exists(entry.claimed) and not (tmp_path / "done" / "a.jpg").exists()


def test_the_commit_process_holds_the_instance_while_it_lives(
        tmp_path: Path, process: CommitProcess) -> None:
    process.lifecycle.unlock_instance()  # the daemon's own descriptors are gone...
    other = Lifecycle(process.lifecycle.config)
    with pytest.raises(InstanceBusy):  # ...yet the instance is busy while the process runs
        other.lock_instance()
    process.close()
    other.lock_instance()
    other.unlock_instance()


def test_a_commit_process_that_dies_is_reported_not_taken_for_an_outcome(
        tmp_path: Path, process: CommitProcess) -> None:
    assert process.send([claimed(process.lifecycle, "a.jpg", b"a")]).result().moves == [None]
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    entry = claimed(process.lifecycle, "b.jpg", b"b")
    with pytest.raises(CommitProcessFailed, match="ended with SIGKILL"):
        process.send([entry]).result()
    assert os.path.exists(entry.claimed)


def test_a_bug_met_in_the_commit_process_comes_back_with_its_traceback(
        process: CommitProcess) -> None:
    unsafe = CommitEntry("../x.jpg", "a" * 64, {}, "/nonexistent", "/nonexistent")
    with pytest.raises(CommitRaised, match="refusing unsafe output key"):
        process.send([unsafe]).result()


def test_a_bug_met_in_a_batch_is_what_every_batch_behind_it_reports(
        process: CommitProcess) -> None:
    """It exits after the traceback, and a batch already sent behind the one that raised must
    fail as that bug too, not as a kill of the process (which would count against no file)."""
    lifecycle = process.lifecycle
    unsafe = CommitEntry("../x.jpg", "a" * 64, {}, "/nonexistent", "/nonexistent")
    first = process.send([unsafe])
    second = process.send([claimed(lifecycle, "b.jpg", b"b")])
    for future in (first, second):
        with pytest.raises(CommitRaised, match="refusing unsafe output key"):
            future.result()
    with pytest.raises(CommitRaised):
        process.send([claimed(lifecycle, "c.jpg", b"c")])


def test_a_large_batch_waits_on_its_own_thread_not_on_the_caller(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch larger than the pipe, sent while the one before is still being committed, is
    handed over at once: the io thread that sends it has other files to move meanwhile."""
    monkeypatch.setenv(COMMIT_PAUSE_MS, "500")  # each step of each commit: 2 s a commit
    lifecycle = lifecycle_for(tmp_path)
    commits = CommitProcess(lifecycle.config, lifecycle)
    commits.start()
    label = "x" * 2000  # 64 documents of 10 KB: a request of 640 KB, ten pipes full
    try:
        batches = [[claimed(lifecycle, f"{n}-{i}.jpg", f"{n}-{i}".encode()) for i in range(64)]
                   for n in range(2)]
        batches = [[CommitEntry(e.key, e.sha256, {**e.document, "top_k": [label] * 5},
                                e.claimed, e.inbox_path) for e in batch] for batch in batches]
        started = time.monotonic()
        sent = [commits.send(batch) for batch in batches]
        assert time.monotonic() - started < 1.0
        assert [len(future.result().filed) for future in sent] == [64, 64]
    finally:
        commits.close()


def test_a_batch_that_cannot_be_encoded_leaves_the_next_one_its_own_reply(
        process: CommitProcess) -> None:
    lifecycle = process.lifecycle
    entry = claimed(lifecycle, "a.jpg", b"a")
    odd = CommitEntry(entry.key, entry.sha256, {"source": {1, 2}}, entry.claimed,
                      entry.inbox_path)
    with pytest.raises(TypeError):
        process.send([odd])  # a bug in the daemon: nothing was sent
    assert process.send([entry]).result().filed == [("a.jpg", False)]


def test_a_reply_thread_that_meets_the_unexpected_fails_every_batch_instead_of_hanging(
        process: CommitProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(header: object) -> Committed:
        raise IndexError("a bug in reading replies")

    monkeypatch.setattr(commit_process_module, "committed_from", broken)
    lifecycle = process.lifecycle
    futures = [process.send([claimed(lifecycle, f"{n}.jpg", f"{n}".encode())]) for n in range(2)]
    for future in futures:
        with pytest.raises(CommitProcessFailed, match="IndexError"):
            future.result(timeout=30)
    with pytest.raises(CommitProcessFailed):
        process.send([claimed(lifecycle, "c.jpg", b"c")])


def test_a_config_whose_paths_are_not_utf8_reaches_the_commit_process(tmp_path: Path) -> None:
    root = tmp_path / os.fsdecode(b"caf\xe9")  # a Latin-1 folder name: not UTF-8
    root.mkdir()
    lifecycle = lifecycle_for(root)
    commits = CommitProcess(lifecycle.config, lifecycle)
    commits.start()
    try:
        committed = commits.send([claimed(lifecycle, "a.jpg", b"a")]).result()
    finally:
        commits.close()
    assert committed.filed == [("a.jpg", False)] and (root / "done" / "a.jpg").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_while_the_commit_process_starts_does_not_end_it(
        tmp_path: Path, sig: signal.Signals) -> None:
    """A Ctrl-C or systemd's SIGTERM to the whole group can come while it is still importing:
    it is the daemon's to drain and end, not the signal's."""
    lifecycle = lifecycle_for(tmp_path)
    commits = CommitProcess(lifecycle.config, lifecycle)
    commits.start()
    try:
        assert commits.pid is not None
        os.kill(commits.pid, sig)
        assert commits.send([claimed(lifecycle, "a.jpg", b"a")]).result().moves == [None]
    finally:
        commits.close()


def test_the_commit_process_dies_with_the_daemon_even_mid_commit(tmp_path: Path) -> None:
    """A SIGKILLed daemon takes its commit process with it at once, even in the middle of a
    commit (paused there for 30 s): nothing moves after the daemon is gone, and the instance is
    free again."""
    config = write_config(tmp_path)
    (tmp_path / "inbox" / "a.jpg").write_bytes(b"data")
    script = (
        "import threading, time\n"
        "from pathlib import Path\n"
        "from inboxd.config import load_config\n"
        "from inboxd.files.commit_process import CommitProcess\n"
        "from inboxd.files.commits import CommitEntry\n"
        "from inboxd.files.lifecycle import Lifecycle\n"
        f"lifecycle = Lifecycle(load_config(Path({str(config)!r})))\n"
        "lifecycle.prepare(); lifecycle.lock_instance()\n"
        "inbox = lifecycle.config.inbox.paths[0]\n"
        "entry = CommitEntry('a.jpg', 'f' * 64, {}, lifecycle.claim(inbox, 'a.jpg'), 'x')\n"
        "commits = CommitProcess(lifecycle.config, lifecycle); commits.start()\n"
        "commits.send([entry])\n"
        "print(commits.pid, flush=True); time.sleep(60)\n")
    daemon = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, COMMIT_PAUSE_MS: "30000"})
    assert daemon.stdout is not None
    pid = int(daemon.stdout.readline())
    processing = Path(processing_dir(load_config(config), tmp_path / "inbox"))
    wait_until(lambda: list((tmp_path / "results" / ".tmp").rglob("*.tmp")), 10,
               "the commit to start")  # inside the commit
    daemon.kill()
    daemon.wait()
    wait_until(lambda: not _alive(pid), 5, "the commit process to die with the daemon")
    assert (processing / "a.jpg").read_bytes() == b"data"
    assert not (tmp_path / "done" / "a.jpg").exists()
    lifecycle = Lifecycle(load_config(config))
    lifecycle.lock_instance()
    lifecycle.unlock_instance()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_stopped_commit_process_shows_as_a_stall_until_it_runs_again(
        process: CommitProcess) -> None:
    """What the watchdog and STATUS read (``Pipeline.stalls``): how long the oldest batch has
    waited for its reply, and whether the process is stopped."""
    assert process.stalled_s() is None, "nothing sent: nothing stalls"
    first = process.send([claimed(process.lifecycle, "first.jpg", b"first")])
    first.result(60)
    assert process.pid is not None and process.stalled_s() is None and not process.stopped()
    os.kill(process.pid, signal.SIGSTOP)  # a hung disk holds it just as still
    try:
        waiting = process.send([claimed(process.lifecycle, "second.jpg", b"second")])
        time.sleep(1.5)
        stalled_s = process.stalled_s()
        assert stalled_s is not None and stalled_s >= 1.5
        assert process.stopped()
        assert not waiting.done()
    finally:
        os.kill(process.pid, signal.SIGCONT)
    assert waiting.result(60).error is None
    assert process.stalled_s() is None and not process.stopped()
    assert process.replies == 2
