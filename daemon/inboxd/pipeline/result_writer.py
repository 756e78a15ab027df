"""The result writer. Model outcomes → durable JSON results → the source moved on.

A batch's results are written together (group commit, ``files.results``): every JSON to its
temp file, all of them fdatasynced in parallel, renamed into place, each results folder fsynced
once, and only then do the sources move (so no source ever moves before its result is safe).
That commit runs in the commit process (``files/commit_child.py`` says why), handed each batch
by this stage's io thread. Up to ``COMMITS_IN_FLIGHT`` batches are there at once (the layer
``committing``, ``pipeline.committing``): it commits one while the next waits in its pipe, so it
never waits for this stage between two, and this stage logs one batch's outcomes while the next
is being committed.
The hand-off from the model stage holds one batch more: the model infers while batches are
being written; with several calls in flight, the finished ones wait on ``submit()`` inside their
in-flight slots, so the model stage's bound still counts them.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from inboxd import __version__
from inboxd.config import Config
from inboxd.files.commits import CommitEntry, Commits, Committed
from inboxd.files.durable import output_full
from inboxd.files.lifecycle import Lifecycle
from inboxd.files.names import relative_inside
from inboxd.item import ModelError, PermanentError, TransientError, WorkItem
from inboxd.models.engines.interface import Outcome
from inboxd.models.predictions import (
    Embedding,
    Prediction,
    TaskAnswer,
    TaskModel,
    TaskResults,
    not_finite,
)
from inboxd.models.weights import weights_sha256
from inboxd.pipeline.committing import Committing
from inboxd.pipeline.outcomes import Outcomes, RunIO, utc_now

HANDOFF_BATCHES = 1


class ResultWriter:
    name = "result_writer"

    def __init__(
        self,
        config: Config,
        model: TaskModel,
        lifecycle: Lifecycle,
        commits: Commits,
        outcomes: Outcomes,
        run_io: RunIO[Any],
        clock: Callable[[], float],
        tasks: dict[str, TaskModel] | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.tasks = tasks or {}  # models: each task's model, for its section
        self.lifecycle = lifecycle
        self.commits = commits
        self.outcomes = outcomes
        self.run_io = run_io
        self.clock = clock
        self.handoff: asyncio.Queue[list[Outcome]] = asyncio.Queue(maxsize=HANDOFF_BATCHES)
        self.high_water = 0
        self.committing = Committing()
        self.crashed_with: list[WorkItem] = []  # the batch whose write raised
        self.abandoned: list[tuple[list[tuple[WorkItem, Prediction]],
                                   list[Future[Committed]]]] = []
        # The weights' sha256 each result records: retrained weights' results told apart.
        self.model_sha256 = weights_sha256(config.model)
        self.task_sha256 = {task: weights_sha256(block)
                            for task, block in (config.models or {}).items()}

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
        committing = self.committing
        getter: asyncio.Future[list[Outcome]] | None = None
        try:
            while True:
                while committing.size >= committing.capacity:
                    await committing.reap()
                getter = asyncio.ensure_future(self.handoff.get())
                while not getter.done():
                    await committing.reap(getter)
                committing.add(asyncio.create_task(self._write_and_finish(getter.result()),
                                                   name="commit"))
                getter = None
        finally:
            if getter is not None:
                getter.cancel()
            for write in committing.writes:
                write.cancel()
            committing.writes.clear()  # the last stats record must not count them

    async def _write_and_finish(self, batch: list[Outcome]) -> None:
        try:
            await self._write(batch)
        except Exception:
            self.crashed_with = [item for item, _ in batch]  # what the crash ledger counts
            raise
        finally:
            self.handoff.task_done()

    async def _write(self, batch: list[Outcome]) -> None:
        good: list[tuple[WorkItem, Prediction]] = []
        for item, outcome in batch:
            if isinstance(outcome, TaskResults):
                outcome = _checked_sections(outcome)
            why = None if isinstance(outcome, Exception) else not_finite(outcome)
            if why is not None:  # the same input gives the same numbers: no retry
                outcome = ModelError(f"the model's output for this file is not a number "
                                     f"({why} are NaN or infinite)")
            if isinstance(outcome, Exception):
                await self.outcomes.error(item, outcome)
            else:
                good.append((item, outcome))
        if not good:
            return
        # Each answer made once: the documents (made again if a full disk holds the batch)
        # and the ``completed`` records are made from it.
        answers = {id(item): self._answer(item, result) for item, result in good}
        for part, committed in await self._commit(good, answers):
            await self._settle(part, committed, answers)

    async def _settle(self, good: list[tuple[WorkItem, Prediction]], committed: Committed,
                      answers: dict[int, dict[str, Any]]) -> None:
        if committed.error is not None:
            why = committed.error.strerror or str(committed.error)
            for item, _ in good:
                await self.outcomes.error(item, TransientError(f"cannot write the result: {why}"))
            return
        self.outcomes.outputs.wrote()
        for item, existed, problem in _filed(good, committed):
            if problem is None:
                self.outcomes.completed(item, duplicate=existed, answer=answers[id(item)])
            elif not item.name:  # no result: this file's own permanent problem
                item.finishing = item.name = None
                await self.outcomes.error(item, PermanentError(problem.strerror or str(problem)))
            else:
                # The result is durable: only the move is retried, never the work.
                await self.outcomes.finish_later(item, problem)

    async def _commit(self, good: list[tuple[WorkItem, Prediction]],
                      answers: dict[int, dict[str, Any]]
                      ) -> list[tuple[list[tuple[WorkItem, Prediction]], Committed]]:
        """``good``'s results filed and their sources moved, by the commit process: each part
        sent with what it came to. A results folder that cannot take more holds the batch
        here, its predictions kept, until a probe finds room (``pipeline/full_outputs.py``);
        then it is sent again, its documents made anew (they say when they were filed). A
        batch refused again after a probe passed is bigger than the room there is (a probe
        writes less than a batch of vectors): it is sent in halves, so what fits is filed
        rather than the whole batch waiting while ``df`` shows free space."""
        held = False
        while True:
            committed = await self._send(good, answers)
            if committed.error is None or not output_full(committed.error):
                return [(good, committed)]
            if held and len(good) > 1:
                half = len(good) // 2
                return [*await self._commit(good[:half], answers),
                        *await self._commit(good[half:], answers)]
            await self.outcomes.outputs.hold(self._full_folder(committed.error),
                                             committed.error)
            held = True

    async def _send(self, good: list[tuple[WorkItem, Prediction]],
                    answers: dict[int, dict[str, Any]]) -> Committed:
        """One try at filing ``good`` (the commit process's answer, errors included)."""
        completed_at = utc_now()  # a batch's documents are made, and filed, together
        entries = [CommitEntry(item.key, item.sha256 or "",
                               self.document(item, result, answers[id(item)], completed_at),
                               item.claimed_path, item.inbox_path,
                               _vector(result))
                   for item, result in good]
        sent: list[Future[Committed]] = []  # filled by the io thread, even if cancelled
        try:
            await self.run_io(functools.partial(_send, self.commits, entries, sent))
            committed = await asyncio.wrap_future(sent[0])
        except asyncio.CancelledError:
            # A stop past its grace period: the commit process still commits what it was
            # sent (cancelling cannot stop it); ``count_abandoned`` counts it afterwards.
            self.abandoned.append((good, sent))
            raise
        return committed

    def _full_folder(self, error: OSError) -> str:
        """The folder a commit's full-disk error is about: results/ (its temp folder is in
        it), or the folder of another file the commit writes (the index)."""
        results = os.fspath(self.config.results_dir)
        where = error.filename if isinstance(error.filename, str) else None
        if where is None or relative_inside(where, results) is not None or where == results:
            return results
        return os.path.dirname(where) or results

    def count_abandoned(self) -> None:
        """Once the io thread and the commit process have ended: the files of batches a stop
        cancelled on their way to it or in it whose sources reached done/ are completed. The
        others are still claimed, and the recovery that follows hands them back to the inbox."""
        for good, sent in self.abandoned:
            if not sent or not sent[0].done() or sent[0].exception() is not None:
                continue  # never sent, or the process died with it: nothing of it moved
            committed = sent[0].result()
            if committed.error is None:
                for item, existed, problem in _filed(good, committed):
                    if problem is None:
                        self.outcomes.completed(item, duplicate=existed)
        self.abandoned.clear()

    def document(self, item: WorkItem, result: Prediction, answer: dict[str, Any],
                 completed_at: str) -> dict[str, Any]:
        """The result JSON as filed under the file's own key (``files.commits.filed_document``
        adjusts it when another name is taken); ``answer`` is ``_answer(item, result)``."""
        if not isinstance(result, TaskResults):  # with several, each section says what ran
            answer = {
                "model": self.model.name,
                "model_sha256": self.model_sha256,
                "device": str(self.model.device),
                "runtime": item.runtime or self.model.runtime,
                "precision": item.precision or self.model.precision,
                **answer,
            }
        return {
            "source": item.key,
            "sha256": item.sha256,
            "size_bytes": item.size_bytes,
            "source_identity": list(item.identity) if item.identity else None,
            **answer,
            "image": item.image_info,
            "timings_ms": item.timings_ms(self.clock()),
            "attempts": item.attempts + 1,
            "instance": self.config.instance,
            "completed_at": completed_at,
            "inboxd_version": __version__,
        }

    def _section(self, task: str, outcome: TaskAnswer | Exception, result: TaskResults,
                 item: WorkItem) -> dict[str, Any]:
        model = self.tasks[task]
        runtime, precision = result.ran.get(task, ("", ""))
        section: dict[str, Any] = {"model": model.name,
                                   "model_sha256": self.task_sha256.get(task),
                                   "device": str(model.device),
                                   "runtime": runtime or model.runtime,
                                   "precision": precision or model.precision}
        if isinstance(outcome, Exception):
            # This task failed on this photo; the photo's other answers stand.
            return {**section, "error": str(outcome) or type(outcome).__name__,
                    "reason_class": (outcome.reason_class
                                     if isinstance(outcome, PermanentError | TransientError)
                                     else "model")}
        return {**section, **self._output(outcome, item)}

    def _answer(self, item: WorkItem, result: Prediction) -> dict[str, Any]:
        """What the model said, as the result holds it (each task's section under its name)."""
        if isinstance(result, TaskResults):
            return {task: self._section(task, outcome, result, item)
                    for task, outcome in result.sections.items()}
        return self._output(result, item)

    def _output(self, result: TaskAnswer, item: WorkItem) -> dict[str, Any]:
        return result.result_fields(
            item.image_info["width"], item.image_info["height"],
            os.path.basename(self.lifecycle.results.vector_file(item.key)))


def _checked_sections(result: TaskResults) -> TaskResults:
    """A section whose numbers are not finite becomes that task's model error."""
    sections: dict[str, TaskAnswer | Exception] = {}
    for task, outcome in result.sections.items():
        why = None if isinstance(outcome, Exception) else not_finite(outcome)
        sections[task] = outcome if why is None else ModelError(
            f"the model's output for this file is not a number ({why} are NaN or infinite)")
    return TaskResults(sections, result.ran)


def _vector(result: Prediction) -> Any:
    """The embedding written beside the result (``models:`` allows one embedding task)."""
    if isinstance(result, Embedding):
        return result.vector
    if isinstance(result, TaskResults):
        for outcome in result.sections.values():
            if isinstance(outcome, Embedding):
                return outcome.vector
    return None


def _send(commits: Commits, entries: list[CommitEntry], sent: list[Future[Committed]]) -> None:
    sent.append(commits.send(entries))


def _filed(good: list[tuple[WorkItem, Prediction]],
           committed: Committed) -> Iterator[tuple[WorkItem, bool, OSError | None]]:
    """Each file of a committed batch, its result's name set on it: (item, whether that result
    was there already, why its source could not move or None)."""
    for (item, _), (name, existed), problem in zip(good, committed.filed, committed.moves,
                                                   strict=True):
        item.finishing, item.name = "success", name
        yield item, existed, problem
