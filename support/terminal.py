"""A command run with its stderr on a pseudo-terminal, as a person at a shell runs it: what the
daemon draws only for a terminal (short lines, the ``once`` progress bar) shows there."""

from __future__ import annotations

import os
import pty
import subprocess
from collections.abc import Sequence

from support.configs import REPO


def run_on_a_terminal(args: Sequence[str], stdout_too: bool = True,
                      timeout_s: float = 60) -> tuple[int, str]:
    """``args`` run from the checkout with stderr (and, with ``stdout_too``, stdout) on a
    pseudo-terminal, read until the program has gone: its exit status and what it wrote."""
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(list(args), stdin=subprocess.DEVNULL,
                            stdout=terminal if stdout_too else subprocess.DEVNULL,
                            stderr=terminal, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO / "daemon")})
    os.close(terminal)
    out = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the program has gone, and with it the terminal's other side
            break
        if not chunk:
            break
        out += chunk
    os.close(controller)
    return proc.wait(timeout_s), out.decode(errors="replace")
