"""The daemon's helper processes (decode workers, the commit process, the Ray bridge, the ONNX
exporter): each a fresh ``python -m inboxd.…`` interpreter, never a fork of the daemon (which has
threads and torch), with the daemon's own inboxd on its path, and killed by the kernel when the
daemon dies, however it dies. ``HelperProcess`` is the one way the daemon starts one (this is
the only module that starts processes); each owner keeps its own protocol and restart policy.
The decode workers and the commit process talk ``inboxd.wire`` frames over their pipes; the Ray
bridge's protocol is pickled over a ``multiprocessing.connection`` socket instead
(``models/engines/ray_bridge_child.py`` says what it sends); the exporter reads one JSON request
and answers with its exit status.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import site
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence

import inboxd

PR_SET_PDEATHSIG = 1
# The helpers import the very inboxd the daemon runs, wherever it was imported from (a source
# tree, PYTHONPATH); an installed one is found through site-packages, which must not be put
# ahead of the standard library.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(inboxd.__file__)))


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The daemon's environment, with ``extra`` and this inboxd on ``PYTHONPATH``."""
    env = {**os.environ, **(extra or {})}
    if PACKAGE_ROOT not in {*site.getsitepackages(), site.getusersitepackages()}:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT,
                                                          os.environ.get("PYTHONPATH")]))
    return env


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the daemon (``parent_pid``) dies, even by SIGKILL."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl: nobody will signal us
        os._exit(0)


def killed_with(parent_pid: int) -> Callable[[], None]:
    """For ``Popen``'s ``preexec_fn``: ``PR_SET_PDEATHSIG`` between fork and exec, so a helper
    dies with the daemon from before its first line. Set only by the helper itself
    (``die_with_parent``), one stopped (SIGSTOP) in its first instant never sets it and
    outlives the daemon, stopped for ever. ``prctl`` is looked up here, in the daemon: the
    child only calls it (no import, no lock another thread may have held at the fork)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the daemon died before prctl: nobody will signal
            os._exit(1)

    return in_child


# Ignored by every helper (protocol_fds), and held back while one starts (held_for_start).
HELPER_IGNORES = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@contextlib.contextmanager
def held_for_start() -> Iterator[None]:
    """Around the ``Popen`` of a helper: SIGINT, SIGTERM and SIGHUP stay blocked in the child
    (it inherits this thread's signal mask) until ``protocol_fds`` ignores them. A Ctrl-C or a
    stop signal to the whole group during its imports (a quarter of a second or more) would
    otherwise kill it as it starts."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, HELPER_IGNORES)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def protocol_fds() -> tuple[int, int]:
    """(requests, replies): private copies of stdin and stdout for the frames; fds 0 and 1
    become /dev/null and stderr, so a library that prints to stdout cannot corrupt a frame.
    SIGINT, SIGTERM and SIGHUP are ignored: a Ctrl-C on the terminal or systemd's stop signal
    to the whole cgroup must not end work the daemon is still draining; the daemon ends its
    helpers itself (EOF on their requests)."""
    requests, replies = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    os.close(devnull)
    ignore_stop_signals()
    return requests, replies


def ignore_stop_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP ignored from here on, then unblocked (``held_for_start``
    blocked them): what came meanwhile is dropped."""
    for sig in HELPER_IGNORES:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELPER_IGNORES)


def describe_exit(code: int) -> str:
    """A helper's exit status as ``Popen`` gives it, in words (``SIGKILL``, ``exit status 3``)."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


# /proc/<pid>/stat states of a process that cannot run until someone continues it: stopped by a
# signal (SIGSTOP, Ctrl-Z's SIGTSTP) or by a tracer (a debugger).
STOPPED_STATES = frozenset("Tt")


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (R, S, D, T, t, Z, ...), None once it has gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    # The name in parentheses may hold anything, spaces and parentheses too: the state
    # follows the last ')'.
    fields = text[text.rfind(b")") + 1:].split()
    return fields[0].decode() if fields else None


def is_stopped(pid: int) -> bool:
    return process_state(pid) in STOPPED_STATES


class HelperProcess:
    """One helper, ``python <command>``, as its owner sees it: started with this inboxd on its
    path (``child_env``) and the stop signals held until it ignores them (``held_for_start``),
    inheriting only ``pass_fds``; its liveness, whether it is stopped from outside, its end
    (EOF, wait, SIGKILL, reap, pipes closed) and its exit status in words. What is said over
    its pipes, and whether a dead one is replaced, are its owner's.

    ``pipes``: its stdin and stdout are pipes to the daemon (the requests and the replies);
    else stdin is /dev/null and stdout the daemon's (the owner hands it a socket in
    ``pass_fds``). ``capture_stderr``: its stderr is a pipe too (``communicate`` reads it).
    ``OSError`` when it cannot start (fork refused, no descriptors)."""

    def __init__(self, command: Sequence[str], *, env: dict[str, str] | None = None,
                 pipes: bool = True, capture_stderr: bool = False,
                 pass_fds: Sequence[int] = ()) -> None:
        with held_for_start():
            self.popen = subprocess.Popen(
                [sys.executable, *command],
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipes else None,
                stderr=subprocess.PIPE if capture_stderr else None,
                env=child_env() if env is None else env, pass_fds=tuple(pass_fds),
                close_fds=True, preexec_fn=killed_with(os.getpid()))

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def requests_fd(self) -> int:
        """Its stdin (``pipes``), the daemon's end."""
        assert self.popen.stdin is not None, "started without pipes"
        return self.popen.stdin.fileno()

    @property
    def replies_fd(self) -> int:
        """Its stdout (``pipes``), the daemon's end."""
        assert self.popen.stdout is not None, "started without pipes"
        return self.popen.stdout.fileno()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def exit_code(self) -> int | None:
        """Its exit status once it has gone (negative: the signal that ended it), else None."""
        return self.popen.poll()

    def stopped(self) -> bool:
        """Whether it is stopped (SIGSTOP, Ctrl-Z, a debugger): it cannot run until continued."""
        return is_stopped(self.popen.pid)

    def describe_exit(self) -> str:
        code = self.popen.poll()
        return "still running" if code is None else describe_exit(code)

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Its exit status, waiting up to ``timeout_s`` (None: as long as it takes); None if it
        is still running then."""
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def signal_kill(self) -> None:
        """SIGKILL, not waiting for it (a thread reading its replies then sees EOF)."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGKILL)

    def end_requests(self) -> None:
        """EOF on its requests: every helper exits on it once it has answered what it has."""
        if self.popen.stdin is not None:
            with contextlib.suppress(OSError):  # it has gone: the pipe is broken
                self.popen.stdin.close()

    def close_replies(self) -> None:
        if self.popen.stdout is not None:
            self.popen.stdout.close()

    def reap(self) -> int:
        """Wait for its exit (as long as it takes), then close the daemon's ends of its pipes."""
        code = self.popen.wait()
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        return code

    def kill(self) -> int:
        """SIGKILL, reaped, pipes closed."""
        self.signal_kill()
        return self.reap()

    def stop(self, timeout_s: float, *, send_eof: bool = True,
             close_pipes: bool = True) -> int:
        """EOF on its requests, up to ``timeout_s`` to exit, then SIGKILL; reaped. An owner
        whose own threads write the EOF or read the replies says so (``send_eof``,
        ``close_pipes`` False): closing a descriptor under a thread blocked on it would hand
        the thread whatever file takes its number next."""
        if send_eof:
            self.end_requests()
        if self.wait(timeout_s) is None:
            self.signal_kill()
        return self.reap() if close_pipes else self.popen.wait()

    def communicate(self, request: bytes, timeout_s: float) -> tuple[bytes, bytes]:
        """Write ``request`` to its stdin, close it, and read its stdout and stderr until it
        exits; ``TimeoutError`` (after SIGKILL and reaping) when it takes longer than
        ``timeout_s``."""
        try:
            out, err = self.popen.communicate(request, timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"pid {self.pid} ran past {timeout_s:g} s") from None
        return out or b"", err or b""
