"""The model stage's in-flight bound and its answer to an engine that cannot be reached, with a
fake engine at the boundary (the real one on a real cluster: tests/models/test_ray_engine.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from inboxd.config import ConfigError, load_config, parse_config
from inboxd.item import WorkItem
from inboxd.models.engines.interface import EngineUnavailable, ModelEngine, Outcome
from inboxd.models.engines.local import LocalEngine
from inboxd.models.model import Classification
from inboxd.pipeline.model_stage import ModelStage
from inboxd.pipeline.wiring import Pipeline

from tests.conftest import make_image, write_config
from tests.fakes import FakeModel


class ParallelEngine(ModelEngine):
    """Answers every call after ``delay_s``; the first ``unavailable_calls`` calls raise
    ``EngineUnavailable`` instead (a cluster that is gone, then back)."""

    parallel_calls = True

    def __init__(self, delay_s: float = 0.02, unavailable_calls: int = 0) -> None:
        self.model = FakeModel()
        self.delay_s = delay_s
        self.unavailable_calls = unavailable_calls
        self.out = 0
        self.max_out = 0
        self.calls = 0
        self.seen: list[str] = []  # what the stage shows while it waits for the engine
        self.status: Any = None  # the pipeline's status_line, set by the test

    async def warm_up(self, max_size: int) -> tuple[list[int], float]:
        return [], 0.0

    async def infer(self, batch: list[WorkItem]) -> list[Outcome]:
        self.calls += 1
        if self.status is not None:
            self.seen.append(self.status())
        if self.unavailable_calls > 0:
            self.unavailable_calls -= 1
            raise EngineUnavailable("the cluster is gone (fake)", 0.01)
        self.out += 1
        self.max_out = max(self.max_out, self.out)
        try:
            await asyncio.sleep(self.delay_s)
            pixels = [item.image.pixels for item in batch if item.image is not None]
            return list(zip(batch, self.model.classify(pixels), strict=True))
        finally:
            self.out -= 1

    def close(self) -> None:
        pass


def run(root: Path, engine: Any, files: int, watch_status: bool = False,
        **sections: Any) -> Pipeline:
    config = load_config(write_config(root, inbox={"settle_ms": 0}, **sections))
    for n in range(files):
        make_image(root / "inbox" / f"f{n:03}.png", size=(8, 8), color=(n % 200 + 20, 0, 0))
    pipeline = Pipeline(config, FakeModel(), engine=engine)  # type: ignore[arg-type]
    if watch_status:
        engine.status = pipeline.report.status_line
    asyncio.run(pipeline.process_backlog())
    return pipeline


def test_a_parallel_engine_gets_up_to_in_flight_batches_calls_and_never_more(
        tmp_path: Path) -> None:
    engine = ParallelEngine()
    pipeline = run(tmp_path, engine, 120, capacity={"in_flight_batches": 3,
                                                    "preprocess_cache": 16},
                   batch={"max_size": 2, "max_delay_ms": 0}, preprocess={"workers": 2})
    assert pipeline.stats.counters.completed == 120
    assert engine.max_out == 3, "the bound was reached, and held"
    fields = pipeline.report.log_stats()
    assert fields["IN_FLIGHT_CAPACITY"] == 3 and fields["IN_FLIGHT_HIGH_WATER"] == 3


def test_the_local_engine_gets_one_call_at_a_time_whatever_the_capacity(
        tmp_path: Path) -> None:
    engine = LocalEngine(FakeModel())  # type: ignore[arg-type]
    pipeline = run(tmp_path, engine, 20, capacity={"in_flight_batches": 8})
    assert pipeline.stats.counters.completed == 20
    assert pipeline.model_stage.capacity == 1 and pipeline.model_stage.high_water == 1


class SideBySide(FakeModel):
    """A model that runs ``concurrent_calls`` batches at once (ONNX Runtime's cached artifact,
    one single-threaded call per core), slowly enough that the stage could send more."""

    concurrent_calls = 2

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.running = 0
        self.max_running = 0
        self.threads: set[str] = set()

    def classify(self, images: Any) -> Any:
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            self.threads.add(threading.current_thread().name)
        try:
            time.sleep(0.02)
            return super().classify(images)
        finally:
            with self.lock:
                self.running -= 1

    predict = classify


def test_a_model_that_runs_calls_side_by_side_gets_one_per_thread_and_never_more(
        tmp_path: Path) -> None:
    """On the CPU the cached ONNX Runtime artifact runs whole batches side by side, one per
    model thread: the stage keeps that many out (not capacity.in_flight_batches, whose surplus
    would only wait in the engine with its batch held out of the cache), and each runs on a
    model thread of its own."""
    model = SideBySide()
    engine = LocalEngine(model)  # type: ignore[arg-type]
    pipeline = run(tmp_path, engine, 40, capacity={"in_flight_batches": 8},
                   batch={"max_size": 2, "max_delay_ms": 0})
    assert pipeline.stats.counters.completed == 40
    assert model.max_running == 2, "two batches ran at once, and never more"
    assert len(model.threads) == 2 and all(t.startswith("inboxd-model") for t in model.threads)
    assert pipeline.model_stage.capacity == 2 and pipeline.model_stage.high_water == 2
    fields = pipeline.report.log_stats()
    assert fields["IN_FLIGHT_CAPACITY"] == 2 and fields["IN_FLIGHT_HIGH_WATER"] == 2


def test_an_unreachable_engine_holds_the_batch_without_spending_an_attempt(
        tmp_path: Path) -> None:
    engine = ParallelEngine(unavailable_calls=5)
    pipeline = run(tmp_path, engine, 10, watch_status=True, retry={"max_attempts": 1})
    counters = pipeline.stats.counters
    assert counters.completed == 10 and counters.failed == 0 and counters.retried == 0
    assert pipeline.model_stage.unavailable_waits == 5
    assert pipeline.model_stage.unavailable_since_s is None, "reachable again, and logged as such"
    # systemctl status says so while it lasts (STATUS=), and not once it is over.
    assert "model unreachable for" in engine.seen[1], engine.seen
    assert "unreachable" not in pipeline.report.status_line()


def test_the_ray_block_is_checked_without_connecting_or_importing_ray(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("model:\n  engine: ray\n  ray:\n    address: somewhere\n"
                     "    replica_resources: {}\n", "x.yaml")
    joined = "\n".join(caught.value.problems)
    assert "line 4: model.ray.address" in joined and "HOST:PORT" in joined
    assert "line 5: model.ray.replica_resources" in joined
    config = write_config(tmp_path, model={"engine": "ray", "ray": {
        "address": "10.0.0.5:6379", "replicas": 3, "replica_resources": {"GPU": 1}}},
        capacity={"in_flight_batches": 6})
    probe = ("import sys; from inboxd.cli import main; sys.argv = ['inboxd', 'check-config', "
             f"'-c', {str(config)!r}]; code = main(); "
             "sys.exit(code or (3 if 'ray' in sys.modules else 0))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "'engine': 'ray'" in done.stdout and "10.0.0.5:6379" in done.stdout


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.mark.parametrize(("call_limit_s", "overdue_after_s"), [(None, 30), (750, 750)])
def test_the_watchdog_waits_out_an_engine_s_own_call_limit(
        call_limit_s: float | None, overdue_after_s: float) -> None:
    """Ray's calls time out by themselves (call_timeout_s, then a retry): a watchdog that gave
    up at WatchdogSec / 2 = 30 s restarted the daemon, in-flight files and all, long before a
    remote node's lost batch could come back as a retry. The oldest of several calls counts."""
    engine = ParallelEngine()
    if call_limit_s is not None:
        engine.call_limit_s = call_limit_s
    clock = Clock()
    worker = ModelStage(engine, None, None, clock, in_flight=4)  # type: ignore[arg-type]
    assert worker.overdue_s(30) is None, "idle"
    worker._busy.update({1: clock.now_s, 2: clock.now_s + 10})
    clock.now_s += overdue_after_s - 1
    assert worker.overdue_s(30) is None
    clock.now_s += 1
    assert worker.overdue_s(30) == overdue_after_s


class FailsAfter(FakeModel):
    """A device that fails for good after ``good_batches`` batches, slowly enough that several
    calls are out when it does."""

    def __init__(self, good_batches: int) -> None:
        super().__init__()
        self.good_batches = good_batches

    def classify(self, images: Any) -> Any:
        time.sleep(0.01)
        if len(self.batch_sizes) >= self.good_batches:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().classify(images)

    predict = classify


def test_a_device_fault_with_several_calls_out_hands_every_file_back(tmp_path: Path) -> None:
    """The overlapped local engine (CUDA's; forced here on the CPU) keeps several calls out:
    when the device fails under them, each batch in flight, and each one after, goes back to
    the inbox unspent; none failed, none lost, none with two results."""
    engine = LocalEngine(FailsAfter(good_batches=3), overlap=True)  # type: ignore[arg-type]
    assert engine.parallel_calls
    pipeline = run(tmp_path, engine, 40, capacity={"in_flight_batches": 4},
                   batch={"max_size": 2, "max_delay_ms": 0})
    counters = pipeline.stats.counters
    assert pipeline.device_fault is not None
    assert pipeline.model_stage.high_water > 1, "several calls were out"
    results = list((tmp_path / "results").glob("*.json"))
    back = [p for p in (tmp_path / "inbox").iterdir() if p.suffix == ".png"]
    assert counters.failed == 0 and not list((tmp_path / "failed").rglob("*.png"))
    assert len(results) == counters.completed > 0
    assert len(back) + len(results) == 40, "every file has a result or is back in the inbox"
    assert not {p.stem for p in back} & {p.name.removesuffix(".png.json") for p in results}


class Resizing(ParallelEngine):
    """On call ``at``, with 4 out, a SIGHUP sets in_flight_batches to 1; then back to 4."""

    def __init__(self) -> None:
        super().__init__(delay_s=0.03)
        self.worker: ModelStage | None = None
        self.after_down: list[int] = []  # calls out, this one included, at each later start
        self.after_up: list[int] = []

    async def infer(self, batch: list[WorkItem]) -> list[Outcome]:
        assert self.worker is not None
        if self.calls == 30:
            self.worker.resize(1)
        elif self.calls == 45:
            self.worker.resize(4)
        elif self.calls > 30:
            (self.after_down if self.calls < 45 else self.after_up).append(self.out + 1)
        return await super().infer(batch)


def test_resizing_in_flight_down_with_four_out_drains_to_the_new_bound(tmp_path: Path) -> None:
    engine = Resizing()
    config = load_config(write_config(tmp_path, inbox={"settle_ms": 0},
                                      capacity={"in_flight_batches": 4, "preprocess_cache": 16},
                                      batch={"max_size": 2, "max_delay_ms": 0}))
    for n in range(140):
        make_image(tmp_path / "inbox" / f"f{n:03}.png", size=(8, 8), color=(n % 200 + 20, 0, 0))
    pipeline = Pipeline(config, FakeModel(), engine=engine)  # type: ignore[arg-type]
    engine.worker = pipeline.model_stage
    asyncio.run(pipeline.process_backlog())
    assert pipeline.stats.counters.completed == 140
    assert engine.max_out == 4 and engine.after_down and engine.after_up
    assert max(engine.after_down) == 1, engine.after_down
    assert max(engine.after_up) == 4, "back up to the new bound, no deadlock on the way"


def test_a_stop_with_four_calls_hung_ends_at_the_grace_period_with_every_file_back(
        tmp_path: Path) -> None:
    engine = ParallelEngine(delay_s=3600)
    config = load_config(write_config(tmp_path, inbox={"settle_ms": 0}, shutdown={"grace_s": 0.5},
                                      capacity={"in_flight_batches": 4},
                                      batch={"max_size": 2, "max_delay_ms": 0}))
    for n in range(30):
        make_image(tmp_path / "inbox" / f"f{n:03}.png", size=(8, 8), color=(n % 200 + 20, 0, 0))
    pipeline = Pipeline(config, FakeModel(), engine=engine)  # type: ignore[arg-type]

    async def stop_when_four_are_out() -> float:
        stop = asyncio.Event()
        backlog = asyncio.create_task(pipeline.process_backlog(stop=stop))
        while engine.out < 4:
            await asyncio.sleep(0.01)
        stop.set()  # what SIGTERM does
        started = time.monotonic()
        await backlog
        stopped_s = time.monotonic() - started
        await asyncio.sleep(0.1)  # a cancelled call that went on would deliver now
        return stopped_s

    stopped_s = asyncio.run(stop_when_four_are_out())
    assert stopped_s < 0.5 + 1.5, stopped_s
    assert engine.out == 0, "the hung calls were cancelled, not left running"
    assert not list((tmp_path / "results").glob("*.json"))
    assert len([p for p in (tmp_path / "inbox").iterdir() if p.suffix == ".png"]) == 30


class NaNFor(ParallelEngine):
    """A replica whose network overflows on some inputs: NaN scores for those items only."""

    async def infer(self, batch: list[WorkItem]) -> list[Outcome]:
        outcomes = await super().infer(batch)
        for _, prediction in outcomes:
            assert isinstance(prediction, Classification)
            if prediction.top_k[0]["index"] % 5 == 0:
                prediction.top_k[0]["score"] = float("nan")
        return outcomes


def test_nan_scores_fail_that_file_and_never_reach_a_result(tmp_path: Path) -> None:
    """``json.dumps`` writes NaN as a bare ``NaN``: a result no strict JSON reader accepts."""
    pipeline = run(tmp_path, NaNFor(), 20, batch={"max_size": 4})
    counters = pipeline.stats.counters
    assert counters.completed == 16 and counters.failed == 4
    for result in (tmp_path / "results").glob("*.json"):
        assert "NaN" not in result.read_text(), result
    reports = [json.loads(p.read_text()) for p in (tmp_path / "failed").glob("*.error.json")]
    assert len(reports) == 4 and all("not a number" in json.dumps(r) for r in reports), reports
