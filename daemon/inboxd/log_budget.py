"""The budget of the frequent records, checked before a record is made, for every sink.

journald drops *everything* a unit logs beyond RateLimitBurst=10000 messages per
RateLimitIntervalSec=30s, stats records included (it counts each priority class separately and
only ever scales the burst up with free disk space). So the frequent per-file records
(completed, failed, retry, released, ...) pass a token bucket per priority class: 1000 at once,
then 100 per second. Worst case per class in any 30 s window: 1000 + 30 * 100 = 4000, leaving
6000 for the records that are never dropped: stats (at most one per second), lifecycle events,
errors and the summaries below (one per 5 s). 100 lines a second is more than anyone reads; the
stats record carries the exact counts anyway.

The same budget holds on stderr: a terminal reads no more than the journal does. And it is
checked before a record is made: a record made and then dropped by a handler still costs most
of what writing it would, one held back here almost nothing (docs/decisions.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

BUCKET_BURST = 1000
BUCKET_RATE_PER_S = 100.0
SUMMARY_INTERVAL_S = 5.0
# Never held back: the lifecycle, and the start and end of an episode (a backlog on disk, the
# model out of reach), which no file can make more frequent than the pipeline's own pace or the
# engine's reconnect backoff. A flood of files spends the budget before its episode ends, and
# "watching again" or "the model is reachable again" must not be what it hides. Per-file
# "failed" warnings are *not* exempt: a flood of bad files must not use up the warning class
# and hide a warning that matters, such as a rejected reload.
EXEMPT_EVENTS = frozenset({
    "started", "ready", "stats", "reloaded", "stopping", "stopped", "suppressed",
    "recovered", "metrics", "gpu_decode", "no_cuda", "faults", "runtime",  # once each
    "deferred", "watching", "model_unavailable", "model_available", "model_connected",
})


@dataclass
class _Bucket:
    tokens: float
    updated_s: float


@dataclass(frozen=True)
class Summary:
    """What the budget held back since the last summary: a ``suppressed`` record."""

    message: str
    fields: dict[str, Any]


def _rate_class(level: int) -> int:
    """journald's pools, as far as Python's levels reach: warning | notice and info | debug
    (errors and worse are never held back)."""
    if level >= logging.WARNING:
        return 2
    if level >= logging.INFO:
        return 3
    return 4


class RecordBudget:
    """Token buckets for the frequent records, and a count of what they held back. Called from
    every thread that logs, so it takes a lock of its own."""

    def __init__(
        self,
        *,
        burst: int = BUCKET_BURST,
        rate_per_s: float = BUCKET_RATE_PER_S,
        summary_interval_s: float = SUMMARY_INTERVAL_S,
        exempt_events: Iterable[str] = EXEMPT_EVENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._burst = burst
        self._rate_per_s = rate_per_s
        self._summary_interval_s = summary_interval_s
        self._exempt = frozenset(exempt_events)
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[int, _Bucket] = {}  # at most 3 keys: the priority classes
        self._pending: dict[str, int] = {}  # held back since the last summary, by event
        self._total = 0
        self._last_summary_s: float | None = None

    def admit(self, level: int, event: str) -> bool:
        if level >= logging.ERROR or event in self._exempt:
            return True
        with self._lock:
            now = self._clock()
            bucket = self._buckets.setdefault(_rate_class(level), _Bucket(float(self._burst), now))
            bucket.tokens = min(float(self._burst),
                                bucket.tokens + (now - bucket.updated_s) * self._rate_per_s)
            bucket.updated_s = now
            if bucket.tokens >= 1.0:
                bucket.tokens -= 1.0
                return True
            self._pending[event] = self._pending.get(event, 0) + 1
            self._total += 1
            if self._last_summary_s is None:
                self._last_summary_s = now  # the first summary one interval after the first drop
            return False

    def summary(self, *, force: bool = False) -> Summary | None:
        """A summary when records were held back and the interval has passed (or ``force``)."""
        if not self._pending:  # read without the lock: a stale answer only delays a summary
            return None
        with self._lock:
            now = self._clock()
            if not self._pending or self._last_summary_s is None:
                return None
            if not force and now - self._last_summary_s < self._summary_interval_s:
                return None
            count = sum(self._pending.values())
            by_event = " ".join(f"{k}={v}" for k, v in sorted(self._pending.items()))
            fields: dict[str, Any] = {"SUPPRESSED": count, "SUPPRESSED_TOTAL": self._total}
            fields.update((f"SUPPRESSED_{name.upper()}", n) for name, n in self._pending.items())
            self._pending.clear()
            self._last_summary_s = now
        return Summary(f"log rate limit: suppressed {count} records ({by_event})", fields)
