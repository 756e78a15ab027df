"""The queue between intake and preprocessing: an ``asyncio.Queue(maxsize=capacity.queue)``.

A plain asyncio.Queue plus what the stats need (high-water mark) and what a live reload needs
(a new maxsize that wakes producers waiting for the room it adds).
"""

from __future__ import annotations

import asyncio

from inboxd.item import WorkItem


class PipelineQueue(asyncio.Queue[WorkItem]):
    name = "queue"

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize=maxsize)
        self.high_water = 0

    def _put(self, item: WorkItem) -> None:
        super()._put(item)
        self.high_water = max(self.high_water, self.qsize())

    @property
    def size(self) -> int:
        return self.qsize()

    @property
    def capacity(self) -> int:
        return self.maxsize

    def resize(self, maxsize: int) -> None:
        """asyncio.Queue has no public setter; its put() re-checks ``full()`` after every wake,
        so changing ``_maxsize`` and waking the waiters is all a resize needs."""
        self._maxsize = maxsize
        for _ in range(max(0, maxsize - self.qsize())):
            self._wakeup_next(self._putters)  # type: ignore[attr-defined]
