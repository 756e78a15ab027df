"""A stand-in for ``inboxd.decode.worker_child`` that speaks its protocol without decoding anything,
and misbehaves as ``SCRIPTED_WORKER`` says (run by ``tests/decode/test_pool_protocol.py``).

Each reply is a duplicate (no payload) whose ``sha256`` is the file's own ``path_hex``, so a
test can tell which file a result was really meant for.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from inboxd import wire

MODE_ENV = "SCRIPTED_WORKER"


def reply(entry: dict[str, Any], request: dict[str, Any], index: int) -> dict[str, Any]:
    header = {"ok": True, "duplicate": True, "sha256": entry["path_hex"], "size_bytes": 1,
              "peak_rss_bytes": 0, "recycle": False}
    # Echo whatever the daemon numbered the request with, as the real worker does.
    header.update({key: request[key] for key in ("request",) if key in request}, file=index)
    return header


def frame(header: str) -> bytes:
    return wire.PREFIX.pack(len(header), 0) + header.encode()


def main() -> None:
    mode, _, arg = os.environ.get(MODE_ENV, "").partition(":")
    requests, replies = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    reader = wire.Reader(requests, 1 << 20)
    reader.recv()  # init
    wire.send(replies, {"ready": True, "pid": os.getpid(), "limit_error": None})
    served = 0
    while True:
        try:
            request, _ = reader.recv()
        except EOFError:
            return
        served += 1
        ack: dict[str, Any] = {"ack": True}
        if "request" in request:
            ack["request"] = request["request"]
        if mode == "garbage_ack":
            os.write(replies, b"\x00\x00\x00\x05\x00\x00\x00\x00hello")
            continue
        if mode == "ack_not_true":
            wire.send(replies, {"ack": "yes"})
            continue
        wire.send(replies, ack)
        files = request["files"]
        for index, entry in enumerate(files):
            if mode == "fewer" and index == len(files) - 1:
                break  # never answers the last: the daemon's deadline must end it
            if mode == "slow":
                time.sleep(float(arg))  # each file legitimately slow, none over the limit
            header = reply(entry, request, index)
            marked = bytes.fromhex(entry["path_hex"]).endswith(b"/f1.png")
            if mode == "infinity" and marked:  # JSON that json.loads takes: a float inf
                os.write(replies, frame(json.dumps(header).replace('"peak_rss_bytes": 0',
                                                                   '"peak_rss_bytes": Infinity')))
                continue
            if mode == "short_identity" and marked:  # a file identity of one number, not 3
                header.update(identity=[1])
            if mode == "small_crop" and marked:  # a decoded image, not crop x crop x 3
                header.update(duplicate=False, shape=[2, 2, 3], width=2, height=2)
                wire.send(replies, header, bytes(12))
                continue
            wire.send(replies, header)
        if mode == "extra_reply" and served == 1:  # one reply more than there were files
            wire.send(replies, reply({"path_hex": "stale"}, request, len(files)))
        if mode == "extra_ack" and served == 1:  # a receipt nobody asked for
            wire.send(replies, ack)


if __name__ == "__main__":
    sys.exit(main())
