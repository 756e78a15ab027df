"""Which stages hold work and have not moved: what ``STATUS=`` names and what stops
``WATCHDOG=1``.

Each stage that can stand still on its own is looked at: the model's oldest call, the commit
process's oldest batch, decode workers stopped from outside; and, for whatever else could stand
still (a stage waiting on another for ever), the pipeline as a whole: files in flight while no
counter moves. Each has a limit past which the service is not doing its job and systemd should
restart it; idle, with nothing waiting, nothing stalls and the pings go on.

Time the daemon itself was stopped (Ctrl-Z, a cgroup freeze) is nobody's stall: a gap between
two looks longer than ``FROZEN_GAP_S`` starts every count again from the end of the gap.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

# A stage standing still this long is named in STATUS= already, before its limit.
SHOWN_AFTER_S = 5.0
# The service looks every 2 s (its STATUS= line); a gap this long means it was not running.
FROZEN_GAP_S = 10.0
# When no watchdog is configured, STATUS= still judges stalls against the shipped unit's
# ping interval (WatchdogSec=60, pinged every 30 s).
DEFAULT_PATIENCE_S = 30.0


@dataclass(frozen=True, slots=True)
class Stall:
    stage: str  # "commit", "model", "decode worker 1234", "pipeline"
    stalled_s: float
    limit_s: float = math.inf  # past this, no WATCHDOG=1 (inf: the stage heals itself)
    detail: str = ""
    shown_after_s: float = SHOWN_AFTER_S

    @property
    def overdue(self) -> bool:
        return self.stalled_s >= self.limit_s

    @property
    def shown(self) -> bool:
        return self.stalled_s >= min(self.shown_after_s, self.limit_s)

    def __str__(self) -> str:
        return f"{self.stage} stalled {self.stalled_s:.0f} s{self.detail}"


class StallClock:
    """Since when the daemon has run without a gap, and since when progress last moved."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        now = clock()
        self._looked_s = now
        self.awake_since_s = now
        self._progress: tuple[int, ...] | None = None
        self.moved_s = now

    def look(self, progress: tuple[int, ...], waiting: bool) -> float:
        """Now; ``progress`` is every counter that moves when work does, ``waiting`` whether
        any work is there to move."""
        now = self.clock()
        if now - self._looked_s > FROZEN_GAP_S:
            self.awake_since_s = now
        self._looked_s = now
        if progress != self._progress or not waiting:
            self._progress = progress
            self.moved_s = now
        return now

    def since(self, started_s: float) -> float:
        """``started_s``, or the end of the last gap if that came later."""
        return max(started_s, self.awake_since_s)
