"""Stage 6: the result writer. Model outcomes → durable JSON results → the source moved on.

A batch's results are written together: each JSON is fsynced, renamed into place, and each
results folder fsynced once, and only then do the sources move (so durability costs one
directory fsync per batch, not per file, and no source ever moves before its result is safe).
The hand-off from the model worker holds one batch: the model infers batch n+1 while batch n is
being written, and waits if writing falls behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from inboxd import __version__
from inboxd.config import Config
from inboxd.files.embeddings import embedding_path, write_embeddings
from inboxd.files.lifecycle import Lifecycle
from inboxd.item import TransientError, WorkItem
from inboxd.models.engine import Outcome
from inboxd.models.model import Embedding, Model, Prediction
from inboxd.pipeline.outcomes import Outcomes, RunIO, utc_now

HANDOFF_BATCHES = 1


class ResultWriter:
    name = "write_handoff"

    def __init__(
        self,
        config: Config,
        model: Model,
        lifecycle: Lifecycle,
        outcomes: Outcomes,
        run_io: RunIO[Any],
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.model = model
        self.lifecycle = lifecycle
        self.outcomes = outcomes
        self.run_io = run_io
        self.clock = clock
        self.handoff: asyncio.Queue[list[Outcome]] = asyncio.Queue(maxsize=HANDOFF_BATCHES)
        self.high_water = 0

    @property
    def size(self) -> int:
        return self.handoff.qsize()

    @property
    def capacity(self) -> int:
        return HANDOFF_BATCHES

    async def submit(self, outcomes: list[Outcome]) -> None:
        await self.handoff.put(outcomes)
        self.high_water = max(self.high_water, self.handoff.qsize())

    async def run(self) -> None:
        while True:
            batch = await self.handoff.get()
            try:
                await self._write(batch)
            finally:
                self.handoff.task_done()

    async def _write(self, batch: list[Outcome]) -> None:
        good: list[tuple[WorkItem, Prediction]] = []
        for item, outcome in batch:
            if isinstance(outcome, Exception):
                await self.outcomes.error(item, outcome)
            else:
                good.append((item, outcome))
        if not good:
            return
        documents = [(item.key, self.document(item, result)) for item, result in good]
        vectors = [(item.key, result.vector) for item, result in good
                   if isinstance(result, Embedding)]
        try:
            await self.run_io(lambda: self._write_files(vectors, documents))
        except OSError as exc:
            for item, _ in good:
                await self.outcomes.error(
                    item, TransientError(f"cannot write the result: {exc.strerror or exc}")
                )
            return
        moved = await self.run_io(lambda: [self._finish_source(item) for item, _ in good])
        for (item, _), problem in zip(good, moved, strict=True):
            if problem is None:
                self.outcomes.completed(item)
            else:
                # The result is durable; the retry finds it by sha256 and only moves the file.
                await self.outcomes.error(
                    item, TransientError(f"cannot move the source after success: {problem}")
                )

    def _write_files(self, vectors: list[tuple[str, Any]],
                     documents: list[tuple[str, dict[str, Any]]]) -> None:
        # Vectors first: a JSON result must never exist without the .npy it describes.
        if vectors:
            write_embeddings(self.lifecycle.results_dir, self.lifecycle.tmp_dir, vectors)
        self.lifecycle.write_results(documents)

    def _finish_source(self, item: WorkItem) -> OSError | None:
        try:
            self.lifecycle.finish_success(item.claimed_path, item.key, item.inbox / item.rel)
        except OSError as exc:
            return exc
        return None

    def document(self, item: WorkItem, result: Prediction) -> dict[str, Any]:
        image = item.image_info
        return {
            "source": item.key,
            "sha256": item.sha256,
            "size_bytes": item.size_bytes,
            "model": self.model.name,
            "device": str(self.model.device),
            "precision": self.model.precision,
            **self._output(item, result),
            "image": image,
            "timings_ms": item.timings_ms(self.clock()),
            "attempts": item.attempts + 1,
            "instance": self.config.instance,
            "completed_at": utc_now(),
            "inboxd_version": __version__,
        }

    def _output(self, item: WorkItem, result: Prediction) -> dict[str, Any]:
        if isinstance(result, Embedding):
            return {"embedding": {
                "file": embedding_path(self.lifecycle.results_dir, item.key).name,
                "dim": result.dim,
                "norm": round(result.norm, 6),
                "dtype": str(result.vector.dtype),
            }}
        return {"top_k": result.top_k}
