"""Renames that never replace anything, and the names to try when one is taken.

Every name can be reused: a scanner that always writes ``scan.jpg``, two cameras with one
numbering, a user dropping the same file twice. A plain ``rename(2)`` silently replaces what is
at the destination — a different input, gone. Every move inboxd makes goes through
:func:`rename_noreplace` (``renameat2(RENAME_NOREPLACE)``, atomic in the kernel), and a taken
name is resolved by trying the next of :func:`name_variants`.

Only EEXIST at the destination means "taken, try the next name". Anything else — a folder on
the way that is a file or a link (``LinkedFolder``: ENOTDIR, ELOOP), a name too long — is the
same for every variant of the name, so trying the next one would loop for ever: it is raised,
and the caller makes it that file's outcome. Every name loop is bounded too
(``MAX_NAME_VARIANTS``, ``NoFreeName``): a variant is only needed when the same name is
already taken by other bytes (or by the same bytes dropped again), and ten thousand of those
in one folder is an attack, not a workload.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from inboxd.files.names import fit_name, portable_name
from inboxd.files.safe_paths import (
    NAME_ERRNOS,
    ForeignFolder,
    LinkedFolder,
    NameRefused,
    open_inside,
    split_rel,
)

RENAME_NOREPLACE = 1
AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)
# Filesystems that lack the flag answer EINVAL (some FUSE and network filesystems); a libc
# without renameat2 has no symbol. Both fall back to link + unlink, which also fails on EEXIST.
_FLAG_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}
# How many names one move tries before it gives up (the name itself and its variants).
MAX_NAME_VARIANTS = 10_000
# Errors of a destination path that no retry and no other variant of the name can change.
PATH_ERRNOS = frozenset({errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG})


class NoFreeName(OSError):
    """Every one of ``MAX_NAME_VARIANTS`` names for a destination is taken."""


def path_problem(exc: OSError) -> bool:
    """Whether ``exc`` is the destination path's own permanent problem (a folder on the way
    that is not one, no free name left), not a condition that may clear (a full disk)."""
    if isinstance(exc, ForeignFolder):  # the layout (.processing swapped), not the path
        return False
    return isinstance(exc, LinkedFolder | NoFreeName | NameRefused) or exc.errno in PATH_ERRNOS


def rename_noreplace(source: Path | str, target: Path | str,
                     source_dir_fd: int | None = None, target_dir_fd: int | None = None) -> None:
    """Rename ``source`` (relative to ``source_dir_fd`` when given) to ``target`` (relative to
    ``target_dir_fd``) unless ``target`` exists (then ``FileExistsError``). A link at
    ``target`` is an existing name like any other; a link at ``source`` is renamed itself,
    never followed."""
    dir_fd = AT_FDCWD if source_dir_fd is None else source_dir_fd
    to_fd = AT_FDCWD if target_dir_fd is None else target_dir_fd
    if _renameat2 is not None:
        if _renameat2(dir_fd, os.fsencode(source), to_fd, os.fsencode(target),
                      RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err in (errno.EILSEQ, errno.ENAMETOOLONG):
            raise NameRefused(err, os.strerror(err), str(target))
        if err not in _FLAG_UNSUPPORTED:
            raise OSError(err, os.strerror(err), str(source), None, str(target))
    try:
        os.link(source, target, src_dir_fd=source_dir_fd, dst_dir_fd=target_dir_fd,
                follow_symlinks=False)
    except OSError as exc:
        if exc.errno in NAME_ERRNOS - {errno.EINVAL}:
            raise NameRefused(exc.errno, exc.strerror, str(target)) from None
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        # No hard links here either (vfat, exFAT, some FUSE): the best left is check, then
        # rename.
        try:
            os.stat(target, dir_fd=target_dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            pass
        except OSError as refused:
            if refused.errno not in NAME_ERRNOS:
                raise
        else:
            raise FileExistsError(errno.EEXIST, "File exists", str(target)) from None
        try:
            os.rename(source, target, src_dir_fd=source_dir_fd, dst_dir_fd=target_dir_fd)
        except OSError as failed:
            if failed.errno in NAME_ERRNOS or (
                    isinstance(failed, FileNotFoundError)
                    and _exists(source, source_dir_fd) and _folder_there(target, target_dir_fd)):
                raise NameRefused(failed.errno if failed.errno in NAME_ERRNOS else errno.EINVAL,
                                  "this filesystem cannot hold the name", str(target)) from None
            raise
        return
    os.unlink(source, dir_fd=source_dir_fd)


def _exists(path: Path | str, dir_fd: int | None) -> bool:
    try:
        os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def _folder_there(target: Path | str, dir_fd: int | None) -> bool:
    """Whether the folder ``target`` goes into is there (a descriptor we hold always is): then
    a rename's ENOENT is about the new name (exfat-fuse's answer to ``?`` or ``:``)."""
    return dir_fd is not None or os.path.isdir(os.path.dirname(target) or ".")


def rename_into(source: Path | str, target: Path | str,
                source_dir_fd: int | None = None) -> None:
    """:func:`rename_noreplace`, creating ``target``'s folder only when the rename finds it
    missing: one syscall per move in the common case, where an up-front ``mkdir`` cost one
    more every time. ``FileNotFoundError`` with the folder there means the source is gone."""
    try:
        rename_noreplace(source, target, source_dir_fd)
    except FileNotFoundError:
        folder = os.path.dirname(target) or "."
        if os.path.isdir(folder):
            raise
        try:
            os.makedirs(folder, exist_ok=True)
        except FileExistsError:
            # Something that is not a folder holds the folder's name (or a part of it): not
            # "the target is taken", which would send the caller on to the next name for ever.
            raise LinkedFolder(errno.ENOTDIR, f"{folder} (or a folder above it) is not a "
                               "folder", str(folder)) from None
        except OSError as exc:  # ENOENT making a folder under one that is there: its name
            if exc.errno in NAME_ERRNOS or isinstance(exc, FileNotFoundError):
                raise NameRefused(exc.errno or errno.EINVAL, exc.strerror, str(folder)) from None
            raise
        rename_noreplace(source, target, source_dir_fd)


def name_variants(name: str, token: str) -> Iterator[str]:
    """``photo.jpg``, then ``photo.<token>.jpg``, ``photo.<token>.1.jpg``, ``photo.<token>.2.jpg``
    … up to ``MAX_NAME_VARIANTS`` names in all; each within NAME_MAX. The token makes the
    second name stable for the same content (a sha256 prefix) so a re-drop finds its earlier
    result in one look."""
    yield name
    stem, dot, suffix = name.rpartition(".")
    if not stem:  # no extension (or only a leading dot): the token goes at the end
        stem, dot, suffix = name, "", ""
    for n in range(MAX_NAME_VARIANTS - 1):
        extra = f".{token}" + (f".{n}" if n else "")
        yield fit_name(stem + extra, dot + suffix)


def no_free_name(where: str | Path) -> NoFreeName:
    return NoFreeName(errno.EEXIST, f"{MAX_NAME_VARIANTS} names for it are all taken "
                      "(move some of them away)", str(where))


def key_variants(key: str, token: str) -> Iterator[str]:
    """:func:`name_variants` of a key's last part, the folders unchanged."""
    folder, slash, name = key.rpartition("/")
    for variant in name_variants(name, token):
        yield folder + slash + variant


# A name with a time token from name_variants: photo.t<hex>.jpg, photo.t<hex>.3.jpg.
_TIME_VARIANT = re.compile(r"^(?P<stem>.+)\.t[0-9a-f]+(?:\.\d+)?(?P<suffix>\.[^.]*)?$")


def before_time_variant(name: str) -> str | None:
    """The name a time-token variant was made from, None when ``name`` does not look like one
    (a guess: only good for looking up something that is then checked, such as a sha256)."""
    match = _TIME_VARIANT.match(name)
    return match["stem"] + (match["suffix"] or "") if match else None


def time_token() -> str:
    """A token for a collision when nothing better is known (no sha256 yet)."""
    return f"t{time.time_ns():x}"


def first_free(name: str, token: str, put: Callable[[str], None]) -> str:
    """``put(candidate)`` for ``name`` and then each variant of it, until one does not raise
    ``FileExistsError``; returns that one. The one loop over names: only EEXIST means "taken"
    (anything else is raised, it would be the same for every variant), and it ends."""
    for candidate in name_variants(name, token):
        try:
            put(candidate)
        except FileExistsError:
            continue
        return candidate
    raise no_free_name(name)


def place(source: Path | str, target: Path | str, token: str) -> str:
    """Rename ``source`` to ``target`` or the first free variant of its name; returns where
    it went. For folders only the daemon writes (results/); under any other, use
    :func:`place_inside`, which walks the folders without following links."""
    folder, leaf = os.path.split(target)
    return os.path.join(folder, first_free(
        leaf, token, lambda name: rename_into(source, os.path.join(folder, name))))


def place_inside(source: str | Path, source_dir_fd: int | None, root: str | Path | int,
                 rel: str, token: str, own: bool = False) -> str:
    """Rename ``source`` (relative to folder ``source_dir_fd``, or a path when None) to
    ``root/rel`` or the first free variant of its name; returns the ``rel`` it got. The
    folders on the way are made or opened without following links (``safe_paths``): one
    swapped for a link since the file left would carry it out of ``root``, and one that is a
    file can never hold it (``LinkedFolder`` both, and nothing moves). ``own``: they must be
    the daemon's own folders, too."""
    folders, leaf = split_rel(rel)
    try:
        return _place_inside(source, source_dir_fd, root, folders, leaf, token, own)
    except NameRefused:
        # The destination's filesystem cannot hold the name: its portable form, every time.
        return _place_inside(source, source_dir_fd, root,
                             [portable_name(part) for part in folders], portable_name(leaf),
                             token, own)


def _place_inside(source: str | Path, source_dir_fd: int | None, root: str | Path | int,
                  folders: list[str], leaf: str, token: str, own: bool) -> str:
    folders = [fit_name(part, "") for part in folders]
    with open_inside(root, folders, create=True, own=own) as target_dir:
        placed = first_free(fit_name(leaf, ""), token, lambda name: rename_noreplace(
            source, name, source_dir_fd, target_dir))
    return "/".join([*folders, placed])
