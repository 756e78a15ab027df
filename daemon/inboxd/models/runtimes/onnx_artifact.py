"""The ONNX artifact on disk, without torch: where it lives, how it is written and read, and the
refusals that make a cached file rebuilt rather than loaded.

Reading and loading an artifact needs only onnxruntime, so a daemon that serves a cached
artifact (``models/onnx_model.py``) never imports torch; exporting one (``runtimes/onnx.py``, in
the exporter process) does.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any

from inboxd.models.runtimes import onnx_wire

ARTIFACT_FORMAT = 2  # bump when what is exported changes for the same inputs
KEY_METADATA = "inboxd.cache_key"
INPUT_NAME, OUTPUT_NAME = "input", "output"
MAX_ARTIFACT_BYTES = 2 << 30  # protobuf's own limit: an export never writes more
ARTIFACT_GRAPH_BYTES = 64 << 20  # the graph and metadata beside the tensors, generously
# A temp file of an export that was killed is removed by a later build once this old (another
# instance sharing the cache may be writing a young one right now).
STALE_TEMP_S = 3600
# What a daemon needs to serve the artifact without rebuilding the network (a JSON object the
# exporter writes: its torch-free key, the input spec, labels, output kind, the probe's verdict).
SERVING_METADATA = "inboxd.serving"
SERVING_KEY_METADATA = "inboxd.serving_key"  # runtimes/serving_key.py


def key_of(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def artifact_path(cache_dir: Path, model_name: str, source: str) -> Path:
    """One file per configured model (name and where it came from), so an upgrade replaces
    the artifact instead of adding one next to it."""
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", model_name)[:64]
    where = hashlib.sha256(source.encode()).hexdigest()[:12]
    return cache_dir / "onnx" / f"{slug}-{where}.onnx"


def write_atomically(path: Path, data: bytes) -> None:
    """Temp file, fsync, rename, fsync the folder: a reader sees the old file or all of the new
    one, whatever instant the process is killed at."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    _remove_stale_temps(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _remove_stale_temps(folder: Path) -> None:
    now = time.time()
    for entry in folder.glob(".*.tmp"):
        try:
            if now - entry.lstat().st_mtime > STALE_TEMP_S:
                entry.unlink()
        except OSError:
            continue


class ArtifactRefused(Exception):
    """The cached file cannot be used (missing, corrupt, another key): build it again."""


def read_artifact(path: Path, limit_bytes: int = MAX_ARTIFACT_BYTES) -> bytes:
    """The file's bytes, refusing a link, a non-regular file or a size above ``limit_bytes``.
    Opened non-blocking: a FIFO planted there would otherwise block the open for good."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise ArtifactRefused("not built yet") from exc
    except OSError as exc:
        raise ArtifactRefused(f"cannot open it: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ArtifactRefused("not a regular file (a FIFO, a device, a socket)")
        if not 0 < info.st_size <= limit_bytes:
            raise ArtifactRefused(f"{info.st_size} bytes, where this network's export takes "
                                  f"at most {limit_bytes}")
        return handle.read(limit_bytes + 1)


def check_self_contained(data: bytes, key: str, key_field: str = KEY_METADATA
                         ) -> dict[str, str]:
    """``data`` parses as ONNX, carries ``key`` (under ``key_field``) and keeps every tensor
    inside the file (external data would make ONNX Runtime open another path). Returns the
    artifact's metadata. Read from the wire format (``onnx_wire``), not with the onnx package:
    its import would double the start of a daemon serving the artifact."""
    try:
        metadata = onnx_wire.metadata(data)
        found = metadata.get(key_field)
        if found != key:
            raise ArtifactRefused("built for other weights, versions, input size or CPU"
                                  if found else "it carries no inboxd cache key")
        if onnx_wire.has_external_data(data):
            raise ArtifactRefused("it refers to external data files")
    except onnx_wire.MalformedOnnx as exc:  # a corrupt or foreign file
        raise ArtifactRefused(f"not a readable ONNX model ({exc})") from exc
    return metadata


def session_options(threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Idle pool threads sleep instead of spinning: the decode workers share these cores, and
    # a spinning pool takes their time between batches.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # errors only: its warnings are about graph rewrites
    return options


CPU_PROVIDERS = ("CPUExecutionProvider",)
CUDA_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")


def providers_for_gpu(what: str) -> tuple[tuple[str, ...], str | None]:
    """The providers for ``what`` asked to run on a GPU: CUDA's where the installed
    onnxruntime has it; else the CPU's, and a note saying why (for the started record)."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        return CUDA_PROVIDERS, None
    return CPU_PROVIDERS, (f"the installed onnxruntime has no CUDA provider: {what} runs on "
                           "the CPU (install onnxruntime-gpu for the GPU)")


def session(data: bytes | str, threads: int,
            providers: tuple[str, ...] = CPU_PROVIDERS) -> Any:
    import onnxruntime as ort

    return ort.InferenceSession(data, session_options(threads), providers=list(providers))
