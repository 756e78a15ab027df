"""Every move a file makes on disk, each one atomic.

inbox/rel ─claim (rename)─▶ inbox/.processing/<instance>/rel ─▶ done/key | deleted | kept
                                                           └─▶ failed/key + failed/key.error.json
A result is written to a temp file, fsynced and renamed into place, and its folder fsynced,
*before* the source moves: a kill at any instant leaves either no result (the file is processed
again) or a complete one (which the rerun finds by its sha256 and does not redo).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from inboxd.config import Config
from inboxd.files.names import output_path

TMP_DIRNAME = ".tmp"


class InstanceBusy(Exception):
    """Another live process holds this instance name on this inbox."""


class Lifecycle:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.results_dir = config.results_dir
        self.tmp_dir = config.results_dir / TMP_DIRNAME / config.instance
        self._locks: list[int] = []

    def lock_instance(self) -> None:
        """Hold ``<inbox>/.processing/<instance>.lock`` while we run. Two live daemons with one
        instance name would each "recover" the other's claimed files; ``recover`` on a running
        instance would pull files from under it. The kernel drops the lock when we die, however
        we die, so a SIGKILLed instance never blocks its own restart."""
        if self._locks:
            return
        for inbox in self.config.inbox.paths:
            lock_path = inbox / ".processing" / f"{self.config.instance}.lock"
            lock_path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                self.unlock_instance()
                raise InstanceBusy(
                    f"instance {self.config.instance!r} is already running on {inbox} "
                    f"(pid {holder}); give each daemon on a shared inbox its own --instance"
                ) from None
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
            self._locks.append(fd)

    def unlock_instance(self) -> None:
        for fd in self._locks:
            os.close(fd)
        self._locks.clear()

    def prepare(self) -> list[str]:
        """Create every folder, and drop temp files a killed run of this instance left.

        An output folder that cannot be created now (a read-only or full disk) is not fatal:
        the files wait in the inbox, and writing retries (and creates it) later. Returns what
        could not be prepared, for the log."""
        for inbox in self.config.inbox.paths:
            self.config.processing_dir(inbox).mkdir(parents=True, exist_ok=True)
        problems = []
        failed_tmp = self.config.failed_dir / TMP_DIRNAME / self.config.instance
        for folder in (self.config.done_dir, self.config.failed_dir, self.tmp_dir, failed_tmp):
            try:
                folder.mkdir(parents=True, exist_ok=True)
                for leftover in folder.iterdir() if folder in (self.tmp_dir, failed_tmp) else ():
                    leftover.unlink(missing_ok=True)
            except OSError as exc:
                problems.append(f"{folder}: {exc.strerror or exc}")
        return problems

    # -- claiming ----------------------------------------------------------------------------

    def claim(self, source: Path, claimed: Path) -> bool:
        """Take a file by renaming it into our processing folder. False: it was already gone
        (another instance claimed it, or its writer removed it)."""
        try:
            os.rename(source, claimed)
        except FileNotFoundError:
            if not claimed.parent.is_dir() and source.parent.exists():
                claimed.parent.mkdir(parents=True, exist_ok=True)
                return self.claim(source, claimed)
            return False
        return True

    def release(self, claimed: Path, inbox_path: Path) -> None:
        """Hand a claimed file back to the inbox, where a later scan finds it again."""
        inbox_path.parent.mkdir(parents=True, exist_ok=True)
        if inbox_path.exists():
            # Somebody dropped a new file of the same name meanwhile: keep both.
            inbox_path = unique_path(inbox_path)
        with contextlib.suppress(FileNotFoundError):
            os.rename(claimed, inbox_path)

    def recover(self) -> int:
        """Return every file this instance had claimed (after a crash) to its inbox."""
        returned = 0
        for inbox in self.config.inbox.paths:
            processing = self.config.processing_dir(inbox)
            for claimed in walk_files(processing):
                self.release(claimed, inbox / claimed.relative_to(processing))
                returned += 1
        return returned

    # -- outcomes ----------------------------------------------------------------------------

    def result_path(self, key: str) -> Path:
        return output_path(self.results_dir, key, ".json")

    def existing_result_sha256(self, key: str) -> str | None:
        try:
            with open(self.result_path(key), "rb") as existing:
                sha = json.load(existing).get("sha256")
        except (OSError, ValueError, AttributeError):
            return None
        return sha if isinstance(sha, str) else None

    def write_results(self, documents: Iterable[tuple[str, dict[str, Any]]]) -> None:
        """Durably write a batch of results: data fsynced per file, each folder fsynced once."""
        renamed: list[tuple[Path, Path]] = []
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        try:
            for key, document in documents:
                tmp = self._write_tmp(self.tmp_dir, key, document)
                renamed.append((tmp, self.result_path(key)))
        except OSError:
            # A full disk fails the batch part-way: give back the space its temps took.
            for tmp, _ in renamed:
                tmp.unlink(missing_ok=True)
            raise
        folders: set[Path] = set()
        for tmp, final in renamed:
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
            folders.add(final.parent)
        for folder in folders:
            fsync_dir(folder)

    def _write_tmp(self, tmp_dir: Path, key: str, document: dict[str, Any]) -> Path:
        data = json.dumps(document, indent=2, ensure_ascii=True).encode() + b"\n"
        tmp = tmp_dir / f"{os.getpid()}-{abs(hash(key)):x}.json.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return tmp

    def finish_success(self, claimed: Path, key: str, inbox_path: Path) -> None:
        """After the result is durable: move, delete or keep the source, per config."""
        policy = self.config.inbox.after_success
        if policy == "delete":
            claimed.unlink(missing_ok=True)
        elif policy == "move":
            move_file(claimed, unique_path(output_path(self.config.done_dir, key)))
        else:
            # keep: back where the user put it; intake skips files whose result is newer.
            self.release(claimed, inbox_path)

    def finish_failure(self, claimed: Path | None, key: str, report: dict[str, Any]) -> None:
        """``failed/key.error.json`` first, then the source: never a failed file without why."""
        failed_dir = self.config.failed_dir
        tmp_dir = failed_dir / TMP_DIRNAME / self.config.instance
        tmp_dir.mkdir(parents=True, exist_ok=True)
        target = output_path(failed_dir, key)
        report_path = output_path(failed_dir, key, ".error.json")
        report_path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self._write_tmp(tmp_dir, key, report), report_path)
        fsync_dir(report_path.parent)
        if claimed is not None and os.path.lexists(claimed):
            move_file(claimed, target)


def unique_path(path: Path) -> Path:
    """``path`` if free, else ``name.1.ext``, ``name.2.ext`` …: a later drop of the same name
    never overwrites an earlier source."""
    if not os.path.lexists(path):
        return path
    for n in range(1, 10_000):
        candidate = path.with_name(f"{path.stem}.{n}{path.suffix}")
        if not os.path.lexists(candidate):
            return candidate
    raise FileExistsError(errno.EEXIST, "too many files of the same name", str(path))


def move_file(source: Path, target: Path) -> None:
    """Rename when on one filesystem; else copy, fsync, then rename (so never half a file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(source, target)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    tmp = target.with_name(f".{target.name}.inboxd-copy")
    with open(source, "rb") as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, target)
    source.unlink()


def fsync_dir(folder: Path) -> None:
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
