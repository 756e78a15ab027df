"""``metrics.listen``: a small HTTP server for Prometheus scrapes, on the daemon's event loop.

Any local process can connect to it, so nothing it holds grows with what clients do: at most
``MAX_CONNECTIONS`` are served at once (one more is accepted and closed at once, so a flood of
idle connections costs the daemon no descriptor for longer than an accept; the oldest
connection still waiting for its request makes room for a new one, so an idle flood cannot keep
a scraper out), a request must
arrive whole within ``REQUEST_TIMEOUT_S`` and be at most ``MAX_REQUEST_BYTES``, the reply must
be taken within ``REPLY_TIMEOUT_S``, and every connection is closed after one reply. The
exposition is built on the event loop (it reads the pipeline's live counters, which only the
loop may touch) at most once per ``EXPOSITION_MAX_AGE_S``: every scrape in between gets the
same bytes, so a local user scraping as fast as the connections allow costs the pipeline a
copy and a write per request, never a rebuild (Prometheus scrapes every 15 s or more). No thread
per connection (``prometheus_client``'s own server starts one each, and an idle flood took the
daemon to its descriptor limit). When accept itself fails for want of descriptors, asyncio
stops accepting for a second instead of spinning. A unix socket (``unix:/path``) needs no
network at all: the shipped unit's ``RestrictAddressFamilies=AF_UNIX`` allows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from typing import Any

from inboxd import logs
from inboxd.config import split_host_port

MAX_CONNECTIONS = 16
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0
REPLY_TIMEOUT_S = 10.0
LISTEN_BACKLOG = 16
# Who may connect to the unix socket: the daemon's user and group (add Prometheus's user to
# the group), nobody else.
UNIX_SOCKET_MODE = 0o660
_SHORT_OF = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # prometheus_client's text format
EXPOSITION_MAX_AGE_S = 1.0


class MetricsServer:
    """Serves ``exposition()`` on GET /metrics (and /), one request per connection."""

    def __init__(self, exposition: Callable[[], bytes],
                 max_connections: int = MAX_CONNECTIONS,
                 request_timeout_s: float = REQUEST_TIMEOUT_S,
                 reply_timeout_s: float = REPLY_TIMEOUT_S,
                 max_age_s: float = EXPOSITION_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.exposition = exposition
        self.max_age_s = max_age_s
        self.clock = clock
        self._body: bytes | None = None
        self._built_s = 0.0
        self.builds = 0  # expositions built: at most one per max_age_s, however many scrapes
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self.reply_timeout_s = reply_timeout_s
        self._server: asyncio.base_events.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        # Connections whose request has not arrived yet, oldest first (a dict keeps order).
        self._waiting: dict[asyncio.StreamWriter, None] = {}
        self._unix_path: str | None = None
        self._accept_failing = False
        self.refused = 0  # connections closed early because MAX_CONNECTIONS were open

    async def start(self, listen: str) -> None:
        """Listen on ``HOST:PORT`` or ``unix:/path``; ``OSError`` when it cannot."""
        self._quiet_accept_failures(asyncio.get_running_loop())
        if listen.startswith("unix:"):
            path = listen.removeprefix("unix:")
            _remove_stale_socket(path)
            self._server = await asyncio.start_unix_server(
                self._serve, path, limit=MAX_REQUEST_BYTES, backlog=LISTEN_BACKLOG)
            self._unix_path = path
            _chmod_socket(path, UNIX_SOCKET_MODE)
            return
        address = split_host_port(listen)
        assert address is not None  # checked when the config was read
        self._server = await asyncio.start_server(
            self._serve, *address, limit=MAX_REQUEST_BYTES,
            backlog=LISTEN_BACKLOG, reuse_address=True)

    def _quiet_accept_failures(self, loop: asyncio.AbstractEventLoop) -> None:
        """asyncio reports an accept that failed for want of descriptors with a traceback,
        every second while it lasts: one warning per episode instead (until an accept works),
        everything else to the handler there was."""
        previous = loop.get_exception_handler()

        def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            exc = context.get("exception")
            if isinstance(exc, OSError) and exc.errno in _SHORT_OF and "accept" in str(
                    context.get("message", "")):
                if not self._accept_failing:
                    logs.emit(logging.WARNING, "metrics_error",
                              f"metrics.listen cannot accept connections: {exc.strerror}; "
                              "trying again every second (files are not affected)",
                              error=str(exc))
                self._accept_failing = True
                return
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(handler)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._accept_failing = False
        if len(self._open) >= self.max_connections:
            self.refused += 1
            if not self._waiting:
                writer.transport.abort()  # its descriptor goes back now, not after a timeout
                return
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.transport.abort()  # its handler sees the connection gone and ends
            self._open.discard(oldest)
        self._open.add(writer)
        self._waiting[writer] = None
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"),
                                             self.request_timeout_s)
            self._waiting.pop(writer, None)
            status, body = self._reply(request)
            head = (f"HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
            writer.write(head + body)
            await asyncio.wait_for(writer.drain(), self.reply_timeout_s)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError, OSError):
            pass  # an idle, slow, oversized or vanished client: its connection just ends
        except asyncio.CancelledError:
            # The server closing (a stop) with clients still connected. Ended here, not
            # raised: Python 3.11's stream callback asks a cancelled task for its exception
            # and logs a traceback for every connection a local process held open.
            writer.transport.abort()
        finally:
            self._open.discard(writer)
            self._waiting.pop(writer, None)
            writer.transport.abort()

    def _reply(self, request: bytes) -> tuple[str, bytes]:
        method, _, rest = request.partition(b" ")
        target = rest.partition(b" ")[0].partition(b"?")[0]
        if method not in (b"GET", b"HEAD"):
            return "405 Method Not Allowed", b"only GET\n"
        if target not in (b"/metrics", b"/"):
            return "404 Not Found", b"metrics are at /metrics\n"
        body = self.latest()
        return "200 OK", b"" if method == b"HEAD" else body

    def latest(self) -> bytes:
        """The exposition, rebuilt when the one in hand is ``max_age_s`` old."""
        now = self.clock()
        if self._body is None or now - self._built_s >= self.max_age_s:
            self._body, self._built_s = self.exposition(), now
            self.builds += 1
        return self._body

    @property
    def connections(self) -> int:
        return len(self._open)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._open):
            writer.transport.abort()
        self._open.clear()
        self._waiting.clear()
        if self._unix_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._unix_path)
            self._unix_path = None


def _chmod_socket(path: str, mode: int) -> None:
    """chmod the socket just bound at ``path``, never what a link there names: in a folder
    others can write, the socket can be swapped for a link between the bind and the chmod,
    and a plain chmod would widen the file it points to (a 0600 photo in done/)."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError(errno.EEXIST, "the socket was replaced by something else just after "
                          "it was made; put it in a folder only the daemon can write", path)
        os.chmod(f"/proc/self/fd/{fd}", mode)  # an O_PATH descriptor: this inode, no link
    finally:
        os.close(fd)


def _remove_stale_socket(path: str) -> None:
    """A socket left by a killed run would make the bind fail; anything else at that path
    (a file, a link somebody planted) is not ours to remove, and the bind says so."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody answers: a killed run's
            return
    raise OSError(errno.EADDRINUSE, "another process serves this socket", path)
