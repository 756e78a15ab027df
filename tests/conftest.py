"""Shared fixtures: configs in temp folders, the real daemon as a subprocess, waiting helpers.

Waiting is always for an outcome (a file, a log record, an exit) with a deadline, never a
fixed sleep.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from support import configs

# Re-exported: what the tests import.
from support.daemon import DaemonProcess as DaemonProcess
from support.daemon import drop as drop
from support.daemon import last_stats as last_stats
from support.daemon import make_image as make_image
from support.daemon import read_json as read_json
from support.records import captured_stderr_records
from support.records import line_fields as line_fields
from support.waiting import wait_until as wait_until

REPO = Path(__file__).resolve().parent.parent
# One ONNX artifact cache for every daemon a test starts (model.cache_dir), so the background
# export runs once per machine and checkout, not once per test; tests of the cache itself give
# their own cache_dir.
SHARED_MODEL_CACHE = Path(tempfile.gettempdir()) / (
    f"inboxd-test-model-cache-{os.getuid()}-{hashlib.sha256(str(REPO).encode()).hexdigest()[:8]}")


def shared_model_artifact() -> None:
    """The built-in model's ONNX artifact in ``SHARED_MODEL_CACHE``, exported once per checkout
    and machine, under a lock (two xdist workers never both export), checked once per run.
    Without it, each daemon a test starts on a fresh checkout serves torch and starts an export
    of its own in the background, which the test's end kills unfinished: the same minutes of
    CPU, over and over. Checked and built in a child: the test process keeps no session,
    thread or descriptor of it (tests count this process's descriptors).

    The run's main process starts that child as it configures (``pytest_configure``), so the
    export runs beside the workers' collection and their first tests, and a worker waits for
    it only when a test of its own needs the artifact; the child leaves a stamp for this run
    when the artifact is ready. Without the stamp (a run started otherwise, or the child
    failed) the check runs here, and its failure is this test's."""
    global _shared_artifact_ready
    if _shared_artifact_ready:
        return
    SHARED_MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    with open(SHARED_MODEL_CACHE / ".export.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held by the background child until it is done
        if _run_ready_stamp is None or not _run_ready_stamp.exists():
            built = subprocess.run([sys.executable, "-c", _BUILD_SHARED_ARTIFACT,
                                    str(SHARED_MODEL_CACHE)], capture_output=True, text=True,
                                   timeout=900, check=False)
            assert built.returncode == 0, built.stdout + built.stderr
    _shared_artifact_ready = True


# What write_config's daemons load (its cache_dir, every other model key the default's): served
# from the cache when it is there; else exported as a daemon would, in the background thread.
# A second argument is the run's stamp, made once the artifact is ready.
_BUILD_SHARED_ARTIFACT = """
import sys
from pathlib import Path
from inboxd.config import ModelConfig
from inboxd.models.onnx_model import load_cached

config = ModelConfig(cache_dir=Path(sys.argv[1]))
cached, _why = load_cached(config)
if cached is None:  # not built yet, or stale (FastPath exports it again)
    from inboxd.models.fast_path import FastPath
    from inboxd.models.loading import load_model

    fast = FastPath(load_model(config), config)
    fast.start()
    fast.join(900)
    fast.swap_if_built()
    assert fast.state == "serving", fast.fields
if len(sys.argv) > 2:
    Path(sys.argv[2]).touch()
"""
_shared_artifact_ready = False
# This run's stamp: named by the main process, handed to xdist's workers (pytest_configure_node).
_run_ready_stamp: Path | None = None
_background_build: subprocess.Popen[bytes] | None = None


def pytest_configure(config: pytest.Config) -> None:
    """The main process (xdist's controller, or the only process) starts the shared artifact's
    check or export in a child that holds the export lock from before it starts (no worker can
    take the lock first and check again); a worker learns the run's stamp from the main
    process."""
    global _run_ready_stamp, _background_build
    worker_input = getattr(config, "workerinput", None)
    if worker_input is not None:
        stamp = worker_input.get("shared_artifact_stamp")
        _run_ready_stamp = Path(stamp) if stamp else None
        return
    SHARED_MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    _run_ready_stamp = SHARED_MODEL_CACHE / f".ready-{os.getpid()}-{time.monotonic_ns()}"
    log = SHARED_MODEL_CACHE / f"{_run_ready_stamp.name}.log"
    with open(SHARED_MODEL_CACHE / ".export.lock", "w") as lock, open(log, "wb") as output:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # The child's copy of the descriptor keeps the lock once this process closes its own.
        _background_build = subprocess.Popen(
            [sys.executable, "-c", _BUILD_SHARED_ARTIFACT, str(SHARED_MODEL_CACHE),
             str(_run_ready_stamp)], pass_fds=(lock.fileno(),), stdin=subprocess.DEVNULL,
            stdout=output, stderr=subprocess.STDOUT)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent without pytest-xdist
def pytest_configure_node(node: Any) -> None:
    node.workerinput["shared_artifact_stamp"] = str(_run_ready_stamp)


def pytest_unconfigure(config: pytest.Config) -> None:
    """A run that ended before its export did has no use for it: the next run starts again."""
    if _background_build is None or _run_ready_stamp is None:
        return
    if _background_build.poll() is None:
        _background_build.terminate()
    _background_build.wait()
    _run_ready_stamp.unlink(missing_ok=True)
    SHARED_MODEL_CACHE.joinpath(f"{_run_ready_stamp.name}.log").unlink(missing_ok=True)


def run_interleaved(targets: list[Callable[[], None]]) -> None:
    """Each target in a thread of its own, the threads switching every microsecond: at
    Python's 5 ms two short calls almost never interleave, and a race would not show."""
    threads = [threading.Thread(target=target) for target in targets]
    interval_s = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval_s)


def write_config(root: Path, **sections: Any) -> Path:
    """A config with every folder under ``root``, quick to settle and to report; ``sections``
    override keys (dicts merge; None removes the key, e.g. ``model=None`` beside ``models=``).
    A daemon started with it finds the built-in model's artifact (``shared_model_artifact``)."""
    shared_model_artifact()
    return configs.write_config(root, {
        "inbox": {"settle_ms": 50, "rescan_interval_s": 5},
        # Every interval, idle or not: tests wait for the next record after a change.
        "stats": {"interval_s": 1, "heartbeat_s": 1},
        "shutdown": {"grace_s": 20},
        "model": {"cache_dir": str(SHARED_MODEL_CACHE)},
    }, sections)


@pytest.fixture(autouse=True)
def fresh_log_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The record budget is process-wide: each test starts with a full one, whatever the tests
    before it logged."""
    from inboxd import log_budget, logs
    monkeypatch.setattr(logs, "budget", log_budget.RecordBudget())


@pytest.fixture
def stderr_records() -> Iterator[io.StringIO]:
    """The records this process logs, as the daemon writes them to stderr (one line each)."""
    with captured_stderr_records() as stream:
        yield stream


@pytest.fixture
def daemon_factory() -> Iterator[Callable[..., DaemonProcess]]:
    started: list[DaemonProcess] = []

    def start(config: Path, *extra: str, **kwargs: Any) -> DaemonProcess:
        process = DaemonProcess(config, *extra, **kwargs)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
