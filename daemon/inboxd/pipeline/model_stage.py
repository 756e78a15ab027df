"""The model stage. Batches from the batcher → the model engine → the result writer.

Where the model runs is the engine's business (``inboxd.models.engines.interface``); this stage
keeps at most ``in_flight`` batches sent and unanswered (one for the local engine running torch
on the CPU; up to ``capacity.in_flight_batches`` for an engine with ``parallel_calls``: the local
engine on CUDA, where a second call's copy overlaps the first's compute, and Ray's; on a CPU
serving the cached ONNX Runtime artifact with a bound of at least the cores, one per core,
each call single-threaded on its own model thread).
While every slot is taken, the batcher is not asked for another batch: the wait reaches the
preprocess cache, the decoders and ``await queue.put()``, exactly as a busy local GPU does. The
bound is this stage's, never a remote queue's.

It remembers since when the oldest call has been out (the watchdog reads that), and hands every
outcome on. When the engine reports a ``DeviceFault`` (the device, not an input, failed) the stage
stops using the model: that batch and every later one go back to the inbox uncounted (no attempt
spent, nothing to failed/), and ``on_device_fault`` tells the service to stop and exit for a
restart. When the engine is unavailable (a Ray cluster that is gone) the stage holds the batch,
waits the engine's ``retry_after_s`` and sends it again: no attempt spent, the backlog on disk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from inboxd import logs
from inboxd.item import WorkItem
from inboxd.models.engines.interface import (
    DeviceFault,
    EngineUnavailable,
    ModelEngine,
    Outcome,
    calls_out,
)
from inboxd.pipeline.batcher import Batcher

# However soon an unavailable engine says to try again: no hot loop.
MIN_UNAVAILABLE_WAIT_S = 0.2


class ModelStage:
    def __init__(
        self,
        engine: ModelEngine,
        batcher: Batcher,
        deliver: Callable[[list[Outcome]], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
        release: Callable[[WorkItem, str], Awaitable[None]] | None = None,
        on_device_fault: Callable[[DeviceFault], None] = lambda fault: None,
        on_inferred: Callable[[float], None] = lambda seconds: None,
        in_flight: int = 1,
        name: str = "model",
    ) -> None:
        # The layer: batches sent to the engine and not answered yet (``model_<task>`` for a
        # task of a models: config; ``in_flight`` until 0.3.0).
        self.name = name
        self.engine = engine
        self.on_inferred = on_inferred  # the seconds each engine call took (stats, metrics)
        self.release = release
        self.on_device_fault = on_device_fault
        self.device_fault: DeviceFault | None = None
        self.batcher = batcher
        self.deliver = deliver
        self.clock = clock
        self.batches_done = 0
        self.max_in_flight = calls_out(engine, in_flight)
        self.high_water = 0
        self._calls: set[asyncio.Task[None]] = set()
        # When each call now on the engine started. The watchdog reads the oldest: a model call
        # that never returns must stop the WATCHDOG=1 pings so systemd restarts us.
        self._busy: dict[int, float] = {}
        self.in_hand = 0  # items taken from the cache and not yet delivered
        # The batch of a call that raised (a bug, not an input's error, which is an outcome):
        # the crash ledger counts these files, not every file claimed at the time.
        self.crashed_with: list[WorkItem] = []
        # Since when the engine has been unavailable (None: it is not), and how often.
        self.unavailable_since_s: float | None = None
        self.unavailable_waits = 0

    @property
    def size(self) -> int:
        return len(self._calls)

    @property
    def capacity(self) -> int:
        return self.max_in_flight

    @property
    def busy_since_s(self) -> float | None:
        return min(self._busy.values(), default=None)

    def call_limit_s(self, patience_s: float) -> float:
        """How long one call may be out before it is a stall: ``patience_s``, or the engine's
        own limit on a call (``call_limit_s``, for an engine that times its calls out itself)
        when that is longer."""
        return max(patience_s, self.engine.call_limit_s)

    def overdue_s(self, patience_s: float) -> float | None:
        """Seconds the oldest call has been out, once that is past ``call_limit_s``; None while
        nothing is overdue."""
        since = self.busy_since_s
        if since is None:
            return None
        busy_s = self.clock() - since
        return busy_s if busy_s >= self.call_limit_s(patience_s) else None

    def resize(self, in_flight: int) -> None:
        """SIGHUP: a new bound; calls already out finish, the next wait for a free slot."""
        self.max_in_flight = calls_out(self.engine, in_flight)

    async def run(self) -> None:
        getter: asyncio.Future[Any] | None = None
        try:
            while True:
                while len(self._calls) >= self.max_in_flight:
                    await self._reap({*self._calls})
                getter = asyncio.ensure_future(self.batcher.next_batch())
                while not getter.done():
                    await self._reap({getter, *self._calls})
                batch = getter.result()
                getter = None
                # A SIGHUP may have lowered the bound while the batch was forming.
                while len(self._calls) >= self.max_in_flight:
                    await self._reap({*self._calls})
                call = asyncio.create_task(self._call(batch), name="model-call")
                self._calls.add(call)
                self.high_water = max(self.high_water, len(self._calls))
        finally:
            if getter is not None:
                getter.cancel()
            for call in self._calls:
                call.cancel()

    async def _reap(self, tasks: set[asyncio.Future[Any]]) -> None:
        """Wait for one of ``tasks``; a call that crashed crashes the stage."""
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task in self._calls:
                self._calls.discard(task)
                task.result()

    async def _call(self, batch: list[WorkItem]) -> None:
        self.in_hand += len(batch)
        try:
            outcomes = await self._infer(batch)
            if outcomes is None:
                return
            now = self.clock()
            for item, _ in outcomes:
                item.inferred_s = now
                item.image = None  # the pixels are done with: free them before the write
            self.batches_done += 1
            await self.deliver(outcomes)
        except Exception:
            self.crashed_with = list(batch)
            raise
        finally:
            self.in_hand -= len(batch)

    async def _infer(self, batch: list[WorkItem]) -> list[Outcome] | None:
        while True:
            if self.device_fault is not None:
                await self._give_back(batch, self.device_fault)
                return None
            token = id(batch)
            started_s = self._busy[token] = self.clock()
            try:
                outcomes = await self.engine.infer(batch)
            except DeviceFault as fault:
                self._device_failed(fault)
                continue
            except EngineUnavailable as gone:
                self._busy.pop(token, None)  # waiting for the cluster is not a hung call
                await self._wait_available(gone)
                continue
            finally:
                self._busy.pop(token, None)
            self._available()
            self.on_inferred(self.clock() - started_s)
            return outcomes

    async def _wait_available(self, gone: EngineUnavailable) -> None:
        self.unavailable_waits += 1
        if self.unavailable_since_s is None:
            self.unavailable_since_s = self.clock()
            logs.emit(logging.ERROR, "model_unavailable",
                      f"the model cannot be reached: {gone}. The batches in flight are held "
                      "and sent again when it is back; new files wait in the inbox",
                      error=str(gone))
        await asyncio.sleep(max(MIN_UNAVAILABLE_WAIT_S, gone.retry_after_s))

    def _available(self) -> None:
        if self.unavailable_since_s is None:
            return
        down_s = self.clock() - self.unavailable_since_s
        self.unavailable_since_s = None
        logs.emit(logging.WARNING, "model_available",
                  f"the model is reachable again after {down_s:.1f} s", down_s=round(down_s, 3))

    def _device_failed(self, fault: DeviceFault) -> None:
        if self.device_fault is not None:
            return
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

    def close(self) -> None:
        self.engine.close()
