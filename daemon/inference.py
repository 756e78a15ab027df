"""Stage 5: the model worker. Batches from the batcher → the model → the result writer.

The model runs in one dedicated thread, so the event loop keeps noticing, claiming and decoding
files while a batch is on the GPU (preprocessing of batch n+1 overlaps inference of batch n).
A batch that fails is split in halves and each half retried, so one bad input or a CUDA
out-of-memory at this batch size costs only what it must: an input that fails alone fails
alone, and an OOM at batch size 1 is a transient error for the retry list.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from daemon import logs
from daemon.batcher import Batcher
from daemon.item import PermanentError, TransientError, WorkItem
from daemon.model import Model, Prediction

Outcome = tuple[WorkItem, Prediction | Exception]


def infer_splitting(model: Model, items: list[WorkItem]) -> list[Outcome]:
    """Run ``items`` through the model, halving the batch on failure until each input either
    has a result or an error of its own."""
    images = [item.image.pixels for item in items if item.image is not None]
    started = time.perf_counter()
    try:
        predictions = model.predict(images)
    except torch.cuda.OutOfMemoryError as exc:
        if len(items) == 1:
            return [(items[0], TransientError(f"CUDA out of memory at batch size 1: {exc}"))]
        return _halves(model, items, "CUDA out of memory")
    except Exception as exc:  # a model error on one input must fail that input only
        if len(items) == 1:
            return [(items[0], PermanentError(f"the model failed on this input: {exc!r}"))]
        return _halves(model, items, f"model error {exc!r}")
    elapsed_ms = (time.perf_counter() - started) * 1000
    for item in items:
        item.inference_ms = elapsed_ms
    return list(zip(items, predictions, strict=True))


def _halves(model: Model, items: list[WorkItem], why: str) -> list[Outcome]:
    middle = len(items) // 2
    logs.emit(logging.WARNING, "batch_split", f"{why} at batch size {len(items)}: retrying as "
              f"{middle} + {len(items) - middle}", batch_size=len(items), reason=why)
    return infer_splitting(model, items[:middle]) + infer_splitting(model, items[middle:])


class ModelWorker:
    def __init__(
        self,
        model: Model,
        batcher: Batcher,
        deliver: Callable[[list[Outcome]], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.batcher = batcher
        self.deliver = deliver
        self.clock = clock
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="inboxd-model")
        self.batches_done = 0
        # When the batch now on the model started (None: idle). The watchdog reads it: a model
        # call that never returns must stop the WATCHDOG=1 pings so systemd restarts us.
        self.busy_since_s: float | None = None
        self.in_hand = 0  # items taken from the cache and not yet delivered

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self.batcher.next_batch()
            self.in_hand = len(batch)
            self.busy_since_s = self.clock()
            try:
                outcomes = await loop.run_in_executor(self.executor, self._infer, batch)
            finally:
                self.busy_since_s = None
            self.batches_done += 1
            await self.deliver(outcomes)
            self.in_hand = 0

    def _infer(self, batch: list[WorkItem]) -> list[Outcome]:
        outcomes = infer_splitting(self.model, batch)
        now = self.clock()
        for item, _ in outcomes:
            item.inferred_s = now
            item.image = None  # the pixels are done with: free them before the write
        return outcomes

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
