"""The model stage of a ``models:`` config: one batcher and one model stage per task.

preprocess cache → task join → per task: its feed → its batcher (``batch_<task>``, the task's
``batch.max_size``) → its model stage (``model_<task>``, the task's ``in_flight_batches``) →
back to the join → result writer, once per photo.

Every task runs at its own pace: a fast task's batches are not held back by a slow task's, up to
the join's capacity (``pipeline/task_join.py``). The watchdog, STATUS= and the stats record read
the tasks' stages through this one object, as they read a one-model stage.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from inboxd.config import Config
from inboxd.item import WorkItem
from inboxd.models.engines.interface import DeviceFault, ModelEngine, Outcome, calls_out
from inboxd.pipeline.batcher import Batcher, BatchSource
from inboxd.pipeline.model_stage import ModelStage
from inboxd.pipeline.task_join import TaskJoin
from inboxd.stats import Layer, Stats


class TaskStages:
    def __init__(
        self,
        config: Config,
        engines: dict[str, ModelEngine],
        cache: BatchSource,
        stats: Stats,
        deliver: Callable[[list[Outcome]], Awaitable[None]],
        release: Callable[[WorkItem, str], Awaitable[None]],
        clock: Callable[[], float],
        upstream_busy: Callable[[], bool],
        on_device_fault: Callable[[DeviceFault], None] = lambda fault: None,
    ) -> None:
        """``upstream_busy``: more photos are on their way to the cache (queued or decoding)."""
        self.cache = cache
        # Each task's bound on batches out, as its stage below will keep it.
        bounds = {task: calls_out(engine, config.task_in_flight(task))
                  for task, engine in engines.items()}
        self.join = TaskJoin(list(engines), config.task_join(bounds), deliver, release)
        self.batchers: dict[str, Batcher] = {}
        self.stages: dict[str, ModelStage] = {}
        for task, engine in engines.items():
            batch = config.task_batch(task)

            def more_coming(upstream: Callable[[], bool] = upstream_busy) -> bool:
                # A photo can only reach a task's feed through a join with room.
                return upstream() and self.join.has_room()

            self.batchers[task] = Batcher(self.join.feeds[task], batch.max_size,
                                          batch.max_delay_ms, clock, stats.batch_sizes,
                                          more_coming=more_coming, name=f"batch_{task}")
            self.stages[task] = ModelStage(
                engine, self.batchers[task], self._answered_by(task), clock,
                release=self.join.give_back, on_device_fault=on_device_fault,
                on_inferred=lambda s: stats.inference_ms.add(s * 1000),
                in_flight=config.task_in_flight(task), name=f"model_{task}")

    @property
    def calls_out(self) -> dict[str, int]:
        """Each task's bound on batches out: one on an engine that takes one call at a time."""
        return {task: stage.capacity for task, stage in self.stages.items()}

    def _answered_by(self, task: str) -> Callable[[list[Outcome]], Awaitable[None]]:
        async def answered(outcomes: list[Outcome]) -> None:
            await self.join.answered(task, outcomes)
        return answered

    @property
    def layers(self) -> list[Layer]:
        """The join, then each task's batch and calls out, task by task."""
        found: list[Layer] = [self.join]
        for task in self.stages:
            found += [self.batchers[task], self.stages[task]]
        return found

    # -- what the watchdog, STATUS= and the stats record read, over every task -----------------

    @property
    def unavailable_since_s(self) -> float | None:
        return min((s.unavailable_since_s for s in self.stages.values()
                    if s.unavailable_since_s is not None), default=None)

    @property
    def batches_done(self) -> int:
        return sum(stage.batches_done for stage in self.stages.values())

    @property
    def busy_since_s(self) -> float | None:
        return min((s.busy_since_s for s in self.stages.values() if s.busy_since_s is not None),
                   default=None)

    def call_limit_s(self, patience_s: float) -> float:
        return max(stage.call_limit_s(patience_s) for stage in self.stages.values())

    @property
    def crashed_with(self) -> list[WorkItem]:
        """The files of the batch whose call raised, for the crash ledger (a task's copy has
        its photo's claimed path)."""
        return [item for stage in self.stages.values() for item in stage.crashed_with]

    # -- running -------------------------------------------------------------------------------

    def configure(self, config: Config) -> None:
        """SIGHUP: each task's batch and in-flight bound, and the join's, from ``config``."""
        for task, batcher in self.batchers.items():
            batch = config.task_batch(task)
            batcher.configure(batch.max_size, batch.max_delay_ms)
            self.stages[task].resize(config.task_in_flight(task))
        self.join.resize(config.task_join(self.calls_out))

    async def run(self) -> None:
        """Photos from the cache into the join while it has room, and every task's stage; the
        first to crash ends them all with its exception."""
        runs = [asyncio.create_task(self._fan_out(), name="task-join")]
        runs += [asyncio.create_task(stage.run(), name=f"model-{task}")
                 for task, stage in self.stages.items()]
        try:
            done, _ = await asyncio.wait(runs, return_when=asyncio.FIRST_EXCEPTION)
            for run in done:
                run.result()
        finally:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)

    async def _fan_out(self) -> None:
        while True:
            # Room first, then the cache: while the slowest task holds the join full, the
            # cache is not drained and the wait reaches await queue.put().
            await self.join.wait_room()
            self.join.admit(await self.cache.get())

    def close(self) -> None:
        for stage in self.stages.values():
            stage.close()
