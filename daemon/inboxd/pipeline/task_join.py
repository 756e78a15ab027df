"""The task join (``models:``): each photo handed to every task, its one outcome once all answered.

A photo leaves the preprocess cache into the join only while the join has room
(``capacity.task_join`` photos). It is copied once per task (the copy carries that task's input,
cut from the one decode) onto each task's feed, from which the task's own batcher forms its
batches, in arrival order and at its own pace. The photo stays in the join until every task has
answered for it; then its answers are joined into one outcome (``models.tasks.joined``) and
handed to the result writer, so the photo's exactly-once outcome is decided once.

The join is the one layer a fast task can run ahead in: it holds the photos the slowest task has
not answered yet, at most its capacity. While it is full nothing more is taken from the cache,
which fills, the decoders wait and ``await queue.put()`` waits: the slowest task paces intake,
and the others run ahead of it by at most the join's capacity.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from inboxd.item import WorkItem
from inboxd.models.engines.interface import Outcome
from inboxd.models.predictions import Prediction
from inboxd.models.tasks import joined, task_copy


class TaskFeed:
    """One task's photos in the join that its batcher has not taken yet, oldest first. Never
    larger than the join, which holds every photo on it."""

    def __init__(self) -> None:
        self._twins: collections.deque[WorkItem] = collections.deque()
        self._arrived = asyncio.Event()

    def __len__(self) -> int:
        return len(self._twins)

    def push(self, twin: WorkItem) -> None:
        self._twins.append(twin)
        self._arrived.set()

    def discard(self, twin: WorkItem) -> None:
        """``twin`` off the feed if its batcher has not taken it yet. By identity: ``==`` on
        items compares their fields, images included (and two photos can share a name)."""
        for index, queued in enumerate(self._twins):
            if queued is twin:
                del self._twins[index]
                return

    def take_nowait(self) -> WorkItem | None:
        return self._twins.popleft() if self._twins else None

    async def get(self) -> WorkItem:
        while not self._twins:
            self._arrived.clear()
            await self._arrived.wait()
        return self._twins.popleft()

    async def wait_arrival(self, timeout_s: float) -> None:
        """Sleep until a photo arrives or ``timeout_s`` passes (a lost wake-up costs a re-check
        only)."""
        self._arrived.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._arrived.wait(), timeout_s)


@dataclass
class _Photo:
    item: WorkItem
    twins: dict[str, WorkItem]  # task -> the photo's copy for that task
    answers: dict[str, Prediction | Exception] = field(default_factory=dict)


class TaskJoin:
    """The layer ``task_join``: photos handed to the tasks and not yet answered by all."""

    name = "task_join"

    def __init__(
        self,
        tasks: list[str],
        capacity: int,
        deliver: Callable[[list[Outcome]], Awaitable[None]],
        release: Callable[[WorkItem, str], Awaitable[None]],
    ) -> None:
        self.tasks = tasks
        self._capacity = capacity
        self.deliver = deliver
        self.release = release
        self.feeds = {task: TaskFeed() for task in tasks}
        self._photos: dict[int, _Photo] = {}  # id(photo's item) -> photo
        self._of_twin: dict[int, _Photo] = {}  # id(a task's copy) -> its photo, until answered
        self._room = asyncio.Event()
        self.high_water = 0

    @property
    def size(self) -> int:
        return len(self._photos)

    @property
    def capacity(self) -> int:
        return self._capacity

    def has_room(self) -> bool:
        return len(self._photos) < self._capacity

    def resize(self, capacity: int) -> None:
        """SIGHUP: photos already in stay; the next enter once the join is below the bound."""
        self._capacity = capacity
        self._room.set()

    async def wait_room(self) -> None:
        while not self.has_room():
            self._room.clear()
            await self._room.wait()

    def admit(self, item: WorkItem) -> None:
        """Hand ``item`` to every task (the caller waited for room)."""
        photo = _Photo(item, {task: task_copy(item, index)
                              for index, task in enumerate(self.tasks)})
        item.image = None  # each copy holds its own task's input; the rest is freed as it goes
        self._photos[id(item)] = photo
        self.high_water = max(self.high_water, len(self._photos))
        for task, twin in photo.twins.items():
            self._of_twin[id(twin)] = photo
            self.feeds[task].push(twin)

    async def answered(self, task: str, outcomes: list[Outcome]) -> None:
        """A task's answers for a batch: each photo every task has now answered for is joined
        and handed on, once."""
        ready: list[Outcome] = []
        for twin, outcome in outcomes:
            photo = self._of_twin.pop(id(twin), None)
            if photo is None:  # given back meanwhile (another task's device failed)
                continue
            photo.answers[task] = outcome
            if len(photo.answers) < len(self.tasks):
                continue
            del self._photos[id(photo.item)]
            photo.item.inferred_s = max(t.inferred_s for t in photo.twins.values())
            ready.append(joined(photo.item, {t: (photo.twins[t], photo.answers[t])
                                             for t in self.tasks}))
        if ready:
            self._room.set()
            await self.deliver(ready)

    async def give_back(self, twin: WorkItem, why: str) -> None:
        """A task cannot answer for ``twin``'s photo (its device failed): the photo goes back
        to the inbox once, and no other task works on it any more."""
        photo = self._of_twin.pop(id(twin), None)
        if photo is None:
            return
        for task, other in photo.twins.items():
            self._of_twin.pop(id(other), None)
            self.feeds[task].discard(other)
        del self._photos[id(photo.item)]
        self._room.set()
        await self.release(photo.item, why)
