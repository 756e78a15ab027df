"""The watcher: notice files. inotify on every inbox (``files/inotify.py``; watchfiles' poller
where inotify cannot see the writes), a scan at start-up, and rescans.

Watch first, then scan what is already there (a file dropped in between is seen by one or
both; the event buffer de-duplicates). Rescans run every ``inbox.rescan_interval_s``, after any
watcher error (an inotify queue overflow among them), and as soon as the event buffer has room
again after it had to defer paths, so a flood drains at full speed without waiting for the
timer. While such a backlog waits on disk the scans find every file, so the watcher is stopped
(changes gather until it is next asked: memory that would grow with the flood) and started
again, with a rescan of its start gap, once a scan has taken everything. A folder moved or
copied in is walked when its own event arrives (inotify reports the folder, not what it
holds). Inboxes on network filesystems are polled (``files/filesystems.py``, per
``inbox.poll``), and so is everything once inotify runs out of watches, at start-up or for a
folder made later (said once, with the sysctl), until a probe finds room for every folder
again. Names not taken are said once (``pipeline/walk.py``); a name that is not UTF-8 is a
name like any other, to the watcher too.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path

import watchfiles

from inboxd import logs
from inboxd.files.filesystems import (
    PollMode,
    StatfsFn,
    WatchPlan,
    inotify_room,
    plan_watch,
    statfs_type,
)
from inboxd.files.names import NameFilter, folder_skipped
from inboxd.pipeline.event_buffer import EventBuffer
from inboxd.pipeline.walk import Walker
from inboxd.pipeline.watch_events import ChangeSet, WatchFn, real_awatch
from inboxd.stats import Stats

SCAN_YIELD_EVERY = 512  # paths between yields to the event loop while walking a huge inbox
WATCHER_RESTART_DELAY_S = 1.0
# awatch starts watching inside its first iteration, a moment after the start-up scan may have
# run: one early rescan covers a file dropped in that gap.
STARTUP_RESCAN_S = 1.0
BACKLOG_POLL_S = 0.05

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
        poll: PollMode = "auto",
        poll_interval_ms: int = 1000,
        statfs: StatfsFn = statfs_type,
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
        self._watching = asyncio.Event()  # cleared while a backlog waits on disk
        self._watching.set()
        self._rescan_soon = False  # the watcher was just started again: rescan its start gap
        self._watched_ids: dict[Path, tuple[int, int]] = {}
        self._prefixes = [f"{inbox}/" for inbox in inboxes]
        self.plans: list[WatchPlan] = [plan_watch(inbox, poll, statfs) for inbox in inboxes]
        self.poll_interval_ms = poll_interval_ms
        self._out_of_watches = False  # inotify's limit was hit: every inbox is polled since
        self._said_out_of_watches = False
        self.inotify_room = inotify_room
        self.walker = Walker(names, recursive, stats)
        self._new_folders: list[tuple[str, Path]] = []  # (folder, inbox) to walk at once

    def stop(self) -> None:
        self._stop.set()
        self._watch_stop.set()
        self._watching.set()  # a paused run_watch wakes, to see the stop

    @property
    def paused(self) -> bool:
        return not self._watching.is_set()

    def _pause_watching(self) -> None:
        self._watching.clear()
        self._watch_stop.set()

    def _resume_watching(self) -> None:
        if self.paused:
            self._watching.set()
            self._rescan_soon = True
            logs.emit(logging.INFO, "watching", "the backlog on disk is taken: watching the "
                      "inboxes again", deferred=self.stats.counters.deferred)

    # -- noticing one path -------------------------------------------------------------------

    def notice(self, path: str, inbox: Path) -> bool | None:
        """Offer one path to the event buffer: True admitted, None known, False deferred."""
        admitted = self.buffer.offer(path, inbox, self.clock())
        if admitted:
            self.stats.counters.accepted += 1
            logs.emit(logging.DEBUG, "accepted", f"accepted {path}",
                      path=str(path), event_buffer_size=self.buffer.size)
        elif admitted is False:
            self.stats.counters.deferred += 1
            if not self.paused:  # once per episode (until "watching"), not once per scan
                logs.emit(logging.INFO, "deferred",
                          f"event buffer full ({self.buffer.capacity} paths): new files wait on "
                          "disk and are picked up by scans as it drains; the watcher pauses "
                          "until then", path=str(path), deferred=self.stats.counters.deferred)
                self._wake.set()  # the scan loop must now watch the buffer drain
            self.backlog_on_disk = True
            self._pause_watching()
        return admitted

    # -- scanning ----------------------------------------------------------------------------

    async def scan(self) -> int:
        """Walk every inbox and notice what is there; stop at the first path the full buffer
        defers (the rest stays on disk for a later scan). Returns the paths seen."""
        self.backlog_on_disk = False
        seen = 0
        for inbox in self.inboxes:
            try:
                inbox.mkdir(parents=True, exist_ok=True)  # deleted while we ran: recreate it
            except OSError as exc:  # its parent read-only, a file in its place: scan the rest
                logs.emit(logging.WARNING, "scan_error", f"cannot scan {inbox}: {exc}",
                          path=str(inbox))
                continue
            count, complete = await self._notice_under(inbox, inbox)
            seen += count
            if not complete:
                return seen  # deferred: the rest waits on disk for the next scan
        if not self.backlog_on_disk:  # nor did the watcher defer anything meanwhile
            self._resume_watching()
        self._check_inbox_identity()
        if self._out_of_watches:
            self._watch_again_if_room()
        return seen

    async def _notice_under(self, folder: str | Path, inbox: Path) -> tuple[int, bool]:
        """Notice every wanted file under ``folder``; (paths seen, False if one was deferred)."""
        seen = 0
        for path in self.walker.walk(folder):
            seen += 1
            if seen % SCAN_YIELD_EVERY == 0:
                await asyncio.sleep(0)
            if self.notice(path, inbox) is False:
                return seen, False
        return seen, True

    def count_waiting(self) -> int:
        """How many files the inbox holds that a run would take (after a stop, for the user)."""
        return sum(1 for inbox in self.inboxes for _ in self.walker.walk(inbox, report=False))

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
            soon = first or self._rescan_soon
            interval_s = min(self.rescan_interval_s, STARTUP_RESCAN_S) if soon else (
                self.rescan_interval_s)
            first = self._rescan_soon = False
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

    def _groups(self) -> dict[bool, list[Path]]:
        """Inboxes by how they are watched: polled (True) or by inotify (False)."""
        groups: dict[bool, list[Path]] = {}
        for plan in self.plans:
            groups.setdefault(plan.polling or self._out_of_watches, []).append(plan.path)
        return groups

    async def run_watch(self) -> None:
        """Feed watcher events into the buffer; restart the watcher after any error or pause."""
        restarted = False
        while not self._stop.is_set():
            await self._watching.wait()
            if self._stop.is_set():
                return
            if restarted:
                # A file that came after the rescan asked for at the stop, and before the new
                # watcher (or poller: it reports changes to what it first saw) started, would
                # wait for the timer: one more rescan once it runs.
                asyncio.get_running_loop().call_later(STARTUP_RESCAN_S, self.request_rescan)
            restarted = True
            self._watch_stop = asyncio.Event()
            try:
                for inbox in self.inboxes:
                    inbox.mkdir(parents=True, exist_ok=True)
                self._watched_ids = {inbox: _identity(inbox) for inbox in self.inboxes}
                async with asyncio.TaskGroup() as group:
                    for polling, paths in self._groups().items():
                        group.create_task(self._watch_group(paths, polling))
            except* Exception as failures:  # watchfiles raises plain RuntimeError/OSError
                exc = failures.exceptions[0]
                if _out_of_watches(exc) and not self._out_of_watches:
                    self._watches_ran_out(exc)
                else:
                    logs.emit(logging.WARNING, "watch_error",
                              f"watcher failed ({exc}); rescanning and restarting it",
                              error=str(exc))
            if self._stop.is_set():
                return
            if self.paused:
                continue  # stopped on purpose: the scans cover the inbox meanwhile
            self.request_rescan()
            await asyncio.sleep(WATCHER_RESTART_DELAY_S)

    async def _watch_group(self, paths: list[Path], polling: bool) -> None:
        async for changes in self.watch(
            *paths, recursive=self.recursive, stop_event=self._watch_stop,
            force_polling=polling, poll_delay_ms=self.poll_interval_ms,
        ):
            self._take(changes)
            while self._new_folders:  # walked now, not at the next rescan
                folder, inbox = self._new_folders.pop()
                await self._notice_under(folder, inbox)

    def _watches_ran_out(self, exc: BaseException) -> None:
        """Poll every inbox from now on, until a probe finds room for inotify again (after a
        scan, ``_watch_again_if_room``); said once per run, with the fix."""
        self._out_of_watches = True
        if self._said_out_of_watches:
            return
        self._said_out_of_watches = True
        logs.emit(logging.WARNING, "watch_error",
                  f"inotify watch limit reached ({exc}); polling every inbox every "
                  f"{self.poll_interval_ms} ms instead until it has room again. To use "
                  "inotify, raise it: `sysctl -w fs.inotify.max_user_watches=524288`, and the "
                  "same in /etc/sysctl.d/", error=str(exc))

    def _watch_again_if_room(self) -> None:
        """Polling for want of watches: if inotify could now watch every folder it would
        (every folder of the inotify inboxes), start the watcher again on inotify."""
        inotify = [plan.path for plan in self.plans if not plan.polling]
        if not inotify or self.inotify_room(_folders_of(inotify, self.recursive)) is not None:
            return
        self._out_of_watches = False
        logs.emit(logging.INFO, "watching", "inotify has room for every folder again: "
                  "watching the inboxes with it instead of polling")
        self._watch_stop.set()

    def _take(self, changes: ChangeSet) -> None:
        for change, raw in changes:
            if change == watchfiles.Change.deleted:
                continue
            found = self._inbox_of(raw)
            if found is None:
                continue
            inbox, rel = found
            if not self.names.wanted(os.path.basename(rel)):
                if self.walker.folder_arrived(raw):
                    if len(self._new_folders) < self.buffer.capacity:  # bounded: else a rescan
                        self._new_folders.append((raw, inbox))
                    else:
                        self.request_rescan()
                continue
            if self.buffer.full() and self.backlog_on_disk:
                # A flood: the rescan will find this file on disk. Only count it, without
                # building objects for each of thousands of events.
                self.stats.counters.deferred += 1
                continue
            self.notice(raw, inbox)

    def _inbox_of(self, raw: str) -> tuple[Path, str] | None:
        """(inbox, relative path) of an event's path if it may be ours: no hidden or litter
        folder on the way (.processing/ among them), as the scan's walk, on the raw string."""
        for inbox, prefix in zip(self.inboxes, self._prefixes, strict=True):
            if raw.startswith(prefix):
                rel = raw[len(prefix):]
                folders = rel.split("/")[:-1]
                if (self.recursive or not folders) and not any(map(folder_skipped, folders)):
                    return inbox, rel
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


def _out_of_watches(exc: BaseException) -> bool:
    """inotify_add_watch's ENOSPC, as the notify crate words it, or as a plain OSError."""
    return "watch limit" in str(exc) or (isinstance(exc, OSError) and exc.errno == errno.ENOSPC)


def _folders_of(inboxes: list[Path], recursive: bool) -> list[str]:
    """Every folder the watcher watches in these inboxes (``files/inotify.py``)."""
    if not recursive:
        return [str(inbox) for inbox in inboxes]
    folders = []
    for inbox in inboxes:
        for folder, dirs, _ in os.walk(inbox):
            dirs[:] = [d for d in dirs if not folder_skipped(d)]
            folders.append(folder)
    return folders


def _identity(folder: Path) -> tuple[int, int]:
    st = os.stat(folder)
    return st.st_dev, st.st_ino
