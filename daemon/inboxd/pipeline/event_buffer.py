"""The event buffer: distinct paths seen by the watcher or a scan, not yet queued.

Bounded by ``capacity.event_buffer``. When it is full a new path is *deferred*: counted and left
on disk, where the next scan finds it again; nothing is dropped, because the inbox folder itself
is the durable backlog. Entries are kept in a heap by the time they are next worth looking at,
so a file that is still being written does not hold up the ones behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class Candidate:
    path: str  # a str, not a Path: one per file noticed (pathlib interns every name)
    inbox: Path
    noticed_s: float
    check_at_s: float  # monotonic time at which it may have settled
    # The file as last seen (inode, size, mtime_ns) and when: settled once it stays the same
    # for inbox.settle_ms, whatever its mtime says (a camera clock can be years ahead).
    observed: tuple[int, int, int] | None = None
    observed_at_s: float = 0.0


class EventBuffer:
    name = "event_buffer"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: dict[str, Candidate] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._order = itertools.count()
        self._changed = asyncio.Event()
        self.high_water = 0

    @property
    def size(self) -> int:
        return len(self._entries)

    def __contains__(self, path: str) -> bool:
        return path in self._entries

    def full(self) -> bool:
        return len(self._entries) >= self.capacity

    def offer(self, path: str, inbox: Path, now_s: float) -> bool | None:
        """Admit a path. True: new; None: already here; False: full (the caller defers it)."""
        if path in self._entries:
            return None
        if self.full():
            return False
        self._push(Candidate(path, inbox, now_s, now_s))
        self.high_water = max(self.high_water, len(self._entries))
        return True

    def retry_later(self, candidate: Candidate, check_at_s: float) -> None:
        """Put back a candidate that has not settled yet (its slot was never given up)."""
        candidate.check_at_s = check_at_s
        self._push(candidate)

    def _push(self, candidate: Candidate) -> None:
        self._entries[candidate.path] = candidate
        heapq.heappush(self._heap, (candidate.check_at_s, next(self._order), candidate.path))
        self._changed.set()

    def pop_due(self, now_s: float) -> Candidate | float | None:
        """The next due candidate; else the time the earliest one is due; None when empty."""
        while self._heap:
            check_at_s, _, path = self._heap[0]
            candidate = self._entries.get(path)
            if candidate is None or candidate.check_at_s != check_at_s:
                heapq.heappop(self._heap)  # stale heap entry of a re-pushed candidate
                continue
            if check_at_s > now_s:
                return check_at_s
            heapq.heappop(self._heap)
            del self._entries[path]
            return candidate
        return None

    async def wait_changed(self, timeout_s: float | None) -> None:
        """Sleep until something is offered or ``timeout_s`` passes."""
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    def clear(self) -> None:
        """Forget everything (shutdown): the files are still on disk, nothing is lost."""
        self._entries.clear()
        self._heap.clear()
