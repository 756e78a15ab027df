"""The boundary to the OS watcher: inotify (``files/inotify.py``) or, for polled inboxes,
``watchfiles.awatch`` in production; a script in tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

import watchfiles

from inboxd.files.inotify import TreeWatch
from inboxd.files.names import folder_skipped

# Let awatch hand over changes at most this long after they happen: the intake's settle time
# is the real "is it finished" test, so a long debounce only adds latency (during a flood the
# pipeline idles until the first set comes). It also bounds one change set during a flood
# (before the watcher pauses, ``pipeline/watcher.py``): a long one lets a single set, and the
# daemon's RSS, grow with the flood. A single drop is handed over WATCH_STEP_MS after it,
# whatever this says. The figures behind 20 ms: docs/decisions.md, "Watch debounce 20 ms".
WATCH_DEBOUNCE_MS = 20
WATCH_STEP_MS = 20
ChangeSet = set[tuple[watchfiles.Change, str]]


class WatchFn(Protocol):
    """The boundary to the OS watcher: inotify (``files/inotify.py``) or, for polled inboxes,
``watchfiles.awatch`` in production; a script in tests."""

    def __call__(
        self, *paths: Path, recursive: bool, stop_event: asyncio.Event,
        force_polling: bool = False, poll_delay_ms: int = 1000,
    ) -> AsyncIterator[ChangeSet]: ...


def real_awatch(
    *paths: Path, recursive: bool, stop_event: asyncio.Event,
    force_polling: bool = False, poll_delay_ms: int = 1000,
) -> AsyncIterator[ChangeSet]:
    """inotify where it sees the writes, watchfiles' poller where it does not. Not
    watchfiles' inotify: a path that is not UTF-8 sets an error in it that never clears, and
    one file so named, renamed back and forth, restarted the watcher at each rename."""
    if force_polling:
        return polled_awatch(*paths, recursive=recursive, stop_event=stop_event,
                             poll_delay_ms=poll_delay_ms)
    return inotify_awatch(*paths, recursive=recursive, stop_event=stop_event)


async def inotify_awatch(*paths: Path, recursive: bool,
                         stop_event: asyncio.Event) -> AsyncIterator[ChangeSet]:
    """Change sets as awatch yields them: after the first event, more are gathered every
    WATCH_STEP_MS for at most WATCH_DEBOUNCE_MS, then handed over; until ``stop_event``. Each
    read takes at most one kernel read (``MAX_CHANGES_PER_READ``), so one set holds at most
    that per step, however fast the events come."""
    watch = TreeWatch([str(path) for path in paths], recursive, folder_skipped)
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    loop.add_reader(watch.fd, readable.set)
    try:
        while not stop_event.is_set():
            readable.clear()
            raw = watch.read()
            if not raw:
                await _either(readable, stop_event)
                continue
            deadline_s = loop.time() + WATCH_DEBOUNCE_MS / 1000
            while loop.time() < deadline_s:
                await asyncio.sleep(WATCH_STEP_MS / 1000)
                more = watch.read()
                if not more:
                    break
                raw |= more
            yield {(watchfiles.Change(change), path) for change, path in raw}
    finally:
        loop.remove_reader(watch.fd)
        watch.close()


async def _either(first: asyncio.Event, second: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(first.wait()), asyncio.ensure_future(second.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


def polled_awatch(
    *paths: Path, recursive: bool, stop_event: asyncio.Event, poll_delay_ms: int = 1000,
) -> AsyncIterator[ChangeSet]:
    return watchfiles.awatch(
        *paths,
        recursive=recursive,
        stop_event=stop_event,
        # Explicit, so that WATCHFILES_FORCE_POLLING in the environment cannot decide.
        force_polling=True,
        poll_delay_ms=poll_delay_ms,
        debounce=WATCH_DEBOUNCE_MS,
        step=WATCH_STEP_MS,
        # Our own filter runs on every path anyway; watchfiles' default one would hide
        # nothing we want and cost a Python call per event.
        watch_filter=None,
        yield_on_timeout=False,
    )
