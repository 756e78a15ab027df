"""Dead instances on a shared inbox: at start-up and every ``inbox.rescan_interval_s``, the
files another instance had claimed before it died go back to the inbox (``files.takeover``),
where the scan finds them again. Each takeover is one ``instance_taken_over`` journal record;
what is left alone on purpose (a folder without a lock, a planted link) is said once.

And this instance's own claim areas: every ``AREA_CHECK_S`` their names are compared with the
folders held, and one a member of the group moved or replaced is put back
(``Lifecycle.ensure_claim_areas``), so that the claimed paths in flight lead to their files
again before their next step needs them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from inboxd import logs
from inboxd.files.claim_area import AREA_CHECK_S
from inboxd.files.lifecycle import Lifecycle
from inboxd.files.takeover import Sweep, take_over_dead
from inboxd.stats import Stats

# Paths already reported as left alone: bounded, so a flood of planted names cannot grow it.
MAX_REPORTED = 256


class Takeovers:
    def __init__(self, lifecycle: Lifecycle, stats: Stats,
                 run_io: Callable[[Callable[[], Any]], Awaitable[Any]],
                 interval_s: float, on_returned: Callable[[], None]) -> None:
        self.lifecycle = lifecycle
        self.stats = stats
        self.run_io = run_io
        self.interval_s = interval_s
        self.on_returned = on_returned  # e.g. ask for a rescan: the files are in the inbox now
        self._reported: set[str] = set()

    def sweep(self) -> int:
        """One look at every other instance's folder (blocking: at start-up, before any
        stage runs); returns the files given back."""
        try:
            return self.account(take_over_dead(self.lifecycle))
        except OSError as exc:
            return self._failed(exc)

    def account(self, found: Sweep) -> int:
        """Log and count what a sweep did (on the event loop: the counters are its)."""
        returned = 0
        for taken in found.taken:
            count = len(taken.returned)
            returned += count
            self.stats.counters.taken_over += count
            if taken.failed:
                self.stats.counters.failed += taken.failed
                self.stats.failed_by_class["other"] += taken.failed
            shown = ", ".join(taken.returned[:10]) + (" …" if count > 10 else "")
            logs.emit(logging.WARNING, "instance_taken_over",
                      f"instance {taken.instance!r} is dead (its lock was free): returned its "
                      f"{count} claimed file(s) to {taken.inbox}"
                      + (f" ({shown})" if count else "")
                      + (f"; {taken.failed} in flight at repeated crashes went to failed/"
                         if taken.failed else "")
                      + (f"; {taken.finished} whose result was already durable finished"
                         if taken.finished else ""),
                      dead_instance=taken.instance, inbox=str(taken.inbox), returned=count,
                      failed=taken.failed, finished=taken.finished,
                      instance=self.lifecycle.config.instance)
        for path, why in found.refused:
            if path not in self._reported and len(self._reported) < MAX_REPORTED:
                self._reported.add(path)
                logs.emit(logging.WARNING, "takeover_refused", f"left alone: {path}: {why}",
                          path=path)
        return returned

    def _failed(self, exc: OSError) -> int:
        logs.emit(logging.WARNING, "takeover_error",
                  f"cannot look for dead instances' files: {exc}", error=str(exc))
        return 0

    async def watch_claim_areas(self) -> None:
        while True:
            await asyncio.sleep(AREA_CHECK_S)
            try:
                put_back = await self.run_io(self.lifecycle.ensure_claim_areas)
            except OSError as exc:
                logs.emit(logging.WARNING, "takeover_error",
                          f"cannot look at the claim areas: {exc}", error=str(exc))
                continue
            if put_back:
                self.on_returned()  # what a former area held may be back in the inbox

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                found = await self.run_io(lambda: take_over_dead(self.lifecycle))
            except OSError as exc:
                self._failed(exc)
                continue
            if self.account(found):
                self.on_returned()
