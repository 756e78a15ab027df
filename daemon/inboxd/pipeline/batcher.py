"""The batcher: preprocess cache → one forming batch of at most ``batch.max_size`` items.

With ``models:`` each task has its own batcher (layer ``batch_<task>``), forming that task's
batches of its own ``batch.max_size`` from the photos the task join hands it
(``pipeline/task_join.py``).

The batch closes when it is full, when ``batch.max_delay_ms`` have passed since its first item
arrived, or at once when nothing else is on the way (the queue is empty and no file is being
decoded): a lone file never waits for company that is not coming, and a busy daemon fills
batches from the cache without waiting at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from inboxd.item import WorkItem
from inboxd.stats import Window


class BatchSource(Protocol):
    """Where a batcher takes its items: the preprocess cache, or one task's feed."""

    async def get(self) -> WorkItem: ...

    def take_nowait(self) -> WorkItem | None: ...

    async def wait_arrival(self, timeout_s: float) -> None: ...


class Batcher:
    def __init__(
        self,
        cache: BatchSource,
        max_size: int,
        max_delay_ms: float,
        clock: Callable[[], float] = time.monotonic,
        sizes: Window | None = None,
        more_coming: Callable[[], bool] = lambda: True,
        name: str = "batch",
    ) -> None:
        self.name = name  # the layer: one forming batch
        self.cache = cache
        self.more_coming = more_coming
        self.sizes = sizes or Window()
        self.max_size = max_size
        self.max_delay_s = max_delay_ms / 1000
        self.clock = clock
        self.forming = 0
        self.high_water = 0

    @property
    def size(self) -> int:
        return self.forming

    @property
    def capacity(self) -> int:
        return self.max_size

    def configure(self, max_size: int, max_delay_ms: float) -> None:
        self.max_size = max_size
        self.max_delay_s = max_delay_ms / 1000

    async def next_batch(self) -> list[WorkItem]:
        batch = [await self.cache.get()]
        deadline_s = self.clock() + self.max_delay_s
        self._forming(1)
        while len(batch) < self.max_size:
            item = self.cache.take_nowait()
            if item is not None:
                batch.append(item)
                self._forming(len(batch))
                continue
            remaining_s = deadline_s - self.clock()
            if remaining_s <= 0 or not self.more_coming():
                break
            await self.cache.wait_arrival(remaining_s)
        self.sizes.add(len(batch))
        self.forming = 0
        return batch

    def _forming(self, size: int) -> None:
        # The mark moves with the size: a scrape mid-batch must never see the size above it.
        self.forming = size
        self.high_water = max(self.high_water, size)
