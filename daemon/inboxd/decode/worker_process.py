"""One decode worker process, as the pool sees it: started by a fixed command line with the
daemon's own inboxd on its path, killed, reaped. What it does is ``decode/worker_child.py``;
what the pool asks of it, ``decode/pool.py``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from inboxd import wire
from inboxd.children import HelperProcess, child_env
from inboxd.decode.spec import PreprocessSpec
from inboxd.decode.time_budget import DecodeBudget

EXIT_WAIT_S = 5.0  # from the EOF on a worker's replies to its exit status
# One allocator arena and one BLAS thread: a worker decodes one file with one thread, and each
# extra arena or thread would reserve address space under RLIMIT_AS for nothing.
WORKER_ENV = {"MALLOC_ARENA_MAX": "2", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def worker_env() -> dict[str, str]:
    return child_env(WORKER_ENV)


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    spec: PreprocessSpec
    max_image_pixels: int
    max_file_bytes: int
    decode_memory_bytes: int
    decode_timeout_s: float
    # Further tasks' specs (``models:``): each file is decoded once and cut for every spec.
    other_specs: tuple[PreprocessSpec, ...] = ()

    @property
    def specs(self) -> tuple[PreprocessSpec, ...]:
        return (self.spec, *self.other_specs)


class WorkerProcess:
    """One ``python -m inboxd.decode.worker_child``: its pipes, its reader, its request numbers."""

    def __init__(self, settings: WorkerSettings, env: dict[str, str]) -> None:
        self.proc = HelperProcess(("-m", "inboxd.decode.worker_child"), env=env)
        self.requests = self.proc.requests_fd
        self.reader = wire.Reader(self.proc.replies_fd)
        self.ready: dict[str, Any] | None = None
        self.budget: DecodeBudget | None = None  # the time of the file it is on, if any
        # Numbers this worker's requests; its receipt and every reply echo it (and a reply its
        # file's place in the request). Replies carry no file name, so order alone would put a
        # stray frame (a buggy or hijacked worker's receipt too many, left in the reader's
        # buffer) in front of the next request's replies and give each file the one before
        # it; with the numbers such a frame is a malformed reply and costs one file at most.
        self.request_id = 0
        init = {**asdict(settings), "parent_pid": os.getpid()}
        init["spec"] = asdict(settings.spec)
        init["other_specs"] = [asdict(spec) for spec in settings.other_specs]
        try:
            wire.send(self.requests, init)  # small: fits the pipe, never blocks
        except BaseException:
            self.kill()  # exited at once: do not leak its pipes and a zombie
            raise

    def signal_kill(self) -> None:
        self.proc.signal_kill()

    def kill(self) -> None:
        self.proc.kill()

    def reap(self) -> int:
        return self.proc.reap()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.alive()

    def exit_status(self) -> int | None:
        """Its exit status once it has gone, waiting up to ``EXIT_WAIT_S``; None: still alive
        (its reply pipe closed, yet running: broken)."""
        return self.proc.wait(EXIT_WAIT_S)
