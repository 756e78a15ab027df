"""Where every claimed file ends: completed, failed, retried later, or released to disk.

Also the pipeline's in-flight count (claimed items not yet resolved), which shutdown and the
``once`` command wait on.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from inboxd import __version__, logs
from inboxd.config import Config
from inboxd.files.lifecycle import Lifecycle
from inboxd.item import PermanentError, WorkItem
from inboxd.pipeline.retry_list import RetryList, backoff_s
from inboxd.stats import Stats, classify_failure

T = TypeVar("T")
RunIO = Callable[[Callable[[], T]], Awaitable[T]]


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Outcomes:
    def __init__(
        self,
        config: Config,
        lifecycle: Lifecycle,
        stats: Stats,
        retry_list: RetryList,
        run_io: RunIO[Any],
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.lifecycle = lifecycle
        self.stats = stats
        self.retry_list = retry_list
        self.run_io = run_io
        self.clock = clock
        self.rng = rng or random.Random()
        self.in_flight = 0
        self._settled = asyncio.Event()

    # -- in-flight accounting ----------------------------------------------------------------

    def admitted(self) -> None:
        self.in_flight += 1

    def _resolved(self) -> None:
        self.in_flight -= 1
        self._settled.set()

    def active(self) -> int:
        """Items somewhere in the pipeline, not counting those waiting out a backoff."""
        return self.in_flight - self.retry_list.size

    async def wait_until_inactive(self) -> None:
        while self.active() > 0:
            self._settled.clear()
            await self._settled.wait()

    # -- outcomes ----------------------------------------------------------------------------

    def completed(self, item: WorkItem, duplicate: bool = False) -> None:
        counters = self.stats.counters
        counters.completed += 1
        if duplicate:
            counters.duplicates += 1
        latency_ms = (self.clock() - item.noticed_s) * 1000
        self.stats.latency_ms.add(latency_ms)
        logs.emit(logging.INFO, "completed", f"completed {item.key}", path=item.key,
                  sha256=item.sha256, latency_ms=round(latency_ms, 3), attempts=item.attempts + 1,
                  duplicate=int(duplicate) if duplicate else None)
        self._resolved()

    async def duplicate(self, item: WorkItem) -> None:
        """Its result already exists with the same sha256: finish the source, do not redo it."""
        try:
            await self.run_io(lambda: self.lifecycle.finish_success(
                item.claimed_path, item.key, item.inbox / item.rel))
        except OSError as exc:
            await self.error(item, exc)
            return
        self.completed(item, duplicate=True)

    async def error(self, item: WorkItem, exc: BaseException) -> None:
        """Permanent errors and exhausted retries go to failed/; the rest to the retry list,
        or back to disk when the retry list is full."""
        reason = str(exc) or type(exc).__name__
        item.errors.append(reason)
        item.attempts += 1
        permanent = isinstance(exc, PermanentError)
        if permanent or item.attempts >= self.config.retry.max_attempts:
            await self._fail(item, permanent, classify_failure(exc))
            return
        item.reset_for_retry()
        delay_s = backoff_s(item.attempts, self.config.retry, self.rng)
        if self.retry_list.offer(item, delay_s):
            self.stats.counters.retried += 1
            logs.emit(logging.WARNING, "retry", f"will retry {item.key} in {delay_s:.1f} s: "
                      f"{reason}", path=item.key, attempt=item.attempts, error=reason,
                      delay_ms=round(delay_s * 1000))
            self._settled.set()
            return
        await self.release(item, "the retry list is full")

    async def release(self, item: WorkItem, why: str) -> None:
        await self.run_io(lambda: self.lifecycle.release(item.claimed_path, item.inbox / item.rel))
        self.stats.counters.released += 1
        logs.emit(logging.INFO, "released", f"returned {item.key} to the inbox: {why}",
                  path=item.key, reason=why)
        self._resolved()

    async def _fail(self, item: WorkItem, permanent: bool, reason_class: str) -> None:
        report = {
            "source": item.key,
            "inbox": str(item.inbox),  # where `inboxd retry` returns it, under rel
            "rel": item.rel,
            "reason": item.errors[-1],
            "reason_class": reason_class,
            "permanent": permanent,
            "attempts": item.errors,
            "sha256": item.sha256,
            "instance": self.config.instance,
            "failed_at": utc_now(),
            "inboxd_version": __version__,
        }
        try:
            await self.run_io(
                lambda: self.lifecycle.finish_failure(item.claimed_path, item.key, report)
            )
        except OSError as exc:
            # Cannot even record the failure (failed/ full or read-only): keep the file safe.
            logs.emit(logging.ERROR, "failed", f"cannot move {item.key} to failed/ ({exc}); "
                      "returning it to the inbox", path=item.key, error=str(exc))
            await self.release(item, f"failed/ not writable: {exc}")
            return
        self.stats.counters.failed += 1
        self.stats.failed_by_class[reason_class] += 1
        logs.emit(logging.WARNING, "failed", f"failed {item.key}: {item.errors[-1]}",
                  path=item.key, error=item.errors[-1], attempts=item.attempts,
                  reason_class=reason_class)
        self._resolved()

    async def refused(self, item: WorkItem, reason: str) -> None:
        """A claimed name that is no image file at all (a link, a FIFO): fail it at once."""
        self.admitted()
        await self.error(item, PermanentError(reason))
