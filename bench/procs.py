"""The bench's daemon config, and what it measures of any process by pid: memory (RSS, its
peak) and CPU seconds by helper process and by thread. The daemon itself runs as tests run it
(``support.daemon.DaemonProcess``: ``[ready]`` timed, ``[stats]`` records parsed as they come).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

from support import configs
from support.configs import SHIPPED_CONFIG, shipped_config

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = SHIPPED_CONFIG


def write_config(root: Path, overrides: dict[str, dict[str, Any]] | None = None) -> Path:
    """The shipped config with every folder under ``root``, a 1-s stats interval and
    ``overrides`` merged per section: what the bench measures is what ``make run`` runs."""
    sections: dict[str, dict[str, Any]] = {"stats": {"interval_s": 1, "heartbeat_s": 1}}  # idle too
    for section, values in (overrides or {}).items():
        sections[section] = {**sections.get(section, {}), **values}
    return configs.write_config(root, shipped_config(), sections)


def rss_bytes(pid: int) -> int:
    """VmRSS of ``pid`` now (0 once it has exited)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def reset_peak_rss(pid: int) -> None:
    """Restart the kernel's peak-RSS count (VmHWM) for ``pid``: writing 5 to clear_refs."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass  # an older kernel: the 20-ms samples still bound the peak from below


def peak_rss_bytes(pid: int) -> int:
    """VmHWM: the largest RSS since start or the last ``reset_peak_rss``, however brief."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class RssSampler:
    """Samples one process's RSS every ``interval_s`` on a thread; peaks over any time span."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            rss = rss_bytes(self.pid)
            if rss == 0:
                return
            self.samples.append((time.monotonic(), rss))

    def now(self) -> int:
        return rss_bytes(self.pid)

    def mark(self) -> float:
        """Start a span: the kernel's peak count restarts now. Returns the monotonic time."""
        reset_peak_rss(self.pid)
        return time.monotonic()

    def span_peak(self, start_s: float, end_s: float | None = None) -> int:
        """The peak since ``mark()`` (VmHWM), or the sampled peak if that is higher (no
        clear_refs). Call it at the end of the span."""
        return max(peak_rss_bytes(self.pid), self.peak(start_s, end_s))

    def peak(self, start_s: float, end_s: float | None = None) -> int:
        end = end_s if end_s is not None else float("inf")
        return max((rss for t, rss in list(self.samples) if start_s <= t <= end), default=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1)


# CPU seconds read from /proc (what the overhead, profile and peer benches charge).
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_cpu_s(path: str) -> float:
    """User + system CPU seconds from a /proc .../stat file."""
    with open(path) as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# The daemon's helper processes, by the module each runs (its command line).
HELPERS = {"inboxd.decode.worker_child": "decode_workers", "inboxd.files.commit_child": "commit"}


def helpers(pid: int) -> list[tuple[int, str]]:
    """The daemon's live child processes, each with its kind (``HELPERS``; "daemon" for any
    other child)."""
    found = []
    for task in _tasks(pid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as kids:
            for child in map(int, kids.read().split()):
                with contextlib.suppress(OSError), open(f"/proc/{child}/cmdline", "rb") as cmd:
                    args = cmd.read().decode(errors="replace").split("\0")
                    found.append((child, next((HELPERS[a] for a in args if a in HELPERS),
                                              "daemon")))
    return found


def cpu_s(pid: int) -> dict[str, float]:
    """User + system CPU seconds of the daemon process (threads that ended included) and of
    its live helper processes, by kind (``HELPERS``)."""
    found = dict.fromkeys(["daemon", *HELPERS.values()], 0.0)
    with contextlib.suppress(OSError, ValueError, IndexError):
        found["daemon"] = _stat_cpu_s(f"/proc/{pid}/stat")
    for child, kind in helpers(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            found[kind] += _stat_cpu_s(f"/proc/{child}/stat")
    return found


def cpu_by_thread_s(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid``'s live threads by kernel name without the index (``io``,
    ``preprocess``, ``model``, ``sync``, ...: inboxd names them, ``os_threads``; the main thread
    is the event loop): a breakdown, not a total (ended threads are missing)."""
    found: dict[str, float] = {}
    for task in _tasks(pid):
        base = f"/proc/{pid}/task/{task}"
        try:  # a thread that ends meanwhile is left out, the others still count
            with open(f"{base}/comm") as comm:
                name = comm.read().strip()
            seconds = _stat_cpu_s(f"{base}/stat")
        except (OSError, ValueError, IndexError):
            continue
        name = "event loop" if task == str(pid) else name.rstrip("0123456789").rstrip("_")
        found[name] = found.get(name, 0.0) + seconds
    return found


def _tasks(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
