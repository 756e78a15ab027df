"""Kernel-visible names for the daemon's threads, so that ``top -H``, ``ps -L``, ``py-spy`` and
``/proc/<pid>/task/*/comm`` say which stage burns the CPU (Python 3.11 names its threads only for
itself; the kernel sees "python" for all of them).
"""

from __future__ import annotations

import ctypes
import threading

PR_SET_NAME = 15
NAME_MAX_BYTES = 15  # the kernel keeps 16 bytes, the last a NUL
_libc = ctypes.CDLL(None, use_errno=True)


def name_this_thread() -> None:
    """Give the calling thread its Python name (without the ``inboxd-`` every one has) in the
    kernel: an executor's ``initializer``, or the first call of a thread's target."""
    name = threading.current_thread().name.removeprefix("inboxd-")
    _libc.prctl(PR_SET_NAME, name.encode()[:NAME_MAX_BYTES], 0, 0, 0)
