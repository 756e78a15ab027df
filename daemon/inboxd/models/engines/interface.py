"""The one interface the model stage talks to: where a batch runs is an engine.

An engine takes a batch of decoded items and returns, for each, a prediction or that item's own
error. ``LocalEngine`` runs the model in a thread of this process; another engine (a process
pool, a remote pool) only has to keep the same promise: every item comes back exactly once, and
an error is attached to the item it belongs to.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from inboxd.item import WorkItem
from inboxd.models.predictions import Prediction

if TYPE_CHECKING:  # the fast path is torch's: a daemon that serves without torch has none
    from inboxd.models.fast_path import FastPath

Outcome: TypeAlias = "tuple[WorkItem, Prediction | Exception]"

# What cuDNN, cuBLAS and the CUDA runtime put in the RuntimeErrors they raise when a kernel
# cannot run: not an input's problem, and the context is usually unusable afterwards.
DEVICE_ERROR_MARKERS = ("CUDA error", "CUDNN_STATUS_", "cuDNN error", "CUBLAS_STATUS_",
                        "cuBLAS error", "unspecified launch failure", "illegal memory access",
                        "uncorrectable ECC error", "device-side assert")


class DeviceFault(Exception):
    """The device, not an input, failed: every later call would fail too (a poisoned CUDA
    context, a lost GPU). The batch goes back to disk and the process must restart."""


def is_device_error(exc: BaseException) -> bool:
    # torch's exception types are asked for only where torch is loaded: an error cannot be
    # one of them otherwise, and importing torch to find out would load it into every daemon.
    torch = sys.modules.get("torch")
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in DEVICE_ERROR_MARKERS)


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA out-of-memory (``torch.cuda.OutOfMemoryError``): the batch is halved."""
    torch = sys.modules.get("torch")
    out_of_memory = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    return out_of_memory is not None and isinstance(exc, out_of_memory)


class EngineUnavailable(Exception):
    """Where the model runs cannot be reached now (a Ray cluster that is gone). Nobody's fault
    and no file's attempt: the model stage holds the batch, waits ``retry_after_s`` and sends
    it again, so the backlog waits on disk behind it."""

    def __init__(self, why: str, retry_after_s: float) -> None:
        super().__init__(why)
        self.retry_after_s = retry_after_s


class ModelEngine(Protocol):
    """What the model stage, the watchdog and the stats record ask of an engine. The optional
    capabilities have defaults here, for an engine that subclasses this one to inherit; mypy
    checks each engine against every member, so a renamed capability is an error, not a
    silent fallback."""

    # Takes several calls at once (up to ``capacity.in_flight_batches``); else one at a time.
    parallel_calls: bool = False
    # The most calls it runs at once, where it has a bound of its own (one thread each); None:
    # as many as the stage sends.
    max_calls: int | None = None
    # The longest one ``infer`` may legitimately take, for an engine that times its calls out
    # itself (the watchdog then waits that long); 0: no limit of its own.
    call_limit_s: float = 0.0
    # A faster runner being brought in beside the model (``models/fast_path.py``), if any: the
    # ``started`` record and the stats say how far it got.
    fast: FastPath | None = None

    def stats_fields(self) -> dict[str, Any]:
        """The engine's own fields of the stats record (``stats.FIELDS`` declares them)."""
        return {}

    async def warm_up(self, max_size: int) -> tuple[list[int], float]:
        """Run the batch sizes up to ``max_size`` once where inference will run (sizes already
        warmed are skipped; a ``ConfigError`` for one the model cannot take). Returns the sizes
        warmed and the seconds it took."""
        ...

    async def infer(self, batch: list[WorkItem]) -> list[Outcome]:
        """One outcome per item of ``batch``, in any order; ``DeviceFault`` when the device,
        not an input, failed; ``EngineUnavailable`` when the model cannot be reached now."""
        ...

    def close(self) -> None:
        """Stop without waiting for a call in progress (it may be hung)."""
        ...


def calls_out(engine: ModelEngine, in_flight: int) -> int:
    """The calls a model stage keeps out on ``engine`` given ``capacity.in_flight_batches``:
    one where it takes one at a time, else ``in_flight`` up to the engine's own bound (a call
    sent beyond it would only wait in the engine, holding its batch out of the bounded
    layers)."""
    if not engine.parallel_calls:
        return 1
    return min(in_flight, engine.max_calls) if engine.max_calls is not None else in_flight
