"""Frames between the daemon and its helper processes: a JSON header and raw bytes, over pipes.

Not pickle: a decode worker parses hostile bytes, and whatever it sends back must not be able to
run code in the daemon. Each frame is ``>II`` (header length, payload length), the header as
UTF-8 JSON, then the payload (a decoded crop, ``crop``×``crop``×3 bytes, 150 KB at 224; a batch's
embedding vectors on their way to the commit process).
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
# A read takes what is there up to this (a pipe holds 64 KiB): several small replies at once.
READ_BYTES = 1 << 16


class WireError(Exception):
    """The other side sent something that is not a frame (or more than it may)."""


def send(fd: int, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    """One frame, the payload written from where it lies (``writev``: never copied into the
    frame; a decoded crop is sent straight from its array)."""
    write(fd, frame(header, payload))


def frame(header: dict[str, Any], payload: bytes | memoryview = b"") -> list[memoryview]:
    """One frame's pieces, ready for ``write`` (encoding raises here, before anything is
    written)."""
    encoded = json.dumps(header).encode()
    payload = memoryview(payload).cast("B")
    return [memoryview(PREFIX.pack(len(encoded), payload.nbytes) + encoded), payload]


def write(fd: int, views: list[memoryview]) -> None:
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if written:
            views[0] = views[0][written:]


class Reader:
    """Frames from one descriptor, read in large pieces: a reply of a few KB costs one
    ``read``, and the frames a busy worker wrote meanwhile come in with it. Keep one per
    descriptor (what it read ahead belongs to the next frame)."""

    def __init__(self, fd: int, max_header_bytes: int = MAX_HEADER_BYTES) -> None:
        self.fd = fd
        self.max_header_bytes = max_header_bytes
        self.buffer = bytearray()
        self.poller = select.poll()  # not select(): it fails on descriptors past 1024
        self.poller.register(fd, select.POLLIN)

    def recv(self, deadline_s: float | None = None,
             max_payload_bytes: int = 1 << 30) -> tuple[dict[str, Any], bytearray]:
        """One frame. ``EOFError`` when the other side has gone, ``TimeoutError`` when nothing
        complete arrived by ``deadline_s`` (``time.monotonic()``), ``WireError`` for garbage."""
        self._fill(PREFIX.size, deadline_s)
        header_bytes, payload_bytes = PREFIX.unpack_from(self.buffer)
        if header_bytes > self.max_header_bytes or payload_bytes > max_payload_bytes:
            raise WireError(f"frame too large: header {header_bytes}, payload {payload_bytes} "
                            "bytes")
        end = PREFIX.size + header_bytes + payload_bytes
        self._fill(end, deadline_s)
        try:
            header = json.loads(self.buffer[PREFIX.size:PREFIX.size + header_bytes])
        except ValueError as exc:
            raise WireError(f"header is not JSON: {exc}") from exc
        if not isinstance(header, dict):
            raise WireError("header is not a JSON object")
        payload = self.buffer[PREFIX.size + header_bytes:end]
        del self.buffer[:end]
        return header, payload

    def _fill(self, size: int, deadline_s: float | None) -> None:
        """At least ``size`` bytes in the buffer."""
        while len(self.buffer) < size:
            if deadline_s is not None:
                wait_ms = (deadline_s - time.monotonic()) * 1000
                if wait_ms <= 0 or not self.poller.poll(wait_ms):
                    raise TimeoutError
            chunk = os.read(self.fd, max(READ_BYTES, size - len(self.buffer)))
            if not chunk:
                raise EOFError
            self.buffer += chunk
