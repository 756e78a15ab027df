"""``inboxd once``: take what waits in the inbox, then exit (no systemd, no watching after);
on a terminal, a progress bar (``service/progress.py``).

The same start-up and pipeline as the service (``service/runner.py``), and the same stop: a
signal only sets a flag, and the pipeline drains and hands what it claimed back to the inbox.
"""

from __future__ import annotations

import asyncio
import signal
import sys

from inboxd import logs
from inboxd.config import Config
from inboxd.exit_codes import OK, SOME_FAILED
from inboxd.heap import freeze_startup_heap
from inboxd.service.progress import ProgressBar
from inboxd.service.runner import Service, exit_status


def run_once(config: Config) -> int:
    return asyncio.run(_once(config, progress=sys.stderr.isatty()))


async def _once(config: Config, progress: bool) -> int:
    service = Service(config, None)
    stopped_by: list[int] = []
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        # Only flags, as in run: the pipeline drains and hands claimed files back itself.
        stopped_by.append(signum)
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, on_signal, signum)
    pipeline = await service.load()
    freeze_startup_heap()
    counters = pipeline.stats.counters
    bar: ProgressBar | None = None
    if progress:
        bar = ProgressBar(sys.stderr, await asyncio.to_thread(pipeline.watcher.count_waiting))
        for handler in logs.log.handlers:
            handler.addFilter(bar)

    def show() -> None:
        if bar is not None:
            bar.draw(counters.completed, counters.failed)

    await pipeline.process_backlog(show if progress else None, stop)
    service.close_metrics()
    if bar is not None:
        bar.finish(counters.completed, counters.failed)
        for handler in logs.log.handlers:
            handler.removeFilter(bar)
    print(f"inboxd once: {counters.completed} completed, {counters.failed} failed")
    if pipeline.crash_event.is_set():
        return exit_status(pipeline)
    if stopped_by:
        waiting = pipeline.watcher.count_waiting()
        name = signal.Signals(stopped_by[0]).name
        print(f"inboxd once: stopped by {name}; {waiting} file(s) wait in the inbox for the "
              "next run", file=sys.stderr)
        return 128 + stopped_by[0]
    return SOME_FAILED if counters.failed else OK
