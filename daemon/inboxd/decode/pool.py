"""A small pool of decode worker processes: one file each at a time, over pipes.

Not ``concurrent.futures.ProcessPoolExecutor``: one dead worker breaks that whole pool
(``BrokenProcessPool``), and a hang cannot be cut short. Here each worker is a separate
``python -m inboxd.decode.worker_child`` with a request and a reply pipe; a request that is not
answered within ``decode_timeout_s`` (of time the worker could run: ``decode/time_budget.py``)
gets the worker SIGKILLed, a worker that dies (a C decoder's
segfault, an abort, the OOM killer) is reaped, and either way a new one takes its place and that
one file gets the reason. One request names several files (the worker opens, checks and hashes
each itself) and is acknowledged once; then one reply per file, in order, carries its crop
(``crop``×``crop``×3 bytes), so a death or a hang is the doing of the first file not answered.

Blocking and thread-safe: each call holds one worker; callers run it in their own threads, and
one beyond the workers waits for the next free one (the decode stage keeps a request ready
that way).
Workers are started from one dedicated thread, because ``PR_SET_PDEATHSIG`` fires when the
*thread* that started a child exits, not only the process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from inboxd import logs, testing, wire
from inboxd.children import describe_exit
from inboxd.decode.replies import DecodeResult, DecodeTimedOut, death_error, result_from
from inboxd.decode.time_budget import DecodeBudget
from inboxd.decode.worker_process import WorkerProcess, WorkerSettings, worker_env
from inboxd.item import PermanentError, TransientError
from inboxd.os_threads import name_this_thread

STARTUP_TIMEOUT_S = 60.0  # a cold interpreter importing numpy and Pillow on a busy machine


class DecodePool:
    def __init__(self, workers: int, settings: WorkerSettings) -> None:
        self.settings = settings
        self.env = worker_env()  # taken once: a replacement runs exactly as the first did
        self.max_payload_bytes = sum(spec.max_output_bytes for spec in settings.specs)
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="inboxd-decode-spawn",
                                           initializer=name_this_thread)
        # One slot per worker thread: a live worker, or None where starting one failed (the
        # next file in that slot tries again), so the slot count never changes.
        self._idle: queue.SimpleQueue[WorkerProcess | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._all: set[WorkerProcess] = set()
        self.workers = workers
        self.started = False
        self.closed = False
        self.replaced = 0  # workers started to replace a dead, hung or recycled one
        self.answered = 0  # files answered, whatever the outcome (the watchdog's progress)

    def start(self) -> None:
        """Start the workers (they get ready in parallel, in the background). Idempotent; the
        first ``decode`` calls it too."""
        with self._lock:
            if self.started or self.closed:
                return
            self.started = True
        if faults := self.env.get(testing.DECODE_FAULTS):
            logs.emit(logging.WARNING, "faults", f"DECODE FAULT INJECTION ACTIVE: "
                      f"{testing.DECODE_FAULTS}={faults}", faults=faults)
        for _ in range(self.workers):
            try:
                self._idle.put(self._start())
            except TransientError:
                self._idle.put(None)

    def _start(self) -> WorkerProcess:
        try:
            process = self._spawner.submit(WorkerProcess, self.settings, self.env).result()
        except (OSError, RuntimeError) as exc:  # fork refused, no descriptors, shut down
            raise TransientError(f"cannot start a decode worker: {exc}") from exc
        with self._lock:
            if not self.closed:
                self._all.add(process)
                return process
        process.kill()  # closed while it started: close() would never see it
        raise TransientError("inboxd is shutting down")

    def _replace(self, process: WorkerProcess, why: str) -> WorkerProcess:
        process.kill()
        with self._lock:
            self._all.discard(process)
        if self.closed:
            raise TransientError("inboxd is shutting down")
        self.replaced += 1
        logs.emit(logging.WARNING, "decode_worker", f"decode worker {process.pid} "
                  f"replaced: {why}", pid=process.pid, reason=why)
        return self._start()

    def stopped_workers(self) -> list[tuple[int, float]]:
        """(pid, seconds) of each worker seen stopped from outside while on a file."""
        with self._lock:
            budgets = [(p.pid, p.budget) for p in self._all]
        return [(pid, budget.stopped_s) for pid, budget in budgets
                if budget is not None and budget.worker_stopped]

    def worker_pids(self) -> list[int]:
        with self._lock:
            return sorted(p.pid for p in self._all)

    def decode(self, path: os.PathLike[str] | str, expected_sha256: str | None = None
               ) -> DecodeResult:
        """Read, hash and decode one file in a worker (see ``decode_many``)."""
        return self.decode_many([(path, expected_sha256)])[0]

    def decode_many(self, files: Sequence[tuple[os.PathLike[str] | str, str | None]],
                    opened: Sequence[int | None] = ()) -> list[DecodeResult]:
        """Read, hash and decode each (path, expected sha256) in one worker, in order: one
        request for them all, one reply per file as soon as it is done. ``opened``: this
        process's descriptor of each file where it holds one open (kept open by the caller
        until this returns): the worker reopens the file through it, not by its path. Every
        outcome of a file is its returned ``DecodeResult``; a worker that dies, hangs or is
        recycled costs only the file it was on, and the rest go to its replacement. Only a
        pool that is closed or cannot start workers raises, before any file was answered (then
        every file of the call is tried again later); after, the files not yet answered get
        that TransientError and those answered keep their outcome."""
        if self.closed:
            raise TransientError("inboxd is shutting down")
        self.start()
        process = self._idle.get()
        results: list[DecodeResult] = []
        try:
            if self.closed:  # closed while this waited for a slot
                raise TransientError("inboxd is shutting down")
            if process is None:
                process = self._start()
            fds: Sequence[int | None] = opened or [None] * len(files)
            entries = [_entry(path, expected, fd)
                       for (path, expected), fd in zip(files, fds, strict=True)]
            while len(results) < len(files):
                rest = entries[len(results):]
                process = self._hand_over(process, rest)
                process = self._answers(process, len(rest), results)
            return results
        except TransientError as exc:
            if not results:
                raise
            # A file decoded (or failed with its own reason) before the replacement failed
            # keeps that outcome: raising would send a good file to be decoded again and a
            # bad one to the retry list instead of failed/, each an attempt it did not earn.
            return results + [DecodeResult(None, None, error=exc)
                              for _ in range(len(files) - len(results))]
        finally:
            self._idle.put(self._keep(process))

    def _hand_over(self, process: WorkerProcess, files: list[dict[str, Any]]) -> WorkerProcess:
        """The worker that has taken ``files`` (acknowledged the request)."""
        request: dict[str, Any] = {"files": files}
        for attempt in range(2):
            process = self._ensure_ready(process)
            why = self._deliver(process, request)
            if why is None:
                return process
            # It died before it took the files (killed while idle, the OOM killer, say), or
            # answered nonsense: not their doing, so they go to a fresh worker, once.
            process = self._replace(process, why)
            if attempt:
                raise TransientError("decode workers die before they can take a file; "
                                     "see the journal")
        raise AssertionError("unreachable")

    def _answers(self, process: WorkerProcess, count: int,
                 results: list[DecodeResult]) -> WorkerProcess:
        """Up to ``count`` replies into ``results``; returns early with the replacement when
        the worker had to be replaced (the files after that one were never started)."""
        for index in range(count):
            try:
                result, replace_why = self._answer(process, index)
            finally:
                process.budget = None
            self.answered += 1
            results.append(result)
            if replace_why is not None:
                return self._replace(process, replace_why)
        return process

    def _keep(self, process: WorkerProcess | None) -> WorkerProcess | None:
        """The slot's worker if it is still alive (a replacement that failed to start leaves
        the killed one here), else None after cleaning it up."""
        if process is None or (process.alive() and not self.closed):
            return process
        process.kill()
        with self._lock:
            self._all.discard(process)
        return None

    def _deliver(self, process: WorkerProcess, request: dict[str, Any]) -> str | None:
        """Send the request and wait for the worker's receipt: None once it has the files,
        else why it must be replaced."""
        process.request_id += 1
        request["request"] = process.request_id
        try:
            wire.send(process.requests, request)
            header, _ = process.reader.recv(time.monotonic() + STARTUP_TIMEOUT_S)
        except (OSError, EOFError, TimeoutError, wire.WireError) as exc:
            return f"died while idle ({type(exc).__name__})"
        if header.get("ack") is True and header.get("request") == process.request_id:
            return None
        return f"a receipt that is not one for request {process.request_id}: {header!r:.200}"

    def _ensure_ready(self, process: WorkerProcess) -> WorkerProcess:
        if process.ready is not None and process.alive():
            return process
        for _attempt in range(2):
            if process.ready is not None:  # was ready, has died since
                process = self._replace(process, "died while idle")
            try:
                header, _ = process.reader.recv(time.monotonic() + STARTUP_TIMEOUT_S)
            except (OSError, EOFError, TimeoutError, wire.WireError) as exc:
                process = self._replace(process, f"did not start ({type(exc).__name__})")
                continue
            process.ready = header
            if header.get("limit_error"):
                logs.emit(logging.WARNING, "decode_worker", "decode worker runs WITHOUT its "
                          f"memory limit: {header['limit_error']}", error=header["limit_error"])
            return process
        raise TransientError("decode workers fail to start; see the journal")

    def _answer(self, process: WorkerProcess, index: int) -> tuple[DecodeResult, str | None]:
        """The outcome of file ``index`` of the worker's current request, and why the worker
        must be replaced now (None: it carries on). The caller replaces it after keeping the
        outcome, so a replacement that cannot start does not cost the answer."""
        timeout_s = self.settings.decode_timeout_s
        budget = process.budget = DecodeBudget(timeout_s, process.pid)
        try:
            while True:
                try:
                    header, payload = process.reader.recv(budget.deadline_s(),
                                                          self.max_payload_bytes)
                    break
                except TimeoutError:
                    budget.waited()
                if budget.timed_out:
                    # Transient the first time: the pipeline fails the file for good only
                    # when it times out again (``Preprocessor``).
                    return DecodeResult(None, None, error=DecodeTimedOut(
                        f"decoding took longer than preprocess.decode_timeout_s = "
                        f"{timeout_s:g} s; the decoder was stopped (raise decode_timeout_s if "
                        "such files are real images)")), "decode timeout"
                if budget.stopped_too_long:
                    return DecodeResult(None, None, error=TransientError(
                        f"the decode worker was stopped from outside (SIGSTOP or a debugger) "
                        f"for {budget.stopped_s:.0f} s while on this file; it was replaced and "
                        "the file is tried again")), (
                        f"stopped from outside for {budget.stopped_s:.0f} s")
        except EOFError:
            if self.closed:  # close() killed it: not this file's doing, nor the OOM killer's
                raise TransientError("inboxd is shutting down") from None
            code = process.exit_status()
            if code is None:  # alive, yet its reply pipe is closed: broken
                return DecodeResult(None, None, error=PermanentError(
                    "the decoder closed its reply pipe on this file")), "closed its reply pipe"
            return DecodeResult(None, None, error=death_error(code)), (
                f"exited with {describe_exit(code)}")
        except wire.WireError as exc:
            return _malformed(str(exc))
        if (header.get("request"), header.get("file")) != (process.request_id, index):
            return _malformed(f"a reply for request {header.get('request')!r} file "
                              f"{header.get('file')!r}, expected request {process.request_id} "
                              f"file {index}")
        try:
            result = result_from(header, payload)
            # The model stacks crops into one batch: one of another shape would fail them all.
            if result.image is not None:
                images = (result.image.pixels, *result.image.others)
                if len(images) != len(self.settings.specs) or not all(
                        spec.accepts_shape(image.shape)
                        for spec, image in zip(self.settings.specs, images, strict=True)):
                    raise ValueError(f"images of shapes {[i.shape for i in images]} for "
                                     f"{[(s.kind, s.crop) for s in self.settings.specs]}")
        # A worker that lost its mind; OverflowError: JSON's Infinity where an int goes.
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            return _malformed(repr(exc))
        return result, "recycled after running out of memory" if header.get("recycle") else None

    def close(self) -> None:
        """End every worker: EOF on its pipe, then SIGKILL for one still busy. Idempotent."""
        with self._lock:
            self.closed = True
            processes = list(self._all)
            self._all.clear()
        # SIGKILL only: a thread still waiting on a busy worker sees EOF, finds the pool closed
        # and gives up (decode_many: the files it had not answered get "shutting down", and go
        # back to the inbox); _keep closes that worker's pipes.
        for process in processes:
            process.signal_kill()
        for process in processes:
            process.proc.wait()
        with contextlib.suppress(queue.Empty):
            while True:  # idle workers have no thread to close their pipes
                idle = self._idle.get_nowait()
                if idle is not None:
                    idle.reap()
        # A caller that found the pool open just before, and now waits for a slot, would wait
        # for ever (and hold up the interpreter's exit): an empty slot each wakes it.
        for _ in range(self.workers):
            self._idle.put(None)
        self._spawner.shutdown(wait=True)


def _malformed(why: str) -> tuple[DecodeResult, str]:
    return DecodeResult(None, None, error=PermanentError(
        f"the decoder sent a malformed reply: {why}")), why


def _entry(path: os.PathLike[str] | str, expected: str | None, fd: int | None
           ) -> dict[str, Any]:
    """One file of a request; its name travels hex-encoded (any bytes a name may hold)."""
    entry: dict[str, Any] = {"path_hex": os.fsencode(path).hex(), "expected_sha256": expected}
    if fd is not None:
        entry["opened"] = f"/proc/{os.getpid()}/fd/{fd}"
    return entry
