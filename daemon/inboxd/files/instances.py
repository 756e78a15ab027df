"""What the instances sharing an inbox keep in ``<inbox>/.processing/``, next to their claimed
files: ``<instance>.lock`` (an ``flock`` held while the instance runs, released by the kernel
however it dies) and ``<instance>.crashes.json`` (its crash ledger: which claimed files were
in flight at its stage crashes in a row)."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

LOCK_SUFFIX = ".lock"
LEDGER_SUFFIX = ".crashes.json"
# How long taking an instance's lock waits for its holder before giving up: another instance
# holds a dead one's lock for a moment while it returns its claimed files (``files.takeover``),
# and the dead one restarting then must wait, not refuse to start.
LOCK_WAIT_S = 5.0
LOCK_RETRY_S = 0.05


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


def read_ledger(path: Path) -> dict[str, tuple[int, str]]:
    """One instance's ledger: claimed name → (crashes in a row, the last crash's reason)."""
    try:
        data = json.loads(path.read_bytes())
        return {rel: (int(n), str(why)) for rel, (n, why) in data.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def merged_ledgers(folder: Path) -> dict[str, tuple[int, str]]:
    """Every instance's ledger in ``folder`` (a ``.processing/``), the highest count per name.

    A file a takeover returned to the inbox can next be claimed by any instance: its count
    must follow it there, or a file that kills whichever instance takes it would go round a
    shared inbox for ever. Each ledger is written only by its own instance, or by whoever
    holds that instance's lock, always by an atomic replace: reading them needs no lock."""
    merged: dict[str, tuple[int, str]] = {}
    try:
        names = sorted(n for n in os.listdir(folder)
                       if n.endswith(LEDGER_SUFFIX) and not n.startswith("."))
    except OSError:
        return merged
    for name in names:
        for rel, (n, why) in read_ledger(folder / name).items():
            if n > merged.get(rel, (0, ""))[0]:
                merged[rel] = (n, why)
    return merged
