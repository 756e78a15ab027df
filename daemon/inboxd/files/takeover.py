"""Returning a dead instance's claimed files to a shared inbox, without waiting for a person.

Every instance holds ``.processing/<name>.lock`` (an ``flock``) while it runs, and the kernel
releases it when the holder dies, however it dies. So an instance that can take another's lock
knows that one is dead, and while it holds the lock nobody else can be it: the dead instance's
restart waits for it (``instances.LOCK_WAIT_S``), ``inboxd recover`` and every other instance's
takeover are shut out. Holding it, the taker returns each claimed file to the inbox under its
own name (a free variant if the name was taken meanwhile, never replacing anything), or sends
one that was in flight at ``CRASHES_BEFORE_FAILING`` stage crashes to failed/ (counts are
read from every instance's ledger, for these bytes: ``instances.crashes_of``), finishes one
whose result is already durable, removes the emptied folder, and lets the lock go. The lock
file itself stays: unlinking a lock file someone may have open lets two processes both
"hold" it.

Never touched: a live instance (its lock is held; we never wait for it), a folder without a
lock file (a version before locks, or a lock someone deleted: its holder may still be running
and a new lock file would prove nothing; reported, for ``inboxd recover --instance NAME``),
and anything that is a symbolic link — ``.processing`` itself, ``<name>.lock``, ``<name>/`` or
a folder inside it: all are opened with ``O_NOFOLLOW`` relative to their parent's descriptor.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from inboxd.files.claim_area import moved_areas, remove_emptied
from inboxd.files.crash_ledger import CRASHES_BEFORE_FAILING
from inboxd.files.instances import LEDGER_SUFFIX, LOCK_SUFFIX, Ledger, crashes_of, read_ledger
from inboxd.files.layout import PROCESSING_DIRNAME
from inboxd.files.lifecycle import Lifecycle
from inboxd.files.renames import place_inside, time_token
from inboxd.files.safe_paths import DIR_FLAGS, LinkedFolder, open_inside


@dataclass
class TakenOver:
    """One dead instance's claimed files on one inbox, handled."""

    inbox: Path
    instance: str
    returned: list[str] = field(default_factory=list)  # names under the inbox
    failed: int = 0
    finished: int = 0  # result already durable (it died before the move): moved on, not back


@dataclass
class Sweep:
    taken: list[TakenOver] = field(default_factory=list)
    # (path, why) left alone: a folder without a lock file, a link in place of a lock or folder.
    refused: list[tuple[str, str]] = field(default_factory=list)


def take_over_dead(lifecycle: Lifecycle, only: str | None = None) -> Sweep:
    """Look at every other instance's folder in every inbox; take over the dead ones. And
    every instance's folder in a former claim area a member of the group renamed away
    (``claim_area.moved_areas``), ours too: its lock is free once whoever held it died or
    put its area back. ``only``: that instance's folders only (``inboxd recover``)."""
    sweep = Sweep()
    own = lifecycle.config.instance
    for inbox in lifecycle.config.inbox.paths:
        if only is None:
            try:
                with open_inside(inbox, [PROCESSING_DIRNAME], own=True) as processing:
                    _take_over_in(lifecycle, inbox, processing, PROCESSING_DIRNAME,
                                  _other_instances(processing, own, inbox / PROCESSING_DIRNAME,
                                                   sweep), sweep)
            except LinkedFolder as exc:  # a link, or not ours (the group can make its own)
                sweep.refused.append((str(inbox / PROCESSING_DIRNAME),
                                      exc.strerror or str(exc)))
            except FileNotFoundError:
                pass
        with moved_areas(inbox) as areas:
            for area_name, area in areas:
                names = _other_instances(area, "", inbox / area_name, sweep)
                _take_over_in(lifecycle, inbox, area, area_name,
                              [n for n in names if only is None or n == only], sweep)
                remove_emptied(inbox, area_name, area)
    return sweep


def _take_over_in(lifecycle: Lifecycle, inbox: Path, processing: int, area_name: str,
                  names: list[str], sweep: Sweep) -> None:
    for name in names:
        try:
            _take_over_one(lifecycle, inbox, processing, name, sweep, area_name)
        except OSError as exc:  # that instance's problem: the others still go
            sweep.refused.append((str(inbox / area_name / name),
                                  f"cannot take it over now: {exc}"))


def _other_instances(processing: int, own: str, where: Path, sweep: Sweep) -> list[str]:
    """Names of the real folders in ``.processing`` other than ours (``.tmp`` and other hidden
    names are never an instance's: instance names cannot start with a dot). A link where a
    folder could be is reported, never followed."""
    names = []
    for name in sorted(os.listdir(processing)):
        if name == own or name.startswith("."):
            continue
        try:
            mode = os.stat(name, dir_fd=processing, follow_symlinks=False).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(mode):
            names.append(name)
        elif stat.S_ISLNK(mode) and not name.endswith((LOCK_SUFFIX, LEDGER_SUFFIX)):
            sweep.refused.append((str(where / name), "a symbolic link, not a folder"))
    return names


def _take_over_one(lifecycle: Lifecycle, inbox: Path, processing: int, name: str,
                   sweep: Sweep, area_name: str = PROCESSING_DIRNAME) -> None:
    where = inbox / area_name
    try:
        lock = os.open(name + LOCK_SUFFIX, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                       dir_fd=processing)
    except FileNotFoundError:
        sweep.refused.append((str(where / name), f"no {name}{LOCK_SUFFIX} beside it: its "
                              "instance may still be running (a version before locks, or "
                              "its lock deleted); once it is not, run inboxd recover "
                              f"--instance {name}"))
        return
    except OSError as exc:  # a folder, a socket, a file we may not open: not a lock of ours
        why = ("a symbolic link, not a lock" if exc.errno == errno.ELOOP
               else f"not a lock we can take: {exc.strerror or exc}")
        sweep.refused.append((str(where / (name + LOCK_SUFFIX)), why))
        return
    try:
        if not stat.S_ISREG(os.fstat(lock).st_mode):
            sweep.refused.append((str(where / (name + LOCK_SUFFIX)), "not a regular file"))
            return
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # alive: its files are its own
        try:
            folder = os.open(name, DIR_FLAGS, dir_fd=processing)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                sweep.refused.append((str(where / name), "a symbolic link, not a folder"))
                return
            if exc.errno == errno.ENOENT:
                return
            raise
        taken = TakenOver(inbox, name)
        try:
            _return_all(lifecycle, inbox, name, folder, taken, sweep,
                        None if area_name == PROCESSING_DIRNAME else processing)
        finally:
            os.close(folder)
            # Counted and said even when we stopped part-way.
            if taken.returned or taken.failed or taken.finished:
                sweep.taken.append(taken)
        with contextlib.suppress(OSError):  # not empty (a file could not go back): next time
            os.rmdir(name, dir_fd=processing)
    finally:
        os.close(lock)  # releases the lock: the dead instance may start again now


@dataclass
class _Walk:
    lifecycle: Lifecycle
    inbox: Path
    instance: str
    counts: list[Ledger]
    taken: TakenOver
    sweep: Sweep
    still_counted: dict[str, list[object]] = field(default_factory=dict)


def _return_all(lifecycle: Lifecycle, inbox: Path, instance: str, top: int,
                taken: TakenOver, sweep: Sweep, moved_area: int | None = None) -> None:
    """Every file under the folder ``top`` back to the inbox (or failed/), folders emptied and
    removed bottom-up. ``moved_area``: ``top`` is in a former claim area (that descriptor),
    whose ledger counts too, and is left as it was (the name's owner in ``.processing`` may
    be alive)."""
    counts = lifecycle.crash_ledger.counts(inbox)
    if moved_area is not None:
        counts.append(read_ledger(instance + LEDGER_SUFFIX, moved_area))
    walk = _Walk(lifecycle, inbox, instance, counts, taken, sweep)
    if moved_area is not None:
        _walk_back(walk, top)
        return
    ledger_path = lifecycle.crash_ledger.path(inbox, instance)
    walked = False
    try:
        _walk_back(walk, top)
        walked = True
    finally:
        # The dead instance's ledger now holds only the files it gave back with a count: they
        # keep it wherever they are claimed next; the rest of it is history. Stopped part-way
        # (an error), the files still there keep theirs too: a crasher must not lose its count.
        known = {k: list(v) for k, v in read_ledger(ledger_path).items()}
        wanted = walk.still_counted if walked else {**known, **walk.still_counted}
        if known != wanted:
            lifecycle.crash_ledger.write(inbox, instance, wanted)


@contextlib.contextmanager
def _open_below(top: int, parts: tuple[str, ...]) -> Iterator[int]:
    """``top/parts…`` opened one part at a time without following links, holding two
    descriptors at most: a walk that kept one per level open would run out of them at a
    depth a recursive inbox allows (PATH_MAX: ~2000 levels), and starve every other thread."""
    fd = os.dup(top)
    try:
        for part in parts:
            child = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _walk_back(walk: _Walk, top: int) -> None:
    """Depth first and iterative (no nesting depth can exhaust the stack), folders named by
    their parts below ``top``, each opened again when needed (see ``_open_below``)."""
    stack: list[tuple[tuple[str, ...], bool]] = [((), False)]  # (folder, its files done)
    while stack:
        parts, expanded = stack.pop()
        if expanded:
            if parts:
                with _open_below(top, parts[:-1]) as parent, contextlib.suppress(OSError):
                    os.rmdir(parts[-1], dir_fd=parent)  # not empty: something stayed
            continue
        stack.append((parts, True))
        with _open_below(top, parts) as fd:
            for entry in sorted(os.listdir(fd), reverse=True):
                try:
                    mode = os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(mode):
                    stack.append(((*parts, entry), False))
                else:
                    _take_back(walk, fd, entry, "/".join((*parts, entry)))


def _take_back(walk: _Walk, fd: int, entry: str, rel: str) -> None:
    """One claimed file: on (its result is durable), to failed/ (a repeat crasher), or back."""
    claimed = Path(f"/proc/self/fd/{fd}") / entry
    sha256 = walk.lifecycle.sha256_of(claimed)
    crashes, reason = crashes_of(walk.counts, rel, sha256)
    if walk.lifecycle.finish_if_done(claimed, walk.inbox, rel, sha256):  # before failing it
        walk.taken.finished += 1
        return
    if crashes >= CRASHES_BEFORE_FAILING and walk.lifecycle.fail_crasher(
            claimed, walk.inbox, rel, crashes, reason, walk.instance):
        walk.taken.failed += 1
        return
    try:
        placed = _give_back(fd, entry, walk.inbox, rel)
    except LinkedFolder as exc:
        walk.sweep.refused.append((str(walk.inbox / rel), f"cannot go back: {exc.strerror}"))
        if crashes:
            walk.still_counted[rel] = [crashes, reason, sha256]  # still claimed under that name
        return
    if placed is not None:
        walk.taken.returned.append(placed)
        if crashes:
            walk.still_counted[placed] = [crashes, reason, sha256]


def _give_back(fd: int, entry: str, inbox: Path, rel: str) -> str | None:
    """``entry`` (in folder ``fd``) back to ``inbox/rel`` or a free variant of its name."""
    try:
        return place_inside(entry, fd, inbox, rel, time_token())
    except FileNotFoundError:
        return None
