"""inotify(7) over a folder tree, through libc: names come as bytes and are decoded as
``os.listdir`` decodes them (surrogateescape), so no name can break the watch.

watchfiles' notify crate turns every event's path into UTF-8, and a path that is not valid
UTF-8 sets an error that stays set: from then on every ``watch()`` of that watcher raises, and
the daemon had to start a new one — each time a member renamed such a file. Here an odd name
is a name like any other.

One descriptor; one watch per folder (the roots and, when recursive, every folder below them
but the ones never walked: hidden and OS litter, ``.processing/`` among them); a folder made or
moved in is watched with everything below it as its event is read, one moved away is
forgotten with everything below it. A watch that cannot be added for want of budget raises
``OSError(ENOSPC)`` (the watcher then polls and says so); a queue overflow raises
``QueueOverflow``, and a root moved away or deleted (another folder at its path sees no
watch) ``WatchedFolderGone``: the watcher rescans and watches again. Not thread-safe: one
reader, on the event loop.

A read hands over at most one kernel read's worth of events (``MAX_CHANGES_PER_READ``): a
writer as fast as the parse (any member of an inbox's group) must not keep one read going, the
event loop with it, nor grow what it hands over. What waits meanwhile is the kernel's queue,
bounded by ``fs.inotify.max_queued_events``; past that, an overflow and a rescan.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Callable

_libc = ctypes.CDLL(None, use_errno=True)

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000
WATCH_MASK = (IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE
              | IN_DELETE | IN_ONLYDIR | IN_DONT_FOLLOW | IN_EXCL_UNLINK)
# A root's own move or deletion: below a root, the parent's IN_MOVED_FROM / IN_DELETE say it.
ROOT_MASK = WATCH_MASK | IN_MOVE_SELF | IN_DELETE_SELF
# Not IN_MODIFY: one per write(2), hundreds for a large photo written in chunks, filling the
# kernel's queue (16384 events) in a flood; the file's IN_CREATE puts it in the event buffer,
# where it is looked at again until it has settled, and IN_CLOSE_WRITE follows a rewrite.
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; the name (len bytes, NUL padded) follows
# One read takes whatever is queued up to this; a full kernel queue is drained in a few reads.
READ_BYTES = 1 << 16
# Each event is at least its header: one read's changes are at most this many.
MAX_CHANGES_PER_READ = READ_BYTES // _EVENT.size
# Why adding a watch may fail that says nothing about the budget: the folder is gone, a link,
# no folder, or not ours to read. It is not watched; the scans still walk what they can.
_NOT_WATCHABLE = {errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EACCES, errno.EPERM}

ADDED, MODIFIED, DELETED = 1, 2, 3  # watchfiles.Change's values


class QueueOverflow(RuntimeError):
    """The kernel's event queue overflowed: events were lost, a rescan finds their files."""


class WatchedFolderGone(RuntimeError):
    """A watched root was moved away or deleted: a folder made at its path is not watched."""


class TreeWatch:
    def __init__(self, roots: list[str], recursive: bool, skipped: Callable[[str], bool]) -> None:
        self.recursive = recursive
        self.skipped = skipped
        fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd: int = fd
        self.folders: dict[int, str] = {}  # watch descriptor → its folder's path
        self.roots: dict[int, str] = {}  # the roots' watch descriptors
        try:
            for root in roots:
                wd = self._add(root, ROOT_MASK)
                if wd is not None:
                    self.roots[wd] = root
                self._add_below(root)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def size(self) -> int:
        return len(self.folders)

    def _add(self, folder: str, mask: int = WATCH_MASK) -> int | None:
        wd: int = _libc.inotify_add_watch(self.fd, os.fsencode(folder), mask)
        if wd < 0:
            err = ctypes.get_errno()
            if err in _NOT_WATCHABLE:
                return None
            raise OSError(err, f"cannot watch {folder}: {os.strerror(err)}", folder)
        self.folders[wd] = folder
        return wd

    def _add_tree(self, top: str) -> None:
        self._add(top)
        self._add_below(top)

    def _add_below(self, top: str) -> None:
        if not self.recursive:
            return
        for folder, dirs, _ in os.walk(top):  # never follows links
            dirs[:] = [d for d in dirs if not self.skipped(d)]
            for name in dirs:
                self._add(os.path.join(folder, name))

    def _forget_tree(self, top: str) -> None:
        below = top + "/"
        for wd, folder in list(self.folders.items()):
            if folder == top or folder.startswith(below):
                del self.folders[wd]
                _libc.inotify_rm_watch(self.fd, wd)  # EINVAL if the kernel dropped it: fine

    def read(self) -> set[tuple[int, str]]:
        """The events of one kernel read (at most ``MAX_CHANGES_PER_READ``), as watchfiles
        reports them: (change, path); empty when none is queued."""
        changes: set[tuple[int, str]] = set()
        try:
            data = os.read(self.fd, READ_BYTES)
        except BlockingIOError:
            return changes
        offset = 0
        while offset < len(data):
            wd, mask, _, length = _EVENT.unpack_from(data, offset)
            name = data[offset + _EVENT.size:offset + _EVENT.size + length].rstrip(b"\0")
            offset += _EVENT.size + length
            self._event(wd, mask, name, changes)
        return changes

    def _event(self, wd: int, mask: int, name: bytes, changes: set[tuple[int, str]]) -> None:
        if mask & IN_Q_OVERFLOW:
            raise QueueOverflow("inotify's event queue overflowed")
        if mask & (IN_MOVE_SELF | IN_DELETE_SELF) and wd in self.roots:
            raise WatchedFolderGone(f"{self.roots[wd]} was moved away or deleted")
        if mask & IN_IGNORED:
            self.folders.pop(wd, None)
            return
        folder = self.folders.get(wd)
        if folder is None or not name:
            return  # a folder forgotten meanwhile, or an event about the folder itself
        leaf = os.fsdecode(name)
        path = f"{folder}/{leaf}"
        if mask & IN_ISDIR and self.recursive and not self.skipped(leaf):
            if mask & IN_MOVED_FROM:
                self._forget_tree(path)
            elif mask & (IN_CREATE | IN_MOVED_TO):
                self._add_tree(path)
        if mask & (IN_DELETE | IN_MOVED_FROM):
            changes.add((DELETED, path))
        elif mask & (IN_CREATE | IN_MOVED_TO):
            changes.add((ADDED, path))
        else:
            changes.add((MODIFIED, path))
