"""The local engine: the model in one dedicated thread of this process, on its GPU or CPU.

The event loop keeps noticing, claiming and decoding files while a batch is on the GPU
(preprocessing of batch n+1 overlaps inference of batch n). The warm-up runs on that same
thread: cuDNN handles and plan caches are per thread, so warming anywhere else would leave the
first real batch of each size to build them again.

A batch that fails is split in halves and each half retried, so one bad input, a CUDA
out-of-memory at this batch size, or an answer that does not fit the batch (rows, shape, NaN:
``Model.check_answer``) costs only what it must: an input that fails alone *on a
healthy device* fails alone, and an OOM at batch size 1 is a transient error for the retry
list. A device error (``torch.AcceleratorError``, a cuDNN/cuBLAS execution failure) is nobody's
input: it poisons the CUDA context for the whole process, so it is raised as ``DeviceFault``
for the pipeline to return the files and the service to exit for a restart.

On CUDA a call is launched on the model thread and its results collected on a second thread
(``cuda_overlap.py``: pinned staging, a copy stream, events), so a second call in flight can
copy its batch while the first computes. Any failure there sends the batch down the careful
path above, on the model thread; on the CPU that path is the only one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, cast

from inboxd import logs
from inboxd.item import ModelError, TransientError, WorkItem
from inboxd.models.engines.interface import (
    DeviceFault,
    ModelEngine,
    Outcome,
    is_device_error,
    is_out_of_memory,
)
from inboxd.models.predictions import TaskModel
from inboxd.os_threads import name_this_thread

if TYPE_CHECKING:
    from inboxd.models.engines.cuda_overlap import Overlap
    from inboxd.models.fast_path import FastPath

# The CLI looks for a live thread of this name at exit: a hung model call must not keep the
# interpreter waiting for it.
THREAD_NAME_PREFIX = "inboxd-model"


class LocalEngine(ModelEngine):
    def __init__(self, model: TaskModel, overlap: bool | None = None,
                 fast: FastPath | None = None) -> None:
        """``overlap``: launch/collect split (default: on CUDA only; a test forces it).
        ``fast``: a faster runner to bring in (``models/fast_path.py``), swapped in on the
        model thread between two batches."""
        self.model = model
        self.fast = fast
        self.warmed_sizes: set[int] = set()
        self.overlap: Overlap | None = None
        if model.on_gpu and model.batches_overlap if overlap is None else overlap:
            # The launch/collect split drives torch on the device: only a Model wants it (an
            # OcrModel says batches_overlap False), or a test's stand-in for one that forces it.
            # Imported only here: torch is loaded wherever a model runs on CUDA.
            from inboxd.models.engines.cuda_overlap import Overlap
            from inboxd.models.model import Model

            self.overlap = Overlap(cast(Model, model))
        # A thread per batch the model runs at once (CUDA's overlap splits its calls its own
        # way, on the one model thread).
        calls = 1 if self.overlap is not None else model.concurrent_calls
        self.executor = ThreadPoolExecutor(calls, thread_name_prefix=THREAD_NAME_PREFIX,
                                           initializer=name_this_thread)
        if fast is not None:
            fast.on_exported = self._swap_soon
        # Results wait here, so the model thread can launch the next batch meanwhile; a model
        # stage may send a second call while one is out only when that helps (CUDA, or a model
        # that runs whole batches side by side on the CPU).
        self.collector = (ThreadPoolExecutor(1, thread_name_prefix=f"{THREAD_NAME_PREFIX}-results",
                                              initializer=name_this_thread)
                          if self.overlap is not None else None)
        self.parallel_calls = self.overlap is not None or calls > 1
        self.max_calls = None if self.overlap is not None else calls

    async def warm_up(self, max_size: int) -> tuple[list[int], float]:
        """Warm the batch sizes up to ``max_size`` not warmed yet, on the inference thread.
        Returns those sizes and the seconds it took."""
        loop = asyncio.get_running_loop()
        sizes = [s for s in self.model.warm_up_sizes(max_size) if s not in self.warmed_sizes]
        seconds = 0.0
        if sizes:
            seconds = await loop.run_in_executor(self.executor, self.model.warm_up, sizes)
            self.warmed_sizes.update(sizes)
        if self.fast is not None and self.fast.state == "pending":
            # After the warm-up, which it would slow down; in the background, so torch serves
            # meanwhile, even the first batch.
            self.fast.start()
        return sizes, seconds

    async def infer(self, batch: list[WorkItem]) -> list[Outcome]:
        if self.overlap is not None:
            outcomes = await self._overlapped(batch)
            if outcomes is not None:
                return outcomes
            # Failed: the call's frames (its input, its activations) went with the coroutine
            # above, so the careful path runs the batch again with nothing of it held.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self._infer_here, batch)

    def _swap_soon(self) -> None:
        """From the build thread: swap on the model thread after the batch it runs now."""
        assert self.fast is not None
        with contextlib.suppress(RuntimeError):  # shut down meanwhile: nothing left to serve
            self.executor.submit(self.fast.swap_if_built)

    def _infer_here(self, batch: list[WorkItem]) -> list[Outcome]:
        """On the model thread: between the previous batch and this one is where a built fast
        runner is swapped in, so a batch never straddles two runners."""
        if self.fast is not None:
            self.fast.swap_if_built()
        return infer_splitting(self.model, batch)

    async def _overlapped(self, batch: list[WorkItem]) -> list[Outcome] | None:
        """Launch on the model thread, collect on the results thread; None when anything
        failed (an OOM, a model error, a device error: the careful path sorts them out)."""
        assert self.overlap is not None and self.collector is not None
        loop = asyncio.get_running_loop()
        try:
            pending = await loop.run_in_executor(self.executor, self.overlap.launch, batch)
            return await loop.run_in_executor(self.collector, pending.collect)
        except Exception:
            return None

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.collector is not None:
            self.collector.shutdown(wait=False, cancel_futures=True)


def infer_splitting(model: TaskModel, items: list[WorkItem]) -> list[Outcome]:
    """Run ``items`` through the model, halving the batch on failure until each input either
    has a result or an error of its own. Raises ``DeviceFault`` when the device is at fault."""
    started = time.perf_counter()
    try:
        predictions = model.predict([model.input_of(item.image) for item in items
                                     if item.image is not None])
        # Inside the try: an answer that does not pair up with the batch (``UnfitAnswer``,
        # or a count that does not match) is this batch's model error, never a crash.
        outcomes: list[Outcome] = list(zip(items, predictions, strict=True))
    except Exception as exc:  # sorted out below: out of memory, the device's fault, or an input's
        kind = ("oom" if is_out_of_memory(exc) else
                "device" if is_device_error(exc) else "model")
        why = repr(exc) if kind == "model" else (
            str(exc) if kind == "oom" else f"{type(exc).__name__}: {exc}")
    else:
        elapsed_ms = (time.perf_counter() - started) * 1000
        for item in items:
            item.inference_ms = elapsed_ms
            item.runtime, item.precision = model.runtime, model.precision
        return outcomes
    # Only now, out of the handler, is the exception gone, and with its traceback the frames of
    # the failed call: its input and activations. Retrying from inside the handler would run
    # the halves with the whole batch's memory still held (and cascade to size 1 on a GPU).
    if kind == "device":
        raise DeviceFault(why)
    if len(items) > 1:
        return _halves(model, items,
                       "CUDA out of memory" if kind == "oom" else f"model error {why}")
    if kind == "oom":
        return [(items[0], TransientError(f"CUDA out of memory at batch size 1: {why}"))]
    sick = model.health_problem()
    if sick is not None:
        raise DeviceFault(f"{why} on one input, and a blank image fails too ({sick}): the "
                          "device or the model is broken, not the input")
    return [(items[0], ModelError(f"the model failed on this input: {why}"))]


def _halves(model: TaskModel, items: list[WorkItem], why: str) -> list[Outcome]:
    middle = len(items) // 2
    logs.emit(logging.WARNING, "batch_split", f"{why} at batch size {len(items)}: retrying as "
              f"{middle} + {len(items) - middle}", batch_size=len(items), reason=why)
    return infer_splitting(model, items[:middle]) + infer_splitting(model, items[middle:])
