"""Stage 5: the model stage. Batches from the batcher → the model engine → the result writer.

Where the model runs is the engine's business (``inboxd.models.engine``); this stage only takes
one batch at a time, remembers since when the engine has had it (the watchdog reads that), and
hands every outcome on.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from inboxd.models.engine import ModelEngine, Outcome
from inboxd.pipeline.batcher import Batcher


class ModelWorker:
    def __init__(
        self,
        engine: ModelEngine,
        batcher: Batcher,
        deliver: Callable[[list[Outcome]], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
        on_inferred: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        self.engine = engine
        self.batcher = batcher
        self.deliver = deliver
        self.clock = clock
        self.on_inferred = on_inferred  # the seconds each engine call took (stats, metrics)
        self.batches_done = 0
        # When the batch now on the model started (None: idle). The watchdog reads it: a model
        # call that never returns must stop the WATCHDOG=1 pings so systemd restarts us.
        self.busy_since_s: float | None = None
        self.in_hand = 0  # items taken from the cache and not yet delivered

    async def run(self) -> None:
        while True:
            batch = await self.batcher.next_batch()
            self.in_hand = len(batch)
            started_s = self.busy_since_s = self.clock()
            try:
                outcomes = await self.engine.infer(batch)
            finally:
                self.busy_since_s = None
            now = self.clock()
            self.on_inferred(now - started_s)
            for item, _ in outcomes:
                item.inferred_s = now
                item.image = None  # the pixels are done with: free them before the write
            self.batches_done += 1
            await self.deliver(outcomes)
            self.in_hand = 0

    def close(self) -> None:
        self.engine.close()
