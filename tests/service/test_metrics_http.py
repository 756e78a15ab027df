"""The metrics endpoint's own bounds, on real sockets: one reply per connection, the connection
cap with the oldest idle one evicted, time-outs, and unix sockets (stale ones replaced, anything
else at the path left alone)."""

from __future__ import annotations

import asyncio
import socket
import stat
from pathlib import Path

import pytest
from inboxd.service.metrics_http import MAX_CONNECTIONS, UNIX_SOCKET_MODE, MetricsServer

BODY = b"inboxd_completed_total 3.0\n"


async def get(open_connection: object, target: str = "/metrics") -> bytes:
    reader, writer = await open_connection  # type: ignore[misc]
    writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    reply: bytes = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return reply


def test_unix_socket_serves_metrics_and_replaces_only_a_stale_socket(tmp_path: Path) -> None:
    path = tmp_path / "metrics.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # a killed run's: bound, nobody listening
    stale.close()

    async def scenario() -> None:
        server = MetricsServer(lambda: BODY)
        await server.start(f"unix:{path}")
        try:
            # The daemon's user and group may connect (connect needs write), nobody else.
            assert stat.S_IMODE(path.stat().st_mode) == UNIX_SOCKET_MODE == 0o660
            reply = await get(asyncio.open_unix_connection(str(path)))
            assert reply.startswith(b"HTTP/1.1 200 OK") and reply.endswith(BODY)
            assert b"404" in (await get(asyncio.open_unix_connection(str(path)), "/x"))[:20]
            # A second server on a live socket refuses instead of stealing it.
            with pytest.raises(OSError):
                await MetricsServer(lambda: BODY).start(f"unix:{path}")
        finally:
            server.close()
        assert not path.exists()
        path.write_text("somebody's file")
        with pytest.raises(OSError):
            await MetricsServer(lambda: BODY).start(f"unix:{path}")
        assert path.read_text() == "somebody's file"

    asyncio.run(scenario())


def test_idle_connections_beyond_the_cap_never_keep_a_scrape_out() -> None:
    async def scenario() -> None:
        server = MetricsServer(lambda: BODY, request_timeout_s=0.5)
        await server.start("127.0.0.1:0")
        assert server._server is not None
        port = server._server.sockets[0].getsockname()[1]
        try:
            idle = [await asyncio.open_connection("127.0.0.1", port)
                    for _ in range(MAX_CONNECTIONS * 3)]
            await asyncio.sleep(0.1)
            assert server.connections <= MAX_CONNECTIONS
            reply = await get(asyncio.open_connection("127.0.0.1", port))
            assert reply.endswith(BODY), reply
            await asyncio.sleep(1)  # past the request time-out: every idle one is closed
            assert server.connections == 0
            for _, writer in idle:
                writer.close()
        finally:
            server.close()

    asyncio.run(scenario())


def test_an_oversized_request_is_dropped() -> None:
    async def scenario() -> None:
        server = MetricsServer(lambda: BODY)
        await server.start("127.0.0.1:0")
        assert server._server is not None
        port = server._server.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /metrics HTTP/1.1\r\n" + b"X: " + b"a" * 20000 + b"\r\n\r\n")
            with_reply = await asyncio.wait_for(reader.read(), 5)
            assert BODY not in with_reply
            writer.close()
        finally:
            server.close()

    asyncio.run(scenario())

