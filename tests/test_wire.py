"""The frames between the daemon and its decode workers, on real pipes: what a worker that lost
its mind (or was taken over by a decoder exploit) can send must end in an error, never in a
hang, a crash or a payload larger than the daemon allowed."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from inboxd import wire


@pytest.fixture
def pipe() -> Iterator[tuple[wire.Reader, int]]:
    read_fd, write_fd = os.pipe()
    yield wire.Reader(read_fd), write_fd
    os.close(read_fd)
    with contextlib.suppress(OSError):  # the test closed it (EOF)
        os.close(write_fd)


def frame(header: bytes, payload: bytes = b"") -> bytes:
    return struct.pack(">II", len(header), len(payload)) + header + payload


def test_frames_written_together_are_read_in_order_with_their_payloads(pipe) -> None:
    reader, write_fd = pipe
    wire.send(write_fd, {"n": 1}, b"abc")
    wire.send(write_fd, {"n": 2})
    wire.send(write_fd, {"n": 3}, memoryview(b"xyz" * 10))
    assert reader.recv(time.monotonic() + 5) == ({"n": 1}, bytearray(b"abc"))
    assert reader.recv(time.monotonic() + 5) == ({"n": 2}, bytearray())
    assert reader.recv(time.monotonic() + 5) == ({"n": 3}, bytearray(b"xyz" * 10))


def test_a_payload_larger_than_the_pipe_arrives_whole(pipe) -> None:
    reader, write_fd = pipe
    payload = os.urandom(224 * 224 * 3)  # a 224 crop: 150 KB, more than a pipe holds
    sender = threading.Thread(target=wire.send, args=(write_fd, {"ok": True}, payload))
    sender.start()
    header, got = reader.recv(time.monotonic() + 10, max_payload_bytes=len(payload))
    sender.join()
    assert header == {"ok": True} and bytes(got) == payload


def test_a_frame_that_trickles_in_is_waited_for(pipe) -> None:
    reader, write_fd = pipe
    data = frame(json.dumps({"slow": True}).encode(), b"p" * 100)

    def trickle() -> None:
        for start in range(0, len(data), 7):
            os.write(write_fd, data[start:start + 7])
            time.sleep(0.002)

    sender = threading.Thread(target=trickle)
    sender.start()
    assert reader.recv(time.monotonic() + 10) == ({"slow": True}, bytearray(b"p" * 100))
    sender.join()


@pytest.mark.parametrize("data, why", [
    (struct.pack(">II", wire.MAX_HEADER_BYTES + 1, 0), "frame too large"),
    (struct.pack(">II", 2, 1 << 30) + b"{}", "frame too large"),
    (frame(b"not json"), "not JSON"),
    (frame(b"[1, 2]"), "not a JSON object"),
    (frame(b"\xff\xfe"), "not JSON"),
])
def test_garbage_is_a_wire_error(pipe, data: bytes, why: str) -> None:
    reader, write_fd = pipe
    os.write(write_fd, data)
    with pytest.raises(wire.WireError, match=why):
        reader.recv(time.monotonic() + 5, max_payload_bytes=1 << 20)


def test_a_sender_that_dies_mid_frame_is_eof(pipe) -> None:
    reader, write_fd = pipe
    os.write(write_fd, frame(b'{"a": 1}', b"12345678")[:-3])
    os.close(write_fd)
    with pytest.raises(EOFError):
        reader.recv(time.monotonic() + 5)


def test_a_half_frame_that_never_finishes_times_out(pipe) -> None:
    reader, write_fd = pipe
    os.write(write_fd, frame(b'{"a": 1}', b"12345678")[:5])
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        reader.recv(started + 0.3)
    assert time.monotonic() - started < 5
