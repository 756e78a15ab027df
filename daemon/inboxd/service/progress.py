"""``inboxd once``'s progress bar on a terminal: files done of the total, the rate and the time
left, redrawn in place on stderr's last line. A log record written meanwhile first clears that
line, so records and the bar never share one; the bar comes back at its next redraw."""

from __future__ import annotations

import logging
import time
from typing import TextIO

BAR_CHARS = 28
REDRAW_S = 0.2
CLEAR_LINE = "\r\x1b[K"


def eta_text(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "--:--"
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def bar_line(done: int, failed: int, total: int, elapsed_s: float) -> str:
    """``[#####.....]  120/500  24%  3.1 files/s  ETA 02:03  2 failed``."""
    finished = done + failed
    total = max(total, finished)
    share = finished / total if total else 1.0
    filled = int(share * BAR_CHARS)
    rate = finished / elapsed_s if elapsed_s > 0 else 0.0
    left = (total - finished) / rate if rate > 0 else float("inf")
    line = (f"[{'#' * filled}{'.' * (BAR_CHARS - filled)}] {finished}/{total} "
            f"{share * 100:3.0f}%  {rate:.1f} files/s  ETA {eta_text(left)}")
    return line + (f"  {failed} failed" if failed else "")


class ProgressBar(logging.Filter):
    def __init__(self, stream: TextIO, total: int) -> None:
        super().__init__()
        self.stream = stream
        self.total = total
        self.started_s = time.monotonic()
        self._drawn_s = 0.0
        self._shown = False

    def draw(self, done: int, failed: int, force: bool = False) -> None:
        now_s = time.monotonic()
        if not force and now_s - self._drawn_s < REDRAW_S:
            return
        self._drawn_s = now_s
        self.stream.write(CLEAR_LINE + bar_line(done, failed, self.total,
                                                now_s - self.started_s))
        self.stream.flush()
        self._shown = True

    def filter(self, record: logging.LogRecord) -> bool:
        """Before a record is written: the bar's line cleared, for the record to take it."""
        if self._shown:
            self.stream.write(CLEAR_LINE)
            self._shown = False
        return True

    def finish(self, done: int, failed: int) -> None:
        self.draw(done, failed, force=True)
        self.stream.write("\n")
        self.stream.flush()
