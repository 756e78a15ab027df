"""A full output is backpressure: the daemon waits, no photo fails.

An output folder that cannot take more (results/, done/, failed/: full, over quota or
read-only, ``durable.OUTPUT_FULL_ERRNOS``) is a condition of the daemon, not of the photo whose
write met it. The stage that met it *holds* its photos where they are (``hold``): still claimed,
their work done and kept (a batch's predictions, a decided failure), nothing decoded or inferred
again. Intake claims nothing meanwhile (``wait_for_room``), and every other stage stops at its
own bound behind the held one, so what waits is what was in flight, no more. One warning says
which folder and what to do; STATUS= and the stats record show it while it lasts. The folder
is probed with one small durable write, from ``retry.backoff_initial_ms`` doubling up to
``retry.output_probe_max_ms``; when the probe passes, the held stages try again, and the first
write that then succeeds ends the wait, with one record saying how long it took.

Held, not released to the inbox: a release would be a rename on that same full filesystem
(often refused too), and the photo would be claimed, read, decoded and inferred again each time
it came back; a held batch costs its small result documents in memory, bounded by the layers
it waits in (the figures: docs/decisions.md, "A full output holds the photos in flight, it does
not give them back").
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from inboxd import logs
from inboxd.config import Config
from inboxd.files.durable import TmpDir, output_full, probe_room, tmp_dir_in

RunProbe = Callable[[Callable[[], None]], Awaitable[None]]


class FullOutputs:
    def __init__(self, config: Config, run_io: RunProbe,
                 clock: Callable[[], float] = time.monotonic,
                 tmp_dir_of: Callable[[str], TmpDir] | None = None) -> None:
        self.config = config
        # Where a folder is probed: our temp folder in it (``Lifecycle.tmp_dir_of``).
        self.tmp_dir_of = tmp_dir_of or (
            lambda folder: tmp_dir_in(Path(folder), config.instance))
        self.run_io = run_io
        self.clock = clock
        self.folders: dict[str, str] = {}  # the full folders, each with why, first first
        self.since_s: float | None = None  # when the current wait began (None: no wait)
        self.waits = 0  # waits begun since start-up
        self.probes = 0
        self._room = asyncio.Event()
        self._room.set()
        self._prober: asyncio.Task[None] | None = None
        self._waited_for: list[str] = []  # every folder the current wait has met full
        self._probe_attempt = 0  # grows through a wait, so a flapping folder is probed less

    @property
    def full(self) -> bool:
        return not self._room.is_set()

    def waited_s(self) -> float:
        return 0.0 if self.since_s is None else self.clock() - self.since_s

    async def wait_for_room(self) -> None:
        """Returns at once unless an output is full; then once a probe found room."""
        await self._room.wait()

    async def hold(self, folder: str | Path, exc: OSError) -> None:
        """``folder`` refused a write with ``exc``: wait (holding whatever the caller holds)
        until a probe finds room there; the caller then tries its write again."""
        where = os.fspath(folder)
        self.folders.setdefault(where, exc.strerror or str(exc))
        if where not in self._waited_for:
            self._waited_for.append(where)
        if self.since_s is None:
            self.since_s = self.clock()
            self.waits += 1
            self._warn(where, exc)
        if self._room.is_set():
            self._room.clear()
            self._prober = asyncio.create_task(self._probe_until_room(), name="output-probe")
        await self._room.wait()

    def wrote(self) -> None:
        """A write to an output succeeded: a wait that a probe ended is over."""
        if self.since_s is None or not self._room.is_set():
            return
        waited_s = self.waited_s()
        logs.emit(logging.INFO, "output_resumed",
                  f"writing again after waiting {waited_s:.1f} s for room in "
                  f"{', '.join(self._waited_for)}", folder=self._waited_for[0],
                  waited_ms=round(waited_s * 1000))
        self._waited_for = []
        self.since_s = None
        self._probe_attempt = 0

    def status(self) -> str:
        """For STATUS=: which folder is full, since when; "" when none is."""
        if not self.full or not self.folders:
            return ""
        folder, why = next(iter(self.folders.items()))
        return (f"{folder} cannot take more ({why}) for {self.waited_s():.0f} s: waiting, "
                "claiming nothing")

    def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()

    def _warn(self, folder: str, exc: OSError) -> None:
        fix = ("remount it read-write" if exc.errno == errno.EROFS
               else "free space there (df -h, df -i) or raise its quota")
        max_s = self.config.retry.output_probe_max_ms / 1000
        logs.emit(logging.WARNING, "output_full",
                  f"{folder} cannot take more ({exc.strerror or exc}): {fix}. inboxd claims "
                  "no more files and holds the ones in flight, their work kept; it tries the "
                  f"folder every {max_s:g} s at most and carries on by itself once it can "
                  "write there. Nothing is failed for this", folder=folder,
                  error=exc.strerror or str(exc))

    async def _probe_until_room(self) -> None:
        retry = self.config.retry
        while True:
            delay_ms = min(retry.output_probe_max_ms,
                           retry.backoff_initial_ms * 2 ** self._probe_attempt)
            self._probe_attempt = min(self._probe_attempt + 1, 62)
            await asyncio.sleep(delay_ms / 1000)
            folders = list(self.folders)
            self.probes += 1
            try:
                for folder in folders:
                    await self.run_io(functools.partial(self._probe, folder))
            except OSError as exc:
                # Only a folder still full keeps the wait: any other error is the retried
                # write's to meet and handle as it handles it.
                if output_full(exc):
                    logs.log.debug("output probe: %s", exc)
                    continue
            # Anything else (a bug) must not leave every held stage waiting for ever: the
            # held writes are tried again, and meet whatever it was themselves.
            except Exception:
                logs.log.exception("probing %s for room failed; trying the writes again",
                                   ", ".join(folders))
            for folder in folders:
                self.folders.pop(folder, None)
            if not self.folders:
                self._room.set()
                self._prober = None
                return

    def _probe(self, folder: str) -> None:
        probe_room(self.tmp_dir_of(folder))
