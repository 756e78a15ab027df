"""The decoding layer with several files per request, against a scripted pool and device route:
each file's outcome stays its own when the pool gives up mid-request, and a shutdown that
cancels a decoder mid-request leaves its counters (``in_progress``, the queue's unfinished
tasks) as if those files had never been taken."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from inboxd.decode.replies import DecodeResult
from inboxd.item import DecodedImage, TransientError, WorkItem
from inboxd.pipeline.preprocess import Preprocessor
from inboxd.pipeline.preprocess_cache import PreprocessCache
from inboxd.pipeline.queue import PipelineQueue

from tests.pipeline.test_layers import item


def crop() -> DecodedImage:
    return DecodedImage(np.zeros((2, 2, 3), np.uint8), 2, 2, "JPEG", "RGB")


class GpuRoute:
    """Decodes every ``gpu-*`` file itself; the rest take the pool."""

    def decode(self, path: Path, expected: str | None) -> DecodeResult | None:
        return DecodeResult("1" * 64, 1, image=crop()) if path.name.startswith("gpu") else None

    def close(self) -> None:
        pass


class FailingPool:
    """A pool that is closed or cannot start workers: ``decode_many`` raises."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    def decode_many(self, files: Sequence[tuple[Path, str | None]],
                    opened: Sequence[int | None] = ()) -> list[DecodeResult]:
        self.asked.append([path.name for path, _ in files])
        raise TransientError("cannot start a decode worker: EAGAIN")

    def close(self) -> None:
        pass


class BlockingPool:
    """Answers once ``release`` is set (a decode still running in its thread)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def decode_many(self, files: Sequence[tuple[Path, str | None]],
                    opened: Sequence[int | None] = ()) -> list[DecodeResult]:
        self.entered.set()
        self.release.wait(10)
        return [DecodeResult("0" * 64, 1, image=crop()) for _ in files]

    def close(self) -> None:
        self.release.set()


def preprocessor(queue: PipelineQueue, cache: PreprocessCache, pool: Any,
                 errors: dict[str, BaseException], route: Any = None,
                 per_request: int = 8) -> Preprocessor:
    async def on_error(work: WorkItem, exc: BaseException) -> None:
        errors[work.key] = exc

    async def on_duplicate(work: WorkItem) -> None:
        raise AssertionError("no file here has a result yet")

    async def on_changing(work: WorkItem, why: str) -> None:
        raise AssertionError("no file here is still being written")

    return Preprocessor(queue, cache, pool, 1, per_request, on_error=on_error,
                        existing_sha256=lambda key: None, on_duplicate=on_duplicate,
                        on_changing=on_changing, device_route=route)


def test_files_decoded_on_the_device_keep_their_crops_when_the_pool_gives_up() -> None:
    """A request mixing device and CPU files: the pool's TransientError is the CPU files'
    outcome, not the device-decoded ones' (they used to be thrown away and decoded again)."""
    async def scenario() -> None:
        queue, cache = PipelineQueue(16), PreprocessCache(capacity=16, capacity_mb=16)
        pool, errors = FailingPool(), {}
        pre = preprocessor(queue, cache, pool, errors, route=GpuRoute())
        names = ["gpu-a.jpg", "cpu-b.png", "gpu-c.jpg", "cpu-d.png"]
        for name in names:
            queue.put_nowait(item(name))
        decoder = asyncio.create_task(pre.run_worker())
        await asyncio.wait_for(queue.join(), 5)
        decoder.cancel()
        pre.close()
        assert pool.asked == [["cpu-b.png", "cpu-d.png"]]
        assert sorted(errors) == ["cpu-b.png", "cpu-d.png"]
        assert all(isinstance(e, TransientError) for e in errors.values())
        cached = [cache.take_nowait() for _ in range(cache.size)]
        assert [w.key for w in cached if w is not None] == ["gpu-a.jpg", "gpu-c.jpg"]

    asyncio.run(scenario())


def test_a_decoder_cancelled_while_its_request_runs_leaves_the_counters_consistent() -> None:
    async def scenario() -> None:
        queue, cache = PipelineQueue(16), PreprocessCache(capacity=16, capacity_mb=16)
        pool, errors = BlockingPool(), {}
        pre = preprocessor(queue, cache, pool, errors, per_request=4)
        for n in range(6):
            queue.put_nowait(item(f"f{n}.png"))
        decoder = asyncio.create_task(pre.run_worker())
        while not pool.entered.is_set():
            await asyncio.sleep(0.01)
        assert pre.in_progress == 4
        decoder.cancel()  # shutdown: the four stay claimed on disk
        await asyncio.gather(decoder, return_exceptions=True)
        pre.close()
        assert pre.in_progress == 0 and not errors and cache.size == 0
        assert queue._unfinished_tasks == queue.qsize() == 2  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_a_decoder_cancelled_waiting_for_cache_room_leaves_the_counters_consistent() -> None:
    async def scenario() -> None:
        queue, cache = PipelineQueue(16), PreprocessCache(capacity=2, capacity_mb=16)
        pool, errors = BlockingPool(), {}
        pool.release.set()
        pre = preprocessor(queue, cache, pool, errors, per_request=5)
        for n in range(5):
            queue.put_nowait(item(f"f{n}.png"))
        queue.put_nowait(item("later.png"))
        decoder = asyncio.create_task(pre.run_worker())
        while cache.size < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the third waits for room
        assert pre.in_progress == 3
        decoder.cancel()
        await asyncio.gather(decoder, return_exceptions=True)
        pre.close()
        # Two handed on to the cache, three cancelled (claimed on disk), one never taken.
        assert pre.in_progress == 0 and cache.size == 2 and not errors
        assert queue._unfinished_tasks == queue.qsize() == 1  # type: ignore[attr-defined]

    asyncio.run(scenario())
