"""Reading one untrusted input file: links refused, only regular files, its size bounded before a
byte is read, its sha256 streamed in chunks.

The decode workers (``decode/worker_child.py``) read each file themselves through these functions,
so a file's bytes never cross a pipe, and only a file that fits in one read (``HASH_CHUNK_BYTES``)
is held whole in memory, to be decoded from there.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from typing import BinaryIO

from inboxd.files.layout import PROCESSING_DIRNAME
from inboxd.files.safe_paths import LinkedFolder, open_inside, split_rel
from inboxd.item import PermanentError, RefusedError, TooLargeError, TransientError

# Errors reading a file that a later attempt may not see (it is being replaced, the disk
# hiccuped, permissions are being fixed); anything else about the bytes is permanent.
TRANSIENT_READ_ERRNOS = {errno.EACCES, errno.EPERM, errno.EIO, errno.EAGAIN, errno.EBUSY,
                         errno.ENOENT, errno.ESTALE, errno.ETIMEDOUT, errno.ENOMEM,
                         errno.EINTR, errno.ENFILE, errno.EMFILE}
HASH_CHUNK_BYTES = 1 << 20  # big enough to amortise the syscalls, small next to any image
# A claimed file is opened as it is found: never through a link at its name, and without
# blocking on a FIFO (the checks on the descriptor refuse both).
READ_CLAIMED_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


def open_input(path: os.PathLike[str] | str, max_bytes: int | None = None,
               opened: str | None = None) -> BinaryIO:
    """The file, opened for reading after checking what it is on the open descriptor (not the
    path, which an adversary can swap): not a link, a regular file (a FIFO opened for reading
    would block a worker for ever), and not larger than ``max_bytes``. ``opened``: the
    daemon's descriptor of it (``/proc/<pid>/fd/<n>``), reopened in preference to the path."""
    try:
        fd = _reopen(opened) if opened is not None else None
        if fd is None:
            fd = _open_claimed(os.fspath(path))
    except LinkedFolder as exc:
        # A folder on the way to a claimed file is not ours: a member of the group moved the
        # claim area's name. The daemon puts the area back within AREA_CHECK_S, and the
        # file is there again: the photo's next attempt reads it.
        raise TransientError(f"cannot open the file now: {exc.strerror or exc}") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RefusedError("refused: a symbolic link; links are never followed") from exc
        raise classify(exc, "cannot open the file") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RefusedError("not a regular file: only regular files are read")
        if max_bytes is not None and info.st_size > max_bytes:
            raise TooLargeError(
                f"file is {info.st_size} bytes, more than preprocess.max_file_mb = "
                f"{max_bytes / 2**20:g} MiB allows (raise it if such files are real images)"
            )
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _reopen(opened: str) -> int | None:
    """The file the daemon holds open, reopened through its ``/proc/<pid>/fd/<n>``: the
    kernel's link to the very file, whatever its folder is called now (a member of the
    group may be moving ``.processing`` every few ms). It is followed on purpose: the daemon
    opened the file without following links. None when /proc will not give it (a hardened
    /proc): the path is walked then, as before."""
    try:
        return os.open(opened, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return None


def _open_claimed(path: str) -> int:
    """``path`` opened for reading without following a link; a claimed file
    (``<inbox>/.processing/<instance>/…``) from its inbox, each folder on the way checked to be
    the daemon's own: the group can swap ``.processing`` for a folder whose ``<instance>`` is a
    link to its own files, and reading by path would read (and file a result of) one of
    those. Hidden folders are never walked into, so the last ``/.processing/`` is the one."""
    inbox, sep, below = path.rpartition(f"/{PROCESSING_DIRNAME}/")
    if not sep or not inbox:
        return os.open(path, READ_CLAIMED_FLAGS)
    folders, leaf = split_rel(f"{PROCESSING_DIRNAME}/{below}")
    with open_inside(inbox, folders, own=True) as folder:
        return os.open(leaf, READ_CLAIMED_FLAGS, dir_fd=folder)


def hash_stream(handle: BinaryIO, max_bytes: int | None = None
                ) -> tuple[str, int, bytes | None]:
    """sha256 and length of what is left in ``handle``, read in chunks, and the bytes
    themselves when they all came in the first chunk (None otherwise): a small file is then
    decoded from memory, not read a second time through the file object: Pillow reads a JPEG
    in dozens of small reads, each a syscall through the file object. A file that
    grows past ``max_bytes`` while being read is refused like one that was too large from the
    start."""
    digest = hashlib.sha256()
    total = 0
    first = b""
    try:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            if not total:
                first = chunk
            total += len(chunk)
            if max_bytes is not None and total > max_bytes:
                raise TooLargeError(f"file grew past preprocess.max_file_mb = "
                                     f"{max_bytes / 2**20:g} MiB while being read")
            digest.update(chunk)
    except OSError as exc:
        raise classify(exc, "cannot read the file") from exc
    return digest.hexdigest(), total, first if total == len(first) else None


def classify(exc: OSError, what: str) -> PermanentError | TransientError:
    """An OS error about one file as that file's outcome: transient when a later attempt may
    not see it (by errno), permanent otherwise."""
    kind = TransientError if exc.errno in TRANSIENT_READ_ERRNOS else PermanentError
    return kind(f"{what}: {exc.strerror or exc}")


def read_and_hash(path: os.PathLike[str] | str,
                  max_bytes: int | None = None) -> tuple[bytes, str]:
    """The file's bytes and their sha256, for callers that want the bytes (benchmarks, tests);
    the daemon's decode workers use :func:`open_input` and :func:`hash_stream` instead."""
    with open_input(path, max_bytes) as handle:
        try:
            data = handle.read()
        except OSError as exc:
            raise classify(exc, "cannot read the file") from exc
    return data, hashlib.sha256(data).hexdigest()
