"""A hostile model is refused, not fatal (issue 36, class 7): a bring-your-own ``.onnx`` that
asks for more memory than there is exits 78 with the reason instead of getting the daemon
OOM-killed; what is planted at the ONNX cache path cannot block or bloat the daemon; the
exporter dies with the daemon even when it was stopped as it started; a batch slower than the
watchdog allows is said at start-up."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.byo_models import labels_file, onnx_memory_bomb
from tests.conftest import make_image, write_config

CGROUP_LIMIT_BYTES = 2 << 30  # what the unit's MemoryMax= does, smaller


@contextlib.contextmanager
def memory_cgroup(name: str, limit_bytes: int) -> Iterator[Path]:
    """A memory cgroup (v1 or v2) of its own with a hard limit; its ``cgroup.procs`` to join."""
    v1 = Path("/sys/fs/cgroup/memory")
    folder = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / name
    try:
        folder.mkdir()
        limit = folder / ("memory.limit_in_bytes" if v1.is_dir() else "memory.max")
        limit.write_text(str(limit_bytes))
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    try:
        yield folder / "cgroup.procs"
    finally:
        with contextlib.suppress(OSError):
            folder.rmdir()


@pytest.mark.daemon
def test_a_memory_bomb_onnx_is_refused_with_78_not_oom_killed(tmp_path: Path) -> None:
    """Before: the start-up probe ran the graph in the daemon, which the cgroup's OOM killer
    ended (exit -9; under the unit a restart loop)."""
    bomb = onnx_memory_bomb(tmp_path / "bomb.onnx")
    config = write_config(tmp_path, model={"onnx": str(bomb),
                                           "labels": str(labels_file(tmp_path, 3))})
    make_image(tmp_path / "inbox" / "a.png")
    with memory_cgroup(f"inboxd-test-{os.getpid()}", CGROUP_LIMIT_BYTES) as procs:
        ran = subprocess.run(
            ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh",
             sys.executable, "-m", "inboxd", "once", "-c", str(config)],
            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 78, (ran.returncode, ran.stderr[-3000:])
    assert "needs more memory than the" in ran.stderr, ran.stderr[-3000:]
    assert "lower batch.max_size" in ran.stderr
    assert (tmp_path / "inbox" / "a.png").exists()
