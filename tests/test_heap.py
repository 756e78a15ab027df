"""The start-up heap is frozen: later full collections leave it alone, and the collector and
reference counting still free what is made or dropped afterwards. Each check runs in a fresh
interpreter with torch imported, as the daemon has it (freezing pytest's own heap would change
every later test)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import line_fields, write_config

PROBE = """
import gc, json, weakref
import torch  # what makes the daemon's heap large
from inboxd.heap import freeze_startup_heap

class Node:
    pass

kept = Node()  # made before the freeze, dropped after it
kept_ref = weakref.ref(kept)
figures = freeze_startup_heap()
walked = len(gc.get_objects())  # what a full collection now walks: not the frozen objects
del kept
cycle = Node()
cycle.self = cycle  # garbage only the collector can find, made after the freeze
cycle_ref = weakref.ref(cycle)
del cycle
gc.collect()
print(json.dumps({**figures, "walked": walked, "dropped_freed": kept_ref() is None,
                  "cycle_collected": cycle_ref() is None}))
"""


def test_a_full_collection_no_longer_walks_the_start_up_heap() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    found = json.loads(out)
    assert found["frozen_objects"] > 100_000, found  # torch alone leaves that many
    assert found["walked"] < found["frozen_objects"] / 20, found
    assert found["dropped_freed"] and found["cycle_collected"], found


@pytest.mark.daemon
def test_the_daemon_freezes_its_heap_before_it_is_ready(
        tmp_path: Path, daemon_factory: Callable[..., Any]) -> None:
    daemon = daemon_factory(write_config(tmp_path))
    [ready] = daemon.wait_for("ready")
    fields = line_fields(ready)
    # Serving from a cached ONNX artifact the daemon never imports torch: its start-up heap
    # (numpy, onnxruntime, asyncio, yaml, its own modules) is some 50 000 objects, not 10^5.
    assert int(fields["FROZEN_OBJECTS"]) > 20_000, ready
    assert float(fields["FREEZE_MS"]) >= 0
    assert daemon.stop() == 0
