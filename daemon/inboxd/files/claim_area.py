"""This instance's claim area in an inbox (``<inbox>/.processing/<instance>/`` and its lock),
held by descriptor while the daemon runs, and put back when a member of the inbox's group
moves it.

The inbox is writable by its group (the shipped 2770), so any member can rename
``.processing`` to another name and make a folder of their own in its place: two calls.
Nothing inside the area is theirs to change (the daemon's own folders, 0755), but its name is.
So the name is never trusted to lead to the area:

* claims go into the folder held open, not through the name: a claim never lands in a
  member's folder and never fails because the name moved;
* before each claim, and every ``AREA_CHECK_S`` from the pipeline, the name is compared with
  the folder held (one ``lstat``). When they differ the area is put back (``put_back``):
  whatever sits at the name now (a member's folder, a link, a file) is renamed aside to
  ``.processing.foreign-uid<N>-<token>`` (hidden: never scanned, never opened, never emptied),
  a fresh ``.processing`` is made (or one another instance made meanwhile is joined), and
  every claimed file is moved by descriptor from the folder held into the fresh one under the
  same name — so every claimed path the pipeline holds leads to the same file again.
* a member can only rename ``.processing`` *within* the inbox: moving a folder to another
  parent needs write permission on the folder itself (its ``..`` changes), which the group
  lacks. So a former area stays findable (``moved_areas``): a folder at the top of the inbox,
  the daemon's own, holding ``*.lock`` files. If the daemon died before it put its area back,
  the next start, every takeover sweep and ``inboxd recover`` return the files from it once its
  locks are free (``files.takeover``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from inboxd.files.instances import LEDGER_SUFFIX, LOCK_SUFFIX, LOCK_WAIT_S, flock_within
from inboxd.files.layout import PROCESSING_DIRNAME, TMP_DIRNAME
from inboxd.files.renames import first_free, rename_noreplace, time_token
from inboxd.files.safe_paths import (
    DIR_FLAGS,
    MODELESS,
    OWN_FOLDER_MODE,
    ForeignFolder,
    keeps_no_modes,
    not_own,
    open_inside,
)

# How often the pipeline compares the name with the area it holds (claims compare first too).
AREA_CHECK_S = 1.0
# Whatever is found at ``.processing`` that is not the daemon's own goes aside under this.
FOREIGN_PREFIX = f"{PROCESSING_DIRNAME}.foreign-"
# An area of this daemon's own found back at ``.processing`` while its helpers still lock it.
FORMER_PREFIX = f"{PROCESSING_DIRNAME}.former-"
# A member who makes a new ``.processing`` each time one is moved aside can keep this up for a
# while; the area held keeps working meanwhile, and the next check tries again.
OPEN_TRIES = 8


class LockHeld(Exception):
    """Another live process holds this instance's lock on this inbox (``args[0]``: its pid,
    as it wrote it, or "?")."""


@dataclass
class HeldArea:
    """The descriptors of ``.processing``, ``.processing/<instance>`` and ``<instance>.lock``
    (flocked), which folder ``.processing`` was (device, inode) when opened, and which folder
    ``folder`` is (a descriptor's folder never changes: no ``fstat`` per claim)."""

    processing: int
    folder: int
    lock: int
    identity: tuple[int, int]
    folder_identity: tuple[int, int]

    def close(self) -> None:
        for fd in (self.folder, self.processing, self.lock):
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class MovedAside:
    """Something found at ``.processing`` that was not the daemon's own, renamed aside."""

    owner_uid: int
    what: str  # "a folder", "a symbolic link", ...
    aside: str  # its name now, in the inbox


@dataclass
class PutBack:
    """What ``put_back`` found and did, for one warning."""

    inbox: Path
    moved_to: str  # where the area held is now ("" when it has no name any more)
    moved_aside: list[MovedAside] = field(default_factory=list)
    taken_back: int = 0  # claimed entries moved by descriptor into the fresh area
    renamed: int = 0  # of those, put under a variant name (their pipeline path is lost)


def identity(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def open_area(inbox: Path, instance: str, held: HeldArea | None = None,
              lock_wait_s: float = LOCK_WAIT_S) -> tuple[HeldArea, list[MovedAside]]:
    """``inbox/.processing/<instance>`` and its lock, made where missing. Whatever sits at
    ``.processing`` that is not the daemon's own is renamed aside first, never opened as ours.
    ``held``: the area held now; if the name leads back to it, it is returned as it is.
    ``LockHeld`` when another process holds the lock; ``OSError`` from the inbox as is."""
    moved: list[MovedAside] = []
    inbox_fd = os.open(inbox, DIR_FLAGS)  # the configured folder: trusted
    try:
        owners = frozenset({os.fstat(inbox_fd).st_uid, os.geteuid(), 0})
        for _ in range(OPEN_TRIES):
            processing = _open_own(inbox_fd, owners, moved)
            if processing is None:
                continue
            if held is not None and identity(os.fstat(processing)) == held.identity:
                os.close(processing)
                return held, moved
            try:
                return _hold(processing, instance, lock_wait_s), moved
            except LockHeld as busy:
                os.close(processing)
                if held is None or busy.args[0] != str(os.getpid()):
                    raise
                # An area this daemon held before, moved back to the name: its lock is still
                # held by the helpers that inherited it at start-up, for as long as they live.
                # It cannot be held again, and waiting would leave every claimed path leading
                # into it: aside, as a former area (the takeover removes it once it is free).
                _move_aside(inbox_fd, moved, FORMER_PREFIX)
            except BaseException:
                os.close(processing)
                raise
        raise OSError(errno.EAGAIN, f"{inbox / PROCESSING_DIRNAME} was replaced {OPEN_TRIES} "
                      "times in a row while inboxd made it again; trying again later")
    finally:
        os.close(inbox_fd)


def _open_own(inbox_fd: int, owners: frozenset[int], moved: list[MovedAside]) -> int | None:
    """``.processing`` opened if it is the daemon's own folder; otherwise made (missing) or
    moved aside (anything else), and None: look again."""
    try:
        fd = os.open(PROCESSING_DIRNAME, DIR_FLAGS, dir_fd=inbox_fd)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):
            os.mkdir(PROCESSING_DIRNAME, OWN_FOLDER_MODE, dir_fd=inbox_fd)
        return None
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        _move_aside(inbox_fd, moved)
        return None
    if not_own(os.fstat(fd), owners) is None:
        return fd
    try:
        # Ours, yet writable by others, because the filesystem keeps no permissions (exFAT):
        # every fresh one would be too, so moving it aside would only repeat, start after start.
        if keeps_no_modes(fd, owners):
            raise ForeignFolder(errno.EPERM, MODELESS, PROCESSING_DIRNAME)
    finally:
        os.close(fd)
    _move_aside(inbox_fd, moved)
    return None


def _move_aside(inbox_fd: int, moved: list[MovedAside], prefix: str = FOREIGN_PREFIX) -> None:
    try:
        info = os.stat(PROCESSING_DIRNAME, dir_fd=inbox_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    what = ("inboxd's own former area (its helpers still lock it)"
            if prefix == FORMER_PREFIX else "a folder" if stat.S_ISDIR(info.st_mode)
            else "a symbolic link" if stat.S_ISLNK(info.st_mode)
            else "a file" if stat.S_ISREG(info.st_mode) else "a special file")
    try:
        aside = first_free(f"{prefix}uid{info.st_uid}", time_token(),
                           lambda name: rename_noreplace(PROCESSING_DIRNAME, name,
                                                         inbox_fd, inbox_fd))
    except FileNotFoundError:
        return  # gone meanwhile: the next look makes a fresh one
    moved.append(MovedAside(info.st_uid, what, aside))


def _hold(processing: int, instance: str, lock_wait_s: float) -> HeldArea:
    with open_inside(processing, [instance], create=True, own=True) as folder:
        folder = os.dup(folder)
    try:
        lock = os.open(f"{instance}{LOCK_SUFFIX}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
                       | os.O_NOFOLLOW, 0o644, dir_fd=processing)
    except BaseException:
        os.close(folder)
        raise
    if not flock_within(lock, lock_wait_s):
        holder = os.read(lock, 32).decode(errors="replace").strip() or "?"
        os.close(lock)
        os.close(folder)
        raise LockHeld(holder)
    os.ftruncate(lock, 0)
    os.write(lock, str(os.getpid()).encode())
    return HeldArea(processing, folder, lock, identity(os.fstat(processing)),
                    identity(os.fstat(folder)))


def name_moved(inbox: Path, held: HeldArea) -> bool:
    """Whether ``inbox/.processing`` no longer names the folder ``held``."""
    try:
        info = os.lstat(os.path.join(inbox, PROCESSING_DIRNAME))  # a str: no Path per claim
    except FileNotFoundError:
        return True
    return identity(info) != held.identity


def put_back(inbox: Path, instance: str, held: HeldArea) -> tuple[HeldArea, PutBack | None]:
    """A fresh area at the name, holding every claimed entry of ``held`` (moved by
    descriptor, under the same names); ``held``'s descriptors are closed. None: the name led
    back to ``held`` after all."""
    fresh, moved = open_area(inbox, instance, held)
    if fresh is held:
        return held, None
    report = PutBack(inbox, _where(held.processing), moved)
    try:
        for name in sorted(os.listdir(held.folder)):
            try:
                placed = first_free(name, time_token(), functools.partial(
                    _rename_into, name, held.folder, fresh.folder))
            except FileNotFoundError:
                continue  # filed or handed back meanwhile (the commit process): not claimed
            report.taken_back += 1
            report.renamed += placed != name
    except BaseException:
        # Not kept half-made: its lock, held by a descriptor nobody would close, would keep
        # every later put-back out. What was moved in stays at the name, where the next one
        # holds it again and brings the rest.
        fresh.close()
        raise
    # Its crash counts follow it; one the fresh area has already is newer.
    with contextlib.suppress(OSError):
        rename_noreplace(instance + LEDGER_SUFFIX, instance + LEDGER_SUFFIX,
                         held.processing, fresh.processing)
    with contextlib.suppress(OSError):
        os.rmdir(instance, dir_fd=held.processing)
    held.close()
    return fresh, report


def _rename_into(name: str, source_dir: int, target_dir: int, candidate: str) -> None:
    rename_noreplace(name, candidate, source_dir, target_dir)


def _where(fd: int) -> str:
    """Where the folder ``fd`` is now, as the kernel names it (for the log only)."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""
    return "" if path.endswith(" (deleted)") else path


@contextlib.contextmanager
def moved_areas(inbox: Path) -> Iterator[list[tuple[str, int]]]:
    """Former claim areas in ``inbox``: (name, descriptor) of each folder at its top, other
    than ``.processing``, that is the daemon's own and holds a ``*.lock`` file — only the
    daemon makes such a folder, and the group can rename one only within the inbox. Closed on
    leaving."""
    found: list[tuple[str, int]] = []
    try:
        inbox_fd = os.open(inbox, DIR_FLAGS)
    except FileNotFoundError:
        yield found
        return
    try:
        owners = frozenset({os.fstat(inbox_fd).st_uid, os.geteuid(), 0})
        with os.scandir(inbox_fd) as entries:
            names = [e.name for e in entries
                     if e.name != PROCESSING_DIRNAME and e.is_dir(follow_symlinks=False)]
        for name in names:
            fd = _former_area(inbox_fd, name, owners)
            if fd is not None:
                found.append((name, fd))
        yield found
    finally:
        for _, fd in found:
            os.close(fd)
        os.close(inbox_fd)


def _former_area(inbox_fd: int, name: str, owners: frozenset[int]) -> int | None:
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=inbox_fd)
    except OSError:
        return None
    try:
        if not_own(os.fstat(fd), owners) is None:
            with os.scandir(fd) as entries:
                if any(entry.name.endswith(LOCK_SUFFIX) and entry.is_file(follow_symlinks=False)
                       for entry in entries):
                    return fd
    except OSError:
        pass
    os.close(fd)
    return None


def remove_emptied(inbox: Path, name: str, area: int) -> bool:
    """Remove the former claim area ``area`` (``inbox/name``) once nothing is claimed in it
    any more: no instance's folder left, and every lock in it free. A member who moves the
    area away and back in a loop makes one such folder of the daemon's per move, which they
    cannot remove (it is not theirs) and the daemon would otherwise keep, and walk at every
    sweep, for ever. Its lock files go too: the instance each belonged to (put back, or dead)
    locks the one in ``.processing`` now, never this one. Returns whether it is gone."""
    names = os.listdir(area)
    if any(n != TMP_DIRNAME and not n.endswith((LOCK_SUFFIX, LEDGER_SUFFIX)) for n in names):
        return False  # a claimed folder (or something else) is still in it: the sweep's work
    locks: list[int] = []
    try:
        for n in names:
            if not n.endswith(LOCK_SUFFIX):
                continue
            fd = os.open(n, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=area)
            locks.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # its instance has not put its area back yet
        with contextlib.suppress(FileNotFoundError):
            _empty_tmp(area)
        for n in names:
            if n != TMP_DIRNAME:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(n, dir_fd=area)
        inbox_fd = os.open(inbox, DIR_FLAGS)
        try:
            # The name may have been moved again meanwhile: only the folder held is removed.
            if identity(os.stat(name, dir_fd=inbox_fd, follow_symlinks=False)) \
                    != identity(os.fstat(area)):
                return False
            os.rmdir(name, dir_fd=inbox_fd)
        finally:
            os.close(inbox_fd)
        return True
    except OSError:
        return False  # not empty after all, or gone: the next sweep looks again
    finally:
        for fd in locks:
            os.close(fd)


def _empty_tmp(area: int) -> None:
    """The temp files left in ``area/.tmp/<instance>/`` (their writer is gone), and the
    folders; never following a link."""
    with open_inside(area, [TMP_DIRNAME], own=True) as tmp:
        for instance in os.listdir(tmp):
            with open_inside(tmp, [instance], own=True) as folder:
                for leftover in os.listdir(folder):
                    os.unlink(leftover, dir_fd=folder)
            os.rmdir(instance, dir_fd=tmp)
    os.rmdir(TMP_DIRNAME, dir_fd=area)
