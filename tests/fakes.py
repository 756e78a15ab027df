"""Fakes for the model and watcher boundaries, for unit tests that need neither to be real, and
the commit moved into the test's process where a test fakes the disk."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import watchfiles
from inboxd.config import load_config
from inboxd.decode.spec import PreprocessSpec
from inboxd.files.commits import CommitEntry, Commits, Committed, Outputs, commit
from inboxd.files.lifecycle import Lifecycle
from inboxd.item import DecodedImage
from inboxd.models.model import Classification
from inboxd.pipeline.wiring import Pipeline

# An image whose top-left red value is this makes the fake model raise, as a real model might
# on one pathological input.
POISON_RED = 13


class FakeModel:
    """Classifies an image as its top-left red value: fast, deterministic, no weights."""

    name = "fake"
    output = "classify"
    device = torch.device("cpu")
    precision = "fp32"
    runtime = "torch"
    on_gpu = False
    concurrent_calls = 1
    spec = PreprocessSpec(resize=8, crop=8, interpolation="nearest", mean=(0.5,) * 3,
                          std=(0.5,) * 3)

    def __init__(self, oom_above_batch: int | None = None) -> None:
        self.oom_above_batch = oom_above_batch
        self.batch_sizes: list[int] = []

    def classify(self, images: Sequence[npt.NDArray[np.uint8]]) -> list[Classification]:
        self.batch_sizes.append(len(images))
        if self.oom_above_batch is not None and len(images) > self.oom_above_batch:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        if any(int(image[0, 0, 0]) == POISON_RED for image in images):
            raise RuntimeError("simulated model failure")
        return [Classification([{"label": f"red{int(image[0, 0, 0])}",
                                 "index": int(image[0, 0, 0]), "score": 1.0}])
                for image in images]

    predict = classify

    def input_of(self, image: DecodedImage) -> npt.NDArray[np.uint8]:
        return image.pixels

    def warm_up_sizes(self, max_size: int) -> list[int]:
        return [max_size]

    def warm_up(self, sizes: Sequence[int]) -> float:
        return 0.0

    def health_problem(self) -> str | None:
        return None  # the fake's only failure is the poisoned input's own

    def memory_fields(self) -> dict[str, int]:
        return {}


class ScriptedWatch:
    """Stands in for ``watchfiles.awatch``: yields the change sets a test pushes."""

    def __init__(self) -> None:
        self.changes: asyncio.Queue[set[tuple[watchfiles.Change, str]]] = asyncio.Queue()
        self.started = asyncio.Event()
        self.polling: list[bool] = []  # force_polling of each call, as awatch would get it

    def push(self, *paths: Path) -> None:
        self.changes.put_nowait({(watchfiles.Change.added, str(p)) for p in paths})

    async def __call__(
        self, *paths: Path, recursive: bool, stop_event: asyncio.Event,
        force_polling: bool = False, poll_delay_ms: int = 1000,
    ) -> AsyncIterator[set[tuple[watchfiles.Change, str]]]:
        self.polling.append(force_polling)
        self.started.set()
        while not stop_event.is_set():
            get = asyncio.ensure_future(self.changes.get())
            stop = asyncio.ensure_future(stop_event.wait())
            await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if get.done():
                yield get.result()
            else:
                get.cancel()


class InProcess(Commits):
    """The commit in the calling thread, on this process's ``lifecycle``: where a test fakes a
    full or failing disk at the filesystem boundary (a monkeypatched ``Lifecycle``)."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self.lifecycle = lifecycle
        self.outputs = Outputs.of(lifecycle)

    def start(self) -> None:
        self.outputs.start()

    def send(self, entries: Sequence[CommitEntry]) -> Future[Committed]:
        future: Future[Committed] = Future()
        future.set_result(commit(self.lifecycle, entries, self.outputs.index,
                                 self.outputs.sidecars))
        return future

    def close(self) -> None:
        self.outputs.close()


def commit_in_this_process(pipeline: Pipeline) -> None:
    """Run ``pipeline``'s group commits in this process, on ``pipeline.lifecycle``, so that a
    test can fake a disk at the filesystem boundary (a monkeypatched ``Lifecycle``), which the
    commit process would never see. Before the pipeline starts."""
    pipeline.commits = pipeline.result_writer.commits = pipeline.report.commits = InProcess(
        pipeline.lifecycle)


def pipeline_for(root: Path, model: Any = None, watch: Any = None, **sections: Any) -> Pipeline:
    """A pipeline on ``write_config(root, **sections)`` with ``FakeModel`` (or ``model``) and the
    real watcher (or ``watch``), not started."""
    from tests.conftest import write_config

    config = load_config(write_config(root, **sections))
    kwargs = {"watch": watch} if watch is not None else {}
    return Pipeline(config, model or FakeModel(), **kwargs)


_UCRED = struct.Struct("iII")  # pid, uid, gid


class NotifySocket:
    """What systemd listens on for $NOTIFY_SOCKET: a datagram socket at a path or an abstract
    ``@name`` (``address`` as the variable spells it), receiving the sender's credentials as
    systemd does (NotifyAccess=main checks the pid)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.env = {"NOTIFY_SOCKET": address}
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.05)
        self.messages: list[str] = []  # what drain() has received so far

    def receive(self, timeout_s: float = 5.0) -> tuple[str, int]:
        """One datagram and the sender's pid from SCM_CREDENTIALS."""
        self.sock.settimeout(timeout_s)
        try:
            data, ancdata, _flags, _addr = self.sock.recvmsg(4096,
                                                             socket.CMSG_SPACE(_UCRED.size))
        finally:
            self.sock.settimeout(0.05)
        pids = [_UCRED.unpack(cdata[: _UCRED.size])[0] for level, kind, cdata in ancdata
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS]
        assert len(pids) == 1
        return data.decode(), pids[0]

    def from_this_process(self, count: int) -> list[str]:
        """The next ``count`` datagrams, each checked to come from this process."""
        received = []
        for _ in range(count):
            text, pid = self.receive()
            assert pid == os.getpid()
            received.append(text)
        return received

    def assert_empty(self) -> None:
        try:
            self.sock.recv(4096)
        except TimeoutError:
            return
        raise AssertionError("a datagram nobody should have sent")

    def drain(self) -> list[str]:
        """Every datagram so far, appended to ``messages``."""
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                return self.messages

    def wait_for(self, prefix: str, timeout_s: float = 120) -> str:
        from support.waiting import wait_until

        def found() -> str | None:
            return next((m for m in self.drain() if m.startswith(prefix)), None)

        return wait_until(found, timeout_s, f"a {prefix!r} notification")  # type: ignore[no-any-return]

    def kinds(self) -> list[str]:
        """The notification sequence with consecutive repeats collapsed (STATUS, WATCHDOG…)."""
        sequence: list[str] = []
        for message in self.drain():
            kind = message.split("=", 1)[0]
            if not sequence or sequence[-1] != kind:
                sequence.append(kind)
        return sequence

    def close(self) -> None:
        self.sock.close()
        if not self.address.startswith("@"):
            Path(self.address).unlink(missing_ok=True)
