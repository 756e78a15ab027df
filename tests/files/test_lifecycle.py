"""Claims, results, failures and moves on a real filesystem: no input replaces another, every
name stays findable, nothing is taken through a linked folder."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from inboxd.config import load_config
from inboxd.files import results as results_module
from inboxd.files.durable import move, tmp_dir_in
from inboxd.files.layout import processing_dir
from inboxd.files.lifecycle import Lifecycle
from inboxd.files.results import ResultEntry
from inboxd.files.safe_paths import LinkedFolder

from tests.conftest import write_config


def lifecycle_for(tmp_path: Path, **overrides: object) -> Lifecycle:
    lifecycle = Lifecycle(load_config(write_config(tmp_path, **overrides)))
    lifecycle.prepare()
    return lifecycle


def entry(key: str, data: bytes) -> ResultEntry:
    sha = hashlib.sha256(data).hexdigest()
    return ResultEntry(key, sha, lambda name: {"source": key, "filed_as": name, "sha256": sha})


def test_a_second_file_of_a_name_in_flight_is_claimed_beside_it(tmp_path: Path) -> None:
    lifecycle = lifecycle_for(tmp_path)
    inbox = tmp_path / "inbox"
    (inbox / "scan.jpg").write_bytes(b"first")
    first = lifecycle.claim(inbox, "scan.jpg")
    (inbox / "scan.jpg").write_bytes(b"second")
    second = lifecycle.claim(inbox, "scan.jpg")
    assert first is not None and second is not None and first != second
    assert isinstance(first, str)  # per-file paths are strs: pathlib interns every name
    assert Path(first).read_bytes() == b"first" and Path(second).read_bytes() == b"second"
    assert Path(first).parent == Path(second).parent == processing_dir(lifecycle.config, inbox)


def test_nothing_is_claimed_through_a_linked_folder(tmp_path: Path) -> None:
    lifecycle = lifecycle_for(tmp_path)
    elsewhere = tmp_path / "alice"
    elsewhere.mkdir()
    (elsewhere / "x.jpg").write_bytes(b"alice's")
    (tmp_path / "inbox" / "photos").symlink_to(elsewhere)
    with pytest.raises(LinkedFolder):
        lifecycle.claim(tmp_path / "inbox", "photos/x.jpg")
    assert (elsewhere / "x.jpg").read_bytes() == b"alice's"


def test_two_different_files_of_one_name_get_two_results(tmp_path: Path) -> None:
    lifecycle = lifecycle_for(tmp_path)
    (first_name, first_known), = lifecycle.results.write([entry("photo.jpg", b"one")])
    (second_name, second_known), = lifecycle.results.write([entry("photo.jpg", b"two")])
    sha_two = hashlib.sha256(b"two").hexdigest()
    assert (first_name, first_known) == ("photo.jpg", False)
    assert (second_name, second_known) == (f"photo.{sha_two[:12]}.jpg", False)
    results = tmp_path / "results"
    assert json.loads((results / "photo.jpg.json").read_text())["sha256"] == hashlib.sha256(
        b"one").hexdigest()
    assert json.loads((results / f"{second_name}.json").read_text())["sha256"] == sha_two
    # The same bytes again: found where they were filed, nothing new written.
    assert lifecycle.results.write([entry("photo.jpg", b"two")]) == [(second_name, True)]
    assert lifecycle.results.find("photo.jpg", sha_two) == second_name


def test_a_done_file_follows_its_result_name(tmp_path: Path) -> None:
    lifecycle = lifecycle_for(tmp_path)
    inbox, done = tmp_path / "inbox", tmp_path / "done"
    for data in (b"one", b"two"):
        (inbox / "photo.jpg").write_bytes(data)
        claimed = lifecycle.claim(inbox, "photo.jpg")
        assert claimed is not None
        (name, _), = lifecycle.results.write([entry("photo.jpg", data)])
        lifecycle.finish_success(claimed, name, inbox / "photo.jpg",
                                 hashlib.sha256(data).hexdigest())
        assert (done / name).read_bytes() == data
        result = json.loads((tmp_path / "results" / f"{name}.json").read_text())
        assert result["sha256"] == hashlib.sha256(data).hexdigest()


def test_failures_of_one_name_never_overwrite_each_other(tmp_path: Path) -> None:
    lifecycle = lifecycle_for(tmp_path)
    inbox, failed = tmp_path / "inbox", tmp_path / "failed"
    names = []
    for n in range(3):
        (inbox / "bad.jpg").write_bytes(f"broken {n}".encode())
        claimed = lifecycle.claim(inbox, "bad.jpg")
        names.append(lifecycle.finish_failure(claimed, "bad.jpg", {"reason": f"broken {n}",
                                                                   "sha256": None}))
    assert len(set(names)) == 3 and names[0] == "bad.jpg"
    for n, name in enumerate(names):
        assert (failed / name).read_bytes() == f"broken {n}".encode()
        assert json.loads((failed / f"{name}.error.json").read_text())["reason"] == f"broken {n}"


def test_a_release_never_replaces_a_new_file_of_the_same_name(tmp_path: Path) -> None:
    lifecycle = lifecycle_for(tmp_path)
    inbox = tmp_path / "inbox"
    (inbox / "a.jpg").write_bytes(b"old")
    claimed = lifecycle.claim(inbox, "a.jpg")
    assert claimed is not None
    (inbox / "a.jpg").write_bytes(b"new")
    back = lifecycle.release(claimed, inbox / "a.jpg")
    assert back is not None and Path(back) != inbox / "a.jpg"
    assert Path(back).parent == inbox
    assert {Path(back).read_bytes(), (inbox / "a.jpg").read_bytes()} == {b"old", b"new"}


def test_a_file_in_flight_at_two_crashes_goes_to_failed(tmp_path: Path) -> None:
    lifecycle = lifecycle_for(tmp_path)
    inbox = tmp_path / "inbox"
    (inbox / "killer.jpg").write_bytes(b"boom")
    for crash in (1, 2):
        claimed = lifecycle.claim(inbox, "killer.jpg")
        assert claimed is not None
        lifecycle.crash_ledger.record("stage preprocess-0 crashed: RuntimeError('boom')")
        returned, failed = lifecycle.recover()
        assert (returned, failed) == ((1, 0) if crash == 1 else (0, 1))
    report = json.loads((tmp_path / "failed" / "killer.jpg.error.json").read_text())
    assert "crashed 2 times" in report["reason"] and "RuntimeError" in report["reason"]
    assert (tmp_path / "failed" / "killer.jpg").read_bytes() == b"boom"


def test_a_kill_is_not_a_crash_of_the_file(tmp_path: Path) -> None:
    """SIGKILL leaves no ledger: however often a file is in flight at kills, it is retried."""
    lifecycle = lifecycle_for(tmp_path)
    inbox = tmp_path / "inbox"
    (inbox / "a.jpg").write_bytes(b"fine")
    for _ in range(3):
        assert lifecycle.claim(inbox, "a.jpg") is not None
        assert lifecycle.recover() == (1, 0)
    assert (inbox / "a.jpg").read_bytes() == b"fine"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a second filesystem needs root")
def test_a_link_moved_across_filesystems_stays_a_link(tmp_path: Path) -> None:
    """Found by the model-based test: failed/ on another filesystem made the move copy the
    *target* of a refused link — a private file from outside the inbox, filed in failed/."""
    other = tmp_path / "other"
    other.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(other)], check=True)
    try:
        secret = tmp_path / "secret.txt"
        secret.write_bytes(b"private")
        (tmp_path / "link.png").symlink_to(secret)
        where = Path(move(tmp_path / "link.png", other, "link.png", "x",
                              tmp_dir_in(other, "default")))
        assert where.is_symlink() and os.readlink(where) == str(secret)
        assert not (tmp_path / "link.png").exists()
    finally:
        subprocess.run(["umount", "-l", str(other)], check=False)


def test_a_crasher_that_failed_cannot_take_goes_back_instead_of_stopping_start_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lifecycle = lifecycle_for(tmp_path)
    inbox = tmp_path / "inbox"
    (inbox / "killer.jpg").write_bytes(b"boom")
    for _ in range(2):
        assert lifecycle.claim(inbox, "killer.jpg") is not None
        lifecycle.crash_ledger.record("stage crashed")
        if _ == 0:
            lifecycle.recover()

    def read_only(*args: object) -> str:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(lifecycle, "finish_failure", read_only)
    assert lifecycle.recover() == (1, 0)
    assert (inbox / "killer.jpg").read_bytes() == b"boom"


def embedding(key: str, data: bytes, vector: list[float]) -> ResultEntry:
    sha = hashlib.sha256(data).hexdigest()
    return ResultEntry(key, sha, lambda name: {"sha256": sha, "vector": f"{name}.npy"},
                       np.array(vector, dtype=np.float32))


def assert_filed_with_its_vector(results: Path, name: str, data: bytes,
                                 vector: list[float]) -> None:
    document = json.loads((results / f"{name}.json").read_text())
    assert document["sha256"] == hashlib.sha256(data).hexdigest()
    assert document["vector"] == f"{name}.npy"
    np.testing.assert_array_equal(np.load(results / f"{name}.npy", allow_pickle=False),
                                  np.array(vector, dtype=np.float32))


def test_two_files_of_one_name_in_one_batch_keep_their_own_vectors(tmp_path: Path) -> None:
    # photo.jpg dropped again while the first copy is claimed: one batch, one key, two files.
    lifecycle = lifecycle_for(tmp_path)
    filed = lifecycle.results.write([embedding("photo.jpg", b"one", [1.0, 2.0]),
                                     embedding("photo.jpg", b"two", [3.0, 4.0])])
    names = [name for name, _ in filed]
    assert names[0] == "photo.jpg" and names[1] != names[0]
    assert [known for _, known in filed] == [False, False]
    results = tmp_path / "results"
    assert_filed_with_its_vector(results, names[0], b"one", [1.0, 2.0])
    assert_filed_with_its_vector(results, names[1], b"two", [3.0, 4.0])


def test_a_killed_attempts_vector_pushes_the_result_to_a_variant(tmp_path: Path) -> None:
    lifecycle = lifecycle_for(tmp_path)
    results = tmp_path / "results"
    stray = results / "photo.jpg.npy"  # vector placed, then killed before its JSON
    np.save(stray, np.array([9.0, 9.0], dtype=np.float32), allow_pickle=False)
    before = stray.read_bytes()
    (name, known), = lifecycle.results.write([embedding("photo.jpg", b"one", [1.0, 2.0])])
    assert name != "photo.jpg" and not known
    assert_filed_with_its_vector(results, name, b"one", [1.0, 2.0])
    assert stray.read_bytes() == before and not (results / "photo.jpg.json").exists()


def test_the_same_file_twice_in_one_batch_shares_one_result(tmp_path: Path) -> None:
    lifecycle = lifecycle_for(tmp_path)
    filed = lifecycle.results.write([embedding("photo.jpg", b"one", [1.0, 2.0]),
                                     embedding("photo.jpg", b"one", [1.0, 2.0])])
    assert filed == [("photo.jpg", False), ("photo.jpg", False)]
    assert sorted(p.name for p in (tmp_path / "results").glob("photo*")) == ["photo.jpg.json",
                                                                             "photo.jpg.npy"]


def test_a_result_found_already_there_is_made_durable_before_it_is_reported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by its sha256, a result may be another commit's that renamed it in and has not
    fsynced its folder yet; the caller moves the source on this answer, so fsync it first."""
    lifecycle = lifecycle_for(tmp_path)
    lifecycle.results.write([entry("sub/photo.jpg", b"one")])
    synced: list[str] = []
    monkeypatch.setattr(results_module, "fsync_dir",
                        lambda folder: synced.append(os.fspath(folder)))
    assert lifecycle.results.write([entry("sub/photo.jpg", b"one")]) == [("sub/photo.jpg", True)]
    assert synced == [str(tmp_path / "results" / "sub")]


def test_keep_files_each_vector_with_its_own_json(tmp_path: Path) -> None:
    lifecycle = lifecycle_for(tmp_path, inbox={"after_success": "keep"})
    results = tmp_path / "results"
    # Rerun of the same bytes: the plain name's result stays theirs, vector and all.
    for _ in range(2):
        (name, _known), = lifecycle.results.write([embedding("photo.jpg", b"one", [1.0, 2.0])])
        assert name == "photo.jpg"
        assert_filed_with_its_vector(results, name, b"one", [1.0, 2.0])
    # New bytes under the name: the old result moves aside, the new one has the plain name.
    (name, _known), = lifecycle.results.write([embedding("photo.jpg", b"two", [3.0, 4.0])])
    assert name == "photo.jpg"
    assert_filed_with_its_vector(results, name, b"two", [3.0, 4.0])
    old = f"photo.jpg.{hashlib.sha256(b'one').hexdigest()[:12]}"
    assert json.loads((results / f"{old}.json").read_text())["sha256"] == hashlib.sha256(
        b"one").hexdigest()
    np.testing.assert_array_equal(np.load(results / f"{old}.npy"), [1.0, 2.0])
    # Two files of one name in one batch: each beside its own vector.
    filed = lifecycle.results.write([embedding("scan.jpg", b"a", [5.0, 6.0]),
                                     embedding("scan.jpg", b"b", [7.0, 8.0])])
    assert filed[0][0] == "scan.jpg" and filed[1][0] != "scan.jpg"
    assert_filed_with_its_vector(results, filed[0][0], b"a", [5.0, 6.0])
    assert_filed_with_its_vector(results, filed[1][0], b"b", [7.0, 8.0])


def test_another_instance_filing_the_name_meanwhile_keeps_its_vector(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two instances share results/: the other files photo.jpg after this one chose the name
    # and before its vector is in place.
    import inboxd.files.results as results_module
    ours, other = lifecycle_for(tmp_path), lifecycle_for(tmp_path)
    real_write_tmp = results_module.write_tmp
    raced: list[list[tuple[str, bool]]] = []

    def write_tmp_after_the_other(*args: object, **kwargs: object) -> str:
        if not raced:
            monkeypatch.setattr(results_module, "write_tmp", real_write_tmp)
            raced.append(other.results.write([embedding("photo.jpg", b"two", [3.0, 4.0])]))
        return real_write_tmp(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(results_module, "write_tmp", write_tmp_after_the_other)
    (name, _), = ours.results.write([embedding("photo.jpg", b"one", [1.0, 2.0])])
    assert raced == [[("photo.jpg", False)]] and name != "photo.jpg"
    results = tmp_path / "results"
    assert_filed_with_its_vector(results, "photo.jpg", b"two", [3.0, 4.0])
    assert_filed_with_its_vector(results, name, b"one", [1.0, 2.0])


def test_a_claimed_name_whose_guessed_original_is_unsafe_is_looked_up_as_nothing_filed(
        tmp_path: Path) -> None:
    """``..t1`` looks like a time variant of ``.``, a name no result can have: the start-up's
    look for its result must answer "none" (it is given back), not raise and stop the start."""
    lifecycle = lifecycle_for(tmp_path)
    inbox = tmp_path / "inbox"
    (inbox / "..t1").write_bytes(b"data")
    claimed = lifecycle.claim(inbox, "..t1")
    sha = hashlib.sha256(b"data").hexdigest()
    assert lifecycle.results.recorded_sha256(".") is None
    assert lifecycle.finish_if_done(Path(claimed), inbox, "..t1", sha) is False
    assert os.path.exists(claimed)


def test_a_full_disk_part_way_takes_back_the_vectors_it_placed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch is sent again once there is room: its vectors must not be left behind, or
    every retried result would land on a variant name (``photo.<sha>.jpg``)."""
    lifecycle = lifecycle_for(tmp_path)
    real = results_module.write_tmps
    calls = {"n": 0}

    def full_once(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(results_module, "write_tmps", full_once)
    batch = [embedding("photo.jpg", b"one", [1.0, 2.0])]
    with pytest.raises(OSError):
        lifecycle.results.write(batch)
    assert not list((tmp_path / "results").glob("*.npy")), "the placed vector was taken back"
    [(name, known)] = lifecycle.results.write(batch)
    assert (name, known) == ("photo.jpg", False)
    assert_filed_with_its_vector(tmp_path / "results", "photo.jpg", b"one", [1.0, 2.0])


def test_a_name_the_results_filesystem_refuses_is_filed_under_its_portable_form(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake at the filesystem boundary (exFAT's refusal of ``?``); test_exfat_outputs.py
    has the real one."""
    from inboxd.files import portable_names
    lifecycle = lifecycle_for(tmp_path)
    real_open = os.open

    def exfat_open(path: object, *args: object, **kwargs: object) -> int:
        if "?" in os.fsdecode(path):  # type: ignore[arg-type]
            raise FileNotFoundError(2, "No such file or directory")
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(portable_names.os, "open", exfat_open)
    [(name, known)] = lifecycle.results.write([entry("what?.jpg", b"q")])
    assert (name, known) == ("what%3F.jpg", False)
    filed = json.loads((tmp_path / "results" / "what%3F.jpg.json").read_text())
    assert (filed["source"], filed["filed_as"]) == ("what?.jpg", "what%3F.jpg")
    assert lifecycle.results.find("what?.jpg", filed["sha256"]) == "what%3F.jpg"
