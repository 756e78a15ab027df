"""Taking over a dead instance's claimed files (``files/takeover.py``) on a real filesystem:
a dead one's files go back under their names, a live one's are never touched, crash counts
follow a file from one instance to the next, and no planted link is followed."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest
from inboxd.config import load_config
from inboxd.files import lifecycle as lifecycle_module
from inboxd.files.lifecycle import InstanceBusy, Lifecycle
from inboxd.files.takeover import take_over_dead

from tests.conftest import write_config


def instance(tmp_path: Path, name: str) -> Lifecycle:
    config = load_config(write_config(tmp_path)).model_copy(update={"instance": name})
    lifecycle = Lifecycle(config)
    lifecycle.lock_instance()
    lifecycle.prepare()
    return lifecycle


def claim_all(lifecycle: Lifecycle, inbox: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (inbox / rel).parent.mkdir(parents=True, exist_ok=True)
        (inbox / rel).write_bytes(data)
        assert lifecycle.claim(inbox, rel) is not None


def test_a_dead_instances_files_go_back_under_their_names(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    a, b = instance(tmp_path, "a"), instance(tmp_path, "b")
    files = {"one.jpg": b"1", "deep/er/two.jpg": b"2", "scan.jpg": b"old"}
    claim_all(a, inbox, files)
    (inbox / "scan.jpg").write_bytes(b"new")  # a new file took a claimed one's name meanwhile
    a.unlock_instance()  # a dies: the kernel releases its lock

    sweep = take_over_dead(b)

    assert [t.instance for t in sweep.taken] == ["a"] and not sweep.refused
    assert sorted(sweep.taken[0].returned)[:2] == ["deep/er/two.jpg", "one.jpg"]
    assert (inbox / "one.jpg").read_bytes() == b"1"
    assert (inbox / "deep/er/two.jpg").read_bytes() == b"2"
    assert (inbox / "scan.jpg").read_bytes() == b"new"  # never replaced
    assert sorted(p.read_bytes() for p in inbox.glob("scan*.jpg")) == [b"new", b"old"]
    assert not (inbox / ".processing" / "a").exists(), "its emptied folder is removed"
    assert (inbox / ".processing" / "a.lock").exists(), "the lock file stays (see module doc)"
    assert list((inbox / ".processing" / "b").iterdir()) == []
    assert take_over_dead(b).taken == [], "a second look finds nothing more"
    a.lock_instance()  # and a can start again under its name


def test_a_live_instance_is_never_touched(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    a, b = instance(tmp_path, "a"), instance(tmp_path, "b")
    claim_all(a, inbox, {"mine.jpg": b"a's"})
    sweep = take_over_dead(b)
    assert sweep.taken == [] and sweep.refused == []
    assert (inbox / ".processing" / "a" / "mine.jpg").read_bytes() == b"a's"
    assert not (inbox / "mine.jpg").exists()
    # Nor does a takeover by a take b's (ours, also alive).
    assert take_over_dead(a).taken == []


def test_a_restart_during_a_takeover_waits_for_it(tmp_path: Path) -> None:
    """The taker holds the dead instance's lock while returning its files; the dead one's
    restart meanwhile waits for the lock instead of refusing to start."""
    instance(tmp_path, "a").unlock_instance()
    lock = tmp_path / "inbox" / ".processing" / "a.lock"
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    threading.Timer(0.5, os.close, [fd]).start()  # a takeover that takes half a second
    config = load_config(write_config(tmp_path)).model_copy(update={"instance": "a"})
    started = time.monotonic()
    Lifecycle(config).lock_instance()
    assert 0.3 < time.monotonic() - started < 4


def test_a_lock_held_for_longer_still_refuses_a_second_daemon(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle_module, "LOCK_WAIT_S", 0.2)
    instance(tmp_path, "a")
    config = load_config(write_config(tmp_path)).model_copy(update={"instance": "a"})
    with pytest.raises(InstanceBusy, match="already running"):
        Lifecycle(config).lock_instance()


def test_a_file_that_kills_every_instance_still_ends_in_failed(tmp_path: Path) -> None:
    """Its crash count follows it: a crashes with it (1, in a's ledger), b takes it over and
    claims it, crashes with it too (2): it goes to failed/, not round the inbox for ever."""
    inbox = tmp_path / "inbox"
    a, b = instance(tmp_path, "a"), instance(tmp_path, "b")
    claim_all(a, inbox, {"killer.jpg": b"boom"})
    a.crash_ledger.record("stage model crashed: RuntimeError('boom')")
    a.unlock_instance()

    assert take_over_dead(b).taken[0].returned == ["killer.jpg"]
    ledger = json.loads((inbox / ".processing" / "a.crashes.json").read_text())
    assert ledger == {"killer.jpg": [1, "stage model crashed: RuntimeError('boom')",
                                    hashlib.sha256(b"boom").hexdigest()]}

    assert b.claim(inbox, "killer.jpg") is not None
    b.crash_ledger.record("stage model crashed: RuntimeError('boom')")
    assert b.recover() == (0, 1)
    report = json.loads((tmp_path / "failed" / "killer.jpg.error.json").read_text())
    assert "crashed 2 times" in report["reason"]


def test_a_dead_instances_repeat_crasher_goes_to_failed_at_takeover(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    a, b = instance(tmp_path, "a"), instance(tmp_path, "b")
    claim_all(a, inbox, {"killer.jpg": b"boom", "fine.jpg": b"ok"})
    a.crash_ledger.record("stage crashed")
    a.recover()  # a's restart returns both (count 1 each) ...
    assert a.claim(inbox, "killer.jpg") is not None  # ... claims one again, crashes again
    a.crash_ledger.record("stage crashed")
    a.unlock_instance()

    taken = take_over_dead(b).taken[0]
    assert (taken.returned, taken.failed) == ([], 1)
    assert (tmp_path / "failed" / "killer.jpg").read_bytes() == b"boom"
    assert json.loads((tmp_path / "failed" / "killer.jpg.error.json").read_text())[
        "instance"] == "a"
    assert not (inbox / ".processing" / "a.crashes.json").exists()


def test_a_folder_without_a_lock_is_left_alone_and_reported(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    b = instance(tmp_path, "b")
    (inbox / ".processing" / "old").mkdir()
    (inbox / ".processing" / "old" / "x.jpg").write_bytes(b"x")
    sweep = take_over_dead(b)
    assert sweep.taken == []
    assert sweep.refused[0][0].endswith(".processing/old")
    assert "inboxd recover --instance old" in sweep.refused[0][1]
    assert (inbox / ".processing" / "old" / "x.jpg").read_bytes() == b"x"


def test_planted_links_are_never_followed(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    b = instance(tmp_path, "b")
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "dir" / "private.jpg").write_bytes(b"private")
    (outside / "lock").write_bytes(b"")
    processing = inbox / ".processing"
    # x: a real folder whose lock is a link; y: a link in place of the folder, a real lock;
    # z: a dead instance's real folder holding a link to a folder outside.
    (processing / "x").mkdir()
    (processing / "x" / "a.jpg").write_bytes(b"a")
    (processing / "x.lock").symlink_to(outside / "lock")
    (processing / "y").symlink_to(outside / "dir")
    (processing / "y.lock").write_bytes(b"")
    (processing / "z").mkdir()
    (processing / "z" / "sub").symlink_to(outside / "dir")
    (processing / "z.lock").write_bytes(b"")

    sweep = take_over_dead(b)

    refused = dict(sweep.refused)
    assert "a symbolic link, not a lock" in refused[str(processing / "x.lock")]
    assert (processing / "x" / "a.jpg").read_bytes() == b"a"
    # y is not even a candidate: only real folders are an instance's.
    assert "a symbolic link, not a folder" in refused[str(processing / "y")]
    assert [t.returned for t in sweep.taken] == [["sub"]]  # the link itself goes back, as a link
    assert (inbox / "sub").is_symlink()
    assert (outside / "dir" / "private.jpg").read_bytes() == b"private"
    assert sorted(p.name for p in outside.rglob("*")) == ["dir", "lock", "private.jpg"]
    assert not (inbox / "private.jpg").exists()


def test_a_linked_processing_folder_is_refused(tmp_path: Path) -> None:
    b = instance(tmp_path, "b")
    b.unlock_instance()
    inbox = tmp_path / "inbox"
    (inbox / ".processing").rename(tmp_path / "elsewhere")
    (inbox / ".processing").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "a").mkdir()
    (tmp_path / "elsewhere" / "a" / "x.jpg").write_bytes(b"x")
    (tmp_path / "elsewhere" / "a.lock").write_bytes(b"")
    sweep = take_over_dead(b)
    assert sweep.taken == [] and "symbolic link" in sweep.refused[0][1]
    assert (tmp_path / "elsewhere" / "a" / "x.jpg").exists()
