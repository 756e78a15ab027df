"""How long one file has really had in its decode worker: the wall clock, less the time the
worker could not run.

``decode_timeout_s`` is meant for a decoder that spins or hangs on hostile bytes, not for a
machine that was stopped under it. Wall time alone would fail good photos after a Ctrl-Z of the
daemon's process group, a cgroup freeze or a SIGSTOP of one worker (measured: each one a
permanent "took too long"). So the pool waits in short slices and counts each one only up to
its own length (a slice that ends much later means the daemon itself was stopped: only the
slice counts), and not at all while the worker is stopped (``/proc/<pid>/stat`` says T). A
worker spinning on the CPU, or sleeping in a hung decoder, still uses its time at the wall
clock's pace and is cut at ``decode_timeout_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from inboxd.children import is_stopped

SLICE_S = 0.5  # the longest single wait; replies normally come far sooner
# How much later than asked a wait may end and still count in full (a busy machine's lag).
LATE_S = 0.5


class DecodeBudget:
    """The counted time of one file, and the time its worker was seen stopped."""

    def __init__(self, limit_s: float, pid: int,
                 clock: Callable[[], float] = time.monotonic,
                 stopped: Callable[[int], bool] = is_stopped) -> None:
        self.limit_s = limit_s
        self.pid = pid
        self.clock = clock
        self.stopped = stopped
        self.used_s = 0.0
        self.stopped_s = 0.0
        self.worker_stopped = False  # at the last look
        self._since_s = clock()
        self._slice_s = 0.0

    def deadline_s(self) -> float:
        """When the next wait ends (``time.monotonic()``, for ``wire.Reader.recv``)."""
        self._since_s = self.clock()
        self._slice_s = min(SLICE_S, max(0.0, self.limit_s - self.used_s))
        return self._since_s + self._slice_s

    def waited(self) -> None:
        """A wait ended without the reply: count it."""
        counted_s = min(self.clock() - self._since_s, self._slice_s + LATE_S)
        self.worker_stopped = self.stopped(self.pid)
        if self.worker_stopped:
            self.stopped_s += counted_s
        else:
            self.used_s += counted_s

    @property
    def timed_out(self) -> bool:
        return self.used_s >= self.limit_s

    @property
    def stopped_too_long(self) -> bool:
        """Stopped from outside for as long as a decode may take: replaced, the file not
        blamed (nobody may ever continue it)."""
        return self.stopped_s >= self.limit_s
