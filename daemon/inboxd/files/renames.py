"""Renames that never replace anything, and the names to try when one is taken.

Every name can be reused: a scanner that always writes ``scan.jpg``, two cameras with one
numbering, a user dropping the same file twice. A plain ``rename(2)`` silently replaces what is
at the destination — a different input, gone. Every move inboxd makes goes through
:func:`rename_noreplace` (``renameat2(RENAME_NOREPLACE)``, atomic in the kernel), and a taken
name is resolved by trying the next of :func:`name_variants`, without an upper limit.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

from inboxd.files.names import fit_name
from inboxd.files.safe_paths import open_inside

RENAME_NOREPLACE = 1
AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)
# Filesystems that lack the flag answer EINVAL (some FUSE and network filesystems); a libc
# without renameat2 has no symbol. Both fall back to link + unlink, which also fails on EEXIST.
_FLAG_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}


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
        if err not in _FLAG_UNSUPPORTED:
            raise OSError(err, os.strerror(err), str(source), None, str(target))
    try:
        os.link(source, target, src_dir_fd=source_dir_fd, dst_dir_fd=target_dir_fd,
                follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        # No hard links here either (vfat, some FUSE): the best left is check, then rename.
        try:
            os.stat(target, dir_fd=target_dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            raise FileExistsError(errno.EEXIST, "File exists", str(target)) from None
        os.rename(source, target, src_dir_fd=source_dir_fd, dst_dir_fd=target_dir_fd)
        return
    os.unlink(source, dir_fd=source_dir_fd)


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
        os.makedirs(folder, exist_ok=True)
        rename_noreplace(source, target, source_dir_fd)


def name_variants(name: str, token: str) -> Iterator[str]:
    """``photo.jpg``, then ``photo.<token>.jpg``, ``photo.<token>.1.jpg``, ``photo.<token>.2.jpg``
    … for ever; each within NAME_MAX. The token makes the second name stable for the same
    content (a sha256 prefix) so a re-drop finds its earlier result in one look."""
    yield name
    stem, dot, suffix = name.rpartition(".")
    if not stem:  # no extension (or only a leading dot): the token goes at the end
        stem, dot, suffix = name, "", ""
    n = 0
    while True:
        extra = f".{token}" + (f".{n}" if n else "")
        yield fit_name(stem + extra, dot + suffix)
        n += 1


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


def place(source: Path | str, target: Path | str, token: str) -> str:
    """Rename ``source`` to ``target``, or to the first free variant of its name; returns where
    it went. The folder is created when missing."""
    folder, leaf = os.path.split(target)
    for name in name_variants(leaf, token):
        candidate = os.path.join(folder, name)
        try:
            rename_into(source, candidate)
        except FileExistsError:
            continue
        return candidate
    raise AssertionError("name_variants never ends")  # pragma: no cover


def place_inside(source: str, source_dir_fd: int, root: str | Path, rel: str, token: str
                 ) -> str:
    """Rename ``source`` (in folder ``source_dir_fd``) to ``root/rel`` or the first free
    variant of its name; returns the ``rel`` it got. The folders on the way are made or opened
    without following links: one swapped for a link since the file left would carry it out
    of ``root`` (``LinkedFolder``, and nothing moves)."""
    folders, _, leaf = rel.rpartition("/")
    with open_inside(root, folders.split("/") if folders else [], create=True) as target_dir:
        for candidate in name_variants(leaf, token):
            try:
                rename_noreplace(source, candidate, source_dir_fd, target_dir)
            except FileExistsError:
                continue
            return f"{folders}/{candidate}" if folders else candidate
    raise AssertionError("name_variants never ends")  # pragma: no cover
