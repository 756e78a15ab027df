"""The boundary to the OS watcher: ``watchfiles.awatch`` in production, a script in tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

import watchfiles

# Let awatch hand over changes at most this long after they happen: the intake's settle time
# is the real "is it finished" test, so a long debounce only adds latency. During a flood the
# first set comes this long after the first drop, and the pipeline idles until then: at 50 ms
# the first of 4,000 results came 125-172 ms after the first drop, at 20 ms 92-118 ms (three
# pairs, 12-02). It also bounds one change set during a flood (before the watcher pauses,
# ``pipeline/watcher.py``): at 200 ms a 20,000-file drop gave a first set of 3,669 changes and
# the daemon's peak RSS grew 1-2 MB more than under a 2,000-file drop. A single drop is
# handed over WATCH_STEP_MS after it, whatever this says.
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
