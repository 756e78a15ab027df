"""Each way an input used to be lost, doubled, stalled or turned into a crash loop, replayed
through the real pipeline (real filesystem, fake model): every input ends with exactly one
outcome of its own."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from inboxd.config import INDEX_FILENAME

from support.harness import file_sha256 as sha
from tests.conftest import make_image, read_json
from tests.fakes import commit_in_this_process, pipeline_for

FAST_RETRY = {"max_attempts": 4, "backoff_initial_ms": 5, "backoff_max_ms": 20}


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chattr +i needs root")


def files_in(folder: Path) -> dict[str, Path]:
    """The files in an outcome folder: its temp folder and the search index (not a result:
    ``files.index``) left out."""
    return {p.relative_to(folder).as_posix(): p for p in folder.rglob("*")
            if p.is_file() and ".tmp" not in p.parts and not p.name.startswith(INDEX_FILENAME)}


def failing_first(monkeypatch: pytest.MonkeyPatch, owner: Any, method: str, times: int,
                  err: int) -> dict[str, int]:
    """``owner.method`` raises ``OSError(err)`` on its first ``times`` calls (a disk that is
    full or read-only for a while: a fake at the filesystem boundary). Returns the call count."""
    real = getattr(owner, method)
    calls = {"n": 0}

    def flaky(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] <= times:
            raise OSError(err, os.strerror(err))
        return real(*args)

    monkeypatch.setattr(owner, method, flaky)
    return calls


@pytest.mark.timeout(60)
def test_a_file_with_a_future_mtime_settles_by_observation(tmp_path: Path) -> None:
    """It used to wait for ever (``once`` never returned): settled meant "mtime is old"."""
    pipeline = pipeline_for(tmp_path, inbox={"settle_ms": 200})
    photo = make_image(tmp_path / "inbox" / "camera.png")
    year_ahead = time.time() + 365 * 86400
    os.utime(photo, (year_ahead, year_ahead))
    asyncio.run(pipeline.process_backlog())
    assert (tmp_path / "results" / "camera.png.json").exists()
    assert pipeline.stats.counters.completed == 1


def test_a_stage_crash_twice_on_one_file_fails_that_file(tmp_path: Path) -> None:
    """A file that crashes a stage used to crash-loop the service: start-up put it back."""
    make_image(tmp_path / "inbox" / "killer.png")
    for run in range(3):
        pipeline = pipeline_for(tmp_path, inbox={"settle_ms": 0})
        if run < 2:
            async def crash(batch: Any) -> None:
                raise RuntimeError("a bug that this file triggers")
            pipeline.result_writer._write = crash  # type: ignore[method-assign]
        asyncio.run(pipeline.process_backlog())
        assert (pipeline.crashed is not None) == (run < 2)
    report = json.loads((tmp_path / "failed" / "killer.png.error.json").read_text())
    assert "crashed 2 times" in report["reason"]
    assert not files_in(tmp_path / "results")
    assert not files_in(tmp_path / "inbox" / ".processing" / "default")


def test_an_unwritable_failed_folder_is_waited_out_without_a_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """failed/ read-only used to release → rescan → fail again, 24 ERROR lines a second."""
    pipeline = pipeline_for(tmp_path, inbox={"settle_ms": 0}, retry=FAST_RETRY)
    (tmp_path / "inbox" / "bad.png").write_bytes(b"not an image")
    calls = failing_first(monkeypatch, pipeline.lifecycle, "finish_failure", 2, errno.EROFS)
    asyncio.run(pipeline.process_backlog())
    assert calls["n"] == 3, "each attempt waits its backoff; the decode is not redone"
    assert sorted(files_in(tmp_path / "failed")) == ["bad.png", "bad.png.error.json"]
    assert pipeline.stats.counters.failed == 1


def test_a_results_folder_that_cannot_be_fsynced_never_fails_a_redropped_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A re-drop of filed bytes is finished once its result's folder is fsynced; an fsync that
    keeps failing (EIO) is waited out like a move that does: the file never goes to failed/
    while its bytes' result stays in results/."""
    expected = sha(make_image(tmp_path / "inbox" / "a.png"))
    asyncio.run(pipeline_for(tmp_path, inbox={"settle_ms": 0}).process_backlog())
    make_image(tmp_path / "inbox" / "a.png")  # the same bytes again
    again = pipeline_for(tmp_path, inbox={"settle_ms": 0}, retry=FAST_RETRY)
    failing = 3 * FAST_RETRY["max_attempts"]  # past every retry: given back to disk, twice
    calls = failing_first(monkeypatch, again.lifecycle.results, "make_durable", failing,
                          errno.EIO)
    with caplog.at_level(logging.INFO, logger="inboxd"):
        asyncio.run(again.process_backlog())
    assert calls["n"] == failing + 1
    retries = [r.getMessage() for r in caplog.records
               if getattr(r, "inboxd_event", "") == "retry"]
    assert retries and all(f"cannot fsync {tmp_path / 'results'}, the folder of a.png's "
                           "result" in message for message in retries), retries
    assert files_in(tmp_path / "failed") == {}
    counters = again.stats.counters
    assert (counters.failed, counters.completed, counters.duplicates) == (0, 1, 1)
    assert counters.released >= 2
    assert sorted(files_in(tmp_path / "results")) == ["a.png.json"]
    token = read_json(tmp_path / "results" / "a.png.json")["sha256"][:12]
    assert sha(tmp_path / "done" / f"a.{token}.png") == expected


def test_a_full_done_folder_never_turns_a_success_into_a_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """done/ full used to end an input with a result *and* a failed/ entry."""
    pipeline = pipeline_for(tmp_path, inbox={"settle_ms": 0}, retry=FAST_RETRY)
    photo = make_image(tmp_path / "inbox" / "a.png")
    expected = sha(photo)
    commit_in_this_process(pipeline)
    failing_first(monkeypatch, pipeline.lifecycle, "finish_success", 3, errno.ENOSPC)
    asyncio.run(pipeline.process_backlog())
    assert files_in(tmp_path / "failed") == {}
    assert sha(tmp_path / "done" / "a.png") == expected
    assert json.loads((tmp_path / "results" / "a.png.json").read_text())["sha256"] == expected
    assert pipeline.stats.counters.completed == 1 and pipeline.stats.counters.failed == 0


@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_kept_file_replaced_by_another_with_an_older_mtime_is_processed_again(
        tmp_path: Path) -> None:
    """keep used to compare mtimes: an older photo moved over a kept one was never seen."""
    make_image(tmp_path / "inbox" / "a.png", color=(10, 20, 30))
    asyncio.run(pipeline_for(tmp_path, inbox={"settle_ms": 0, "after_success": "keep"})
                .process_backlog())
    other = make_image(tmp_path / "elsewhere" / "a.png", color=(90, 80, 70))
    os.utime(other, (1_000_000, 1_000_000))  # 1970: older than any result
    os.replace(other, tmp_path / "inbox" / "a.png")
    pipeline = pipeline_for(tmp_path, inbox={"settle_ms": 0, "after_success": "keep"})
    asyncio.run(pipeline.process_backlog())
    assert pipeline.stats.counters.completed == 1
    current = json.loads((tmp_path / "results" / "a.png.json").read_text())
    assert current["sha256"] == sha(tmp_path / "inbox" / "a.png")
    # The first photo's result was moved aside, not overwritten.
    assert len(list((tmp_path / "results").glob("a.png*.json"))) == 2
    # And a third pass finds both unchanged: nothing is redone.
    again = pipeline_for(tmp_path, inbox={"settle_ms": 0, "after_success": "keep"})
    asyncio.run(again.process_backlog())
    assert again.stats.counters.completed == 0


def deep_tree(root: Path, min_path_bytes: int, payload: bytes) -> Path:
    """A folder whose path is longer than PATH_MAX: made one level at a time, relative to the
    level above, as an unzip or a sync tool can."""
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    length = len(os.fsencode(root))
    part = "d" * 200
    try:
        while length < min_path_bytes:
            os.mkdir(part, dir_fd=fd)
            child = os.open(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
            length += len(part) + 1
        with open(os.open("deep.png", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as out:
            out.write(payload)
    finally:
        os.close(fd)
    return root


@needs_root
def test_claim_problems_are_the_files_own_and_never_stop_the_pipeline(tmp_path: Path) -> None:
    """Each of these was a stage crash (exit 70), and after a restart the same crash again:
    a name a folder once had in .processing/ (IsADirectoryError), a file the service may not
    rename (EPERM), a tree deeper than PATH_MAX (ENAMETOOLONG)."""
    pipeline = pipeline_for(tmp_path, inbox={"settle_ms": 0})
    inbox = tmp_path / "inbox"
    (inbox / ".processing" / "default" / "was-a-folder.png").mkdir(parents=True)
    make_image(inbox / "was-a-folder.png")
    immutable = make_image(inbox / "immutable.png")
    subprocess.run(["chattr", "+i", str(immutable)], check=True)  # rename → EPERM, even as root
    deep_tree(inbox / "deep", 4200, make_image(tmp_path / "src.png").read_bytes())
    make_image(inbox / "ordinary.png")
    try:
        asyncio.run(pipeline.process_backlog())
    finally:
        subprocess.run(["chattr", "-i", str(immutable)], check=True)
    assert pipeline.crashed is None
    assert (tmp_path / "results" / "was-a-folder.png.json").exists()
    assert (tmp_path / "results" / "ordinary.png.json").exists()
    assert immutable.exists(), "a file that cannot be claimed stays where it is"
