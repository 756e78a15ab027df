"""The names of the daemon's own folders, and layouts that cannot work, refused before anything
is touched (exit 78).

An output folder inside a watched inbox is taken back in as new input (``failed/failed/…``
until the names are too long); an inbox inside an output folder is the same loop the other way;
an inbox path that is a file makes every start fail. None of these can be fixed at run time,
so ``check-config`` and start-up say what to change instead.

An inbox that cannot be written when the daemon starts (``InboxUnusable``) exits with a status
systemd can act on: 78 when the layout cannot work as it is (a read-only filesystem, no
permission, a file where a folder goes), 75 when it may clear by itself (full, no inodes).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from inboxd.config import EX_CONFIG, EX_TEMPFAIL, Config, ConfigError, load_config
from inboxd.files.filesystems import REMOTE_TYPES, statfs_type
from inboxd.files.names import TEMP_SUFFIXES

FUSE_MAGIC = 0x65735546

OUTPUTS = ("results_dir", "done_dir", "failed_dir")
# Inside each inbox (hidden, so the watcher and the scan never take it): the claimed files, one
# folder per instance, and the instances' locks and ledgers beside them.
PROCESSING_DIRNAME = ".processing"
# Inside every folder written to (results, done, failed, processing): each instance's temp
# files, on the destination's filesystem so that the final rename is atomic.
TMP_DIRNAME = ".tmp"


def processing_dir(config: Config, inbox: Path) -> Path:
    """Where this instance's claimed files live: inside their inbox (the same filesystem, so
    the claim is one rename), under a hidden name the watcher ignores."""
    return inbox / PROCESSING_DIRNAME / config.instance


def load_checked_config(path: Path | None, overrides: dict[str, Any] | None = None) -> Config:
    """:func:`inboxd.config.load_config`, then the layout checks below."""
    config = load_config(path, overrides)
    problems = layout_problems(config)
    if path is not None:  # the embedded default's var/ folders are made as they are needed
        problems += missing_inboxes(config)
    if problems:
        raise ConfigError(str(path or "config/inboxd.yaml"), problems)
    return config


def missing_inboxes(config: Config) -> list[str]:
    """A configured inbox that does not exist is a typo far more often than a folder to make:
    made silently, the daemon would watch a folder nobody drops into."""
    return [f"inbox.paths[{n}]: {inbox} does not exist; create it (mkdir -p {inbox}, writable "
            "by the daemon's user) or correct the path (make run and make install create "
            "their own inbox)"
            for n, inbox in enumerate(config.inbox.paths) if not os.path.lexists(inbox)]


def _inside(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def layout_problems(config: Config) -> list[str]:
    problems = []
    # Real paths: a link must not hide that two folders are one.
    inboxes = [(n, Path(os.path.realpath(p))) for n, p in enumerate(config.inbox.paths)]
    outputs = [(key, Path(os.path.realpath(getattr(config, key)))) for key in OUTPUTS]
    for n, inbox in inboxes:
        where = f"inbox.paths[{n}]"
        if inbox.exists() and not inbox.is_dir():
            problems.append(f"{where}: {inbox} is not a folder; give the folder files are "
                            "dropped into")
        for key, output in outputs:
            if _inside(output, inbox):
                problems.append(f"{key}: {output} is inside the inbox {inbox} ({where}), so the "
                                "daemon would take its own output as new input; move it out, "
                                f"e.g. to {inbox.parent / output.name}")
            elif _inside(inbox, output):
                problems.append(f"{where}: the inbox {inbox} is inside {key} ({output}); "
                                "keep inboxes and output folders apart")
        for m, other in inboxes[n + 1:]:
            if _inside(other, inbox) or _inside(inbox, other):
                problems.append(f"inbox.paths[{m}]: {other} and {inbox} overlap; a file would "
                                "belong to two inboxes")
    for (key, output), (other_key, other) in ((a, b) for i, a in enumerate(outputs)
                                              for b in outputs[i + 1:]):
        if output == other:
            problems.append(f"{other_key}: the same folder as {key} ({output}); give each "
                            "outcome its own folder")
    if config.index is not None and (remote := _network_fs(config.index)) is not None:
        problems.append(f"index: {config.index} is on {remote}, a network filesystem, where "
                        "SQLite's locks do not hold (several hosts would damage it): give "
                        "index: a path on a local disk (e.g. /var/lib/inboxd/index.sqlite3; "
                        "the results may stay where they are), or turn it off with index: null")
    for n, pattern in enumerate(config.inbox.include or []):
        why = pattern_never_matches(pattern)
        if why:
            problems.append(f"inbox.include[{n}]: {pattern!r} can never match: {why}")
    return problems


def _network_fs(path: Path) -> str | None:
    """The network filesystem's name if ``path`` would be on one (judged by the nearest
    folder that exists), else None."""
    probe = path.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        magic = statfs_type(probe)
    except OSError:
        return None
    # FUSE is left to the user: exfat-fuse and ntfs-3g are one host's disks (the kernel keeps
    # their locks), sshfs is not; docs/service.md says to keep an index off a networked one.
    return None if magic == FUSE_MAGIC else REMOTE_TYPES.get(magic)


def pattern_never_matches(pattern: str) -> str | None:
    """Why no file name the daemon takes could match ``pattern`` (None: some could)."""
    if not pattern:
        return "it is empty"
    if "/" in pattern:
        return "patterns match file names, not paths; drop the folder part"
    if pattern.startswith("."):
        return "hidden names (starting with a dot) are never taken"
    if pattern.lower().endswith(TEMP_SUFFIXES):
        return f"names ending in {', '.join(TEMP_SUFFIXES)} are temp files, never taken"
    return None


# Errors of an inbox at start-up that may clear without anyone changing the layout.
MAY_CLEAR = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ENOMEM, errno.EAGAIN, errno.EINTR,
             errno.ETIMEDOUT, errno.ESTALE, errno.ENFILE, errno.EMFILE, errno.EBUSY,
             errno.ENOLCK}


class InboxUnusable(Exception):
    """The inbox cannot be written at start-up (its folders and lock cannot be made):
    ``exit_status`` is EX_CONFIG or EX_TEMPFAIL, and the message says what to do."""

    def __init__(self, message: str, exit_status: int) -> None:
        super().__init__(message)
        self.exit_status = exit_status


def inbox_unusable(exc: OSError) -> InboxUnusable:
    where = f"{exc.filename}: " if exc.filename is not None else ""
    problem = f"cannot prepare the inbox: {where}{exc.strerror or exc}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InboxUnusable(f"{problem}. Its filesystem is full or out of inodes (see df -h and "
                             "df -i there): free some; exit 75, so systemd starts inboxd again "
                             "(within the unit's start limit)", EX_TEMPFAIL)
    if exc.errno == errno.EROFS:
        return InboxUnusable(f"{problem}. The filesystem is read-only: remount it read-write, "
                             "or list the folder in the unit's ReadWritePaths=; exit 78 (not "
                             "restarted: it will not change by itself)", EX_CONFIG)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return InboxUnusable(f"{problem}. Give the daemon's user (uid {os.geteuid()}) write "
                             "access to the inbox (the shipped layout: group inboxd, mode "
                             "2770); exit 78", EX_CONFIG)
    if exc.errno in MAY_CLEAR:
        return InboxUnusable(f"{problem}; exit 75, so systemd tries again", EX_TEMPFAIL)
    return InboxUnusable(f"{problem}. Fix the inbox folder (inbox.paths) and start again; "
                         "exit 78", EX_CONFIG)


@contextlib.contextmanager
def inbox_writable() -> Iterator[None]:
    """Around the start-up's first writes to the inboxes (the instance lock, the processing
    folders): an OSError there is ``InboxUnusable``, not a traceback."""
    try:
        yield
    except OSError as exc:
        raise inbox_unusable(exc) from exc
