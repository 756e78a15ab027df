"""sd_notify(3) over a plain AF_UNIX datagram socket: no libsystemd needed.

systemd passes ``$NOTIFY_SOCKET`` to ``Type=notify`` services: a filesystem path, or an abstract
socket written as ``@name`` (sent with a leading NUL byte). Each message is one datagram of
newline-separated ``KEY=value`` assignments; systemd learns the sender's pid from the kernel
(SCM_CREDENTIALS), which ``NotifyAccess=main`` checks. Without ``$NOTIFY_SOCKET`` (a terminal,
a test) every call is a no-op.

Sending never raises: if the socket is gone (systemd re-executing, a test that closed it) the
daemon must keep working, so the first failure is logged at debug level and later ones are
silent until a send succeeds again.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import time
from collections.abc import Mapping

from inboxd import logs

log = logging.getLogger("inboxd.notify")

# A blocking send to a datagram socket waits while the receiver's queue is full. systemd drains
# it quickly; if it does not, losing one STATUS= beats stalling the event loop for longer.
_SEND_TIMEOUT_S = 1.0


def _socket_address(value: str) -> str | None:
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]  # Linux abstract namespace
    return None  # e.g. "vsock:..." (systemd >= 254): not supported here


class Notifier:
    """Tells systemd about the service's state. All methods are cheap no-ops when disabled."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._env = env
        raw = env.get("NOTIFY_SOCKET", "")
        self._address = _socket_address(raw) if raw else None
        if raw and self._address is None:
            log.debug("NOTIFY_SOCKET=%r is not a path or @abstract name; notify disabled", raw)
        self._sock: socket.socket | None = None
        self._failing = False

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def ready(self) -> None:
        self.send("READY=1")

    def status(self, text: str) -> None:
        # One assignment per line: a newline inside the text would start a bogus assignment,
        # and systemctl status prints the rest to a terminal.
        self.send("STATUS=" + logs.escape_controls(" ".join(text.splitlines())))

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def reloading(self) -> None:
        # MONOTONIC_USEC lets systemd (>= 253, Type=notify-reload) tell this reload from an
        # older one; it must be CLOCK_MONOTONIC, the clock systemd uses.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def extend_timeout(self, seconds: float) -> None:
        """Ask for ``seconds`` more of the current start/stop timeout (from now)."""
        self.send(f"EXTEND_TIMEOUT_USEC={max(0, round(seconds * 1_000_000))}")

    def watchdog_timeout_s(self) -> float | None:
        """``WatchdogSec=`` in seconds, or None when no watchdog applies to this process."""
        raw_usec = self._env.get("WATCHDOG_USEC", "")
        raw_pid = self._env.get("WATCHDOG_PID", "")
        # The variables are inherited by children; they are only meant for the main pid.
        if raw_pid and (not raw_pid.isdigit() or int(raw_pid) != os.getpid()):
            return None
        if not raw_usec.isdigit() or int(raw_usec) == 0:
            return None
        return int(raw_usec) / 1_000_000

    def watchdog_interval_s(self) -> float | None:
        """How often to send ``WATCHDOG=1``: half the timeout, as sd_watchdog_enabled(3) advises,
        so one late ping never gets the service killed. None when there is no watchdog."""
        timeout_s = self.watchdog_timeout_s()
        return None if timeout_s is None else timeout_s / 2

    def send(self, *assignments: str) -> bool:
        """Send one datagram; True if it went out (False when disabled or it failed)."""
        if self._address is None:
            return False
        payload = "\n".join(assignments).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # CLOEXEC by default
                self._sock.settimeout(_SEND_TIMEOUT_S)
            self._sock.sendto(payload, self._address)
        except OSError as exc:  # socket.timeout is an OSError too
            if not self._failing:
                log.debug("sd_notify to %r failed (%s); carrying on", self._address, exc)
            self._failing = True
            return False
        self._failing = False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def abort_with_stacks() -> None:
    """What the event loop does on SIGABRT (systemd's watchdog, when the model is stuck in a
    call): every thread's stack to stderr, then the death SIGABRT asks for. faulthandler's own
    SIGABRT dump runs in the signal handler while the other threads run on, and crashed half-way
    (SIGSEGV) when one of them moved (the nspawn watchdog test, 2 runs in 6); here the GIL is
    held, so no thread moves while its stack is read. A C library's abort() ends the process
    before this runs, without the stacks."""
    faulthandler.dump_traceback(all_threads=True)
    signal.signal(signal.SIGABRT, signal.SIG_DFL)
    os.abort()
