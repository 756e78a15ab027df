"""Which filesystem an inbox lives on, and so whether inotify can see what is written there.

inotify only reports changes made through this kernel: on NFS, SMB/CIFS, FUSE (sshfs, rclone,
gcsfuse, …), 9p (WSL, VMs) or Ceph another host's (or the hypervisor's) writes raise no event,
and files would wait for the timer rescan. Those inboxes are polled instead. The filesystem is
read with statfs(2) ``f_type``, the kernel's own magic number, so a mount's name (``fuse.sshfs``
or an admin's label) cannot mislead it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

PollMode = Literal["auto", "always", "never"]
StatfsFn = Callable[[Path], int]

# statfs f_type magic numbers (linux/magic.h and the filesystems' sources) of mounts whose
# writers may be elsewhere.
REMOTE_TYPES = {
    0x6969: "nfs",
    0x517B: "smb",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x65735546: "fuse",
    0x01021997: "9p",
    0x00C36400: "ceph",
    0x5346414F: "afs",
    0x73757245: "coda",
    0x47504653: "gpfs",
    0x0BD00BD0: "lustre",
    0x013111A8: "ibrix",
    0x19830326: "fhgfs",
    0x786F4256: "vboxsf",
}
LOCAL_NAMES = {0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x01021994: "tmpfs",
               0x794C7630: "overlayfs", 0x2FC12FC1: "zfs", 0x4D44: "vfat", 0x5346544E: "ntfs",
               0xF2F52010: "f2fs"}
# The process's own libc (find_library would run ldconfig in a subprocess on every call).
_libc = ctypes.CDLL(None, use_errno=True)
# struct statfs is 120 bytes on 64-bit Linux; f_type (a long) comes first. Room to spare.
_STATFS_BUFFER_BYTES = 256


def statfs_type(path: Path) -> int:
    """statfs(2) ``f_type`` of the filesystem holding ``path`` (the boundary tests fake)."""
    buffer = ctypes.create_string_buffer(_STATFS_BUFFER_BYTES)
    if _libc.statfs(os.fsencode(path), buffer) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return ctypes.c_ulong.from_buffer(buffer).value & 0xFFFFFFFF


@dataclass(frozen=True)
class WatchPlan:
    """How one inbox is watched, and why (said in the ``started`` record)."""

    path: Path
    polling: bool
    filesystem: str
    reason: str


def plan_watch(path: Path, mode: PollMode, statfs: StatfsFn = statfs_type) -> WatchPlan:
    """inotify or polling for one inbox, per ``inbox.poll``. An inbox not created yet is
    judged by the nearest folder above it that exists (where it will be created)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        magic = statfs(probe)
    except OSError as exc:
        magic, name = -1, f"unknown ({exc.strerror})"
    else:
        name = REMOTE_TYPES.get(magic) or LOCAL_NAMES.get(magic) or f"0x{magic:x}"
    if mode == "always":
        return WatchPlan(path, True, name, "inbox.poll: always")
    if mode == "never":
        return WatchPlan(path, False, name, "inbox.poll: never")
    if magic in REMOTE_TYPES:
        return WatchPlan(path, True, name, f"{name} is a network/FUSE filesystem: inotify "
                         "does not see other hosts' writes")
    return WatchPlan(path, False, name, "local filesystem")


def describe(plans: list[WatchPlan]) -> str:
    return "; ".join(f"{p.path}: {'polling' if p.polling else 'inotify'} ({p.filesystem}, "
                     f"{p.reason})" for p in plans)


# inotify_add_watch(2) flags for a probe: any event will do, a folder only, never through a link.
_IN_CREATE = 0x100
_IN_ONLYDIR = 0x01000000
_IN_DONT_FOLLOW = 0x02000000
# Errors of a probe that say the user's inotify budget is spent (watches; instances).
OUT_OF_WATCHES = {errno.ENOSPC, errno.EMFILE}


def inotify_room(folders: Iterable[str | Path]) -> OSError | None:
    """Whether inotify can watch every one of ``folders`` now: they are added to a probe
    instance of our own, which is closed again (None: it could). The notify crate under
    watchfiles adds a watch for each folder made after start-up and, when the user's watch
    limit is reached, drops the failure without a word: this is how the watcher learns it.
    A folder that is gone or is no folder is no answer about the budget and is skipped."""
    fd = _libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
    if fd < 0:
        err = ctypes.get_errno()
        return OSError(err, os.strerror(err))
    try:
        for folder in folders:
            if _libc.inotify_add_watch(fd, os.fsencode(folder),
                                       _IN_CREATE | _IN_ONLYDIR | _IN_DONT_FOLLOW) < 0:
                err = ctypes.get_errno()
                if err in OUT_OF_WATCHES:
                    return OSError(err, os.strerror(err), str(folder))
        return None
    finally:
        os.close(fd)
