"""The service around one Pipeline: start-up, signals, sd_notify, the watchdog, reload.

Signal handlers only set flags (an asyncio.Event each); the coroutines below act on them:
SIGTERM/SIGINT → ``STOPPING=1`` and an orderly drain (a second signal cuts it short), SIGHUP →
``RELOADING=1``, re-read the YAML, apply what can change live, ``READY=1`` — after every
``RELOADING=1``, whatever the reload met (systemd waits for it, and ``systemctl reload`` with it).
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from inboxd import logs
from inboxd.config import Config, ConfigError
from inboxd.exit_codes import EX_DEVICE, EX_SOFTWARE, OK
from inboxd.files.layout import inbox_writable, load_checked_config
from inboxd.files.lifecycle import Lifecycle
from inboxd.files.settling import survive_lease_breaks
from inboxd.heap import freeze_startup_heap
from inboxd.models import faults
from inboxd.models.device import with_device_defaults
from inboxd.models.engines.choice import load_here, make_engine
from inboxd.models.engines.interface import ModelEngine
from inboxd.models.onnx_model import OnnxModel
from inboxd.models.onnx_probe import probe_onnx_blocks, probe_reloaded_size
from inboxd.models.predictions import TaskModel, loaded_class
from inboxd.models.tasks import TasksEngine
from inboxd.pipeline.stalls import DEFAULT_PATIENCE_S
from inboxd.pipeline.wiring import Pipeline
from inboxd.service.notify import Notifier, abort_with_stacks
from inboxd.service.started import log_started

if TYPE_CHECKING:
    from inboxd.models.model import Model

# While the model loads, ask systemd for this much more start time, this often.
EXTEND_TIMEOUT_S = 30
EXTEND_EVERY_S = 10
STATUS_EVERY_S = 2.0
# What SIGHUP changes without a restart; everything else is logged as "needs restart".
LIVE_SECTIONS = ("capacity", "batch", "stats")


def load_tasks(config: Config) -> dict[str, TaskModel]:
    """A ``models:`` config's models by task name ({} for one ``model:``), each checked as a
    ``model:`` is; a problem names the task's key."""
    if config.models is None:
        return {}
    tasks = {}
    for task, block in config.models.items():
        try:
            tasks[task] = load_here(block, config.task_in_flight(task))
        except ConfigError as exc:
            raise ConfigError(f"models.{task}", exc.problems) from exc
    return tasks


class Service:
    def __init__(self, config: Config, config_path: Path | None,
                 overrides: dict[str, Any] | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.overrides = overrides
        self.notifier = Notifier()
        self.stop = asyncio.Event()
        self.force = asyncio.Event()
        self.reload_requested = asyncio.Event()
        self.pipeline: Pipeline | None = None
        # Why the last reload was refused, shown in STATUS= until one succeeds (None: it did).
        self.reload_failure: str | None = None
        self._patience_s = DEFAULT_PATIENCE_S  # the watchdog's ping interval, once known
        self.metrics: Any = None  # service.metrics.Metrics, only when metrics: is configured

    # -- start-up ----------------------------------------------------------------------------

    async def load(self) -> Pipeline:
        """Lock the instance, load and warm up the model (telling systemd it takes a while)."""
        # Refuse a second daemon of this instance before spending seconds on the model.
        lifecycle = Lifecycle(self.config)
        with inbox_writable():  # a read-only or full inbox: exit 78 or 75 saying so
            lifecycle.lock_instance()
        survive_lease_breaks()  # the main thread's, before any file is leased
        metrics = self.config.metrics
        if metrics.textfile is not None or metrics.listen is not None:
            # Imported only here: without metrics: no prometheus_client in the process at all.
            from inboxd.service.metrics import Metrics

            self.metrics = Metrics(self.config)
            await self.metrics.start()  # before the model: a port in use fails at once
        started = time.perf_counter()
        extending = asyncio.create_task(self._extend_start_timeout())
        try:
            # A graph may ask for any memory: tried aside first.
            await asyncio.to_thread(probe_onnx_blocks, self.config)
            tasks = await asyncio.to_thread(load_tasks, self.config)
            model = next(iter(tasks.values())) if tasks else await asyncio.to_thread(
                load_here, self.config.model, self.config.task_in_flight("model"))
            batch_bounds = [m.max_batch for m in (tasks or {"": model}).values()
                            if m.max_batch is not None]
            self.config, profile = with_device_defaults(  # unset keys follow the device
                self.config, model.device, min(batch_bounds, default=None))
            engine: ModelEngine | TasksEngine
            if not tasks:
                engine = make_engine(self.config, model)
            else:  # each task at its own batch size where it has one
                engine = TasksEngine(
                    tasks, {task: make_engine(self.config.model_copy(update={"model": block}),
                                              tasks[task])
                            for task, block in self.config.tasks.items()},
                    {task: block.batch.max_size for task, block in self.config.tasks.items()
                     if block.batch is not None})
            try:
                warmed, warm_s = await engine.warm_up(self.config.batch.max_size)
            except BaseException:
                engine.close()
                raise
        finally:
            extending.cancel()
        faults.install(model)
        self.pipeline = Pipeline(self.config, model, lifecycle=lifecycle, engine=engine,
                                 tasks=tasks or None)
        log_started(self.config, model, tasks, engine, self.pipeline.model_stage,
                    self.pipeline.watcher.plans, profile, warmed, warm_s, started)
        self._warn_if_slower_than_watchdog(list(warm_timings(tasks or {"model": model}).values()))
        if self.metrics is not None:
            self.metrics.attach(self.pipeline)
        return self.pipeline

    def _warn_if_slower_than_watchdog(self, measured: list[dict[int, float]]) -> None:
        """A batch that takes longer than the watchdog's patience (half ``WatchdogSec=``) stops
        the pings at its first real batch and gets the service restarted, again and again:
        say so now, with the fix, since the warm-up has just measured it."""
        patience_s = self.notifier.watchdog_interval_s()
        timings = [entry for batch_seconds in measured for entry in batch_seconds.items()]
        if patience_s is None or not timings:
            return
        size, took_s = max(timings, key=lambda entry: entry[1])
        if took_s < patience_s:
            return
        logs.emit(logging.WARNING, "watchdog_too_short",
                  f"a batch of {size} took {took_s:.1f} s at warm-up, longer than the "
                  f"{patience_s:.1f} s the watchdog allows a model call (half of WatchdogSec="
                  f"{2 * patience_s:.0f}s): systemd would restart inboxd at its first busy "
                  f"batch. Raise WatchdogSec= to at least {4 * took_s:.0f}s (a drop-in), or "
                  "lower batch.max_size", batch_size=size, batch_s=round(took_s, 3),
                  watchdog_patience_s=patience_s)

    def close_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

    async def _extend_start_timeout(self) -> None:
        while True:
            self.notifier.extend_timeout(EXTEND_TIMEOUT_S)
            await asyncio.sleep(EXTEND_EVERY_S)

    # -- signals -----------------------------------------------------------------------------

    def _on_stop_signal(self) -> None:
        if self.stop.is_set():
            self.force.set()
        self.stop.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_stop_signal)
        loop.add_signal_handler(signal.SIGHUP, self.reload_requested.set)
        faulthandler.enable()  # a crash prints every thread's stack; so does (safely) the
        loop.add_signal_handler(signal.SIGABRT, abort_with_stacks)  # watchdog's SIGABRT

    # -- run ---------------------------------------------------------------------------------

    async def run(self) -> int:
        self.install_signal_handlers()
        pipeline = await self.load()
        heap = freeze_startup_heap()

        def ready() -> None:
            # STATUS= first: `systemctl start` returns on READY=1, and what it shows next must
            # already have the status line (the status task runs only after this returns).
            self.notifier.status(self.status_line(pipeline))
            self.notifier.ready()
            logs.emit(logging.INFO, "ready", "ready: watching "
                      + ", ".join(str(p) for p in self.config.inbox.paths),
                      instance=self.config.instance, **heap)

        helpers = [asyncio.create_task(coro) for coro in (
            self._keep_status(pipeline), self._keep_watchdog(pipeline),
            self._reload_on_request(pipeline), self._stop_on_crash(pipeline))]
        await pipeline.serve(self.stop, self.force, ready, on_stopping=self._stopping)
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        self.close_metrics()
        logs.emit(logging.INFO, "stopped", "stopped", instance=self.config.instance)
        self.notifier.close()
        return exit_status(pipeline)

    def _stopping(self) -> None:
        self.notifier.stopping()
        logs.emit(logging.INFO, "stopping", "stopping: no new files are claimed; draining for "
                  f"up to {self.config.shutdown.grace_s:g} s", instance=self.config.instance)

    async def _stop_on_crash(self, pipeline: Pipeline) -> None:
        await pipeline.crash_event.wait()
        self.stop.set()
        if pipeline.crashed is not None:
            self.force.set()  # after a device fault the stages still drain (back to disk)

    def status_line(self, pipeline: Pipeline) -> str:
        line = pipeline.report.status_line(self._patience_s)
        if self.reload_failure is None:
            return line
        return f"reload failed, old configuration kept ({self.reload_failure}); {line}"

    async def _keep_status(self, pipeline: Pipeline) -> None:
        while True:
            self.notifier.status(self.status_line(pipeline))
            await asyncio.sleep(STATUS_EVERY_S)

    async def _keep_watchdog(self, pipeline: Pipeline) -> None:
        """``WATCHDOG=1`` only while no stage holding work has stood still past its limit
        (``Pipeline.stalls``): a model call that hangs (past half the watchdog timeout, or an
        engine's own ``call_limit_s``: a lost remote call is a retry there), a commit process
        that is stopped or stuck on a hung disk, files in flight while nothing moves. Then the
        pings stop and systemd restarts us; idle, with nothing waiting, they go on."""
        interval_s = self.notifier.watchdog_interval_s()
        if interval_s is None:
            return
        self._patience_s = interval_s
        while True:
            overdue = [stall for stall in pipeline.report.stalls(interval_s) if stall.overdue]
            if not overdue:
                self.notifier.watchdog()
            else:
                logs.emit(logging.ERROR, "watchdog",
                          f"{'; '.join(map(str, overdue))}: no watchdog ping, systemd will "
                          "restart the service", stalled=",".join(s.stage for s in overdue),
                          busy_s=round(max(s.stalled_s for s in overdue)))
            await asyncio.sleep(interval_s)

    # -- reload ------------------------------------------------------------------------------

    async def _reload_on_request(self, pipeline: Pipeline) -> None:
        while True:
            await self.reload_requested.wait()
            self.reload_requested.clear()
            self.notifier.reloading()
            try:
                await self.reload(pipeline)
            except Exception as exc:  # whatever it is, the old configuration serves on
                # A task that died here would leave systemd in "reloading" for ever, and no
                # later SIGHUP would be heard.
                self._reload_refused(f"{type(exc).__name__}: {exc}")
            finally:
                self.notifier.status(self.status_line(pipeline))  # the new capacities at once
                self.notifier.ready()

    def _reload_refused(self, why: str) -> None:
        self.reload_failure = " ".join(why.splitlines()[:1])[:200]
        logs.emit(logging.ERROR, "reloaded",
                  f"reload refused, the running configuration stays: {why} (fix "
                  f"{self.config_path or 'the config file'} and reload again: systemctl reload "
                  "inboxd, or SIGHUP)", error=why, applied=0)

    async def reload(self, pipeline: Pipeline) -> None:
        try:
            # In a thread: a config on a hung network filesystem must not stop the event loop.
            new = await asyncio.to_thread(load_checked_config, self.config_path, self.overrides)
            new, _ = with_device_defaults(new, pipeline.model.device, pipeline.model.max_batch)
            # A size an .onnx never ran yet: tried aside first, as at start-up (every task's).
            await asyncio.to_thread(probe_reloaded_size, self.config,
                                    warm_timings(pipeline.tasks or {"model": pipeline.model}),
                                    new.batch.max_size)
            # A larger batch is checked against the model (a .pt2 program's bound) and warmed
            # on the model's thread *before* the batcher may produce it.
            warmed, warm_s = await pipeline.engine.warm_up(new.batch.max_size)
        except ConfigError as exc:
            self._reload_refused(str(exc))
            return
        self.reload_failure = None
        live, restart = config_changes(self.config, new)
        pipeline.apply_live(new)
        self.config = pipeline.config
        message = "reloaded: " + (", ".join(live) or "no live change")
        if restart:
            message += "; needs restart to change: " + ", ".join(restart)
        logs.emit(logging.WARNING if restart else logging.INFO, "reloaded", message,
                  applied=len(live), changed_live=",".join(live) or None,
                  needs_restart=",".join(restart) or None,
                  warmed_batch_sizes=",".join(map(str, warmed)) or None,
                  warmup_s=round(warm_s, 3) if warmed else None)


def config_changes(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """Dotted keys whose value differs, split into (applied live, needs a restart)."""
    live: list[str] = []
    restart: list[str] = []
    old_data, new_data = old.model_dump(mode="json"), new.model_dump(mode="json")
    for section, new_value in new_data.items():
        old_value = old_data.get(section)
        if new_value == old_value:
            continue
        # Keys of both: a key only the old file had (a models: task taken out) is a change too.
        keys = ([f"{section}.{k}" for k in {**old_value, **new_value}
                 if new_value.get(k) != old_value.get(k)]
                if isinstance(new_value, dict) and isinstance(old_value, dict) else [section])
        (live if section in LIVE_SECTIONS else restart).extend(keys)
    return live, restart


def run_service(config: Config, config_path: Path | None,
                overrides: dict[str, Any] | None) -> int:
    return asyncio.run(Service(config, config_path, overrides).run())


def exit_status(pipeline: Pipeline) -> int:
    if pipeline.device_fault is not None:
        logs.emit(logging.CRITICAL, "stopped", f"exiting {EX_DEVICE}: the device failed "
                  f"({pipeline.device_fault}); a restart gets a fresh CUDA context",
                  exit_status=EX_DEVICE)
        return EX_DEVICE
    return EX_SOFTWARE if pipeline.crashed else OK


def warm_timings(models: Mapping[str, TaskModel]) -> dict[str, dict[int, float]]:
    """Each task's seconds per warmed batch size, for the models that run here and time their
    warm-up (torch's, and ONNX Runtime's without torch): remote and OCR models have none."""
    return {task: m.batch_seconds for task, m in models.items()
            if _is_torch_model(m) or isinstance(m, OnnxModel)}


def _is_torch_model(model: object) -> TypeGuard[Model]:
    """Whether ``model`` is a torch ``Model``: none can be where torch's model module was never
    loaded (a daemon serving its artifact without torch), and asking would load it."""
    torch_model = loaded_class("inboxd.models.model", "Model")
    return torch_model is not None and isinstance(model, torch_model)
