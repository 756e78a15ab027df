"""The real daemon as tests and the bench drive it: ``python -m inboxd`` as a child process with
its output collected line by line, and the files dropped into its inbox."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from support.records import line_fields, numeric_fields
from support.waiting import wait_until


def make_image(path: Path, size: tuple[int, int] = (64, 48),
               color: tuple[int, int, int] = (200, 30, 30), fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path, format=fmt)
    return path


def drop(source: Path, inbox: Path, name: str | None = None) -> Path:
    """Drop a file as well-behaved writers do: write a hidden temp, then rename into place."""
    target = inbox / (name or source.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.part")
    tmp.write_bytes(source.read_bytes())
    os.rename(tmp, target)
    return target


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


class DaemonProcess:
    """``python -m inboxd <command> -c CONFIG`` as a child process, for tests and the bench
    alike: its output (stdout and stderr, one stream) read line by line on a thread and kept.

    As lines arrive, ``[ready]`` sets ``ready`` (``ready_s``: start to ready, what the bench
    times), the ``[started]`` record's fields are kept, and every ``[stats]`` record is parsed
    with its arrival time (``stats``): the bench's figures come from them.
    """

    def __init__(self, config: Path, *extra: str, env: dict[str, str] | None = None,
                 command: str = "run", prefix: Sequence[str] = (),
                 program: Sequence[str] = ("-m", "inboxd"), new_session: bool = False) -> None:
        """``extra`` follows ``-c CONFIG``; ``prefix`` runs before the interpreter (a user
        namespace, say); ``program`` replaces ``-m inboxd`` (the bench's profiled runner);
        ``new_session``: the daemon leads a process group of its own, as a shell job does."""
        self.config = config
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.ready_s: float | None = None
        self.started_fields: dict[str, float | str] = {}
        # (monotonic arrival time, fields) of every [stats] record.
        self.stats: list[tuple[float, dict[str, float | str]]] = []
        self._changed = threading.Condition()
        self._started = time.monotonic()
        # The records are read from the output, never the journal: an inherited JOURNAL_STREAM
        # (a harness run under systemd) would send them there. A test that wants the journal
        # passes its own.
        inherited = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, *program, command, "-c", str(config), *extra],
            cwd=config.parent,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env={**inherited, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=new_session,
        )
        self.pid = self.proc.pid
        self._reader = threading.Thread(target=self._read, name="daemon-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            with self._changed:
                self.lines.append(line)
                if "[stats]" in line:
                    self.stats.append((time.monotonic(), numeric_fields(line)))
                elif "[started]" in line:
                    self.started_fields = numeric_fields(line)
                elif "[ready]" in line and not self.ready.is_set():
                    self.ready_s = time.monotonic() - self._started
                    self.ready.set()
                self._changed.notify_all()
        self.ready.set()  # exited: wake anybody waiting for [ready]
        with self._changed:
            self._changed.notify_all()

    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def lines_since(self, mark: int) -> list[str]:
        """The lines printed after the first ``mark`` (``len(self.lines)`` taken earlier)."""
        with self._changed:
            return self.lines[mark:]

    def tail(self, count: int = 60) -> str:
        """The last ``count`` lines other than ``[completed]`` records: what went wrong, for an
        error message after a flood of thousands of files."""
        kept: list[str] = []
        with self._changed:
            for line in reversed(self.lines):
                if "[completed]" not in line:
                    kept.append(line)
                    if len(kept) == count:
                        break
        return "\n".join(reversed(kept))

    def records(self, event: str) -> list[str]:
        with self._changed:
            return [line for line in self.lines if f"[{event}]" in line]

    def wait_for(self, event: str, timeout_s: float = 120, count: int = 1) -> list[str]:
        def seen() -> list[str] | None:
            if self.proc.poll() is not None and len(self.records(event)) < count:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.output()}")
            found = self.records(event)
            return found if len(found) >= count else None

        return wait_until(seen, timeout_s, f"{count}× [{event}]")  # type: ignore[no-any-return]

    def wait_ready(self, timeout_s: float = 180) -> float:
        """Seconds from start to ``[ready]``; the daemon killed and the reason raised if it
        never gets there."""
        if not self.ready.wait(timeout_s) or self.ready_s is None:
            self.kill()
            raise RuntimeError("inboxd never became ready:\n" + self.tail())
        return self.ready_s

    def next_stats(self, timeout_s: float = 30) -> dict[str, float | str]:
        """Wait for the next ``[stats]`` record (the daemon has been through one more tick)."""
        with self._changed:
            seen = len(self.stats)
            if not self._changed.wait_for(lambda: len(self.stats) > seen or not self.alive(),
                                          timeout_s):
                raise RuntimeError(f"no [stats] record from inboxd within {timeout_s} s")
        self.check_alive()
        return self.stats[-1][1]

    def runtime_state(self) -> str:
        """What serves the model: ``serving`` (the fast runtime), ``building`` (torch serves
        while it is exported), ``failed``, or ``""`` (no fast path applies): the latest
        ``[runtime]`` record's, else the ``[started]`` record's."""
        runtime = self.records("runtime")
        fields = numeric_fields(runtime[-1]) if runtime else self.started_fields
        return str(fields.get("RUNTIME_STATE", ""))

    def wait_runtime_settled(self, timeout_s: float) -> str:
        """Wait until no fast runtime is being built any more; returns the state."""
        with self._changed:
            self._changed.wait_for(
                lambda: self.runtime_state() != "building" or not self.alive(), timeout_s)
        self.check_alive()
        return self.runtime_state()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            raise RuntimeError(f"inboxd exited {self.proc.returncode}:\n" + self.tail())

    def stats_between(self, start_s: float, end_s: float) -> list[dict[str, float | str]]:
        """Stats records that arrived between two monotonic times."""
        with self._changed:
            return [fields for t, fields in self.stats if start_s <= t <= end_s]

    def stat_values(self, key: str, start_s: float, end_s: float) -> list[float]:
        return [float(value) for f in self.stats_between(start_s, end_s)
                if isinstance(value := f.get(key), float)]

    def stat_max(self, key: str, start_s: float, end_s: float) -> float | None:
        return max(self.stat_values(key, start_s, end_s), default=None)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 120) -> int:
        """Send ``sig`` and reap: the exit status. A daemon that does not exit within
        ``timeout_s`` is killed (nothing outlives the harness) and the timeout raised."""
        if self.alive():
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(30)


def last_stats(lines: list[str]) -> dict[str, str]:
    """The KEY=value fields of the last stats line a daemon printed."""
    return line_fields(lines[-1])
