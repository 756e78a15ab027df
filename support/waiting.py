"""The one way the tests wait: for an outcome, with a deadline, never a fixed sleep.

Standard library only: the nspawn scenario imports it inside the container (from the checkout
bound there), where neither pytest nor inboxd is imported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class WaitTimeout(TimeoutError, AssertionError):
    """The outcome did not come in time: a failed test (AssertionError) to pytest, a
    TimeoutError to code that treats it as one (the nspawn scenario records it and goes on)."""


def wait_until(predicate: Callable[[], Any], timeout_s: float = 30, what: str = "",
               every_s: float = 0.02) -> Any:
    """``predicate()``'s first true value, asked every ``every_s`` until ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout_s} s waiting for {what or predicate}")
        time.sleep(every_s)
