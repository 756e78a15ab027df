"""An adversary against takeover (``files/takeover.py``): planted links and odd lock files on
a shared inbox, and the files a SIGKILLed instance left mid-way. Nothing may leave the inbox
through a link, one bad entry may not stop the sweep for every other dead instance, and a
file whose result was already durable may not get a second one."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import resource
import shutil
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from inboxd.config import load_config
from inboxd.files.lifecycle import Lifecycle
from inboxd.files.results import ResultEntry
from inboxd.files.takeover import take_over_dead
from inboxd.pipeline.takeover_sweep import Takeovers
from inboxd.pipeline.wiring import Pipeline
from inboxd.stats import Stats

from tests.conftest import make_image, write_config
from tests.fakes import FakeModel
from tests.files.test_takeover import instance


def dead(tmp_path: Path, name: str, files: dict[str, bytes]) -> Lifecycle:
    lifecycle = instance(tmp_path, name)
    inbox = tmp_path / "inbox"
    for rel, data in files.items():
        (inbox / rel).parent.mkdir(parents=True, exist_ok=True)
        (inbox / rel).write_bytes(data)
        assert lifecycle.claim(inbox, rel) is not None
    lifecycle.unlock_instance()
    return lifecycle


def test_a_link_planted_where_a_returned_files_folder_was_is_not_followed(
        tmp_path: Path) -> None:
    """a claimed sub/x.jpg and died; meanwhile someone replaced the inbox's sub/ with a link
    to a folder outside. Giving x.jpg back must not move it out through that link."""
    inbox, outside = tmp_path / "inbox", tmp_path / "outside"
    outside.mkdir()
    dead(tmp_path, "a", {"sub/x.jpg": b"x"})
    (inbox / "sub").rmdir()
    (inbox / "sub").symlink_to(outside)
    b = instance(tmp_path, "b")

    sweep = take_over_dead(b)

    assert list(outside.iterdir()) == [], "a file left the inbox through a planted link"
    assert (inbox / ".processing" / "a" / "sub" / "x.jpg").read_bytes() == b"x"
    assert any("symbolic link" in why for _, why in sweep.refused)


def test_one_odd_lock_does_not_stop_the_sweep_for_the_others(tmp_path: Path) -> None:
    """Locks that are a folder or a socket (planted, or left by something else) are that
    instance's problem: every other dead instance is still taken over, on every inbox."""
    inbox = tmp_path / "inbox"
    dead(tmp_path, "z", {"z.jpg": b"z"})
    processing = inbox / ".processing"
    for odd in ("a0", "a1", "a2"):
        (processing / odd).mkdir()
        (processing / odd / f"{odd}.jpg").write_bytes(odd.encode())
    (processing / "a0.lock").mkdir()  # EISDIR
    os.mkfifo(processing / "a2.lock")  # opens at once (O_RDWR), but is no lock file
    with socket.socket(socket.AF_UNIX) as sock:  # ENXIO
        sock.bind(str(processing / "a1.lock"))
        b = instance(tmp_path, "b")
        sweep = take_over_dead(b)
    assert [t.instance for t in sweep.taken] == ["z"]
    assert (inbox / "z.jpg").read_bytes() == b"z"
    refused = dict(sweep.refused)
    for odd in ("a0", "a1", "a2"):
        assert str(processing / f"{odd}.lock") in refused
        assert (processing / odd / f"{odd}.jpg").exists()


def test_a_fifo_where_a_claimed_folder_was_goes_back_like_a_file(tmp_path: Path) -> None:
    """A FIFO swapped in for a dead instance's sub-folder is neither opened (it would block)
    nor a reason to stop: it goes back as it is, and the other instance is taken over too."""
    inbox = tmp_path / "inbox"
    dead(tmp_path, "a", {"deep/x.jpg": b"x"})
    dead(tmp_path, "c", {"c.jpg": b"c"})
    folder = inbox / ".processing" / "a" / "deep"
    shutil.rmtree(folder)
    os.mkfifo(folder)  # a FIFO where a folder was: goes back like any other entry
    b = instance(tmp_path, "b")
    sweep = take_over_dead(b)
    assert sorted(t.instance for t in sweep.taken) == ["a", "c"]
    assert (inbox / "c.jpg").read_bytes() == b"c"


def test_odd_bytes_in_names_are_taken_over_and_reported(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    odd = os.fsdecode(b"\xff\xfe-\x01.jpg")
    dead(tmp_path, "a", {odd: b"odd"})
    b = instance(tmp_path, "b")
    takeovers = Takeovers(b, Stats(), None, 1.0, lambda: None)  # type: ignore[arg-type]
    assert takeovers.sweep() == 1  # logged and counted: the name's bytes do not break either
    assert (inbox / odd).read_bytes() == b"odd"
    # And as a crasher: its count (a JSON key) and its error report (a JSON value) hold them.
    c = instance(tmp_path, "c")
    assert c.claim(inbox, odd) is not None
    c.crash_ledger.record("stage crashed")
    c.recover()
    assert c.claim(inbox, odd) is not None
    c.crash_ledger.record("stage crashed")
    c.unlock_instance()
    assert takeovers.sweep() == 0
    assert (tmp_path / "failed" / odd).read_bytes() == b"odd"


def results_for(root: Path, sha256: str) -> list[Path]:
    return [p for p in (root / "results").rglob("*.json")
            if json.loads(p.read_text()).get("sha256") == sha256]


def test_a_returned_file_whose_result_is_durable_gets_no_second_one(tmp_path: Path) -> None:
    """a wrote scan.png's result, then was SIGKILLed before the source moved to done/; a new
    scan.png has since taken the name in the inbox, so the takeover gives the old one back
    under a variant name. It must still be found done by its sha256, not processed again."""
    config = load_config(write_config(tmp_path, inbox={"settle_ms": 0}))
    inbox = tmp_path / "inbox"
    make_image(inbox / "scan.png", color=(1, 2, 3))
    a = Pipeline(config.model_copy(update={"instance": "a"}), FakeModel())  # type: ignore[arg-type]
    asyncio.run(a.process_backlog())
    [result] = list((tmp_path / "results").glob("*.json"))
    sha = json.loads(result.read_text())["sha256"]
    # Undo the move: the result is durable, the source still claimed, a is dead.
    os.rename(tmp_path / "done" / "scan.png", inbox / ".processing" / "a" / "scan.png")
    make_image(inbox / "scan.png", color=(200, 100, 50))  # a new file takes the name
    b = Pipeline(config.model_copy(update={"instance": "b"}), FakeModel())  # type: ignore[arg-type]
    asyncio.run(b.process_backlog())
    assert len(results_for(tmp_path, sha)) == 1, "the old scan.png got a second result"
    assert len(list((tmp_path / "results").glob("*.json"))) == 2


def test_a_claim_variant_whose_result_is_durable_is_finished_not_given_back(
        tmp_path: Path) -> None:
    """a claimed a second x.jpg as x.t<hex>.jpg (the first was still in flight), filed its
    result under x.<sha>.jpg and died before the move. Neither the takeover nor a's own
    restart may give it back to be filed a third time."""
    inbox = tmp_path / "inbox"
    a = instance(tmp_path, "a")
    (inbox / "x.jpg").write_bytes(b"first")
    a.claim(inbox, "x.jpg")
    (inbox / "x.jpg").write_bytes(b"second")
    second = a.claim(inbox, "x.jpg")
    assert second is not None and os.path.basename(second) != "x.jpg"
    sha = hashlib.sha256(b"second").hexdigest()
    [(filed, _)] = a.results.write([ResultEntry("x.jpg", sha, lambda n: {"sha256": sha})])
    a.unlock_instance()

    taken = take_over_dead(instance(tmp_path, "b")).taken[0]

    assert (taken.returned, taken.finished) == (["x.jpg"], 1)
    assert (inbox / "x.jpg").read_bytes() == b"first"
    assert [p.read_bytes() for p in (tmp_path / "done").glob("x*.jpg")] == [b"second"]
    assert a.results.find("x.jpg", sha) == filed


def test_own_recovery_finishes_a_durable_file_too(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    a = instance(tmp_path, "a")
    (inbox / "scan.jpg").write_bytes(b"old")
    a.claim(inbox, "scan.jpg")
    sha = hashlib.sha256(b"old").hexdigest()
    a.results.write([ResultEntry("scan.jpg", sha, lambda n: {"sha256": sha})])
    (inbox / "scan.jpg").write_bytes(b"new")  # the name is taken again
    assert a.recover() == (0, 0)  # neither returned nor failed: finished
    assert [p.read_bytes() for p in inbox.glob("scan*.jpg")] == [b"new"]
    assert (tmp_path / "done" / "scan.jpg").read_bytes() == b"old"


def test_a_stale_count_under_a_reused_name_does_not_fail_a_healthy_file(tmp_path: Path) -> None:
    """a crashed once with IMG_0001.jpg in flight, restarted and processed it: its ledger still
    says 1 for that name. Days later another camera's IMG_0001.jpg (other bytes) is in flight
    at one crash of b: it was in flight at one crash, not two, and must go back, not fail."""
    inbox = tmp_path / "inbox"
    a, b = instance(tmp_path, "a"), instance(tmp_path, "b")
    (inbox / "IMG_0001.jpg").write_bytes(b"first camera")
    a.claim(inbox, "IMG_0001.jpg")
    a.crash_ledger.record("stage crashed: a CUDA error")
    a.recover()
    claimed = a.claim(inbox, "IMG_0001.jpg")
    assert claimed is not None
    os.unlink(claimed)  # processed fine (after_success: delete)

    (inbox / "IMG_0001.jpg").write_bytes(b"second camera")
    assert b.claim(inbox, "IMG_0001.jpg") is not None
    b.crash_ledger.record("stage crashed: a CUDA error")
    assert b.recover() == (1, 0)
    assert (inbox / "IMG_0001.jpg").read_bytes() == b"second camera"


def test_names_that_look_like_variants_of_dot_dot_do_not_break_the_sweep(
        tmp_path: Path) -> None:
    """``...t1`` reads as a time-token variant of ``..``: looking its result up under that
    name must not raise (output_path refuses ``..``) and stop the sweep, or start-up."""
    inbox = tmp_path / "inbox"
    a = instance(tmp_path, "a")
    for name in ("...t1", "..t1.", "sub/...t2"):
        (inbox / ".processing" / "a" / name).parent.mkdir(parents=True, exist_ok=True)
        (inbox / ".processing" / "a" / name).write_bytes(name.encode())
    a.unlock_instance()
    taken = take_over_dead(instance(tmp_path, "b")).taken[0]
    assert sorted(taken.returned) == ["...t1", "..t1.", "sub/...t2"]
    assert a.recover() == (0, 0)


def test_two_takers_and_the_dead_ones_restart_at_once_lose_and_double_nothing(
        tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    files = {f"d{i % 7}/f{i}.jpg": f"bytes {i}".encode() for i in range(150)}
    dead(tmp_path, "a", files)
    b, c = instance(tmp_path, "b"), instance(tmp_path, "c")
    config = load_config(write_config(tmp_path)).model_copy(update={"instance": "a"})
    restarted = Lifecycle(config)

    def restart() -> None:
        restarted.lock_instance()
        restarted.recover()

    errors: list[BaseException] = []

    def guarded(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)
        return run

    threads = [threading.Thread(target=guarded(fn)) for fn in
               (lambda: take_over_dead(b), lambda: take_over_dead(c), restart)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    found = sorted(p.read_bytes() for p in inbox.rglob("*.jpg") if ".processing" not in p.parts)
    assert found == sorted(files.values())
    assert list((inbox / ".processing").rglob("*.jpg")) == []


def test_a_planted_ledger_that_is_a_fifo_or_a_link_is_not_read(tmp_path: Path) -> None:
    """Every instance reads every ``*.crashes.json`` beside it now: a FIFO there would block
    start-up (and every crash record) for ever, a link to /dev/zero would read without end,
    and a link to a file outside would be read as ours."""
    inbox = tmp_path / "inbox"
    b = instance(tmp_path, "b")
    processing = inbox / ".processing"
    os.mkfifo(processing / "fifo.crashes.json")
    (processing / "zero.crashes.json").symlink_to("/dev/zero")
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"x.jpg": [5, "planted"]}))
    (processing / "link.crashes.json").symlink_to(outside)
    (inbox / "x.jpg").write_bytes(b"x")
    assert b.claim(inbox, "x.jpg") is not None
    done: list[tuple[int, int]] = []
    thread = threading.Thread(target=lambda: done.append(b.recover()), daemon=True)
    thread.start()
    thread.join(timeout=5)
    if not done:  # unblock the reader so the thread can end
        os.close(os.open(processing / "fifo.crashes.json", os.O_WRONLY | os.O_NONBLOCK))
    assert done == [(1, 0)], "recover blocked on a planted ledger, or read a linked one"


def test_a_crasher_given_back_under_a_variant_name_keeps_its_count(tmp_path: Path) -> None:
    """A new killer.jpg took the name while the crasher was claimed: recovery gives the
    crasher back as killer.t<hex>.jpg. Crashing again under that name is its second crash."""
    inbox = tmp_path / "inbox"
    a = instance(tmp_path, "a")
    (inbox / "killer.jpg").write_bytes(b"boom")
    a.claim(inbox, "killer.jpg")
    a.crash_ledger.record("stage crashed")
    (inbox / "killer.jpg").write_bytes(b"a healthy newcomer")
    assert a.recover() == (1, 0)
    [variant] = [p.name for p in inbox.glob("killer.*.jpg")]
    assert a.claim(inbox, variant) is not None
    a.crash_ledger.record("stage crashed")
    assert a.recover() == (0, 1)
    assert (inbox / "killer.jpg").read_bytes() == b"a healthy newcomer"
    [failed] = list((tmp_path / "failed").glob("killer*.jpg"))
    assert failed.read_bytes() == b"boom"


def test_a_deeply_nested_claim_is_taken_over_with_few_descriptors(tmp_path: Path) -> None:
    """A recursive inbox can be as deep as PATH_MAX allows (~2000 levels), and a claim of
    such a file holds one descriptor at a time. Taking it over must too: a walk that holds
    one per level runs out of descriptors (the soft limit is often 1024), fails that
    instance's takeover at every sweep, and starves every other thread of descriptors."""
    inbox = tmp_path / "inbox"
    deep = "/".join(["d"] * 300) + "/deep.jpg"
    dead(tmp_path, "a", {deep: b"deep"})
    b = instance(tmp_path, "b")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64, hard))
    try:
        sweep = take_over_dead(b)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert [t.returned for t in sweep.taken] == [[deep]], sweep.refused
    assert (inbox / deep).read_bytes() == b"deep"
    assert not (inbox / ".processing" / "a").exists()


def test_recovery_does_not_give_a_file_back_through_a_planted_link(tmp_path: Path) -> None:
    """The dead instance's own restart (and every release) takes the same care."""
    inbox, outside = tmp_path / "inbox", tmp_path / "outside"
    outside.mkdir()
    a = dead(tmp_path, "a", {"sub/x.jpg": b"x"})
    (inbox / "sub").rmdir()
    (inbox / "sub").symlink_to(outside)
    a.lock_instance()
    a.recover()
    assert list(outside.iterdir()) == []
    assert (inbox / ".processing" / "a" / "sub" / "x.jpg").read_bytes() == b"x"
