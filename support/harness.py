"""Small helpers every harness writes otherwise: a free port, a sha256, a log line."""

from __future__ import annotations

import hashlib
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    return sha256_hex(path.read_bytes())


def logger(tag: str) -> Callable[[str], None]:
    """A ``log(message)`` that prints ``[tag HH:MM:SS] message`` to stderr at once."""

    def log(message: str) -> None:
        print(f"[{tag} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    return log
