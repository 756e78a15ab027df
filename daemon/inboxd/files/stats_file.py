"""The daemon's own copy of its stats records, for ``inboxd stats -c FILE`` and ``inboxd report
-c FILE`` where there is no journal to read (a daemon run in the foreground, a container).

One JSON object a line, in ``<results_dir>/../state/<instance>.stats.jsonl`` (beside the default
cache folder: under /var/lib/inboxd with the shipped layout, which the unit may write). Each
record says whose it is (instance, pid, the config file), so a reader never shows another
daemon's record as this one's. Bounded: past ``MAX_BYTES`` the file becomes ``.1`` (the one
before that is dropped), so a long-running daemon holds at most twice that.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from inboxd import logs
from inboxd.config import Config

MAX_BYTES = 8 << 20
SUFFIX = ".stats.jsonl"


def stats_path(config: Config) -> Path:
    return config.results_dir.parent / "state" / f"{config.instance}{SUFFIX}"


class StatsFile:
    def __init__(self, config: Config, config_file: Path | None = None) -> None:
        self.path = stats_path(config)
        self.whose = {"INSTANCE": config.instance, "PID": os.getpid(),
                      "CONFIG": os.fsdecode(config_file) if config_file else None}
        self._failing = False

    def append(self, fields: dict[str, Any]) -> None:
        record = {"TIME": datetime.now(UTC).isoformat(timespec="milliseconds"),
                  **self.whose, **fields}
        line = (json.dumps(record, default=str) + "\n").encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                if self.path.stat().st_size + len(line) > MAX_BYTES:
                    os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            except FileNotFoundError:
                pass
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                         | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, line)  # one write of one line: readers never see half of one
            finally:
                os.close(fd)
        except OSError as exc:
            if not self._failing:  # said once, not at every record: the journal has them
                logs.emit(logging.WARNING, "stats", f"cannot keep the stats file {self.path}: "
                          f"{exc.strerror or exc}; inboxd stats -c reads the journal only")
            self._failing = True
        else:
            self._failing = False


def records(path: Path, start: datetime | None = None) -> Iterator[dict[str, Any]]:
    """The records of a stats file (its older part first), TIME as a local datetime."""
    for part in (path.with_name(path.name + ".1"), path):
        try:
            with open(part, "rb") as file:
                lines = file.readlines()
        except FileNotFoundError:
            continue
        for line in lines:
            try:
                record = json.loads(line)
                when = datetime.fromisoformat(record["TIME"]).astimezone().replace(tzinfo=None)
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a full disk
            if start is None or when >= start:
                record["TIME"] = when
                yield record


def running(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError):
        return False
    return True


def age_s(record: dict[str, Any]) -> float:
    when = record.get("TIME")
    return time.time() - when.timestamp() if isinstance(when, datetime) else float("inf")
