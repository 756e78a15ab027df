"""The exporter process: ``python -m inboxd.models.onnx_export`` rebuilds the configured
network
and writes its ONNX artifact into the cache.

A process of its own, not a thread beside the model: torch.export's tracing modes are not
confined to the thread that exports, and an eager forward run meanwhile on another thread was
seen to run under the exporter's fake-tensor mode (and to fail). Here the exporter cannot touch
a real batch, it runs at a lower priority (the daemon serves on the same cores meanwhile), and
its crash, hang or runaway memory is its own: the daemon logs the reason and keeps serving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inboxd.config import ModelConfig

EXPORT_TIMEOUT_S = 900.0
# Below the daemon's own threads, so the first results are not delayed by the export, but not
# at the bottom (19): under a steady flood the CPU is never idle, and an exporter that only
# gets idle time would never finish, while the runner it builds pays for itself within minutes.
EXPORTER_NICE = 10
EXIT_OTHER_NETWORK = 3
PR_SET_PDEATHSIG = 1
_TAIL_CHARS = 400


class ExportFailed(Exception):
    """Why no artifact was written, in words for the journal."""


def request(config: ModelConfig, path: Path, key: str) -> str:
    return json.dumps({"model": config.model_dump(mode="json"), "path": str(path), "key": key})


def export_in_child(config: ModelConfig, path: Path, key: str,
                    timeout_s: float = EXPORT_TIMEOUT_S) -> None:
    """Run the exporter process; ``ExportFailed`` with its reason when it wrote nothing."""
    try:
        done = subprocess.run([sys.executable, "-m", "inboxd.models.onnx_export"],
                              input=request(config, path, key), capture_output=True, text=True,
                              errors="replace", timeout=timeout_s, check=False,
                              preexec_fn=killed_with_parent(os.getpid()))
    except subprocess.TimeoutExpired as exc:
        raise ExportFailed(f"the exporter took more than {timeout_s:.0f} s and was killed"
                           ) from exc
    except OSError as exc:
        raise ExportFailed(f"the exporter could not start: {exc.strerror or exc}") from exc
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1][-_TAIL_CHARS:]
        raise ExportFailed(f"the exporter exited {done.returncode}: {last}")


def killed_with_parent(parent_pid: int) -> Callable[[], None]:
    """For ``preexec_fn``: the exporter is killed with its parent from before it runs a line of
    its own. Set in ``main`` instead, an exporter stopped (SIGSTOP) in its first instant would
    never set it and outlive the daemon, stopped for ever. ``prctl`` is looked up here, in
    the parent: between fork and exec the child only calls it."""
    import ctypes
    import signal

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl: nobody will signal
            os._exit(1)

    return in_child


def die_with_parent() -> None:
    """The exporter must not outlive the daemon (``inboxd once`` exits without waiting for it):
    the kernel kills it when the thread that started it ends."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return  # not Linux: the exporter may finish its one file after the daemon is gone
    if os.getppid() == 1:  # the parent died before prctl: nobody is waiting for this
        sys.exit(1)


def main() -> int:
    die_with_parent()
    os.nice(EXPORTER_NICE)
    import torch

    from inboxd.models.loading import network_for
    from inboxd.models.preflight import read_labels
    from inboxd.models.runtimes import onnx as onnx_runtime

    torch.set_num_threads(1)
    asked: dict[str, Any] = json.loads(sys.stdin.read())
    config = ModelConfig.model_validate(asked["model"])
    labels = read_labels(config.labels) if config.labels is not None else None
    source, spec, _ = network_for(config, torch.device("cpu"), labels)
    key = onnx_runtime.expected_key(source.network, spec.crop, source.max_batch)
    if key != asked["key"]:
        print("the network rebuilt here is not the daemon's (its weights or versions differ)",
              file=sys.stderr)
        return EXIT_OTHER_NETWORK
    data = onnx_runtime.export_bytes(source.network, spec.crop, source.max_batch, key)
    onnx_runtime.write_atomically(Path(asked["path"]), data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
