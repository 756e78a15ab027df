"""What the pipeline reports about itself: the periodic ``stats`` record (journal, stats file,
metrics hooks), the ``STATUS=`` line systemd shows, and the stages that stall.

Kept apart from the wiring because it owns different state: what the idle check compares
between two records, when a record was last logged, and the stall clock. It reads the stages
the wiring built and changes none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

from inboxd import logs
from inboxd.config import Config
from inboxd.decode.pool import DecodePool
from inboxd.files.commits import Commits
from inboxd.files.stats_file import StatsFile
from inboxd.models.engines.interface import ModelEngine
from inboxd.models.tasks import TasksEngine
from inboxd.pipeline.event_buffer import EventBuffer
from inboxd.pipeline.full_outputs import FullOutputs
from inboxd.pipeline.model_stage import ModelStage
from inboxd.pipeline.outcomes import Outcomes
from inboxd.pipeline.preprocess_cache import PreprocessCache
from inboxd.pipeline.queue import PipelineQueue
from inboxd.pipeline.stalls import DEFAULT_PATIENCE_S, Stall, StallClock
from inboxd.pipeline.task_stages import TaskStages
from inboxd.stats import Stats


class PipelineReport:
    def __init__(
        self,
        config: Config,
        stats: Stats,
        clock: Callable[[], float],
        *,
        event_buffer: EventBuffer,
        queue: PipelineQueue,
        preprocess_cache: PreprocessCache,
        decode_pool: DecodePool,
        model_stage: ModelStage | TaskStages,
        engine: ModelEngine | TasksEngine,
        commits: Commits,
        outcomes: Outcomes,
        outputs: FullOutputs,
    ) -> None:
        self.config = config
        self.stats = stats
        self.clock = clock
        self.event_buffer = event_buffer
        self.queue = queue
        self.preprocess_cache = preprocess_cache
        self.decode_pool = decode_pool
        self.model_stage = model_stage
        self.engine = engine
        self.commits = commits
        self.outcomes = outcomes
        self.outputs = outputs
        self._stats_changed = asyncio.Event()
        # What the idle check compares (``log_stats``): the counters at the last record, whether
        # work went on then, and when a record was last logged.
        self._counters_seen: tuple[Any, ...] = dataclasses.astuple(stats.counters)
        self._was_busy = True  # the first record always comes
        self._stats_logged_s = -math.inf
        # Each record logged, also where `inboxd stats -c` finds it without a journal.
        self.stats_file = StatsFile(config)
        # Called after each stats record (every stats.interval_s and at shutdown): the
        # metrics textfile is written here, so it is exactly as fresh as the journal.
        self.on_stats: list[Callable[[], None]] = []
        self.stall_clock = StallClock(clock)

    def reconfigure(self, config: Config) -> None:
        """SIGHUP: new stats settings; the next record comes at once with the new capacities."""
        self.config = config
        self._stats_changed.set()

    def stats_fields(self, reset: bool = True) -> dict[str, Any]:
        """The whole ``stats`` record (every field declared in ``inboxd.stats.FIELDS``);
        ``reset=False`` for a scrape, which must not start a new interval."""
        fields = self.stats.snapshot(reset)
        # The cache's second bound, in bytes (the generic layer fields count items).
        fields.update(PREPROCESS_CACHE_BYTES=self.preprocess_cache.size_bytes,
                      PREPROCESS_CACHE_CAPACITY_BYTES=self.preprocess_cache.capacity_bytes,
                      PREPROCESS_CACHE_HIGH_WATER_BYTES=self.preprocess_cache.high_water_bytes)
        # A remote engine's own figures (engine: ray: per-replica latency, lost batches).
        fields.update(self.engine.stats_fields())
        down_since_s = self.model_stage.unavailable_since_s
        fields["MODEL_UNAVAILABLE_S"] = (round(self.clock() - down_since_s, 3)
                                         if down_since_s is not None else 0)
        fields.update(OUTPUT_FULL_S=round(self.outputs.waited_s(), 3),
                      OUTPUT_FULL_WAITS=self.outputs.waits, OUTPUT_PROBES=self.outputs.probes)
        return fields

    def log_stats(self, quiet_when_idle: bool = False) -> dict[str, Any]:
        """The stats record. ``quiet_when_idle`` (the periodic one): logged while work goes on,
        once when it stops, and otherwise only every ``stats.heartbeat_s`` — an idle daemon
        does not fill the journal with identical records (the metrics still update)."""
        fields = self.stats_fields()
        counters = self.stats.counters
        moved = dataclasses.astuple(counters)
        busy = moved != self._counters_seen or any(
            value for key, value in fields.items() if key.endswith("_SIZE"))
        self._counters_seen = moved
        now_s = self.clock()
        if (not quiet_when_idle or busy or self._was_busy
                or now_s - self._stats_logged_s >= self.config.stats.heartbeat_s):
            logs.emit(
                logging.INFO, "stats",
                f"completed={counters.completed} failed={counters.failed} "
                f"queue={self.queue.qsize()}/{self.queue.maxsize} "
                f"buffer={self.event_buffer.size}/{self.event_buffer.capacity} "
                f"files/s={fields['FILES_PER_S']:.1f}",
                instance=self.config.instance,
                **fields,
            )
            self.stats_file.append(fields)
            self._stats_logged_s = now_s
        self._was_busy = busy
        for hook in self.on_stats:
            hook()
        return fields

    async def run_stats(self) -> None:
        while True:
            self._stats_changed.clear()
            # A reload that shortens the interval takes effect at once, not after the old one.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stats_changed.wait(), self.config.stats.interval_s)
                self._was_busy = True  # a reload: the next record shows the new capacities
                continue
            self.log_stats(quiet_when_idle=True)

    def status_line(self, patience_s: float = DEFAULT_PATIENCE_S) -> str:
        """The one line systemd shows in ``systemctl status`` (STATUS=), stalled stages last."""
        counters = self.stats.counters
        down_since_s = self.model_stage.unavailable_since_s
        down = ("" if down_since_s is None else
                f"model unreachable for {self.clock() - down_since_s:.0f} s (reconnecting), ")
        stalled = "".join(f"; {stall}" for stall in self.stalls(patience_s) if stall.shown)
        full = self.outputs.status()
        waiting = f"{down}{full}, " if full else down
        return (f"{waiting}queue {self.queue.qsize()}/{self.queue.maxsize}, "
                f"buffer {self.event_buffer.size}/{self.event_buffer.capacity}, "
                f"{counters.completed} completed, {counters.failed} failed, "
                f"{self.stats.recent_files_per_s():.1f} files/s{stalled}")

    def stalls(self, patience_s: float) -> list[Stall]:
        """Every stage holding work that has not moved (``pipeline.stalls``); ``patience_s``:
        the watchdog's ping interval, the least time any stage is given."""
        counters = self.stats.counters
        progress = (counters.enqueued, counters.completed, counters.failed, counters.retried,
                    counters.released, self.decode_pool.answered, self.model_stage.batches_done,
                    self.commits.replies)
        active = self.outcomes.active()
        # Waiting for a model cluster to come back, or for room in a full output folder, is no
        # stall: each is shown as what it is.
        waiting = (active > 0 and self.model_stage.unavailable_since_s is None
                   and not self.outputs.full)
        clock = self.stall_clock
        now = clock.look(progress, waiting)
        found: list[Stall] = []
        busy_since_s = self.model_stage.busy_since_s
        if busy_since_s is not None:
            found.append(Stall("model", now - clock.since(busy_since_s),
                               self.model_stage.call_limit_s(patience_s), " (on one batch)"))
        commit_waits_s = self.commits.stalled_s()
        if commit_waits_s is not None:
            stopped = self.commits.stopped()
            found.append(Stall("commit", now - clock.since(now - commit_waits_s), patience_s,
                               f" (its process, pid {self.commits.pid}, is "
                               "stopped: SIGCONT it, or restart inboxd)" if stopped else ""))
        timeout_s = self.config.preprocess.decode_timeout_s
        for pid, stopped_s in self.decode_pool.stopped_workers():
            found.append(Stall(f"decode worker {pid}", stopped_s, detail=" (stopped from "
                               f"outside; replaced after {timeout_s:g} s, its file retried)"))
        if waiting and not any(stall.shown for stall in found):
            # The longest a stage may legitimately take without any counter moving: a decode
            # (its counted time, then as long again stopped) or a model call, then one interval.
            limit_s = patience_s + 2 * max(timeout_s, self.model_stage.call_limit_s(patience_s))
            found.append(Stall("pipeline", now - clock.since(clock.moved_s), limit_s,
                               f" ({active} file(s) in flight, nothing moved)",
                               shown_after_s=patience_s))
        return found
