"""Names an output filesystem cannot hold, filed under a portable form of themselves
(``names.portable_key``).

A Linux inbox takes any name but ``/`` and NUL; an output on exFAT or FAT (a USB disk), or an
SMB share, refuses ``?``, ``:``, ``*``, ``"``, ``<``, ``>``, ``|``, ``\\``, control characters
and names that are not UTF-8 — each driver with its own errno (exfat-fuse even answers ENOENT).
That is a fact about the name at that destination, the same on every try: such a key is filed
under ``portable_key`` instead (each offending byte percent-encoded, ``%`` itself too, so
the form is deterministic and a re-drop finds its earlier result); the result or error
report keeps the original name (``source``) beside the one it is filed under (``filed_as``).

Only a key that differs from its portable form is looked at (a rare name), by making an empty
file of that name in the destination's temp folder: whether the filesystem holds it is then
known, not guessed from its type.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from inboxd.files.durable import ensure_dir, unlink_quietly
from inboxd.files.names import fit_name, portable_key
from inboxd.files.safe_paths import NAME_ERRNOS


def filing_key(key: str, tmp_dir: str | Path) -> str:
    """``key``, or its portable form when the filesystem of ``tmp_dir`` (a temp folder of the
    destination) cannot hold one of its parts. Other errors (a full disk) are raised."""
    portable = portable_key(key)
    if portable == key:
        return key
    ensure_dir(tmp_dir)
    parts = {fit_name(part, "") for part in key.split("/")}
    return key if all(_holds(tmp_dir, part) for part in parts) else portable


def _holds(folder: str | Path, name: str) -> bool:
    path = os.path.join(folder, name)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except FileExistsError:
        return True  # a probe of ours a kill left (emptied at start-up)
    except OSError as exc:
        # ENOENT in a folder that is there: exfat-fuse's way of refusing a character.
        if exc.errno in NAME_ERRNOS or exc.errno == errno.ENOENT:
            return False
        raise
    os.close(fd)
    unlink_quietly(path)
    return True
