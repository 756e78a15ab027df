"""The key under which an exported artifact may serve without torch: computed from files and
package metadata alone, so a daemon can tell a valid cached artifact before importing torch.

The exporter process writes it into the artifact beside the torch key (``runtimes/onnx.py``'s
hash of the rebuilt network's weights); both change together. It covers what decides the
exported network: the built-in weights file byte for byte, the inboxd code that builds and
exports it, the model's input and output settings, the torch / torchvision / onnx / onnxscript
/ onnxruntime versions and the CPU's flags. Only the built-in model has one: a bring-your-own
torch model is checked by rebuilding it, which needs torch anyway.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path
from typing import Any

from inboxd.config import ModelConfig
from inboxd.models.builtin_weights import BuiltinWeightsError, builtin_weights_path
from inboxd.models.runtimes.choice import cpu_flags
from inboxd.models.runtimes.onnx_artifact import ARTIFACT_FORMAT, key_of

# The modules whose code decides what the built-in network computes and how it is exported.
_NETWORK_CODE = ("efficientnet_lite.py", "sources.py", "loading.py", "runtimes/onnx.py")
_PACKAGES = ("torch", "torchvision", "onnx", "onnxscript", "onnxruntime")
_CHUNK_BYTES = 1 << 20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def package_versions() -> dict[str, str]:
    found: dict[str, str] = {}
    for name in _PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "missing"
    return found


def serving_fields(config: ModelConfig, root: Path = Path("/")) -> dict[str, Any] | None:
    """What the key hashes, or None where the model has no torch-free key (not the built-in,
    or its weights package is missing: loading it says why)."""
    if config.kind != "builtin":
        return None
    try:
        weights = builtin_weights_path()
    except BuiltinWeightsError:
        return None
    models = Path(__file__).resolve().parent.parent
    code = hashlib.sha256()
    for name in _NETWORK_CODE:
        code.update((models / name).read_bytes())
    flags = " ".join(sorted(cpu_flags(root)))
    return {"format": ARTIFACT_FORMAT, "weights_sha256": file_sha256(weights),
            "code_sha256": code.hexdigest(), "output": config.output,
            "input": config.input.model_dump(mode="json"), **package_versions(),
            "cpu_flags_sha256": hashlib.sha256(flags.encode()).hexdigest()}


def serving_key(config: ModelConfig, root: Path = Path("/")) -> str | None:
    fields = serving_fields(config, root)
    return key_of(fields) if fields is not None else None
