"""What importing the package does to the process: torch's idle threads sleep unless the user
says otherwise (``inboxd/__init__.py`` says why)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import inboxd, torch, os; print(os.environ['OMP_WAIT_POLICY'])"


@pytest.mark.parametrize(("given", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_omp_threads_sleep_when_idle_unless_the_user_chose(given: str | None,
                                                           expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, check=True, timeout=120).stdout
    assert out.strip() == expected
