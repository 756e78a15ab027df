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
from inboxd.files.durable import output_full
from inboxd.files.index_rows import top_outcome
from inboxd.files.lifecycle import Lifecycle
from inboxd.files.renames import path_problem
from inboxd.files.settling import still_being_written
from inboxd.item import PermanentError, RefusedError, WorkItem
from inboxd.pipeline.full_outputs import FullOutputs
from inboxd.pipeline.held_files import HeldFiles
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
        held: HeldFiles | None = None,
        outputs: FullOutputs | None = None,
    ) -> None:
        self.config = config
        self.outputs = outputs or FullOutputs(config, run_io, clock)
        self.held = held  # files given back still open for writing: claimed again later
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

    def completed(self, item: WorkItem, duplicate: bool = False,
                  answer: dict[str, Any] | None = None) -> None:
        """``answer``: the result's answer, whose few words of what the model saw
        (``index_rows.top_outcome``) the record carries, so that ``journalctl -u inboxd -f``
        shows it."""
        counters = self.stats.counters
        counters.completed += 1
        if duplicate:
            counters.duplicates += 1
        latency_ms = (self.clock() - item.noticed_s) * 1000
        self.stats.latency_ms.add(latency_ms)

        def record() -> tuple[str, dict[str, Any]]:
            outcome = None if answer is None else top_outcome(answer)
            said = f": {outcome}" if outcome else ""
            return f"completed {item.key}{said}", {
                "path": item.key, "outcome": outcome or None,
                "result": item.name if item.name != item.key else None,
                "sha256": item.sha256, "latency_ms": round(latency_ms, 3),
                "attempts": item.attempts + 1, "duplicate": int(duplicate) if duplicate else None}

        logs.emit_made(logging.INFO, "completed", record)
        self._resolved()

    async def duplicate(self, item: WorkItem, name: str) -> None:
        """Its result already exists under ``name`` with the same sha256: finish the source,
        do not redo it (a rerun after a crash, or the same bytes dropped again)."""
        item.finishing, item.name = "success", name
        await self.finish(item, duplicate=True)

    async def finish(self, item: WorkItem, duplicate: bool = False) -> None:
        """The outcome is decided and recorded; move the source. A full or read-only done/ or
        failed/ holds the file here until a probe finds room (``pipeline/full_outputs.py``);
        other errors are waited out with backoff like any transient error. Neither ever turns
        a success into a failure: every input ends with exactly one outcome.

        A success finished here did not just come from the result writer (a duplicate, or a
        move retried): the result it names may be another commit's, renamed in and its folder
        not fsynced yet, so that fsync comes first (and is retried with the move)."""
        assert item.finishing is not None and item.name is not None
        while (problem := await self._try_finish(item)) is not None:
            exc, folder, doing = problem
            if not output_full(exc):
                await self.finish_later(item, exc, doing)
                return
            await self.outputs.hold(folder, exc)
        self.outputs.wrote()
        if item.finishing == "success":
            self.completed(item, duplicate=duplicate)
        else:
            self._failed(item)

    async def _try_finish(self, item: WorkItem) -> tuple[OSError, str, str | None] | None:
        """One try at ``finish``'s moves: None, or what went wrong, in which folder, doing
        what (None: the move itself)."""
        name = item.name or item.key
        if item.finishing == "success":
            try:
                await self.run_io(lambda: self.lifecycle.results.make_durable(name))
            except OSError as exc:
                folder = self.lifecycle.results.json_folder(name)
                return exc, folder, (f"cannot fsync {folder}, the folder of {item.key}'s "
                                     "result, before its source moves")
        try:
            if item.finishing == "success":
                await self.run_io(lambda: self.lifecycle.finish_success(
                    item.claimed_path, name, item.inbox_path, item.sha256 or ""))
            else:
                report = item.failure_report or {}
                await self.run_io(lambda: self.lifecycle.finish_failure(
                    item.claimed_path, item.key, report))
        except OSError as exc:
            return exc, self.destination(item), None
        return None

    def destination(self, item: WorkItem) -> str:
        """The folder a decided file's source moves to (what a full-disk wait names)."""
        if item.finishing != "success":
            return str(self.config.failed_dir)
        if self.config.inbox.after_success == "move":
            return str(self.config.done_dir)
        return str(item.inbox)

    async def finish_later(self, item: WorkItem, exc: OSError, doing: str | None = None) -> None:
        if output_full(exc):  # the folder's condition, not the file's: held until there is room
            await self.outputs.hold(self.destination(item), exc)
            await self.finish(item)
            return
        where = "done/" if item.finishing == "success" else "failed/"
        doing = doing or f"cannot move {item.key} to {where}"
        reason = f"{doing}: {exc.strerror or exc}"
        if path_problem(exc):
            # A folder on the way that is a file or a link: no wait and no retry changes that.
            await self._cannot_finish(item, reason)
            return
        item.finish_attempts += 1
        if item.finish_attempts >= self.config.retry.max_attempts:
            # Still failing after every backoff: the file waits on disk, its outcome not lost
            # (a durable result is found again by sha256; a failure is decided again).
            await self.release(item, f"{reason}, after {item.finish_attempts} attempts")
            return
        delay_s = backoff_s(item.finish_attempts, self.config.retry, self.rng)
        if self.retry_list.offer(item, delay_s):
            self.stats.counters.retried += 1
            logs.emit(logging.WARNING, "retry", f"{reason}; trying again in {delay_s:.1f} s",
                      path=item.key, attempt=item.finish_attempts, error=reason,
                      delay_ms=round(delay_s * 1000))
            self._settled.set()
            return
        # No room to wait here: the file waits on disk. Its durable result (if any) is found
        # again by sha256, so a later pass only finishes the move.
        await self.release(item, f"{reason}, and the retry list is full")

    async def _cannot_finish(self, item: WorkItem, reason: str) -> None:
        """The source can never reach its destination: a success goes to failed/ instead,
        saying so (its result stays filed); a failure that failed/ cannot take (no free name
        left there) waits in the inbox."""
        if item.finishing != "success":
            await self.release(item, reason)
            return
        result = self.lifecycle.results.json_file(item.name or item.key)
        item.errors.append(f"its result is filed ({result}), but {reason}")
        self._decide_failure(item, True, "io")
        await self.finish(item)

    async def error(self, item: WorkItem, exc: BaseException) -> None:
        """Permanent errors and exhausted retries go to failed/; the rest to the retry list,
        or back to disk when the retry list is full. A file that turns out to be still being
        written goes back to the inbox to settle, without counting an attempt."""
        reason = str(exc) or type(exc).__name__
        if await self.run_io(lambda: still_being_written(item.claimed_path, item.identity)):
            item.reset_for_retry()
            await self.give_back_held(item, "it is still being written (it changed after it "
                                      f"was claimed); it is taken again once it settles "
                                      f"({reason})")
            return
        item.errors.append(reason)
        item.attempts += 1
        permanent = isinstance(exc, PermanentError)
        if permanent or item.attempts >= self.config.retry.max_attempts:
            self._decide_failure(item, permanent, classify_failure(exc))
            await self.finish(item)
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

    async def give_back_held(self, item: WorkItem, why: str) -> None:
        """Back to the inbox because it is still being written (or held open for writing): its
        next claim waits, longer each time (``pipeline/held_files.py``)."""
        if self.held is not None:
            wait_s = self.held.given_back(item.inbox_path,
                                          item.identity[0] if item.identity else None)
            why = f"{why}; not claimed again for {wait_s:.1f} s"
        await self.release(item, why)

    async def release(self, item: WorkItem, why: str) -> None:
        await self.run_io(lambda: self.lifecycle.release(item.claimed_path,
                                                         item.inbox_path))
        self.stats.counters.released += 1
        logs.emit(logging.INFO, "released", f"returned {item.key} to the inbox: {why}",
                  path=item.key, reason=why)
        self._resolved()

    def _decide_failure(self, item: WorkItem, permanent: bool, reason_class: str) -> None:
        item.finishing, item.name = "failure", item.key
        item.failure_report = {
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

    def _failed(self, item: WorkItem) -> None:
        reason_class = str((item.failure_report or {}).get("reason_class", "other"))
        self.stats.counters.failed += 1
        self.stats.failed_by_class[reason_class] += 1
        logs.emit(logging.WARNING, "failed", f"failed {item.key}: {item.errors[-1]}",
                  path=item.key, error=item.errors[-1], attempts=item.attempts,
                  reason_class=reason_class)
        self._resolved()

    async def refused(self, item: WorkItem, reason: str) -> None:
        """A claimed name that is no image file at all (a link, a FIFO): fail it at once."""
        self.admitted()
        await self.error(item, RefusedError(reason))
