"""Stage 3: queue → read, hash and decode each file (in a decode worker process) → preprocess cache.

The untrusted bytes are never parsed in the daemon: ``decode/pool.py`` runs ``preprocess.workers``
worker processes, each under a memory and a time limit, and every outcome of one file — whatever
a decoder raised, a hang, a crash — comes back as that file's ``PermanentError`` or
``TransientError``. ``workers`` threads here wait on them, so the event loop stays free. Each
worker holds at most one file, so the memory in this stage is bounded by ``workers`` ×
``decode_memory_mb``, and what comes back per file is one crop.

With the model on a GPU, baseline JPEGs are decoded there instead (``decode/device_route.py``:
the header is checked on the CPU first, everything else still goes to the workers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from inboxd import logs
from inboxd.decode.device_route import DeviceRoute
from inboxd.decode.pool import DecodePool
from inboxd.item import PermanentError, TransientError, WorkItem
from inboxd.pipeline.preprocess_cache import PreprocessCache
from inboxd.pipeline.queue import PipelineQueue

Outcome = Callable[[WorkItem, BaseException], Awaitable[None]]


class Preprocessor:
    name = "preprocess"

    def __init__(
        self,
        queue: PipelineQueue,
        cache: PreprocessCache,
        pool: DecodePool,
        workers: int,
        on_error: Outcome,
        existing_sha256: Callable[[str], str | None],
        on_duplicate: Callable[[WorkItem], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
        device_route: DeviceRoute | None = None,
    ) -> None:
        self.queue = queue
        self.cache = cache
        self.pool = pool
        self.workers = workers
        self.on_error = on_error
        self.existing_sha256 = existing_sha256
        self.on_duplicate = on_duplicate
        self.clock = clock
        self.device_route = device_route
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="inboxd-preprocess")
        self.in_progress = 0

    async def run_worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await self.queue.get()
            self.in_progress += 1
            try:
                item.dequeued_s = self.clock()
                try:
                    duplicate = await loop.run_in_executor(self.executor, self._prepare, item)
                except (PermanentError, TransientError) as exc:
                    await self.on_error(item, exc)
                    continue
                if duplicate:
                    await self.on_duplicate(item)
                    continue
                item.preprocessed_s = self.clock()
                await self.cache.put(item)
            finally:
                self.in_progress -= 1
                self.queue.task_done()

    def _prepare(self, item: WorkItem) -> bool:
        """Read, hash and decode one file; True when its result already exists (a rerun after
        a crash between the result and the move, or the same file dropped twice)."""
        expected = self.existing_sha256(item.key)
        result = None
        if self.device_route is not None:
            result = self.device_route.decode(item.claimed_path, expected)
        if result is None:
            result = self.pool.decode(item.claimed_path, expected)
        item.sha256, item.size_bytes = result.sha256, result.size_bytes
        if result.error is not None:
            raise result.error
        if result.duplicate:
            return True
        image = item.image = result.image
        assert image is not None
        item.image_info = {"width": image.width, "height": image.height,
                           "format": image.format, "mode": image.mode}
        logs.emit(logging.DEBUG, "preprocessed", f"preprocessed {item.key}", path=item.key,
                  bytes=item.size_bytes, worker_peak_rss_bytes=result.peak_rss_bytes)
        return False

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.device_route is not None:
            self.device_route.close()
        self.pool.close()
