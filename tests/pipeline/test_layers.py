"""Each bounded layer on its own: it holds at most its capacity and says what it did."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from inboxd.config import RetryPolicyConfig
from inboxd.decode.replies import DecodeResult
from inboxd.item import DecodedImage, PermanentError, WorkItem
from inboxd.pipeline.batcher import Batcher
from inboxd.pipeline.event_buffer import Candidate, EventBuffer
from inboxd.pipeline.preprocess import Preprocessor
from inboxd.pipeline.preprocess_cache import MB, PreprocessCache
from inboxd.pipeline.queue import PipelineQueue
from inboxd.pipeline.retry_list import RetryList, backoff_s


def item(name: str = "a.jpg", nbytes: int = 0) -> WorkItem:
    work = WorkItem(Path("/in"), name, name, Path("/in/.processing/default") / name)
    if nbytes:
        pixels = np.zeros(nbytes, dtype=np.uint8)
        work.image = DecodedImage(pixels, 1, 1, "PNG", "RGB")  # type: ignore[arg-type]
    return work


def test_event_buffer_deduplicates_and_defers_when_full() -> None:
    buffer = EventBuffer(capacity=2)
    inbox = Path("/in")
    assert buffer.offer("/in/a", inbox, 0.0) is True
    assert buffer.offer("/in/a", inbox, 0.0) is None  # already there
    assert buffer.offer("/in/b", inbox, 0.0) is True
    assert buffer.offer("/in/c", inbox, 0.0) is False  # full: the caller defers it
    assert (buffer.size, buffer.high_water) == (2, 2)


def test_event_buffer_does_not_let_an_unsettled_file_hold_up_others() -> None:
    buffer = EventBuffer(capacity=4)
    inbox = Path("/in")
    buffer.offer("/in/slow", inbox, 0.0)
    buffer.offer("/in/fast", inbox, 0.1)
    slow = buffer.pop_due(1.0)
    assert isinstance(slow, Candidate) and slow.path == "/in/slow"
    buffer.retry_later(slow, check_at_s=5.0)  # still being written
    fast = buffer.pop_due(1.0)
    assert isinstance(fast, Candidate) and fast.path == "/in/fast"
    assert buffer.pop_due(1.0) == 5.0  # nothing due: when to look next
    assert isinstance(buffer.pop_due(5.0), Candidate)
    assert buffer.pop_due(5.0) is None


def test_queue_put_waits_when_full_and_resize_wakes_it() -> None:
    async def scenario() -> None:
        queue = PipelineQueue(maxsize=1)
        await queue.put(item("a"))
        blocked = asyncio.create_task(queue.put(item("b")))
        await asyncio.sleep(0)
        assert not blocked.done(), "put() must wait while the queue is full"
        queue.resize(2)
        await asyncio.wait_for(blocked, 1)
        assert (queue.size, queue.high_water, queue.capacity) == (2, 2, 2)

    asyncio.run(scenario())


def test_preprocess_cache_is_bounded_by_items_and_by_bytes() -> None:
    async def scenario() -> None:
        cache = PreprocessCache(capacity=3, capacity_mb=1)
        await cache.put(item("a", MB // 2))
        await cache.put(item("b", MB // 4))
        over_bytes = asyncio.create_task(cache.put(item("c", MB // 2)))
        await asyncio.sleep(0)
        assert not over_bytes.done(), "the byte budget must hold the producer back"
        assert (await cache.get()).key == "a"
        await asyncio.wait_for(over_bytes, 1)
        await cache.put(item("d", 1))
        over_items = asyncio.create_task(cache.put(item("e", 1)))
        await asyncio.sleep(0)
        assert not over_items.done(), "the item count must hold the producer back"
        cache.take_nowait()
        await asyncio.wait_for(over_items, 1)
        assert cache.high_water == 3
        assert cache.high_water_bytes <= MB

    asyncio.run(scenario())


class RecordingPool:
    """The decode pool's boundary: answers every file at once, remembering each request."""

    def __init__(self) -> None:
        self.requests: list[list[str]] = []

    def decode_many(self, files: list[tuple[Path, str | None]],
                    opened: Sequence[int | None] = ()) -> list[DecodeResult]:
        self.requests.append([Path(path).name for path, _ in files])
        return [DecodeResult("0" * 64, 1, error=PermanentError("bad")) if "bad" in str(path)
                else DecodeResult("0" * 64, 1, image=DecodedImage(
                    np.zeros((2, 2, 3), np.uint8), 2, 2, "PNG", "RGB"))
                for path, _ in files]

    def close(self) -> None:
        pass


def test_decoders_take_a_fair_share_of_the_queue_up_to_files_per_request() -> None:
    """Ten queued files, two decoders, at most four per request: no request is larger than
    four, the second decoder is left its share, and a bad file fails alone."""
    async def scenario() -> None:
        queue, cache = PipelineQueue(16), PreprocessCache(capacity=16, capacity_mb=16)
        pool, failed = RecordingPool(), []

        async def on_error(work: WorkItem, exc: BaseException) -> None:
            failed.append(work.key)

        async def on_duplicate(work: WorkItem) -> None:
            raise AssertionError("no file here has a result yet")

        async def on_changing(work: WorkItem, why: str) -> None:
            raise AssertionError("no file here is still being written")

        pre = Preprocessor(queue, cache, pool, 2, 4, on_error=on_error,  # type: ignore[arg-type]
                           existing_sha256=lambda key: None, on_duplicate=on_duplicate,
                           on_changing=on_changing)
        names = [f"f{i}.png" for i in range(9)] + ["bad.png"]
        for name in names:
            queue.put_nowait(item(name))
        decoders = [asyncio.create_task(pre.run_worker()) for _ in range(2)]
        await asyncio.wait_for(queue.join(), 5)
        for task in decoders:
            task.cancel()
        pre.close()
        assert sorted(n for request in pool.requests for n in request) == sorted(names)
        assert max(len(request) for request in pool.requests) == 4
        # 4 of 10, then a fair share of the 6 left (3); the capacity has room for a second
        # request per worker (REQUESTS_PER_WORKER decoders per worker)
        assert (pre.high_water, pre.capacity, pre.size) == (7, 16, 0)
        assert failed == ["bad.png"] and cache.size == 9

    asyncio.run(scenario())


class OneWorkerPool:
    """The decode pool's boundary with one worker: a request waits for it, and each request's
    decode lasts until the test lets one finish."""

    def __init__(self) -> None:
        self.worker = threading.Lock()
        self.finish = threading.Semaphore(0)

    def decode_many(self, files: list[tuple[Path, str | None]],
                    opened: Sequence[int | None] = ()) -> list[DecodeResult]:
        with self.worker:
            assert self.finish.acquire(timeout=10), "the test never let the decode finish"
            return [DecodeResult("0" * 64, 1, image=DecodedImage(
                np.zeros((2, 2, 3), np.uint8), 2, 2, "PNG", "RGB")) for _ in files]

    def close(self) -> None:
        pass


def test_a_worker_s_next_request_is_ready_while_it_decodes() -> None:
    """One worker, one file per request: while the worker decodes the first file, the second
    file's request is already prepared (its earlier result looked up) and waiting for it, so
    the worker does not wait for the event loop and a thread between requests; the third
    waits in the queue."""
    async def scenario() -> None:
        queue, cache = PipelineQueue(4), PreprocessCache(capacity=16, capacity_mb=16)
        pool, looked_up = OneWorkerPool(), []

        async def unexpected(work: WorkItem, *args: object) -> None:
            raise AssertionError(f"{work.key}: every file here decodes")

        pre = Preprocessor(queue, cache, pool, 1, 1,  # type: ignore[arg-type]
                           on_error=unexpected, existing_sha256=looked_up.append,
                           on_duplicate=unexpected, on_changing=unexpected)
        for name in ("a", "b", "c"):
            queue.put_nowait(item(name))
        decoders = [asyncio.create_task(pre.run_worker()) for _ in range(pre.decoders)]
        for _ in range(500):
            if looked_up == ["a", "b"]:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # room for a third request that must not come
        assert looked_up == ["a", "b"] and cache.size == 0
        assert (pre.size, pre.capacity, queue.size) == (2, 2, 1)
        for _ in range(3):
            pool.finish.release()
        await asyncio.wait_for(queue.join(), 5)
        for task in decoders:
            task.cancel()
        pre.close()
        assert looked_up == ["a", "b", "c"] and cache.size == 3

    asyncio.run(scenario())


def test_an_item_larger_than_the_byte_budget_passes_alone() -> None:
    async def scenario() -> None:
        cache = PreprocessCache(capacity=4, capacity_mb=1)
        await asyncio.wait_for(cache.put(item("huge", 3 * MB)), 1)
        assert cache.size == 1

    asyncio.run(scenario())


def test_batcher_closes_a_batch_when_full_or_after_the_delay() -> None:
    async def scenario() -> None:
        cache = PreprocessCache(capacity=16, capacity_mb=16)
        batcher = Batcher(cache, max_size=4, max_delay_ms=20)
        for n in range(6):
            await cache.put(item(str(n)))
        full = await batcher.next_batch()
        assert [w.key for w in full] == ["0", "1", "2", "3"]
        partial = await asyncio.wait_for(batcher.next_batch(), 1)
        assert [w.key for w in partial] == ["4", "5"]
        assert batcher.high_water == 4

    asyncio.run(scenario())


def test_a_lone_item_does_not_wait_for_company_that_is_not_coming() -> None:
    async def scenario() -> None:
        cache = PreprocessCache(capacity=16, capacity_mb=16)
        coming = {"more": False}
        batcher = Batcher(cache, max_size=8, max_delay_ms=60_000,
                          more_coming=lambda: coming["more"])
        await cache.put(item("alone"))
        alone = await asyncio.wait_for(batcher.next_batch(), 1)
        assert [w.key for w in alone] == ["alone"]

        coming["more"] = True  # a decode is in progress: wait for it (up to max_delay_ms)
        await cache.put(item("first"))
        forming = asyncio.create_task(batcher.next_batch())
        await asyncio.sleep(0.01)
        assert not forming.done()
        await cache.put(item("second"))
        coming["more"] = False
        await cache.put(item("third"))
        assert [w.key for w in await asyncio.wait_for(forming, 1)] == ["first", "second", "third"]

    asyncio.run(scenario())


def test_retry_list_refuses_beyond_capacity_and_requeues_when_due() -> None:
    async def scenario() -> None:
        requeued: list[str] = []

        async def requeue(work: WorkItem) -> None:
            requeued.append(work.key)

        retry = RetryList(capacity=2, requeue=requeue)
        assert retry.offer(item("a"), 0.01)
        assert retry.offer(item("b"), 0.0)
        assert not retry.offer(item("c"), 0.0), "full: the caller releases the file to disk"
        runner = asyncio.create_task(retry.run())
        deadline = asyncio.get_running_loop().time() + 2
        while len(requeued) < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        runner.cancel()
        assert requeued == ["b", "a"], "earliest due first"
        assert retry.high_water == 2

    asyncio.run(scenario())


def test_backoff_grows_exponentially_with_jitter_and_a_cap() -> None:
    config = RetryPolicyConfig(max_attempts=10, backoff_initial_ms=100, backoff_max_ms=1000)
    rng = random.Random(1)
    for attempt, cap_s in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)]:
        delays = [backoff_s(attempt, config, rng) for _ in range(50)]
        assert all(cap_s / 2 <= d <= cap_s for d in delays), (attempt, delays)
        assert len(set(delays)) > 1, "jittered"


def test_during_a_flood_the_watcher_counts_deferred_paths_without_taking_them(
    tmp_path: Path,
) -> None:
    import watchfiles
    from inboxd.files.names import NameFilter
    from inboxd.pipeline.watcher import Watcher
    from inboxd.stats import Stats

    inbox = tmp_path / "inbox"
    buffer = EventBuffer(capacity=1)
    stats = Stats()
    watcher = Watcher([inbox], True, NameFilter(["*.jpg"]), buffer, stats, 30, lambda: 0.0)

    async def scenario() -> None:
        added = watchfiles.Change.added
        watcher._take({(added, f"{inbox}/a.jpg"), (added, f"{inbox}/b.jpg")})
        assert buffer.size == 1 and stats.counters.deferred == 1 and watcher.backlog_on_disk
        watcher._take({(added, f"{inbox}/c.jpg"), (added, f"{inbox}/sub/d.jpg"),
                       (added, f"{inbox}/.processing/default/e.jpg"),
                       (added, f"{inbox}/f.txt"), (added, f"{tmp_path}/elsewhere.jpg")})
        assert stats.counters.deferred == 3, "c and sub/d only: not hidden, not .txt, inside"
        assert buffer.size == 1

    asyncio.run(scenario())
