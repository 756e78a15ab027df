"""Frames between the daemon and its decode workers: a JSON header and raw bytes, over pipes.

Not pickle: a worker parses hostile bytes, and whatever it sends back must not be able to run
code in the daemon. Each frame is ``>II`` (header length, payload length), the header as UTF-8
JSON, then the payload (a decoded crop, ``crop``×``crop``×3 bytes; 150 KB at 224).
"""

from __future__ import annotations

import json
import os
import select
import struct
import time
from typing import Any

PREFIX = struct.Struct(">II")
MAX_HEADER_BYTES = 1 << 16


class WireError(Exception):
    """The other side sent something that is not a frame (or more than it may)."""


def send(fd: int, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    """One frame, the payload written from where it lies (``writev``: never copied into the
    frame; a decoded crop is sent straight from its array)."""
    encoded = json.dumps(header).encode()
    payload = memoryview(payload).cast("B")
    views = [memoryview(PREFIX.pack(len(encoded), payload.nbytes) + encoded), payload]
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if written:
            views[0] = views[0][written:]


def recv(fd: int, deadline_s: float | None = None,
         max_payload_bytes: int = 1 << 30) -> tuple[dict[str, Any], bytearray]:
    """One frame. ``EOFError`` when the other side has gone, ``TimeoutError`` when nothing
    complete arrived by ``deadline_s`` (``time.monotonic()``), ``WireError`` for garbage."""
    header_bytes, payload_bytes = PREFIX.unpack(_read_exactly(fd, PREFIX.size, deadline_s))
    if header_bytes > MAX_HEADER_BYTES or payload_bytes > max_payload_bytes:
        raise WireError(f"frame too large: header {header_bytes}, payload {payload_bytes} bytes")
    try:
        header = json.loads(_read_exactly(fd, header_bytes, deadline_s))
    except ValueError as exc:
        raise WireError(f"header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise WireError("header is not a JSON object")
    return header, _read_exactly(fd, payload_bytes, deadline_s)


def _read_exactly(fd: int, size: int, deadline_s: float | None) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    poller = select.poll()  # not select(): it fails on descriptors past 1024
    poller.register(fd, select.POLLIN)
    while got < size:
        if deadline_s is not None:
            wait_ms = (deadline_s - time.monotonic()) * 1000
            if wait_ms <= 0 or not poller.poll(wait_ms):
                raise TimeoutError
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise EOFError
        got += n
    return buffer
