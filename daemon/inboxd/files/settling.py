"""Is a file finished? There is no close-write event, so this is judged by observation.

Before the claim a file must look the same (inode, size, mtime) for ``inbox.settle_ms``; after
the claim, a file that still changes, or that somebody still holds open for writing, was taken
during a writer's pause: it is given back to wait, not failed as truncated.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

Identity = tuple[int, int, int]


def identity(st: os.stat_result) -> Identity:
    return st.st_ino, st.st_size, st.st_mtime_ns


def still_being_written(path: str | Path, claimed_as: Identity | None) -> bool:
    """True when ``path`` changed since it was claimed as ``claimed_as``, or is open for
    writing elsewhere (a read lease is refused then; only for files we may lease — our own,
    or with CAP_LEASE — so for others' files only the change is seen)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if claimed_as is not None and identity(st) != claimed_as:
        return True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError as exc:
        return exc.errno == errno.EAGAIN  # EACCES/EINVAL: not ours to lease, cannot tell
    else:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)
