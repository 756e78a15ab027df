"""Is a file finished? There is no close-write event, so this is judged by observation.

Before the claim a file must look the same (inode, size, mtime) for ``inbox.settle_ms``; after
the claim, a file that still changes, or that somebody still holds open for writing, was taken
during a writer's pause: it is given back to wait, not failed as truncated. The decode worker
asks on the file it has just read (``held_open_for_writing``), the daemon again before it fails
a file (``still_being_written``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
from pathlib import Path

Identity = tuple[int, int, int]


def identity(st: os.stat_result) -> Identity:
    return st.st_ino, st.st_size, st.st_mtime_ns


def changed(claimed_as: Identity | None, now: Identity | None) -> bool:
    """Whether the file is not the one claimed (an identity not known is not seen to change)."""
    return None not in (claimed_as, now) and now != claimed_as


def still_being_written(path: str | Path, claimed_as: Identity | None) -> bool:
    """True when ``path`` changed since it was claimed as ``claimed_as``, or is open for
    writing elsewhere."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if changed(claimed_as, identity(st)):
        return True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return held_open_for_writing(fd)
    finally:
        os.close(fd)


def held_open_for_writing(fd: int) -> bool:
    """Whether another open file holds ``fd``'s file for writing: a read lease is refused then.
    Only for files we may lease (our own, or with CAP_LEASE); for others' files this cannot
    tell and says False. Needs ``survive_lease_breaks()`` in the process."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError as exc:
        return exc.errno == errno.EAGAIN  # EACCES/EINVAL: not ours to lease, cannot tell
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return False


def survive_lease_breaks() -> None:
    """A process that opens the file for writing while our lease is held (microseconds, but an
    uploader can retry it in a loop) breaks the lease, and the kernel tells the holder with
    SIGIO, whose default action kills it. Nothing in inboxd uses SIGIO: ignore it. Main thread
    only."""
    signal.signal(signal.SIGIO, signal.SIG_IGN)
