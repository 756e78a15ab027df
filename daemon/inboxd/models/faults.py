"""Fault injection for the fault tests, through one environment variable.

``INBOXD_TEST_MODEL_FAULTS="oom_above_batch=2,hang_on_batch=5"`` makes the real model, in the real
daemon, raise ``torch.cuda.OutOfMemoryError`` for batches larger than 2, or block for ever on
the 5th model call; ``device_error_from_batch=3`` makes the 3rd and every later call raise
``torch.AcceleratorError`` (a poisoned CUDA context). It is the only way to show on a CPU
machine that a batch is halved on OOM, that a hung model call stops the watchdog and that a
broken device ends the process instead of failing every file. Unset (always, in production)
it does nothing; when set, the daemon says so loudly at start-up.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from inboxd import logs, testing

ENV = testing.MODEL_FAULTS
KNOWN = {"oom_above_batch", "hang_on_batch", "device_error_from_batch"}


def parse(spec: str) -> dict[str, int]:
    faults: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        if name not in KNOWN:
            raise ValueError(f"{ENV}: unknown fault {name!r} (known: {', '.join(sorted(KNOWN))})")
        faults[name] = int(value)
    return faults


def install(model: Any) -> None:
    spec = testing.hook(ENV)
    if not spec:
        return
    faults = parse(spec)
    calls = {"n": 0}
    never = threading.Event()

    def before_forward(batch_size: int) -> None:
        calls["n"] += 1
        if calls["n"] == faults.get("hang_on_batch"):
            never.wait()  # a CUDA call that never returns
        poisoned_from = faults.get("device_error_from_batch")
        if poisoned_from is not None and calls["n"] >= poisoned_from:
            # What a CUDA context raises for ever after an illegal address or an Xid.
            raise torch.AcceleratorError(
                f"CUDA error: an illegal memory access was encountered (injected by {ENV})")
        limit = faults.get("oom_above_batch")
        if limit is not None and batch_size > limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected by {ENV})")

    model.before_forward = before_forward
    logs.emit(logging.WARNING, "faults", f"FAULT INJECTION ACTIVE: {ENV}={spec}", faults=spec)
