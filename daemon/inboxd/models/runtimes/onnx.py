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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from inboxd.config import ModelConfig
from inboxd.decode.spec import TORCHVISION_INPUT
from inboxd.models.preflight import problem
from inboxd.models.runtimes.choice import cpu_flags
from inboxd.models.runtimes.onnx_artifact import (
    ARTIFACT_FORMAT,
    ARTIFACT_GRAPH_BYTES,
    CPU_PROVIDERS,
    INPUT_NAME,
    KEY_METADATA,
    MAX_ARTIFACT_BYTES,
    OUTPUT_NAME,
    STALE_TEMP_S,
    ArtifactRefused,
    artifact_path,
    check_self_contained,
    key_of,
    providers_for_gpu,
    read_artifact,
    session,
    session_options,
    write_atomically,
)
from inboxd.models.runtimes.runner import Runner
from inboxd.models.sources import Source

# The artifact's torch-free half lives in onnx_artifact; its names are this module's too.
__all__ = ["ARTIFACT_FORMAT", "ARTIFACT_GRAPH_BYTES", "CPU_PROVIDERS", "INPUT_NAME",
           "KEY_METADATA", "MAX_ARTIFACT_BYTES", "OUTPUT_NAME", "STALE_TEMP_S", "ArtifactRefused",
           "OnnxNetwork", "artifact_limit_bytes", "artifact_path", "cache_key",
           "check_self_contained", "cpu_identity", "expected_key", "export_bytes", "from_bytes",
           "key_of", "onnx_program", "providers_for_gpu", "read_artifact", "runner", "session",
           "session_options", "verified", "versions", "weights_digest", "with_metadata",
           "write_atomically"]



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


def with_metadata(data: bytes, metadata: dict[str, str]) -> bytes:
    """``data`` (a serialised ONNX model) with ``metadata`` added."""
    import onnx

    proto = onnx.load_from_string(data)
    for name, value in metadata.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = name, value
    out: bytes = proto.SerializeToString()
    return out


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


def runner(network: OnnxNetwork) -> Runner:
    return Runner("onnxruntime", "fp32", network, torch.contiguous_format)


def expected_key(network: nn.Module, crop: int, max_batch: int | None) -> str:
    return key_of(cache_key(network, crop, max_batch))


def artifact_limit_bytes(network: nn.Module) -> int:
    """The largest artifact ``network`` can export to: its tensors, twice over for what the
    exporter may keep beside them, and room for the graph. A file above it is refused
    before a byte of it is read."""
    tensors = sum(int(t.numel() * t.element_size()) for t in network.state_dict().values())
    return min(MAX_ARTIFACT_BYTES, 2 * tensors + ARTIFACT_GRAPH_BYTES)


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
