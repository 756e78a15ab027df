"""The daemon's helper processes (decode workers, the commit process, the Ray bridge): each a
fresh ``python -m inboxd.…`` interpreter, never a fork of the daemon (which has threads and
torch), with the daemon's own inboxd on its path, and killed by the kernel when the daemon dies,
however it dies. The decode workers and the commit process talk ``inboxd.wire`` frames over
their pipes; the Ray bridge's protocol is pickled over a ``multiprocessing.connection``
socket instead (``models/engines/ray_bridge_child.py`` says what it sends).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import site
from collections.abc import Iterator

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
