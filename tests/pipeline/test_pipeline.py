"""The pipeline in-process, with fakes only at the model and watcher boundaries and the real
filesystem underneath."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from inboxd.config import load_config
from inboxd.pipeline.wiring import Pipeline

from tests.conftest import make_image, read_json, write_config
from tests.fakes import POISON_RED, FakeModel, ScriptedWatch, commit_in_this_process, pipeline_for


def outcome_names(root: Path) -> tuple[set[str], set[str]]:
    results = {p.name.removesuffix(".json") for p in (root / "results").glob("*.json")}
    failed = {p.name for p in (root / "failed").glob("*") if not p.name.endswith(".error.json")
              and p.is_file()}
    return results, failed


def fail_writes(pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch,
                times: int | None = None) -> None:
    """The results disk fails writes (EIO) for the next ``times`` batches (None: for ever): a
    fault of the write, retried per file. A fake at the filesystem boundary. A *full* disk is
    no file's failure at all: tests/guarantees/test_full_disk.py fills real filesystems."""
    commit_in_this_process(pipeline)
    real_write = pipeline.lifecycle.results.write
    left = {"n": times}

    def write(entries: Any, *more: Any) -> Any:
        if left["n"] is None or left["n"] > 0:
            if left["n"] is not None:
                left["n"] -= 1
            raise OSError(errno.EIO, "Input/output error")
        return real_write(entries, *more)

    monkeypatch.setattr(pipeline.lifecycle.results, "write", write)


@pytest.mark.slow
def test_flood_through_tiny_capacities_gives_each_file_one_outcome(tmp_path: Path) -> None:
    capacity = {"event_buffer": 8, "queue": 2, "preprocess_cache": 3, "retry_list": 2}
    pipeline = pipeline_for(tmp_path, capacity=capacity, batch={"max_size": 4},
                            inbox={"settle_ms": 0})
    names = {f"f{n:04}.png" for n in range(1500)}
    for n, name in enumerate(sorted(names)):
        make_image(tmp_path / "inbox" / name, size=(8, 8), color=(n % 100 + 50, 0, 0))
    asyncio.run(pipeline.process_backlog())

    results, failed = outcome_names(tmp_path)
    assert results == names and not failed
    counters = pipeline.stats.counters
    assert (counters.completed, counters.failed) == (1500, 0)
    assert counters.deferred > 0
    for layer in pipeline.stats.layers:
        assert layer.high_water <= layer.capacity, layer.name
    assert pipeline.queue.high_water == 2
    assert list((tmp_path / "inbox").rglob("*.png")) == []


def test_a_model_error_on_one_input_fails_that_input_only(tmp_path: Path) -> None:
    model = FakeModel()
    pipeline = pipeline_for(tmp_path, model=model, batch={"max_size": 8, "max_delay_ms": 200},
                            inbox={"settle_ms": 0}, preprocess={"workers": 1})
    for n in range(8):
        red = POISON_RED if n == 5 else 100 + n
        make_image(tmp_path / "inbox" / f"{n}.png", size=(8, 8), color=(red, 0, 0))
    asyncio.run(pipeline.process_backlog())
    results, failed = outcome_names(tmp_path)
    assert failed == {"5.png"}
    assert results == {f"{n}.png" for n in range(8)} - {"5.png"}
    report = read_json(tmp_path / "failed" / "5.png.error.json")
    assert "the model failed on this input" in report["reason"]
    assert report["permanent"] is True
    assert max(model.batch_sizes) > 1, "the poisoned input really came in a batch"


def test_cuda_oom_halves_the_batch_until_it_fits(tmp_path: Path) -> None:
    model = FakeModel(oom_above_batch=2)
    pipeline = pipeline_for(tmp_path, model=model, batch={"max_size": 8, "max_delay_ms": 200},
                            inbox={"settle_ms": 0})
    for n in range(8):
        make_image(tmp_path / "inbox" / f"{n}.png", size=(8, 8), color=(100 + n, 0, 0))
    asyncio.run(pipeline.process_backlog())
    results, failed = outcome_names(tmp_path)
    assert len(results) == 8 and not failed
    assert any(size > 2 for size in model.batch_sizes)
    # The calls that fit (≤ 2) covered the 8 images exactly once: halves, not repeats.
    assert sum(size for size in model.batch_sizes if size <= 2) == 8


def test_a_transient_write_error_is_retried_with_every_attempt_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = pipeline_for(tmp_path, inbox={"settle_ms": 0},
                            retry={"max_attempts": 3, "backoff_initial_ms": 5,
                                   "backoff_max_ms": 10})
    fail_writes(pipeline, monkeypatch, times=2)
    make_image(tmp_path / "inbox" / "a.png", size=(8, 8))
    asyncio.run(pipeline.process_backlog())
    assert read_json(tmp_path / "results" / "a.png.json")["attempts"] == 3
    assert pipeline.stats.counters.retried == 2


def test_exhausted_retries_go_to_failed_with_every_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = pipeline_for(tmp_path, inbox={"settle_ms": 0},
                            retry={"max_attempts": 2, "backoff_initial_ms": 5,
                                   "backoff_max_ms": 10})
    fail_writes(pipeline, monkeypatch)
    make_image(tmp_path / "inbox" / "a.png", size=(8, 8))
    asyncio.run(pipeline.process_backlog())
    report = read_json(tmp_path / "failed" / "a.png.error.json")
    assert report["permanent"] is False
    assert report["attempts"] == ["cannot write the result: Input/output error"] * 2


def test_a_full_retry_list_releases_files_to_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = pipeline_for(tmp_path, inbox={"settle_ms": 0}, capacity={"retry_list": 1},
                            retry={"backoff_initial_ms": 60_000, "backoff_max_ms": 60_000})
    fail_writes(pipeline, monkeypatch)

    async def scenario() -> None:
        pipeline.prepare()
        pipeline.start_processing()
        pipeline.start_intake(watch=False)
        for n in range(3):
            make_image(tmp_path / "inbox" / f"{n}.png", size=(8, 8))
        await pipeline.watcher.scan()
        while pipeline.stats.counters.released < 2:
            await asyncio.sleep(0.01)
        assert pipeline.retry_list.size == 1
        await pipeline.shutdown(grace_s=1, force=asyncio.Event())

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert sorted(p.name for p in (tmp_path / "inbox").glob("*.png")) == ["0.png", "1.png", "2.png"]
    assert not list((tmp_path / "results").glob("*.json"))


def test_watched_files_are_processed_and_shutdown_returns_claimed_ones(tmp_path: Path) -> None:
    watch = ScriptedWatch()
    pipeline = pipeline_for(tmp_path, watch=watch, inbox={"settle_ms": 0,
                                                          "rescan_interval_s": 3600})

    async def scenario() -> None:
        stop, force = asyncio.Event(), asyncio.Event()
        serving = asyncio.create_task(pipeline.serve(stop, force))
        await watch.started.wait()
        path = make_image(tmp_path / "inbox" / "new.png", size=(8, 8))
        watch.push(path)
        while not (tmp_path / "results" / "new.png.json").exists():
            await asyncio.sleep(0.01)
        # A file the pipeline has claimed but not finished when the stop comes goes back.
        stuck = tmp_path / "inbox" / ".processing" / "default" / "stuck.png"
        make_image(stuck, size=(8, 8))
        stop.set()
        await serving

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert (tmp_path / "done" / "new.png").exists()
    assert (tmp_path / "inbox" / "stuck.png").exists()
    assert not list((tmp_path / "inbox" / ".processing").rglob("*.png"))


def test_restart_finds_its_own_result_and_does_not_redo_it(tmp_path: Path) -> None:
    """A kill between the durable result and the source's move: the rerun only moves it."""
    pipeline = pipeline_for(tmp_path, inbox={"settle_ms": 0})
    make_image(tmp_path / "inbox" / "a.png", size=(8, 8))
    asyncio.run(pipeline.process_backlog())
    first = read_json(tmp_path / "results" / "a.png.json")
    os.rename(tmp_path / "done" / "a.png", tmp_path / "inbox" / ".processing" / "default" / "a.png")

    again = pipeline_for(tmp_path, inbox={"settle_ms": 0})
    asyncio.run(again.process_backlog())
    # Recovery finds the result by its sha256 and moves the file on: not even queued again
    # (given back instead, a new a.png there meanwhile would make it a.t<hex>.png, filed twice).
    assert again.stats.counters.enqueued == 0
    assert read_json(tmp_path / "results" / "a.png.json") == first
    assert (tmp_path / "done" / "a.png").exists()


def test_a_redropped_file_moves_only_after_its_earlier_result_is_made_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same bytes dropped again are finished without being redone; the result they match
    may be another commit's whose folder fsync is still to come, so that fsync comes first."""
    make_image(tmp_path / "inbox" / "a.png", size=(8, 8))
    asyncio.run(pipeline_for(tmp_path, inbox={"settle_ms": 0}).process_backlog())
    make_image(tmp_path / "inbox" / "a.png", size=(8, 8))
    again = pipeline_for(tmp_path, inbox={"settle_ms": 0})
    steps: list[str] = []

    def recorded(real: Any, step: str) -> Any:
        def call(*args: Any) -> Any:
            steps.append(step)
            return real(*args)
        return call

    monkeypatch.setattr(again.lifecycle.results, "make_durable",
                        recorded(again.lifecycle.results.make_durable, "result durable"))
    monkeypatch.setattr(again.lifecycle, "finish_success",
                        recorded(again.lifecycle.finish_success, "source moved"))
    asyncio.run(again.process_backlog())
    assert again.stats.counters.duplicates == 1
    assert steps == ["result durable", "source moved"]
    token = read_json(tmp_path / "results" / "a.png.json")["sha256"][:12]
    assert sorted(p.name for p in (tmp_path / "done").iterdir()) == [f"a.{token}.png", "a.png"]


def test_keep_policy_leaves_sources_and_does_not_loop(tmp_path: Path) -> None:
    pipeline = pipeline_for(tmp_path, inbox={"settle_ms": 0, "after_success": "keep"})
    make_image(tmp_path / "inbox" / "a.png", size=(8, 8))
    asyncio.run(pipeline.process_backlog())
    assert (tmp_path / "inbox" / "a.png").exists()
    assert (tmp_path / "results" / "a.png.json").exists()
    again = pipeline_for(tmp_path, inbox={"settle_ms": 0, "after_success": "keep"})
    asyncio.run(asyncio.wait_for(again.process_backlog(), 30))
    assert again.stats.counters.enqueued == 0


def test_several_inboxes_file_results_under_each_inbox_name(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    data = yaml.safe_load(config.read_text())
    data["inbox"]["paths"] = [str(tmp_path / "cams"), str(tmp_path / "scans")]
    data["inbox"]["settle_ms"] = 0
    config.write_text(yaml.safe_dump(data))
    make_image(tmp_path / "cams" / "x.png", size=(8, 8))
    make_image(tmp_path / "scans" / "x.png", size=(8, 8))
    asyncio.run(Pipeline(load_config(config), FakeModel()).process_backlog())  # type: ignore[arg-type]
    assert (tmp_path / "results" / "cams" / "x.png.json").exists()
    assert (tmp_path / "results" / "scans" / "x.png.json").exists()


def test_one_paths_surprise_in_a_claim_batch_costs_only_that_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug or an odd error on one candidate (here a RuntimeError) must not crash the intake:
    the claims already made in that batch would be stranded and counted against at a crash."""
    pipeline = pipeline_for(tmp_path, capacity={"queue": 16}, inbox={"settle_ms": 0})
    names = {f"f{n:03}.png" for n in range(40)}
    for n, name in enumerate(sorted(names)):
        make_image(tmp_path / "inbox" / name, size=(8, 8), color=(n + 50, 0, 0))
    real_claim = pipeline.intake._claim_if_ready

    def claim(candidate: Any, effects: Any) -> Any:
        if os.path.basename(candidate.path) == "f007.png":
            raise RuntimeError("a surprise")
        return real_claim(candidate, effects)

    monkeypatch.setattr(pipeline.intake, "_claim_if_ready", claim)
    asyncio.run(asyncio.wait_for(pipeline.process_backlog(), 60))
    results, failed = outcome_names(tmp_path)
    assert results == names - {"f007.png"} and not failed
    assert (tmp_path / "inbox" / "f007.png").exists()  # left where it was, said once
    assert not list((tmp_path / "inbox" / ".processing").rglob("*.png"))


def test_a_durable_result_wins_over_a_crash_count(tmp_path: Path) -> None:
    """A file in flight at two crashes whose result was already durable (the crashes came
    between the write and the move) is finished, not failed: failed/ too would be two outcomes."""
    pipeline = pipeline_for(tmp_path, inbox={"settle_ms": 0})
    make_image(tmp_path / "inbox" / "a.png", size=(8, 8))
    asyncio.run(pipeline.process_backlog())
    os.rename(tmp_path / "done" / "a.png", tmp_path / "inbox" / ".processing" / "default" / "a.png")

    again = pipeline_for(tmp_path, inbox={"settle_ms": 0})
    for _ in range(2):
        again.lifecycle.crash_ledger.record("a crash between the write and the move")
    asyncio.run(again.process_backlog())
    results, failed = outcome_names(tmp_path)
    assert results == {"a.png"} and not failed
    assert (tmp_path / "done" / "a.png").exists()
