"""The daemon's end of the Ray bridge: the child process
(``inboxd.models.engines.ray_bridge_child``) and the socket to it. A reader thread hands each
message to the event loop; a pipe that closes or goes out of step (bytes that do not unpickle) ends
the bridge, and ``on_closed`` says so."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from inboxd.children import HelperProcess
from inboxd.os_threads import name_this_thread

# What the child runs (after the interpreter); a test puts a scripted bridge of its own here.
BRIDGE_COMMAND: tuple[str, ...] = ("-m", "inboxd.models.engines.ray_bridge_child")


class BridgeGone(Exception):
    pass


class BridgeProcess:
    """The child running ``inboxd.models.engines.ray_bridge_child``, and the socket to it."""

    def __init__(self, on_message: Callable[[Any], None], on_closed: Callable[[], None]) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.process = HelperProcess((*BRIDGE_COMMAND, str(theirs.fileno()),
                                          str(os.getpid())),
                                         pipes=False, pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.sender = ThreadPoolExecutor(1, thread_name_prefix="inboxd-ray-send",
                                         initializer=name_this_thread)
        self.first: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._on_message = on_message
        self._on_closed = on_closed
        self.closed = False

    def start_reading(self) -> None:
        loop = asyncio.get_running_loop()

        def read() -> None:
            name_this_thread()
            while True:
                try:
                    message = self.conn.recv()
                except Exception:  # EOF, or bytes that do not unpickle: no bridge to trust
                    self.process.signal_kill()  # the pipe is out of step: nothing after is sane
                    _tell(loop, self._closed)
                    return
                _tell(loop, self._message, message)

        threading.Thread(target=read, name="inboxd-ray-read", daemon=True).start()

    def _message(self, message: Any) -> None:
        if not self.first.done():
            self.first.set_result(message)
        else:
            self._on_message(message)

    def _closed(self) -> None:
        self.closed = True
        if not self.first.done():
            self.first.set_exception(BridgeGone(f"the Ray bridge exited with status "
                                                f"{self.process.exit_code()} before connecting"))
        self._on_closed()

    async def send(self, message: Any) -> None:
        if self.closed:
            raise BridgeGone("the Ray bridge has exited")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self.sender, self.conn.send, message)
        except OSError as exc:
            raise BridgeGone(f"the Ray bridge has exited ({exc})") from None

    def kill(self) -> None:
        self.closed = True
        self.process.kill()
        self.conn.close()
        self.sender.shutdown(wait=False, cancel_futures=True)


def _tell(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody left to tell
        loop.call_soon_threadsafe(callback, *args)
