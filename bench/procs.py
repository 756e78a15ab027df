"""The real daemon as a child process, and memory sampling of any process by pid.

The daemon's stderr is read line by line on a thread: ``[ready]`` sets an event (start-up is
timed to it, not guessed), ``[stats]`` lines are parsed into dicts (peak CUDA reserved memory
comes from them), everything else is kept only as a short tail for error messages.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from support import configs
from support.configs import SHIPPED_CONFIG, shipped_config
from support.records import numeric_fields

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


class Daemon:
    """``python -m inboxd run -c CONFIG``; ``ready_s`` is start → ``[ready]`` in seconds."""

    def __init__(self, config: Path, env: dict[str, str] | None = None,
                 command: list[str] | None = None) -> None:
        """``command`` replaces ``-m inboxd`` (the profiled runner, say); ``run -c CONFIG``
        follows it."""
        self.config = config
        self.ready = threading.Event()
        self.ready_s: float | None = None
        self.started_fields: dict[str, float | str] = {}
        # The latest ``[runtime]`` record's fields (a fast runtime swapped in, or its failure).
        self.runtime_fields: dict[str, float | str] = {}
        # (monotonic arrival time, fields) of every [stats] record.
        self.stats: list[tuple[float, dict[str, float | str]]] = []
        self.tail: collections.deque[str] = collections.deque(maxlen=60)
        self._lock = threading.Condition()
        self._started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, *(command or ["-m", "inboxd"]), "run", "-c", str(config)],
            cwd=config.parent,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            # Never the journal: the bench reads the records from stderr.
            env={k: v for k, v in {**os.environ, **(env or {})}.items() if k != "JOURNAL_STREAM"},
        )
        self.pid = self.proc.pid
        self._reader = threading.Thread(target=self._read, name="daemon-stderr", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if "[stats]" in line:
                with self._lock:
                    self.stats.append((time.monotonic(), numeric_fields(line)))
                    self._lock.notify_all()
            elif "[started]" in line:
                self.started_fields = numeric_fields(line)
            elif "[runtime]" in line:
                with self._lock:
                    self.runtime_fields = numeric_fields(line)
                    self._lock.notify_all()
            elif "[ready]" in line and not self.ready.is_set():
                self.ready_s = time.monotonic() - self._started
                self.ready.set()
            if "[completed]" not in line:
                self.tail.append(line.rstrip("\n"))
        self.ready.set()  # exited: wake anybody waiting for [ready]
        with self._lock:
            self._lock.notify_all()

    def wait_ready(self, timeout_s: float = 180) -> float:
        if not self.ready.wait(timeout_s) or self.ready_s is None:
            self.kill()
            raise RuntimeError("inboxd never became ready:\n" + "\n".join(self.tail))
        return self.ready_s

    def next_stats(self, timeout_s: float = 30) -> dict[str, float | str]:
        """Wait for the next ``[stats]`` record (the daemon has been through one more tick)."""
        with self._lock:
            seen = len(self.stats)
            if not self._lock.wait_for(lambda: len(self.stats) > seen or not self.alive(),
                                       timeout_s):
                raise RuntimeError(f"no [stats] record from inboxd within {timeout_s} s")
        self.check_alive()
        return self.stats[-1][1]

    def runtime_state(self) -> str:
        """What serves the model: ``serving`` (the fast runtime), ``building`` (torch serves
        while it is exported), ``failed``, or ``""`` (no fast path applies)."""
        fields = self.runtime_fields or self.started_fields
        return str(fields.get("RUNTIME_STATE", ""))

    def wait_runtime_settled(self, timeout_s: float) -> str:
        """Wait until no fast runtime is being built any more; returns the state."""
        with self._lock:
            self._lock.wait_for(lambda: self.runtime_state() != "building" or not self.alive(),
                                timeout_s)
        self.check_alive()
        return self.runtime_state()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            raise RuntimeError(f"inboxd exited {self.proc.returncode}:\n" + "\n".join(self.tail))

    def stats_between(self, start_s: float, end_s: float) -> list[dict[str, float | str]]:
        """Stats records that arrived between two monotonic times."""
        with self._lock:
            return [fields for t, fields in self.stats if start_s <= t <= end_s]

    def stat_values(self, key: str, start_s: float, end_s: float) -> list[float]:
        return [float(value) for f in self.stats_between(start_s, end_s)
                if isinstance(value := f.get(key), float)]

    def stat_max(self, key: str, start_s: float, end_s: float) -> float | None:
        return max(self.stat_values(key, start_s, end_s), default=None)

    def stop(self, timeout_s: float = 120) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            code = -9
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(30)


# CPU seconds read from /proc (what the overhead, profile and peer benches charge).
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_cpu_s(path: str) -> float:
    """User + system CPU seconds from a /proc .../stat file."""
    with open(path) as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# The daemon's helper processes, by the module each runs (its command line).
HELPERS = {"inboxd.decode.worker_child": "decode_workers", "inboxd.files.commit_child": "commit"}


def cpu_s(pid: int) -> dict[str, float]:
    """User + system CPU seconds of the daemon process (threads that ended included) and of
    its live helper processes, by kind (``HELPERS``)."""
    found = dict.fromkeys(["daemon", *HELPERS.values()], 0.0)
    with contextlib.suppress(OSError, ValueError, IndexError):
        found["daemon"] = _stat_cpu_s(f"/proc/{pid}/stat")
    for task in _tasks(pid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as kids:
            for child in kids.read().split():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                        args = cmdline.read().split(b"\0")
                    kind = next((HELPERS[a.decode()] for a in args if a.decode() in HELPERS),
                                "daemon")
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
