"""Reading one untrusted input file: links refused, only regular files, bytes and sha256."""

from __future__ import annotations

import errno
import hashlib
import os
import stat

from inboxd.item import PermanentError, TransientError

# Errors reading a file that a later attempt may not see (it is being replaced, the disk
# hiccuped, permissions are being fixed); anything else about the bytes is permanent.
TRANSIENT_READ_ERRNOS = {errno.EACCES, errno.EPERM, errno.EIO, errno.EAGAIN, errno.EBUSY,
                         errno.ENOENT, errno.ESTALE, errno.ETIMEDOUT}


def read_and_hash(path: os.PathLike[str] | str) -> tuple[bytes, str]:
    """The file's bytes and their sha256. Links are not followed and only regular files are
    read (a FIFO opened for reading would block a worker for ever)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermanentError("refused: a symbolic link; links are never followed") from exc
        if exc.errno in TRANSIENT_READ_ERRNOS:
            raise TransientError(f"cannot open the file: {exc.strerror}") from exc
        raise PermanentError(f"cannot open the file: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PermanentError("not a regular file: only regular files are read")
        try:
            data = handle.read()
        except OSError as exc:
            raise TransientError(f"cannot read the file: {exc.strerror}") from exc
    return data, hashlib.sha256(data).hexdigest()
