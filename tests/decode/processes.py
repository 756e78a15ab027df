"""Watching processes from the outside, through /proc: is one alive, which are a daemon's
decode workers."""

from __future__ import annotations

from os import readlink as os_readlink
from pathlib import Path


def alive(pid: int) -> bool:
    """Running or sleeping, not gone and not a zombie (an orphan waits for a reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def decode_workers_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == pid and b"inboxd.decode.worker_child" in cmdline:
            found.append(int(entry.name))
    return found


def decode_workers_in(cwd: Path) -> list[int]:
    """Live decode workers whose working directory is ``cwd`` (they inherit the daemon's)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit()
                    and b"inboxd.decode.worker_child" in (entry / "cmdline").read_bytes()
                    and Path(os_readlink(entry / "cwd")) == cwd and alive(int(entry.name))):
                found.append(int(entry.name))
        except OSError:
            continue
    return found
