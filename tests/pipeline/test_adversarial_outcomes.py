"""Each way an input used to be lost, doubled, stalled or turned into a crash loop, replayed
through the real pipeline (real filesystem, fake model): every input ends with exactly one
outcome of its own."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from inboxd.config import load_config
from inboxd.pipeline.wiring import Pipeline

from tests.conftest import make_image, write_config
from tests.fakes import FakeModel

FAST_RETRY = {"max_attempts": 4, "backoff_initial_ms": 5, "backoff_max_ms": 20}


def pipeline_for(root: Path, **sections: Any) -> Pipeline:
    return Pipeline(load_config(write_config(root, **sections)), FakeModel())  # type: ignore[arg-type]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def files_in(folder: Path) -> dict[str, Path]:
    return {p.relative_to(folder).as_posix(): p for p in folder.rglob("*")
            if p.is_file() and ".tmp" not in p.parts}


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
            pipeline.writer._write = crash  # type: ignore[method-assign]
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
    real = pipeline.lifecycle.finish_failure
    calls = {"n": 0}

    def read_only_twice(*args: Any) -> str:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args)

    monkeypatch.setattr(pipeline.lifecycle, "finish_failure", read_only_twice)
    asyncio.run(pipeline.process_backlog())
    assert calls["n"] == 3, "each attempt waits its backoff; the decode is not redone"
    assert sorted(files_in(tmp_path / "failed")) == ["bad.png", "bad.png.error.json"]
    assert pipeline.stats.counters.failed == 1


def test_a_full_done_folder_never_turns_a_success_into_a_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """done/ full used to end an input with a result *and* a failed/ entry."""
    pipeline = pipeline_for(tmp_path, inbox={"settle_ms": 0}, retry=FAST_RETRY)
    photo = make_image(tmp_path / "inbox" / "a.png")
    expected = sha(photo)
    real = pipeline.lifecycle.finish_success
    calls = {"n": 0}

    def full_three_times(*args: Any) -> None:
        calls["n"] += 1
        if calls["n"] <= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(*args)

    monkeypatch.setattr(pipeline.lifecycle, "finish_success", full_three_times)
    asyncio.run(pipeline.process_backlog())
    assert files_in(tmp_path / "failed") == {}
    assert sha(tmp_path / "done" / "a.png") == expected
    assert json.loads((tmp_path / "results" / "a.png.json").read_text())["sha256"] == expected
    assert pipeline.stats.counters.completed == 1 and pipeline.stats.counters.failed == 0


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
