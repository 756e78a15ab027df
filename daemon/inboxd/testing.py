"""The test-only hooks: environment variables, all ``INBOXD_TEST_*``, that make the real daemon
misbehave on purpose where no input reliably does on a test machine. Unset (always, in
production) each does nothing; a fault hook that is set is announced loudly at start-up.

- ``INBOXD_TEST_MODEL_FAULTS`` (``models/faults.py``): the real model raises an OOM above a
  batch size, hangs on a call, or raises a device error from a call on.
- ``INBOXD_TEST_DECODE_FAULTS`` (``decode/worker_child.py``): a decode worker crashes, hangs,
  raises or runs slowly on the files named.
- ``INBOXD_TEST_COMMIT_PAUSE_MS`` (``files/durable.py``): every step of a group commit is
  widened, so a kill can be timed inside one.
- ``INBOXD_TEST_RAY_REPLICA_DELAY_S`` (``models/engines/ray_replica.py``): each Ray replica
  call is slowed, so that several are out at once.
"""

from __future__ import annotations

import os

PREFIX = "INBOXD_TEST_"
MODEL_FAULTS = f"{PREFIX}MODEL_FAULTS"
DECODE_FAULTS = f"{PREFIX}DECODE_FAULTS"
COMMIT_PAUSE_MS = f"{PREFIX}COMMIT_PAUSE_MS"
RAY_REPLICA_DELAY_S = f"{PREFIX}RAY_REPLICA_DELAY_S"
HOOKS = (MODEL_FAULTS, DECODE_FAULTS, COMMIT_PAUSE_MS, RAY_REPLICA_DELAY_S)


def hook(name: str) -> str:
    """The hook's value in this process's environment ('' when unset)."""
    assert name in HOOKS, f"{name} is no test hook"
    return os.environ.get(name, "")
