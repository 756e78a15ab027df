"""Writes that survive a crash: temp file, fsync, rename, folder fsync; and moves across
filesystems that never leave half a file.

Many files at once (a batch's results: group commit) are written to their temp files first and
made durable together: one ``fdatasync`` per file, issued in parallel from a small thread pool,
so the filesystem's journal commits them in one or a few transactions where a loop of fsyncs
pays one commit each. ``fdatasync`` flushes a file's data and the metadata needed to read it
back (the size of a new file), which is all a temp file needs: its name is made durable by the
rename and the folder fsync that follow.

Temp files live in a hidden ``.tmp/<instance>/`` folder of the destination's root (same
filesystem, so the final rename is atomic); ``Lifecycle.prepare`` empties it at start-up, so a
kill at any instant leaves no temp file behind for longer than one restart.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from pathlib import Path
from typing import Any, NamedTuple

from inboxd import testing
from inboxd.files.layout import TMP_DIRNAME
from inboxd.files.renames import place_inside
from inboxd.files.safe_paths import open_inside
from inboxd.os_threads import name_this_thread

RESULT_MODE = 0o644  # before the umask (the unit's 0027 makes it 0640): see output_mode
SYNC_THREADS = 16  # parallel fdatasync calls of one group commit (8-16: 5-10x a loop here)
# Test-only: a pause (ms) at each step of a group commit, so that kills land inside commits.
_COMMIT_PAUSE_S = float(testing.hook(testing.COMMIT_PAUSE_MS) or 0) / 1000
# No extended attributes here (the filesystem has none, or this one is not ours to copy).
_NO_XATTRS = {errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.EACCES, errno.ENODATA,
              errno.E2BIG, errno.ERANGE}
# An output that cannot take more (full, over quota, read-only): a condition of the folder that
# passes once somebody frees space or remounts it, never a fact about the file being written.
OUTPUT_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
# What a probe of a full output writes: room for a batch's results, so that a filesystem with a
# few blocks left does not pass the probe only to refuse the batch that follows.
PROBE_BYTES = 64 << 10
_sync_pool: ThreadPoolExecutor | None = None
_sync_pool_lock = threading.Lock()


class TmpDir(NamedTuple):
    """A temp folder ``root/parts…``: ``root`` is trusted (a configured folder), the parts are
    walked without following links and, with ``own``, checked to be the daemon's own (a temp
    folder inside one others can write: the inbox's ``.processing/.tmp/<instance>``)."""

    root: Path
    parts: tuple[str, ...]
    own: bool = False

    @property
    def path(self) -> Path:
        return self.root.joinpath(*self.parts)

    def open(self) -> contextlib.AbstractContextManager[int]:
        return open_inside(self.root, self.parts, create=True, own=self.own)


def tmp_dir_in(root: Path, instance: str) -> TmpDir:
    """``root/.tmp/<instance>``, for a folder only the daemon writes (results/, done/, …)."""
    return TmpDir(root, (TMP_DIRNAME, instance))


def create_excl(name: str, dir_fd: int, mode: int = 0o644) -> int:
    """A new file ``name`` in folder ``dir_fd``, for writing: never one that was there, never
    through a link (``O_EXCL`` refuses an existing name, dangling links included)."""
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                   mode, dir_fd=dir_fd)


def tmp_name(tmp_dir: str | Path, suffix: str) -> str:
    """A fresh temp file name under ``tmp_dir``, as a ``str``: one is made per result, and
    pathlib would intern every one of these never-repeated names for the life of the process."""
    return os.path.join(tmp_dir, f"{uuid.uuid4().hex}{suffix}.tmp")


def ensure_dir(folder: str | Path) -> None:
    """``mkdir -p``, one syscall when the folder is there (each write_tmp of a batch asks)."""
    try:
        os.mkdir(folder, 0o755)  # a temp folder: never writable by the group, whatever the umask
    except FileExistsError:
        if not os.path.isdir(folder):
            raise
    except FileNotFoundError:
        os.makedirs(folder, 0o755, exist_ok=True)


def output_full(exc: BaseException) -> bool:
    """Whether ``exc`` says its folder cannot take more now (``OUTPUT_FULL_ERRNOS``)."""
    return isinstance(exc, OSError) and exc.errno in OUTPUT_FULL_ERRNOS


def probe_room(tmp_dir: TmpDir) -> None:
    """Raise what a write to ``tmp_dir``'s filesystem raises now: ``PROBE_BYTES`` written to a
    temp file there, made durable (a full disk may refuse only the flush) and removed. The
    folder is walked without following links (it may be the inbox's ``.processing/.tmp``)."""
    with tmp_dir.open() as folder:
        name = tmp_name("", ".probe")
        fd = create_excl(name, folder, 0o600)
        try:
            view = memoryview(bytes(PROBE_BYTES))
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=folder)


def unlink_quietly(path: str | Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def output_mode(source_mode: int | None) -> int:
    """The mode a file the daemon writes about a source gets (before the umask): owner
    read-write (the daemon reads its own results back), group and others may read it only
    when they may read the source. A 0600 photo's result is 0600: its name, sha256 and
    labels are no more public than the photo."""
    if source_mode is None:
        return RESULT_MODE
    return 0o600 | (source_mode & 0o044)


def write_tmp(tmp_dir: str | Path, data: bytes, suffix: str, mode: int = 0o644) -> str:
    """``data`` in a new temp file under ``tmp_dir``, fsynced; removed again if writing fails."""
    ensure_dir(tmp_dir)
    tmp = tmp_name(tmp_dir, suffix)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError:
        os.close(fd)
        unlink_quietly(tmp)
        raise
    os.close(fd)
    return tmp


def commit_pause() -> None:
    """Between two steps of a group commit: nothing, unless a test widened the window."""
    if _COMMIT_PAUSE_S:
        time.sleep(_COMMIT_PAUSE_S)


def _pool() -> ThreadPoolExecutor:
    global _sync_pool
    with _sync_pool_lock:
        if _sync_pool is None:
            _sync_pool = ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="inboxd-sync",
                                            initializer=name_this_thread)
        return _sync_pool


def sync_together(fds: Sequence[int]) -> None:
    """``fdatasync`` every descriptor, in parallel; returns when all are durable, raises the
    first error once every call has finished (so no descriptor is still in use)."""
    if len(fds) <= 1:
        for fd in fds:
            os.fdatasync(fd)
        return
    # One task per thread, each with its share: a hand-off per thread, not one per file.
    shares = [fds[start::SYNC_THREADS] for start in range(min(SYNC_THREADS, len(fds)))]
    futures = [_pool().submit(_sync_each, share) for share in shares]
    errors = [exc for future in futures if (exc := future.exception()) is not None]
    if errors:
        raise errors[0]


def _sync_each(fds: Sequence[int]) -> None:
    for fd in fds:
        os.fdatasync(fd)


def write_tmps(tmp_dir: str | Path, blobs: Sequence[bytes], suffix: str,
               modes: Sequence[int] | None = None, also_sync: Sequence[int] = ()) -> list[str]:
    """Each of ``blobs`` in a new temp file under ``tmp_dir`` (with ``modes[i]``, before the
    umask), all durable together when this returns (group commit); if anything fails, none of
    them is left. ``also_sync``: descriptors made durable in the same parallel sync (the
    index's write-ahead log: its pending entries must be durable before a result is placed)."""
    ensure_dir(tmp_dir)
    written: list[tuple[str, int]] = []
    try:
        for index, data in enumerate(blobs):
            tmp = tmp_name(tmp_dir, suffix)
            mode = RESULT_MODE if modes is None else modes[index]
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            written.append((tmp, fd))
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        commit_pause()
        sync_together([*(fd for _, fd in written), *also_sync])
    except BaseException:
        for tmp, fd in written:
            os.close(fd)
            unlink_quietly(tmp)
        raise
    for _, fd in written:
        os.close(fd)
    return [tmp for tmp, _ in written]


def json_bytes(document: dict[str, Any]) -> bytes:
    """One top-level key per line, each value on its line (as the README shows a result):
    readable, and every value goes through the C encoder (``indent`` would force json's
    pure-Python one, a tenth of a millisecond per result)."""
    lines = ",\n".join(f"  {_json_key(key)}: {_json_value(value)}"
                       for key, value in document.items())
    return f"{{\n{lines}\n}}\n".encode() if document else b"{}\n"


def _json_value(value: Any) -> str:
    """``json.dumps(value)``, without its Python layers around the C encoder (argument checks,
    a new encoder object per call): they cost more than encoding a result's small values, and
    a result has a dozen of them. ``json.dumps`` where the C encoder is missing."""
    if _ENCODE is None:
        return json.dumps(value)
    return "".join(_ENCODE(value, 0))


def _not_serializable(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# json.dumps's defaults (ASCII output, NaN allowed, ", " and ": "), minus the circular-reference
# check: every document is plain data made by inboxd or read from JSON. Stateless without that
# check, so one encoder serves every thread.
_ENCODE = None if c_make_encoder is None else c_make_encoder(
    None, _not_serializable, encode_basestring_ascii, None, ": ", ", ", False, False, True)


def _json_key(key: Any) -> str:
    """``json.dumps(str(key))``; a plain ASCII name (every result field) needs no escaping."""
    text = str(key)
    return f'"{text}"' if text.isascii() and text.isidentifier() else json.dumps(text)


def move(source: str | Path, root: str | Path, rel: str, token: str, tmp_dir: TmpDir,
         source_dir_fd: int | None = None) -> str:
    """Move ``source`` (relative to folder ``source_dir_fd`` when given) to ``root/rel`` or a
    free variant of its name (never replacing anything, the folders below ``root`` walked
    without following links: ``renames.place_inside``); across filesystems copy it to
    ``tmp_dir`` first (fsynced), so the destination only ever holds the whole file, with the
    source's mode, owner and group (as far as this process may set them), timestamps and
    extended attributes (ACLs among them): a move must not make a private photo readable by
    the folder's group. Returns where it went."""
    try:
        return os.path.join(root, place_inside(source, source_dir_fd, root, rel, token))
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    with tmp_dir.open() as tmp_fd:
        tmp = tmp_name("", ".copy")
        try:
            info = os.stat(source, dir_fd=source_dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):
                # A refused link travels as a link: copying would read (and file) what it
                # points to, a file from outside the inbox.
                os.symlink(os.readlink(source, dir_fd=source_dir_fd), tmp, dir_fd=tmp_fd)
            else:
                _copy_whole(source, source_dir_fd, tmp, tmp_fd)
            final = os.path.join(root, place_inside(tmp, tmp_fd, root, rel, token))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=tmp_fd)
            raise
    fsync_dir(os.path.dirname(final) or ".")
    os.unlink(source, dir_fd=source_dir_fd)
    return final


def _copy_whole(source: str | Path, source_dir_fd: int | None, tmp: str, tmp_fd: int) -> None:
    """``source``'s bytes and metadata into the new file ``tmp`` (each in its folder's fd),
    fsynced. The copy is made 0600 and only gets the source's mode once its owner is set:
    never, even for a moment, readable by anybody the source was not."""
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=source_dir_fd)
    try:
        st = os.fstat(src)
        dst = create_excl(tmp, tmp_fd, 0o600)
        try:
            with os.fdopen(os.dup(src), "rb") as reader, os.fdopen(os.dup(dst), "wb") as writer:
                shutil.copyfileobj(reader, writer, 1 << 20)
            _copy_xattrs(src, dst)
            _copy_owner(dst, st)
            # After chown (which clears set-id bits); set-id bits are never carried: a photo
            # has no business with them.
            os.fchmod(dst, stat.S_IMODE(st.st_mode) & 0o777)
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _copy_owner(dst: int, st: os.stat_result) -> None:
    """The source's owner and group; without the right to give files away (not root), the
    group alone where we are in it; else the copy stays ours, and its mode (0600 when the
    source's group could not read it) still keeps it private."""
    for uid, gid in ((st.st_uid, st.st_gid), (-1, st.st_gid)):
        try:
            os.fchown(dst, uid, gid)
            return
        except PermissionError:
            continue


def _copy_xattrs(src: int, dst: int) -> None:
    """Every extended attribute this process may read and set (``user.*``, POSIX ACLs;
    ``security.*``/``trusted.*`` where privileged); a filesystem without them has none."""
    try:
        names = os.listxattr(src)
    except OSError as exc:
        if exc.errno in _NO_XATTRS:
            return
        raise
    for name in names:
        try:
            os.setxattr(dst, name, os.getxattr(src, name))
        except OSError as exc:
            if exc.errno not in _NO_XATTRS:
                raise


def fsync_dir(folder: str | Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def walk_files(root: Path) -> Iterator[Path]:
    """Every non-directory under ``root``; links are listed, never followed."""
    if not root.is_dir():
        return
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            yield Path(folder) / name
        for name in dirs:
            if os.path.islink(os.path.join(folder, name)):
                yield Path(folder) / name
