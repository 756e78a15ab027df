"""Several tasks per photo (``models:``): one decode, each task's model, one result.

Each photo is read, hashed and decoded once; the decode worker cuts each task's input from that
decode (``DecodedImage.others``). A batch goes to every task's engine at once, each task seeing
its own copy of the batch's items with its own image, each engine in its own thread with its own
bound on calls out (the ``in_flight_<task>`` layers). The outcomes are joined per photo into one
``TaskResults``: a task whose model failed on this photo (``ModelError``) keeps its reason in its
section and the others their answers; only a transient failure of a task (a CUDA OOM at batch
size 1) sends the whole photo round again, so its one outcome is still decided once.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from typing import Any

from inboxd.item import PermanentError, TransientError, WorkItem
from inboxd.models.engines.interface import ModelEngine, Outcome
from inboxd.models.model import Prediction, TaskAnswer, TaskModel, TaskResults


class TaskLayer:
    """A task's calls out on its engine: at most one per model stage slot (the stage bounds
    them), reported per task so a slow task shows."""

    def __init__(self, task: str, capacity: int) -> None:
        self.name = f"in_flight_{task}"
        self._capacity = capacity
        self.size_now = 0
        self.high_water = 0

    @property
    def size(self) -> int:
        return self.size_now

    @property
    def capacity(self) -> int:
        return self._capacity

    def enter(self) -> None:
        self.size_now += 1
        self.high_water = max(self.high_water, self.size_now)

    def leave(self) -> None:
        self.size_now -= 1


class TasksEngine(ModelEngine):
    """The model engine of a ``models:`` config: every task's engine behind one interface."""

    def __init__(self, models: dict[str, TaskModel], engines: dict[str, ModelEngine],
                 in_flight: int) -> None:
        self.models = models
        self.engines = engines
        self.parallel_calls = all(e.parallel_calls for e in engines.values())
        # The slowest task's own limit on a call: a batch waits for every task.
        self.call_limit_s = max((e.call_limit_s for e in engines.values()), default=0.0)
        bound = in_flight if self.parallel_calls else 1
        self.layers = {task: TaskLayer(task, bound) for task in engines}

    def stats_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for engine in self.engines.values():
            fields.update(engine.stats_fields())
        return fields

    async def warm_up(self, max_size: int) -> tuple[list[int], float]:
        sizes: set[int] = set()
        seconds = 0.0
        for engine in self.engines.values():  # one at a time: each warms its own thread
            warmed, took = await engine.warm_up(max_size)
            sizes.update(warmed)
            seconds += took
        return sorted(sizes), seconds

    async def infer(self, batch: list[WorkItem]) -> list[Outcome]:
        copies = {task: [task_copy(item, index) for item in batch]
                  for index, task in enumerate(self.engines)}
        answers = await asyncio.gather(*(self._one(task, copies[task]) for task in self.engines))
        by_task = {task: {id(item): outcome for item, outcome in outcomes}
                   for task, outcomes in zip(self.engines, answers, strict=True)}
        return [joined(item, {task: (copies[task][n], by_task[task][id(copies[task][n])])
                              for task in self.engines})
                for n, item in enumerate(batch)]

    async def _one(self, task: str, items: list[WorkItem]) -> list[Outcome]:
        layer = self.layers[task]
        layer.enter()
        try:
            return await self.engines[task].infer(items)
        finally:
            layer.leave()

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


def task_copy(item: WorkItem, index: int) -> WorkItem:
    """``item`` for one task: the same file, that task's image (a shallow copy: the engine
    writes its timings and runtime on it, not on the photo's item)."""
    twin = copy.copy(item)
    twin.image = item.image.for_task(index) if item.image is not None else None
    return twin


def joined(item: WorkItem, outcomes: dict[str, tuple[WorkItem, Prediction | Exception]]
           ) -> Outcome:
    """One photo's outcome from its tasks': the first transient failure (the photo is tried
    again as a whole), else every section, a task's own permanent failure in its section."""
    for _, outcome in outcomes.values():
        if isinstance(outcome, TransientError):
            return item, outcome
    sections: dict[str, TaskAnswer | Exception] = {}
    ran: dict[str, tuple[str, str]] = {}
    for task, (twin, outcome) in outcomes.items():
        if isinstance(outcome, PermanentError):
            sections[task] = outcome
        elif isinstance(outcome, Exception):
            sections[task] = PermanentError(f"{type(outcome).__name__}: {outcome}")
        else:
            assert not isinstance(outcome, TaskResults)  # a task's engine runs one model
            sections[task] = outcome
        ran[task] = (twin.runtime or "", twin.precision or "")
    twins = [twin for twin, _ in outcomes.values()]
    item.inference_ms = max((t.inference_ms or 0.0 for t in twins), default=0.0)
    return item, TaskResults(sections, ran)


def task_names(models: Sequence[str]) -> str:
    return ",".join(models)


def memory_fields(models: dict[str, TaskModel]) -> dict[str, Any]:
    """The CUDA figures of the first model on a GPU (the tasks share one device's memory)."""
    for model in models.values():
        if model.on_gpu:
            return model.memory_fields()
    return {}
