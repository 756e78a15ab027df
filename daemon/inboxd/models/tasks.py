"""Several tasks per photo (``models:``): one decode, each task's model, one result.

Each photo is read, hashed and decoded once; the decode worker cuts each task's input from that
decode (``DecodedImage.others``). Each task sees its own copy of the photo's item with its own
image (``task_copy``), batched by its own batcher and run by its own engine with its own bound
on calls out (``pipeline/task_stages.py``). The answers are joined per photo into one
``TaskResults`` (``joined``): a task whose model failed on this photo (``ModelError``) keeps its
reason in its section and the others their answers; only a transient failure of a task (a CUDA
OOM at batch size 1) sends the whole photo round again, so its one outcome is still decided once.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from inboxd.item import PermanentError, TransientError, WorkItem
from inboxd.models.engines.interface import ModelEngine, Outcome
from inboxd.models.predictions import Prediction, TaskAnswer, TaskModel, TaskResults

if TYPE_CHECKING:  # the fast path is torch's: a daemon that serves without torch has none
    from inboxd.models.fast_path import FastPath


class TasksEngine:
    """The engines of a ``models:`` config, one per task, each with its own thread (the local
    engine) or its own calls out. The pipeline gives each task its own batcher and model stage
    (``pipeline/task_stages.py``); this holds what is asked of them all at once: warm-up, the
    stats fields, close."""

    # A faster runner being brought in (the one-model engine's ``fast``): none for the tasks
    # as a whole; each task's engine reports its own in the started record.
    fast: FastPath | None = None

    def __init__(self, models: dict[str, TaskModel], engines: dict[str, ModelEngine],
                 batch_sizes: dict[str, int] | None = None) -> None:
        """``batch_sizes``: the tasks whose ``batch.max_size`` is their own (the others take
        the top-level one), for the warm-up."""
        self.models = models
        self.engines = engines
        self.batch_sizes = batch_sizes or {}

    def stats_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for engine in self.engines.values():
            fields.update(engine.stats_fields())
        return fields

    async def warm_up(self, max_size: int) -> tuple[list[int], float]:
        """Each task at its own largest batch (``max_size`` where it has none of its own)."""
        sizes: set[int] = set()
        seconds = 0.0
        for task, engine in self.engines.items():  # one at a time: each warms its own thread
            warmed, took = await engine.warm_up(self.batch_sizes.get(task, max_size))
            sizes.update(warmed)
            seconds += took
        return sorted(sizes), seconds

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
