"""``inboxd``: the command line. Its exit statuses are declared in ``inboxd.exit_codes``."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import secrets
import stat
import sys
import threading
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from inboxd import __version__, logs
from inboxd.config import Config, ConfigError
from inboxd.exit_codes import EX_CONFIG, EX_TEMPFAIL, USAGE
from inboxd.files.layout import InboxUnusable, inbox_writable, load_checked_config
from inboxd.files.lifecycle import InstanceBusy
from inboxd.files.names import NameFilter

SIGPIPE_STATUS = 128 + 13  # what a shell reports for a program a SIGPIPE ended


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help(sys.stderr)
        return USAGE
    try:
        return int(COMMANDS[args.command](args))
    except ConfigError as exc:
        print(f"inboxd: the configuration cannot be used:\n{exc}", file=sys.stderr)
        return EX_CONFIG
    except InstanceBusy as exc:
        print(f"inboxd: {logs.shown(exc)}", file=sys.stderr)
        return EX_TEMPFAIL
    except InboxUnusable as exc:
        print(f"inboxd: {exc}", file=sys.stderr)
        return exc.exit_status


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
    models = with_config("models", "list the built-in model and load the configured one "
                         "(checking it), with parameter count and expected input")
    models.add_argument("--torchvision", action="store_true",
                        help="also list the architecture names torchvision: accepts")
    with_config("recover", "return the files an instance had claimed to the inbox "
                "(only while that instance is not running; start-up does this by itself)")
    retry = with_config("retry", "move failed files back into their inbox (after fixing the "
                        "cause), under their original names; safe while the daemon runs")
    retry.add_argument("paths", nargs="*", type=Path, metavar="PATH",
                       help="failed files (in failed_dir, or their .error.json, or their name "
                       "relative to failed_dir)")
    retry.add_argument("--reason", metavar="TEXT",
                       help="only failures of this reason class (decode, too_large, io, model, "
                       "refused, other) or whose reason contains TEXT")
    retry.add_argument("--all", action="store_true", help="every failed file of this instance")
    retry.add_argument("-n", "--dry-run", action="store_true",
                       help="only print what would be returned")
    search = with_config("search", "find filed photos by their labels and the text in them, "
                         "or by likeness to a photo (--like); reads the index")
    search.add_argument("words", nargs="*", metavar="WORD",
                        help="words every match holds (in a label or in its text)")
    search.add_argument("--like", type=Path, metavar="PHOTO",
                        help="rank photos by the cosine similarity of their embeddings to "
                        "this photo's (needs a model that embeds)")
    search.add_argument("--task", help="which task's embeddings --like compares (several "
                        "tasks embed)")
    search.add_argument("-n", "--limit", type=int, default=20, help="at most this many (20)")
    search.add_argument("--json", action="store_true", help="a JSON list, for scripts")
    index = with_config("index", "the search index: how many results it holds, repaired "
                        "from the result files if a kill left it behind")
    index.add_argument("--rebuild", action="store_true",
                       help="remake it from the result files (the source of truth)")
    stats = sub.add_parser("stats", help="the latest stats record (the journal's, or with -c "
                           "the daemon's own stats file)")
    report = sub.add_parser("report", help="a PNG of the stats records over time: files "
                            "completed and failed, latency, layers, memory, against the clock")
    for reader in (stats, report):
        reader.add_argument("-u", "--unit", help="systemd unit (default: any inboxd process)")
        reader.add_argument("--instance", help="only this instance's records")
        reader.add_argument("-c", "--config", type=Path, default=None,
                            help="the daemon of this config file, from the stats file it "
                            "keeps (no journal needed: a daemon run in the foreground)")
    stats.add_argument("--json", action="store_true", help="one JSON object per record")
    stats.add_argument("-f", "--follow", action="store_true", help="print each new record")
    report.add_argument("--since", type=parse_since, default=None,
                        help="start: ISO time, or how long ago: 10min, 2h (default: this boot)")
    report.add_argument("-o", "--output", type=Path, default=Path("inboxd-report.png"))
    return parser


def parse_since(text: str) -> datetime:
    """``2026-11-30T07:00``, or how long ago: ``90s``, ``10min``, ``2h``, ``1d``."""
    relative = re.fullmatch(r"-?(\d+)\s*(s|sec|m|min|h|d)", text.strip())
    if relative:
        amount, unit = int(relative[1]), relative[2]
        seconds = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}[unit]
        return datetime.now() - timedelta(seconds=amount * seconds)
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a time: {text!r} (try 10min or 2026-11-30T07:00)") from None


def overrides(args: argparse.Namespace) -> dict[str, Any] | None:
    return {"instance": args.instance} if args.instance else None


def read_config(args: argparse.Namespace) -> Config:
    return load_checked_config(args.config, overrides(args))


def setup_logging(level: str) -> None:
    from inboxd.service.journal import setup_logging as journal_or_stderr

    journal_or_stderr(level)


# -- commands ----------------------------------------------------------------------------------


def cmd_check_config(args: argparse.Namespace) -> int:
    from inboxd.decode import formats
    from inboxd.files.names import NameFilter
    from inboxd.models.onnx_probe import probe_onnx_blocks
    from inboxd.models.preflight import preflight

    config = read_config(args)
    # The model's files too (no torch); `inboxd models` loads the model itself.
    problems = [problem if config.models is None
                else f"models.{task}.{problem.removeprefix('model.')}"
                for task, block in config.tasks.items() for problem in preflight(block)]
    if problems:
        raise ConfigError(str(args.config or "config/inboxd.yaml"), problems)
    # A bring-your-own .onnx is run as the daemon would run it, in a child under a memory
    # limit (seconds): one a photo could make ask for any memory is refused here already.
    probe_onnx_blocks(config)
    print(f"{logs.shown(args.config or 'config/inboxd.yaml (embedded default)')}: OK")
    for key, value in config.model_dump(mode="json").items():
        print(f"  {key}: {logs.shown(value)}")
    print("formats this build decodes (the default inbox.include):")
    print("\n".join(f"  {line}" for line in formats.describe()))
    print(f"  taken: {' '.join(NameFilter(config.inbox.include).include)}")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    config = read_config(args)
    inbox = config.inbox.paths[0]
    inbox.mkdir(parents=True, exist_ok=True)
    status = 0
    names = NameFilter(config.inbox.include)
    for source in args.files:
        # Copied in, it would sit there for ever: say why instead.
        if reason := names.refusal(source.name) or (
                None if names.wanted(source.name) else "a temp or OS litter name, never taken"):
            print(logs.shown(f"inboxd submit: {source}: not submitted: {reason}"), file=sys.stderr)
            status = 1
            continue
        try:
            target = submit_file(source, inbox)
        except OSError as exc:
            print(logs.shown(f"inboxd submit: {source}: {exc.strerror or exc}"), file=sys.stderr)
            status = 1
            continue
        print(logs.shown(target))
    return status


def submit_file(source: Path, inbox: Path) -> Path:
    """Copy ``source`` into the inbox so that the daemon sees the whole file or nothing.

    The inbox is shared by a group, so nothing here follows a link or uses a name another
    member could guess and plant one at: the copy is an unnamed file (``O_TMPFILE``) in the
    inbox, opened by descriptor, fsynced, then linked in under its name (or a free variant;
    a link there is a taken name, never followed). A full disk, a quota or an interrupt leaves
    nothing behind, not even a kill: an unnamed file is gone with its descriptor. Where the
    filesystem has no ``O_TMPFILE`` (NFS, vfat), a hidden temp with a random name, created
    with ``O_EXCL|O_NOFOLLOW``, is renamed in instead, and removed on every failure. The old
    mtime is kept (as ``cp -p``), so the daemon takes it at once."""
    from inboxd.files.renames import first_free, rename_noreplace, time_token
    from inboxd.files.safe_paths import open_inside

    # Without blocking, and only a regular file: a FIFO named like a photo (planted in a folder
    # somebody submits from) hung submit for ever, and a link to /dev/zero filled the disk.
    src_fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(src_fd, "rb") as src, open_inside(inbox, []) as folder:
        info = os.fstat(src.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, a device or a folder); "
                          "submit the photo itself")
        tmp: str | None = None
        try:
            fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600, dir_fd=folder)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            tmp = f".inboxd-submit-{secrets.token_hex(16)}.tmp"  # hidden and .tmp: never taken
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=folder)
        try:
            with os.fdopen(fd, "wb") as dst:
                # The size it had when opened: a file somebody keeps appending to is not a
                # finished photo, and must not fill the inbox's disk.
                left = info.st_size
                while left > 0 and (chunk := src.read(min(left, 1 << 20))):
                    dst.write(chunk)
                    left -= len(chunk)
                dst.flush()
                os.fchmod(dst.fileno(), stat.S_IMODE(info.st_mode))
                os.utime(dst.fileno(), ns=(info.st_atime_ns, info.st_mtime_ns))
                os.fsync(dst.fileno())
                if tmp is None:
                    unnamed = f"/proc/self/fd/{dst.fileno()}"
                    name = first_free(source.name, time_token(), lambda candidate: os.link(
                        unnamed, candidate, dst_dir_fd=folder, follow_symlinks=True))
            if tmp is not None:
                named = tmp
                name = first_free(source.name, time_token(), lambda candidate: rename_noreplace(
                    named, candidate, folder, folder))
                tmp = None
        except BaseException:
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=folder)
            raise
    return inbox / name


def cmd_stats(args: argparse.Namespace) -> int:
    from inboxd.service.readback import print_stats

    config = read_config(args) if args.config else None
    return print_stats(args.unit, args.instance, args.json, args.follow, config)


def cmd_report(args: argparse.Namespace) -> int:
    from inboxd.service.readback import write_report

    config = read_config(args) if args.config else None
    return write_report(args.unit, args.instance, args.since, args.output, config)


def cmd_recover(args: argparse.Namespace) -> int:
    from inboxd.files.lifecycle import Lifecycle
    from inboxd.files.takeover import take_over_dead

    config = read_config(args)
    lifecycle = Lifecycle(config)
    with inbox_writable():
        lifecycle.lock_instance()
    returned, failed = lifecycle.recover()
    # And what it had claimed in an area a member of the group renamed away before it died.
    for taken in take_over_dead(lifecycle, only=config.instance).taken:
        returned += len(taken.returned)
        failed += taken.failed
    lifecycle.unlock_instance()
    print(f"returned {returned} file(s) claimed by instance {config.instance!r} to the inbox"
          + (f"; {failed} in flight at repeated crashes went to failed/" if failed else ""))
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    from inboxd.files import retry_failed as retry

    if not (args.paths or args.all or args.reason):
        print("inboxd retry: name the failed files (PATH…), or use --reason TEXT or --all",
              file=sys.stderr)
        return USAGE
    config = read_config(args)
    if not args.dry_run:
        retry.put_back_stranded(config)
    chosen, problems = retry.select(config, args.paths, args.all, args.reason)
    for problem in problems:
        print(f"inboxd retry: {logs.shown(problem)}", file=sys.stderr)
    returned = 0
    for failed in chosen:
        if args.dry_run:
            what = f"{failed.input_path} -> {failed.destination} ({failed.reason})"
            print(logs.shown(f"would return {what}"))
            returned += 1
            continue
        try:
            target = retry.retry(config, failed)
        except OSError as exc:
            print(logs.shown(f"inboxd retry: {failed.input_path}: {exc.strerror}"), file=sys.stderr)
            problems.append(str(exc))
            continue
        print(f"returned {logs.shown(failed.input_path)} -> {logs.shown(target)}")
        returned += 1
    verb = "would return" if args.dry_run else "returned"
    print(f"{verb} {returned} failed file(s) to the inbox")
    return 1 if problems and args.paths else 0


def cmd_run(args: argparse.Namespace) -> int:
    from inboxd.service.runner import run_service

    config = read_config(args)
    setup_logging(config.log_level)
    return run_service(config, args.config, overrides(args))


def cmd_once(args: argparse.Namespace) -> int:
    from inboxd.service.once import run_once

    config = read_config(args)
    setup_logging(config.log_level)
    return run_once(config)


def cmd_search(args: argparse.Namespace) -> int:
    from inboxd.files.index_search import SearchError
    from inboxd.service.search import search

    if not args.words and args.like is None:
        print("inboxd search: give words to find, or --like PHOTO", file=sys.stderr)
        return USAGE
    if args.limit < 1:
        print("inboxd search: --limit must be at least 1", file=sys.stderr)
        return USAGE
    try:
        return search(read_config(args), args.words, args.like, args.task, args.limit,
                      args.json)
    except (SearchError, OSError) as exc:
        print(logs.shown(f"inboxd search: {exc}"), file=sys.stderr)
        return EX_CONFIG if isinstance(exc, SearchError) else EX_TEMPFAIL


def cmd_index(args: argparse.Namespace) -> int:
    from inboxd.files.index_search import SearchError
    from inboxd.service.search import index_command

    try:
        return index_command(read_config(args), args.rebuild)
    except (SearchError, OSError) as exc:
        print(logs.shown(f"inboxd index: {exc}"), file=sys.stderr)
        return EX_CONFIG if isinstance(exc, SearchError) else EX_TEMPFAIL


def cmd_models(args: argparse.Namespace) -> int:
    from inboxd.models import listing as model_listing
    from inboxd.models.engines.choice import load_here
    from inboxd.models.onnx_probe import probe_onnx_blocks

    config = read_config(args)
    probe_onnx_blocks(config)  # before this process loads a graph that may ask for any memory
    where = str(args.config or "config/inboxd.yaml, the embedded default")
    lines = [*model_listing.builtin_lines(), ""]
    for task, block in config.tasks.items():
        here = where if config.models is None else f"{where}, task {task}"
        lines += model_listing.configured_lines(config.model_copy(update={"model": block}),
                                                load_here(block), here)
    if args.torchvision:
        lines += ["", *model_listing.torchvision_lines()]
    print("\n".join(lines))
    return 0


COMMANDS: dict[str, Any] = {
    "run": cmd_run,
    "once": cmd_once,
    "check-config": cmd_check_config,
    "models": cmd_models,
    "submit": cmd_submit,
    "recover": cmd_recover,
    "retry": cmd_retry,
    "search": cmd_search,
    "index": cmd_index,
    "stats": cmd_stats,
    "report": cmd_report,
}


def exit_now_if_stuck(status: int) -> None:
    """A model call that never returns (a hung GPU) would keep the interpreter from exiting,
    since thread pools are joined at exit; after shutdown nothing of ours is left to wait for."""
    stuck = [t for t in threading.enumerate()  # the local engine's model thread
             if t.name.startswith("inboxd-model") and t.is_alive()]
    if stuck:
        logs.flush_suppressed()  # an atexit hook, which os._exit skips
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def entry() -> None:
    try:
        status = main()
        sys.stdout.flush()  # here, where a reader that has gone can be told from a bug
    except BrokenPipeError:
        # `inboxd check-config | head`: the reader stopped reading, no fault of ours. Nothing
        # more reaches it (the flush at exit would raise again), and the status is a SIGPIPE's.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = SIGPIPE_STATUS
    exit_now_if_stuck(status)
    sys.exit(status)
