"""The commit process as the daemon sees it (what it does: ``files/commit_child.py``): started
once with the pipeline, handed batches by the result writer's io thread, ended by EOF on its
requests when the pipeline stops.

A batch is handed over as soon as the writer has it (``send`` encodes it and returns a future at
once), while the process may still be busy with the one before: a thread of its own writes the
batches down the pipe, in order, so a full pipe holds up that thread, never the io thread; the
process takes them one at a time and never waits for the daemon between two; another thread
reads the replies and hands each to its batch's future.

Which of a batch's sources had already moved when the commit process failed cannot be known
from here, so a failure crashes the result writer's stage, like any stage crash: the service
exits, and its restart returns what was claimed to the inbox, where each file's durable result
(if it got one) is found by its sha256. Two kinds:

- ``CommitProcessFailed``: the process died (killed, the OOM killer) or sent what is not a
  reply. Like a kill of the daemon, not the doing of the files in flight: no crash is counted
  against them (``CrashLedger.record``).
- ``CommitRaised``: the commit raised (a bug that a batch met), with the traceback; counted
  against the files in flight like any stage crash, so one that keeps causing it ends in
  failed/ instead of stopping the service again and again.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

from inboxd import logs, wire
from inboxd.children import HelperProcess, describe_exit
from inboxd.config import Config
from inboxd.files.commit_child import MAX_HEADER_BYTES
from inboxd.files.commits import (
    CommitEntry,
    Commits,
    Committed,
    committed_from,
    config_json,
    request_frame,
)
from inboxd.files.lifecycle import Lifecycle
from inboxd.os_threads import name_this_thread

EXIT_WAIT_S = 10.0  # from EOF on its requests to its exit: the batches it has are finished first


class CommitProcessFailed(RuntimeError):
    """The commit process died, or sent what is not a reply to the batch it was given."""


class CommitRaised(RuntimeError):
    """The commit of a batch raised in the commit process (the traceback is the message)."""


class CommitProcess(Commits):
    def __init__(self, config: Config, lifecycle: Lifecycle) -> None:
        self.config = config
        self.lifecycle = lifecycle  # its instance locks go with the process
        self.proc: HelperProcess | None = None
        self.request_id = 0
        # Batches sent and not answered, oldest first: (request number, files, their future).
        self._waiting: collections.deque[tuple[int, int, Future[Committed]]] = (
            collections.deque())
        self._outbox: queue.SimpleQueue[list[memoryview] | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._lock = threading.Lock()  # _waiting, _failure, _closing, the order of the outbox
        self._failure: RuntimeError | None = None  # why it takes no more batches
        self._raised: str | None = None  # the traceback of a commit that raised, if one did
        self._closing = False
        # Since when the oldest unanswered batch has waited for its reply (the last reply, or
        # when it was sent into an idle process): a stopped process, a hung disk or a loop
        # shows here, and the watchdog stops pinging (``Pipeline.stalls``).
        self._progress_s = time.monotonic()
        self.replies = 0

    def start(self) -> None:
        """Start it (it gets ready in the background). Call it from a thread that lives as long
        as the process is wanted: the kernel kills the process when the thread that started it
        ends (``PR_SET_PDEATHSIG``). Idempotent."""
        if self.proc is not None:
            return
        init = {"parent_pid": os.getpid(), "config": config_json(self.config)}
        self.proc = HelperProcess(("-m", "inboxd.files.commit_child"),
                                  pass_fds=self.lifecycle.lock_fds())
        self._outbox.put(wire.frame(init))
        self._sender = threading.Thread(target=self._write_requests, args=(self.proc,),
                                        name="inboxd-commit-requests", daemon=True)
        self._sender.start()
        threading.Thread(target=self._read_replies, args=(self.proc,),
                         name="inboxd-commit-replies", daemon=True).start()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def stalled_s(self) -> float | None:
        """Seconds the oldest unanswered batch has waited for its reply; None: none waits."""
        with self._lock:
            return time.monotonic() - self._progress_s if self._waiting else None

    def stopped(self) -> bool:
        """Whether the process is stopped (SIGSTOP, a debugger): for STATUS to say so."""
        return self.proc is not None and self.proc.stopped()

    def send(self, entries: Sequence[CommitEntry]) -> Future[Committed]:
        """Hand ``entries`` over to be filed and moved; the outcome arrives on the future."""
        if self.proc is None:
            raise RuntimeError("CommitProcess.send() before start()")
        rows, payload = request_frame(entries)
        future: Future[Committed] = Future()
        # Running: a writer cancelled at shutdown cannot cancel it (the batch is committed all
        # the same, and its reply still has to be matched to it).
        future.set_running_or_notify_cancel()
        with self._lock:
            if self._failure is not None:
                raise type(self._failure)(str(self._failure))
            if self._closing:
                raise CommitProcessFailed("the commit process is closed")
            request = self.request_id + 1
            views = wire.frame({"request": request, "entries": rows}, payload)  # may raise
            self.request_id = request
            if not self._waiting:
                self._progress_s = time.monotonic()
            self._waiting.append((request, len(entries), future))
            self._outbox.put(views)
        return future

    def _write_requests(self, proc: HelperProcess) -> None:
        """The outbox down the pipe, until ``close`` puts None; then EOF. Once the process has
        gone the rest is dropped: the reply thread fails their batches."""
        name_this_thread()
        gone = False
        while (views := self._outbox.get()) is not None:
            if not gone:
                try:
                    wire.write(proc.requests_fd, views)
                except OSError:
                    gone = True
        proc.end_requests()

    def _read_replies(self, proc: HelperProcess) -> None:
        name_this_thread()
        reader = wire.Reader(proc.replies_fd, MAX_HEADER_BYTES)
        try:
            ready = reader.recv()[0]
            if ready.get("ready") is not True:
                raise wire.WireError("its first frame is not the ready one")
            if ready.get("index"):
                logs.emit(logging.INFO, "index", str(ready["index"]))
            while True:
                header, _ = reader.recv()
                with self._lock:
                    if not self._waiting:
                        raise wire.WireError("a reply to no batch")
                    request, files, future = self._waiting[0]  # taken off once answered
                if header.get("request") != request:
                    raise wire.WireError(f"a reply to request {header.get('request')!r}, not "
                                         f"{request}")
                if "crash" in header:
                    self._raised = str(header["crash"])
                    raise wire.WireError("a commit raised")  # it exits now: fail the rest too
                committed = committed_from(header)
                for note in committed.notes:
                    logs.emit(logging.WARNING, "output", note)
                if committed.error is None and len(committed.filed) != files:
                    raise wire.WireError(f"{len(committed.filed)} outcomes for {files} files")
                with self._lock:
                    self._waiting.popleft()
                    self._progress_s = time.monotonic()
                    self.replies += 1
                future.set_result(committed)
        # Any exception: a reply thread that ended quietly would leave every batch waiting for
        # ever (and ``inboxd once`` with them).
        except Exception as exc:
            self._fail(proc, exc)
        finally:
            proc.close_replies()

    def _fail(self, proc: HelperProcess, exc: BaseException) -> None:
        failure: RuntimeError
        if self._raised is not None:
            # A bug a batch met, with what came after it: counted against the files in flight
            # however the next write task reads it (a kill of the process would not be).
            failure = CommitRaised(f"the commit process raised on a batch:\n{self._raised}")
        else:
            if isinstance(exc, EOFError | OSError):
                code = proc.wait(EXIT_WAIT_S)
                how = (f"closed its pipes ({exc!r})" if code is None
                       else f"ended with {describe_exit(code)}")
            else:
                how = f"sent what is not a reply ({exc!r})"
            failure = CommitProcessFailed(
                f"the commit process (pid {proc.pid}) {how}; inboxd stops, and its restart "
                "takes the files of the batches it had again, none of them counted as at fault")
        with self._lock:
            if self._closing and isinstance(exc, EOFError) and not self._waiting:
                return  # closed by us, every batch answered
            self._failure = failure
            waiting = list(self._waiting)
            self._waiting.clear()
        for _request, _files, future in waiting:
            future.set_exception(type(failure)(str(failure)))

    def close(self) -> None:
        """EOF on its requests: it finishes the batches it has and exits; killed if it does not
        within ``EXIT_WAIT_S`` (a write still blocked on its pipe then fails). Idempotent."""
        with self._lock:
            if self.proc is None or self._closing:
                return
            self._closing = True
            self._outbox.put(None)
        # Its threads own the pipes: the writer sends the EOF after the last batch, the reader
        # closes the replies once it has read them all.
        self.proc.stop(EXIT_WAIT_S, send_eof=False, close_pipes=False)
        if self._sender is not None:
            self._sender.join()
