"""The daemon without systemd-python (the bare GPU machine has none): the journal bindings are
imported only when stderr is the journal."""

from __future__ import annotations

import os
import subprocess
import sys

# A None entry in sys.modules makes `import systemd` raise ImportError, as if not installed.
CHILD = """
import sys
sys.modules["systemd"] = sys.modules["systemd.journal"] = None
import logging
from inboxd import cli, logs
cli.setup_logging("INFO")
logs.emit(logging.INFO, "started", "logging works without systemd-python", probe=1)
"""


def test_logging_to_stderr_needs_no_systemd_python() -> None:
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          env=env, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "[started] logging works without systemd-python PROBE=1" in proc.stderr
