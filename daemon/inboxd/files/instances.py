"""What the instances sharing an inbox keep in ``<inbox>/.processing/``, next to their claimed
files: ``<instance>.lock`` (an ``flock`` held while the instance runs, released by the kernel
however it dies) and ``<instance>.crashes.json`` (its crash ledger: which claimed files were
in flight at its stage crashes in a row)."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import time
from pathlib import Path

from inboxd.files.layout import PROCESSING_DIRNAME
from inboxd.files.reading import hash_stream, open_input
from inboxd.files.safe_paths import open_inside
from inboxd.item import PermanentError, TransientError

LOCK_SUFFIX = ".lock"
LEDGER_SUFFIX = ".crashes.json"
# How long taking an instance's lock waits for its holder before giving up: another instance
# holds a dead one's lock for a moment while it returns its claimed files (``files.takeover``),
# and the dead one restarting then must wait, not refuse to start.
LOCK_WAIT_S = 5.0
LOCK_RETRY_S = 0.05
# A ledger names what was in flight at a crash (a few batches): far below this. Cut short, a
# planted giant one is not valid JSON and counts nothing.
MAX_LEDGER_BYTES = 4 << 20


def flock_within(fd: int, wait_s: float) -> bool:
    """``flock(LOCK_EX)`` on ``fd``, retrying for ``wait_s``; False if another still holds it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(LOCK_RETRY_S)


# One instance's ledger: claimed name → (crashes in a row, the last crash's reason, the sha256
# of the bytes in flight then, "" when they could not be read).
Ledger = dict[str, tuple[int, str, str]]


def read_ledger(path: Path | str, dir_fd: int | None = None) -> Ledger:
    """One instance's ledger (an entry from before the sha256 was kept has an unknown one).

    Every instance reads every ledger beside it, so one planted there is read carefully: a
    link is not followed (it could name anything), a FIFO not waited on (start-up would block
    for ever), and no more than ``MAX_LEDGER_BYTES`` read (a link to /dev/zero never ends)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return {}
            data = json.loads(handle.read(MAX_LEDGER_BYTES))
        return {rel: (int(entry[0]), str(entry[1]), str(entry[2]) if len(entry) > 2 else "")
                for rel, entry in data.items()}
    except (OSError, ValueError, TypeError, AttributeError, IndexError, KeyError):
        return {}


def all_ledgers(inbox: Path) -> list[Ledger]:
    """Every instance's ledger in ``inbox``'s ``.processing/``.

    A file a takeover returned to the inbox can next be claimed by any instance: its count
    must follow it there, or a file that kills whichever instance takes it would go round a
    shared inbox for ever. Each ledger is written only by its own instance, or by whoever
    holds that instance's lock, always by an atomic replace: reading them needs no lock.
    ``.processing`` is opened checked to be ours: the group can swap it for a folder of its
    own, whose forged counts would fail another member's good photo as a crasher (and be
    copied into our own ledger at the next crash). Not ours: no counts (a file is never
    failed for counts nobody trustworthy wrote)."""
    try:
        with open_inside(inbox, [PROCESSING_DIRNAME], own=True) as folder:
            names = sorted(n for n in os.listdir(folder)
                           if n.endswith(LEDGER_SUFFIX) and not n.startswith("."))
            return [read_ledger(name, folder) for name in names]
    except OSError:  # LinkedFolder and ForeignFolder among them
        return []


def crashes_of(ledgers: list[Ledger], rel: str, sha256: str) -> tuple[int, str]:
    """The highest count any ledger has for *these bytes*: under any name (given back when its
    name was taken, a file comes back as a variant, and a crasher must not shed its count by
    that), and under ``rel`` only for the same bytes — names are reused (two cameras'
    IMG_0001.jpg), and a count other bytes left under it (a ledger is only rewritten at its
    own instance's next crash) must not fail a healthy file. Bytes unknown on either side:
    the name decides, erring towards failed/ rather than a crash loop."""
    best = (0, "")
    for ledger in ledgers:
        for name, (n, why, sha) in ledger.items():
            same = sha == sha256 if sha and sha256 else name == rel
            if n > best[0] and same:
                best = (n, why)
    return best


def file_sha256(path: Path, max_bytes: int) -> str:
    """The sha256 of a claimed regular file, "" when it cannot be read (a link, a FIFO, gone,
    larger than ``max_bytes``)."""
    try:
        with open_input(path, max_bytes) as handle:
            return hash_stream(handle)[0]
    except (OSError, PermanentError, TransientError):
        return ""
