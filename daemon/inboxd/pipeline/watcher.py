"""Stage 1: notice files. watchfiles ``awatch`` on every inbox, a scan at start-up, and rescans.

Watch first, then scan what is already there (a file dropped in between is seen by one or
both; the event buffer de-duplicates). Rescans run every ``inbox.rescan_interval_s``, after any
watcher error (watchfiles silently drops inotify queue overflows), and as soon as the event
buffer has room again after it had to defer paths, so a flood drains at full speed without
waiting for the timer.

This stage never waits on the pipeline: a full event buffer defers, it does not block, so the
watcher is always free to keep up with the kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Protocol

import watchfiles

from inboxd import logs
from inboxd.files.names import NameFilter
from inboxd.pipeline.event_buffer import EventBuffer
from inboxd.stats import Stats

# Let awatch hand over changes at most this long after they happen: the intake's settle time
# is the real "is it finished" test, so a long debounce would only add latency.
WATCH_DEBOUNCE_MS = 200
WATCH_STEP_MS = 20
# Yield to the event loop while walking a huge inbox.
SCAN_YIELD_EVERY = 512
WATCHER_RESTART_DELAY_S = 1.0
# awatch starts watching inside its first iteration, a moment after the start-up scan may have
# run: one early rescan covers a file dropped in that gap.
STARTUP_RESCAN_S = 1.0
BACKLOG_POLL_S = 0.05

ChangeSet = set[tuple[watchfiles.Change, str]]


class WatchFn(Protocol):
    """The boundary to the OS watcher: ``watchfiles.awatch`` in production, a script in tests."""

    def __call__(
        self, *paths: Path, recursive: bool, stop_event: asyncio.Event
    ) -> AsyncIterator[ChangeSet]: ...


def real_awatch(
    *paths: Path, recursive: bool, stop_event: asyncio.Event
) -> AsyncIterator[ChangeSet]:
    return watchfiles.awatch(
        *paths,
        recursive=recursive,
        stop_event=stop_event,
        debounce=WATCH_DEBOUNCE_MS,
        step=WATCH_STEP_MS,
        # Our own filter runs on every path anyway; watchfiles' default one would hide
        # nothing we want and cost a Python call per event.
        watch_filter=None,
        yield_on_timeout=False,
    )


class Watcher:
    def __init__(
        self,
        inboxes: list[Path],
        recursive: bool,
        names: NameFilter,
        buffer: EventBuffer,
        stats: Stats,
        rescan_interval_s: float,
        clock: Callable[[], float],
        watch: WatchFn = real_awatch,
    ) -> None:
        self.inboxes = inboxes
        self.recursive = recursive
        self.names = names
        self.buffer = buffer
        self.stats = stats
        self.rescan_interval_s = rescan_interval_s
        self.clock = clock
        self.watch = watch
        self._rescan_requested = False
        # Wakes the scan loop: a rescan was requested, or a backlog just started to wait on disk.
        self._wake = asyncio.Event()
        self.backlog_on_disk = False  # a path was deferred since the last complete scan
        self._stop = asyncio.Event()
        self._watch_stop = asyncio.Event()
        self._watched_ids: dict[Path, tuple[int, int]] = {}
        self._prefixes = [f"{inbox}/" for inbox in inboxes]

    def stop(self) -> None:
        self._stop.set()
        self._watch_stop.set()

    # -- noticing one path -------------------------------------------------------------------

    def notice(self, path: Path, inbox: Path) -> bool | None:
        """Offer one path to the event buffer: True admitted, None known, False deferred."""
        admitted = self.buffer.offer(path, inbox, self.clock())
        if admitted:
            self.stats.counters.accepted += 1
            logs.emit(logging.DEBUG, "accepted", f"accepted {path}",
                      path=str(path), event_buffer_size=self.buffer.size)
        elif admitted is False:
            self.stats.counters.deferred += 1
            if not self.backlog_on_disk:  # once per episode, not once per file
                logs.emit(logging.INFO, "deferred",
                          f"event buffer full ({self.buffer.capacity} paths): new files wait on "
                          "disk and are picked up as it drains", path=str(path),
                          deferred=self.stats.counters.deferred)
                self._wake.set()  # the scan loop must now watch the buffer drain
            self.backlog_on_disk = True
        return admitted

    # -- scanning ----------------------------------------------------------------------------

    async def scan(self) -> int:
        """Walk every inbox and notice what is there; stop at the first path the full buffer
        defers (the rest stays on disk for a later scan). Returns the paths seen."""
        self.backlog_on_disk = False
        seen = 0
        for inbox in self.inboxes:
            inbox.mkdir(parents=True, exist_ok=True)  # deleted while we ran: recreate it
            for path in self._walk(inbox):
                seen += 1
                if seen % SCAN_YIELD_EVERY == 0:
                    await asyncio.sleep(0)
                if path in self.buffer:
                    continue
                if self.notice(path, inbox) is False:
                    return seen  # deferred: the rest waits on disk for the next scan
        self._check_inbox_identity()
        return seen

    def _walk(self, folder: Path) -> Iterator[Path]:
        """Wanted files under ``folder``, lazily: a scan that stops early reads no further."""
        stack = [folder]
        while stack:
            current = stack.pop()
            try:
                with os.scandir(current) as entries:
                    for entry in entries:
                        if entry.name.startswith("."):
                            continue
                        if entry.is_dir(follow_symlinks=False):
                            if self.recursive:
                                stack.append(Path(entry.path))
                        elif self.names.wanted(entry.name):
                            yield Path(entry.path)
            except OSError as exc:  # gone, not a folder, no permission, a path too long
                logs.emit(logging.WARNING, "scan_error", f"cannot scan {current}: {exc}",
                          path=str(current))

    def count_waiting(self) -> int:
        """How many files the inbox holds that a run would take (after a stop, for the user)."""
        return sum(1 for inbox in self.inboxes for _ in self._walk(inbox))

    def request_rescan(self) -> None:
        self._rescan_requested = True
        self._wake.set()

    async def run_scans(self) -> None:
        """Scan now, then on the timer, on request, and whenever deferred paths wait on disk
        and the buffer has drained to half (so a flood drains without waiting for the timer)."""
        first = True
        while not self._stop.is_set():
            self._rescan_requested = False
            await self.scan()
            interval_s = min(self.rescan_interval_s, STARTUP_RESCAN_S) if first else (
                self.rescan_interval_s)
            first = False
            deadline = self.clock() + interval_s
            while not self._stop.is_set() and not self._rescan_requested:
                if self.backlog_on_disk and self.buffer.size <= self.buffer.capacity // 2:
                    break
                remaining = deadline - self.clock()
                if remaining <= 0:
                    break
                self._wake.clear()
                # With a backlog on disk, look at the buffer often; else sleep until woken.
                wait_s = min(remaining, BACKLOG_POLL_S) if self.backlog_on_disk else remaining
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait_s)

    # -- watching ----------------------------------------------------------------------------

    async def run_watch(self) -> None:
        """Feed watcher events into the buffer; restart the watcher after any error."""
        while not self._stop.is_set():
            self._watch_stop = asyncio.Event()
            try:
                for inbox in self.inboxes:
                    inbox.mkdir(parents=True, exist_ok=True)
                self._watched_ids = {inbox: _identity(inbox) for inbox in self.inboxes}
                async for changes in self.watch(
                    *self.inboxes, recursive=self.recursive, stop_event=self._watch_stop
                ):
                    self._take(changes)
            except Exception as exc:  # watchfiles raises plain RuntimeError/OSError variants
                logs.emit(logging.WARNING, "watch_error",
                          f"watcher failed ({exc}); rescanning and restarting it", error=str(exc))
            if self._stop.is_set():
                return
            self.request_rescan()
            await asyncio.sleep(WATCHER_RESTART_DELAY_S)

    def _take(self, changes: ChangeSet) -> None:
        for change, raw in changes:
            if change == watchfiles.Change.deleted:
                continue
            inbox = self._inbox_wanting(raw)
            if inbox is None:
                continue
            if self.buffer.full() and self.backlog_on_disk:
                # A flood: the rescan will find this file on disk. Only count it, without
                # building objects for each of thousands of events.
                self.stats.counters.deferred += 1
                continue
            self.notice(Path(raw), inbox)

    def _inbox_wanting(self, raw: str) -> Path | None:
        """The inbox an event's path belongs to, if it is ours to take: inside that inbox,
        no hidden part (our own .processing/ among them), a wanted name. The same rule as
        the scan's walk, on the raw string."""
        for inbox, prefix in zip(self.inboxes, self._prefixes, strict=True):
            if raw.startswith(prefix):
                rel = raw[len(prefix):]
                if ("/." not in "/" + rel and (self.recursive or "/" not in rel)
                        and self.names.wanted(os.path.basename(rel))):
                    return inbox
                return None
        return None

    def _check_inbox_identity(self) -> None:
        """An inbox deleted and recreated is a new inode that the old inotify watch never
        sees: restart the watcher on the new one."""
        for inbox, watched in self._watched_ids.items():
            try:
                current = _identity(inbox)
            except OSError:
                current = (0, 0)
            if current != watched:
                logs.emit(logging.WARNING, "watch_error",
                          f"inbox {inbox} was replaced; restarting the watcher", path=str(inbox))
                self._watched_ids = {}
                self._watch_stop.set()
                return


def _identity(folder: Path) -> tuple[int, int]:
    st = os.stat(folder)
    return st.st_dev, st.st_ino
