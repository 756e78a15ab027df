"""Between preprocessing and the batcher: decoded images awaiting the model.

Bounded twice, by ``capacity.preprocess_cache`` items and ``capacity.preprocess_cache_mb`` bytes,
because one 12-MP image and one thumbnail are the same "item" but not the same memory. A
preprocess worker that finds it full waits; one item larger than the whole byte budget is still
let in when the cache is empty, or it could never pass.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

from inboxd.item import WorkItem

MB = 1024 * 1024


class PreprocessCache:
    name = "preprocess_cache"

    def __init__(self, capacity: int, capacity_mb: int) -> None:
        self.capacity = capacity  # items
        self.capacity_bytes = capacity_mb * MB
        self._items: collections.deque[WorkItem] = collections.deque()
        self._bytes = 0
        # Single-threaded event loop: two events are all the signalling needed, no locks.
        self._room = asyncio.Event()
        self._arrived = asyncio.Event()
        self.high_water = 0
        self.high_water_bytes = 0

    @property
    def size(self) -> int:
        return len(self._items)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def _has_room(self, nbytes: int) -> bool:
        if not self._items:
            return True
        return (
            len(self._items) < self.capacity
            and self._bytes + nbytes <= self.capacity_bytes
        )

    async def put(self, item: WorkItem) -> None:
        nbytes = item.image.nbytes if item.image is not None else 0
        while not self._has_room(nbytes):
            self._room.clear()
            await self._room.wait()
        self._items.append(item)
        self._bytes += nbytes
        self.high_water = max(self.high_water, len(self._items))
        self.high_water_bytes = max(self.high_water_bytes, self._bytes)
        self._arrived.set()

    def take_nowait(self) -> WorkItem | None:
        if not self._items:
            return None
        item = self._items.popleft()
        self._bytes -= item.image.nbytes if item.image is not None else 0
        self._room.set()
        return item

    async def get(self) -> WorkItem:
        while not self._items:
            self._arrived.clear()
            await self._arrived.wait()
        item = self.take_nowait()
        assert item is not None
        return item

    async def wait_arrival(self, timeout_s: float) -> None:
        """Sleep until an item arrives or ``timeout_s`` passes (a lost wake-up only costs a
        re-check, so a timeout here can never lose an item)."""
        self._arrived.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._arrived.wait(), timeout_s)

    def resize(self, capacity: int, capacity_mb: int) -> None:
        self.capacity = capacity
        self.capacity_bytes = capacity_mb * MB
        self._room.set()
