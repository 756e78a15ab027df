"""Files given back because somebody still holds them open for writing: wait longer each time.

A finished photo whose writer keeps its handle open (no writes) looks settled by its mtime, is
claimed, found held by the lease check and given back, and — without this — claimed again at
once, about 13 times a second for as long as the handle stays open. Each give-back of the same
file (same inode under the same path) doubles the wait before its next claim, from
``max(inbox.settle_ms, retry.backoff_initial_ms)`` up to ``min(retry.backoff_max_ms,
inbox.rescan_interval_s)``. At most ``capacity.event_buffer`` files are remembered (the oldest
forgotten first: it is then only claimed sooner), and a file not given back for a while starts
over. Used from the event loop and the intake's claim thread, hence the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from inboxd.config import Config


@dataclass(slots=True)
class _Held:
    inode: int
    give_backs: int
    not_before_s: float


class HeldFiles:

    def __init__(self, capacity: int, initial_s: float, max_s: float,
                 clock: Callable[[], float]) -> None:
        self.capacity = capacity
        self.initial_s = initial_s
        self.max_s = max(initial_s, max_s)
        self.clock = clock
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Config, clock: Callable[[], float]) -> HeldFiles:
        initial_s = max(config.inbox.settle_ms, config.retry.backoff_initial_ms) / 1000
        max_s = min(config.retry.backoff_max_ms / 1000, config.inbox.rescan_interval_s)
        return cls(config.capacity.event_buffer, initial_s, max_s, clock)

    @property
    def size(self) -> int:
        return len(self._held)

    def given_back(self, path: str, inode: int | None) -> float:
        """``path`` (inode ``inode``) was given back still held open: returns the wait before
        it may be claimed again."""
        now_s = self.clock()
        with self._lock:
            held = self._held.pop(path, None)
            if held is None or held.inode != inode or now_s > held.not_before_s + self.max_s:
                held = _Held(inode or 0, 0, now_s)  # another file, or quiet for a while
            held.give_backs += 1
            wait_s = min(self.max_s, self.initial_s * 2.0 ** (held.give_backs - 1))
            held.not_before_s = now_s + wait_s
            self._held[path] = held
            while len(self._held) > self.capacity:
                self._held.popitem(last=False)
            return wait_s

    def not_before(self, path: str, inode: int) -> float | None:
        """When ``path`` may be claimed again, if that is later than now (None: at once)."""
        with self._lock:
            held = self._held.get(path)
            if held is None or held.inode != inode:
                return None
            return held.not_before_s if held.not_before_s > self.clock() else None

    def resize(self, capacity: int) -> None:
        with self._lock:
            self.capacity = capacity
            while len(self._held) > capacity:
                self._held.popitem(last=False)
