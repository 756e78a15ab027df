"""``inboxd stats`` and ``inboxd report``: the journal's stats records, read back.

Every ``stats`` record carries every counter and every layer's size, capacity and high-water
mark as journal fields, so the journal alone is enough to see backpressure at work: the queue
pinned at its capacity while the backlog waits on disk, memory flat.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pwd
import re
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from inboxd.config import Config
from inboxd.files import stats_file
from inboxd.stats import COUNTER_FIELDS, DEPRECATED_LAYER_NAMES, FIELDS, OTHER_FIELDS, declared

# What ``inboxd stats`` shows, in this order, derived from the record's declaration.
COUNTERS = tuple(f.name for f in COUNTER_FIELDS)
FIGURES = tuple(f.name for f in OTHER_FIELDS)
SERVICE_USER = "inboxd"  # the shipped unit's User=
FOLLOW_POLL_S = 1.0
WHO_FIELDS = ("_PID", "_UID", "_SYSTEMD_UNIT")  # journald's, from the sender's credentials
MEMORY = ("RSS_BYTES", "CUDA_ALLOCATED_BYTES", "CUDA_RESERVED_BYTES", "CUDA_PEAK_ALLOCATED_BYTES")


def _journal() -> Any:
    # The repo's systemd/ folder (unit files) would shadow the package for type checkers.
    return importlib.import_module("systemd.journal")


def trusted_uids() -> list[int]:
    """Who may have written the daemon's records: root, the ``inboxd`` service user, and the
    user asking (a daemon run from their own terminal). ``_UID`` is set by journald from the
    sender's credentials; ``SYSLOG_IDENTIFIER`` and ``INBOXD_EVENT`` are the sender's own
    words, which any local user can send."""
    uids = {0, os.getuid()}
    with contextlib.suppress(KeyError):  # no such user here: the daemon runs as another
        uids.add(pwd.getpwnam(SERVICE_USER).pw_uid)
    return sorted(uids)


def stats_reader(unit: str | None, instance: str | None) -> Any:
    journal = _journal()
    reader = journal.Reader()
    reader.this_boot()
    reader.add_match(INBOXD_EVENT="stats")
    if unit:  # _SYSTEMD_UNIT is journald's, from the sender's cgroup: a system unit's
        reader.add_match(_SYSTEMD_UNIT=unit if "." in unit else f"{unit}.service")
    else:
        reader.add_match(SYSLOG_IDENTIFIER="inboxd")
        for uid in trusted_uids():  # matches on one field are ORed, on different ones ANDed
            reader.add_match(_UID=str(uid))
    if instance:
        reader.add_match(INSTANCE=instance)
    return reader


def clean(entry: dict[str, Any]) -> dict[str, Any]:
    """Journal entry → the daemon's own fields, numbers as numbers (and who sent it)."""
    fields: dict[str, Any] = {key: entry[key] for key in WHO_FIELDS if key in entry}
    for key, value in entry.items():
        if key.startswith("_") or key in ("MESSAGE", "PRIORITY", "SYSLOG_IDENTIFIER",
                                           "CODE_FILE", "CODE_LINE", "CODE_FUNC"):
            continue
        name = key.removeprefix("INBOXD_")
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        if isinstance(value, str) and re.fullmatch(r"-?\d+(\.\d+)?", value):
            value = float(value) if "." in value else int(value)
        fields[name] = value
    if "__REALTIME_TIMESTAMP" in entry:
        fields["TIME"] = entry["__REALTIME_TIMESTAMP"]
    return fields


class JournalRecords:
    """The stats records of this boot's journal: one unit's, or (no unit) those a trusted user's
    inboxd sent; of one instance, or of every one."""

    def __init__(self, unit: str | None, instance: str | None) -> None:
        self.unit, self.instance = unit, instance
        self.where = "the journal"

    def latest(self) -> dict[str, Any] | None:
        reader = stats_reader(self.unit, self.instance)
        reader.seek_tail()
        entry = reader.get_previous()
        return clean(entry) if entry else None

    def since(self, start: datetime | None) -> Iterator[dict[str, Any]]:
        reader = stats_reader(self.unit, self.instance)
        if start is not None:
            reader.seek_realtime(start)
        for entry in reader:
            yield clean(entry)

    def following(self) -> Iterator[dict[str, Any]]:
        """Each record after the latest, as it comes; never ends."""
        reader = stats_reader(self.unit, self.instance)
        reader.seek_tail()
        reader.get_previous()
        while True:
            reader.wait()
            for entry in reader:
                yield clean(entry)

    def none_found(self, command: str) -> str:
        where = f"unit {self.unit}" if self.unit else "SYSLOG_IDENTIFIER=inboxd"
        return (f"no stats record in this boot's journal for {where}; for a daemon run in the "
                f"foreground, give its config: inboxd {command} -c FILE")


class FileRecords:
    """The stats records ``config``'s daemon keeps in its own file (``files.stats_file``)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.path = stats_file.stats_path(config)
        self.where = str(self.path)

    def latest(self) -> dict[str, Any] | None:
        seen = list(stats_file.records(self.path))
        return seen[-1] if seen else None

    def since(self, start: datetime | None) -> Iterator[dict[str, Any]]:
        return stats_file.records(self.path, start)

    def following(self) -> Iterator[dict[str, Any]]:
        """Each record after the latest, as it comes; never ends."""
        latest = self.latest()
        last = latest["TIME"] if latest else datetime.min
        while True:
            time.sleep(FOLLOW_POLL_S)
            for record in stats_file.records(self.path):
                if record["TIME"] > last:
                    yield record
                    last = record["TIME"]

    def none_found(self, command: str) -> str:
        return (f"no stats record in {self.path} (instance {self.config.instance}): has the "
                "daemon of this config run yet?")


def records_of(unit: str | None, instance: str | None,
               config: Config | None) -> JournalRecords | FileRecords:
    """Where the records are read from: the file of ``config``'s daemon when a config is given
    (a daemon run in the foreground), else the journal."""
    return FileRecords(config) if config is not None else JournalRecords(unit, instance)


def format_table(stats: dict[str, Any]) -> str:
    def num(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:,.2f}"
        return f"{value:,}" if isinstance(value, int) else str(value)

    when = stats.get("TIME")
    lines = [f"inboxd stats ({whose(stats)}"
             + (f", {when:%Y-%m-%d %H:%M:%S}" if isinstance(when, datetime) else "") + ")", ""]
    counters = [f"{c.lower()} {num(stats.get(c, 0))}" for c in COUNTERS]
    for start in range(0, len(counters), 6):  # six a line: a terminal's width
        lines.append(("counters   " if not start else " " * 11)
                     + "  ".join(counters[start:start + 6]))
    lines += ["", f"{'layer':<18}{'size':>8}{'capacity':>10}{'high-water':>12}"]
    for layer in layers_of(stats):
        lines.append(f"{layer.lower():<18}{num(stats.get(f'{layer}_SIZE', 0)):>8}"
                     f"{num(stats[f'{layer}_CAPACITY']):>10}"
                     f"{num(stats.get(f'{layer}_HIGH_WATER', 0)):>12}")
    lines.append("")
    for key in FIGURES:
        if key in stats:
            value = stats[key]
            shown = (f"{value / 2**20:,.1f} MiB" if FIELDS[key].unit == "bytes"
                     and isinstance(value, int | float) else num(value))
            lines.append(f"{key.lower():<34}{shown:>14}")
    return "\n".join(lines)


def whose(stats: dict[str, Any]) -> str:
    """Whose record it is: the instance, and the process (pid, user, unit, config file) as
    the journal or the stats file says, so another daemon's record is never taken for ours."""
    parts = [f"instance {stats.get('INSTANCE', '?')}"]
    pid = stats.get("PID") or stats.get("_PID")
    if pid:
        parts.append(f"pid {pid}" + ("" if stats_file.running(pid) else " (not running)"))
    uid = stats.get("_UID")
    if uid is not None and int(uid) != os.getuid():
        with contextlib.suppress(KeyError, ValueError):
            parts.append(f"user {pwd.getpwuid(int(uid)).pw_name}")
    if stats.get("_SYSTEMD_UNIT"):
        parts.append(f"unit {stats['_SYSTEMD_UNIT']}")
    if stats.get("CONFIG"):
        parts.append(f"config {stats['CONFIG']}")
    return ", ".join(parts)


def daemon_of(stats: dict[str, Any]) -> str:
    """Which daemon a record is of, across its restarts: instance, user, unit."""
    return ", ".join(f"{name} {stats[key]}" for name, key in (
        ("instance", "INSTANCE"), ("uid", "_UID"), ("unit", "_SYSTEMD_UNIT"),
        ("config", "CONFIG")) if stats.get(key) is not None)


def layers_of(stats: dict[str, Any]) -> list[str]:
    """The layers a record reports, in its own order (the pipeline's): every declared layer
    field's prefix, so a new layer shows without a change here; a renamed layer's old name only
    where the record has no new one (a record from an older inboxd)."""
    found: dict[str, None] = {}
    for key in stats:
        match = declared(key)
        if match is not None and match[1] is not None:
            layer = match[1].upper()
            renamed_to = [new for new, old in DEPRECATED_LAYER_NAMES.items() if old == match[1]]
            if renamed_to and f"{renamed_to[0].upper()}_CAPACITY" in stats:
                continue
            if f"{layer}_CAPACITY" in stats:
                found[layer] = None
    return list(found)


def print_stats(unit: str | None, instance: str | None, as_json: bool, follow: bool,
                config: Config | None = None) -> int:
    """The latest record; ``follow``: then each new one as it comes."""
    source = records_of(unit, instance, config)
    stats = source.latest()
    if stats is None:
        print(f"inboxd stats: {source.none_found('stats')}", file=sys.stderr)
        return 1
    show(stats, as_json)
    if follow:
        for record in source.following():
            show(record, as_json)
    return 0


def show(stats: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(stats, default=str, sort_keys=True), flush=True)
    else:
        print(format_table(stats) + "\n", flush=True)


def draw_report(records: list[dict[str, Any]], output: Path) -> None:
    """Five panels against the clock: files completed and failed (and the rate), latency,
    layer depths against their capacities, put-wait, memory. The picture of backpressure: a
    flood drains with the queue pinned at capacity, memory flat."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    t = [r["TIME"] for r in records]
    fig, axes = plt.subplots(5, 1, figsize=(10, 15), sharex=True)
    fig.suptitle(f"inboxd: {whose(records[-1])}", fontsize=10)
    done = axes[0]
    done.plot(t, [r.get("COMPLETED", 0) for r in records], "C2", label="completed (total)")
    done.plot(t, [r.get("FAILED", 0) for r in records], "C3", label="failed (total)")
    done.set_ylabel("files")
    rate = done.twinx()  # a rate, on its own scale
    rate.plot(t, [r.get("FILES_PER_S", 0) for r in records], "C0", alpha=0.6, label="files/s")
    rate.set_ylabel("files/s")
    done.set_title("files completed and failed, and throughput")
    done.legend(loc="upper left", fontsize=8)
    rate.legend(loc="upper right", fontsize=8)
    latency = axes[1]
    for key in ("LATENCY_MS_P50", "LATENCY_MS_P99"):
        latency.plot(t, [r.get(key, 0) for r in records], label=key.lower())
    latency.set_ylabel("ms")
    latency.set_title("latency: noticed to done")
    latency.legend(fontsize=8)
    depth = axes[2]
    for layer, colour in zip(("QUEUE", "EVENT_BUFFER", "PREPROCESS_CACHE", "RETRY_LIST"),
                             ("C0", "C1", "C2", "C3"), strict=True):
        depth.plot(t, [r.get(f"{layer}_SIZE", 0) for r in records], colour,
                   label=f"{layer.lower()} size")
        depth.plot(t, [r.get(f"{layer}_CAPACITY", 0) for r in records], colour, linestyle=":",
                   label=f"{layer.lower()} capacity")
    depth.set_yscale("symlog")
    depth.set_ylabel("items")
    depth.set_title("layer depth vs capacity (dotted)")
    depth.legend(fontsize=7, ncol=2)
    wait = axes[3]
    for key in ("PUT_WAIT_MS_P50", "PUT_WAIT_MS_P99"):
        wait.plot(t, [r.get(key, 0) for r in records], label=key.lower())
    wait.set_ylabel("ms")
    wait.set_title("queue.put() wait")
    wait.legend(fontsize=8)
    memory = axes[4]
    for key in MEMORY:
        if any(key in r for r in records):
            memory.plot(t, [r.get(key, 0) / 2**20 for r in records], label=key.lower())
    memory.set_ylim(bottom=0)  # flat should look flat, not like noise magnified
    memory.set_ylabel("MiB")
    memory.set_xlabel("local time")
    memory.set_title("memory")
    memory.legend(fontsize=8)
    memory.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))  # type: ignore[no-untyped-call]
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(output, dpi=90)
    plt.close(fig)


def write_report(unit: str | None, instance: str | None, start: datetime | None,
                 output: Path, config: Config | None = None) -> int:
    source = records_of(unit, instance, config)
    records = list(source.since(start))
    if not records:
        print(f"inboxd report: no stats records in {source.where} for that selection"
              + ("" if config else "; for a daemon run in the foreground, give its config: "
                 "inboxd report -c FILE"), file=sys.stderr)
        return 1
    daemons = {daemon_of(r) for r in records}
    if len(daemons) > 1:  # said, never drawn as one daemon's line
        print(f"inboxd report: records of {len(daemons)} daemons ("
              f"{'; '.join(sorted(daemons))}); choose one with --instance, -u or -c",
              file=sys.stderr)
        return 1
    draw_report(records, output)
    print(f"{output}: {len(records)} stats records, "
          f"{(records[-1]['TIME'] - records[0]['TIME']).total_seconds():.0f} s")
    return 0
