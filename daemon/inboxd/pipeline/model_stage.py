"""Stage 5: the model stage. Batches from the batcher → the model engine → the result writer.

Where the model runs is the engine's business (``inboxd.models.engine``); this stage only takes
one batch at a time, remembers since when the engine has had it (the watchdog reads that), and
hands every outcome on. When the engine reports a ``DeviceFault`` (the device, not an input,
failed) the stage stops using the model: that batch and every later one go back to the inbox
uncounted (no attempt spent, nothing to failed/), and ``on_device_fault`` tells the service to
stop and exit for a restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from inboxd import logs
from inboxd.item import WorkItem
from inboxd.models.engine import DeviceFault, ModelEngine, Outcome
from inboxd.pipeline.batcher import Batcher


class ModelWorker:
    def __init__(
        self,
        engine: ModelEngine,
        batcher: Batcher,
        deliver: Callable[[list[Outcome]], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
        release: Callable[[WorkItem, str], Awaitable[None]] | None = None,
        on_device_fault: Callable[[DeviceFault], None] = lambda fault: None,
        on_inferred: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        self.engine = engine
        self.on_inferred = on_inferred  # the seconds each engine call took (stats, metrics)
        self.release = release
        self.on_device_fault = on_device_fault
        self.device_fault: DeviceFault | None = None
        self.batcher = batcher
        self.deliver = deliver
        self.clock = clock
        self.batches_done = 0
        # When the batch now on the model started (None: idle). The watchdog reads it: a model
        # call that never returns must stop the WATCHDOG=1 pings so systemd restarts us.
        self.busy_since_s: float | None = None
        self.in_hand = 0  # items taken from the cache and not yet delivered

    async def run(self) -> None:
        while True:
            batch = await self.batcher.next_batch()
            self.in_hand = len(batch)
            if self.device_fault is not None:
                await self._give_back(batch, self.device_fault)
                continue
            started_s = self.busy_since_s = self.clock()
            try:
                outcomes = await self.engine.infer(batch)
            except DeviceFault as fault:
                self._device_failed(fault)
                await self._give_back(batch, fault)
                continue
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

    def _device_failed(self, fault: DeviceFault) -> None:
        self.device_fault = fault
        logs.emit(logging.CRITICAL, "device_fault",
                  f"the model's device failed: {fault}. The CUDA context of this process cannot "
                  "be trusted any more: returning the files in flight to the inbox and exiting "
                  "so that a new process gets a fresh context", error=str(fault))
        self.on_device_fault(fault)

    async def _give_back(self, batch: list[WorkItem], fault: DeviceFault) -> None:
        if self.release is None:
            raise fault  # nobody to hand the files to: a crash, and the claims are recovered
        for item in batch:
            await self.release(item, "the device failed, not this file")
        self.in_hand = 0

    def close(self) -> None:
        self.engine.close()
