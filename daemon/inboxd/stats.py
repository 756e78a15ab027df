"""Counters at every boundary, every layer's fill, and the periodic ``stats`` record.

The names follow the article: *accepted* (noticed and admitted to the event buffer), *enqueued*
(``queue.put()`` returned), *completed* (result durable); plus *failed*, *retried*, *deferred*
(noticed while the event buffer was full: left on disk for the next scan) and *released*
(handed back to the inbox on disk: retry list full, or shutdown) and *ignored* (not taken:
admitted to the event buffer, then not claimed — gone before the claim, a folder, or already
done — or, counted in *ignored_names* too, a name the daemon never takes, logged once).

Failures are also counted by ``reason_class``, a small fixed set (never free text or a path),
so that a metrics label can never grow with the inputs.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from inboxd.item import PermanentError, TransientError

# Percentiles are taken over the most recent samples only, so this window never grows.
SAMPLE_WINDOW = 2048


class Layer(Protocol):
    """A bounded container on the way from the watcher to the results: its size now, its
    capacity, and the largest size it has ever had (the proof that the bound held)."""

    name: str
    high_water: int

    @property
    def size(self) -> int: ...

    @property
    def capacity(self) -> int: ...


@dataclass
class Window:
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLE_WINDOW))
    max_seen: float = 0.0
    # Every sample is also handed here (the metrics histograms), when something listens.
    on_add: Callable[[float], None] | None = None

    def add(self, value: float) -> None:
        self.samples.append(value)
        self.max_seen = max(self.max_seen, value)
        if self.on_add is not None:
            self.on_add(value)

    def percentile(self, q: float) -> float:
        if not self.samples:
            return 0.0
        ordered = sorted(self.samples)
        index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
        return ordered[index]


@dataclass
class Counters:
    accepted: int = 0
    enqueued: int = 0
    completed: int = 0
    failed: int = 0
    retried: int = 0
    deferred: int = 0
    released: int = 0
    duplicates: int = 0  # same name and content as an existing result: finished without inference
    # Not taken: admitted to the event buffer, then not claimed (gone, a folder, done), or a
    # name never admitted (no include pattern, hidden: ``ignored_names``, said once each).
    ignored: int = 0
    ignored_names: int = 0
    # Claimed by an instance that died, returned to the inbox by this one (files.takeover).
    taken_over: int = 0


# Why a file failed, coarsely: the metrics label. An exception may name its own class with a
# ``reason_class`` attribute; otherwise classify_failure() decides from its type and message.
REASON_CLASSES = ("decode", "too_large", "io", "model", "refused", "other")


def classify_failure(exc: BaseException) -> str:
    """The reason class of the exception that made a file fail (one of REASON_CLASSES)."""
    declared = getattr(exc, "reason_class", None)
    if declared in REASON_CLASSES:
        return str(declared)
    text = str(exc).lower()
    if text.startswith(("refused", "not a regular file")):
        return "refused"
    if "decompression bomb" in text or "too large" in text or "larger than" in text:
        return "too_large"
    if "the model failed" in text:
        return "model"
    if isinstance(exc, (OSError, TransientError)):
        return "io"  # transient errors that used up every attempt
    if isinstance(exc, PermanentError):
        return "decode"
    return "other"


class Stats:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.counters = Counters()
        self.failed_by_class = dict.fromkeys(REASON_CLASSES, 0)
        self.layers: list[Layer] = []
        self.put_wait_ms = Window()
        self.latency_ms = Window()
        self.batch_sizes = Window()
        self.inference_ms = Window()  # one sample per model call (a whole batch)
        self.started_s = clock()
        self._last_completed = 0
        self._last_s = self.started_s
        self.memory_probe: Callable[[], dict[str, int]] = lambda: {}

    def register(self, *layers: Layer) -> None:
        self.layers.extend(layers)

    def recent_files_per_s(self) -> float:
        """Completions per second since the last stats record (for STATUS=, between records)."""
        elapsed = max(self.clock() - self._last_s, 1e-9)
        return (self.counters.completed - self._last_completed) / elapsed

    def snapshot(self) -> dict[str, Any]:
        """Every figure of the ``stats`` record, as uppercase journal field names."""
        now = self.clock()
        done = self.counters.completed
        elapsed = max(now - self._last_s, 1e-9)
        files_per_s = (done - self._last_completed) / elapsed
        self._last_completed, self._last_s = done, now
        fields: dict[str, Any] = {k.upper(): v for k, v in vars(self.counters).items()}
        for layer in self.layers:
            prefix = layer.name.upper()
            fields[f"{prefix}_SIZE"] = layer.size
            fields[f"{prefix}_CAPACITY"] = layer.capacity
            fields[f"{prefix}_HIGH_WATER"] = layer.high_water
        fields.update(
            PUT_WAIT_MS_P50=round(self.put_wait_ms.percentile(50), 3),
            PUT_WAIT_MS_P99=round(self.put_wait_ms.percentile(99), 3),
            PUT_WAIT_MS_MAX=round(self.put_wait_ms.max_seen, 3),
            LATENCY_MS_P50=round(self.latency_ms.percentile(50), 3),
            LATENCY_MS_P99=round(self.latency_ms.percentile(99), 3),
            BATCH_SIZE_P50=self.batch_sizes.percentile(50),
            FILES_PER_S=round(files_per_s, 3),
            UPTIME_S=round(now - self.started_s, 3),
            RSS_BYTES=rss_bytes(),
        )
        fields.update(self.memory_probe())
        return fields


def rss_bytes() -> int:
    """Resident set size now (not the peak), from /proc: cheap enough for every stats record."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
