"""The local engine: the model in one dedicated thread of this process, on its GPU or CPU.

The event loop keeps noticing, claiming and decoding files while a batch is on the GPU
(preprocessing of batch n+1 overlaps inference of batch n). A batch that fails is split in
halves and each half retried, so one bad input or a CUDA out-of-memory at this batch size costs
only what it must: an input that fails alone fails alone, and an OOM at batch size 1 is a
transient error for the retry list.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from inboxd import logs
from inboxd.item import PermanentError, TransientError, WorkItem
from inboxd.models.engine import Outcome
from inboxd.models.model import Model

# The CLI looks for a live thread of this name at exit: a hung model call must not keep the
# interpreter waiting for it.
THREAD_NAME_PREFIX = "inboxd-model"


class LocalEngine:
    def __init__(self, model: Model) -> None:
        self.model = model
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME_PREFIX)

    async def infer(self, batch: list[WorkItem]) -> list[Outcome]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, infer_splitting, self.model, batch)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


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
