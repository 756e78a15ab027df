"""Shared fixtures: configs in temp folders, the real daemon as a subprocess, waiting helpers.

Waiting is always for an outcome (a file, a log record, an exit) with a deadline, never a
fixed sleep.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from PIL import Image

from tests.waiting import wait_until as wait_until  # re-exported: what the tests import

REPO = Path(__file__).resolve().parent.parent
# One ONNX artifact cache for every daemon a test starts (model.cache_dir), so the background
# export runs once per machine and checkout, not once per test; tests of the cache itself give
# their own cache_dir.
SHARED_MODEL_CACHE = Path(tempfile.gettempdir()) / (
    f"inboxd-test-model-cache-{os.getuid()}-{hashlib.sha256(str(REPO).encode()).hexdigest()[:8]}")


def run_interleaved(targets: list[Callable[[], None]]) -> None:
    """Each target in a thread of its own, the threads switching every microsecond: at
    Python's 5 ms two short calls almost never interleave, and a race would not show."""
    threads = [threading.Thread(target=target) for target in targets]
    interval_s = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval_s)


def write_config(root: Path, **sections: Any) -> Path:
    """A config with every folder under ``root``; ``sections`` override keys (dicts merge)."""
    config: dict[str, Any] = {
        "inbox": {"paths": [str(root / "inbox")], "settle_ms": 50, "rescan_interval_s": 5},
        "results_dir": str(root / "results"),
        "done_dir": str(root / "done"),
        "failed_dir": str(root / "failed"),
        # Every interval, idle or not: tests wait for the next record after a change.
        "stats": {"interval_s": 1, "heartbeat_s": 1},
        "shutdown": {"grace_s": 20},
        "model": {"cache_dir": str(SHARED_MODEL_CACHE)},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    path = root / "inboxd.yaml"
    path.write_text(yaml.safe_dump(config))
    (root / "inbox").mkdir(parents=True, exist_ok=True)
    return path


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
    """``python -m inboxd run`` as a child process, its stderr collected line by line."""

    def __init__(self, config: Path, *extra: str, env: dict[str, str] | None = None,
                 command: str = "run") -> None:
        self.config = config
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "inboxd", command, "-c", str(config), *extra],
            cwd=config.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def records(self, event: str) -> list[str]:
        with self._lock:
            return [line for line in self.lines if f"[{event}]" in line]

    def wait_for(self, event: str, timeout_s: float = 120, count: int = 1) -> list[str]:
        def seen() -> list[str] | None:
            if self.proc.poll() is not None and len(self.records(event)) < count:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.output()}")
            found = self.records(event)
            return found if len(found) >= count else None

        return wait_until(seen, timeout_s, f"{count}× [{event}]")  # type: ignore[no-any-return]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout_s)
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


# A KEY=value field of a daemon's stderr record. A value holding whitespace, a quote or "=" is
# written as repr() writes it (inboxd.logs.format_value), spaces and all.
_FIELD = re.compile(
    r"""(?<!\S)([A-Z][A-Z0-9_]*)=(?:('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")(?!\S)|(\S+))""")


def line_fields(line: str) -> dict[str, str]:
    """The KEY=value fields of one stderr record line, quoted values unquoted."""
    return {key: ast.literal_eval(quoted) if quoted else bare
            for key, quoted, bare in _FIELD.findall(line)}


def last_stats(lines: list[str]) -> dict[str, str]:
    """The KEY=value fields of the last stats line a daemon printed."""
    return line_fields(lines[-1])


@pytest.fixture(autouse=True)
def fresh_log_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The record budget is process-wide: each test starts with a full one, whatever the tests
    before it logged."""
    from inboxd import log_budget, logs
    monkeypatch.setattr(logs, "budget", log_budget.RecordBudget())


@pytest.fixture
def daemon_factory() -> Iterator[Callable[..., DaemonProcess]]:
    started: list[DaemonProcess] = []

    def start(config: Path, *extra: str, **kwargs: Any) -> DaemonProcess:
        process = DaemonProcess(config, *extra, **kwargs)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
