"""The retry list: items that failed for a reason that may pass (disk full, CUDA OOM, a file
locked or briefly gone), waiting out an exponential backoff with jitter before going back on
the queue.

Bounded by ``capacity.retry_list``. When it is full the item is *released*: its file goes back
to the inbox on disk (the durable backlog) and a later scan finds it. Nothing is dropped, and
the list never grows with the backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import random
import time
from collections.abc import Awaitable, Callable

from inboxd.config import RetryPolicyConfig
from inboxd.item import WorkItem


def backoff_s(attempt: int, config: RetryPolicyConfig, rng: random.Random) -> float:
    """Full jitter (a random delay up to the exponential cap), so that items that failed
    together, say on a full disk, do not all come back in the same instant."""
    cap_ms = min(config.backoff_max_ms, config.backoff_initial_ms * 2 ** max(0, attempt - 1))
    return rng.uniform(cap_ms / 2, cap_ms) / 1000


class RetryList:
    name = "retry_list"

    def __init__(
        self,
        capacity: int,
        requeue: Callable[[WorkItem], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity = capacity
        self.requeue = requeue
        self.clock = clock
        self._heap: list[tuple[float, int, WorkItem]] = []
        self._order = itertools.count()
        self._changed = asyncio.Event()
        self.high_water = 0

    @property
    def size(self) -> int:
        return len(self._heap)

    def offer(self, item: WorkItem, delay_s: float) -> bool:
        """Schedule another attempt; False when full (the caller releases the file to disk)."""
        if len(self._heap) >= self.capacity:
            return False
        heapq.heappush(self._heap, (self.clock() + delay_s, next(self._order), item))
        self.high_water = max(self.high_water, len(self._heap))
        self._changed.set()
        return True

    def drain(self) -> list[WorkItem]:
        """Empty the list (shutdown): the caller hands each file back to the inbox."""
        items = [item for _, _, item in self._heap]
        self._heap.clear()
        return items

    async def run(self) -> None:
        while True:
            if not self._heap:
                self._changed.clear()
                await self._changed.wait()
                continue
            due_s = self._heap[0][0]
            wait_s = due_s - self.clock()
            if wait_s > 0:
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), wait_s)
                continue
            _, _, item = heapq.heappop(self._heap)
            await self.requeue(item)
