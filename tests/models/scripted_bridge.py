"""A stand-in for ``inboxd.models.engines.ray_bridge_child`` that speaks its protocol without Ray,
and misbehaves as ``settings["script"]`` says (run by
``tests/models/test_ray_bridge_faults.py``)."""

from __future__ import annotations

import sys
import time
import types
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

# Pickled under the real class's name without importing it (and torch with it): this process
# starts in a tenth of the time, and the daemon unpickles a real Classification.
model_module = types.ModuleType("inboxd.models.model")
sys.modules[model_module.__name__] = model_module


@dataclass
class Classification:
    top_k: list[dict[str, Any]]


Classification.__module__ = model_module.__name__
model_module.Classification = Classification  # type: ignore[attr-defined]


def reply(crops: list[object]) -> dict[str, object]:
    return {"replica": "scripted:1", "ms": 1.0,
            "outcomes": [("ok", Classification([{"label": f"n{n}", "index": n, "score": 1.0}]))
                         for n in range(len(crops))]}


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    script = conn.recv()["script"]
    if script == "bad_hello":
        conn.send(("ready", "no info"))
        time.sleep(60)
    conn.send(("ready", {"app_name": "scripted", "reused": False, "nodes": 1,
                         "replicas": {"RUNNING": 1}}))
    while True:
        try:
            _, call_id, crops, _ = conn.recv()
        except EOFError:
            return
        answer = reply(crops)
        if script == "hold":  # never answers: the test kills this process
            continue
        if script == "short":
            answer["outcomes"] = answer["outcomes"][:-1]  # type: ignore[index]
        elif script == "stray":
            answer["outcomes"] = [("ok", "not a prediction"), ("weird", None),
                                  *answer["outcomes"][2:]]  # type: ignore[index]
        elif script == "no_replica":
            del answer["replica"]
        elif script == "garbage":
            conn.send_bytes(b"\x80\x05 this is not a pickle")
            time.sleep(60)
        elif script == "truncated":  # a header for 1000 bytes, 10 of them, then silence
            conn._send(b"\x00\x00\x03\xe8" + b"x" * 10)  # type: ignore[attr-defined]
            time.sleep(60)
        elif script == "strangers":  # answers nobody's call first, and no reply at all
            conn.send(("result", call_id + 1000, answer))
            conn.send(("bogus",))
            conn.send("a string")
        conn.send(("result", call_id, answer))


if __name__ == "__main__":
    main()
