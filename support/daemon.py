"""The real daemon as a test drives it: ``python -m inboxd`` as a child process with its output
collected line by line, and the files dropped into its inbox."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from support.records import line_fields
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
    """``python -m inboxd run`` as a child process, its stderr collected line by line."""

    def __init__(self, config: Path, *extra: str, env: dict[str, str] | None = None,
                 command: str = "run", prefix: Sequence[str] = ()) -> None:
        self.config = config
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "inboxd", command, "-c", str(config), *extra],
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


def last_stats(lines: list[str]) -> dict[str, str]:
    """The KEY=value fields of the last stats line a daemon printed."""
    return line_fields(lines[-1])
