"""The ``committing`` layer: batches the result writer handed to the commit process
(``files.commit_process``) and that are not answered yet. Its own module because it is its own
layer in the stats record (the README's stage table: commit), though the result writer fills it."""

from __future__ import annotations

import asyncio
from typing import Any

COMMITS_IN_FLIGHT = 2


class Committing:
    """The layer of batches handed to the commit process and not answered yet."""

    name = "committing"
    capacity = COMMITS_IN_FLIGHT

    def __init__(self) -> None:
        self.writes: set[asyncio.Task[None]] = set()
        self.high_water = 0

    @property
    def size(self) -> int:
        return len(self.writes)

    def add(self, write: asyncio.Task[None]) -> None:
        self.writes.add(write)
        self.high_water = max(self.high_water, len(self.writes))

    async def reap(self, also: asyncio.Future[Any] | None = None) -> None:
        """Wait for a write to end (or ``also``); a write that crashed crashes the stage."""
        done, _ = await asyncio.wait({*self.writes, *filter(None, [also])},
                                     return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task in self.writes:
                self.writes.discard(task)
                task.result()
