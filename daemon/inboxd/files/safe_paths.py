"""Opening folders under an inbox without ever following a link.

A path under the inbox is only inside it if no component on the way is a symbolic link:
``inbox/photos -> /home/alice`` makes ``inbox/photos/x.jpg`` alice's file, and a rename through
it would move her file out of her folder. The kernel resolves every component in one
``openat(O_NOFOLLOW)`` each, so nothing can swap a folder for a link between a check and a use.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class LinkedFolder(OSError):
    """A folder on the way is a symbolic link (or not a folder): nothing behind it is ours."""


@contextlib.contextmanager
def open_inside(root: str | Path, parts: Sequence[str],
                create: bool = False) -> Iterator[int]:
    """A file descriptor for ``root/parts…``, each part opened without following links;
    ``create``: a missing part is made (a link there is still refused, never followed)."""
    fd = os.open(root, DIR_FLAGS)
    try:
        for part in parts:
            if part in ("", ".", ".."):
                raise LinkedFolder(errno.EINVAL, f"not a plain folder name: {part!r}")
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise LinkedFolder(exc.errno, f"{part} is a symbolic link, not a folder; "
                                       "links are never followed", part) from None
                raise
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)
