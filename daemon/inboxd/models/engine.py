"""The one interface the model stage talks to: where a batch runs is an engine.

An engine takes a batch of decoded items and returns, for each, a prediction or that item's own
error. ``LocalEngine`` runs the model in a thread of this process; another engine (a process
pool, a remote pool) only has to keep the same promise: every item comes back exactly once, and
an error is attached to the item it belongs to.
"""

from __future__ import annotations

from typing import Protocol

from inboxd.item import WorkItem
from inboxd.models.model import Prediction

Outcome = tuple[WorkItem, Prediction | Exception]


class ModelEngine(Protocol):
    async def infer(self, batch: list[WorkItem]) -> list[Outcome]:
        """One outcome per item of ``batch``, in any order."""
        ...

    def close(self) -> None:
        """Stop without waiting for a call in progress (it may be hung)."""
        ...
