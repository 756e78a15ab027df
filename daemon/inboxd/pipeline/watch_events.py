"""The boundary to the OS watcher: ``watchfiles.awatch`` in production, a script in tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

import watchfiles

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
    """The boundary to the OS watcher: ``watchfiles.awatch`` in production, a script in tests."""

    def __call__(
        self, *paths: Path, recursive: bool, stop_event: asyncio.Event,
        force_polling: bool = False, poll_delay_ms: int = 1000,
    ) -> AsyncIterator[ChangeSet]: ...


def real_awatch(
    *paths: Path, recursive: bool, stop_event: asyncio.Event,
    force_polling: bool = False, poll_delay_ms: int = 1000,
) -> AsyncIterator[ChangeSet]:
    return watchfiles.awatch(
        *paths,
        recursive=recursive,
        stop_event=stop_event,
        # Explicit, so that WATCHFILES_FORCE_POLLING in the environment cannot decide.
        force_polling=force_polling,
        poll_delay_ms=poll_delay_ms,
        debounce=WATCH_DEBOUNCE_MS,
        step=WATCH_STEP_MS,
        # Our own filter runs on every path anyway; watchfiles' default one would hide
        # nothing we want and cost a Python call per event.
        watch_filter=None,
        yield_on_timeout=False,
    )
