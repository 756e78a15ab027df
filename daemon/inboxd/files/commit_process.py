"""The commit process as the daemon sees it (what it does: ``files/commit_worker.py``): started
once with the pipeline, handed one batch at a time by the result writer's io thread, ended by
EOF on its requests when the pipeline stops.

A commit process that dies or answers nonsense is not a file's doing, and which of its batch's
sources had already moved cannot be known from here: ``CommitProcessFailed`` crashes the result
writer's stage, like any stage crash. The service exits, and its restart returns what was
claimed to the inbox, where each file's durable result (if it got one) is found by its sha256.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from inboxd import wire
from inboxd.children import child_env, describe_exit
from inboxd.config import Config
from inboxd.files.commit_worker import MAX_HEADER_BYTES
from inboxd.files.commits import CommitEntry, Committed, committed_from, request_frame
from inboxd.files.lifecycle import Lifecycle

EXIT_WAIT_S = 10.0  # from EOF on its requests to its exit: the batch in hand is finished first


class CommitProcessFailed(RuntimeError):
    """The commit process died, or sent what is not a reply to the batch it was given."""


class CommitProcess:
    def __init__(self, config: Config, lifecycle: Lifecycle) -> None:
        self.config = config
        self.lifecycle = lifecycle  # its instance locks go with the process
        self.proc: subprocess.Popen[bytes] | None = None
        self.reader: wire.Reader | None = None
        self.ready = False
        self.request_id = 0

    def start(self) -> None:
        """Start it (it gets ready in the background; the first commit waits for that). Call it
        from a thread that lives as long as the process is wanted: the kernel kills the process
        when the thread that started it ends (``PR_SET_PDEATHSIG``). Idempotent."""
        if self.proc is not None:
            return
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "inboxd.files.commit_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env(),
            pass_fds=self.lifecycle.lock_fds(),
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.reader = wire.Reader(self.proc.stdout.fileno(), MAX_HEADER_BYTES)
        wire.send(self.proc.stdin.fileno(), {"parent_pid": os.getpid(),
                                             "config": self.config.model_dump_json()})

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def commit(self, entries: Sequence[CommitEntry]) -> Committed:
        """File ``entries``' results and move their sources (blocking: the io thread's)."""
        self.start()
        assert self.proc is not None and self.proc.stdin is not None and self.reader is not None
        self.request_id += 1
        rows, payload = request_frame(entries)
        try:
            if not self.ready:
                self.ready = self.reader.recv()[0].get("ready") is True
                if not self.ready:
                    raise wire.WireError("its first frame is not the ready one")
            wire.send(self.proc.stdin.fileno(), {"request": self.request_id, "entries": rows},
                      payload)
            header, _ = self.reader.recv()
            if header.get("request") != self.request_id:
                raise wire.WireError(f"a reply to request {header.get('request')!r}, not "
                                     f"{self.request_id}")
            committed = committed_from(header)
            if committed.error is None and len(committed.filed) != len(entries):
                raise wire.WireError(f"{len(committed.filed)} outcomes for {len(entries)} files")
            return committed
        except (OSError, EOFError, wire.WireError, KeyError, TypeError, ValueError) as exc:
            raise CommitProcessFailed(self._why(exc)) from exc

    def _why(self, exc: BaseException) -> str:
        assert self.proc is not None
        if isinstance(exc, EOFError | OSError):
            try:
                how = f"ended with {describe_exit(self.proc.wait(EXIT_WAIT_S))}"
            except subprocess.TimeoutExpired:
                how = f"closed its pipes ({exc!r})"
        else:
            how = f"sent what is not a reply ({exc})"
        return (f"the commit process (pid {self.proc.pid}) {how} during a batch; inboxd stops, "
                "and its restart takes the batch's files again")

    def close(self) -> None:
        """EOF on its requests: it finishes the batch in hand, if any, and exits; killed if it
        does not within ``EXIT_WAIT_S``. Idempotent."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        try:
            proc.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
