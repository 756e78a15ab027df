"""Dropping files into an inbox and noticing their results: the bench's side of the daemon.

Files are dropped as hard links to the corpus: one atomic ``link()`` per file, with the corpus
file's old mtime, so the daemon takes each at once (what ``inboxd submit`` and any temp+rename
writer look like) and a 20,000-file flood costs no disk space. Results are noticed by a thread
that lists the results folder every few milliseconds and, by default, consumes what it saw
(records the time and the stage timings inside, then deletes it), so the listing stays short
however many files pass through.

The overhead scenario's watcher consumes nothing (``consume=False``): it looks for the expected
names' results with one ``stat`` each, in the order they were dropped, and neither reads nor
deletes them. There the bench's own work would be a tenth of the CPU being measured, and on this
machine's ext4 (no journal) every delete makes later file creations slower for up to minutes
(``bench/overhead.py``, ``QUIET_CREATE_US``), the daemon's own included.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from bench.photos import Photo

STAGES = ("queue_wait", "preprocess", "batch_wait", "inference", "total")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``nan`` for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def drop_name(index: int, photo: Photo, prefix: str = "f") -> str:
    return f"{prefix}{index:06d}-{photo.path.name}"


def drop(photo: Photo, inbox: Path, name: str) -> None:
    os.link(photo.path, inbox / name)


def drop_many(photos: Sequence[Photo], inbox: Path, count: int, prefix: str) -> list[str]:
    """``count`` files, cycling through ``photos``, as fast as the filesystem takes them."""
    names = []
    for index in range(count):
        photo = photos[index % len(photos)]
        name = drop_name(index, photo, prefix)
        drop(photo, inbox, name)
        names.append(name)
    return names


class ResultWatcher:
    """Notices ``<name>.json`` in the results folder; ``seen[name]`` is the monotonic time (at
    most ``interval_s`` late)."""

    def __init__(self, results_dir: Path, interval_s: float = 0.01, consume: bool = True) -> None:
        self.results_dir = results_dir
        self.interval_s = interval_s
        self.consume = consume
        self.seen: dict[str, float] = {}
        self.timings: list[dict[str, float]] = []
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="result-watcher", daemon=True)
        if consume:  # otherwise wait_for looks, for the names it is given
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poll()
            self._stop.wait(self.interval_s)

    def _poll(self) -> None:
        try:
            entries = [e for e in os.scandir(self.results_dir)
                       if e.name.endswith(".json") and not e.name.startswith(".")]
        except FileNotFoundError:
            return
        if not entries:
            return
        now = time.monotonic()
        for entry in entries:
            name = entry.name[: -len(".json")]
            if name in self.seen:
                continue
            self.seen[name] = now
            if self.consume:
                self._take(Path(entry.path))
        with self._changed:
            self._changed.notify_all()

    def _take(self, path: Path) -> None:
        try:
            document = json.loads(path.read_bytes())
            self.timings.append({k: float(v) for k, v in document["timings_ms"].items()})
        except (OSError, ValueError, KeyError, TypeError):
            pass  # the timings are a bonus; presence is the measurement
        path.unlink(missing_ok=True)

    def wait_for(self, names: Iterable[str], timeout_s: float) -> bool:
        """True once every name has a result; False at the deadline."""
        if not self.consume:
            return self._look_for(list(names), timeout_s)
        missing = list(names)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                missing = [name for name in missing if name not in self.seen]
                remaining_s = deadline - time.monotonic()
                if not missing or remaining_s <= 0:
                    return not missing
                self._changed.wait(remaining_s)

    def _look_for(self, missing: list[str], timeout_s: float) -> bool:
        """Without consuming: each poll stats the missing names in order and stops at the first
        still missing (files finish about in the order they were dropped), so a flood costs
        about one ``stat`` per file. A result found behind a late one is stamped when the late
        one is, so the last stamp is still the last result's arrival, one poll late at most."""
        folder = os.fspath(self.results_dir)
        deadline = time.monotonic() + timeout_s
        first = 0  # the first name not seen yet
        while True:
            now = time.monotonic()
            while first < len(missing) and os.path.exists(
                    os.path.join(folder, missing[first] + ".json")):
                self.seen[missing[first]] = now
                first += 1
            if first == len(missing):
                return True
            if now >= deadline:
                return False
            time.sleep(self.interval_s)

    def stage_summary(self, start: int = 0) -> dict[str, dict[str, float]]:
        """Median and p90 of each stage's time (from the results' own timings) since index
        ``start`` of ``timings``: where a file's time goes inside the daemon."""
        rows = self.timings[start:]
        return {stage: {"p50": round(percentile([r[stage] for r in rows if stage in r], 50), 2),
                        "p90": round(percentile([r[stage] for r in rows if stage in r], 90), 2)}
                for stage in STAGES}

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
