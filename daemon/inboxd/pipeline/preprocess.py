"""Preprocess: queue → read, hash, decode each file (in a decode worker) → preprocess cache.

The untrusted bytes are never parsed in the daemon: ``decode/pool.py`` runs ``preprocess.workers``
worker processes, each under a memory and a time limit, and every outcome of one file — whatever
a decoder raised, a hang, a crash — comes back as that file's ``PermanentError`` or
``TransientError``. ``REQUESTS_PER_WORKER`` × ``workers`` decoders here (a coroutine and a
thread each) wait on them, so the event loop stays free; each takes up to ``files_per_request``
files from the queue and hands them to a worker in one request (one hop to a thread and one
round trip per request, not per file). Each worker decodes one file at a time, so the memory in
this stage is bounded by ``workers`` × ``decode_memory_mb``, plus at most ``REQUESTS_PER_WORKER``
× ``workers`` × ``files_per_request`` crops waiting for room in the cache.

With the model on a GPU, baseline JPEGs are decoded there instead (``decode/device_route.py``:
the header is checked on the CPU first, everything else still goes to the workers). A request's
JPEGs go to the device one after another, each batched with those of the other decoders
(``TensorDecoder``), before its other files go to the worker.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from inboxd import logs
from inboxd.decode.device_route import DeviceRoute
from inboxd.decode.pool import DecodePool
from inboxd.decode.replies import DecodeResult, DecodeTimedOut
from inboxd.item import PermanentError, TransientError, WorkItem
from inboxd.os_threads import name_this_thread
from inboxd.pipeline.preprocess_cache import PreprocessCache
from inboxd.pipeline.queue import PipelineQueue

Outcome = Callable[[WorkItem, BaseException], Awaitable[None]]
Release = Callable[[WorkItem, str], Awaitable[None]]

# A claimed file whose writer paused longer than inbox.settle_ms: what was read is not all of it.
CHANGING_REASON = ("it changed after it was claimed (still being written); it is taken again "
                   "once it settles")


class Prepared(enum.Enum):
    DECODED = "decoded"  # its crop is on the item
    DUPLICATE = "duplicate"  # a result of these bytes exists already
    CHANGING = "changing"  # still being written: back to the inbox to settle


# Two decoders per worker: while one request is decoded, the next is ready behind it (its files'
# earlier results looked up, its thread waiting for the worker), and the worker starts on it the
# moment it has answered its last file. With one, the worker idled meanwhile, while the event
# loop handed the outcomes on (docs/decisions.md, "Two decoders per decode worker").
REQUESTS_PER_WORKER = 2


def decoders_for(workers: int) -> int:
    """The decoders (a coroutine and a thread each) the stage runs for ``workers``."""
    return workers * REQUESTS_PER_WORKER


class Preprocessor:
    """The preprocess stage: files from the queue to the decode workers and on into the cache.
    Its tasks, its threads, its time in each result's ``timings_ms`` and its layer in the stats
    are all called ``preprocess``."""

    name = "preprocess"  # the layer: files taken from the queue, not yet in the cache

    def __init__(
        self,
        queue: PipelineQueue,
        cache: PreprocessCache,
        pool: DecodePool,
        workers: int,
        files_per_request: int,
        on_error: Outcome,
        existing_sha256: Callable[[str], str | None],
        on_duplicate: Callable[[WorkItem], Awaitable[None]],
        on_changing: Release,
        clock: Callable[[], float] = time.monotonic,
        device_route: DeviceRoute | None = None,
        open_claimed: Callable[[str], int] | None = None,
    ) -> None:
        self.queue = queue
        self.cache = cache
        self.pool = pool
        self.workers = workers
        self.files_per_request = files_per_request
        self.on_error = on_error
        self.existing_sha256 = existing_sha256
        self.on_duplicate = on_duplicate
        self.on_changing = on_changing
        self.clock = clock
        self.device_route = device_route
        self.open_claimed = open_claimed
        self.decoders = decoders_for(workers)  # run_worker tasks the pipeline starts
        self.executor = ThreadPoolExecutor(self.decoders, thread_name_prefix="inboxd-preprocess",
                                           initializer=name_this_thread)
        self.in_progress = 0
        self.high_water = 0
        # The files of a request whose handling raised: what the crash ledger counts.
        self.crashed_with: list[WorkItem] = []

    async def run_worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = await self._take()
            self.in_progress += len(items)
            self.high_water = max(self.high_water, self.in_progress)
            handed_on = 0
            try:
                now_s = self.clock()
                for item in items:
                    item.dequeued_s = now_s
                outcomes = await loop.run_in_executor(self.executor, self._prepare_all, items)
                # When the request was done, for all of them: a wait for room in the cache is
                # the batch's wait, not this stage's.
                done_s = self.clock()
                for item, outcome in zip(items, outcomes, strict=True):
                    if isinstance(outcome, Exception):
                        await self.on_error(item, outcome)
                    elif outcome is Prepared.DUPLICATE:
                        await self.on_duplicate(item)
                    elif outcome is Prepared.CHANGING:
                        await self.on_changing(item, CHANGING_REASON)
                    else:
                        item.preprocessed_s = done_s
                        await self.cache.put(item)
                    handed_on += 1
                    self.in_progress -= 1
                    self.queue.task_done()
            except Exception:
                self.crashed_with = list(items)
                raise
            finally:
                for _ in range(len(items) - handed_on):  # cancelled: they stay claimed on disk
                    self.in_progress -= 1
                    self.queue.task_done()

    @property
    def size(self) -> int:
        return self.in_progress

    @property
    def capacity(self) -> int:
        return self.decoders * self.files_per_request

    async def _take(self) -> list[WorkItem]:
        """The next file, and as many more as a fair share of what waits allows (every decoder
        gets some of a short queue), up to ``files_per_request``: one request for them all."""
        items = [await self.queue.get()]
        share = min(self.files_per_request, -(-(self.queue.qsize() + 1) // self.workers))
        while len(items) < share and not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items

    def _prepare_all(self, items: list[WorkItem]
                     ) -> list[Prepared | PermanentError | TransientError]:
        """Read, hash and decode each file: what came of it (DUPLICATE: a rerun after a crash
        between the result and the move, or the same file dropped twice), or why it failed."""
        expected = [self.existing_sha256(item.key) for item in items]
        routed = [self._on_device(item, sha256) for item, sha256 in zip(items, expected,
                                                                        strict=True)]
        on_cpu = [(item.claimed_path, sha256)
                  for item, sha256, result in zip(items, expected, routed, strict=True)
                  if result is None]
        opened = [self._open(path) for path, _ in on_cpu]
        try:
            decoded = self.pool.decode_many(on_cpu, opened) if on_cpu else []
        except TransientError as exc:  # the pool is closed or cannot start workers
            # Only the CPU files' outcome: a file decoded on the device has its crop already.
            decoded = [DecodeResult(None, None, error=exc) for _ in on_cpu]
        finally:
            for fd in opened:
                if fd is not None:
                    os.close(fd)
        assert len(decoded) == len(on_cpu), "one outcome per file sent to the pool"
        from_pool = iter(decoded)
        return [self._outcome(item, next(from_pool) if result is None else result)
                for item, result in zip(items, routed, strict=True)]

    def _open(self, claimed: str) -> int | None:
        """The claimed file held open by descriptor while a worker reads it: the worker reopens
        it through this process's /proc, so a member of the group renaming ``.processing``
        meanwhile cannot make it fail. None where it cannot be opened here: the worker tries
        the path, and its error is the file's outcome as before."""
        if self.open_claimed is None:
            return None
        try:
            return self.open_claimed(claimed)
        except OSError:  # a link, a member's folder at .processing (LinkedFolder), gone
            return None

    def _on_device(self, item: WorkItem, expected_sha256: str | None) -> DecodeResult | None:
        """The file's outcome from the device path, or None (the CPU path takes it). A surprise
        there costs this file an attempt, not the stage: a crash would leave every file of the
        request with a strike in the crash ledger."""
        if self.device_route is None:
            return None
        try:
            return self.device_route.decode(item.claimed_path, expected_sha256)
        except Exception as exc:
            logs.emit(logging.ERROR, "device_decode", f"the device path failed on {item.key}: "
                      f"{exc!r}", path=item.key, error=repr(exc))
            return DecodeResult(None, None, error=TransientError(
                f"the device decode path failed: {exc!r}"))

    def _outcome(self, item: WorkItem, result: DecodeResult
                 ) -> Prepared | PermanentError | TransientError:
        item.sha256, item.size_bytes = result.sha256, result.size_bytes
        if isinstance(result.error, DecodeTimedOut):
            item.decode_timeouts += 1
            if item.decode_timeouts > 1:  # not a starved or stopped machine: this file
                return PermanentError(f"{result.error} (the second time)")
        if result.error is not None:
            return result.error
        if result.still_being_written(item.identity):
            return Prepared.CHANGING
        if result.duplicate:
            return Prepared.DUPLICATE
        image = item.image = result.image
        assert image is not None
        item.image_info = {"width": image.width, "height": image.height,
                           "format": image.format, "mode": image.mode}
        logs.emit(logging.DEBUG, "preprocessed", f"preprocessed {item.key}", path=item.key,
                  bytes=item.size_bytes, worker_peak_rss_bytes=result.peak_rss_bytes)
        return Prepared.DECODED

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.device_route is not None:
            self.device_route.close()
        self.pool.close()
