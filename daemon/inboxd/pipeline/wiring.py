"""The whole pipeline, wired in data-flow order, and its start-up and shutdown.

watcher → event buffer → intake (await queue.put) → queue → preprocess → preprocess cache
→ batcher → model → result writer, with the retry list feeding back into the queue. With
``models:`` the cache feeds the task join, and each task its own batcher and model stage
(``pipeline/task_stages.py``).

Shutdown goes in the same order: stop noticing and claiming, let what is already claimed drain
(``queue.join()``, then the stages behind it) for at most ``shutdown.grace_s``, cancel the rest
with a reason, and hand every file still claimed back to the inbox, where it waits on disk.

Construction, the two modes and the ordered shutdown live in one module because they are read
together: the order things start in and the order they drain in are checked against each other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar, cast

from inboxd import logs
from inboxd.config import Config
from inboxd.decode import device_route
from inboxd.decode.pool import DecodePool
from inboxd.decode.worker_process import WorkerSettings
from inboxd.files.commit_process import CommitProcess, CommitProcessFailed
from inboxd.files.commits import Commits
from inboxd.files.layout import inbox_writable
from inboxd.files.lifecycle import Lifecycle
from inboxd.files.names import NameFilter
from inboxd.item import WorkItem
from inboxd.models.engines.interface import DeviceFault, ModelEngine
from inboxd.models.engines.local import LocalEngine
from inboxd.models.predictions import TaskModel, loaded_class
from inboxd.models.tasks import TasksEngine
from inboxd.models.tasks import memory_fields as task_memory_fields
from inboxd.os_threads import name_this_thread
from inboxd.pipeline.batcher import Batcher
from inboxd.pipeline.event_buffer import EventBuffer
from inboxd.pipeline.full_outputs import FullOutputs
from inboxd.pipeline.held_files import HeldFiles
from inboxd.pipeline.intake import Intake
from inboxd.pipeline.model_stage import ModelStage
from inboxd.pipeline.outcomes import Outcomes
from inboxd.pipeline.preprocess import Preprocessor, decoders_for
from inboxd.pipeline.preprocess_cache import PreprocessCache
from inboxd.pipeline.queue import PipelineQueue
from inboxd.pipeline.result_writer import ResultWriter
from inboxd.pipeline.retry_list import RetryList
from inboxd.pipeline.status import PipelineReport
from inboxd.pipeline.takeover_sweep import Takeovers
from inboxd.pipeline.task_stages import TaskStages
from inboxd.pipeline.watch_events import WatchFn, real_awatch
from inboxd.pipeline.watcher import Watcher
from inboxd.stats import Stats

if TYPE_CHECKING:  # OCR loads torch and OpenCV: only a daemon that runs it imports them
    from inboxd.models.ocr_model import OcrModel


def ocr_models(models: Iterable[TaskModel]) -> list[OcrModel]:
    """The OCR tasks among ``models`` (none unless a daemon loaded the OCR model's module)."""
    ocr = loaded_class("inboxd.models.ocr_model", "OcrModel")
    return [cast("OcrModel", each) for each in models
            if ocr is not None and isinstance(each, ocr)]

T = TypeVar("T")
POLL_S = 0.02


class Pipeline:
    def __init__(
        self,
        config: Config,
        model: TaskModel,
        watch: WatchFn = real_awatch,
        clock: Callable[[], float] = time.monotonic,
        lifecycle: Lifecycle | None = None,
        engine: ModelEngine | TasksEngine | None = None,
        tasks: dict[str, TaskModel] | None = None,
    ) -> None:
        """``tasks``: a ``models:`` config's models by task name (``model`` is then the first),
        each photo decoded once for all of them and answered in one result."""
        self.config = config
        self.model = model
        self.tasks = tasks
        # Every task's model (the one model: alone without models:).
        self.models: list[TaskModel] = list(tasks.values()) if tasks is not None else [model]
        self.clock = clock
        capacity = config.capacity
        self.stats = Stats(clock)
        self.stats.memory_probe = (model.memory_fields if tasks is None
                                   else lambda: task_memory_fields(tasks))
        self.lifecycle = lifecycle or Lifecycle(config)
        self.io_executor = ThreadPoolExecutor(1, thread_name_prefix="inboxd-io",
                                              initializer=name_this_thread)

        self.event_buffer = EventBuffer(capacity.event_buffer)
        self.held = HeldFiles.from_config(config, clock)
        self.queue = PipelineQueue(capacity.queue)
        self.preprocess_cache = PreprocessCache(capacity.preprocess_cache,
                                                capacity.preprocess_cache_mb)
        self.retry_list = RetryList(capacity.retry_list, self._requeue, clock)
        self.outputs = FullOutputs(config, self.run_io, clock, self.lifecycle.tmp_dir_of)
        self.outcomes = Outcomes(config, self.lifecycle, self.stats, self.retry_list,
                                 self.run_io, clock, held=self.held, outputs=self.outputs)
        self.watcher = Watcher(
            config.inbox.paths, config.inbox.recursive, NameFilter(config.inbox.include),
            self.event_buffer, self.stats, config.inbox.rescan_interval_s, clock, watch,
            poll=config.inbox.poll, poll_interval_ms=config.inbox.poll_interval_ms,
        )
        self.takeovers = Takeovers(self.lifecycle, self.stats, self.run_io,
                                   config.inbox.rescan_interval_s, self.watcher.request_rescan)
        self.intake = Intake(
            config, self.event_buffer, self.queue, self.lifecycle, self.stats,
            on_enqueued=lambda item: self.outcomes.admitted(),
            on_refused=self.outcomes.refused, clock=clock, held=self.held,
            outputs=self.outputs,
        )
        pre = config.preprocess
        # The model says what its input is; preprocess.resize says how exactly the workers
        # make it (the GPU route's tensors are torchvision's either way).
        specs = [dataclasses.replace(m.spec, resize_mode=pre.resize)
                 for m in (tasks.values() if tasks is not None else [model])]
        self.decode_pool = DecodePool(pre.workers, WorkerSettings(
            specs[0], pre.max_image_pixels, pre.max_file_mb << 20, pre.decode_memory_mb << 20,
            pre.decode_timeout_s, tuple(specs[1:])))
        # The device decoder makes one crop per file; several tasks' cuts come from the workers.
        gpu_decode = pre.gpu_decode if len(specs) == 1 else "off"
        self.preprocessor = Preprocessor(
            self.queue, self.preprocess_cache, self.decode_pool, pre.workers, pre.files_per_request,
            on_error=self.outcomes.error,
            existing_sha256=self.lifecycle.results.recorded_sha256,
            on_duplicate=lambda item: self.outcomes.duplicate(item, item.key),
            on_changing=self.outcomes.give_back_held, clock=clock,
            device_route=device_route.build(gpu_decode, model.device, model.spec,
                                            pre.max_image_pixels, pre.max_file_mb << 20,
                                            decoders_for(pre.workers)),
            open_claimed=self.lifecycle.open_claimed,
        )
        self.commits: Commits = CommitProcess(config, self.lifecycle)
        self.result_writer = ResultWriter(config, model, self.lifecycle, self.commits,
                                          self.outcomes, self.run_io, clock, tasks)
        self.stats.register(self.event_buffer, self.queue, self.preprocessor,
                            self.preprocess_cache)
        self.engine: ModelEngine | TasksEngine
        self.model_stage: ModelStage | TaskStages
        self.batcher: Batcher | None = None  # one model's (with models:, each task has its own)
        if tasks is None:
            self.engine = engine or LocalEngine(model)
            assert not isinstance(self.engine, TasksEngine)
            self.batcher = Batcher(
                self.preprocess_cache, config.batch.max_size, config.batch.max_delay_ms, clock,
                self.stats.batch_sizes, more_coming=self._more_decoded)
            self.model_stage = ModelStage(
                self.engine, self.batcher, self.result_writer.submit, clock,
                release=self.outcomes.release, on_device_fault=self._device_fault,
                on_inferred=lambda s: self.stats.inference_ms.add(s * 1000),
                in_flight=capacity.in_flight_batches)
            self.stats.register(self.batcher, self.model_stage)
        else:
            self.engine = engine or TasksEngine(
                tasks, {task: LocalEngine(m) for task, m in tasks.items()})
            assert isinstance(self.engine, TasksEngine), "models: runs on a TasksEngine"
            self.model_stage = TaskStages(
                config, self.engine.engines, self.preprocess_cache, self.stats,
                self.result_writer.submit, self.outcomes.release, clock,
                upstream_busy=lambda: self.preprocess_cache.size > 0 or self._more_decoded(),
                on_device_fault=self._device_fault)
            self.stats.register(*self.model_stage.layers)
        self.stats.register(self.result_writer, self.result_writer.committing, self.retry_list)
        for ocr in ocr_models(self.models):  # the OCR task's fan-out: crops for the recogniser
            ocr.crops.resize(capacity.ocr_crops)
            self.stats.register(ocr.crops)
        self._intake_tasks: list[asyncio.Task[None]] = []
        self._processing_tasks: list[asyncio.Task[None]] = []
        self.crashed: BaseException | None = None
        self.device_fault: DeviceFault | None = None
        # Set by a stage crash or a device fault: the service stops (and exits non-zero).
        self.crash_event = asyncio.Event()
        # The stats record, STATUS= and the stall list: what the pipeline says about itself.
        self.report = PipelineReport(
            config, self.stats, clock, event_buffer=self.event_buffer, queue=self.queue,
            preprocess_cache=self.preprocess_cache, decode_pool=self.decode_pool,
            model_stage=self.model_stage, engine=self.engine,
            commits=self.commits, outcomes=self.outcomes, outputs=self.outputs)

    def _more_decoded(self) -> bool:
        """Files are on their way to the preprocess cache (queued, or being decoded)."""
        return self.queue.qsize() > 0 or self.preprocessor.in_progress > 0

    async def run_io(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.io_executor, work)

    async def _requeue(self, item: WorkItem) -> None:
        if item.finishing is not None:  # only its move is left: no need to redo the work
            await self.outcomes.finish(item)
            return
        started = time.perf_counter()
        await self.queue.put(item)
        self.stats.put_wait_ms.add((time.perf_counter() - started) * 1000)
        item.enqueued_s = self.clock()

    def _device_fault(self, fault: DeviceFault) -> None:
        self.device_fault = fault
        self.crash_event.set()

    # -- start-up ----------------------------------------------------------------------------

    def prepare(self) -> int:
        """Folders exist, stale temp files are gone, files a killed run had claimed are back
        in the inbox. Returns how many were returned."""
        with inbox_writable():  # a read-only or full inbox: exit 78 or 75 saying so
            self.lifecycle.lock_instance()
            problems = self.lifecycle.prepare()
        for problem in problems:
            logs.emit(logging.WARNING, "prepare_error", f"cannot prepare {problem}; files wait "
                      "in the inbox and writing is retried", error=problem)
        returned, failed = self.lifecycle.recover()
        if returned:
            logs.emit(logging.INFO, "recovered",
                      f"returned {returned} file(s) claimed by an earlier run to the inbox",
                      recovered=returned)
        if failed:
            logs.emit(logging.ERROR, "failed", f"{failed} file(s) were in flight at repeated "
                      "crashes: moved to failed/ with the crash's reason", failed=failed)
            self.stats.counters.failed += failed
            self.stats.failed_by_class["other"] += failed
        self.takeovers.sweep()  # dead instances' files too, before the first scan
        return returned

    def _spawn(self, tasks: list[asyncio.Task[None]], coro: Coroutine[Any, Any, None],
               name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._crashed)
        tasks.append(task)

    def _crashed(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        logs.log.critical("pipeline stage %s crashed: %r", task.get_name(), exc,
                          exc_info=exc)
        self.crashed = exc
        # A commit process that died is a kill, not the doing of the files in flight.
        if not isinstance(exc, CommitProcessFailed):
            try:
                self.lifecycle.crash_ledger.record(f"stage {task.get_name()} crashed: {exc!r}",
                                            self._inside(task.get_name()))
            except OSError as record_error:
                logs.log.error("cannot record which files were in flight: %s", record_error)
        self.crash_event.set()

    def _inside(self, stage: str) -> set[str] | None:
        """The claimed paths of the files the crashed ``stage`` held, for the crash ledger: a
        crash is counted against those, not against every file in flight (a model stage that
        crashed on one batch must not fail the photos being decoded meanwhile). None for a
        stage that cannot say which files it held."""
        held = (self.model_stage.crashed_with if stage == "model" else
                self.result_writer.crashed_with if stage == "result-writer" else
                self.preprocessor.crashed_with if stage.startswith("preprocess-") else None)
        return None if held is None else {os.path.normpath(item.claimed_path) for item in held}

    def start_processing(self) -> None:
        # Helper processes start from this thread, which lives as long as they are wanted (the
        # kernel kills a child when the thread that started it ends); they import Pillow and
        # numpy while the rest starts up.
        self.decode_pool.start()
        self.commits.start()
        for n in range(self.preprocessor.decoders):
            self._spawn(self._processing_tasks, self.preprocessor.run_worker(), f"preprocess-{n}")
        self._spawn(self._processing_tasks, self.model_stage.run(), "model")
        self._spawn(self._processing_tasks, self.result_writer.run(), "result-writer")
        self._spawn(self._processing_tasks, self.retry_list.run(), "retry-list")

    def start_intake(self, watch: bool) -> None:
        if watch:  # watch first, then scan: a file dropped in between is seen by one or both
            self._spawn(self._intake_tasks, self.watcher.run_watch(), "watcher")
            self._spawn(self._intake_tasks, self.watcher.run_scans(), "scanner")
            self._spawn(self._intake_tasks, self.takeovers.run(), "takeover")
            self._spawn(self._intake_tasks, self.takeovers.watch_claim_areas(), "claim-areas")
        self._spawn(self._intake_tasks, self.intake.run(), "intake")

    # -- the two modes -----------------------------------------------------------------------

    async def serve(
        self,
        stop: asyncio.Event,
        force: asyncio.Event,
        on_ready: Callable[[], None] = lambda: None,
        on_stopping: Callable[[], None] = lambda: None,
    ) -> None:
        """``inboxd run``: until ``stop`` is set, then drain (cut short by ``force``)."""
        self.prepare()
        self.start_processing()
        self.start_intake(watch=True)
        stats_task = asyncio.create_task(self.report.run_stats(), name="stats")
        on_ready()
        await stop.wait()
        on_stopping()
        stats_task.cancel()
        await self.shutdown(self.config.shutdown.grace_s, force)

    def apply_live(self, config: Config) -> None:
        """SIGHUP: the new capacities, batch and stats settings take effect now; the rest of
        ``config`` waits for a restart (the caller says which)."""
        capacity = config.capacity
        self.event_buffer.capacity = capacity.event_buffer
        self.held.resize(capacity.event_buffer)
        self.queue.resize(capacity.queue)
        self.preprocess_cache.resize(capacity.preprocess_cache, capacity.preprocess_cache_mb)
        self.retry_list.capacity = capacity.retry_list
        for ocr in ocr_models(self.models):
            ocr.crops.resize(capacity.ocr_crops)
        self.config = self.config.model_copy(
            update={"capacity": capacity, "batch": config.batch, "stats": config.stats}
        )
        if isinstance(self.model_stage, TaskStages):  # a task's own batch: keys need a restart
            self.model_stage.configure(self.config)
        else:
            self.model_stage.resize(capacity.in_flight_batches)
            self.model_stage.batcher.configure(config.batch.max_size, config.batch.max_delay_ms)
        self.report.reconfigure(self.config)

    async def process_backlog(self, progress: Callable[[], None] | None = None,
                              stop: asyncio.Event | None = None) -> None:
        """``inboxd once``: take everything in the inbox now (rescanning while the buffer had
        to defer), wait until each file has an outcome, then return. ``stop`` (a signal) ends
        it early like ``run``'s shutdown: drain, then hand what is still claimed back."""
        stop = stop or asyncio.Event()
        self.prepare()
        self.start_processing()
        self.start_intake(watch=False)
        while not self.crash_event.is_set() and not stop.is_set():
            claimed_before = self.intake.claimed
            await self.watcher.scan()
            await self._until(lambda: self.event_buffer.size == 0 and not self.intake.busy
                              and self.outcomes.active() == 0, progress, stop)
            if self.intake.claimed == claimed_before and not self.watcher.backlog_on_disk:
                if self.retry_list.size == 0:
                    break
                await self._until(lambda: self.outcomes.in_flight == 0, progress, stop)
        # Stopped by a signal: drain for the grace period; otherwise drained already (a
        # crashed stage cuts the drain short in shutdown itself).
        await self.shutdown(self.config.shutdown.grace_s if stop.is_set() else None,
                            asyncio.Event())

    async def _until(self, done: Callable[[], bool], progress: Callable[[], None] | None,
                     stop: asyncio.Event) -> None:
        while not done() and not self.crash_event.is_set() and not stop.is_set():
            if progress is not None:
                progress()
            await asyncio.sleep(POLL_S)

    # -- shutdown ----------------------------------------------------------------------------

    async def shutdown(self, grace_s: float | None, force: asyncio.Event) -> None:
        self.watcher.stop()
        await _cancel(self._intake_tasks)
        self.event_buffer.clear()  # only names: the files are still in the inbox
        if self.crashed is not None:
            force.set()  # a crashed stage drains nothing: waiting on it would wait for ever
        full = self.outputs.full  # nothing held for room can drain: it goes back now
        if full:
            grace_s = 0
        drain = asyncio.create_task(self._drain())
        forced = asyncio.create_task(_wait(force))
        await asyncio.wait({drain, forced}, timeout=grace_s,
                           return_when=asyncio.FIRST_COMPLETED)
        if not drain.done():
            why = ("a stage crashed" if self.crashed is not None else "second signal"
                   if force.is_set() else "an output folder is full" if full
                   else f"grace period of {grace_s:g} s over")
            where = ("stay claimed for the next start-up" if self.crashed is not None
                     else "go back to the inbox")
            logs.emit(logging.WARNING, "stopping",
                      f"{why} with {self.outcomes.active()} file(s) in flight: they {where}",
                      in_flight=self.outcomes.active())
        await _cancel([drain, forced])
        await _cancel(self._processing_tasks)
        self.outputs.close()
        self.intake.close()
        self.preprocessor.close()
        self.model_stage.close()
        for item in self.retry_list.drain():
            self.lifecycle.release(item.claimed_path, item.inbox_path)
            self.stats.counters.released += 1
        self.io_executor.shutdown(wait=True)
        self.commits.close()  # what it still has is committed (or, past a timeout, recovered)
        self.result_writer.count_abandoned()
        if self.crashed is None:
            returned, _ = self.lifecycle.recover()  # anything cancelled mid-flight
            self.stats.counters.released += returned
        # After a crash what was in flight stays claimed: the next start-up returns it, and
        # fails the file instead if it was in flight at the crash before this one too.
        self.lifecycle.unlock_instance()
        self.report.log_stats()

    async def _drain(self) -> None:
        await self.queue.join()
        await self.outcomes.wait_until_inactive()


async def _wait(event: asyncio.Event) -> None:
    await event.wait()


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel("inboxd is shutting down")
    await asyncio.gather(*tasks, return_exceptions=True)
    tasks.clear()
