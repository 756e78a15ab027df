"""Stage 2: from the event buffer into the queue, by ``await queue.put()``.

For each candidate: is it a regular file that has settled (mtime at least ``inbox.settle_ms``
old)? Then claim it with one atomic rename into this instance's processing folder and put it on
the queue. The put is where backpressure lands: when the GPU is behind, this coroutine waits,
the event buffer fills, and further files stay on disk (deferred) until there is room.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from inboxd import logs
from inboxd.config import Config
from inboxd.files.lifecycle import Lifecycle
from inboxd.files.names import relative_inside
from inboxd.item import WorkItem
from inboxd.pipeline.event_buffer import Candidate, EventBuffer
from inboxd.pipeline.queue import PipelineQueue
from inboxd.stats import Stats


class Intake:
    def __init__(
        self,
        config: Config,
        buffer: EventBuffer,
        queue: PipelineQueue,
        lifecycle: Lifecycle,
        stats: Stats,
        on_enqueued: Callable[[WorkItem], None],
        on_refused: Callable[[WorkItem, str], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.buffer = buffer
        self.queue = queue
        self.lifecycle = lifecycle
        self.stats = stats
        self.on_enqueued = on_enqueued
        self.on_refused = on_refused  # claimed but not processable (link, FIFO): fail it
        self.claimed = 0
        self.clock = clock
        self.wall_clock = wall_clock
        self.settle_s = config.inbox.settle_ms / 1000
        self.several_inboxes = len(config.inbox.paths) > 1
        self.busy = False  # between taking a candidate and its put() returning

    def key_for(self, inbox: Path, rel: str) -> str:
        return f"{inbox.name}/{rel}" if self.several_inboxes else rel

    async def run(self) -> None:
        while True:
            due = self.buffer.pop_due(self.clock())
            if due is None:
                await self.buffer.wait_changed(None)
                continue
            if isinstance(due, float):
                await self.buffer.wait_changed(max(0.0, due - self.clock()))
                continue
            self.busy = True
            try:
                claim = self._claim_if_ready(due)
                if claim is None:
                    continue
                item, refusal = claim
                if refusal is None:
                    await self._put(item)
                else:
                    await self.on_refused(item, refusal)
            finally:
                self.busy = False

    def _claim_if_ready(self, candidate: Candidate) -> tuple[WorkItem, str | None] | None:
        path, inbox = candidate.path, candidate.inbox
        rel = relative_inside(path, inbox)
        if rel is None:
            return self._ignored()
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return self._ignored()  # claimed by another instance, or removed by its writer
        if stat.S_ISDIR(st.st_mode):
            return self._ignored()  # folders are walked by the scan, never processed
        refusal = None
        if stat.S_ISLNK(st.st_mode):
            refusal = describe_link(path, inbox)
        elif not stat.S_ISREG(st.st_mode):
            refusal = "not a regular file (a FIFO, socket or device): only regular files are read"
        else:
            age_s = self.wall_clock() - st.st_mtime
            if age_s < self.settle_s:
                # Still being written, probably: look again once it could have settled.
                self.buffer.retry_later(candidate, self.clock() + self.settle_s - age_s)
                return None
            if self.config.inbox.after_success == "keep" and self._already_done(rel, inbox, st):
                return self._ignored()
        key = self.key_for(inbox, rel)
        item = WorkItem(
            inbox=inbox,
            rel=rel,
            key=key,
            claimed_path=self.config.processing_dir(inbox) / rel,
            noticed_s=candidate.noticed_s,
        )
        if not self.lifecycle.claim(path, item.claimed_path):
            return self._ignored()
        self.claimed += 1
        return item, refusal

    def _ignored(self) -> tuple[WorkItem, str | None] | None:
        """Admitted to the buffer but not ours after all: counted, so that every accepted path
        ends up either claimed or ignored. Returns None: nothing to put on the queue."""
        self.stats.counters.ignored += 1
        return None

    def _already_done(self, rel: str, inbox: Path, st: os.stat_result) -> bool:
        """With ``after_success: keep`` sources stay in the inbox: skip those whose result is
        newer than the file (a changed file gets a fresh result)."""
        try:
            result_mtime = os.stat(self.lifecycle.result_path(self.key_for(inbox, rel))).st_mtime
        except OSError:
            return False
        return result_mtime >= st.st_mtime

    async def _put(self, item: WorkItem) -> None:
        started = time.perf_counter()
        try:
            await self.queue.put(item)
        except asyncio.CancelledError:
            # Shutdown while waiting for room: the file goes back to the inbox, untouched.
            self.lifecycle.release(item.claimed_path, item.inbox / item.rel)
            self.stats.counters.released += 1
            raise
        waited_ms = (time.perf_counter() - started) * 1000
        item.enqueued_s = self.clock()
        self.on_enqueued(item)
        self.stats.counters.enqueued += 1
        self.stats.put_wait_ms.add(waited_ms)
        logs.emit(logging.DEBUG, "enqueued", f"enqueued {item.key}", path=item.key,
                  put_wait_ms=round(waited_ms, 3), queue_size=self.queue.qsize())


def describe_link(path: Path, inbox: Path) -> str:
    """Why a symbolic link is refused. Links are never followed: one that leads outside the
    inbox would let anybody who can write the inbox make the daemon read any file it can."""
    try:
        target = path.resolve(strict=True)
    except RuntimeError:
        return "refused: a symbolic link loop; links are never followed"
    except OSError:
        return "refused: a dangling symbolic link; links are never followed"
    if relative_inside(target, inbox.resolve()) is None:
        return f"refused: a symbolic link to {target}, outside the inbox; links are never followed"
    return "refused: a symbolic link; drop the file itself, links are never followed"
