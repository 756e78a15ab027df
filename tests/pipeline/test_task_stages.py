"""``models:``: each task its own batcher, batch size and calls out, the photos joined into one
result each. The models are fakes at the boundary (the local engine and everything else real);
tests/models/test_tasks.py and tests/guarantees/test_model_based.py run real models."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from inboxd.config import ConfigError, load_config
from inboxd.models.model import Classification
from inboxd.pipeline.task_stages import TaskStages
from inboxd.pipeline.wiring import Pipeline
from inboxd.service.metrics import Metrics
from prometheus_client.parser import text_string_to_metric_families

from support.waiting import wait_until
from tests.conftest import make_image, write_config
from tests.fakes import FakeModel

TASKS = ("fast", "slow")


class GatedModel(FakeModel):
    """A fake model whose calls wait for ``gate`` (a slow task, as slow as the test wants)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.answered = 0

    def classify(self, images: Sequence[npt.NDArray[np.uint8]]) -> list[Classification]:
        self.gate.wait(60)
        answers = super().classify(images)
        self.answered += len(images)
        return answers

    predict = classify


class OutOfMemoryOnce(FakeModel):
    """Runs out of CUDA memory on the photo of red ``red`` the first ``times`` times it sees it,
    even alone (a transient failure at batch size 1)."""

    def __init__(self, red: int, times: int = 1) -> None:
        super().__init__()
        self.red = red
        self.left = times

    def classify(self, images: Sequence[npt.NDArray[np.uint8]]) -> list[Classification]:
        if self.left > 0 and any(int(image[0, 0, 0]) == self.red for image in images):
            if len(images) == 1:
                self.left -= 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().classify(images)

    predict = classify


def flood(root: Path, files: int, **sections: Any) -> Pipeline:
    tasks = sections.pop("tasks")
    config = load_config(write_config(
        root, inbox={"settle_ms": 0}, model=None,
        models={task: {"batch": {"max_size": size, "max_delay_ms": 50}} if size else {}
                for task, size in tasks.items()}, **sections))
    for n in range(files):
        make_image(root / "inbox" / f"f{n:03}.png", size=(8, 8), color=(n % 200 + 20, 0, 0))
    return Pipeline(config, FakeModel(), tasks={task: FakeModel() for task in tasks}
                    )  # type: ignore[arg-type, dict-item]


def with_models(pipeline: Pipeline, **models: FakeModel) -> Pipeline:
    """``pipeline`` with these tasks' models in place (on the engines the stage calls)."""
    stages = pipeline.model_stage
    assert isinstance(stages, TaskStages)
    for task, model in models.items():
        stages.stages[task].engine.model = model  # type: ignore[attr-defined]
    return pipeline


def results(root: Path) -> dict[str, dict[str, Any]]:
    return {p.name.removesuffix(".json"): json.loads(p.read_text())
            for p in (root / "results").glob("*.json")}


def test_each_task_batches_at_its_own_size_and_every_layer_holds_its_bound(
        tmp_path: Path) -> None:
    """A flood with batch sizes 2 and 5: each task's model gets batches of its own size (the
    model counts them, the stats record's batch_<task> layer says the same), every layer's
    high-water stays within its capacity, and every photo gets one result with both sections."""
    fast, slow = FakeModel(), GatedModel()
    pipeline = with_models(flood(tmp_path, 60, tasks={"fast": 2, "slow": 5},
                                 capacity={"queue": 4, "preprocess_cache": 8,
                                           "task_join": 12}), fast=fast, slow=slow)
    metrics = Metrics(pipeline.config)
    metrics.attach(pipeline)
    asyncio.run(pipeline.process_backlog())
    assert max(fast.batch_sizes) == 2 and max(slow.batch_sizes) == 5
    assert sum(fast.batch_sizes) == sum(slow.batch_sizes) == 60
    record = pipeline.report.log_stats()
    assert record["BATCH_FAST_HIGH_WATER"] == 2 and record["BATCH_FAST_CAPACITY"] == 2
    assert record["BATCH_SLOW_HIGH_WATER"] == 5 and record["BATCH_SLOW_CAPACITY"] == 5
    assert record["TASK_JOIN_CAPACITY"] == 12 and 1 <= record["TASK_JOIN_HIGH_WATER"] <= 12
    assert record["MODEL_FAST_CAPACITY"] == record["MODEL_SLOW_CAPACITY"] == 1  # CPU: one call
    layers = [key.removesuffix("_CAPACITY") for key in record if key.endswith("_CAPACITY")]
    assert {"TASK_JOIN", "BATCH_FAST", "MODEL_FAST", "BATCH_SLOW", "MODEL_SLOW"} <= set(layers)
    over = {layer: (record[f"{layer}_HIGH_WATER"], record[f"{layer}_CAPACITY"])
            for layer in layers if record[f"{layer}_HIGH_WATER"] > record[f"{layer}_CAPACITY"]}
    assert over == {}
    scraped = {sample.labels["layer"]: sample.value for family in
               text_string_to_metric_families(metrics.exposition().decode())
               if family.name == "inboxd_layer_high_water_items" for sample in family.samples}
    assert scraped["batch_fast"] == 2 and scraped["batch_slow"] == 5
    assert scraped["model_fast"] == scraped["model_slow"] == 1 and "in_flight" not in scraped
    assert 1 <= scraped["task_join"] <= 12
    found = results(tmp_path)
    assert len(found) == 60 and pipeline.stats.counters.completed == 60
    for name, result in found.items():
        red = int(name[1:4]) % 200 + 20
        for task in TASKS:
            assert result[task]["top_k"][0]["index"] == red, (name, task)
    assert len(list((tmp_path / "done").glob("*.png"))) == 60


def test_a_fast_task_runs_ahead_of_a_slow_one_by_the_join_and_then_intake_waits(
        tmp_path: Path) -> None:
    """While the slow task's model is stuck, the fast task answers exactly the join's capacity
    of photos (not one more: the join is full), the cache stops being drained and fills, and
    the queue fills so that ``await queue.put()`` waits. Let go, every photo is answered."""
    fast, slow = GatedModel(), GatedModel()
    slow.gate.clear()
    pipeline = with_models(flood(tmp_path, 60, tasks={"fast": 2, "slow": 4},
                                 capacity={"queue": 3, "preprocess_cache": 4, "task_join": 10}),
                           fast=fast, slow=slow)

    async def scenario() -> None:
        backlog = asyncio.create_task(pipeline.process_backlog())

        def backed_up() -> bool:
            return (fast.answered >= 10 and pipeline.preprocess_cache.size == 4
                    and pipeline.queue.qsize() == 3)

        await asyncio.to_thread(wait_until, backed_up, 60, "the join, cache and queue full")
        assert fast.answered == 10, "the fast task ran past the join's capacity"
        assert slow.answered == 0 and pipeline.stats.counters.completed == 0
        stages = pipeline.model_stage
        assert isinstance(stages, TaskStages)
        assert stages.join.size == stages.join.high_water == 10
        slow.gate.set()
        await backlog

    asyncio.run(scenario())
    assert fast.answered == slow.answered == 60
    assert len(results(tmp_path)) == 60


def test_a_transient_failure_of_one_task_sends_the_whole_photo_round_again(
        tmp_path: Path) -> None:
    """A CUDA OOM at batch size 1 in one task: the photo is tried again as a whole (both tasks
    answer it again) and ends with one result holding both answers; the other photos once."""
    fast, slow = FakeModel(), OutOfMemoryOnce(red=25)
    pipeline = with_models(flood(tmp_path, 12, tasks={"fast": 4, "slow": 4},
                                 retry={"backoff_initial_ms": 10, "backoff_max_ms": 20}),
                           fast=fast, slow=slow)
    asyncio.run(pipeline.process_backlog())
    found = results(tmp_path)
    assert len(found) == 12 and pipeline.stats.counters.retried == 1
    assert found["f005.png"]["attempts"] == 2
    assert found["f005.png"]["slow"]["top_k"][0]["index"] == 25
    assert sum(fast.batch_sizes) == 13, "the fast task answers the retried photo again"
    assert all(found[name]["attempts"] == 1 for name in found if name != "f005.png")


class BrokenDevice(FakeModel):
    """Every call fails as a poisoned CUDA context does."""

    def classify(self, images: Sequence[npt.NDArray[np.uint8]]) -> list[Classification]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    predict = classify


def test_a_device_fault_in_every_task_gives_each_photo_back_once(tmp_path: Path) -> None:
    """Both tasks' devices fail: each photo in flight goes back to the inbox once (counted
    once, its claim returned once), none is failed or filed, and the stage stops."""
    pipeline = with_models(flood(tmp_path, 12, tasks={"fast": 4, "slow": 4}),
                           fast=BrokenDevice(), slow=BrokenDevice())
    asyncio.run(pipeline.process_backlog())
    assert pipeline.device_fault is not None
    assert results(tmp_path) == {}
    assert sorted(p.name for p in (tmp_path / "inbox").glob("*.png")) == [
        f"f{n:03}.png" for n in range(12)]
    # Each claim is resolved once: a second give-back would count it twice and take the
    # count of files in flight below zero.
    assert pipeline.outcomes.in_flight == 0
    assert 0 < pipeline.stats.counters.released <= pipeline.intake.claimed
    assert not (tmp_path / "failed").exists() or not list((tmp_path / "failed").iterdir())


def test_a_join_smaller_than_a_task_s_batch_is_refused_saying_what_to_raise(
        tmp_path: Path) -> None:
    config = write_config(tmp_path, model=None, capacity={"task_join": 4}, models={
        "fast": {"batch": {"max_size": 8}}, "slow": {}})
    with pytest.raises(ConfigError, match=r"capacity.task_join \(4\) is smaller than task "
                       r"fast's batch.max_size \(8\).*raise capacity.task_join to at least 8"):
        load_config(config)
    one = write_config(tmp_path, model={"batch": {"max_size": 8}})
    with pytest.raises(ConfigError, match=r"model: .*batch is a models: task.s own key.*"
                       r"set the top-level batch:"):
        load_config(one)


def test_a_reload_resizes_each_task_s_batch_and_the_join(tmp_path: Path) -> None:
    """SIGHUP: the top-level batch size reaches the task without its own (the other keeps its
    own), and capacity.task_join takes effect at once."""
    pipeline = flood(tmp_path, 0, tasks={"fast": 2, "slow": 0})  # slow: the top-level batch
    stages = pipeline.model_stage
    assert isinstance(stages, TaskStages)
    assert stages.batchers["slow"].capacity == 4  # the top-level default
    assert stages.join.capacity == (1 + 1) * 4  # unset: (calls out + 1) x the largest batch
    new = load_config(write_config(
        tmp_path, model=None, batch={"max_size": 6}, capacity={"task_join": 9,
                                                               "in_flight_batches": 2},
        models={"fast": {"batch": {"max_size": 2}}, "slow": {}}))
    pipeline.apply_live(new)
    assert stages.batchers["fast"].capacity == 2 and stages.batchers["slow"].capacity == 6
    assert stages.join.capacity == 9
