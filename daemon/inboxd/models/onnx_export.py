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
import sys
from pathlib import Path
from typing import Any

from inboxd.children import HelperProcess, die_with_parent, ignore_stop_signals
from inboxd.config import ModelConfig

EXPORT_TIMEOUT_S = 900.0
# Below the daemon's own threads, so the first results are not delayed by the export, but not
# at the bottom (19): under a steady flood the CPU is never idle, and an exporter that only
# gets idle time would never finish, while the runner it builds pays for itself within minutes.
EXPORTER_NICE = 10
EXIT_OTHER_NETWORK = 3
_TAIL_CHARS = 400


class ExportFailed(Exception):
    """Why no artifact was written, in words for the journal."""


def request(config: ModelConfig, path: Path, key: str) -> str:
    return json.dumps({"model": config.model_dump(mode="json"), "path": str(path), "key": key,
                       "parent_pid": os.getpid()})


def export_in_child(config: ModelConfig, path: Path, key: str,
                    timeout_s: float = EXPORT_TIMEOUT_S) -> None:
    """Run the exporter process; ``ExportFailed`` with its reason when it wrote nothing."""
    try:
        exporter = HelperProcess(("-m", "inboxd.models.onnx_export"), capture_stderr=True)
    except OSError as exc:
        raise ExportFailed(f"the exporter could not start: {exc.strerror or exc}") from exc
    try:
        _, stderr = exporter.communicate(request(config, path, key).encode(), timeout_s)
    except TimeoutError as exc:
        raise ExportFailed(f"the exporter took more than {timeout_s:.0f} s and was killed"
                           ) from exc
    finally:
        exporter.reap()
    code = exporter.exit_code()
    if code != 0:
        text = stderr.decode(errors="replace")
        last = (text.strip().splitlines() or ["(no output)"])[-1][-_TAIL_CHARS:]
        raise ExportFailed(f"the exporter exited with {exporter.describe_exit()}: {last}")


def main() -> int:
    asked: dict[str, Any] = json.loads(sys.stdin.read())
    # It must not outlive the daemon (``inboxd once`` exits without waiting for it); like every
    # helper it is ended by the daemon, not by a Ctrl-C or a stop signal to the whole group.
    die_with_parent(asked["parent_pid"])
    ignore_stop_signals()
    os.nice(EXPORTER_NICE)
    import torch

    from inboxd.models.loading import network_for
    from inboxd.models.preflight import read_labels
    from inboxd.models.runtimes import onnx as onnx_runtime

    torch.set_num_threads(1)
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
