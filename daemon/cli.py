"""``inboxd``: the command line.

Exit statuses: 0 success; 1 ``once`` finished but some file failed; 2 usage; 70 (EX_SOFTWARE)
a stage crashed; 75 (EX_TEMPFAIL) this instance name is already running on the inbox;
78 (EX_CONFIG) the configuration cannot work — systemd's
``RestartPreventExitStatus=78`` then stops instead of restarting into the same error.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from daemon import __version__, faults, logs
from daemon.config import EX_CONFIG, Config, ConfigError, load_config
from daemon.lifecycle import InstanceBusy

EX_SOFTWARE = 70
EX_TEMPFAIL = 75


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command or "run"
    try:
        return int(COMMANDS[command](args))
    except ConfigError as exc:
        print(f"inboxd: the configuration cannot be used:\n{exc}", file=sys.stderr)
        return EX_CONFIG
    except InstanceBusy as exc:
        print(f"inboxd: {exc}", file=sys.stderr)
        return EX_TEMPFAIL


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inboxd", description="Watch inbox folders and run a vision model on each image."
    )
    parser.add_argument("--version", action="version", version=f"inboxd {__version__}")
    sub = parser.add_subparsers(dest="command")

    def with_config(name: str, help_text: str) -> argparse.ArgumentParser:
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.add_argument("-c", "--config", type=Path, default=None,
                             help="YAML config file (default: the embedded config/inboxd.yaml)")
        command.add_argument("--instance", default=None,
                             help="instance name (overrides the config's `instance`)")
        return command

    with_config("run", "run the daemon in the foreground until SIGTERM/SIGINT")
    with_config("once", "process everything in the inbox now, then exit (1 if any file failed)")
    with_config("check-config", "validate the config file and print the resolved settings")
    submit = with_config("submit", "copy files into the inbox atomically (temp name, then rename)")
    submit.add_argument("files", nargs="+", type=Path)
    with_config("recover", "return the files an instance had claimed to the inbox "
                "(only while that instance is not running; start-up does this by itself)")
    return parser


def read_config(args: argparse.Namespace) -> Config:
    overrides = {"instance": args.instance} if args.instance else None
    return load_config(args.config, overrides)


def setup_logging(level: str) -> None:
    try:
        from daemon.journal import setup_logging as setup_journal_or_stderr
    except ImportError:
        logs.setup_stderr_logging(level)
        return
    setup_journal_or_stderr(level)


# -- commands ----------------------------------------------------------------------------------


def cmd_check_config(args: argparse.Namespace) -> int:
    config = read_config(args)
    print(f"{args.config or 'config/inboxd.yaml (embedded default)'}: OK")
    for key, value in config.model_dump(mode="json").items():
        print(f"  {key}: {value}")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    config = read_config(args)
    inbox = config.inbox.paths[0]
    inbox.mkdir(parents=True, exist_ok=True)
    status = 0
    for source in args.files:
        try:
            target = submit_file(source, inbox)
        except OSError as exc:
            print(f"inboxd submit: {source}: {exc.strerror or exc}", file=sys.stderr)
            status = 1
            continue
        print(target)
    return status


def submit_file(source: Path, inbox: Path) -> Path:
    """Copy under a hidden temp name (never picked up), fsync, then rename into place: the
    daemon sees the whole file or nothing. copy2 keeps the old mtime, so it is taken at once."""
    from daemon.lifecycle import unique_path

    tmp = inbox / f".{source.name}.{os.getpid()}.submit.tmp"
    shutil.copy2(source, tmp)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    target = unique_path(inbox / source.name)
    os.rename(tmp, target)
    return target


def cmd_recover(args: argparse.Namespace) -> int:
    from daemon.lifecycle import Lifecycle

    config = read_config(args)
    lifecycle = Lifecycle(config)
    lifecycle.lock_instance()
    returned = lifecycle.recover()
    lifecycle.unlock_instance()
    print(f"returned {returned} file(s) claimed by instance {config.instance!r} to the inbox")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    config = read_config(args)
    setup_logging(config.log_level)
    return asyncio.run(Daemon(config).run())


def cmd_once(args: argparse.Namespace) -> int:
    config = read_config(args)
    setup_logging(config.log_level)
    return asyncio.run(Daemon(config).once(progress=sys.stdout.isatty()))


COMMANDS: dict[str, Any] = {
    "run": cmd_run,
    "once": cmd_once,
    "check-config": cmd_check_config,
    "submit": cmd_submit,
    "recover": cmd_recover,
}


class Daemon:
    """Start-up (model load and warm-up) and signals around one Pipeline."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.stop = asyncio.Event()
        self.force = asyncio.Event()

    def _load(self) -> Any:
        from daemon.lifecycle import Lifecycle
        from daemon.model import load_model
        from daemon.pipeline import Pipeline

        # Refuse a second daemon of this instance before spending seconds on the model.
        lifecycle = Lifecycle(self.config)
        lifecycle.lock_instance()
        started = time.perf_counter()
        model = load_model(self.config.model)
        warm_s = model.warm_up(self.config.batch.max_size)
        faults.install(model)
        logs.emit(logging.INFO, "started",
                  f"inboxd {__version__}: model {model.name} on {model.device} "
                  f"(loaded and warmed up in {time.perf_counter() - started:.1f} s)",
                  model=model.name, device=str(model.device), warmup_s=round(warm_s, 3),
                  instance=self.config.instance, version=__version__)
        return Pipeline(self.config, model, lifecycle=lifecycle)

    def _on_signal(self, signum: int) -> None:
        # Only flags here: the pipeline's own tasks do the stopping, in order.
        if self.stop.is_set():
            self.force.set()
        self.stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
        pipeline = self._load()

        def ready() -> None:
            logs.emit(logging.INFO, "ready", "ready: watching "
                      + ", ".join(str(p) for p in self.config.inbox.paths))

        serving = asyncio.create_task(pipeline.serve(self.stop, self.force, ready))
        crashed = asyncio.create_task(self._watch_crash(pipeline))
        await asyncio.wait({serving, crashed}, return_when=asyncio.FIRST_COMPLETED)
        if not serving.done():
            self.stop.set()
            self.force.set()
            await serving
        crashed.cancel()
        logs.emit(logging.INFO, "stopped", "stopped")
        return EX_SOFTWARE if pipeline.crashed else 0

    async def _watch_crash(self, pipeline: Any) -> None:
        while pipeline.crashed is None:
            await asyncio.sleep(0.5)

    async def once(self, progress: bool) -> int:
        pipeline = self._load()
        counters = pipeline.stats.counters

        def show() -> None:
            sys.stdout.write(f"\rinboxd: {counters.completed} done, {counters.failed} failed, "
                             f"{pipeline.outcomes.in_flight} in progress ")
            sys.stdout.flush()

        await pipeline.process_backlog(show if progress else None)
        if progress:
            show()
            sys.stdout.write("\n")
        print(f"inboxd once: {counters.completed} completed, {counters.failed} failed",
              file=sys.stderr if progress else sys.stdout)
        if pipeline.crashed is not None:
            return EX_SOFTWARE
        return 1 if counters.failed else 0


def exit_now_if_stuck(status: int) -> None:
    """A model call that never returns (a hung GPU) would keep the interpreter from exiting,
    since thread pools are joined at exit; after shutdown nothing of ours is left to wait for."""
    stuck = [t for t in threading.enumerate() if t.name.startswith("inboxd-model") and t.is_alive()]
    if stuck:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def entry() -> None:
    status = main()
    exit_now_if_stuck(status)
    sys.exit(status)
