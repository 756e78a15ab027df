"""ONNX Runtime as a runner: the torch network exported once, cached on disk, run on the CPU.

The export (``torch.onnx.export(dynamo=True)``, a dynamic batch axis) takes seconds, so it runs in
the background (``models/fast_path.py``) and its artifact is cached in ``model.cache_dir``,
one file per configured model. The artifact carries its cache key inside it (ONNX metadata): a hash
of the network's weights and structure, the input size, the torch / onnx / onnxscript / onnxruntime
versions and the CPU (torch's capability and every /proc/cpuinfo flag). A file whose key is not the
one expected now is rebuilt and replaced, never loaded; a file that is truncated, corrupt, not a
regular file, or that points at external data is treated the same way, so nothing in the cache can
crash the daemon or make it read another file. What does load is still checked against torch on a
probe batch before it serves.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from inboxd.config import ModelConfig
from inboxd.models.preflight import problem
from inboxd.models.runtimes.choice import cpu_flags
from inboxd.models.runtimes.runner import Runner
from inboxd.models.sources import TORCHVISION_INPUT, Source

ARTIFACT_FORMAT = 1  # bump when what is exported changes for the same inputs
KEY_METADATA = "inboxd.cache_key"
INPUT_NAME, OUTPUT_NAME = "input", "output"
MAX_ARTIFACT_BYTES = 2 << 30  # protobuf's own limit: an export never writes more
ARTIFACT_GRAPH_BYTES = 64 << 20  # the graph and metadata beside the tensors, generously
# A temp file of an export that was killed is removed by a later build once this old (another
# instance sharing the cache may be writing a young one right now).
STALE_TEMP_S = 3600


def versions() -> dict[str, str]:
    """The versions the cache key holds, read from the installed packages' metadata: importing
    onnxscript only to ask would load the whole exporter into the daemon, for good."""
    return {"torch": torch.__version__,
            **{name: importlib.metadata.version(name)
               for name in ("onnx", "onnxscript", "onnxruntime")}}


def cpu_identity(root: Path = Path("/")) -> dict[str, str]:
    flags = " ".join(sorted(cpu_flags(root)))
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_flags_sha256": hashlib.sha256(flags.encode()).hexdigest()}


def weights_digest(network: nn.Module) -> str:
    """A hash of what the network computes: its structure (a GraphModule's code, a module's
    repr) and every parameter and buffer, byte for byte, whatever their memory format."""
    digest = hashlib.sha256()
    code = getattr(network, "code", None)
    digest.update((code if isinstance(code, str) else repr(network)).encode())
    for name, tensor in network.state_dict().items():
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()


def cache_key(network: nn.Module, crop: int, max_batch: int | None, *,
              found_versions: dict[str, str] | None = None,
              cpu: dict[str, str] | None = None) -> dict[str, Any]:
    """Everything an artifact depends on; ``key_of`` hashes it."""
    return {"format": ARTIFACT_FORMAT, "weights_sha256": weights_digest(network),
            "input": [3, crop, crop], "max_batch": max_batch,
            **(found_versions if found_versions is not None else versions()),
            **(cpu if cpu is not None else cpu_identity())}


def key_of(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def artifact_path(cache_dir: Path, model_name: str, source: str) -> Path:
    """One file per configured model (name and where it came from), so an upgrade replaces
    the artifact instead of adding one next to it."""
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", model_name)[:64]
    where = hashlib.sha256(source.encode()).hexdigest()[:12]
    return cache_dir / "onnx" / f"{slug}-{where}.onnx"


def export_bytes(network: nn.Module, crop: int, max_batch: int | None, key: str) -> bytes:
    """The network as a serialised ONNX model with a dynamic batch axis and ``key`` inside."""
    example = torch.zeros(2, 3, crop, crop)
    batch = torch.export.Dim("batch", min=1, max=max_batch or 4096)
    program = torch.onnx.export(
        network, (example,), dynamo=True, dynamic_shapes=({0: batch},),
        input_names=[INPUT_NAME], output_names=[OUTPUT_NAME], verbose=False, optimize=True)
    if program is None:
        raise RuntimeError("torch.onnx.export returned nothing")
    proto = program.model_proto
    entry = proto.metadata_props.add()
    entry.key, entry.value = KEY_METADATA, key
    data: bytes = proto.SerializeToString()
    return data


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


def artifact_limit_bytes(network: nn.Module) -> int:
    """The largest artifact ``network`` can export to: its tensors, twice over for what the
    exporter may keep beside them, and room for the graph. A file above it is refused
    before a byte of it is read."""
    tensors = sum(int(t.numel() * t.element_size()) for t in network.state_dict().values())
    return min(MAX_ARTIFACT_BYTES, 2 * tensors + ARTIFACT_GRAPH_BYTES)


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


def check_self_contained(data: bytes, key: str) -> None:
    """``data`` parses as ONNX, carries ``key`` and keeps every tensor inside the file (external
    data would make ONNX Runtime open another path)."""
    import onnx

    try:
        proto = onnx.load_from_string(data)
    except Exception as exc:  # any parse failure: a corrupt or foreign file
        raise ArtifactRefused(f"not a readable ONNX model ({type(exc).__name__})") from exc
    found = {entry.key: entry.value for entry in proto.metadata_props}.get(KEY_METADATA)
    if found != key:
        raise ArtifactRefused("built for other weights, versions, input size or CPU"
                              if found else "it carries no inboxd cache key")
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
        raise ArtifactRefused("it refers to external data files")


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


class OnnxNetwork(nn.Module):
    """An ONNX Runtime session behind the torch module interface, so the rest of the model
    code (the probe, normalisation, reduce) treats it as any network. CPU only."""

    def __init__(self, session: Any) -> None:
        super().__init__()
        self.session = session
        self.input_name = session.get_inputs()[0].name
        self.output_name = session.get_outputs()[0].name

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        array = np.ascontiguousarray(batch.detach().cpu().numpy(), dtype=np.float32)
        out = self.session.run([self.output_name], {self.input_name: array})[0]
        return torch.from_numpy(np.asarray(out))


def session(data: bytes | str, threads: int) -> Any:
    import onnxruntime as ort

    return ort.InferenceSession(data, session_options(threads),
                                providers=["CPUExecutionProvider"])


def runner(network: OnnxNetwork) -> Runner:
    return Runner("onnxruntime", "fp32", network, torch.contiguous_format)


def expected_key(network: nn.Module, crop: int, max_batch: int | None) -> str:
    return key_of(cache_key(network, crop, max_batch))


def verified(path: Path, key: str, limit_bytes: int = MAX_ARTIFACT_BYTES) -> bytes:
    data = read_artifact(path, limit_bytes)
    check_self_contained(data, key)
    return data


def from_bytes(data: bytes, threads: int) -> Runner:
    try:
        return runner(OnnxNetwork(session(data, threads)))
    except Exception as exc:  # ONNX Runtime refuses what it cannot run: rebuild it
        raise ArtifactRefused(f"onnxruntime cannot load it ({type(exc).__name__}: "
                              f"{str(exc)[:200]})") from exc


# -- an ONNX file ---------------------------------------------------------------------------


def onnx_program(config: ModelConfig) -> Source:
    """An ``.onnx`` file in an ONNX Runtime session (CPU). It must take one float N×3×H×W input
    with a dynamic N, like a .pt2 program; its first output is what inboxd reads."""
    assert config.onnx is not None
    path = config.onnx
    try:
        loaded = session(str(path), torch.get_num_threads())
    except Exception as exc:  # ONNX Runtime's own words say what is wrong with the file
        missing = not path.is_file()
        raise problem(f"onnx: cannot read {path}: no such file" if missing else
                      f"onnx: {path} cannot be loaded by onnxruntime: {type(exc).__name__}: "
                      f"{str(exc)[:300]}") from exc
    inputs = loaded.get_inputs()
    if len(inputs) != 1:
        raise problem(f"onnx: {path} must take exactly one input (a N×3×H×W batch), it takes "
                      f"{len(inputs)}")
    shape, kind = list(inputs[0].shape), inputs[0].type
    if kind != "tensor(float)":
        raise problem(f"onnx: {path} takes a {kind} input; inboxd feeds float32 (export the "
                      "network in fp32)")
    if len(shape) != 4 or shape[1] != 3:
        raise problem(f"onnx: {path} takes a {shape} input; inboxd feeds N×3×H×W")
    if isinstance(shape[0], int):
        raise problem(f"onnx: {path} was exported for a fixed batch of {shape[0]}; inboxd sends "
                      "batches of varying size: export with a dynamic batch axis "
                      "(dynamic_shapes or dynamic_axes on dimension 0)")
    height, width = shape[2], shape[3]
    fixed = (height, width) if isinstance(height, int) and isinstance(width, int) else None
    return Source(path.name, OnnxNetwork(loaded), TORCHVISION_INPUT,
                  f"ONNX model {path}", None, None, fixed)
