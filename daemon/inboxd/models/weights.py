"""The file whose bytes are a model, and its sha256 (each result's ``model_sha256``), found
without torch: the result writer asks for it in a daemon that may serve without torch."""

from __future__ import annotations

import hashlib
from pathlib import Path

from inboxd.config import ModelConfig
from inboxd.models.builtin_weights import BuiltinWeightsError, builtin_weights_path


def weights_file(config: ModelConfig) -> Path | None:
    """The file whose bytes are the model: the built-in's weights, a state_dict, a program."""
    if config.weights is not None:
        return config.weights
    if config.export is not None:
        return config.export
    if config.onnx is not None:
        return config.onnx
    if config.torchvision is not None or config.name == "ocr":
        return None  # (the OCR networks are the rapidocr wheel's, versioned with it)
    try:
        return builtin_weights_path()
    except BuiltinWeightsError:
        return None


def weights_sha256(config: ModelConfig) -> str | None:
    """The sha256 of the model's file, which each result records (``model_sha256``): results
    of retrained weights under the same name are told apart. None: no file here to read."""
    path = weights_file(config)
    if path is None:
        return None
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as file:
            while chunk := file.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()
