"""Fixtures the guarantee tests share."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def root() -> Iterator[Path]:
    """A folder of the test's own outside pytest's basetemp, which a second uid (the inbox's
    group member) can reach: a pytest session that starts meanwhile (as root) makes
    ``/tmp/pytest-of-root`` 0700 again, and the member could no longer reach the inbox in the
    middle of a test that runs a daemon for a while."""
    folder = Path(tempfile.mkdtemp(prefix="inboxd-member-"))
    os.chmod(folder, 0o701)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
