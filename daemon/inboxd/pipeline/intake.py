"""The intake: from the event buffer into the queue, by ``await queue.put()``.

For each candidate: is it a regular file that has settled (mtime at least ``inbox.settle_ms``
old)? Then claim it with one atomic rename into this instance's processing folder and put it on
the queue. The put is where backpressure lands: when the GPU is behind, this coroutine waits,
the event buffer fills, and further files stay on disk (deferred) until there is room.

Claims are batched: as many due candidates as the queue has room for (at most
``CLAIM_BATCH``) are looked at and claimed in one call on the intake's own thread, so a flood
costs one hand-off per batch and the event loop makes none of those syscalls. A batch is sized
to the queue's free room when it is taken; the retry list may fill some of that room meanwhile,
so at most ``CLAIM_BATCH`` - 1 claimed files can wait on ``put()`` beyond the queue. A lone
candidate is claimed inline. One path's surprise (a bug, an odd error) skips that path only.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from inboxd import logs
from inboxd.config import Config
from inboxd.files.durable import output_full
from inboxd.files.layout import PROCESSING_DIRNAME
from inboxd.files.lifecycle import Lifecycle
from inboxd.files.names import relative_inside
from inboxd.files.safe_paths import LinkedFolder
from inboxd.files.settling import identity
from inboxd.item import WorkItem
from inboxd.os_threads import name_this_thread
from inboxd.pipeline.event_buffer import Candidate, EventBuffer
from inboxd.pipeline.full_outputs import FullOutputs
from inboxd.pipeline.held_files import HeldFiles
from inboxd.pipeline.queue import PipelineQueue
from inboxd.pipeline.skipped import SkippedPaths
from inboxd.stats import Stats

# A mtime further ahead than this is worth a word in the log (small skews are normal on NFS).
FUTURE_MTIME_S = 2.0
CLAIM_BATCH = 64
Claim = tuple[WorkItem, str | None] | None


@dataclass
class Effects:
    """What looking at candidates changes in event-loop state, applied on the loop afterwards
    (the looking may run on the intake's thread)."""

    ignored: int = 0
    later: list[tuple[Candidate, float]] = field(default_factory=list)
    # A claim refused because the processing folder cannot take more (the inbox's filesystem
    # full or read-only): its folder and error. The intake then waits for room.
    full: tuple[str, OSError] | None = None


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
        held: HeldFiles | None = None,
        outputs: FullOutputs | None = None,
    ) -> None:
        self.config = config
        # A full output folder: nothing more is claimed until there is room (the files wait in
        # the inbox, untouched, instead of joining the ones held in flight).
        self.outputs = outputs
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
        self.held = held  # files given back still open for writing: not claimed before due
        self.busy = False  # between taking candidates and their put() returning
        self.skipped = SkippedPaths()
        self._claimer: ThreadPoolExecutor | None = None  # made on the first batch

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.outputs is not None and self.outputs.full:
                await self.outputs.wait_for_room()
                continue
            due = self.buffer.pop_due(self.clock())
            if due is None:
                await self.buffer.wait_changed(None)
                continue
            if isinstance(due, float):
                await self.buffer.wait_changed(max(0.0, due - self.clock()))
                continue
            self.busy = True
            try:
                batch = self._more_due(due)
                effects = Effects()
                if len(batch) == 1:
                    claims = self._claim_all(batch, effects)
                else:
                    claims = await self._claim_batch(loop, batch, effects)
                self.stats.counters.ignored += effects.ignored
                for candidate, due_s in effects.later:
                    self.buffer.retry_later(candidate, due_s)
                await self._enqueue(claims)
            finally:
                self.busy = False
            if effects.full is not None and self.outputs is not None:
                await self.outputs.hold(*effects.full)

    def _more_due(self, first: Candidate) -> list[Candidate]:
        """``first`` and further due candidates, as many as the queue has room for."""
        batch = [first]
        room = min(CLAIM_BATCH, self.queue.maxsize - self.queue.qsize())
        while len(batch) < room:
            more = self.buffer.pop_due(self.clock())
            if not isinstance(more, Candidate):
                break
            batch.append(more)
        return batch

    def _executor(self) -> ThreadPoolExecutor:
        if self._claimer is None:
            self._claimer = ThreadPoolExecutor(1, thread_name_prefix="inboxd-intake",
                                               initializer=name_this_thread)
        return self._claimer

    def close(self) -> None:
        if self._claimer is not None:
            self._claimer.shutdown(wait=True)

    async def _claim_batch(self, loop: asyncio.AbstractEventLoop, batch: list[Candidate],
                           effects: Effects) -> list[Claim]:
        claiming = loop.run_in_executor(self._executor(), self._claim_all, batch, effects)
        try:
            return await asyncio.shield(claiming)
        except asyncio.CancelledError:
            # Shutdown: the thread's renames go on regardless; what they claimed goes back.
            self._release([claim for claim in await claiming if claim is not None])
            raise

    def _claim_all(self, batch: list[Candidate], effects: Effects) -> list[Claim]:
        claims: list[Claim] = []
        for candidate in batch:
            try:
                claims.append(self._claim_if_ready(candidate, effects))
            except Exception as exc:  # one path's surprise must not cost the batch's claims
                self.skipped.note(candidate.path, f"cannot claim it: {exc!r}")
                claims.append(_ignored(effects))
        return claims

    async def _enqueue(self, claims: list[Claim]) -> None:
        taken = [claim for claim in claims if claim is not None]
        for index, (item, refusal) in enumerate(taken):
            try:
                if refusal is None:
                    await self._put(item)
                else:
                    await self.on_refused(item, refusal)
            except asyncio.CancelledError:
                self._release(taken[index + 1:])  # shutdown: the rest goes back, untouched
                raise

    def _release(self, taken: list[tuple[WorkItem, str | None]]) -> None:
        for item, _ in taken:
            self.lifecycle.release(item.claimed_path, item.inbox_path)
            self.stats.counters.released += 1

    def _claim_if_ready(self, candidate: Candidate, effects: Effects) -> Claim:
        path, inbox = candidate.path, candidate.inbox
        rel = relative_inside(path, inbox)
        if rel is None:
            return _ignored(effects)
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return _ignored(effects)  # claimed by another instance, or removed by its writer
        except OSError as exc:  # ENAMETOOLONG, EACCES on a folder, ELOOP: this path's problem
            self.skipped.note(path, f"cannot look at it: {exc.strerror}")
            return _ignored(effects)
        if stat.S_ISDIR(st.st_mode):
            return _ignored(effects)  # folders are walked by the scan, never processed
        refusal = None
        if stat.S_ISLNK(st.st_mode):
            refusal = describe_link(path, inbox)
        elif not stat.S_ISREG(st.st_mode):
            refusal = "not a regular file (a FIFO, socket or device): only regular files are read"
        else:
            if not self._settled(candidate, st, effects):
                return None
            due_s = None if self.held is None else self.held.not_before(path, st.st_ino)
            if due_s is not None:
                effects.later.append((candidate, due_s))
                return None
            if self.config.inbox.after_success == "keep" and self._already_done(rel, inbox, st):
                return _ignored(effects)
        try:
            claimed = self.lifecycle.claim(inbox, rel)
        except LinkedFolder as exc:
            self.skipped.note(path, f"refused: {exc.strerror}; it stays where it is")
            return _ignored(effects)
        except OSError as exc:
            if output_full(exc) and self.outputs is not None:
                # The folder's condition, not the file's: it is tried again once there is room.
                effects.full = (os.path.join(inbox, PROCESSING_DIRNAME), exc)
                effects.later.append((candidate, self.clock()))
                return None
            self.skipped.note(path, claim_problem(exc))
            return _ignored(effects)
        if claimed is None:
            return _ignored(effects)
        self.claimed += 1
        item = WorkItem(inbox=inbox, rel=rel, key=self.config.key_for(inbox, rel),
                        claimed_path=claimed, noticed_s=candidate.noticed_s,
                        identity=identity(st))
        return item, refusal

    def _settled(self, candidate: Candidate, st: os.stat_result, effects: Effects) -> bool:
        """Unchanged for settle_ms, by its mtime (a file renamed in finished is old at once)
        or by our own observation (whatever its mtime says: clocks can be wrong)."""
        now_s = self.clock()
        age_s = self.wall_clock() - st.st_mtime
        if age_s >= self.settle_s:
            return True
        seen = identity(st)
        if candidate.observed == seen and now_s - candidate.observed_at_s >= self.settle_s:
            return True
        if candidate.observed != seen:
            candidate.observed, candidate.observed_at_s = seen, now_s
            if age_s < -FUTURE_MTIME_S:
                self.skipped.note(candidate.path, f"its modification time is {-age_s:.0f} s in "
                                  "the future (a wrong clock?); it is taken once it has not "
                                  f"changed for {self.settle_s * 1000:g} ms", level=logging.INFO)
        due_s = candidate.observed_at_s + self.settle_s
        if age_s >= 0:
            due_s = min(due_s, now_s + self.settle_s - age_s)
        effects.later.append((candidate, due_s))
        return False

    def _already_done(self, rel: str, inbox: Path, st: os.stat_result) -> bool:
        """With ``after_success: keep`` sources stay in the inbox: skip those whose result
        describes this very file (same inode, size and mtime); anything else, also another
        photo moved over it with an older mtime, gets a fresh result. Looked up where the
        result is filed: under the portable form of a name results/ cannot hold (exFAT:
        ``a?.jpg``), or such a photo is claimed, inferred and put back for ever."""
        try:
            path = self.lifecycle.results.filed_json_file(self.config.key_for(inbox, rel))
        except OSError:  # results/ full: claimed, and held there like any other photo
            return False
        try:
            with open(path, "rb") as handle:
                recorded = json.load(handle).get("source_identity")
        except (OSError, ValueError, AttributeError):
            return False
        return bool(recorded == list(identity(st)))

    async def _put(self, item: WorkItem) -> None:
        started = time.perf_counter()
        try:
            await self.queue.put(item)
        except asyncio.CancelledError:
            # Shutdown while waiting for room: the file goes back to the inbox, untouched.
            self.lifecycle.release(item.claimed_path, item.inbox_path)
            self.stats.counters.released += 1
            raise
        waited_ms = (time.perf_counter() - started) * 1000
        item.enqueued_s = self.clock()
        self.on_enqueued(item)
        self.stats.counters.enqueued += 1
        self.stats.put_wait_ms.add(waited_ms)
        logs.emit(logging.DEBUG, "enqueued", f"enqueued {item.key}", path=item.key,
                  put_wait_ms=round(waited_ms, 3), queue_size=self.queue.qsize())


def _ignored(effects: Effects) -> Claim:
    """Admitted to the buffer but not ours after all: counted, so that every accepted path
    ends up either claimed or ignored. Returns None: nothing to put on the queue."""
    effects.ignored += 1
    return None


def claim_problem(exc: OSError) -> str:
    """Why a file could not be claimed, and what to do about it. It stays where it is."""
    if exc.errno in (errno.EACCES, errno.EPERM):
        return ("cannot claim it (permission denied): the service must be able to rename files "
                "in their folder; make the folder writable for the inboxd group (chmod g+ws) or "
                "drop files with `inboxd submit`")
    if exc.errno == errno.ENAMETOOLONG:
        return "cannot claim it: the path is too long for this filesystem; shorten it"
    return f"cannot claim it: {exc.strerror or exc}"


def describe_link(path: str, inbox: Path) -> str:
    """Why a symbolic link is refused. Links are never followed: one that leads outside the
    inbox would let anybody who can write the inbox make the daemon read any file it can."""
    try:
        target = Path(path).resolve(strict=True)  # a link is rare: no Path per file
    except RuntimeError:
        return "refused: a symbolic link loop; links are never followed"
    except OSError:
        return "refused: a dangling symbolic link; links are never followed"
    if relative_inside(target, inbox.resolve()) is None:
        return f"refused: a symbolic link to {target}, outside the inbox; links are never followed"
    return "refused: a symbolic link; drop the file itself, links are never followed"
