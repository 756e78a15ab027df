"""Every move a file makes on disk, each one atomic and none replacing anything.

inbox/rel ─claim─▶ inbox/.processing/<instance>/rel ─▶ done/<name> | deleted | kept
                                                   └─▶ failed/<name> + failed/<name>.error.json
A result is durable (``files.results``) *before* the source moves: a kill at any instant leaves
either no result (the file is processed again) or a complete one (which the rerun finds by its
sha256 and does not redo). Every destination that is taken gets the next free variant of the
name (``files.renames``), so no input ever replaces another. Every move is here, so that the
no-replace and durable-first rules can be checked in one place.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from inboxd import logs
from inboxd.config import Config, ConfigError
from inboxd.files import claim_area, instances, renames
from inboxd.files.crash_ledger import CRASHES_BEFORE_FAILING, CrashLedger
from inboxd.files.durable import (
    TmpDir,
    json_bytes,
    move,
    output_mode,
    tmp_dir_in,
    unlink_quietly,
    walk_files,
    write_tmp,
)
from inboxd.files.instances import LOCK_WAIT_S
from inboxd.files.layout import PROCESSING_DIRNAME, TMP_DIRNAME, processing_dir
from inboxd.files.names import fit_name, relative_inside
from inboxd.files.portable_names import filing_key
from inboxd.files.reading import READ_CLAIMED_FLAGS
from inboxd.files.renames import (
    name_variants,
    no_free_name,
    place_inside,
    rename_noreplace,
    time_token,
)
from inboxd.files.results import ResultFiles, sha_token
from inboxd.files.safe_paths import ForeignFolder, LinkedFolder, open_inside, split_rel

ERROR_SUFFIX = ".error.json"
# Errors that say the process is short of something for now, not that the file has a problem.
SHORT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
RELEASE_TRIES = 4
RELEASE_PAUSE_S = 0.05


class InstanceBusy(Exception):
    """Another live process holds this instance name on this inbox."""


def _open_claimed(name: str, folder: int | None) -> int:
    return os.open(name, READ_CLAIMED_FLAGS, dir_fd=folder)


def _say_moved_aside(inbox: Path, moved: list[claim_area.MovedAside]) -> None:
    for found in moved:
        logs.emit(logging.WARNING, "claim_area_moved",
                  f"{inbox / PROCESSING_DIRNAME} was {found.what} of uid {found.owner_uid}'s, "
                  f"not inboxd's own: renamed aside to {inbox / found.aside} (left as it is) "
                  "and made again. A member of the inbox's group can rename entries in it; "
                  "nothing was lost", inbox=str(inbox), owner_uid=found.owner_uid,
                  moved_aside=str(inbox / found.aside))


def _whose(found: claim_area.MovedAside) -> str:
    if found.aside.startswith(claim_area.FORMER_PREFIX):
        return found.what  # the daemon's own
    return f"{found.what} of uid {found.owner_uid}'s"


def _say_put_back(report: claim_area.PutBack) -> None:
    inbox = report.inbox
    where = report.moved_to or "a folder inboxd can no longer name"
    replaced = "; ".join(f"{_whose(found)} was in its place, renamed aside to "
                         f"{inbox / found.aside}" for found in report.moved_aside)
    logs.emit(logging.WARNING, "claim_area_moved",
              f"inboxd's claim area {inbox / PROCESSING_DIRNAME} was renamed away (to {where})"
              + (f"; {replaced}" if replaced else "")
              + f": made it again and took back its {report.taken_back} claimed entries by "
              "descriptor, so nothing in flight is lost"
              + (f" ({report.renamed} under a variant name, returned at the next start)"
                 if report.renamed else "")
              + ". A member of the inbox's group can rename entries in it",
              inbox=str(inbox), moved_to=report.moved_to, taken_back=report.taken_back,
              owner_uid=",".join(str(f.owner_uid) for f in report.moved_aside),
              moved_aside=",".join(str(inbox / f.aside) for f in report.moved_aside))


class Lifecycle:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.results_dir = config.results_dir
        self.tmp_dir = tmp_dir_in(config.results_dir, config.instance).path
        policy = config.inbox.after_success
        self.results = ResultFiles(config.results_dir, self.tmp_dir,
                                   config.done_dir if policy == "move" else None,
                                   replace_kept=policy == "keep")
        self._areas: dict[Path, claim_area.HeldArea] = {}  # by inbox, while locked
        # Putting an area back (the claim thread, the io thread) is done by one at a time.
        self._areas_lock = threading.Lock()
        self._put_backs = 0  # areas put back since start: a file met missing may have moved
        # Each inbox's processing folder as a str, made once: a claim's path is made from it.
        self._processing = {inbox: os.fspath(processing_dir(config, inbox))
                            for inbox in config.inbox.paths}
        # Per thread, inside ``walked_once``: claimed folders walked to by name, by (inbox, parts).
        self._walked = threading.local()
        self.max_file_bytes = config.preprocess.max_file_mb * 2**20
        self._done = os.fspath(config.done_dir)
        self._done_tmp = tmp_dir_in(config.done_dir, config.instance)
        self._failed_tmp = tmp_dir_in(config.failed_dir, config.instance)
        self.crash_ledger = CrashLedger(config)

    def processing_tmp(self, inbox: Path) -> TmpDir:
        """The temp folder on an inbox's filesystem, inside ``.processing/``: a folder the group
        can replace, so each part of it is checked to be ours."""
        return TmpDir(inbox, (PROCESSING_DIRNAME, TMP_DIRNAME, self.config.instance), own=True)

    def tmp_dir_of(self, folder: str) -> TmpDir:
        """Our temp folder in ``folder`` (an output, or an inbox's ``.processing``: then the
        one whose every part is checked to be ours), where a full folder is probed."""
        parent, name = os.path.split(os.fspath(folder))
        if name == PROCESSING_DIRNAME:
            return self.processing_tmp(Path(parent))
        return tmp_dir_in(Path(folder), self.config.instance)

    def tmp_dirs(self) -> list[TmpDir]:
        """Our temp folders, on the filesystem of each destination (emptied at start-up)."""
        return [tmp_dir_in(self.results_dir, self.config.instance), self._failed_tmp,
                self._done_tmp, *(self.processing_tmp(inbox) for inbox in self.config.inbox.paths)]

    def lock_instance(self) -> None:
        """Hold this instance's claim area in every inbox while we run
        (``files.claim_area``): ``<inbox>/.processing/<instance>/`` by descriptor, and
        ``<instance>.lock`` beside it. Two live daemons with one instance name would each
        "recover" the other's claimed files; ``recover`` on a running instance would pull files
        from under it. The kernel drops the lock when we die, however we die, so a SIGKILLed
        instance never blocks its own restart; another instance that found it free may hold it
        for a moment while it returns our files (``files.takeover``), which is why we wait up
        to ``LOCK_WAIT_S`` before calling the name busy. Whatever a member of the inbox's group
        put at ``.processing`` is renamed aside, and a fresh one made."""
        if self._areas:
            return
        for inbox in self.config.inbox.paths:
            inbox.mkdir(parents=True, exist_ok=True)  # the configured folder: trusted
            try:
                area, moved = claim_area.open_area(inbox, self.config.instance,
                                                    lock_wait_s=LOCK_WAIT_S)
            except claim_area.LockHeld as held:
                self.unlock_instance()
                raise InstanceBusy(
                    f"instance {self.config.instance!r} is already running on {inbox} "
                    f"(pid {held.args[0]}); give each daemon on a shared inbox its own "
                    "--instance") from None
            except LinkedFolder as exc:  # <instance> inside our own folder: not ours either
                self.unlock_instance()
                raise ConfigError(str(inbox), [
                    f"{inbox / PROCESSING_DIRNAME}: {exc.strerror}. inboxd keeps the files it "
                    "works on there and never uses one it does not own"]) from None
            except OSError as exc:  # read-only, full: start-up says so (inbox_unusable)
                self.unlock_instance()
                # Opened relative to a descriptor: name the whole path, so the message says
                # which inbox.
                if isinstance(exc.filename, str) and not os.path.isabs(exc.filename):
                    exc.filename = str(inbox / PROCESSING_DIRNAME / exc.filename)
                raise
            self._areas[inbox] = area
            if moved:
                _say_moved_aside(inbox, moved)

    def lock_fds(self) -> list[int]:
        """The descriptors holding our instance locks (a helper that inherits them keeps the
        instance busy until it has gone too)."""
        return [area.lock for area in self._areas.values()]

    def unlock_instance(self) -> None:
        with self._areas_lock:
            for area in self._areas.values():
                area.close()
            self._areas.clear()

    def ensure_claim_areas(self) -> int:
        """Put back every claim area whose name a member of the group moved or replaced
        (``claim_area.put_back``), saying so once each; returns how many were put back. Cheap
        when nothing moved (one ``lstat`` per inbox): called before each claim and every
        ``AREA_CHECK_S``."""
        put = 0
        for inbox in list(self._areas):
            with self._areas_lock:
                before = self._areas.get(inbox)
                put += self._put_back(inbox) is not before
        return put

    @contextlib.contextmanager
    def _claim_area(self, inbox: Path) -> Iterator[claim_area.HeldArea | None]:
        """The area held for ``inbox``, put back first if its name moved, and not put back
        (its descriptors not closed) while the caller uses it; None when none is held (not
        locked: a command that walks by name)."""
        with self._areas_lock:
            yield self._put_back(inbox)

    def _put_back(self, inbox: Path) -> claim_area.HeldArea | None:
        """With ``_areas_lock`` held: ``_claim_area``'s area (the held one if it cannot be put
        back now: claims still go into it, and the next check tries again)."""
        held = self._areas.get(inbox)
        if held is None or not claim_area.name_moved(inbox, held):
            return held
        try:
            fresh, report = claim_area.put_back(inbox, self.config.instance, held)
        except (OSError, claim_area.LockHeld) as exc:
            logs.emit(logging.ERROR, "claim_area_moved", f"{inbox / PROCESSING_DIRNAME} is "
                      "not inboxd's claim area any more and cannot be made again now: "
                      f"{exc!r}; claims go on into the folder inboxd holds, and it tries again",
                      inbox=str(inbox), error=repr(exc))
            return held
        self._areas[inbox] = fresh
        self._put_backs += 1
        if report is not None:
            _say_put_back(report)
        return fresh

    def prepare(self) -> list[str]:
        """Create every folder, and drop temp files a killed run of this instance left.

        An output folder that cannot be created now (a read-only or full disk) is not fatal:
        the files wait in the inbox, and writing retries (and creates it) later. Temp files
        are only removed from a temp folder that is ours (made by us, not a link: one planted
        in place of ``.processing/.tmp/<instance>`` could point at done/). Returns what could
        not be prepared, for the log."""
        for inbox in self.config.inbox.paths:
            with open_inside(inbox, [PROCESSING_DIRNAME, self.config.instance], create=True,
                             own=True):
                pass
        problems = []
        for folder in (self.config.results_dir, self.config.done_dir, self.config.failed_dir):
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                problems.append(f"{folder}: {exc.strerror or exc}")
        for tmp_dir in self.tmp_dirs():  # made when first needed; emptied here if there
            try:
                with open_inside(tmp_dir.root, tmp_dir.parts, own=True) as fd:
                    for leftover in os.listdir(fd):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(leftover, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                problems.append(f"{tmp_dir.path}: {exc.strerror or exc}; not emptied")
        return problems

    # -- claiming ----------------------------------------------------------------------------

    def claim(self, inbox: Path, rel: str) -> str | None:
        """Take ``inbox/rel`` by renaming it into our processing folder, under its own name or,
        when an earlier file of that name is still in flight, a free variant of it. None: it
        was already gone (another instance claimed it, or its writer removed it).

        The source's folders are opened without following links: a linked folder inside the
        inbox would otherwise let the rename take a file from outside it (``OSError`` ELOOP).
        """
        parts = rel.split("/")
        with self._claim_area(inbox) as area, open_inside(inbox, parts[:-1]) as source_dir:
            try:
                if area is None:  # not locked (a test, a command): walked from the inbox
                    placed = place_inside(parts[-1], source_dir, inbox,
                                          f"{PROCESSING_DIRNAME}/{self.config.instance}/{rel}",
                                          time_token(), own=True)
                    return os.path.join(inbox, placed)
                if claim_area.identity(os.fstat(source_dir)) == area.folder_identity:
                    return None  # our own area, renamed into sight since the check above
                # Into the folder we hold, whatever its name is now: the group can rename
                # .processing away and put a folder of links in its place.
                placed = place_inside(parts[-1], source_dir, area.folder, rel, time_token(),
                                      own=True)
            except FileNotFoundError:
                return None
        where = self._processing.get(inbox) or os.fspath(processing_dir(self.config, inbox))
        return os.path.join(where, placed)

    def release(self, claimed: str | Path, inbox_path: str | Path) -> str | None:
        """Hand a claimed file back to the inbox, where a later scan finds it again (under a
        free variant of its name if a new file took it meanwhile), never through a folder
        swapped for a link since the claim: then it stays claimed (None, as if gone). On
        strs: with after_success: keep, every success ends here."""
        where = os.fspath(inbox_path)
        inbox: str | Path
        for inbox in self.config.inbox.paths:
            rel = relative_inside(where, inbox)
            if rel is not None:
                break
        else:
            inbox, rel = os.path.split(where)
        for attempt in range(RELEASE_TRIES):
            put_backs = self._put_backs
            try:
                with self.claimed_file(claimed) as (folder, name):
                    placed = place_inside(name, folder, inbox, rel, time_token())
            except FileNotFoundError:
                if self._put_backs != put_backs:
                    continue  # moved into a fresh area as it was handed back: there now
                return None
            except LinkedFolder:
                return None
            except OSError as exc:
                if exc.errno not in SHORT_OF_RESOURCES:
                    raise
                # Out of descriptors or memory for now (another process's doing, often): a
                # moment later it usually works; if not, the file stays claimed, and the next
                # start returns it. Raising would crash the stage and count against the file.
                time.sleep(RELEASE_PAUSE_S * 2**attempt)
                continue
            return os.path.join(inbox, placed)
        return None

    @contextlib.contextmanager
    def claimed_file(self, claimed: str | Path) -> Iterator[tuple[int | None, str]]:
        """A claimed file as (its folder's descriptor, its name), the folder walked from its
        inbox and checked to be ours: the group can swap ``.processing`` for a folder of links
        to files elsewhere, and a move by path would take one of those. A path that is not in
        a ``.processing/`` (a takeover's ``/proc/self/fd/N/name``) is used as it is."""
        path = os.fspath(claimed)
        for inbox in self.config.inbox.paths:
            rel = relative_inside(path, inbox)
            if rel is not None and rel.startswith(PROCESSING_DIRNAME + "/"):
                folders, name = split_rel(rel)
                folder = self._open_claimed_folder(inbox, folders)
                try:
                    yield folder, name
                finally:
                    os.close(folder)
                return
        yield None, path

    def open_claimed(self, claimed: str | Path) -> int:
        """A claimed file opened for reading (not following a link, not blocking on a FIFO),
        for a decode worker to reopen through ``/proc``: in the area held, by descriptor,
        with the area not put back meanwhile (putting it back moves every claimed file out of
        the folder held). A member moving ``.processing`` every few ms cannot make this fail
        for a file that is claimed. Reached as ``claimed_file`` reaches it otherwise."""
        path = os.fspath(claimed)
        for inbox in self.config.inbox.paths:
            rel = relative_inside(path, inbox)
            if rel is None or not rel.startswith(PROCESSING_DIRNAME + "/"):
                continue
            folders, file_name = split_rel(rel)
            # Putting the area back when its name moved is the claims' part (and
            # AREA_CHECK_S's): one lstat a file fewer here.
            opened = self._in_held_area(inbox, folders,
                                        functools.partial(_open_claimed, file_name),
                                        put_back=False)
            if opened is not None:
                return opened
        with self.claimed_file(claimed) as (folder, name):
            return _open_claimed(name, folder)

    def _in_held_area(self, inbox: Path, folders: list[str], use: Callable[[int], int],
                      put_back: bool = True) -> int | None:
        """``use`` of a claimed file's folder in the area held, reached by the area's
        descriptor and under its lock (so it is not put back meanwhile), the area put back
        first if its name moved (``put_back``); None where no area is held (a command) or the
        folder is not in it."""
        with self._claim_area(inbox) if put_back else self._area_as_held(inbox) as area:
            if area is None or folders[:2] != [PROCESSING_DIRNAME, self.config.instance]:
                return None
            if len(folders) == 2:  # at the area's top: no folder to walk or check
                return use(area.folder)
            with open_inside(area.folder, folders[2:], own=True) as folder:
                return use(folder)

    @contextlib.contextmanager
    def _area_as_held(self, inbox: Path) -> Iterator[claim_area.HeldArea | None]:
        """``_claim_area`` without looking at the area's name first."""
        with self._areas_lock:
            yield self._areas.get(inbox)

    @contextlib.contextmanager
    def walked_once(self) -> Iterator[None]:
        """Inside, in this thread: a claimed file's folder walked to by name (no area held:
        the commit process, a command) is walked once and held, not walked again for each
        file and step of a group commit (about ten syscalls a walk, two walks a file). What
        the walk checked holds for the folder held: a folder swapped in at the name later is
        not the one used. At most one descriptor per folder of the batch, closed on leaving."""
        held: dict[tuple[str, tuple[str, ...]], int] = {}
        self._walked.folders = held
        try:
            yield
        finally:
            self._walked.folders = None
            for fd in held.values():
                os.close(fd)

    def _open_claimed_folder(self, inbox: Path, folders: list[str]) -> int:
        """The folder of a claimed file, checked to be ours: under the area held, reached by
        its descriptor (a member of the group can move the area's name every few ms, and a
        walk by name in between meets their link or folder); walked from ``inbox`` when no
        area is held (a command; once per folder inside ``walked_once``)."""
        in_area = self._in_held_area(inbox, folders, os.dup)
        if in_area is not None:
            return in_area
        held: dict[tuple[str, tuple[str, ...]], int] | None = getattr(self._walked, "folders",
                                                                       None)
        key = (os.fspath(inbox), tuple(folders))
        if held is not None and key in held:
            return os.dup(held[key])
        try:
            with open_inside(inbox, folders, own=True) as folder:
                if held is not None:
                    held[key] = os.dup(folder)
                return os.dup(folder)
        except ForeignFolder:
            raise
        except LinkedFolder as exc:
            if folders[:1] != [PROCESSING_DIRNAME]:
                raise
            # A link or a file at ``.processing``: a member moved the area's name (the daemon
            # puts it back within AREA_CHECK_S), not a problem of this file's path for good.
            raise ForeignFolder(exc.errno, exc.strerror, exc.filename) from exc

    def source_mode(self, claimed: str | Path) -> int | None:
        """A claimed file's permission bits (what its result's mode follows: ``output_mode``),
        read through ``claimed_file``; None when it is gone."""
        try:
            with self.claimed_file(claimed) as (folder, name):
                return os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode & 0o7777
        except (OSError, LinkedFolder):
            return None

    def recover(self) -> tuple[int, int]:
        """Return every file this instance had claimed (after a crash) to its inbox — except
        one that was in flight at ``CRASHES_BEFORE_FAILING`` stage crashes: that one goes to
        failed/ with the crash's reason, so one file cannot crash-loop the service.
        Returns (returned, failed)."""
        returned = failed = 0
        for inbox in self.config.inbox.paths:
            processing = processing_dir(self.config, inbox)
            ledgers = self.crash_ledger.counts(inbox)
            for claimed in walk_files(processing):
                rel = claimed.relative_to(processing).as_posix()
                sha256 = self.sha256_of(claimed)
                crashes, reason = instances.crashes_of(ledgers, rel, sha256)
                # A durable result first: failing that file too would give it two outcomes.
                if self.finish_if_done(claimed, inbox, rel, sha256):
                    continue
                if crashes >= CRASHES_BEFORE_FAILING and self.fail_crasher(
                        claimed, inbox, rel, crashes, reason, self.config.instance):
                    failed += 1
                else:
                    self.release(claimed, inbox / rel)
                    returned += 1
        return returned, failed

    def sha256_of(self, claimed: Path) -> str:
        return instances.file_sha256(claimed, self.max_file_bytes)

    def finish_if_done(self, claimed: Path, inbox: Path, rel: str, sha256: str) -> bool:
        """Finish a claimed file whose result is durable (its holder died before the move):
        given back under a variant name (a new file took its own) it would be filed again.
        Found by sha256 under its name or the one before a claim's collision variant."""
        if self.config.inbox.after_success == "keep" or not sha256:  # keep: redone on purpose
            return False
        folder, slash, leaf = rel.rpartition("/")
        plain = renames.before_time_variant(leaf)
        try:
            for key in [rel] + ([folder + slash + plain] if plain else []):
                name = self.results.find(self.config.key_for(inbox, key), sha256)
                if name is not None:
                    # Its holder may have died before the folder's fsync.
                    self.results.make_durable(name)
                    self.finish_success(claimed, name, inbox / key, sha256)
                    return True
        except OSError:
            pass  # done/ full or read-only: given back, and decided again later
        return False

    def fail_crasher(self, claimed: Path, inbox: Path, rel: str, crashes: int,
                     reason: str, instance: str) -> bool:
        """failed/ for a file that was in flight at repeated crashes; False when failed/ cannot
        take it now (full, read-only): start-up must not die of that, the file goes back."""
        key = self.config.key_for(inbox, rel)
        try:
            self.finish_failure(claimed, key, {
                "source": key, "inbox": str(inbox), "rel": rel,
                "reason": f"the daemon crashed {crashes} times while this file was in flight: "
                          f"{reason}",
                "reason_class": "other", "permanent": True,
                "attempts": [reason] * crashes, "instance": instance})
        except OSError:
            return False
        return True

    # -- outcomes ----------------------------------------------------------------------------

    def finish_success(self, claimed: str | Path, name: str, inbox_path: str | Path,
                       sha256: str) -> str | None:
        """After the result is durable: move, delete or keep the source, per config. Returns
        where the photo is now (None: deleted, or not put back)."""
        policy = self.config.inbox.after_success
        if policy == "delete":
            with self.claimed_file(claimed) as (folder, leaf), \
                    contextlib.suppress(FileNotFoundError):
                os.unlink(leaf, dir_fd=folder)
            return None
        if policy == "move":
            with self.claimed_file(claimed) as (folder, leaf):
                return move(leaf, self._done, name, sha_token(sha256), self._done_tmp, folder)
        # keep: back where the user put it; intake skips files whose result describes them.
        return self.release(claimed, inbox_path)

    def finish_failure(self, claimed: str | Path | None, key: str,
                       report: dict[str, Any]) -> str:
        """``failed/<name>.error.json`` first, then the source under the same ``<name>``: never
        a failed file without why, never over an earlier failure. Returns ``<name>``. A key
        whose folder in failed/ is a file (``x.jpg/a.png`` after ``x.jpg`` failed: its report
        is ``x.jpg.error.json``, its file ``x.jpg``) is filed at the top of failed/ instead:
        its report says where it came from, which is all ``inboxd retry`` needs."""
        sha = report.get("sha256")
        token = sha_token(sha) if isinstance(sha, str) else time_token()
        mode = output_mode(None if claimed is None else self.source_mode(claimed))
        filing = filing_key(key, self._failed_tmp.path)
        report_as = _ReportAs(self._failed_tmp.path, report, mode, portable=filing != key)
        key = filing  # failed/'s filesystem cannot hold the name: its portable form
        try:
            # Written first: a full failed/ is met before anything moves (its folder is made).
            report_as.tmp_for(key)
            try:
                return self._file_failure(claimed, key, report_as, token)
            except LinkedFolder:
                if "/" not in key:
                    raise
                return self._file_failure(claimed, key.rpartition("/")[2], report_as, token)
        finally:
            report_as.discard()

    def _file_failure(self, claimed: str | Path | None, key: str, report_as: _ReportAs,
                      token: str) -> str:
        failed_dir = self.config.failed_dir
        folders, leaf = split_rel(key)
        folders = [fit_name(part, "") for part in folders]
        with open_inside(failed_dir, folders, create=True) as folder:
            for name in name_variants(fit_name(leaf, ""), token):
                variant = "/".join([*folders, name])
                if _lexists(name, folder):
                    continue
                report_name = fit_name(name, ERROR_SUFFIX)
                try:
                    rename_noreplace(report_as.tmp_for(variant), report_name, None, folder)
                except FileExistsError:
                    continue
                os.fsync(folder)
                if claimed is not None:
                    self._move_failed(claimed, folder, variant, report_name)
                return variant
        raise no_free_name(failed_dir / key)

    def _move_failed(self, claimed: str | Path, folder: int, variant: str,
                     report_name: str) -> None:
        walked = False
        try:
            with self.claimed_file(claimed) as (source_dir, source):
                walked = True
                if not _lexists(source, source_dir):
                    return  # gone (a report for a file only: fail_crasher's, or a lost one)
                try:
                    rename_noreplace(source, variant.rpartition("/")[2], source_dir, folder)
                except OSError as exc:
                    if exc.errno != errno.EXDEV:
                        raise
                    move(source, self.config.failed_dir, variant, "x", self._failed_tmp,
                         source_dir)
        except OSError as exc:
            if not walked and isinstance(exc, FileNotFoundError):
                return  # its folder is gone, and the file with it: the report stands alone
            # The report is out but the source could not follow (a file appeared under that
            # very name since the check): take the report back, so there is one outcome only.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(report_name, dir_fd=folder)
            raise


class _ReportAs:
    """A failure's report, in a temp file ready to be renamed in under the name its file is
    filed as. A name failed/'s filesystem cannot hold is filed under its portable form, and
    the report says which (``filed_as``): the variant actually taken, never the form a real
    file of that very name (``a%3F.jpg`` beside ``a?.jpg``) already holds."""

    def __init__(self, tmp_dir: Path, report: dict[str, Any], mode: int,
                 portable: bool) -> None:
        self.tmp_dir, self.report, self.mode, self.portable = tmp_dir, report, mode, portable
        self._tmp: str | None = None
        self._written_for: str | None = None

    def tmp_for(self, variant: str) -> str:
        if self._tmp is not None and (not self.portable or self._written_for == variant):
            return self._tmp
        self.discard()
        report = {**self.report, "filed_as": variant} if self.portable else self.report
        self._tmp = write_tmp(self.tmp_dir, json_bytes(report), ERROR_SUFFIX, self.mode)
        self._written_for = variant
        return self._tmp

    def discard(self) -> None:
        if self._tmp is not None:
            unlink_quietly(self._tmp)
            self._tmp = None


def _lexists(name: str, folder: int | None) -> bool:
    try:
        os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
