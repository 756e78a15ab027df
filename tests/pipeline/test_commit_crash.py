"""A commit process that dies: the daemon stops as at any stage crash, its next run gives every
file exactly one outcome, and none of them is held to blame."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from inboxd.config import load_config
from inboxd.files.commit_process import CommitProcess, CommitProcessFailed
from inboxd.pipeline.wiring import Pipeline
from inboxd.testing import COMMIT_PAUSE_MS

from tests.conftest import make_image, write_config
from tests.fakes import FakeModel
from tests.index_check import assert_index_matches_results


@pytest.mark.timeout(120)
def test_a_commit_process_killed_mid_flood_stops_the_daemon_and_loses_nothing(
        tmp_path: Path) -> None:
    """The process is killed under a flood: that run stops as a stage crash, and the next one
    gives every file exactly one result, none lost and none twice."""
    names = {f"f{n:03}.png" for n in range(120)}
    for n, name in enumerate(sorted(names)):
        make_image(tmp_path / "inbox" / name, size=(8, 8), color=(n + 20, 0, 0))
    config = load_config(write_config(tmp_path, inbox={"settle_ms": 0},
                                      batch={"max_size": 4}))
    first = Pipeline(config, FakeModel())  # type: ignore[arg-type]

    async def kill_after_some_results() -> None:
        task = asyncio.create_task(first.process_backlog())
        while first.stats.counters.completed < 20 and not task.done():
            await asyncio.sleep(0.005)
        assert isinstance(first.commits, CommitProcess) and first.commits.pid is not None
        os.kill(first.commits.pid, signal.SIGKILL)
        await task

    asyncio.run(kill_after_some_results())
    assert isinstance(first.crashed, CommitProcessFailed)
    second = Pipeline(config, FakeModel())  # type: ignore[arg-type]
    asyncio.run(second.process_backlog())
    assert second.crashed is None
    results = {p.name.removesuffix(".json") for p in (tmp_path / "results").glob("*.json")}
    assert results == names
    assert {p.name for p in (tmp_path / "done").iterdir() if p.is_file()} == names
    assert not list((tmp_path / "failed").glob("*.png"))


def test_a_commit_process_killed_again_and_again_never_fails_a_file(tmp_path: Path) -> None:
    """Its death is a kill, not the doing of the files in flight: a file that was in flight at
    two such crashes in a row is not sent to failed/ (two stage crashes would send it)."""
    make_image(tmp_path / "inbox" / "good.png")
    config = load_config(write_config(tmp_path, inbox={"settle_ms": 0}))
    for _run in range(3):
        pipeline = Pipeline(config, FakeModel())  # type: ignore[arg-type]

        async def kill_it_idle(pipeline: Pipeline = pipeline) -> None:
            original = pipeline.start_processing

            def start_then_kill() -> None:
                original()
                assert isinstance(pipeline.commits, CommitProcess)
                assert pipeline.commits.pid is not None
                os.kill(pipeline.commits.pid, signal.SIGKILL)

            pipeline.start_processing = start_then_kill  # type: ignore[method-assign]
            await pipeline.process_backlog()

        asyncio.run(kill_it_idle())
        assert isinstance(pipeline.crashed, CommitProcessFailed)
    last = Pipeline(config, FakeModel())  # type: ignore[arg-type]
    asyncio.run(last.process_backlog())
    assert last.stats.counters.completed == 1 and last.stats.counters.failed == 0
    assert (tmp_path / "results" / "good.png.json").exists()
    assert not list((tmp_path / "failed").iterdir())


@pytest.mark.timeout(120)
def test_a_stop_past_the_grace_period_still_counts_what_the_commit_process_commits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches in the commit process when the grace period ends are cancelled in the daemon,
    but the process still commits them (their results durable, their sources in done/): each
    of those files is counted as completed, and every file claimed is completed or handed
    back, none unaccounted for."""
    monkeypatch.setenv(COMMIT_PAUSE_MS, "300")  # each of a commit's 4 steps: 1.2 s a batch
    names = {f"f{n:03}.png" for n in range(24)}
    for n, name in enumerate(sorted(names)):
        make_image(tmp_path / "inbox" / name, size=(8, 8), color=(n + 20, 0, 0))
    config = load_config(write_config(tmp_path, inbox={"settle_ms": 0}, shutdown={"grace_s": 0.2},
                                      batch={"max_size": 4, "max_delay_ms": 0}))
    pipeline = Pipeline(config, FakeModel())  # type: ignore[arg-type]

    async def stop_with_two_batches_in_commit() -> None:
        stop = asyncio.Event()
        backlog = asyncio.create_task(pipeline.process_backlog(stop=stop))
        while pipeline.result_writer.committing.size < 2 and not backlog.done():
            await asyncio.sleep(0.005)
        stop.set()  # what SIGTERM does; the grace period ends inside both commits
        await backlog

    asyncio.run(stop_with_two_batches_in_commit())
    results = {p.name.removesuffix(".json") for p in (tmp_path / "results").glob("*.json")}
    done = {p.name for p in (tmp_path / "done").iterdir() if p.is_file()}
    back = {p.name for p in (tmp_path / "inbox").iterdir() if p.is_file()}
    counters = pipeline.stats.counters
    assert results and results == done, "the batches in the commit process were committed"
    assert counters.completed == len(results), (counters.completed, len(results))
    assert results | back == names and not results & back
    assert counters.completed + counters.released == pipeline.intake.claimed, counters


@pytest.mark.slow  # ten seconds of kills: `make test`, not the fast tier
@pytest.mark.timeout(120)
def test_the_index_equals_the_result_files_after_kills_inside_commits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit process killed while a batch's results are placed and its rows not yet
    written (the window widened): the next run's start-up resolves what was pending, and the
    index holds exactly the result files, with their sha256s."""
    monkeypatch.setenv(COMMIT_PAUSE_MS, "150")
    names = {f"f{n:03}.png" for n in range(24)}
    for n, name in enumerate(sorted(names)):
        make_image(tmp_path / "inbox" / name, size=(8, 8), color=(n + 20, 0, 0))
    config = load_config(write_config(tmp_path, inbox={"settle_ms": 0},
                                      batch={"max_size": 4, "max_delay_ms": 0}))
    results = tmp_path / "results"
    for kill in range(3):
        pipeline = Pipeline(config, FakeModel())  # type: ignore[arg-type]
        before = len(list(results.glob("*.json")))

        async def kill_once_results_are_placed(pipeline: Pipeline = pipeline,
                                               before: int = before) -> None:
            task = asyncio.create_task(pipeline.process_backlog())
            while len(list(results.glob("*.json"))) <= before and not task.done():
                await asyncio.sleep(0.002)
            assert isinstance(pipeline.commits, CommitProcess)
            assert pipeline.commits.pid is not None
            os.kill(pipeline.commits.pid, signal.SIGKILL)
            await task

        asyncio.run(kill_once_results_are_placed())
        assert isinstance(pipeline.crashed, CommitProcessFailed), kill
    last = Pipeline(config, FakeModel())  # type: ignore[arg-type]
    asyncio.run(last.process_backlog())
    assert {p.name.removesuffix(".json") for p in results.glob("*.json")} == names
    assert assert_index_matches_results(results) == len(names)
