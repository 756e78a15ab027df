"""Opening folders under an inbox (or an outcome folder) without ever following a link.

A path under the inbox is only inside it if no component on the way is a symbolic link:
``inbox/photos -> /home/alice`` makes ``inbox/photos/x.jpg`` alice's file, and a rename through
it would move her file out of her folder. The kernel resolves every component in one
``openat(O_NOFOLLOW)`` each, so nothing can swap a folder for a link between a check and a use.
This is the one walk every move, claim, clean-up and temp file under such a folder goes
through (``renames.place_inside``, ``Lifecycle``).

A folder the daemon keeps its own state in, inside a folder others can write (the inbox is
shared by a group: ``.processing/`` and everything in it), is also checked to be its own:
owned by this user and writable by nobody else. Anybody in the group can rename
``.processing`` away and make one of their own; what is in theirs is never emptied, claimed
into or trusted (``ForeignFolder``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class LinkedFolder(OSError):
    """A folder on the way is a symbolic link or not a folder at all (a file, a FIFO): nothing
    behind it is ours, and no retry changes that (a permanent problem of the path)."""


class ForeignFolder(LinkedFolder):
    """A folder that should be the daemon's own is somebody else's, or writable by others."""


class NameRefused(OSError):
    """The destination's filesystem cannot hold this name (exFAT: ``?``, ``:``, a name that is
    not UTF-8): the same for every variant of it and on every try, so the caller files it
    under its portable form (``names.portable_key``) instead."""


# What a filesystem answers for a name it cannot hold (exfat-fuse answers ENOENT: callers
# that know the folder is there read that as a refused name too).
NAME_ERRNOS = frozenset({errno.EINVAL, errno.EILSEQ, errno.ENAMETOOLONG})

# Folders the daemon makes for its own state: never writable by the group, whatever the umask.
OWN_FOLDER_MODE = 0o755


def not_own(info: os.stat_result, owners: frozenset[int]) -> str | None:
    """Why a folder with ``info`` is not one the daemon may keep its state in (None: it is).
    ``owners``: the uids trusted with it — the owner of the configured folder it is in (the
    daemon's user; root running ``inboxd retry`` trusts it too), this process's, root."""
    if info.st_uid not in owners:
        return (f"owned by uid {info.st_uid}, not by the inbox's owner "
                f"(uid {', '.join(map(str, sorted(owners)))})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


MODELESS = ("this filesystem does not keep Unix permissions (FAT, exFAT or NTFS through FUSE, "
            "an SMB share without them): any local user could write into the daemon's own "
            "folders there. Put the inbox on a filesystem that keeps them, or mount this one "
            "with the daemon's uid and umask=022 (exfat-fuse, vfat: -o uid=UID,umask=022)")


def keeps_no_modes(fd: int, owners: frozenset[int]) -> bool:
    """Whether the folder ``fd``, ours and writable by others, is so because its filesystem
    keeps no permissions (a chmod changes nothing), not because someone made it so. Only our
    own folder is tried, and only tightened: a folder found writable by others is still
    refused, for the user to look inside."""
    info = os.fstat(fd)
    if info.st_uid not in owners:
        return False
    try:
        os.fchmod(fd, stat.S_IMODE(info.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
    except OSError:
        return True  # refused outright: FUSE drivers without permissions answer EPERM
    return bool(os.fstat(fd).st_mode & (stat.S_IWGRP | stat.S_IWOTH))


@contextlib.contextmanager
def open_inside(root: str | Path | int, parts: Sequence[str], create: bool = False,
                own: bool = False) -> Iterator[int]:
    """A file descriptor for ``root/parts…``, each part opened without following links;
    ``root`` is a path (trusted: the configured folder) or a descriptor (not closed here).
    ``create``: a missing part is made (a link there is still refused, never followed).
    ``own``: every part must be the daemon's own folder (``ForeignFolder`` otherwise)."""
    fd = os.dup(root) if isinstance(root, int) else os.open(root, DIR_FLAGS)
    # The path walked so far, for the errors: a user reads "/srv/inbox/.processing", not the
    # bare ".processing" the syscall was given relative to a descriptor.
    where = None if isinstance(root, int) else os.fspath(root)
    try:
        owners = frozenset({os.fstat(fd).st_uid, os.geteuid(), 0}) if own else frozenset()
        for part in parts:
            try:
                child = _open_part(fd, part, create, OWN_FOLDER_MODE if own else 0o777)
                os.close(fd)
                fd = child
                if own and (why := not_own(os.fstat(fd), owners)) is not None:
                    if keeps_no_modes(fd, owners):
                        raise ForeignFolder(errno.EPERM, f"{part}: {MODELESS}", part)
                    raise ForeignFolder(errno.EPERM, f"{part} is not the daemon's own folder: "
                                        f"{why}; someone replaced it — move it aside and look "
                                        "inside", part)
            except OSError as exc:
                if where is not None and exc.filename == part:
                    exc.filename = os.path.join(where, part)
                raise
            where = None if where is None else os.path.join(where, part)
        yield fd
    finally:
        os.close(fd)


def _open_part(fd: int, part: str, create: bool, mode: int) -> int:
    if part in ("", ".", "..") or "/" in part:
        raise LinkedFolder(errno.EINVAL, f"not a plain folder name: {part!r}", part)
    try:
        try:
            return os.open(part, DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise
        # Open first, make only when missing: one syscall per part in the common case. Made
        # by someone else meanwhile is fine; what it is, is checked by the open that follows.
        try:
            os.mkdir(part, mode, dir_fd=fd)
        except FileExistsError:
            pass
        except FileNotFoundError:  # in a folder we hold open: the name is what is refused
            raise NameRefused(errno.EINVAL, "this filesystem cannot hold the name",
                              part) from None
        return os.open(part, DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        if exc.errno in NAME_ERRNOS and not isinstance(exc, LinkedFolder):
            raise NameRefused(exc.errno, exc.strerror, part) from None
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            what = ("a symbolic link, not a folder; links are never followed"
                    if _is_link(fd, part) else "not a folder (a file has that name)")
            raise LinkedFolder(exc.errno, f"{part} is {what}", part) from None
        raise


def _is_link(fd: int, part: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def split_rel(rel: str) -> tuple[list[str], str]:
    """``a/b/c.jpg`` → (["a", "b"], "c.jpg")."""
    folders, _, leaf = rel.rpartition("/")
    return (folders.split("/") if folders else []), leaf
